"""Registry of techniques: ``METHODS[name]`` is a :class:`~kvslim.methods.base.Method`."""

from .base import Method
from .mla import MLA
from .storage import DENSE, INT4, INT8, WINDOW

METHODS: dict[str, Method] = {m.name: m for m in (DENSE, WINDOW, INT8, INT4)}
METHODS[MLA.name] = MLA
METHODS["slim"] = __import__(f"{__package__}.slim", fromlist=["SLIM"]).SLIM

__all__ = ["METHODS", "Method"]
