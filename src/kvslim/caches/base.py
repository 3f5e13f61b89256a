"""Shared plumbing of kvslim's key/value cache layers (the Hugging Face ``CacheLayerMixin`` protocol)."""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from .storage import StoreSpec, TensorStore, make_store


class BatchOpsMixin:
    """HF's beam-search / batch-editing entry points in terms of one ``_map_batch(fn)`` over the tensors a
    layer holds per sequence (axis 0). Offloading is not supported: the layer owns its tensors."""

    def _map_batch(self, fn) -> None:
        raise NotImplementedError

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def offload(self) -> None:
        return None

    def prefetch(self) -> None:
        return None


class KVStoreLayer(BatchOpsMixin, CacheLayerMixin):
    """A cache layer keeping keys and values in two :class:`TensorStore` objects.

    Subclasses choose slots (append or ring). ``keys``/``values`` of the HF mixin stay ``None``: the stores own
    the tensors, and every HF entry point that would touch them (reorder, batch select, reset) is overridden.
    """

    is_sliding = False

    def __init__(self, spec: StoreSpec | None = None):
        super().__init__()
        self.spec = spec or StoreSpec()
        self.k_store: TensorStore | None = None
        self.v_store: TensorStore | None = None
        self.cumulative_length = 0
        self.scratch_pool = None  # set by KVSlimCache: shared buffers for dequantized reads

    def __repr__(self) -> str:
        return f"{type(self).__name__}(bits={self.spec.bits}, seen={self.cumulative_length})"

    # -- allocation ------------------------------------------------------------------------------------------
    def _initial_capacity(self, incoming: int) -> int:
        raise NotImplementedError

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        cap = self._initial_capacity(key_states.shape[2])
        self.k_store = make_store(self.spec, key_states, cap)
        self.v_store = make_store(self.spec.for_values(), value_states, cap)  # smoothing, KIVI: keys only
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def _check_update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.dim() != 4 or value_states.dim() != 4:
            raise ValueError("key_states/value_states must be (batch, heads, seq, head_dim) tensors")
        if key_states.shape[:3] != value_states.shape[:3]:
            raise ValueError(f"key_states {tuple(key_states.shape)} and value_states {tuple(value_states.shape)} "
                             "must agree in batch, heads and seq")
        if self.is_initialized:
            b, h = self.k_store.data.shape[:2]
            if key_states.shape[:2] != (b, h) or key_states.dtype != self.dtype:
                raise ValueError(f"key_states must be (batch={b}, heads={h}, seq, dim) in {self.dtype}, got "
                                 f"{tuple(key_states.shape)} in {key_states.dtype}")

    # -- HF protocol -----------------------------------------------------------------------------------------
    def get_seq_length(self) -> int:
        return self.cumulative_length

    def reset(self) -> None:
        """Forget the stored tokens (buffers are kept and overwritten); key smoothing is fitted anew."""
        self.cumulative_length = 0
        for store in self._stores():
            store.reset()

    def _stores(self) -> list[TensorStore]:
        return [s for s in (self.k_store, self.v_store) if s is not None]

    def _map_batch(self, fn) -> None:
        for store in self._stores():
            store.map_sequences(fn)

    # -- accounting ------------------------------------------------------------------------------------------
    def stored_tokens(self) -> int:
        """Token slots that hold live data."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Exact bytes of the live keys, values and scales this layer holds."""
        n = self.stored_tokens()
        return sum(s.nbytes(n) for s in self._stores())

    @property
    def allocated_nbytes(self) -> int:
        """Bytes of the preallocated buffers (>= ``nbytes``)."""
        return sum(s.allocated_nbytes() for s in self._stores())
