"""Multi-token calls over a coded history through the fused ops (issue 49 item 1).

A call of S > 1 new tokens over a stored history (a question after a prompt file, a chat turn, a verify step)
hands attention ``caches/fused.history_handle``: the history as stored, the call's own tokens exactly.
``attention/quant.decode_call`` packs the G·S query rows per KV head into one op call over the history and merges
the call's own causal block by log-sum-exp. Checked against the unfused path (the history dequantized, then SDPA:
the same mathematics) end to end for every fused format, across a flush inside the call, with sinks, under left
padding, and at the layer against ``quant.reference`` with HF's 4-D masks.
"""

from __future__ import annotations

import pytest
import torch
from conftest import padded_batch, tiny_model
from tolerances import assert_rel_close

import kvslim
from kvslim.adapters.compat import CACHE_KW
from kvslim.attention import quant
from kvslim.caches import base
from kvslim.caches.fused import fused_of
from kvslim.kernels import quant_decode as kernel

FORMATS = ["int8", "int4", "int3", "int2", "turbo4", "turbo3", "turbo2"]
pytestmark = pytest.mark.skipif(not kernel.available(), reason="no C++ compiler: the ops cannot be built here")


@pytest.fixture
def unfused(monkeypatch):
    """Call to turn the multi-token fused route off (the history dequantized, then SDPA)."""
    def off():
        monkeypatch.setattr(base, "FUSED_CALL_TOKENS", 1)
        monkeypatch.setattr(base, "FUSED_CALL_HISTORY", 10 ** 9)
    return off


def _logits(model, method, ids, cuts, mask=None, **options):
    kvslim.apply(model, method, **options)
    try:
        cache = kvslim.make_cache(model)
        out = []
        with torch.no_grad():
            for a, b in zip(cuts, cuts[1:]):
                kw = {} if mask is None else {"attention_mask": mask[:, :b]}
                out.append(model(ids[:, a:b], use_cache=True, **kw, **{CACHE_KW: cache}).logits)
        return out, cache
    finally:
        kvslim.restore(model)


@pytest.mark.parametrize("method", FORMATS)
@pytest.mark.parametrize("cuts", [(0, 300, 317, 318), (0, 120, 137, 138), (0, 250, 290, 291), (0, 5, 8, 9)],
                         ids=["codes+window", "flush-inside-call", "40-tokens", "sinks-only"])
def test_a_call_over_the_codes_equals_the_dequantized_read(method, cuts, unfused, no_grad, monkeypatch):
    """The call's logits (and a decode step after it) equal the unfused path's to fp32 rounding, and the call
    went through the ops (a spy on ``decode_call`` sees every layer)."""
    model = tiny_model("llama", kv_heads=2)
    ids = torch.randint(1, 128, (1, cuts[-1]), generator=torch.Generator().manual_seed(1))
    calls = []
    real = quant.decode_call
    monkeypatch.setattr(quant, "decode_call", lambda *a: calls.append(1) or real(*a))
    fast, _ = _logits(model, method, ids, cuts)
    assert len(calls) == model.config.num_hidden_layers, "the call did not go through the fused ops"
    unfused()
    slow, _ = _logits(model, method, ids, cuts)
    for i, (f, s) in enumerate(zip(fast[1:], slow[1:])):
        assert_rel_close(f, s, torch.float32, f"{method} call {i + 1}")


@pytest.mark.parametrize("method", ["int4", "int2", "turbo3"])
def test_a_left_padded_batch_calls_through_the_ops(method, unfused, no_grad):
    model = tiny_model("llama", kv_heads=2)
    ids, mask = padded_batch(batch=3, length=200)
    more = torch.randint(1, 128, (3, 12), generator=torch.Generator().manual_seed(2))
    ids, mask = torch.cat((ids, more), 1), torch.cat((mask, torch.ones(3, 12, dtype=mask.dtype)), 1)
    cuts = (0, 200, 212)
    fast, _ = _logits(model, method, ids, cuts, mask)
    unfused()
    slow, _ = _logits(model, method, ids, cuts, mask)
    assert_rel_close(fast[1], slow[1], torch.float32, f"{method} padded call")


@pytest.mark.parametrize("method", ["int4", "int2", "turbo2"])
def test_layer_call_equals_the_reference_under_hf_masks(method, no_grad):
    """At one layer: ``decode_call`` vs the twin (the layer's unfused reads, fp32 softmax) with HF's causal mask
    (bool and additive) and left padding; a mask whose rows disagree on the history is declined (``None``)."""
    model = tiny_model("llama", kv_heads=2)
    kvslim.apply(model, method)
    try:
        cache = kvslim.make_cache(model)
        layer = cache.layers[1]
        g = torch.Generator().manual_seed(3)
        b, hk, d, past, s = 2, 2, 16, 210, 9
        layer.update(torch.randn(b, hk, past, d, generator=g), torch.randn(b, hk, past, d, generator=g))
        mk, _ = layer.update(torch.randn(b, hk, s, d, generator=g), torch.randn(b, hk, s, d, generator=g))
        h = fused_of(mk)
        assert h is not None and h.own is not None and h.tokens == past + s
        q = torch.randn(b, 4, s, d, generator=g)
        causal = torch.ones(s, past + s, dtype=torch.bool).tril(past)
        pad = torch.ones(b, past + s, dtype=torch.bool)
        pad[1, :37] = False  # row 1 left-padded
        allowed = causal[None, None] & pad[:, None, None]
        additive = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
        for mask in (allowed, additive, causal[None, None].expand(1, 1, s, past + s)):
            assert_rel_close(quant.decode(h, q, mask, None), quant.reference(h, q, mask, None), torch.float32,
                             f"{method} {mask.dtype} {tuple(mask.shape)}")
        odd = allowed.clone()
        odd[0, 0, 3, 5] = False  # one row masks a history column the others attend
        assert quant.decode(h, q, odd, None) is None
        assert quant.decode(h, q, None, None) is None  # HF always gives a call over a history its mask
    finally:
        kvslim.restore(model)


def test_the_route_by_length(no_grad, monkeypatch):
    """Calls of ≤ FUSED_CALL_TOKENS tokens are fused over any history; longer ones only over a history at least
    FUSED_CALL_HISTORY times their length; never under autograd or without history."""
    model = tiny_model("llama", kv_heads=2)
    kvslim.apply(model, "int4")
    try:
        layer = kvslim.make_cache(model).layers[0]
        x = torch.zeros(1, 2, 4, 16)
        layer.update(x, x)  # the stores exist from the first write
        assert not layer._fused_call(x, 0)  # a first call: nothing stored
        assert layer._fused_call(x, 1) and layer._fused_call(torch.zeros(1, 2, 64, 16), 10)
        long = torch.zeros(1, 2, 100, 16)
        assert not layer._fused_call(long, 399) and layer._fused_call(long, 400)
        huge = torch.zeros(1, 2, base.FUSED_CALL_MAX + 1, 16)  # its own S×S block would be too large: SDPA
        assert not layer._fused_call(huge, 100 * huge.shape[2])
        assert not layer._fused_call(torch.zeros(1, 2, 1, 16), 10)  # a decode step: the single-token route
        with torch.enable_grad():
            assert not layer._fused_call(x, 10)
    finally:
        kvslim.restore(model)


def test_a_bf16_model_builds_no_full_precision_history(no_grad, monkeypatch):
    """bf16: the call reads the codes; the layer's dequantized read (``_history_and_current``) is never run, and the
    logits stay within bf16's tolerance of the unfused path."""
    from kvslim.caches.dense import AppendLayer

    model = tiny_model("llama", kv_heads=2, dtype=torch.bfloat16)
    ids = torch.randint(1, 128, (1, 317), generator=torch.Generator().manual_seed(4))
    reads = []
    real = AppendLayer._history_and_current
    monkeypatch.setattr(AppendLayer, "_history_and_current", lambda self, store, start, x, role: (
        reads.append(start) or real(self, store, start, x, role)))
    fast, _ = _logits(model, "int4", ids, (0, 300, 317))
    assert not [r for r in reads if r > 0], "a multi-token call dequantized its history"
    monkeypatch.setattr(base, "FUSED_CALL_TOKENS", 1)
    monkeypatch.setattr(base, "FUSED_CALL_HISTORY", 10 ** 9)
    slow, _ = _logits(model, "int4", ids, (0, 300, 317))
    assert (fast[1].float() - slow[1].float()).abs().max() <= 0.1  # bf16 rounding of the unfused path's reads


@pytest.mark.parametrize("how", ["prompt_lookup", "assistant"])
def test_assisted_decoding_verifies_through_the_ops_and_keeps_greedy_tokens(how, monkeypatch):
    """Prompt-lookup and assistant-model decoding over an int4 cache: every verify step (a multi-token call over
    the history) runs ``decode_call``, the crops after it rewind the codes, and the tokens equal plain greedy's
    over the same cache method."""
    model = tiny_model("llama", kv_heads=2)
    base_ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    ids = torch.cat([base_ids] * 8, 1)  # repeats: prompt lookup finds candidates
    kvslim.apply(model, "int4")
    try:
        plain = model.generate(ids, max_new_tokens=24, do_sample=False)
        calls = []
        real = quant.decode_call
        monkeypatch.setattr(quant, "decode_call", lambda *a: calls.append(a[1].shape[2]) or real(*a))
        if how == "prompt_lookup":
            out = model.generate(ids, max_new_tokens=24, do_sample=False, prompt_lookup_num_tokens=3)
        else:
            assistant = tiny_model("llama", kv_heads=2, seed=1)
            kvslim.apply(assistant, "int4")
            out = model.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=assistant)
            kvslim.restore(assistant)
    finally:
        kvslim.restore(model)
    assert torch.equal(out, plain)
    assert [s for s in calls if s > 1], "no verify step went through the fused ops"


def test_ring_layers_keep_the_dequantized_call_and_the_plan_says_so(no_grad, monkeypatch):
    """A model with sliding-window layers (rings): their multi-token calls keep today's path (the window decoded), the
    append layers' go through the ops, and the plan names the ring layers."""
    model = tiny_model("qwen2-mixed", kv_heads=2)  # layer 0 full attention, layer 1 sliding
    plan = kvslim.apply(model, "int4")
    try:
        assert any("ring layer(s) decode their window" in n for n in plan.notes)
        calls = []
        real = quant.decode_call
        monkeypatch.setattr(quant, "decode_call", lambda *a: calls.append(1) or real(*a))
        ids = torch.randint(1, 128, (1, 220), generator=torch.Generator().manual_seed(6))
        cache = kvslim.make_cache(model)
        model(ids[:, :200], use_cache=True, **{CACHE_KW: cache})
        model(ids[:, 200:], use_cache=True, **{CACHE_KW: cache})
        assert len(calls) == 1  # the full-attention layer only
    finally:
        kvslim.restore(model)


@pytest.mark.parametrize("method, options", [
    ("int4", {"residual": 32, "sink": 2, "key_channel_group": 16}),
    ("int2", {"residual": 32, "sink": 2, "key_channel_group": 16}),
    ("turbo3", {"residual": 32}),
])
def test_a_long_call_that_flushes_its_own_tokens(method, options, unfused, no_grad, monkeypatch):
    """A 100-token call over 400 (routed fused: the history holds 4× the call) whose write flushes past the history
    into the call's own tokens: the op reads the history's codes up to a row inside a key group (partial group) and
    the call's own tokens come from ``own``; the logits equal the dequantized read's."""
    model = tiny_model("llama", kv_heads=2)
    ids = torch.randint(1, 128, (1, 501), generator=torch.Generator().manual_seed(8))
    calls = []
    real = quant.decode_call
    monkeypatch.setattr(quant, "decode_call", lambda *a: calls.append(1) or real(*a))
    cuts = (0, 400, 500, 501)
    fast, cache = _logits(model, method, ids, cuts, **options)
    assert len(calls) == model.config.num_hidden_layers
    layer = cache.layers[0]
    inner = layer.k_store.inner if hasattr(layer.k_store, "sink") else layer.k_store
    assert inner.flushed + getattr(layer.k_store, "sink", 0) > 400  # the call's own tokens were coded
    unfused()
    slow, _ = _logits(model, method, ids, cuts, **options)
    for i, (f, s) in enumerate(zip(fast[1:], slow[1:])):
        assert_rel_close(f, s, torch.float32, f"{method} call {i + 1}")
