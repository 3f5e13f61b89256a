"""Sequence-parallel decode across processes (``torch.distributed``) for every kvslim cache format.

Each rank holds a contiguous slice of every layer's cache, computes partial attention over it and the ranks merge
by log-sum-exp (one small collective per layer per step). See ``docs/distributed.md``.
"""

from .cache import ShardedCache, make_sharded_cache
from .group import DistributedError, close_group, init_group
from .merge import Partial, merge, merge_local, partial_attention
from .placement import Placement
from .runtime import SeqParallel, SeqParallelOptions, apply, restore

__all__ = ["DistributedError", "Partial", "Placement", "SeqParallel", "SeqParallelOptions", "ShardedCache",
           "apply", "close_group", "init_group", "make_sharded_cache", "merge", "merge_local",
           "partial_attention", "restore"]
