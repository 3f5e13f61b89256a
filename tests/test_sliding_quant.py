"""Quantized methods on a model's own sliding-window layers (Gemma-3): a ring of W − 1 tokens, as HF's cache.

References: HF's ``DynamicSlidingWindowLayer`` (which tokens, mask sizes), an append-only layer of the same format
(the values: the ring holds the same codes for the same positions), the unfused reads (the fused kernel), HF's
model with its own ``DynamicCache`` (tokens, logits, bytes).
"""

from __future__ import annotations

import pytest
import torch
from tolerances import LOSSY_LOGIT_ATOL
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig
from transformers.cache_utils import DynamicSlidingWindowLayer

import kvslim
from kvslim.adapters.compat import CACHE_KW
from kvslim.attention import quant
from kvslim.caches import StoreSpec
from kvslim.caches.dense import AppendLayer
from kvslim.caches.fused import fused_of
from kvslim.caches.window import ResidualRingLayer, RingLayer, residual_ring_slots
from kvslim.evaluate import compare_caches

SPECS = {  # the int4 / int2 defaults' formats, scaled to short sequences (KIVI key groups of 8, window of 16)
    "int4": StoreSpec(4, 16, torch.float16, asymmetric=True, channel_group=8, residual=16, flush=8,
                      value_rotation="hadamard"),
    "int2": StoreSpec(3, 16, torch.float16, asymmetric=True, channel_group=8, residual=16, flush=8, value_bits=2,
                      value_rotation="hadamard"),
    "int8-r": StoreSpec(8, 16, torch.float32, residual=12, flush=4),
}
CALLS = [20, 1, 1, 30, 1, 1, 5] + [1] * 45 + [50] + [1] * 12 + [3, 64] + [1] * 9  # prefill, steps, chunks


@pytest.mark.parametrize("fmt", sorted(SPECS))
@pytest.mark.parametrize("window", [40, 12])  # W − 1 above and below the full-precision window
def test_ring_attends_hf_tokens_with_append_only_values(fmt, window):
    """Every call returns HF's token set (same length and mask sizes as HF's sliding layer, each token within the
    format's error of HF's), with exactly the values an append-only layer of the format gives for them."""
    spec = SPECS[fmt]
    ring, app, hf = ResidualRingLayer(window, spec), AppendLayer(spec), DynamicSlidingWindowLayer(window)
    g = torch.Generator().manual_seed(0)
    c = 0
    for s in CALLS:
        k, v = torch.randn(1, 2, s, 32, generator=g), torch.randn(1, 2, s, 32, generator=g)
        assert ring.get_mask_sizes(s) == hf.get_mask_sizes(s), c
        past = min(c, window - 1)
        before = [st.read(c - past, c).clone() for st in (app.k_store, app.v_store)] if c else None
        rk, rv = ring.update(k, v)
        ak, av = app.update(k, v)
        hk, hv = hf.update(k, v)
        assert rk.shape == hk.shape and rv.shape == hv.shape, (c, s)
        if s == 1:  # a decode step writes then reads: the append-only layer's values, sliced to the window
            assert torch.equal(rk, ak[:, :, c - past:]) and torch.equal(rv, av[:, :, c - past:]), c
        elif c:  # a chunk reads the past as stored before its write
            assert torch.equal(rk, torch.cat((before[0], k), 2)) and torch.equal(rv, torch.cat((before[1], v), 2))
        # each returned row is nearest to HF's row at the same index (quantization error ≪ distance of tokens)
        ours, theirs = torch.cat((rk, rv), -1).flatten(0, 1), torch.cat((hk, hv), -1).flatten(0, 1)
        nearest = torch.cdist(ours, theirs).argmin(-1)
        assert torch.equal(nearest, torch.arange(ours.shape[1]).expand_as(nearest)), (c, s)
        c += s
    assert ring.stored_tokens() == window - 1
    if window - 1 > spec.residual:  # bytes: fewer than the plain ring's W − 1 rows (else the plan picks that)
        assert ring.nbytes < 2 * 2 * (window - 1) * 32 * 4
    assert ring.k_store.inner.capacity == residual_ring_slots(window, spec)


@pytest.mark.parametrize("fmt", ["int4", "int2", "int8-r"])
@pytest.mark.parametrize("window", [40, 12])
def test_fused_ring_step_matches_unfused(fmt, window):
    """A decode step's codes through ``kvslim::quant_decode`` (or its twin) equal softmax attention over the
    layer's unfused reads, with HF-like masks (a masked column included); expired slots are never attended."""
    ring = ResidualRingLayer(window, SPECS[fmt])
    ring.fused_decode = True
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        ring.update(torch.randn(1, 2, 30, 32, generator=g), torch.randn(1, 2, 30, 32, generator=g))
        for step in range(70):
            k, v = torch.randn(1, 2, 1, 32, generator=g), torch.randn(1, 2, 1, 32, generator=g)
            h = fused_of(ring.update(k, v)[0])
            assert h is not None and h.tokens == min(30 + step, window - 1) + 1
            keys, _ = h.materialize()
            assert keys.shape[2] == h.tokens and torch.equal(keys[:, :, -1:], k)
            q = torch.randn(1, 4, 1, 32, generator=g)
            mask = None
            if step % 2:
                mask = torch.zeros(1, 1, 1, h.tokens)
                mask[..., step % h.tokens] = float("-inf")
            out = quant.decode(h, q, mask, None)
            assert out is not None
            torch.testing.assert_close(out, quant.reference(h, q, mask, None), atol=1e-5, rtol=1e-5)


def test_ring_crop_after_recording_equals_fresh():
    """Speculative decoding's rollback (``activate_past_recording`` + ``crop``) leaves the ring as a fresh one fed
    only the kept tokens."""
    spec, w = SPECS["int4"], 40
    g = torch.Generator().manual_seed(2)
    xs = [(torch.randn(1, 1, s, 32, generator=g), torch.randn(1, 1, s, 32, generator=g)) for s in [60, 1, 1, 5]]
    a, b = ResidualRingLayer(w, spec), ResidualRingLayer(w, spec)
    a.activate_past_recording()
    for k, v in xs[:3]:
        a.update(k, v)
    a.update(*xs[3])
    a.crop(-3)  # keep 2 of the 5 speculative tokens
    for k, v in xs[:3]:
        b.update(k, v)
    b.update(xs[3][0][:, :, :2], xs[3][1][:, :, :2])
    k, v = torch.randn(1, 1, 1, 32, generator=g), torch.randn(1, 1, 1, 32, generator=g)
    for x, y in zip(a.update(k, v), b.update(k, v)):
        assert torch.equal(x, y)


# -- a real transformers Gemma-3 built from a config --------------------------------------------------------------
W = 48


def gemma3(seed: int = 0) -> Gemma3ForCausalLM:
    """3 sliding layers (window 48) then a full one; MQA 4/1, head dim 32."""
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=W,
                           layer_types=["sliding_attention"] * 3 + ["full_attention"], query_pre_attn_scalar=32,
                           max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    return Gemma3ForCausalLM(cfg).eval()


OPTS = {"int8": {}, "int4": {"residual": 8, "key_channel_group": 8}}  # int4's format, window scaled to W


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_gemma3_quantized_sliding_layers(method, monkeypatch):
    m = gemma3()
    plan = kvslim.apply(m, method, **OPTS[method])
    try:
        assert [lp.window for lp in plan.layers] == [W, W, W, None]
        assert [lp.attention for lp in plan.layers] == ["sliding"] * 3 + ["full"]
        ring = RingLayer if method == "int8" else ResidualRingLayer
        cache = kvslim.make_cache(m)
        assert [type(layer) for layer in cache.layers] == [ring] * 3 + [AppendLayer]
        ids = torch.randint(2, 128, (1, 160), generator=torch.Generator().manual_seed(3))
        # teacher-forced: prefill 100 tokens, then 59 single-token steps through the fused kernel
        calls = []
        decode = quant.decode
        monkeypatch.setattr(quant, "decode", lambda *a: calls.append(1) or decode(*a))
        q = compare_caches(m, ids, {method: lambda: kvslim.make_cache(m)}, mode="token", steps=59,
                           reference=lambda: DynamicCache(config=m.config))[method]
        assert len(calls) >= 59 * 4  # every layer's decode steps ran on the codes
        assert q.max_dlogit <= LOSSY_LOGIT_ATOL[method], q
        # bytes from the tensors: the plan's, and below HF's own cache in fp16 (HF: W − 1 rows per sliding layer)
        hf = DynamicCache(config=m.config)
        with torch.no_grad():
            m(ids[:, :-1], **{CACHE_KW: hf}, use_cache=True)
        hf_fp32 = sum(t.numel() * t.element_size() for layer in hf.layers for t in (layer.keys, layer.values))
        assert q.nbytes == plan.cache_bytes(159) and plan.hf_bytes(159) == hf_fp32
        by = plan.bytes_by_attention(159)
        assert by["sliding"]["hf_bytes"] == 3 * (W - 1) * 2 * 32 * 4
        assert by["sliding"]["cache_bytes"] <= by["sliding"]["hf_bytes"] // 2  # ≤ HF's sliding layers in fp16
        assert q.nbytes <= hf_fp32 // 2
        assert "sliding layers (3)" in str(plan)
        # greedy: HF's tokens, or near-ties under HF's logits (the documented loss)
        with torch.no_grad():
            ref = m.generate(ids[:, :100], max_new_tokens=30, do_sample=False)
            out = m.generate(ids[:, :100], max_new_tokens=30, do_sample=False, **{CACHE_KW: kvslim.make_cache(m)})
            logits = m(out[:, :-1]).logits[0, 99:]
        chosen = out[0, 100:]
        gap = (logits.max(-1).values - logits.gather(-1, chosen[:, None])[:, 0]).max().item()
        assert gap <= 2 * LOSSY_LOGIT_ATOL[method], (gap, (out == ref).float().mean())
    finally:
        kvslim.restore(m)


def test_plan_residual_window_covers_the_sliding_window():
    """W − 1 ≤ residual: the sliding layers keep a plain ring (every visible token would be full precision)."""
    plan = kvslim.plan_config(gemma3().config, "int4", "float32")
    sliding = [lp for lp in plan.layers if lp.attention == "sliding"]
    assert all(lp.exactness == "exact" and lp.window == W for lp in sliding)  # 128-token default window > 47
    assert plan.bytes_by_attention(1000)["sliding"]["cache_bytes"] == 3 * (W - 1) * 2 * 32 * 4
