"""A drop-in for HF's ``sdpa`` attention that decodes GQA with packed queries.

With an exact-length kvslim cache, HF needs no attention mask in decode and calls SDPA with
``enable_gqa=True``; torch's CPU kernel runs that ~4× slower than the same attention with the query heads of
each KV group packed as extra query rows (measured: 9.7 ms vs 2.6 ms per layer, SmolLM2 shapes, 8k × 8). HF
itself packs queries when a mask is present (a StaticCache always has one). This registers HF's own SDPA path
under another name, changing one case: a single query token, no mask, GQA → packed queries. Same mathematics;
registered through HF's public ``AttentionInterface`` / ``AttentionMaskInterface`` when a method is applied.

Quantized caches (int8/int4) built for a model running this attention hand it, on decode steps, the codes
instead of dequantized keys and values (``caches/fused.py``): those steps run the fused kernel
(``attention/quant.py`` → ``torch.ops.kvslim.quant_decode``); anything that path does not take attends over the
layer's ordinary dequantized reads.

On CUDA every SDPA call made here runs under the forced backend list of :func:`kvslim.ops.sdpa.sdpa_backends`
(flash, then memory-efficient, then math; never cuDNN): torch's own choice on an H100 took 48.6 ms per kvslim dense
decode step against 9.5–9.8 ms with one backend forced (1B MHA, 8k × 8, bf16; ``docs/gpu.md``). Every storage
method (dense and MHA included) runs this attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from ..attention import quant, sparse, sparse_static
from ..caches.capture_ring import ring_columns, ring_mask
from ..caches.fused import fused_of
from ..caches.sparse import sparse_of
from ..ops.sdpa import CUDA_BACKENDS, sdpa_backends, sdpa_context

__all__ = ["CUDA_BACKENDS", "NAME", "packable_prefix", "packed_gqa_sdpa_forward", "packed_rows_sdpa",
           "restore_attention", "sdpa_backends", "sdpa_context", "use_packed_sdpa"]
NAME = "kvslim_sdpa"


def packed_gqa_sdpa_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """HF's SDPA attention; decode steps of GQA models without a mask run with packed queries.

    Shapes as HF: query (B, H, S, D), key/value (B, Hkv, T, D); returns (B, S, H, D). Key/value markers of a
    quantized cache (``caches/fused.py``) run the fused int8/int4 decode kernel.
    """
    with sdpa_context(query.device):
        return _forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


def _forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs) -> tuple[torch.Tensor, None]:
    columns = ring_columns(key)
    if columns is not None:  # a capturable ring's W slots: HF's mask over absolute positions, at their columns
        attention_mask = ring_mask(attention_mask, columns, query.shape[2])
    picked = sparse_of(key)
    if picked is not None:  # a sparse decode step (caches/sparse.py): the chosen pages only
        if dropout == 0.0 and kwargs.get("position_bias") is None and kwargs.get("s_aux") is None:
            decode = sparse_static.decode_static if picked.static else sparse.decode  # a capturable layer's step
            return decode(picked, query, attention_mask, scaling), None
        if picked.fused is None:  # (a static step's buffers run past its max_length visible slots)
            key, value = picked.keys[:, :, :picked.tokens], picked.values[:, :, :picked.tokens]
        else:
            key, value = picked.fused.materialize()
    fused = fused_of(key)
    if fused is not None:
        out = None
        if dropout == 0.0 and kwargs.get("position_bias") is None and kwargs.get("s_aux") is None:
            out = quant.decode(fused, query, attention_mask, scaling)
        if out is not None:
            return out, None
        key, value = fused.materialize()
    groups = getattr(module, "num_key_value_groups", 1)
    if (groups > 1 and query.shape[2] == 1 and attention_mask is None and dropout == 0.0
            and kwargs.get("position_bias") is None and key.shape[1] * groups == query.shape[1]):
        b, h, _, d = query.shape
        packed = query.reshape(b, h // groups, groups, d)  # head h -> (h // G, h % G), HF's repeat_kv order
        out = F.scaled_dot_product_attention(packed, key, value, scale=scaling)  # (B, Hkv, G, D)
        return out.reshape(b, h, 1, value.shape[-1]).transpose(1, 2).contiguous(), None
    if packable_prefix(module, query, key, attention_mask, dropout, kwargs):
        return packed_rows_sdpa(query, key, value, attention_mask, groups, scaling), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def packable_prefix(module, query, key, mask, dropout: float, kwargs: dict) -> bool:
    """Whether a multi-token call over a cache (a question asked of a prompt cache, a chunk of a chunked prefill) can
    run :func:`packed_rows_sdpa`: CPU, GQA, an explicit mask shared by the heads, nothing HF adds to the scores."""
    groups = getattr(module, "num_key_value_groups", 1)
    return (groups > 1 and query.shape[2] > 1 and query.device.type == "cpu" and isinstance(mask, torch.Tensor)
            and mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == query.shape[2]
            and mask.shape[3] == key.shape[2] and dropout == 0.0 and key.shape[1] * groups == query.shape[1]
            and kwargs.get("position_bias") is None and kwargs.get("s_aux") is None
            and kwargs.get("softcap") is None and not torch.compiler.is_compiling())


def packed_rows_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, groups: int,
                     scaling: float | None) -> torch.Tensor:
    """GQA attention of S > 1 query tokens with each KV group's G query heads packed as G·S query rows.

    HF's ``sdpa_attention_forward`` runs a masked multi-token call by ``repeat_kv``: a copy of the layer's whole key
    and value history per query head (G× the cache, every layer, every call). Here the history is read as stored and
    the mask (B|1, 1, S, T) is repeated G times instead (G·S·T entries). Reference: HF's path (tested against it).

    Shapes: query (B, H, S, D), key/value (B, Hkv, T, D); returns (B, S, H, D) as HF's attention functions.
    """
    b, h, s, d = query.shape
    packed = query.reshape(b, h // groups, groups * s, d)  # (B, Hkv, G·S, D): row g·S + i = head Hkv·G + g, token i
    mb, _, _, t = mask.shape
    rows = mask.unsqueeze(2).expand(mb, 1, groups, s, t).reshape(mb, 1, groups * s, t)  # (B|1, 1, G·S, T)
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=rows, scale=scaling)  # (B, Hkv, G·S, Dv)
    return out.reshape(b, h, s, value.shape[-1]).transpose(1, 2).contiguous()


def use_packed_sdpa(model, quantized: bool = False) -> str | None:
    """Switch an ``sdpa`` model to :func:`packed_gqa_sdpa_forward` (packed GQA decode, fused int8/int4/int2 decode,
    the forced SDPA backends on CUDA: every ``sdpa`` model, MHA and unquantized included, since the device is not
    known until the model runs); returns the previous implementation name to restore, or ``None`` when nothing was
    changed. ``quantized`` is kept for callers; it no longer changes the choice."""
    previous = getattr(model.config, "_attn_implementation", None)
    if previous != "sdpa":
        return None
    AttentionInterface.register(NAME, packed_gqa_sdpa_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return previous


def restore_attention(model, previous: str | None) -> None:
    if previous is not None and getattr(model.config, "_attn_implementation", None) == NAME:
        model.set_attn_implementation(previous)
