"""Ring-buffer cache layer for sliding-window attention (SPEC §2).

Stores: the last W tokens only (token at position t in slot t mod W); memory is flat after W tokens however
long generation runs. Exact against full-cache attention under the sliding-window mask (plain storage).
"""

from __future__ import annotations

import functools

import torch

from . import fused
from .base import KVStoreLayer, check_crop
from .storage import StoreSpec


class RingLayer(KVStoreLayer):
    """Capacity ``window`` slots; O(1) writes; reads return the visible tokens in temporal order."""

    is_sliding = True
    is_croppable = True

    def __init__(self, window: int, spec: StoreSpec | None = None):
        super().__init__(spec)
        if not isinstance(window, int) or window <= 0:
            raise ValueError(f"window must be a positive int, got {window!r}")
        self.window = window
        #: no sequence has padding: decode may return the ring in slot order (no copy), see ``update``
        self.slot_order_ok = False
        #: HF's ``activate_past_recording``: remember the ring before each step, and the step's tokens, until
        #: the next ``crop`` (which can then take speculative tokens back exactly)
        self.record_past = False
        self._snapshot: tuple[int, list[list[torch.Tensor]] | None] | None = None  # (length, store tensors)
        self._log: list[tuple[torch.Tensor, torch.Tensor]] = []  # key/value states written since the snapshot

    def activate_past_recording(self) -> None:
        """HF's hook before speculative decoding (assisted decoding, prompt lookup): from now on each step can be
        rolled back by :meth:`crop`. Costs one copy of the W-slot ring per step while recording."""
        self.record_past = True

    def _remember(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if not self.record_past:
            return
        if self._snapshot is None:
            tensors = [[t.clone() for t in st.tensors()] for st in self._stores()] if self.is_initialized else None
            self._snapshot = (self.cumulative_length, tensors)
        self._log.append((key_states, value_states))

    def crop(self, tokens_to_remove: int) -> None:
        """HF semantics (``DynamicSlidingWindowLayer.crop``): ``-n`` removes the last n tokens, 0 removes nothing,
        a positive value raises ``ValueError``. Taking back tokens that left the window needs
        :meth:`activate_past_recording` first (``RuntimeError`` otherwise, as HF). Ends the recorded step."""
        check_crop(tokens_to_remove)
        c, target = self.cumulative_length, max(0, self.cumulative_length + tokens_to_remove)
        if target < c:
            if self._snapshot is None:
                if max(0, target - (self.window - 1)) < max(0, c - self.window):
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
                st.set_tensors(saved)
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

    def _initial_capacity(self, incoming: int) -> int:
        return self.window

    def _read_temporal(self, store, first: int, last: int) -> torch.Tensor:
        """Positions [first, last) (all still in the ring) in temporal order, (B, H, last-first, D)."""
        w = self.window
        a, b = first % w, (last - 1) % w + 1
        if last - first == 0:
            return store.read(0, 0)
        if a < b:
            return store.read(a, b)
        return torch.cat((store.read(a, w), store.read(0, b)), dim=2)

    def _fused_reads(self, c: int, key_states: torch.Tensor, value_states: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The unfused result of a decode step at position ``c`` (already written): the visible history in temporal
        order, then the step's own token as given."""
        first = max(0, c + 1 - self.window)
        return (torch.cat((self._read_temporal(self.k_store, first, c), key_states), dim=2),
                torch.cat((self._read_temporal(self.v_store, first, c), value_states), dim=2))

    def _write(self, first: int, x: torch.Tensor, store) -> None:
        """Write tokens at positions [first, first+S) into their slots (only the last W survive)."""
        w, s = self.window, x.shape[2]
        if s > w:
            x, first = x[:, :, s - w:], first + s - w
            s = w
        a = first % w
        head = min(s, w - a)
        store.write(a, x[:, :, :head])
        if head < s:
            store.write(0, x[:, :, head:])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self._check_update(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        c, s, w = self.cumulative_length, key_states.shape[2], self.window
        self._remember(key_states, value_states)
        if s == 1 and self._fused_step(key_states):  # attention reads the codes (caches/fused.py)
            self._write(c, key_states, self.k_store)
            self._write(c, value_states, self.v_store)
            self.cumulative_length = c + 1
            reads = functools.partial(self._fused_reads, c, key_states, value_states)
            return fused.markers(fused.ring_handle(self.k_store, self.v_store, c + 1, w, key_states, value_states,
                                                   reads), key_states)
        if s == 1 and c >= w - 1:
            # decode: overwrite the oldest slot, then read the whole window (positions c-W+1 .. c)
            self._write(c, key_states, self.k_store)
            self._write(c, value_states, self.v_store)
            self.cumulative_length = c + 1
            if self.slot_order_ok:
                # every visible position is unmasked and attention does not depend on key order: no copy
                # (quantized: the decoded window is a fresh tensor; the current token's slot gets it unquantized)
                keys, values = self.k_store.read(0, w), self.v_store.read(0, w)
                if self.spec.bits:
                    keys[:, :, c % w], values[:, :, c % w] = key_states[:, :, 0], value_states[:, :, 0]
                return keys, values
            # HF's padding mask is positional: return positions c-W+1 .. c in temporal order
            if not self.spec.bits:
                return (self._read_temporal(self.k_store, c + 1 - w, c + 1),
                        self._read_temporal(self.v_store, c + 1 - w, c + 1))
            return (torch.cat((self._read_temporal(self.k_store, c + 1 - w, c), key_states), dim=2),
                    torch.cat((self._read_temporal(self.v_store, c + 1 - w, c), value_states), dim=2))
        # prefill / short history: the visible past is the last min(c, W-1) cached tokens plus all new ones
        # (quantized storage: the current tokens are attended in full precision, as given)
        past = min(c, w - 1)
        keys = torch.cat((self._read_temporal(self.k_store, c - past, c), key_states), dim=2)
        values = torch.cat((self._read_temporal(self.v_store, c - past, c), value_states), dim=2)
        self._write(c, key_states, self.k_store)
        self._write(c, value_states, self.v_store)
        self.cumulative_length = c + s
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        c = self.cumulative_length
        past = min(c, self.window - 1)
        return past + query_length, c - past

    def get_max_length(self) -> int:
        return self.window

    def stored_tokens(self) -> int:
        return min(self.cumulative_length, self.window)
