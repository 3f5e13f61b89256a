"""Triton slim attention option 2 decode (SPEC §3) over a K-only cache: the rows are shared by all heads.

The GPU twin of ``csrc/slim_decode.cpp``, same contract as :func:`kvslim.kernels.slim_decode.reference`: for one
query token per sequence, ``u_j = softmax(scaling · q_j · rope(K_j)ᵀ + mask) · C`` (B, h, c) and ``lse_j`` (B, h)
fp32, over the first ``lengths[b]`` (≤ n) rows ``C`` (B, n, c) (h·dk key columns, raw or RoPE-rotated, then
conditioning columns; fp32, fp16 or bf16). Flash-decoding in two kernels:

* ``_slim_stage1``: one program per (column tile of u, split of the rows, sequence). Per block of ``BLOCK_N`` rows:
  the scores of every head (head j's dk key columns against q_j; for raw keys the RoPE of each row is folded into
  the query: ``q·R_θ k = (q ⊙ cos + q[p] ⊙ σ sin[p]) · k`` with p the half-swap, so keys are read once, unchanged),
  an online softmax per head, then ``acc (h, BLOCK_C) += p · C[:, tile]`` in one ``tl.dot`` (rotated keys are
  un-rotated in that tile on the fly). The rows are read once for all heads; the accumulator ``h_pad × BLOCK_C``
  fp32 lives in registers, so u is tiled over c by the grid (``MAX_ACC``): a program of tile t > 0 recomputes the
  scores of its block (h·dk key columns, read from L2 right after tile 0's program read them). Slim layers of
  Whisper tiny and base, the tiny Llama (h_pad × c ≤ ``MAX_ACC``) run one tile: every row is read from DRAM once.
  Rows at or past ``lengths[b]`` are never read (masked loads): NaN there cannot leak.
* stage 2, :func:`kvslim.kernels.triton.merge.merge_splits`: the log-sum-exp merge of the splits (skipped with one
  split: stage 1 writes the result).
  Shared with :mod:`kvslim.kernels.triton.encdec_decode`.

:func:`launch` (bottom) takes only tensors and sizes and picks the block sizes and the split count;
:func:`op` registers it as ``torch.ops.kvslim.slim_decode_triton`` (a ``torch.library.custom_op`` with a fake impl,
so ``torch.compile(fullgraph=True)`` traces a call). ``slim_decode_mapped`` is that op then ``u_j · value_map[j]``
as one batched matmul in torch (a tiny (h, B, c) × (h, c, dk) GEMM). Importing this module imports Triton; the
dispatch (:mod:`kvslim.kernels.slim_decode`) imports it only when the Triton backend is picked.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import interpreter_scalars
from .merge import finish, merge_splits, softmax_step, unit_last

#: the largest head dim the kernel takes (a (BLOCK_N, dk) fp32 key tile and the RoPE tiles live in registers)
MAX_HEAD_DIM = 256
#: the register accumulator's budget, h_pad · BLOCK_C fp32 values (u is tiled over c by the grid past it); 8192
#: keeps both stage-1 kernels free of spills on sm_90 (ptxas, triton 3.9, 8 warps: slim 212 registers, encdec 122)
MAX_ACC = 8192
#: ``tl.dot`` precision: fp32 products as the twin computes them ("tf32x3" would use tensor cores, untested on GPU)
DOT_PRECISION = "ieee"
#: streaming multiprocessors assumed when the tensors are not on a GPU (interpreter runs): an H100 SXM
DEFAULT_SMS = 132


@triton.jit
def _slim_stage1(
    Q, ROWS, COS, SIN, MASK, LENGTHS, PO, PL,
    s_rb, s_rn, s_cb, s_cn, s_mb,
    h, dk, c, n, rot, chunk, scaling,
    H_PAD: tl.constexpr, DK_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
    ROPE_KEYS: tl.constexpr, UNROTATE: tl.constexpr, HAS_MASK: tl.constexpr, HAS_LENGTHS: tl.constexpr, DOT: tl.constexpr,
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    splits = tl.num_programs(1)
    e = h * dk

    heads = tl.arange(0, H_PAD)
    ds = tl.arange(0, DK_PAD)  # channels of one head
    toks = tl.arange(0, BLOCK_N)
    cols = tile * BLOCK_C + tl.arange(0, BLOCK_C)  # this program's columns of u
    head_ok = heads < h
    d_ok = ds < dk
    col_ok = cols < c

    # RoPE (HF rotate_half): rope(k)[i] = k[i]·cos[i] + σ(i)·k[p(i)]·sin[i], p the half swap, σ = −1 on the first half
    half = rot // 2
    d_rot = ds < rot
    d_partner = tl.where(ds < half, ds + half, ds - half)
    sign_partner = tl.where(d_partner < half, -1.0, 1.0)  # σ(p(i)): folds the rotation into the query
    col_key = cols < e
    col_head = cols // dk
    col_d = cols - col_head * dk
    col_rot = col_key & (col_d < rot)
    col_partner = col_head * dk + tl.where(col_d < half, col_d + half, col_d - half)
    sign_unrot = tl.where(col_d < half, 1.0, -1.0)  # −σ(i): un-rotation by −θ

    row_base = ROWS + b * s_rb
    q_base = Q + b * e
    length = n
    if HAS_LENGTHS:
        length = tl.minimum(tl.maximum(tl.load(LENGTHS + b).to(tl.int32), 0), n)
    start = split * chunk
    end = tl.minimum(start + chunk, length)

    m_i = tl.full((H_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((H_PAD,), tl.float32)
    acc = tl.zeros((H_PAD, BLOCK_C), tl.float32)

    for t0 in range(start, end, BLOCK_N):
        t = t0 + toks
        t_ok = t < end
        rows_t = row_base + t[:, None] * s_rn  # (BLOCK_N, 1) row pointers
        if ROPE_KEYS:  # raw keys: the scores see them rotated
            ok_r = t_ok[:, None] & d_rot[None, :]
            cos_d = tl.load(COS + b * s_cb + t[:, None] * s_cn + ds[None, :], mask=ok_r, other=1.0)
            sin_p = tl.load(SIN + b * s_cb + t[:, None] * s_cn + d_partner[None, :], mask=ok_r, other=0.0)
            sin_p = sin_p * sign_partner[None, :]
        # -- scores of every head over this block (key columns of head j read once) --------------------------
        s = tl.zeros((H_PAD, BLOCK_N), tl.float32)
        for j in range(0, h):
            k = tl.load(rows_t + j * dk + ds[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0)
            qj = tl.load(q_base + j * dk + ds, mask=d_ok, other=0.0)
            if ROPE_KEYS:
                qp = tl.load(q_base + j * dk + d_partner, mask=d_rot, other=0.0)
                qr = qj[None, :] * cos_d + qp[None, :] * sin_p  # (BLOCK_N, DK_PAD): query seen by each row
                sj = tl.sum(k.to(tl.float32) * qr, axis=1)
            else:
                sj = tl.sum(k.to(tl.float32) * qj[None, :], axis=1)
            s = tl.where(heads[:, None] == j, sj[None, :], s)
        s = s * scaling
        if HAS_MASK:
            s = s + tl.load(MASK + b * s_mb + t, mask=t_ok, other=0.0)[None, :]
        s = tl.where(t_ok[None, :] & head_ok[:, None], s, float("-inf"))
        # -- online softmax per head ------------------------------------------------------------------------
        m_new, alpha, p, l_i = softmax_step(s, m_i, l_i)  # (H_PAD, BLOCK_N)
        # -- u tile: all heads in one product over the block's rows ------------------------------------------
        ok_c = t_ok[:, None] & col_ok[None, :]
        x = tl.load(rows_t + cols[None, :], mask=ok_c, other=0.0).to(tl.float32)  # (BLOCK_N, BLOCK_C)
        if UNROTATE:  # keys stored rotated: u sums the un-rotated rows
            ok_u = t_ok[:, None] & col_rot[None, :]
            xp = tl.load(rows_t + col_partner[None, :], mask=ok_u, other=0.0).to(tl.float32)
            cc = tl.load(COS + b * s_cb + t[:, None] * s_cn + col_d[None, :], mask=ok_u, other=1.0)
            ss = tl.load(SIN + b * s_cb + t[:, None] * s_cn + col_d[None, :], mask=ok_u, other=0.0)
            x = x * cc + xp * ss * sign_unrot[None, :]
        acc = acc * alpha[:, None] + tl.dot(p, x, input_precision=DOT)
        m_i = m_new

    out, lse = finish(acc, m_i, l_i)
    part = (b * splits + split) * h  # partials (B, splits, h, c) and (B, splits, h)
    tl.store(PO + (part + heads[:, None]) * c + cols[None, :], out, mask=head_ok[:, None] & col_ok[None, :])
    tl.store(PL + part + heads, lse, mask=heads < tl.where(tile == 0, h, 0))  # written once, by tile 0


# ---- launcher ------------------------------------------------------------------------------------------------


def covers(q: torch.Tensor, rows: torch.Tensor) -> str | None:
    """Why the kernels do not take these inputs (``None`` when they do): head dim, row dtype, autograd."""
    if q.dim() == 3 and q.shape[-1] > MAX_HEAD_DIM:
        return f"head dim {q.shape[-1]} > {MAX_HEAD_DIM}"
    if rows.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"rows of dtype {rows.dtype} (fp32, fp16 or bf16 only)"
    if torch.is_grad_enabled() and (q.requires_grad or rows.requires_grad):
        return "inputs that require grad (the kernels have no backward)"
    return None


def check(q, rows, cos, sin, mask, lengths) -> None:
    """Argument checks as named ValueErrors (no device sync: ``lengths`` are clamped to ``[0, n]`` in the kernel)."""
    name = "kvslim::slim_decode_triton"
    if q.dim() != 3 or q.dtype != torch.float32:
        raise ValueError(f"{name}: q must be float32 (B, h, dk), got {q.dtype} {tuple(q.shape)}")
    b, h, dk = q.shape
    if rows.dim() != 3 or rows.shape[0] != b or rows.shape[2] < h * dk:
        raise ValueError(f"{name}: rows must be (B={b}, n, c ≥ h·dk={h * dk}), got {tuple(rows.shape)}")
    n = rows.shape[1]
    if (cos is None) != (sin is None):
        raise ValueError(f"{name}: cos and sin come together")
    if cos is not None:
        for t, what in ((cos, "cos"), (sin, "sin")):
            if (t.dtype != torch.float32 or t.dim() != 3 or t.shape[0] not in (1, b) or t.shape[1] != n
                    or t.shape[2] > dk or t.shape[2] % 2 or t.shape != cos.shape):
                raise ValueError(f"{name}: {what} must be float32 (1 or B={b}, n={n}, R ≤ dk={dk}, even), shaped "
                                 f"like cos, got {t.dtype} {tuple(t.shape)}")
    if mask is not None and (mask.dtype != torch.float32 or mask.dim() != 2 or mask.shape[0] not in (1, b)
                             or mask.shape[1] != n):
        raise ValueError(f"{name}: mask must be float32 (1 or B={b}, n={n}), got {mask.dtype} {tuple(mask.shape)}")
    if lengths is not None and (lengths.dtype != torch.int64 or tuple(lengths.shape) != (b,)):
        raise ValueError(f"{name}: lengths must be int64 of shape (B={b},), got {lengths.dtype} "
                         f"{tuple(lengths.shape)}")


def choose_splits(tasks: int, n: int, block: int, sms: int, splits: int = 0) -> tuple[int, int]:
    """``(splits, chunk)``: the rows ``[0, n)`` cut into ``splits`` chunks of ``chunk`` rows (a multiple of
    ``block``). Forced ``splits`` > 0 is honoured up to one block per split; otherwise enough splits for about two
    programs per SM, each at least 256 rows long."""
    blocks = -(-n // block)
    if blocks <= 1:
        return 1, max(n, 1)
    want = splits if splits > 0 else min(-(-2 * sms // max(tasks, 1)), -(-n // 256), 64)
    want = max(1, min(want, blocks))
    chunk = -(-blocks // want) * block
    return -(-n // chunk), chunk


def tiles(h: int, c: int, unrotate: bool = False) -> tuple[int, int, int]:
    """``(h_pad, block_c, num_warps)``: heads padded for ``tl.dot`` (≥ 16) and the u column tile within ``MAX_ACC``
    (half of it where the tile is un-rotated: its partner columns and RoPE table take registers too; ptxas sm_90,
    triton 3.6: 292 bytes of spills at h_pad 16, dk 128, BLOCK_C 512, none at 256)."""
    h_pad = max(16, triton.next_power_of_2(h))
    block_c = max(16, min(triton.next_power_of_2(c), MAX_ACC // h_pad // (2 if unrotate else 1)))
    return h_pad, block_c, 4 if h_pad * block_c <= 2048 else 8



def launch(q: torch.Tensor, rows: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
           mask: torch.Tensor | None, lengths: torch.Tensor | None, scaling: float, rotated: bool,
           splits: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(u (B, h, c), lse (B, h))`` fp32; arguments as :func:`kvslim.kernels.slim_decode.reference` (``q``,
    ``cos``, ``sin`` and ``mask`` fp32; ``splits`` > 0 forces the number of splits of the rows)."""
    interpreter_scalars()  # Triton 3.6's interpreter: loop bounds computed in the kernel
    check(q, rows, cos, sin, mask, lengths)
    b, h, dk = q.shape
    n, c = rows.shape[1], rows.shape[2]
    out = q.new_empty(b, h, c)
    lse = q.new_empty(b, h)
    if b * h == 0:
        return out, lse
    if n == 0:
        return out.fill_(float("nan")), lse.fill_(float("-inf"))  # the twin's softmax over nothing
    q = q.contiguous()
    rows, mask = unit_last(rows), unit_last(mask)
    if cos is not None:
        cos, sin = unit_last(cos), unit_last(sin)
        if cos.stride() != sin.stride():
            cos, sin = cos.contiguous(), sin.contiguous()
    h_pad, block_c, warps = tiles(h, c, cos is not None and bool(rotated))
    dk_pad = max(16, triton.next_power_of_2(dk))
    block_n = 16
    col_tiles = triton.cdiv(c, block_c)
    sms = (torch.cuda.get_device_properties(q.device).multi_processor_count if q.device.type == "cuda"
           else DEFAULT_SMS)
    s, chunk = choose_splits(b * col_tiles, n, block_n, sms, splits)
    if s == 1:
        part_o, part_l = out, lse
    else:
        part_o = q.new_empty(b, s, h, c)
        part_l = q.new_empty(b, s, h)
    dummy = q  # pointer for absent optional tensors (never read: constexpr flags)
    s_cb = 0 if cos is None or cos.shape[0] == 1 else cos.stride(0)
    s_cn = 0 if cos is None else cos.stride(1)
    s_mb = 0 if mask is None or mask.shape[0] == 1 else mask.stride(0)
    _slim_stage1[(col_tiles, s, b)](
        q, rows, dummy if cos is None else cos, dummy if sin is None else sin, dummy if mask is None else mask,
        dummy if lengths is None else lengths, part_o, part_l,
        rows.stride(0), rows.stride(1), s_cb, s_cn, s_mb,
        h, dk, c, n, 0 if cos is None else cos.shape[2], chunk, float(scaling),
        H_PAD=h_pad, DK_PAD=dk_pad, BLOCK_N=block_n, BLOCK_C=block_c, ROPE_KEYS=cos is not None and not rotated,
        UNROTATE=cos is not None and bool(rotated), HAS_MASK=mask is not None, HAS_LENGTHS=lengths is not None,
        DOT=DOT_PRECISION, num_warps=warps, num_stages=1)
    if s > 1:
        merge_splits(part_o, part_l, out, lse)
    return out, lse


@functools.cache
def op():
    """``torch.ops.kvslim.slim_decode_triton``, registered on first use (a custom op with a fake impl)."""

    @torch.library.custom_op("kvslim::slim_decode_triton", mutates_args=())
    def slim_decode_triton(q: torch.Tensor, rows: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                           mask: torch.Tensor | None, lengths: torch.Tensor | None, scaling: float, rotated: bool,
                           splits: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return launch(q, rows, cos, sin, mask, lengths, scaling, rotated, splits)

    @slim_decode_triton.register_fake
    def _(q, rows, cos, sin, mask, lengths, scaling, rotated, splits=0):
        b, h, _ = q.shape
        return q.new_empty(b, h, rows.shape[2]), q.new_empty(b, h)

    return torch.ops.kvslim.slim_decode_triton


def slim_decode_mapped(q: torch.Tensor, rows: torch.Tensor, value_map: torch.Tensor, cos: torch.Tensor | None,
                       sin: torch.Tensor | None, mask: torch.Tensor | None, lengths: torch.Tensor | None,
                       scaling: float, rotated: bool, splits: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (B, h, odk), lse (B, h))``: :func:`op` then ``out_j = u_j · value_map[j]`` (h, c, odk) fp32, one batched
    matmul over heads in torch after the kernel (a tiny GEMM next to the pass over the rows)."""
    if value_map.dim() != 3 or value_map.shape[0] != q.shape[1] or value_map.shape[1] != rows.shape[2]:
        raise ValueError(f"kvslim::slim_decode_triton: value_map must be (h={q.shape[1]}, c={rows.shape[2]}, odk), "
                         f"got {tuple(value_map.shape)}")
    u, lse = op()(q, rows, cos, sin, mask, lengths, scaling, rotated, splits)
    out = torch.bmm(u.transpose(0, 1), value_map.float())  # "bhc,hck->hbk": (h, B, odk)
    return out.transpose(0, 1), lse


__all__ = ["MAX_ACC", "MAX_HEAD_DIM", "check", "choose_splits", "covers", "launch", "merge_splits", "op",
           "slim_decode_mapped", "tiles"]
