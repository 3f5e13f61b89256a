"""Public entry points: ``apply``, ``make_cache``, ``restore``, ``plan_config``."""

from __future__ import annotations

import functools

import torch

from .adapters.shape import shape_from_config
from .caches import KVSlimCache
from .methods import METHODS
from .methods.base import parse_dtype
from .plan import Plan

_STATE = "_kvslim_state"


def _method(method: str):
    if method not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {method!r}")
    return METHODS[method]


def apply(model: torch.nn.Module, method: str, **options) -> Plan:
    """Prepare ``model`` in place for ``method`` and return its printable per-layer plan.

    After this, ``model.generate(...)`` uses a kvslim cache unless a ``past_key_values`` is passed.
    A previous ``apply`` is undone first. On a ``ValueError`` (unknown method, unsupported model, bad option)
    the model is left exactly as it was.
    """
    m = _method(method)
    plan = m.plan_model(model, **options)  # validates; changes nothing
    restore(model)
    m.prepare(model, plan)
    setattr(model, _STATE, plan)
    original = type(model).generate.__get__(model)

    @functools.wraps(original)
    def generate(*args, **kwargs):
        if kwargs.get("past_key_values") is None:
            cache = make_cache(model, max_length=_max_length(args, kwargs, model))
            if _unpadded(args, kwargs, model) and hasattr(cache, "declare_unpadded"):
                cache.declare_unpadded()
            kwargs["past_key_values"] = cache
        return original(*args, **kwargs)

    model.generate = generate
    return plan


def restore(model: torch.nn.Module) -> None:
    """Undo :func:`apply` (no-op for a model that was never applied)."""
    plan = getattr(model, _STATE, None)
    if plan is None:
        return
    METHODS[plan.method].restore(model)
    delattr(model, _STATE)
    if "generate" in vars(model):
        del model.generate


def get_plan(model: torch.nn.Module) -> Plan | None:
    """The plan applied to ``model``, or ``None``."""
    return getattr(model, _STATE, None)


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
    return KVSlimCache([lp.factory(max_length) for lp in plan.layers], plan=plan)


def plan_config(config, method: str, dtype: str | torch.dtype = "bfloat16", **options) -> Plan:
    """Plan ``method`` for an HF config without loading weights (what ``kvslim plan`` prints)."""
    m = _method(method)
    shape = shape_from_config(config)
    reason = m.not_applicable(shape)
    if reason:
        raise ValueError(f"method {method!r} does not apply to this {shape.model_type} model: {reason}")
    return m.plan(shape, parse_dtype(dtype), **options)


def _unpadded(args, kwargs, model) -> bool:
    """True when no prompt of this ``generate`` call is padded (so no position will ever be masked)."""
    mask = kwargs.get("attention_mask")
    if mask is not None:
        return bool(mask.bool().all())
    ids = kwargs.get("input_ids", args[0] if args else None)
    gc = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    pad = kwargs.get("pad_token_id", getattr(gc, "pad_token_id", None))
    return isinstance(ids, torch.Tensor) and (pad is None or not bool((ids == pad).any()))


def _max_length(args, kwargs, model) -> int | None:
    ids = kwargs.get("input_ids", args[0] if args else None)
    new = kwargs.get("max_new_tokens")
    if ids is None or new is None:
        gc = kwargs.get("generation_config") or getattr(model, "generation_config", None)
        new = new if new is not None else getattr(gc, "max_new_tokens", None)
        if ids is None or new is None:
            return None
    return int(ids.shape[-1]) + int(new)
