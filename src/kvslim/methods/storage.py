"""Storage-only methods: ``dense``, ``window`` (ring buffer) and ``int8`` / ``int4`` (grouped quantization).

They change nothing in the model: the cache stores K and V differently. ``dense`` and ``window`` on layers the
model itself runs with a sliding window are exact; ``window`` on full-attention layers is an approximation
(the model was trained to see everything); ``int8``/``int4`` are lossy and measured (``kvslim demo``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..adapters.sdpa import restore_attention, use_packed_sdpa
from ..adapters.shape import ModelShape
from ..caches import AppendLayer, RingLayer, StoreSpec
from ..plan import LayerPlan, Plan
from .base import Method, parse_dtype

STANDARD_KV_MODELS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gpt2", "mixtral")


@dataclass(frozen=True)
class StorageOptions:
    """Options of the storage methods (fields map 1:1 to ``kvslim.apply`` keywords and CLI flags)."""

    bits: int = 0
    window: int | None = None
    group_size: int = 64
    scale_dtype: torch.dtype = torch.float32
    chunk: int = 256
    smooth_keys: bool = True

    def __post_init__(self) -> None:
        if self.window is not None and (not isinstance(self.window, int) or isinstance(self.window, bool)
                                        or self.window <= 0):
            raise ValueError(f"window must be a positive int (tokens), got {self.window!r}")
        if not isinstance(self.group_size, int) or self.group_size <= 0:
            raise ValueError(f"group_size must be a positive int, got {self.group_size!r}")
        if not isinstance(self.chunk, int) or self.chunk <= 0:
            raise ValueError(f"chunk must be a positive int, got {self.chunk!r}")
        if not isinstance(self.smooth_keys, bool):
            raise ValueError(f"smooth_keys must be True or False, got {self.smooth_keys!r}")
        object.__setattr__(self, "scale_dtype", parse_dtype(self.scale_dtype, "scale_dtype"))
        StoreSpec(self.bits, self.group_size, self.scale_dtype)


class StorageMethod(Method):
    """A K+V cache kept plain or quantized, append-only or in ring buffers."""

    model_types = STANDARD_KV_MODELS

    def __init__(self, name: str, bits: int, windowed: bool):
        self.name, self.bits, self.windowed = name, bits, windowed

    def not_applicable(self, shape: ModelShape) -> str | None:
        if shape.family in ("mla", "encoder-decoder"):
            other = "mla" if shape.family == "mla" else "slim"
            return f"{shape.family} attention keeps a different cache; use method={other!r} for it"
        return None

    def prepare(self, model, plan: Plan) -> None:
        """HF's own attention keeps running; GQA decode gets packed queries (see ``adapters/sdpa.py``)."""
        model._kvslim_attn_previous = use_packed_sdpa(model)

    def restore(self, model) -> None:
        restore_attention(model, vars(model).pop("_kvslim_attn_previous", None))

    def options(self, **options) -> StorageOptions:
        allowed = {"window", "group_size", "scale_dtype", "chunk", "smooth_keys"} if self.bits else {"window", "chunk"}
        if self.name == "dense":
            allowed = {"chunk"}
        unknown = set(options) - allowed
        if unknown:
            raise ValueError(f"unknown option(s) {sorted(unknown)} for method {self.name!r}; allowed: "
                             f"{sorted(allowed)}")
        return StorageOptions(bits=self.bits, **options)

    def plan(self, shape: ModelShape, dtype: torch.dtype, **options) -> Plan:
        reason = self.not_applicable(shape)
        if reason:
            raise ValueError(f"method {self.name!r} does not apply: {reason}")
        opts = self.options(**options)
        spec = StoreSpec(opts.bits, opts.group_size, opts.scale_dtype, smooth=bool(opts.bits and opts.smooth_keys))
        row = spec.bytes_per_value_row(shape.head_dim, dtype)  # validates group_size against head_dim
        per_token = 2 * shape.num_kv_heads * row
        fixed = shape.num_kv_heads * shape.head_dim * 4 if spec.smooth else 0  # fp32 key smoothing factors
        window, explicit = opts.window, opts.window is not None
        if self.windowed and window is None:
            if shape.sliding_window is None:
                raise ValueError(
                    f"method 'window' needs window=W: this {shape.model_type} config has no sliding_window")
            window = shape.sliding_window
        layers, notes = [], []
        for i, sliding in enumerate(shape.is_sliding):
            lossy = "lossy" if opts.bits else "exact"
            if window is None or not (sliding or explicit):
                layers.append(LayerPlan(i, self.name, per_token, None, lossy, fixed_bytes=fixed,
                                        factory=_append(spec, opts.chunk)))
                continue
            if sliding and window >= shape.sliding_window:
                w, exactness = window, lossy
                note = f"model's own window {shape.sliding_window}"
            else:
                w, exactness = window, "approximate"
                note = ("model trained with full attention here" if not sliding
                        else f"window < model's {shape.sliding_window}")
            name = f"{self.name}+window" if self.bits else "window"
            layers.append(LayerPlan(i, name, per_token, w, exactness, note=note, fixed_bytes=fixed,
                                    factory=_ring(spec, w)))
        if any(lp.exactness == "approximate" for lp in layers):
            notes.append("a ring buffer on layers the model runs with full attention drops old tokens: "
                         "outputs differ from the model once the context exceeds the window (measure with "
                         "`kvslim demo`)")
        dense = 2 * shape.num_kv_heads * shape.head_dim * dtype.itemsize
        return Plan(self.name, shape.model_type, shape.family, str(dtype).replace("torch.", ""), tuple(layers),
                    dense, options={k: v for k, v in options.items()}, notes=tuple(notes))


def _append(spec: StoreSpec, chunk: int):
    return lambda max_length: AppendLayer(spec, chunk=chunk, max_length=max_length)


def _ring(spec: StoreSpec, window: int):
    return lambda max_length: RingLayer(window, spec)


DENSE = StorageMethod("dense", 0, windowed=False)
WINDOW = StorageMethod("window", 0, windowed=True)
INT8 = StorageMethod("int8", 8, windowed=False)
INT4 = StorageMethod("int4", 4, windowed=False)
