"""The online-softmax pieces every split-K decode kernel shares (int8/int4, int2, slim, encdec, MLA).

* :func:`softmax_step`: one block of an online softmax (stage 1's inner loop);
* :func:`finish`: a split's ``(out, lse)`` partial from its running sums;
* :func:`merge_splits` (``_merge_stage2``): the exact log-sum-exp merge of S disjoint splits' partials,
  ``out = Σ_s w_s · out_s`` with ``w_s = exp(lse_s − lse)``, ``lse = log Σ_s exp(lse_s)`` (slim, encdec, int2).

Everywhere a row with nothing to attend yet never computes ``−inf − −inf``: it gives zeros and lse −inf, and a split
with nothing (lse −inf) weighs 0 in the merge.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreter_scalars


@triton.jit
def softmax_step(s, m_i, l_i):
    """One block of scores ``s`` (ROWS, BLOCK_N), −inf where not attended, into the running max ``m_i`` and sum
    ``l_i`` (ROWS,): returns ``(m_new, alpha, p, l_new)``; the caller rescales its accumulator by ``alpha`` and adds
    ``p · values``."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing live yet: no -inf - -inf
    alpha = tl.exp(m_i - m_use)
    p = tl.exp(s - m_use[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, 1)


#: operand precisions of the decode kernels' ``tl.dot`` (the ``dot=`` of their launchers; the shipped ops use
#: ``"ieee"``): fp32 operands as IEEE products or as three TF32 products (``tf32x3``; both spellings accepted by
#: triton 3.0 through 3.9), or the operands rounded to bf16 (fp32 accumulation; no ``input_precision`` needed).
#: Triton's interpreter ignores the precision and multiplies bf16 operands wrongly (docs/gpu.md): CPU runs "ieee".
DOT_CHOICES = ("ieee", "tf32x3", "bf16")


def check_dot(dot: str) -> str:
    if dot not in DOT_CHOICES:
        raise ValueError(f"dot must be one of {DOT_CHOICES}, got {dot!r}")
    return dot


@triton.jit
def mm(a, b, DOT: tl.constexpr):
    """``tl.dot(a, b)`` in fp32 with the operand precision ``DOT`` (:data:`DOT_CHOICES`)."""
    if DOT == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), out_dtype=tl.float32)
    else:
        return tl.dot(a, b, input_precision=DOT)


@triton.jit
def finish(acc, m_i, l_i):
    """``(out, lse)`` of an online softmax's accumulator: zeros and −inf for a row that attended nothing."""
    live = l_i > 0.0
    out = acc / tl.where(live, l_i, 1.0)[:, None]
    lse = tl.where(live, m_i + tl.log(tl.where(live, l_i, 1.0)), float("-inf"))
    return out, lse


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
    interpreter_scalars()  # Triton 3.6's interpreter: loop bounds computed in the kernel
    b, s, h, c = part_o.shape
    h_pad = max(16, triton.next_power_of_2(h))
    block_c = max(16, min(triton.next_power_of_2(c), 4096 // h_pad))
    _merge_stage2[(triton.cdiv(c, block_c), b)](part_o, part_l, out, lse, h, c, s, H_PAD=h_pad, BLOCK_C=block_c,
                                                 num_warps=4)


def unit_last(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` with a unit stride on its last dim (the kernels index channels directly), copied only if needed."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def stored_pages(pages: torch.Tensor | None, page: int, *buffers: torch.Tensor) -> int:
    """The pages the ``buffers`` (B, H, rows, ·) hold whole, the bound a kernel clamps each listed page id to (no id
    reads memory outside them, whatever the list holds: the ids are not checked on the host, which would sync the
    device); 1 without a list (unused)."""
    if pages is None:
        return 1
    return max(1, min(int(t.shape[2]) for t in buffers) // int(page))


def check_pages(name: str, pages: torch.Tensor | None, page: int, b: int, hk: int, n: int, multiple: int = 1,
                least: int = 1) -> int:
    """A launcher's page list (sparse decode): ``None``, or an integer (B, Hk, ≥ ⌈n / page⌉) tensor with ``page`` a
    power of two ≥ ``least`` and a multiple of ``multiple`` (a key group). Returns the rows each buffer must hold:
    ``n`` without a list, else one page (the ids themselves are not read here: no device sync). ``ValueError``
    naming the argument otherwise."""
    if pages is None:
        return n
    if page < least or page & (page - 1) or page % max(multiple, 1):
        raise ValueError(f"{name}: page must be a power of two ≥ {least} and a multiple of {max(multiple, 1)} (the "
                         f"key groups), got {page}")
    if pages.dim() != 3 or tuple(pages.shape[:2]) != (b, hk) or pages.shape[2] * page < n or pages.is_floating_point():
        raise ValueError(f"{name}: pages must be an integer (B={b}, Hk={hk}, ≥{-(-n // page)}) page list, got "
                         f"{pages.dtype} {tuple(pages.shape)}")
    return page
