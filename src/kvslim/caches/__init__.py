"""Storage only: cache layers that keep tensors and know their exact size."""

from .base import KVStoreLayer
from .cache import KVSlimCache
from .dense import AppendLayer
from .spec import StoreSpec
from .storage import QuantizedStore, TensorStore
from .stores import make_store
from .window import RingLayer

__all__ = ["AppendLayer", "KVSlimCache", "KVStoreLayer", "QuantizedStore", "RingLayer", "StoreSpec", "TensorStore",
           "make_store"]
