"""Shared plumbing of kvslim's key/value cache layers (the Hugging Face ``CacheLayerMixin`` protocol)."""

from __future__ import annotations

import functools

import torch
from transformers.cache_utils import CacheLayerMixin

from ..kernels.backend import same_device
from .fused import fusable
from .spec import StoreSpec
from .storage import TensorStore, check_finite, raise_deferred
from .stores import make_store

#: the dtypes a cache layer stores (integer key/value states are a caller's bug, never a cache format)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _index_select(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return t.index_select(0, idx.to(t.device))


def _repeat(t: torch.Tensor, repeats: int) -> torch.Tensor:
    return t.repeat_interleave(repeats, dim=0)


def _select(t: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return t[indices]


def check_crop(tokens_to_remove: int) -> None:
    """HF's ``DynamicLayer.crop`` contract: a positive count is refused (the legacy "keep n" meaning is gone)."""
    if not isinstance(tokens_to_remove, int) or isinstance(tokens_to_remove, bool):
        raise ValueError(f"tokens_to_remove must be an int, got {tokens_to_remove!r}")
    if tokens_to_remove > 0:
        raise ValueError(f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                         "Please use a negative integer to remove that number of tokens from the cache instead.")


class BatchOpsMixin:
    """HF's beam-search / batch-editing entry points in terms of one ``_map_batch(fn)`` over the tensors a
    layer holds per sequence (axis 0). Offloading is not supported: the layer owns its tensors.
    (Module-level functions and ``functools.partial``, never lambdas: caches pickle.)"""

    def _map_batch(self, fn) -> None:
        raise NotImplementedError

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(functools.partial(_index_select, idx=beam_idx))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(functools.partial(_repeat, repeats=repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(functools.partial(_select, indices=indices))

    def offload(self) -> None:
        return None

    def prefetch(self) -> None:
        return None


#: a call of up to this many new tokens attends its history through the fused ops (:meth:`KVStoreLayer._fused_call`)
#: whatever the history's length; a longer call does when the history holds at least :data:`FUSED_CALL_HISTORY`
#: times its tokens, else it dequantizes the history once and runs SDPA. Measured on mha-100m int4, 2 threads
#: (``benchmarks/bench_question_pass.py``): 512 new tokens over 1,024 run faster through SDPA, over 4,096 faster
#: fused; 64 over 1,024 faster fused.
FUSED_CALL_TOKENS = 64
FUSED_CALL_HISTORY = 4
#: the longest call taken there at all: its own causal block is attended as one (G·S × S) fp32 product per KV head
#: (at 1,024 tokens and Qwen2.5's 7 query heads per KV head, 29 MB per KV head); longer calls dequantize and run SDPA
FUSED_CALL_MAX = 1024


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
        #: set by ``KVSlimCache.enable_fused_decode``: decode steps of int8/int4 layers hand attention the codes
        #: (NaN marker tensors carrying a ``caches.fused.FusedKV``) instead of a dequantized copy
        self.fused_decode = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(bits={self.spec.bits}, seen={self.cumulative_length})"

    # -- allocation ------------------------------------------------------------------------------------------
    def _initial_capacity(self, incoming: int) -> int:
        raise NotImplementedError

    def value_spec(self) -> StoreSpec:
        """How the second tensor of ``update`` is stored (values: the key spec without key-only options)."""
        return self.spec.for_values()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        cap = self._initial_capacity(key_states.shape[2])
        self.k_store = make_store(self.spec, key_states, cap)
        self.v_store = make_store(self.value_spec(), value_states, cap)  # smoothing, KIVI: keys only
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def _check_update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """``ValueError`` naming the argument for anything this layer cannot store; runs before any write, so a
        refused call changes nothing. Metadata only (shapes, dtypes, devices): no host synchronisation."""
        for name, x in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
            if x.dtype not in FLOAT_DTYPES:
                raise ValueError(f"{name} must be a floating-point tensor (float32, float16, bfloat16 or float64), "
                                 f"got {x.dtype}")
        if key_states.dim() != 4 or value_states.dim() != 4:
            raise ValueError("key_states/value_states must be (batch, heads, seq, head_dim) tensors")
        if key_states.shape[2] == 0 or value_states.shape[2] == 0:
            raise ValueError(f"key_states/value_states hold no tokens (seq = 0; shapes {tuple(key_states.shape)}, "
                             f"{tuple(value_states.shape)}): an update must add at least one token")
        device = same_device("key_states/value_states", key_states, value_states)
        if self.is_initialized and device != self.device:
            raise ValueError(f"key_states/value_states are on {device}, but this cache layer holds its tensors on "
                             f"{self.device}: keep the model and its cache on one device")
        if key_states.shape[:3] != value_states.shape[:3]:
            raise ValueError(f"key_states {tuple(key_states.shape)} and value_states {tuple(value_states.shape)} "
                             "must agree in batch, heads and seq")
        if key_states.dtype != value_states.dtype:
            raise ValueError(f"key_states ({key_states.dtype}) and value_states ({value_states.dtype}) must share "
                             "a dtype")
        if self.is_initialized:
            b, h = self.k_store.data.shape[:2]
            for name, x, store in (("key_states", key_states, self.k_store), ("value_states", value_states,
                                                                                 self.v_store)):
                if x.shape[:2] != (b, h) or x.shape[3] != store.dim or x.dtype != self.dtype:
                    raise ValueError(f"{name} must be (batch={b}, heads={h}, seq, head_dim={store.dim}) in "
                                     f"{self.dtype}, got {tuple(x.shape)} in {x.dtype}")
        elif self.spec.bits:
            for name, x, spec in (("key_states", key_states, self.spec), ("value_states", value_states,
                                                                           self.value_spec())):
                try:
                    spec.check_dim(x.shape[3])
                except ValueError as e:
                    raise ValueError(f"{name}: {e}") from None
        if key_states.shape[2] == 1:  # a decode step: each quantized store checks its write on the device
            return
        self.raise_deferred()  # a host boundary: refuse a cache that an earlier decode step poisoned
        if self.spec.bits and self.value_spec().bits:
            # the key store checks its own write, and it is written first; the values are checked before it, so a
            # refused call writes neither (a key store whose window advanced would later re-read a flushed group)
            check_finite(value_states)

    def raise_deferred(self) -> None:
        """``ValueError`` when a decode step since the last check wrote inf/nan into a quantized store of this layer
        (the device-side flags of :func:`~kvslim.caches.storage.check_finite`; one host read per store)."""
        for store in self._stores():
            while store is not None:
                raise_deferred(store)
                store = getattr(store, "inner", None)
        if hasattr(self, "raise_overflow"):
            self.raise_overflow()  # a graph step refused past max_length (caches/capture.py)

    # -- HF protocol -----------------------------------------------------------------------------------------
    def _fused_step(self, key_states: torch.Tensor) -> bool:
        """Whether this update is a decode step that returns markers (fused decode on, one token, int8/int4)."""
        return (self.fused_decode and key_states.shape[2] == 1 and not torch.is_grad_enabled()
                and fusable(self.k_store) and fusable(self.v_store))

    def _fused_call(self, key_states: torch.Tensor, start: int) -> bool:
        """Whether this update is a multi-token call over a history (a question after a prompt file, a chat turn,
        a verify step, a prefill chunk) whose history attention reads as codes (``caches/fused.history_handle``):
        fused decode on, more than one new token (a long call only over a long history: :data:`FUSED_CALL_TOKENS`),
        eager, no autograd."""
        s = key_states.shape[2]
        short = s <= FUSED_CALL_TOKENS or (start >= FUSED_CALL_HISTORY * s and s <= FUSED_CALL_MAX)
        return (self.fused_decode and s > 1 and short and start > 0 and not torch.is_grad_enabled()
                and not torch.compiler.is_compiling() and fusable(self.k_store) and fusable(self.v_store))

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
