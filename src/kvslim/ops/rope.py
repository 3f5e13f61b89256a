"""Rotary position embedding (RoPE) forward and inverse from a cos/sin table (HF "rotate_half" layout).

Partial rotary (Phi-3 style) is supported: only the first ``cos.shape[-1]`` channels rotate.
The inverse rotates by −θ with the *same* table, so ``unrotate(rotate(x)) == x`` up to rounding.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (−x2, x1)`` on the last axis (HF's convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _split(x: torch.Tensor, rot: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    if rot == x.shape[-1]:
        return x, None
    return x[..., :rot], x[..., rot:]


def table(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (S, 2·len(inv_freq)) of ``positions`` (S,) as HF's rotary embedding builds them: position × inverse
    frequency in ``inv_freq``'s dtype, both halves."""
    freqs = positions.to(inv_freq.dtype)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE by +θ: ``x·cos + rotate_half(x)·sin``.

    Args:
        x: (..., T, D) with ``cos``/``sin`` broadcastable to (..., T, R), R ≤ D even.
    """
    xr, xp = _split(x, cos.shape[-1])
    # rotate_half(x)·sin == roll(x, R/2)·[−sin₁, sin₂] (sin has equal halves): same values, fewer passes
    half = cos.shape[-1] // 2
    signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    out = xr * cos + xr.roll(half, dims=-1) * signed
    return out if xp is None else torch.cat((out, xp), dim=-1)


def unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE by −θ with the same table: ``x·cos − rotate_half(x)·sin`` (inverse of :func:`rotate`)."""
    xr, xp = _split(x, cos.shape[-1])
    out = xr * cos - rotate_half(xr) * sin
    return out if xp is None else torch.cat((out, xp), dim=-1)


def rotate_heads(rows: torch.Tensor, h: int, dk: int, cos: torch.Tensor, sin: torch.Tensor,
                 inverse: bool = False) -> torch.Tensor:
    """RoPE (or its inverse) of every head's keys in cached rows, written head-interleaved like the rows.

    Same values as :func:`rotate`/:func:`unrotate` on ``split_heads(rows[..., :h·dk], h)``, in four fused
    multiply(-add) passes over half-width slices into one buffer (no roll, no concatenation, no other
    full-size temporaries).

    Args:
        rows: (B, n, c) with the keys of head j in columns ``j·dk : (j+1)·dk`` (c ≥ h·dk; the rest is ignored).
        h, dk: heads and head size.
        cos, sin: (B|1, n, R) tables, R ≤ dk even.
        inverse: rotate by −θ (un-rotate) instead of +θ.

    Returns:
        (B, n, h·dk) rotated keys, contiguous, in ``rows``' dtype.
    """
    b, n, _ = rows.shape
    r, e = cos.shape[-1], h * dk
    half = r // 2
    if torch.compiler.is_compiling() or (torch.is_grad_enabled()
                                         and (rows.requires_grad or cos.requires_grad or sin.requires_grad)):
        # out= ops have no autograd, and dynamo refuses out= into non-contiguous views (a compiler fuses anyway)
        keys = rows[..., :e].unflatten(-1, (h, dk)).transpose(1, 2)  # (B, h, n, dk)
        out = (unrotate if inverse else rotate)(keys, cos[:, None].to(rows.dtype), sin[:, None].to(rows.dtype))
        return out.transpose(1, 2).reshape(b, n, e)
    out = torch.empty(b, n, e, dtype=rows.dtype, device=rows.device)
    x = rows[..., :e].unflatten(-1, (h, dk))  # (B, n, h, dk)
    o = out.view(b, n, h, dk)
    x1, x2, o1, o2 = x[..., :half], x[..., half:r], o[..., :half], o[..., half:r]
    cos, sin = cos.to(rows.dtype), sin.to(rows.dtype)
    c1, c2 = cos[..., None, :half], cos[..., None, half:]  # (B|1, n, 1, R/2)
    s1, s2 = sin[..., None, :half], sin[..., None, half:]
    sign = 1.0 if inverse else -1.0
    torch.mul(x1, c1, out=o1)
    o1.addcmul_(x2, s1, value=sign)  # +θ: x1·c − x2·s;  −θ: x1·c + x2·s
    torch.mul(x2, c2, out=o2)
    o2.addcmul_(x1, s2, value=-sign)  # +θ: x2·c + x1·s;  −θ: x2·c − x1·s
    if r < dk:
        o[..., r:].copy_(x[..., r:])
    return out
