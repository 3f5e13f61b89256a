"""The scripts in examples/ run as their docstrings say (single-process path; the multi-rank one is
tests/test_distributed.py's), without warnings from kvslim's own calls."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_seq_parallel_generate_single_process(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    mod = _module("seq_parallel_generate")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # e.g. generate(past_key_values=...) on transformers 5.24
        assert mod.main(["--method", "int8", "--new-tokens", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("tokens: ") and lines[1].startswith("cache bytes per rank: ")
    assert len(lines[0].split()) == 1 + 4 and int(lines[1].split()[-1]) > 0
