"""``turbo4`` / ``turbo3`` / ``turbo2``: TurboQuant-class KV codes (Zandieh et al., ICLR 2026, arXiv 2504.19874).

Per token and head: a seeded random rotation (``"orthogonal"``: Haar; ``"hadamard"``: random signs, then a
Walsh–Hadamard matrix; a new seed per layer, keys and values apart), then every coordinate coded with the
Lloyd–Max codebook of N(0, 1) and one fp16 scale per row (``ops/turbo.py``, ``caches/turbo.py``). Beside the
codes, kvslim's attention sinks and full-precision recent window (as int4/int3/int2). Options: ``residual``,
``sink``, ``flush``, ``rotation``, ``outliers`` (key channels per head coded at one bit more, fitted by the first
write; default a quarter of the head dim below 4 bits), ``center_keys`` (the first write's key channel means
subtracted before the rotation; default on), ``key_bits`` (``turbo2``: 3-bit keys, 2-bit values),
``smooth_keys``, ``scale_dtype``, ``seed``, ``prerope_keys`` (keys coded before RoPE, KVQuant's lever: the rotary
table comes from the model's ``rotary_emb`` under ``apply``, from the config's RoPE base for a plan without
weights; such keys decode through the layers' reads, not the fused op), ``rope_centred_keys`` (keys stay post-RoPE,
centred by their pre-RoPE channel means turned to each row's position: pre-RoPE keys' gain, fused; needs
``center_keys``), ``per_layer`` (``{i: {"key_scales": (KV heads, head dim)}}`` only: fixed key channel scales coded
as ``s ⊙ k``, from ``kvslim.calibrate(model, ids, "turbo3")``; docs/quantization.md §13). Measured against int3/int2 at equal bytes in docs/quantization.md §10.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..adapters.shape import ModelShape
from ..caches.factories import append_factory
from ..caches.spec import MAX_RESIDUAL
from ..plan import Plan
from . import sparse_options
from .storage import StorageMethod, StorageOptions, check_full_precision

TURBO_OPTIONS = {"residual", "flush", "sink", "rotation", "outliers", "key_bits", "smooth_keys", "center_keys",
                 "scale_dtype",
                 "chunk", "seed", "value_rotation", "prerope_keys", "rope_centred_keys", "per_layer"}
TURBO_PER_LAYER = ("key_scales",)  # what a turbo layer may set of its own (kvslim.calibrate(model, ids, "turbo3"))
ROPE_OPTIONS = ("prerope_keys", "rope_centred_keys")  # the options that need the model's RoPE table
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # cos/sin depend on the position only (a static table)


def rope_from_shape(shape: ModelShape) -> tuple[float, ...] | None:
    """RoPE inverse frequencies of a config's default RoPE (HF's ``compute_default_rope_parameters``, fp32), or
    ``None`` when the config names another RoPE type or none."""
    rope = shape.extras.get("rope")
    if not rope or rope["rope_type"] != "default":
        return None
    dim = int(shape.head_dim * rope["partial_rotary_factor"])
    inv = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return tuple(float(f) for f in inv)


def rope_from_model(model) -> tuple[float, ...] | None:
    """The model's own RoPE inverse frequencies (``model.model.rotary_emb.inv_freq``) when its RoPE type keeps a
    static table, else ``None``."""
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    inv = getattr(rotary, "inv_freq", None)
    rope = getattr(model.config, "rope_parameters", None)
    kind = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
    if not isinstance(inv, torch.Tensor) or kind not in ROPE_TYPES:
        return None
    return tuple(float(f) for f in inv.detach().float().cpu())


class TurboMethod(StorageMethod):
    """K and V as turbo codes behind sinks and a full-precision window, append-only layers only."""

    def not_applicable(self, shape: ModelShape) -> str | None:
        reason = super().not_applicable(shape)
        if reason is None and any(shape.is_sliding):
            return (f"{self.name} keeps append-only layers; this {shape.model_type} model runs sliding-window layers "
                    "(use int4/int3/int2 there)")
        return reason

    def options(self, **options):
        _, options = sparse_options.split(options)  # checked and set aside (methods/sparse_options.py)
        unknown = set(options) - TURBO_OPTIONS
        if unknown:
            raise ValueError(f"unknown option(s) {sorted(unknown)} for method {self.name!r}; allowed: "
                             f"{sorted(TURBO_OPTIONS | set(sparse_options.SPARSE_OPTIONS))}")
        options = dict(options)
        check_full_precision(options, self.defaults)
        rope = self._rope_mode(options)
        for name in ROPE_OPTIONS:
            options.pop(name, None)
        seed = options.pop("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        merged = {k: v for k, v in {**self.defaults, **options}.items() if k not in ROPE_OPTIONS}
        if rope == "rope_centred_keys" and not merged["center_keys"]:
            raise ValueError("rope_centred_keys=True is a way of centring keys: it needs center_keys=True "
                             "(or rope_centred_keys=False)")
        if merged["outliers"] is None:  # the default: a quarter of the head dim, set by plan() (0 without a shape)
            merged["outliers"] = 0
        if "sink" not in options:  # the default sinks share the 128 full-precision tokens with the window
            merged["sink"] = max(0, min(merged["sink"], MAX_RESIDUAL - merged["residual"])) if merged["residual"] else 0
        if "flush" not in options:
            merged["flush"] = min(merged["flush"], merged["residual"]) or 1
        opts = StorageOptions(bits=self.bits, **merged)
        for i, over in opts.per_layer:
            other = sorted(set(dict(over)) - set(TURBO_PER_LAYER))
            if other:
                raise ValueError(f"per_layer[{i}]: a {self.name} layer may set {', '.join(TURBO_PER_LAYER)}, got "
                                 f"{other}")
        return opts

    def _rope_mode(self, options: dict) -> str | None:
        """Which RoPE option is on (``"prerope_keys"``, ``"rope_centred_keys"`` or ``None``), each checked by name.
        An option the caller passes wins over the method's default: ``prerope_keys=True`` alone turns a default
        RoPE-centring off, and so does ``center_keys=False`` (keys not centred at all)."""
        explicit = {name: options[name] for name in ROPE_OPTIONS if name in options}
        values = {name: explicit.get(name, self.defaults.get(name, False)) for name in ROPE_OPTIONS}
        for name, value in values.items():
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        if "rope_centred_keys" not in explicit and (explicit.get("prerope_keys")
                                                    or options.get("center_keys") is False):
            values["rope_centred_keys"] = False
        on = [name for name in ROPE_OPTIONS if values[name]]
        if len(on) > 1:
            raise ValueError("prerope_keys and rope_centred_keys are two ways of coding keys around RoPE: take one")
        return on[0] if on else None

    def plan_model(self, model, **options) -> Plan:
        shape = self.check_model(model)
        return self._plan(shape, next(model.parameters()).dtype, rope_from_model(model), **options)

    def plan(self, shape: ModelShape, dtype: torch.dtype, **options) -> Plan:
        return self._plan(shape, dtype, rope_from_shape(shape), **options)

    def _plan(self, shape: ModelShape, dtype: torch.dtype, rope: tuple[float, ...] | None, **options) -> Plan:
        seed = options.get("seed", 0)
        self.options(**options)  # every option checked by name before the plan is built
        mode = self._rope_mode(options)
        notes = []
        if mode and rope is None and mode not in options:  # the method's default: plain centring instead
            notes.append(f"{mode}=False (this {shape.model_type} model has no RoPE with a static table; keys centred "
                         "by their channel means)")
            mode = None
        if mode and rope is None:
            raise ValueError(f"{mode}=True needs the model's RoPE table: this {shape.model_type} model has no "
                             f"RoPE with a static table ({', '.join(ROPE_TYPES)}); use {mode}=False")
        base = {k: v for k, v in options.items() if k not in ("seed", *ROPE_OPTIONS)}
        base.update({name: mode == name for name in ROPE_OPTIONS})  # resolved once: the store options see it
        kbits = options.get("key_bits") or self.bits
        if "outliers" not in options and self.defaults.get("outliers", 0) is None and kbits < 4:
            want = shape.head_dim // 4  # the paper's split: a quarter of the channels at one more bit
            try:
                replace(self.options(**base, outliers=want).key_spec(), seed=0).check_dim(shape.head_dim)
                base["outliers"] = want
            except ValueError as e:
                notes.append(f"outliers=0 (a quarter of head dim {shape.head_dim} cannot be kept: {e})")
        plan = super().plan(shape, dtype, **base)
        layers = []
        for lp in plan.layers:  # a rotation seed per layer: keys 2·(seed·L + i), values that + 1
            spec = lp.factory.keywords["spec"]
            spec = replace(spec, seed=2 * (seed * len(plan.layers) + lp.index), rope=rope if mode else None,
                           rope_centred=mode == "rope_centred_keys")
            spec.check_dim(shape.head_dim)
            if spec.key_scales is not None and len(spec.key_scales) != shape.num_kv_heads:
                raise ValueError(f"per_layer[{lp.index}]: key_scales has {len(spec.key_scales)} rows, the model has "
                                 f"{shape.num_kv_heads} KV heads")
            fixed = shape.num_kv_heads * (spec.fixed_bytes(shape.head_dim)
                                          + spec.for_values().fixed_bytes(shape.head_dim))
            layers.append(replace(lp, fixed_bytes=fixed, factory=append_factory(spec, lp.factory.keywords["chunk"],
                                                                                sparse=lp.sparse)))
        return replace(plan, layers=tuple(layers), options=dict(options), notes=plan.notes + tuple(notes))


# Defaults chosen on the development text (Botchan, 2,049 / 512, one pass) of SmolLM2 and Qwen2.5-Coder
# (docs/quantization.md §10): keys centred per channel (Qwen2.5's constant key offsets otherwise ride on every row's
# norm: turbo3 KL 0.89), a quarter of the key channels (the largest, fitted by the first write) at one more bit
# (Qwen2.5 without them: KL 0.65 centred), Haar rotations (48 + 16 channels have no Hadamard matrix; on SmolLM2 the
# two rotations measured alike), the window flushed 64 tokens at a time as int3/int2. turbo3: KL 0.0065 / 0.0189
# against int3's 0.0074 / 0.0242 at +0.3 % bytes; turbo2 (3-bit keys, 2-bit values): 0.0239 / 0.0382 against
# int2's 0.0116 / 0.0371 (it loses on SmolLM2). turbo3's keys are RoPE-centred (channel means fitted before RoPE,
# turned to each row's position; fused): on the held-out texts of both models 13-39 % less KL than plain centring at
# the same bytes (docs/quantization.md §10.1); turbo2 keeps plain centring (RoPE-centred: 5 of 6 held-out texts).
_DEFAULTS = dict(codec="turbo", rotation="orthogonal", residual=124, sink=4, flush=64, scale_dtype=torch.float16,
                 smooth_keys=False, center_keys=True, outliers=None)
TURBO4 = TurboMethod("turbo4", 4, windowed=False, defaults={**_DEFAULTS, "rotation": "hadamard", "outliers": 0})
TURBO3 = TurboMethod("turbo3", 3, windowed=False, defaults={**_DEFAULTS, "rope_centred_keys": True})
TURBO2 = TurboMethod("turbo2", 2, windowed=False, defaults={**_DEFAULTS, "key_bits": 3})
