"""kvslim: smaller KV caches for Hugging Face transformers models, exact where the mathematics allows.

The public names are imported on first use (PEP 562), so that ``import kvslim`` (and ``kvslim --help``) does not
import torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ._version import __version__

#: public name -> the module defining it
_EXPORTS = {"apply": "api", "get_plan": "api", "make_cache": "api", "plan_config": "api", "restore": "api",
            "calibrate": "calibration", "calibrate_sparse": "calibration_sparse", "load_per_layer": "per_layer_file",
            "save_per_layer": "per_layer_file",
            "load_cache": "prompt_cache", "save_cache": "prompt_cache", "KVSlimCache": "caches", "METHODS": "methods", "LayerPlan": "plan", "Plan": "plan"}

__all__ = ["METHODS", "KVSlimCache", "LayerPlan", "Plan", "__version__", "apply", "calibrate", "calibrate_sparse",
           "get_plan", "load_cache", "load_per_layer", "make_cache", "plan_config", "restore", "save_cache", "save_per_layer"]

if TYPE_CHECKING:
    from .api import apply, get_plan, make_cache, plan_config, restore
    from .caches import KVSlimCache
    from .calibration import calibrate
    from .calibration_sparse import calibrate_sparse
    from .methods import METHODS
    from .per_layer_file import load_per_layer, save_per_layer
    from .plan import LayerPlan, Plan
    from .prompt_cache import load_cache, save_cache


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvslim' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
