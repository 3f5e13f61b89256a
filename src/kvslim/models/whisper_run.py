"""Transcribe with a (kvslim-prepared or plain) Hugging Face Whisper model, and measure its context memory.

Shared by ``kvslim transcribe``, ``kvslim demo --model whisper-*`` and the real-model tests.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from ..adapters.compat import CACHE_KW
from ..audio import SAMPLE_RATE

WINDOW_SAMPLES = 30 * SAMPLE_RATE


class _WhisperOwnKwargs(logging.Filter):
    """Drops the deprecation notice transformers' Whisper ``generate`` triggers itself: it hands
    ``suppress_tokens`` / ``begin_suppress_tokens`` to ``GenerationMixin.generate`` beside its own
    ``generation_config`` (transformers 5.x), on every call, whatever the caller passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not ("together with generation-related" in msg and "suppress_tokens" in msg)


_GENERATE_LOGGER = "transformers.generation.utils"


def whisper_inputs(processor, audio: np.ndarray, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Log-mel features (and, past 30 s, the attention mask HF's long-form ``generate`` needs)."""
    if len(audio) > WINDOW_SAMPLES:
        inputs = processor(audio, sampling_rate=SAMPLE_RATE, return_tensors="pt", truncation=False,
                           padding="longest", return_attention_mask=True)
        return {"input_features": inputs.input_features.to(dtype), "attention_mask": inputs.attention_mask}
    return {"input_features": processor(audio, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features.to(dtype)}


@torch.no_grad()
def transcribe_tokens(model, processor, audio: np.ndarray, *, num_beams: int = 1, timestamps: bool = False,
                      language: str | None = None) -> torch.Tensor:
    """Generated token ids ``(1, T)`` (HF's ``generate``: greedy or beam search, optional timestamps; audio
    longer than 30 s goes through HF's sequential long-form decoding, which needs timestamps)."""
    if not isinstance(num_beams, int) or num_beams < 1:
        raise ValueError(f"num_beams must be a positive int, got {num_beams!r}")
    inputs = whisper_inputs(processor, audio, model.dtype)
    kwargs = {"num_beams": num_beams, "do_sample": False}
    if timestamps or len(audio) > WINDOW_SAMPLES:
        kwargs["return_timestamps"] = True
    if language is not None:
        kwargs["language"] = language
    if getattr(model.generation_config, "is_multilingual", False):
        kwargs.setdefault("task", "transcribe")
        kwargs.setdefault("language", "en")
    notice = _WhisperOwnKwargs()
    logger = logging.getLogger(_GENERATE_LOGGER)
    logger.addFilter(notice)
    try:
        return model.generate(**inputs, **kwargs)
    finally:
        logger.removeFilter(notice)


@torch.no_grad()
def context_bytes(model, processor, audio: np.ndarray, tokens: torch.Tensor) -> int:
    """Measured bytes of the cache after decoding ``tokens`` over the first 30 s window of ``audio``.

    The cache is kvslim's (:func:`kvslim.make_cache`) when a method is applied to ``model``, else HF's own
    ``EncoderDecoderCache`` of ``DynamicCache`` layers; one decoder pass over the start token + ``tokens``.
    """
    from transformers import DynamicCache, EncoderDecoderCache

    from .. import api
    from ..caches.encdec import hf_cache_nbytes

    feats = whisper_inputs(processor, audio[:WINDOW_SAMPLES], model.dtype)["input_features"]
    start = torch.tensor([[model.generation_config.decoder_start_token_id]])
    limit = model.config.max_target_positions - 1
    ids = torch.cat([start, tokens[:, :limit].to(start.dtype)], 1)
    if api.get_plan(model) is not None:
        cache = api.make_cache(model)
    else:
        cache = EncoderDecoderCache(DynamicCache(config=model.config), DynamicCache(config=model.config))
    out = model(input_features=feats, decoder_input_ids=ids, use_cache=True, **{CACHE_KW: cache})
    return hf_cache_nbytes(getattr(out, CACHE_KW))
