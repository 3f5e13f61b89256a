"""``kvslim bench --quick --device cpu``: the GPU table's whole path (fill, eager and compiled steps, bytes,
bandwidth, capacity search, JSON + PNG + Markdown) on tiny shapes."""

from __future__ import annotations

import json

import pytest

from kvslim.cli import bench as cli


def _args(tmp_path, **kw):
    parser = __import__("argparse").ArgumentParser()
    cli.add_arguments(parser)
    argv = ["--device", "cpu", "--quick", "--steps", "1", "--rounds", "1", "--out", str(tmp_path),
            "--kinds", "hf-static,kvslim-dense,kvslim-int4,kvslim-mla"]
    for k, v in kw.items():
        argv += [f"--{k}", v]
    return parser.parse_args(argv)


@pytest.mark.usefixtures("one_thread")
def test_quick_table_runs_end_to_end_on_cpu(tmp_path):
    args = _args(tmp_path, compile="none")
    assert cli.run(args) == 0
    doc = json.loads((tmp_path / "bench_gpu_quick.json").read_text())
    assert doc["environment"]["commit"] is not None and "gpu" in doc and doc["bandwidth"]["copy_gbps"] > 0
    rows = {(r["point"], r["kind"]): r for r in doc["records"]}
    for point in ("tiny-mha", "tiny-gqa"):
        for kind in ("hf-static", "kvslim-dense", "kvslim-int4"):
            r = rows[(point, kind)]
            assert r["step_ms"] > 0 and r["cache_bytes"] > 0, r
            assert r["bytes_read_per_step"] == r["weights_bytes"] + r["cache_bytes"]
        assert "multi-head latent" in rows[(point, "kvslim-mla")]["skipped"]
    # int4 stores fewer bytes than dense once its full-precision window is counted (all 96 tokens sit there)
    assert rows[("tiny-mha", "kvslim-dense")]["cache_bytes"] == rows[("tiny-mha", "hf-static")]["cache_bytes"]
    cap = {c["kind"]: c for c in doc["capacity"]}
    assert set(cap) == {"hf-static", "kvslim-dense", "kvslim-int8", "kvslim-int4", "kvslim-int2"}
    assert all(1 <= c["largest_batch"] <= 32 and c["tokens_per_s"] > 0 for c in cap.values()), cap
    assert (tmp_path / "bench_gpu_quick.png").stat().st_size > 0
    assert "| tiny-gqa | kvslim-int4 |" in (tmp_path / "bench_gpu_quick.md").read_text()


def test_bad_flags_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="--kinds"):
        cli.run(_args(tmp_path, kinds="kvslim-int5"))
