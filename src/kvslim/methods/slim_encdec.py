"""Slim attention for encoder-decoder models (Whisper, T5, BART; SPEC §3 "Encoder-decoder", "Non-square").

Cross-attention caches the encoder output E once for *all* decoder layers (each layer goes through its own
W_K, W_V; no inverse, any head layout) instead of K and V per layer. Decoder self-attention gets a slim cache
per layer chosen by the slim policy (X-cache — no inverse, the robust choice without RoPE —, K-cache through
W_K⁻¹ or, for e > d, the right inverse W_Kᵀ(W_K W_Kᵀ)⁻¹, V-cache, or plain K+V), measured on calibration
activations. Exact in exact arithmetic; the per-layer rounding is measured and shown in the plan.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from importlib.resources import files

import torch

from ..adapters.bart import BartAdapter
from ..adapters.encdec_patch import patch, unpatch
from ..adapters.shape import ModelShape, shape_from_config
from ..adapters.t5 import T5Adapter
from ..adapters.whisper import WhisperAdapter
from ..adapters.whisper import install as install_whisper_outputs
from ..attention.encdec import CrossWeights
from ..caches import StoreSpec
from ..caches.encdec import EncDecSlimCache
from ..caches.factories import append_factory, slim_factory
from ..plan import LayerPlan, Plan
from .base import model_dtype, parse_dtype
from .slim_policy import LayerNumerics, Policy, check_policy_fields, choose, weights_to_device

ADAPTERS = {"whisper": WhisperAdapter(), "t5": T5Adapter(), "bart": BartAdapter()}
CACHES = ("auto", "k", "v", "x", "kv")
CROSS = ("shared", "kv")
DEFAULT_FLOOR = {torch.float32: 1e-5, torch.float16: 0.0, torch.bfloat16: 0.0}
#: options of decoder-only slim attention that have no meaning here, with the reason
REFUSED = {"rope_storage": "encoder-decoder models supported here have no RoPE",
           "bits": "quantized slim rows are not supported for encoder-decoder models",
           "group_size": "quantized slim rows are not supported for encoder-decoder models",
           "tokenizer": "calibration uses calibration_ids or the text's bytes for encoder-decoder models"}


@dataclass(frozen=True)
class EncDecOptions:
    """Options of ``kvslim.apply(model, "slim", ...)`` on an encoder-decoder model (each error names its field).

    Attributes:
        cache: decoder self-attention: ``"auto"`` (per-layer policy) or ``"k"``, ``"v"``, ``"x"``, ``"kv"``.
        cross: ``"shared"`` (E once for all layers) or ``"kv"`` (HF's per-layer cross K/V, unchanged).
        decode: slim decode ``"option2"`` or ``"option1"`` (self-attention K-/V-caches).
        budget, floor, rank, basis: the slim policy's (see :class:`kvslim.methods.slim.SlimOptions`).
        encoder_length: encoder frames/tokens for the plan's byte figures (default: the model's fixed encoder
            length, e.g. Whisper's 1500; 512 for T5/BART).
        calibration: text whose bytes (mod vocabulary) are the calibration decoder tokens (default built-in).
        calibration_ids: token ids instead (1-D or (1, N)).
        max_calibration_tokens: cap on calibration decoder tokens.
        chunk: growth step of the self-attention caches in tokens.
    """

    cache: str = "auto"
    cross: str = "shared"
    decode: str = "option2"
    budget: float = 2.0
    floor: float | None = None
    rank: int | None = None
    basis: str = "svd"
    encoder_length: int | None = None
    calibration: str | None = None
    calibration_ids: object = None
    max_calibration_tokens: int = 128
    chunk: int = 256

    def __post_init__(self) -> None:
        for name, allowed in (("cache", CACHES), ("cross", CROSS), ("decode", ("option2", "option1")),
                              ("basis", ("svd", "svdv", "act"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        check_policy_fields(self)
        if self.encoder_length is not None and (not isinstance(self.encoder_length, int) or self.encoder_length <= 0):
            raise ValueError(f"encoder_length must be a positive int or None, got {self.encoder_length!r}")


@dataclass(frozen=True)
class EncDecPlan(Plan):
    """A :class:`~kvslim.plan.Plan` whose cache is an :class:`~kvslim.caches.encdec.EncDecSlimCache`.

    ``layers`` are the decoder self-attention layers; the shared E is layer 0's ``fixed_bytes`` (per sequence),
    HF's cross K/V are ``dense_fixed_bytes``.
    """

    max_decoder_length: int | None = None

    def make_cache(self, max_length: int | None = None) -> EncDecSlimCache:
        if max_length is not None and self.max_decoder_length is not None:
            max_length = min(max_length, self.max_decoder_length)
        cross = self.options.get("cross", "shared")
        if self.model_type == "whisper":
            install_whisper_outputs()  # Whisper's generate post-processing reads caches per sequence
        return EncDecSlimCache([lp.factory(max_length) for lp in self.layers], plan=self, cross=cross)


def _dname(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _self_layer(i: int, tech: str, r: int, d: int, e: int, dk: int, dtype: torch.dtype, chunk: int, **kw
                ) -> LayerPlan:
    spec = StoreSpec()
    if tech == "kv":
        return LayerPlan(i, "kv", 2 * e * dtype.itemsize,
                         factory=append_factory(spec, chunk), **kw)
    width = {"k": e + r, "v": e, "x": d}[tech]
    label = f"slim-{tech}" + (f"+r{r}" if r else "")
    return LayerPlan(i, label, width * dtype.itemsize,
                     factory=slim_factory(tech, width, spec, chunk),
                     **kw)


class SlimEncDec:
    """The encoder-decoder half of the ``"slim"`` method (``methods/slim.py`` delegates here)."""

    name = "slim"
    model_types = tuple(ADAPTERS)

    def not_applicable(self, shape: ModelShape) -> str | None:
        if shape.model_type not in ADAPTERS:
            return (f"no slim adapter for encoder-decoder model_type {shape.model_type!r} "
                    f"(supported: {', '.join(ADAPTERS)})")
        return None

    def options(self, **options) -> EncDecOptions:
        for key, why in REFUSED.items():
            if key in options:
                raise ValueError(f"option {key!r} does not apply: {why}")
        unknown = set(options) - set(EncDecOptions.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown option(s) {sorted(unknown)} for method 'slim' on an encoder-decoder model; "
                             f"allowed: {sorted(EncDecOptions.__dataclass_fields__)}")
        return EncDecOptions(**options)

    @staticmethod
    def _check_technique(tech: str, rope: bool, d: int, e: int) -> None:
        if tech in ("v", "x") and rope:
            raise ValueError(f"cache={tech!r} needs keys without RoPE between projection and dot product; "
                             "use cache='k' or 'auto'")
        if tech in ("k", "v") and e < d:
            raise ValueError(f"cache={tech!r} needs h·dk = {e} ≥ d = {d} to rebuild the input; use 'x' or 'kv'")

    def check_model(self, model) -> tuple[ModelShape, object]:
        shape = shape_from_config(model.config)
        reason = self.not_applicable(shape)
        if reason:
            raise ValueError(f"method 'slim' does not apply to this {shape.model_type} model: {reason}")
        adapter = ADAPTERS[shape.model_type]
        reason = adapter.check(model)
        if reason:
            raise ValueError(f"method 'slim' does not apply to this {shape.model_type} model: {reason}")
        return shape, adapter

    # -- config-only plan ------------------------------------------------------------------------------------
    def plan(self, shape: ModelShape, dtype: torch.dtype, **options) -> EncDecPlan:
        reason = self.not_applicable(shape)
        if reason:
            raise ValueError(f"method 'slim' does not apply: {reason}")
        opts = self.options(**options)
        dtype = parse_dtype(dtype)
        adapter = ADAPTERS[shape.model_type]
        d, dk = shape.hidden_size, shape.head_dim
        e = shape.num_heads * dk
        tech = opts.cache if opts.cache != "auto" else ("x" if d <= 2 * e else "kv")
        self._check_technique(tech, adapter.has_rope, d, e)
        r = (opts.rank or 0) if tech == "k" else 0
        layers = [_self_layer(i, tech, r, d, e, dk, dtype, opts.chunk,
                              exactness="exact in exact arithmetic; rounding not measured (apply measures it)")
                  for i in range(shape.num_layers)]
        return self._finish(shape, dtype, opts, options, layers, ("config-only plan: apply() chooses per layer "
                                                                  "from measured errors",))

    def _finish(self, shape: ModelShape, dtype, opts: EncDecOptions, options: dict, layers: list[LayerPlan],
                notes: tuple[str, ...], max_decoder_length: int | None = None) -> EncDecPlan:
        d, e, s = shape.hidden_size, shape.num_heads * shape.head_dim, dtype.itemsize
        n_enc = opts.encoder_length or shape.encoder_length or 512
        big = len(layers)
        cross_note = ""
        if opts.cross == "shared":
            layers[0] = replace(layers[0], fixed_bytes=n_enc * d * s,
                                note=(layers[0].note + "; " if layers[0].note else "")
                                + f"+ shared encoder output E: {n_enc}×{d} for all {big} layers")
            cross_note = (f"cross-attention: E once ({n_enc * d * s:,} B/sequence) instead of K+V in {big} layers "
                          f"({big * 2 * e * n_enc * s:,} B): {2 * big * e / d:g}× smaller")
        else:
            layers = [replace(lp, fixed_bytes=2 * e * n_enc * s) for lp in layers]
            cross_note = "cross-attention: HF's per-layer K+V (cross='kv')"
        r = e / d
        side = (f"self-attention per token and layer: K+V {2 * e * s} B; K-cache (W_K⁻¹ or right inverse "
                f"W_Kᵀ(W_K W_Kᵀ)⁻¹, W_KV {e}×{e} = {r:g}× W_V) {e * s} B = 2× smaller; X-cache {d * s} B = "
                f"{2 * r:g}× smaller (no inverse)")
        opts_shown = {k: v for k, v in options.items() if k != "calibration_ids"}
        opts_shown["cross"] = opts.cross
        return EncDecPlan(self.name, shape.model_type, shape.family, _dname(dtype), tuple(layers), 2 * e * s,
                          options=opts_shown, notes=(cross_note, side, f"encoder length {n_enc}", *notes),
                          dense_fixed_bytes=big * 2 * e * n_enc * s, max_decoder_length=max_decoder_length)

    # -- measured plan ---------------------------------------------------------------------------------------
    def plan_model(self, model, **options) -> EncDecPlan:
        shape, adapter = self.check_model(model)
        opts = self.options(**options)
        dtype = model_dtype(model)
        d, dk = shape.hidden_size, shape.head_dim
        e = shape.num_heads * dk
        self._check_technique(opts.cache, adapter.has_rope, d, e)
        xs, n_tokens, source = _calibrate(model, adapter, opts)
        floor = DEFAULT_FLOOR[dtype] if opts.floor is None else float(opts.floor)
        policy = Policy(cache=opts.cache, budget=opts.budget, rank=opts.rank, basis=opts.basis)
        spec = StoreSpec()
        layers, weights = [], {}
        for i, layer in enumerate(adapter.decoder_layers(model)):
            attn = adapter.self_attention(layer)
            num = LayerNumerics(adapter.weights(attn), xs[i], shape.num_heads, dk, None, spec, "raw", opts.decode)
            if opts.cache == "kv":
                cand, within = num.plain(), True
            else:
                cand, within = choose(num, policy, floor, adapter.has_rope)
            # only a technique the caller forced can miss the budget: the plan states its measured error
            kind = "exact" if within else f"approximate (cache={opts.cache!r})"
            note = f"cond W_K {num.cond_k:.1e}, W_V {num.cond_v:.1e}"
            if e > d and cand.technique != "k":  # the right-inverse K-cache beside the chosen one
                alt = num.measure_k(0, opts.basis)
                note += f"; right-inverse slim-k: {e * dtype.itemsize} B/token, err {alt.error:.1e}"
            layers.append(_self_layer(i, cand.technique, cand.rank, d, e, dk, dtype, opts.chunk,
                                      exactness=f"{kind} in {_dname(dtype)}: {cand.ratio:.2f}× plain error",
                                      error=cand.error, note=note))
            if cand.weights is not None:
                weights[i] = cand.weights
        notes = (f"error = relative Frobenius error vs float64 of what the layer rebuilds, measured on {n_tokens} "
                 f"decoder calibration tokens ({source}); 'exact' = within max({opts.budget:g}× plain, {floor:g})",)
        plan = self._finish(shape, dtype, opts, options, layers, notes,
                            adapter.max_decoder_positions(model.config))
        object.__setattr__(plan, "_slim_weights", weights)
        return plan

    def prepare(self, model, plan: Plan) -> None:
        weights = getattr(plan, "_slim_weights", None)
        if weights is None:
            raise ValueError("prepare() needs a plan from plan_model() (it carries the precomputed maps)")
        adapter = ADAPTERS[model.config.model_type]
        dev = next(model.parameters()).device
        self_w = {i: weights_to_device(w, dev) for i, w in weights.items()}
        cross_w = {}
        if plan.options.get("cross", "shared") == "shared":
            ct = torch.promote_types(model_dtype(model), torch.float32)
            for i, layer in enumerate(adapter.decoder_layers(model)):
                attn = adapter.cross_attention(layer)
                lin = adapter.linears(attn)
                cross_w[i] = CrossWeights.from_linear(lin["k"].weight, lin["v"].weight, lin["v"].bias,
                                                      adapter.num_heads(attn), adapter.score_scaling(attn), ct)
        patch(model, adapter, self_w, cross_w)

    def restore(self, model) -> None:
        adapter = ADAPTERS.get(getattr(model.config, "model_type", None))
        if adapter is not None:
            unpatch(model, adapter)


def _calibration_ids(model, adapter, opts: EncDecOptions) -> tuple[torch.Tensor, str]:
    vocab = model.config.vocab_size
    if opts.calibration_ids is not None:
        ids = torch.as_tensor(opts.calibration_ids).reshape(-1)
        if ids.numel() < 2 or int(ids.max()) >= vocab or int(ids.min()) < 0:
            raise ValueError(f"calibration_ids must hold ≥ 2 token ids in [0, {vocab})")
        source = "given ids"
    else:
        text = opts.calibration if opts.calibration is not None else \
            (files("kvslim") / "data" / "calibration.txt").read_text(encoding="utf-8")
        if not isinstance(text, str) or not text.strip():
            raise ValueError("calibration must be a non-empty string")
        ids = torch.tensor(list(text.encode("utf-8"))) % vocab
        source = ("given" if opts.calibration is not None else "built-in") + " text as bytes mod vocab"
    cap = min(opts.max_calibration_tokens, adapter.max_decoder_positions(model.config) or 1 << 30)
    return ids[:cap], source


@torch.no_grad()
def _calibrate(model, adapter, opts: EncDecOptions):
    """Inputs (N, d) of every decoder self-attention on the calibration tokens, in the model dtype."""
    ids, source = _calibration_ids(model, adapter, opts)
    modules = [adapter.self_attention(layer) for layer in adapter.decoder_layers(model)]
    xs: list[torch.Tensor | None] = [None] * len(modules)

    def hook(i):
        def fn(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            xs[i] = x[0].detach()
        return fn

    handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in enumerate(modules)]
    try:
        dev = next(model.parameters()).device
        model(**adapter.encoder_inputs(model, ids), decoder_input_ids=ids[None].to(dev), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return [x.cpu() for x in xs], int(ids.numel()), source


ENCDEC = SlimEncDec()
