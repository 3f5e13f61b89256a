"""Triton flash-decoding over grouped int8/int4 KV codes: the GPU twin of ``torch.ops.kvslim.quant_decode``.

Contract: :func:`kvslim.kernels.quant_decode.reference` with ``scores="exact"``, ``values="exact"`` (scores are
computed in fp32 from the codes; the CPU op's int8 query/weight rounding is a CPU speed trick that this path does
not take, whatever the call's ``scores``/``values`` say). Two kernels, split-K as SGLang's ``decode_attention.py``:

* ``_quant_stage1``: one program per (sequence, KV head × head block, split). The G query heads of the KV head are
  one (BLOCK_H ≥ 16, BLOCK_D) block so that both products are ``tl.dot`` (tensor-core shaped: M, N, K ≥ 16; padded
  rows and channels are masked). Codes are read as stored: int4 bytes are loaded once per channel and the nibble
  (low first) is taken in registers, symmetric nibbles sign-extended; scale/zero per token group of ``group_size``
  channels, or for KIVI keys per channel of a ``key_channel_group``-token group. Online softmax over the split's
  slots ``[start, min(end, lengths[b], n))`` — no slot past them is loaded (NaN there cannot leak). The same kernel
  (``TAIL``) attends the fp32 tail (slot columns ``n + j`` of the mask) into one extra partial.
* ``_quant_stage2``: one program per (sequence, KV head × head block): log-sum-exp merge of the splits. With
  ``v_unrot`` (value codes hold ``v·R``) the merged coded part is multiplied by M = Rᵀ, chunk of channels by chunk,
  before the tail's partial is added in the values' own basis (the tail is never rotated).

:func:`launch` is the plain launcher (tensors and sizes in, ``(out, lse)`` out); :func:`op` registers it as
``torch.ops.kvslim.quant_decode_triton`` (a ``torch.library.custom_op`` with a fake impl, so
``torch.compile(fullgraph=True)`` traces a call; not ``triton_op``: its tracing into the kernels cannot run under
the interpreter, so CI could not test it). Importing this module imports Triton and registers the op.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import interpreter_scalars
from .merge import DOT_CHOICES as DOT_CHOICES  # re-exported: the variants a launcher takes
from .merge import check_dot, check_pages, finish, mm, softmax_step, stored_pages, unit_last

#: the largest head dim the kernel takes (a (BLOCK_N, D) fp32 tile of keys and of values lives in registers)
MAX_HEAD_DIM = 256
#: fewest tokens a split gets when the split count is chosen (so the merge stays a small share of the work)
MIN_SPLIT_TOKENS = 128
#: splits per (sequence, KV head) at most, when chosen
MAX_SPLITS = 64


@triton.jit
def _dequant(C, S, Z, t, c, ok, sc_t, ss_t, BITS: tl.constexpr, ASYM: tl.constexpr, GROUP: tl.constexpr,
             KCG: tl.constexpr, KW: tl.constexpr):
    """fp32 values of slots ``t`` × channels ``c`` (broadcastable index blocks; ``ok`` masks the loads).
    C/S/Z point at one (sequence, head)'s codes / scales / zeros; ``sc_t``/``ss_t`` their token strides."""
    if BITS == 4:
        byte = tl.load(C + t * sc_t + c // 2, mask=ok, other=0).to(tl.int32)
        code = (byte >> ((c % 2) * 4)) & 15  # element 2i in the low nibble, 2i + 1 in the high one
        if not ASYM:
            code = code - ((code & 8) << 1)  # two's complement nibble
    else:
        code = tl.load(C + t * sc_t + c, mask=ok, other=0).to(tl.int32)  # int8 (symmetric) or uint8 codes
    if KCG > 0:  # KIVI: token group t // KCG keeps its D per-channel params in KCG rows of KW entries
        row = (t // KCG) * KCG + c // KW
        col = c % KW
    else:
        row = t
        col = c // GROUP
    x = code.to(tl.float32) * tl.load(S + row * ss_t + col, mask=ok, other=0.0).to(tl.float32)
    if ASYM:
        x += tl.load(Z + row * ss_t + col, mask=ok, other=0.0).to(tl.float32)
    return x


@triton.jit
def _quant_stage1(
    Q, KC, KS, KZ, VC, VS, VZ, KT, VT, MASK, LENGTHS, PO, PL, PAGES,
    n, r, G, tokens_per_split, slots, scaling, sp_b, sp_h, npg,
    sq_b, sq_h, sq_g,
    skc_b, skc_h, skc_t, sks_b, sks_h, sks_t,
    svc_b, svc_h, svc_t, svs_b, svs_h, svs_t,
    st_b, st_h, st_t, sm_b,
    D: tl.constexpr, BITS: tl.constexpr, ASYM: tl.constexpr, GROUP: tl.constexpr, KCG: tl.constexpr,
    KW: tl.constexpr, VGROUP: tl.constexpr, HAS_LEN: tl.constexpr, HAS_MASK: tl.constexpr, TAIL: tl.constexpr,
    NHB: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr,
    PAGE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)  # 64-bit offsets: a batch of long caches passes 2^31 bytes
    h = (tl.program_id(1) // NHB).to(tl.int64)
    hb = tl.program_id(1) % NHB
    split = tl.program_id(2)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < D
    q = tl.load(Q + b * sq_b + h * sq_h + offs_h[:, None] * sq_g + offs_d[None, :],
                mask=(offs_h < G)[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # (BLOCK_H, BLOCK_D)

    if TAIL:
        start = 0
        end = r
        col0 = n  # the tail's columns of the mask follow the n coded slots
        slot = slots - 1
    else:
        length = n
        if HAS_LEN:
            length = tl.minimum(tl.load(LENGTHS + b).to(tl.int32), n)
        start = split * tokens_per_split
        end = tl.minimum(start + tokens_per_split, length)
        col0 = 0
        slot = split

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s0 in range(start, end, BLOCK_N):
        t = s0 + offs_n
        live = t < end
        if TAIL:
            base = b * st_b + h * st_h
            k = tl.load(KT + base + t[None, :] * st_t + offs_d[:, None], mask=d_ok[:, None] & live[None, :],
                        other=0.0)  # (BLOCK_D, BLOCK_N)
        else:
            if PAGE > 0:  # a page list (sparse decode): logical slot t is stored row pages[t // PAGE]·PAGE + t % PAGE
                listed = tl.load(PAGES + b * sp_b + h * sp_h + t // PAGE, mask=live, other=0).to(tl.int64)
                listed = tl.minimum(tl.maximum(listed, 0), npg - 1)  # in bounds whatever the ids (no host check)
                row = listed * PAGE + t % PAGE
            else:
                row = t
            k = _dequant(KC + b * skc_b + h * skc_h, KS + b * sks_b + h * sks_h, KZ + b * sks_b + h * sks_h,
                         row[None, :], offs_d[:, None], d_ok[:, None] & live[None, :], skc_t, sks_t,
                         BITS, ASYM, GROUP, KCG, KW)
        s = mm(q, k, DOT) * scaling  # (BLOCK_H, BLOCK_N)
        if HAS_MASK:
            s += tl.load(MASK + b * sm_b + col0 + t, mask=live, other=0.0).to(tl.float32)[None, :]
        s = tl.where(live[None, :], s, float("-inf"))
        m_new, alpha, p, l_i = softmax_step(s, m_i, l_i)
        if TAIL:
            v = tl.load(VT + b * st_b + h * st_h + t[:, None] * st_t + offs_d[None, :],
                        mask=live[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_N, BLOCK_D)
        else:
            v = _dequant(VC + b * svc_b + h * svc_h, VS + b * svs_b + h * svs_h, VZ + b * svs_b + h * svs_h,
                         row[:, None], offs_d[None, :], live[:, None] & d_ok[None, :], svc_t, svs_t,
                         BITS, ASYM, VGROUP, 0, 1)
        acc = acc * alpha[:, None] + mm(p, v, DOT)
        m_i = m_new

    out, lse = finish(acc, m_i, l_i)
    rows = (b * tl.num_programs(1) + tl.program_id(1)) * slots + slot  # partials (B, Hk·NHB, slots, BLOCK_H, ...)
    tl.store(PO + (rows * BLOCK_H + tl.arange(0, BLOCK_H))[:, None] * BLOCK_D + offs_d[None, :], out)
    tl.store(PL + rows * BLOCK_H + tl.arange(0, BLOCK_H), lse)


@triton.jit
def _quant_stage2(
    PO, PL, M, OUT, LSE, G, splits, so_b, so_h, so_g, sl_b, sl_h,
    D: tl.constexpr, HAS_TAIL: tl.constexpr, UNROT: tl.constexpr, NHB: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = (tl.program_id(1) // NHB).to(tl.int64)
    hb = tl.program_id(1) % NHB
    if HAS_TAIL:
        slots = splits + 1
    else:
        slots = splits
    first = (b * tl.num_programs(1) + tl.program_id(1)) * slots
    rows = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)

    top = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in range(0, slots):
        top = tl.maximum(top, tl.load(PL + (first + s) * BLOCK_H + rows))
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([BLOCK_H], tl.float32)
    for s in range(0, slots):
        total += tl.exp(tl.load(PL + (first + s) * BLOCK_H + rows) - top)
    some = total > 0.0
    inv = tl.where(some, 1.0 / tl.where(some, total, 1.0), 0.0)
    heads = hb * BLOCK_H + rows
    h_ok = heads < G
    tl.store(LSE + b * sl_b + h * sl_h + heads, tl.where(some, top + tl.log(tl.where(some, total, 1.0)),
                                                         float("-inf")), mask=h_ok)

    if UNROT:  # out = (Σ_coded w·o) · M + w_tail·o_tail, M taken BLOCK_K rows at a time
        out = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for k0 in tl.static_range(0, BLOCK_D, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            part = tl.zeros([BLOCK_H, BLOCK_K], tl.float32)
            for s in range(0, splits):
                w = tl.exp(tl.load(PL + (first + s) * BLOCK_H + rows) - top) * inv
                part += w[:, None] * tl.load(PO + ((first + s) * BLOCK_H + rows)[:, None] * BLOCK_D
                                             + offs_k[None, :])
            mt = tl.load(M + offs_k[:, None] * D + offs_d[None, :],
                         mask=(offs_k < D)[:, None] & (offs_d < D)[None, :], other=0.0)  # (BLOCK_K, BLOCK_D)
            out += tl.dot(part, mt, input_precision="ieee")
        if HAS_TAIL:
            w = tl.exp(tl.load(PL + (first + splits) * BLOCK_H + rows) - top) * inv
            out += w[:, None] * tl.load(PO + ((first + splits) * BLOCK_H + rows)[:, None] * BLOCK_D + offs_d[None, :])
    else:
        out = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for s in range(0, slots):
            w = tl.exp(tl.load(PL + (first + s) * BLOCK_H + rows) - top) * inv
            out += w[:, None] * tl.load(PO + ((first + s) * BLOCK_H + rows)[:, None] * BLOCK_D + offs_d[None, :])
    tl.store(OUT + b * so_b + h * so_h + heads[:, None] * so_g + offs_d[None, :], out,
             mask=h_ok[:, None] & (offs_d < D)[None, :])


def covers(q: torch.Tensor, k_codes: torch.Tensor, bits: int) -> str | None:
    """Why the kernel does not take these inputs (the caller then runs the twin), or ``None`` when it does."""
    if bits not in (4, 8):
        return f"{bits}-bit codes (the int8/int4 kernel takes 4 or 8)"
    if q.dim() != 4 or q.shape[-1] > MAX_HEAD_DIM:
        return f"query of shape {tuple(q.shape)} (the kernel takes (B, Hk, G, D) with D ≤ {MAX_HEAD_DIM})"
    if k_codes.dtype not in (torch.int8, torch.uint8):
        return f"codes of dtype {k_codes.dtype} (int8 or uint8 expected)"
    if torch.is_grad_enabled() and q.requires_grad:
        return "a query that requires grad (the kernel has no backward)"
    return None


def choose_splits(batch: int, heads: int, n: int, sms: int = 132, splits: int = 0) -> int:
    """Splits per (sequence, KV head): ``splits`` when > 0, else enough programs for ≥ 2 per SM, each split at least
    ``MIN_SPLIT_TOKENS`` slots, at most ``MAX_SPLITS``."""
    if splits > 0:
        return splits
    want = -(-2 * sms // max(1, batch * heads))
    return max(1, min(want, -(-n // MIN_SPLIT_TOKENS), MAX_SPLITS))


def tile_config(block_d: int) -> tuple[int, int]:
    """(tokens per inner step, warps) of stage 1 for a padded head dim. First choices from a static compile for
    sm_90a (``ptxas -v``; no GPU run yet): at D ≥ 128, 32-token steps on 4 warps spill registers, 16 on 8 mostly
    do not (docs/gpu.md)."""
    return (32, 4) if block_d <= 64 else (16, 8)


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _check(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, bits, group_size, key_channel_group, n, lengths,
           k_tail, v_tail, mask, v_unrot, pages=None, page=0) -> None:
    b, hk, g, d = q.shape
    width = d * bits // 8
    stored = check_pages("kvslim::quant_decode_triton", pages, page, b, hk, n, key_channel_group)
    if bits == 4 and d % 2:
        raise ValueError(f"q: int4 codes pack two channels per byte, the head dim must be even, got {d}")
    if n < 0:
        raise ValueError(f"n must be ≥ 0, got {n}")
    for name, t in (("k_codes", k_codes), ("v_codes", v_codes)):
        if t.dim() != 4 or tuple(t.shape[:2]) != (b, hk) or t.shape[2] < stored or t.shape[3] != width:
            raise ValueError(f"{name} must be ({b}, {hk}, ≥{stored}, {width}) codes, got {tuple(t.shape)}")
    if group_size <= 0 or d % group_size:
        raise ValueError(f"group_size must divide the head dim {d}, got {group_size}")
    kcg = key_channel_group
    if kcg < 0 or (kcg and d % kcg):
        raise ValueError(f"key_channel_group must be 0 or divide the head dim {d}, got {kcg}")
    rows_k = -(-stored // kcg) * kcg if kcg else stored
    for name, t, rows, cols in (("k_scale", k_scale, rows_k, d // kcg if kcg else d // group_size),
                                ("k_zero", k_zero, rows_k, d // kcg if kcg else d // group_size),
                                ("v_scale", v_scale, stored, d // group_size),
                                ("v_zero", v_zero, stored, d // group_size)):
        if t is not None and (t.dim() != 4 or tuple(t.shape[:2]) != (b, hk) or t.shape[2] < rows
                              or t.shape[3] != cols or not t.is_floating_point()):
            raise ValueError(f"{name} must be floating ({b}, {hk}, ≥{rows}, {cols}), got {t.dtype} {tuple(t.shape)}")
    if lengths is not None and (lengths.dim() != 1 or lengths.shape[0] != b or lengths.is_floating_point()):
        raise ValueError(f"lengths must be an integer ({b},) tensor, got {lengths.dtype} {tuple(lengths.shape)}")
    r = 0
    if k_tail is not None:
        r = k_tail.shape[2] if k_tail.dim() == 4 else -1
        for name, t in (("k_tail", k_tail), ("v_tail", v_tail)):
            if t.dim() != 4 or tuple(t.shape) != (b, hk, r, d):
                raise ValueError(f"{name} must be ({b}, {hk}, r, {d}) and match, got {tuple(t.shape)}")
    if mask is not None and (mask.dim() != 2 or mask.shape[0] not in (1, b) or mask.shape[1] != n + r):
        raise ValueError(f"mask must be (1 or {b}, {n + r}) (n coded slots, then the tail), got {tuple(mask.shape)}")
    if v_unrot is not None and tuple(v_unrot.shape) != (d, d):
        raise ValueError(f"v_unrot must be ({d}, {d}), got {tuple(v_unrot.shape)}")



def launch(q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor | None,
           v_codes: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor | None, bits: int, group_size: int,
           key_channel_group: int, n: int, lengths: torch.Tensor | None = None, k_tail: torch.Tensor | None = None,
           v_tail: torch.Tensor | None = None, mask: torch.Tensor | None = None, scaling: float = 1.0,
           splits: int = 0, v_unrot: torch.Tensor | None = None, dot: str = "ieee", pages: torch.Tensor | None = None,
           page: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (B, Hk, G, D), lse (B, Hk, G))`` fp32 of the twin's exact paths; shapes as in
    :func:`kvslim.kernels.quant_decode.reference`. ``splits`` > 0 forces the split count (0: :func:`choose_splits`);
    ``dot``: the operand precision of the scores and weighted sums (``merge.DOT_CHOICES``; the op uses ``"ieee"``).
    ``pages`` (B, Hk, ≥ ⌈n / page⌉) integer with ``page`` (sparse decode): the ``n`` slots are logical, slot t read
    in place at stored row ``pages[b, h, t // page]·page + t % page`` (one page id per slot block, as paged
    attention reads a block table; nothing gathered).

    Raises:
        ValueError: a shape, dtype or size that does not fit, naming the argument.
    """
    interpreter_scalars()  # Triton 3.6's interpreter: loop bounds computed in the kernel
    _check(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, bits, group_size, key_channel_group, n, lengths,
           k_tail, v_tail, mask, v_unrot, pages, page)
    check_dot(dot)
    b, hk, g, d = q.shape
    asym = k_zero is not None
    q = unit_last(q.float())
    k_codes, v_codes, k_scale, v_scale = map(unit_last, (k_codes, v_codes, k_scale, v_scale))
    k_zero, v_zero = unit_last(k_zero), unit_last(v_zero)
    if asym and (k_zero.stride() != k_scale.stride() or v_zero.stride() != v_scale.stride()):
        k_scale, k_zero, v_scale, v_zero = (t.contiguous() for t in (k_scale, k_zero, v_scale, v_zero))
    has_tail = k_tail is not None and k_tail.shape[2] > 0
    r = k_tail.shape[2] if k_tail is not None else 0
    # the tail is read through its strides (a residual window is a slice of its buffer: no per-step copy)
    kt = unit_last(k_tail.float()) if has_tail else q
    vt = unit_last(v_tail.float()) if has_tail else q
    if has_tail and vt.stride()[:3] != kt.stride()[:3]:  # the kernel takes one set of tail strides
        kt, vt = kt.contiguous(), vt.contiguous()
    m = mask.float().contiguous() if mask is not None else q
    sm_b = 0 if mask is None or mask.shape[0] == 1 else m.stride(0)
    unrot = v_unrot.float().contiguous() if v_unrot is not None else q

    block_h = min(32, max(16, triton.next_power_of_2(g)))
    nhb = -(-g // block_h)
    block_d = max(16, triton.next_power_of_2(d))
    s = choose_splits(b, hk, n, _sms(q.device), splits)
    per = max(1, -(-n // s))
    slots = s + has_tail
    po = torch.empty(b, hk * nhb, slots, block_h, block_d, dtype=torch.float32, device=q.device)
    pl = torch.empty(b, hk * nhb, slots, block_h, dtype=torch.float32, device=q.device)
    out = torch.empty(b, hk, g, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, hk, g, dtype=torch.float32, device=q.device)
    kcg = int(key_channel_group)
    kz = k_zero if asym else k_scale
    vz = v_zero if asym else v_scale
    lens = lengths if lengths is not None else q
    pg = unit_last(pages) if pages is not None else lens
    block_n, warps = tile_config(block_d)
    consts = dict(D=d, BITS=int(bits), ASYM=asym, GROUP=int(group_size), KCG=kcg,
                  KW=(d // kcg if kcg else 1), VGROUP=int(group_size), HAS_LEN=lengths is not None,
                  HAS_MASK=mask is not None, NHB=nhb, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d, DOT=dot,
                  PAGE=int(page) if pages is not None else 0, num_warps=warps)
    sp = (pg.stride(0), pg.stride(1)) if pages is not None else (0, 0)
    args = (q, k_codes, k_scale, kz, v_codes, v_scale, vz, kt, vt, m, lens, po, pl, pg, n, r, g, per, slots,
            float(scaling), *sp, stored_pages(pages, page, k_codes, v_codes), q.stride(0), q.stride(1), q.stride(2),
            k_codes.stride(0), k_codes.stride(1), k_codes.stride(2), k_scale.stride(0), k_scale.stride(1),
            k_scale.stride(2), v_codes.stride(0), v_codes.stride(1), v_codes.stride(2), v_scale.stride(0),
            v_scale.stride(1), v_scale.stride(2), kt.stride(0), kt.stride(1), kt.stride(2), sm_b)
    _quant_stage1[(b, hk * nhb, s)](*args, TAIL=False, **consts)
    if has_tail:
        _quant_stage1[(b, hk * nhb, 1)](*args, TAIL=True, **consts)
    _quant_stage2[(b, hk * nhb)](po, pl, unrot, out, lse, g, s, out.stride(0), out.stride(1), out.stride(2),
                                 lse.stride(0), lse.stride(1), D=d, HAS_TAIL=has_tail, UNROT=v_unrot is not None,
                                 NHB=nhb, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_K=min(64, block_d),
                                 num_warps=warps)
    return out, lse


def _register() -> None:
    """Define ``kvslim::quant_decode_triton`` (a custom op with a fake impl) unless it exists (a module reload)."""
    if hasattr(torch.ops.kvslim, "quant_decode_triton"):
        return

    @torch.library.custom_op("kvslim::quant_decode_triton", mutates_args=())
    def quant_decode_triton(q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor,
                            k_zero: torch.Tensor | None, v_codes: torch.Tensor, v_scale: torch.Tensor,
                            v_zero: torch.Tensor | None, bits: int, group_size: int, key_channel_group: int, n: int,
                            lengths: torch.Tensor | None, k_tail: torch.Tensor | None, v_tail: torch.Tensor | None,
                            mask: torch.Tensor | None, scaling: float, splits: int,
                            v_unrot: torch.Tensor | None, pages: torch.Tensor | None = None,
                            page: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return launch(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, bits, group_size, key_channel_group,
                      n, lengths, k_tail, v_tail, mask, scaling, splits, v_unrot, pages=pages, page=page)

    @quant_decode_triton.register_fake
    def _(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, bits, group_size, key_channel_group, n, lengths,
          k_tail, v_tail, mask, scaling, splits, v_unrot, pages=None, page=0):
        b, hk, g, d = q.shape
        return q.new_empty(b, hk, g, d, dtype=torch.float32), q.new_empty(b, hk, g, dtype=torch.float32)


_register()  # at import (once per process): dynamo traces calls to op(), never a registration


def op():
    """``torch.ops.kvslim.quant_decode_triton`` (registered when this module is imported)."""
    return torch.ops.kvslim.quant_decode_triton
