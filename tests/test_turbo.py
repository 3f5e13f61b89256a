"""TurboQuant-class codes (``turbo4``/``turbo3``/``turbo2``, issue 35): the Lloyd–Max codebook meets its optimality
conditions, the rotations are orthogonal and seeded, the codes match a float64 oracle, the store's bytes equal the
plan's, and bad options are refused by name at ``apply`` with nothing changed."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch
from conftest import tiny_model
from scipy import integrate
from transformers import DynamicCache

import kvslim
from kvslim.adapters.compat import CACHE_KW
from kvslim.caches import KVSlimCache, StoreSpec, make_store
from kvslim.methods import METHODS
from kvslim.ops import turbo
from kvslim.ops.quant_formats import hadamard


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_lloyd_max_codebook_is_optimal(bits):
    """Centroid condition (each level the mean of N(0, 1) over its cell, checked by quadrature), nearest-neighbour
    condition (boundaries at the midpoints), symmetry, and the MSE of Max's table."""
    levels, bounds = turbo.lloyd_max(bits)
    assert levels.dtype == np.float64 and len(levels) == 1 << bits and np.all(np.diff(levels) > 0)
    np.testing.assert_array_equal(levels, -levels[::-1])
    np.testing.assert_allclose(bounds, (levels[1:] + levels[:-1]) / 2, rtol=0, atol=1e-15)
    edges = np.concatenate(([-np.inf], bounds, [np.inf]))
    pdf = lambda x: math.exp(-x * x / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    for c, lo, hi in zip(levels, edges[:-1], edges[1:]):
        mass = integrate.quad(pdf, lo, hi, epsabs=1e-14)[0]
        mean = integrate.quad(lambda x: x * pdf(x), lo, hi, epsabs=1e-14)[0] / mass
        assert abs(mean - c) < 1e-9
    mse = turbo.codebook_mse(levels)
    assert mse == pytest.approx(turbo.GAUSSIAN_MSE[bits], rel=1e-3)
    # a level moved either way does worse (a stationary point that is a minimum, not a saddle)
    for j in range(len(levels)):
        for eps in (1e-3, -1e-3):
            moved = levels.copy()
            moved[j] += eps
            assert turbo.codebook_mse(np.sort(moved)) > mse


def test_rotations_are_orthogonal_seeded_and_refuse_what_they_cannot_take():
    for kind, dim in (("hadamard", 64), ("orthogonal", 48), ("orthogonal", 64)):
        r = turbo.rotation_matrix(kind, dim, 3).double()
        torch.testing.assert_close(r @ r.T, torch.eye(dim, dtype=torch.float64), rtol=0, atol=1e-6)
        assert torch.equal(r.float(), turbo.rotation_matrix(kind, dim, 3))
        assert not torch.equal(r.float(), turbo.rotation_matrix(kind, dim, 4))
    r = turbo.rotation_matrix("hadamard", 16, 0)
    signs = torch.sign(r[:, 0]) * torch.sign(hadamard(16)[:, 0])  # random signs, then the Walsh–Hadamard matrix
    torch.testing.assert_close(r, signs[:, None] * hadamard(16))
    with pytest.raises(ValueError, match="power-of-two.*orthogonal"):
        turbo.rotation_matrix("hadamard", 48, 0)
    with pytest.raises(ValueError, match="rotation must be one of"):
        turbo.rotation_matrix("none", 16, 0)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_codes_match_a_float64_oracle_and_the_distortion(bits):
    """Codes: the nearest level of the rotated, normalized coordinate (float64 oracle; float32 may flip a value
    sitting on a boundary); scale: the least-squares fit; distortion of Gaussian rows ≈ the codebook's MSE."""
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(4000, 128, generator=g) * torch.linspace(0.1, 3, 128)  # uneven channels: the rotation evens them
    rot = turbo.rotation_matrix("hadamard", 128, 7)
    q, s = turbo.encode(x, bits, rot, torch.float32)
    levels = torch.from_numpy(turbo.lloyd_max(bits)[0])
    y = x.double() @ rot.double()
    u = y * math.sqrt(128) / y.norm(dim=-1, keepdim=True)
    oracle = (u[..., None] - levels).abs().argmin(-1)
    assert (q.long() != oracle).float().mean() < 1e-4
    c = levels[q.long()]  # the scale and the decode of the codes chosen, in float64
    ls = (y * c).sum(-1, keepdim=True) / (c * c).sum(-1, keepdim=True)
    torch.testing.assert_close(s.double(), ls, rtol=1e-5, atol=0)
    xh = turbo.decode(q, s, bits, rot).double()
    torch.testing.assert_close(xh, (ls * c) @ rot.double().T, rtol=0, atol=1e-5 * x.abs().max().item())
    rel = ((xh - x.double()).pow(2).sum(-1) / x.double().pow(2).sum(-1)).mean().item()
    d = turbo.GAUSSIAN_MSE[bits]
    assert 0.8 * d < rel < 1.1 * d  # the least-squares scale recovers a little of the distortion


@pytest.mark.parametrize("spec", [
    StoreSpec(3, codec="turbo", rotation="hadamard", residual=16, flush=8, sink=2),
    StoreSpec(2, codec="turbo", rotation="orthogonal", outliers=8, value_bits=2),
    StoreSpec(3, codec="turbo", rotation="orthogonal", outliers=16, smooth=True, scale_dtype=torch.float16),
    StoreSpec(3, codec="turbo", rotation="hadamard", center=True, residual=8, flush=8),
    StoreSpec(4, codec="turbo", rotation="hadamard", scale_dtype=torch.bfloat16),
])
def test_store_reads_back_its_codes_with_exact_bytes(spec):
    x = torch.randn(2, 3, 70, 64, generator=torch.Generator().manual_seed(0))
    x[..., 5] *= 30  # an outlier channel
    store = make_store(spec, x, 128)
    store.write(0, x[:, :, :40])
    store.write(40, x[:, :, 40:])
    got = store.read(0, 70)
    assert got.shape == x.shape and got.dtype == x.dtype
    err = ((got - x).pow(2).sum() / x.pow(2).sum()).item()
    assert 0 < err < 3 * turbo.GAUSSIAN_MSE[spec.bits]
    row = spec.bytes_per_value_row(64, x.dtype)
    parts = spec.turbo_parts(64)
    assert row == sum(w * b // 8 for w, b in parts) + len(parts) * spec.scale_dtype.itemsize
    coded = getattr(store, "coded", getattr(store, "inner", store))
    fp = 70 - getattr(store, "flushed", 70) + min(70, spec.sink)
    fixed = 2 * 3 * spec.fixed_bytes(64)
    assert store.nbytes(70) == 2 * 3 * ((70 - fp) * row + fp * 64 * 4) + fixed
    assert coded.data.shape[-1] == sum(w * b // 8 for w, b in parts)
    twin = pickle.loads(pickle.dumps(store))
    assert torch.equal(twin.read(0, 70), got)
    if spec.outliers:  # the largest channel is among the outliers, fitted by the first write
        assert (coded.perm[..., :spec.outliers] == 5).any(-1).all()


def test_centred_keys_drop_a_constant_offset_from_the_codes():
    x = torch.randn(1, 2, 200, 64, generator=torch.Generator().manual_seed(2)) + torch.linspace(-6, 6, 64)
    errs = []
    for center in (False, True):
        s = make_store(StoreSpec(3, codec="turbo", rotation="hadamard", center=center), x, 256)
        s.write(0, x[:, :, :150])  # the means come from the first write
        s.write(150, x[:, :, 150:])
        errs.append(((s.read(0, 200) - x).pow(2).sum() / x.pow(2).sum()).item())
        assert s.nbytes(200) == 2 * 200 * (24 + 4) + center * 2 * 64 * 4  # codes, fp32 scale; + the fp32 means
    assert errs[1] < 0.3 * errs[0]
    with pytest.raises(ValueError, match="center, rope and rope_centred are options of turbo codes"):
        StoreSpec(3, center=True)


def test_outliers_lower_the_error_of_a_row_with_large_channels():
    x = torch.randn(1, 2, 200, 64, generator=torch.Generator().manual_seed(1))
    x[..., :4] *= 25
    base = StoreSpec(3, codec="turbo", rotation="orthogonal")
    errs = []
    for spec in (base, StoreSpec(3, codec="turbo", rotation="orthogonal", outliers=8)):
        s = make_store(spec, x, 256)
        s.write(0, x)
        errs.append(((s.read(0, 200) - x).pow(2).sum(-1) / x.pow(2).sum(-1)).mean().item())
    assert errs[1] < 0.5 * errs[0]


@pytest.mark.parametrize("name,opts", [("turbo3", {}), ("turbo2", dict(residual=8, flush=4)),
                                       ("turbo4", dict(residual=8, sink=0)),
                                       ("turbo3", dict(residual=8, outliers=8, rotation="orthogonal", key_bits=2))])
def test_plan_bytes_equal_the_cache_after_generate(name, opts):
    model = tiny_model("llama", kv_heads=2)
    plan = kvslim.apply(model, name, **opts)
    ids = torch.randint(3, 120, (2, 140), generator=torch.Generator().manual_seed(0))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                         return_dict_in_generate=True, pad_token_id=0)
    n = ids.shape[1] + 5
    assert out.past_key_values.nbytes == plan.cache_bytes(n, batch=2)
    lp = plan.layers[0]
    spec = lp.factory(None).spec  # head dim 16, 2 KV heads
    assert lp.bytes_per_token == 2 * (spec.bytes_per_value_row(16, torch.float32)
                                      + spec.for_values().bytes_per_value_row(16, torch.float32))
    kvslim.restore(model)


def test_defaults_adapt_the_outliers_to_the_head_dim():
    spec = METHODS["turbo3"].plan_model(tiny_model("llama", hidden_size=128, num_attention_heads=2)).layers[0]
    assert spec.factory(None).spec.outliers == 16 and spec.factory(None).spec.center  # a quarter of head dim 64
    plan = METHODS["turbo3"].plan_model(tiny_model("llama"))  # head dim 16: 4 + 12 channels do not fill bytes
    assert plan.layers[0].factory(None).spec.outliers == 0 and any("outliers=0" in n for n in plan.notes)
    t2 = METHODS["turbo2"].plan_model(tiny_model("llama", hidden_size=128, num_attention_heads=2)).layers[0]
    k = t2.factory(None).spec
    assert (k.bits, k.for_values().bits, k.outliers) == (3, 2, 16)
    assert METHODS["turbo4"].plan_model(tiny_model("llama")).layers[0].factory(None).spec.outliers == 0


def test_layers_get_their_own_rotation_seeds():
    plan = METHODS["turbo3"].plan_model(tiny_model("llama"))
    seeds = [lp.factory(None).spec.seed for lp in plan.layers]
    assert len(set(seeds)) == len(seeds) and all(s % 2 == 0 for s in seeds)
    assert plan.layers[1].factory(None).spec.for_values().seed == seeds[1] + 1


def test_prefill_logits_equal_the_dense_model():
    model = tiny_model("llama", num_hidden_layers=2)
    ids = torch.randint(1, 128, (1, 96), generator=torch.Generator().manual_seed(3))
    plan = METHODS["turbo3"].plan_model(model, residual=8, sink=0)
    ref, cache = DynamicCache(), KVSlimCache([lp.factory(None) for lp in plan.layers], plan=plan)
    with torch.inference_mode():
        kvslim.apply(model, "dense")
        a = model(ids[:, :64], **{CACHE_KW: ref}, use_cache=True).logits
        b = model(ids[:, :64], **{CACHE_KW: cache}, use_cache=True).logits
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        a = model(ids[:, 64:], **{CACHE_KW: ref}, use_cache=True).logits
        b = model(ids[:, 64:], **{CACHE_KW: cache}, use_cache=True).logits
    kvslim.restore(model)
    assert 0 < (a - b).abs().max().item() < 1.0


@pytest.mark.parametrize("method", ["turbo3", "turbo2"])
def test_decode_steps_before_the_first_flush_with_outlier_channels(method):
    """Regression: with outlier channels (head dim 32: 8 of them, two coded parts) a fused decode step before the
    first flush (nothing coded, no permutation fitted yet) put the window into the coded basis with the first part's
    rotation alone and failed on a shape mismatch. Nothing is coded there: the tokens are the dense model's."""
    model = tiny_model("llama", num_hidden_layers=1, head_dim=32)
    ids = torch.randint(1, 128, (1, 20), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    kvslim.apply(model, "dense")
    want = model.generate(ids, **kw)
    kvslim.apply(model, method)
    assert kvslim.get_plan(model).layers[0].factory(None).spec.outliers == 8
    assert torch.equal(model.generate(ids, **kw), want)
    kvslim.restore(model)


@pytest.mark.parametrize("opts,match", [
    (dict(outliers=5), "outliers=5.*whole bytes"),
    (dict(outliers=16, rotation="orthogonal"), "outliers=16 must be below the head dimension 16"),
    (dict(rotation="none"), "rotation must be one of"),
    (dict(key_bits=8), "bits must be 2, 3 or 4 for turbo codes"),
    (dict(window=8), "unknown option.*window"),
    (dict(group_size=8), "unknown option.*group_size"),
    (dict(residual=200), "at most 128"),
    (dict(seed=-1), "seed must be a non-negative int"),
    (dict(outliers=-2), "outliers must be a non-negative int"),
])
def test_bad_options_refused_by_name_nothing_changed(opts, match):
    model = tiny_model("llama", kv_heads=4)  # head dim 16
    before = type(model.model.layers[0].self_attn).forward, model.config._attn_implementation
    with pytest.raises(ValueError, match=match):
        kvslim.apply(model, "turbo3", **opts)
    assert (type(model.model.layers[0].self_attn).forward, model.config._attn_implementation) == before
    assert getattr(model, "_kvslim", None) is None


def test_refusals_that_depend_on_the_model():
    with pytest.raises(ValueError, match="outliers=8 are coded at bits \\+ 1"):
        kvslim.apply(tiny_model("llama"), "turbo4", outliers=8, rotation="orthogonal")
    d64 = tiny_model("llama", hidden_size=128, num_attention_heads=2)  # 16 outliers leave 48 channels
    with pytest.raises(ValueError, match="rotation='hadamard' needs a power-of-two width, got 48.*orthogonal"):
        kvslim.apply(d64, "turbo3", outliers=16, rotation="hadamard")
    kvslim.apply(d64, "turbo3", outliers=16, rotation="orthogonal")
    odd = tiny_model("llama", hidden_size=96, num_attention_heads=4)  # head dim 24: no Hadamard matrix
    with pytest.raises(ValueError, match="power-of-two.*orthogonal"):
        kvslim.apply(odd, "turbo4")
    kvslim.apply(odd, "turbo4", rotation="orthogonal")  # what the message offers works
    with pytest.raises(ValueError, match="sliding-window layers"):
        kvslim.apply(tiny_model("qwen2-mixed"), "turbo3")
