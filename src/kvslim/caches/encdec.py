"""Encoder-decoder cache of slim attention (SPEC §3 "Encoder-decoder"): the encoder output E once, shared.

Stores: E (B, n_enc, d) once for *all* decoder cross-attention layers (HF stores K and V per layer:
2·L·h·dk values per encoder frame; this stores d — 2L·e/d × less), plus one slim layer (K-, V- or X-rows)
per decoder self-attention layer. Exact storage;
the cross-attention recomputes its scores/outputs from E through each layer's own W_K, W_V (no inverse).
Paper: Graef & Wasielewski 2025, §6.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, EncoderDecoderCache

from .base import BatchOpsMixin
from .cache import KVSlimCache


def hf_cache_nbytes(cache: Cache) -> int:
    """Exact bytes of a cache: its own ``nbytes`` if it has one, else the K/V tensors of HF's layers."""
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes)
    if isinstance(cache, EncoderDecoderCache):
        return hf_cache_nbytes(cache.self_attention_cache) + hf_cache_nbytes(cache.cross_attention_cache)
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


class EncoderOutputLayer(BatchOpsMixin, CacheLayerMixin):
    """Holds the encoder output E (B, n_enc, d) once; every cross-attention layer reads it.

    E is kept by reference (no copy): ``generate`` keeps the encoder output alive anyway, so the bytes counted
    in ``nbytes`` (the paper's accounting) are not even allocated twice.
    """

    is_sliding = False
    is_compileable = False

    def __init__(self):
        super().__init__()
        self.enc: torch.Tensor | None = None

    def __repr__(self) -> str:
        shape = None if self.enc is None else tuple(self.enc.shape)
        return f"EncoderOutputLayer({shape})"

    # -- storage ---------------------------------------------------------------------------------------------
    def write(self, enc: torch.Tensor) -> None:
        """Keep ``enc`` (B, n_enc, d) as this generation's encoder context (once)."""
        if enc.dim() != 3:
            raise ValueError(f"encoder output must be (batch, frames, d_model), got {tuple(enc.shape)}")
        self.enc = enc.detach()
        self.dtype, self.device, self.is_initialized = enc.dtype, enc.device, True

    def read(self) -> torch.Tensor:
        if self.enc is None:
            raise RuntimeError("the encoder output has not been cached yet")
        return self.enc

    @property
    def nbytes(self) -> int:
        return 0 if self.enc is None else self.enc.numel() * self.enc.element_size()

    @property
    def allocated_nbytes(self) -> int:
        return self.nbytes

    # -- HF protocol -----------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states, value_states) -> None:  # pragma: no cover - protocol only
        raise RuntimeError("EncoderOutputLayer is filled by write()")

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("EncoderOutputLayer holds E, not K/V: it was reached by unpatched cross-attention "
                           "(apply the 'slim' method first)")

    def get_seq_length(self) -> int:
        return 0 if self.enc is None else self.enc.shape[1]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length(), 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.enc = None
        self.is_initialized = False

    def _map_batch(self, fn) -> None:
        if self.enc is not None:
            self.enc = fn(self.enc)


class SharedEncoderCache(Cache):
    """The cross-attention half: one :class:`EncoderOutputLayer` shared by every decoder layer."""

    def __init__(self):
        super().__init__(layers=[EncoderOutputLayer()])

    @property
    def encoder(self) -> EncoderOutputLayer:
        return self.layers[0]

    @property
    def nbytes(self) -> int:
        return self.encoder.nbytes

    @property
    def allocated_nbytes(self) -> int:
        return self.encoder.allocated_nbytes


class EncDecSlimCache(EncoderDecoderCache):
    """HF's :class:`EncoderDecoderCache` with kvslim halves: slim self-attention layers + E once.

    ``self_attention_cache`` is a :class:`~kvslim.caches.cache.KVSlimCache` of per-layer slim (or dense) layers;
    ``cross_attention_cache`` a :class:`SharedEncoderCache`. Generation, beam reordering and batch selection
    work through HF's protocol; ``nbytes`` is exact.
    """

    #: not written by ``kvslim.save_cache`` (``caches/state.py``): ``load_cache`` takes the model's plan
    file_skip = ("plan",)

    def __init__(self, self_layers: list[CacheLayerMixin], plan=None, cross: str = "shared"):
        if cross not in ("shared", "kv"):
            raise ValueError(f"cross must be 'shared' or 'kv', got {cross!r}")
        cross_cache = SharedEncoderCache() if cross == "shared" else DynamicCache()
        super().__init__(KVSlimCache(self_layers, plan=plan), cross_cache)
        self.plan = plan

    @property
    def encoder(self) -> EncoderOutputLayer:
        return self.cross_attention_cache.encoder

    @property
    def nbytes(self) -> int:
        """Exact bytes of live cached data: self-attention rows plus E."""
        return int(self.self_attention_cache.nbytes + hf_cache_nbytes(self.cross_attention_cache))

    @property
    def allocated_nbytes(self) -> int:
        cross = self.cross_attention_cache
        return int(self.self_attention_cache.allocated_nbytes
                   + getattr(cross, "allocated_nbytes", hf_cache_nbytes(cross)))

    def set_capturable(self, capturable: bool = True) -> None:
        """:meth:`KVSlimCache.set_capturable` of the self-attention half (its slim rows; the cross-attention half,
        E, has a fixed size once written)."""
        self.self_attention_cache.set_capturable(capturable)

    def check_finite(self) -> None:
        """:meth:`KVSlimCache.check_finite` of the self-attention half."""
        self.self_attention_cache.check_finite()

    def _map_all(self, name: str, arg) -> None:
        getattr(self.self_attention_cache, name)(arg)
        getattr(self.cross_attention_cache, name)(arg)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_all("batch_repeat_interleave", repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_all("batch_select_indices", indices)

    def crop(self, tokens_to_remove: int) -> None:
        self.self_attention_cache.crop(tokens_to_remove)

    # -- whole sequences out of / into caches (Whisper's per-sequence split of its generate outputs) ----------
    def _layers(self) -> list[CacheLayerMixin]:
        return [*self.self_attention_cache.layers, *self.cross_attention_cache.layers]

    def _walk(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace every per-sequence tensor t (batch on axis 0) by ``fn(t)``, in a fixed order."""
        for layer in self._layers():
            _walk_layer(layer, fn)

    def take(self, indices: Sequence[int] | torch.Tensor) -> EncDecSlimCache:
        """A new cache holding only the sequences ``indices`` (their slim rows and E copied; this one unchanged).

        Nothing is rebuilt: the copy keeps the same X/K/V rows and encoder output, so it continues generation
        exactly like this cache would for those sequences.
        """
        idx = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        batch = self.batch_size
        if idx.numel() == 0 or (batch is not None and (int(idx.min()) < 0 or int(idx.max()) >= batch)):
            raise ValueError(f"indices must be non-empty sequence indices in [0, {batch}), got {idx.tolist()}")
        kept: list[torch.Tensor] = []

        def select(t: torch.Tensor) -> torch.Tensor:
            kept.append(t)
            return t.index_select(0, idx.to(t.device))

        self._walk(select)
        try:
            out = copy.deepcopy(self, memo={id(self.plan): self.plan})  # the plan is shared, not copied
        finally:
            originals = iter(kept)
            self._walk(lambda t: next(originals))
        return out

    def _tensors(self) -> list[torch.Tensor]:
        """The per-sequence tensors in :meth:`_walk` order."""
        got: list[torch.Tensor] = []
        self._walk(lambda t: got.append(t) or t)
        return got

    @property
    def batch_size(self) -> int | None:
        """Sequences held (``None`` before the first write)."""
        tensors = self._tensors()
        return tensors[0].shape[0] if tensors else None

    @staticmethod
    def concat(caches: Sequence[EncDecSlimCache]) -> EncDecSlimCache:
        """One cache holding the sequences of ``caches`` one after the other (a single cache is returned as is).

        Raises:
            ValueError: the caches differ in anything but their batch (layers, lengths, buffer shapes): sequences
                of decoder passes of different lengths cannot share one cache.
        """
        if not caches or not all(isinstance(c, EncDecSlimCache) for c in caches):
            raise ValueError("caches must be a non-empty sequence of EncDecSlimCache")
        if len(caches) == 1:
            return caches[0]
        per_cache = [c._tensors() for c in caches]
        lengths = [[layer.get_seq_length() for layer in c._layers()] for c in caches]
        shapes = [[t.shape[1:] for t in got] for got in per_cache]
        if any(n != lengths[0] for n in lengths) or any(s != shapes[0] for s in shapes):
            raise ValueError(f"caches must agree in everything but the batch; sequence lengths per cache: "
                             f"{[c.get_seq_length() for c in caches]}")
        out = caches[0].take(range(per_cache[0][0].shape[0]))
        joined = iter(list(zip(*per_cache)))
        out._walk(lambda t: torch.cat([x.to(t.device) for x in next(joined)], dim=0))
        return out


def _walk_layer(layer: CacheLayerMixin, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """``fn`` over one layer's per-sequence tensors: kvslim layers through ``_map_batch``, HF's ``DynamicLayer``
    (``cross="kv"``) through its ``keys``/``values``."""
    if hasattr(layer, "_map_batch"):
        layer._map_batch(fn)
    elif getattr(layer, "is_initialized", False) and isinstance(getattr(layer, "keys", None), torch.Tensor) \
            and layer.keys.numel():
        layer.keys, layer.values = fn(layer.keys), fn(layer.values)
