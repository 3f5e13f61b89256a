"""Stores for KIVI-style caches: keys quantized per channel over token groups, and a full-precision residual.

* :class:`ChannelQuantizedStore` (KIVI keys, Liu et al. 2024): one scale (and zero-point) per channel per group
  of ``G = spec.channel_group`` consecutive tokens. Keys have outlier *channels*; grouping along tokens gives
  each channel its own range. Lossy, measured (docs/quantization.md).
* :class:`ResidualStore`: the most recent tokens (at most ``spec.residual``) in full precision; once the window
  would overflow, its oldest ``spec.flush`` tokens are encoded into the wrapped coded store, a whole group at a
  time. Appending never re-quantizes history. Memory: ``flushed·code_row + (n − flushed)·fp_row``.
"""

from __future__ import annotations

import torch

from ..ops.quant_formats import pack_codes, unpack_codes
from .spec import StoreSpec
from .storage import QuantizedStore, ScratchPool, TensorStore, check_finite


class ChannelQuantizedStore(QuantizedStore):
    """Per-channel codes over token groups: codes (B, H, capacity, D·bits/8) per token as usual; ``scale``
    (and ``zero``) (B, H, capacity, D/G) hold, in the G rows of token group g, that group's D per-channel
    parameters: ``scale.view(B, H, capacity/G, D)[:, :, g, c]`` (see :meth:`group_params`).

    Writes and reads cover whole token groups (``start`` and the length multiples of G); a
    :class:`ResidualStore` in front guarantees that.
    """

    def __init__(self, spec: StoreSpec, batch: int, heads: int, capacity: int, dim: int,
                 dtype: torch.dtype, device: torch.device):
        if capacity % spec.channel_group:
            raise ValueError(f"capacity {capacity} must be a multiple of channel_group={spec.channel_group}")
        super().__init__(spec, batch, heads, capacity, dim, dtype, device)

    def group_params(self, t: torch.Tensor) -> torch.Tensor:
        """``scale`` or ``zero`` slice (B, H, T, D/G) viewed per token group: (B, H, T/G, D)."""
        return t.unflatten(2, (-1, self.spec.channel_group)).flatten(3)

    def _check_span(self, start: int, length: int) -> None:
        g = self.spec.channel_group
        if start % g or length % g:
            raise ValueError(f"a channel-grouped store reads and writes whole groups of {g} tokens, got tokens "
                             f"[{start}, {start + length})")

    def _encode(self, x: torch.Tensor, channel: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        sp, g = self.spec, self.spec.channel_group
        y = self._to_stored_basis(x, channel).float().unflatten(2, (-1, g))  # (B, H, S/G, G, D)
        info = torch.finfo(sp.scale_dtype)
        if sp.asymmetric:
            lo, hi = y.amin(dim=3), y.amax(dim=3)  # (B, H, S/G, D)
            scale = ((hi - lo) / ((1 << sp.bits) - 1)).clamp(info.tiny, info.max).to(sp.scale_dtype)
            zero = lo.clamp(-info.max, info.max).to(sp.scale_dtype)
            q = torch.round((y - zero.float().unsqueeze(3)) / scale.float().unsqueeze(3))
            q = q.clamp_(0, (1 << sp.bits) - 1).to(torch.uint8)
        else:
            qm = (1 << (sp.bits - 1)) - 1
            scale = (y.abs().amax(dim=3) / qm).clamp(info.tiny, info.max).to(sp.scale_dtype)
            zero = None
            q = torch.round(y / scale.float().unsqueeze(3)).clamp_(-qm, qm).to(torch.int8)
        codes = pack_codes(q.flatten(2, 3), sp.bits)  # (B, H, S, D·bits/8)
        rows = (*scale.shape[:2], -1, self.scale.shape[-1])  # parameters (B, H, S/G, D) -> (B, H, S, D/G)
        return codes, scale.reshape(rows), None if zero is None else zero.reshape(rows)

    def _decode(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                channel: torch.Tensor | None) -> torch.Tensor:
        sp = self.spec
        q = unpack_codes(codes, sp.bits, signed=zero is None).float()  # (B, H, T, D)
        q = q.unflatten(2, (-1, sp.channel_group))  # (B, H, T/G, G, D)
        y = q * self.group_params(scale).float().unsqueeze(3)
        if zero is not None:
            y += self.group_params(zero).float().unsqueeze(3)
        return self._from_stored_basis(y.flatten(2, 3), channel).to(self.dtype)

    def write(self, start: int, x: torch.Tensor, *, checked: bool = False) -> None:
        self._check_span(start, x.shape[2])
        super().write(start, x, checked=checked)

    def read(self, start: int, end: int, scratch: tuple[ScratchPool, str] | None = None) -> torch.Tensor:
        self._check_span(start, end - start)
        zero = None if self.zero is None else self.zero[:, :, start:end]
        return self._decode(self.data[:, :, start:end], self.scale[:, :, start:end], zero, self.channel)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("a channel-grouped store is read through a ResidualStore")


def rotated_tail_nbytes(store) -> int:
    """Bytes of the rotated copy of a store's full-precision tail that fused decode keeps
    (``caches/fused.rotated_tail``; 0 until a fused step made one)."""
    saved = store.rotated_copy
    return 0 if saved is None else saved[1].numel() * saved[1].element_size()


class ResidualStore(TensorStore):
    """Full-precision window in front of a coded store: tokens [0, flushed) in ``inner``'s codes, tokens
    [flushed, n) in ``fp`` (B, H, residual, D) in the model dtype. ``data``/``scale``/``tensors()`` are the
    inner store's (token-slot axis 2, grown by the layer); the window is fixed-size."""

    def __init__(self, spec: StoreSpec, inner: TensorStore, batch: int, heads: int, dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.spec, self.inner, self.dtype, self.dim = spec, inner, dtype, dim
        self.fp = torch.empty(batch, heads, spec.residual, dim, dtype=dtype, device=device)
        self.flushed = 0  # tokens in codes (a multiple of spec.flush)
        self.length = 0  # tokens held in all
        self.epoch = 0  # bumped by every change but an append (rewind, reorder, reset, restore): fused.py's key
        self.rotated_copy = None  # fused decode's (key, rotated tail, rows) (caches/fused.rotated_tail)

    def __getstate__(self) -> dict:
        # fused decode's rotated tail is keyed by ``id(fp)``, which means nothing in another process: rebuilt on use
        return {**self.__dict__, "rotated_copy": None}

    # the coded store's tensors are the ones that grow with capacity
    @property
    def data(self) -> torch.Tensor:
        return self.inner.data

    @property
    def capacity(self) -> int:
        return self.inner.capacity

    def tensors(self) -> list[torch.Tensor]:
        return self.inner.tensors()

    def set_tensors(self, tensors: list[torch.Tensor]) -> None:
        self.inner.set_tensors(tensors)

    def write(self, start: int, x: torch.Tensor, *, checked: bool = False) -> None:
        """Append ``x`` (B, H, S, D) at token ``start`` (≤ current length: a shorter start rewinds, as after a
        crop); flush whole groups of the oldest window tokens into codes while more than ``residual`` wait.
        ``checked``: the caller has already refused inf/nan in ``x``."""
        if start > self.length:
            raise ValueError(f"a residual store appends: start {start} is past its {self.length} tokens")
        if not checked:
            check_finite(x, self)  # refused now (a decode step: on the device), not at the flush
        if start < self.length:
            self.epoch += 1
        if start < self.flushed:  # rewind into coded history: bring the partial group back to the window
            keep = start - start % self.spec.flush
            self.fp[:, :, :start - keep] = self._inner_read(keep, keep + self.spec.flush)[:, :, :start - keep]
            self.flushed = keep
        waiting = start - self.flushed
        n = start + x.shape[2]
        target = max(self.spec.flushed(n), self.flushed)
        if target == self.flushed:  # everything still fits the window
            self.fp[:, :, waiting:waiting + x.shape[2]] = x
        else:
            pending = torch.cat((self.fp[:, :, :waiting], x), dim=2)  # tokens [flushed, n)
            self._inner_write(self.flushed, pending[:, :, :target - self.flushed])
            rest = pending[:, :, target - self.flushed:]
            self.fp[:, :, :rest.shape[2]] = rest
            self.flushed = target
        self.length = n

    def read(self, start: int, end: int, scratch: tuple[ScratchPool, str] | None = None) -> torch.Tensor:
        """Tokens [start, end) as (B, H, end-start, D) in the model dtype (codes decoded, window as is)."""
        cut = min(max(start, self.flushed), end)
        window = self.fp[:, :, cut - self.flushed:end - self.flushed]
        if cut == start:
            return window
        g = self.spec.flush  # decode whole groups, then slice
        a, b = start - start % g, min(self.flushed, -(-cut // g) * g)
        coded = self._inner_read(a, b)[:, :, start - a:cut - a]
        if cut == end:
            return coded
        if scratch is None or self.dtype != torch.float32 or torch.is_grad_enabled():
            return torch.cat((coded, window), dim=2)
        pool, role = scratch
        out = pool.view(role, coded.shape[0], coded.shape[1], end - start, self.dim, coded.device)
        out[:, :, :cut - start] = coded
        out[:, :, cut - start:] = window
        return out

    def _inner_write(self, start: int, x: torch.Tensor) -> None:
        """Encode tokens [start, start+S) (whole flush groups) into the coded store (checked on entry)."""
        self.inner.write(start, x, checked=True)

    def _inner_read(self, start: int, end: int) -> torch.Tensor:
        """Decode coded tokens [start, end) (whole flush groups)."""
        return self.inner.read(start, end)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("a residual store is appended to, not written by slot")

    def snapshot(self) -> tuple:
        """Everything :meth:`restore` needs to put this store back (codes, window and counters), copied."""
        return [t.clone() for t in self.tensors()], self.fp.clone(), self.flushed, self.length

    def restore(self, saved: tuple) -> None:
        tensors, fp, self.flushed, self.length = saved
        self.set_tensors(tensors)
        self.fp = fp
        self.epoch += 1

    def map_sequences(self, fn) -> None:
        self.inner.map_sequences(fn)
        self.fp = fn(self.fp)
        self.epoch += 1

    def allocated_nbytes(self) -> int:
        return self.inner.allocated_nbytes() + self.fp.numel() * self.fp.element_size() + rotated_tail_nbytes(self)

    def reset(self) -> None:
        self.flushed = self.length = 0
        self.epoch += 1
        self.nonfinite = None
        self.inner.reset()

    def nbytes(self, used_slots: int) -> int:
        """Codes of the flushed tokens plus the full-precision window, for the first ``used_slots`` tokens."""
        coded = min(self.flushed, used_slots)
        b, h = self.fp.shape[:2]
        return self.inner.nbytes(coded) + b * h * (used_slots - coded) * self.dim * self.dtype.itemsize


class RingResidualStore(ResidualStore):
    """A :class:`ResidualStore` whose coded tokens live in a ring of ``slots`` token slots (a multiple of
    ``spec.flush``): coded position p sits in slot ``p mod slots``, so only the most recent ``slots`` coded tokens
    survive. Positions stay absolute for :meth:`write` / :meth:`read` (sliding-window layers,
    :class:`kvslim.caches.window.ResidualRingLayer`); reading a position whose slot was overwritten is an error
    of the caller (the layer sizes the ring so that every position it can still attend survives).
    """

    def __init__(self, spec: StoreSpec, inner: TensorStore, batch: int, heads: int, dim: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__(spec, inner, batch, heads, dim, dtype, device)
        self.slots = inner.capacity
        if self.slots % spec.flush:
            raise ValueError(f"ring of {self.slots} coded slots must be a multiple of flush={spec.flush}")

    def _runs(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """Positions [start, end) as (slot, offset in the span, length) runs that do not wrap."""
        out, p = [], start
        while p < end:
            slot = p % self.slots
            n = min(end - p, self.slots - slot)
            out.append((slot, p - start, n))
            p += n
        return out

    def _inner_write(self, start: int, x: torch.Tensor) -> None:
        skip = max(0, x.shape[2] - self.slots)  # a long write keeps only the last ``slots`` tokens (group aligned)
        for slot, off, n in self._runs(start + skip, start + x.shape[2]):
            self.inner.write(slot, x[:, :, skip + off:skip + off + n], checked=True)

    def _inner_read(self, start: int, end: int) -> torch.Tensor:
        if start < self.flushed - self.slots:
            raise RuntimeError(f"coded tokens [{start}, {end}) have left the ring of {self.slots} slots "
                               f"({self.flushed} tokens coded)")
        pieces = [self.inner.read(slot, slot + n) for slot, _, n in self._runs(start, end)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)

    def coded_slots(self) -> int:
        """Ring slots that hold coded tokens."""
        return min(self.flushed, self.slots)

    def slot_positions(self) -> torch.Tensor:
        """(slots,) int64: the position each ring slot holds (−1: never written)."""
        j = torch.arange(self.slots, device=self.fp.device)  # on the device: used with its masks (fused.py)
        f = self.flushed
        pos = j + self.slots * torch.div(f - 1 - j, self.slots, rounding_mode="floor")
        return torch.where(j < f, pos, torch.full_like(pos, -1))

    def nbytes(self, used_slots: int) -> int:
        """Bytes of the coded slots in use plus the full-precision window's tokens (``used_slots`` is ignored:
        the ring holds what it holds, a little more than the visible tokens, see ``ResidualRingLayer``)."""
        b, h = self.fp.shape[:2]
        return (self.inner.nbytes(self.coded_slots())
                + b * h * (self.length - self.flushed) * self.dim * self.dtype.itemsize)


def make_ring_residual_store(spec: StoreSpec, like: torch.Tensor, slots: int) -> RingResidualStore:
    """A :class:`RingResidualStore` for tensors shaped like ``like`` (B, H, S, D) with ``slots`` coded slots."""
    b, h, _, d = like.shape
    cls = ChannelQuantizedStore if spec.channel_group else QuantizedStore
    inner = cls(spec, b, h, slots, d, like.dtype, like.device)
    return RingResidualStore(spec, inner, b, h, d, like.dtype, like.device)
