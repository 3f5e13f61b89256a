"""How ``model.generate`` gets a kvslim cache: HF's own cache decision, read from the model it runs on.

Hugging Face builds the cache of a ``generate`` call in ``GenerationMixin._prepare_cache_for_generation`` (once per
call: Whisper's several decoder passes per call each get a fresh one). kvslim replaces that one method, once, on
``GenerationMixin``; the replacement reads the applied plan from ``self`` and changes nothing for any model that
has none. HF's own arguments keep their meaning:

* ``past_key_values=`` given: HF's path, that cache is used;
* ``use_cache=False``: no cache at all;
* ``cache_implementation=`` given: HF builds the cache asked for (kvslim steps aside for that call, with a
  warning); the patched attention of ``slim``/``mla`` falls back to the model's own on a non-kvslim cache;
* otherwise: a fresh kvslim cache sized for ``max_length``.

Nothing is stored on the instance but the plan (no closure over the model), so ``copy.deepcopy`` and ``pickle``
of an applied model keep working and the copy builds its caches from its own plan.

This module holds what ``kvslim.apply`` leaves on a model (:class:`AppliedState`, read by :func:`applied_plan`)
and the plan -> cache step (:func:`build_cache`): the hook needs both, and ``kvslim.api`` imports them from here
(the hook never imports the public API: no import circle). The state and the hook share this module because
unpickling a state must install the hook.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from transformers.generation.utils import GenerationMixin

from ..caches import KVSlimCache
from .compat import CACHE_KW

STATE = "_kvslim_state"
_ORIGINAL: dict[str, Callable[..., Any]] = {}


class AppliedState:
    """What ``kvslim.apply`` leaves on a model: its plan. Unpickling one re-installs the generate hook."""

    def __init__(self, plan):
        self.plan = plan
        install()

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        install()

    def __repr__(self) -> str:
        return f"AppliedState({self.plan.method} on {self.plan.model_type})"


def applied_plan(model):
    """The plan :func:`kvslim.apply` left on ``model`` (any object), or ``None``."""
    state = getattr(model, "__dict__", {}).get(STATE)
    return state.plan if isinstance(state, AppliedState) else None


def build_cache(model, plan, max_length: int | None) -> KVSlimCache:
    """A fresh cache for ``plan`` on ``model``: ``[lp.factory(max_length) for lp in plan.layers]``, or the plan's
    own cache class (encoder-decoder slim attention); fused decode on when ``model`` runs kvslim's attention and
    the method's op is built."""
    if hasattr(plan, "make_cache"):
        return plan.make_cache(max_length)
    cache = KVSlimCache([lp.factory(max_length) for lp in plan.layers], plan=plan)
    if getattr(model.config, "_attn_implementation", None) == "kvslim_sdpa":  # adapters/sdpa.NAME
        cache.enable_column_attention()
        cache.enable_sparse_decode()
    if _fused_attention(model, plan):
        cache.enable_fused_decode()
    return cache


def _fused_attention(model, plan) -> bool:
    """Whether ``model`` runs kvslim's attention (which reads int8/int4/int3/int2/turbo codes directly) and the
    method's kernel runs where the model's weights are: Triton on CUDA (the C++ build is not needed there), the C++
    op on CPU (built on first use; without a compiler the twin runs, reported once)."""
    # loaded only when a cache is built
    from ..kernels import backend, quant_decode, quant_decode_lowbit, turbo_decode
    from .sdpa import NAME

    if getattr(model.config, "_attn_implementation", None) != NAME:
        return False
    if plan.method.startswith("turbo"):
        family = turbo_decode
    elif plan.method in ("int2", "int3"):
        family = quant_decode_lowbit
    elif plan.method in ("int8", "int4"):
        family = quant_decode
    else:
        return False
    return backend.decode_kernel_runs(_device_type(model), family.available)


def _device_type(model) -> str:
    """The device type of ``model``'s first parameter (``"cpu"`` without parameters)."""
    param = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    return "cpu" if param is None else param.device.type


def install() -> None:
    """Put :func:`prepare_cache_for_generation` on ``GenerationMixin`` (idempotent)."""
    current = GenerationMixin.__dict__["_prepare_cache_for_generation"]
    if current is prepare_cache_for_generation:
        return
    _ORIGINAL["prepare"] = current
    GenerationMixin._prepare_cache_for_generation = prepare_cache_for_generation


def check_model_class(model) -> None:
    """``ValueError`` when ``model``'s class decides its cache by its own ``_prepare_cache_for_generation``."""
    install()
    if type(model)._prepare_cache_for_generation is not prepare_cache_for_generation:
        raise ValueError(f"{type(model).__name__} builds its generate cache its own way "
                         "(_prepare_cache_for_generation is overridden): kvslim cannot plug into it")


def prepare_cache_for_generation(self, generation_config, model_kwargs: dict, generation_mode, batch_size: int,
                                 max_cache_length: int):
    """HF's ``_prepare_cache_for_generation``; a model applied by kvslim gets a fresh kvslim cache instead of
    HF's default ``DynamicCache``/``EncoderDecoderCache`` (see the module docstring for when it steps aside)."""
    original = _ORIGINAL["prepare"]
    state = self.__dict__.get(STATE)
    args = (generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)
    if (not isinstance(state, AppliedState) or model_kwargs.get(CACHE_KW) is not None
            or generation_config.use_cache is False or not self._supports_default_dynamic_cache()):
        return original(self, *args)
    if generation_config.cache_implementation is not None:
        warnings.warn(f"cache_implementation={generation_config.cache_implementation!r} was asked for: this "
                      f"generate call uses that Hugging Face cache, not kvslim's {state.plan.method!r} cache",
                      stacklevel=3)
        return original(self, *args)
    cache = build_cache(self, state.plan, max_cache_length + 1)
    mask = model_kwargs.get("attention_mask")
    if not self.config.is_encoder_decoder and (mask is None or bool(mask.bool().all())):
        cache.declare_unpadded()  # no position will ever be masked: ring layers may read in slot order
    model_kwargs[CACHE_KW] = cache
    if generation_config.is_assistant:
        cache.activate_past_recording()
