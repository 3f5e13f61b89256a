"""Token-indexed tensor stores: the bytes every cache layer keeps, plain or quantized.

A store holds one tensor family of shape (B, H, capacity, D) in token slots. Cache layers decide *which*
slot a token goes to (append, ring); stores decide *how* it is kept (as is, or grouped int8/int4 codes
plus scales, quantized once at write time and never re-quantized).

The format itself (:class:`~kvslim.caches.spec.StoreSpec`: validation, bytes per row) is in :mod:`kvslim.caches.spec`;
``StoreSpec`` is importable from here too (tests and benchmarks do).
"""

from __future__ import annotations

import math

import torch

from ..ops.quant import dequantize, dequantize_into, quantize
from ..ops.quant_formats import dequantize_asym, dequantize_sym, hadamard, quantize_asym, quantize_sym
from .spec import StoreSpec


def check_finite(x: torch.Tensor, owner: object | None = None) -> None:
    """``ValueError`` when ``x`` (the key or value states about to be quantized) holds ``inf`` or ``nan``.

    Grouped codes cannot represent a non-finite value: an ``inf`` would set its group's scale to the largest
    float and round every finite neighbour to 0, a ``nan`` would turn the whole group to ``nan``. Quantized stores
    refuse such a write instead (nothing is written); a plain store keeps them as the model made them.

    A write of one token per sequence (a decode step) with an ``owner`` is not read back to the host (no device
    synchronisation per step, docs/gpu.md): whether it held inf/nan is OR-ed into ``owner.nonfinite`` on the device
    and :func:`raise_deferred` refuses by name at the next host boundary (a multi-token update of the layer,
    ``KVSlimCache.check_finite``).
    """
    if owner is not None and x.shape[-2] == 1:
        bad = ~torch.isfinite(x).all()  # 0-dim bool on x's device
        flag = getattr(owner, "nonfinite", None)
        if flag is None or flag.device != bad.device:
            owner.nonfinite = bad
        else:
            flag.logical_or_(bad)  # in place: a CUDA graph replays it
        return
    if math.isfinite(x.sum(dtype=torch.float32).item()):  # inf/nan always reach the sum: one cheap op per write
        return
    if not bool(torch.isfinite(x).all()):  # the sum overflowed (or a value is not finite): look element-wise
        bad = (~torch.isfinite(x)).nonzero()[0].tolist()  # (b, h, s, d) of the first one
        raise ValueError(f"key/value states hold a non-finite value ({x[tuple(bad)].item()} at batch {bad[0]}, "
                         f"head {bad[1]}, token {bad[2]} of this write, channel {bad[3]}): a quantized cache "
                         "cannot store inf/nan (it would silently zero or poison the rest of its group); nothing "
                         "was written. Fix the overflow in the model (e.g. run it in float32 or bfloat16) or use "
                         "an unquantized method (dense, window, slim, mla without bits)")


def raise_deferred(owner: object) -> None:
    """Raise the ``ValueError`` of :func:`check_finite` when a decode step since the last check wrote inf/nan into
    ``owner`` (its ``nonfinite`` flag, read here: one host synchronisation at a host boundary). The flag stays set
    (the codes of those tokens' groups are lost) until the owner is reset."""
    flag = getattr(owner, "nonfinite", None)
    if flag is not None and bool(flag):
        raise ValueError("key/value states of an earlier decode step held a non-finite value (inf/nan): a quantized "
                         "cache cannot store inf/nan, and decode steps are checked on the device, without stopping "
                         "(docs/gpu.md), so those tokens' groups were written and are lost. Reset the cache; fix the "
                         "overflow in the model (e.g. run it in float32 or bfloat16) or use an unquantized method "
                         "(dense, window, slim, mla without bits)")


def _kept(buf: torch.Tensor, pos: torch.Tensor, new: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """``new``, or where ``keep`` (1-element bool, on the device) is true what ``buf`` holds at slots ``pos``."""
    return new if keep is None else torch.where(keep, buf.index_select(2, pos), new)


class ScratchPool:
    """Reusable float32 buffers for dequantized reads, shared by the layers of one cache.

    A decoder consumes layer ℓ's keys and values before it asks for layer ℓ+1's, so one K and one V buffer
    serve every layer: a decode step then dequantizes the history without allocating (and page-faulting)
    gigabytes of fresh memory. The price: a tensor returned by a quantized read is valid until the next read
    of the same role.
    """

    def __init__(self, chunk: int = 256):
        self.chunk = chunk
        self.buffers: dict[str, torch.Tensor] = {}
        #: values one decode step derives once for every layer (sparse decode's view of the step's attention mask,
        #: keyed by that mask's identity and version): ``attention/sparse.py``
        self.memo: dict = {}

    def __getstate__(self) -> dict:
        return {"chunk": self.chunk, "buffers": {}}  # scratch holds nothing to keep: a copied cache makes its own

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.memo = {}

    def flat(self, role: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A reusable 1-D buffer of at least ``numel`` elements of ``dtype`` (sparse decode's gathered pages,
        ``attention/sparse.py``): valid until the next request of the same role."""
        key = f"flat:{role}"
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            size = max(numel, 0 if buf is None or buf.dtype != dtype else buf.numel() * 3 // 2)
            buf = self.buffers[key] = torch.empty(size, dtype=dtype, device=device)
        return buf[:numel]

    def view(self, role: str, batch: int, heads: int, tokens: int, dim: int, device: torch.device) -> torch.Tensor:
        buf = self.buffers.get(role)
        if buf is None or buf.shape[0] != batch or buf.shape[1] < heads or buf.shape[2] < tokens \
                or buf.shape[3] != dim or buf.device != device:
            cap = -(-tokens // self.chunk) * self.chunk
            if buf is not None and buf.shape[:2] == (batch, heads) and buf.shape[3] == dim:
                cap = max(cap, buf.shape[2] + buf.shape[2] // 2)
            buf = self.buffers[role] = torch.empty(batch, heads, cap, dim, dtype=torch.float32, device=device)
        return buf[:, :heads, :tokens]


class TensorStore:
    """Plain storage (B, H, capacity, D) in the model's dtype."""

    def __init__(self, spec: StoreSpec, batch: int, heads: int, capacity: int, dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.spec, self.dtype, self.dim = spec, dtype, dim
        self.data = torch.empty(batch, heads, capacity, dim, dtype=dtype, device=device)

    @property
    def capacity(self) -> int:
        return self.data.shape[2]

    def tensors(self) -> list[torch.Tensor]:
        return [self.data]

    def set_tensors(self, tensors: list[torch.Tensor]) -> None:
        (self.data,) = tensors

    def snapshot(self) -> object:
        """A copy of what this store holds, for :meth:`restore` (speculative-decoding rollback of rings)."""
        return [t.clone() for t in self.tensors()]

    def restore(self, saved: object) -> None:
        self.set_tensors(saved)

    def write(self, start: int, x: torch.Tensor) -> None:
        """Write ``x`` (B, H, S, D) into slots [start, start+S)."""
        self.data[:, :, start:start + x.shape[2]] = x

    def write_at(self, pos: torch.Tensor, x: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """Write ``x`` (B, H, S, D) into slots ``pos`` (S,) int64, a device tensor (the static path of
        ``caches/capture.py``: the shapes of the write do not depend on where it goes). ``keep`` (a 1-element bool
        tensor): when true, the slots are rewritten with what they hold (a refused write, decided on the device)."""
        self.data.index_copy_(2, pos, _kept(self.data, pos, x.to(self.data.dtype), keep))

    def read(self, start: int, end: int, scratch: tuple[ScratchPool, str] | None = None) -> torch.Tensor:
        """Slots [start, end) as (B, H, end-start, D) in the model dtype (a view when possible).

        ``scratch``: a pool and a role under which a quantized store may write its dequantized output.
        """
        return self.data[:, :, start:end]

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as it would read back after a write (identity for plain storage)."""
        return x

    def allocated_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def reset(self) -> None:
        """Called when the owning layer forgets its tokens."""

    def map_sequences(self, fn) -> None:
        """Apply ``fn`` (a batch-axis reindexing) to every tensor held per sequence."""
        self.set_tensors([fn(t) for t in self.tensors()])

    def nbytes(self, used_slots: int) -> int:
        b, h = self.data.shape[:2]
        return b * h * used_slots * self.spec.bytes_per_value_row(self.dim, self.dtype)


class QuantizedStore(TensorStore):
    """Grouped int8/int4/int3/int2 storage, per token: codes (B, H, capacity, D·bits/8) and scales
    (B, H, capacity, D/G); asymmetric adds ``zero`` (same shape as ``scale``, ``x ≈ q·scale + zero``).

    Symmetric codes are signed (SPEC §1; int4 two's-complement nibbles), asymmetric ones unsigned (see
    :mod:`kvslim.ops.quant_formats`). With ``rotation`` set, ``rotation`` is the D×D orthogonal R and the codes
    hold ``x·R``; :meth:`read` returns values in the original basis.
    """

    def __init__(self, spec: StoreSpec, batch: int, heads: int, capacity: int, dim: int,
                 dtype: torch.dtype, device: torch.device):
        spec.check_dim(dim)
        self.spec, self.dtype, self.dim = spec, dtype, dim
        code_dtype = torch.int8 if spec.bits == 8 and not spec.asymmetric else torch.uint8
        self.data = torch.empty(batch, heads, capacity, dim * spec.bits // 8, dtype=code_dtype, device=device)
        groups = dim // spec.channel_group if spec.channel_group else dim // spec.group_size
        self.scale = torch.empty(batch, heads, capacity, groups, dtype=spec.scale_dtype, device=device)
        self.zero = torch.empty_like(self.scale) if spec.asymmetric else None
        self.rotation = hadamard(dim).to(device) if spec.rotation == "hadamard" else None  # (D, D) fp32
        # Rᵀ, contiguous: the fused decode op takes its coded values' weighted sum back with it (attention/quant.py)
        self.unrotation = None if self.rotation is None else self.rotation.T.contiguous()
        self.channel: torch.Tensor | None = None  # (B, H, 1, D) fp32 smoothing factors, set by the first write

    def tensors(self) -> list[torch.Tensor]:
        return [self.data, self.scale] + ([] if self.zero is None else [self.zero])

    def set_tensors(self, tensors: list[torch.Tensor]) -> None:
        self.data, self.scale = tensors[:2]
        if self.zero is not None:
            self.zero = tensors[2]

    def _channel_for(self, x: torch.Tensor) -> torch.Tensor | None:
        """The smoothing factors in force, fixed from ``x`` by the first write (or roundtrip) of this store."""
        if self.spec.smooth and self.channel is None:
            amax = x.detach().float().abs().amax(dim=2, keepdim=True)  # (B, H, 1, D)
            floor = amax.amax(dim=-1, keepdim=True) * 1e-3 + torch.finfo(torch.float32).tiny
            self.channel = torch.maximum(amax, floor).sqrt()
        return self.channel

    @property
    def _spec1(self) -> bool:
        """Plain SPEC §1 codes (symmetric int8/int4, no rotation): the fast dequantize-into-scratch path."""
        return not self.spec.asymmetric and self.rotation is None and self.spec.bits in (4, 8)

    def _to_stored_basis(self, x: torch.Tensor, channel: torch.Tensor | None) -> torch.Tensor:
        y = x if channel is None else x.float() / channel
        return y if self.rotation is None else y.float() @ self.rotation  # (B, H, S, D) · (D, D)

    def _from_stored_basis(self, y: torch.Tensor, channel: torch.Tensor | None) -> torch.Tensor:
        """``y`` (B, H, S, D) fp32 decoded codes -> values in the original basis, fp32 (may reuse ``y``)."""
        if self.rotation is not None:
            y = y @ self.rotation.T
        return y if channel is None else y.mul_(channel)

    def _encode(self, x: torch.Tensor, channel: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``x`` (B, H, S, D) -> (codes, scale, zero or None)."""
        y, sp = self._to_stored_basis(x, channel), self.spec
        if sp.asymmetric:
            return quantize_asym(y, sp.bits, sp.group_size, sp.scale_dtype)
        if sp.bits in (2, 3):
            return (*quantize_sym(y, sp.bits, sp.group_size, sp.scale_dtype), None)
        return (*quantize(y, sp.bits, sp.group_size, sp.scale_dtype), None)

    def _decode(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                channel: torch.Tensor | None) -> torch.Tensor:
        sp = self.spec
        if self._spec1 and channel is None:
            return dequantize(codes, scale, sp.bits, sp.group_size, self.dtype)
        if zero is not None:
            y = dequantize_asym(codes, scale, zero, sp.bits, sp.group_size)
        elif sp.bits in (2, 3):
            y = dequantize_sym(codes, scale, sp.bits, sp.group_size)
        else:
            y = dequantize(codes, scale, sp.bits, sp.group_size)
        return self._from_stored_basis(y, channel).to(self.dtype)

    def write(self, start: int, x: torch.Tensor, *, checked: bool = False) -> None:
        """Quantize ``x`` (B, H, S, D) into slots [start, start+S); ``ValueError`` on inf/nan (see
        :func:`check_finite`; a one-token write is checked on the device), nothing written. ``checked``: the caller
        has already checked ``x`` (a residual window's flush)."""
        from ..kernels import quant_write as qw

        sp = self.spec  # decode steps of plain SPEC §1 stores: one C++ call, bit-identical (kernels/quant_write.py)
        if (self._spec1 and not sp.channel_group and (self.channel is not None or not sp.smooth)
                and qw.applies(x, self.data)):
            if qw.quant_write(x, self.channel, sp.bits, sp.group_size, start, self.data, self.scale):
                return
        if not checked:
            check_finite(x, self)
        channel = self._channel_for(x)
        codes, scale, zero = self._encode(x, channel)
        end = start + x.shape[2]
        self.data[:, :, start:end] = codes
        self.scale[:, :, start:end] = scale
        if zero is not None:
            self.zero[:, :, start:end] = zero

    def write_at(self, pos: torch.Tensor, x: torch.Tensor, keep: torch.Tensor | None = None, *,
                 checked: bool = False) -> None:
        """Quantize ``x`` (B, H, S, D) into slots ``pos`` (S,) int64 on the device (``caches/capture.py``); the
        checks of :meth:`write` (a one-token write: the device-side non-finite flag) unless ``checked`` (a flush of
        tokens checked when they were written, ``caches/capture_residual.py``); ``keep`` as
        :meth:`TensorStore.write_at`."""
        if not checked:
            check_finite(x, self)
        codes, scale, zero = self._encode(x, self._channel_for(x))
        self.data.index_copy_(2, pos, _kept(self.data, pos, codes, keep))
        self.scale.index_copy_(2, pos, _kept(self.scale, pos, scale, keep))
        if zero is not None:
            self.zero.index_copy_(2, pos, _kept(self.zero, pos, zero, keep))

    def read(self, start: int, end: int, scratch: tuple[ScratchPool, str] | None = None) -> torch.Tensor:
        codes, scale = self.data[:, :, start:end], self.scale[:, :, start:end]
        zero = None if self.zero is None else self.zero[:, :, start:end]
        if scratch is None or self.dtype != torch.float32 or torch.is_grad_enabled() or not self._spec1:
            return self._decode(codes, scale, zero, self.channel)
        pool, role = scratch
        b, h = codes.shape[:2]
        out = dequantize_into(codes, scale, self.spec.bits, self.spec.group_size,
                              pool.view(role, b, h, end - start, self.dim, codes.device))
        return out if self.channel is None else out.mul_(self.channel)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        channel = self._channel_for(x)
        return self._decode(*self._encode(x, channel), channel)

    def map_sequences(self, fn) -> None:
        super().map_sequences(fn)
        if self.channel is not None:
            self.channel = fn(self.channel)

    def allocated_nbytes(self) -> int:
        return super().allocated_nbytes() + (0 if self.channel is None else self.channel.numel() * 4)

    def reset(self) -> None:
        self.channel = None
        self.nonfinite = None

    def nbytes(self, used_slots: int) -> int:
        fixed = 0 if self.channel is None or used_slots == 0 else self.channel.numel() * 4
        return super().nbytes(used_slots) + fixed

