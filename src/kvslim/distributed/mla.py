"""Sequence-parallel MLA (DeepSeek-V2/V3): each rank keeps its slice of the latent ``c_kv`` + ``k_pe``.

Decode on each rank scores its slots with the absorbed query (``q̃ = q_nope W_UK``, RoPE term ``q_pe k_peᵀ``
added), forms ``acc = Σ_j exp(s_j − m)·c_kv,j`` in the latent space (dc wide), the ranks merge by log-sum-exp and
every rank applies ``W_UV`` once to the merged latent. The prompt runs the method's own path on the whole
sequence. Reuses the method's projections and absorbed weights (:mod:`kvslim.adapters.deepseek`).
"""

from __future__ import annotations

import torch

from ..adapters import deepseek
from ..adapters.compat import CACHE_KW
from ..attention import mla
from .attention import local_mask
from .layers import ShardedLatentLayer
from .merge import merge, partial_from_scores

_PREVIOUS = "_kvslim_seqpar_previous_forward"


def seqpar_mla_forward(module, rt, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       position_embeddings=None, **kwargs):
    """Drop-in for the MLA module's forward on a sequence-parallel rank; returns ``(out, None)`` (the cache comes
    as ``kwargs[CACHE_KW]``, adapters/compat.py)."""
    past_key_values = kwargs.pop(CACHE_KW, None)
    layers = getattr(past_key_values, "layers", None)
    layer = layers[module.layer_idx] if layers is not None and module.layer_idx < len(layers) else None
    if not isinstance(layer, ShardedLatentLayer):
        return getattr(module, _PREVIOUS)(hidden_states, attention_mask=attention_mask,
                                          position_embeddings=position_embeddings,
                                          **{CACHE_KW: past_key_values}, **kwargs)
    past_key_values.current = layer
    p = getattr(module, deepseek._STATE)
    b, s = hidden_states.shape[:-1]
    q_nope, q_pe, c_kv, k_pe = deepseek.project(module, hidden_states, position_embeddings)
    w = deepseek.weights(module)
    if layer.cumulative_length == 0:  # prompt: the method's own path over the whole prompt
        c_all, pe_all = layer.update(c_kv, k_pe)  # (B, 1, S, ·) as stored
        impl = p.impl
        if p.prefill_threshold is not None and s >= p.prefill_threshold:
            impl = "compressed"
        out = mla.LATENT_PATHS[impl](q_nope, q_pe, c_all[:, 0], pe_all[:, 0], w, attention_mask)
    else:
        c_loc, pe_loc = layer.update(c_kv, k_pe)  # (B, 1, n, ·): this rank's slots
        c_loc, pe_loc = c_loc[:, 0], pe_loc[:, 0]
        n = c_loc.shape[1]
        q_lat = mla.absorb_query(q_nope, w).float()  # (B, H, S, dc), softmax scale included
        scores = torch.einsum("bhsr,btr->bhst", q_pe.float() * w.scale, pe_loc.float())  # RoPE term
        scores += torch.einsum("bhsc,btc->bhst", q_lat, c_loc.float())  # + latent term, (B, H, S, n)
        mask = local_mask(attention_mask, layer.view_cols, layer.view_live, layer.cumulative_length, s)
        part = partial_from_scores(scores, c_loc if n else c_loc.new_empty(b, 0, c_kv.shape[-1]), mask)
        what = f"MLA merge (layer {module.layer_idx}, position {layer.cumulative_length - 1})"
        if rt.project == "before":  # W_UV on this rank's partial (linear: same result, dv-wide instead of dc-wide)
            part.acc = torch.matmul(part.acc.to(w.w_uv_t.dtype), w.w_uv_t).float()
            out = merge(part, rt.comm, rt.merge, what).to(c_kv.dtype)  # (B, H, S, dv)
        else:
            lat = merge(part, rt.comm, rt.merge, what)  # (B, H, S, dc)
            out = torch.matmul(lat.to(w.w_uv_t.dtype), w.w_uv_t).to(c_kv.dtype)  # W_UV after the merge: (B, H, S, dv)
    out = out.transpose(1, 2).reshape(b, s, -1)  # (B, S, H·dv)
    return module.o_proj(out), None


def patch(model, rt) -> None:
    for m in deepseek.attention_modules(model):
        setattr(m, _PREVIOUS, m.forward)
        m.forward = _bind(m, rt)


def unpatch(model) -> None:
    for m in model.modules():
        if hasattr(m, _PREVIOUS):
            m.forward = getattr(m, _PREVIOUS)
            delattr(m, _PREVIOUS)


def _bind(module, rt):
    def forward(*args, **kwargs):
        return seqpar_mla_forward(module, rt, *args, **kwargs)
    return forward
