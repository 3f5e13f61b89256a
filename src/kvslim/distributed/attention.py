"""The attention hook of the storage methods (dense / window / int8 / int4): an HF attention function.

Registered under :data:`NAME` through HF's public ``AttentionInterface`` (and the SDPA mask under the same
name). HF's attention module calls ``past_key_values.update(k, v)`` then this function: for the prompt the
cache returned the whole K/V and HF's own attention runs (exactly what one process does); afterwards it returned
this rank's slice, and the function computes the partial attention and merges it across ranks.
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .merge import merge, partial_attention

NAME = "kvslim_seqpar"
_RUNTIME = "_kvslim_seqpar"


def local_mask(mask: torch.Tensor | None, cols: torch.Tensor, live: torch.Tensor | None, seen: int,
               q_len: int) -> torch.Tensor | None:
    """The columns of HF's global mask ``(B|1, 1, T, seen)`` (bool True = visible, or additive float) that
    belong to this rank's slots ``cols`` (n,), with dead ring slots (``live`` False) hidden; ``None`` = all
    visible. A ``None`` mask with T > 1 means causal."""
    if mask is not None:
        m = mask[..., cols]  # (B|1, 1, T, n)
    elif q_len > 1:
        qpos = torch.arange(seen - q_len, seen, device=cols.device)
        m = (cols[None, :] <= qpos[:, None])[None, None]  # (1, 1, T, n)
    else:
        m = None
    if live is None:
        return m
    if m is None:
        return live[None, None, None, :]
    if m.dtype == torch.bool:
        return m & live
    return m.masked_fill(~live, float("-inf"))


def seqpar_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0,
                             scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """HF attention-function signature: query (B, H, T, D), key/value (B, Hkv, n, D) -> (B, T, H, D)."""
    rt = getattr(module, _RUNTIME, None)
    cache = None if rt is None else rt.cache
    layer = None if cache is None else cache.current
    if layer is None or layer.local_mode or key is not layer.returned_key:  # the prompt, or not a sharded cache
        fn = ALL_ATTENTION_FUNCTIONS.get(rt.prompt_impl) if rt is not None else None
        fn = fn if fn is not None and fn is not seqpar_attention_forward else sdpa_attention_forward
        return fn(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if dropout:
        raise ValueError("sequence-parallel attention is for inference: dropout must be 0")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    mask = local_mask(attention_mask, layer.view_cols, layer.view_live, layer.cumulative_length, query.shape[2])
    part = partial_attention(query, key, value, mask, scale)
    out = merge(part, rt.comm, rt.merge, f"attention merge (layer {module.layer_idx}, "
                                         f"position {layer.cumulative_length - 1})")
    return out.to(query.dtype).transpose(1, 2).contiguous(), None
