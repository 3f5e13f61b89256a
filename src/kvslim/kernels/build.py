"""Build and load kvslim's C++ ops (``torch.ops.kvslim.*``) with ``torch.utils.cpp_extension``.

Each op family is one C++ source under ``kernels/csrc/`` that registers its ops with
``TORCH_LIBRARY_FRAGMENT(kvslim, m)`` (schema) and ``TORCH_LIBRARY_IMPL(kvslim, CPU, m)`` (kernel); shared
SIMD helpers live in ``csrc/vec.h``. :func:`load_ops` compiles one family once into a cache directory keyed by
a hash of its sources, flags, compiler, CPU and torch version (``$KVSLIM_CACHE_DIR`` or ``~/.cache/kvslim``),
and loads it into the process.

A build folder belongs to its key, not to a checkout: the sources are copied into it (``src/``) and compiled
from there, so ``build.ninja`` names the cache's own paths, and a finished build is sealed by a stamp
(``.kvslim-built.json``: the shared object's name, size and SHA-256). A folder whose stamp is valid is loaded
without running the build tools at all, so two checkouts (or virtualenvs) of one commit share one build and
never rebuild each other's. A folder without a valid stamp (a killed build, a truncated or overwritten ``.so``)
is emptied and rebuilt, never loaded; a build that fails to load is deleted and rebuilt once. Without a working
compiler :func:`load_ops` returns ``False``; callers then use the op's pure-torch twin. A missing compiler or ninja
is reported once per process (one warning for every family), on the first CPU use: the C++ ops take CPU tensors
only, and a CUDA model never asks for them (its decode takes the Triton kernels, which need no C++ build).
``python -m kvslim.kernels.build`` builds every family ahead of time (the set-up does), so compile time never
falls inside a benchmark.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import platform
import re
import shutil
import sys
import threading
import warnings
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
#: compiler flags shared by every family; AVX-512 / AVX2 paths are chosen at run time inside the sources.
#: -fopenmp: ``at::parallel_for`` is an inline OpenMP region in torch's headers (ATen parallel backend OpenMP) and
#: runs on one thread without it; the GOMP symbols resolve to the libgomp torch already loaded (same soname).
CFLAGS = ("-O3", "-std=c++17", "-fno-math-errno", "-ffp-contract=fast", "-fopenmp")
_lock = threading.Lock()
_warned: set[str] = set()


def cache_root() -> Path:
    """Where builds are kept: ``$KVSLIM_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvslim``, else ``~/.cache/kvslim``."""
    root = os.environ.get("KVSLIM_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvslim"


def _cpu_tag() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor() + platform.machine()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.M)


def _closure(sources: list[Path]) -> set[Path]:
    """The sources and every local header they ``#include "..."``, transitively (system headers are covered by
    the compiler and torch versions in the key)."""
    seen: set[Path] = set()
    todo = list(sources)
    while todo:
        path = todo.pop()
        if path in seen or not path.exists():
            continue
        seen.add(path)
        todo += [(path.parent / m.decode()) for m in _INCLUDE.findall(path.read_bytes())]
    return seen


def _snapshot(sources: list[Path]) -> dict[str, bytes]:
    """The bytes of every file in the sources' closure, keyed by its path relative to the first source's folder
    (what gets hashed is what gets copied and compiled: an edit during a build cannot slip in between)."""
    root = sources[0].parent
    snap = {}
    for path in sorted(_closure(sources)):
        rel = os.path.relpath(path, root)
        if rel.startswith(".."):
            raise ValueError(f"kernel source {path} is outside {root}; local headers must live beside the sources")
        snap[rel] = path.read_bytes()
    return snap


def _key(name: str, sources: list[Path] | dict[str, bytes], cflags: tuple[str, ...]) -> str:
    """Hash of what the build depends on: the family's sources and the headers they include (another family's
    header edit does not rebuild this one), flags, compiler, CPU, Python and torch versions. Not the checkout's
    path: two checkouts of one commit share one build."""
    snap = sources if isinstance(sources, dict) else _snapshot(list(sources))
    h = hashlib.sha256()
    for part in (name, torch.__version__, sys.version, _compiler() or "", _cpu_tag(), *cflags):
        h.update(part.encode() + b"\0")
    for rel in sorted(snap):
        h.update(Path(rel).name.encode() + b"\0" + snap[rel])
    return h.hexdigest()[:16]


class ToolchainMissing(RuntimeError):
    """No C++ compiler or no ninja here: nothing can be built (a sealed build still loads)."""


#: the key of the one warning about a missing toolchain (every family shares it)
TOOLCHAIN = "toolchain"


def _toolchain_warning(what: str) -> str:
    return (f"kvslim: {what}: the C++ ops (CPU tensors only) cannot be built; CPU decode uses the pure-torch twins "
            "(CUDA tensors take the Triton kernels, which need no C++ build)")


def _ninja() -> bool:
    from torch.utils import cpp_extension

    return cpp_extension.is_ninja_available()


def _warn_once(name: str, message: str) -> None:
    if name not in _warned:
        _warned.add(name)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


@functools.cache
def load_ops(name: str, extra_cflags: tuple[str, ...] = ()) -> bool:
    """Compile (first call only, cached on disk) and load the op family ``csrc/{name}.cpp``.

    Returns ``True`` when its ops are registered under ``torch.ops.kvslim``, ``False`` (after one warning
    naming the family) when no compiler works; the caller falls back to the pure-torch twin.
    """
    if os.environ.get("KVSLIM_NO_KERNELS"):
        return False
    sources = [CSRC / f"{name}.cpp"]
    if not sources[0].exists():
        raise ValueError(f"no kernel source for op family {name!r} in {CSRC}")
    if _compiler() is None:
        _warn_once(TOOLCHAIN, _toolchain_warning("no C++ compiler found (g++, c++ or $CXX)"))
        return False
    cflags = CFLAGS + tuple(extra_cflags)
    snap = _snapshot(sources)
    build_dir = cache_root() / "ops" / f"{name}-{_key(name, snap, cflags)}"
    with _lock:
        for attempt in range(2):
            try:
                return _build_and_load(name, snap, cflags, build_dir)
            except ToolchainMissing as exc:
                _warn_once(TOOLCHAIN, _toolchain_warning(str(exc)))
                return False
            except Exception as exc:  # noqa: BLE001 - any failure of the toolchain or the loader
                shutil.rmtree(build_dir, ignore_errors=True)  # corrupt or stale: never trusted, rebuilt once
                if attempt == 1:
                    detail = str(exc).strip().splitlines()[-12:]
                    _warn_once(name, f"kvslim: could not build the {name} ops ({' | '.join(detail)}); "
                                     "using the pure-torch twin")
    return False


STAMP = ".kvslim-built.json"
_LOCKFILE = ".kvslim-build.lock"


def _build_and_load(name: str, snap: dict[str, bytes], cflags: tuple[str, ...], build_dir: Path) -> bool:
    build_dir.mkdir(parents=True, exist_ok=True)
    # one build per directory across processes: an OS lock, released even when its holder is killed. torch's own
    # file baton ("lock") is a plain file that a killed build leaves behind, after which every later load would
    # wait on it forever; holding our lock, nobody else is building here, so a leftover baton is stale.
    with open(build_dir / _LOCKFILE, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        so = sealed(build_dir)
        if so is not None:
            try:
                torch.ops.load_library(str(so))  # a finished build: no compiler, no ninja, nothing rebuilt
                return True
            except Exception:  # noqa: BLE001 - sealed but unloadable (e.g. torch changed under it): rebuild
                pass
        if not _ninja():  # torch's extension builder needs it: say so once, do not retry
            raise ToolchainMissing("ninja not found on PATH")
        _clear(build_dir)  # a killed or corrupt build is never loaded: start from an empty folder
        so = _compile(name, snap, cflags, build_dir)
        _seal(build_dir, so)
    return True


def sealed(build_dir: Path) -> Path | None:
    """The shared object of a finished build in ``build_dir``, or ``None`` when there is none or it is not the one
    the stamp names (missing, truncated, overwritten: the SHA-256 differs)."""
    try:
        stamp = json.loads((build_dir / STAMP).read_text())
        so = build_dir / stamp["so"]
        if so.parent != build_dir or so.stat().st_size != stamp["size"]:
            return None
        return so if _sha256(so) == stamp["sha256"] else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _clear(build_dir: Path) -> None:
    for entry in build_dir.iterdir():
        if entry.name == _LOCKFILE:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _seal(build_dir: Path, so: Path) -> None:
    stamp = {"so": so.name, "size": so.stat().st_size, "sha256": _sha256(so), "torch": torch.__version__}
    tmp = build_dir / f"{STAMP}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(stamp))
    os.replace(tmp, build_dir / STAMP)  # atomic: a reader sees no stamp or the whole stamp


def _compile(name: str, snap: dict[str, bytes], cflags: tuple[str, ...], build_dir: Path) -> Path:
    """Copy the sources into ``build_dir/src`` and build and load them from there (``build.ninja`` then names only
    the cache's paths). Returns the loaded shared object."""
    from torch.utils import cpp_extension

    src = build_dir / "src"
    for rel, data in snap.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    # cpp_extension runs ninja only when its in-process versioner sees new inputs: forget the entry, so that the
    # retry after a failed load (the build dir emptied) really rebuilds instead of loading nothing again
    versioner = getattr(cpp_extension, "JIT_EXTENSION_VERSIONER", None)
    if versioner is not None:
        versioner.entries.pop(f"kvslim_{name}", None)
    path = cpp_extension.load(name=f"kvslim_{name}", sources=[str(src / f"{name}.cpp")], extra_cflags=list(cflags),
                              extra_include_paths=[str(src)], build_directory=str(build_dir),
                              is_python_module=False, verbose=False)
    return Path(path)


def families() -> list[str]:
    """Names of every op family shipped in ``csrc/``."""
    return sorted(p.stem for p in CSRC.glob("*.cpp"))


def main() -> int:
    ok = True
    for name in families():
        built = load_ops(name)
        print(f"kvslim kernels: {name}: {'ok' if built else 'FAILED (pure-torch twin will be used)'}")
        ok &= built
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
