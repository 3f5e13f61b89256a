"""Append-only cache layer: preallocated buffers written by index, grown in chunks (never a per-step cat).

Stores: every token's K and V (plain: memory factor 1; int8/int4: ~0.27/0.15 of fp32). Exact when plain.
Quantized: each call attends to its own K/V in full precision; only the history is decoded from codes.
"""

from __future__ import annotations

import functools

import torch

from . import fused, memory
from .base import KVStoreLayer, check_crop
from .capture import CapturableMixin, graph_step, reset_static_state
from .sparse import PageStats, SparseKV, SparseSpec, candidate_pages, sparse_markers
from .spec import StoreSpec


class AppendLayer(CapturableMixin, KVStoreLayer):
    """Grows by whole chunks of ``chunk`` tokens (or to ``max_length`` at once when known). With ``max_length``, a
    step traced by dynamo or captured by a CUDA graph (or any step of a ``capturable`` cache) takes the static path
    of :mod:`kvslim.caches.capture`. ``sparse``: query-aware sparse decode (:mod:`kvslim.caches.sparse`): page
    statistics are kept as tokens are written, and a single-token step past the budget reads only chosen pages
    (the static path too: ``attention/sparse_static.decode_static``)."""

    is_croppable = True

    def __init__(self, spec: StoreSpec | None = None, *, chunk: int = 256, max_length: int | None = None,
                 sparse: SparseSpec | None = None):
        super().__init__(spec)
        if sparse is not None and not isinstance(sparse, SparseSpec):
            raise ValueError(f"sparse must be a SparseSpec or None, got {type(sparse).__name__}")
        self.sparse = sparse
        self.sparse_attention = False  # set by KVSlimCache.enable_sparse_decode (kvslim's attention runs)
        # the paged region starts behind a layer's full-precision sinks (its coded slot 0 = token ``sink``)
        self.page_stats = None if sparse is None else PageStats(
            sparse, self.spec.sink if self.spec.sink and self.spec.residual else 0)
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0:
            raise ValueError(f"chunk must be a positive int, got {chunk!r}")
        if max_length is not None and (not isinstance(max_length, int) or isinstance(max_length, bool)
                                       or max_length <= 0):
            raise ValueError(f"max_length must be a positive int or None, got {max_length!r}")
        self.chunk, self.max_length = chunk, max_length
        self.length_t = None  # (B,) int64 on the device, with max_length (caches/capture.py)
        self.overflow = None

    def _initial_capacity(self, incoming: int) -> int:
        want = max(incoming, self.max_length or 0)
        return -(-want // self.chunk) * self.chunk

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if self._static_format() and (self.spec.residual or self.spec.sink):  # caches/capture_residual.py
            self.make_static_stores(key_states, value_states, self._initial_capacity(key_states.shape[2]))
            self.dtype, self.device = key_states.dtype, key_states.device
            self.is_initialized = True
        else:
            super().lazy_initialization(key_states, value_states)
        if self._static_format():
            self._init_static()
        self._advise()

    def _advise(self) -> None:
        """Huge pages under a sparse layer's history when ``max_length`` fixed its capacity (caches/memory.py: its
        steps read pages at random; a 2 MB page is resident once written to, so a growing cache, whose capacity runs
        up to 1.5× ahead of its tokens, keeps 4 KB pages)."""
        if self.sparse is not None and self.max_length is not None:
            for store in self._stores():
                for t in store.tensors():
                    memory.advise(t)

    def _ensure_capacity(self, needed: int) -> None:
        cap = self.k_store.capacity
        if needed <= cap:
            return
        new_cap = -(-max(needed, cap + cap // 2) // self.chunk) * self.chunk
        for store in self._stores():
            grown = []
            for t in store.tensors():
                g = t.new_empty(t.shape[0], t.shape[1], new_cap, t.shape[3])
                g[:, :, :cap] = t
                grown.append(g)
            store.set_tensors(grown)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self._static_now():
            return self._static_update(key_states, value_states)
        self._check_update(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._sync_host()
        start, end = self.cumulative_length, self.cumulative_length + key_states.shape[2]
        self._ensure_capacity(end)
        self.k_store.write(start, key_states)
        self.v_store.write(start, value_states)
        self.cumulative_length = end
        self._note_length()
        if self.page_stats is not None:
            self.page_stats.write(start, key_states)
            if key_states.shape[2] != 1:
                self.page_stats.kept_pages = None  # select="prompt": chosen again at the next step
            else:
                h = self._sparse_step(start, key_states, value_states)
                if h is not None:
                    return sparse_markers(h, key_states)
        if self._fused_step(key_states):  # attention reads the codes (caches/fused.py)
            reads = functools.partial(self._reads, start, key_states, value_states)
            return fused.markers(fused.append_handle(self.k_store, self.v_store, start, key_states, value_states,
                                                     reads), key_states)
        if self._fused_call(key_states, start):  # the history read as codes, the call's own block exactly
            reads = functools.partial(self._reads, start, key_states, value_states)
            h = fused.history_handle(self.k_store, self.v_store, start, key_states, value_states, reads)
            if h is not None:
                return fused.markers(h, key_states)
        return self._reads(start, key_states, value_states)

    def _sparse_step(self, start: int, key_states: torch.Tensor, value_states: torch.Tensor) -> SparseKV | None:
        """The handle of a sparse decode step, or ``None`` when this step reads everything (the pages fit the
        budget: the full read, bit for bit; no kvslim attention; autograd; statistics lost to a rewind)."""
        st, sp = self.page_stats, self.sparse
        if not self.sparse_attention or torch.is_grad_enabled() or st.broken:
            return None
        end = start + 1
        if self.spec.bits:
            if not (fused.fusable(self.k_store) and fused.fusable(self.v_store)):
                return None
            reads = functools.partial(self._reads, start, key_states, value_states)
            h = fused.append_handle(self.k_store, self.v_store, start, key_states, value_states, reads)
            n = h.n
            pages = candidate_pages(n, h.tokens - n, sp, st.complete)  # the sinks count among the rows read outright
            if sp.reads_all(pages, end, key_states.shape[0]):
                return None
            k = sp.step_pages(end)
            kept, choose = st.choice(pages, key_states.shape[0], key_states.shape[1], key_states.device, k)
            return SparseKV(st, n, pages, fused=h, scratch=self.scratch_pool, kept=kept, choose=kept is None or choose,
                            read=k)
        pages = candidate_pages(end - 1, 1, sp, st.complete)
        if sp.reads_all(pages, end, key_states.shape[0]):
            return None
        k = sp.step_pages(end)
        kept, choose = st.choice(pages, key_states.shape[0], key_states.shape[1], key_states.device, k)
        return SparseKV(st, end - 1, pages, keys=self.k_store.read(0, end), values=self.v_store.read(0, end),
                        scratch=self.scratch_pool, kept=kept, choose=kept is None or choose, read=k)

    def _reads(self, start: int, key_states: torch.Tensor, value_states: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``update`` returns after writing ``key_states``/``value_states`` at ``start``."""
        return (self._history_and_current(self.k_store, start, key_states, "k"),
                self._history_and_current(self.v_store, start, value_states, "v"))

    def _history_and_current(self, store, start: int, x: torch.Tensor, role: str) -> torch.Tensor:
        """Tokens [0, start) as stored followed by the call's own ``x`` (B, H, S, D) as given.

        A quantized store decodes only the history: the current call attends to its own keys and values in full
        precision (as HF's ``QuantizedCache``); they are quantized for later calls only. Plain stores return a
        view of the buffer (which holds ``x`` exactly).
        """
        pool = self.scratch_pool
        if not store.spec.bits:
            return store.read(0, start + x.shape[2], None if pool is None else (pool, role))
        if start == 0:
            return x
        # traced: a plain cat (the compiler places it; torch 2.11's dynamo cannot compare data_ptr()s)
        if pool is None or x.dtype != torch.float32 or torch.is_grad_enabled() or torch.compiler.is_compiling():
            return torch.cat((store.read(0, start), x), dim=2)
        b, h, s, d = x.shape
        out = pool.view(role, b, h, start + s, d, x.device)  # sized first: the read below reuses it
        hist = store.read(0, start, (pool, role))
        if hist.data_ptr() != out.data_ptr():
            out[:, :, :start] = hist
        out[:, :, start:] = x
        return out

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self._static_now():
            return self.max_length, 0
        self._sync_host()
        return self.cumulative_length + query_length, 0

    def get_seq_length(self):
        if graph_step() and self._static_format() and self.length_t is not None:
            return self.length_t[0]  # a 0-dim device tensor (HF's StaticLayer does the same)
        self._sync_host()
        return self.cumulative_length

    def reset(self) -> None:
        super().reset()
        if self.page_stats is not None:
            self.page_stats.reset()
        self.host_stale = self.refused = False
        reset_static_state(self)

    def _map_batch(self, fn) -> None:
        super()._map_batch(fn)
        if self.page_stats is not None:
            self.page_stats.map_sequences(fn)
        if self.length_t is not None:
            self.length_t = fn(self.length_t)

    def get_max_length(self) -> int:
        return -1

    def file_slots(self) -> int | None:
        """Leading token slots of the stores' ``tensors()`` that hold data (``caches/state.py`` writes only those);
        ``None``: all of them (a capturable residual layout keeps its own)."""
        if not self.is_initialized or self._residual_static():
            return None
        return min(self.stored_tokens(), self.k_store.capacity)

    @property
    def nbytes(self) -> int:
        """Exact bytes of the live keys, values and scales, and of the complete pages' sparse statistics."""
        return super().nbytes + (0 if self.page_stats is None else self.page_stats.nbytes())

    @property
    def allocated_nbytes(self) -> int:
        return super().allocated_nbytes + (0 if self.page_stats is None else self.page_stats.allocated_nbytes())

    def stored_tokens(self) -> int:
        self._sync_host()
        return self.cumulative_length

    def crop(self, tokens_to_remove: int) -> None:
        """HF ``DynamicLayer.crop``: ``-n`` removes the last n tokens (all of them if n ≥ length), 0 removes
        nothing, a positive value raises ``ValueError`` (as HF does). Buffers are kept; later writes overwrite."""
        check_crop(tokens_to_remove)
        if tokens_to_remove and self._residual_static():
            raise ValueError(f"tokens_to_remove={tokens_to_remove}: a capturable cache with a residual window "
                             "(caches/capture_residual.py) cannot rewind; build it without capturable=True")
        self._sync_host()
        self.cumulative_length = max(0, self.cumulative_length + tokens_to_remove)
        self._note_length()
        if self.page_stats is not None:  # a crop inside a page: its sums rebuilt from the rows (k_store still has them)
            self.page_stats.rewind(self.cumulative_length, lambda a, b: self.k_store.read(a, b))
