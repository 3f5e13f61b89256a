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
