"""The ``transformers.Cache`` each rank hands to ``generate``: its own slice of every layer.

Built from a kvslim :class:`~kvslim.plan.Plan` by mapping each layer's single-process cache class onto its
sharded twin (:mod:`kvslim.distributed.layers`); ``nbytes`` is this rank's exact share.
"""

from __future__ import annotations

from transformers.cache_utils import Cache

from ..caches.dense import AppendLayer
from ..caches.latent import LatentLayer
from ..caches.slim import SlimLayer
from ..caches.spec import StoreSpec
from ..caches.storage import ScratchPool
from ..caches.window import RingLayer
from .layers import ShardedKVLayer, ShardedLatentLayer, ShardedLayer, ShardedRowLayer
from .placement import Placement


class ShardedCache(Cache):
    """Every layer's local slice on this rank; ``get_seq_length`` is the job-wide length (all ranks agree).

    Attributes:
        rank, world_size: this rank and the number of ranks.
        placements: one :class:`Placement` per window size (``None``: unbounded layers).
        current: the layer whose ``update`` ran last (the attention hook reads its local slots).
    """

    def __init__(self, layers: list[ShardedLayer], placements: dict, rank: int, world_size: int, plan=None,
                 runtime=None):
        super().__init__(layers=layers)
        self.placements, self.rank, self.world_size, self.plan = placements, rank, world_size, plan
        self.runtime = runtime  # the SeqParallel whose attention hooks read this cache
        self.current: ShardedLayer | None = None
        pool = ScratchPool()
        for layer in layers:
            layer.scratch_pool = pool

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        self.current = self.layers[layer_idx]
        if self.runtime is not None:
            self.runtime.cache = self
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def reset(self) -> None:
        super().reset()
        for p in self.placements.values():
            p.reset()

    @property
    def nbytes(self) -> int:
        """Exact bytes of the live tokens this rank holds, over all layers."""
        return int(sum(layer.nbytes for layer in self.layers))

    @property
    def allocated_nbytes(self) -> int:
        return int(sum(layer.allocated_nbytes for layer in self.layers))

    def local_tokens(self) -> list[int]:
        """Live tokens per layer on this rank."""
        return [layer.live_tokens() for layer in self.layers]


def make_sharded_cache(plan, rank: int, world_size: int, *, rule: str = "fewest", split=None,
                       max_length: int | None = None, runtime=None) -> ShardedCache:
    """A :class:`ShardedCache` for ``plan`` (the layers' formats come from the plan's own cache factories).

    To decode with it, build it with :meth:`SeqParallel.make_cache` (which passes ``runtime``): the attention
    hooks find the cache through it.

    Args:
        plan: a kvslim plan (dense, window, int8/int4, slim K/K+r/V/X/KV, MLA latent).
        rank, world_size: this rank of ``world_size``.
        rule, split: the placement (see :mod:`kvslim.distributed.placement`).
        max_length: total tokens (prompt + new) to preallocate for, divided over the ranks; ``None`` grows.

    Raises:
        ValueError: a layer whose format has no sharded twin (e.g. the encoder-decoder caches).
    """
    placements: dict = {}

    def placement(window):
        if window not in placements:
            placements[window] = Placement(world_size, rule, split, window)
        return placements[window]

    cap = None if max_length is None else -(-max_length // world_size) + 1
    layers: list[ShardedLayer] = []
    for lp in plan.layers:
        ref = lp.factory(max_length) if lp.factory is not None else None
        chunk = getattr(ref, "chunk", 256)
        if isinstance(ref, SlimLayer):
            layers.append(ShardedRowLayer(ref.technique, ref.width, ref.spec, placement(None), rank, chunk=chunk,
                                          capacity=cap))
        elif isinstance(ref, LatentLayer):
            layers.append(ShardedLatentLayer([ref.spec, StoreSpec()], placement(None), rank, chunk=chunk,
                                             capacity=cap))
        elif isinstance(ref, RingLayer):
            specs = [ref.spec, ref.spec.for_values()]
            layers.append(ShardedKVLayer(specs, placement(ref.window), rank, capacity=cap))
        elif isinstance(ref, AppendLayer):
            specs = [ref.spec, ref.spec.for_values()]
            layers.append(ShardedKVLayer(specs, placement(None), rank, chunk=chunk, capacity=cap))
        else:
            raise ValueError(f"layer {lp.index} ({lp.technique}, {type(ref).__name__}) has no sequence-parallel "
                             "cache; supported: dense, window, int8/int4, slim (decoder-only), mla")
    return ShardedCache(layers, placements, rank, world_size, plan, runtime)
