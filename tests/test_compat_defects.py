"""The defects of issue 10, one test each (each failed before its fix), beside the matrix of test_compat_matrix.py.

crop follows HF's ``DynamicLayer.crop``; ring layers crop speculative tokens back with past recording; layer
factories, plans and caches pickle; ``update`` names the tensor with the wrong head dim; the int8/int4 default
group size adapts to the head dim; quantized stores refuse inf/nan instead of zeroing the group around it.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from conftest import tiny_model
from transformers import DynamicCache, Phi3Config, Phi3ForCausalLM
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

import kvslim
from kvslim.adapters.compat import CACHE_KW
from kvslim.caches import StoreSpec
from kvslim.caches.dense import AppendLayer
from kvslim.caches.stores import make_store
from kvslim.caches.window import ResidualRingLayer, RingLayer

pytestmark = pytest.mark.usefixtures("one_thread")


def _kv(t: int, seed: int = 0, d: int = 8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, t, d, generator=g), torch.randn(2, 2, t, d, generator=g)


def _fill(layer, t: int = 6):
    k, v = _kv(t)
    layer.update(k, v)
    return k, v


@pytest.mark.parametrize("make", [lambda: AppendLayer(), lambda: AppendLayer(StoreSpec(8, 4)), lambda: RingLayer(16)])
def test_crop_follows_hf_dynamic_layer(make):
    ours, hf = make(), DynamicLayer()
    _fill(ours), _fill(hf)
    ours.crop(0)  # HF: 0 removes nothing (we used to read it as "keep 0 tokens" and empty the cache)
    hf.crop(0)
    assert ours.get_seq_length() == hf.get_seq_length() == 6
    for bad in (5, 1):  # HF refuses the legacy positive "keep n" meaning
        with pytest.raises(ValueError, match="positive"):
            ours.crop(bad)
        assert ours.get_seq_length() == 6
    ours.crop(-2)
    hf.crop(-2)
    assert ours.get_seq_length() == hf.get_seq_length() == 4
    k, v = _kv(1, seed=3)
    mine_k, _ = ours.update(k, v)
    theirs_k, _ = hf.update(k, v)
    assert torch.allclose(mine_k, theirs_k, atol=0.1 if ours.spec.bits else 0)


def test_ring_layer_crops_speculative_tokens_back_with_past_recording():
    window = 4
    ours, hf = RingLayer(window), DynamicSlidingWindowLayer(window)
    k, v = _kv(6)
    ours.update(k, v)
    hf.update(k, v)
    with pytest.raises(RuntimeError, match="activate_past_recording"):
        ours.crop(-2)  # the window is full: the tokens to take back are overwritten (HF raises too)
    ours.activate_past_recording()
    hf.activate_past_recording() if hasattr(hf, "activate_past_recording") else setattr(hf, "record_past", True)
    spec_k, spec_v = _kv(3, seed=5)  # three speculative tokens, two rejected
    ours.update(spec_k, spec_v)
    hf.update(spec_k, spec_v)
    ours.crop(-2)
    hf.crop(-2)
    assert ours.get_seq_length() == 7
    k1, v1 = _kv(1, seed=6)
    mine_k, mine_v = ours.update(k1, v1)
    theirs_k, theirs_v = hf.update(k1, v1)
    # the last window-1 tokens plus the new one, in temporal order, exactly
    assert torch.equal(mine_k[:, :, -window:], theirs_k[:, :, -window:])
    assert torch.equal(mine_v[:, :, -window:], theirs_v[:, :, -window:])


@pytest.mark.parametrize("method,opts", [("dense", {}), ("window", {}), ("int8", {}), ("int4", {"window": 4})])
def test_filled_caches_and_plans_pickle(method, opts):
    model = tiny_model("mistral")
    plan = kvslim.apply(model, method, **opts)
    cache = kvslim.make_cache(model)
    ids = torch.randint(1, 128, (1, 10))
    with torch.no_grad():
        model(ids, **{CACHE_KW: cache})
    again = pickle.loads(pickle.dumps(cache))  # lambdas/closures inside caches used to make this fail
    assert again.get_seq_length() == cache.get_seq_length() == 10
    assert pickle.loads(pickle.dumps(plan)).layers[0].factory(None).__class__ is type(cache.layers[0])
    nxt = torch.randint(1, 128, (1, 1))
    with torch.no_grad():
        a = model(nxt, **{CACHE_KW: cache}).logits
        b = model(nxt, **{CACHE_KW: again}).logits
    assert torch.equal(a, b)


@pytest.mark.parametrize("bits", [0, 8])
def test_update_with_a_wrong_head_dim_names_the_tensor(bits):
    layer = AppendLayer(StoreSpec(bits, 4) if bits else None)
    k, v = _kv(3)
    layer.update(k, v)
    before = layer.get_seq_length()
    for name, args in (("key_states", (torch.randn(2, 2, 1, 6), torch.randn(2, 2, 1, 8))),
                       ("value_states", (torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 6)))):
        with pytest.raises(ValueError, match=f"{name}.*head_dim=8"):
            layer.update(*args)
        assert layer.get_seq_length() == before
    fresh = AppendLayer(StoreSpec(8, 4))
    with pytest.raises(ValueError, match="value_states"):
        fresh.update(torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 6))  # 6 is no multiple of group 4


def test_default_group_size_adapts_to_the_head_dim():
    from kvslim.ops.quant import default_group_size

    assert [default_group_size(d) for d in (128, 64, 96, 80, 24, 48, 12)] == [64, 64, 32, 16, 8, 16, 12]
    assert default_group_size(96, preferred=32) == 32 and default_group_size(80, preferred=32) == 16


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_bare_quantized_apply_works_on_head_dim_96_and_the_plan_says_which_group(method):
    torch.manual_seed(0)  # Phi-3-mini's head dim 96 (one head of 96 here): the old default 64 was refused
    model = Phi3ForCausalLM(Phi3Config(vocab_size=64, hidden_size=96, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=1, num_key_value_heads=1, pad_token_id=0)).eval()
    plan = kvslim.apply(model, method)
    assert any("group_size=32" in n and "head dim 96" in n for n in plan.notes), plan.notes
    assert "g32" in plan.layers[0].note and "group_size=32" in str(plan)
    out = model.generate(torch.randint(1, 64, (1, 5)), max_new_tokens=3, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True)
    assert out.past_key_values.layers[0].k_store.spec.group_size == 32
    with pytest.raises(ValueError, match="group_size=64 must divide"):
        kvslim.apply(model, method, group_size=64)  # asked for explicitly: still refused, with the divisors


def test_mla_bits_default_group_adapts_to_kv_lora_rank():
    from test_mla_model import deepseek

    model = deepseek("v2-lite", kv_lora_rank=40)  # 40: no multiple of 64, 32 or 16
    ids = torch.randint(1, 128, (1, 6))
    with torch.no_grad():
        ref = model(ids).logits
    plan = kvslim.apply(model, "mla", bits=8)
    assert "int8/g8" in plan.layers[0].note and any("kv_lora_rank 40" in n for n in plan.notes)
    with torch.no_grad():
        got = model(ids, **{CACHE_KW: kvslim.make_cache(model)}).logits
    assert (got - ref).abs().max() < 5e-2


@pytest.mark.parametrize("spec", [StoreSpec(8, 8), StoreSpec(4, 8), StoreSpec(8, 8, asymmetric=True),
                                  StoreSpec(8, 8, residual=2, flush=2)])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_quantized_store_refuses_non_finite_values_and_writes_nothing(spec, bad):
    x = torch.randn(1, 1, 4, 16)
    store = make_store(spec, x, 8)
    store.write(0, x)
    before = [t.clone() for t in store.tensors()]
    y = torch.randn(1, 1, 3, 16)
    y[0, 0, 1, 5] = bad  # one value; before the fix an inf zeroed its 7 finite group neighbours silently
    with pytest.raises(ValueError, match="non-finite.*token 1 of this write, channel 5"):
        store.write(4, y)
    assert all(torch.equal(a.flatten().view(torch.uint8), b.flatten().view(torch.uint8))  # bitwise: unwritten
               for a, b in zip(before, store.tensors(), strict=True))  # slots may hold NaN patterns
    plain = make_store(StoreSpec(), x, 8)
    plain.write(0, y)  # plain storage keeps what the model made
    assert torch.allclose(plain.read(0, 3), y, rtol=0, atol=0, equal_nan=True)


KIVI = StoreSpec(4, 16, torch.float16, asymmetric=True, channel_group=4, residual=8, flush=4, sink=2)


@pytest.mark.parametrize("make", [lambda: AppendLayer(StoreSpec(8, 8)), lambda: AppendLayer(KIVI),
                                  lambda: RingLayer(32, StoreSpec(4, 8)),
                                  lambda: ResidualRingLayer(16, StoreSpec(4, 16, torch.float16, asymmetric=True,
                                                                          residual=8, flush=4))],
                         ids=["append-int8", "append-int4-kivi-sinks", "ring-int4", "residual-ring-int4"])
def test_layer_update_refused_for_bad_values_writes_neither_store(make):
    """A step whose *values* hold a NaN is refused before the keys are written (before the fix the key store took
    the token: its residual window advanced, so the next step replayed it as a rewind, re-reading a flushed group
    from codes)."""
    layer = make()
    gen = torch.Generator().manual_seed(0)
    layer.update(torch.randn(1, 2, 13, 16, generator=gen), torch.randn(1, 2, 13, 16, generator=gen))

    def state():
        out = []
        for store in layer._stores():
            out += [t.clone() for t in store.tensors()] + ([store.fp.clone()] if hasattr(store, "fp") else [])
            out += [torch.tensor([getattr(store, "length", -1), getattr(getattr(store, "inner", None), "flushed", -1)])]
        return out

    before = state()  # two tokens: a decode step (one token) is checked on the device instead (test_sync_free.py)
    k, v = torch.randn(1, 2, 2, 16, generator=gen), torch.randn(1, 2, 2, 16, generator=gen)
    v[0, 1, 1, 7] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        layer.update(k, v)
    assert layer.get_seq_length() == 13
    assert all(torch.equal(a.flatten().view(torch.uint8), b.flatten().view(torch.uint8))
               for a, b in zip(before, state(), strict=True))


def test_quantized_cache_refuses_inf_inside_generate_step():
    model = tiny_model("llama")
    kvslim.apply(model, "int8")
    cache = kvslim.make_cache(model)
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.bias = torch.nn.Parameter(torch.full((32,), float("inf")))
        with pytest.raises(ValueError, match="non-finite"):
            model(torch.randint(1, 128, (1, 4)), **{CACHE_KW: cache})
    assert cache.get_seq_length() == 0


def test_cache_from_user_dynamic_cache_is_left_alone():
    model = tiny_model("llama")
    kvslim.apply(model, "int8")
    mine = DynamicCache()
    out = model.generate(torch.randint(1, 128, (1, 4)), max_new_tokens=2, do_sample=False, pad_token_id=0,
                         **{CACHE_KW: mine}, return_dict_in_generate=True)
    assert out.past_key_values is mine


def test_finite_check_does_not_refuse_large_finite_values_whose_sum_overflows():
    # the check sums the write first (inf/nan always reach the sum); a sum that overflows on finite values must
    # fall back to the element-wise test, not refuse a valid write
    x = torch.full((1, 1, 4, 16), 3.0e38)
    assert not torch.isfinite(x.sum())
    store = make_store(StoreSpec(8, 8), x, 8)
    store.write(0, x)  # no ValueError
    assert torch.isfinite(store.read(0, 4)).all()
    y = x.clone()
    y[0, 0, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="non-finite.*token 2 of this write, channel 3"):
        store.write(4, y)
