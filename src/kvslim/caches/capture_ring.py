"""Sliding-window ring layers in a layout that CUDA graphs capture (issue 33; ``kvslim.make_cache(model,
max_length=N, capturable=True)`` on a model that runs kvslim's attention, ``adapters/sdpa.py``).

The eager ring (``caches/window.RingLayer``) keeps W − 1 slots and hands attention the visible tokens in temporal
order, with HF's mask sized to them (``get_mask_sizes`` → (visible, offset)): each step a new key length and a new
``kv_offset``, on which HF's padding mask branches in Python. The capturable ring keeps **W** slots (position p in
slot p mod W: the step's own token is written first, then the whole ring is read) and the length on the device:

* a decode step writes its token at slot ``length mod W`` (``index_copy_``) and returns all W slots (quantized: the
  decoded history, the step's own token exactly, as the eager ring);
* ``get_mask_sizes`` is ``(max_length, 0)`` for a decode step, as a full layer's: HF builds its mask over absolute
  positions ``[0, max_length)`` (its sliding-window rule included, ``kv_offset`` a constant 0);
* the returned keys carry the position each slot holds (:func:`ring_columns`: ``P − ((P − i) mod W)`` for slot i at
  position P, −1 for a slot not yet written); kvslim's attention gathers HF's mask at those columns, so the W rows
  are masked exactly as the eager ring's visible tokens (padding included).

Shapes and control flow never depend on the length. A multi-token update (a prefill) runs eagerly on host integers in
the same layout and returns, like the eager ring, the visible past then its own tokens (HF's mask sized as the eager
ring's for it). Past ``max_length`` (the mask has no column for it): as every capturable layer (``caches/capture.py``).
Formats: plain and per-token quantized rings (``window``; a model's own sliding window with ``dense``/``int8``);
rings with a full-precision residual window (``ResidualRingLayer``, the int4/int2 defaults on sliding layers) and
turbo codes are not covered. Costs against the eager ring: one slot more, and the mask gathered per layer per step.
"""

from __future__ import annotations

import torch

from .capture import graph_step, init_static_state, overflow_error
from .storage import QuantizedStore

ATTR = "_kvslim_ring_columns"


class RingColumns:
    """What a capturable ring's keys carry: (W,) int64 on the device, the absolute position of every slot."""

    def __init__(self, columns: torch.Tensor):
        self.columns = columns


def ring_columns(key: torch.Tensor) -> torch.Tensor | None:
    held = getattr(key, ATTR, None)
    return None if held is None else held.columns


def ring_mask(mask: torch.Tensor | None, columns: torch.Tensor, q_len: int) -> torch.Tensor:
    """HF's mask over absolute positions (B|1, 1, q, ≥ max position + 1; bool or additive) gathered at ``columns``
    (W,), a slot not yet written (−1) masked: (B|1, 1, q, W), same kind as ``mask``."""
    hidden = columns < 0
    if mask is None:
        out = torch.zeros(1, 1, q_len, columns.shape[0], device=columns.device)
        return out.masked_fill(hidden, torch.finfo(torch.float32).min)
    got = mask.index_select(-1, columns.clamp(min=0))
    if got.dtype == torch.bool:
        return got & ~hidden
    return got.masked_fill(hidden, torch.finfo(got.dtype).min)


def supported(layer) -> bool:
    sp = layer.spec
    return (layer.max_length is not None and layer.column_attention and layer.window > 1
            and not (sp.residual or sp.channel_group or sp.sink) and sp.codec == "int")


class StaticRingMixin:
    """The capturable layout of :class:`~kvslim.caches.window.RingLayer` (module docstring)."""

    capturable = False
    max_length: int | None = None
    #: the model runs kvslim's attention, which reads :func:`ring_columns` (set by ``build_cache``)
    column_attention = False
    length_t: torch.Tensor | None = None
    overflow: torch.Tensor | None = None

    def can_capture(self) -> bool:
        return supported(self)

    def _static_format(self) -> bool:
        return self.capturable and supported(self) and (not self.is_initialized or self.length_t is not None)

    @property
    def is_compileable(self) -> bool:
        return self._static_format()

    def _init_static(self) -> None:
        init_static_state(self)
        self.refused = False

    def _sync_host(self) -> None:
        if getattr(self, "host_stale", False):
            self.cumulative_length = int(self.length_t[0])
            self.host_stale = False
            self.refused = bool(self.overflow)
        if getattr(self, "refused", False):
            raise overflow_error(self.max_length)

    def raise_overflow(self) -> None:
        if self.overflow is not None and bool(self.overflow):
            raise overflow_error(self.max_length)

    def _static_ring_update(self, key_states: torch.Tensor, value_states: torch.Tensor):
        s, w = key_states.shape[2], self.window
        in_graph = graph_step()
        if in_graph and s > 1:
            raise ValueError(f"key_states hold {s} tokens: a compiled or captured step of a capturable ring layer "
                             "takes one token per sequence; run multi-token updates (a prefill) eagerly")
        if not in_graph:
            self._sync_host()
            c = self.cumulative_length
            if c + s > self.max_length:
                raise ValueError(f"max_length={self.max_length}: this capturable cache holds {c} tokens and "
                                 f"cannot take {s} more (nothing written); build it with a larger max_length")
        if s > 1:
            return self._static_prefill(c, key_states, value_states)
        n = self.length_t[:1].clone()  # (1,): this token's position
        keep = None
        if in_graph:
            ok = n < self.max_length
            keep = ~ok
            self.length_t.add_(ok.to(torch.int64))
            self.overflow.logical_or_(keep[0])
            self.host_stale = True
        else:
            self.cumulative_length = c + 1
            self.length_t.fill_(c + 1)
        slot = n.remainder(w)
        out = []
        for store, x in ((self.k_store, key_states), (self.v_store, value_states)):
            store.write_at(slot, x, keep)
            full = store.read(0, w)
            out.append(full.index_copy(2, slot, x.to(full.dtype)) if store.spec.bits else full)
        last = n.clamp(max=self.max_length - 1)  # a refused step: the columns of the full buffer (output void)
        i = torch.arange(w, device=n.device)
        cols = last - (last - i).remainder(w)
        cols = torch.where(cols >= 0, cols, torch.full_like(cols, -1))
        k = out[0][:, :, :w]  # a new tensor object: the columns ride on it
        setattr(k, ATTR, RingColumns(cols))
        return k, out[1]

    def _static_prefill(self, c: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """Eager multi-token call at position ``c``: the visible past (last min(c, W − 1) tokens) in temporal order,
        then the call's tokens as given; the last W of them written into their slots."""
        s, w, dev = key_states.shape[2], self.window, key_states.device
        past = min(c, w - 1)
        hist = torch.arange(c - past, c, device=dev).remainder(w)
        first = max(c, c + s - w)
        pos = torch.arange(first, c + s, device=dev)
        out = []
        for store, x in ((self.k_store, key_states), (self.v_store, value_states)):
            seen = store.read(0, w).index_select(2, hist).to(x.dtype) if past else None
            if isinstance(store, QuantizedStore) and store.spec.smooth and store.channel is None:
                store._channel_for(self._eager_first_write(c, x))  # the eager ring's smoothing factors
            store.write_at(pos.remainder(w), x[:, :, first - c:])
            out.append(x if seen is None else torch.cat((seen, x), dim=2))
        self.cumulative_length = c + s
        self.length_t.fill_(c + s)
        return out[0], out[1]

    def _eager_first_write(self, c: int, x: torch.Tensor) -> torch.Tensor:
        """The tokens of ``x`` (written at ``c``) that the eager ring's first store write takes (its W − 1 slots,
        split at the ring's end): smoothed keys fit their factors on them, so the codes equal the eager ring's."""
        r, s = self.window - 1, x.shape[2]
        first = max(c, c + s - r)
        head = min(c + s - first, r - first % r)
        return x[:, :, first - c:first - c + head]

    def _static_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if query_length == 1 or graph_step():
            return self.max_length, 0
        self._sync_host()
        c = self.cumulative_length
        past = min(c, self.window - 1)
        return past + query_length, c - past
