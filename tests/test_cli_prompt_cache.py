"""``kvslim cache-prompt`` / ``kvslim generate --prompt-cache`` on the shipped tiny MHA model (no download)."""

from __future__ import annotations

import hashlib

import pytest

from kvslim.cli.main import main

pytestmark = pytest.mark.usefixtures("one_thread")


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    """A prompt cache of 200 tokens of Botchan on tiny-mha, int4, written by ``kvslim cache-prompt``."""
    folder = tmp_path_factory.mktemp("pc")
    out = folder / "doc.kvslim"
    assert main(["cache-prompt", "--model", "tiny-mha", "--method", "int4", "--text", "botchan", "--tokens", "200",
                 "--chunk", "64", "--out", str(out)]) == 0
    return out


def test_cache_prompt_prints_tokens_bytes_seconds(doc, capsys):
    out = doc.with_name("chat.kvslim")
    assert main(["cache-prompt", "--model", "tiny-mha", "--method", "int8", "--option", "int8.group_size=32",
                 "--text", "botchan", "--tokens", "150", "--out", str(out), "--chat"]) == 0
    line = capsys.readouterr().out
    assert "150 tokens, int8" in line and f"{out.stat().st_size:,} bytes" in line and "prefill" in line
    assert " s, save " in line
    assert main(["generate", "--model", "tiny-mha", "--prompt-cache", str(out), "--prompt", "Who?", "--chat",
                 "--max-new-tokens", "3"]) == 0  # the template's tail, kept in the file, follows the question
    assert "reused 150 of the file's 150 tokens" in capsys.readouterr().err
    assert main(["generate", "--model", "tiny-mha", "--prompt-cache", str(out), "--prompt", "Who?"]) == 2
    assert "made with --chat" in capsys.readouterr().err


def test_generate_from_the_file_twice_gives_one_answer_and_keeps_the_file(doc, capsys):
    before = _sha(doc)
    answers = []
    for _ in range(2):
        assert main(["generate", "--model", "tiny-mha", "--prompt-cache", str(doc), "--prompt", "Who is he?",
                     "--max-new-tokens", "5"]) == 0
        cap = capsys.readouterr()
        answers.append(cap.out)
        assert "reused 200 of the file's 200 tokens" in cap.err and "5 answer tokens" in cap.err
    assert answers[0] == answers[1] and _sha(doc) == before


def test_generate_refuses_room_chat_mismatch_and_method(doc, capsys):
    before = _sha(doc)
    assert main(["generate", "--model", "tiny-mha", "--prompt-cache", str(doc), "--prompt", "Who?",
                 "--max-new-tokens", "900"]) == 2
    assert "beyond the model's max_position_embeddings (1024)" in capsys.readouterr().err
    assert main(["generate", "--model", "tiny-mha", "--prompt-cache", str(doc), "--prompt", "Who?", "--chat"]) == 2
    assert "made without --chat" in capsys.readouterr().err
    assert main(["generate", "--model", "tiny-mha", "--prompt-cache", str(doc), "--prompt", "Who?",
                 "--method", "int8"]) == 2
    assert "--method" in capsys.readouterr().err
    assert _sha(doc) == before


def test_generate_refuses_a_missing_or_foreign_file_before_loading(tmp_path, capsys):
    assert main(["generate", "--model", "tiny-mha", "--prompt-cache", str(tmp_path / "no.kvslim"),
                 "--prompt", "Who?"]) == 2
    assert "no prompt cache file" in capsys.readouterr().err
    junk = tmp_path / "junk.kvslim"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    assert main(["generate", "--model", "tiny-mha", "--prompt-cache", str(junk), "--prompt", "Who?"]) == 2
    assert "not a readable kvslim prompt cache" in capsys.readouterr().err


def test_cache_prompt_refuses_bad_arguments_writing_nothing(tmp_path, capsys):
    out = tmp_path / "x.kvslim"
    assert main(["cache-prompt", "--model", "tiny-mha", "--text", "botchan", "--out", str(out)]) == 2
    assert "max_position_embeddings is 1024" in capsys.readouterr().err  # Botchan is longer than the model's
    assert main(["cache-prompt", "--model", "tiny-mha", "--text", "botchan", "--out", str(tmp_path / "no" / "x"),
                 "--tokens", "10"]) == 2
    assert "existing folder" in capsys.readouterr().err
    assert main(["cache-prompt", "--model", "tiny-mha", "--text", "botchan", "--out", str(out), "--tokens", "10",
                 "--option", "int4.nope=1"]) == 2
    assert "nope" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_cli_defects_refused_in_one_line_before_the_work(tmp_path, capsys):
    """An empty text, an unwritable folder, an empty prompt and more answer tokens than the model's positions: one
    line, exit 2, nothing written (an empty text died with ZeroDivisionError after writing a 0-token file, an
    unwritable folder with PermissionError after the prefill, an empty prompt with a torch traceback, and
    --max-new-tokens past the positions ran)."""
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    out = tmp_path / "x.kvslim"
    assert main(["cache-prompt", "--model", "tiny-mha", "--text", str(empty), "--out", str(out)]) == 2
    assert "holds no tokens" in capsys.readouterr().err
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        import os

        if not os.access(locked, os.W_OK):  # root writes anywhere: nothing to check there
            assert main(["cache-prompt", "--model", "tiny-mha", "--text", "botchan", "--tokens", "10",
                         "--out", str(locked / "x.kvslim")]) == 2
            assert "cannot be written" in capsys.readouterr().err
    finally:
        locked.chmod(0o700)
    assert main(["generate", "--model", "tiny-mha", "--prompt", ""]) == 2
    assert "--prompt: empty" in capsys.readouterr().err
    assert main(["generate", "--model", "tiny-mha", "--prompt", "Who?", "--max-new-tokens", "100000"]) == 2
    err = capsys.readouterr().err
    assert "max_position_embeddings (1024)" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_plain_question_follows_the_document_as_a_new_paragraph(doc):
    """Without --chat the question is a new paragraph after the document (it was glued to its last token)."""
    from kvslim.cli.eval import load_model
    from kvslim.cli.generate import question_ids
    from kvslim.prompt_cache import read_meta

    _, tok = load_model("tiny-mha")
    q = question_ids(tok, "Who is he?", False, read_meta(doc))
    assert tok.decode(q[0]).startswith("\n\n") and tok.decode(q[0]).endswith("Who is he?")


def test_generate_reuses_the_files_prefix_of_an_edited_document(tmp_path, capsys):
    """``--text``: the document as cached, then edited near its end: the file's tokens are reused up to the edit,
    the count reported; the unedited document reuses them all. ``--text`` without ``--prompt-cache`` is refused."""
    from kvslim.evaluate import load_text

    text = load_text("botchan")[:1500]
    original, edited = tmp_path / "doc.txt", tmp_path / "edited.txt"
    original.write_text(text, encoding="utf-8")
    edited.write_text(text[:1200] + " An edit the file never saw." + text[1200:], encoding="utf-8")
    out = tmp_path / "doc.kvslim"
    assert main(["cache-prompt", "--model", "tiny-mha", "--text", str(original), "--out", str(out)]) == 0
    held = int(capsys.readouterr().out.split(": ")[1].split(" tokens")[0].replace(",", ""))
    assert main(["generate", "--model", "tiny-mha", "--prompt-cache", str(out), "--text", str(original),
                 "--prompt", "Who?", "--max-new-tokens", "3"]) == 0
    assert f"reused {held:,} of the file's {held:,} tokens" in capsys.readouterr().err
    assert main(["generate", "--model", "tiny-mha", "--prompt-cache", str(out), "--text", str(edited),
                 "--prompt", "Who?", "--max-new-tokens", "3"]) == 0
    err = capsys.readouterr().err
    reused = int(err.split("reused ")[1].split(" of")[0].replace(",", ""))
    assert 0.6 * held < reused < held, err
    assert main(["generate", "--model", "tiny-mha", "--text", str(original), "--prompt", "Who?"]) == 2
    assert "--text" in capsys.readouterr().err


def test_generate_takes_method_options_and_refuses_bad_ones_before_loading(capsys, monkeypatch):
    """``--option METHOD.NAME=VALUE`` reaches ``apply`` without a prompt cache; a misspelt name, another method's option or one beside a prompt
    cache file is refused by name before any model loads."""
    from kvslim import api

    seen = {}
    real = api.apply

    def spy(model, method, **options):
        seen.update(method=method, options=options)
        return real(model, method, **options)

    monkeypatch.setattr(api, "apply", spy)
    assert main(["generate", "--model", "tiny-mha", "--prompt", "It was a long day at the school, and the master "
                 "said to me that", "--method", "int8", "--option", "int8.sparse_budget=2048", "--option",
                 "int8.group_size=32", "--max-new-tokens", "3"]) == 0
    assert seen == {"method": "int8", "options": {"sparse_budget": 2048, "group_size": 32}}
    assert "3 answer tokens" in capsys.readouterr().err
    for bad, says in [(["--option", "int4.sparse_budgett=8"], "sparse_budgett"),
                      (["--method", "int8", "--option", "int4.group_size=32"], "int4"),
                      (["--prompt-cache", "x.kvslim", "--option", "int4.group_size=32"], "carries its method")]:
        seen.clear()
        assert main(["generate", "--model", "tiny-mha", "--prompt", "Who?", *bad]) == 2
        assert says in capsys.readouterr().err and not seen, bad
