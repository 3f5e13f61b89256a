"""Grouped symmetric integer quantization (SPEC §1), shared by the operator and every quantized cache.

Per group of ``group_size`` consecutive elements of the last axis:
``scale = max(max|x| / (2^(bits-1) - 1), eps)``, ``q = clamp(round(x / scale), -qmax, qmax)``, ``x ≈ q·scale``.
8 bits store one int8 per value; 4 bits pack two values per uint8 (low nibble = even index).
"""

from __future__ import annotations

import torch

SUPPORTED_BITS = (4, 8)
SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def qmax(bits: int) -> int:
    """Largest code magnitude for ``bits`` (127 for int8, 7 for int4)."""
    return 2 ** (bits - 1) - 1


def check_quant_args(head_dim: int, bits: int, group_size: int, *, bits_name: str = "bits",
                     group_name: str = "group_size") -> None:
    """Raise ``ValueError`` naming the argument when (bits, group_size) cannot quantize rows of ``head_dim``."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{bits_name} must be 4 or 8, got {bits!r}")
    if not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"{group_name} must be a positive int, got {group_size!r}")
    if head_dim % group_size != 0:
        raise ValueError(
            f"{group_name}={group_size} must divide the head dimension {head_dim}; "
            f"divisors that work: {[g for g in range(1, head_dim + 1) if head_dim % g == 0]}"
        )
    if bits == 4 and head_dim % 2 != 0:
        raise ValueError(f"{bits_name}=4 packs two values per byte and needs an even head dimension, got {head_dim}")


#: group sizes a method tries, largest first, when the user names none (a group must divide the head dimension)
PREFERRED_GROUP_SIZES = (64, 32, 16, 8)


def default_group_size(dim: int, preferred: int = 64) -> int:
    """The group size used when none is asked for: ``preferred`` if it divides ``dim``, else the largest of
    :data:`PREFERRED_GROUP_SIZES` below it that does (head dim 96 -> 32, 80 -> 16, 24 -> 8), else the largest
    divisor of ``dim`` not above ``preferred``."""
    for g in (preferred, *(g for g in PREFERRED_GROUP_SIZES if g < preferred)):
        if dim % g == 0:
            return g
    return max(g for g in range(1, min(dim, preferred) + 1) if dim % g == 0)


def codes_width(head_dim: int, bits: int) -> int:
    """Width of the stored code axis: ``head_dim`` for int8, ``head_dim // 2`` bytes for packed int4."""
    return head_dim if bits == 8 else head_dim // 2


def compute_scale(x: torch.Tensor, bits: int, group_size: int,
                  scale_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-group scales of ``x`` (..., D) -> (..., D // group_size) in ``scale_dtype``."""
    groups = x.float().unflatten(-1, (-1, group_size))  # (..., D/G, G)
    scale = groups.abs().amax(dim=-1) / qmax(bits)
    info = torch.finfo(scale_dtype)  # clamp high too: an fp16 scale must not overflow to inf (codes saturate)
    return scale.clamp(info.tiny, info.max).to(scale_dtype)


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Codes of ``x`` (..., D) for given per-group ``scale`` (..., D/G): int8 (..., D) or packed uint8 (..., D/2)."""
    m = qmax(bits)
    groups = x.float().unflatten(-1, (-1, group_size))  # (..., D/G, G)
    q = torch.round(groups / scale.float().unsqueeze(-1)).clamp_(-m, m).flatten(-2).to(torch.int8)
    return q if bits == 8 else pack_int4(q)


def quantize(x: torch.Tensor, bits: int, group_size: int,
             scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (..., D); returns ``(codes, scale)``. The codes use the scale as stored (in ``scale_dtype``)."""
    scale = compute_scale(x, bits, group_size, scale_dtype)
    return quantize_with_scale(x, scale, bits, group_size), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize`: codes (..., D or D/2) and scale (..., D/G) -> (..., D) in ``dtype``."""
    q = codes if bits == 8 else unpack_int4(codes)
    groups = q.unflatten(-1, (-1, group_size)).to(torch.float32)  # (..., D/G, G)
    return (groups * scale.float().unsqueeze(-1)).flatten(-2).to(dtype)


def dequantize_into(codes: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int,
                    out: torch.Tensor) -> torch.Tensor:
    """:func:`dequantize` into a preallocated float32 ``out`` (..., D) (a view is fine): no temporaries the
    size of the output, bit-identical to :func:`dequantize` in float32."""
    if out.dtype != torch.float32:
        raise ValueError(f"out must be float32, got {out.dtype}")
    if bits == 8:
        out.copy_(codes)
    else:  # sign-extend each nibble straight into the even / odd columns
        out[..., 0::2].copy_(((codes & 0xF).to(torch.int8) ^ 8) - 8)
        out[..., 1::2].copy_(((codes >> 4).to(torch.int8) ^ 8) - 8)
    out.unflatten(-1, (-1, group_size)).mul_(scale.unsqueeze(-1))
    return out


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack int8 codes in [-8, 7] (..., D) into uint8 (..., D/2): element 2i in the low nibble, 2i+1 high."""
    nib = (q.to(torch.int16) & 0xF).to(torch.uint8)  # two's-complement nibbles
    return nib[..., 0::2] | (nib[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: uint8 (..., D/2) -> int8 (..., D), sign-extended."""
    lo = (packed & 0xF).to(torch.int8)
    hi = (packed >> 4).to(torch.int8)
    both = torch.stack((lo, hi), dim=-1).flatten(-2)  # (..., D)
    return (both ^ 8) - 8
