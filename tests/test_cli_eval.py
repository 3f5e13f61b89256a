"""``kvslim eval`` (issue 34): bad input refused by name with nothing written, the memory check before any prefill,
and both modes end to end on the built-in tiny model."""

from __future__ import annotations

import pytest

from kvslim.cli import eval as cli_eval
from kvslim.cli.main import main
from kvslim.evaluate import load_text


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(load_text("botchan"))
    return path


def _refused(capsys, tmp_path, monkeypatch, argv, *needles):
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["eval", *argv]) == 2
    err = capsys.readouterr().err
    for n in needles:
        assert n in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_bad_input_refused_by_name(capsys, tmp_path, monkeypatch, text_file):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    short = tmp_path / "short.txt"
    short.write_text("def f(x):\n    return x\n")
    m = ["--model", "tiny-mha"]
    _refused(capsys, tmp_path, monkeypatch, [*m, "--text", str(tmp_path / "missing.txt")], "--text", "missing.txt")
    _refused(capsys, tmp_path, monkeypatch, [*m, "--text", str(empty)], "--text", "empty")
    _refused(capsys, tmp_path, monkeypatch, [*m], "--text")
    _refused(capsys, tmp_path, monkeypatch, [*m, "--text", str(text_file), "--methods", "int4,int5"], "--methods",
             "int5")
    _refused(capsys, tmp_path, monkeypatch, [*m, "--text", str(text_file), "--methods", "slim"], "--methods")
    _refused(capsys, tmp_path, monkeypatch, [*m, "--task", "haystack"], "--task", "haystack")
    _refused(capsys, tmp_path, monkeypatch, ["--model", "no-such-model", "--text", str(text_file)], "--model",
             "no-such-model")
    _refused(capsys, tmp_path, monkeypatch, [*m, "--text", str(short), "--tokens", "200", "--steps", "50"],
             "--text", "fewer than --tokens 200")
    _refused(capsys, tmp_path, monkeypatch, [*m, "--task", "passkey", "--context", "4096"], "--context 4096",
             "max_position_embeddings (1024)")
    _refused(capsys, tmp_path, monkeypatch, [*m, "--text", str(text_file), "--tokens", "2048", "--steps", "32"],
             "--tokens 2048", "max_position_embeddings (1024)")


def test_context_that_does_not_fit_is_refused_before_prefill(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(cli_eval, "memory_available", lambda: 2**20)
    monkeypatch.setattr("kvslim.longctx.protocol.prefill_kv", lambda *a: pytest.fail("prefill ran"))
    _refused(capsys, tmp_path, monkeypatch, ["--model", "tiny-mha", "--task", "passkey", "--context", "1024"],
             "--context 1024 needs about", "MiB is available", "tokens would fit")


def test_text_that_does_not_fit_is_refused_before_prefill(capsys, tmp_path, monkeypatch, text_file):
    monkeypatch.setattr(cli_eval, "memory_available", lambda: 2**20)
    monkeypatch.setattr("kvslim.stepwise.compare_specs_steps", lambda *a, **k: pytest.fail("model ran"))
    _refused(capsys, tmp_path, monkeypatch, ["--model", "tiny-mha", "--text", str(text_file), "--tokens", "1000",
                                             "--steps", "32"], "--tokens 1000 needs about", "tokens would fit")


def test_text_is_a_file_or_a_shipped_text_by_name(tmp_path, monkeypatch, text_file):
    """``--text botchan`` (what docs/longctx.md runs) reads the shipped novel without its source line; a file of that
    name wins; anything else is refused naming the shipped texts."""
    assert cli_eval.read_text("botchan") == load_text("botchan") == cli_eval.read_text(str(text_file))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "botchan").write_text("my own text")
    assert cli_eval.read_text("botchan") == "my own text"
    with pytest.raises(FileNotFoundError, match="no such file 'botchan.txt' .*shipped with kvslim: botchan"):
        cli_eval.read_text("botchan.txt")


def test_eval_perplexity_end_to_end(capsys):
    assert main(["eval", "--model", "tiny-mha", "--text", "botchan", "--tokens", "200", "--steps", "32",
                 "--methods", "int4,int2"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["int4"], ["int2"])}
    assert set(rows) == {"int4", "int2"}
    # bytes per token measured from the filled caches: int2 below int4 below dense
    assert float(rows["int2"][1].replace(",", "")) < float(rows["int4"][1].replace(",", ""))
    assert 0 < float(rows["int4"][2]) < 1
    assert "%" in rows["int4"] and "[" in out


def test_eval_retrieval_end_to_end(capsys):
    from kvslim.models.tiny_mha import tiny_mha_path

    # a local Hugging Face folder (the built-in tiny model's own files) as --model
    assert main(["eval", "--model", str(tiny_mha_path()), "--task", "passkey", "--context", "200", "--trials", "1",
                 "--methods", "int4"]) == 0
    out = capsys.readouterr().out
    assert "passkey at 200 tokens, 1 haystacks" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["dense"], ["int4"])]
    assert [r[0] for r in rows] == ["dense", "int4"] and all(r[1].endswith("/1") for r in rows)


def test_help_lists_the_turbo_methods_and_option(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    for name in ("turbo4", "turbo3", "turbo2", "int3", "--option", "METHOD.NAME=VALUE"):
        assert name in out, name


def test_bad_method_options_refused_by_name(capsys, tmp_path, monkeypatch, text_file):
    """Each bad ``--option`` is refused naming it (and what would work), before any model runs, nothing written;
    one the model's shape cannot take (tiny-mha: head dim 32) is refused at its plan, before any prefill."""
    monkeypatch.setattr("kvslim.stepwise.compare_specs_steps", lambda *a, **k: pytest.fail("model ran"))
    monkeypatch.setattr("kvslim.longctx.protocol.prefill_kv", lambda *a: pytest.fail("prefill ran"))
    t = ["--model", "tiny-mha", "--text", str(text_file), "--tokens", "200", "--steps", "32",
         "--methods", "turbo3,turbo2"]
    for option, needles in (
            ("turbo3.outlier=4", ["--option turbo3", "'outlier'", "allowed", "'outliers'"]),
            ("turbo3.rope_centred_keys=1", ["--option turbo3", "rope_centred_keys must be True or False"]),
            ("turbo2.key_bits=5", ["--option turbo2", "key_bits", "got 5"]),
            ("turbo3.residual=500", ["--option turbo3", "at most 128"]),
            ("int4.group_size=32", ["--option", "'int4' is not in --methods"]),
            ("turbo3residual=64", ["--option", "METHOD.NAME=VALUE", "turbo3residual=64"]),
            ("turbo3.residual=", ["--option", "METHOD.NAME=VALUE"]),
            ("turbo3.outliers=32", ["--option turbo3", "outliers=32 must be below the head dimension 32"])):
        _refused(capsys, tmp_path, monkeypatch, [*t, "--option", option], *needles)
    _refused(capsys, tmp_path, monkeypatch, [*t, "--methods", "dense,turbo3", "--option", "dense.residual=4"],
             "--option", "dense cache takes no options")
    _refused(capsys, tmp_path, monkeypatch, [*t, "--option", "turbo3.sink=2", "--option", "turbo3.sink=4"],
             "turbo3.sink is given twice")


def test_eval_turbo_with_options_end_to_end(capsys, text_file):
    """turbo3 with a smaller window beside turbo2 at its defaults, through both modes on the tiny model: each option
    reaches the measured cache (bytes per token as ``kvslim plan`` counts that method with those options, and not
    as it counts the default's)."""
    import torch

    from kvslim.methods import METHODS
    from kvslim.models import load_tiny_mha

    small = {"residual": 16, "sink": 2, "flush": 8}
    base = ["eval", "--model", "tiny-mha", "--text", str(text_file)]
    opts = [a for k, v in small.items() for a in ("--option", f"turbo3.{k}={v}")]
    assert main([*base, "--tokens", "200", "--steps", "32", "--methods", "turbo3,turbo2", *opts]) == 0
    out = capsys.readouterr().out
    got = {line.split()[0]: float(line.split()[1].replace(",", "")) for line in out.splitlines()
           if line.split()[:1] in (["turbo3"], ["turbo2"])}
    model, _ = load_tiny_mha(torch.float32)

    def planned(m, **o):
        return round(METHODS[m].plan_model(model, **o).cache_bytes(200) / 200)

    assert round(got["turbo3"]) == planned("turbo3", **small) != planned("turbo3")
    assert round(got["turbo2"]) == planned("turbo2")
    assert main([*base, "--task", "passkey", "--context", "200", "--trials", "1", "--methods", "turbo3", *opts]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:1] in (["dense"],
                                                                                                 ["turbo3"])]
    assert [r[0] for r in rows] == ["dense", "turbo3"] and all(r[1].endswith("/1") for r in rows)
    assert round(float(rows[1][-1].replace(",", ""))) == planned("turbo3", **small)
