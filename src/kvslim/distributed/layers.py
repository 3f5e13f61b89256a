"""Sequence-sharded cache layers: each rank keeps its own slice of every layer, in any kvslim storage format.

A layer holds one or more :class:`~kvslim.caches.storage.TensorStore` (plain or grouped int8/int4, reused from
``caches/storage.py``) in local token slots, plus the global index of the token in each slot. Which tokens are
local is decided by a shared :class:`~kvslim.distributed.placement.Placement`. Stores: K and V (dense / int8 /
int4, optionally a sliding window), one row (slim K-, V- or X-cache) or ``c_kv`` + ``k_pe`` (MLA latent).
Memory per rank: its live tokens × the format's bytes per token (total / N with the default placement).

The first call (the prompt) is computed on every rank (weights are replicated) and returned whole, as read back
from storage, so each rank runs the prompt's attention locally, exactly as one process would; only the rank's
own slice is stored. Later calls store only the owner's tokens and return the rank's local slice for the partial
attention of :mod:`kvslim.distributed.merge`.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from ..caches.base import BatchOpsMixin
from ..caches.spec import StoreSpec
from ..caches.storage import TensorStore, check_finite
from ..caches.stores import make_store
from .placement import Placement


class ShardedLayer(BatchOpsMixin, CacheLayerMixin):
    """One layer's local slice: ``len(specs)`` stores of shape (B, H_i, capacity, D_i) and ``slot_index``.

    Attributes:
        cumulative_length: tokens seen by the whole job (every rank agrees), not the local count.
        slot_index: (capacity,) long, global index of the token in each local slot (-1: empty).
        local_mode: whether the last call returned the whole incoming chunk (prompt) rather than the local slice.
    """

    is_croppable = False

    def __init__(self, specs: list[StoreSpec], placement: Placement, rank: int, *, chunk: int = 256,
                 capacity: int | None = None):
        super().__init__()
        self.specs, self.placement, self.rank, self.chunk = specs, placement, rank, chunk
        self.window = placement.window
        self.is_sliding = self.window is not None
        self.capacity_hint = capacity
        self.stores: list[TensorStore] | None = None
        self.slot_index = torch.full((0,), -1, dtype=torch.long)
        self.used = 0  # high-water mark of slots
        self.cumulative_length = 0
        self.local_mode = True
        self.scratch_pool = None
        #: global indices (n,) and live mask of the slice returned by the last ``update`` (for the attention hook)
        self.view_cols: torch.Tensor | None = None
        self.view_live: torch.Tensor | None = None
        self.returned_key: torch.Tensor | None = None

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rank={self.rank}, window={self.window}, local={self.live_tokens()}, "
                f"seen={self.cumulative_length})")

    # -- storage ---------------------------------------------------------------------------------------------
    def _init_stores(self, tensors: list[torch.Tensor]) -> None:
        n = self.placement.world_size
        cap = self.capacity_hint or self.chunk
        if self.window is not None:
            cap = max(1, min(cap, -(-self.window // n)))
        else:  # whole chunks (channel-grouped stores need whole token groups; chunk is a multiple of them)
            cap = -(-max(cap, 1) // self.chunk) * self.chunk
        self.stores = [make_store(spec, x, cap) for spec, x in zip(self.specs, tensors)]
        self.slot_index = torch.full((cap,), -1, dtype=torch.long, device=tensors[0].device)
        self.dtype, self.device = tensors[0].dtype, tensors[0].device
        self.is_initialized = True

    def _grow(self, needed: int) -> None:
        cap = self.slot_index.shape[0]
        new_cap = -(-max(needed, cap + cap // 2) // self.chunk) * self.chunk
        for store in self.stores:
            grown = []
            for t in store.tensors():
                g = t.new_empty(t.shape[0], t.shape[1], new_cap, t.shape[3])
                g[:, :, :cap] = t
                grown.append(g)
            store.set_tensors(grown)
        idx = self.slot_index.new_full((new_cap,), -1)
        idx[:cap] = self.slot_index
        self.slot_index = idx

    def _free_slots(self, count: int, last: int) -> list[int]:
        """``count`` slots to write into: after the high-water mark, or (window) slots whose token has left."""
        if self.window is None:
            slots = list(range(self.used, self.used + count))
        else:
            dead = ((self.slot_index[: self.used] < 0) | (self.slot_index[: self.used] <= last - self.window))
            slots = dead.nonzero().flatten().tolist()[:count]
            slots += list(range(self.used, self.used + count - len(slots)))
        if slots and slots[-1] >= self.slot_index.shape[0]:
            self._grow(slots[-1] + 1)
        return slots

    def append(self, tensors: list[torch.Tensor]) -> bool:
        """Record the next S tokens (tensors (B, H_i, S, D_i), the same on every rank); store the local ones.

        Returns:
            ``True`` when this call is the prompt (the cache was empty), ``False`` otherwise.
        """
        s = tensors[0].shape[2]
        c = self.cumulative_length
        if self.stores is None:
            self._init_stores(tensors)
        elif tensors[0].shape[0] != self.stores[0].data.shape[0] or tensors[0].dtype != self.dtype:
            raise ValueError(f"states must be batch {self.stores[0].data.shape[0]} in {self.dtype}, got "
                             f"{tuple(tensors[0].shape)} in {tensors[0].dtype}")
        if c > 0 and s > 1 and self.window is not None:
            raise NotImplementedError("sequence-parallel window layers take the prompt then one token per step; "
                                      "a multi-token call after the prompt is not supported")
        for spec, x in zip(self.specs, tensors):  # every tensor before any store writes: a refused call writes nothing
            if spec.bits:
                check_finite(x)
        local = self.placement.local_indices(self.rank, c, s)
        slots = self._free_slots(len(local), c + s - 1)
        for slot, i in _runs(slots, local):
            for store, x in zip(self.stores, tensors):
                store.write(slot[0], x[:, :, i[0]:i[1]])
            self.slot_index[slot[0]:slot[1]] = torch.arange(c + i[0], c + i[1], device=self.slot_index.device)
        self.used = max([self.used] + [sl + 1 for sl in slots])
        self.cumulative_length = c + s
        self.local_mode = c == 0
        return self.local_mode

    def local(self) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None]:
        """The local slots: each store's contents (B, H_i, n, D_i) in the model dtype (dequantized), the global
        index of each slot (n,), and a bool (n,) of live slots (``None`` when all are live)."""
        n = self.used
        pool = self.scratch_pool
        roles = ("k", "v", "r")
        views = [st.read(0, n, None if pool is None else (pool, roles[j] + str(len(self.stores))))
                 for j, st in enumerate(self.stores)]
        cols = self.slot_index[:n]
        live = None
        if self.window is not None:
            live = (cols >= 0) & (cols > self.cumulative_length - 1 - self.window)
            if bool(live.all()):
                live = None
        return views, cols.clamp_min(0), live

    def roundtrip(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The prompt as one process's cache would read it back (also fixes quantized key smoothing from the
        whole prompt, as a single process does). Stores that cannot round-trip a chunk (full-precision residual
        window, per-channel key groups) are emulated: a transient one-process store of the prompt."""
        out = []
        for st, spec, x in zip(self.stores, self.specs, tensors):
            try:
                out.append(st.roundtrip(x))
            except NotImplementedError:
                cap = -(-x.shape[2] // self.chunk) * self.chunk
                tmp = make_store(spec, x, cap)
                tmp.write(0, x)
                out.append(tmp.read(0, x.shape[2]).clone())
        return out

    # -- HF protocol -----------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._init_stores([key_states, value_states][: len(self.specs)])

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """HF builds the global mask (every position seen by the job); attention picks the local columns."""
        return self.cumulative_length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.cumulative_length = self.used = 0
        self.slot_index.fill_(-1)
        for store in self.stores or []:
            store.reset()

    def _map_batch(self, fn) -> None:
        for store in self.stores or []:
            store.map_sequences(fn)

    # -- accounting ------------------------------------------------------------------------------------------
    def live_tokens(self) -> int:
        """Local tokens a later step can still attend: a window layer's last W − 1 positions job-wide (as one
        process and HF's ``DynamicSlidingWindowLayer``; the slot of the W-th, seen only by the step that just
        ran, is free for the next token)."""
        if self.stores is None:
            return 0
        cols = self.slot_index[: self.used]
        if self.window is None:
            return int((cols >= 0).sum())
        return int(((cols >= 0) & (cols > self.cumulative_length - self.window)).sum())

    @property
    def nbytes(self) -> int:
        """Exact bytes of the live tokens (and scales) this rank holds for this layer."""
        n = self.live_tokens()
        return sum(s.nbytes(n) for s in self.stores or [])

    @property
    def allocated_nbytes(self) -> int:
        return sum(s.allocated_nbytes() for s in self.stores or [])


def _runs(slots: list[int], idx: list[int]):
    """Maximal runs where slots and incoming offsets both advance by one: ((slot0, slot1), (i0, i1))."""
    k = 0
    while k < len(idx):
        j = k
        while j + 1 < len(idx) and slots[j + 1] == slots[j] + 1 and idx[j + 1] == idx[j] + 1:
            j += 1
        yield (slots[k], slots[j] + 1), (idx[k], idx[j] + 1)
        k = j + 1


class ShardedKVLayer(ShardedLayer):
    """Keys and values (dense, int8/int4, optionally windowed): HF's ``update(k, v)`` protocol."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Prompt: the whole (B, Hkv, S, D) K and V as stored; later: the local slice (B, Hkv, n, D)."""
        if key_states.dim() != 4 or value_states.dim() != 4 or key_states.shape[:3] != value_states.shape[:3]:
            raise ValueError("key_states/value_states must be (batch, heads, seq, head_dim) and agree in batch, "
                             f"heads and seq, got {tuple(key_states.shape)} and {tuple(value_states.shape)}")
        if self.stores is None:
            self._init_stores([key_states, value_states])
        c = self.cumulative_length
        if c == 0:
            if any(sp.smooth for sp in self.specs):
                self.roundtrip([key_states, value_states])  # fits key smoothing on the whole prompt, as one process
            k, v = key_states, value_states  # a call attends to its own K/V in full precision (as one process)
            self.append([key_states, value_states])
        else:
            self.append([key_states, value_states])
            (k, v), self.view_cols, self.view_live = self.local()
            k, v = self._own_in_full_precision([k, v], [key_states, value_states], c)
        self.returned_key = k  # the attention hook checks that it was handed this layer's tensors
        return k, v

    def _own_in_full_precision(self, views: list[torch.Tensor], tensors: list[torch.Tensor], first: int
                               ) -> list[torch.Tensor]:
        """Local slots holding this call's tokens (global index ≥ ``first``) get them as given, not decoded
        (quantized stores; their views are fresh or scratch tensors, or a residual window that holds them)."""
        if not any(sp.bits for sp in self.specs):
            return views
        mine = (self.view_cols >= first).nonzero().flatten()
        if not mine.numel():
            return views
        src = self.view_cols[mine] - first
        return [view.index_copy_(2, mine, x.index_select(2, src)) if sp.bits else view
                for view, x, sp in zip(views, tensors, self.specs)]


class ShardedLatentLayer(ShardedKVLayer):
    """MLA: ``update(c_kv (B, 1, S, dc), k_pe (B, 1, S, dr))`` — the same protocol as :class:`ShardedKVLayer`."""


class ShardedRowLayer(ShardedLayer):
    """Slim attention: one row of ``width`` values per token (K, K + conditioning, V or X).

    Keeps each sequence's position offset (global slot − position, as :class:`~kvslim.caches.slim.SlimLayer`)
    so stored raw keys can be rotated at their own positions under left padding.
    """

    def __init__(self, technique: str, width: int, spec: StoreSpec, placement: Placement, rank: int, *,
                 chunk: int = 256, capacity: int | None = None):
        super().__init__([spec], placement, rank, chunk=chunk, capacity=capacity)
        self.technique, self.width = technique, width
        self.offsets: torch.Tensor | None = None  # (B,) long

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("ShardedRowLayer holds one tensor per token and is filled by the sequence-parallel "
                           "slim attention; it was called by unpatched attention")

    def write(self, rows: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Record rows (B, S, width) as the next S tokens; returns them as they read back from storage."""
        if rows.dim() != 3 or rows.shape[-1] != self.width:
            raise ValueError(f"rows must be (batch, seq, {self.width}), got {tuple(rows.shape)}")
        x = rows.unsqueeze(1)  # (B, 1, S, width)
        end = self.cumulative_length + x.shape[2]
        if position_ids is not None:
            last = position_ids[:, -1].to(device=x.device, dtype=torch.long).expand(x.shape[0])
            offsets = (end - 1) - last
            if self.offsets is None or self.cumulative_length == 0:
                self.offsets = offsets
            elif not torch.equal(offsets, self.offsets):
                raise ValueError("slim attention with RoPE needs consecutive positions per sequence")
        if self.stores is None:
            self._init_stores([x])
        back = self.roundtrip([x])[0][:, 0] if self.cumulative_length == 0 else rows
        self.append([x])
        return back

    def rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Local rows (B, n, width), their global indices (n,), live mask (``None``) and positions (B, n)."""
        (x,), cols, live = self.local()
        off = self.offsets if self.offsets is not None else cols.new_zeros(x.shape[0])
        return x[:, 0], cols, live, (cols[None, :] - off[:, None]).clamp_min(0)

    def _map_batch(self, fn) -> None:
        super()._map_batch(fn)
        if self.offsets is not None:
            self.offsets = fn(self.offsets[:, None, None, None])[:, 0, 0, 0]

    def reset(self) -> None:
        super().reset()
        self.offsets = None
