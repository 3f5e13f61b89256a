"""Storage-only methods: ``dense``, ``window`` (ring buffer) and ``int8`` / ``int4`` (grouped quantization).

They change nothing in the model: the cache stores K and V differently. ``dense`` and ``window`` on layers the
model itself runs with a sliding window are exact; ``window`` on full-attention layers is an approximation
(the model was trained to see everything); ``int8``/``int4`` are lossy and measured (``kvslim demo``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..adapters.sdpa import restore_attention, use_packed_sdpa
from ..adapters.shape import ModelShape
from ..caches import StoreSpec
from ..caches.factories import append_factory, ring_factory
from ..caches.spec import MAX_RESIDUAL
from ..caches.window import residual_ring_slots
from ..ops.quant import default_group_size
from ..plan import LayerPlan, Plan
from . import sparse_options
from .base import Method, parse_dtype

STANDARD_KV_MODELS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gpt2", "mixtral", "gemma3_text")


@dataclass(frozen=True)
class StorageOptions:
    """Options of the storage methods (fields map 1:1 to ``kvslim.apply`` keywords and CLI flags).

    Quantized methods only: ``asymmetric`` (min/max codes with a zero-point), ``rotation`` (``"hadamard"``:
    rotate the head dimension before quantizing), ``key_channel_group`` (> 0: keys per channel over groups of
    that many tokens, KIVI), ``residual`` (≤ 128 most recent tokens in full precision, flushed ``flush`` tokens
    at a time; ``flush`` defaults to ``key_channel_group`` or 32), ``key_bits`` (bits of the keys when they
    differ from the method's, which then holds for the values: ``int2`` keeps 3-bit keys), ``value_rotation``
    (the values' rotation when it differs from ``rotation``: ``"hadamard"`` or ``"none"``; ``int2`` rotates its
    values only), ``sink`` (the first tokens of a sequence kept in full precision for good, beside the residual
    window: ``sink + residual`` ≤ 128). ``per_layer``: ``{layer index: {option: value}}``, a layer's own
    ``bits`` (keys and values; ``key_bits`` then defaults to them), ``key_bits``, ``rotation`` or
    ``value_rotation`` over the method's (e.g. ``{0: {"bits": 8}}``: layer 0 in 8 bits); the layer indices are
    checked against the model at ``plan``. See docs/quantization.md.
    """

    bits: int = 0
    window: int | None = None
    group_size: int = 64
    scale_dtype: torch.dtype = torch.float32
    chunk: int = 256
    smooth_keys: bool = True
    asymmetric: bool = False
    rotation: str | None = None
    key_channel_group: int = 0
    residual: int = 0
    flush: int | None = None
    key_bits: int | None = None
    value_rotation: str | None = None
    sink: int = 0
    codec: str = "int"
    outliers: int = 0
    center_keys: bool = False
    key_scales: tuple | None = None  # turbo keys' fixed channel scales (per_layer only; StoreSpec.key_scales)
    per_layer: tuple = ()  # ((layer, ((option, value), ...)), ...), normalized from the {layer: {option: value}} given

    def __post_init__(self) -> None:
        if self.window is not None and (not isinstance(self.window, int) or isinstance(self.window, bool)
                                        or self.window <= 0):
            raise ValueError(f"window must be a positive int (tokens), got {self.window!r}")
        for name in ("group_size", "chunk"):  # a bool is an int to Python, not a size
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not isinstance(self.smooth_keys, bool):
            raise ValueError(f"smooth_keys must be True or False, got {self.smooth_keys!r}")
        object.__setattr__(self, "scale_dtype", parse_dtype(self.scale_dtype, "scale_dtype"))
        if self.key_bits is not None and (self.key_bits not in (2, 3, 4, 8) or isinstance(self.key_bits, bool)
                                          or not self.bits):
            raise ValueError(f"key_bits must be None (= the method's bits) or 2, 3, 4 or 8 on a quantized method, "
                             f"got {self.key_bits!r}")
        if self.flush is None:
            object.__setattr__(self, "flush", self.key_channel_group or min(32, self.residual) or 1)
        spec = self.key_spec()  # validates bits, asymmetric, rotation, key_channel_group, residual, flush
        if spec.channel_group and self.chunk % spec.channel_group:
            raise ValueError(f"chunk={self.chunk} must be a multiple of key_channel_group={spec.channel_group}")
        if self.window is not None and spec.residual:
            raise ValueError("residual needs an append-only cache: it cannot be combined with window")
        object.__setattr__(self, "per_layer", _normalized_per_layer(self.per_layer, bool(self.bits)))
        for i, _ in self.per_layer:
            self.for_layer(i)  # each layer's options validate as the method's do (the message names the layer)

    def for_layer(self, index: int) -> StorageOptions:
        """The options of layer ``index``: the method's, with that layer's ``per_layer`` entry over them."""
        over = dict(dict(self.per_layer).get(index, ()))
        if not over:
            return self
        if "bits" in over and "key_bits" not in over:
            over["key_bits"] = None  # a layer's bits are its keys' and values' unless key_bits says otherwise
        if over.get("key_bits") == over.get("bits", self.bits):
            over["key_bits"] = None
        try:
            return replace(self, per_layer=(), **over)
        except ValueError as e:
            raise ValueError(f"per_layer[{index}]: {e}") from None

    def key_spec(self) -> StoreSpec:
        """The key store's spec (the value store's is ``key_spec().for_values()``)."""
        try:
            kb = self.key_bits or self.bits
            return StoreSpec(kb, self.group_size, self.scale_dtype,
                             smooth=bool(self.bits and self.smooth_keys and not self.key_channel_group),
                             asymmetric=self.asymmetric, rotation=self.rotation,
                             channel_group=self.key_channel_group, residual=self.residual, flush=self.flush,
                             value_bits=self.bits if kb != self.bits else None, value_rotation=self.value_rotation,
                             sink=self.sink, codec=self.codec, outliers=self.outliers, center=self.center_keys,
                             key_scales=self.key_scales)
        except ValueError as e:  # name the option, not the store field
            msg = str(e).replace("channel_group", "key_channel_group")
            raise ValueError(msg.replace("key_key_", "key_")) from None


class StorageMethod(Method):
    """A K+V cache kept plain or quantized, append-only or in ring buffers."""

    model_types = STANDARD_KV_MODELS

    def __init__(self, name: str, bits: int, windowed: bool, defaults: dict | None = None):
        self.name, self.bits, self.windowed = name, bits, windowed
        self.defaults = dict(defaults or {})  # this method's measured best configuration (docs/quantization.md)

    def not_applicable(self, shape: ModelShape) -> str | None:
        if shape.family in ("mla", "encoder-decoder"):
            other = "mla" if shape.family == "mla" else "slim"
            hint = " (bits=8 or 4 quantizes its latent)" if self.bits and other == "mla" else ""
            return f"{shape.family} attention keeps a different cache; use method={other!r} for it{hint}"
        return None

    def prepare(self, model, plan: Plan) -> None:
        """HF's own attention keeps running; GQA decode gets packed queries, int8/int4 decode the fused kernel
        (see ``adapters/sdpa.py``)."""
        model._kvslim_attn_previous = use_packed_sdpa(model, quantized=self.bits in (2, 3, 4, 8))

    def restore(self, model) -> None:
        restore_attention(model, vars(model).pop("_kvslim_attn_previous", None))

    def options(self, **options) -> StorageOptions:
        """The method's :class:`StorageOptions` (the sparse-decode options are checked and set aside:
        ``methods/sparse_options.py``)."""
        if self.windowed and any(k in options for k in sparse_options.SPARSE_OPTIONS):
            raise ValueError(f"sparse_budget: method {self.name!r} keeps ring buffers, which already read a bounded "
                             "window; sparse decode needs an append-only cache (dense, int8, int4, int3, int2, turbo)")
        _, options = sparse_options.split(options)
        allowed = ({"window", "group_size", "scale_dtype", "chunk", "smooth_keys", "asymmetric", "rotation",
                    "key_channel_group", "residual", "flush", "key_bits", "value_rotation", "sink", "per_layer"}
                   if self.bits else {"window", "chunk"})
        if self.name == "dense":
            allowed = {"chunk"}
        unknown = set(options) - allowed
        if unknown:
            sparse = set() if self.windowed else set(sparse_options.SPARSE_OPTIONS)  # a ring takes none of them
            raise ValueError(f"unknown option(s) {sorted(unknown)} for method {self.name!r}; allowed: "
                             f"{sorted(allowed | sparse)}")
        check_full_precision(options, self.defaults)
        merged = dict(self.defaults)
        if "window" in options and options["window"] is not None:
            merged.pop("residual", None)  # a ring buffer keeps no residual window (nor sinks beside it)
            merged.pop("sink", None)
            merged.pop("key_channel_group", None)
        merged.update(options)
        if "sink" not in options and merged.get("sink"):  # the default sinks share the 128 full-precision tokens
            merged["sink"] = max(0, min(merged["sink"], MAX_RESIDUAL - merged.get("residual", 0)))
            if not merged.get("residual"):
                merged["sink"] = 0
        return StorageOptions(bits=self.bits, **merged)

    def plan(self, shape: ModelShape, dtype: torch.dtype, **options) -> Plan:
        reason = self.not_applicable(shape)
        if reason:
            raise ValueError(f"method {self.name!r} does not apply: {reason}")
        self.options(**options)  # every option checked (the sparse ones included) before anything is built
        sparse, rest = sparse_options.split(options)
        plan = self._plan_storage(shape, dtype, rest)
        plan = sparse_options.apply(plan, sparse, shape.num_kv_heads, shape.head_dim)
        return replace(plan, options=dict(options))

    def _plan_storage(self, shape: ModelShape, dtype: torch.dtype, options: dict) -> Plan:
        opts = self.options(**options)
        notes = []
        kcg = opts.key_channel_group
        if kcg and "key_channel_group" not in options and shape.head_dim % kcg:  # the default adapts too
            g = default_group_size(shape.head_dim, kcg)
            notes.append(f"key_channel_group={g} (the default {kcg} does not divide head dim {shape.head_dim})")
            opts = replace(opts, key_channel_group=g, flush=g if "flush" not in options else opts.flush)
        d = shape.head_dim
        if opts.value_rotation == "hadamard" and "value_rotation" not in options and d & (d - 1):
            notes.append(f"value_rotation=None (the default Hadamard rotation needs a power-of-two head dim, got {d})")
            opts = replace(opts, value_rotation=None)
        if opts.bits and "group_size" not in options:  # the default adapts to the head dim (the plan says so)
            g = default_group_size(shape.head_dim, opts.group_size)
            if g != opts.group_size:
                notes.append(f"group_size={g} (the default {opts.group_size} does not divide head dim "
                             f"{shape.head_dim})")
                opts = replace(opts, group_size=g)
        if "sink" not in options and opts.sink != self.defaults.get("sink", 0):
            notes.append(f"sink={opts.sink} (the default {self.defaults['sink']} sink tokens and residual="
                         f"{opts.residual} share at most {MAX_RESIDUAL} full-precision tokens)")
        outside = [i for i, _ in opts.per_layer if i >= shape.num_layers]
        if outside:
            raise ValueError(f"per_layer: layer(s) {outside} outside the model's {shape.num_layers} layers "
                             f"(0..{shape.num_layers - 1})")
        formats = [_layer_format(opts, i, shape, dtype) for i in range(shape.num_layers)]
        window, explicit = opts.window, opts.window is not None
        if self.windowed and window is None:
            if shape.sliding_window is None:
                raise ValueError(
                    f"method 'window' needs window=W: this {shape.model_type} config has no sliding_window")
            window = shape.sliding_window
        layers = []
        dense_row = 2 * shape.num_kv_heads * shape.head_dim * dtype.itemsize
        for i, sliding in enumerate(shape.is_sliding):
            spec, per_token, fixed, residual_row, fmt = formats[i]
            lossy = "lossy" if opts.bits else "exact"
            kind = "sliding" if sliding else "full"
            if window is None and sliding and shape.sliding_window:  # the model's own window, as HF's cache
                layers.append(_own_window_layer(i, self.name, spec, shape.sliding_window, per_token, fixed,
                                                residual_row, dense_row, fmt, dtype))
                continue
            if window is None or not (sliding or explicit):
                layers.append(LayerPlan(i, self.name, per_token, None, lossy, fixed_bytes=fixed, note=fmt,
                                        residual=spec.residual + spec.sink, flush=spec.flush,
                                        residual_bytes_per_token=residual_row, attention=kind,
                                        factory=append_factory(spec, opts.chunk)))
                continue
            if sliding and window >= shape.sliding_window:
                w, exactness = window, lossy
                note = f"model's own window {shape.sliding_window}"
            else:
                w, exactness = window, "approximate"
                note = ("model trained with full attention here" if not sliding
                        else f"window < model's {shape.sliding_window}")
            name = f"{self.name}+window" if self.bits else "window"
            note = f"{note}; {fmt}" if fmt else note
            layers.append(LayerPlan(i, name, per_token, w, exactness, note=note, fixed_bytes=fixed, attention=kind,
                                    factory=ring_factory(spec, w)))
        if any(lp.exactness == "approximate" for lp in layers):
            notes.append("a ring buffer on layers the model runs with full attention drops old tokens: "
                         "outputs differ from the model once the context exceeds the window (measure with "
                         "`kvslim demo`)")
        if window is None and shape.sliding_window and any(shape.is_sliding):
            full = "; the full-attention layers keep every token" if not all(shape.is_sliding) else ""
            notes.append(f"the model's {sum(shape.is_sliding)} sliding-window layers keep its own window of "
                         f"{shape.sliding_window} (the last {shape.sliding_window - 1} tokens, as HF's cache){full}")
        rings = sum(lp.window is not None for lp in layers)
        if self.bits and rings:  # caches/base.KVStoreLayer._fused_call: append layers only
            notes.append(f"multi-token calls over a history (a question, a chat turn, a verify step) read it through "
                         f"the fused ops on the append layers; the {rings} ring layer(s) decode their window for them")
        return Plan(self.name, shape.model_type, shape.family, str(dtype).replace("torch.", ""), tuple(layers),
                    dense_row, options={k: v for k, v in options.items()}, notes=tuple(notes),
                    sliding_window=shape.sliding_window)


PER_LAYER_OPTIONS = ("bits", "key_bits", "rotation", "value_rotation", "key_scales")


def _scale_rows(value, where: str) -> tuple[tuple[float, ...], ...]:
    """``key_scales`` given as a (H, D) tensor or nested sequence -> a tuple of H tuples of D floats (hashable, as a
    frozen spec keeps it); ``ValueError`` naming ``where`` for anything else (values are checked by the spec)."""
    try:
        t = torch.as_tensor(value, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        t = None
    if t is None or t.dim() != 2 or 0 in t.shape:
        raise ValueError(f"{where}: key_scales must be a (KV heads, head dim) tensor or nested list of floats, got "
                         f"{tuple(t.shape) if t is not None else type(value).__name__}")
    return tuple(tuple(float(f) for f in row) for row in t.tolist())


def check_full_precision(options: dict, defaults: dict) -> None:
    """The full-precision tokens a caller set (``residual``, ``sink``), checked before the defaults adapt to them
    (the default sinks shrink to fit a larger window): ``ValueError`` naming what was set and what would work. Values
    that are not ints are left to :class:`StorageOptions`' own checks."""
    def given(name):
        v = options.get(name)
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None

    res, sink, cap = given("residual"), given("sink"), MAX_RESIDUAL
    if res is not None and res + (sink or 0) > cap:
        if sink:
            raise ValueError(f"sink={sink} + residual={res} = {sink + res} full-precision tokens: at most {cap} "
                             f"per layer; e.g. sink={sink} with residual={max(0, cap - sink)}, or fewer sinks")
        room = defaults.get("sink", 0)
        fit = (f" (the default {room} sink tokens shrink to fit: residual={cap - room} keeps all {room})" if room
               else "")
        raise ValueError(f"residual={res}: a layer keeps at most {cap} full-precision tokens (sinks + residual "
                         f"window); take residual={cap} or less{fit}")
    if sink is not None and res is None and "window" not in options:
        default = defaults.get("residual", 0)
        if sink + default > cap:
            raise ValueError(f"sink={sink} beside the default residual={default} makes {sink + default} "
                             f"full-precision tokens: at most {cap} per layer; set residual={cap - sink} or less too, "
                             f"or sink={cap - default} or fewer")


def _normalized_per_layer(per_layer, quantized: bool) -> tuple:
    """``per_layer`` as a sorted tuple ``((layer, ((option, value), ...)), ...)``; ``ValueError`` naming it for a
    shape other than ``{int >= 0: {option: value}}``, an option it does not take or bits outside 2, 3, 4, 8."""
    if isinstance(per_layer, tuple) and all(isinstance(e, tuple) and len(e) == 2 and isinstance(e[1], tuple)
                                            for e in per_layer):
        per_layer = {i: dict(ov) for i, ov in per_layer}  # already normalized (dataclasses.replace)
    if per_layer is None:
        per_layer = {}
    if not isinstance(per_layer, dict):
        raise ValueError(f"per_layer must be a dict {{layer index: {{option: value}}}}, got {type(per_layer).__name__}")
    if per_layer and not quantized:
        raise ValueError("per_layer applies to the quantized methods (int8, int4, int3, int2)")
    out = []
    for i, over in per_layer.items():
        if not isinstance(i, int) or isinstance(i, bool) or i < 0:
            raise ValueError(f"per_layer: layer indices must be ints >= 0, got {i!r}")
        if not isinstance(over, dict) or not over:
            raise ValueError(f"per_layer[{i}] must be a non-empty dict of options, got {over!r}")
        unknown = sorted(set(over) - set(PER_LAYER_OPTIONS))
        if unknown:
            raise ValueError(f"per_layer[{i}]: unknown option(s) {unknown}; a layer may set "
                             f"{', '.join(PER_LAYER_OPTIONS)}")
        if "bits" in over and (over["bits"] not in (2, 3, 4, 8) or isinstance(over["bits"], bool)):
            raise ValueError(f"per_layer[{i}]: bits must be 2, 3, 4 or 8, got {over['bits']!r}")
        if "key_scales" in over:
            over = {**over, "key_scales": _scale_rows(over["key_scales"], f"per_layer[{i}]")}
        out.append((i, tuple(sorted(over.items()))))
    return tuple(sorted(out))


def _layer_format(opts: StorageOptions, index: int, shape: ModelShape, dtype: torch.dtype
                  ) -> tuple[StoreSpec, int, int, int, str]:
    """Layer ``index``'s key spec, coded bytes per token, fixed bytes, full-precision row bytes and plan note."""
    own = opts.for_layer(index)
    spec = own.key_spec()
    try:
        spec.check_dim(shape.head_dim)
    except ValueError as e:
        where = f"per_layer[{index}]: " if own is not opts else ""
        raise ValueError(where + str(e).replace("channel_group", "key_channel_group")) from None
    vspec = spec.for_values()
    per_token = shape.num_kv_heads * (spec.bytes_per_value_row(shape.head_dim, dtype)
                                      + vspec.bytes_per_value_row(shape.head_dim, dtype))
    fixed = shape.num_kv_heads * shape.head_dim * 4 if spec.smooth else 0  # fp32 key smoothing factors
    residual_row = 2 * shape.num_kv_heads * shape.head_dim * dtype.itemsize if spec.residual else 0
    return spec, per_token, fixed, residual_row, _format_note(spec, vspec, shape.head_dim, dtype)


def _own_window_layer(i: int, name: str, spec: StoreSpec, window: int, per_token: int, fixed: int,
                      residual_row: int, dense_row: int, fmt: str, dtype: torch.dtype) -> LayerPlan:
    """A storage method on a layer the model runs with a sliding window of ``window``: a ring of the last
    W − 1 tokens, as HF's own cache (so the layer attends exactly HF's tokens, each in the method's format).

    * ``dense`` (a plain spec): a :class:`~kvslim.caches.window.RingLayer` of W − 1 rows, exact, HF's bytes;
    * no residual window (int8): a quantized :class:`~kvslim.caches.window.RingLayer` of W − 1 coded rows;
    * a residual window R < W − 1 (int4/int2 defaults): :class:`~kvslim.caches.window.ResidualRingLayer`, the R
      most recent tokens in the model dtype in front of a ring of whole coded token groups (attention sinks are
      dropped there: the first tokens leave the window like any other);
    * W − 1 ≤ R: every visible token would sit in the full-precision window anyway: a plain ring (exact).
    """
    name, own = f"{name}+window", f"model's own window {window}"
    if getattr(spec, "sink", 0):
        spec = replace(spec, sink=0)
    if spec.residual and window - 1 <= spec.residual:
        return LayerPlan(i, name, dense_row, window, "exact", attention="sliding",
                         note=f"{own} ≤ residual {spec.residual}: kept in {str(dtype).replace('torch.', '')}",
                         factory=ring_factory(StoreSpec(), window))
    note = f"{own}; {fmt}" if fmt else f"{own} (as HF's cache)"
    if not spec.residual:
        return LayerPlan(i, name, per_token, window, "lossy" if spec.bits else "exact", note=note, fixed_bytes=fixed,
                         attention="sliding", factory=ring_factory(spec, window))
    return LayerPlan(i, name, per_token, window, "lossy", note=note, fixed_bytes=fixed, attention="sliding",
                     residual=spec.residual, flush=spec.flush, residual_bytes_per_token=residual_row,
                     ring_codes=residual_ring_slots(window, spec), factory=ring_factory(spec, window))


def _format_note(spec: StoreSpec, vspec: StoreSpec, dim: int, dtype: torch.dtype) -> str:
    """Plan note: the formats and bits per element (codes + scales/zero-points), residual window apart."""
    if not spec.bits:
        return ""
    kb, vb = spec.bits_per_element(dim, dtype), vspec.bits_per_element(dim, dtype)
    note = f"K {spec.describe()}, V {vspec.describe()}: {(kb + vb) / 2:.2f} bits/element"
    if spec.residual:
        n = 4096  # the window's cost at the context length: full-precision rows instead of codes
        coded = spec.flushed(n) - spec.sink
        eff = (coded * (kb + vb) / 2 + (n - coded) * 8 * dtype.itemsize) / n
        first = f"the first {spec.sink} and " if spec.sink else ""
        note += (f"; + {first}≤{spec.residual} recent tokens in {str(dtype).replace('torch.', '')} "
                 f"({eff:.2f} bits/element with them at {n:,} tokens)")
    return note


DENSE = StorageMethod("dense", 0, windowed=False)
WINDOW = StorageMethod("window", 0, windowed=True)
INT8 = StorageMethod("int8", 8, windowed=False)
# int4 / int2 defaults: the best measured configuration (docs/quantization.md, benchmarks/bench_quality.py):
# asymmetric codes with fp16 scale + zero-point, keys per channel over token groups (KIVI), values per token,
# the 128 most recent tokens in full precision (flushed a key group at a time). A ring window drops KIVI and the
# window. Values are Hadamard-rotated (per-token groups see no outlier channel; top-1 +1.2 points for int4).
# int2: 3-bit keys over 64-token groups + 2-bit Hadamard-rotated values in groups of 64 = 3.00
# bits/element over K and V (pure 2-bit keys, key_bits=2, cost 4x the KL at the same bits).
# int4 keeps the first 4 tokens (attention sinks) in full precision beside a 124-token window (128 full-precision
# tokens in all): they draw much of every head's attention, and out of the first KIVI group they no longer set its
# range (SmolLM2, token mode 2,048 / 512: KL 0.0019 -> 0.0009).
# int2 keeps 4 sink tokens beside a 124-token window (same bytes); chosen on the development text (Botchan, token
# protocol 2,048 / 512, one pass) of both SmolLM2 (KL 0.0247 -> 0.0117) and Qwen2.5-Coder (0.0405 -> 0.0371).
# Keys are not rotated: a Hadamard rotation before the KIVI groups helps SmolLM2 (int4 KL 0.00089 -> 0.00056) and
# wrecks Qwen2.5 (int4 0.0026 -> 0.0196, int2 0.037 -> 0.51; docs/quantization.md §9); ``rotation="hadamard"`` asks.
INT4 = StorageMethod("int4", 4, windowed=False,
                     defaults=dict(asymmetric=True, key_channel_group=32, residual=124, sink=4, group_size=64,
                                   scale_dtype=torch.float16, value_rotation="hadamard"))
INT2 = StorageMethod("int2", 2, windowed=False,
                     defaults=dict(asymmetric=True, key_bits=3, key_channel_group=64, residual=124, sink=4,
                                   group_size=64, scale_dtype=torch.float16, value_rotation="hadamard"))
# int3 (issue 29 item 4): 3-bit KIVI keys over 64-token groups and 3-bit rotated values in groups of 64, 4 sinks +
# a 124-token window: 3.50 bits/element, between int4 (4.75) and int2 (3.00). Botchan, 2,048 / 512: KL 0.0073 at
# 7,260 B/token on SmolLM2 (the int2-int4 line: 0.0090), 0.0242 at 3,872 on Qwen2.5-Coder (line: 0.0285).
INT3 = StorageMethod("int3", 3, windowed=False,
                     defaults=dict(asymmetric=True, key_channel_group=64, residual=124, sink=4, group_size=64,
                                   scale_dtype=torch.float16, value_rotation="hadamard"))
