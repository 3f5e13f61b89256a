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
