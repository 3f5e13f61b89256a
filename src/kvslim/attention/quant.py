"""Decode attention over a quantized cache layer's codes: int8/int4 through ``kvslim.quant_decode``, asymmetric
2/3-bit codes (``int2``) through ``kvslim.quant_decode_lowbit``, turbo codes through ``kvslim.turbo_decode``.

A decode step (one query token) reads the whole handle through the op. A multi-token call over a history (a
question asked of a prompt file, a chat turn, an assisted-decoding verify step; ``caches/fused.history_handle``)
packs its G·S query rows per KV head into one op call over the history and merges the call's own S×S causal block,
attended exactly in fp32, by log-sum-exp (:func:`decode_call`): the history is read once, as stored, never
dequantized into a full-precision copy.

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

from dataclasses import replace

import torch

from ..caches.fused import FusedKV
from ..caches.turbo import TurboStore
from ..kernels import backend
from ..kernels.quant_decode import merge, quant_decode
from ..kernels.quant_decode_lowbit import BITS as LOW_BITS
from ..kernels.quant_decode_lowbit import quant_decode_lowbit
from ..kernels.turbo_decode import turbo_decode

#: query rows per call of the low-bit and turbo Triton kernels in a multi-token call (their tiles hold every row)
GPU_ROWS = 32


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
    """Attention output (B, S, H, D) in the query's dtype for a decode step's query (B, H, 1, D), or for a
    multi-token call's (B, H, S, D) over a handle with ``own`` (:func:`decode_call`); ``None`` when this path does
    not take the inputs (the caller then attends over ``h.materialize()``). Any device: the ops' dispatch
    (:mod:`kvslim.kernels.backend`) picks the C++ op, the Triton kernels or the twin."""
    if h.own is not None:
        return decode_call(h, query, attention_mask, scaling)
    b, heads, s, d = query.shape
    hk = h.k.data.shape[1]
    mask = additive_mask(attention_mask, h.tokens)
    if s != 1 or heads % hk or mask is False:
        return None
    scaling = d ** -0.5 if scaling is None else float(scaling)
    q = query.float().reshape(b, hk, heads // hk, d)  # head j·G + g -> (KV head j, g)
    got = history(h, q, mask, scaling)
    return None if got is None else got[0].view(b, 1, heads, d).to(query.dtype)


def decode_call(h: FusedKV, query: torch.Tensor, attention_mask: torch.Tensor | None,
                scaling: float | None) -> torch.Tensor | None:
    """A call of S new tokens over a stored history (``h.own``: their keys and values exactly): the G·S query
    rows of each KV head go through the op once over the history (:func:`history`: its output and log-sum-exp),
    the S×S block of the call's own tokens is attended in fp32 under HF's mask, and the two are merged exactly
    (``kernels.quant_decode.merge``). Takes HF's 4-D mask (B|1, 1, S, history + S) whose rows agree on the
    history's columns (a causal mask, left padding); anything else -> ``None``."""
    b, heads, s, d = query.shape
    hk = h.k.data.shape[1]
    k_own, v_own = h.own
    if heads % hk or k_own.shape[2] != s:
        return None
    hist = replace(h, own=None)
    masks = call_masks(attention_mask, hist.tokens, s)
    if masks is None:
        return None
    scaling = d ** -0.5 if scaling is None else float(scaling)
    g = heads // hk
    q = query.float().reshape(b, hk, g * s, d)  # row g·S + i: query head j·G + g, token i (HF's repeat_kv order)
    triton = q.device.type != "cpu" or backend.forced() == "triton"
    step = GPU_ROWS if triton and (isinstance(h.k, TurboStore) or h.k.spec.bits in LOW_BITS) else g * s
    # (the low-bit and turbo Triton kernels pad every row of a KV head into one tile: at most GPU_ROWS per call)
    parts = [history(hist, q[:, :, i:i + step], masks[0], scaling) for i in range(0, g * s, step)]
    if any(p is None for p in parts):
        return None
    got = parts[0] if len(parts) == 1 else (torch.cat([p[0] for p in parts], 2), torch.cat([p[1] for p in parts], 2))
    qs = q.view(b, hk, g, s, d)
    scores = torch.einsum("bhgsd,bhtd->bhgst", qs, k_own.float()) * scaling  # (B, Hk, G, S, S)
    scores = scores + masks[1][:, None, None]
    lse = torch.logsumexp(scores, dim=-1)
    own = torch.einsum("bhgst,bhtd->bhgsd", torch.softmax(scores, dim=-1).nan_to_num(0.0), v_own.float())
    out, _ = merge([got, (own.reshape(b, hk, g * s, -1), lse.reshape(b, hk, g * s))])
    return out.view(b, heads, s, -1).transpose(1, 2).to(query.dtype)


def call_masks(attention_mask: torch.Tensor | None, past: int, s: int
               ) -> tuple[torch.Tensor | None, torch.Tensor] | None:
    """HF's mask of a multi-token call (bool "attend" or additive; (B|1, 1, S, past + S)) -> (the history's
    additive fp32 (B|1, past) or ``None`` when nothing there is masked, the own block's additive fp32
    (B|1, S, S)); ``None`` when the rows disagree on the history (a mask this path does not take) or no mask
    was given (HF gives one whenever a call follows a history)."""
    m = attention_mask
    if m is None or m.dim() != 4 or m.shape[1] != 1 or m.shape[2] != s or m.shape[3] != past + s:
        return None
    m = m[:, 0]
    if m.dtype == torch.bool:
        m = torch.zeros(m.shape, dtype=torch.float32, device=m.device).masked_fill_(~m, float("-inf"))
    else:
        m = m.float()
    hist = m[:, :, :past]
    if not bool((hist == hist[:, :1]).all()):  # one host read: the history's columns must not depend on the row
        return None
    first = hist[:, 0]
    return (None if not bool((first != 0).any()) else first), m[:, :, past:]


def history(h: FusedKV, q: torch.Tensor, mask: torch.Tensor | None, scaling: float
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(out (B, Hk, R, D) fp32 in the model's basis, lse (B, Hk, R))`` of fp32 query rows ``q`` (B, Hk, R, D)
    over the handle's coded history and tail under an additive mask (B|1, tokens), through the op of its codes;
    ``None`` for codes no op takes."""
    b, hk, rows, d = q.shape
    kt, vt = h.k_tail, h.v_tail
    kt, vt = (None, None) if kt is None else (kt.float(), vt.float())
    if isinstance(h.k, TurboStore) or isinstance(h.v, TurboStore):
        return _turbo(h, q, kt, vt, mask, scaling)
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
        out, lse = quant_decode_lowbit(q, h.k.data, h.k.scale, h.k.zero, h.v.data, h.v.scale, h.v.zero, spec.bits,
                                       vbits, spec.group_size, spec.channel_group, h.n, h.lengths, kt, vt,
                                       h.kernel_mask(mask), scaling, pages=h.pages, page=h.page,
                                       select=h.select)
        if vrot is not None:
            out = (out.reshape(-1, d) @ vrot.T).view(out.shape)  # one 2-D product (a batched one copies R per head)
        return out, lse
    # the int8/int4 op takes the tail in the values' own basis (fused.append_handle hands it over unrotated)
    return quant_decode(q, h.k.data, h.k.scale, h.k.zero, h.v.data, h.v.scale, h.v.zero, spec.bits,
                        spec.group_size, spec.channel_group, h.n, h.lengths, kt, vt, h.kernel_mask(mask), scaling,
                        v_unrot=h.v.unrotation, pages=h.pages, page=h.page, select=h.select)


def _turbo(h: FusedKV, q: torch.Tensor, kt: torch.Tensor | None, vt: torch.Tensor | None, mask, scaling: float
           ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Turbo codes (``caches/turbo.py``): the query and the tail go into the stores' coded bases (smoothing, the
    outlier permutation, each part's rotation), ``kvslim.turbo_decode`` attends (RoPE-centred keys: with the
    per-row score bias ``q·RoPE_t(μ)``), the output is rotated back."""
    k, v = h.k, h.v
    if not (isinstance(k, TurboStore) and isinstance(v, TurboStore)) or v.perm is not None or v.channel is not None:
        return None
    b, hk, g, d = q.shape
    # plainly centred keys score q·(k − μ): the softmax is the same, the log-sum-exp short by q·μ (a merge needs it)
    shift = None if k.mean is None or k.spec.rope_centred else torch.einsum("bhgd,bhd->bhg", q, k.mean[:, :, 0])
    q, ab = k.move_query(q)  # scores: (q ⊙ c)·k̃ in the coded basis; RoPE-centred keys: + ab·[cos|sin]_t per row
    paged = h.pages is not None or h.select is not None
    rows = k.data.shape[2] if paged else h.n  # a page list reads bias rows by stored row
    bias = (None, None) if ab is None else (ab, k.bias_rows(rows, ab.shape[-1]))
    if kt is not None:  # an append layer's tails come in the coded bases (caches/fused.turbo_tail), kept per step
        kt = kt if h.k_tail_rotated else k.to_coded_basis(kt)
        vt = vt if h.v_tail_rotated else v.to_coded_basis(vt)
    out, lse = turbo_decode(q, k.data, k.scale, v.data, v.scale, k.spec.outliers, k.spec.bits, v.spec.bits, h.n, kt,
                            vt, h.kernel_mask(mask), scaling, *bias, lengths=h.lengths, pages=h.pages, page=h.page,
                            select=h.select)
    if shift is not None:
        lse = lse + scaling * shift
    return (out.reshape(b * hk * g, d) @ v.rotations[0].T).view(b, hk, g, d), lse


def reference(h: FusedKV, query: torch.Tensor, attention_mask: torch.Tensor | None,
              scaling: float | None) -> torch.Tensor:
    """The twin of :func:`decode`: the layer's unfused keys/values (B, Hk, T, D), then fp32 softmax attention
    under HF's mask (a decode step's (B|1, 1, 1, T) or (B|1, T); a multi-token call's (B|1, 1, S, T))."""
    keys, values = h.materialize()
    b, heads, s, d = query.shape
    hk = keys.shape[1]
    scaling = d ** -0.5 if scaling is None else float(scaling)
    q = query.float().reshape(b, hk, heads // hk, s, d)
    scores = torch.einsum("bhgsd,bhtd->bhgst", q, keys.float()) * scaling
    if attention_mask is not None:
        m = attention_mask if attention_mask.dim() == 4 else attention_mask[:, None, None, :]  # (B|1, 1, S|1, T)
        if m.dtype == torch.bool:
            m = torch.zeros(m.shape, dtype=torch.float32, device=m.device).masked_fill_(~m, float("-inf"))
        scores = scores + m.float()[:, :, None]
    out = torch.einsum("bhgst,bhtd->bhgsd", torch.softmax(scores, dim=-1), values.float())
    return out.reshape(b, heads, s, -1).transpose(1, 2).to(query.dtype)
