"""DeepSeek MLA's absorbed decode step over the latent cache (op family ``mla_decode``): twin, registration, dispatch.

For one query token per sequence, with ``q_abs = q_nope W_UK`` (B, H, dc) and the rotated ``q_pe`` (B, H, dr) over
the cached ``c_kv`` (B, T, dc) and ``k_pe`` (B, T, dr):
``scores = scale · (q_abs · c_kvᵀ + q_pe · k_peᵀ) + mask`` (the "elided" form: two products, no concatenated key),
``u = softmax(scores) · c_kv`` (B, H, dc) fp32 and ``lse`` (B, H) fp32; the caller applies ``W_UV`` to ``u``.

Backends: ``triton`` (:mod:`kvslim.kernels.triton.mla_decode`, FlashMLA's one read of the latent for a block of
heads, split over the rows with a log-sum-exp merge; CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``),
registered lazily as ``torch.ops.kvslim.mla_decode_triton`` (custom op + fake impl: ``torch.compile(fullgraph=True)``
traces it), and ``torch``: :func:`reference`, the fp32 twin. There is no C++ op: on CPU the attention code keeps its
torch matmul paths (``attend_elided`` / ``attend_absorbed``), see :func:`backend_for`.
"""

from __future__ import annotations

import functools

import torch

from . import backend

FAMILY = "mla_decode"


def reference(q_abs: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
              lengths: torch.Tensor | None = None, mask: torch.Tensor | None = None,
              scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's pure-torch twin, in fp32 (obviously correct: dense scores, masked, softmax, weighted sum).

    Args:
        q_abs: (B, H, dc) absorbed query ``q_nope W_UK`` (unscaled).
        q_pe: (B, H, dr) rotated RoPE query.
        c_kv: (B, T, dc) latent rows; k_pe: (B, T, dr) rotated RoPE keys (any float dtype).
        lengths: (B,) int64 rows per sequence (rows at or past it are never used: they may hold anything), or None.
        mask: (B|1, T) additive float or boolean (True = visible) mask shared by the heads, or None.
        scale: softmax scale.

    Returns:
        u (B, H, dc) and lse (B, H), fp32 (a sequence with no visible row: u = 0, lse = −inf).
    """
    t = c_kv.shape[1]
    src, keys = c_kv.float(), k_pe.float()
    live = None
    if lengths is not None:
        live = torch.arange(t, device=c_kv.device)[None, :] < lengths[:, None]  # (B, T)
        zero = torch.zeros((), dtype=torch.float32, device=c_kv.device)
        src = torch.where(live[..., None], src, zero)
        keys = torch.where(live[..., None], keys, zero)
    scores = torch.einsum("bhc,btc->bht", q_abs.float(), src) + torch.einsum("bhr,btr->bht", q_pe.float(), keys)
    scores = scores * scale
    if mask is not None:
        scores = scores + additive(mask)[:, None]
    if live is not None:
        scores = scores.masked_fill(~live[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, H)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # an empty row (lse −inf) weighs nothing
    return torch.einsum("bht,btc->bhc", probs, src), lse


def additive(mask: torch.Tensor) -> torch.Tensor:
    """A (B|1, T) decode mask as fp32 additive: boolean True → 0, False → −inf; float as given."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask.float()


def check(q_abs: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
          lengths: torch.Tensor | None, mask: torch.Tensor | None) -> None:
    """Shapes and dtypes, as ValueErrors naming the argument (no device sync: ``lengths`` values are not read)."""
    for x, what in ((q_abs, "q_abs"), (q_pe, "q_pe"), (c_kv, "c_kv"), (k_pe, "k_pe")):
        if x.dim() != 3 or not x.is_floating_point():
            raise ValueError(f"mla_decode: {what} must be a 3-D float tensor, got {x.dtype} {tuple(x.shape)}")
    b, h, dc = q_abs.shape
    t = c_kv.shape[1]
    if c_kv.shape != (b, t, dc):
        raise ValueError(f"mla_decode: c_kv must be (B={b}, T, dc={dc}) like q_abs, got {tuple(c_kv.shape)}")
    dr = k_pe.shape[-1]
    if k_pe.shape != (b, t, dr) or q_pe.shape != (b, h, dr):
        raise ValueError(f"mla_decode: k_pe must be (B={b}, T={t}, dr) and q_pe (B={b}, H={h}, dr) with one dr, "
                         f"got {tuple(k_pe.shape)} and {tuple(q_pe.shape)}")
    if lengths is not None and (lengths.dtype != torch.int64 or lengths.shape != (b,)):
        raise ValueError(f"mla_decode: lengths must be int64 of shape (B={b},), got {lengths.dtype} "
                         f"{tuple(lengths.shape)}")
    if mask is not None and (mask.dim() != 2 or mask.shape[0] not in (1, b) or mask.shape[1] != t
                             or not (mask.dtype == torch.bool or mask.is_floating_point())):
        raise ValueError(f"mla_decode: mask must be boolean or float (1 or B={b}, T={t}), got {mask.dtype} "
                         f"{tuple(mask.shape)}")


def backend_for(device: torch.device | str) -> str:
    """``"triton"`` or ``"torch"`` for an MLA decode step on ``device`` (:func:`kvslim.kernels.backend.pick` without a
    C++ op; ``KVSLIM_BACKEND=cpp`` runs the torch path, with one warning, as there is no C++ op for MLA)."""
    if backend.forced() == "cpp":
        backend.warn_fallback(FAMILY, "KVSLIM_BACKEND=cpp, but MLA has no C++ op")
        return "torch"
    return backend.pick(device, cpp_available=False)


def _uncovered(q_abs, q_pe, c_kv, k_pe) -> str | None:
    from .triton import mla_decode as tk

    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q_abs, q_pe, c_kv, k_pe))
    return "inputs that require grad (the kernels have no backward)" if grad else tk.covers(c_kv, k_pe)


@functools.cache
def op():
    """``torch.ops.kvslim.mla_decode_triton``, registered on first use (imports Triton)."""
    from .triton import mla_decode as tk

    @torch.library.custom_op("kvslim::mla_decode_triton", mutates_args=())
    def mla_decode_triton(q_abs: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                          lengths: torch.Tensor | None, mask: torch.Tensor | None, scale: float,
                          splits: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return tk.launch(q_abs, q_pe, c_kv, k_pe, lengths, mask, scale, splits)

    @mla_decode_triton.register_fake
    def _(q_abs, q_pe, c_kv, k_pe, lengths, mask, scale, splits=0):
        b, h, dc = q_abs.shape
        return q_abs.new_empty(b, h, dc, dtype=torch.float32), q_abs.new_empty(b, h, dtype=torch.float32)

    return torch.ops.kvslim.mla_decode_triton


@torch.compiler.assume_constant_result
def _registered() -> bool:
    """Registers the op (imports Triton) outside any graph: under ``torch.compile`` Dynamo runs this eagerly while
    tracing and keeps the constant, so a compiled first call does not trace the registration itself."""
    op()
    return True


def mla_decode(q_abs: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
               lengths: torch.Tensor | None = None, mask: torch.Tensor | None = None, scale: float = 1.0,
               splits: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(u, lse)`` of :func:`reference` through the Triton kernels where the backend is ``triton`` and they take
    the inputs (else the twin; one warning when the Triton backend was picked but does not cover them).

    Shapes as in :func:`reference`; ``q_abs`` and the mask are made fp32 here (small); ``splits`` > 0 forces the
    number of row splits (0: from the shapes and the GPU's SM count).

    Raises:
        ValueError: bad shapes or dtypes (naming the argument), tensors on several devices, or a
            ``KVSLIM_BACKEND`` that cannot run here.
    """
    check(q_abs, q_pe, c_kv, k_pe, lengths, mask)
    device = backend.same_device("mla_decode", q_abs, q_pe, c_kv, k_pe, lengths, mask)
    if backend_for(device) == "triton":
        why = _registered() and _uncovered(q_abs, q_pe, c_kv, k_pe)
        if why is None:
            m = None if mask is None else additive(mask)
            return torch.ops.kvslim.mla_decode_triton(q_abs.float(), q_pe, c_kv, k_pe, lengths, m, float(scale),
                                                      int(splits))
        backend.warn_fallback(FAMILY, why)
    return reference(q_abs, q_pe, c_kv, k_pe, lengths, mask, scale)


__all__ = ["FAMILY", "additive", "backend_for", "check", "mla_decode", "op", "reference"]
