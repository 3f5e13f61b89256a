"""models/files.py: the atomic folder publish shared by the GGUF and CTranslate2 loaders."""

from __future__ import annotations

import pytest

from kvslim.models.files import publish_dir


def test_publish_dir_replaces_only_on_success(tmp_path):
    out = tmp_path / "cache" / "models" / "m-1"  # parents created, as in a fresh cache directory
    with publish_dir(out) as tmp:
        assert tmp.parent == out.parent and not out.exists()
        (tmp / "a.txt").write_text("one")
    assert (out / "a.txt").read_text() == "one"
    with pytest.raises(RuntimeError, match="conversion failed"), publish_dir(out) as tmp:
        (tmp / "a.txt").write_text("half")
        raise RuntimeError("conversion failed")
    assert (out / "a.txt").read_text() == "one"  # the old folder is untouched
    with publish_dir(out) as tmp:  # a finished conversion replaces an older folder whole
        (tmp / "b.txt").write_text("two")
    assert sorted(p.name for p in out.iterdir()) == ["b.txt"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["m-1"]  # no temporary folders left
