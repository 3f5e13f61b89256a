"""Slim attention math (SPEC §3): attention over a cache that holds one tensor per token.

What is cached per technique (row of ``c`` values per token, shared by all heads):
``k`` — the keys (e values; RoPE either not yet applied, "raw", or applied, "rotated"), optionally followed
by r conditioning coordinates ``z = x P``; ``v`` — the values; ``x`` — the layer input. Memory 0.5× of K+V
for e = d (``k``+r: (e+r)/2e). Exact in exact arithmetic; rounding is amplified by the rebuilding map
(measured by the plan). Paper: Graef & Wasielewski 2025. :func:`reference_attention` is the plain path
every optimized one is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import encdec_decode as rows_kernel
from ..kernels import slim_decode as kernel
from ..ops.rope import rotate_heads


@dataclass(frozen=True)
class SlimLayerWeights:
    """Precomputed (float64 → fp32) maps of one layer.

    Attributes:
        technique: ``"k"``, ``"v"`` or ``"x"``.
        num_heads, head_dim: h and dk (e = h·dk).
        width: cached values per token (c).
        value_map: (h, c, dk) — head i's value ``v_i = C value_map[i]`` (minus its constant), ``k``/``x``.
        value_map_full: (c, e) — the same maps side by side (decode option 1).
        score_map: (h, c, dk) — ``k_i = C score_map[i]`` up to a constant per query, ``v``/``x``.
        proj: (d, r) conditioning directions (``k`` with r > 0), else ``None``.
        out_bias: folded output bias ``b_O + c_V W_O`` (d,) for the decode path, or ``None`` if the o-projection
            has no bias and the rebuilt values need no constant.
        rope: whether keys carry RoPE (``k`` only); ``rope_storage`` is ``"raw"`` or ``"rotated"``.
        decode: ``"option2"`` (``u = softmax·C`` then ``u·W``) or ``"option1"`` (rebuild V, then attention).
        kernel: decode ``"k"``/option 2 with one query token through the op of :mod:`kvslim.kernels.slim_decode`
            (Triton on CUDA; C++ on CPU, fp32 or bf16 rows; RoPE raw or rotated) when it applies and builds
            (``"auto"``; ``"c"`` is the same), or always through the torch path below (``"torch"``).
    """

    technique: str
    num_heads: int
    head_dim: int
    width: int
    value_map: torch.Tensor | None = None
    value_map_full: torch.Tensor | None = None
    score_map: torch.Tensor | None = None
    proj: torch.Tensor | None = None
    out_bias: torch.Tensor | None = None
    rope: bool = False
    rope_storage: str = "raw"
    decode: str = "option2"
    kernel: str = "auto"

    @property
    def rank(self) -> int:
        return 0 if self.proj is None else self.proj.shape[1]


def additive_mask(mask: torch.Tensor | None, q_len: int, kv_len: int, device) -> torch.Tensor | None:
    """HF attention mask (bool: True = visible, or additive float; (B|1, 1, T, n)) as an fp32 additive mask.

    ``None`` means causal without padding: the T queries are the last T of the n positions.
    """
    if mask is None:
        if q_len == 1:
            return None
        i = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
        j = torch.arange(kv_len, device=device)[None, :]
        return torch.zeros(q_len, kv_len, device=device).masked_fill(j > i, torch.finfo(torch.float32).min)
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, torch.finfo(torch.float32).min)
    return mask[..., -kv_len:].float().clamp_min(torch.finfo(torch.float32).min)


def _softmax(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is not None:
        scores = scores + mask
    return torch.softmax(scores, dim=-1)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                        scaling: float) -> torch.Tensor:
    """Plain attention: q (B, h, T, dk), k/v (B, h, n, dk), fp32 softmax -> (B, h, T, dk) in q's dtype."""
    s = _softmax((q @ k.transpose(-1, -2)).float() * scaling, mask)
    return (s.to(v.dtype) @ v).to(q.dtype)


def split_heads(c: torch.Tensor, h: int) -> torch.Tensor:
    """(B, n, h·dk) -> (B, h, n, dk)."""
    b, n, _ = c.shape
    return c.view(b, n, h, -1).transpose(1, 2)


def slim_attention(q: torch.Tensor, cache: torch.Tensor, w: SlimLayerWeights, mask: torch.Tensor | None,
                   scaling: float, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                   lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of queries over a slim cache.

    Args:
        q: (B, h, T, dk) queries, RoPE already applied.
        cache: (B, n, c) cached rows in the model dtype.
        w: the layer's :class:`SlimLayerWeights`.
        mask: fp32 additive mask broadcastable to (B, h, T, n) (see :func:`additive_mask`), or ``None``.
        scaling: score scale (``dk**-0.5`` or the model's own).
        cos, sin: (B|1, n, R) RoPE table of the cached positions (``k`` with RoPE).
        lengths: (B,) int64 rows per sequence (a capturable cache's whole buffer, ``caches/capture.py``): the kernels
            read no row past it; the torch paths rely on ``mask`` hiding those rows (they hold finite values).

    Returns:
        (B, h, T, dk) head outputs in q's dtype, *without* the rebuilt values' constant (it is folded into
        ``w.out_bias``).
    """
    b, h, t, dk = q.shape
    n, e = cache.shape[1], h * dk
    rope = w.technique == "k" and w.rope
    rotated = rope and w.rope_storage == "rotated"
    if _fused_option2(q, cache, w, mask):  # one pass over the rows per step: scores, softmax, u = softmax·C
        cs, sn = (cos, sin) if rope else (None, None)
        # u·W_KV inside the op too, for one sequence only: quiet 2-thread runs (bench_slim.py) put the mapped op at
        # 0.90× dense at 8k × 8 against 1.06× for op + one batched W_KV product, and level with it at batch 1
        if q.shape[0] == 1 and w.value_map.dtype == torch.float32 and w.value_map.device.type == "cpu":
            out, _ = kernel.slim_decode_mapped(q[:, :, 0], cache, w.value_map, cs, sn, _mask_rows(mask, n), lengths,
                                               scaling, rotated)
            return out[:, :, None].to(q.dtype)
        u, _ = option2_partials(q, cache, mask, scaling, cs, sn, rotated, lengths)
        return _per_head_map(u[:, :, None], w.value_map).to(q.dtype)
    if _fused_x(q, cache, w, mask):  # X-cache: absorbed query, one pass over X for all heads, value map: one op
        out, _ = rows_kernel.encdec_decode_mapped(q[:, :, 0], cache, w.score_map, w.value_map, None,
                                                  _mask_rows(mask, n), lengths, scaling, dk_last=True)
        return out[:, :, None].to(q.dtype)
    # -- scores ---------------------------------------------------------------------------------------------
    if w.technique == "k":
        keys = cache[..., :e]  # (B, n, e) head-interleaved
        if rope and not rotated:
            keys = rotate_heads(keys, h, dk, cos, sin)  # (B, n, e) contiguous
        scores = _key_scores(q, keys) * scaling
    else:  # absorbed query: q̃_i = q_i score_map_i^T, scores over the shared rows
        qt = _per_head_map(q.float(), w.score_map.transpose(-1, -2))  # (B, h, T, c), maps not copied per sequence
        scores = (qt.reshape(b, h * t, -1) @ cache.float().transpose(1, 2)).view(b, h, t, n) * scaling
    s = _softmax(scores, mask)  # (B, h, T, n) fp32
    # -- values ---------------------------------------------------------------------------------------------
    if w.technique == "v":
        return (s @ split_heads(cache, h).float()).to(q.dtype)
    src = cache.float()
    if rotated:  # un-rotate before rebuilding V
        raw = rotate_heads(src, h, dk, cos.float(), sin.float(), inverse=True)  # (B, n, e)
        src = raw if src.shape[-1] == e else torch.cat((raw, src[..., e:]), dim=-1)
    if w.decode == "option1":  # rebuild V = C W (n·c·e per step), then ordinary attention
        v = split_heads(src @ w.value_map_full, h)  # (B, h, n, dk)
        return (s @ v).to(q.dtype)
    # option 2: u = softmax·C for all heads as one matrix product, then one small map per head
    u = (s.reshape(b, h * t, n) @ src).view(b, h, t, -1)  # "bhtn,bnc->bhtc"
    return _per_head_map(u, w.value_map).to(q.dtype)


def _mask_rows(mask: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """A decode mask broadcastable to (B, h, 1, n) and shared by the heads, as (B|1, n); ``None`` stays ``None``."""
    return None if mask is None else mask.reshape(mask.shape[0], n)


def _fused_option2(q: torch.Tensor, cache: torch.Tensor, w: SlimLayerWeights, mask: torch.Tensor | None) -> bool:
    """Whether option 2 of a K-cache goes through a kernel (one query token, mask shared by heads): Triton on CUDA,
    the C++ op on CPU (:func:`kvslim.kernels.slim_decode.choose`)."""
    if w.technique != "k" or w.decode != "option2" or w.kernel == "torch" or q.shape[2] != 1:
        return False
    if mask is not None and (mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1
                             or mask.shape[3] != cache.shape[1]):
        return False
    return kernel.choose(q[:, :, 0], cache) != "torch"  # Triton (CUDA), the C++ op (CPU), or neither


def _fused_x(q: torch.Tensor, cache: torch.Tensor, w: SlimLayerWeights, mask: torch.Tensor | None) -> bool:
    """Whether an X-cache decode step goes through ``kvslim::encdec_decode_mapped`` (the X rows play E's part:
    scores ``(q_i score_map_iᵀ) Xᵀ``, output ``(s_i X) value_map_i``): one query token, a mask shared by the heads,
    fp32 maps, a kernel for the device (:func:`kvslim.kernels.encdec_decode.choose`), no autograd."""
    if w.technique != "x" or w.kernel == "torch" or q.shape[2] != 1:
        return False
    if mask is not None and (mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1
                             or mask.shape[3] != cache.shape[1]):
        return False
    maps = (w.score_map, w.value_map)
    if any(m is None or m.dtype != torch.float32 for m in maps):
        return False
    grad = torch.is_grad_enabled() and (q.requires_grad or cache.requires_grad or any(m.requires_grad for m in maps))
    return (not grad and cache.shape[1] > 0
            and rows_kernel.choose(q[:, :, 0], cache, None, None, maps, width=cache.shape[-1]) != "torch")


def option2_partials(q: torch.Tensor, cache: torch.Tensor, mask: torch.Tensor | None, scaling: float,
                     cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, rotated: bool = False,
                     lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Option 2 of a K-cache before the per-head maps, for one query token: ``(u, lse)``.

    ``u`` (B, h, c) fp32 is ``softmax(scaling · q·rope(K)ᵀ + mask) · C`` (C un-rotated for rotated storage) and
    ``lse`` (B, h) the log of the softmax denominator, so partials over disjoint row sets (shards, pages) merge
    exactly with :func:`kvslim.kernels.slim_decode.merge`; the output is then ``u_j W_KV,j``. Through the C++
    op :func:`kvslim.kernels.slim_decode.slim_decode` (its pure-torch twin without a compiler).

    Args:
        q: (B, h, 1, dk) queries, RoPE applied.
        cache: (B, n, c) rows, fp32 or bf16.
        mask: fp32 additive mask broadcastable to (B, h, 1, n) and shared by the heads, or ``None``.
        cos, sin: (B|1, n, R) RoPE table of the cached positions, or ``None``.
        rotated: keys stored rotated (else raw).
        lengths: (B,) int64 rows per sequence, or ``None`` (all n).
    """
    n = cache.shape[1]
    return kernel.slim_decode(q[:, :, 0], cache, cos, sin, _mask_rows(mask, n), lengths, scaling, rotated)


def _per_head_map(u: torch.Tensor, maps: torch.Tensor) -> torch.Tensor:
    """"bhtc,hcd->bhtd" as one bmm batched over heads (``matmul`` would copy the maps once per sequence)."""
    b, h, t, c = u.shape
    out = torch.bmm(u.permute(1, 0, 2, 3).reshape(h, b * t, c), maps)  # (h, B·T, dk)
    return out.view(h, b, t, -1).permute(1, 0, 2, 3)


def _key_scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Raw scores q·kᵀ (B, h, T, n) fp32 of queries (B, h, T, dk) over head-interleaved keys (B, n, h·dk).

    One query token: a single GEMM of the rows with a block-diagonal (h·dk, h) query matrix — reads the keys
    once, in storage order (a batched GEMV over the (B, h, n, dk) view makes torch copy the whole cache). The
    zero blocks add exact zeros, so the scores equal the per-head dot products.
    """
    b, h, t, dk = q.shape
    if t != 1:
        k = split_heads(keys, h)  # (B, h, n, dk)
        return (k @ q.transpose(-1, -2)).transpose(-1, -2).float()
    eye = torch.eye(h, dtype=q.dtype, device=q.device)
    qbd = (q[:, :, 0, :, None] * eye[:, None, :]).reshape(b, h * dk, h)  # "bhd,hj->(bhd)j" block-diagonal
    return torch.bmm(keys, qbd.to(keys.dtype)).transpose(1, 2).unsqueeze(2).float()  # (B, h, 1, n)
