"""Append layers that CUDA graphs can capture (issue 33): fixed buffers, the stored length on the device.

An :class:`~kvslim.caches.dense.AppendLayer` built with ``max_length`` (``kvslim.make_cache(model, max_length=N)``)
keeps capacity-sized buffers (zeroed: every slot finite) and, beside its Python-int length, the length as a (B,)
int64 tensor on the device. Its *static path* is HF's ``StaticLayer`` layout: a write goes to slots given by that
tensor (``index_copy_``), reads return the first ``max_length`` slots whatever the length, ``get_mask_sizes`` is
``(max_length, 0)`` (HF's mask then covers the whole buffer: a slot past the length is a future position, masked
by the causal rule) and ``get_seq_length`` the device length. A decode step's shapes then never depend on the
length: ``torch.compile(fullgraph=True)`` compiles once, and a CUDA graph replays the same step at every length.

When the static path runs:

* inside a step being traced by dynamo or captured by a CUDA graph (:func:`graph_step`), always, whatever the layer
  did eagerly before (its eager steps keep today's growing views and exact reads; the device length is kept current
  by one in-place fill per eager update, and after graph steps the Python int is read back once, at the next eager
  call: one host synchronisation at that boundary);
* in every call, eager included, once the cache is made ``capturable`` (``kvslim.make_cache(...,
  capturable=True)``): then ``is_compileable`` is ``True``, so HF's ``generate`` builds whole-buffer masks and may
  compile its decode step (``generation_config.compile_config``), as with a ``StaticCache``.

Formats: plain stores and per-token quantized stores (int8; int4/int3/int2 with ``residual=0``, no KIVI keys, no
sinks) with ``max_length``. A layer whose stores keep a full-precision residual window (the int4/int3/int2 defaults)
takes the static path only when made ``capturable`` before its first update: its stores are then
:class:`~kvslim.caches.capture_residual.StaticResidualStore` s (sinks + a ring window, flushes decided on the device);
otherwise it keeps today's path (``is_compileable`` ``False``).

Sparse decode (``sparse_budget``, docs/sparse.md "Captured steps"): a single-token static step writes its page's
box on the device (``PageStats.write_static``) and hands attention a static :class:`~kvslim.caches.sparse.SparseKV`
(the device length, the rows the stores hold), whose page table ``attention/sparse_static.decode_static`` decides on the
device; the box buffers cover the whole capacity from the first update.

Past ``max_length``: an eager step outside the static path grows the buffers as before (tokens unchanged). A graph
step writes nothing (the last slot is rewritten with what it holds, the length stays; that step's output is void)
and sets a device flag (a CUDA graph cannot raise); the next eager call of the layer after graph steps
(``get_seq_length``, ``nbytes``, an update) or ``KVSlimCache.check_finite`` reads it and raises a ``ValueError``
naming ``max_length``, as does every later eager call until ``reset``. A ``capturable`` cache refuses an eager write
past ``max_length`` at once (nothing written).
"""

from __future__ import annotations

import functools

import torch

from . import fused
from .capture_residual import StaticResidualStore, supported
from .sparse import SparseKV, sparse_markers
from .storage import QuantizedStore


def graph_step() -> bool:
    """Whether the running code is being traced by dynamo or captured into a CUDA graph."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def overflow_error(max_length: int) -> ValueError:
    return ValueError(f"a compiled or captured decode step would have written past max_length={max_length} tokens; "
                      "it wrote nothing (graph steps cannot grow the buffers). Build the cache with a larger "
                      "max_length (kvslim.make_cache(model, max_length=...)) or decode past it eagerly")


def init_static_state(layer) -> None:
    """At lazy initialization with ``max_length`` (plain and ring layers alike): zeroed buffers, the device length
    and overflow flag; their addresses marked static (CUDA graphs replay in place)."""
    b = layer.k_store.data.shape[0]
    layer.length_t = torch.zeros(b, dtype=torch.int64, device=layer.device)
    layer.overflow = torch.zeros((), dtype=torch.bool, device=layer.device)
    layer.host_stale = False
    held = [layer.length_t, layer.overflow]
    for store in layer._stores():
        for t in store.tensors():
            t.zero_()
            held.append(t)
        if isinstance(store, QuantizedStore):
            store.nonfinite = torch.zeros((), dtype=torch.bool, device=layer.device)
            held.append(store.nonfinite)
        if isinstance(store, StaticResidualStore):
            held += store.device_state()
    st = getattr(layer, "page_stats", None)
    if st is not None:  # sparse decode's boxes for the whole capacity, written in place by graph steps
        pages = -(-(layer.max_length - st.offset) // st.spec.page) + 1
        held += st.allocate(b, layer.k_store.data.shape[1], layer.k_store.dim, pages, layer.device)
    if not torch.compiler.is_compiling():
        for t in held:
            torch._dynamo.mark_static_address(t)


def reset_static_state(layer) -> None:
    """At ``reset`` of a layer with ``max_length`` (plain and ring layers alike; nothing without): the device length
    and overflow flag zeroed in place, and the stores' non-finite flags allocated again (stores reset theirs to
    ``None``; graph steps need them allocated)."""
    if layer.length_t is None:
        return
    layer.length_t.zero_()
    layer.overflow.zero_()
    for store in layer._stores():
        if hasattr(store, "nonfinite"):
            store.nonfinite = torch.zeros((), dtype=torch.bool, device=layer.device)


class CapturableMixin:
    """The static path of :class:`~kvslim.caches.dense.AppendLayer` (see the module docstring)."""

    capturable = False

    def _static_format(self) -> bool:
        """Whether this layer's buffers have the static layout: per-token formats with ``max_length``; formats with
        a residual window (the int4/int3/int2 defaults) once made ``capturable`` before their first update
        (``caches/capture_residual.py``)."""
        sp = self.spec
        if self.max_length is None:
            return False
        if not (sp.residual or sp.channel_group or sp.sink):
            return True
        return self.capturable and supported(sp) and (not self.is_initialized or self._residual_static())

    def can_capture(self) -> bool:
        """Whether ``capturable=True`` can apply to this layer (``KVSlimCache.set_capturable``)."""
        sp = self.spec
        return self.max_length is not None and (not (sp.residual or sp.channel_group or sp.sink) or supported(sp))

    def _residual_static(self) -> bool:
        return isinstance(self.k_store, StaticResidualStore)

    def make_static_stores(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int) -> None:
        """Lazy initialization of a capturable layer with a residual window: :class:`StaticResidualStore` s."""
        self.k_store = StaticResidualStore(self.spec, key_states, capacity)
        self.v_store = StaticResidualStore(self.value_spec(), value_states, capacity)

    def _static_now(self) -> bool:
        return self._static_format() and (self.capturable or graph_step())

    @property
    def is_compileable(self) -> bool:
        return self._static_now()

    def static_lengths(self) -> torch.Tensor | None:
        """(B,) tokens held per sequence (this call's included) while the static path runs (reads are the whole
        buffer: an attention op may skip the slots past it), else ``None``."""
        return self.length_t if self._static_now() else None

    def _init_static(self) -> None:
        """At lazy initialization with ``max_length``: see :func:`init_static_state`."""
        init_static_state(self)

    def _sync_host(self) -> None:
        """After graph steps: the Python-int length and the overflow flag from the device (host reads at an eager
        boundary only, never per eager step); a graph step refused past ``max_length`` makes every later eager call
        raise ``ValueError`` naming it, until :meth:`reset`."""
        if getattr(self, "host_stale", False):
            self.cumulative_length = int(self.length_t[0])
            self.host_stale = False
            for store in self._stores():
                if isinstance(store, StaticResidualStore):
                    store.sync_host(self.cumulative_length)
            if getattr(self, "page_stats", None) is not None:
                self.page_stats.sync(self.cumulative_length)
            self.refused = bool(self.overflow)
        if getattr(self, "refused", False):
            raise overflow_error(self.max_length)

    def _note_length(self) -> None:
        """Eager update: keep the device length current (one in-place fill; no host read)."""
        if getattr(self, "length_t", None) is not None:
            self.length_t.fill_(self.cumulative_length)

    def raise_overflow(self) -> None:
        flag = getattr(self, "overflow", None)
        if flag is not None and bool(flag):
            raise overflow_error(self.max_length)

    def _static_update(self, key_states: torch.Tensor, value_states: torch.Tensor):
        s = key_states.shape[2]
        in_graph = graph_step()
        self._check_update(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if getattr(self, "length_t", None) is None:  # initialized before max_length took effect: cannot happen
            raise ValueError("max_length: this layer was built without a device length")
        residual = self._residual_static()
        if residual and in_graph and s > 1:
            raise ValueError(f"key_states hold {s} tokens: a compiled or captured step of a capturable cache with a "
                             "residual window (int4/int3/int2 defaults) takes one token per sequence; run multi-token "
                             "updates (a prefill) eagerly")
        old, pos, keep = self._claim(s, in_graph)
        self._static_stats(pos, key_states, keep, in_graph)
        if residual:
            return self._static_residual(key_states, value_states, old, pos, keep, in_graph)
        for store, x in ((self.k_store, key_states), (self.v_store, value_states)):
            store.write_at(pos, x, keep)
        reads = functools.partial(self._static_reads, pos, key_states, value_states)
        if s == 1 and not self.spec.bits:  # a dense layer's sparse step reads its buffers in place
            sparse = self._static_sparse(None, self.length_t)
            if sparse is not None:
                return sparse_markers(sparse, key_states)
        # a sparse step hands the codes whether or not the op is built (its twin reads the table as it does)
        if s == 1 and (self.fused_decode or self._sparse_on()) and not torch.is_grad_enabled() \
                and fused.fusable(self.k_store) and fused.fusable(self.v_store):
            h = fused.FusedKV(self.k_store, self.v_store, self.max_length, key_states, value_states, reads,
                              visible=self.max_length, lengths=old, static=True)
            sparse = self._static_sparse(h, old)
            if sparse is not None:
                return sparse_markers(sparse, key_states)
            if self.fused_decode:
                return fused.markers(h, key_states)
        return reads()

    def _sparse_on(self) -> bool:
        return getattr(self, "page_stats", None) is not None and getattr(self, "sparse_attention", False)

    def _static_stats(self, pos: torch.Tensor, keys: torch.Tensor, keep: torch.Tensor | None, in_graph: bool) -> None:
        """Sparse decode's page boxes for a static write at slots ``pos``: one token on the device
        (:meth:`PageStats.write_static`, eager steps too, the host length kept after them), a multi-token eager call
        as an eager layer writes them, a multi-token graph call token by token."""
        st = getattr(self, "page_stats", None)
        if st is None:
            return
        s = keys.shape[2]
        if s > 1 and not in_graph:
            st.write(self.cumulative_length - s, keys)
            return
        for i in range(s):
            st.write_static(pos[i:i + 1], keys[:, :, i:i + 1], None if keep is None else ~keep)
        if not in_graph:
            st.sync(self.cumulative_length)

    def _static_sparse(self, h, stored: torch.Tensor):
        """A static sparse step's handle (``attention/sparse_static.decode_static``) over ``h`` (a coded layer's static
        handle; ``None``: a dense layer's buffers), ``stored`` (B,) the region rows the stores hold; ``None`` when
        the step reads everything (no sparse decode here, kvslim's attention off, autograd, statistics lost)."""
        st, sp = getattr(self, "page_stats", None), getattr(self, "sparse", None)
        if st is None or not getattr(self, "sparse_attention", False) or torch.is_grad_enabled() or st.broken:
            return None
        pages = st.boxes.shape[2]
        k = min(pages, sp.step_pages(self.max_length) if sp.fraction else sp.pages)
        b = self.length_t.shape[0]
        if h is None:
            n = self.max_length
            return SparseKV(st, n, pages, keys=self.k_store.data, values=self.v_store.data,
                            read=k, static=True, length=self.length_t, stored=stored.expand(b))
        return SparseKV(st, h.n, pages, fused=h, read=k, static=True, length=self.length_t, stored=stored.expand(b))

    def _claim(self, s: int, in_graph: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The slots of an ``s``-token static write: ``(old, pos, keep)``, the device length before it (a copy), the
        (s,) slot indices and, in a graph step, ``keep`` (1-element bool: the write is refused past ``max_length``
        and must leave the slots as they are; the overflow flag is set). Eagerly a write past ``max_length`` raises
        ``ValueError`` naming it before anything is written. The lengths advance here."""
        old, keep = self.length_t.clone(), None
        if in_graph:
            ok = old[:1] + s <= self.max_length  # (1,) bool, on the device
            pos = (old[:1] + torch.arange(s, device=old.device)).clamp(max=self.max_length - 1)
            keep = ~ok  # refused: the slots are written with what they hold (nothing changes)
            self.length_t.add_(ok.to(torch.int64) * s)
            self.overflow.logical_or_(~ok[0])
            self.host_stale = True
        else:
            self._sync_host()
            start = self.cumulative_length
            if start + s > self.max_length:
                raise ValueError(f"max_length={self.max_length}: this capturable cache holds {start} tokens and "
                                 f"cannot take {s} more (nothing written); build it with a larger max_length")
            pos = torch.arange(start, start + s, device=self.device)
            self.cumulative_length = start + s
            self.length_t.fill_(start + s)
        return old, pos, keep

    def _static_reads(self, pos: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``max_length`` slots; a quantized store's decoded slots hold the call's own tokens exactly."""
        out = []
        for store, x in ((self.k_store, key_states), (self.v_store, value_states)):
            if not store.spec.bits:
                out.append(store.data[:, :, :self.max_length])
                continue
            full = store.read(0, self.max_length)
            out.append(full.index_copy(2, pos, x.to(full.dtype)))
        return out[0], out[1]

    def _static_residual(self, key_states: torch.Tensor, value_states: torch.Tensor, old: torch.Tensor,
                         pos: torch.Tensor, keep: torch.Tensor | None, in_graph: bool):
        """The write and reads of a layer with :class:`StaticResidualStore` s (``caches/capture_residual.py``);
        ``old``: the device length before the call, ``keep``: a refused graph step (nothing changes)."""
        k, v = self.k_store, self.v_store
        s = key_states.shape[2]
        for store, x in ((k, key_states), (v, value_states)):
            if s == 1:
                store.step(old[:1], x, None if keep is None else ~keep, host=not in_graph)
            else:
                store.append(int(self.cumulative_length) - s, x)
        reads = functools.partial(self._static_residual_reads, pos, key_states, value_states)
        if s == 1 and (self.fused_decode or self._sparse_on()) and not torch.is_grad_enabled() \
                and fused.fusable(k.inner) and fused.fusable(v.inner) and k.fitted:
            b = key_states.shape[0]
            (kt, k_coded), (vt, v_coded) = k.fused_tail(), v.fused_tail()
            h = fused.FusedKV(k.inner, v.inner, k.capacity, kt, vt, reads, columns=k.columns(self.length_t[0]),
                              visible=self.max_length, lengths=k.flushed_t.expand(b).clone(),
                              k_tail_rotated=k_coded, v_tail_rotated=v_coded)
            sparse = self._static_sparse(h, k.flushed_t)
            if sparse is not None:
                return sparse_markers(sparse, key_states)
            if self.fused_decode:
                return fused.markers(h, key_states)
        return reads()

    def _static_residual_reads(self, pos: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every position up to ``max_length``; a multi-token call attends to its own tokens as given (the eager
        layout's reads do the same)."""
        out = []
        for store, x in ((self.k_store, key_states), (self.v_store, value_states)):
            full = store.read_positions(self.max_length)
            out.append(full if x.shape[2] == 1 else full.index_copy(2, pos, x.to(full.dtype)))
        return out[0], out[1]
