"""Sequence-parallel slim attention (decoder-only K-, K+r-, V- and X-caches), option 2 across ranks.

Each rank scores its own rows and forms the unnormalised ``acc = Σ_j exp(s_j − m)·C_j`` (c-wide, c = the cached
row: e, e + r or d), the ranks merge ``(acc, m, l)`` by log-sum-exp, and every rank applies the per-head value map
``W_KV`` (``value_map``) once to the merged row: the cache stays halved and the maths is the method's own. V-caches
merge per-head values (dk wide). The prompt runs locally on the whole sequence, as one process does.

The forward replaces the slim method's patched forward per instance and reuses its precomputed weights
(:class:`~kvslim.attention.slim.SlimLayerWeights`) and adapters; layers the plan keeps as a full K/V cache fall
through to the method's forward and from there to the storage hook (:mod:`kvslim.distributed.attention`).
"""

from __future__ import annotations

import types

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..adapters.compat import CACHE_KW, CACHE_KWS
from ..adapters.slim_patch import project_and_row
from ..attention.slim import SlimLayerWeights
from ..ops.rope import rotate_heads
from .attention import local_mask
from .layers import ShardedRowLayer
from .merge import Partial, merge, partial_from_scores

_PREVIOUS = "_kvslim_seqpar_previous_forward"


def slim_partial(q: torch.Tensor, rows: torch.Tensor, w: SlimLayerWeights, mask: torch.Tensor | None,
                 scaling: float, cos: torch.Tensor | None, sin: torch.Tensor | None) -> Partial:
    """Partial slim attention of queries (B, h, T, dk) over local rows (B, n, c).

    Returns ``acc`` (B, h, T, c) for K-/X-caches (before ``W_KV``) or (B, h, T, dk) for V-caches.
    """
    b, h, t, dk = q.shape
    n, e = rows.shape[1], h * dk
    src = rows.float()
    if w.technique == "k":
        keys = src[..., :e]
        rotated = w.rope and w.rope_storage == "rotated"
        if w.rope and not rotated and n:
            keys = rotate_heads(keys, h, dk, cos.float(), sin.float())  # (B, n, e) rotated at their positions
        scores = torch.einsum("bhtd,bnhd->bhtn", q.float(), keys.reshape(b, n, h, dk)) * scaling
        if rotated and n:  # un-rotate before the value map (which expects raw keys)
            raw = rotate_heads(src, h, dk, cos.float(), sin.float(), inverse=True)
            src = raw if src.shape[-1] == e else torch.cat((raw, src[..., e:]), dim=-1)
    else:  # absorbed query over the shared rows
        qt = torch.matmul(q.float(), w.score_map.float().transpose(-1, -2))  # (B, h, T, c)
        scores = torch.einsum("bhtc,bnc->bhtn", qt, src) * scaling
    if w.technique == "v":
        return partial_from_scores(scores, src.view(b, n, h, dk).transpose(1, 2), mask)  # (B, h, n, dk) values
    return partial_from_scores(scores, src, mask)


def seqpar_slim_forward(self, rt, adapter, w: SlimLayerWeights, rope, hidden_states: torch.Tensor, *args,
                        **kwargs):
    """Replacement ``forward`` of one HF attention module on a sequence-parallel rank."""
    past = kwargs.get(CACHE_KW)
    layers = getattr(past, "layers", None)
    layer = layers[self.layer_idx] if layers is not None and self.layer_idx < len(layers) else None
    if args or not isinstance(layer, ShardedRowLayer) or kwargs.get("encoder_hidden_states") is not None:
        return getattr(self, _PREVIOUS)(hidden_states, *args, **kwargs)
    past.current = layer
    b, t, _ = hidden_states.shape
    e = w.num_heads * w.head_dim
    prompt = layer.cumulative_length == 0
    q, k, v, stored = project_and_row(self, adapter, w, hidden_states, kwargs, prefill=prompt)
    layer.write(stored, kwargs.get("position_ids") if w.rope else None)
    mask = kwargs.get("attention_mask")
    if prompt:  # the model's own attention on the whole prompt, as one process does
        fn = ALL_ATTENTION_FUNCTIONS.get(rt.prompt_impl) or sdpa_attention_forward
        extra = {key: val for key, val in kwargs.items()
                 if key not in (*CACHE_KWS, "attention_mask", "position_embeddings", "use_cache",
                                "output_attentions", "position_ids")}
        out, _ = fn(self, q, k, v, mask, dropout=0.0, scaling=self.scaling, **adapter.attention_kwargs(self),
                    **extra)
        return adapter.out_proj(self, out.reshape(b, t, e), adapter.weights(self).b_o), None
    rows, cols, live, positions = layer.rows()
    cos_l = sin_l = None
    if w.rope and rows.shape[1]:
        cos_l, sin_l = rope.for_positions(positions, rows.shape[1], q.dtype, q.device)
    part = slim_partial(q, rows, w, local_mask(mask, cols, live, layer.cumulative_length, t), self.scaling,
                        cos_l, sin_l)
    mapped = w.technique != "v" and rt.project == "before"
    if mapped:  # W_KV on this rank's partial (linear: same result, a dk-wide collective instead of c-wide)
        part.acc = torch.einsum("bhtc,hcd->bhtd", part.acc, w.value_map.float())
    u = merge(part, rt.comm, rt.merge, f"slim merge (layer {self.layer_idx}, position {layer.cumulative_length - 1})")
    if w.technique != "v" and not mapped:  # W_KV once, after the merge: "bhtc,hcd->bhtd"
        u = torch.einsum("bhtc,hcd->bhtd", u, w.value_map.float())
    out = u.to(q.dtype).transpose(1, 2).reshape(b, t, e)
    bias = w.out_bias.to(out.dtype) if w.out_bias is not None else None
    return adapter.out_proj(self, out, bias), None


def patch(model, rt, adapter, weights: dict[int, SlimLayerWeights], rope) -> None:
    """Wrap each slim-patched attention module's forward (the previous one is kept for other layers)."""
    for i, attn in enumerate(adapter.attention_modules(model)):
        if i not in weights:
            continue
        setattr(attn, _PREVIOUS, attn.forward)
        attn.forward = types.MethodType(_bind(rt, adapter, weights[i], rope), attn)


def unpatch(model, adapter) -> None:
    for attn in adapter.attention_modules(model):
        if hasattr(attn, _PREVIOUS):
            attn.forward = getattr(attn, _PREVIOUS)
            delattr(attn, _PREVIOUS)


def _bind(rt, adapter, w, rope):
    def forward(self, hidden_states, *args, **kwargs):
        return seqpar_slim_forward(self, rt, adapter, w, rope, hidden_states, *args, **kwargs)
    return forward
