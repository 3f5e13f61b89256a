"""Optional accelerated kernels; each has a pure-torch twin in ``attention/`` and is tested against it."""

from __future__ import annotations

import importlib

#: the op families a method's decode steps may call (kernels/<family>.py; ``quant_write``: symmetric int8/int4
#: stores); the others never run for it
FAMILIES = {"slim": ("slim_decode", "encdec_decode"), "int8": ("quant_decode", "quant_write"),
            "int4": ("quant_decode", "quant_write"), "int3": ("quant_decode_lowbit",), "int2": ("quant_decode_lowbit",),
            **{f"turbo{b}": ("turbo_decode",) for b in (2, 3, 4)}}


def load_for(method: str) -> None:
    """Build (once per machine, cached; minutes on first use) and load the op families ``method`` decodes with,
    now: before a timing, so that neither lands inside it. A method without ops does nothing; no compiler: each
    family warns once and its twin runs."""
    for family in FAMILIES.get(method, ()):
        importlib.import_module(f"{__name__}.{family}").available()
