"""Multi-head latent attention (DeepSeek-V2/V3, SPEC §4): four implementations with the same outputs.

Stores (per token, per layer): decompressed ``h·(dk+dr+dv)`` values; latent ``dc + dr`` values (V2: 576 vs
40,960, 71× smaller). All four paths are exact up to rounding; seeds 003/004 (DeepSeek-V2 paper, ktransformers).

* :func:`attend_dense`      — per-head K and V (the decompressed cache, or the compressed cache re-expanded);
* :func:`attend_compressed` — latent in, re-expand ``k_nope, v = c_kv W_UKV`` for every cached token (HF does this);
* :func:`attend_absorbed`   — ``q̃ = q_nope W_UK`` scored against ``[c_kv, k_pe]`` (one concatenated key),
  ``o = (softmax · c_kv) W_UV^T``: per-head K/V never exist;
* :func:`attend_elided`     — absorbed, with the RoPE and non-RoPE score terms as two products added in place
  (no concatenation, no broadcast of ``k_pe`` to the heads);
* :func:`attend_decode`     — the elided form for one query token through the op ``kernels.mla_decode`` (the Triton
  kernels read the latent once per block of heads; ``q_nope W_UK`` before and ``W_UV`` after it stay torch GEMMs),
  used for decode steps where :func:`kernel_decodes` says so (the Triton backend);
* :func:`attend_reference`  — the obviously-correct formula (expand, concatenate, softmax) all others are tested
  against, in any dtype including float64.

Shapes: ``q_nope (B, H, S, dk)``, ``q_pe (B, H, S, dr)`` (rotated), ``c_kv (B, T, dc)``, ``k_pe (B, T, dr)`` (rotated),
outputs ``(B, H, S, dv)``. ``mask``: ``None`` (causal, the S queries are the last S of T positions), a boolean
``(B, 1, S, T)`` (True = visible) or an additive float ``(B, 1, S, T)``, as Hugging Face builds them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels import mla_decode as kernel
from ..ops.sdpa import sdpa_context


@dataclass(frozen=True)
class MLAWeights:
    """The up-projection ``kv_b_proj`` of one layer, as stored and split per head.

    Attributes:
        kv_b: ``(H·(dk+dv), dc)`` in the model dtype (the live ``kv_b_proj.weight``; expansion uses it as HF does).
        w_uk: ``(H, dk, dc)`` key up-projection, float32 or float64 (absorbed into the query).
        w_uv_t: ``(H, dc, dv)`` value up-projection, transposed, float32 or float64 (applied after softmax·c_kv).
        scale: softmax scale, ``1/√(dk+dr)`` times YaRN's ``mscale²`` where configured (the module's ``scaling``).
    """

    kv_b: torch.Tensor
    w_uk: torch.Tensor
    w_uv_t: torch.Tensor
    num_heads: int
    qk_nope_dim: int
    v_dim: int
    scale: float


def absorb(kv_b_weight: torch.Tensor, num_heads: int, qk_nope_dim: int, v_dim: int, scale: float,
           dtype: torch.dtype = torch.float32) -> MLAWeights:
    """Split ``kv_b_proj.weight`` ``(H·(dk+dv), dc)`` into per-head ``W_UK``/``W_UV`` kept in ``dtype`` (≥ fp32)."""
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"absorbed weights must be float32 or float64, got {dtype}")
    rows, dc = kv_b_weight.shape
    if rows != num_heads * (qk_nope_dim + v_dim):
        raise ValueError(f"kv_b_proj.weight has {rows} rows, expected heads·(qk_nope+v) = "
                         f"{num_heads}·({qk_nope_dim}+{v_dim})")
    w = kv_b_weight.detach().to(dtype).view(num_heads, qk_nope_dim + v_dim, dc)  # (H, dk+dv, dc)
    w_uk = w[:, :qk_nope_dim].contiguous()  # (H, dk, dc)
    w_uv_t = w[:, qk_nope_dim:].transpose(1, 2).contiguous()  # (H, dc, dv)
    return MLAWeights(kv_b_weight.detach(), w_uk, w_uv_t, num_heads, qk_nope_dim, v_dim, float(scale))


# -- masks -------------------------------------------------------------------------------------------------------
def _causal_keep(s: int, t: int, device) -> torch.Tensor:
    """(S, T) bool, True where query i (absolute position t-s+i) may see key j."""
    q = torch.arange(t - s, t, device=device)[:, None]
    return torch.arange(t, device=device)[None, :] <= q


def _masked(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``scores (B, H, S, T)`` with ``mask`` applied in place (HF's conventions, see module doc)."""
    s, t = scores.shape[-2:]
    if mask is None:
        if s > 1:
            scores.masked_fill_(~_causal_keep(s, t, scores.device), torch.finfo(scores.dtype).min)
        return scores
    mask = mask[..., -s:, :t]
    if mask.dtype == torch.bool:
        return scores.masked_fill_(~mask, torch.finfo(scores.dtype).min)
    return scores.add_(mask.to(scores.dtype))


def _softmax(scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Softmax in float32 or better (as HF's eager attention), back in ``dtype``."""
    acc = scores.dtype if scores.dtype == torch.float64 else torch.float32
    return torch.softmax(scores, dim=-1, dtype=acc).to(dtype)


# -- reference ---------------------------------------------------------------------------------------------------
def attend_reference(q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                     w: MLAWeights, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The MLA formula as written: expand per-head K = [c_kv W_UK^T, k_pe], V = c_kv W_UV^T; softmax(QK^T·s)V.

    Runs in the dtype of ``q_nope`` (use float64 inputs for a reference); weights are cast to it.
    """
    dt = q_nope.dtype
    w_uk, w_uv_t = w.w_uk.to(dt), w.w_uv_t.to(dt)
    k_nope = torch.einsum("btc,hdc->bhtd", c_kv.to(dt), w_uk)  # (B, H, T, dk)
    v = torch.einsum("btc,hcd->bhtd", c_kv.to(dt), w_uv_t)  # (B, H, T, dv)
    k = torch.cat((k_nope, k_pe.to(dt)[:, None].expand(-1, w.num_heads, -1, -1)), dim=-1)  # (B, H, T, dk+dr)
    q = torch.cat((q_nope, q_pe.to(dt)), dim=-1)  # (B, H, S, dk+dr)
    scores = torch.einsum("bhsd,bhtd->bhst", q, k) * w.scale
    probs = torch.softmax(_masked(scores, mask), dim=-1)
    return torch.einsum("bhst,bhtd->bhsd", probs, v)


# -- 1. per-head K/V (decompressed cache) -----------------------------------------------------------------------
def expand(c_kv: torch.Tensor, k_pe: torch.Tensor, w: MLAWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head keys ``(B, H, T, dk+dr)`` and values ``(B, H, T, dv)`` from the latent (``kv_b_proj`` as HF)."""
    b, t, _ = c_kv.shape
    kv = F.linear(c_kv, w.kv_b).view(b, t, w.num_heads, -1).transpose(1, 2)  # (B, H, T, dk+dv)
    k_nope, v = kv.split([w.qk_nope_dim, w.v_dim], dim=-1)
    k = kv.new_empty(b, w.num_heads, t, w.qk_nope_dim + k_pe.shape[-1])
    k[..., :w.qk_nope_dim] = k_nope
    k[..., w.qk_nope_dim:] = k_pe[:, None]  # broadcast over heads
    return k, v


def attend_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """Standard attention over per-head ``q (B,H,S,dk+dr)``, ``k (B,H,T,dk+dr)``, ``v (B,H,T,dv)`` (torch SDPA)."""
    s, t = q.shape[2], k.shape[2]
    if mask is None:
        causal = s > 1 and s == t
        attn_mask = _causal_keep(s, t, q.device) if s > 1 and not causal else None
        with sdpa_context(q.device):  # forced backends on CUDA (ops/sdpa.py)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal, scale=scale)
    mask = mask[..., -s:, :t]
    if mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    with sdpa_context(q.device):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


# -- 2. compressed cache, re-expanded every call ------------------------------------------------------------------
def attend_compressed(q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                      w: MLAWeights, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Expand K/V of all T cached tokens (O(T·dc·h·(dk+dv)) per call), then :func:`attend_dense`."""
    k, v = expand(c_kv, k_pe, w)
    return attend_dense(torch.cat((q_nope, q_pe), dim=-1), k, v, w.scale, mask)


# -- 3./4. absorbed ----------------------------------------------------------------------------------------------
def absorb_query(q_nope: torch.Tensor, w: MLAWeights) -> torch.Tensor:
    """``q̃ = s · q_nope W_UK`` (B, H, S, dc), computed in the absorbed weights' precision, returned in q's dtype."""
    q = torch.matmul(q_nope.to(w.w_uk.dtype), w.w_uk)  # (B,H,S,dk) @ (H,dk,dc) -> (B,H,S,dc)
    return q.mul_(w.scale).to(q_nope.dtype)


def _latent_output(probs: torch.Tensor, c_kv: torch.Tensor, w: MLAWeights, shape: tuple[int, ...]) -> torch.Tensor:
    """``o = (probs · c_kv) W_UV^T``: probs (B, H·S, T) -> (B, H, S, dv)."""
    b, h, s = shape
    o_lat = torch.bmm(probs, c_kv).view(b, h, s, -1)  # (B, H·S, T) @ (B, T, dc) -> (B, H, S, dc)
    return torch.matmul(o_lat.to(w.w_uv_t.dtype), w.w_uv_t).to(c_kv.dtype)  # (B, H, S, dv)


def attend_absorbed(q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                    w: MLAWeights, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed MLA with one concatenated query ``[q̃, q_pe]`` and key ``[c_kv, k_pe]`` (an MQA of width dc+dr).

    Concatenating the key copies the whole cache every call: this is the "move" that :func:`attend_elided` removes.
    """
    b, h, s, _ = q_nope.shape
    t = c_kv.shape[1]
    q = torch.cat((absorb_query(q_nope, w), q_pe * w.scale), dim=-1).view(b, h * s, -1)  # (B, H·S, dc+dr)
    k = torch.cat((c_kv, k_pe), dim=-1)  # (B, T, dc+dr): a copy of the cache
    scores = torch.bmm(q, k.transpose(1, 2)).view(b, h, s, t)  # (B, H, S, T)
    probs = _softmax(_masked(scores, mask), c_kv.dtype).view(b, h * s, t)
    return _latent_output(probs, c_kv, w, (b, h, s))


def attend_elided(q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                  w: MLAWeights, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed MLA with move elision: ``scores = q_pe k_pe^T + q̃ c_kv^T`` as two products, accumulated in place.

    Reads ``c_kv`` and ``k_pe`` where they lie (views into the cache); nothing of size T is copied or broadcast.
    """
    b, h, s, _ = q_nope.shape
    t = c_kv.shape[1]
    q_lat = absorb_query(q_nope, w).view(b, h * s, -1)  # (B, H·S, dc)
    q_rot = (q_pe * w.scale).reshape(b, h * s, -1)  # (B, H·S, dr)
    scores = torch.bmm(q_rot, k_pe.transpose(1, 2))  # (B, H·S, T): the RoPE term
    scores.baddbmm_(q_lat, c_kv.transpose(1, 2))  # + the latent term
    probs = _softmax(_masked(scores.view(b, h, s, t), mask), c_kv.dtype).view(b, h * s, t)
    return _latent_output(probs, c_kv, w, (b, h, s))


# -- 5. one decode token through the op (Triton on a GPU) ----------------------------------------------------------
def decode_mask(mask: torch.Tensor | None, t: int) -> torch.Tensor | None:
    """HF's mask of a one-token step, ``(B|1, 1, S, ≥T)`` (bool or additive), as the op's ``(B|1, T)`` (None stays)."""
    return None if mask is None else mask[:, 0, -1, :t]


def kernel_decodes(q_nope: torch.Tensor, c_kv: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether a step goes through :func:`attend_decode`: one query token, a mask shared by the heads covering the
    T cached rows, and the Triton backend for the cache's device (``kernels.mla_decode.backend_for``)."""
    if q_nope.shape[2] != 1:
        return False
    if mask is not None and (mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-1] < c_kv.shape[1]):
        return False
    return kernel.backend_for(c_kv.device) == "triton"


def attend_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                  w: MLAWeights, mask: torch.Tensor | None = None, lengths: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """:func:`attend_elided` for one query token (S = 1) through ``kernels.mla_decode.mla_decode``.

    ``q̃ = q_nope W_UK`` (a batched GEMM in the absorbed weights' precision, fp32 into the op), then
    ``u = softmax(s·(q̃ c_kvᵀ + q_pe k_peᵀ) + mask) · c_kv`` in the op, then ``o = u W_UV^T``. Returns (B, H, 1, dv)
    in q's dtype. ``lengths`` (B,): rows held per sequence (a capturable cache's whole buffer): the op reads none
    past it.
    """
    t = c_kv.shape[1]
    q_abs = torch.matmul(q_nope.to(w.w_uk.dtype), w.w_uk)[:, :, 0]  # (B,H,1,dk) @ (H,dk,dc) -> (B, H, dc)
    u, _ = kernel.mla_decode(q_abs.float(), q_pe[:, :, 0], c_kv, k_pe, lengths, decode_mask(mask, t), w.scale)
    o = torch.matmul(u.to(w.w_uv_t.dtype)[:, :, None], w.w_uv_t)  # (B,H,1,dc) @ (H,dc,dv) -> (B, H, 1, dv)
    return o.to(q_nope.dtype)


IMPLS = ("decompressed", "compressed", "absorbed", "elided")
LATENT_PATHS = {"compressed": attend_compressed, "absorbed": attend_absorbed, "elided": attend_elided}
