"""DeepSeek-V2/V3 (Hugging Face ``deepseek_v2`` / ``deepseek_v3``): patch each MLA attention module's ``forward``.

The patched forward computes the queries, the latent ``c_kv`` and the rotated ``k_pe`` exactly as HF does (same
modules, HF's own RoPE function: V2 multiplies complex interleaved pairs, V3 uses rotate_half or its interleaved
variant), hands ``(c_kv, k_pe)`` to the cache with HF's ``update`` protocol, and then attends with one of the four
paths of :mod:`kvslim.attention.mla` (a one-token decode step of the absorbed/elided paths goes through the MLA
decode op where the backend is Triton: ``mla.kernel_decodes``). Nothing is patched at import time; :func:`unpatch`
restores the class forward.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from ..attention import mla
from ..caches.cache import KVSlimCache
from ..ops.masks import static_causal_mask
from .bound import BoundForward
from .compat import CACHE_KW

MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
_STATE = "_kvslim_mla"
_REQUIRED = ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj", "scaling", "layer_idx")


@dataclass
class MLAPatch:
    """Per-module settings of the patched forward."""

    impl: str
    prefill_threshold: int | None
    absorb_dtype: torch.dtype
    weights: mla.MLAWeights | None = None
    key: tuple | None = None


def attention_modules(model) -> list[torch.nn.Module]:
    """The MLA attention modules of ``model`` in layer order; ``ValueError`` if it has none or misses pieces."""
    mods = [m for m in model.modules() if hasattr(m, "kv_b_proj") and hasattr(m, "kv_a_proj_with_mqa")]
    if not mods:
        raise ValueError(f"model {type(model).__name__} has no MLA attention modules (kv_a_proj_with_mqa/kv_b_proj)")
    for m in mods:
        missing = [a for a in _REQUIRED if not hasattr(m, a)]
        if missing:
            raise ValueError(f"attention module {type(m).__name__} lacks {', '.join(missing)}: not a DeepSeek MLA")
    n = getattr(model.config, "num_hidden_layers", len(mods))
    if len(mods) != n or sorted(m.layer_idx for m in mods) != list(range(n)):
        raise ValueError(f"found {len(mods)} MLA attention modules for num_hidden_layers={n}")
    return sorted(mods, key=lambda m: m.layer_idx)


def patch(model, impl: str, prefill_threshold: int | None, absorb_dtype: torch.dtype = torch.float32) -> None:
    """Replace every MLA module's ``forward`` (per instance) by the kvslim one."""
    for m in attention_modules(model):
        setattr(m, _STATE, MLAPatch(impl, prefill_threshold, absorb_dtype))
        m.forward = BoundForward(mla_forward, m)


def unpatch(model) -> None:
    """Undo :func:`patch` (no-op on modules never patched)."""
    for m in model.modules():
        if hasattr(m, _STATE):
            delattr(m, _STATE)
            if "forward" in vars(m):
                del m.forward


def weights(module) -> mla.MLAWeights:
    """The layer's absorbed weights, computed from ``kv_b_proj`` once (again if that weight changes)."""
    p: MLAPatch = getattr(module, _STATE)
    w = module.kv_b_proj.weight
    if torch.compiler.is_compiling():  # no data_ptr/_version in a graph: split in the graph, fresh every step
        return mla.absorb(w, module.num_heads, module.qk_nope_head_dim, module.v_head_dim, module.scaling,
                          p.absorb_dtype)
    key = (w.data_ptr(), w.dtype, w.device, w._version)
    if p.key != key:
        p.weights = mla.absorb(w, module.num_heads, module.qk_nope_head_dim, module.v_head_dim, module.scaling,
                               p.absorb_dtype)
        p.key = key
    return p.weights


def project(module, hidden_states: torch.Tensor, position_embeddings):
    """HF's own projections and RoPE: ``q_nope (B,H,S,dk)``, ``q_pe (B,H,S,dr)``, ``c_kv (B,1,S,dc)``,
    ``k_pe (B,1,S,dr)``."""
    b, s = hidden_states.shape[:-1]
    if module.q_lora_rank is None:
        q = module.q_proj(hidden_states)
    else:
        q = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden_states)))
    q = q.view(b, s, -1, module.qk_head_dim).transpose(1, 2)  # (B, H, S, dk+dr)
    q_nope, q_pe = q.split([module.qk_nope_head_dim, module.qk_rope_head_dim], dim=-1)
    c_kv, k_pe = module.kv_a_proj_with_mqa(hidden_states).split([module.kv_lora_rank, module.qk_rope_head_dim], dim=-1)
    c_kv = module.kv_a_layernorm(c_kv).view(b, 1, s, module.kv_lora_rank)
    k_pe = k_pe.view(b, 1, s, module.qk_rope_head_dim)
    hf = sys.modules[type(module).__module__]
    if isinstance(position_embeddings, tuple):  # V3: (cos, sin)
        cos, sin = position_embeddings
        rope = hf.apply_rotary_pos_emb_interleave if module.config.rope_interleave else hf.apply_rotary_pos_emb
        q_pe, k_pe = rope(q_pe, k_pe, cos, sin)
    else:  # V2: complex freqs_cis
        q_pe, k_pe = hf.apply_rotary_emb(q_pe, k_pe, position_embeddings.to(q_pe.device))
    return q_nope, q_pe, c_kv, k_pe


def _static(cache, layer_idx: int, mask: torch.Tensor | None, s: int, t: int):
    """``(lengths, mask)`` of a layer on the static path of ``caches/capture.py`` (its reads are the whole buffer of
    ``t`` slots): the device length, and HF's mask or, where HF skipped it (a prefill), the causal mask over the
    buffer (the latent paths' own causal rule puts the queries at its end). Otherwise ``(None, mask)``."""
    layer = cache.layers[layer_idx] if cache is not None else None
    lengths = layer.static_lengths() if hasattr(layer, "static_lengths") else None
    if lengths is not None and mask is None:
        mask = static_causal_mask(lengths, s, t)
    return lengths, mask


def mla_forward(module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_embeddings=None, **kwargs):
    """Drop-in for ``DeepseekV2Attention.forward`` / ``DeepseekV3Attention.forward``; returns ``(out, None)``.
    The cache comes as ``kwargs[CACHE_KW]`` (``past_key_values`` or, from transformers 5.24, ``cache``)."""
    past_key_values = kwargs.pop(CACHE_KW, None)
    p: MLAPatch = getattr(module, _STATE)
    if past_key_values is not None and not isinstance(past_key_values, KVSlimCache):
        # a Hugging Face cache the user asked for (cache_implementation=..., past_key_values=DynamicCache()):
        # it holds per-head K/V as HF's attention writes them, so HF's own forward serves it
        return type(module).forward(module, hidden_states, attention_mask=attention_mask,
                                    position_embeddings=position_embeddings, **{CACHE_KW: past_key_values},
                                    **kwargs)
    b, s = hidden_states.shape[:-1]
    q_nope, q_pe, c_kv, k_pe = project(module, hidden_states, position_embeddings)
    w = weights(module)
    if p.impl == "decompressed":
        k, v = mla.expand(c_kv[:, 0], k_pe[:, 0], w)  # (B, H, S, dk+dr), (B, H, S, dv)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, module.layer_idx)
        lengths, attention_mask = _static(past_key_values, module.layer_idx, attention_mask, s, k.shape[2])
        out = mla.attend_dense(torch.cat((q_nope, q_pe), dim=-1), k, v, w.scale, attention_mask)
    else:
        if past_key_values is not None:
            c_kv, k_pe = past_key_values.update(c_kv, k_pe, module.layer_idx)
        c_kv, k_pe = c_kv[:, 0], k_pe[:, 0]  # (B, T, dc), (B, T, dr): views of the cache
        lengths, attention_mask = _static(past_key_values, module.layer_idx, attention_mask, s, c_kv.shape[1])
        impl = p.impl
        if p.prefill_threshold is not None and s >= p.prefill_threshold:
            impl = "compressed"  # long prefill: expanding once is cheaper than scoring H·S queries on dc+dr
        if impl in ("absorbed", "elided") and mla.kernel_decodes(q_nope, c_kv, attention_mask):
            out = mla.attend_decode(q_nope, q_pe, c_kv, k_pe, w, attention_mask, lengths)  # the Triton decode op
        else:
            out = mla.LATENT_PATHS[impl](q_nope, q_pe, c_kv, k_pe, w, attention_mask)
    out = out.transpose(1, 2).reshape(b, s, -1)  # (B, S, H·dv)
    return module.o_proj(out), None
