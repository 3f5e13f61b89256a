"""Encoder-decoder cross-attention over the shared encoder output E as the C++ op ``torch.ops.kvslim.encdec_decode``.

For one query token per sequence and absorbed queries ``qt_j = q_j W_K,jᵀ`` (B, h, d), the op computes in one pass
over E (B, n, d), shared by all heads (and all decoder layers), ``u_j = softmax(scaling · qt_j Eᵀ + mask) E``
(B, h, d) and ``lse_j`` (B, h); the caller applies ``W_V,j`` (and ``b_V,j``) to ``u_j``. Source:
``csrc/encdec_decode.cpp`` (+ ``shared_rows.h``, AVX-512 / AVX2 / scalar chosen at run time), built by
:func:`kvslim.kernels.build.load_ops`; on CUDA (or under ``TRITON_INTERPRET=1``) the Triton kernels of
``kernels/triton/encdec_decode.py``. :func:`reference` is their pure-torch twin; :func:`encdec_decode` dispatches
through :func:`kvslim.kernels.backend.pick` (Triton on CUDA, the C++ op on CPU, ``KVSLIM_BACKEND`` overrides) and
runs the twin for inputs the chosen kernel does not take.
"""

from __future__ import annotations

import functools

import torch

from . import backend
from .build import load_ops

FAMILY = "encdec_decode"


@functools.cache
def available() -> bool:
    """Whether ``torch.ops.kvslim.encdec_decode`` is built and loaded (one warning from the build if not)."""
    if not load_ops(FAMILY):
        return False
    torch.library.register_fake("kvslim::encdec_decode")(_fake)
    torch.library.register_fake("kvslim::encdec_decode_mapped")(_fake_mapped)
    return True


def _fake(qt, enc, mask, lengths, scaling, splits=0):
    b, h, d = qt.shape
    return qt.new_empty(b, h, d), qt.new_empty(b, h)


def _fake_mapped(q, enc, w_k, w_v, b_v, mask, lengths, scaling, dk_last=False, splits=0):
    b, h, _ = q.shape
    return q.new_empty(b, h, w_v.shape[2 if dk_last else 1]), q.new_empty(b, h)


def isa() -> str:
    """The instruction set the op runs with here (``avx512``, ``avx2`` or ``scalar``), or ``"twin"``."""
    return torch.ops.kvslim.encdec_decode_isa() if available() else "twin"


def reference(qt: torch.Tensor, enc: torch.Tensor, mask: torch.Tensor | None = None,
              lengths: torch.Tensor | None = None, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's pure-torch twin (fp32 arithmetic).

    Args:
        qt: (B, h, d) absorbed queries.
        enc: (B, n, d) encoder output.
        mask: (B|1, n) additive fp32 mask shared by the heads, or ``None``.
        lengths: (B,) int64 frames per sequence (frames at or after it are never used), or ``None``.
        scaling: score scale.

    Returns:
        u (B, h, d) and lse (B, h), fp32.
    """
    n = enc.shape[1]
    src = enc.float()
    scores = torch.einsum("bhd,bnd->bhn", qt.float(), src) * scaling
    if mask is not None:
        scores = scores + mask[:, None].float()
    if lengths is not None:  # never use a frame past a sequence's length (it may hold anything, NaN included)
        live = torch.arange(n, device=enc.device)[None, :] < lengths[:, None]  # (B, n)
        src = torch.where(live[..., None], src, torch.zeros((), dtype=src.dtype))
        scores = scores.masked_fill(~live[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.einsum("bhn,bnd->bhd", torch.softmax(scores, dim=-1), src), lse


def supported(qt: torch.Tensor, enc: torch.Tensor, mask: torch.Tensor | None = None) -> bool:
    """Whether the op takes these inputs: CPU, fp32/bf16 E, matching widths, a 2-D mask, no autograd."""
    if qt.device.type != "cpu" or enc.device.type != "cpu" or enc.dtype not in (torch.float32, torch.bfloat16):
        return False
    if qt.dim() != 3 or enc.dim() != 3 or qt.shape[2] != enc.shape[2] or enc.shape[1] == 0:
        return False
    if mask is not None and mask.dim() != 2:
        return False
    return not (torch.is_grad_enabled() and (qt.requires_grad or enc.requires_grad))


def _triton():
    """The Triton family module (imported on first use: importing this module never imports Triton)."""
    from .triton import encdec_decode as te

    return te


@torch.compiler.assume_constant_result  # under torch.compile: decided once at trace time, not traced into
def _backend(device_type: str) -> str:
    """:func:`kvslim.kernels.backend.pick` for this family (a CUDA call never builds the C++ op)."""
    return backend.pick(device_type, device_type == "cpu" and available())


def choose(qt: torch.Tensor, enc: torch.Tensor, mask: torch.Tensor | None = None,
           lengths: torch.Tensor | None = None, maps: tuple = (), width: int | None = None) -> str:
    """The implementation a call with these inputs runs: ``"triton"``, ``"cpp"`` or ``"torch"`` (the twin).

    ``qt`` (B, h, ·) queries; ``maps`` the mapped op's weights (``w_k``, ``w_v``, ``b_v``; ``None`` entries skipped)
    and ``width`` the absorbed queries' width when ``qt`` is not yet absorbed (the mapped op).

    Raises:
        ValueError: tensors on several devices, or a forced backend that cannot run here.
    """
    maps = tuple(z for z in maps if z is not None)
    device = backend.same_device(FAMILY, qt, enc, mask, lengths, *maps)
    which = _backend(device.type)
    grad_maps = torch.is_grad_enabled() and any(z.requires_grad for z in maps)
    if which == "triton":
        why = _triton().covers(qt, enc) or ("maps that require grad" if grad_maps else None)
        if why is None:
            return "triton"
        backend.warn_fallback(f"{FAMILY} (triton)", why)
    elif which == "cpp":
        shaped = qt if width is None or qt.dim() != 3 else qt.new_empty(qt.shape[0], qt.shape[1], width)
        if (supported(shaped, enc, mask) and all(z.dtype == torch.float32 for z in maps) and not grad_maps
                and not (torch.is_grad_enabled() and qt.requires_grad)):
            return "cpp"
        if backend.forced() == "cpp":
            backend.warn_fallback(f"{FAMILY} (cpp)", "E not fp32/bf16, maps not fp32, a mask not 2-D, or autograd")
    return "torch"


def encdec_decode(qt: torch.Tensor, enc: torch.Tensor, mask: torch.Tensor | None = None,
                  lengths: torch.Tensor | None = None, scaling: float = 1.0, splits: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(u, lse)`` of :func:`reference` through the implementation :func:`choose` picks (Triton, C++ or the twin).

    ``splits`` forces the number of sequence splits per row of the batch (0: chosen from the batch and the
    threads / SMs).

    Raises:
        ValueError: tensors on several devices, or a forced backend that cannot run here.
    """
    which = choose(qt, enc, mask, lengths)
    if which != "torch":
        call = _triton().op() if which == "triton" else torch.ops.kvslim.encdec_decode
        return call(qt.float(), enc, None if mask is None else mask.float(), lengths, float(scaling), int(splits))
    return reference(qt, enc, mask, lengths, scaling)


def reference_mapped(q: torch.Tensor, enc: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor,
                     b_v: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                     lengths: torch.Tensor | None = None, scaling: float = 1.0, dk_last: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of the mapped op: absorbed queries ``qt_j = q_j · w_k[j]``, :func:`reference`, then
    ``out_j = u_j · w_v[j]ᵀ + b_v[j]``.

    Args:
        q: (B, h, dk) queries. w_k: (h, dk, d), w_v: (h, dv, d) (HF ``k_proj``/``v_proj`` weights viewed per head);
            with ``dk_last`` (h, d, dk) and (h, d, dv) instead (slim's X-cache ``score_map`` / ``value_map``).
        b_v: (h, dv) value bias or ``None``. Other arguments as in :func:`reference`.

    Returns:
        out (B, h, dv) and lse (B, h), fp32.
    """
    w_k, w_v = (w.float().transpose(1, 2) if dk_last else w.float() for w in (w_k, w_v))
    qt = torch.einsum("bhk,hkc->bhc", q.float(), w_k)
    u, lse = reference(qt, enc, mask, lengths, scaling)
    out = torch.einsum("bhc,hkc->bhk", u, w_v)
    return (out if b_v is None else out + b_v.float()), lse


def encdec_decode_mapped(q: torch.Tensor, enc: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor,
                         b_v: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                         lengths: torch.Tensor | None = None, scaling: float = 1.0, dk_last: bool = False,
                         splits: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-attention of one decoder layer (absorbed query, one pass over E for all heads, ``W_V``, ``b_V``):
    ``(out, lse)`` of :func:`reference_mapped` through the implementation :func:`choose` picks (the C++ op in one
    call; Triton as its kernel between two batched matmuls in torch; else the twin). Also serves slim's X-cache
    self-attention (rows X, ``dk_last`` maps)."""
    which = choose(q, enc, mask, lengths, (w_k, w_v, b_v), width=enc.shape[-1])
    mask = None if mask is None else mask.float()
    if which == "triton":
        return _triton().encdec_decode_mapped(q, enc, w_k, w_v, b_v, mask, lengths, float(scaling), bool(dk_last),
                                              int(splits))
    if which == "cpp":
        return torch.ops.kvslim.encdec_decode_mapped(q.float(), enc, w_k, w_v, b_v, mask, lengths, float(scaling),
                                                     bool(dk_last), int(splits))
    return reference_mapped(q, enc, w_k, w_v, b_v, mask, lengths, scaling, dk_last)
