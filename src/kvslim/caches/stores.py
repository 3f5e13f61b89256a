"""Which store a :class:`~kvslim.caches.spec.StoreSpec` builds: the one place that knows every store class.

``storage.py`` defines the plain and grouped-quantized stores, ``residual.py`` and ``sink.py`` build on them; this
module sits above all three (it used to live in ``storage.py``, which then imported its own subclasses: an
import circle).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .residual import ChannelQuantizedStore, ResidualStore
from .sink import SinkStore
from .spec import StoreSpec
from .storage import QuantizedStore, TensorStore
from .turbo import TurboStore


def make_store(spec: StoreSpec, like: torch.Tensor, capacity: int) -> TensorStore:
    """A store for tensors shaped like ``like`` (B, H, S, D) with ``capacity`` token slots: plain
    (:class:`TensorStore`), coded per token or per channel, behind a full-precision residual window
    (:class:`ResidualStore`) and attention sinks (:class:`SinkStore`) as ``spec`` asks."""
    b, h, _, d = like.shape
    if spec.bits == 0:
        return TensorStore(spec, b, h, capacity, d, like.dtype, like.device)
    cls = TurboStore if spec.codec == "turbo" else ChannelQuantizedStore if spec.channel_group else QuantizedStore
    if spec.sink:  # tokens [sink, …) go to a residual store of their own positions, shifted by sink
        inner = replace(spec, sink=0)
        store = cls(inner, b, h, capacity, d, like.dtype, like.device)
        store.position_offset = spec.sink  # the coded part's slot 0 is position ``sink`` (pre-RoPE turbo keys)
        return SinkStore(spec, ResidualStore(inner, store, b, h, d, like.dtype, like.device))
    store = cls(spec, b, h, capacity, d, like.dtype, like.device)
    return ResidualStore(spec, store, b, h, d, like.dtype, like.device) if spec.residual else store
