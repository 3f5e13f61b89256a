"""Picklable per-layer cache factories: ``LayerPlan.factory(max_length)`` builds one layer.

Plans (and the caches that keep their plan) must survive ``pickle`` and ``copy.deepcopy``: factories are
``functools.partial`` objects over the module-level functions below, never lambdas or closures.
"""

from __future__ import annotations

import functools

from .dense import AppendLayer
from .latent import LatentLayer
from .slim import SlimLayer
from .sparse import SparseSpec
from .spec import StoreSpec
from .window import ResidualRingLayer, RingLayer


def _append(max_length: int | None, spec: StoreSpec, chunk: int, sparse: SparseSpec | None = None) -> AppendLayer:
    return AppendLayer(spec, chunk=chunk, max_length=max_length, sparse=sparse)


def _ring(max_length: int | None, spec: StoreSpec, window: int) -> RingLayer:
    return ResidualRingLayer(window, spec) if spec.residual else RingLayer(window, spec, max_length=max_length)


def _latent(max_length: int | None, spec: StoreSpec, chunk: int) -> LatentLayer:
    return LatentLayer(spec, chunk=chunk, max_length=max_length)


def _slim(max_length: int | None, technique: str, width: int, spec: StoreSpec, chunk: int) -> SlimLayer:
    return SlimLayer(technique, width, spec, chunk=chunk, max_length=max_length)


def append_factory(spec: StoreSpec, chunk: int, sparse: SparseSpec | None = None) -> functools.partial:
    """Factory of :class:`AppendLayer` (K and V, plain or quantized; ``sparse``: sparse decode, caches/sparse.py)."""
    if sparse is None:
        return functools.partial(_append, spec=spec, chunk=chunk)
    return functools.partial(_append, spec=spec, chunk=chunk, sparse=sparse)


def ring_factory(spec: StoreSpec, window: int) -> functools.partial:
    """Factory of a ring-buffer layer for a sliding window of ``window`` tokens: :class:`RingLayer`, or
    :class:`ResidualRingLayer` for a spec with a full-precision residual window."""
    return functools.partial(_ring, spec=spec, window=window)


def latent_factory(spec: StoreSpec, chunk: int) -> functools.partial:
    """Factory of MLA :class:`LatentLayer` (``c_kv`` with ``spec``, ``k_pe`` plain)."""
    return functools.partial(_latent, spec=spec, chunk=chunk)


def slim_factory(technique: str, width: int, spec: StoreSpec, chunk: int) -> functools.partial:
    """Factory of slim-attention :class:`SlimLayer` rows of ``width`` values."""
    return functools.partial(_slim, technique=technique, width=width, spec=spec, chunk=chunk)
