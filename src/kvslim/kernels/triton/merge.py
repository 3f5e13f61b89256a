"""Stage 2 of the split-K decode kernels: the exact log-sum-exp merge of per-split partials (slim, encdec, int2).

Partials ``(out, lse)`` of S disjoint splits of one row's tokens: ``out = Σ_s w_s · out_s`` with
``w_s = exp(lse_s − lse)``, ``lse = log Σ_s exp(lse_s)``; a split with nothing to attend (lse −inf) weighs 0, and a
row with nothing at all gives zeros and lse −inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_stage2(PO, PL, OUT, LSE, h, c, splits, H_PAD: tl.constexpr, BLOCK_C: tl.constexpr):
    # LSE merge of `splits` partials (B, splits, h, c) + (B, splits, h) into (B, h, c) + (B, h)
    tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    heads = tl.arange(0, H_PAD)
    cols = tile * BLOCK_C + tl.arange(0, BLOCK_C)
    head_ok = heads < h
    ok = head_ok[:, None] & (cols < c)[None, :]
    m = tl.full((H_PAD,), float("-inf"), tl.float32)
    w_sum = tl.zeros((H_PAD,), tl.float32)
    acc = tl.zeros((H_PAD, BLOCK_C), tl.float32)
    for s in range(0, splits):
        part = (b * splits + s) * h
        lse = tl.load(PL + part + heads, mask=head_ok, other=float("-inf"))
        o = tl.load(PO + (part + heads[:, None]) * c + cols[None, :], mask=ok, other=0.0)
        m_new = tl.maximum(m, lse)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_use)
        w = tl.exp(lse - m_use)
        w_sum = w_sum * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * o
        m = m_new
    live = w_sum > 0.0
    out = acc / tl.where(live, w_sum, 1.0)[:, None]
    lse = tl.where(live, m + tl.log(tl.where(live, w_sum, 1.0)), float("-inf"))
    tl.store(OUT + (b * h + heads[:, None]) * c + cols[None, :], out, mask=ok)
    tl.store(LSE + b * h + heads, lse, mask=heads < tl.where(tile == 0, h, 0))  # written once, by tile 0


def merge_splits(part_o: torch.Tensor, part_l: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Stage 2: ``part_o`` (B, S, h, c), ``part_l`` (B, S, h) fp32 merged into ``out`` (B, h, c), ``lse`` (B, h)."""
    b, s, h, c = part_o.shape
    h_pad = max(16, triton.next_power_of_2(h))
    block_c = max(16, min(triton.next_power_of_2(c), 4096 // h_pad))
    _merge_stage2[(triton.cdiv(c, block_c), b)](part_o, part_l, out, lse, h, c, s, H_PAD=h_pad, BLOCK_C=block_c,
                                                 num_warps=4)
