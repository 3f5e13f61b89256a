"""The command line's first hour (issue 28): instant help, bad input refused in one line naming what is wrong, fair
timings, a demo table that explains itself. Nothing here runs a real model."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import wave
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import tiny_model

from kvslim.cli.main import COMMANDS, command_module, main

ROOT = Path(__file__).resolve().parents[1]
LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100}


def _python(code: str) -> str:
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                          cwd=ROOT).stdout


# -- 3. help without torch ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["--help"], ["plan", "--help"], ["transcribe", "--help"], ["demo", "--help"], ["bench", "--help"]])
def test_help_imports_neither_torch_nor_transformers(argv):
    out = _python("import contextlib, io, sys\nfrom kvslim.cli.main import main\n"
                  f"with contextlib.redirect_stdout(io.StringIO()) as f, contextlib.suppress(SystemExit): main({argv!r})\n"
                  "print('usage' in f.getvalue(), 'torch' in sys.modules, 'transformers' in sys.modules)")
    assert out.split() == ["True", "False", "False"], out


def test_import_kvslim_is_lazy_and_its_names_still_work():
    assert _python("import sys, kvslim; print('torch' in sys.modules)").strip() == "False"
    import kvslim

    assert callable(kvslim.apply) and "int4" in kvslim.METHODS and set(kvslim.__all__) <= set(dir(kvslim))
    with pytest.raises(AttributeError, match="no_such_name"):
        kvslim.no_such_name  # noqa: B018


def test_command_help_lines_are_the_modules_docstrings():
    for name, (_, help_line) in COMMANDS.items():
        assert command_module(name).__doc__.strip().splitlines()[0] == help_line, name


# -- 5b. plan --config and --group-size -----------------------------------------------------------------------------

@pytest.mark.parametrize("content, expected", [
    ("3", "holds a JSON int"),
    (json.dumps(LLAMA | {"num_attention_heads": 0}), "num_attention_heads must be a positive int, got 0"),
    (json.dumps(LLAMA | {"hidden_size": 66}), "hidden_size 66 is not a multiple of num_attention_heads 4"),
    (json.dumps(LLAMA | {"num_hidden_layers": True}), "num_hidden_layers must be a positive int"),
])
def test_plan_config_bad_values_one_line_error(tmp_path, capsys, content, expected):
    path = tmp_path / "config.json"
    path.write_text(content)
    assert main(["plan", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err and str(path) in err, err


@pytest.mark.parametrize("flag", ["--group-size", "--window"])
def test_plan_zero_size_flags_are_one_error(tmp_path, capsys, flag):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert main(["plan", "--config", str(tmp_path), flag, "0"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and f"{flag} must be a positive int, got 0" in captured.err


# -- 5c. evaluate_parallel block ------------------------------------------------------------------------------------

@pytest.mark.parametrize("block", [-1, 0, 1.5, True])
def test_compare_specs_refuses_a_bad_block(block):
    from kvslim import api
    from kvslim.evaluate_parallel import compare_specs, layer_specs_of

    model = tiny_model("llama")
    ids = torch.randint(1, 128, (1, 48), generator=torch.Generator().manual_seed(0))
    plan = api.plan_config(model.config, "int8", torch.float32, group_size=16)
    with pytest.raises(ValueError, match="block must be a positive int"):
        compare_specs(model, ids, {"int8": layer_specs_of(plan)}, steps=16, block=block)


# -- 5d. demo --out checked first -----------------------------------------------------------------------------------

def test_demo_refuses_an_unwritable_out_before_measuring(tmp_path, capsys, monkeypatch):
    import kvslim.models

    def measured(*args, **kwargs):
        raise AssertionError("the demo loaded a model before checking --out")

    monkeypatch.setattr(kvslim.models, "load_smollm2", measured)
    (tmp_path / "a_file").write_text("")
    assert main(["demo", "--out", str(tmp_path / "a_file" / "sub")]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "a_file" in err and len(err.strip().splitlines()) == 1


# -- 5e. corrupt model files ----------------------------------------------------------------------------------------

def test_empty_ct2_model_bin_names_the_file(tmp_path):
    from kvslim.models.ctranslate2 import read_ct2

    (tmp_path / "model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"model\.bin.* is empty"):
        read_ct2(tmp_path / "model.bin")


@pytest.mark.parametrize("config", ["[]", "3", "{not json"])
def test_ct2_config_that_is_not_an_object_names_the_file(tmp_path, config):
    from kvslim.models.ctranslate2 import convert_whisper, write_ct2

    write_ct2(tmp_path / "model.bin", "WhisperSpec", 1, {"x": np.zeros(2, np.float32)})
    (tmp_path / "config.json").write_text(config)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [], "model": {"merges": []}}))
    with pytest.raises(ValueError, match=r"config\.json") as err:
        convert_whisper(tmp_path, tmp_path / "out")
    assert str(tmp_path) in str(err.value) and "\n" not in str(err.value)


def _gguf_header(kv_count: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, 0, kv_count)


@pytest.mark.parametrize("name, data", [
    ("huge_kv_count.gguf", _gguf_header(2**63 - 1) + b"\0" * 64),  # transformers: "config ... not a valid JSON file"
    ("bad_key.gguf", _gguf_header(1) + struct.pack("<Q", 3) + b"abc" + struct.pack("<I", 999) + b"\0" * 16),
    ("short.gguf", b"GGUF\x03\x00"),
])
def test_damaged_gguf_is_named_not_called_a_json_config(tmp_path, name, data):
    from kvslim.models.gguf import load_gguf

    (tmp_path / name).write_bytes(data)
    with pytest.raises(ValueError, match="not a readable GGUF checkpoint") as err:
        load_gguf(tmp_path / name, "damaged", cache_dir=tmp_path / "cache")
    assert str(tmp_path / name) in str(err.value) and "JSON" not in str(err.value)


def test_truncated_gguf_tensor_data_names_the_file(tmp_path):
    """A GGUF whose tensor data is cut short: the reader's reshape error, with the file's name."""
    import gguf

    from kvslim.models.gguf import gguf_problem, load_gguf

    path = tmp_path / "cut.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.ones((64, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path.write_bytes(path.read_bytes()[:-4096])
    assert "reshape" in gguf_problem(path)
    with pytest.raises(ValueError, match="reshape") as err:
        load_gguf(path, "cut", cache_dir=tmp_path / "cache")
    assert str(path) in str(err.value)


# -- 5a. WAV files --------------------------------------------------------------------------------------------------

def _wav(path: Path, samples: np.ndarray, rate: int = 16000, channels: int = 1) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.astype("<i2").tobytes())
    return path


def test_wav_with_zero_frames_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    from kvslim.audio import read_wav
    from kvslim.cli import transcribe

    monkeypatch.setattr(transcribe, "load_whisper", lambda *a: pytest.fail("loaded Whisper for an empty file"))
    path = _wav(tmp_path / "empty.wav", np.zeros(0))
    with pytest.raises(ValueError, match="holds no audio"):
        read_wav(path)
    assert main(["transcribe", str(path)]) == 2
    err = capsys.readouterr().err
    assert "empty.wav" in err and "no audio" in err


def test_truncated_wav_warns_with_its_name_and_reads_what_is_there(tmp_path):
    from kvslim.audio import read_wav

    path = _wav(tmp_path / "cut.wav", np.arange(1600) % 100)
    path.write_bytes(path.read_bytes()[:-1001])  # 500.5 frames short: a partial last frame too
    with pytest.warns(UserWarning, match=r"cut\.wav.*cut short.*1600 frames"):
        x = read_wav(path)
    assert x.shape == (1600 - 501,) and np.allclose(x * 32768, np.arange(1099) % 100)


def test_stereo_8khz_and_noise_read_as_16khz_mono(tmp_path):
    from kvslim.audio import read_wav

    t = np.arange(8000) / 8000
    tone = np.round(8000 * np.sin(2 * np.pi * 440 * t))
    stereo = np.stack([tone, tone], 1).reshape(-1)
    x = read_wav(_wav(tmp_path / "stereo8k.wav", stereo, rate=8000, channels=2))
    assert x.shape == (16000,) and abs(np.abs(x).max() - 8000 / 32768) < 0.01  # resampled, channels averaged
    noise = np.random.default_rng(0).integers(-32768, 32767, 16000)
    y = read_wav(_wav(tmp_path / "noise.wav", noise))
    assert y.dtype == np.float32 and np.all(np.abs(y) <= 1) and y.std() > 0.5


def test_an_hour_of_audio_is_refused_by_name_from_its_header(tmp_path, capsys, monkeypatch):
    """A silent 1-hour WAV (a sparse file: nothing is written or read) is refused from its header; the limit is a
    flag."""
    from kvslim.audio import read_wav
    from kvslim.cli import transcribe

    path = tmp_path / "hour.wav"
    frames = 3600 * 16000
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.setnframes(frames)
        w.writeframes(b"\0\0")
    header = path.read_bytes()[:44]
    with path.open("wb") as fh:  # header sizes for the full hour, then a hole of zeros
        fh.write(header[:4] + struct.pack("<I", 36 + 2 * frames) + header[8:40] + struct.pack("<I", 2 * frames))
        fh.truncate(44 + 2 * frames)
    with pytest.raises(ValueError, match=r"hour\.wav.*60\.0 min of audio"):
        read_wav(path)
    monkeypatch.setattr(transcribe, "load_whisper", lambda *a: pytest.fail("loaded Whisper for a refused file"))
    assert main(["transcribe", str(path), "--max-seconds", "600"]) == 2
    assert "10.0 min limit" in capsys.readouterr().err


def test_transcribe_reference_text_is_the_clips():
    from kvslim.audio import speech_clip
    from kvslim.cli.transcribe import reference_text

    path, said = speech_clip()
    assert reference_text(path) == said and "lazy dog" in said
    assert reference_text(path.with_name("no_such_clip.wav")) is None


# -- 4. fair timings ------------------------------------------------------------------------------------------------

def test_timed_warms_each_side_up_then_alternates():
    from kvslim.cli.transcribe import timed

    calls = []
    sides = {"a": lambda: calls.append("a") or "A", "b": lambda: calls.append("b") or "B"}
    out = timed(sides, 3, {"a": lambda: calls.append("a-warm")})
    assert calls == ["a-warm", "b", "a", "b", "b", "a", "a", "b"]
    assert [len(out[s][0]) for s in "ab"] == [3, 3] and out["a"][1] == "A" and out["b"][1] == "B"
    with pytest.raises(ValueError, match="rounds"):
        timed(sides, 0)


# -- 1. the demo's table --------------------------------------------------------------------------------------------

def _plan(*exactness, window=None, residual=0):
    return SimpleNamespace(layers=[SimpleNamespace(exactness=e, window=window, residual=residual) for e in exactness])


def test_exactness_summary_says_one_true_thing_per_kind_of_layer():
    from kvslim.cli.demo import summarize_exactness

    mixed = _plan("approximate (cache='k') in float32: 166.33× plain error", "exact in float32: 1.20× plain error",
                  "approximate (cache='k') in float32: 3.00× plain error", "exact in float32: 0.90× plain error")
    assert summarize_exactness(mixed) == [
        "approximate (cache='k') in float32 on 2 of 4 layers (≤ 166.33× plain error)",
        "exact in float32 on 2 of 4 layers (≤ 1.20× plain error)"]
    assert summarize_exactness(_plan("exact in float32: 1.10× plain error", "exact in float32: 1.30× plain error")
                               ) == ["exact in float32 (≤ 1.30× plain error)"]
    assert summarize_exactness(_plan("lossy", "lossy")) == ["lossy"]


def test_demo_note_explains_a_window_larger_than_the_generation():
    from kvslim.cli.demo import explain

    assert explain(_plan("approximate", window=256), 88, 361) == (
        "window 256 holds all 88 tokens of the generation; the 361-token eval text overflows it (Δppl)")
    assert explain(_plan("approximate", window=64), 88, 361) == ""
    assert "none quantized (bytes = dense)" in explain(_plan("lossy", residual=128), 88, 361)
    assert explain(_plan("lossy", residual=32), 88, 361) == ""


def test_tiny_model_text_tokenizes_only_a_prefix_and_matches_the_whole_file():
    import inspect
    import json.decoder

    from transformers import AutoTokenizer

    from kvslim.cli.demo import code_ids
    from kvslim.models import tiny_mha_path

    tok = AutoTokenizer.from_pretrained(tiny_mha_path(), local_files_only=True)
    seen = []

    class Recording:
        def __call__(self, text, **kwargs):
            seen.append(len(text))
            return tok(text, **kwargs)

    prompt, text = code_ids(Recording())
    source = inspect.getsource(json.decoder)
    whole = tok(source, return_tensors="pt", verbose=False).input_ids
    assert max(seen) < len(source) / 2
    assert torch.equal(prompt, whole[:, :48]) and torch.equal(text, whole[:, 48:560])


def test_chunked_eval_logits_give_its_perplexity():
    from kvslim import api
    from kvslim.evaluate import chunked_eval, chunked_perplexity

    model = tiny_model("llama")
    ids = torch.randint(1, 128, (1, 70), generator=torch.Generator().manual_seed(0))
    ppl, logits = chunked_eval(model, ids, lambda: api.make_cache(model), chunk=16)
    nll = -torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).mean().item()
    assert logits.shape == (69, 128) and abs(ppl - np.exp(nll)) < 1e-4 * ppl
    assert abs(ppl - chunked_perplexity(model, ids, lambda: api.make_cache(model), chunk=16)) < 1e-6 * ppl


# -- 2. set-up ------------------------------------------------------------------------------------------------------

def test_pyproject_license_is_an_spdx_string_with_a_setuptools_that_reads_it():
    tomllib = pytest.importorskip("tomllib")  # Python ≥ 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    assert "setuptools>=77" in project["build-system"]["requires"]


def test_setup_builds_the_kernels_without_runpy():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "-m kvslim.kernels.build" not in setup.replace("`python -m kvslim.kernels.build`", "")
    assert "from kvslim.kernels.build import main" in setup
