"""Partial attention over one rank's slice and the log-sum-exp merge across ranks (flash-decoding's split-K).

A rank's partial for queries ``(B, H, T)`` over its keys is the triple
``acc = Σ_j exp(s_j − m)·v_j`` (unnormalised, ``(B, H, T, D)``), ``m = max_j s_j`` and ``l = Σ_j exp(s_j − m)``
(``(B, H, T)``), all fp32. With ``M = max_r m_r`` and ``w_r = exp(m_r − M)`` the exact attention is
``Σ_r w_r·acc_r / Σ_r w_r·l_r``. An empty slice (or all keys masked) contributes ``(0, −inf, 0)``.
``D`` is whatever the values are: head_dim (K/V caches), the d-wide cached row (slim option 2: ``W_KV`` is
applied after the merge) or the latent ``dc`` (MLA: ``W_UV`` after the merge).

Two ways to merge, both exact and identical on every rank:
``"gather"`` — one all-gather of ``(B, H, T, D + 2)`` per layer, merged locally in rank order (each rank sends
(N−1)·P bytes); ``"reduce"`` — an all-reduce(max) of ``m`` then an all-reduce(sum) of ``[w·acc, w·l]`` (2·(N−1)/N·P
bytes, bandwidth-optimal for many ranks). ``"auto"`` gathers for N ≤ 3 and reduces above.
:func:`reference_attention` is the plain float64 formula the merged result is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .group import Comm

MERGES = ("auto", "gather", "reduce")


@dataclass
class Partial:
    """One rank's partial attention: ``acc (B, H, T, D)``, ``m``/``l`` ``(B, H, T)``, fp32."""

    acc: torch.Tensor
    m: torch.Tensor
    l: torch.Tensor  # noqa: E741


def partial_from_scores(scores: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> Partial:
    """Partial over scores ``(B, H, T, n)`` (already scaled) and values ``(B, Hv, n, D)`` with ``H % Hv == 0``
    (query head ``j·H/Hv + i`` reads value head ``j``, HF's ``repeat_kv`` order), or ``(B, n, D)`` shared by all
    heads.

    ``mask``: fp32 additive ``(B|1, 1|H, T, n)`` or bool (True = visible), or ``None``.
    """
    b, h, t, n = scores.shape
    d = values.shape[-1]
    s = scores.float()
    if n == 0:
        return Partial(s.new_zeros(b, h, t, d), s.new_full((b, h, t), float("-inf")), s.new_zeros(b, h, t))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    m = s.amax(dim=-1)  # (B, H, T)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m_safe[..., None])  # masked: exp(-inf) = 0 (finfo.min underflows to 0 as well)
    l = p.sum(dim=-1)  # noqa: E741
    if values.dim() == 3:  # (B, n, D) shared by the heads: one bmm over (B, H·T, n)
        acc = torch.bmm(p.reshape(b, h * t, n), values.float()).view(b, h, t, d)
    else:
        hv = values.shape[1]
        acc = torch.matmul(p.view(b, hv, h // hv * t, n), values.float()).view(b, h, t, d)
    return Partial(acc, m, l)


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float) -> Partial:
    """Partial of ordinary attention: q ``(B, H, T, D)``, k/v ``(B, Hkv, n, D)`` (GQA: query heads grouped onto
    their KV head, HF's ``repeat_kv`` order), mask as :func:`partial_from_scores` with ``(B|1, 1, T, n)``."""
    b, h, t, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    qg = q.reshape(b, hkv, h // hkv * t, d)  # query head j·G + i -> KV head j; rows (i, t)
    scores = torch.matmul(qg.to(k.dtype), k.transpose(-1, -2)).float().mul_(scale)  # (B, Hkv, G·T, n)
    return partial_from_scores(scores.view(b, h, t, n), v, mask)


def merge_local(parts: list[Partial]) -> torch.Tensor:
    """The merged, normalised output ``(B, H, T, D)`` fp32 of partials held in one process (the reference
    for the collective merge, and what ``"gather"`` runs after its all-gather)."""
    m = torch.stack([p.m for p in parts])  # (N, B, H, T)
    big = m.amax(dim=0)
    big = torch.where(torch.isfinite(big), big, torch.zeros_like(big))
    w = torch.exp(m - big)  # exp(-inf) = 0 for empty slices
    num = sum(wi[..., None] * p.acc for wi, p in zip(w, parts))
    den = sum(wi * p.l for wi, p in zip(w, parts))
    return num / torch.where(den > 0, den, torch.ones_like(den))[..., None]


def merge(part: Partial, comm: Comm, how: str = "auto", what: str = "merge") -> torch.Tensor:
    """Exact attention output ``(B, H, T, D)`` fp32 from every rank's partial (one call on every rank)."""
    n = comm.world_size
    if how == "auto":
        how = "gather" if n <= 3 else "reduce"
    if how not in ("gather", "reduce"):
        raise ValueError(f"merge must be one of {MERGES}, got {how!r}")
    if n == 1:
        return merge_local([part])
    d = part.acc.shape[-1]
    if how == "gather":
        packed = torch.cat((part.acc, part.m[..., None], part.l[..., None]), dim=-1)  # (B, H, T, D + 2)
        every = comm.all_gather(packed, what)  # (N, B, H, T, D + 2)
        return merge_local([Partial(e[..., :d], e[..., d], e[..., d + 1]) for e in every])
    big = comm.all_reduce(part.m.clone(), "max", what + " (max)")
    big = torch.where(torch.isfinite(big), big, torch.zeros_like(big))
    w = torch.exp(part.m - big)
    packed = torch.cat((part.acc * w[..., None], (part.l * w)[..., None]), dim=-1)  # (B, H, T, D + 1)
    comm.all_reduce(packed, "sum", what + " (sum)")
    den = packed[..., d]
    return packed[..., :d] / torch.where(den > 0, den, torch.ones_like(den))[..., None]


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                        scale: float) -> torch.Tensor:
    """Plain softmax attention in float64: q ``(B, H, T, D)``, k/v ``(B, Hkv, n, D)``; mask as above."""
    h, hkv = q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(h // hkv, dim=1)
    v = v.double().repeat_interleave(h // hkv, dim=1)
    s = (q.double() @ k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    return torch.softmax(s, dim=-1) @ v
