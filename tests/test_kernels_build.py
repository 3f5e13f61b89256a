"""kernels/build.py: a corrupt or stale build in the cache is deleted and rebuilt, never trusted; a build that
cannot be made falls back to the twin with one warning."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from kvslim.kernels import build


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty cache directory and a cleared in-process memo (restored afterwards)."""
    monkeypatch.setenv("KVSLIM_CACHE_DIR", str(tmp_path))
    build.load_ops.cache_clear()
    yield tmp_path
    build.load_ops.cache_clear()


def test_failed_load_deletes_the_build_and_rebuilds_once(fresh, monkeypatch):
    calls = []

    def flaky(name, sources, cflags, build_dir):
        calls.append(build_dir)
        if len(calls) == 1:  # what a corrupt .so does: the loader raises; leave junk behind like a real build
            (build_dir / "kvslim_x.so").write_bytes(b"not an ELF file")
            raise OSError("invalid ELF header")
        assert not any(build_dir.iterdir()), "the corrupt build was reused instead of deleted"
        return True

    monkeypatch.setattr(build, "_build_and_load", lambda *a: (a[3].mkdir(parents=True, exist_ok=True), flaky(*a))[1])
    assert build.load_ops("encdec_decode", ("-DKVSLIM_TEST_REBUILD",)) is True
    assert len(calls) == 2 and calls[0] == calls[1] and calls[0].parent == fresh / "ops"


def test_build_that_keeps_failing_warns_once_and_falls_back(fresh, monkeypatch):
    def broken(name, sources, cflags, build_dir):
        build_dir.mkdir(parents=True, exist_ok=True)
        raise RuntimeError("Error building extension\nundefined reference to something")

    monkeypatch.setattr(build, "_build_and_load", broken)
    build._warned.discard("encdec_decode")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert build.load_ops("encdec_decode", ("-DKVSLIM_TEST_BROKEN",)) is False
        assert build.load_ops("encdec_decode", ("-DKVSLIM_TEST_BROKEN",)) is False  # memoised: no second warning
    msgs = [str(w.message) for w in caught if "encdec_decode" in str(w.message)]
    assert len(msgs) == 1 and "twin" in msgs[0] and "undefined reference" in msgs[0]
    assert not any((fresh / "ops").iterdir()), "a failed build was left in the cache"


def test_key_changes_with_sources_and_flags(tmp_path, monkeypatch):
    src = build.CSRC / "encdec_decode.cpp"
    a = build._key("encdec_decode", [src], build.CFLAGS)
    assert build._key("encdec_decode", [src], (*build.CFLAGS, "-DX")) != a
    copy = tmp_path / "encdec_decode.cpp"
    copy.write_bytes(src.read_bytes() + b"\n// edited\n")
    assert build._key("encdec_decode", [copy], build.CFLAGS) != a  # an edited source is a new build, not a stale one


def test_unknown_family_is_refused_by_name():
    with pytest.raises(ValueError, match="no_such_family"):
        build.load_ops("no_such_family")


def _copy_of_cached_build(cache: Path) -> Path:
    """A copy, under cache/ops, of this machine's real encdec_decode build (skips when it cannot be built)."""
    from kvslim.kernels import encdec_decode

    if not encdec_decode.available():
        pytest.skip("the op cannot be built here")
    key = build._key("encdec_decode", [build.CSRC / "encdec_decode.cpp"], build.CFLAGS)
    good = build.cache_root() / "ops" / f"encdec_decode-{key}"
    if not good.is_dir():
        pytest.skip("no cached build of encdec_decode to copy")
    copy = cache / "ops" / good.name
    shutil.copytree(good, copy, ignore=shutil.ignore_patterns("lock", ".kvslim-build.lock"))
    return copy


@pytest.mark.skipif(build._compiler() is None, reason="no C++ compiler")
def test_corrupt_shared_object_on_disk_is_rebuilt(tmp_path):
    """A real build dir whose .so was overwritten with garbage (ninja would call it up to date): a fresh process
    loads it, fails, deletes it, rebuilds, and the op then computes the right thing."""
    bad = _copy_of_cached_build(tmp_path)
    so = next(bad.glob("*.so"))
    so.write_bytes(b"\x7fELF corrupt" + os.urandom(64))
    script = textwrap.dedent("""
        import torch
        from kvslim.kernels import build, encdec_decode as ek
        assert build.load_ops("encdec_decode") is True
        qt, enc = torch.randn(2, 3, 16), torch.randn(2, 40, 16)
        u, _ = torch.ops.kvslim.encdec_decode(qt, enc, None, None, 0.5, 0)
        ref, _ = ek.reference(qt, enc, None, None, 0.5)
        assert torch.allclose(u, ref, rtol=1e-5, atol=1e-6), (u - ref).abs().max()
        print("rebuilt-ok")
    """)
    env = {**os.environ, "KVSLIM_CACHE_DIR": str(tmp_path)}
    env.pop("KVSLIM_NO_KERNELS", None)
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "rebuilt-ok" in res.stdout, res.stderr[-2000:]
    assert next(bad.glob("*.so")).read_bytes()[:4] == b"\x7fELF" and next(bad.glob("*.so")).stat().st_size > 10_000


def test_key_follows_included_headers_only(tmp_path):
    """A family's key covers the headers it includes (transitively), not every header in csrc/."""
    (tmp_path / "fam.cpp").write_text('#include "a.h"\n#include <vector>\nint f();\n')
    (tmp_path / "a.h").write_text('#pragma once\n#include "b.h"\n')
    (tmp_path / "b.h").write_text("// b\n")
    (tmp_path / "other.h").write_text("// another family's header\n")
    src = [tmp_path / "fam.cpp"]
    assert build._closure(src) == {tmp_path / n for n in ("fam.cpp", "a.h", "b.h")}
    key = build._key("fam", src, build.CFLAGS)
    (tmp_path / "other.h").write_text("// edited\n")
    assert build._key("fam", src, build.CFLAGS) == key
    (tmp_path / "b.h").write_text("// b edited\n")
    assert build._key("fam", src, build.CFLAGS) != key  # an included header's edit is a new build


@pytest.mark.skipif(build._compiler() is None, reason="no C++ compiler")
def test_stale_torch_baton_left_by_a_killed_build_does_not_hang_the_next_load(tmp_path):
    """torch's file baton ("lock") left in a build dir by a killed process: the next load removes it under kvslim's
    OS lock and loads, instead of waiting forever."""
    stale = _copy_of_cached_build(tmp_path)
    (stale / "lock").write_text("")
    script = "from kvslim.kernels import build; assert build.load_ops('encdec_decode') is True; print('loaded-ok')"
    env = {**os.environ, "KVSLIM_CACHE_DIR": str(tmp_path)}
    env.pop("KVSLIM_NO_KERNELS", None)
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "loaded-ok" in res.stdout, res.stderr[-2000:]
    assert not (stale / "lock").exists()


def test_load_for_builds_exactly_the_families_a_method_decodes_with(monkeypatch):
    """``kernels.load_for(method)`` (called by the demo and ``kvslim transcribe`` before they time anything) loads the
    method's op families and no others; every family it names is a real kernels module."""
    import importlib

    from kvslim import kernels

    calls = []
    families = {f for fams in kernels.FAMILIES.values() for f in fams}
    for family in families:
        mod = importlib.import_module(f"kvslim.kernels.{family}")
        monkeypatch.setattr(mod, "available", lambda family=family: calls.append(family) or True)
    kernels.load_for("int4")
    assert calls == ["quant_decode", "quant_write"]
    calls.clear()
    kernels.load_for("slim")
    assert sorted(calls) == ["encdec_decode", "slim_decode"]
    calls.clear()
    kernels.load_for("dense")
    assert calls == []


# --- two checkouts of one commit against one cache folder ------------------------------------------------------

# no torch headers: a compile takes a fraction of a second (``load_ops`` only needs a shared object to load)
_TINY_CPP = """#include "tiny_factor.h"
extern "C" int kvslim_buildtest_twice(int x) { return x * TINY_FACTOR; }
"""

_LOADER = """
import ctypes, importlib.util, os, sys
spec = importlib.util.spec_from_file_location("kvslim_build_copy", sys.argv[1])
build = importlib.util.module_from_spec(spec); spec.loader.exec_module(build)
assert build.load_ops("tinyfam") is True
(so,) = (build.cache_root() / "ops").glob("tinyfam-*/*.so")
assert ctypes.CDLL(str(so)).kvslim_buildtest_twice(21) == 42
print("loaded-ok")
"""


def _checkout(root: Path) -> Path:
    """A copy of build.py with its own csrc/ holding one tiny op family (and a local header it includes)."""
    kernels = root / "kvslim" / "kernels"
    (kernels / "csrc").mkdir(parents=True)
    shutil.copy(Path(build.__file__), kernels / "build.py")
    (kernels / "csrc" / "tinyfam.cpp").write_text(_TINY_CPP)
    (kernels / "csrc" / "tiny_factor.h").write_text("#pragma once\n#define TINY_FACTOR 2\n")
    return kernels / "build.py"


@pytest.mark.skipif(build._compiler() is None, reason="no C++ compiler")
def test_two_checkouts_share_one_build_and_never_rebuild_each_other(tmp_path):
    """Two checkouts of one commit (two source roots) against one cache folder, loading at the same time and then
    in turn: one compile in all. A compiler wrapper counts the compiles (``-c`` invocations), so the count does not
    depend on how build.py decides. Then a truncated ``.so`` (sealed build overwritten) is rebuilt, never loaded."""
    a, b = _checkout(tmp_path / "a"), _checkout(tmp_path / "b")
    real = build._compiler()
    count = tmp_path / "compiles"
    wrapper = tmp_path / "bin" / "g++"  # named g++ so torch accepts it without a warning
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\ncase " $* " in *" -c "*) echo x >> "{count}";; esac\nexec "{real}" "$@"\n')
    wrapper.chmod(0o755)
    env = {**os.environ, "KVSLIM_CACHE_DIR": str(tmp_path / "cache"), "CXX": str(wrapper)}
    env.pop("KVSLIM_NO_KERNELS", None)

    def start(copy):
        return subprocess.Popen([sys.executable, "-c", _LOADER, str(copy)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def finish(proc):
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0 and "loaded-ok" in out, err[-3000:]

    def compiles():
        return len(count.read_text().split()) if count.exists() else 0

    both = [start(a), start(b)]  # at the same time
    for proc in both:
        finish(proc)
    assert compiles() == 1
    for copy in (a, b):  # in turn
        finish(start(copy))
    assert compiles() == 1, "a checkout rebuilt the other's build"
    (dirs,) = list((tmp_path / "cache" / "ops").iterdir())
    assert "src" in (dirs / "build.ninja").read_text() and str(tmp_path / "a") not in (dirs / "build.ninja").read_text()

    so = next(dirs.glob("*.so"))
    so.write_bytes(so.read_bytes()[: so.stat().st_size // 2])  # half-written / truncated
    finish(start(b))
    assert compiles() == 2 and build.sealed(dirs) is not None


def test_unsealed_or_corrupt_build_is_rebuilt_never_loaded(fresh, monkeypatch):
    """A build folder without a valid stamp (a killed build: a .so but no stamp; or a stamp whose .so changed) is
    emptied and rebuilt; the junk is never handed to the loader."""
    loaded, compiled = [], []

    def fake_compile(name, snap, cflags, build_dir):
        assert [p.name for p in build_dir.iterdir()] == [build._LOCKFILE], "left-overs were not cleared"
        so = build_dir / f"kvslim_{name}.so"
        so.write_bytes(b"\x7fELF good build " + bytes(64))
        compiled.append(so)
        return so

    monkeypatch.setattr(build, "_compile", fake_compile)
    monkeypatch.setattr(torch.ops, "load_library", lambda path: loaded.append(Path(path).read_bytes()))
    snap = build._snapshot([build.CSRC / "encdec_decode.cpp"])
    d = fresh / "ops" / "encdec_decode-x"
    d.mkdir(parents=True)
    (d / "kvslim_encdec_decode.so").write_bytes(b"half a shared object")  # killed build: no stamp
    (d / "build.ninja").write_text("stale")
    assert build._build_and_load("encdec_decode", snap, build.CFLAGS, d) is True
    assert len(compiled) == 1 and loaded == [] and build.sealed(d) == compiled[0]
    assert build._build_and_load("encdec_decode", snap, build.CFLAGS, d) is True  # sealed: loaded, not rebuilt
    assert len(compiled) == 1 and loaded == [compiled[0].read_bytes()]
    compiled[0].write_bytes(b"\x7fELF overwritten" + bytes(64))  # same size, other bytes
    assert build.sealed(d) is None
    loaded.clear()
    assert build._build_and_load("encdec_decode", snap, build.CFLAGS, d) is True
    assert len(compiled) == 2 and loaded == []
    (d / build.STAMP).write_text("{not json")
    assert build.sealed(d) is None


@pytest.mark.parametrize("method", ["int8", "int4", "int3", "int2", "turbo3", "turbo2", "slim", "window"])
def test_load_for_names_every_family_a_methods_decode_reaches(monkeypatch, method):
    """Every op family a method's decode steps ask for (each op checks ``available()`` before it runs) is one
    ``load_for`` preloads: otherwise the demo's warm-up misses it and its first build lands in a timing."""
    import importlib

    from conftest import tiny_model

    from kvslim import api, kernels
    from kvslim.adapters.compat import CACHE_KW

    asked = set()
    for family in ("encdec_decode", "quant_decode", "quant_decode_lowbit", "quant_write", "slim_decode",
                   "turbo_decode"):
        mod = importlib.import_module(f"kvslim.kernels.{family}")
        monkeypatch.setattr(mod, "available", lambda family=family, real=mod.available: asked.add(family) or real())
    # MHA, so slim applies; window needs a model with sliding layers, the append-only methods one without
    model = tiny_model("mistral" if method == "window" else "llama", kv_heads=4)
    api.apply(model, method)
    try:
        ids = torch.randint(1, 128, (1, 200), generator=torch.Generator().manual_seed(0))
        cache = api.make_cache(model)
        with torch.inference_mode():
            out = model(ids, use_cache=True, **{CACHE_KW: cache})
            for _ in range(3):
                out = model(out.logits[:, -1:].argmax(-1), use_cache=True, **{CACHE_KW: cache})
    finally:
        api.restore(model)
    assert asked or method == "window", f"{method}: no op family asked; the probe no longer reaches the decode path"
    assert asked <= set(kernels.FAMILIES.get(method, ())), (method, sorted(asked), kernels.FAMILIES.get(method))
