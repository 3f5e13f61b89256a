"""GPT-2 attention for slim attention: fused ``c_attn`` and ``c_proj`` are ``Conv1D`` (``y = x W + b``,
W already (d_in, d_out)), biases everywhere, learned absolute positions (no RoPE: K-, V- and X-caches apply).
"""

from __future__ import annotations

import torch

from .llama import ProjectionWeights


class GPT2Adapter:
    """``model.transformer.h[i].attn`` (self-attention only; cross-attention models are refused)."""

    model_type = "gpt2"
    has_rope = False

    def attention_modules(self, model) -> list[torch.nn.Module]:
        return [block.attn for block in model.transformer.h]

    def rotary(self, model):
        return None

    def check(self, model) -> str | None:
        if getattr(model.config, "add_cross_attention", False):
            return "GPT-2 with cross-attention is not supported by slim attention"
        return None

    def weights(self, attn: torch.nn.Module) -> ProjectionWeights:
        d = attn.embed_dim
        w, b = attn.c_attn.weight, attn.c_attn.bias  # (d, 3d), (3d,)
        return ProjectionWeights(w[:, :d], w[:, d:2 * d], w[:, 2 * d:], attn.c_proj.weight,
                                 b[:d], b[d:2 * d], b[2 * d:], attn.c_proj.bias)

    def qkv(self, attn, x, parts: str = "qkv"):  # one fused projection: all three come together
        return attn.c_attn(x).split(attn.split_size, dim=2)

    def out_proj(self, attn, a: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = a.reshape(-1, a.shape[-1])
        w = attn.c_proj.weight
        out = flat @ w if bias is None else torch.addmm(bias, flat, w)
        return out.view(*a.shape[:-1], w.shape[1])

    def attention_kwargs(self, attn) -> dict:
        return {}
