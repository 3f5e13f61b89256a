"""KV-cache quantization formats beyond SPEC §1: asymmetric codes, 2-bit packing, Hadamard rotation.

* Symmetric (SPEC §1, :mod:`kvslim.ops.quant`): ``x ≈ q·scale``, signed codes in ``[-(2^(b-1)-1), 2^(b-1)-1]``.
* Asymmetric (min/max, as quanto / KIVI): per group ``zero = min(x)``, ``scale = (max(x) - min(x)) / (2^b - 1)``,
  unsigned codes ``q = clamp(round((x - zero) / scale), 0, 2^b - 1)``, ``x ≈ q·scale + zero``. Scale and zero are
  kept in ``scale_dtype``; codes are computed from the *stored* (rounded) scale and zero so that decoding matches.
* Packing (:func:`pack_codes`): ``8 // bits`` codes per byte, element ``i·k + j`` in bits ``[j·b, (j+1)·b)``
  (low bits first; for 4 bits the SPEC §1 layout: even index in the low nibble). Signed codes are packed in
  two's complement. 3 bits: every 8 codes fill 3 bytes, code ``8i + j`` in bits ``[3j, 3j+3)`` of the 24-bit
  little-endian word ``byte[3i] | byte[3i+1] << 8 | byte[3i+2] << 16`` (D a multiple of 8).
* Rotation (:func:`hadamard`): a normalized Sylvester–Hadamard matrix ``R`` (D×D, orthogonal, symmetric);
  a store keeps ``x·R`` and reads back ``(x·R)·Rᵀ = x``. It spreads a channel outlier over all channels (QuaRot).
"""

from __future__ import annotations

import functools

import torch

PACKED_BITS = (2, 3, 4, 8)


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes (..., D) into uint8 (..., D·bits/8). 8 bits: returned as is (int8 or uint8)."""
    if bits == 8:
        return q
    if bits == 3:
        word = (q.to(torch.int32) & 7).unflatten(-1, (-1, 8))  # (..., D/8, 8)
        word = (word << torch.arange(0, 24, 3, dtype=torch.int32, device=q.device)).sum(-1, dtype=torch.int32)
        out = torch.stack([(word >> s) & 0xFF for s in (0, 8, 16)], dim=-1)  # (..., D/8, 3)
        return out.to(torch.uint8).flatten(-2)
    per = 8 // bits
    mask = (1 << bits) - 1
    nib = (q.to(torch.int16) & mask).to(torch.uint8).unflatten(-1, (-1, per))  # (..., D/per, per)
    out = nib[..., 0].clone()
    for j in range(1, per):
        out |= nib[..., j] << (j * bits)
    return out


def unpack_codes(packed: torch.Tensor, bits: int, signed: bool) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: uint8 (..., D·bits/8) -> int8 (signed, sign-extended) or uint8 (..., D).

    On the CPU (not traced) by one table lookup per byte (2 and 4 bits: 256 × 8/bits codes) or per 12-bit half
    of a 3-byte word (3 bits: 4,096 × 4 codes): the same integers as :func:`unpack_codes_reference`, whose shifts
    on uint8 tensors run element by element in torch's CPU kernels (a multi-token call over a coded prompt cache
    decodes the whole history through here, every layer: 16k tokens × 64 channels per head)."""
    if bits == 8:
        return packed
    if packed.device.type != "cpu" or torch.compiler.is_compiling():
        return unpack_codes_reference(packed, bits, signed)
    table = _unpack_table(bits, signed)  # (256 | 4096, codes per entry)
    shape = (*packed.shape[:-1], packed.shape[-1] * 8 // bits)  # (..., D)
    if bits == 3:
        word = packed.unflatten(-1, (-1, 3)).to(torch.int32)  # (..., D/8, 3)
        word = word[..., 0] | (word[..., 1] << 8) | (word[..., 2] << 16)  # (..., D/8) 24-bit words
        halves = torch.stack((word & 0xFFF, word >> 12), dim=-1)  # (..., D/8, 2): codes 0-3, codes 4-7
        return table.index_select(0, halves.reshape(-1)).view(shape)
    index = packed.to(torch.int32).reshape(-1)  # (N·D·bits/8,)
    return table.index_select(0, index).view(shape)


@functools.cache
def _unpack_table(bits: int, signed: bool) -> torch.Tensor:
    """The codes of every byte (2, 4 bits: (256, 8/bits)) or 12-bit half word (3 bits: (4096, 4)), CPU, built once
    by :func:`unpack_codes_reference` (a constant of the format, not state)."""
    if bits == 3:  # a 12-bit half holds 4 codes: as the low half of a 3-byte word
        half = torch.arange(4096, dtype=torch.int32, device="cpu")
        words = torch.stack((half & 0xFF, half >> 8, torch.zeros_like(half)), dim=-1).to(torch.uint8)
        return unpack_codes_reference(words, 3, signed)[:, :4].contiguous()
    return unpack_codes_reference(torch.arange(256, dtype=torch.uint8, device="cpu")[:, None], bits, signed)


def unpack_codes_reference(packed: torch.Tensor, bits: int, signed: bool) -> torch.Tensor:
    """:func:`unpack_codes` by shifts and masks, code by code: the reference the table lookup is tested against
    (and the path a traced or non-CPU call takes)."""
    if bits == 8:
        return packed
    if bits == 3:
        b = packed.to(torch.int32).unflatten(-1, (-1, 3))  # (..., D/8, 3)
        word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
        q = torch.stack([(word >> (3 * j)) & 7 for j in range(8)], dim=-1).flatten(-2).to(torch.uint8)
    else:
        per, mask = 8 // bits, (1 << bits) - 1
        parts = [(packed >> (j * bits)) & mask for j in range(per)]
        q = torch.stack(parts, dim=-1).flatten(-2)  # (..., D)
    if not signed:
        return q
    half = 1 << (bits - 1)
    return (q.to(torch.int8) ^ half) - half


def asym_params(x: torch.Tensor, bits: int, group_size: int,
                scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group ``(scale, zero)`` of ``x`` (..., D) -> two (..., D/G) tensors in ``scale_dtype``."""
    groups = x.float().unflatten(-1, (-1, group_size))  # (..., D/G, G)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    info = torch.finfo(scale_dtype)
    scale = ((hi - lo) / ((1 << bits) - 1)).clamp(info.tiny, info.max).to(scale_dtype)
    zero = lo.clamp(-info.max, info.max).to(scale_dtype)
    return scale, zero


def quantize_asym(x: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype = torch.float32
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric codes of ``x`` (..., D): ``(packed codes uint8 (..., D·bits/8), scale, zero)``."""
    scale, zero = asym_params(x, bits, group_size, scale_dtype)
    groups = x.float().unflatten(-1, (-1, group_size))  # (..., D/G, G)
    q = torch.round((groups - zero.float().unsqueeze(-1)) / scale.float().unsqueeze(-1))
    q = q.clamp_(0, (1 << bits) - 1).flatten(-2).to(torch.uint8)
    return pack_codes(q, bits), scale, zero


def dequantize_asym(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group_size: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_asym`: ``q·scale + zero`` as (..., D) in ``dtype``."""
    q = unpack_codes(codes, bits, signed=False).unflatten(-1, (-1, group_size)).float()  # (..., D/G, G)
    return (q * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)).flatten(-2).to(dtype)


def quantize_sym(x: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype = torch.float32
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """SPEC §1 symmetric codes at 2, 3, 4 or 8 bits: ``(packed codes, scale)`` (2 bits: codes in {-1, 0, 1})."""
    qm = (1 << (bits - 1)) - 1
    groups = x.float().unflatten(-1, (-1, group_size))  # (..., D/G, G)
    info = torch.finfo(scale_dtype)
    scale = (groups.abs().amax(dim=-1) / qm).clamp(info.tiny, info.max).to(scale_dtype)
    q = torch.round(groups / scale.float().unsqueeze(-1)).clamp_(-qm, qm).flatten(-2).to(torch.int8)
    return pack_codes(q, bits), scale


def dequantize_sym(codes: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_sym`: ``q·scale`` as (..., D) in ``dtype``."""
    q = unpack_codes(codes, bits, signed=True).unflatten(-1, (-1, group_size)).float()  # (..., D/G, G)
    return (q * scale.float().unsqueeze(-1)).flatten(-2).to(dtype)


def hadamard(dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Normalized Sylvester–Hadamard matrix (dim, dim): orthogonal and symmetric; ``dim`` a power of two."""
    if not isinstance(dim, int) or dim < 1 or dim & (dim - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head dimension, got {dim!r}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h / dim ** 0.5).to(dtype)
