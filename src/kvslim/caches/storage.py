"""Token-indexed tensor stores: the bytes every cache layer keeps, plain or quantized.

A store holds one tensor family of shape (B, H, capacity, D) in token slots. Cache layers decide *which*
slot a token goes to (append, ring); stores decide *how* it is kept (as is, or grouped int8/int4 codes
plus scales, quantized once at write time and never re-quantized).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.quant import check_quant_args, codes_width, dequantize, dequantize_into, quantize


@dataclass(frozen=True)
class StoreSpec:
    """How a store keeps values: ``bits`` 0 (as is), 8 or 4; ``group_size`` and ``scale_dtype`` for quantized.

    ``smooth`` (quantized only) divides each channel by a per-sequence, per-head factor before the grouped
    quantization and multiplies it back on read: ``sqrt(max_t |x[t, c]|)`` over the first write (the prefill),
    kept in fp32 (D values per head per sequence). Keys have outlier channels that otherwise set every group's
    scale. On SmolLM2 (256 tokens of the demo text, group 64): int4 keys alone +31 % perplexity without it;
    int4 keys and values +5.3 % with it (``kvslim demo``, full text: +6.2 %).
    """

    bits: int = 0
    group_size: int = 64
    scale_dtype: torch.dtype = torch.float32
    smooth: bool = False

    def __post_init__(self) -> None:
        if self.bits not in (0, 4, 8):
            raise ValueError(f"bits must be 0, 4 or 8, got {self.bits!r}")
        if self.scale_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"scale_dtype must be float32, float16 or bfloat16, got {self.scale_dtype}")

    def bytes_per_value_row(self, dim: int, dtype: torch.dtype) -> int:
        """Exact bytes to keep one row of ``dim`` values (one token, one head)."""
        if self.bits == 0:
            return dim * dtype.itemsize
        check_quant_args(dim, self.bits, self.group_size)
        return codes_width(dim, self.bits) + (dim // self.group_size) * self.scale_dtype.itemsize


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

    def write(self, start: int, x: torch.Tensor) -> None:
        """Write ``x`` (B, H, S, D) into slots [start, start+S)."""
        self.data[:, :, start:start + x.shape[2]] = x

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
    """Grouped symmetric int8/int4 storage: codes (B, H, capacity, D or D/2) and scales (B, H, capacity, D/G)."""

    def __init__(self, spec: StoreSpec, batch: int, heads: int, capacity: int, dim: int,
                 dtype: torch.dtype, device: torch.device):
        check_quant_args(dim, spec.bits, spec.group_size)
        self.spec, self.dtype, self.dim = spec, dtype, dim
        code_dtype = torch.int8 if spec.bits == 8 else torch.uint8
        self.data = torch.empty(batch, heads, capacity, codes_width(dim, spec.bits), dtype=code_dtype, device=device)
        self.scale = torch.empty(batch, heads, capacity, dim // spec.group_size, dtype=spec.scale_dtype,
                                 device=device)
        self.channel: torch.Tensor | None = None  # (B, H, 1, D) fp32 smoothing factors, set by the first write

    def tensors(self) -> list[torch.Tensor]:
        return [self.data, self.scale]

    def set_tensors(self, tensors: list[torch.Tensor]) -> None:
        self.data, self.scale = tensors

    def _channel_for(self, x: torch.Tensor) -> torch.Tensor | None:
        """The smoothing factors in force, fixed from ``x`` by the first write (or roundtrip) of this store."""
        if self.spec.smooth and self.channel is None:
            amax = x.detach().float().abs().amax(dim=2, keepdim=True)  # (B, H, 1, D)
            floor = amax.amax(dim=-1, keepdim=True) * 1e-3 + torch.finfo(torch.float32).tiny
            self.channel = torch.maximum(amax, floor).sqrt()
        return self.channel

    def _encode(self, x: torch.Tensor, channel: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize(x if channel is None else x.float() / channel, self.spec.bits, self.spec.group_size,
                        self.spec.scale_dtype)

    def _decode(self, codes: torch.Tensor, scale: torch.Tensor, channel: torch.Tensor | None) -> torch.Tensor:
        if channel is None:
            return dequantize(codes, scale, self.spec.bits, self.spec.group_size, self.dtype)
        return (dequantize(codes, scale, self.spec.bits, self.spec.group_size) * channel).to(self.dtype)

    def write(self, start: int, x: torch.Tensor) -> None:
        channel = self._channel_for(x)
        codes, scale = self._encode(x, channel)
        end = start + x.shape[2]
        self.data[:, :, start:end] = codes
        self.scale[:, :, start:end] = scale

    def read(self, start: int, end: int, scratch: tuple[ScratchPool, str] | None = None) -> torch.Tensor:
        codes, scale = self.data[:, :, start:end], self.scale[:, :, start:end]
        if scratch is None or self.dtype != torch.float32 or torch.is_grad_enabled():
            return self._decode(codes, scale, self.channel)
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

    def nbytes(self, used_slots: int) -> int:
        fixed = 0 if self.channel is None or used_slots == 0 else self.channel.numel() * 4
        return super().nbytes(used_slots) + fixed


def make_store(spec: StoreSpec, like: torch.Tensor, capacity: int) -> TensorStore:
    """A store for tensors shaped like ``like`` (B, H, S, D) with ``capacity`` token slots."""
    b, h, _, d = like.shape
    cls = TensorStore if spec.bits == 0 else QuantizedStore
    return cls(spec, b, h, capacity, d, like.dtype, like.device)
