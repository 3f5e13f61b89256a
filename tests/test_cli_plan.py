"""``kvslim plan``: figures from the config alone equal the bytes measured in a real cache."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import padded_batch, tiny_model

import kvslim
from kvslim.adapters.compat import CACHE_KW
from kvslim.cli.main import main


def _plan_json(capsys, path, *extra) -> dict:
    assert main(["plan", "--config", str(path), "--json", *extra]) == 0
    return {r["method"]: r for r in json.loads(capsys.readouterr().out)}


@pytest.mark.parametrize("kind", ["mistral", "qwen2-mixed", "llama"])
def test_planner_bytes_equal_measured_nbytes(tmp_path, capsys, kind):
    model = tiny_model(kind)
    model.config.save_pretrained(tmp_path)
    ids, mask = padded_batch(batch=2, length=20)
    records = _plan_json(capsys, tmp_path / "config.json", "--context", "20", "--batch", "2", "--dtype",
                         "float32", "--window", "8", "--group-size", "8")
    for method in ("dense", "window", "int8", "int4"):
        rec = records[method]
        assert rec["applies"], rec
        opts = {"window": 8} if method == "window" else {"group_size": 8, "window": 8} if method != "dense" else {}
        kvslim.apply(model, method, **opts)
        cache = kvslim.make_cache(model)
        model(ids, attention_mask=mask, **{CACHE_KW: cache})
        assert cache.nbytes == rec["cache_bytes"], method
    dense = records["dense"]  # dense keeps what HF keeps: the model's own window on its sliding layers
    assert dense["cache_bytes"] == dense["hf_bytes"]
    assert dense["ratio"] == 1.0 if kind == "llama" else dense["ratio"] < 1.0


def test_plan_prints_the_bytes_a_step_reads_with_sparse_decode(tmp_path, capsys):
    """``read / step``: the whole cache without sparse decode; with ``--option int4.sparse_budget`` what the plan's
    ``step_read_bytes`` says (the budget's rows + page statistics), far less than the cache at a long context."""
    model = tiny_model("llama", max_position_embeddings=8192)
    model.config.save_pretrained(tmp_path)
    args = ["--context", "8192", "--dtype", "float32", "--option", "int4.sparse_budget=512",
            "--option", "int4.sparse_dense_layers=0", "--option", "dense.sparse_budget=512",
            "--option", "dense.sparse_dense_layers=0"]  # the tiny model's few layers all sparse
    records = _plan_json(capsys, tmp_path / "config.json", *args)
    assert records["int8"]["step_read_bytes"] == records["int8"]["cache_bytes"]
    for method in ("int4", "dense"):
        rec = records[method]
        plan = kvslim.plan_config(model.config, method, torch.float32, sparse_budget=512, sparse_dense_layers=0)
        assert rec["step_read_bytes"] == plan.step_read_bytes(8192) < rec["cache_bytes"] / 4, rec
    assert main(["plan", "--config", str(tmp_path), *args]) == 0
    assert "read / step" in capsys.readouterr().out


def test_plan_lists_methods_that_do_not_apply_with_reason(tmp_path, capsys):
    cfg = {"model_type": "deepseek_v2", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
           "kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
           "q_lora_rank": None, "intermediate_size": 512, "moe_intermediate_size": 128, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    records = _plan_json(capsys, tmp_path / "config.json")
    assert not records["dense"]["applies"] and "mla" in records["dense"]["reason"]


def test_plan_table_output_and_bad_input(tmp_path, capsys):
    model = tiny_model("llama")
    model.config.save_pretrained(tmp_path)
    assert main(["plan", "--config", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "int8" in out and "window" in out and "not applicable" in out  # window needs --window on Llama
    assert main(["plan", "--config", str(tmp_path / "missing.json")]) == 2
    assert "--config" in capsys.readouterr().err
    assert main(["plan", "--config", str(tmp_path), "--dtype", "int3"]) == 2
    assert "--dtype" in capsys.readouterr().err
    assert main(["plan", "--config", str(tmp_path), "--context", "0"]) == 2
    assert "--context" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{not json")
    assert main(["plan", "--config", str(tmp_path / "bad.json")]) == 2
    assert "JSON" in capsys.readouterr().err


def test_bench_refuses_bad_arguments(capsys):
    assert main(["bench", "--contexts", "0,5"]) == 2
    assert "--contexts" in capsys.readouterr().err
    assert main(["bench", "--methods", "hf-dynamic,nope"]) == 2
    assert "--methods" in capsys.readouterr().err


def test_bench_group_interleaves_kinds_on_separate_copies(monkeypatch):
    from kvslim.bench import decode

    model = tiny_model("llama")
    order, real = [], decode.time_decode

    def spy(m, cache, batch, context, steps, warmup=1, pads=None):
        order.append((kvslim.get_plan(m).method if kvslim.get_plan(m) else "hf", context))
        assert pads is None  # an unpadded group
        return real(m, cache, batch, context, steps, warmup, pads)

    monkeypatch.setattr(decode, "time_decode", spy)
    recs = decode.measure_group(model, "tiny", ["hf-dynamic", "kvslim-int8"], 2, 32, 2, 3, 10.0)
    # A B A B A B, positions continue from the cache length (first round has one warm-up step)
    assert order == [("hf", 32), ("int8", 32), ("hf", 35), ("int8", 35), ("hf", 37), ("int8", 37)]
    assert [r["method"] for r in recs] == ["hf-dynamic", "kvslim-int8"]
    for r in recs:
        assert len(r["step_s_all"]) == 6 and len(r["step_s_round_medians"]) == 3 and r["rounds"] == 3
    assert recs[1]["cache_bytes"] < recs[0]["cache_bytes"]
    assert kvslim.get_plan(model) is None
    with pytest.raises(ValueError, match="rounds"):
        decode.measure_group(model, "tiny", ["hf-dynamic"], 2, 32, 2, 0, 10.0)


def test_bench_group_runs_slim_on_mha_and_says_why_not_on_gqa():
    from kvslim.bench import decode

    mha = tiny_model("llama", kv_heads=4)
    recs = decode.measure_group(mha, "tiny", ["kvslim-dense", "kvslim-slim"], 2, 32, 2, 2, 10.0)
    dense, slim = recs
    assert slim["method"] == "kvslim-slim" and slim["tokens_per_s"] > 0
    assert slim["cache_bytes"] * 2 == dense["cache_bytes"]  # K only
    gqa = decode.measure_group(tiny_model("llama"), "tiny", ["kvslim-dense", "kvslim-slim"], 2, 32, 1, 1, 10.0)
    assert gqa[0]["method"] == "kvslim-slim" and "skipped" in gqa[0] and gqa[1]["tokens_per_s"] > 0
    from kvslim.bench.report import markdown_table

    assert "kvslim-slim not run on tiny" in markdown_table(gqa)


def test_bench_point_measures_real_decode():
    from kvslim.bench.decode import measure_point

    model = tiny_model("llama")
    for kind in ("hf-dynamic", "hf-static", "kvslim-dense"):
        rec = measure_point(model, "tiny", kind, 2, 32, 2, 10.0)
        assert rec["tokens_per_s"] > 0 and rec["cache_bytes"] == 3 * 2 * 2 * 2 * 16 * 4 * 32
    assert kvslim.get_plan(model) is None
    with torch.no_grad():
        assert model(torch.ones(1, 3, dtype=torch.long)).logits.shape == (1, 3, 128)
