"""Fixed, calibrated key channel scales of turbo codes (``StoreSpec.key_scales``, ``per_layer={i: {"key_scales": s}}``,
``kvslim.calibrate(model, ids, "turbo3")``; docs/quantization.md §13): a key row is coded as ``s ⊙ k`` and read as
``k̂ / s``, the fused decode moves the query as ``q / s``. Round trips, the fused decode against the unfused reads,
the calibration, the capturable cache, and refusals by name with nothing changed."""

from __future__ import annotations

import math
import pickle
from dataclasses import replace

import pytest
import torch
from conftest import tiny_model

import kvslim
from kvslim.adapters.compat import CACHE_KW
from kvslim.caches import StoreSpec, make_store
from kvslim.caches.turbo import TurboStore
from kvslim.calibration import key_scales

OPTS = dict(residual=8, flush=4, sink=2)


def _spec(**kw) -> StoreSpec:
    return StoreSpec(3, codec="turbo", rotation="orthogonal", scale_dtype=torch.float16, outliers=16, center=True,
                     seed=4, **kw)


def _rows(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, 1, 64, generator=g) + torch.randn(1, 2, 90, 64, generator=g) * torch.linspace(
        0.1, 3, 64)


def _read(spec: StoreSpec, x: torch.Tensor) -> tuple[torch.Tensor, TurboStore]:
    st = make_store(spec, x, max(128, x.shape[2]))
    st.write(0, x[:, :, :60])
    st.write(60, x[:, :, 60:])
    return st.read(0, x.shape[2]), st


def test_unit_scales_decode_as_the_unscaled_store_and_powers_of_two_as_scaled_rows():
    """s = 1: the very codes and reads of the unscaled store (torch.equal, fp32 and float64 rows). s a power of two
    per channel: the store's read of x equals the unscaled store's read of s ⊙ x, divided by s (exact: no rounding
    in the scaling), and the scaled store's fixed factors cost no bytes of the sequence."""
    for dtype in (torch.float32, torch.float64):
        x = _rows().to(dtype)
        plain, ps = _read(_spec(), x)
        ones, os_ = _read(_spec(key_scales=((1.0,) * 64,) * 2), x)
        assert torch.equal(plain, ones) and torch.equal(ps.data[:, :, :90], os_.data[:, :, :90])
        assert torch.equal(ps.scale[:, :, :90], os_.scale[:, :, :90])
    x = _rows(1)
    s = 2.0 ** torch.randint(-3, 4, (2, 64), generator=torch.Generator().manual_seed(3)).double()
    scaled, st = _read(_spec(key_scales=tuple(tuple(r) for r in s.tolist())), x)
    ref, rs = _read(_spec(), x * s.float()[None, :, None, :])
    torch.testing.assert_close(scaled * s.float()[None, :, None, :], ref, rtol=0, atol=0)
    assert st.nbytes(90) == rs.nbytes(90)


def test_scaled_reads_stay_within_the_codes_error_and_calibrated_scales_lower_the_logit_error():
    """Scales of a spread of 8x: the read is x within the code's error (relative squared error < 0.06 at 3 bits);
    with queries whose energy sits in other channels than the keys', scales from :func:`key_scales` lower the
    squared logit error of q·k̂ against q·k (the prediction of §13)."""
    g = torch.Generator().manual_seed(5)
    k = torch.randn(1, 2, 400, 64, generator=g) * torch.linspace(3, 0.2, 64)
    q = torch.randn(1, 4, 400, 64, generator=g) * torch.linspace(0.2, 3, 64)
    spec = _spec()
    s = key_scales(q, k, spec)
    assert s.shape == (2, 64) and (s > 0).all() and s.max() / s.min() > 4
    errs = {}
    for name, sp in (("plain", spec), ("scaled", replace(spec, key_scales=tuple(tuple(r) for r in s.tolist())))):
        kh, _ = _read(sp, k)
        assert ((kh - k).pow(2).sum() / k.pow(2).sum()).item() < 0.06
        qq = q.view(1, 2, 2, 400, 64)
        errs[name] = (torch.einsum("bhgtd,bhsd->bhgts", qq, kh - k).pow(2).mean()).item()
    assert errs["scaled"] < 0.8 * errs["plain"]


@pytest.mark.parametrize("method,opts,backend", [("turbo3", {}, "cpp"), ("turbo3", {}, "torch"),
                                                 ("turbo2", {}, "cpp"), ("turbo2", {"rope_centred_keys": True}, "torch")])
def test_fused_decode_with_key_scales_equals_the_unfused_reads(method, opts, backend, monkeypatch):
    """Calibrated scales (RoPE-centred keys: the scales act on the residual k − RoPE_s(μ) in the post-RoPE basis,
    no pair constraint): a left-padded batch decodes to the same greedy tokens through the fused op (C++ and the
    pure-torch twin) as through the layers' reads, logits close (fp32, 1e-4); the scales changed the codes."""
    from kvslim.kernels import turbo_decode as kernel

    if backend == "cpp" and not kernel.available():
        pytest.skip("the turbo_decode C++ op is not built here")
    monkeypatch.setenv("KVSLIM_BACKEND", backend)
    model = tiny_model("llama", kv_heads=2, head_dim=32)
    cal = torch.randint(3, 120, (1, 60), generator=torch.Generator().manual_seed(2))
    per_layer = kvslim.calibrate(model, cal, method, queries=8, **OPTS, **opts)
    kvslim.apply(model, method, per_layer=per_layer, **OPTS, **opts)
    ids = torch.randint(3, 120, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True, output_logits=True)
    try:
        fused = model.generate(ids, **kw)
        layer = fused.past_key_values.layers[0]
        coded = layer.k_store.coded
        assert layer.fused_decode and coded.fixed_channel is not None and "scaled-k" in coded.spec.describe()
        torch.testing.assert_close(coded.channel[0, :, 0].double(),
                                   1 / torch.tensor(per_layer[0]["key_scales"], dtype=torch.float64))
        cache = kvslim.make_cache(model)
        for lay in cache.layers:
            lay.fused_decode = False
        plain = model.generate(ids, **{CACHE_KW: cache}, **kw)
    finally:
        kvslim.restore(model)
    assert torch.equal(fused.sequences, plain.sequences)
    for a, b in zip(fused.logits, plain.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_calibrated_scales_pickle_apply_and_the_capturable_cache_gives_the_same_tokens():
    """``calibrate(model, ids, "turbo3")``: one (KV heads × head dim) list of positive floats per layer (geometric
    mean 1 per head), pickles; ``apply`` takes it (the plan's bytes unchanged: the scales are the plan's, as the
    rotations); a capturable cache gives the eager cache's tokens; a given layer's scales are kept."""
    model = tiny_model("llama", kv_heads=2, head_dim=32)
    cal = torch.randint(3, 120, (1, 60), generator=torch.Generator().manual_seed(2))
    mine = [[1.0] * 32, [2.0] * 32]
    per_layer = kvslim.calibrate(model, cal, "turbo3", queries=8, per_layer={1: {"key_scales": mine}}, **OPTS)
    assert per_layer == pickle.loads(pickle.dumps(per_layer)) and per_layer[1]["key_scales"] == mine
    s = torch.tensor(per_layer[0]["key_scales"], dtype=torch.float64)
    assert s.shape == (2, 32) and (s > 0).all() and s.log().mean(-1).abs().max() < 1e-9 and s.max() / s.min() > 1.1
    def layer_bytes(plan):
        return [(lp.bytes_per_token, lp.fixed_bytes) for lp in plan.layers]

    base = layer_bytes(kvslim.METHODS["turbo3"].plan_model(model, **OPTS))
    assert layer_bytes(kvslim.METHODS["turbo3"].plan_model(model, per_layer=per_layer, **OPTS)) == base
    kvslim.apply(model, "turbo3", per_layer=per_layer, **OPTS)
    ids = torch.randint(1, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    try:
        outs = []
        for capturable in (False, True):
            cache = kvslim.make_cache(model, max_length=64, capturable=capturable)
            with torch.no_grad():
                outs.append(model.generate(ids, max_new_tokens=10, do_sample=False, **{CACHE_KW: cache}))
        assert cache.layers[0].k_store.inner.fixed_channel is not None
        pickle.loads(pickle.dumps(kvslim.get_plan(model)))
    finally:
        kvslim.restore(model)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("method,bad,words", [
    ("turbo3", {0: {"key_scales": [[1.0] * 32] * 3}}, "per_layer[0]: key_scales has 3 rows, the model has 2 KV heads"),
    ("turbo3", {0: {"key_scales": [[1.0] * 16] * 2}}, "per_layer[0]: key_scales: rows of 16 scales, the head dimension is 32"),
    ("turbo3", {0: {"key_scales": [1.0] * 32}}, "per_layer[0]: key_scales must be a (KV heads, head dim)"),
    ("turbo3", {0: {"key_scales": "ones"}}, "per_layer[0]: key_scales must be a (KV heads, head dim)"),
    ("turbo3", {1: {"key_scales": [[1.0] * 31 + [0.0]] * 2}}, "per_layer[1]: key_scales must be positive finite"),
    ("turbo3", {1: {"key_scales": [[1.0] * 31 + [-2.0]] * 2}}, "per_layer[1]: key_scales must be positive finite"),
    ("turbo3", {1: {"key_scales": [[1.0] * 31 + [math.inf]] * 2}}, "per_layer[1]: key_scales must be positive finite"),
    ("turbo3", {1: {"key_scales": [[1.0] * 31 + [math.nan]] * 2}}, "per_layer[1]: key_scales must be positive finite"),
    ("turbo3", {0: {"bits": 4}}, "per_layer[0]: a turbo3 layer may set key_scales, got ['bits']"),
    ("int4", {0: {"key_scales": [[1.0] * 32] * 2}}, "per_layer[0]: key_scales are fixed channel scales of turbo keys"),
])
def test_bad_key_scales_are_refused_by_name_and_change_nothing(method, bad, words):
    model = tiny_model("llama", kv_heads=2, head_dim=32)
    kvslim.apply(model, "int4")
    try:
        before = kvslim.get_plan(model)
        with pytest.raises(ValueError) as e:
            kvslim.apply(model, method, per_layer=bad)
        assert words in str(e.value)
        assert kvslim.get_plan(model) is before
    finally:
        kvslim.restore(model)


def test_calibrate_refusals_and_spec_checks():
    model = tiny_model("llama", kv_heads=2, head_dim=32)
    cal = torch.randint(3, 120, (1, 60), generator=torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match="choose must be 'rotation' .* got 'key_scales' for 'int4'"):
        kvslim.calibrate(model, cal, "int4", choose="key_scales")
    with pytest.raises(ValueError, match="choose must be .* got 'rotation' for 'turbo3'"):
        kvslim.calibrate(model, cal, "turbo3", choose="rotation")
    with pytest.raises(ValueError, match="prerope_keys=True: key scales are calibrated for post-RoPE codes"):
        kvslim.calibrate(model, cal, "turbo3", queries=8, prerope_keys=True, **OPTS)
    with pytest.raises(ValueError, match="smooth_keys=True: key scales replace smoothing"):
        kvslim.calibrate(model, cal, "turbo3", queries=8, smooth_keys=True, **OPTS)
    with pytest.raises(ValueError, match="key_scales are fixed channel scales of turbo keys"):
        StoreSpec(4, key_scales=((1.0,) * 64,))
    with pytest.raises(ValueError, match="they replace smoothing"):
        _spec(key_scales=((1.0,) * 64,), smooth=True)
    with pytest.raises(ValueError, match="key_scales: 1 rows of scales for 2 KV heads"):
        make_store(_spec(key_scales=((1.0,) * 64,)), _rows(), 128)
    assert _spec(key_scales=((1.0,) * 64,)).for_values().key_scales is None
