"""Phi-3 attention for slim attention: one fused ``qkv_proj`` (no biases), RoPE (partial rotary allowed)."""

from __future__ import annotations

import torch

from .llama import LlamaAdapter, ProjectionWeights


class Phi3Adapter(LlamaAdapter):
    """``model.model.layers[i].self_attn`` with a fused ``qkv_proj`` (rows: Q, then K, then V) and ``o_proj``."""

    model_type = "phi3"

    def _split(self, attn) -> tuple[int, int]:
        e_q = attn.config.num_attention_heads * attn.head_dim
        e_kv = attn.num_key_value_heads * attn.head_dim
        return e_q, e_kv

    def weights(self, attn: torch.nn.Module) -> ProjectionWeights:
        e_q, e_kv = self._split(attn)
        w = attn.qkv_proj.weight.T  # (d, e_q + 2 e_kv)
        b = attn.qkv_proj.bias
        parts = (slice(0, e_q), slice(e_q, e_q + e_kv), slice(e_q + e_kv, e_q + 2 * e_kv))
        bq, bk, bv = (None, None, None) if b is None else (b[p] for p in parts)
        return ProjectionWeights(w[:, parts[0]], w[:, parts[1]], w[:, parts[2]], attn.o_proj.weight.T,
                                 bq, bk, bv, attn.o_proj.bias)

    def qkv(self, attn, x, parts: str = "qkv"):  # one fused projection: all three come together
        e_q, e_kv = self._split(attn)
        qkv = attn.qkv_proj(x)
        return qkv[..., :e_q], qkv[..., e_q:e_q + e_kv], qkv[..., e_q + e_kv:]

    def attention_kwargs(self, attn) -> dict:
        return {"sliding_window": getattr(attn.config, "sliding_window", None)}
