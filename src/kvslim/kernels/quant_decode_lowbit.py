"""Decode attention straight from asymmetric 2-bit / 3-bit KV codes: the C++ op ``kvslim.quant_decode_lowbit``.

The ``int2`` method's format (3-bit KIVI keys, 2-bit per-token values; :mod:`kvslim.ops.quant_formats`) and its
2/3-bit variants. For one query token per sequence, the G query heads of each KV head attend over the first
``lengths[b]`` (≤ n) coded tokens of that KV head, then over an optional fp32 tail (the residual window):

    out[b, h, j] = softmax_t(scaling · q[b, h, j] · k_t + mask[b, t]) · v_t        (B, Hk, G, D) fp32
    lse[b, h, j] = log Σ_t exp(scaling · q[b, h, j] · k_t + mask[b, t])            (B, Hk, G)    fp32

with ``k_t = c·s + z`` (``k_bits``-bit codes; per channel over token groups of ``key_channel_group`` when > 0,
else per token over ``group_size`` channels) and ``v_t = c·s + z`` (``v_bits``-bit codes, per token). The op never
materialises the history in full precision: codes are converted in registers (scores as ``(q ⊙ s)·c + q·z``,
values with the softmax weight folded into the scale). Source: ``csrc/quant_decode_lowbit.cpp`` (+
``quant_decode_lowbit_body.h``, ``vec_lowbit.h``; AVX2 + FMA + F16C or scalar, chosen at run time), built by
:func:`kvslim.kernels.build.load_ops`. :func:`reference` is its pure-torch twin (dequantize, then softmax attention
in fp32); :func:`quant_decode_lowbit` dispatches by device (:mod:`kvslim.kernels.backend`): CPU tensors to the op
when it is built and takes the inputs, CUDA tensors to the Triton kernels (:mod:`kvslim.kernels.triton.quant_decode_lowbit`),
anything else to the twin.
A sequence with nothing to attend to (``lengths[b] = 0`` or ``n = 0`` and no tail, or every column masked) gets
``out`` zeros and ``lse`` −inf on every backend (the merge of partials checks it once, at the end), as torch's
SDPA gives a fully masked row zeros (``tests/test_empty_rows.py``).
Rotations and key smoothing are undone on the query and the output by the caller (:mod:`kvslim.attention.quant`).
"""

from __future__ import annotations

import functools

import torch

from ..ops.quant_formats import unpack_codes
from . import backend
from .build import load_ops
from .sparse_select import PageChoice, op_args, resolve

FAMILY = "quant_decode_lowbit"
BITS = (2, 3)


@functools.cache
def available() -> bool:
    """Whether ``torch.ops.kvslim.quant_decode_lowbit`` is built and loaded (one warning from the build if not)."""
    if not load_ops(FAMILY):
        return False
    torch.library.register_fake("kvslim::quant_decode_lowbit")(_fake)
    return True


def _fake(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_bits, v_bits, group_size, key_channel_group, n,
          lengths, k_tail, v_tail, mask, scaling, splits=0, pages=None, page=0):
    b, hk, g, d = q.shape
    return q.new_empty(b, hk, g, d), q.new_empty(b, hk, g)


def isa() -> str:
    """The instruction set the op runs with here (``avx2`` or ``scalar``), or ``twin`` when it is not built."""
    return torch.ops.kvslim.quant_decode_lowbit_isa() if available() else "twin"


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group_size: int,
               channel_group: int = 0) -> torch.Tensor:
    """fp32 values (B, H, T, D) of asymmetric codes (B, H, T, D·bits/8): per-token parameters (B, H, T, D/group_size),
    or with ``channel_group`` g > 0 per-channel parameters of token groups laid over g rows (B, H, T, D/g), T a
    multiple of g."""
    q = unpack_codes(codes, bits, signed=False).float()  # (B, H, T, D)
    if channel_group:
        q = q.unflatten(2, (-1, channel_group))  # (B, H, T/g, g, D)
        per_group = (*scale.shape[:2], -1, scale.shape[3] * channel_group)  # (B, H, T/g, D)
        y = q * scale.float().reshape(per_group).unsqueeze(3) + zero.float().reshape(per_group).unsqueeze(3)
        return y.flatten(2, 3)
    q = q.unflatten(-1, (-1, group_size))  # (B, H, T, D/G, G)
    return (q * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)).flatten(-2)


def reference(q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
              v_codes: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor, k_bits: int, v_bits: int,
              group_size: int, key_channel_group: int, n: int, lengths: torch.Tensor | None = None,
              k_tail: torch.Tensor | None = None, v_tail: torch.Tensor | None = None,
              mask: torch.Tensor | None = None, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's pure-torch twin: dequantize the first ``n`` tokens, append the tail, softmax attention in fp32.

    Args:
        q: (B, Hk, G, D) queries, G query heads per KV head.
        k_codes, v_codes: (B, Hk, ≥n, D·bits/8) uint8 codes (``k_bits`` / ``v_bits``: 2 or 3).
        k_scale, k_zero: keys' parameters: per token (B, Hk, ≥n, D/group_size), or with ``key_channel_group``
            g > 0 per channel (B, Hk, ≥n rounded up to g, D/g).
        v_scale, v_zero: (B, Hk, ≥n, D/group_size) per-token parameters of the values.
        n: coded tokens; lengths: (B,) int64 coded tokens to use per sequence (≤ n; later slots may hold anything,
            NaN included).
        k_tail, v_tail: (B, Hk, r, D) fp32 tokens after the coded ones, or ``None``.
        mask: (B|1, n + r) additive fp32, or ``None``.

    Returns:
        out (B, Hk, G, D) and lse (B, Hk, G), fp32.
    """
    g = key_channel_group
    nk = -(-n // g) * g if g else n
    keys = dequantize(k_codes[:, :, :nk], k_scale[:, :, :nk], k_zero[:, :, :nk], k_bits, group_size, g)[:, :, :n]
    values = dequantize(v_codes[:, :, :n], v_scale[:, :, :n], v_zero[:, :, :n], v_bits, group_size)
    live = torch.ones(q.shape[0], n, dtype=torch.bool, device=q.device)
    if lengths is not None:  # never use a slot past a sequence's length (it may hold anything)
        live = torch.arange(n, device=q.device)[None, :] < lengths.to(q.device)[:, None]
        keys = torch.where(live[:, None, :, None], keys, 0.0)
        values = torch.where(live[:, None, :, None], values, 0.0)
    if k_tail is not None:
        keys = torch.cat((keys, k_tail.float()), dim=2)
        values = torch.cat((values, v_tail.float()), dim=2)
        live = torch.cat((live, torch.ones(q.shape[0], k_tail.shape[2], dtype=torch.bool, device=q.device)), dim=1)
    scores = torch.einsum("bhgd,bhtd->bhgt", q.float(), keys) * scaling
    if mask is not None:
        scores = scores + mask.float()[:, None, None, :]
    scores = scores.masked_fill(~live[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with nothing to attend to -> zeros
    return torch.einsum("bhgt,bhtd->bhgd", weights, values), lse


def supported(q: torch.Tensor, k_codes: torch.Tensor, group_size: int) -> bool:
    """Whether the op takes these inputs: CPU, no autograd, D and ``group_size`` multiples of 16."""
    if q.device.type != "cpu" or k_codes.device.type != "cpu" or q.dim() != 4:
        return False
    d = q.shape[3]
    if d < 16 or d % 16 or group_size % 16 or d % group_size:
        return False
    return not (torch.is_grad_enabled() and q.requires_grad)


def _triton():
    """The Triton family module (imported on first use: importing this module never imports Triton)."""
    from .triton import quant_decode_lowbit as tq

    return tq


@torch.compiler.assume_constant_result  # under torch.compile: decided once at trace time, not traced into
def _backend(device_type: str) -> str:
    """:func:`kvslim.kernels.backend.pick` for this family; the C++ op is looked for (built on first use) only where
    it could run: CPU tensors, no other backend forced."""
    cpp = device_type == "cpu" and backend.forced() in (None, "cpp") and available()
    return backend.pick(device_type, cpp)


def quant_decode_lowbit(q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
                        v_codes: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor, k_bits: int, v_bits: int,
                        group_size: int, key_channel_group: int, n: int, lengths: torch.Tensor | None = None,
                        k_tail: torch.Tensor | None = None, v_tail: torch.Tensor | None = None,
                        mask: torch.Tensor | None = None, scaling: float = 1.0,
                        splits: int = 0, pages: torch.Tensor | None = None,
                        page: int = 0, select: PageChoice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of :func:`reference` through the backend :func:`kvslim.kernels.backend.pick` chooses: the
    Triton kernels (``kernels/triton/quant_decode_lowbit.py``; CUDA, or CPU under ``TRITON_INTERPRET=1``), the C++
    op (CPU), or the twin; an input the chosen kernel does not take runs the twin.

    Shapes as in :func:`reference`; ``q``, the tail and the mask are widened to fp32 here (small). ``splits``
    forces the number of sequence splits per (sequence, KV head) (0: chosen from the work and the threads / SMs).
    ``pages`` / ``page``: a page list (sparse decode) as in :func:`kvslim.kernels.quant_decode.quant_decode`: the C++
    op and the Triton kernels read the rows in place, the twin a gathered copy.
    ``select`` (:class:`~kvslim.kernels.sparse_select.PageChoice`, instead of ``pages``): the page list chosen in
    the same call (the C++ op scores the boxes and attends through its choice; other backends choose first).

    Raises:
        ValueError: bad bits, a tail half given, no zero-points, tensors on several devices, or a backend forced by
            ``KVSLIM_BACKEND`` that cannot run here.
    """
    if k_bits not in BITS or v_bits not in BITS:
        raise ValueError(f"k_bits and v_bits must be 2 or 3, got {k_bits!r} / {v_bits!r}")
    if (k_tail is None) != (v_tail is None):
        raise ValueError("k_tail and v_tail come together")
    if k_zero is None or v_zero is None:
        raise ValueError("k_zero and v_zero are required (the low-bit op reads asymmetric codes only)")
    device = backend.same_device(FAMILY, q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, lengths, k_tail,
                                 v_tail, mask, pages)
    which = _backend(device.type)
    if select is not None and not (which == "cpp" and supported(q, k_codes, group_size) and select.in_call()):
        pages, select = resolve(select, pages, scaling), None
    if which == "triton":
        tq = _triton()
        why = tq.covers(q)
        if why is None:
            k_tail, v_tail, mask = (None if t is None else t.float() for t in (k_tail, v_tail, mask))
            return torch.ops.kvslim.quant_decode_lowbit_triton(q.float(), k_codes, k_scale, k_zero, v_codes, v_scale,
                                                               v_zero, int(k_bits), int(v_bits), int(group_size),
                                                               int(key_channel_group), int(n), lengths, k_tail,
                                                               v_tail, mask, float(scaling), int(splits), pages,
                                                               int(page))
        backend.warn_fallback(f"{FAMILY} (triton)", why)
    elif which == "cpp":
        if supported(q, k_codes, group_size):
            k_tail, v_tail, mask = (None if t is None else t.float() for t in (k_tail, v_tail, mask))
            return torch.ops.kvslim.quant_decode_lowbit(q.float(), k_codes, k_scale, k_zero, v_codes, v_scale,
                                                        v_zero, int(k_bits), int(v_bits), int(group_size),
                                                        int(key_channel_group), int(n), lengths, k_tail, v_tail,
                                                        mask, float(scaling), int(splits), pages, int(page),
                                                        *op_args(select, pages))
        if backend.forced() == "cpp":
            backend.warn_fallback(f"{FAMILY} (cpp)", "head dim or group size not a multiple of 16, or autograd")
    if pages is not None:  # the twin reads the listed rows gathered (same values, same math)
        from .quant_decode import paged_rows

        k_codes, k_scale, k_zero, v_codes, v_scale, v_zero = (
            paged_rows(t, pages, page) for t in (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero))
    return reference(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_bits, v_bits, group_size,
                     key_channel_group, n, lengths, k_tail, v_tail, mask, scaling)
