"""Decode attention straight from grouped int8/int4 KV codes: the C++ op ``torch.ops.kvslim.quant_decode``.

For one query token per sequence, the G query heads of each KV head attend over the first ``lengths[b]`` (≤ n)
coded tokens of that KV head, then over an optional fp32 tail (a residual window kept in full precision):

    out[b, h, j] = softmax_t(scaling · q[b, h, j] · k_t + mask[b, t]) · v_t        (B, Hk, G, D) fp32
    lse[b, h, j] = log Σ_t exp(scaling · q[b, h, j] · k_t + mask[b, t])            (B, Hk, G)    fp32

with ``k_t``/``v_t`` the values the codes stand for (:mod:`kvslim.ops.quant`, :mod:`kvslim.ops.quant_formats`):
symmetric ``q·s`` or asymmetric ``q·s + z`` (``k_zero``/``v_zero`` given), scales per token over ``group_size``
channels, or for keys with ``key_channel_group`` g > 0 per channel over groups of g tokens (KIVI layout of
:class:`kvslim.caches.residual.ChannelQuantizedStore`). The op never materialises the history in full precision
(it decodes a block of tokens at a time into a small scratch). Source: ``csrc/quant_decode.cpp`` (+
``quant_decode_body.h``, ``vec_quant.h``; AVX-512 VNNI / AVX-512 / AVX2 / scalar chosen at run time), built by
:func:`kvslim.kernels.build.load_ops`. :func:`reference` is its pure-torch twin (dequantize, then softmax
attention in fp32). :func:`quant_decode` dispatches by device (:func:`kvslim.kernels.backend.pick`): CPU tensors to
the op when it is built, CUDA tensors (or CPU ones under ``KVSLIM_BACKEND=triton`` with ``TRITON_INTERPRET=1``) to
the Triton kernels of :mod:`kvslim.kernels.triton.quant_decode` (exact scores and values only: they ignore
``scores``/``values``), anything else (or ``KVSLIM_BACKEND=torch``) to the twin.

A sequence with nothing to attend to (``lengths[b] = 0`` or ``n = 0`` and no tail, or every column masked) gets
``out`` zeros and ``lse`` −inf on every backend (the merge of partials checks it once, at the end), as torch's
SDPA gives a fully masked row zeros (``tests/test_empty_rows.py``).

Score paths (``scores``): ``"exact"`` computes ``q · k_t`` in fp32 from the codes; ``"int8"`` (llama.cpp's q8_0
technique) rounds the query the codes see (``scaling·q``, or ``scaling·q ⊙ s`` per KIVI token
group) to int8 per block of 32 channels (``d_b = max|u_b| / 127``, round half to even) and multiplies it with the
codes in integer arithmetic; zero-points, token scales and the tail stay fp32. It applies where
:func:`int_scores_apply` says so (other formats take the exact path); the twin rounds the query the same way.
``KVSLIM_QUANT_SCORES=exact|int8`` overrides the default (:func:`default_mode`: ``int8`` for 4-bit codes,
``exact`` for int8 codes).

Value paths (``values``): ``"exact"`` accumulates ``p_t · v_t`` in fp32; ``"int8"`` rounds ``w_t = p_t · s_{t,g}``
(softmax weight × value scale) to uint8 per 16-token sub-block of the sequence (``dw = max w / 127``) and multiplies
with the unsigned int4 codes in integer arithmetic (zero-points in fp32), where :func:`int_values_apply` says so.
``KVSLIM_QUANT_VALUES=exact|int8`` overrides the default (:func:`default_mode`, as for scores).
"""

from __future__ import annotations

import functools
import os

import torch

from ..ops.quant import dequantize
from ..ops.quant_formats import dequantize_asym, unpack_codes
from . import backend
from .build import load_ops
from .sparse_select import PageChoice, op_args, resolve

FAMILY = "quant_decode"
SCORES = ("int8", "exact")


def default_mode(bits: int) -> str:
    """The score and value path a call that names none takes for ``bits``-bit codes: ``int8`` for codes of ≤ 4
    bits (rounding the query, or the softmax weights, to 8 bits adds an error well below the codes' own: on
    SmolLM2 KL from dense 0.0009 -> 0.0010, docs/quant_decode.md), ``exact`` for int8 codes (there the query
    rounding raised KL 0.00026 -> 0.00046)."""
    return "int8" if bits <= 4 else "exact"


def default_scores(bits: int) -> str:
    """The score path used when a call names none: ``KVSLIM_QUANT_SCORES`` (``int8`` | ``exact``) when set,
    else :func:`default_mode`."""
    return _mode("scores", None, bits)


def default_values(bits: int) -> str:
    """The value path used when a call names none: ``KVSLIM_QUANT_VALUES`` (``int8`` | ``exact``) when set,
    else :func:`default_mode`."""
    return _mode("values", None, bits)


def _mode(what: str, mode: str | None, bits: int) -> str:
    if mode is None:
        env = f"KVSLIM_QUANT_{what.upper()}"
        mode = os.environ.get(env) or default_mode(bits)
        if mode not in SCORES:
            raise ValueError(f"{env} must be one of {SCORES}, got {mode!r}")
    if mode not in SCORES:
        raise ValueError(f"{what} must be one of {SCORES}, got {mode!r}")
    return mode


def int_values_apply(bits: int, asymmetric: bool, head_dim: int, group_size: int) -> bool:
    """Whether ``values="int8"`` rounds the weights for this value format (the op's ``qv_ok``): asymmetric int4
    codes with the head dim and ``group_size`` multiples of 64."""
    return bits == 4 and asymmetric and head_dim % 64 == 0 and group_size % 64 == 0


def int8_weight_values(w: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                       group_size: int) -> torch.Tensor:
    """``Σ_t w_t · v_t`` (B, Hk, G, D) of the ``"int8"`` value path over n coded tokens: w (B, Hk, G, n) softmax
    weights (0 where a token is not attended), codes/scale/zero the first n asymmetric int4 value rows. Per value
    group g, ``w_t · s_{t,g}`` is rounded to uint8 per 16-token sub-block (``dw = max / 127``, round half to even)
    and times the codes; the zero-point term ``Σ_t w_t z_{t,g}`` stays exact."""
    b, hk, g, n = w.shape
    s, z = scale.float(), zero.float()  # (B, Hk, n, ng)
    live = w > 0
    wg = torch.where(live[..., None], w[..., None] * s[:, :, None], 0.0)  # (B, Hk, G, n, ng)
    pad = -n % 16
    blocks = torch.nn.functional.pad(wg, (0, 0, 0, pad)).unflatten(3, (-1, 16))  # (B, Hk, G, nsb, 16, ng)
    dw = blocks.amax(4, keepdim=True) / 127.0
    wq = torch.where(dw > 0, blocks / torch.where(dw > 0, dw, 1.0), 0.0).round() * dw
    wq = wq.flatten(3, 4)[:, :, :, :n]  # (B, Hk, G, n, ng)
    c = unpack_codes(codes, 4, signed=False).float().unflatten(-1, (-1, group_size))  # (B, Hk, n, ng, gs)
    out = torch.einsum("bhgtk,bhtkc->bhgkc", wq, c)
    zt = torch.einsum("bhgt,bhtk->bhgk", w, torch.where(live.any(2)[..., None], z, 0.0))
    return (out + zt[..., None]).flatten(-2)


def int_scores_apply(bits: int, asymmetric: bool, head_dim: int, group_size: int, key_channel_group: int) -> bool:
    """Whether ``scores="int8"`` rounds the query for this key format (the op's ``qdot_ok``): int4 codes with the
    head dim and the channels one key parameter set covers (``group_size``, or the head dim for KIVI keys) multiples
    of 64; symmetric int8 codes with them multiples of 32."""
    covered = head_dim if key_channel_group else group_size
    if bits == 4:
        return head_dim % 64 == 0 and covered % 64 == 0
    return bits == 8 and not asymmetric and head_dim % 32 == 0 and covered % 32 == 0


def round_query(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``u`` (..., D) fp32, D a multiple of 32 -> (int8-valued codes (..., D/32, 32) fp32, block scales
    (..., D/32, 1)): ``d = max|u_block| / 127``, codes ``round(u / d)`` (0 where d = 0)."""
    blocks = u.float().unflatten(-1, (-1, 32))
    d = blocks.abs().amax(-1, keepdim=True) / 127.0
    codes = torch.where(d > 0, blocks / torch.where(d > 0, d, 1.0), 0.0).round()
    return codes, d


@functools.cache
def available() -> bool:
    """Whether ``torch.ops.kvslim.quant_decode`` is built and loaded (one warning from the build if not)."""
    if not load_ops(FAMILY):
        return False
    torch.library.register_fake("kvslim::quant_decode")(_fake)
    return True


def _fake(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, bits, group_size, key_channel_group, n, lengths,
          k_tail, v_tail, mask, scaling, splits=0, int_scores=False, int_values=False, v_unrot=None, pages=None,
          page=0):
    b, hk, g, d = q.shape
    return q.new_empty(b, hk, g, d), q.new_empty(b, hk, g)


def isa(head_dim: int = 64) -> str:
    """The instruction set the op runs with for ``head_dim`` here (``avx512_vnni``, ``avx512``, ``avx2``,
    ``scalar``) or ``twin``. ``KVSLIM_ISA`` caps it per process, ``torch.ops.kvslim.quant_decode_set_isa`` in one."""
    return torch.ops.kvslim.quant_decode_isa(head_dim) if available() else "twin"


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int,
                     group_size: int, channel_group: int = 0) -> torch.Tensor:
    """The fp32 values (B, H, T, D) codes (B, H, T, D·bits/8) stand for; ``channel_group`` > 0: per-channel
    parameters over token groups (T a multiple of it)."""
    if channel_group:
        q = unpack_codes(codes, bits, signed=zero is None).float().unflatten(2, (-1, channel_group))
        per_group = (*scale.shape[:2], -1, scale.shape[3] * channel_group)  # (B, H, T/g, D)
        y = q * scale.float().reshape(per_group).unsqueeze(3)
        if zero is not None:
            y = y + zero.float().reshape(per_group).unsqueeze(3)
        return y.flatten(2, 3)
    if zero is not None:
        return dequantize_asym(codes, scale, zero, bits, group_size)
    return dequantize(codes, scale, bits, group_size)


def int8_query_scores(q: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                      bits: int, group_size: int, channel_group: int, n: int, scaling: float) -> torch.Tensor:
    """Scores (B, Hk, G, n) fp32 of the ``"int8"`` score path over the first n coded keys: the query the codes see
    (``u = scaling·q``, or ``scaling·q ⊙ s`` per KIVI token group) rounded by :func:`round_query`, times the integer
    codes, × the block scales (and the token scales of per-token groups), plus ``u · z`` in fp32."""
    qs = q.float() * scaling
    b, hk, g, d = qs.shape
    cb = unpack_codes(codes[:, :, :n], bits, signed=zero is None).float().unflatten(-1, (-1, 32))  # (B,Hk,n,nb,32)
    if channel_group:
        ng = -(-n // channel_group)
        per = (b, hk, ng, d)
        grp = torch.arange(n) // channel_group
        u = qs[:, :, :, None, :] * scale[:, :, :ng * channel_group].float().reshape(per)[:, :, None]  # (B,Hk,G,ng,D)
        uq, dq = round_query(u)
        dots = torch.einsum("bhgtkc,bhtkc->bhgtk", uq[:, :, :, grp], cb)
        sc = (dots * dq[:, :, :, grp, :, 0]).sum(-1)
        if zero is not None:
            z = zero[:, :, :ng * channel_group].float().reshape(per)
            sc = sc + torch.einsum("bhgd,bhkd->bhgk", qs, z)[..., grp]
        return sc
    ng = d // group_size
    uq, dq = round_query(qs)  # (B,Hk,G,nb,32), (B,Hk,G,nb,1)
    dots = torch.einsum("bhgkc,bhtkc->bhgtk", uq, cb) * dq[..., 0][:, :, :, None, :]  # (B,Hk,G,n,nb)
    sc = (dots.unflatten(-1, (ng, -1)).sum(-1) * scale[:, :, None, :n].float()).sum(-1)
    if zero is not None:
        qsum = qs.unflatten(-1, (ng, -1)).sum(-1)  # (B,Hk,G,ng)
        sc = sc + torch.einsum("bhgk,bhtk->bhgt", qsum, zero[:, :, :n].float())
    return sc


def reference(q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor | None,
              v_codes: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor | None, bits: int, group_size: int,
              key_channel_group: int, n: int, lengths: torch.Tensor | None = None,
              k_tail: torch.Tensor | None = None, v_tail: torch.Tensor | None = None,
              mask: torch.Tensor | None = None, scaling: float = 1.0,
              scores: str | None = None, values: str | None = None,
              v_unrot: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's pure-torch twin: dequantize the first ``n`` tokens, append the tail, softmax attention in fp32.

    Args:
        q: (B, Hk, G, D) queries, G query heads per KV head.
        k_codes, v_codes: (B, Hk, ≥n, D·bits/8) codes (int8 for symmetric int8, else uint8).
        k_scale, v_scale (k_zero, v_zero): (B, Hk, ≥n, D/group_size) per-token parameters; keys with
            ``key_channel_group`` g > 0: (B, Hk, ≥n rounded up to g, D/g).
        bits: 4 or 8; group_size: channels per per-token group; n: coded tokens.
        lengths: (B,) int64 coded tokens to use per sequence (≤ n; later slots may hold anything, NaN included).
        k_tail, v_tail: (B, Hk, r, D) fp32 tokens after the coded ones, or ``None``.
        mask: (B|1, n + r) additive fp32, or ``None``.
        scores: ``"exact"`` or ``"int8"`` (:func:`int8_query_scores` where :func:`int_scores_apply`); ``None``:
            :func:`default_scores`.
        values: ``"exact"`` or ``"int8"`` (:func:`int8_weight_values` where :func:`int_values_apply`); ``None``:
            :func:`default_values`.
        v_unrot: (D, D) fp32 M, or ``None``: the value codes hold ``v·R`` (a rotated store) and the tail is in the
            values' own basis; the coded tokens' weighted sum is taken back by ``· M`` (M = Rᵀ) before the tail's
            is added.

    Returns:
        out (B, Hk, G, D) and lse (B, Hk, G), fp32.
    """
    mode, vmode = _mode("scores", scores, bits), _mode("values", values, bits)
    g = key_channel_group
    nk = -(-n // g) * g if g else n
    keys = dequantize_codes(k_codes[:, :, :nk], k_scale[:, :, :nk], None if k_zero is None else k_zero[:, :, :nk],
                            bits, group_size, g)[:, :, :n]
    vals = dequantize_codes(v_codes[:, :, :n], v_scale[:, :, :n], None if v_zero is None else v_zero[:, :, :n],
                            bits, group_size)
    live = torch.ones(q.shape[0], n, dtype=torch.bool, device=q.device)
    if lengths is not None:  # never use a slot past a sequence's length (it may hold anything)
        live = torch.arange(n, device=q.device)[None, :] < lengths[:, None]
        keys = torch.where(live[:, None, :, None], keys, 0.0)
        vals = torch.where(live[:, None, :, None], vals, 0.0)
    if mode == "int8" and int_scores_apply(bits, k_zero is not None, q.shape[-1], group_size, g):
        coded = int8_query_scores(q, k_codes, k_scale, k_zero, bits, group_size, g, n, scaling)
    else:
        coded = torch.einsum("bhgd,bhtd->bhgt", q.float(), keys) * scaling
    parts = [coded]
    if k_tail is not None:
        parts.append(torch.einsum("bhgd,bhtd->bhgt", q.float(), k_tail.float()) * scaling)
        vals = torch.cat((vals, v_tail.float()), dim=2)
        live = torch.cat((live, torch.ones(q.shape[0], k_tail.shape[2], dtype=torch.bool, device=q.device)), dim=1)
    scores_ = torch.cat(parts, dim=-1)
    if mask is not None:
        scores_ = scores_ + mask.float()[:, None, None, :]
    scores_ = scores_.masked_fill(~live[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores_, dim=-1)
    weights = torch.softmax(scores_, dim=-1).nan_to_num(0.0)  # a row with nothing to attend to -> zeros
    if vmode == "int8" and int_values_apply(bits, v_zero is not None, q.shape[-1], group_size):
        out = int8_weight_values(weights[..., :n], v_codes[:, :, :n], v_scale[:, :, :n], v_zero[:, :, :n], group_size)
    elif v_unrot is not None:
        out = torch.einsum("bhgt,bhtd->bhgd", weights[..., :n], vals[:, :, :n])
    else:
        return torch.einsum("bhgt,bhtd->bhgd", weights, vals), lse
    if v_unrot is not None:
        out = out @ v_unrot.float()
    return out + torch.einsum("bhgt,bhtd->bhgd", weights[..., n:], vals[:, :, n:]), lse


def supported(q: torch.Tensor, k_codes: torch.Tensor, bits: int) -> bool:
    """Whether the op takes these inputs: CPU tensors, int8/int4 codes, no autograd."""
    if q.device.type != "cpu" or k_codes.device.type != "cpu" or bits not in (4, 8) or q.dim() != 4:
        return False
    return not (torch.is_grad_enabled() and q.requires_grad)


def quant_decode(q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor | None,
                 v_codes: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor | None, bits: int,
                 group_size: int, key_channel_group: int, n: int, lengths: torch.Tensor | None = None,
                 k_tail: torch.Tensor | None = None, v_tail: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None, scaling: float = 1.0,
                 splits: int = 0, scores: str | None = None,
                 values: str | None = None, v_unrot: torch.Tensor | None = None, pages: torch.Tensor | None = None,
                 page: int = 0, select: PageChoice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of :func:`reference` through the backend :func:`kvslim.kernels.backend.pick` names: the C++
    op (CPU), the Triton kernels (CUDA; CPU under ``TRITON_INTERPRET=1``) or the twin; an input the chosen kernel
    does not take runs the twin.

    ``pages`` (B, Hk, k) int64 with ``page`` (sparse decode, docs/sparse.md): the ``n`` coded rows are logical, row
    t stored at ``pages[b, h, t // page]·page + t % page``; the C++ op and the Triton kernels read them in place, the
    twin reads :func:`paged_rows` (a gathered copy: same values, same math).
    ``select`` (:class:`~kvslim.kernels.sparse_select.PageChoice`, instead of ``pages``): the page list chosen in
    the same call (the C++ op scores the boxes and attends through its choice; other backends choose first).

    Shapes as in :func:`reference`; ``q``, the tail and the mask are widened to fp32 here (small). ``splits``
    forces the number of sequence splits per (sequence, KV head) (0: chosen from the work and the threads / SMs);
    ``scores`` / ``values`` pick the score / value paths (``"int8"`` | ``"exact"``; ``None``: the defaults) of the
    C++ op and the twin; the Triton kernels always compute the exact ones.

    Raises:
        ValueError: tensors on more than one device, a bad ``v_unrot``, a forced backend that cannot run here.
    """
    mode, vmode = _mode("scores", scores, bits), _mode("values", values, bits)
    if (k_tail is None) != (v_tail is None):
        raise ValueError("k_tail and v_tail come together")
    if (k_zero is None) != (v_zero is None):
        raise ValueError("k_zero and v_zero come together (asymmetric codes)")
    d = q.shape[-1]
    if v_unrot is not None and (v_unrot.dtype != torch.float32 or tuple(v_unrot.shape) != (d, d)
                                or v_unrot.device.type != q.device.type):
        raise ValueError(f"v_unrot must be a float32 {q.device.type.upper()} tensor of shape ({d}, {d}) (Rᵀ of the "
                         f"value codes' rotation), got {v_unrot.dtype} {tuple(v_unrot.shape)} on {v_unrot.device}")
    device = backend.same_device("quant_decode", q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, lengths,
                                 k_tail, v_tail, mask, v_unrot, pages)
    which = _backend(str(device.type))
    if select is not None and not (which == "cpp" and supported(q, k_codes, bits) and select.in_call()):
        pages, select = resolve(select, pages, scaling), None
    if which == "triton":
        from .triton import quant_decode as tq  # imports Triton: only when a call takes this path

        why = tq.covers(q, k_codes, bits)
        if why is None:
            return tq.op()(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, int(bits), int(group_size),
                           int(key_channel_group), int(n), lengths, k_tail, v_tail, mask, float(scaling), int(splits),
                           v_unrot, pages, int(page))
        backend.warn_fallback(FAMILY, f"the Triton kernel does not take {why}")
    elif which == "cpp" and supported(q, k_codes, bits):
        k_tail, v_tail, mask = (None if t is None else t.float() for t in (k_tail, v_tail, mask))
        return torch.ops.kvslim.quant_decode(q.float(), k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                                             int(bits), int(group_size), int(key_channel_group), int(n), lengths,
                                             k_tail, v_tail, mask, float(scaling), int(splits), mode == "int8",
                                             vmode == "int8", v_unrot, pages, int(page), *op_args(select, pages))
    if pages is not None:  # the twin reads the listed rows gathered (same values, same math)
        k_codes, k_scale, k_zero, v_codes, v_scale, v_zero = (
            None if t is None else paged_rows(t, pages, page) for t in (k_codes, k_scale, k_zero, v_codes, v_scale,
                                                                        v_zero))
    return reference(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, bits, group_size, key_channel_group, n,
                     lengths, k_tail, v_tail, mask, scaling, mode, vmode, v_unrot)


def paged_rows(t: torch.Tensor, pages: torch.Tensor, page: int) -> torch.Tensor:
    """(B, H, stored rows, X) -> (B, H, k·page, X): the rows a page list names, in its order (the twin's and the
    Triton kernels' view of a paged call)."""
    b, h, _, x = t.shape
    rows = (pages[..., None] * page + torch.arange(page, device=pages.device)).reshape(b, h, -1)
    return t.gather(2, rows[..., None].expand(b, h, rows.shape[-1], x))


@torch._dynamo.assume_constant_result  # under torch.compile: decided once at trace time, not traced into
def _backend(device_type: str) -> str:
    """:func:`kvslim.kernels.backend.pick` for this family (a CUDA call never builds the C++ op)."""
    return backend.pick(device_type, device_type == "cpu" and available())


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax merge of ``(out, lse)`` partials over disjoint token sets (..., D) / (...)."""
    lse = torch.stack([p[1] for p in parts])
    total = torch.logsumexp(lse, dim=0)
    w = torch.exp(lse - total).nan_to_num(0.0)  # a part with no tokens (lse −inf) weighs 0
    return sum(wi[..., None] * p[0] for wi, p in zip(w, parts)), total
