"""TurboQuant-class codes (Zandieh et al., arXiv 2504.19874): rotate, then a fixed scalar codebook per coordinate.

One row x (one token, one head, D values) is kept as

* ``y = x·R``, R a seeded random orthogonal D×D matrix: ``"hadamard"`` (random signs, then the normalized
  Walsh–Hadamard matrix: ``R = diag(s)·H/√D``, D a power of two) or ``"orthogonal"`` (Haar-random, any D, the QR
  of a float64 Gaussian matrix). After the rotation every coordinate of ``y`` is close to N(0, ‖x‖²/D) whatever
  ``x`` looked like (for Haar R: exactly ‖x‖/√D times a coordinate of a uniform point on the sphere);
* codes ``q_i`` = the cell of ``y_i·√D/‖x‖`` in the MSE-optimal (Lloyd–Max) codebook of N(0, 1) with 2^b levels,
  precomputed once (:func:`lloyd_max`, float64): no per-group scale, no zero-point;
* one scale per row, ``s = <y, c>/<c, c>`` with ``c`` the code levels (the least-squares fit of the row to its
  codes: it also puts the right length back, where the paper's ``‖x‖/√D`` shrinks every row by the codebook's
  distortion), kept in ``scale_dtype``.

Decode: ``x̂ = (s·c[q])·Rᵀ``. The reference path is pure torch (this module); ``caches/turbo.py`` keeps the codes.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from .quant_formats import hadamard, pack_codes, unpack_codes

TURBO_BITS = (2, 3, 4)  # bits per coordinate of a turbo code (outlier channels: one more, at most 4)
TURBO_ROTATIONS = ("hadamard", "orthogonal")
# Lloyd–Max MSE of N(0, 1) per bit width (Max 1960, Table I; the paper's D_mse): what lloyd_max must reproduce
GAUSSIAN_MSE = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}


def _pdf(x: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def ndtr(x: np.ndarray) -> np.ndarray:
    """Φ(x), the N(0, 1) distribution function, float64 (torch's: scipy may be absent, e.g. on a GPU machine)."""
    return torch.special.ndtr(torch.as_tensor(x, dtype=torch.float64)).numpy()


def ndtri(p: np.ndarray) -> np.ndarray:
    """Φ⁻¹(p), float64 (torch's)."""
    return torch.special.ndtri(torch.as_tensor(p, dtype=torch.float64)).numpy()


@functools.cache
def lloyd_max(bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(levels (2^bits,), boundaries (2^bits − 1,)) of the MSE-optimal scalar quantizer of N(0, 1), float64.

    Lloyd's iteration from the quantile midpoints: boundaries at the midpoints of neighbouring levels, each level
    the mean of N(0, 1) over its cell (``(φ(a) − φ(b)) / (Φ(b) − Φ(a))``), until no level moves by 1e-13; the
    result is made exactly symmetric. Deterministic (no randomness, float64 throughout)."""
    if not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= 4:
        raise ValueError(f"bits must be 1, 2, 3 or 4 for a Lloyd-Max codebook, got {bits!r}")
    n = 1 << bits
    c = ndtri((np.arange(n) + 0.5) / n)
    for _ in range(200_000):
        b = (c[1:] + c[:-1]) / 2
        lo, hi = np.concatenate(([-np.inf], b)), np.concatenate((b, [np.inf]))
        new = (_pdf(lo) - _pdf(hi)) / (ndtr(hi) - ndtr(lo))
        done = np.abs(new - c).max() < 1e-13
        c = new
        if done:
            break
    c = (c - c[::-1]) / 2
    return c, (c[1:] + c[:-1]) / 2


def codebook_mse(levels: np.ndarray) -> float:
    """E[(X − c(X))²] for X ~ N(0, 1) quantized to the nearest of ``levels`` (ascending), in closed form."""
    b = (levels[1:] + levels[:-1]) / 2
    lo, hi = np.concatenate(([-np.inf], b)), np.concatenate((b, [np.inf]))
    p = ndtr(hi) - ndtr(lo)
    first = _pdf(lo) - _pdf(hi)  # ∫ x φ over the cell
    with np.errstate(invalid="ignore"):  # ±inf · 0 at the outer cells: their x·φ(x) is 0
        lo_f, hi_f = np.where(np.isinf(lo), 0.0, lo * _pdf(lo)), np.where(np.isinf(hi), 0.0, hi * _pdf(hi))
    second = p + lo_f - hi_f  # ∫ x² φ over the cell
    return float(np.sum(second - 2 * levels * first + levels * levels * p))


@functools.lru_cache(maxsize=16)
def _levels(bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    levels, bounds = lloyd_max(bits)
    return torch.from_numpy(levels).float(), torch.from_numpy(bounds).float()


def check_rotation(kind: str, dim: int, name: str = "rotation") -> None:
    """``ValueError`` naming ``name`` when a rotation of this ``kind`` cannot take rows of ``dim`` values."""
    if kind not in TURBO_ROTATIONS:
        raise ValueError(f"{name} must be one of {TURBO_ROTATIONS} for a turbo code, got {kind!r}")
    if kind == "hadamard" and (dim < 1 or dim & (dim - 1)):
        raise ValueError(f"{name}='hadamard' needs a power-of-two width, got {dim}; rotation='orthogonal' takes any")


@functools.lru_cache(maxsize=512)
def rotation_matrix(kind: str, dim: int, seed: int) -> torch.Tensor:
    """The (dim, dim) float32 orthogonal R of a turbo code (rows are coded as ``x·R``), seeded, on the CPU."""
    check_rotation(kind, dim)
    g = torch.Generator().manual_seed(int(seed))
    if kind == "hadamard":
        signs = torch.randint(0, 2, (dim,), generator=g, dtype=torch.int64) * 2 - 1
        return (signs.double()[:, None] * hadamard(dim).double()).float()
    a = torch.randn(dim, dim, generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    q = q * torch.sign(torch.diagonal(r))[None, :]  # the Haar measure (sign convention of the QR fixed)
    return q.float()


def level_tables(bits: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(levels, bounds) fp32 of the ``bits`` codebook on ``device``: what :func:`encode` / :func:`decode` take as
    ``tables`` (a store keeps them, so that a compiled step never builds the codebook)."""
    return tuple(t.to(device) for t in _levels(bits))


def encode(x: torch.Tensor, bits: int, rotation: torch.Tensor, scale_dtype: torch.dtype, fit: str = "ls",
           tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x`` (..., d) -> (codes uint8 (..., d) in ``[0, 2^bits)``, scale (..., 1) in ``scale_dtype``).

    ``fit``: ``"ls"`` (the least-squares scale, the library's) or ``"norm"`` (the paper's ``‖x‖/√d``).
    ``tables``: :func:`level_tables` on ``x``'s device (built here when ``None``)."""
    levels, bounds = level_tables(bits, x.device) if tables is None else tables
    y = x.float() @ rotation
    d = y.shape[-1]
    norm = y.norm(dim=-1, keepdim=True)
    u = y * (math.sqrt(d) / norm.clamp_min(torch.finfo(torch.float32).tiny))
    q = torch.searchsorted(bounds, u.contiguous())  # cell index 0 … 2^bits − 1
    c = levels[q]
    info = torch.finfo(scale_dtype)
    if fit == "norm":
        scale = norm / math.sqrt(d)
    else:
        scale = (y * c).sum(-1, keepdim=True) / (c * c).sum(-1, keepdim=True)
    scale = scale.clamp(0, info.max).to(scale_dtype)
    return q.to(torch.uint8), scale


def decode(q: torch.Tensor, scale: torch.Tensor, bits: int, rotation: torch.Tensor,
           tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Inverse of :func:`encode`: (..., d) float32 rows ``(s·c[q])·Rᵀ``."""
    levels = _levels(bits)[0].to(q.device) if tables is None else tables[0]
    return (levels[q.long()] * scale.float()) @ rotation.T


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (..., d) uint8 -> packed uint8 (..., d·bits/8), kvslim's layout (``ops/quant_formats.pack_codes``)."""
    return pack_codes(q, bits)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    return unpack_codes(packed, bits, signed=False)


def packable(width: int, bits: int) -> bool:
    """Whether ``width`` codes of ``bits`` fill whole bytes in kvslim's packing (3 bits: 8 codes in 3 bytes)."""
    return width % (8 if bits == 3 else 8 // bits) == 0
