"""``kvslim plan --per-layer`` / ``--turbo`` / ``--group-size``: method options from the command line give the bytes
``plan_config`` gives with the same options in Python; text it cannot read, or options a method refuses, are one
error line naming the flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import kvslim
from kvslim.api import plan_config
from kvslim.cli.main import main
from kvslim.cli.method_options import parse_options, parse_per_layer
from kvslim.cli.plan import load_config

TINY = Path(kvslim.__file__).parent / "data" / "tiny_mha" / "config.json"  # llama, 4 layers, head dim 32


def _records(capsys, *flags) -> dict:
    assert main(["plan", "--config", str(TINY), "--json", "--context", "512", *flags]) == 0
    return {r["method"]: r for r in json.loads(capsys.readouterr().out)}


def _bytes(method, **options) -> int:
    return plan_config(load_config(TINY), method, torch.bfloat16, **options).cache_bytes(512, 1)


def test_parsers_read_layers_ranges_and_values():
    assert parse_per_layer(["0,2-3:bits=8", "1:rotation=none,key_bits=4"]) == {
        0: {"bits": 8}, 2: {"bits": 8}, 3: {"bits": 8}, 1: {"rotation": None, "key_bits": 4}}
    assert parse_per_layer(None) == {}
    assert parse_options("rope_centred_keys=false,outliers=8,rotation=hadamard", "--turbo") == {
        "rope_centred_keys": False, "outliers": 8, "rotation": "hadamard"}


@pytest.mark.parametrize("spec, expected", [
    ("bits=8", "expected LAYERS:OPTION=VALUE"), ("x:bits=8", "layers must be indices or ranges"),
    ("3-1:bits=8", "bad layer range '3-1'"), ("1:bits", "expected OPTION=VALUE"), ("1:bits=8,bits=4", "given twice"),
])
def test_unreadable_per_layer_text_is_refused_by_flag(spec, expected):
    with pytest.raises(ValueError, match="--per-layer") as e:
        parse_per_layer([spec])
    assert expected in str(e.value)
    with pytest.raises(ValueError, match="layer 1 given twice"):
        parse_per_layer(["1:bits=8", "0-1:bits=4"])


def test_per_layer_and_turbo_flags_give_the_python_bytes(capsys):
    plain = _records(capsys)
    recs = _records(capsys, "--per-layer", "1-2:bits=8", "--turbo", "rope_centred_keys=false,outliers=8")
    for m in ("int4", "int3", "int2"):
        assert recs[m]["cache_bytes"] == _bytes(m, per_layer={1: {"bits": 8}, 2: {"bits": 8}})
        assert recs[m]["cache_bytes"] > plain[m]["cache_bytes"]
    for m in ("turbo3", "turbo2"):
        assert recs[m]["cache_bytes"] == _bytes(m, rope_centred_keys=False, outliers=8)
    # turbo4 takes no outliers (its keys would need 5 bits): its row says so, the others still plan
    assert not recs["turbo4"]["applies"] and "outliers=8" in recs["turbo4"]["reason"]
    assert recs["dense"] == plain["dense"] and recs["slim"] == plain["slim"]  # the flags reach their methods only


def test_group_size_defaults_to_the_methods_own(capsys):
    """Head dim 32: without --group-size int8/int4 adapt (group 32, as apply does) instead of refusing 64."""
    recs = _records(capsys)
    for m in ("int8", "int4", "int3", "int2"):
        assert recs[m]["applies"] and recs[m]["cache_bytes"] == _bytes(m), m
    recs = _records(capsys, "--group-size", "16")
    for m in ("int8", "int4", "int3", "int2"):
        assert recs[m]["cache_bytes"] == _bytes(m, group_size=16), m


@pytest.mark.parametrize("flags, expected", [
    (["--per-layer", "9:bits=8"], "--per-layer: layer(s) [9] outside the model's 4 layers (0..3)"),
    (["--per-layer", "1:bits=5"], "--per-layer: layer 1: bits must be 2, 3, 4 or 8, got 5"),
    (["--per-layer", "1:colour=2"], "--per-layer: layer 1: unknown option(s) ['colour']"),
    (["--turbo", "window=5"], "--turbo: unknown option(s) ['window']"),
    (["--turbo", "seeed=1"], "--turbo: unknown option(s) ['seeed']"),
    (["--turbo", "prerope_keys"], "--turbo: expected OPTION=VALUE"),
])
def test_refused_options_are_one_error_line(capsys, flags, expected):
    assert main(["plan", "--config", str(TINY), *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1 and expected in captured.err, captured


def test_python_m_kvslim_is_the_kvslim_command():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "kvslim", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("usage: kvslim ") and "plan" in out.stdout


def test_plan_refuses_a_model_type_apply_refuses(tmp_path, capsys):
    """A GPT-NeoX config: every method's row says why (apply refuses that model_type), none shows bytes."""
    cfg = {"model_type": "gpt_neox", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
           "intermediate_size": 128, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["plan", "--config", str(tmp_path), "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert records and not any(r["applies"] for r in records)
    assert "does not support model_type 'gpt_neox'" in {r["method"]: r for r in records}["int4"]["reason"]


def test_eval_takes_every_llm_name_demo_takes():
    """A name that works with ``kvslim demo --model`` works with ``kvslim eval --model`` (gemma-3-270m was refused)."""
    from kvslim.cli.demo_models import MODEL_NAMES
    from kvslim.cli.eval import BUILTINS

    llms = [n for n in MODEL_NAMES if not n.startswith("whisper")]
    assert llms and not [n for n in llms if n not in BUILTINS]
