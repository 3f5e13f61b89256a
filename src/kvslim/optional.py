"""Optional peers that benchmarks compare against but kvslim itself never needs.

``importlib.util.find_spec("optimum.quanto")`` raises ``ModuleNotFoundError`` when ``optimum`` itself is absent (it
imports the parent package), so presence is checked by importing, once, here."""

from __future__ import annotations

import functools

QUANTO_INSTALL = "pip install --no-deps optimum-quanto==0.2.7"


@functools.cache
def quanto_missing() -> str | None:
    """``None`` when HF's quanto-backed ``QuantizedCache`` can run here, else why not (with the install command)."""
    try:
        import optimum.quanto  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means the peer is skipped, with its reason
        return f"optimum-quanto does not import ({type(e).__name__}: {e}); install it with `{QUANTO_INSTALL}`"
    return None
