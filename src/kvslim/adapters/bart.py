"""BART decoder attention for slim attention: Whisper's layout with biases on all four projections and the
score scale applied by the attention interface (query not pre-scaled). No RoPE (learned positions).
"""

from __future__ import annotations

import torch

from .whisper import WhisperAdapter


class BartAdapter(WhisperAdapter):
    """``model.model.decoder.layers[i].self_attn`` / ``.encoder_attn`` of ``BartForConditionalGeneration``."""

    model_type = "bart"
    prescaled_query = False

    def max_decoder_positions(self, config) -> int | None:
        return getattr(config, "max_position_embeddings", None)

    def encoder_inputs(self, model, ids: torch.Tensor) -> dict:
        return {"input_ids": ids[None].to(next(model.parameters()).device)}

    def encoder_length(self, config, input_length: int | None) -> int | None:
        return input_length
