"""The quality protocol in one forward pass: what a quantized cache would give, without feeding it call by call.

:func:`kvslim.evaluate.compare_caches` runs a protocol call by call (token mode: 1,024 single-token calls, each
decoding the whole stored history). The result depends only on *which version* of each stored key/value a
query sees, and that is known in advance for an append-only cache (``AppendLayer``):

* a token's key/value rows are computed once, by the call that feeds it, and quantized once (a whole group at
  a time for KIVI keys, when the residual window flushes it); from then on every later call reads the same
  decoded rows;
* the call feeding tokens ``[a, b)`` attends to its own rows in full precision, to history tokens
  ``[0, F)`` decoded from codes and to ``[F, a)`` in full precision (the residual window), where
  ``F = min(spec.flushed(b), a)``.

So one forward pass over the whole text reproduces the protocol: at every layer, queries attend to a key set of
length 2T (the decoded rows, then the full-precision rows) under a mask that picks, for query ``t`` and key
``s``, the decoded row when ``s < F(t)`` and the full-precision one otherwise. The decoded rows come from the
library's own stores (``make_store``: the same code quantizes them), written call by call's first segment
then the rest (key smoothing is fitted on the first call, as in the protocol).

The only difference from the call-by-call run is float rounding (a batched matmul instead of T small ones):
``tests/test_evaluate_parallel.py`` checks both against each other. Append-only layers only (no ring buffers);
HF ``QuantizedCache`` (quanto) re-quantizes its history and is measured call by call.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from .caches.storage import StoreSpec, make_store
from .evaluate import Quality, check_protocol_ids, protocol_segments

NAME = "kvslim_protocol_sim"
LayerSpecs = Sequence[tuple[StoreSpec, StoreSpec]]  # per layer: (key spec, value spec)


def layer_specs_of(plan) -> list[tuple[StoreSpec, StoreSpec]]:
    """Per-layer (key, value) specs of a storage-method plan (``kvslim.plan``); ``ValueError`` for ring layers."""
    out = []
    for lp in plan.layers:
        layer = lp.factory(None)
        if not hasattr(layer, "value_spec") or getattr(layer, "window", None) is not None or lp.window:
            raise ValueError(f"layer {lp.index} is not an append-only store layer ({type(layer).__name__}); "
                             "the one-pass protocol covers append-only caches only")
        out.append((layer.spec, layer.value_spec()))
    return out


class _Run:
    """What the attention hook needs during one forward: specs, call boundaries, and the stores it built."""

    def __init__(self, specs: LayerSpecs | None, segments: list[tuple[int, int]], total: int):
        self.specs, self.segments, self.total = specs, segments, total
        starts = torch.empty(total, dtype=torch.long)
        ends = torch.empty(total, dtype=torch.long)
        for a, b in segments:
            starts[a:b], ends[a:b] = a, b
        self.starts, self.ends = starts, ends
        self.stores: dict[int, list] = {}

    def decoded(self, layer: int, which: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows as a later call reads them (B, H, T, D), first-decoded index per query F (T,))."""
        spec = self.specs[layer][which]
        t = x.shape[2]
        store = make_store(spec, x, -(-t // 256) * 256)
        a0, b0 = self.segments[0]
        store.write(0, x[:, :, :b0])
        if t > b0:
            store.write(b0, x[:, :, b0:])
        self.stores.setdefault(layer, []).append(store)
        out = x.clone()
        if not spec.bits:
            return out, torch.zeros(t, dtype=torch.long)
        coded = getattr(store, "flushed", t)  # tokens before the residual window (sinks, if any, read as kept)
        if coded:
            out[:, :, :coded] = store.read(0, coded).to(x.dtype)
        flushed = torch.tensor([spec.flushed(int(e)) for e in self.ends.tolist()], dtype=torch.long)
        return out, torch.minimum(flushed, self.starts)

    def nbytes(self) -> int:
        return sum(s.nbytes(self.total) for stores in self.stores.values() for s in stores)


_ACTIVE: list[_Run] = []


def _attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of a whole text as the protocol's calls would see it. query (B, H, T, D), key/value
    (B, Hkv, T, D); ``attention_mask`` HF's boolean (B, 1, T, T) (sliding windows included) or None (causal).
    Returns (B, T, H, D)."""
    run = _ACTIVE[-1]
    if kwargs.get("softcap") is not None:
        raise ValueError("the one-pass protocol does not support attention logit soft-capping")
    b, h, t, d = query.shape
    if key.shape[2] != t:
        raise ValueError("the one-pass protocol runs the whole text in one call without a cache")
    layer = module.layer_idx
    kd, fk = run.decoded(layer, 0, key)
    vd, fv = run.decoded(layer, 1, value)
    if not torch.equal(fk, fv):
        raise ValueError("keys and values of one layer must flush at the same tokens")
    base = torch.ones(t, t, dtype=torch.bool).tril() if attention_mask is None else attention_mask.bool()
    base = base.expand(b, 1, t, t)
    s = torch.arange(t)
    use_decoded = s[None, :] < fk[:, None]  # (T, T): query t reads key s decoded
    groups = h // key.shape[1]
    out = torch.empty(b, h, t, value.shape[-1], dtype=query.dtype)
    block = 512
    for a in range(0, t, block):
        e = min(t, a + block)
        m = base[:, :, a:e, :e]
        ud = use_decoded[a:e, :e]
        mask = torch.cat((m & ud, m & ~ud), dim=-1)  # (B, 1, rows, 2·e)
        k2 = torch.cat((kd[:, :, :e], key[:, :, :e]), dim=2).repeat_interleave(groups, dim=1)
        v2 = torch.cat((vd[:, :, :e], value[:, :, :e]), dim=2).repeat_interleave(groups, dim=1)
        out[:, :, a:e] = F.scaled_dot_product_attention(query[:, :, a:e], k2, v2, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


@contextmanager
def _protocol_attention(model, run: _Run):
    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    _ACTIVE.append(run)
    try:
        yield
    finally:
        _ACTIVE.pop()
        model.set_attn_implementation(previous)


def _logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head on hidden states (N, d) -> fp32 logits (N, V), with the model's final soft-capping."""
    logits = model.lm_head(hidden).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


@torch.inference_mode()
def protocol_hidden(model, ids: torch.Tensor, specs: LayerSpecs | None, segments: list[tuple[int, int]]
                    ) -> tuple[torch.Tensor, int]:
    """Final hidden states (T, d) of ``ids`` (1, T) as a cache with per-layer ``specs`` would give them under
    the protocol's calls ``segments``, and the bytes that cache would hold. ``specs=None``: the dense model
    (plain attention, no hook)."""
    total = ids.shape[1]
    if specs is None:
        return model.model(ids, use_cache=False).last_hidden_state[0], 0
    if len(specs) != model.config.num_hidden_layers:
        raise ValueError(f"specs must give one (key, value) spec per layer ({model.config.num_hidden_layers}), "
                         f"got {len(specs)}")
    run = _Run(specs, segments, total)
    with _protocol_attention(model, run):
        hidden = model.model(ids, use_cache=False).last_hidden_state[0]
    return hidden, run.nbytes()


@torch.inference_mode()
def compare_specs(model, ids: torch.Tensor, specs: dict[str, LayerSpecs], *, mode: str = "token",
                  min_tokens: int | None = None, prefill: int = 512, chunk: int = 64, steps: int = 1024,
                  block: int = 256) -> dict[str, Quality]:
    """:func:`kvslim.evaluate.compare_caches` for append-only caches given by per-layer specs, each in one
    forward pass (see the module docstring); same protocol, same metrics, reference = the dense model."""
    total = check_protocol_ids(ids, min_tokens)
    if not specs:
        raise ValueError("specs must name at least one configuration")
    segments, first = protocol_segments(total, mode, prefill, chunk, steps)
    fed = segments[-1][1]  # token mode: the last text token is only a target
    positions = torch.arange(first - 1, min(fed, total - 1))  # position p predicts token p + 1
    targets = ids[0, positions + 1]
    ids = ids[:, :fed]
    t0 = time.perf_counter()
    ref_hidden, _ = protocol_hidden(model, ids, None, segments)
    ref_s = time.perf_counter() - t0
    results = {}
    for label, layer_specs in specs.items():
        t1 = time.perf_counter()
        hidden, nbytes = protocol_hidden(model, ids, layer_specs, segments)
        seconds = time.perf_counter() - t1
        nll = ref_nll = kl = maxd = 0.0
        top1 = 0
        for a in range(0, len(positions), block):
            pos = positions[a:a + block]
            ref = _logits(model, ref_hidden[pos])
            out = _logits(model, hidden[pos])
            tgt = targets[a:a + block, None]
            ref_lp, lp = torch.log_softmax(ref, -1), torch.log_softmax(out, -1)
            ref_nll -= ref_lp.gather(-1, tgt).sum().item()
            nll -= lp.gather(-1, tgt).sum().item()
            kl += (ref_lp.exp() * (ref_lp - lp)).sum().item()
            top1 += int((out.argmax(-1) == ref.argmax(-1)).sum())
            maxd = max(maxd, (out - ref).abs().max().item())
        n = len(positions)
        results[label] = Quality(label, mode, fed, n, math.exp(nll / n), math.exp(ref_nll / n), kl / n, top1 / n,
                                 maxd, nbytes, seconds + ref_s / len(specs))
    return results
