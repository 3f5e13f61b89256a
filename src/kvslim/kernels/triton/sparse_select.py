"""The page scores of a sparse decode step on the GPU: one Triton kernel, then ``topk`` (``kernels/sparse_select.py``).

Per sequence b and KV head h (one program each), with the group's G query heads q_g (fp32) and the first
``n_pages`` page boxes ``[c | r]`` (fp16 / fp32 values, or the library's int8 codes times one fp16 scale per
``group`` channels, converted as they are loaded):

    s_gp  = scaling · (q_g · c_p + |q_g| · r_p)              each head's bound on the page's best q·k
    score = logsumexp_g (s_gp − logsumexp_p' s_gp')          the log of the group's summed estimated attentions

in fp32, two passes over the pages (the first keeps each head's running max and sum, the second writes the scores):
the torch twin's dozen small kernels (conversion, products, log-softmax, log-sum-exp) in one launch. With ``first``
(B,) int64 (a left-padded batch) only sequence b's pages from ``first[b]`` on are candidates: the log-softmax runs
over them, the pages before score ``-inf``.
``sparse_select.reference`` is the twin; its ``topk`` / ``sort`` / concatenation follow the kernel unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreter_scalars


@triton.jit
def _bounds(Q_ROWS, QA_ROWS, BOX, SC, base, sbase, p, p_ok, d, d_ok, bx_p, sc_p, D: tl.constexpr,
            GROUP: tl.constexpr, CODED: tl.constexpr):
    """(G_PAD, BLOCK_P) fp32 bounds q·c + |q|·r of pages ``p`` (unscaled)."""
    ok = p_ok[:, None] & d_ok[None, :]
    off = base + p[:, None] * bx_p + d[None, :]
    c = tl.load(BOX + off, mask=ok, other=0).to(tl.float32)  # (BLOCK_P, D_PAD)
    r = tl.load(BOX + off + D, mask=ok, other=0).to(tl.float32)
    if CODED:
        soff = sbase + p[:, None] * sc_p + d[None, :] // GROUP
        c = c * tl.load(SC + soff, mask=ok, other=0).to(tl.float32)
        r = r * tl.load(SC + soff + D // GROUP, mask=ok, other=0).to(tl.float32)
    return tl.sum(Q_ROWS[:, None, :] * c[None, :, :], 2) + tl.sum(QA_ROWS[:, None, :] * r[None, :, :], 2)


@triton.jit
def _page_scores(Q, BOX, SC, FIRST, LAST, OUT, n_pages, scaling, H, bx_b, bx_h, bx_p, sc_b, sc_h, sc_p,
                 G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr,
                 CODED: tl.constexpr, HAS_FIRST: tl.constexpr, HAS_LAST: tl.constexpr, BLOCK_P: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    b = bh // H
    h = bh % H
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    g_ok = g < G
    d_ok = d < D
    q = tl.load(Q + (bh * G + g[:, None]) * D + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    qa = tl.abs(q)
    base = b * bx_b + h * bx_h
    sbase = b * sc_b + h * sc_h
    lo = 0
    if HAS_FIRST:  # a left-padded row: its candidates start at its first visible page
        lo = tl.load(FIRST + b)
    hi = n_pages
    if HAS_LAST:  # a static step: the candidates end at a count held on the device
        hi = tl.minimum(tl.load(LAST + b), n_pages)
    m = tl.full((G_PAD,), float("-inf"), tl.float32)
    s_sum = tl.zeros((G_PAD,), tl.float32)
    # pass 1: each head's log-sum-exp over the candidate pages (from the block holding `lo`: a block of padding
    # pages alone would make the running max -inf and the sum NaN)
    for p0 in range(lo // BLOCK_P * BLOCK_P, hi, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        p_ok = (p < hi) & (p >= lo)
        s = _bounds(q, qa, BOX, SC, base, sbase, p, p_ok, d, d_ok, bx_p, sc_p, D, GROUP, CODED) * scaling
        s = tl.where(p_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        s_sum = s_sum * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
        m = m_new
    # a row with no candidate (a static step early on): a finite stand-in, its pages all written -inf below
    lse = tl.where(m > float("-inf"), m, 0.0) + tl.log(tl.maximum(s_sum, 1e-30))
    for p0 in range(0, n_pages, BLOCK_P):  # pass 2: the group's log of summed estimated attentions
        p = p0 + tl.arange(0, BLOCK_P)
        p_ok = p < n_pages
        t = _bounds(q, qa, BOX, SC, base, sbase, p, p_ok, d, d_ok, bx_p, sc_p, D, GROUP, CODED) * scaling
        t = tl.where(g_ok[:, None], t - lse[:, None], float("-inf"))
        mx = tl.max(t, 0)
        score = tl.where((p >= lo) & (p < hi), mx + tl.log(tl.sum(tl.exp(t - mx[None, :]), 0)), float("-inf"))
        tl.store(OUT + bh * n_pages + p, score, mask=p_ok)


def page_scores(q: torch.Tensor, boxes: torch.Tensor, n_pages: int, scaling: float,
                scales: torch.Tensor | None = None, first: torch.Tensor | None = None,
                last: torch.Tensor | None = None, block_pages: int = 32) -> torch.Tensor:
    """(B, H, G, D) fp32 queries, (B, H, ≥ n_pages, 2D) boxes (fp16/fp32, or int8 with ``scales``
    (B, H, ≥ n_pages, 2D / group) fp16) -> (B, H, n_pages) fp32 scores (``sparse_select.scores``' contract; with
    ``first`` (B,) int64, ``sparse_select.reference``'s before its forced page: the pages before ``first[b]``
    ``-inf``, the log-softmax over the rest; with ``last`` (B,) int64 likewise the pages from ``last[b]`` on, a
    count the host never reads: a static step's candidates, ``attention/sparse_static.static_table``)."""
    interpreter_scalars()
    b, h, g, d = q.shape
    out = torch.empty(b, h, n_pages, dtype=torch.float32, device=q.device)
    if b * h == 0 or n_pages == 0:
        return out
    q = q.float().contiguous()
    coded = scales is not None
    group = (2 * d) // scales.shape[-1] if coded else 1
    sc = scales if coded else boxes  # a pointer the kernel never reads without scales
    lo = out if first is None else first.to(device=q.device, dtype=torch.int64).contiguous()  # (likewise)
    hi = out if last is None else last.to(device=q.device, dtype=torch.int64).contiguous()
    _page_scores[(b * h,)](q, boxes, sc, lo, hi, out, int(n_pages), float(scaling), h, boxes.stride(0), boxes.stride(1),
                           boxes.stride(2), sc.stride(0), sc.stride(1), sc.stride(2), G=g,
                           G_PAD=triton.next_power_of_2(g), D=d, D_PAD=triton.next_power_of_2(d), GROUP=group,
                           CODED=coded, HAS_FIRST=first is not None, HAS_LAST=last is not None,
                           BLOCK_P=block_pages, num_warps=4)
    return out


def _register() -> None:
    """Define ``kvslim::page_scores_triton`` (a custom op with a fake impl, so that a compiled static step traces a
    call, as ``quant_decode_triton``) unless it exists (a module reload)."""
    if hasattr(torch.ops.kvslim, "page_scores_triton"):
        return

    @torch.library.custom_op("kvslim::page_scores_triton", mutates_args=())
    def page_scores_triton(q: torch.Tensor, boxes: torch.Tensor, n_pages: int, scaling: float,
                           scales: torch.Tensor | None, first: torch.Tensor | None,
                           last: torch.Tensor | None) -> torch.Tensor:
        return page_scores(q, boxes, n_pages, scaling, scales, first, last)

    @page_scores_triton.register_fake
    def _(q, boxes, n_pages, scaling, scales, first, last):
        return q.new_empty(q.shape[0], q.shape[1], n_pages, dtype=torch.float32)


_register()  # at import (once per process): dynamo traces calls to op(), never a registration


def op():
    """``torch.ops.kvslim.page_scores_triton`` (registered when this module is imported)."""
    return torch.ops.kvslim.page_scores_triton
