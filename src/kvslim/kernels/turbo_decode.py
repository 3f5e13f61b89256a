"""Decode attention straight from TurboQuant-class codes (``turbo2``/``turbo3``/``turbo4``): ``kvslim.turbo_decode``.

For one query token per sequence, the G query heads of each KV head attend over the first ``n`` coded tokens (or
``lengths[b]`` ≤ n of them, a (B,) int64 tensor: no block past them is read), then
over an optional fp32 tail (sinks and the residual window), all in the stores' coded bases (the caller rotates the
query and the tail in and the output back once, :mod:`kvslim.attention.quant`):

    k_t[i] = s_t[part(i)] · levels[bits(i)][code_t,i]   (channels [0, k_out) at k_bits + 1 bits, the rest at k_bits)
    v_t[i] = s_t · levels[v_bits][code_t,i]
    out = softmax_t(scaling · (q · k_t + ab · rows_t) + mask) · v_t,  lse = log Σ_t exp(...)

(the factored score bias, optional, coded rows only: ``bias_ab`` (B, Hk, G, W), ``bias_rows`` (≥n, W), W a multiple
of 8: RoPE-centred keys' ``q·RoPE_t(μ)``, ``caches/turbo.TurboStore.bias_factors``.)

A sequence with nothing to attend to (``lengths[b] = 0`` or ``n = 0`` and no tail, or every column masked) gets
``out`` zeros and ``lse`` −inf on every backend (the merge of partials checks it once, at the end), as torch's
SDPA gives a fully masked row zeros (``tests/test_empty_rows.py``).

Codes are little-endian bit streams per row (kvslim's packing, :mod:`kvslim.ops.quant_formats`), the outlier part
first. :func:`reference` is the pure-torch twin (decode, then fp32 softmax attention); :func:`turbo_decode`
dispatches by device (:mod:`kvslim.kernels.backend`): CPU tensors to the C++ op (``csrc/turbo_decode.cpp``: AVX2
or its scalar twin body, :func:`set_isa`; head dim and outlier width multiples of 8, else the twin), CUDA tensors
(or ``TRITON_INTERPRET=1``) to the Triton kernel (:mod:`kvslim.kernels.triton.turbo_decode`), anything else to
the twin.
"""

from __future__ import annotations

import functools

import torch

from ..ops import turbo
from . import backend
from .build import load_ops
from .sparse_select import PageChoice, op_args, resolve

FAMILY = "turbo_decode"


@functools.cache
def available() -> bool:
    """Whether ``torch.ops.kvslim.turbo_decode`` is built and loaded."""
    if not load_ops(FAMILY):
        return False
    torch.library.register_fake("kvslim::turbo_decode")(_fake)
    return True


def _fake(q, k_codes, k_scale, v_codes, v_scale, k_out, k_bits, v_bits, levels, n, k_tail, v_tail, mask, scaling,
          bias_ab=None, bias_rows=None, splits=0, lengths=None, pages=None, page=0):
    b, hk, g, d = q.shape
    return q.new_empty(b, hk, g, d), q.new_empty(b, hk, g)


def isa() -> str:
    """The C++ op's instruction set in force: ``"avx2"`` or ``"scalar"``."""
    available()
    return torch.ops.kvslim.turbo_decode_isa()


def set_isa(name: str) -> str:
    """Run the C++ op on ``"avx2"`` or its ``"scalar"`` body (tests run both); returns the previous one."""
    available()
    return torch.ops.kvslim.turbo_decode_set_isa(name)


@functools.cache
def _levels_cpu() -> torch.Tensor:
    out = torch.zeros(5, 16, dtype=torch.float32)
    for bits in (2, 3, 4):
        out[bits, :1 << bits] = torch.from_numpy(turbo.lloyd_max(bits)[0]).float()
    return out


@torch._dynamo.assume_constant_result  # under torch.compile: a constant of the graph, never rebuilt per step
def levels(device: torch.device | str) -> torch.Tensor:
    """(5, 16) fp32: row b holds the 2^b Lloyd–Max levels of the b-bit codebook (rows 0, 1 unused)."""
    return _levels_cpu().to(device)


@torch._dynamo.assume_constant_result  # decided once at trace time, not traced into (it may build the op)
def _cpp_available() -> bool:
    return available()


def decode_rows(codes: torch.Tensor, scale: torch.Tensor, k_out: int, bits: int) -> torch.Tensor:
    """fp32 rows (..., D) in the coded basis from codes (..., bytes) and scales (..., parts): ``k_out`` channels at
    ``bits + 1``, the rest at ``bits``."""
    rest = (codes.shape[-1] * 8 - k_out * (bits + 1)) // bits
    out, at = [], 0
    for j, (w, b) in enumerate(p for p in ((k_out, bits + 1), (rest, bits)) if p[0]):
        nb = w * b // 8
        q = turbo.unpack(codes[..., at:at + nb], b).long()
        lv = torch.from_numpy(turbo.lloyd_max(b)[0]).float().to(codes.device)
        out.append(lv[q] * scale[..., j:j + 1].float())
        at += nb
    return torch.cat(out, dim=-1)


def reference(q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, v_codes: torch.Tensor,
              v_scale: torch.Tensor, k_out: int, k_bits: int, v_bits: int, n: int,
              k_tail: torch.Tensor | None = None, v_tail: torch.Tensor | None = None,
              mask: torch.Tensor | None = None, scaling: float = 1.0, bias_ab: torch.Tensor | None = None,
              bias_rows: torch.Tensor | None = None, lengths: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's pure-torch twin: decode the first ``n`` rows, append the tail, fp32 softmax attention.

    ``q`` (B, Hk, G, D); codes (B, Hk, ≥n, bytes) uint8; scales (B, Hk, ≥n, parts); tails (B, Hk, r, D) fp32;
    ``mask`` additive (B|1, n + r); ``bias_ab`` (B, Hk, G, W) and ``bias_rows`` (≥n, W) fp32 (or (B, Hk, ≥n, W):
    a page list's rows gathered per sequence and head): ``ab·rows_t`` added to the coded rows' ``q·k``; ``lengths`` (B,) int64: coded rows used per sequence (≤ n; slots past them are never
    used, whatever they hold; the tail and its mask columns stay at n). Returns
    (out (B, Hk, G, D), lse (B, Hk, G)) fp32."""
    keys = decode_rows(k_codes[:, :, :n], k_scale[:, :, :n], k_out, k_bits)
    values = decode_rows(v_codes[:, :, :n], v_scale[:, :, :n], 0, v_bits)
    if k_tail is not None:
        keys = torch.cat((keys, k_tail.float()), 2)
        values = torch.cat((values, v_tail.float()), 2)
    scores = torch.einsum("bhgd,bhtd->bhgt", q.float(), keys)
    if bias_ab is not None and bias_rows.dim() == 4:
        scores[..., :n] += torch.einsum("bhgw,bhtw->bhgt", bias_ab.float(), bias_rows[:, :, :n].float())
    elif bias_ab is not None:
        scores[..., :n] += bias_ab.float() @ bias_rows[:n].float().T
    scores = scores * scaling
    if mask is not None:
        scores = scores + mask.float()[:, None, None, :]
    if lengths is not None:  # slots past a sequence's length: no weight, no value (they may hold anything)
        live = torch.arange(scores.shape[-1], device=q.device)[None, :] < lengths.to(q.device)[:, None]
        live |= torch.arange(scores.shape[-1], device=q.device)[None, :] >= n  # the tail
        scores = torch.where(live[:, None, None, :], scores, float("-inf"))
        values = torch.where(live[:, None, :, None], values, 0.0)
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with nothing to attend to -> zeros
    return torch.einsum("bhgt,bhtd->bhgd", weights, values), lse


def turbo_decode(q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, v_codes: torch.Tensor,
                 v_scale: torch.Tensor, k_out: int, k_bits: int, v_bits: int, n: int,
                 k_tail: torch.Tensor | None = None, v_tail: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None, scaling: float = 1.0, bias_ab: torch.Tensor | None = None,
                 bias_rows: torch.Tensor | None = None, lengths: torch.Tensor | None = None,
                 pages: torch.Tensor | None = None, page: int = 0, select: PageChoice | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`reference`'s contract on the backend :func:`kvslim.kernels.backend.pick` chooses for ``q``'s device
    (the C++ op takes head dims and outlier widths that are multiples of 8; others go to the twin on CPU).

    ``pages`` (B, Hk, k) int64 with ``page`` (sparse decode, docs/sparse.md): the ``n`` coded rows are logical, row t
    stored at ``pages[b, h, t // page]·page + t % page`` (its bias row too); the C++ op and the Triton kernel read them
    in place, the twin a gathered copy (with a bias: per-sequence-and-head rows, the table the twin takes).
    ``select`` (:class:`~kvslim.kernels.sparse_select.PageChoice`, instead of ``pages``): the page list chosen in
    the same call (the C++ op scores the boxes and attends through its choice; other backends choose first).

    Raises:
        ValueError: ``lengths`` not an int64 (B,) tensor on ``q``'s device, or (eagerly) a value outside [0, n].
    """
    backend.check_lengths("kvslim.turbo_decode", lengths, q, n)
    cpp_ok = (q.device.type == "cpu" and q.shape[-1] % 8 == 0 and int(k_out) % 8 == 0
              and (bias_ab is None or bias_ab.shape[-1] % 8 == 0) and _cpp_available())
    kind = backend.pick(q.device, cpp_ok)
    if select is not None and not (kind == "cpp" and select.in_call()):
        pages, select = resolve(select, pages, scaling), None
    if kind == "triton":
        from .triton.turbo_decode import turbo_decode_triton

        return turbo_decode_triton(q, k_codes, k_scale, v_codes, v_scale, int(k_out), int(k_bits), int(v_bits),
                                   levels(q.device), int(n), k_tail, v_tail, mask, float(scaling), bias_ab, bias_rows,
                                   lengths, pages, int(page))
    if pages is not None and kind == "torch":  # the twin reads the listed rows gathered
        from .quant_decode import paged_rows

        k_codes, k_scale, v_codes, v_scale = (paged_rows(t, pages, page) for t in (k_codes, k_scale, v_codes, v_scale))
        if bias_rows is not None:  # per sequence and head now: the twin takes that table
            b, hk, _ = pages.shape
            rows = (pages[..., None] * page + torch.arange(page, device=pages.device)).reshape(b, hk, -1)
            bias_rows = bias_rows[rows]
    args = (q, k_codes, k_scale, v_codes, v_scale, int(k_out), int(k_bits), int(v_bits))
    if kind == "cpp":
        return torch.ops.kvslim.turbo_decode(*args, levels("cpu"), int(n), k_tail, v_tail, mask, float(scaling),
                                             bias_ab, bias_rows, 0, lengths, pages, int(page), *op_args(select, pages))
    return reference(*args, n, k_tail, v_tail, mask, scaling, bias_ab, bias_rows, lengths)
