"""Per-instance patching of encoder-decoder attention for slim attention (the only HF-aware glue).

Decoder self-attention: prefill runs the model's own forward (no cache) and stores the slim row (X, K or V);
decode runs :func:`~kvslim.attention.slim.slim_attention` over the stored rows, with T5's relative position
bias added to the scores. Cross-attention: the first call keeps the encoder output E once in the shared
:class:`~kvslim.caches.encdec.EncoderOutputLayer`; every layer attends over it with
:func:`~kvslim.attention.encdec.shared_cross_attention`. Any other cache (none, HF's own) falls back to the
original forward, so outputs stay correct in every case.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..attention.encdec import CrossWeights, additive_bias, shared_cross_attention, weights_key
from ..attention.slim import SlimLayerWeights, slim_attention
from ..caches.encdec import EncDecSlimCache, SharedEncoderCache
from ..caches.slim import SlimLayer
from .bound import BoundForward
from .compat import CACHE_KW
from .slim_patch import decode_mask, prefill_mask

_ORIG = "_kvslim_original_forward"


def _pack(adapter, out: torch.Tensor, position_bias):
    return (out, position_bias, None) if adapter.returns_position_bias else (out, None)


def _rows(adapter, attn, w: SlimLayerWeights, x: torch.Tensor) -> torch.Tensor:
    """The row a slim layer stores for inputs x (B, T, d): (B, T, c)."""
    lin = adapter.linears(attn)
    if w.technique == "x":
        return x
    if w.technique == "v":
        return lin["v"](x)
    rows = lin["k"](x)
    if w.proj is not None:
        rows = torch.cat((rows, (x.float() @ w.proj).to(x.dtype)), dim=-1)
    return rows


def self_forward(self, adapter, w: SlimLayerWeights, hidden_states: torch.Tensor, *args, **kwargs):
    """Replacement ``forward`` of a decoder self-attention module (bound per instance)."""
    # the class forward (the instance one is the patch), called unbound: torch 2.11's dynamo cannot trace
    # ``function.__get__`` (every compiled slim step failed there)
    original = functools.partial(type(self).forward, self)
    past = kwargs.get(CACHE_KW)
    layer = past.self_attention_cache.layers[self.layer_idx] if isinstance(past, EncDecSlimCache) else None
    if args or not isinstance(layer, SlimLayer) or kwargs.get("key_value_states") is not None:
        return original(hidden_states, *args, **kwargs)
    first = layer.is_empty()
    n_past = 0 if first else layer.get_seq_length()  # a 0-dim device tensor in a graph step (caches/capture.py)
    rows = _rows(adapter, self, w, hidden_states)
    if first:  # prefill: the model's own attention, uncached; then keep the slim rows
        mask_kw = adapter.mask_kwarg
        out = original(hidden_states, **{**kwargs, CACHE_KW: None,
                                         mask_kw: prefill_mask(kwargs.get(mask_kw), hidden_states.shape[1])})
        layer.write(rows)
        return out
    b, t, _ = hidden_states.shape
    held = layer.k_store.data.shape[0]
    if b != held:
        raise ValueError(f"past_key_values holds {held} sequences but this decoder pass has {b} ({t} new tokens): "
                         "a cache continues only the sequences it holds. Whisper's generate hands a past_key_values "
                         "you pass to every decoder pass (segments, fallback), which HF's own cache cannot serve "
                         "either: pass the encoder attention_mask so a short-form input runs one decoder pass, or "
                         "continue step by step with model(...)")
    q = adapter.query(self, hidden_states)  # (B, h, T, dk)
    layer.write(rows)
    cached = layer.read()  # (B, n, c): n = max_length on the static path (caches/capture.py)
    n = cached.shape[1]
    lengths = layer.lengths()
    position_bias = None
    if adapter.returns_position_bias:
        position_bias = kwargs.get("position_bias")
        if position_bias is None:
            position_bias = (self.compute_bias(t, n, device=q.device, past_seen_tokens=n_past)
                             if self.has_relative_attention_bias
                             else torch.zeros(1, q.shape[1], t, n, device=q.device, dtype=q.dtype))
    bias = decode_mask(kwargs.get(adapter.mask_kwarg), t, n, lengths, q.device)
    if position_bias is not None:
        bias = additive_bias(bias, position_bias, n)
    out = slim_attention(q, cached, w, bias, adapter.score_scaling(self), lengths=lengths)  # (B, h, T, dk)
    out = out.transpose(1, 2).reshape(b, t, -1)
    o = adapter.linears(self)["o"]
    out = F.linear(out, o.weight, None if w.out_bias is None else w.out_bias.to(out.dtype))
    return _pack(adapter, out, position_bias)


def current_cross_weights(attn, adapter, w: CrossWeights) -> CrossWeights:
    """``w``, or the maps rebuilt from the module's weights as they are now when those moved since ``w`` was made
    (``model.to(dtype/device)`` after ``apply``, an in-place load): the rebuilt maps are kept for the next call.
    A compiled or captured step cannot read a storage address or version: it uses the maps of the last eager call
    (the prefill of every generation is eager, so a weight change between generations is seen there)."""
    if torch.compiler.is_compiling():
        return w
    lin = adapter.linears(attn)
    k, v = lin["k"].weight, lin["v"].weight
    if w.source == weights_key(k, v, lin["v"].bias):
        return w
    fresh = CrossWeights.from_linear(k, v, lin["v"].bias, adapter.num_heads(attn), w.scaling,
                                     torch.promote_types(k.dtype, torch.float32))
    attn.forward.extra = (adapter, fresh)
    return fresh


def cross_forward(self, adapter, w: CrossWeights, hidden_states: torch.Tensor, *args, **kwargs):
    """Replacement ``forward`` of a decoder cross-attention module (bound per instance)."""
    # the class forward (the instance one is the patch), called unbound: torch 2.11's dynamo cannot trace
    # ``function.__get__`` (every compiled slim step failed there)
    original = functools.partial(type(self).forward, self)
    past = kwargs.get(CACHE_KW)
    enc_in = kwargs.get("key_value_states")
    if (args or enc_in is None or not isinstance(past, EncDecSlimCache)
            or not isinstance(past.cross_attention_cache, SharedEncoderCache)):
        return original(hidden_states, *args, **kwargs)
    w = current_cross_weights(self, adapter, w)
    store = past.encoder
    if store.enc is None or store.enc.shape[0] != enc_in.shape[0]:
        store.write(enc_in)  # once per generation, shared by every layer
    enc = store.read()  # (B, n, d)
    b, t, _ = hidden_states.shape
    n = enc.shape[1]
    q = adapter.query(self, hidden_states)  # (B, h, T, dk)
    position_bias = None
    if adapter.returns_position_bias:
        position_bias = kwargs.get("position_bias")
        if position_bias is None:
            position_bias = torch.zeros(1, q.shape[1], t, n, device=q.device, dtype=q.dtype)
    bias = additive_bias(kwargs.get(adapter.mask_kwarg), position_bias, n)
    out = shared_cross_attention(q, enc, w, bias)  # (B, h, T, dk)
    out = adapter.linears(self)["o"](out.transpose(1, 2).reshape(b, t, -1))
    return _pack(adapter, out, position_bias)


def _patch_one(attn, fn, adapter, w) -> None:
    setattr(attn, _ORIG, True)
    attn.forward = BoundForward(fn, attn, adapter, w)


def patch(model, adapter, self_weights: dict[int, SlimLayerWeights], cross_weights: dict[int, CrossWeights]
          ) -> None:
    """Patch decoder self-attention of the layers in ``self_weights`` and cross-attention in ``cross_weights``."""
    for i, layer in enumerate(adapter.decoder_layers(model)):
        if i in self_weights:
            _patch_one(adapter.self_attention(layer), self_forward, adapter, self_weights[i])
        if i in cross_weights:
            _patch_one(adapter.cross_attention(layer), cross_forward, adapter, cross_weights[i])


def unpatch(model, adapter) -> None:
    """Undo :func:`patch` (no-op on modules that were not patched)."""
    for layer in adapter.decoder_layers(model):
        for attn in (adapter.self_attention(layer), adapter.cross_attention(layer)):
            if hasattr(attn, _ORIG):
                del attn.forward
                delattr(attn, _ORIG)
