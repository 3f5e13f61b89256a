"""RoPE-centred turbo keys (``rope_centred_keys``, ``StoreSpec.rope_centred``): channel means fitted before RoPE,
each key coded after RoPE as ``k − RoPE_s(μ)``; reads, the fused decode's per-row score bias, plans and refusals."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest
import torch
from conftest import tiny_model
from test_turbo_levers import _rope_rows

import kvslim
from kvslim.adapters.compat import CACHE_KW
from kvslim.caches import StoreSpec, make_store
from kvslim.caches.fused import fusable
from kvslim.caches.turbo import TurboStore
from kvslim.methods import METHODS


def _spec(**kw) -> StoreSpec:
    model = tiny_model("llama", hidden_size=128, num_attention_heads=2, kv_heads=2)  # head dim 64
    return replace(METHODS["turbo3"].plan_model(model, rope_centred_keys=True).layers[0].factory(None).spec, **kw)


def test_rope_centred_keys_code_the_position_free_part():
    """A key whose pre-RoPE part is one constant per head plus noise: post-RoPE centring cannot remove the constant
    (it turns with the position), RoPE-centred keys remove it as pre-RoPE keys do; same bytes."""
    spec = _spec(residual=0, sink=0, flush=1)
    assert spec.rope_centred and spec.center and "rope-centred-k" in spec.describe()
    g = torch.Generator().manual_seed(0)
    pre = 5 * torch.randn(1, 2, 1, 64, generator=g) + 0.3 * torch.randn(1, 2, 200, 64, generator=g)
    post = _rope_rows(spec.rope, pre)
    errs, nbytes = {}, {}
    for name, s in (("post", replace(spec, rope=None, rope_centred=False)), ("pre", replace(spec, rope_centred=False)),
                    ("centred", spec)):
        st = make_store(s, post, 256)
        st.write(0, post[:, :, :120])
        st.write(120, post[:, :, 120:])
        errs[name] = ((st.read(0, 200) - post).pow(2).sum() / (0.3 ** 2 * post.numel())).item()
        nbytes[name] = st.nbytes(200)
    assert errs["centred"] < 0.1 * errs["post"] and errs["centred"] < 1.5 * errs["pre"]
    assert nbytes["centred"] == nbytes["post"] == nbytes["pre"]
    r = make_store(spec, post, 256).roundtrip(post)
    assert ((r - post).pow(2).sum() / (0.3 ** 2 * post.numel())).item() < 0.1 * errs["post"]


def test_rope_centred_means_behind_sinks_and_the_score_bias():
    """Behind sinks the coded slot 0 is position ``sink``: a constant pre-RoPE key is fitted as its very value
    (fp32, 1e-4) and read back; ``score_bias`` equals q·RoPE_s(μ) in float64 (1e-4)."""
    spec = _spec(residual=16, flush=8, sink=4)
    k0 = 3 * torch.randn(1, 2, 1, 64, generator=torch.Generator().manual_seed(1))
    post = _rope_rows(spec.rope, k0.expand(1, 2, 100, 64).clone())
    s = make_store(spec, post, 128)
    s.write(0, post)
    coded = s.coded
    assert isinstance(coded, TurboStore) and coded.position_offset == 4
    torch.testing.assert_close(coded.mean, k0, atol=1e-4, rtol=0)
    torch.testing.assert_close(s.read(0, 100), post, atol=1e-3, rtol=0)
    n = s.inner.flushed
    q = torch.randn(1, 2, 3, 64, generator=torch.Generator().manual_seed(2))
    offset = post[:, :, 4:4 + n].double()  # the coded rows' own offsets: slot t is position 4 + t
    want = torch.einsum("bhgd,bhtd->bhgt", q.double(), offset)
    torch.testing.assert_close(coded.score_bias(q, n).double(), want, rtol=1e-4, atol=1e-4)
    assert coded.score_bias(q, n).shape == (1, 2, 3, n)


def test_rope_centred_plan_bytes_fusable_and_pickle():
    model = tiny_model("llama", hidden_size=128, num_attention_heads=2, kv_heads=2)
    plan = kvslim.apply(model, "turbo3", rope_centred_keys=True)
    spec = plan.layers[0].factory(None).spec
    assert spec.rope_centred and spec.for_values().rope is None and not spec.for_values().rope_centred
    again = pickle.loads(pickle.dumps(plan))
    assert again.layers[1].factory(None).spec == plan.layers[1].factory(None).spec
    assert plan.layers[0].bytes_per_token == METHODS["turbo3"].plan_model(model).layers[0].bytes_per_token
    assert plan.layers[0].fixed_bytes == METHODS["turbo3"].plan_model(model).layers[0].fixed_bytes
    ids = torch.randint(3, 120, (2, 140), generator=torch.Generator().manual_seed(0))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                         return_dict_in_generate=True, pad_token_id=0)
    cache = out.past_key_values
    assert cache.nbytes == plan.cache_bytes(143, batch=2)
    assert fusable(cache.layers[0].k_store)
    kvslim.restore(model)


@pytest.mark.parametrize("opts,match", [
    (dict(rope_centred_keys="yes"), "rope_centred_keys must be True or False"),
    (dict(rope_centred_keys=True, prerope_keys=True), "prerope_keys and rope_centred_keys .* take one"),
    (dict(rope_centred_keys=True, center_keys=False), "rope_centred_keys=True .* needs center_keys=True"),
])
def test_rope_centred_bad_options_refused_by_name(opts, match):
    model = tiny_model("llama", kv_heads=2)
    with pytest.raises(ValueError, match=match):
        kvslim.apply(model, "turbo3", **opts)
    assert getattr(model, "_kvslim", None) is None


def test_rope_centred_refused_without_rope_and_spec_checks():
    with pytest.raises(ValueError, match="rope_centred_keys=True needs the model's RoPE table.*rope_centred_keys=False"):
        kvslim.apply(tiny_model("gpt2"), "turbo3", rope_centred_keys=True)
    with pytest.raises(ValueError, match="rope_centred=True .* needs rope"):
        StoreSpec(3, codec="turbo", rotation="orthogonal", center=True, rope_centred=True)
    with pytest.raises(ValueError, match="rope_centred must be True or False"):
        StoreSpec(3, codec="turbo", rotation="orthogonal", rope_centred=1)
    with pytest.raises(ValueError, match="are options of turbo codes"):
        StoreSpec(3, rope_centred=True)


@pytest.mark.parametrize("method,opts", [("turbo3", dict(residual=8, flush=4, sink=2)),
                                         ("turbo2", dict(residual=8, flush=4, sink=0))])
@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_fused_decode_with_rope_centred_keys_equals_the_unfused_reads(method, opts, backend, monkeypatch):
    """Left-padded batch through the fused op (the C++ op and the pure-torch twin, each with the score bias) and
    through the layers' dequantized reads: the same greedy tokens, logits close (fp32, 1e-4)."""
    from kvslim.kernels import turbo_decode as kernel

    if backend == "cpp" and not kernel.available():
        pytest.skip("the turbo_decode C++ op is not built here")
    monkeypatch.setenv("KVSLIM_BACKEND", backend)
    model = tiny_model("llama", kv_heads=2)
    kvslim.apply(model, method, rope_centred_keys=True, **opts)
    ids = torch.randint(3, 120, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding of the second sequence
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True, output_logits=True)
    calls = []
    original = TurboStore.move_query

    def counting(self, q):
        out = original(self, q)
        if out[1] is not None:
            torch.testing.assert_close(out[1], self.bias_factors(q, 1)[0], rtol=1e-5, atol=1e-5)
        calls.append(out[1] is not None)
        return out

    monkeypatch.setattr(TurboStore, "move_query", counting)
    fused = model.generate(ids, **kw)
    assert fused.past_key_values.layers[0].fused_decode and any(calls)  # the fused op took the score bias
    cache = kvslim.make_cache(model)
    for layer in cache.layers:
        layer.fused_decode = False
    plain = model.generate(ids, **{CACHE_KW: cache}, **kw)
    assert torch.equal(fused.sequences, plain.sequences)
    for a, b in zip(fused.logits, plain.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    kvslim.restore(model)


def test_partial_rotary_bias_factors_carry_the_unturned_channels():
    """RoPE on 32 of 64 channels: the factors hold a·cos, b·sin and the unturned channels' q·μ on a column of ones
    (W = 40); multiplied out they equal q·RoPE_s(μ) in float64 (1e-4), and the fused op takes them."""
    rope = tuple(float(10000 ** (-i / 16)) for i in range(16))
    spec = StoreSpec(3, codec="turbo", rotation="orthogonal", outliers=16, center=True, rope=rope, rope_centred=True)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2, 50, 64, generator=g) + 2
    s = make_store(spec, x, 64)
    s.write(0, x)
    q = torch.randn(1, 2, 3, 64, generator=g)
    ab, rows = s.bias_factors(q, 50)
    assert ab.shape == (1, 2, 3, 40) and rows.shape == (50, 40)
    want = torch.einsum("bhgd,bhtd->bhgt", q.double(), s._rope_mean(torch.arange(50)).double())
    torch.testing.assert_close(s.score_bias(q, 50).double(), want, rtol=1e-4, atol=1e-4)


def test_turbo3_default_is_rope_centred_and_gives_way_by_name():
    """turbo3's default keys are RoPE-centred; ``prerope_keys=True`` or ``center_keys=False`` alone turn that off;
    a model without a static RoPE table gets plainly centred keys and a note (turbo2 keeps plain centring)."""
    model = tiny_model("llama", kv_heads=2)
    spec = lambda **kw: METHODS["turbo3"].plan_model(model, **kw).layers[0].factory(None).spec  # noqa: E731
    assert spec().rope_centred and spec().rope is not None
    assert not spec(prerope_keys=True).rope_centred and spec(prerope_keys=True).rope is not None
    assert not spec(center_keys=False).rope_centred and not spec(center_keys=False).center
    assert not spec(rope_centred_keys=False).rope_centred and spec(rope_centred_keys=False).rope is None
    assert not METHODS["turbo2"].plan_model(model).layers[0].factory(None).spec.rope_centred
    plan = METHODS["turbo3"].plan_model(tiny_model("gpt2"))
    assert plan.layers[0].factory(None).spec.rope is None and plan.layers[0].factory(None).spec.center
    assert any("rope_centred_keys=False" in n for n in plan.notes)


def test_query_move_matrix_follows_a_reorder():
    """``move_query``'s kept matrix equals the permutation + part rotations + smoothing done step by step (fp32, 1e-5),
    and is rebuilt when a reorder (beam search) replaces the fitted tensors."""
    spec = replace(_spec(residual=0, sink=0, flush=1), smooth=True)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 2, 40, 64, generator=g) * torch.linspace(0.5, 3, 64)
    s = make_store(spec, x, 48)
    s.write(0, x)
    q = torch.randn(2, 2, 3, 64, generator=g)

    def manual(store, q):
        z = (q * store.channel).gather(-1, store.perm.long()[:, :, None, :].expand(q.shape))
        w = store.parts[0][0]
        return torch.cat((z[..., :w] @ store.rotations[0], z[..., w:] @ store.rotations[1]), -1)

    for _ in range(2):
        got, ab = s.move_query(q)
        torch.testing.assert_close(got, manual(s, q), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ab, s.bias_factors(q, 1)[0], rtol=1e-5, atol=1e-5)
        s.map_sequences(lambda t: t.flip(0))  # the two sequences swap
