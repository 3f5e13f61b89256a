"""Triton encoder-decoder cross-attention decode over the shared encoder output E (SPEC §3 "Encoder-decoder").

The GPU twin of ``csrc/encdec_decode.cpp``, same contract as :func:`kvslim.kernels.encdec_decode.reference`: for one
query token per sequence and absorbed queries ``qt_j = q_j W_K,jᵀ`` (B, h, d), ``u_j = softmax(scaling · qt_j Eᵀ +
mask) E`` (B, h, d) and ``lse_j`` (B, h) fp32 over the first ``lengths[b]`` (≤ n) frames of E (B, n, d) (fp32, fp16
or bf16). Flash-decoding in two kernels:

* ``_encdec_stage1``: one program per (column tile of u, split of the frames, sequence). Per block of ``BLOCK_N``
  frames: the scores of every head as ``tl.dot`` over d in ``BLOCK_D`` slices (every head reads every column), an
  online softmax per head, then ``acc (h, BLOCK_C) += p · E[:, tile]`` in one ``tl.dot``. E is read once for all
  heads; u is tiled over d by the grid past ``MAX_ACC`` (h_pad · BLOCK_C fp32 in registers): Whisper tiny and
  base run one tile, small and medium two, large (h 20 → 32 padded, d 1280) five, each recomputing its block's
  scores (E read again from L2: the tiles of one block are neighbours in the launch order). Frames at
  or past ``lengths[b]`` are never read (masked loads).
* stage 2: the log-sum-exp merge of the splits, :func:`kvslim.kernels.triton.merge.merge_splits`.

:func:`launch` (bottom) takes only tensors and sizes; :func:`op` registers it as
``torch.ops.kvslim.encdec_decode_triton`` (a ``torch.library.custom_op`` with a fake impl). ``encdec_decode_mapped``
is that op between two batched matmuls in torch (``qt = q · w_k`` before, ``u · w_vᵀ + b_v`` after: tiny GEMMs).
Importing this module imports Triton; :mod:`kvslim.kernels.encdec_decode` imports it only when Triton is picked.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import interpreter_scalars
from .merge import finish, merge_splits, softmax_step, unit_last
from .slim_decode import DEFAULT_SMS, DOT_PRECISION, MAX_ACC, choose_splits, tiles


@triton.jit
def _encdec_stage1(
    QT, ENC, MASK, LENGTHS, PO, PL,
    s_eb, s_en, s_mb,
    h, d, n, chunk, scaling,
    H_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_LENGTHS: tl.constexpr, DOT: tl.constexpr,
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    splits = tl.num_programs(1)

    heads = tl.arange(0, H_PAD)
    toks = tl.arange(0, BLOCK_N)
    dd = tl.arange(0, BLOCK_D)
    cols = tile * BLOCK_C + tl.arange(0, BLOCK_C)  # this program's columns of u
    head_ok = heads < h
    col_ok = cols < d

    enc_base = ENC + b * s_eb
    qt_base = QT + b * h * d
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
        rows_t = enc_base + t[:, None] * s_en  # (BLOCK_N, 1) frame pointers
        # -- scores of every head: qt (h, d) · E_blockᵀ, d in slices ------------------------------------------
        s = tl.zeros((H_PAD, BLOCK_N), tl.float32)
        for d0 in range(0, d, BLOCK_D):
            dc = d0 + dd
            d_ok = dc < d
            qt = tl.load(qt_base + heads[:, None] * d + dc[None, :], mask=head_ok[:, None] & d_ok[None, :],
                         other=0.0)  # (H_PAD, BLOCK_D)
            x = tl.load(rows_t + dc[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            s += tl.dot(qt, tl.trans(x), input_precision=DOT)
        s = s * scaling
        if HAS_MASK:
            s = s + tl.load(MASK + b * s_mb + t, mask=t_ok, other=0.0)[None, :]
        s = tl.where(t_ok[None, :] & head_ok[:, None], s, float("-inf"))
        # -- online softmax per head, then the u tile of all heads in one product ----------------------------
        m_new, alpha, p, l_i = softmax_step(s, m_i, l_i)  # (H_PAD, BLOCK_N)
        x = tl.load(rows_t + cols[None, :], mask=t_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, x, input_precision=DOT)
        m_i = m_new

    out, lse = finish(acc, m_i, l_i)
    part = (b * splits + split) * h  # partials (B, splits, h, d) and (B, splits, h)
    tl.store(PO + (part + heads[:, None]) * d + cols[None, :], out, mask=head_ok[:, None] & col_ok[None, :])
    tl.store(PL + part + heads, lse, mask=heads < tl.where(tile == 0, h, 0))  # written once, by tile 0


# ---- launcher ------------------------------------------------------------------------------------------------


def covers(qt: torch.Tensor, enc: torch.Tensor) -> str | None:
    """Why the kernels do not take these inputs (``None`` when they do): E's dtype, autograd."""
    if enc.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"an encoder output of dtype {enc.dtype} (fp32, fp16 or bf16 only)"
    if torch.is_grad_enabled() and (qt.requires_grad or enc.requires_grad):
        return "inputs that require grad (the kernels have no backward)"
    return None


def check(qt, enc, mask, lengths) -> None:
    """Argument checks as named ValueErrors (no device sync: ``lengths`` are clamped to ``[0, n]`` in the kernel)."""
    name = "kvslim::encdec_decode_triton"
    if qt.dim() != 3 or qt.dtype != torch.float32:
        raise ValueError(f"{name}: qt must be float32 (B, h, d), got {qt.dtype} {tuple(qt.shape)}")
    b, h, d = qt.shape
    if enc.dim() != 3 or enc.shape[0] != b or enc.shape[2] != d:
        raise ValueError(f"{name}: enc must be (B={b}, n, d={d}), got {tuple(enc.shape)}")
    n = enc.shape[1]
    if mask is not None and (mask.dtype != torch.float32 or mask.dim() != 2 or mask.shape[0] not in (1, b)
                             or mask.shape[1] != n):
        raise ValueError(f"{name}: mask must be float32 (1 or B={b}, n={n}), got {mask.dtype} {tuple(mask.shape)}")
    if lengths is not None and (lengths.dtype != torch.int64 or tuple(lengths.shape) != (b,)):
        raise ValueError(f"{name}: lengths must be int64 of shape (B={b},), got {lengths.dtype} "
                         f"{tuple(lengths.shape)}")


def launch(qt: torch.Tensor, enc: torch.Tensor, mask: torch.Tensor | None, lengths: torch.Tensor | None,
           scaling: float, splits: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(u (B, h, d), lse (B, h))`` fp32; arguments as :func:`kvslim.kernels.encdec_decode.reference` (``qt`` and
    ``mask`` fp32; ``splits`` > 0 forces the number of splits of the frames)."""
    interpreter_scalars()  # Triton 3.6's interpreter: loop bounds computed in the kernel
    check(qt, enc, mask, lengths)
    b, h, d = qt.shape
    n = enc.shape[1]
    out = qt.new_empty(b, h, d)
    lse = qt.new_empty(b, h)
    if b * h == 0:
        return out, lse
    if n == 0:
        return out.fill_(float("nan")), lse.fill_(float("-inf"))  # the twin's softmax over nothing
    qt = qt.contiguous()
    enc, mask = unit_last(enc), unit_last(mask)
    h_pad, block_c, warps = tiles(h, d)
    block_n = 16
    block_d = max(16, min(64, triton.next_power_of_2(d)))
    col_tiles = triton.cdiv(d, block_c)
    sms = (torch.cuda.get_device_properties(qt.device).multi_processor_count if qt.device.type == "cuda"
           else DEFAULT_SMS)
    s, chunk = choose_splits(b * col_tiles, n, block_n, sms, splits)
    if s == 1:
        part_o, part_l = out, lse
    else:
        part_o = qt.new_empty(b, s, h, d)
        part_l = qt.new_empty(b, s, h)
    dummy = qt  # pointer for absent optional tensors (never read: constexpr flags)
    s_mb = 0 if mask is None or mask.shape[0] == 1 else mask.stride(0)
    _encdec_stage1[(col_tiles, s, b)](
        qt, enc, dummy if mask is None else mask, dummy if lengths is None else lengths, part_o, part_l,
        enc.stride(0), enc.stride(1), s_mb, h, d, n, chunk, float(scaling),
        H_PAD=h_pad, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_C=block_c, HAS_MASK=mask is not None,
        HAS_LENGTHS=lengths is not None, DOT=DOT_PRECISION, num_warps=warps,
        num_stages=1)  # pipelining the d loop doubles the registers (ptxas sm_90: 254 vs 122) for no extra reuse
    if s > 1:
        merge_splits(part_o, part_l, out, lse)
    return out, lse


@functools.cache
def op():
    """``torch.ops.kvslim.encdec_decode_triton``, registered on first use (a custom op with a fake impl)."""

    @torch.library.custom_op("kvslim::encdec_decode_triton", mutates_args=())
    def encdec_decode_triton(qt: torch.Tensor, enc: torch.Tensor, mask: torch.Tensor | None,
                             lengths: torch.Tensor | None, scaling: float,
                             splits: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return launch(qt, enc, mask, lengths, scaling, splits)

    @encdec_decode_triton.register_fake
    def _(qt, enc, mask, lengths, scaling, splits=0):
        b, h, d = qt.shape
        return qt.new_empty(b, h, d), qt.new_empty(b, h)

    return torch.ops.kvslim.encdec_decode_triton


def encdec_decode_mapped(q: torch.Tensor, enc: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor,
                         b_v: torch.Tensor | None, mask: torch.Tensor | None, lengths: torch.Tensor | None,
                         scaling: float, dk_last: bool = False, splits: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (B, h, dv), lse (B, h))`` of :func:`kvslim.kernels.encdec_decode.reference_mapped`: absorbed queries
    ``qt_j = q_j · w_k[j]`` and ``out_j = u_j · w_v[j]ᵀ + b_v[j]`` as batched matmuls over heads in torch around
    :func:`op` (``w_k`` (h, dk, d), ``w_v`` (h, dv, d); with ``dk_last`` (h, d, dk) and (h, d, dv))."""
    h, d = q.shape[1], enc.shape[2]
    if w_k.dim() != 3 or w_v.dim() != 3 or w_k.shape[0] != h or w_v.shape[0] != h:
        raise ValueError(f"kvslim::encdec_decode_triton: w_k and w_v must be (h={h}, ·, ·), got {tuple(w_k.shape)} "
                         f"and {tuple(w_v.shape)}")
    wk = w_k.float() if dk_last else w_k.float().transpose(1, 2)  # (h, d, dk)
    wv = w_v.float() if dk_last else w_v.float().transpose(1, 2)  # (h, d, dv)
    if wk.shape[1] != d or wv.shape[1] != d or wk.shape[2] != q.shape[2]:
        raise ValueError(f"kvslim::encdec_decode_triton: w_k and w_v must map dk={q.shape[2]} / dv to d={d} per "
                         f"head, got {tuple(w_k.shape)} and {tuple(w_v.shape)} (dk_last={dk_last})")
    qt = torch.bmm(q.float().transpose(0, 1), wk.transpose(1, 2)).transpose(0, 1)  # "bhk,hkc->bhc": (B, h, d)
    u, lse = op()(qt.contiguous(), enc, mask, lengths, scaling, splits)
    out = torch.bmm(u.transpose(0, 1), wv).transpose(0, 1)  # "bhc,hck->bhk": (B, h, dv)
    return (out if b_v is None else out + b_v.float().reshape(h, -1)), lse


__all__ = ["MAX_ACC", "check", "covers", "encdec_decode_mapped", "launch", "op"]
