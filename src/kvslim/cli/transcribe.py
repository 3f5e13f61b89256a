"""Transcribe a WAV file with real Whisper (tiny.en / base from PyPI, offline) and a kvslim cache.

``kvslim transcribe FILE.wav [--model tiny.en|base] [--method slim] [--beams N] [--timestamps]
[--compare]``: prints the transcript and the context memory against HF's ``EncoderDecoderCache``;
``--compare`` also decodes with HF's own cache and says whether the tokens are identical.
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

WHISPER_MODELS = ("tiny.en", "base")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", nargs="?", default=None,
                   help="PCM WAV file (any rate, mono or stereo); default: the shipped 17 s clip")
    p.add_argument("--model", default="tiny.en", choices=WHISPER_MODELS, help="Whisper checkpoint (default tiny.en)")
    p.add_argument("--method", default="slim", choices=("slim",),
                   help="kvslim method (slim: encoder output cached once for all layers, decoder X/K caches; "
                        "the storage methods do not apply to encoder-decoders)")
    p.add_argument("--beams", type=int, default=1, help="beam width (default 1: greedy)")
    p.add_argument("--timestamps", action="store_true", help="predict segment timestamps")
    p.add_argument("--dtype", default="fp32", choices=tuple(DTYPES), help="model dtype (default fp32)")
    p.add_argument("--compare", action="store_true", help="also decode with HF's cache and compare the tokens")


def load_whisper(name: str, dtype: torch.dtype):
    from ..models.ctranslate2 import load_whisper_base, load_whisper_tiny_en

    if name not in WHISPER_MODELS:
        raise ValueError(f"--model must be one of {WHISPER_MODELS}, got {name!r}")
    return (load_whisper_tiny_en if name == "tiny.en" else load_whisper_base)(dtype)


def run(args: argparse.Namespace) -> int:
    from ..audio import read_wav, speech_clip

    if args.beams < 1:
        raise ValueError(f"--beams must be ≥ 1, got {args.beams}")
    path = args.file or speech_clip()[0]
    audio = read_wav(path)  # a missing or bad file is refused before the model loads

    from .. import api
    from ..kernels import load_for
    from ..models.whisper_run import context_bytes, transcribe_tokens
    console = Console()
    model, processor = load_whisper(args.model, DTYPES[args.dtype])
    opts = {"num_beams": args.beams, "timestamps": args.timestamps}
    api.apply(model, args.method)
    load_for(args.method)  # build / load the method's ops outside the timing (a first use may compile them)
    t = time.perf_counter()
    tokens = transcribe_tokens(model, processor, audio, **opts)
    seconds = time.perf_counter() - t
    text = processor.batch_decode(tokens, skip_special_tokens=not args.timestamps,
                                  decode_with_timestamps=args.timestamps)[0]
    console.print(text.strip(), highlight=False, soft_wrap=True)
    ours = context_bytes(model, processor, audio, tokens)
    api.restore(model)
    hf_bytes = context_bytes(model, processor, audio, tokens)  # same tokens through HF's own cache
    hf_tokens = hf_s = None
    if args.compare:
        t = time.perf_counter()
        hf_tokens = transcribe_tokens(model, processor, audio, **opts)
        hf_s = time.perf_counter() - t
    table = Table(title=f"Whisper {args.model} ({args.dtype}), {len(audio) / 16000:.1f} s audio, "
                        f"{tokens.shape[1]} tokens, beams {args.beams}")
    for col in ("cache", "context bytes (first 30 s window)", "× HF", "decode s"):
        table.add_column(col)
    table.add_row("HF EncoderDecoderCache", f"{hf_bytes:,}", "1.000", f"{hf_s:.1f}" if hf_s is not None else "")
    table.add_row(f"kvslim {args.method}", f"{ours:,}", f"{ours / hf_bytes:.3f}", f"{seconds:.1f}")
    console.print(table)
    if hf_tokens is not None:
        same = hf_tokens.shape == tokens.shape and torch.equal(hf_tokens, tokens)
        console.print(f"tokens identical to HF's cache: {'yes' if same else 'NO'}")
        return 0 if same else 1
    return 0
