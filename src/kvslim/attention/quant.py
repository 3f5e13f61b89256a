"""Decode attention over a quantized cache layer's codes (one query token): int8/int4 through
``kvslim.quant_decode``, asymmetric 2/3-bit codes (``int2``) through ``kvslim.quant_decode_lowbit``.

The layer hands a :class:`kvslim.caches.fused.FusedKV` (the coded history plus the full-precision tail) instead
of dequantized keys and values. Everything a store does to values before coding is undone on the query and the
output, never on the history:

* key smoothing (``x / c`` coded, c per channel): scores use ``q ⊙ c``; the tail keys are divided by c;
* Hadamard rotation (``x·R`` coded): scores use ``q·R`` (key tail ``k·R``, kept rotated across steps by
  ``caches/fused.rotated_tail``); values: the int8/int4 op takes the
  coded tokens' weighted sum back by ``Rᵀ`` inside and adds the tail's in its own basis (no rotated tail, no
  product after the op); the int2 op attends a rotated tail (``v·R``) and the output is rotated back once;
* GQA / MQA: the G query heads of a KV head share one pass over its codes (HF's ``repeat_kv`` order).

:func:`reference` is the obviously-correct twin: the layer's own unfused reads, then softmax attention.
"""

from __future__ import annotations

import torch

from ..caches.fused import FusedKV
from ..caches.turbo import TurboStore
from ..kernels.quant_decode import quant_decode
from ..kernels.quant_decode_lowbit import BITS as LOW_BITS
from ..kernels.quant_decode_lowbit import quant_decode_lowbit
from ..kernels.turbo_decode import turbo_decode


def additive_mask(attention_mask: torch.Tensor | None, tokens: int) -> torch.Tensor | None | bool:
    """HF's decode mask (bool "attend" or additive float; (B|1, 1, 1, T) or (B|1, T)) -> additive fp32 (B|1, T),
    ``None`` (no mask) or ``False`` (a shape this path does not take)."""
    if attention_mask is None:
        return None
    m = attention_mask
    if m.dim() == 4:
        if m.shape[1] != 1 or m.shape[2] != 1:
            return False
        m = m[:, 0, 0]
    if m.dim() != 2 or m.shape[-1] != tokens:
        return False
    if m.dtype == torch.bool:
        return torch.zeros(m.shape, dtype=torch.float32, device=m.device).masked_fill_(~m, float("-inf"))
    return m.float()


def decode(h: FusedKV, query: torch.Tensor, attention_mask: torch.Tensor | None,
           scaling: float | None) -> torch.Tensor | None:
    """Attention output (B, 1, H, D) in the query's dtype for a decode step's query (B, H, 1, D), or ``None`` when
    this path does not take the inputs (the caller then attends over ``h.materialize()``). Any device: the ops'
    dispatch (:mod:`kvslim.kernels.backend`) picks the C++ op, the Triton kernels or the twin."""
    b, heads, s, d = query.shape
    hk = h.k.data.shape[1]
    mask = additive_mask(attention_mask, h.tokens)
    if s != 1 or heads % hk or mask is False:
        return None
    scaling = d ** -0.5 if scaling is None else float(scaling)
    q = query.float().reshape(b, hk, heads // hk, d)  # head j·G + g -> (KV head j, g)
    kt, vt = h.k_tail, h.v_tail
    kt, vt = (None, None) if kt is None else (kt.float(), vt.float())
    if isinstance(h.k, TurboStore) or isinstance(h.v, TurboStore):
        return None if h.pages is not None else _turbo(h, q, kt, vt, mask, scaling, query.dtype)
    channel, rot, vrot = h.k.channel, h.k.rotation, h.v.rotation
    if channel is not None:
        q = q * channel
        kt = None if kt is None else kt / channel
    if rot is not None:
        q = q @ rot
        if kt is not None and not h.k_tail_rotated:
            kt = kt @ rot
    spec, vbits = h.k.spec, h.v.spec.bits
    if spec.bits != vbits or spec.bits in LOW_BITS:  # low-bit (int2) formats: their own op, asymmetric only
        if spec.bits not in LOW_BITS or vbits not in LOW_BITS or h.k.zero is None or h.v.zero is None:
            return None
        if vrot is not None and vt is not None and not h.v_tail_rotated:
            vt = vt @ vrot
        out, _ = quant_decode_lowbit(q, h.k.data, h.k.scale, h.k.zero, h.v.data, h.v.scale, h.v.zero, spec.bits,
                                     vbits, spec.group_size, spec.channel_group, h.n, h.lengths, kt, vt,
                                     h.kernel_mask(mask), scaling, pages=h.pages, page=h.page)
        out = out.reshape(b * heads, d)
        if vrot is not None:
            out = out @ vrot.T  # one 2-D product (a batched one would copy R per head)
        return out.view(b, 1, heads, d).to(query.dtype)
    # the int8/int4 op takes the tail in the values' own basis (fused.append_handle hands it over unrotated)
    out, _ = quant_decode(q, h.k.data, h.k.scale, h.k.zero, h.v.data, h.v.scale, h.v.zero, spec.bits,
                          spec.group_size, spec.channel_group, h.n, h.lengths, kt, vt, h.kernel_mask(mask), scaling,
                          v_unrot=h.v.unrotation, pages=h.pages, page=h.page)
    return out.view(b, 1, heads, d).to(query.dtype)


def _turbo(h: FusedKV, q: torch.Tensor, kt: torch.Tensor | None, vt: torch.Tensor | None, mask, scaling: float,
           dtype: torch.dtype) -> torch.Tensor | None:
    """Turbo codes (``caches/turbo.py``): the query and the tail go into the stores' coded bases (smoothing, the
    outlier permutation, each part's rotation), ``kvslim.turbo_decode`` attends (RoPE-centred keys: with the
    per-row score bias ``q·RoPE_t(μ)``), the output is rotated back."""
    k, v = h.k, h.v
    if not (isinstance(k, TurboStore) and isinstance(v, TurboStore)) or v.perm is not None or v.channel is not None:
        return None
    b, hk, g, d = q.shape
    q, ab = k.move_query(q)  # scores: (q ⊙ c)·k̃ in the coded basis; RoPE-centred keys: + ab·[cos|sin]_t per row
    bias = (None, None) if ab is None else (ab, k.bias_rows(h.n, ab.shape[-1]))
    if kt is not None:  # an append layer's tails come in the coded bases (caches/fused.turbo_tail), kept per step
        kt = kt if h.k_tail_rotated else k.to_coded_basis(kt)
        vt = vt if h.v_tail_rotated else v.to_coded_basis(vt)
    out, _ = turbo_decode(q, k.data, k.scale, v.data, v.scale, k.spec.outliers, k.spec.bits, v.spec.bits, h.n, kt, vt,
                          h.kernel_mask(mask), scaling, *bias, lengths=h.lengths)
    out = out.reshape(b * hk * g, d) @ v.rotations[0].T
    return out.view(b, 1, hk * g, d).to(dtype)


def reference(h: FusedKV, query: torch.Tensor, attention_mask: torch.Tensor | None,
              scaling: float | None) -> torch.Tensor:
    """The twin of :func:`decode`: the layer's unfused keys/values (B, Hk, T, D), then fp32 softmax attention."""
    keys, values = h.materialize()
    b, heads, _, d = query.shape
    hk = keys.shape[1]
    scaling = d ** -0.5 if scaling is None else float(scaling)
    q = query.float().reshape(b, hk, heads // hk, d)
    scores = torch.einsum("bhgd,bhtd->bhgt", q, keys.float()) * scaling
    mask = additive_mask(attention_mask, keys.shape[2])
    if mask is not None:
        scores = scores + mask[:, None, None, :]
    out = torch.einsum("bhgt,bhtd->bhgd", torch.softmax(scores, dim=-1), values.float())
    return out.reshape(b, 1, heads, d).to(query.dtype)
