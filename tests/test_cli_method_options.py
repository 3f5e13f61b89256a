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
    err = [line for line in captured.err.strip().splitlines() if "deprecated" not in line]  # --turbo's note
    assert captured.out == "" and len(err) == 1 and expected in err[0], captured


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


# --- one spelling on every command: --option METHOD.NAME=VALUE (plan, eval, demo); --turbo a deprecated alias ---


def test_plan_option_gives_the_python_bytes_for_the_named_method_only(capsys):
    plain = _records(capsys)
    recs = _records(capsys, "--option", "turbo3.rope_centred_keys=false", "--option", "turbo3.outliers=8",
                    "--option", "int4.residual=64", "--option", "int2.per_layer={1: {'bits': 8}}")
    assert recs["turbo3"]["cache_bytes"] == _bytes("turbo3", rope_centred_keys=False, outliers=8)
    assert recs["int4"]["cache_bytes"] == _bytes("int4", residual=64) != plain["int4"]["cache_bytes"]
    assert recs["int2"]["cache_bytes"] == _bytes("int2", per_layer={1: {"bits": 8}}) > plain["int2"]["cache_bytes"]
    for m in ("turbo4", "turbo2", "int8", "int3", "dense", "slim"):  # methods no --option names: their defaults
        assert recs[m] == plain[m], m


def test_plan_turbo_is_a_deprecated_alias_with_a_one_line_note(capsys):
    """``--turbo K=V`` still sets K on turbo4/turbo3/turbo2 (the bytes of ``--option turboN.K=V`` each) and says
    once, on stderr, what to write instead."""
    assert main(["plan", "--config", str(TINY), "--json", "--context", "512", "--turbo", "rope_centred_keys=false"]) == 0
    out, err = capsys.readouterr()
    old = {r["method"]: r for r in json.loads(out)}
    assert len(err.strip().splitlines()) == 1 and "--turbo" in err and "deprecated" in err and "--option" in err
    new = _records(capsys, *[a for m in ("turbo4", "turbo3", "turbo2")
                             for a in ("--option", f"{m}.rope_centred_keys=false")])
    assert capsys.readouterr().err == ""
    for m in ("turbo4", "turbo3", "turbo2"):
        assert old[m]["cache_bytes"] == new[m]["cache_bytes"] == _bytes(m, rope_centred_keys=False), m


@pytest.mark.parametrize("flags, expected", [
    (["--option", "turbo3.seeed=1"], "--option turbo3: unknown option(s) ['seeed']"),
    (["--option", "int9.bits=4"], "method 'int9' is not in the methods"),
    (["--option", "turbo3outliers=8"], "--option: expected METHOD.NAME=VALUE"),
    (["--option", "turbo4.outliers=8"], "--option turbo4: outliers=8 are coded at bits + 1"),
    (["--option", "turbo3.outliers=64"], "--option turbo3:"),  # the tiny model's head dim is 32: at its plan
    (["--option", "turbo3.outliers=8", "--turbo", "outliers=16"], "--option turbo3: outliers also set by"),
    (["--option", "int4.group_size=16", "--group-size", "32"], "--option int4: group_size also set by"),
])
def test_plan_refused_options_are_one_error_line(capsys, flags, expected):
    assert main(["plan", "--config", str(TINY), *flags]) == 2
    captured = capsys.readouterr()
    err = [line for line in captured.err.strip().splitlines() if "deprecated" not in line]
    assert captured.out == "" and len(err) == 1 and expected in err[0], captured


class _Stop(Exception):
    pass


def test_demo_option_reaches_the_runs_of_its_method(monkeypatch, tmp_path):
    """``kvslim demo --option slim.cache=v``: every slim row of the tiny table runs with it (label says so), dense
    untouched; checked where the runs are measured (the measurement itself is tests/test_demo.py's)."""
    from kvslim.cli import demo

    seen = []

    def measure(model, tok, runs, *a, **k):
        seen.extend(runs)
        raise _Stop

    monkeypatch.setattr(demo, "measure", measure)
    with pytest.raises(_Stop):
        main(["demo", "--model", "tiny-mha", "--out", str(tmp_path), "--option", "slim.cache=v"])
    assert seen[0] == ("dense fp32", "dense", {})
    assert [o["cache"] for _, m, o in seen if m == "slim"] == ["v", "v"]
    assert all(label.endswith(" cache=v") for label, m, _ in seen if m == "slim")


@pytest.mark.parametrize("flags, expected", [
    (["--model", "tiny-mha", "--option", "int4.residual=64"], "method 'int4' is not in the methods of this demo"),
    (["--option", "int4.residual=500"], "--option int4: residual=500: a layer keeps at most 128"),
    (["--option", "dense.chunk=8"], "the dense cache takes no options"),
    (["--model", "whisper-base", "--option", "slim.cache=k"], "is not in the methods of this demo"),
    (["--methods", "int4", "--option", "int8.group_size=32"], "method 'int8' is not in the methods of this demo"),
    (["--methods", "int4", "--option", "slim.cache=v"], "method 'slim' is not in the methods of this demo"),
])
def test_demo_refuses_bad_options_before_loading_anything(capsys, tmp_path, flags, expected):
    assert main(["demo", "--out", str(tmp_path / "out"), *flags]) == 2
    captured = capsys.readouterr()
    assert len(captured.err.strip().splitlines()) == 1 and expected in captured.err, captured
    assert not (tmp_path / "out").exists()


def test_bench_option_reaches_the_kinds_of_its_method():
    """``kvslim bench --option int8.group_size=8``: the kvslim-int8 kind runs with it (more scale bytes than its
    default group), its record says so; other kinds untouched."""
    from conftest import tiny_model

    from kvslim.bench import decode

    model = tiny_model("llama")
    plain = decode.measure_group(model, "tiny", ["kvslim-int8", "kvslim-int4"], 1, 32, 1, 1, 10.0)
    opts = decode.measure_group(model, "tiny", ["kvslim-int8", "kvslim-int4"], 1, 32, 1, 1, 10.0,
                                {"int8": {"group_size": 8}})
    assert opts[0]["options"] == {"group_size": 8} and "options" not in plain[0] and "options" not in opts[1]
    assert opts[0]["cache_bytes"] > plain[0]["cache_bytes"] and opts[1]["cache_bytes"] == plain[1]["cache_bytes"]


def test_bench_padded_steps_mask_each_rows_padding():
    """``kvslim bench --padded``: every timed step gets row r's first r·C/(2B) tokens masked and positions counted
    from its first real token; the records list the pads."""
    from conftest import tiny_model

    from kvslim.bench import decode

    assert decode.left_pads(4, 64) == [0, 8, 16, 24]
    model = tiny_model("llama")
    seen = []
    forward = model.forward

    def spy(*a, **kw):
        seen.append((kw.get("attention_mask"), kw["position_ids"]))
        return forward(*a, **kw)

    model.forward = spy
    recs = decode.measure_group(model, "tiny", ["kvslim-int4", "hf-dynamic"], 4, 64, 2, 1, 10.0, padded=True)
    assert [r["padded"] for r in recs] == [[0, 8, 16, 24]] * 2
    assert len(seen) == 2 * 3  # two kinds, a warm-up step and two timed steps each
    for i, (mask, pos) in enumerate(seen[:3]):
        assert mask.shape == (4, 64 + i + 1) and mask.sum(1).tolist() == [64 + i + 1 - p for p in (0, 8, 16, 24)]
        assert (mask[:, -1] == 1).all() and pos[:, 0].tolist() == [64 + i - p for p in (0, 8, 16, 24)]
    plain = decode.measure_group(model, "tiny", ["kvslim-int4"], 4, 64, 1, 1, 10.0)
    assert "padded" not in plain[0] and seen[-1][0] is None
    from kvslim.bench.report import markdown_table
    from kvslim.cli.bench import points

    assert points([1, 4], [64, 128], True) == [(1, 64, False), (1, 128, False), (4, 64, False), (4, 64, True),
                                               (4, 128, False), (4, 128, True)]  # batch 1: nothing to pad
    assert points([4], [64], False) == [(4, 64, False)]
    table = markdown_table(plain + recs)  # a padded row is its own row, its ratios taken against padded rows
    assert "| kvslim-int4 (padded) |" in table and "| kvslim-int4 |" in table
    row = next(line for line in table.splitlines() if "| kvslim-int4 (padded) |" in line)
    want = recs[0]["tokens_per_s"] / recs[1]["tokens_per_s"]
    assert row.split("|")[7].strip() == f"{want:.2f}"  # × HF dynamic: the padded hf-dynamic of the same run


@pytest.mark.parametrize("flags, expected", [
    (["--quick", "--padded"], "--padded: the GPU table"),
    (["--methods", "hf-dynamic,kvslim-int4", "--option", "int8.group_size=8"],
     "method 'int8' is not in the methods of --methods ['int4']"),
    (["--methods", "kvslim-turbo3-rc", "--option", "turbo3.residual=500"], "--option turbo3: residual=500:"),
    (["--quick", "--option", "int4.residual=64"], "--option: the GPU table"),
])
def test_bench_refuses_bad_options_before_measuring(capsys, flags, expected):
    assert main(["bench", *flags]) == 2
    captured = capsys.readouterr()
    assert len(captured.err.strip().splitlines()) == 1 and expected in captured.err, captured


def test_every_command_that_takes_a_method_takes_option(capsys):
    """plan, eval, demo and bench list ``--option METHOD.NAME=VALUE`` in their help (transcribe runs one method,
    slim, at its defaults)."""
    for command in ("plan", "eval", "demo", "bench"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "--option METHOD.NAME=VALUE" in capsys.readouterr().out, command


@pytest.mark.parametrize("method, opts, says", [
    # the defaults' 4 sinks shrink for a larger window: the refusal names the residual set, not "sink=0 + ..."
    ("turbo3", dict(residual=500), ["residual=500:", "at most 128", "residual=128 or less", "residual=124 keeps"]),
    ("int4", dict(residual=500), ["residual=500:", "at most 128", "residual=124 keeps all 4"]),
    ("int8", dict(residual=129), ["residual=129:", "residual=128 or less"]),
    ("turbo2", dict(residual=126, sink=4), ["sink=4 + residual=126 = 130", "sink=4 with residual=124"]),
    ("int3", dict(sink=10), ["sink=10 beside the default residual=124", "residual=118 or less", "sink=4 or fewer"]),
])
def test_full_precision_refusals_name_what_was_set_and_what_works(method, opts, says):
    from kvslim.methods import METHODS

    with pytest.raises(ValueError) as e:
        METHODS[method].options(**opts)
    assert "sink=0" not in str(e.value) and all(s in str(e.value) for s in says), str(e.value)
    fixed = dict(opts, residual=128) if "sink" not in opts else dict(opts, residual=128 - opts["sink"])
    METHODS[method].options(**fixed)  # what the message proposes is taken


def test_bench_skips_only_a_method_that_does_not_apply_and_refuses_a_bad_option():
    """``measure_group``: slim on a GQA model is a ``skipped`` record (the method cannot serve it), but a bad
    option (a per_layer entry past the model's layers) is a ``ValueError`` naming the kind, before any timing (it
    used to be recorded as skipped, so a typo looked like an unsupported method)."""
    from conftest import tiny_model

    from kvslim.bench import decode

    model = tiny_model("llama", kv_heads=2)  # GQA
    (rec,) = decode.measure_group(model, "tiny", ["kvslim-slim"], 1, 16, 1, 1, 10.0)
    assert "does not apply" in rec["skipped"], rec
    with pytest.raises(ValueError, match=r"kvslim-int4: .*per_layer"):
        decode.measure_group(model, "tiny", ["kvslim-int4"], 1, 16, 1, 1, 10.0,
                             {"int4": {"per_layer": {99: {"rotation": "hadamard"}}}})
