"""Per-instance ``forward`` replacements that travel with their module.

``module.forward = BoundForward(fn, module, *extra)`` calls ``fn(module, *extra, *args, **kwargs)``. Unlike a
closure, it holds its module as an attribute, so ``copy.deepcopy`` of the model rebinds it to the copied module
(and copies ``extra``: precomputed weights), and ``pickle`` works when ``fn`` is a module-level function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class BoundForward:
    """``fn`` bound to ``module`` with extra leading arguments (what a patched attention needs)."""

    def __init__(self, fn: Callable[..., Any], module, *extra: Any):
        self.fn, self.module, self.extra = fn, module, extra

    def __call__(self, *args, **kwargs):
        return self.fn(self.module, *self.extra, *args, **kwargs)

    def __repr__(self) -> str:
        return f"BoundForward({self.fn.__module__}.{self.fn.__qualname__} on {type(self.module).__name__})"
