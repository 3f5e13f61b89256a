"""Cross-attention over the shared encoder output E (slim attention §6, SPEC §3 "Encoder-decoder").

Stores: nothing per layer — every decoder layer reads the same E (B, n, d) and goes through its own
projections: scores ``A_i = (q_i W_K,i^T) E^T`` (the key bias drops out: softmax is shift-invariant), head
output ``(s_i E) W_V,i + b_V,i`` (softmax rows sum to 1). Works for any head layout (MHA/GQA/MQA; e ≷ d).
Exact in exact arithmetic, no inverse; :func:`reference_cross_attention` (K, V materialized) is its twin.
Paper: Graef & Wasielewski 2025.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import encdec_decode as kernel


@dataclass(frozen=True)
class CrossWeights:
    """One cross-attention layer's maps, per head.

    Attributes:
        w_k: (h, dk, d) — ``W_K,i^T`` (the HF ``k_proj.weight`` viewed per head, no copy in fp32).
        w_v: (h, dk, d) — ``W_V,i^T``.
        b_v: (h, 1, dk) value bias added to the head outputs, or ``None``.
        scaling: the score scale the model applies after the dot product (1.0 where q is pre-scaled).
        source: what the maps were built from — :func:`weights_key` of the HF ``k_proj``/``v_proj`` weights — so a
            caller can tell when the model's weights moved (``model.to(dtype/device)``, in-place loads).
    """

    w_k: torch.Tensor
    w_v: torch.Tensor
    b_v: torch.Tensor | None = None
    scaling: float = 1.0
    source: tuple = ()

    @property
    def num_heads(self) -> int:
        return self.w_k.shape[0]

    @classmethod
    def from_linear(cls, w_k: torch.Tensor, w_v: torch.Tensor, b_v: torch.Tensor | None, num_heads: int,
                    scaling: float, dtype: torch.dtype) -> CrossWeights:
        """From HF ``nn.Linear`` weights ``(e, d)`` / bias ``(e,)``; kept as views when ``dtype`` matches."""
        e, d = w_k.shape
        dk = e // num_heads

        def heads(w):
            return w.detach().to(dtype).view(num_heads, dk, d)

        bias = None if b_v is None else b_v.detach().to(dtype).view(num_heads, 1, dk)
        return cls(heads(w_k), heads(w_v), bias, float(scaling), weights_key(w_k, w_v, b_v))


def weights_key(*tensors: torch.Tensor | None) -> tuple:
    """Identity of the weights' current contents: storage, in-place version, dtype and device of each tensor."""
    return tuple(None if t is None else (t.data_ptr(), t._version, t.dtype, t.device) for t in tensors)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def shared_cross_attention(q: torch.Tensor, enc: torch.Tensor, w: CrossWeights,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of decoder queries over the encoder output through absorbed per-head projections.

    Args:
        q: (B, h, T, dk) queries (as the model forms them, e.g. pre-scaled for Whisper).
        enc: (B, n, d) the encoder output E (shared by all layers).
        w: the layer's :class:`CrossWeights` (fp32 or wider).
        bias: fp32 additive term broadcastable to (B, h, T, n) (padding mask, T5 position bias), or ``None``.

    Returns:
        (B, h, T, dk) head outputs (value bias included) in q's dtype. Compute in fp32 (or wider), softmax in the same (fp32 or fp64).
    """
    b, h, t, dk = q.shape
    n, d = enc.shape[1], enc.shape[2]
    ct = _compute_dtype(q.dtype)
    if _fused(q, enc, w, bias):  # one op: absorbed queries, one pass over E for all heads, W_V and b_V
        b_v = None if w.b_v is None else w.b_v.reshape(h, -1)
        out, _ = kernel.encdec_decode_mapped(q[:, :, 0], enc, w.w_k, w.w_v, b_v,
                                             None if bias is None else bias.reshape(bias.shape[0], n), None,
                                             w.scaling)
        return out[:, :, None].to(q.dtype)  # (B, h, 1, dk)
    e_c = enc.to(ct)
    qt = torch.matmul(q.to(ct), w.w_k)  # absorbed queries "bhtk,hkc->bhtc": (B, h, T, d)
    scores = torch.bmm(qt.reshape(b, h * t, d), e_c.transpose(1, 2)).view(b, h, t, n)  # all heads, one product
    if w.scaling != 1.0:
        scores = scores * w.scaling
    if bias is not None:
        scores = scores + bias
    s = torch.softmax(scores, dim=-1)  # (B, h, T, n)
    u = torch.bmm(s.reshape(b, h * t, n), e_c).view(b, h, t, d)  # "bhtn,bnc->bhtc"
    out = torch.matmul(u, w.w_v.transpose(1, 2))  # "bhtc,hck->bhtk"
    if w.b_v is not None:
        out = out + w.b_v
    return out.to(q.dtype)


def _fused(q: torch.Tensor, enc: torch.Tensor, w: CrossWeights, bias: torch.Tensor | None) -> bool:
    """Whether the decode step goes through a kernel (Triton on CUDA, the C++ op on CPU: :func:`kernel.choose`): one
    query token, fp32 weights, a bias shared by heads."""
    if q.shape[2] != 1 or w.w_k.dtype != torch.float32 or q.dtype not in (torch.float32, torch.bfloat16,
                                                                          torch.float16):
        return False
    if bias is not None and (bias.dim() != 4 or bias.shape[1] != 1 or bias.shape[2] != 1
                             or bias.shape[3] != enc.shape[1]):
        return False
    grad = torch.is_grad_enabled() and (q.requires_grad or enc.requires_grad or w.w_k.requires_grad)
    return not grad and kernel.choose(q[:, :, 0], enc, None, None, (w.w_k, w.w_v, w.b_v), enc.shape[-1]) != "torch"


def reference_cross_attention(q: torch.Tensor, enc: torch.Tensor, w_k: torch.Tensor, b_k: torch.Tensor | None,
                              w_v: torch.Tensor, b_v: torch.Tensor | None, scaling: float,
                              bias: torch.Tensor | None = None) -> torch.Tensor:
    """The plain path: K = E W_K^T + b_K, V = E W_V^T + b_V per head, softmax(q K^T · scaling + bias) V.

    ``w_k``/``w_v`` are HF ``(e, d)`` weights. Shapes as in :func:`shared_cross_attention`.
    """
    b, h, t, dk = q.shape
    ct = _compute_dtype(q.dtype)
    k = torch.nn.functional.linear(enc.to(ct), w_k.to(ct), None if b_k is None else b_k.to(ct))
    v = torch.nn.functional.linear(enc.to(ct), w_v.to(ct), None if b_v is None else b_v.to(ct))
    k, v = (z.view(b, -1, h, dk).transpose(1, 2) for z in (k, v))  # (B, h, n, dk)
    scores = q.to(ct) @ k.transpose(-1, -2) * scaling
    if bias is not None:
        scores = scores + bias
    return (torch.softmax(scores, dim=-1) @ v).to(q.dtype)


def additive_bias(mask: torch.Tensor | None, position_bias: torch.Tensor | None, kv_len: int
                  ) -> torch.Tensor | None:
    """fp32 additive term from an HF mask (bool: True = visible, or additive float) plus a position bias."""
    out = None
    if mask is not None:
        if mask.dtype == torch.bool:
            out = torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, torch.finfo(torch.float32).min)
        else:
            out = mask[..., -kv_len:].float().clamp_min(torch.finfo(torch.float32).min)
    if position_bias is not None:
        pb = position_bias[..., -kv_len:].float()
        out = pb if out is None else (out + pb).clamp_min(torch.finfo(torch.float32).min)
    return out
