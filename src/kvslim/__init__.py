"""kvslim: smaller KV caches for Hugging Face transformers models, exact where the mathematics allows."""

from .api import apply, get_plan, make_cache, plan_config, restore
from .caches import KVSlimCache
from .methods import METHODS
from .plan import LayerPlan, Plan

__version__ = "0.1.0"

__all__ = ["METHODS", "KVSlimCache", "LayerPlan", "Plan", "__version__", "apply", "get_plan", "make_cache",
           "plan_config", "restore"]
