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
from .storage import QuantizedStore, ScratchPool, StoreSpec, TensorStore, check_finite


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

    def write(self, start: int, x: torch.Tensor) -> None:
        self._check_span(start, x.shape[2])
        super().write(start, x)

    def read(self, start: int, end: int, scratch: tuple[ScratchPool, str] | None = None) -> torch.Tensor:
        self._check_span(start, end - start)
        zero = None if self.zero is None else self.zero[:, :, start:end]
        return self._decode(self.data[:, :, start:end], self.scale[:, :, start:end], zero, self.channel)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("a channel-grouped store is read through a ResidualStore")


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

    def write(self, start: int, x: torch.Tensor) -> None:
        """Append ``x`` (B, H, S, D) at token ``start`` (≤ current length: a shorter start rewinds, as after a
        crop); flush whole groups of the oldest window tokens into codes while more than ``residual`` wait."""
        if start > self.length:
            raise ValueError(f"a residual store appends: start {start} is past its {self.length} tokens")
        check_finite(x)  # refused now, not when the token is flushed into codes later
        if start < self.flushed:  # rewind into coded history: bring the partial group back to the window
            keep = start - start % self.spec.flush
            self.fp[:, :, :start - keep] = self.inner.read(keep, keep + self.spec.flush)[:, :, :start - keep]
            self.flushed = keep
        waiting = start - self.flushed
        n = start + x.shape[2]
        target = max(self.spec.flushed(n), self.flushed)
        if target == self.flushed:  # everything still fits the window
            self.fp[:, :, waiting:waiting + x.shape[2]] = x
        else:
            pending = torch.cat((self.fp[:, :, :waiting], x), dim=2)  # tokens [flushed, n)
            self.inner.write(self.flushed, pending[:, :, :target - self.flushed])
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
        coded = self.inner.read(a, b)[:, :, start - a:cut - a]
        if cut == end:
            return coded
        if scratch is None or self.dtype != torch.float32 or torch.is_grad_enabled():
            return torch.cat((coded, window), dim=2)
        pool, role = scratch
        out = pool.view(role, coded.shape[0], coded.shape[1], end - start, self.dim, coded.device)
        out[:, :, :cut - start] = coded
        out[:, :, cut - start:] = window
        return out

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("a residual store is appended to, not written by slot (ring buffers)")

    def map_sequences(self, fn) -> None:
        self.inner.map_sequences(fn)
        self.fp = fn(self.fp)

    def allocated_nbytes(self) -> int:
        return self.inner.allocated_nbytes() + self.fp.numel() * self.fp.element_size()

    def reset(self) -> None:
        self.flushed = self.length = 0
        self.inner.reset()

    def nbytes(self, used_slots: int) -> int:
        """Codes of the flushed tokens plus the full-precision window, for the first ``used_slots`` tokens."""
        coded = min(self.flushed, used_slots)
        b, h = self.fp.shape[:2]
        return self.inner.nbytes(coded) + b * h * (used_slots - coded) * self.dim * self.dtype.itemsize
