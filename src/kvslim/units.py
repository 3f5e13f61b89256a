"""Byte counts as a person reads them: ``human_bytes(17179869184) == "16.0 GiB"`` (binary units, three significant
figures). Every table kvslim prints (``kvslim plan``, ``kvslim demo``, ``kvslim bench``, ``kvslim transcribe``)
formats bytes with it; the exact integer count stays in the ``--json`` output and the JSON records.
"""

from __future__ import annotations

UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def human_bytes(n: int | float | None) -> str:
    """``n`` bytes in the largest binary unit that keeps the figure at least 1: ``"512 B"``, ``"1.50 KiB"``,
    ``"37.5 MiB"``, ``"16.0 GiB"`` (two decimals below 10, one below 100, none above); ``"-"`` for ``None``.
    ``ValueError`` for a negative or non-finite count."""
    if n is None:
        return "-"
    if isinstance(n, bool) or not isinstance(n, (int, float)) or n != n or n in (float("inf"), float("-inf")):
        raise ValueError(f"n must be a finite number of bytes, got {n!r}")
    if n < 0:
        raise ValueError(f"n must be a non-negative number of bytes, got {n!r}")
    if round(n) < 1024:
        return f"{round(n)} B"
    value, unit = n / 1024, 1  # n >= 1023.5 here
    while value >= 1024 and unit < len(UNITS) - 1:
        value /= 1024
        unit += 1
    if round(value, 2) >= 1024 and unit < len(UNITS) - 1:  # 1023.999 KiB would print as "1024 KiB"
        value, unit = value / 1024, unit + 1
    # two decimals below 10, one below 100, none above -- judged on the rounded figure (9.999 prints "10.0")
    digits = 2 if round(value, 2) < 10 else 1 if round(value, 1) < 100 else 0
    return f"{value:.{digits}f} {UNITS[unit]}"
