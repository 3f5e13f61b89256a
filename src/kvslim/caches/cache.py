"""The ``transformers.Cache`` that kvslim hands to ``generate``: HF's container plus exact byte accounting."""

from __future__ import annotations

from transformers.cache_utils import Cache, CacheLayerMixin

from .storage import ScratchPool


class KVSlimCache(Cache):
    """A ``transformers.Cache`` of kvslim layers; ``nbytes`` is the exact size of everything stored."""

    def __init__(self, layers: list[CacheLayerMixin], plan=None):
        super().__init__(layers=layers)
        self.plan = plan
        pool = ScratchPool()
        for layer in layers:
            if hasattr(layer, "scratch_pool"):
                layer.scratch_pool = pool

    @property
    def nbytes(self) -> int:
        """Exact bytes of live cached data (keys, values, latents, scales) over all layers."""
        return int(sum(layer.nbytes for layer in self.layers))

    @property
    def allocated_nbytes(self) -> int:
        """Bytes of all preallocated buffers (>= ``nbytes``)."""
        return int(sum(getattr(layer, "allocated_nbytes", layer.nbytes) for layer in self.layers))
