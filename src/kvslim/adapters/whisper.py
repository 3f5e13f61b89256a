"""Whisper decoder attention for slim attention (encoder-decoder): separate ``q/k/v/out_proj`` ``nn.Linear``,
``k_proj`` without bias, the query scaled *before* the dot product (the interface runs with scaling 1.0),
learned absolute positions (no RoPE: X-, K- and V-caches all apply). Also the base of :mod:`.bart`.

Whisper's ``generate`` runs ``GenerationMixin.generate`` once per decoder pass (30 s segment, temperature
fallback); each pass gets a fresh kvslim cache from :mod:`.generate`. With ``return_dict_in_generate`` its
post-processing splits the outputs per sequence and stacks them back, reading the cache as HF K/V tensors
(``self_attention_cache.layers[i].keys[b]``). :func:`install` routes that one step through the cache's own
sequence operations instead (:meth:`~kvslim.caches.encdec.EncDecSlimCache.take` /
:meth:`~kvslim.caches.encdec.EncDecSlimCache.concat`): the returned ``past_key_values`` is a kvslim cache of the
same slim rows and encoder output, no K/V history is ever materialized, and it continues generation.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..caches.encdec import EncDecSlimCache
from .compat import CACHE_KW
from .llama import ProjectionWeights

_ORIGINAL: dict[str, Callable[..., Any]] = {}
_KEY = CACHE_KW  # the cache field of HF's outputs (adapters/compat.py)


def install() -> None:
    """Put :func:`postprocess_outputs` / :func:`stack_split_outputs` on HF's ``WhisperGenerationMixin``
    (idempotent; both step aside for any cache that is not an :class:`EncDecSlimCache`)."""
    from transformers.models.whisper.generation_whisper import WhisperGenerationMixin as Mixin

    if Mixin.__dict__["_postprocess_outputs"] is postprocess_outputs:
        return
    _ORIGINAL["post"] = Mixin.__dict__["_postprocess_outputs"]
    _ORIGINAL["stack"] = Mixin.__dict__["_stack_split_outputs"]
    Mixin._postprocess_outputs = postprocess_outputs
    Mixin._stack_split_outputs = stack_split_outputs


def postprocess_outputs(self, seek_outputs, decoder_input_ids, return_token_timestamps, generation_config,
                        is_shortform, seek, batch_idx_map):
    """HF's ``_postprocess_outputs``; a kvslim cache is split per sequence by :meth:`EncDecSlimCache.take`
    (short-form; long-form keeps no cache, as HF)."""
    args = (decoder_input_ids, return_token_timestamps, generation_config, is_shortform, seek, batch_idx_map)
    cache = None if isinstance(seek_outputs, torch.Tensor) else seek_outputs.get(_KEY)
    if not isinstance(cache, EncDecSlimCache):
        return _ORIGINAL["post"](self, seek_outputs, *args)
    rest = type(seek_outputs)(**{k: v for k, v in seek_outputs.items() if k != _KEY})
    tokens, per_sequence = _ORIGINAL["post"](self, rest, *args)
    for i, out in enumerate(per_sequence):  # row i of the cache, as HF's split reads it
        out[_KEY] = cache.take([i]) if is_shortform else None
    return tokens, per_sequence


def stack_split_outputs(self, seek_outputs, model_output_type, device, kwargs):
    """HF's ``_stack_split_outputs``; per-sequence kvslim caches are joined by :meth:`EncDecSlimCache.concat`."""
    caches = [out.get(_KEY) for out in seek_outputs]
    if not any(isinstance(c, EncDecSlimCache) for c in caches):
        return _ORIGINAL["stack"](self, seek_outputs, model_output_type, device, kwargs)
    rest = [{k: v for k, v in out.items() if k != _KEY} for out in seek_outputs]
    outputs = _ORIGINAL["stack"](self, rest, model_output_type, device, kwargs)
    try:
        outputs[_KEY] = EncDecSlimCache.concat(caches)
    except ValueError as e:  # HF's own stacking fails here too (torch.stack of K/V of different lengths)
        warnings.warn(f"past_key_values is None: the sequences come from decoder passes whose caches cannot be "
                      f"joined ({e})", stacklevel=3)
        outputs[_KEY] = None
    return outputs


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
        return q.view(b, t, self.num_heads(attn), attn.head_dim).transpose(1, 2)  # t may be 0

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
