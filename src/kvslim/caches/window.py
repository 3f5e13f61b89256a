"""Ring-buffer cache layer for sliding-window attention (SPEC §2).

Stores: the last W tokens only (token at position t in slot t mod W); memory is flat after W tokens however
long generation runs. Exact against full-cache attention under the sliding-window mask (plain storage).
"""

from __future__ import annotations

import torch

from .base import KVStoreLayer
from .storage import StoreSpec


class RingLayer(KVStoreLayer):
    """Capacity ``window`` slots; O(1) writes; reads return the visible tokens in temporal order."""

    is_sliding = True
    is_croppable = False

    def __init__(self, window: int, spec: StoreSpec | None = None):
        super().__init__(spec)
        if not isinstance(window, int) or window <= 0:
            raise ValueError(f"window must be a positive int, got {window!r}")
        self.window = window
        #: no sequence has padding: decode may return the ring in slot order (no copy), see ``update``
        self.slot_order_ok = False

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
        if s == 1 and c >= w - 1:
            # decode: overwrite the oldest slot, then read the whole window (positions c-W+1 .. c)
            self._write(c, key_states, self.k_store)
            self._write(c, value_states, self.v_store)
            self.cumulative_length = c + 1
            if self.slot_order_ok:
                # every visible position is unmasked and attention does not depend on key order: no copy
                return self.k_store.read(0, w), self.v_store.read(0, w)
            # HF's padding mask is positional: return positions c-W+1 .. c in temporal order
            return (self._read_temporal(self.k_store, c + 1 - w, c + 1),
                    self._read_temporal(self.v_store, c + 1 - w, c + 1))
        # prefill / short history: the visible past is the last min(c, W-1) cached tokens plus all new ones
        past = min(c, w - 1)
        # (quantized storage: the current tokens are attended as they will read back later)
        keys = torch.cat((self._read_temporal(self.k_store, c - past, c), self.k_store.roundtrip(key_states)), dim=2)
        values = torch.cat((self._read_temporal(self.v_store, c - past, c), self.v_store.roundtrip(value_states)),
                           dim=2)
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
