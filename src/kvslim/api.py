"""Public entry points: ``apply``, ``make_cache``, ``restore``, ``plan_config``."""

from __future__ import annotations

import torch
import transformers
from packaging.version import Version

from .adapters.generate import STATE, AppliedState, applied_plan, build_cache, check_model_class
from .adapters.shape import shape_from_config
from .caches import KVSlimCache
from .methods import METHODS
from .methods.base import NotApplicable, parse_dtype
from .plan import Plan

#: the transformers releases kvslim accepts, [low, high), as pyproject pins them. The suite runs on 5.23 and 5.24
#: (5.24 renamed the attention forwards' ``past_key_values`` argument to ``cache``, adapters/compat.py); releases
#: before 5.23 are accepted untested.
TRANSFORMERS_RANGE = ("5.0", "5.25")


def check_transformers(version: str | None = None) -> None:
    """``RuntimeError`` when the installed transformers (or ``version``) is outside :data:`TRANSFORMERS_RANGE`:
    kvslim patches attention modules and ``generate``'s cache hook, whose arguments change between releases (5.24
    renamed the cache argument), so a newer release could miss the cache (an error, or wrong tokens)."""
    version = transformers.__version__ if version is None else version
    low, high = TRANSFORMERS_RANGE
    if not Version(low) <= Version(version) < Version(high):
        raise RuntimeError(f"kvslim supports transformers >= {low}, < {high}; this is transformers {version}. "
                           f"Install a supported release (pip install 'transformers>={low},<{high}'): kvslim "
                           "patches attention modules whose arguments change between releases. Nothing was changed.")


def _method(method: str):
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {method!r}")
    return METHODS[method]


GENERATION_MODEL = "a transformers PreTrainedModel with a generation head (e.g. LlamaForCausalLM)"


def check_model(model, expected: str = GENERATION_MODEL) -> None:
    """``ValueError`` unless ``model`` is a ``transformers.PreTrainedModel``, saying what was passed instead
    (``expected``: how the message names what the caller needs)."""
    from transformers import PreTrainedModel

    if isinstance(model, str):
        raise ValueError(f"model must be {expected}; got the string {model!r}: load the model first, e.g. "
                         f"AutoModelForCausalLM.from_pretrained({model!r})")
    if not isinstance(model, PreTrainedModel):
        raise ValueError(f"model must be {expected}; got {_describe(model)}")


def check_generation_head(model) -> None:
    """``ValueError`` unless ``model`` (a ``PreTrainedModel``) can ``generate``: :func:`apply` plugs into the cache
    ``generate`` builds; a base model (``LlamaModel``) is a common mistake for the ``LlamaForCausalLM`` holding it."""
    if not model.can_generate():
        raise ValueError(f"model must be {GENERATION_MODEL}; got {type(model).__name__}, a model without a "
                         "generation head (pass the *ForCausalLM / *ForConditionalGeneration model that holds it)")


def _describe(obj) -> str:
    return "None" if obj is None else f"a {type(obj).__module__}.{type(obj).__qualname__}"


def _plan_model(m, model, **options) -> Plan:
    """``m.plan_model``; a refusal for the model's shape names the methods that do apply."""
    from .methods import sparse_options
    from .methods.storage import StorageMethod

    asked = [k for k in sparse_options.SPARSE_OPTIONS if k in options]
    if asked and not isinstance(m, StorageMethod):
        raise ValueError(f"{asked[0]}: method {m.name!r} cannot decode sparsely (sparse decode pages an append-only "
                         "K+V cache: dense, int8, int4, int3, int2, turbo4/3/2; slim's K-/X-only rows and MLA's "
                         "latent rows are not scored yet, docs/sparse.md)")
    try:
        return m.plan_model(model, **options)
    except NotApplicable as e:
        working = [name for name, other in METHODS.items() if other.supports(e.shape)]
        raise NotApplicable(f"{e} (methods that apply to {e.shape.model_type}: {', '.join(working) or 'none'})",
                            e.shape) from None


def apply(model: torch.nn.Module, method: str, **options) -> Plan:
    """Prepare ``model`` in place for ``method`` and return its printable per-layer plan.

    After this, ``model.generate(...)`` builds a fresh kvslim cache for each call (each decoder pass) unless a
    ``past_key_values`` is passed, ``use_cache=False`` or a ``cache_implementation`` is asked for (see
    :mod:`kvslim.adapters.generate`: HF's own cache hook, no wrapper around ``generate``). A previous ``apply``
    is undone first. On a ``ValueError`` (unknown method, unsupported model, bad option) the model is left
    exactly as it was.
    """
    check_transformers()
    check_model(model)
    m = _method(method)
    plan = _plan_model(m, model, **options)  # validates; changes nothing
    check_generation_head(model)  # after the plan: an unsupported model_type is the better reason
    check_model_class(model)
    restore(model)
    m.prepare(model, plan)
    setattr(model, STATE, AppliedState(plan))
    return plan


def restore(model: torch.nn.Module) -> None:
    """Undo :func:`apply` (no-op for a model that was never applied)."""
    plan = get_plan(model)
    if plan is None:
        return
    METHODS[plan.method].restore(model)
    delattr(model, STATE)


def get_plan(model: torch.nn.Module) -> Plan | None:
    """The plan applied to ``model``, or ``None`` (also for an object that is not a model)."""
    return applied_plan(model)


def make_cache(model: torch.nn.Module, max_length: int | None = None, capturable: bool = False) -> KVSlimCache:
    """A ``transformers.Cache`` for the plan applied to ``model`` (a dense kvslim cache if none).

    Args:
        model: a Hugging Face model (a ``PreTrainedModel``), optionally prepared by :func:`apply`.
        max_length: total tokens (prompt + new) to preallocate for; ``None`` grows in chunks. With it, append
            layers (dense, int8, per-token int4/int3/int2) keep capacity-sized buffers and their length on the
            device: a step under ``torch.compile`` or a CUDA graph has the same shapes at every length
            (``caches/capture.py``); eager steps are unchanged.
        capturable: every step (eager too) takes that static path and ``is_compileable`` is ``True``, as with HF's
            ``StaticCache`` (HF's ``generate`` compile path); needs ``max_length``. The int4/int3/int2 and turbo
            defaults (sinks, residual window, KIVI keys, turbo codes) are capturable only so: their window becomes a
            ring flushed on the device, what the first coded write fits (turbo channel means and outlier channels,
            smoothed keys' factors) is fitted by the eager prefill (``caches/capture_residual.py``). Sparse decode
            (``sparse_budget``) runs there too, its page choice made on the device (docs/sparse.md, "Captured
            steps"); ``sparse_select="prompt"`` is refused with it.
    """
    if max_length is not None and (not isinstance(max_length, int) or isinstance(max_length, bool)
                                   or max_length <= 0):
        raise ValueError(f"max_length must be a positive int or None, got {max_length!r}")
    if not isinstance(capturable, bool):
        raise ValueError(f"capturable must be True or False, got {capturable!r}")
    if capturable and max_length is None:
        raise ValueError("capturable=True needs max_length (the buffers a CUDA graph replays are fixed)")
    plan = get_plan(model)
    if plan is None:
        check_model(model, "a transformers PreTrainedModel (e.g. LlamaForCausalLM)")
        plan = _plan_model(METHODS["dense"], model)
    cache = build_cache(model, plan, max_length)
    if capturable:
        cache.set_capturable(True)
    return cache


def plan_config(config, method: str, dtype: str | torch.dtype = "bfloat16", **options) -> Plan:
    """Plan ``method`` for an HF config without loading weights (what ``kvslim plan`` prints). Refuses what
    :func:`apply` would refuse for that config's model, its ``model_type`` included."""
    m = _method(method)
    shape = shape_from_config(config)
    reason = m.not_applicable(shape)
    if reason:
        raise ValueError(f"method {method!r} does not apply to this {shape.model_type} model: {reason}")
    if not m.supports(shape):  # its model_type (a method with its own adapters checks them in not_applicable)
        raise ValueError(f"method {method!r} does not support model_type {shape.model_type!r} (apply() refuses it); "
                         f"supported: {', '.join(m.model_types)}")
    return m.plan(shape, parse_dtype(dtype), **options)
