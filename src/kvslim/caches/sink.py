"""Attention-sink tokens kept in full precision in front of a residual-window store.

The first tokens of a sequence draw a large share of every head's attention (attention sinks, StreamingLLM;
KVQuant and IntactKV keep them unquantized). :class:`SinkStore` keeps the first ``spec.sink`` tokens in the
model dtype for good and hands every later token to a :class:`~kvslim.caches.residual.ResidualStore` at its
position minus ``sink``: the sinks are left out of the coded groups' ranges (a KIVI key group starts at token
``sink``), and the coded store's slots hold tokens ``[sink, flushed)``.

Layout: one full-precision buffer ``fp`` (B, H, sink + residual, D) holds the sinks in rows ``[0, sink)`` and
the residual window behind them (the inner store's ``fp`` is a view of rows ``[sink, …)``), so a fused decode
step reads sinks and window as one contiguous tail (``caches/fused.py``: ``lead`` = the sinks, attended before
the coded history in temporal order). Cost: ``sink`` rows in the model dtype per layer, counted with the window.
"""

from __future__ import annotations

import torch

from .residual import ResidualStore, rotated_tail_nbytes
from .spec import StoreSpec
from .storage import ScratchPool, TensorStore, check_finite


class SinkStore(TensorStore):
    """Tokens ``[0, sink)`` in full precision (``fp[:, :, :sink]``); tokens ``[sink, n)`` in ``inner`` (a
    :class:`ResidualStore`) at positions ``[0, n − sink)``. ``data``/``tensors()`` are the coded store's."""

    def __init__(self, spec: StoreSpec, inner: ResidualStore):
        if not spec.sink or not isinstance(inner, ResidualStore):
            raise ValueError("a SinkStore needs spec.sink > 0 and a ResidualStore for the tokens after the sinks")
        self.spec, self.inner, self.dtype, self.dim = spec, inner, inner.dtype, inner.dim
        self.sink = spec.sink
        b, h, r, d = inner.fp.shape
        self.fp = torch.empty(b, h, self.sink + r, d, dtype=inner.dtype, device=inner.fp.device)
        inner.fp = self.fp[:, :, self.sink:]  # the window right behind the sinks: one contiguous tail
        self.length = 0
        self.epoch = 0  # bumped by every change but an append (rewind, reorder, reset): fused.py's key
        self.rotated_copy = None  # fused decode's (key, rotated tail, rows) (caches/fused.rotated_tail)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "rotated_copy": None}  # fused decode's rotated tail is rebuilt on use

    def __setstate__(self, state: dict) -> None:
        """``pickle`` keeps no view relation between tensors: the inner window comes back as a separate copy of
        ``fp``'s rows, which later writes would update apart from the ``fp`` a fused decode step reads (sinks and
        window as one tail), so a continued ``generate`` read a stale window. Re-made a view of ``fp``."""
        self.__dict__.update(state)
        self.inner.fp = self.fp[:, :, self.sink:]

    @property
    def data(self) -> torch.Tensor:
        return self.inner.data

    @property
    def capacity(self) -> int:
        return self.inner.capacity  # the coded store's slots (tokens shifted by ``sink``: a little to spare)

    @property
    def coded(self) -> TensorStore:
        """The store of the codes (slot ``j`` = token ``sink + j``)."""
        return self.inner.inner

    @property
    def flushed(self) -> int:
        """Tokens before the full-precision window: the sinks held so far and the coded tokens."""
        return min(self.length, self.sink) + self.inner.flushed

    def tensors(self) -> list[torch.Tensor]:
        return self.inner.tensors()

    def set_tensors(self, tensors: list[torch.Tensor]) -> None:
        self.inner.set_tensors(tensors)

    def write(self, start: int, x: torch.Tensor) -> None:
        """Append ``x`` (B, H, S, D) at token ``start`` (≤ current length; a shorter start rewinds, as after a
        crop). ``ValueError`` on inf/nan, nothing written."""
        if start > self.length:
            raise ValueError(f"a sink store appends: start {start} is past its {self.length} tokens")
        check_finite(x, self)  # a decode step: on the device (storage.check_finite)
        if start < self.length:
            self.epoch += 1
        s, n = self.sink, start + x.shape[2]
        if start < s:
            k = min(s, n) - start
            self.fp[:, :, start:start + k] = x[:, :, :k]
            x = x[:, :, k:]
            if self.inner.length:  # rewound into the sinks: everything after them is forgotten
                self.inner.flushed = self.inner.length = 0
        if x.shape[2]:
            self.inner.write(max(start, s) - s, x, checked=True)
        self.length = n

    def read(self, start: int, end: int, scratch: tuple[ScratchPool, str] | None = None) -> torch.Tensor:
        """Tokens [start, end) as (B, H, end-start, D) in the model dtype (sinks as kept, the rest through the
        residual store)."""
        s = self.sink
        if start >= s:
            return self.inner.read(start - s, end - s, scratch)
        head = self.fp[:, :, start:min(end, s)]
        if end <= s:
            return head
        return torch.cat((head, self.inner.read(0, end - s)), dim=2)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("a sink store is appended to, not written by slot")

    def map_sequences(self, fn) -> None:
        self.inner.inner.map_sequences(fn)
        self.fp = fn(self.fp)
        self.inner.fp = self.fp[:, :, self.sink:]
        self.epoch += 1

    def allocated_nbytes(self) -> int:
        return (self.inner.inner.allocated_nbytes() + self.fp.numel() * self.fp.element_size()
                + rotated_tail_nbytes(self))

    def reset(self) -> None:
        self.length = 0
        self.epoch += 1
        self.nonfinite = None
        self.inner.reset()

    def nbytes(self, used_slots: int) -> int:
        """Bytes of the first ``used_slots`` tokens: sinks in full precision, then the residual store's."""
        b, h = self.fp.shape[:2]
        head = min(used_slots, self.sink)
        return b * h * head * self.dim * self.dtype.itemsize + self.inner.nbytes(max(0, used_slots - self.sink))
