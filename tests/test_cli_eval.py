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


def test_eval_perplexity_end_to_end(capsys, text_file):
    assert main(["eval", "--model", "tiny-mha", "--text", str(text_file), "--tokens", "200", "--steps", "32",
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
