"""Helpers shared by the model loaders (one module per source format): content keys of large source files,
publishing a converted folder atomically, and one converter at a time per folder."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def publish_dir(out: Path) -> Iterator[Path]:
    """Write a folder atomically: yields a fresh temporary folder beside ``out`` (same file system); when the block
    ends normally it replaces ``out`` (an older ``out`` is removed first), and when it raises the temporary folder is
    removed and ``out`` is left as it was. Readers never see a half-written ``out``."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def converting(out: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``out`` for the block, so that processes converting the same folder at
    once (two CLI runs, pytest-xdist workers) take turns: the caller checks again inside the block and finds the first
    one's folder instead of converting again and replacing it while the first one reads it. The lock file lives in the
    system's temporary folder, named by a hash of ``out``'s absolute path (the cache folder holds only conversions).
    Without ``fcntl`` (not POSIX) the block runs unlocked."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    key = hashlib.sha256(str(Path(out).resolve()).encode()).hexdigest()[:16]
    with open(Path(tempfile.gettempdir()) / f"kvslim-convert-{key}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
