"""``turbo4`` / ``turbo3`` / ``turbo2``: TurboQuant-class KV codes (Zandieh et al., ICLR 2026, arXiv 2504.19874).

Per token and head: a seeded random rotation (random signs, then a Walsh–Hadamard matrix; a new seed per layer,
keys and values apart), then every coordinate coded with the Lloyd–Max codebook of N(0, 1) and one fp16 scale
per row (``ops/turbo.py``, ``caches/turbo.py``). Beside the codes, kvslim's attention sinks and full-precision
recent window (as int4/int3/int2). Options: ``residual``, ``sink``, ``flush``, ``rotation`` (``"hadamard"`` or
``"orthogonal"``), ``outliers`` (channels per head coded at one bit more, fitted by the first write),
``key_bits`` (the keys' bits when they differ), ``smooth_keys`` (per-channel key smoothing before the rotation),
``scale_dtype``, ``seed``. Measured against int3/int2 at equal bytes in docs/quantization.md §10.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..adapters.shape import ModelShape
from ..caches.factories import append_factory
from ..caches.storage import MAX_RESIDUAL
from ..plan import Plan
from .storage import StorageMethod, StorageOptions

TURBO_OPTIONS = {"residual", "flush", "sink", "rotation", "outliers", "key_bits", "smooth_keys", "center_keys",
                 "scale_dtype",
                 "chunk", "seed", "value_rotation"}


class TurboMethod(StorageMethod):
    """K and V as turbo codes behind sinks and a full-precision window, append-only layers only."""

    def not_applicable(self, shape: ModelShape) -> str | None:
        reason = super().not_applicable(shape)
        if reason is None and any(shape.is_sliding):
            return (f"{self.name} keeps append-only layers; this {shape.model_type} model runs sliding-window layers "
                    "(use int4/int3/int2 there)")
        return reason

    def options(self, **options):
        unknown = set(options) - TURBO_OPTIONS
        if unknown:
            raise ValueError(f"unknown option(s) {sorted(unknown)} for method {self.name!r}; allowed: "
                             f"{sorted(TURBO_OPTIONS)}")
        options = dict(options)
        seed = options.pop("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        merged = {**self.defaults, **options}
        if "sink" not in options:  # the default sinks share the 128 full-precision tokens with the window
            merged["sink"] = max(0, min(merged["sink"], MAX_RESIDUAL - merged["residual"])) if merged["residual"] else 0
        if "flush" not in options:
            merged["flush"] = min(merged["flush"], merged["residual"]) or 1
        return StorageOptions(bits=self.bits, **merged)

    def plan(self, shape: ModelShape, dtype: torch.dtype, **options) -> Plan:
        seed = options.get("seed", 0)
        self.options(**options)  # every option checked by name before the plan is built
        base = {k: v for k, v in options.items() if k != "seed"}
        plan = super().plan(shape, dtype, **base)
        layers = []
        for lp in plan.layers:  # a rotation seed per layer: keys 2·(seed·L + i), values that + 1
            spec = lp.factory.keywords["spec"]
            spec = replace(spec, seed=2 * (seed * len(plan.layers) + lp.index))
            fixed = shape.num_kv_heads * (spec.fixed_bytes(shape.head_dim)
                                          + spec.for_values().fixed_bytes(shape.head_dim))
            layers.append(replace(lp, fixed_bytes=fixed, factory=append_factory(spec, lp.factory.keywords["chunk"])))
        return replace(plan, layers=tuple(layers), options=dict(options))


_DEFAULTS = dict(codec="turbo", rotation="hadamard", residual=124, sink=4, flush=1, scale_dtype=torch.float16,
                 smooth_keys=False, outliers=0)
TURBO4 = TurboMethod("turbo4", 4, windowed=False, defaults=_DEFAULTS)
TURBO3 = TurboMethod("turbo3", 3, windowed=False, defaults=_DEFAULTS)
TURBO2 = TurboMethod("turbo2", 2, windowed=False, defaults=_DEFAULTS)
