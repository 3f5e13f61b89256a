"""Whisper decoder attention for slim attention (encoder-decoder): separate ``q/k/v/out_proj`` ``nn.Linear``,
``k_proj`` without bias, the query scaled *before* the dot product (the interface runs with scaling 1.0),
learned absolute positions (no RoPE: X-, K- and V-caches all apply). Also the base of :mod:`.bart`.
"""

from __future__ import annotations

import torch

from .llama import ProjectionWeights


class WhisperAdapter:
    """``model.model.decoder.layers[i].self_attn`` / ``.encoder_attn``; the encoder is ``model.model.encoder``."""

    model_type = "whisper"
    has_rope = False
    #: the HF forward multiplies q by ``attn.scaling`` before the dot product (Whisper) or the interface
    #: applies ``attn.scaling`` to the scores (BART)
    prescaled_query = True
    mask_kwarg = "attention_mask"
    returns_position_bias = False

    def decoder_layers(self, model) -> list[torch.nn.Module]:
        return list(model.model.decoder.layers)

    def self_attention(self, layer) -> torch.nn.Module:
        return layer.self_attn

    def cross_attention(self, layer) -> torch.nn.Module:
        return layer.encoder_attn

    def check(self, model) -> str | None:
        return None

    def max_decoder_positions(self, config) -> int | None:
        return getattr(config, "max_target_positions", None)

    def weights(self, attn) -> ProjectionWeights:
        def t(lin):
            return lin.weight.T

        def b(lin):
            return lin.bias

        return ProjectionWeights(t(attn.q_proj), t(attn.k_proj), t(attn.v_proj), t(attn.out_proj),
                                 b(attn.q_proj), b(attn.k_proj), b(attn.v_proj), b(attn.out_proj))

    def linears(self, attn) -> dict[str, torch.nn.Linear]:
        return {"q": attn.q_proj, "k": attn.k_proj, "v": attn.v_proj, "o": attn.out_proj}

    def num_heads(self, attn) -> int:
        return attn.num_heads

    def query(self, attn, x: torch.Tensor) -> torch.Tensor:
        """(B, T, d) -> (B, h, T, dk), exactly as the HF forward forms it."""
        q = attn.q_proj(x)
        if self.prescaled_query:
            q = q * attn.scaling
        b, t, _ = x.shape
        return q.view(b, t, -1, attn.head_dim).transpose(1, 2)

    def score_scaling(self, attn) -> float:
        return 1.0 if self.prescaled_query else attn.scaling

    def encoder_inputs(self, model, ids: torch.Tensor) -> dict:
        """Deterministic encoder inputs for calibration: a seeded log-mel-like input of the full length."""
        c = model.config
        g = torch.Generator().manual_seed(0)
        feats = torch.randn(1, c.num_mel_bins, 2 * c.max_source_positions, generator=g)
        p = next(model.parameters())
        return {"input_features": feats.to(device=p.device, dtype=p.dtype)}

    def encoder_length(self, config, input_length: int | None) -> int | None:
        return config.max_source_positions
