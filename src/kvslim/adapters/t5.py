"""T5 decoder attention for slim attention: bias-free ``q/k/v/o`` ``nn.Linear`` of width e = h·d_kv (e > d on
T5-3B/11B: r = e/d), no score scaling, relative position *bias* added to the scores (no RoPE: the X-cache
applies, the paper's option for r > 1), the bias computed by layer 0 and passed on to later layers.
"""

from __future__ import annotations

import torch

from .llama import ProjectionWeights


class T5Adapter:
    """``model.decoder.block[i].layer[0].SelfAttention`` / ``.layer[1].EncDecAttention``."""

    model_type = "t5"
    has_rope = False
    prescaled_query = False
    mask_kwarg = "mask"
    returns_position_bias = True

    def decoder_layers(self, model) -> list[torch.nn.Module]:
        return list(model.decoder.block)

    def self_attention(self, layer) -> torch.nn.Module:
        return layer.layer[0].SelfAttention

    def cross_attention(self, layer) -> torch.nn.Module:
        return layer.layer[1].EncDecAttention

    def check(self, model) -> str | None:
        if not hasattr(model, "decoder"):
            return "only T5ForConditionalGeneration / T5Model (with a decoder) are supported"
        return None

    def max_decoder_positions(self, config) -> int | None:
        return None

    def weights(self, attn) -> ProjectionWeights:
        return ProjectionWeights(attn.q.weight.T, attn.k.weight.T, attn.v.weight.T, attn.o.weight.T)

    def linears(self, attn) -> dict[str, torch.nn.Linear]:
        return {"q": attn.q, "k": attn.k, "v": attn.v, "o": attn.o}

    def num_heads(self, attn) -> int:
        return attn.n_heads

    def query(self, attn, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return attn.q(x).view(b, t, -1, attn.key_value_proj_dim).transpose(1, 2)

    def score_scaling(self, attn) -> float:
        return attn.scaling

    def encoder_inputs(self, model, ids: torch.Tensor) -> dict:
        return {"input_ids": ids[None].to(next(model.parameters()).device)}

    def encoder_length(self, config, input_length: int | None) -> int | None:
        return input_length
