"""Transcribe a WAV file with real Whisper (tiny.en / base from PyPI, offline) and a kvslim cache.

``kvslim transcribe FILE.wav [--model tiny.en|base] [--method slim] [--beams N] [--timestamps]
[--compare [--rounds N]] [--max-seconds S]``: prints the transcript (and the clip's reference text, when a
``FILE.txt`` lies beside it, as for the shipped clip) and the context memory against HF's ``EncoderDecoderCache``;
``--compare`` also decodes with HF's own cache, says whether the tokens are identical and times both fairly: each
side is warmed up first, then the sides alternate for ``--rounds`` rounds and the medians are printed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

# torch, transformers and rich are imported inside run(): ``kvslim transcribe --help`` stays instant

WHISPER_MODELS = ("tiny.en", "base")
DTYPES = ("fp32", "bf16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..audio import MAX_SECONDS

    p.add_argument("file", nargs="?", default=None,
                   help="PCM WAV file (any rate, mono or stereo); default: the shipped 17 s clip")
    p.add_argument("--model", default="tiny.en", choices=WHISPER_MODELS, help="Whisper checkpoint (default tiny.en)")
    p.add_argument("--method", default="slim", choices=("slim",),
                   help="kvslim method (slim: encoder output cached once for all layers, decoder X/K caches; "
                        "the storage methods do not apply to encoder-decoders)")
    p.add_argument("--beams", type=int, default=1, help="beam width (default 1: greedy)")
    p.add_argument("--timestamps", action="store_true", help="predict segment timestamps")
    p.add_argument("--dtype", default="fp32", choices=DTYPES, help="model dtype (default fp32)")
    p.add_argument("--compare", action="store_true", help="also decode with HF's cache and compare the tokens")
    p.add_argument("--rounds", type=int, default=3,
                   help="with --compare: timed rounds per side after the warm-up, alternating (default 3)")
    p.add_argument("--max-seconds", type=float, default=MAX_SECONDS,
                   help=f"refuse longer audio, from the WAV header (default {MAX_SECONDS:.0f} s)")


def load_whisper(name: str, dtype):
    from ..models.ctranslate2 import load_whisper_base, load_whisper_tiny_en

    if name not in WHISPER_MODELS:
        raise ValueError(f"--model must be one of {WHISPER_MODELS}, got {name!r}")
    return (load_whisper_tiny_en if name == "tiny.en" else load_whisper_base)(dtype)


def reference_text(path: Path) -> str | None:
    """The text a clip says, from ``<same name>.txt`` beside it (the shipped clip has one), else ``None``."""
    txt = Path(path).with_suffix(".txt")
    return txt.read_text(encoding="utf-8").strip() if txt.is_file() else None


def timed(sides: dict, rounds: int, warm_ups: dict | None = None) -> dict[str, tuple[list[float], object]]:
    """Time each side's run (side -> a function of no arguments) fairly: one untimed warm-up run per side (generate's
    first call pays one-time costs; ``warm_ups``: side -> a cheaper warm-up, default the run itself), then
    ``rounds`` rounds with the order of the sides alternating. Returns side -> (seconds of each timed run, the last
    run's result)."""
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        raise ValueError(f"rounds must be a positive int, got {rounds!r}")
    for name, run in sides.items():
        (warm_ups or {}).get(name, run)()
    out = {name: ([], None) for name in sides}
    names = list(sides)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            t = time.perf_counter()
            result = sides[name]()
            out[name] = (out[name][0] + [time.perf_counter() - t], result)
    return out


def run(args: argparse.Namespace) -> int:
    from ..audio import read_wav, speech_clip

    if args.beams < 1:
        raise ValueError(f"--beams must be ≥ 1, got {args.beams}")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be ≥ 1, got {args.rounds}")
    if not args.max_seconds > 0:
        raise ValueError(f"--max-seconds must be positive, got {args.max_seconds}")
    path = Path(args.file) if args.file else speech_clip()[0]
    audio = read_wav(path, max_seconds=args.max_seconds)  # a missing or bad file is refused before the model loads

    import torch
    from rich.console import Console
    from rich.table import Table

    from .. import api
    from ..kernels import load_for
    from ..models.whisper_run import context_bytes, transcribe_tokens
    from ..units import human_bytes

    console = Console()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model, processor = load_whisper(args.model, dtype)
    api.apply(model, args.method)
    load_for(args.method)  # build / load the method's ops before any timing (a first use may compile them)
    opts = {"num_beams": args.beams, "timestamps": args.timestamps}
    sides = {"kvslim": lambda: transcribe_tokens(model, processor, audio, **opts)}
    if args.compare:  # HF's side on its own copy of the model: no apply/restore between the timed runs
        hf_model, _ = load_whisper(args.model, dtype)
        sides["hf"] = lambda: transcribe_tokens(hf_model, processor, audio, **opts)
    # alone, the warm-up decodes the first 5 s only (the one-time costs, not the whole file twice)
    warm = None if args.compare else {"kvslim": lambda: transcribe_tokens(model, processor, audio[:5 * 16000], **opts)}
    runs = timed(sides, args.rounds if args.compare else 1, warm)
    tokens = runs["kvslim"][1]
    text = processor.batch_decode(tokens, skip_special_tokens=not args.timestamps,
                                  decode_with_timestamps=args.timestamps)[0]
    console.print(text.strip(), highlight=False, soft_wrap=True)
    said = reference_text(path)
    if said is not None:
        console.print(f"reference ({path.with_suffix('.txt').name}): {said}", highlight=False, soft_wrap=True)
    ours = context_bytes(model, processor, audio, tokens)
    api.restore(model)
    hf_bytes = context_bytes(model, processor, audio, tokens)  # same tokens through HF's own cache
    n = len(runs["kvslim"][0])
    title = (f"Whisper {args.model} ({args.dtype}), {len(audio) / 16000:.1f} s audio, {tokens.shape[1]} tokens, "
             f"beams {args.beams}")
    caption = (f"decode s: median of {n} runs per side after one warm-up run each, the sides alternating"
               if args.compare else "decode s: one run, after a warm-up on the first 5 s")
    table = Table(title=title, caption=caption)
    for col in ("cache", "context bytes (first 30 s window)", "× HF", "decode s"):
        table.add_column(col)
    hf_s = f"{statistics.median(runs['hf'][0]):.2f}" if args.compare else ""
    table.add_row("HF EncoderDecoderCache", human_bytes(hf_bytes), "1.000", hf_s)
    table.add_row(f"kvslim {args.method}", human_bytes(ours), f"{ours / hf_bytes:.3f}",
                  f"{statistics.median(runs['kvslim'][0]):.2f}")
    console.print(table)
    if args.compare:
        hf_tokens = runs["hf"][1]
        same = hf_tokens.shape == tokens.shape and torch.equal(hf_tokens, tokens)
        console.print(f"tokens identical to HF's cache: {'yes' if same else 'NO'}")
        return 0 if same else 1
    return 0
