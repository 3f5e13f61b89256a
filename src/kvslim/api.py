"""Public entry points: ``apply``, ``make_cache``, ``restore``, ``plan_config``."""

from __future__ import annotations

import torch
import transformers
from packaging.version import Version

from .adapters.generate import STATE, AppliedState, check_model_class
from .adapters.shape import shape_from_config
from .caches import KVSlimCache
from .methods import METHODS
from .methods.base import parse_dtype
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
    if method not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {method!r}")
    return METHODS[method]


def apply(model: torch.nn.Module, method: str, **options) -> Plan:
    """Prepare ``model`` in place for ``method`` and return its printable per-layer plan.

    After this, ``model.generate(...)`` builds a fresh kvslim cache for each call (each decoder pass) unless a
    ``past_key_values`` is passed, ``use_cache=False`` or a ``cache_implementation`` is asked for (see
    :mod:`kvslim.adapters.generate`: HF's own cache hook, no wrapper around ``generate``). A previous ``apply``
    is undone first. On a ``ValueError`` (unknown method, unsupported model, bad option) the model is left
    exactly as it was.
    """
    check_transformers()
    m = _method(method)
    plan = m.plan_model(model, **options)  # validates; changes nothing
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
    """The plan applied to ``model``, or ``None``."""
    state = vars(model).get(STATE)
    return state.plan if isinstance(state, AppliedState) else None


def make_cache(model: torch.nn.Module, max_length: int | None = None) -> KVSlimCache:
    """A ``transformers.Cache`` for the plan applied to ``model`` (a dense kvslim cache if none).

    Args:
        model: a Hugging Face model, optionally prepared by :func:`apply`.
        max_length: total tokens (prompt + new) to preallocate for; ``None`` grows in chunks.
    """
    if max_length is not None and (not isinstance(max_length, int) or max_length <= 0):
        raise ValueError(f"max_length must be a positive int or None, got {max_length!r}")
    plan = get_plan(model) or METHODS["dense"].plan_model(model)
    if hasattr(plan, "make_cache"):  # plans with their own cache class (encoder-decoder slim attention)
        return plan.make_cache(max_length)
    cache = KVSlimCache([lp.factory(max_length) for lp in plan.layers], plan=plan)
    if _fused_attention(model, plan):
        cache.enable_fused_decode()
    return cache


def _fused_attention(model: torch.nn.Module, plan: Plan) -> bool:
    """Whether ``model`` runs kvslim's attention (which reads int8/int4/int2 codes directly) and the method's op
    is built."""
    from .adapters.sdpa import NAME
    from .kernels import quant_decode, quant_decode_lowbit

    if getattr(model.config, "_attn_implementation", None) != NAME:
        return False
    if plan.method == "int2":
        return quant_decode_lowbit.available()
    return plan.method in ("int8", "int4") and quant_decode.available()


def plan_config(config, method: str, dtype: str | torch.dtype = "bfloat16", **options) -> Plan:
    """Plan ``method`` for an HF config without loading weights (what ``kvslim plan`` prints)."""
    m = _method(method)
    shape = shape_from_config(config)
    reason = m.not_applicable(shape)
    if reason:
        raise ValueError(f"method {method!r} does not apply to this {shape.model_type} model: {reason}")
    return m.plan(shape, parse_dtype(dtype), **options)
