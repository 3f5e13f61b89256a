"""Whisper decode speed and context memory: kvslim ``slim`` (E once for all cross-attention layers, X-cache
self-attention) against Hugging Face's own ``EncoderDecoderCache``, same run, same weights.

Model: Whisper-tiny shapes (d 384, 6 heads, 4 decoder layers, 1500-frame encoder context, max 448 target
positions), random init, vocabulary cut to 4,096 (the real 51,865-row LM head would dominate batch-64 time on a
2-core CPU and hide the attention). float32. The encoder output E (B, 1500, 384) is random (decode cost does not
depend on its values); both paths prefill the same start tokens, then decode the same greedy tokens (checked).

    .venv/bin/python benchmarks/bench_whisper.py                 # ~3 min on 2 cores; JSON + PNG in benchmarks/results/
    .venv/bin/python benchmarks/bench_whisper.py --batches 1 8   # smaller
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch
import transformers
from transformers import WhisperConfig, WhisperForConditionalGeneration

import kvslim
from kvslim.caches.encdec import hf_cache_nbytes

OUT = Path(__file__).parent / "results"


def build(vocab: int) -> WhisperForConditionalGeneration:
    torch.manual_seed(0)
    cfg = WhisperConfig(vocab_size=vocab, num_mel_bins=80, d_model=384, encoder_layers=4, decoder_layers=4,
                        encoder_attention_heads=6, decoder_attention_heads=6, encoder_ffn_dim=1536,
                        decoder_ffn_dim=1536, max_source_positions=1500, max_target_positions=448,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    return WhisperForConditionalGeneration(cfg).eval()


@torch.no_grad()
def decode(model, enc: torch.Tensor, steps: int, cache) -> tuple[list[float], torch.Tensor, object]:
    """Greedy decode ``steps`` tokens after a 4-token prompt; per-step seconds, tokens, final cache."""
    b = enc.shape[0]
    ids = torch.tensor([[1, 5, 6, 7]]).expand(b, 4)
    o = model(encoder_outputs=(enc,), decoder_input_ids=ids, past_key_values=cache, use_cache=True)
    cache, tok, times, toks = o.past_key_values, o.logits[:, -1].argmax(-1, keepdim=True), [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        o = model(encoder_outputs=(enc,), decoder_input_ids=tok, past_key_values=cache, use_cache=True)
        tok = o.logits[:, -1].argmax(-1, keepdim=True)
        times.append(time.perf_counter() - t0)
        cache = o.past_key_values
        toks.append(tok)
    return times, torch.cat(toks, 1), cache


def run(batches: list[int], steps: int, trials: int, vocab: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    model = build(vocab)
    rows = []
    for b in batches:
        enc = torch.randn(b, 1500, 384, generator=torch.Generator().manual_seed(b))
        res = {}
        for name in ("hf", "kvslim"):
            if name == "kvslim":
                plan = kvslim.apply(model, "slim")
            else:
                kvslim.restore(model)
            make = (lambda: None) if name == "hf" else (lambda: kvslim.make_cache(model, max_length=4 + steps + 1))
            decode(model, enc, 2, make())  # warm-up
            meds, toks, cache = [], None, None
            for _ in range(trials):
                times, toks, cache = decode(model, enc, steps, make())
                meds.append(statistics.median(times))
            step = statistics.median(meds)
            nbytes = hf_cache_nbytes(cache)
            res[name] = {"step_s": step, "tokens_per_s": b / step, "cache_bytes": nbytes,
                         "cache_bytes_per_sequence": nbytes // b, "tokens": toks}
            print(f"batch {b:3d} {name:7s} {b / step:9.1f} tok/s  step {step * 1e3:8.1f} ms  "
                  f"cache {nbytes / 2**20:9.1f} MiB", flush=True)
        same = torch.equal(res["hf"].pop("tokens"), res["kvslim"].pop("tokens"))
        ctx = 4 + steps
        rows.append({"batch": b, "context_tokens": ctx, "encoder_frames": 1500, "tokens_identical": same,
                     "speedup": res["kvslim"]["tokens_per_s"] / res["hf"]["tokens_per_s"],
                     "memory_ratio": res["hf"]["cache_bytes"] / res["kvslim"]["cache_bytes"],
                     "plan_bytes": plan.cache_bytes(ctx, b), "plan_dense_bytes": plan.dense_bytes(ctx, b), **res})
    full = kvslim.plan_config(model.config, "slim", dtype="float32")
    return {"benchmark": "bench_whisper", "model": "whisper-tiny shapes (d 384, h 6, 4 decoder layers), vocab "
            f"{vocab}, float32, random init", "device": "cpu", "threads": threads, "steps": steps, "trials": trials,
            "rows": rows,
            "ratio_at_448_tokens": full.dense_bytes(448) / full.cache_bytes(448),
            "ratio_cross_only": full.dense_fixed_bytes / full.layers[0].fixed_bytes,
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "python": platform.python_version()},
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                     cwd=Path(__file__).parent).stdout.strip(),
            "cpu": platform.processor() or platform.machine()}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [str(r["batch"]) for r in rows]
    x = range(len(rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar([i - 0.2 for i in x], [r["hf"]["tokens_per_s"] for r in rows], 0.4, label="HF EncoderDecoderCache")
    a.bar([i + 0.2 for i in x], [r["kvslim"]["tokens_per_s"] for r in rows], 0.4, label="kvslim slim (E once)")
    a.set_xticks(list(x), labels)
    a.set_xlabel("batch")
    a.set_ylabel("decode tokens/s")
    a.set_yscale("log")
    a.legend()
    b.bar([i - 0.2 for i in x], [r["hf"]["cache_bytes_per_sequence"] / 2**20 for r in rows], 0.4, label="HF")
    b.bar([i + 0.2 for i in x], [r["kvslim"]["cache_bytes_per_sequence"] / 2**20 for r in rows], 0.4, label="kvslim")
    b.set_xticks(list(x), labels)
    b.set_xlabel("batch")
    b.set_ylabel("context memory per sequence (MiB)")
    b.legend()
    fig.suptitle(f"Whisper-tiny shapes, 1500 encoder frames, {result['device']} {result['threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    result = run(a.batches, a.steps, a.trials, a.vocab, a.threads)
    OUT.mkdir(exist_ok=True)
    (OUT / "bench_whisper.json").write_text(json.dumps(result, indent=2))
    plot(result, OUT / "bench_whisper.png")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
    main()
