"""Registry of techniques: ``METHODS[name]`` is a :class:`~kvslim.methods.base.Method`."""

from .base import Method
from .mla import MLA
from .slim import SLIM
from .storage import DENSE, INT2, INT3, INT4, INT8, WINDOW
from .turbo import TURBO2, TURBO3, TURBO4

METHODS: dict[str, Method] = {m.name: m for m in (DENSE, WINDOW, INT8, INT4, INT3, INT2, MLA, SLIM, TURBO4, TURBO3,
                                                  TURBO2)}

__all__ = ["METHODS", "Method"]
