"""Helpers shared by the model loaders (one module per source format): content keys of large source files."""

from __future__ import annotations

import hashlib
from pathlib import Path


def fingerprint(paths: list[Path], salt: bytes) -> str:
    """Content key of ``paths``: sizes plus the first and last MiB of each (fast on 100+ MB files), salted by the
    converter's name and version so that a changed conversion gets a new cache folder."""
    h = hashlib.sha256(salt)
    for p in paths:
        size = p.stat().st_size
        h.update(str(size).encode())
        with p.open("rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]
