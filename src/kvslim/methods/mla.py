"""``mla``: DeepSeek-V2/V3 multi-head latent attention with a latent cache, matrix absorption and move elision.

Stores ``c_kv`` + ``k_pe`` (dc + dr values per token per layer; V2 in bf16: 1,152 B instead of 81,920 B for per-head
K and V). Exact (fp32 tokens identical to HF) with plain storage; ``bits=8/4`` quantize ``c_kv`` (lossy, measured),
``k_pe`` stays in the model dtype. Four implementations (``impl``), see :mod:`kvslim.attention.mla`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..adapters import deepseek
from ..adapters.shape import ModelShape
from ..attention.mla import IMPLS
from ..caches import StoreSpec
from ..caches.factories import append_factory, latent_factory
from ..caches.latent import LatentLayer
from ..ops.quant import default_group_size
from ..plan import LayerPlan, Plan
from .base import Method, NotApplicable, model_dtype, parse_dtype

#: new tokens at or above which a prefill expands per-head K/V once instead of scoring absorbed queries:
#: measured crossover on CPU for V2-Lite shapes (h=16, dc=512, fp32, 1 thread) between 64 and 128 tokens
#: (benchmarks/bench_mla.py: S=T=64 elided 12.6 ms vs expanded 16.8 ms; S=T=128 elided 48 ms vs expanded 38 ms)
DEFAULT_PREFILL_THRESHOLD = 128


@dataclass(frozen=True)
class MLAOptions:
    """Options of ``kvslim.apply(model, "mla", ...)`` (fields map 1:1 to keywords and CLI flags).

    Attributes:
        impl: ``"decompressed"`` (per-head K/V cache), ``"compressed"`` (latent cache re-expanded every step, as
            HF), ``"absorbed"`` or ``"elided"`` (absorbed with move elision, the default: fastest and exact).
        bits: 0 (plain), 8 or 4: grouped quantization of ``c_kv`` (latent impls only).
        group_size: quantization group along ``kv_lora_rank``.
        scale_dtype: dtype of the quantization scales.
        prefill_threshold: a call with at least this many new tokens (a prefill) uses the expanded path (faster
            for long prompts); ``None`` never expands. Ignored by ``decompressed``/``compressed``.
        absorb_dtype: precision of the absorbed ``W_UK``/``W_UV`` (float32 or float64).
        chunk: cache growth chunk in tokens.
    """

    impl: str = "elided"
    bits: int = 0
    group_size: int = 64
    scale_dtype: torch.dtype = torch.float32
    prefill_threshold: int | None = DEFAULT_PREFILL_THRESHOLD
    absorb_dtype: torch.dtype = torch.float32
    chunk: int = 256

    def __post_init__(self) -> None:
        if self.impl not in IMPLS:
            raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {self.impl!r}")
        if self.bits not in (0, 4, 8) or isinstance(self.bits, bool):
            raise ValueError(f"bits must be 0, 4 or 8, got {self.bits!r}")
        if self.bits and self.impl == "decompressed":
            raise ValueError("bits quantizes the latent c_kv: it needs impl='compressed', 'absorbed' or 'elided', "
                             "not impl='decompressed'")
        for name in ("group_size", "chunk"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        t = self.prefill_threshold
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t <= 0):
            raise ValueError(f"prefill_threshold must be a positive int (tokens) or None, got {t!r}")
        object.__setattr__(self, "scale_dtype", parse_dtype(self.scale_dtype, "scale_dtype"))
        absorb = {"float32": torch.float32, "float64": torch.float64}.get(self.absorb_dtype, self.absorb_dtype)
        if absorb not in (torch.float32, torch.float64):
            raise ValueError(f"absorb_dtype must be float32 or float64, got {self.absorb_dtype!r}")
        object.__setattr__(self, "absorb_dtype", absorb)

    @property
    def spec(self) -> StoreSpec:
        return StoreSpec(self.bits, self.group_size, self.scale_dtype)


class MLAMethod(Method):
    """Latent cache + absorbed attention for DeepSeek MLA models."""

    name = "mla"
    model_types = deepseek.MLA_MODEL_TYPES

    def not_applicable(self, shape: ModelShape) -> str | None:
        if shape.family != "mla":
            return f"it has {shape.family} attention, not multi-head latent attention (no kv_lora_rank)"
        return None

    def options(self, **options) -> MLAOptions:
        allowed = set(MLAOptions.__dataclass_fields__)
        unknown = set(options) - allowed
        if unknown:
            raise ValueError(f"unknown option(s) {sorted(unknown)} for method 'mla'; allowed: {sorted(allowed)}")
        return MLAOptions(**options)

    def plan(self, shape: ModelShape, dtype: torch.dtype, **options) -> Plan:
        reason = self.not_applicable(shape)
        if reason:
            raise NotApplicable(f"method 'mla' does not apply: {reason}", shape)
        opts = self.options(**options)
        dc, dr = shape.kv_lora_rank, shape.qk_rope_head_dim
        chosen = ()
        if opts.bits and "group_size" not in options:  # the default adapts to kv_lora_rank (the plan says so)
            g = default_group_size(dc, opts.group_size)
            if g != opts.group_size:
                chosen = (f"group_size={g} (the default {opts.group_size} does not divide kv_lora_rank {dc})",)
                opts = replace(opts, group_size=g)
        item = dtype.itemsize
        dense = shape.num_heads * (shape.qk_nope_head_dim + dr + shape.v_head_dim) * item
        if opts.impl == "decompressed":
            per_token, technique, exactness = dense, "mla-decompressed", "exact"
            note = f"per-head K ({shape.qk_nope_head_dim}+{dr}) and V ({shape.v_head_dim}) × {shape.num_heads} heads"
            make = append_factory(StoreSpec(), opts.chunk)
        else:
            if opts.bits and dc % opts.group_size:
                raise ValueError(f"group_size={opts.group_size} must divide kv_lora_rank {dc}")
            per_token = LatentLayer.bytes_per_token(dc, dr, dtype, opts.spec)
            technique = "mla-latent" + (f"-int{opts.bits}" if opts.bits else "")
            exactness = "lossy" if opts.bits else "exact"
            note = f"c_kv {dc}" + (f" int{opts.bits}/g{opts.group_size}" if opts.bits else "") + f" + k_pe {dr}"
            make = latent_factory(opts.spec, opts.chunk)
        layers = tuple(LayerPlan(i, technique, per_token, None, exactness, note=note, factory=make)
                       for i in range(shape.num_layers))
        notes = (f"impl={opts.impl}" + (f", prefill ≥ {opts.prefill_threshold} tokens expands K/V once"
                                        if opts.impl in ("absorbed", "elided") and opts.prefill_threshold else ""),
                 *chosen)
        return Plan(self.name, shape.model_type, shape.family, str(dtype).replace("torch.", ""), layers, dense,
                    options=dict(options), notes=notes)

    def plan_model(self, model, **options) -> Plan:
        shape = self.check_model(model)
        deepseek.attention_modules(model)  # the modules are really MLA
        return self.plan(shape, model_dtype(model), **options)

    def prepare(self, model, plan: Plan) -> None:
        opts = self.options(**plan.options)
        deepseek.patch(model, opts.impl, opts.prefill_threshold if opts.impl in ("absorbed", "elided") else None,
                       opts.absorb_dtype)

    def restore(self, model) -> None:
        deepseek.unpatch(model)


MLA = MLAMethod()

__all__ = ["DEFAULT_PREFILL_THRESHOLD", "MLA", "MLAMethod", "MLAOptions"]
