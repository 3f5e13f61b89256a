"""What differs between the supported transformers releases, decided once at import.

transformers 5.24 renamed the cache argument of the model, decoder-layer and attention ``forward`` methods and of
``generate``'s model kwargs from ``past_key_values`` to ``cache`` (the old name is still accepted by ``forward``
with a FutureWarning until 5.40). kvslim's attention patches read the cache from the keyword arguments HF passes,
so they read it under :data:`CACHE_KW`, the name this release uses. (Reading "whichever is present" would be
wrong on 5.23: its continuous batching passes a paged cache to attention as ``cache=``.)
"""

from __future__ import annotations

import inspect

from transformers.generation.utils import GenerationMixin

#: the keyword this transformers release passes the cache under: ``"cache"`` (≥ 5.24) or ``"past_key_values"``
CACHE_KW = ("cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
            else "past_key_values")

#: both names, for filtering the cache out of keyword arguments handed on
CACHE_KWS = ("past_key_values", "cache")
