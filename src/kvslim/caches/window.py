"""Ring-buffer cache layer for sliding-window attention (SPEC §2).

Stores: the last W − 1 tokens only (token at position t in slot t mod (W − 1)), as HF's
``DynamicSlidingWindowLayer``: a query at position t sees positions t−W+1 … t, and its own token is handed to
attention as given, so W − 1 stored rows suffice. Memory is flat after W − 1 tokens however long generation runs.
Exact against full-cache attention under the sliding-window mask (plain storage).
"""

from __future__ import annotations

import functools

import torch

from . import fused
from .base import KVStoreLayer, check_crop
from .capture import graph_step, reset_static_state
from .capture_ring import StaticRingMixin
from .spec import StoreSpec


class RingLayer(StaticRingMixin, KVStoreLayer):
    """Capacity ``window - 1`` slots; O(1) writes; reads return the visible tokens in temporal order. With
    ``max_length`` and ``capturable`` (on a model running kvslim's attention): the layout of
    ``caches/capture_ring.py`` (W slots, device length, whole-ring reads with their mask columns)."""

    is_sliding = True
    is_croppable = True

    def __init__(self, window: int, spec: StoreSpec | None = None, *, max_length: int | None = None):
        super().__init__(spec)
        if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
            raise ValueError(f"window must be a positive int, got {window!r}")
        if max_length is not None and (not isinstance(max_length, int) or isinstance(max_length, bool)
                                       or max_length <= 0):
            raise ValueError(f"max_length must be a positive int or None, got {max_length!r}")
        self.window, self.max_length = window, max_length
        #: stored slots: the W − 1 most recent tokens (a window of 1 stores nothing)
        self.slots = window - 1
        #: no sequence has padding: a full decode step may hand attention the ring in slot order (the current
        #: token last), saving the temporal reorder of quantized reads, see ``update``
        self.slot_order_ok = False
        #: HF's ``activate_past_recording``: remember the ring before each step, and the step's tokens, until
        #: the next ``crop`` (which can then take speculative tokens back exactly)
        self.record_past = False
        self._snapshot: tuple[int, list[object] | None] | None = None  # (length, store snapshots)
        self._log: list[tuple[torch.Tensor, torch.Tensor]] = []  # key/value states written since the snapshot

    def activate_past_recording(self) -> None:
        """HF's hook before speculative decoding (assisted decoding, prompt lookup): from now on each step can be
        rolled back by :meth:`crop`. Costs one copy of the ring per step while recording."""
        self.record_past = True

    def _remember(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if not self.record_past:
            return
        if self._snapshot is None:
            tensors = [st.snapshot() for st in self._stores()] if self.is_initialized else None
            self._snapshot = (self.cumulative_length, tensors)
        self._log.append((key_states, value_states))

    def crop(self, tokens_to_remove: int) -> None:
        """HF semantics (``DynamicSlidingWindowLayer.crop``): ``-n`` removes the last n tokens, 0 removes nothing,
        a positive value raises ``ValueError``. Taking back tokens whose window has left the ring needs
        :meth:`activate_past_recording` first (``RuntimeError`` otherwise, as HF). Ends the recorded step."""
        check_crop(tokens_to_remove)
        if tokens_to_remove and self.length_t is not None:
            raise ValueError(f"tokens_to_remove={tokens_to_remove}: a capturable ring layer (caches/capture_ring.py) "
                             "cannot rewind; build the cache without capturable=True")
        c, target = self.cumulative_length, max(0, self.cumulative_length + tokens_to_remove)
        if target < c:
            if self._snapshot is None:
                r = self.slots  # the next step after the crop needs positions >= target - r; the ring has >= c - r
                if max(0, target - r) < max(0, c - r):
                    raise RuntimeError("`crop` was called, but this ring-buffer layer does not track past states "
                                       "and its window is full. Call `activate_past_recording` before `crop` to be "
                                       "able to roll the cache back.")
                self.cumulative_length = target
            else:
                self._replay(target)
        self._snapshot, self._log = None, []

    def _replay(self, target: int) -> None:
        """Put the ring back as it was before the recorded step, then write the recorded tokens up to ``target``."""
        length, tensors = self._snapshot
        if target < length:
            raise RuntimeError(f"crop to {target} tokens reaches before the recorded step (which began at {length})")
        if tensors is None:
            for st in self._stores():
                st.reset()
        else:
            for st, saved in zip(self._stores(), tensors):
                st.restore(saved)
        pos = self.cumulative_length = length
        for k, v in self._log:
            keep = min(k.shape[2], target - pos)
            if keep <= 0:
                break
            self._write(pos, k[:, :, :keep], self.k_store)
            self._write(pos, v[:, :, :keep], self.v_store)
            pos += keep
        self.cumulative_length = pos

    def reset(self) -> None:
        super().reset()
        self._snapshot, self._log = None, []
        self.host_stale = self.refused = False
        reset_static_state(self)

    def _map_batch(self, fn) -> None:
        super()._map_batch(fn)
        if self.length_t is not None:
            self.length_t = fn(self.length_t)

    def _initial_capacity(self, incoming: int) -> int:
        if self._static_format():
            return self.window  # caches/capture_ring.py: the step's own token has a slot too
        return max(1, self.slots)  # a window of 1 keeps one idle slot (stored_tokens stays 0)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        static = self._static_format()
        super().lazy_initialization(key_states, value_states)
        if static:
            self._init_static()

    def _pieces(self, store, first: int, last: int) -> list[torch.Tensor]:
        """Positions [first, last) (all still in the ring) in temporal order: one or two (B, H, n, D) reads."""
        r = self.slots
        if last - first <= 0:
            return [store.read(0, 0)]
        a, b = first % r, (last - 1) % r + 1
        if a < b:
            return [store.read(a, b)]
        return [store.read(a, r), store.read(0, b)]

    def _read_temporal(self, store, first: int, last: int) -> torch.Tensor:
        """Positions [first, last) (all still in the ring) in temporal order, (B, H, last-first, D)."""
        pieces = self._pieces(store, first, last)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)

    def _visible(self, store, c: int, states: torch.Tensor) -> torch.Tensor:
        """What a call at positions [c, c+S) attends: the last min(c, W−1) stored tokens, then ``states`` as
        given (B, H, min(c, W−1) + S, D), one copy. Must run before the call's tokens are written."""
        past = min(c, self.slots)
        if past == 0:
            return states
        if self.slot_order_ok and past == self.slots and states.shape[2] == 1 and self.spec.bits:
            pieces = [store.read(0, past)]  # slot order: one dequantization, no reorder (nothing is masked)
        else:
            pieces = self._pieces(store, c - past, c)
        return torch.cat(pieces + [states], dim=2)

    def _fused_reads(self, c: int, evicted: tuple[torch.Tensor, torch.Tensor] | None, key_states: torch.Tensor,
                     value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The unfused result of a decode step at position ``c`` (already written): the visible history in temporal
        order (``evicted``: position c−W+1, read before the step's token took its slot), then the token as given."""
        first = max(0, c - self.slots)
        out = []
        for store, now, j in ((self.k_store, key_states, 0), (self.v_store, value_states, 1)):
            head = [] if evicted is None else [evicted[j]]
            out.append(torch.cat(head + self._pieces(store, first + len(head), c) + [now], dim=2))
        return out[0], out[1]

    def _write(self, first: int, x: torch.Tensor, store) -> None:
        """Write tokens at positions [first, first+S) into their slots (only the last W − 1 survive)."""
        r, s = self.slots, x.shape[2]
        if r == 0:
            return
        if s > r:
            x, first = x[:, :, s - r:], first + s - r
            s = r
        a = first % r
        head = min(s, r - a)
        store.write(a, x[:, :, :head])
        if head < s:
            store.write(0, x[:, :, head:])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self._check_update(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._static_format():
            return self._static_ring_update(key_states, value_states)
        c, s, r = self.cumulative_length, key_states.shape[2], self.slots
        self._remember(key_states, value_states)
        if s == 1 and r and self._fused_step(key_states):  # attention reads the codes (caches/fused.py)
            evicted = None
            if c >= r:  # the slot about to be taken holds position c−W+1, still visible to this step
                slot = c % r
                evicted = (self.k_store.read(slot, slot + 1), self.v_store.read(slot, slot + 1))
            self._write(c, key_states, self.k_store)
            self._write(c, value_states, self.v_store)
            self.cumulative_length = c + 1
            reads = functools.partial(self._fused_reads, c, evicted, key_states, value_states)
            return fused.markers(fused.ring_handle(self.k_store, self.v_store, c + 1, r, key_states, value_states,
                                                   reads, evicted), key_states)
        return self._read_then_write(c, key_states, value_states)

    def _read_then_write(self, c: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """The visible past (last min(c, W−1) stored tokens) plus the call's own tokens as given (quantized
        storage: they are attended in full precision), read before the write can take the oldest slots."""
        keys = self._visible(self.k_store, c, key_states)
        values = self._visible(self.v_store, c, value_states)
        self._write(c, key_states, self.k_store)
        self._write(c, value_states, self.v_store)
        self.cumulative_length = c + key_states.shape[2]
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self._static_format():
            return self._static_mask_sizes(query_length)
        c = self.cumulative_length
        past = min(c, self.slots)
        return past + query_length, c - past

    def get_seq_length(self):
        if self.length_t is not None:
            if graph_step():
                return self.length_t[0]  # a 0-dim device tensor (HF's StaticLayer does the same)
            self._sync_host()
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.window

    def file_slots(self) -> int | None:
        """Leading ring slots that hold data (``caches/state.py``): a ring not yet full has filled slots [0, n);
        ``None`` (all) for a capturable ring (``caches/capture_ring.py``) or a residual ring's own layout."""
        if not self.is_initialized or self.length_t is not None or self.spec.residual:
            return None
        return min(self.cumulative_length, self.k_store.capacity)

    def stored_tokens(self) -> int:
        if self.length_t is not None:
            self._sync_host()
            return min(self.cumulative_length, self.window)
        return min(self.cumulative_length, self.slots)


def residual_ring_slots(window: int, spec: StoreSpec) -> int:
    """Coded ring slots of a :class:`ResidualRingLayer`: enough whole flush groups that every position a step can
    attend (the last ``window`` tokens, the step's own included) is still held after the step's write.

    After n tokens the full-precision window holds n − f of them, with f = ``spec.flushed(n)`` and
    n − f ≥ R − F + 1 once anything is coded (R = ``spec.residual``, F = ``spec.flush``); the coded tokens still
    needed, [n − W, f) rounded down to a group, are at most W − (R − F + 1) + F − 1 = W − R + 2F − 2.
    """
    f = spec.flush
    return f * max(1, -(-(window - spec.residual + 2 * f - 2) // f))


class ResidualRingLayer(RingLayer):
    """A sliding-window layer of a format with a full-precision residual window (int4/int2 defaults: KIVI keys
    per channel over token groups, values per token, the most recent ≤ R tokens in full precision).

    Attends exactly what :class:`RingLayer` (and HF's ``DynamicSlidingWindowLayer``) attends: a call at positions
    [c, c+S) gets the last min(c, W − 1) tokens then its own tokens as given. Values: a decode step (S = 1) writes
    first and reads back, so it sees exactly what an append-only layer of the same format returns (sliced to the
    window), and the fused kernel reads the same codes; a multi-token call reads the past before its write (the
    ring may reuse slots during the write), so history tokens that this call flushes into codes are attended in
    full precision, as HF's ``QuantizedCache`` does. Storage: the window of R tokens in
    the model dtype, in front of a ring of coded token groups (:class:`RingResidualStore`,
    :func:`residual_ring_slots` slots: whole groups, so a few tokens older than the window may still sit in codes;
    they are never returned, and the fused decode masks their slots). Tokens enter codes a whole group at a time
    and are never re-quantized, so the codes of a position equal those an append-only layer with the same format
    holds for it (tested: the returned keys/values are the append-only layer's, sliced to the window).
    """

    def __init__(self, window: int, spec: StoreSpec):
        super().__init__(window, spec)
        if not spec.residual:
            raise ValueError("ResidualRingLayer needs a spec with a residual window (use RingLayer otherwise)")
        self.ring_slots = residual_ring_slots(window, spec)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        from .residual import make_ring_residual_store

        self.k_store = make_ring_residual_store(self.spec, key_states, self.ring_slots)
        self.v_store = make_ring_residual_store(self.value_spec(), value_states, self.ring_slots)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def _pieces(self, store, first: int, last: int) -> list[torch.Tensor]:
        return [store.read(first, last)]  # the store keeps absolute positions

    def _visible(self, store, c: int, states: torch.Tensor) -> torch.Tensor:
        past = min(c, self.slots)
        return states if past == 0 else torch.cat((store.read(c - past, c), states), dim=2)

    def _write(self, first: int, x: torch.Tensor, store) -> None:
        if self.slots:
            store.write(first, x)  # appends (rewinds after a crop); the store's ring drops old groups

    def _columns(self, c: int) -> torch.Tensor:
        """For a decode step at position c (already written): HF's mask column of every coded slot then every
        full-precision token (the visible positions c − min(c, W−1) … c in order), −1 where not visible."""
        st = self.k_store
        first = c - min(c, self.slots)
        pos = torch.cat((st.slot_positions()[:st.coded_slots()],
                         torch.arange(st.flushed, c + 1, device=st.fp.device)))  # on the device (fused.py)
        return torch.where(pos >= first, pos - first, torch.full_like(pos, -1))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self._check_update(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        c, s = self.cumulative_length, key_states.shape[2]
        self._remember(key_states, value_states)
        if s == 1 and self.slots:  # a decode step: write, then read back (the ring still holds [c − W + 1, c])
            self._write(c, key_states, self.k_store)
            self._write(c, value_states, self.v_store)
            self.cumulative_length = c + 1
            past = min(c, self.slots)
            reads = functools.partial(self._step_reads, c - past, c + 1)
            if not self._fused_step(key_states):
                return reads()
            k, v = self.k_store, self.v_store  # attention reads the codes (caches/fused.py)
            tail = c + 1 - k.flushed  # full-precision tokens [flushed, c], the step's own last
            h = fused.FusedKV(k.inner, v.inner, k.coded_slots(), k.fp[:, :, :tail], v.fp[:, :, :tail], reads,
                              columns=self._columns(c), visible=past + 1)
            return fused.markers(h, key_states)
        # a multi-token call (tokens this call flushes into codes are attended in full precision, as HF's
        # QuantizedCache does)
        return self._read_then_write(c, key_states, value_states)

    def _step_reads(self, first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The unfused result of a decode step: positions [first, last) read back (the step's own token from the
        full-precision window, where it is held exactly)."""
        return self.k_store.read(first, last), self.v_store.read(first, last)
