"""Triton decode attention straight from TurboQuant-class codes (``turbo2``/``turbo3``/``turbo4``).

The GPU twin of ``csrc/turbo_decode.cpp``, same contract as :func:`kvslim.kernels.turbo_decode.reference`:
``(out (B, Hk, G, D), lse (B, Hk, G))`` fp32 for one query token over the first ``n`` coded tokens of each KV head
(or ``lengths[b]`` ≤ n, a (B,) int64 tensor: the block loop stops there, no slot past it is loaded),
then an optional fp32 tail, with an additive mask (B|1, n + r) and an optional factored score bias on the coded rows
(``bias_ab`` (B, Hk, G, W) · ``bias_rows`` (≥n, W)ᵀ: RoPE-centred keys' ``q·RoPE_t(μ)``), all in the stores' coded
bases.

``_turbo_decode``: one program per (sequence, KV head); the G query heads of the KV group are one block (padded to
16 rows for ``tl.dot``). A code is read from the row's little-endian bit stream (two bytes around its bit offset:
channel i of the outlier part at bit ``i·(KB+1)``, of the rest at ``KOUT·(KB+1) + (i − KOUT)·KB``), its level
gathered from the (5, 16) codebook table and multiplied by its part's scale, in registers; online softmax over
blocks of tokens, then the tail. One split per (sequence, KV head) (no flash-decoding split of the sequence).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import check_lengths
from . import interpreter_scalars
from .merge import check_pages, finish, softmax_step, stored_pages, unit_last

MAX_HEAD_DIM = 256


@triton.jit
def _rows(base, t, s_t, s_s, S, LEV, t_ok, cols, col_ok, KOUT: tl.constexpr, KB: tl.constexpr,
          NBYTES: tl.constexpr, PARTS: tl.constexpr):
    """fp32 rows (BLOCK_N, D_PAD) decoded in the coded basis: level of each code times its part's scale."""
    outlier = cols < KOUT
    bits = tl.where(outlier, KB + 1, KB)
    bit = tl.where(outlier, cols * (KB + 1), KOUT * (KB + 1) + (cols - KOUT) * KB)
    byte = bit // 8
    ok = t_ok[:, None] & col_ok[None, :]
    at = base + t[:, None] * s_t + byte[None, :]
    word = tl.load(at, mask=ok, other=0).to(tl.int32)
    nxt = ok & ((byte + 1) < NBYTES)[None, :]
    word = word | (tl.load(at + 1, mask=nxt, other=0).to(tl.int32) << 8)
    code = (word >> (bit % 8)[None, :]) & tl.where(outlier, (1 << (KB + 1)) - 1, (1 << KB) - 1)[None, :]
    level = tl.load(LEV + bits[None, :] * 16 + code, mask=ok, other=0.0)
    part = tl.where(outlier, 0, PARTS - 1)
    scale = tl.load(S + t[:, None] * s_s + part[None, :], mask=ok, other=0.0).to(tl.float32)
    return level * scale


@triton.jit
def _attend(q, k, v, s_add, t_ok, m_i, l_i, acc):
    s = tl.dot(q, tl.trans(k), input_precision="ieee") + s_add
    s = tl.where(t_ok[None, :], s, float("-inf"))
    m_new, alpha, p, l_i = softmax_step(s, m_i, l_i)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _turbo_decode(
    Q, KC, KS, VC, VS, LEV, KT, VT, MASK, BAB, BROWS, LENGTHS, OUT, LSE, PAGES,
    s_qb, s_qh, s_qg, s_pb, s_ph, s_kcb, s_kch, s_kct, s_ksb, s_ksh, s_kst, s_vcb, s_vch, s_vct, s_vsb, s_vsh, s_vst,
    s_ktb, s_kth, s_ktt, s_vtb, s_vth, s_vtt, s_mb, s_bb, s_bh, s_bg, s_br, W,
    Hk, G, n, r, scaling, npg,
    D: tl.constexpr, D_PAD: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    KOUT: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr, KBYTES: tl.constexpr, VBYTES: tl.constexpr,
    KPARTS: tl.constexpr, HAS_TAIL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
    W_PAD: tl.constexpr, HAS_LEN: tl.constexpr, PAGE: tl.constexpr,
):
    bh = tl.program_id(0)
    b64 = (bh // Hk).to(tl.int64)
    h64 = (bh % Hk).to(tl.int64)
    rows = tl.arange(0, G_PAD)
    cols = tl.arange(0, D_PAD)
    toks = tl.arange(0, BLOCK_N)
    row_ok = rows < G
    col_ok = cols < D
    q = tl.load(Q + b64 * s_qb + h64 * s_qh + rows[:, None] * s_qg + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=0.0) * scaling
    kc = KC + b64 * s_kcb + h64 * s_kch
    ks = KS + b64 * s_ksb + h64 * s_ksh
    vc = VC + b64 * s_vcb + h64 * s_vch
    vs = VS + b64 * s_vsb + h64 * s_vsh
    m_base = MASK + b64 * s_mb
    wcols = tl.arange(0, W_PAD)
    ab = tl.zeros((G_PAD, W_PAD), tl.float32)
    if HAS_BIAS:  # the bias factors of the G heads, times scaling, as q is
        ab = tl.load(BAB + b64 * s_bb + h64 * s_bh + rows[:, None] * s_bg + wcols[None, :],
                     mask=row_ok[:, None] & (wcols < W)[None, :], other=0.0) * scaling
    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D_PAD), tl.float32)
    length = n
    if HAS_LEN:  # the sequence's coded tokens (clamped to [0, n]): no block past them is loaded
        length = tl.minimum(tl.maximum(tl.load(LENGTHS + b64).to(tl.int32), 0), n)
    for t0 in range(0, length, BLOCK_N):
        t = t0 + toks
        t_ok = t < length
        if PAGE > 0:  # a page list (sparse decode): the block lies in one listed page, read where it is stored
            listed = tl.load(PAGES + b64 * s_pb + h64 * s_ph + t0 // PAGE).to(tl.int64)
            ts = tl.minimum(tl.maximum(listed, 0), npg - 1) * PAGE + t0 % PAGE + toks  # in bounds whatever the ids
        else:
            ts = t
        k = _rows(kc, ts, s_kct, s_kst, ks, LEV, t_ok, cols, col_ok, KOUT, KB, KBYTES, KPARTS)
        v = _rows(vc, ts, s_vct, s_vst, vs, LEV, t_ok, cols, col_ok, 0, VB, VBYTES, 1)
        s_add = tl.zeros((G_PAD, BLOCK_N), tl.float32)
        if HAS_MASK:
            s_add += tl.load(m_base + t, mask=t_ok, other=0.0)[None, :]
        if HAS_BIAS:
            br = tl.load(BROWS + ts[:, None] * s_br + wcols[None, :], mask=t_ok[:, None] & (wcols < W)[None, :],
                         other=0.0)
            s_add += tl.dot(ab, tl.trans(br), input_precision="ieee")
        m_i, l_i, acc = _attend(q, k, v, s_add, t_ok, m_i, l_i, acc)
    if HAS_TAIL:
        kt = KT + b64 * s_ktb + h64 * s_kth
        vt = VT + b64 * s_vtb + h64 * s_vth
        for t0 in range(0, r, BLOCK_N):
            t = t0 + toks
            t_ok = t < r
            ok = t_ok[:, None] & col_ok[None, :]
            k = tl.load(kt + t[:, None] * s_ktt + cols[None, :], mask=ok, other=0.0)
            v = tl.load(vt + t[:, None] * s_vtt + cols[None, :], mask=ok, other=0.0)
            s_add = tl.zeros((BLOCK_N,), tl.float32)
            if HAS_MASK:
                s_add = tl.load(m_base + n + t, mask=t_ok, other=0.0)
            m_i, l_i, acc = _attend(q, k, v, s_add[None, :], t_ok, m_i, l_i, acc)
    out, lse = finish(acc, m_i, l_i)
    at = bh.to(tl.int64) * G
    tl.store(OUT + (at + rows[:, None]) * D + cols[None, :], out, mask=row_ok[:, None] & col_ok[None, :])
    tl.store(LSE + at + rows, lse, mask=row_ok)


# ---- launcher ------------------------------------------------------------------------------------------------


def check(q, k_codes, k_scale, v_codes, v_scale, k_out, k_bits, v_bits, n, k_tail, v_tail, mask,
          bias_ab=None, bias_rows=None, lengths=None, pages=None, page=0) -> None:
    """The C++ op's argument checks, as named ValueErrors."""
    name = "kvslim::turbo_decode_triton"
    check_lengths(name, lengths, q, n)
    if q.dim() != 4 or q.dtype != torch.float32:
        raise ValueError(f"{name}: q must be float32 (B, Hk, G, D), got {q.dtype} {tuple(q.shape)}")
    b, hk, _, d = q.shape
    stored = check_pages(name, pages, page, b, hk, n, least=16)  # blocks are cut to the page
    if k_bits not in (2, 3, 4) or v_bits not in (2, 3, 4):
        raise ValueError(f"{name}: k_bits and v_bits must be 2, 3 or 4, got {k_bits} / {v_bits}")
    if not 0 <= k_out < d or (k_out and k_bits == 4) or d > MAX_HEAD_DIM:
        raise ValueError(f"{name}: k_out={k_out} must be in [0, D={d}) (0 with 4-bit keys), D ≤ {MAX_HEAD_DIM}")
    kbits = k_out * (k_bits + 1) + (d - k_out) * k_bits
    if kbits % 8 or (d * v_bits) % 8 or (k_out * (k_bits + 1)) % 8:
        raise ValueError(f"{name}: parts must fill whole bytes (k_out={k_out}, D={d})")
    parts = 2 if k_out else 1
    for t, what, width in ((k_codes, "k_codes", kbits // 8), (v_codes, "v_codes", d * v_bits // 8),
                           (k_scale, "k_scale", parts), (v_scale, "v_scale", 1)):
        if t.dim() != 4 or t.shape[0] != b or t.shape[1] != hk or t.shape[2] < stored or t.shape[3] != width:
            raise ValueError(f"{name}: {what} must be (B={b}, Hk={hk}, ≥{stored}, {width}), got {tuple(t.shape)}")
    if k_codes.dtype != torch.uint8 or v_codes.dtype != torch.uint8:
        raise ValueError(f"{name}: codes must be uint8, got {k_codes.dtype} / {v_codes.dtype}")
    if (k_tail is None) != (v_tail is None):
        raise ValueError(f"{name}: k_tail and v_tail come together")
    r = 0 if k_tail is None else k_tail.shape[2]
    if mask is not None and (mask.dim() != 2 or mask.shape[0] not in (1, b) or mask.shape[1] != n + r):
        raise ValueError(f"{name}: mask must be (1 or B={b}, n + tail={n + r}), got {tuple(mask.shape)}")
    g = q.shape[2]
    if (bias_ab is None) != (bias_rows is None):
        raise ValueError(f"{name}: bias_ab and bias_rows come together")
    if bias_ab is not None and (bias_ab.dim() != 4 or tuple(bias_ab.shape[:3]) != (b, hk, g)):
        raise ValueError(f"{name}: bias_ab must be (B={b}, Hk={hk}, G={g}, W), got {tuple(bias_ab.shape)}")
    if bias_ab is not None and (bias_rows.dim() != 2 or bias_rows.shape[0] < stored
                                or bias_rows.shape[1] != bias_ab.shape[3]):
        raise ValueError(f"{name}: bias_rows must be (≥{stored}, W={bias_ab.shape[3]}), got {tuple(bias_rows.shape)}")


def turbo_decode_triton(q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, v_codes: torch.Tensor,
                        v_scale: torch.Tensor, k_out: int, k_bits: int, v_bits: int, levels: torch.Tensor, n: int,
                        k_tail: torch.Tensor | None = None, v_tail: torch.Tensor | None = None,
                        mask: torch.Tensor | None = None, scaling: float = 1.0, bias_ab: torch.Tensor | None = None,
                        bias_rows: torch.Tensor | None = None, lengths: torch.Tensor | None = None,
                        pages: torch.Tensor | None = None, page: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.kvslim.turbo_decode_triton`` (a custom op with a fake impl: dynamo records one call per step, a
    CUDA graph replays the launch), checks included."""
    return torch.ops.kvslim.turbo_decode_triton(q, k_codes, k_scale, v_codes, v_scale, int(k_out), int(k_bits),
                                                int(v_bits), levels, int(n), k_tail, v_tail, mask, float(scaling),
                                                bias_ab, bias_rows, lengths, pages, int(page))


def launch(q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, v_codes: torch.Tensor,
           v_scale: torch.Tensor, k_out: int, k_bits: int, v_bits: int, levels: torch.Tensor, n: int,
           k_tail: torch.Tensor | None = None, v_tail: torch.Tensor | None = None,
           mask: torch.Tensor | None = None, scaling: float = 1.0, bias_ab: torch.Tensor | None = None,
           bias_rows: torch.Tensor | None = None, lengths: torch.Tensor | None = None,
           pages: torch.Tensor | None = None, page: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The checks, then the kernel launch (the custom op's body). ``pages`` (B, Hk, ≥ ⌈n / page⌉) integer with
    ``page`` (sparse decode): slot t read in place at stored row ``pages[b, h, t // page]·page + t % page``, its bias
    row too (blocks no longer than a page, one page id per block)."""
    interpreter_scalars()  # Triton 3.6's interpreter: loop bounds computed in the kernel
    q = q.float().contiguous()
    check(q, k_codes, k_scale, v_codes, v_scale, k_out, k_bits, v_bits, n, k_tail, v_tail, mask, bias_ab, bias_rows,
          lengths, pages, page)
    b, hk, g, d = q.shape
    k_codes, k_scale, v_codes, v_scale = (unit_last(t) for t in (k_codes, k_scale, v_codes, v_scale))
    out = torch.empty(b, hk, g, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, hk, g, dtype=torch.float32, device=q.device)
    has_tail = k_tail is not None and k_tail.shape[2] > 0
    kt = unit_last(k_tail.float()) if has_tail else q
    vt = unit_last(v_tail.float()) if has_tail else q
    r = kt.shape[2] if has_tail else 0
    m = mask.float().contiguous() if mask is not None else q
    s_mb = 0 if mask is None or mask.shape[0] == 1 else m.stride(0)
    has_bias = bias_ab is not None
    ab = unit_last(bias_ab.float()) if has_bias else q
    brows = bias_rows.float() if has_bias else q[0, 0]
    brows = brows if brows.stride(-1) == 1 else brows.contiguous()
    w = ab.shape[3] if has_bias else 16
    d_pad = max(16, triton.next_power_of_2(d))
    kbytes = (k_out * (k_bits + 1) + (d - k_out) * k_bits) // 8
    pg = unit_last(pages) if pages is not None else None
    _turbo_decode[(b * hk,)](
        q, k_codes, k_scale, v_codes, v_scale, levels.float().contiguous().to(q.device), kt, vt, m, ab, brows,
        q if lengths is None else lengths, out, lse, q if pg is None else pg,
        q.stride(0), q.stride(1), q.stride(2), *((0, 0) if pg is None else pg.stride()[:2]),
        *k_codes.stride()[:3], *k_scale.stride()[:3], *v_codes.stride()[:3], *v_scale.stride()[:3],
        *kt.stride()[:3], *vt.stride()[:3], s_mb, *ab.stride()[:3], brows.stride(0), w,
        hk, g, n, r, scaling, stored_pages(pg, page, k_codes, v_codes),
        D=d, D_PAD=d_pad, G_PAD=max(16, triton.next_power_of_2(g)), BLOCK_N=32 if pg is None else min(32, page),
        KOUT=k_out, KB=k_bits, VB=v_bits,
        KBYTES=kbytes, VBYTES=d * v_bits // 8, KPARTS=2 if k_out else 1, HAS_TAIL=has_tail,
        HAS_MASK=mask is not None, HAS_BIAS=has_bias, W_PAD=max(16, triton.next_power_of_2(w)), HAS_LEN=lengths is not None,
        PAGE=0 if pg is None else int(page), num_warps=4)
    return out, lse


def _register() -> None:
    """Define ``kvslim::turbo_decode_triton`` (a custom op with a fake impl) unless it exists (a module reload)."""
    if hasattr(torch.ops.kvslim, "turbo_decode_triton"):
        return

    @torch.library.custom_op("kvslim::turbo_decode_triton", mutates_args=())
    def turbo_decode_op(q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, v_codes: torch.Tensor,
                        v_scale: torch.Tensor, k_out: int, k_bits: int, v_bits: int, levels: torch.Tensor, n: int,
                        k_tail: torch.Tensor | None, v_tail: torch.Tensor | None, mask: torch.Tensor | None,
                        scaling: float, bias_ab: torch.Tensor | None,
                        bias_rows: torch.Tensor | None, lengths: torch.Tensor | None = None,
                        pages: torch.Tensor | None = None, page: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return launch(q, k_codes, k_scale, v_codes, v_scale, k_out, k_bits, v_bits, levels, n, k_tail, v_tail, mask,
                      scaling, bias_ab, bias_rows, lengths, pages, page)

    @turbo_decode_op.register_fake
    def _(q, k_codes, k_scale, v_codes, v_scale, k_out, k_bits, v_bits, levels, n, k_tail, v_tail, mask, scaling,
          bias_ab, bias_rows, lengths=None, pages=None, page=0):
        b, hk, g, d = q.shape
        return q.new_empty(b, hk, g, d, dtype=torch.float32), q.new_empty(b, hk, g, dtype=torch.float32)


_register()  # at import (once per process): dynamo traces calls to the op, never a registration
