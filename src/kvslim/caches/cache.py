"""The ``transformers.Cache`` that kvslim hands to ``generate``: HF's container plus exact byte accounting."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .capture import graph_step
from .storage import ScratchPool


class KVSlimCache(Cache):
    """A ``transformers.Cache`` of kvslim layers; ``nbytes`` is the exact size of everything stored."""

    #: not written by ``kvslim.save_cache`` (``caches/state.py``): ``load_cache`` takes the model's plan
    file_skip = ("plan",)

    def __init__(self, layers: list[CacheLayerMixin], plan=None):
        super().__init__(layers=layers)
        self.plan = plan
        pool = ScratchPool()
        for layer in layers:
            if hasattr(layer, "scratch_pool"):
                layer.scratch_pool = pool

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """HF's ``Cache.update`` into layer ``layer_idx``; ``ValueError`` naming ``layer_idx`` and the range for an
        index this cache has no layer for (a kvslim cache is built for one model's layers, it never grows)."""
        n = len(self.layers)
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < n:
            raise ValueError(f"layer_idx must be an int in [0, {n}) (this cache holds {n} layers), got {layer_idx!r}")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def declare_unpadded(self) -> None:
        """Promise that no sequence in the batch has padding: ring-buffer layers may then hand the window to
        attention in slot order instead of copying it into temporal order at every decode step."""
        for layer in self.layers:
            if hasattr(layer, "slot_order_ok"):
                layer.slot_order_ok = True

    def enable_fused_decode(self) -> None:
        """Decode steps of int8/int4 layers hand attention their codes (``caches/fused.py``): only for a model
        whose attention knows them (``adapters/sdpa.py``; ``kvslim.make_cache`` decides)."""
        for layer in self.layers:
            if hasattr(layer, "fused_decode"):
                layer.fused_decode = True

    def enable_sparse_decode(self) -> None:
        """The model runs kvslim's attention (``adapters/sdpa.py``), which reads a sparse decode step's chosen pages
        (``caches/sparse.py``): layers built with ``sparse`` may then hand it those steps."""
        for layer in self.layers:
            if getattr(layer, "sparse", None) is not None:
                layer.sparse_attention = True

    def enable_column_attention(self) -> None:
        """The model runs kvslim's attention (``adapters/sdpa.py``), which masks a capturable ring's slots by the
        positions they hold (``caches/capture_ring.py``): ring layers may then be made capturable."""
        for layer in self.layers:
            if hasattr(layer, "column_attention"):
                layer.column_attention = True

    @property
    def is_compileable(self) -> bool:
        """HF's flag (all layers compileable: ``generate`` may compile, masks are always built). Also ``True`` while a
        step is traced or captured when any layer takes the static path of ``caches/capture.py``: its reads are the
        whole buffer, so HF must build the causal mask for that step (it skips it for one query token otherwise)."""
        if self.layers and all(getattr(layer, "is_compileable", False) for layer in self.layers):
            return True
        return graph_step() and any(getattr(layer, "is_compileable", False) for layer in self.layers)

    def set_capturable(self, capturable: bool = True) -> None:
        """Every call of the layers that can (append layers built with ``max_length``: plain, per-token quantized, or
        with a residual window and sinks, the int4/int3/int2 and turbo defaults, ``caches/capture_residual.py``; slim rows,
        ``caches/slim.py``) takes the
        static path of ``caches/capture.py``, eager included: ``is_compileable`` is then ``True`` when all layers
        can, and HF's ``generate`` builds whole-buffer masks and may compile its decode step. ``ValueError`` when no
        layer can, or when a layer with a residual window already holds tokens (its layout is chosen at its first
        update)."""
        if not isinstance(capturable, bool):
            raise ValueError(f"capturable must be True or False, got {capturable!r}")
        kept = [i for i, layer in enumerate(self.layers)
                if getattr(layer, "sparse", None) is not None and layer.sparse.select == "prompt"]
        if capturable and kept:
            raise ValueError(f"capturable=True: layers {kept} keep the pages chosen after the prompt "
                             "(sparse_select='prompt'), a choice held on the host; take sparse_select='step' (the "
                             "default) with capturable=True, or build the cache without it")
        able = [layer for layer in self.layers if hasattr(layer, "can_capture") and layer.can_capture()]
        if capturable and not able:
            raise ValueError("capturable=True: no layer of this cache can be captured (it needs max_length and "
                             "append, slim or latent layers: dense, int8, int4/int3/int2 with their defaults or "
                             "per-token, turbo4/turbo3/turbo2, slim, mla; ring windows of those formats on a model running kvslim's "
                             "attention; not rings with a residual window)")
        late = [i for i, layer in enumerate(self.layers) if layer in able and layer.is_initialized
                and (layer.spec.residual or layer.spec.sink or layer.is_sliding) and layer.capturable != capturable]
        if late:
            raise ValueError(f"capturable={capturable}: layers {late} already hold tokens in the other layout (a "
                             "residual window's layout is chosen at the first update); set it on a fresh cache "
                             "(kvslim.make_cache(model, max_length=..., capturable=True))")
        for layer in able:
            layer.capturable = capturable

    def check_finite(self) -> None:
        """``ValueError`` when a decode step since the last check wrote inf/nan into a quantized layer: decode steps
        check their keys and values on the device, without a host synchronisation (docs/gpu.md); this reads the
        flags (one host read per store). A multi-token update of a layer (a prefill) checks that layer too. Also
        ``ValueError`` naming ``max_length`` when a compiled or captured step was refused past it
        (``caches/capture.py``)."""
        for layer in self.layers:
            if hasattr(layer, "raise_deferred"):
                layer.raise_deferred()

    @property
    def nbytes(self) -> int:
        """Exact bytes of live cached data (keys, values, latents, scales) over all layers."""
        return int(sum(layer.nbytes for layer in self.layers))

    @property
    def allocated_nbytes(self) -> int:
        """Bytes of all preallocated buffers (>= ``nbytes``)."""
        return int(sum(getattr(layer, "allocated_nbytes", layer.nbytes) for layer in self.layers))
