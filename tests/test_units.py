"""``kvslim.units.human_bytes``: the one byte formatter of every table a person reads; the JSON keeps exact counts."""

from __future__ import annotations

import json
import re

import pytest

from kvslim.cli.main import main
from kvslim.units import human_bytes


@pytest.mark.parametrize(("n", "text"), [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"), (10 * 1024 - 1, "10.0 KiB"),
    (99.96 * 1024, "100 KiB"), (2**20 - 1, "1.00 MiB"), (37.5 * 2**20, "37.5 MiB"), (17_179_869_184, "16.0 GiB"),
    (5 * 2**40, "5.00 TiB"), (1023.7, "1.00 KiB"), (None, "-")])
def test_human_bytes(n, text):
    assert human_bytes(n) == text


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "12", True])
def test_human_bytes_refuses_what_is_not_a_byte_count(bad):
    with pytest.raises(ValueError, match="n must be"):
        human_bytes(bad)


LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}


def test_plan_table_reads_in_binary_units_and_json_keeps_the_count(tmp_path, capsys, monkeypatch):
    """``kvslim plan`` on a Llama-3-8B shape at 32k: the table says 4.00 GiB for dense bf16 (no 4,294,967,296), and
    ``--json`` keeps the exact count."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["plan", "--config", str(tmp_path), "--context", "32768"]) == 0
    out = capsys.readouterr().out
    assert "4.00 GiB" in out and not re.search(r"\d,\d{3},\d{3}", out), out
    assert main(["plan", "--config", str(tmp_path), "--context", "32768", "--json"]) == 0
    dense = next(r for r in json.loads(capsys.readouterr().out) if r["method"] == "dense")
    assert dense["cache_bytes"] == 2 * 32 * 8 * 128 * 2 * 32768


def test_bench_tables_use_binary_units():
    from kvslim.bench import cuda
    from kvslim.bench.report import markdown_table

    rec = {"model": "m", "context": 4096, "batch": 1, "method": "kvslim-dense", "tokens_per_s": 10.0,
           "cache_bytes": 3 * 2**30, "gbps": 1.0, "roofline_fraction": 0.5}
    assert "| 3.00 GiB |" in markdown_table([rec])
    gpu = {"point": "p", "batch": 1, "kind": "hf-static", "step_ms": 2.0, "cache_bytes": 1536 * 2**20,
           "read_gbps": 100.0, "fraction_of_copy_bandwidth": 0.5, "peak_bytes": 70 * 2**30}
    table = cuda.markdown({"records": [gpu], "capacity": []})
    assert "| 1.50 GiB |" in table and "| 70.0 GiB |" in table
