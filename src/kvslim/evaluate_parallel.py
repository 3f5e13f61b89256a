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

Ring-buffer layers (``RingLayer``, ``ResidualRingLayer``: sliding-window layers such as Gemma-3's, or
``window=W``) hold the same codes for the same positions; what differs is which tokens a call sees and when it
reads them:

* a call feeding ``[a, b)`` sees only the ring's last ``W − 1`` stored tokens and its own:
  keys ``s ≥ a − W + 1`` (and-ed with HF's mask, which on the model's own sliding layers already keeps only
  ``t − s < W``);
* a multi-token call reads the history *before* writing (the write may reuse slots), so ``F = flushed(a)``;
  a single-token call writes then reads, ``F = min(flushed(b), a)`` as an append-only layer;
* a plain coded ring (no residual window) keeps only the last ``W − 1`` tokens of a longer call: its first
  write (which fixes key smoothing) is the first call's last ``W − 1`` tokens;
* bytes: what the ring holds (``W − 1`` rows, or the residual window plus the ring's whole coded groups).

The only difference from the call-by-call run is float rounding (a batched matmul instead of T small ones):
``tests/test_evaluate_parallel.py`` checks both against each other. HF ``QuantizedCache`` (quanto) re-quantizes
its history and is measured call by call.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from .caches.dense import AppendLayer
from .caches.spec import StoreSpec
from .caches.stores import make_store
from .caches.window import ResidualRingLayer, RingLayer, residual_ring_slots
from .evaluate import Quality, check_protocol_ids, protocol_segments

NAME = "kvslim_protocol_sim"


class LayerSpec(NamedTuple):
    """One layer's cache for the one-pass protocol: key and value specs, and the window W of a ring-buffer layer
    (``None``: append-only). A plain ``(key, value)`` pair is an append-only layer."""

    key: StoreSpec
    value: StoreSpec
    window: int | None = None

    @property
    def ring_slots(self) -> int | None:
        """Coded slots of a ring with a residual window (``ResidualRingLayer``), else ``None``."""
        if self.window is None or not (self.key.bits and self.key.residual):
            return None
        return residual_ring_slots(self.window, self.key)


LayerSpecs = Sequence[LayerSpec | tuple[StoreSpec, StoreSpec]]  # per layer


def layer_specs_of(plan) -> list[LayerSpec]:
    """Per-layer specs of a storage-method plan (``kvslim.plan``): append-only layers and ring-buffer layers
    (``RingLayer``, ``ResidualRingLayer``); ``ValueError`` for any other layer."""
    out = []
    for lp in plan.layers:
        layer = lp.factory(None)
        if isinstance(layer, (RingLayer, ResidualRingLayer)):
            out.append(LayerSpec(layer.spec, layer.value_spec(), layer.window))
        elif type(layer) is AppendLayer and not lp.window:
            out.append(LayerSpec(layer.spec, layer.value_spec()))
        else:
            raise ValueError(f"layer {lp.index} is neither an append-only store layer nor a ring buffer "
                             f"({type(layer).__name__}); the one-pass protocol covers those only")
    return out


def _checked(specs: LayerSpecs, layers: int) -> list[LayerSpec]:
    """``specs`` as one :class:`LayerSpec` per layer; ``ValueError`` naming ``specs`` otherwise."""
    if len(specs) != layers:
        raise ValueError(f"specs must give one (key, value) spec per layer ({layers}), got {len(specs)}")
    out = [LayerSpec(*s) for s in specs]
    for i, ls in enumerate(out):
        if ls.window is not None and (not isinstance(ls.window, int) or ls.window <= 0):
            raise ValueError(f"specs: layer {i} window must be a positive int, got {ls.window!r}")
        if ls.window is not None and (ls.key.sink or ls.value.sink):
            raise ValueError(f"specs: layer {i} is a ring (window={ls.window}) with sink tokens; a ring keeps "
                             "no sinks (its first tokens leave the window like any other)")
    return out


class _Run:
    """What the attention hook needs during one forward: specs, call boundaries, and the stores it built."""

    def __init__(self, specs: LayerSpecs | None, segments: list[tuple[int, int]], total: int):
        self.specs = None if specs is None else [LayerSpec(*s) for s in specs]
        self.segments, self.total = segments, total
        starts = torch.empty(total, dtype=torch.long)
        ends = torch.empty(total, dtype=torch.long)
        for a, b in segments:
            starts[a:b], ends[a:b] = a, b
        self.starts, self.ends = starts, ends
        self.stores: dict[int, list] = {}

    def decoded(self, layer: int, which: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows as a later call reads them (B, H, T, D), first-decoded index per query F (T,))."""
        ls = self.specs[layer]
        spec = ls[which]
        t = x.shape[2]
        store = make_store(spec, x, -(-t // 256) * 256)
        a0, b0 = self.segments[0]
        lo, head = 0, b0  # the first write (it fixes key smoothing) is tokens [lo, head)
        if ls.window is not None and spec.bits and not spec.residual:
            # a plain ring keeps the first call's last W − 1 tokens, written from slot lo mod (W − 1) to the
            # ring's end, then the rest from slot 0 (RingLayer._write)
            r = ls.window - 1
            lo = max(0, b0 - r)
            head = lo + min(b0 - lo, r - lo % r) if r else b0
        for a, b in ((lo, head), (head, b0), (b0, t)):
            if a < b:
                store.write(a, x[:, :, a:b])
        self.stores.setdefault(layer, []).append(store)
        out = x.clone()
        if not spec.bits:
            return out, torch.zeros(t, dtype=torch.long)
        coded = getattr(store, "flushed", t)  # tokens before the residual window (sinks, if any, read as kept)
        if coded > lo:  # rows before lo are never visible decoded (older than any later call's window)
            out[:, :, lo:coded] = store.read(lo, coded).to(x.dtype)
        flushed = torch.tensor([spec.flushed(int(e)) for e in self.ends.tolist()], dtype=torch.long)
        if ls.window is not None:  # a ring's multi-token call reads the history before its write
            before = torch.tensor([spec.flushed(int(a)) for a in self.starts.tolist()], dtype=torch.long)
            flushed = torch.where(self.ends - self.starts > 1, before, flushed)
        return out, torch.minimum(flushed, self.starts)

    def window_mask(self, layer: int) -> torch.Tensor | None:
        """(T, T) bool, key s visible to query t through a ring layer (``s ≥ start(t) − W + 1``), or ``None``."""
        w = self.specs[layer].window
        if w is None:
            return None
        return torch.arange(self.total)[None, :] >= (self.starts - (w - 1))[:, None]

    def nbytes(self) -> int:
        """Bytes the cache holds after all tokens: append-only stores whole, rings what they keep."""
        total = 0
        for layer, stores in self.stores.items():
            ls = self.specs[layer]
            for s in stores:
                if ls.window is None:
                    total += s.nbytes(self.total)
                elif ls.ring_slots is None:  # a plain ring: the last W − 1 rows
                    total += s.nbytes(min(self.total, ls.window - 1))
                else:  # the residual window, then the ring's coded slots in use
                    fp = s.nbytes(self.total) - s.inner.nbytes(s.flushed)
                    total += fp + s.inner.nbytes(min(s.flushed, ls.ring_slots))
        return total


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
    ring = run.window_mask(layer)
    base = (base if ring is None else base & ring).expand(b, 1, t, t)
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


def check_block(block: int) -> None:
    """``ValueError`` naming ``block`` unless it is a positive int."""
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")


def score_positions(model, ref_hidden: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                    targets: torch.Tensor, block: int = 256
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Per scored position (``positions`` (N,) of the final hidden states, ``targets`` (N,) the tokens they
    predict), ``block`` positions per LM-head batch: ``(nll, ref_nll, kl, top1, max |Δlogit|)``, the first three
    (N,) float64 (KL(reference ‖ cache), nats), ``top1`` (N,) bool (argmax equals the reference's)."""
    n = len(positions)
    nll, ref_nll, kl = (torch.zeros(n, dtype=torch.float64) for _ in range(3))
    top1 = torch.zeros(n, dtype=torch.bool)
    maxd = 0.0
    for a in range(0, n, block):
        pos = positions[a:a + block]
        ref, out = _logits(model, ref_hidden[pos]), _logits(model, hidden[pos])
        tgt = targets[a:a + block, None]
        ref_lp, lp = torch.log_softmax(ref, -1), torch.log_softmax(out, -1)
        ref_nll[a:a + block] = -ref_lp.gather(-1, tgt)[:, 0].double()
        nll[a:a + block] = -lp.gather(-1, tgt)[:, 0].double()
        kl[a:a + block] = (ref_lp.exp() * (ref_lp - lp)).sum(-1).double()
        top1[a:a + block] = out.argmax(-1) == ref.argmax(-1)
        maxd = max(maxd, (out - ref).abs().max().item())
    return nll, ref_nll, kl, top1, maxd


@torch.inference_mode()
def protocol_hidden(model, ids: torch.Tensor, specs: LayerSpecs | None, segments: list[tuple[int, int]]
                    ) -> tuple[torch.Tensor, int]:
    """Final hidden states (T, d) of ``ids`` (1, T) as a cache with per-layer ``specs`` would give them under
    the protocol's calls ``segments``, and the bytes that cache would hold. ``specs=None``: the dense model
    (plain attention, no hook)."""
    total = ids.shape[1]
    if specs is None:
        return model.model(ids, use_cache=False).last_hidden_state[0], 0
    run = _Run(_checked(specs, model.config.num_hidden_layers), segments, total)
    with _protocol_attention(model, run):
        hidden = model.model(ids, use_cache=False).last_hidden_state[0]
    return hidden, run.nbytes()


@torch.inference_mode()
def compare_specs(model, ids: torch.Tensor, specs: dict[str, LayerSpecs], *, mode: str = "token",
                  min_tokens: int | None = None, prefill: int = 512, chunk: int = 64, steps: int = 1024,
                  block: int = 256) -> dict[str, Quality]:
    """:func:`kvslim.evaluate.compare_caches` for append-only and ring-buffer caches given by per-layer specs,
    each in one forward pass (see the module docstring); same protocol, same metrics, reference = the dense
    model. ``block``: scored positions per logits batch (a positive int)."""
    check_block(block)
    total = check_protocol_ids(ids, min_tokens)
    if not specs:
        raise ValueError("specs must name at least one configuration")
    for layer_specs in specs.values():
        _checked(layer_specs, model.config.num_hidden_layers)
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
        nll, ref_nll, kl, top1, maxd = score_positions(model, ref_hidden, hidden, positions, targets, block)
        n = len(positions)
        results[label] = Quality(label, mode, fed, n, math.exp(nll.mean().item()), math.exp(ref_nll.mean().item()),
                                 kl.mean().item(), top1.double().mean().item(), maxd, nbytes,
                                 seconds + ref_s / len(specs))
    return results
