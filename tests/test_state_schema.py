"""Every cache class's file state: its version and its attributes, held against a table (``data/state_schema.json``).

``kvslim.save_cache`` writes each object's ``__getstate__`` under its class name and ``STATE_VERSION``
(``caches/state.py``); a file written at another version is refused. This test builds every cache kind of
``test_prompt_cache.CASES``, encodes it, and compares each class's (version, attribute names) with the table. A class
that gains, loses or renames an attribute fails here: decide whether old files still mean the same thing (if not,
bump the class's ``STATE_VERSION``), then update the table (``KVSLIM_WRITE_STATE_SCHEMA=1`` rewrites it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_prompt_cache import CASES, _ids, _model, _prefill

import kvslim
from kvslim.caches import state as st
from kvslim.prompt_cache import load_cache, save_cache

TABLE = Path(__file__).parent / "data" / "state_schema.json"


def _classes(node, out: dict) -> None:
    if isinstance(node, dict):
        if node.get("$") == "obj":
            keys = sorted(node["v"])
            seen = out.setdefault(node["cls"], {"version": node["ver"], "attributes": keys})
            seen["attributes"] = sorted(set(seen["attributes"]) | set(keys))
        for v in node.values():
            _classes(v, out)
    elif isinstance(node, list):
        for v in node:
            _classes(v, out)


def test_every_cache_class_matches_the_state_table():
    found: dict = {}
    for _, kind, method, options, max_length, capturable in CASES:
        model = _model(kind)
        kvslim.apply(model, method, **options)
        ids, _ = _ids()
        cache = _prefill(model, ids, max_length, capturable)
        _classes(st.Encoder().encode(cache), found)
        kvslim.restore(model)
    found = dict(sorted(found.items()))
    if os.environ.get("KVSLIM_WRITE_STATE_SCHEMA"):
        TABLE.write_text(json.dumps(found, indent=1) + "\n")
    table = json.loads(TABLE.read_text())
    for cls in sorted(set(found) | set(table)):
        assert cls in table, f"{cls}: not in {TABLE.name}; add it (KVSLIM_WRITE_STATE_SCHEMA=1)"
        assert cls in found, f"{cls}: in {TABLE.name} but no cache kind builds it any more; drop it from the table"
        assert found[cls] == table[cls], (
            f"{cls}: state {found[cls]} differs from the table's {table[cls]}: if a file of the old state would load "
            "with another meaning, bump the class's STATE_VERSION; then rewrite the table (KVSLIM_WRITE_STATE_SCHEMA=1)")


def test_a_file_of_another_state_version_is_refused(tmp_path, monkeypatch):
    from kvslim.caches.residual import ResidualStore

    model = _model("llama")
    kvslim.apply(model, "int4")
    ids, _ = _ids()
    path = save_cache(_prefill(model, ids), tmp_path / "p.kvslim", model, ids)
    monkeypatch.setattr(ResidualStore, "STATE_VERSION", 2, raising=False)
    with pytest.raises(ValueError, match="ResidualStore state version 1 in the file, this kvslim reads version 2"):
        load_cache(path, model)
    monkeypatch.undo()
    assert load_cache(path, model).cache.get_seq_length() == ids.shape[1]
    kvslim.restore(model)
