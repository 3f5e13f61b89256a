"""Per-instance patching of HF attention modules for slim attention (the only HF-aware glue).

``patch`` replaces ``forward`` on each attention module listed in the plan (keeping the original in
``_kvslim_original_forward``); ``unpatch`` puts it back. The patched forward falls back to the original one
whenever the layer's cache is not a :class:`~kvslim.caches.slim.SlimLayer` (no cache, a user-provided HF cache,
a full-KV layer of a mixed plan), so outputs stay correct in every case.

Prefill (empty cache) runs the model's own attention on the fresh K and V, then stores the slim row;
decode runs :func:`~kvslim.attention.slim.slim_attention` over the stored rows.
"""

from __future__ import annotations

import functools
import sys

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..attention.slim import SlimLayerWeights, additive_mask, slim_attention
from ..caches.slim import SlimLayer
from ..ops.masks import static_causal_mask
from ..ops.rope import rotate
from .bound import BoundForward
from .compat import CACHE_KW, CACHE_KWS

_ORIG = "_kvslim_original_forward"


class RopeTable:
    """cos/sin of positions 0..N-1 from the model's own rotary module, grown by doubling, shared by layers."""

    def __init__(self, rotary: torch.nn.Module):
        self.rotary = rotary
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def table(self, n: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, R) cos and sin for positions 0..n-1 in ``dtype`` (bitwise what HF computes per position)."""
        if self.cos is None or self.cos.shape[0] < n or self.cos.dtype != dtype or self.cos.device != device:
            size = max(64, 1 << (max(n, 1) - 1).bit_length())
            pos = torch.arange(size, device=device)[None]
            cos, sin = self.rotary(torch.empty(0, dtype=dtype, device=device), pos)
            if torch.compiler.is_compiling():  # a graph step keeps no state: computed in the graph, not stored
                return cos[0, :n], sin[0, :n]
            self.cos, self.sin = cos[0], sin[0]
        return self.cos[:n], self.sin[:n]

    def for_positions(self, positions: torch.Tensor | None, n: int, dtype, device, rows: int | None = None):
        """(B|1, n, R) tables for slot positions (B, n), or 0..n-1 for every sequence when ``None``. ``rows``: a
        bound on the positions known on the host (the static path: no read of ``positions`` back to the host)."""
        size = n if positions is None else (rows if rows is not None else int(positions.max()) + 1)
        cos, sin = self.table(size, dtype, device)
        if positions is None:
            return cos[:n][None], sin[:n][None]
        return cos[positions], sin[positions]


#: the projections a decode step needs besides q: the one its row stores (prefill needs all three)
_DECODE_PARTS = {"k": "qk", "v": "qv", "x": "q"}


def project_and_row(self, adapter, w: SlimLayerWeights, hidden_states: torch.Tensor, kwargs: dict,
                    prefill: bool = True):
    """The attention inputs of one call and the row slim stores for it.

    Returns ``q, k, v`` (B, h, T, dk), RoPE applied to q and k when the model has it, and ``stored`` (B, T, c):
    K (raw or rotated, as ``w.rope_storage`` says, plus the conditioning columns x·P), V, or the input X. With
    ``prefill`` false, k and v are ``None`` unless the row stores them (adapters with separate projections then
    skip the others).
    """
    b, t, _ = hidden_states.shape
    h, dk, e = w.num_heads, w.head_dim, w.num_heads * w.head_dim
    parts = "qkv" if prefill else _DECODE_PARTS[w.technique]
    q, k, v = adapter.qkv(self, hidden_states, parts)  # (B, T, e) each, or None
    q, k, v = (None if z is None else z.reshape(b, t, h, dk).transpose(1, 2) for z in (q, k, v))  # (B, h, T, dk)
    k_raw = k
    if adapter.has_rope:
        cos, sin = kwargs["position_embeddings"]
        q = rotate(q, cos[:, None], sin[:, None])
        if k is not None:
            k = rotate(k, cos[:, None], sin[:, None])
    if w.technique == "k":
        stored = (k if w.rope and w.rope_storage == "rotated" else k_raw).transpose(1, 2).reshape(b, t, e)
        if w.proj is not None:
            z = (hidden_states.float() @ w.proj).to(hidden_states.dtype)  # x·P, rounded like the keys
            stored = torch.cat((stored, z), dim=-1)
    elif w.technique == "v":
        stored = v.transpose(1, 2).reshape(b, t, e)
    else:
        stored = hidden_states
    return q, k, v, stored


def slim_forward(self, adapter, w: SlimLayerWeights, rope: RopeTable | None, hidden_states: torch.Tensor,
                 *args, **kwargs):
    """Replacement ``forward`` of one HF attention module (bound per instance)."""
    # the class forward (the instance one is the patch), called unbound: torch 2.11's dynamo cannot trace
    # ``function.__get__`` (every compiled slim step failed there)
    original = functools.partial(type(self).forward, self)
    past = kwargs.get(CACHE_KW)
    layers = getattr(past, "layers", None)
    layer = layers[self.layer_idx] if layers is not None and self.layer_idx < len(layers) else None
    if args or not isinstance(layer, SlimLayer) or kwargs.get("encoder_hidden_states") is not None:
        return original(hidden_states, *args, **kwargs)
    b, t, _ = hidden_states.shape
    e = w.num_heads * w.head_dim
    first = layer.is_empty()
    q, k, v, stored = project_and_row(self, adapter, w, hidden_states, kwargs, prefill=first)
    layer.write(stored, kwargs.get("position_ids") if w.rope else None)
    mask = kwargs.get("attention_mask")
    if first:  # prefill: the model's own attention on the fresh keys and values
        mask = prefill_mask(mask, t)
        if rope is not None and layer.rope_table_rows() is not None:  # built now: graph steps only read it
            rope.table(layer.rope_table_rows(), q.dtype, q.device)
        eager = getattr(sys.modules[type(self).__module__], "eager_attention_forward", None)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager)
        extra = {key: val for key, val in kwargs.items()
                 if key not in (*CACHE_KWS, "attention_mask", "position_embeddings", "use_cache",
                                "output_attentions", "position_ids")}
        if interface is None:
            from ..attention.slim import reference_attention
            out = reference_attention(q, k, v, additive_mask(mask, t, t, q.device), self.scaling).transpose(1, 2)
        else:
            out, _ = interface(self, q, k, v, mask, dropout=0.0, scaling=self.scaling,
                               **adapter.attention_kwargs(self), **extra)
        out = adapter.out_proj(self, out.reshape(b, t, e), adapter.weights(self).b_o)
        return out, None
    rows = layer.read()  # (B, n, c): n = max_length on the static path (caches/capture.py)
    n = rows.shape[1]
    cos_all = sin_all = None
    if w.rope:
        cos_all, sin_all = rope.for_positions(layer.positions(), n, q.dtype, q.device, layer.rope_table_rows())
    lengths = layer.lengths()
    out = slim_attention(q, rows, w, decode_mask(mask, t, n, lengths, q.device), self.scaling, cos_all, sin_all,
                         lengths=lengths)
    out = out.transpose(1, 2).reshape(b, t, e)
    bias = w.out_bias.to(out.dtype) if w.out_bias is not None else None
    return adapter.out_proj(self, out, bias), None


def prefill_mask(mask, t: int):
    """The mask of a prefill over its own ``t`` tokens: HF's mask for a static layer covers ``max_length`` slots,
    of which the prefill's tokens are the first ``t``."""
    return mask[..., :t] if mask is not None and mask.shape[-1] > t else mask


def decode_mask(mask, t: int, n: int, lengths: torch.Tensor | None, device) -> torch.Tensor | None:
    """:func:`additive_mask` of HF's mask; on the static path (``lengths``: rows written per sequence, this call's
    included) without one, the causal mask over the whole buffer."""
    if mask is not None or lengths is None:
        return additive_mask(mask, t, n, device)
    return static_causal_mask(lengths, t, n)


def patch(model, adapter, weights: dict[int, SlimLayerWeights]) -> None:
    """Patch the attention modules whose layer index is in ``weights`` (others keep their forward)."""
    rotary = adapter.rotary(model)
    rope = RopeTable(rotary) if rotary is not None else None
    for i, attn in enumerate(adapter.attention_modules(model)):
        if i not in weights:
            continue
        setattr(attn, _ORIG, True)
        attn.forward = BoundForward(slim_forward, attn, adapter, weights[i], rope)


def unpatch(model, adapter) -> None:
    """Undo :func:`patch` (no-op on modules that were not patched)."""
    for attn in adapter.attention_modules(model):
        if hasattr(attn, _ORIG):
            del attn.forward  # the instance attribute; the class method shows through again
            delattr(attn, _ORIG)
