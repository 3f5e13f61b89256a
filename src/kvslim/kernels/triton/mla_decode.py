"""Triton decode of DeepSeek MLA's absorbed attention over the latent cache (FlashMLA's idea, flash-decoding split).

Same contract as :func:`kvslim.kernels.mla_decode.reference`: for one query token per sequence,
``scores = scale · (q_abs · c_kvᵀ + q_pe · k_peᵀ) + mask`` (the two terms as two products: no concatenated key),
``u = softmax(scores) · c_kv`` (B, H, dc) fp32 and ``lse`` (B, H) fp32, over the first ``lengths[b]`` (≤ T) rows.

* ``_mla_stage1``: one program per (sequence, block of ``BLOCK_H`` heads, split of the rows). The block's heads
  are the rows of ``tl.dot`` (padded to 16), so each ``(BLOCK_N, dc)`` latent tile and ``(BLOCK_N, dr)`` RoPE
  tile is loaded once and used by every head of the block, for the scores and for the weighted sum. With H >
  ``BLOCK_H`` (V2/V3: 128 heads, 8 blocks of 16) each latent row is read once per head block, not once per step
  (the blocks of one split run side by side, so the repeats mostly hit L2). Online softmax in fp32; half caches
  multiply in their own dtype on tensor cores (query and weights rounded to it, as the torch path does), fp32
  caches in IEEE fp32 (Triton 3.9's interpreter multiplies bf16 ``tl.dot`` operands as their uint16 bit patterns:
  under ``TRITON_INTERPRET=1`` the rounded bf16 values are widened to fp32 first, the same exact products).
  Rows at or past ``lengths[b]`` are never loaded: NaN there cannot leak.
* ``_mla_stage2``: the log-sum-exp merge of the splits (not launched with one split: stage 1 writes the result).

:func:`launch` (bottom) takes only tensors and sizes and picks the block sizes and the split count from shapes
alone (no host synchronisation). Importing this module imports Triton; :mod:`kvslim.kernels.mla_decode` registers
the op and imports this module only when the Triton backend is picked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import interpreting
from . import interpreter_scalars
from .merge import finish, softmax_step, unit_last

#: the widest latent / RoPE key the kernel takes: a (BLOCK_H, dc) fp32 accumulator and a (BLOCK_N, dc) tile live
#: in registers / shared memory (DeepSeek-V2/V3: dc = 512, dr = 64)
MAX_RANK = 1024
MAX_ROPE = 256
#: head block: the rows of the score and weighted-sum products (tl.dot needs ≥ 16); 16 × 512 fp32 accumulators
BLOCK_H = 16
#: the most row splits of one sequence (stage 2 loads all their log-sum-exps as one block)
MAX_SPLITS = 128
#: streaming multiprocessors assumed when the tensors are not on a GPU (interpreter runs): an H100 SXM
DEFAULT_SMS = 132


@triton.jit
def _mla_stage1(
    QA, QP, C, KP, LENGTHS, MASK, PO, PL,
    s_qab, s_qah, s_qpb, s_qph, s_cb, s_ct, s_kb, s_kt, s_mb,
    H, T, chunk, scale,
    DC: tl.constexpr, DR: tl.constexpr, C_PAD: tl.constexpr, R_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    HALF: tl.constexpr, UPCAST: tl.constexpr, HAS_LENGTHS: tl.constexpr, HAS_MASK: tl.constexpr,
):
    b = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    splits = tl.num_programs(2)
    b64 = b.to(tl.int64)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, C_PAD)  # latent channels
    rcols = tl.arange(0, R_PAD)  # RoPE channels
    toks = tl.arange(0, BLOCK_N)
    h_ok = heads < H
    c_ok = cols < DC
    r_ok = rcols < DR
    qa = tl.load(QA + b64 * s_qab + heads[:, None] * s_qah + cols[None, :],
                 mask=h_ok[:, None] & c_ok[None, :], other=0.0)  # (BLOCK_H, C_PAD) fp32
    qp = tl.load(QP + b64 * s_qpb + heads[:, None] * s_qph + rcols[None, :],
                 mask=h_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)  # (BLOCK_H, R_PAD)
    if HALF:  # the products run in the cache's dtype (tensor cores), accumulate in fp32
        qa = qa.to(C.dtype.element_ty)
        qp = qp.to(C.dtype.element_ty)
        if UPCAST:  # the same rounded values as exact fp32 operands (bf16·bf16 products are exact in fp32)
            qa = qa.to(tl.float32)
            qp = qp.to(tl.float32)

    length = T
    if HAS_LENGTHS:
        length = tl.minimum(tl.maximum(tl.load(LENGTHS + b).to(tl.int32), 0), T)
    start = split * chunk
    end = tl.minimum(start + chunk, length)
    c_base = C + b64 * s_cb
    k_base = KP + b64 * s_kb
    m_base = MASK + b64 * s_mb

    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, C_PAD), tl.float32)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + toks
        t_ok = t < end
        c = tl.load(c_base + t[:, None] * s_ct + cols[None, :], mask=t_ok[:, None] & c_ok[None, :],
                    other=0.0)  # (BLOCK_N, C_PAD): read once for all BLOCK_H heads
        kp = tl.load(k_base + t[:, None] * s_kt + rcols[None, :], mask=t_ok[:, None] & r_ok[None, :], other=0.0)
        if UPCAST or not HALF:
            c = c.to(tl.float32)
            kp = kp.to(tl.float32)
        s = tl.dot(qa, tl.trans(c), input_precision="ieee")  # (BLOCK_H, BLOCK_N): the latent term
        s = tl.dot(qp, tl.trans(kp), acc=s, input_precision="ieee")  # + the RoPE term, no concatenated key
        s = s * scale
        if HAS_MASK:
            s = s + tl.load(m_base + t, mask=t_ok, other=0.0)[None, :]
        s = tl.where(t_ok[None, :], s, float("-inf"))

        m_new, alpha, p, l_i = softmax_step(s, m_i, l_i)
        if HALF:
            p = p.to(C.dtype.element_ty)  # the weights rounded to the cache dtype, as the torch path does
            if UPCAST:
                p = p.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, c, input_precision="ieee")  # (BLOCK_H, C_PAD)
        m_i = m_new

    out, lse = finish(acc, m_i, l_i)
    part = (b64 * H + heads) * splits + split  # (BLOCK_H,) rows of the (B, H, splits, ·) partials
    tl.store(PO + part[:, None] * DC + cols[None, :], out, mask=h_ok[:, None] & c_ok[None, :])
    tl.store(PL + part, lse, mask=h_ok)


@triton.jit
def _mla_stage2(PO, PL, OUT, LSE, splits, DC: tl.constexpr, C_PAD: tl.constexpr, S_PAD: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)  # one (sequence, head)
    cols = tl.arange(0, C_PAD)
    c_ok = cols < DC
    parts = tl.arange(0, S_PAD)
    lses = tl.load(PL + bh * splits + parts, mask=parts < splits, other=float("-inf"))  # (S_PAD,)
    m = tl.max(lses, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w_sum = tl.sum(tl.exp(lses - m_use), 0)  # an empty split (lse −inf) weighs 0
    acc = tl.zeros((C_PAD,), tl.float32)
    for s in range(0, splits):
        w = tl.exp(tl.load(PL + bh * splits + s) - m_use)
        acc += w * tl.load(PO + (bh * splits + s) * DC + cols, mask=c_ok, other=0.0)
    live = w_sum > 0.0
    tl.store(OUT + bh * DC + cols, acc / tl.where(live, w_sum, 1.0), mask=c_ok)
    tl.store(LSE + bh, tl.where(live, m_use + tl.log(tl.where(live, w_sum, 1.0)), float("-inf")))


# ---- launcher ------------------------------------------------------------------------------------------------


def covers(c_kv: torch.Tensor, k_pe: torch.Tensor) -> str | None:
    """Why the kernels do not take these rows (``None`` when they do): widths, dtypes."""
    if c_kv.shape[-1] > MAX_RANK:
        return f"kv_lora_rank {c_kv.shape[-1]} > {MAX_RANK}"
    if k_pe.shape[-1] > MAX_ROPE:
        return f"rope dim {k_pe.shape[-1]} > {MAX_ROPE}"
    if c_kv.dtype not in (torch.float32, torch.bfloat16, torch.float16) or k_pe.dtype != c_kv.dtype:
        return f"cache dtypes {c_kv.dtype} / {k_pe.dtype} (fp32, bf16 or fp16, both the same)"
    return None


def choose_splits(tasks: int, n: int, block: int, sms: int, splits: int = 0) -> tuple[int, int]:
    """``(splits, chunk)``: rows ``[0, n)`` cut into ``splits`` chunks of ``chunk`` rows (a multiple of ``block``).
    A forced ``splits`` > 0 is honoured up to one block per split (and at most ``MAX_SPLITS``); otherwise enough
    splits for about two programs per SM, each at least 256 rows long."""
    blocks = -(-n // block)
    if blocks <= 1:
        return 1, max(n, 1)
    want = splits if splits > 0 else min(-(-2 * sms // max(tasks, 1)), -(-n // 256), 64)
    want = max(1, min(want, blocks, MAX_SPLITS))
    chunk = -(-blocks // want) * block
    return -(-n // chunk), chunk



def launch(q_abs: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
           lengths: torch.Tensor | None, mask: torch.Tensor | None, scale: float,
           splits: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(u (B, H, dc), lse (B, H))`` fp32.

    Args (checked by :func:`kvslim.kernels.mla_decode.check`):
        q_abs: (B, H, dc) fp32, ``q_nope W_UK`` (unscaled).
        q_pe: (B, H, dr) rotated RoPE query, any float dtype.
        c_kv: (B, T, dc), k_pe: (B, T, dr): the cache rows, fp32/bf16/fp16 (one dtype), any row strides.
        lengths: (B,) int64 rows per sequence (clamped to [0, T] in the kernel; rows past it are never read), or None.
        mask: (B|1, T) fp32 additive mask, or None.
        scale: softmax scale.
        splits: > 0 forces the number of row splits (0: from shapes and the SM count).
    """
    interpreter_scalars()  # Triton 3.6's interpreter: loop bounds computed in the kernel
    b, h, dc = q_abs.shape
    t, dr = c_kv.shape[1], k_pe.shape[-1]
    u = q_abs.new_empty(b, h, dc, dtype=torch.float32)
    lse = q_abs.new_empty(b, h, dtype=torch.float32)
    if b * h == 0:
        return u, lse
    qa, qp, c, kp, mask = (unit_last(x) for x in (q_abs.float(), q_pe, c_kv, k_pe, mask))
    c_pad = max(16, triton.next_power_of_2(dc))
    r_pad = max(16, triton.next_power_of_2(dr))
    block_n = 32 if c_pad <= 512 else 16
    h_blocks = triton.cdiv(h, BLOCK_H)
    sms = (torch.cuda.get_device_properties(c.device).multi_processor_count if c.device.type == "cuda"
           else DEFAULT_SMS)
    s, chunk = choose_splits(b * h_blocks, t, block_n, sms, splits)
    if s == 1:
        part_o, part_l = u, lse
    else:
        part_o = u.new_empty(b, h, s, dc)
        part_l = u.new_empty(b, h, s)
    dummy = qa  # pointer for absent optional tensors (never read: constexpr flags)
    s_mb = 0 if mask is None or mask.shape[0] == 1 else mask.stride(0)
    _mla_stage1[(b, h_blocks, s)](
        qa, qp, c, kp, lengths if lengths is not None else dummy, mask if mask is not None else dummy,
        part_o, part_l,
        qa.stride(0), qa.stride(1), qp.stride(0), qp.stride(1), c.stride(0), c.stride(1), kp.stride(0),
        kp.stride(1), s_mb, h, t, chunk, float(scale),
        DC=dc, DR=dr, C_PAD=c_pad, R_PAD=r_pad, BLOCK_H=BLOCK_H, BLOCK_N=block_n,
        HALF=c.dtype != torch.float32, UPCAST=c.dtype == torch.bfloat16 and interpreting(), HAS_LENGTHS=lengths is not None, HAS_MASK=mask is not None,
        num_warps=4, num_stages=2)
    if s > 1:
        _mla_stage2[(b * h,)](part_o, part_l, u, lse, s, DC=dc, C_PAD=c_pad, S_PAD=triton.next_power_of_2(s),
                              num_warps=4)
    return u, lse


__all__ = ["BLOCK_H", "MAX_RANK", "MAX_ROPE", "choose_splits", "covers", "launch"]
