"""Slim attention option 2 decode (SPEC §3) as the C++ op ``torch.ops.kvslim.slim_decode``, with its twin.

For one query token per sequence over a K-only cache C (B, n, c) — h·dk key columns (RoPE raw or rotated) then
c − h·dk conditioning columns, fp32 or bf16 — the op computes, in one pass over C shared by all heads,
``u_j = softmax(scaling · q_j · rope(K_j)ᵀ + mask) · C`` (B, h, c) and ``lse_j`` (B, h); the caller applies
``W_KV,j`` once to ``u_j``. Source: ``csrc/slim_decode.cpp`` (+ ``shared_rows.h``, AVX-512 / AVX2 / scalar chosen
at run time), built by :func:`kvslim.kernels.build.load_ops`; on CUDA (or under ``TRITON_INTERPRET=1``) the Triton
kernels of ``kernels/triton/slim_decode.py``. :func:`reference` is their pure-torch twin (float32, per-head,
obviously correct); :func:`slim_decode` dispatches through :func:`kvslim.kernels.backend.pick` (Triton on CUDA, the
C++ op on CPU, ``KVSLIM_BACKEND`` overrides) and runs the twin for inputs the chosen kernel does not take.
``lse`` makes the result mergeable across shards (``merge``).
"""

from __future__ import annotations

import functools

import torch

from ..ops.rope import rotate, unrotate
from . import backend
from .build import load_ops

FAMILY = "slim_decode"


@functools.cache
def available() -> bool:
    """Whether ``torch.ops.kvslim.slim_decode`` is built and loaded (one warning from the build if not)."""
    if not load_ops(FAMILY):
        return False
    torch.library.register_fake("kvslim::slim_decode")(_fake)
    torch.library.register_fake("kvslim::slim_decode_mapped")(_fake_mapped)
    return True


def _fake(q, rows, cos, sin, mask, lengths, scaling, rotated, splits=0):
    b, h, _ = q.shape
    return q.new_empty(b, h, rows.shape[2]), q.new_empty(b, h)


def _fake_mapped(q, rows, value_map, cos, sin, mask, lengths, scaling, rotated, splits=0):
    b, h, _ = q.shape
    return q.new_empty(b, h, value_map.shape[2]), q.new_empty(b, h)


def isa() -> str:
    """The instruction set the op runs with here (``avx512``, ``avx2`` or ``scalar``), or ``"twin"``."""
    return torch.ops.kvslim.slim_decode_isa() if available() else "twin"


def reference(q: torch.Tensor, rows: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
              mask: torch.Tensor | None = None, lengths: torch.Tensor | None = None, scaling: float = 1.0,
              rotated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's pure-torch twin (fp32 arithmetic, head by head through ``ops.rope``).

    Args:
        q: (B, h, dk) queries (RoPE applied).
        rows: (B, n, c) cached rows, keys of head j in columns ``j·dk : (j+1)·dk``, c ≥ h·dk.
        cos, sin: (B|1, n, R) RoPE table of the cached positions, R ≤ dk even, or ``None``.
        mask: (B|1, n) additive fp32 mask shared by the heads, or ``None``.
        lengths: (B,) int64 rows per sequence (rows at or after it are never used), or ``None``.
        scaling: score scale.
        rotated: keys stored with RoPE applied (un-rotated for u) rather than raw (rotated for the scores).

    Returns:
        u (B, h, c) and lse (B, h), fp32.
    """
    b, h, dk = q.shape
    n, e = rows.shape[1], h * dk
    src = rows.float()
    if lengths is not None:  # never use a row past a sequence's length (it may hold anything, NaN included)
        live = torch.arange(n, device=rows.device)[None, :] < lengths[:, None]  # (B, n)
        src = torch.where(live[..., None], src, torch.zeros((), dtype=src.dtype))
    keys = src[..., :e].unflatten(-1, (h, dk)).transpose(1, 2)  # (B, h, n, dk)
    score_keys = keys
    if cos is not None:
        cs, sn = cos[:, None].float(), sin[:, None].float()  # (B|1, 1, n, R)
        if rotated:
            raw = unrotate(keys, cs, sn).transpose(1, 2).reshape(b, n, e)
            src = torch.cat((raw, src[..., e:]), dim=-1)
        else:
            score_keys = rotate(keys, cs, sn)
    scores = torch.einsum("bhd,bhnd->bhn", q.float(), score_keys) * scaling
    if mask is not None:
        scores = scores + mask[:, None].float()
    if lengths is not None:
        scores = scores.masked_fill(~live[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    u = torch.einsum("bhn,bnc->bhc", torch.softmax(scores, dim=-1), src)
    return u, lse


def supported(q: torch.Tensor, rows: torch.Tensor, cos: torch.Tensor | None = None,
              mask: torch.Tensor | None = None) -> bool:
    """Whether the op takes these inputs: CPU, fp32/bf16 rows, R ≤ dk, a 2-D mask, no autograd."""
    if q.device.type != "cpu" or rows.device.type != "cpu" or rows.dtype not in (torch.float32, torch.bfloat16):
        return False
    if q.dim() != 3 or rows.dim() != 3 or q.shape[1] * q.shape[2] > rows.shape[2] or rows.shape[1] == 0:
        return False
    if cos is not None and (cos.shape[-1] > q.shape[2] or cos.shape[-1] % 2):
        return False
    if mask is not None and mask.dim() != 2:
        return False
    grad = torch.is_grad_enabled() and (q.requires_grad or rows.requires_grad)
    return not grad


def _triton():
    """The Triton family module (imported on first use: importing this module never imports Triton)."""
    from .triton import slim_decode as ts

    return ts


@torch.compiler.assume_constant_result  # under torch.compile: decided once at trace time, not traced into
def _backend(device_type: str) -> str:
    """:func:`kvslim.kernels.backend.pick` for this family (a CUDA call never builds the C++ op)."""
    return backend.pick(device_type, device_type == "cpu" and available())


def choose(q: torch.Tensor, rows: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
           mask: torch.Tensor | None = None, lengths: torch.Tensor | None = None,
           value_map: torch.Tensor | None = None) -> str:
    """The implementation a call with these inputs runs: ``"triton"``, ``"cpp"`` or ``"torch"`` (the twin).

    :func:`kvslim.kernels.backend.pick` chooses by device (``KVSLIM_BACKEND`` overrides); an input the chosen kernel
    does not take runs the twin (with one warning per process where a backend was forced or is Triton).

    Raises:
        ValueError: tensors on several devices, or a forced backend that cannot run here.
    """
    device = backend.same_device(FAMILY, q, rows, cos, sin, mask, lengths, value_map)
    which = _backend(device.type)
    if which == "triton":
        why = _triton().covers(q, rows)
        if why is None and value_map is not None and torch.is_grad_enabled() and value_map.requires_grad:
            why = "a value map that requires grad"
        if why is None:
            return "triton"
        backend.warn_fallback(f"{FAMILY} (triton)", why)
    elif which == "cpp":
        ok = supported(q, rows, cos, mask) and (value_map is None or (
            value_map.dtype == torch.float32 and not (torch.is_grad_enabled() and value_map.requires_grad)))
        if ok:
            return "cpp"
        if backend.forced() == "cpp":
            backend.warn_fallback(f"{FAMILY} (cpp)", "rows not fp32/bf16, R > dk, a mask not 2-D, or autograd")
    return "torch"


def slim_decode(q: torch.Tensor, rows: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, lengths: torch.Tensor | None = None, scaling: float = 1.0,
                rotated: bool = False, splits: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(u, lse)`` of :func:`reference` through the implementation :func:`choose` picks (Triton, C++ or the twin).

    Shapes as in :func:`reference`; ``q``, ``cos``, ``sin`` and ``mask`` are widened to fp32 here (small).
    ``splits`` forces the number of sequence splits per row of the batch (0: chosen from the batch and the
    threads / SMs).

    Raises:
        ValueError: ``cos`` without ``sin``, tensors on several devices, or a forced backend that cannot run here.
    """
    if cos is not None and sin is None or cos is None and sin is not None:
        raise ValueError("cos and sin come together")
    which = choose(q, rows, cos, sin, mask, lengths)
    if which != "torch":
        cos, sin, mask = (None if z is None else z.float() for z in (cos, sin, mask))
        call = _triton().op() if which == "triton" else torch.ops.kvslim.slim_decode
        return call(q.float(), rows, cos, sin, mask, lengths, float(scaling), bool(rotated), int(splits))
    return reference(q, rows, cos, sin, mask, lengths, scaling, rotated)


def reference_mapped(q: torch.Tensor, rows: torch.Tensor, value_map: torch.Tensor, cos: torch.Tensor | None = None,
                     sin: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                     lengths: torch.Tensor | None = None, scaling: float = 1.0, rotated: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of the mapped op: :func:`reference` then ``out_j = u_j · value_map[j]`` ("bhc,hck->bhk").

    ``value_map`` (h, c, odk); returns out (B, h, odk) and lse (B, h), fp32.
    """
    u, lse = reference(q, rows, cos, sin, mask, lengths, scaling, rotated)
    return torch.einsum("bhc,hck->bhk", u, value_map.float()), lse


def slim_decode_mapped(q: torch.Tensor, rows: torch.Tensor, value_map: torch.Tensor, cos: torch.Tensor | None = None,
                       sin: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                       lengths: torch.Tensor | None = None, scaling: float = 1.0, rotated: bool = False,
                       splits: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`slim_decode` with ``W_KV`` applied too: ``(out (B, h, odk), lse (B, h))`` of :func:`reference_mapped`.

    The C++ op applies it inside (one parallel region per layer and step; ``value_map`` fp32 there), the Triton
    path as one batched matmul after its kernel, the twin last. ``value_map`` (h, c, odk) (the layer's
    ``SlimLayerWeights.value_map``); other shapes as in :func:`reference`. ``lse`` still merges shards exactly (the
    map is linear: ``merge`` works on ``out`` too).
    """
    if cos is not None and sin is None or cos is None and sin is not None:
        raise ValueError("cos and sin come together")
    which = choose(q, rows, cos, sin, mask, lengths, value_map)
    if which != "torch":
        cos, sin, mask = (None if z is None else z.float() for z in (cos, sin, mask))
        if which == "triton":
            return _triton().slim_decode_mapped(q.float(), rows, value_map, cos, sin, mask, lengths, float(scaling),
                                                bool(rotated), int(splits))
        return torch.ops.kvslim.slim_decode_mapped(q.float(), rows, value_map, cos, sin, mask, lengths,
                                                   float(scaling), bool(rotated), int(splits))
    return reference_mapped(q, rows, value_map, cos, sin, mask, lengths, scaling, rotated)


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax merge of ``(u, lse)`` partials over disjoint row sets (e.g. shards of one sequence)."""
    lse = torch.stack([p[1] for p in parts])  # (S, B, h)
    total = torch.logsumexp(lse, dim=0)
    w = torch.exp(lse - total).nan_to_num(0.0)  # a shard with no rows (lse −inf) weighs 0
    return sum(wi[..., None] * p[0] for wi, p in zip(w, parts)), total
