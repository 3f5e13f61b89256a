"""Llama-family attention (separate q/k/v/o ``nn.Linear``, RoPE) for slim attention.

Also serves model types with Llama's attention layout (``LlamaAttention``-shaped modules: Mistral, Qwen2
with MHA). The adapter reads weights in row convention (``y = x W + b``, W of shape (d_in, d_out)) and
computes the projections exactly as the HF forward does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ProjectionWeights:
    """One attention layer's projections, row convention, as stored (model dtype, not copied).

    ``w_q``/``w_k``/``w_v``: (d, e); ``w_o``: (e, d); biases (e,) / (d,) or ``None``.
    """

    w_q: torch.Tensor
    w_k: torch.Tensor
    w_v: torch.Tensor
    w_o: torch.Tensor
    b_q: torch.Tensor | None = None
    b_k: torch.Tensor | None = None
    b_v: torch.Tensor | None = None
    b_o: torch.Tensor | None = None


class LlamaAdapter:
    """``model.model.layers[i].self_attn`` with ``q_proj``/``k_proj``/``v_proj``/``o_proj`` and RoPE."""

    model_type = "llama"
    has_rope = True
    #: HF rope types whose cos/sin depend only on the position (the table of cached positions is static)
    static_rope_types = ("default", "linear", "llama3", "yarn")

    def attention_modules(self, model) -> list[torch.nn.Module]:
        return [layer.self_attn for layer in model.model.layers]

    def rotary(self, model) -> torch.nn.Module | None:
        return model.model.rotary_emb

    def check(self, model) -> str | None:
        """Why slim attention cannot run on this model's attention code, or ``None``."""
        rope = getattr(model.config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
        if rope_type not in self.static_rope_types:
            return (f"rope_type {rope_type!r} changes the rotation of past positions with the sequence length; "
                    f"slim attention supports {', '.join(self.static_rope_types)}")
        return None

    def weights(self, attn: torch.nn.Module) -> ProjectionWeights:
        def lin(m):
            return m.weight.T, m.bias

        (wq, bq), (wk, bk), (wv, bv), (wo, bo) = (lin(attn.q_proj), lin(attn.k_proj), lin(attn.v_proj),
                                                  lin(attn.o_proj))
        return ProjectionWeights(wq, wk, wv, wo, bq, bk, bv, bo)

    def qkv(self, attn: torch.nn.Module, x: torch.Tensor, parts: str = "qkv"
            ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """(B, T, d) -> q, k, v each (B, T, e), before RoPE; ``None`` for a projection not named in ``parts``
        (a slim decode step needs only q and the stored one: each skipped projection is a weight matrix not read)."""
        return tuple(proj(x) if name in parts else None
                     for name, proj in zip("qkv", (attn.q_proj, attn.k_proj, attn.v_proj)))

    def out_proj(self, attn: torch.nn.Module, a: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """o-projection of (B, T, e) with ``bias`` replacing the module's own."""
        return F.linear(a, attn.o_proj.weight, bias)

    def attention_kwargs(self, attn: torch.nn.Module) -> dict:
        return {}
