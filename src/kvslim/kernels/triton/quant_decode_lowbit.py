"""Triton decode attention straight from asymmetric 2-bit / 3-bit KV codes (the ``int2`` method's format).

The GPU twin of ``csrc/quant_decode_lowbit.cpp``, same contract as :func:`kvslim.kernels.quant_decode_lowbit.reference`:
``(out (B, Hk, G, D), lse (B, Hk, G))`` fp32 for one query token, over the first ``lengths[b]`` (≤ n) coded tokens
of each KV head, then an optional fp32 tail, with an additive mask (B|1, n + r). Flash-decoding in two kernels:

* ``_lowbit_stage1``: one program per (sequence, KV head, split of the coded tokens); the G query heads of the KV
  group are one block (padded to 16 rows for ``tl.dot``); codes are unpacked and dequantized in registers
  (``c·s + z``; 3 bits: code ``8i + j`` at bits ``[3j, 3j+3)`` of 3 bytes, read as two bytes around its bit
  offset; 2 bits: 4 codes per byte, low bits first); online softmax; the last split also attends the tail. Slots at
  or past ``lengths[b]`` (or ``n``) are never read: their loads are masked, so NaN there cannot leak.
* stage 2, :func:`kvslim.kernels.triton.merge.merge_splits`: the log-sum-exp merge of the splits (skipped with one
  split: stage 1 writes the result).

:func:`launch` (bottom) takes only tensors and sizes and picks the block sizes and the split count;
it is registered as the op ``torch.ops.kvslim.quant_decode_lowbit_triton`` (a ``torch.library.custom_op`` with a
fake impl, so ``torch.compile(fullgraph=True)`` traces a call) when this module is imported. Importing it imports
Triton; the dispatch (:mod:`kvslim.kernels.quant_decode_lowbit`) imports it only when the Triton backend is picked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreter_scalars
from .merge import DOT_CHOICES as DOT_CHOICES  # re-exported: the variants a launcher takes
from .merge import check_dot, check_pages, finish, merge_splits, mm, softmax_step, stored_pages, unit_last

#: the largest head dim the kernel takes (a (BLOCK_N, D) fp32 tile of keys and of values lives in registers)
MAX_HEAD_DIM = 256
#: streaming multiprocessors assumed when the tensors are not on a GPU (interpreter runs): an H100 SXM
DEFAULT_SMS = 132


@triton.jit
def _codes(rows, t_ok, BITS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """fp32 codes (BLOCK_N, D_PAD) of the packed rows starting at ``rows`` (BLOCK_N,): whole bytes (2 bits) or 3-byte
    words (3 bits) loaded as a tile, the codes shifted out in registers; 0 where not ``t_ok`` or past D."""
    if BITS == 2:  # code 4i + j at bits [2j, 2j+2) of byte i
        i = tl.arange(0, D_PAD // 4)
        ok = t_ok[:, None] & (i < D // 4)[None, :]
        word = tl.load(rows[:, None] + i[None, :], mask=ok, other=0).to(tl.int32)  # (BLOCK_N, D_PAD/4)
        code = (word[:, :, None] >> (tl.arange(0, 4) * 2)[None, None, :]) & 3  # (BLOCK_N, D_PAD/4, 4)
    else:  # code 8i + j at bits [3j, 3j+3) of the little-endian word of bytes 3i, 3i+1, 3i+2
        i = tl.arange(0, D_PAD // 8)
        ok = t_ok[:, None] & (i < D // 8)[None, :]
        at = rows[:, None] + 3 * i[None, :]
        word = tl.load(at, mask=ok, other=0).to(tl.int32)
        word = word | (tl.load(at + 1, mask=ok, other=0).to(tl.int32) << 8)
        word = word | (tl.load(at + 2, mask=ok, other=0).to(tl.int32) << 16)  # (BLOCK_N, D_PAD/8)
        code = (word[:, :, None] >> (tl.arange(0, 8) * 3)[None, None, :]) & 7  # (BLOCK_N, D_PAD/8, 8)
    return tl.reshape(code, (BLOCK_N, D_PAD)).to(tl.float32)


@triton.jit
def _per_token(rows, t_ok, cols, GS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
               GS_POW2: tl.constexpr):
    """fp32 per-token parameters (BLOCK_N, D_PAD) of rows ``rows`` (BLOCK_N,) holding one value per ``GS`` channels:
    loaded as (BLOCK_N, D/GS) and broadcast over each group in registers (a power-of-two GS), else gathered."""
    if GS_POW2:
        j = tl.arange(0, D_PAD // GS)
        x = tl.load(rows[:, None] + j[None, :], mask=t_ok[:, None] & (j < D // GS)[None, :], other=0.0)
        x = tl.broadcast_to(x.to(tl.float32)[:, :, None], (BLOCK_N, D_PAD // GS, GS))
        return tl.reshape(x, (BLOCK_N, D_PAD))
    else:
        ok = t_ok[:, None] & (cols < D)[None, :]
        return tl.load(rows[:, None] + (cols // GS)[None, :], mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _attend(q, k, v, s_add, t_ok, m_i, l_i, acc, DOT: tl.constexpr):
    """One block of the online softmax: scores q·kᵀ + s_add ((G_PAD, BLOCK_N); −inf where not ``t_ok``); operand
    precision ``DOT`` (``merge.DOT_CHOICES``)."""
    s = mm(q, tl.trans(k), DOT) + s_add  # (G_PAD, BLOCK_N)
    s = tl.where(t_ok[None, :], s, float("-inf"))
    m_new, alpha, p, l_i = softmax_step(s, m_i, l_i)
    acc = acc * alpha[:, None] + mm(p, v, DOT)
    return m_new, l_i, acc


@triton.jit
def _lowbit_stage1(
    Q, KC, KS, KZ, VC, VS, VZ, LENGTHS, KT, VT, MASK, PO, PL, PAGES,
    s_qb, s_qh, s_qg, s_pb, s_ph,
    s_kcb, s_kch, s_kct, s_ksb, s_ksh, s_kst, s_kzb, s_kzh, s_kzt,
    s_vcb, s_vch, s_vct, s_vsb, s_vsh, s_vst, s_vzb, s_vzh, s_vzt,
    s_ktb, s_kth, s_ktt, s_vtb, s_vth, s_vtt, s_mb,
    Hk, G, n, r, chunk, scaling, npg,
    D: tl.constexpr, D_PAD: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    KB: tl.constexpr, VB: tl.constexpr, GS: tl.constexpr, GS_POW2: tl.constexpr, KIVI: tl.constexpr,
    HAS_LENGTHS: tl.constexpr, HAS_TAIL: tl.constexpr, HAS_MASK: tl.constexpr, DOT: tl.constexpr,
    PAGE: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    b = bh // Hk
    h = bh % Hk
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)

    rows = tl.arange(0, G_PAD)  # query heads of the group
    cols = tl.arange(0, D_PAD)  # channels
    toks = tl.arange(0, BLOCK_N)
    row_ok = rows < G
    col_ok = cols < D
    q = tl.load(Q + b64 * s_qb + h64 * s_qh + rows[:, None] * s_qg + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    q = q * scaling  # (G_PAD, D_PAD)
    if KIVI > 0:  # group i's D key parameters over rows [i·g, (i+1)·g), D/g per row: channel c at (c // P, c % P)
        k_prow = cols // (D // KIVI)
        k_pcol = cols % (D // KIVI)

    kc_base = KC + b64 * s_kcb + h64 * s_kch
    ks_base = KS + b64 * s_ksb + h64 * s_ksh
    kz_base = KZ + b64 * s_kzb + h64 * s_kzh
    vc_base = VC + b64 * s_vcb + h64 * s_vch
    vs_base = VS + b64 * s_vsb + h64 * s_vsh
    vz_base = VZ + b64 * s_vzb + h64 * s_vzh
    m_base = MASK + b64 * s_mb

    length = n
    if HAS_LENGTHS:
        length = tl.minimum(tl.maximum(tl.load(LENGTHS + b).to(tl.int32), 0), n)
    start = split * chunk
    end = tl.minimum(start + chunk, length)

    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D_PAD), tl.float32)

    for t0 in range(start, end, BLOCK_N):  # blocks start at multiples of BLOCK_N
        t = t0 + toks
        t_ok = t < end  # never a slot at or past lengths[b] or n
        if PAGE > 0:  # a page list (sparse decode): the block lies in one listed page, read where it is stored
            listed = tl.load(PAGES + b64 * s_pb + h64 * s_ph + t0 // PAGE).to(tl.int64)
            p0 = tl.minimum(tl.maximum(listed, 0), npg - 1) * PAGE + t0 % PAGE  # in bounds whatever the ids
            ts = p0 + toks
        else:
            p0 = t0
            ts = t
        code = _codes(kc_base + ts * s_kct, t_ok, KB, D, D_PAD, BLOCK_N)
        if KIVI > 0:
            if KIVI % BLOCK_N == 0:  # the block lies in one token group: one parameter row of D, read once
                at = (p0 // KIVI) * KIVI + k_prow
                ks = tl.load(ks_base + at * s_kst + k_pcol, mask=col_ok, other=0.0).to(tl.float32)
                kz = tl.load(kz_base + at * s_kzt + k_pcol, mask=col_ok, other=0.0).to(tl.float32)
                k = code * ks[None, :] + kz[None, :]
            else:
                at = ((ts // KIVI) * KIVI)[:, None] + k_prow[None, :]
                ok = t_ok[:, None] & col_ok[None, :]
                ks = tl.load(ks_base + at * s_kst + k_pcol[None, :], mask=ok, other=0.0).to(tl.float32)
                kz = tl.load(kz_base + at * s_kzt + k_pcol[None, :], mask=ok, other=0.0).to(tl.float32)
                k = code * ks + kz
        else:
            k = (code * _per_token(ks_base + ts * s_kst, t_ok, cols, GS, D, D_PAD, BLOCK_N, GS_POW2)
                 + _per_token(kz_base + ts * s_kzt, t_ok, cols, GS, D, D_PAD, BLOCK_N, GS_POW2))  # (BLOCK_N, D_PAD)
        v = (_codes(vc_base + ts * s_vct, t_ok, VB, D, D_PAD, BLOCK_N)
             * _per_token(vs_base + ts * s_vst, t_ok, cols, GS, D, D_PAD, BLOCK_N, GS_POW2)
             + _per_token(vz_base + ts * s_vzt, t_ok, cols, GS, D, D_PAD, BLOCK_N, GS_POW2))  # 0 on slots not read
        s_add = tl.zeros((BLOCK_N,), tl.float32)
        if HAS_MASK:
            s_add = tl.load(m_base + t, mask=t_ok, other=0.0)
        m_i, l_i, acc = _attend(q, k, v, s_add[None, :], t_ok, m_i, l_i, acc, DOT)

    if HAS_TAIL:
        tail_end = tl.where(split == splits - 1, r, 0)  # the last split attends the fp32 tail
        kt_base = KT + b64 * s_ktb + h64 * s_kth
        vt_base = VT + b64 * s_vtb + h64 * s_vth
        for t0 in range(0, tail_end, BLOCK_N):
            t = t0 + toks
            t_ok = t < tail_end
            ok = t_ok[:, None] & col_ok[None, :]
            k = tl.load(kt_base + t[:, None] * s_ktt + cols[None, :], mask=ok, other=0.0)
            v = tl.load(vt_base + t[:, None] * s_vtt + cols[None, :], mask=ok, other=0.0)
            s_add = tl.zeros((BLOCK_N,), tl.float32)
            if HAS_MASK:
                s_add = tl.load(m_base + n + t, mask=t_ok, other=0.0)
            m_i, l_i, acc = _attend(q, k, v, s_add[None, :], t_ok, m_i, l_i, acc, DOT)

    out, lse = finish(acc, m_i, l_i)
    part = (bh.to(tl.int64) * splits + split) * G
    tl.store(PO + (part + rows[:, None]) * D + cols[None, :], out, mask=row_ok[:, None] & col_ok[None, :])
    tl.store(PL + part + rows, lse, mask=row_ok)


# ---- launcher ------------------------------------------------------------------------------------------------


def covers(q: torch.Tensor) -> str | None:
    """Why the kernels do not take this query (``None`` when they do): head dim, autograd."""
    if q.shape[-1] > MAX_HEAD_DIM or q.shape[-1] % 8:
        return f"head dim {q.shape[-1]} (the kernels take multiples of 8 up to {MAX_HEAD_DIM})"
    if torch.is_grad_enabled() and q.requires_grad:
        return "a query that requires grad (the kernels have no backward)"
    return None


def check(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_bits, v_bits, group_size, key_channel_group, n,
          lengths, k_tail, v_tail, mask, pages=None, page=0) -> None:
    """The C++ op's argument checks, as named ValueErrors (no device sync: ``lengths`` values are clamped to
    ``[0, n]`` in the kernel instead of checked)."""
    name = "kvslim::quant_decode_lowbit_triton"
    if q.dim() != 4 or q.dtype != torch.float32:
        raise ValueError(f"{name}: q must be float32 (B, Hk, G, D), got {q.dtype} {tuple(q.shape)}")
    b, hk, _, d = q.shape
    if k_bits not in (2, 3) or v_bits not in (2, 3):
        raise ValueError(f"{name}: k_bits and v_bits must be 2 or 3, got {k_bits} / {v_bits}")
    if d < 1 or d % 8 or (d * k_bits) % 8 or (d * v_bits) % 8:
        raise ValueError(f"{name}: the head dimension must be a positive multiple of 8, got {d}")
    if group_size < 1 or d % group_size:
        raise ValueError(f"{name}: group_size={group_size} must divide the head dimension {d}")
    if key_channel_group < 0 or (key_channel_group and d % key_channel_group):
        raise ValueError(f"{name}: key_channel_group={key_channel_group} must be 0 or divide the head dimension {d}")
    if n < 0:
        raise ValueError(f"{name}: n must be ≥ 0, got {n}")
    kivi = key_channel_group
    stored = check_pages(name, pages, page, b, hk, n, kivi, least=16)  # blocks are cut to the page
    ktokens = -(-stored // kivi) * kivi if kivi else stored
    kparams = d // kivi if kivi else d // group_size
    for t, what, tokens, width in ((k_codes, "k_codes", stored, d * k_bits // 8),
                                   (v_codes, "v_codes", stored, d * v_bits // 8),
                                   (k_scale, "k_scale", ktokens, kparams), (k_zero, "k_zero", ktokens, kparams),
                                   (v_scale, "v_scale", stored, d // group_size),
                                   (v_zero, "v_zero", stored, d // group_size)):
        if t.dim() != 4 or t.shape[0] != b or t.shape[1] != hk or t.shape[2] < tokens or t.shape[3] != width:
            raise ValueError(f"{name}: {what} must be (B={b}, Hk={hk}, ≥{tokens}, {width}), got {tuple(t.shape)}")
    if k_codes.dtype != torch.uint8 or v_codes.dtype != torch.uint8:
        raise ValueError(f"{name}: codes must be uint8, got {k_codes.dtype} / {v_codes.dtype}")
    dtypes = {t.dtype for t in (k_scale, k_zero, v_scale, v_zero)}
    if len(dtypes) != 1 or k_scale.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{name}: scales and zero-points must share one dtype of fp32/fp16/bf16, got {dtypes}")
    if lengths is not None and (lengths.dtype != torch.int64 or lengths.shape != (b,)):
        raise ValueError(f"{name}: lengths must be int64 of shape (B={b},), got {lengths.dtype} "
                         f"{tuple(lengths.shape)}")
    if (k_tail is None) != (v_tail is None):
        raise ValueError(f"{name}: k_tail and v_tail come together")
    r = 0
    if k_tail is not None:
        for t, what in ((k_tail, "k_tail"), (v_tail, "v_tail")):
            if t.dtype != torch.float32 or t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != (b, hk, d):
                raise ValueError(f"{name}: {what} must be float32 (B={b}, Hk={hk}, r, D={d}), got {t.dtype} "
                                 f"{tuple(t.shape)}")
        r = k_tail.shape[2]
        if v_tail.shape[2] != r:
            raise ValueError(f"{name}: k_tail and v_tail hold different token counts ({r} / {v_tail.shape[2]})")
    if mask is not None and (mask.dtype != torch.float32 or mask.dim() != 2 or mask.shape[0] not in (1, b)
                             or mask.shape[1] != n + r):
        raise ValueError(f"{name}: mask must be float32 (1 or B={b}, n + tail={n + r}), got {mask.dtype} "
                         f"{tuple(mask.shape)}")


def choose_splits(tasks: int, n: int, block: int, sms: int, splits: int = 0) -> tuple[int, int]:
    """``(splits, chunk)``: the coded tokens ``[0, n)`` cut into ``splits`` chunks of ``chunk`` tokens (a multiple
    of ``block``). Forced ``splits`` > 0 is honoured up to one block per split; otherwise enough splits for about
    two programs per SM, each at least 256 tokens long."""
    blocks = -(-n // block)
    if blocks <= 1:
        return 1, max(n, 1)
    want = splits if splits > 0 else min(-(-2 * sms // max(tasks, 1)), -(-n // 256), 64)
    want = max(1, min(want, blocks))
    chunk = -(-blocks // want) * block
    return -(-n // chunk), chunk


def block_size(d: int, key_channel_group: int) -> int:
    """Tokens per block: 64 / 32 / 16 for padded head dims ≤ 64 / 128 / 256 (sm_90, 8 warps, triton 3.9: 92 / 122 /
    115 registers, no spills), then halved (not below 16) until a KIVI token group holds whole blocks, so that a
    block's key parameters are one row read once."""
    d_pad = max(16, triton.next_power_of_2(d))
    block = 64 if d_pad <= 64 else 32 if d_pad <= 128 else 16
    while key_channel_group and key_channel_group % block and block > 16:
        block //= 2
    return block



def launch(q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
           v_codes: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor, k_bits: int, v_bits: int,
           group_size: int, key_channel_group: int, n: int, lengths: torch.Tensor | None,
           k_tail: torch.Tensor | None, v_tail: torch.Tensor | None, mask: torch.Tensor | None, scaling: float,
           splits: int = 0, dot: str = "ieee", pages: torch.Tensor | None = None,
           page: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (B, Hk, G, D), lse (B, Hk, G))`` fp32; arguments as :func:`kvslim.kernels.quant_decode_lowbit.reference`
    (``q``, the tail and the mask fp32; ``splits`` > 0 forces the number of splits of the coded tokens; ``dot``: the
    operand precision of the products, ``merge.DOT_CHOICES``; the op uses ``"ieee"``). ``pages`` (B, Hk,
    ≥ ⌈n / page⌉) integer with ``page`` (sparse decode): slot t read in place at stored row
    ``pages[b, h, t // page]·page + t % page`` (blocks no longer than a page, one page id per block)."""
    interpreter_scalars()  # Triton 3.6's interpreter: loop bounds computed in the kernel
    check(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_bits, v_bits, group_size, key_channel_group, n,
          lengths, k_tail, v_tail, mask, pages, page)
    check_dot(dot)
    b, hk, g, d = q.shape
    out = q.new_empty(b, hk, g, d)
    lse = q.new_empty(b, hk, g)
    if b * hk * g == 0:
        return out, lse
    q = q.contiguous()
    kc, ks, kz, vc, vs, vz, kt, vt, mask = (unit_last(t) for t in (k_codes, k_scale, k_zero, v_codes, v_scale,
                                                                      v_zero, k_tail, v_tail, mask))
    r = 0 if kt is None else kt.shape[2]
    d_pad = max(16, triton.next_power_of_2(d))
    g_pad = max(16, triton.next_power_of_2(g))
    block = block_size(d, key_channel_group)
    if pages is not None:
        block = min(block, page)
    pg = unit_last(pages) if pages is not None else None
    sms = (torch.cuda.get_device_properties(q.device).multi_processor_count if q.device.type == "cuda"
           else DEFAULT_SMS)
    s, chunk = choose_splits(b * hk, n, block, sms, splits)
    if s == 1:
        part_o, part_l = out, lse
    else:
        part_o = q.new_empty(b * hk, s, g, d)
        part_l = q.new_empty(b * hk, s, g)
    dummy = q  # pointer for absent optional tensors (never read: constexpr flags)
    kt_, vt_ = (kt, vt) if kt is not None else (dummy, dummy)
    st_k = kt.stride()[:3] if kt is not None else (0, 0, 0)
    st_v = vt.stride()[:3] if vt is not None else (0, 0, 0)
    s_mb = 0 if mask is None or mask.shape[0] == 1 else mask.stride(0)
    _lowbit_stage1[(b * hk, s)](
        q, kc, ks, kz, vc, vs, vz, lengths if lengths is not None else dummy, kt_, vt_,
        mask if mask is not None else dummy, part_o, part_l, pg if pg is not None else dummy,
        *q.stride()[:3], *(pg.stride()[:2] if pg is not None else (0, 0)),
        *kc.stride()[:3], *ks.stride()[:3], *kz.stride()[:3], *vc.stride()[:3], *vs.stride()[:3], *vz.stride()[:3],
        *st_k, *st_v, s_mb,
        hk, g, n, r, chunk, float(scaling), stored_pages(pages, page, kc, vc),
        D=d, D_PAD=d_pad, G_PAD=g_pad, BLOCK_N=block, KB=int(k_bits), VB=int(v_bits), GS=int(group_size),
        GS_POW2=group_size & (group_size - 1) == 0, KIVI=int(key_channel_group), HAS_LENGTHS=lengths is not None, HAS_TAIL=kt is not None and r > 0,
        HAS_MASK=mask is not None, DOT=dot, PAGE=int(page) if pages is not None else 0, num_warps=8)
    if s > 1:
        merge_splits(part_o, part_l, out.view(b * hk, g, d), lse.view(b * hk, g))
    return out, lse


@torch.library.custom_op("kvslim::quant_decode_lowbit_triton", mutates_args=())
def quant_decode_lowbit_triton(q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
                               v_codes: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor, k_bits: int,
                               v_bits: int, group_size: int, key_channel_group: int, n: int,
                               lengths: torch.Tensor | None, k_tail: torch.Tensor | None, v_tail: torch.Tensor | None,
                               mask: torch.Tensor | None, scaling: float, splits: int = 0,
                               pages: torch.Tensor | None = None, page: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`launch` as the op ``torch.ops.kvslim.quant_decode_lowbit_triton`` (registered when this module is
    first imported, which the dispatch does only when it picks Triton), opaque to torch.compile (fake impl below)."""
    return launch(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_bits, v_bits, group_size,
                  key_channel_group, n, lengths, k_tail, v_tail, mask, scaling, splits, pages=pages, page=page)


@quant_decode_lowbit_triton.register_fake
def _(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_bits, v_bits, group_size, key_channel_group, n,
      lengths, k_tail, v_tail, mask, scaling, splits=0, pages=None, page=0):
    b, hk, g, d = q.shape
    return q.new_empty(b, hk, g, d), q.new_empty(b, hk, g)


__all__ = ["MAX_HEAD_DIM", "block_size", "check", "choose_splits", "covers", "launch", "quant_decode_lowbit_triton"]
