"""Slim attention (Graef & Wasielewski 2025, SPEC §3): cache one tensor per token instead of K and V.

Per layer the plan picks the smallest cache whose measured error stays within the budget: ``slim-k``
(keys; V rebuilt with ``W_KV = W_K⁻¹ W_V``), ``slim-k+rN`` (keys plus N conditioning coordinates that bound the
rounding amplification), ``slim-v`` (values; K rebuilt, only without RoPE), ``slim-x`` (the layer input; no
inverse, only without RoPE) or ``kv`` (the ordinary cache). Memory 0.5× of K+V for a pure K/V/X plan.
Exact in exact arithmetic; rounding is measured per layer on calibration text and shown in the plan.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from importlib.resources import files

import torch

from ..adapters.gpt2 import GPT2Adapter
from ..adapters.llama import LlamaAdapter
from ..adapters.phi3 import Phi3Adapter
from ..adapters.shape import ModelShape
from ..adapters.slim_patch import patch, unpatch
from ..caches import StoreSpec
from ..caches.factories import append_factory, slim_factory
from ..plan import LayerPlan, Plan
from .base import Method, NotApplicable, model_dtype, parse_dtype
from .slim_encdec import ENCDEC
from .slim_policy import Candidate, LayerNumerics, check_policy_fields, rank_ladder, weights_to_device
from .slim_policy import choose as _choose

ADAPTERS = {"gpt2": GPT2Adapter(), "llama": LlamaAdapter(), "phi3": Phi3Adapter()}
CACHES = ("auto", "k", "v", "x", "kv")
#: relative error always accepted per dtype (fp32: far below the 1e-4 logit contract; half: none)
DEFAULT_FLOOR = {torch.float32: 1e-5, torch.float16: 0.0, torch.bfloat16: 0.0}


@dataclass(frozen=True)
class SlimOptions:
    """Options of ``kvslim.apply(model, "slim", ...)`` (validated; each error names its field).

    Attributes:
        cache: ``"auto"`` (per-layer policy), or force ``"k"``, ``"v"``, ``"x"``, ``"kv"`` on every layer.
        decode: ``"option2"`` (softmax·C first, then the small per-head maps) or ``"option1"`` (rebuild V).
        rope_storage: keys stored ``"raw"`` (rotated on read for the scores) or ``"rotated"`` (un-rotated with
            the same cos/sin before rebuilding V).
        budget: allowed error as a multiple of the plain K+V cache's own error in the same dtype.
        floor: relative error always accepted (default: 1e-5 in fp32, 0 in half precision).
        rank: conditioning coordinates r for K-caches; ``None`` picks the smallest r within the budget
            (``"auto"``/``"k"``); ``0`` disables them.
        basis: conditioning directions: ``"svd"`` (W_K's smallest singular directions; measured best on
            all-MiniLM-L6-v2), ``"svdv"`` (the same ranked by their reach into V) or ``"act"``
            (activation-whitened).
        calibration: text for the measurement (default: ``kvslim/data/calibration.txt``).
        calibration_ids: token ids (1-D or (1, N)) instead of text.
        tokenizer: tokenizer for ``calibration``; without one a local tokenizer of the model is tried, then
            byte values modulo the vocabulary.
        max_calibration_tokens: cap on calibration tokens.
        bits / group_size: int8/int4 storage of the cache rows (0 = the model dtype).
        chunk: growth step of the cache in tokens.
        kernel: decode of K-caches (option 2, one token, CPU, fp32 or bf16 rows) through the C++ op
            ``torch.ops.kvslim.slim_decode`` (``"auto"``/``"c"``; without a compiler: the torch path after one
            warning), or always the torch path (``"torch"``).
    """

    cache: str = "auto"
    decode: str = "option2"
    rope_storage: str = "raw"
    budget: float = 2.0
    floor: float | None = None
    rank: int | None = None
    basis: str = "svd"
    calibration: str | None = None
    calibration_ids: object = None
    tokenizer: object = None
    max_calibration_tokens: int = 512
    bits: int = 0
    group_size: int = 32
    chunk: int = 256
    kernel: str = "auto"

    def __post_init__(self) -> None:
        for name, allowed in (("cache", CACHES), ("decode", ("option2", "option1")),
                              ("rope_storage", ("raw", "rotated")), ("kernel", ("auto", "c", "torch")),
                              ("basis", ("svd", "svdv", "act"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        check_policy_fields(self)
        StoreSpec(self.bits, self.group_size)  # validates bits


def default_calibration_text() -> str:
    """The short built-in calibration text."""
    return (files("kvslim") / "data" / "calibration.txt").read_text(encoding="utf-8")


class SlimMethod(Method):
    """Slim attention for decoder-only MHA models (GPT-2, Llama with h_kv = h, Phi-3)."""

    name = "slim"
    model_types = tuple(ADAPTERS)

    def not_applicable(self, shape: ModelShape) -> str | None:
        if shape.family == "encoder-decoder":  # Whisper/T5/BART: methods/slim_encdec.py
            return ENCDEC.not_applicable(shape)
        if shape.family == "mla":
            return ("MLA already caches a shared latent (kv_lora_rank + rope dim per token), far smaller than a "
                    "slim K-cache; use method 'mla'")
        if shape.family != "mha":
            return (f"slim attention needs multi-head attention: with {shape.num_kv_heads} KV heads for "
                    f"{shape.num_heads} query heads ({shape.family}), K holds {shape.num_kv_heads * shape.head_dim} "
                    f"< d={shape.hidden_size} values per token and cannot rebuild the layer input or V; "
                    "use 'int8', 'int4' or 'window' instead")
        if any(shape.is_sliding):
            return "sliding-window layers are not supported by slim attention (use method 'window')"
        if shape.model_type not in ADAPTERS:
            return f"no slim adapter for model_type {shape.model_type!r} (supported: {', '.join(ADAPTERS)})"
        return None

    def options(self, **options) -> SlimOptions:
        unknown = set(options) - set(SlimOptions.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown option(s) {sorted(unknown)} for method 'slim'; allowed: "
                             f"{sorted(SlimOptions.__dataclass_fields__)}")
        return SlimOptions(**options)

    def supports(self, shape: ModelShape) -> bool:
        return self.not_applicable(shape) is None  # checks the decoder and encoder-decoder adapters itself

    # -- config-only plan ------------------------------------------------------------------------------------
    def plan(self, shape: ModelShape, dtype: torch.dtype, **options) -> Plan:
        if shape.family == "encoder-decoder":
            return ENCDEC.plan(shape, dtype, **options)
        reason = self.not_applicable(shape)
        if reason:
            raise NotApplicable(f"method 'slim' does not apply: {reason}", shape)
        opts = self.options(**options)
        dtype = parse_dtype(dtype)
        spec = StoreSpec(opts.bits, opts.group_size)
        rope = ADAPTERS[shape.model_type].has_rope
        d, e = shape.hidden_size, shape.num_heads * shape.head_dim
        tech = opts.cache if opts.cache != "auto" else ("k" if rope or e < d else "x")
        self._check_technique(tech, rope, d, e)
        r = opts.rank or 0 if tech == "k" else 0
        layers = []
        for i in range(shape.num_layers):
            lp = _layer_plan(i, tech, r, d, e, shape.head_dim, dtype, spec, opts.chunk)
            layers.append(LayerPlan(i, lp.technique, lp.bytes_per_token, None,
                                    "exact in exact arithmetic; rounding not measured (apply measures it)",
                                    factory=lp.factory))
        return Plan(self.name, shape.model_type, shape.family, _dname(dtype), tuple(layers),
                    2 * e * dtype.itemsize, options=dict(options),
                    notes=("config-only plan: apply() chooses per layer from measured errors",))

    @staticmethod
    def _check_technique(tech: str, rope: bool, d: int, e: int) -> None:
        if tech in ("v", "x") and rope:
            raise ValueError(f"cache={tech!r} needs keys without RoPE (position enters K after projection); "
                             "use cache='k' or 'auto'")
        if tech in ("k", "v") and e < d:
            raise ValueError(f"cache={tech!r} needs h·dk = {e} ≥ d = {d} to rebuild the input")

    # -- measured plan ---------------------------------------------------------------------------------------
    def plan_model(self, model, **options) -> Plan:
        if getattr(model.config, "is_encoder_decoder", False):
            return ENCDEC.plan_model(model, **options)
        shape = self.check_model(model)
        opts = self.options(**options)
        adapter = ADAPTERS[shape.model_type]
        reason = adapter.check(model)
        if reason:
            raise NotApplicable(f"method 'slim' does not apply to this {shape.model_type} model: {reason}", shape)
        dtype = model_dtype(model)
        d, e, dk = shape.hidden_size, shape.num_heads * shape.head_dim, shape.head_dim
        self._check_technique(opts.cache, adapter.has_rope, d, e)
        spec = StoreSpec(opts.bits, opts.group_size)
        if opts.bits:
            for width, what in ((e, "h·dk"), (dk, "head_dim")):
                if width % opts.group_size:
                    raise ValueError(f"group_size={opts.group_size} must divide {what}={width}")
        xs, rope, n_tokens, source = _calibrate(model, adapter, opts)
        floor = DEFAULT_FLOOR[dtype] if opts.floor is None else float(opts.floor)
        layers, weights, notes = [], {}, []
        for i, attn in enumerate(adapter.attention_modules(model)):
            num = LayerNumerics(adapter.weights(attn), xs[i], shape.num_heads, dk, rope, spec,
                                opts.rope_storage, opts.decode)
            cand, within = _choose(num, opts, floor, adapter.has_rope)
            if opts.bits and not within and opts.cache != "auto":
                warnings.warn(f"slim layer {i}: {cand.label} with int{opts.bits} rows has {cand.ratio:.1f}× the "
                              f"error of a plain int{opts.bits} K+V cache ({cand.error:.2e}); quantized keys are "
                              "amplified by cond(W_K) when V is rebuilt", stacklevel=3)
            lp = _layer_plan(i, cand.technique, cand.rank, d, e, dk, dtype, spec, opts.chunk)
            # only a technique the caller forced (cache="k"/"v"/"x") can miss the budget: nothing was decided by
            # it, so the plan states the measured error rather than a warning
            kind = "lossy" if opts.bits else ("exact" if within else f"approximate (cache={opts.cache!r})")
            exactness = f"{kind} in {_dname(dtype)}: {cand.ratio:.2f}× plain error"
            note = f"cond W_K {num.cond_k:.1e}, W_V {num.cond_v:.1e}"
            layers.append(LayerPlan(i, lp.technique, lp.bytes_per_token, None, exactness, cand.error, note,
                                    factory=lp.factory))
            if cand.weights is not None:
                weights[i] = cand.weights
        notes.append(f"error = relative Frobenius error vs float64 of what the layer rebuilds (V from K, K from V, "
                     f"K and V from X), measured on {n_tokens} calibration tokens ({source}); "
                     f"'exact' = measured within max({opts.budget:g}× the plain cache's error, {floor:g})")
        plan = Plan(self.name, shape.model_type, shape.family, _dname(dtype), tuple(layers),
                    2 * e * dtype.itemsize,
                    options={k: v for k, v in options.items() if k not in ("calibration_ids", "tokenizer")},
                    notes=tuple(notes))
        object.__setattr__(plan, "_slim_weights", weights)  # consumed by prepare()
        return plan

    def prepare(self, model, plan: Plan) -> None:
        if plan.family == "encoder-decoder":
            return ENCDEC.prepare(model, plan)
        weights = getattr(plan, "_slim_weights", None)
        if weights is None:
            raise ValueError("prepare() needs a plan from plan_model() (it carries the precomputed maps)")
        dev = next(model.parameters()).device
        kernel = plan.options.get("kernel", "auto")
        moved = {i: replace(weights_to_device(w, dev), kernel=kernel) for i, w in weights.items()}
        patch(model, ADAPTERS[model.config.model_type], moved)

    def restore(self, model) -> None:
        if getattr(model.config, "is_encoder_decoder", False):
            return ENCDEC.restore(model)
        adapter = ADAPTERS.get(getattr(model.config, "model_type", None))
        if adapter is not None:
            unpatch(model, adapter)

    def candidates(self, model, **options) -> list[list[Candidate]]:
        """Every measured option per layer (diagnostics; what the policy chose from)."""
        shape = self.check_model(model)
        opts = self.options(**options)
        adapter = ADAPTERS[shape.model_type]
        xs, rope, _, _ = _calibrate(model, adapter, opts)
        spec = StoreSpec(opts.bits, opts.group_size)
        out = []
        for i, attn in enumerate(adapter.attention_modules(model)):
            num = LayerNumerics(adapter.weights(attn), xs[i], shape.num_heads, shape.head_dim, rope, spec,
                                opts.rope_storage, opts.decode)
            row = [num.plain(), num.measure_k(0, opts.basis)]
            if not adapter.has_rope:
                row += [num.measure_v(), num.measure_x()]
            row += [num.measure_k(r, opts.basis) for r in rank_ladder(num.e, num.d, 8)]
            out.append(row)
        return out


def _dname(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _layer_plan(i: int, tech: str, r: int, d: int, e: int, dk: int, dtype, spec: StoreSpec, chunk: int) -> LayerPlan:
    suffix = f"+int{spec.bits}" if spec.bits else ""
    if tech == "kv":
        per_token = 2 * (e // dk) * spec.bytes_per_value_row(dk, dtype)
        return LayerPlan(i, "kv" + suffix, per_token,
                         factory=append_factory(spec, chunk))
    width = {"k": e + r, "v": e, "x": d}[tech]
    label = f"slim-{tech}" + (f"+r{r}" if r else "") + suffix
    return LayerPlan(i, label, spec.bytes_per_value_row(width, dtype),
                     factory=slim_factory(tech, width, spec, chunk))


def _calibration_ids(model, opts: SlimOptions) -> tuple[torch.Tensor, str]:
    ids, source = _calibration_ids_uncapped(model, opts)
    limit = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    return ids[:limit] if limit else ids, source


def _calibration_ids_uncapped(model, opts: SlimOptions) -> tuple[torch.Tensor, str]:
    vocab = model.config.vocab_size
    if opts.calibration_ids is not None:
        ids = torch.as_tensor(opts.calibration_ids).reshape(-1)
        if ids.numel() < 2 or int(ids.max()) >= vocab or int(ids.min()) < 0:
            raise ValueError(f"calibration_ids must hold ≥ 2 token ids in [0, {vocab})")
        return ids[:opts.max_calibration_tokens], "given ids"
    text = opts.calibration if opts.calibration is not None else default_calibration_text()
    if not isinstance(text, str) or not text.strip():
        raise ValueError("calibration must be a non-empty string")
    source = "given text" if opts.calibration is not None else "built-in text"
    tok = opts.tokenizer
    if tok is None:
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(model.config._name_or_path, local_files_only=True)
        except Exception:  # no local tokenizer (e.g. a model built from a config)
            tok = None
    if tok is not None:
        ids = torch.as_tensor(tok(text)["input_ids"]).reshape(-1)
        ids = ids[ids < vocab]
    else:
        ids, source = torch.tensor(list(text.encode("utf-8"))) % vocab, source + " as bytes mod vocab"
    return ids[:opts.max_calibration_tokens], source


@torch.no_grad()
def _calibrate(model, adapter, opts: SlimOptions):
    """Inputs (N, d) of every attention layer on the calibration tokens, in the model dtype, and RoPE tables."""
    ids, source = _calibration_ids(model, opts)
    modules = adapter.attention_modules(model)
    xs: list[torch.Tensor | None] = [None] * len(modules)
    rope: list = [None]

    def hook(i):
        def fn(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            xs[i] = x[0].detach()
            if adapter.has_rope and rope[0] is None:
                cos, sin = kwargs["position_embeddings"]
                rope[0] = (cos[0].detach().cpu(), sin[0].detach().cpu())
        return fn

    handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in enumerate(modules)]
    try:
        device = next(model.parameters()).device
        model(input_ids=ids[None].to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return [x.cpu() for x in xs], rope[0], int(ids.numel()), source


SLIM = SlimMethod()
