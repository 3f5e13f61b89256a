"""Whisper decode speed and context memory: kvslim ``slim`` (E once for all cross-attention layers, read by the
``kvslim::encdec_decode`` op; X-cache self-attention) against Hugging Face's own ``EncoderDecoderCache``.

Model: Whisper-tiny shapes (d 384, 6 heads, 4 decoder layers, 1500-frame encoder context, max 448 target
positions), random init, vocabulary cut to 4,096 (the real 51,865-row LM head would dominate batch-64 time on a
2-core CPU and hide the attention). float32, 2 threads. E (B, 1500, 384) is random (decode cost does not depend on
its values); both paths prefill the same 4 start tokens (untimed), then decode the same greedy tokens (checked).

The two configurations run interleaved (A B B A A B ...: trial t runs both, order alternating) on two copies of
the same weights, so machine noise hits both alike; each trial's figure is the median step time, and the speedup
is the median of the per-trial ratios. % roofline: bytes a step must read (decoder weights + every cached tensor
each layer reads: HF's K and V per layer, kvslim's E once per layer) ÷ the measured bandwidth, over the step time.

    .venv/bin/python benchmarks/bench_whisper.py                 # JSON + PNG in benchmarks/results/
    .venv/bin/python benchmarks/bench_whisper.py --batches 1 8 --trials 3
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import subprocess
import time
import warnings
from pathlib import Path

import torch
import transformers
from transformers import WhisperConfig, WhisperForConditionalGeneration

import kvslim
from kvslim.adapters.compat import CACHE_KW
from kvslim.bench.decode import weight_bytes
from kvslim.bench.roofline import measure_bandwidth
from kvslim.caches.encdec import hf_cache_nbytes
from kvslim.kernels import encdec_decode

OUT = Path(__file__).parent / "results"
CONFIGS = ("hf", "kvslim")


def build(vocab: int) -> WhisperForConditionalGeneration:
    torch.manual_seed(0)
    cfg = WhisperConfig(vocab_size=vocab, num_mel_bins=80, d_model=384, encoder_layers=4, decoder_layers=4,
                        encoder_attention_heads=6, decoder_attention_heads=6, encoder_ffn_dim=1536,
                        decoder_ffn_dim=1536, max_source_positions=1500, max_target_positions=448,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    return WhisperForConditionalGeneration(cfg).eval()


@torch.no_grad()
def decode(model, enc: torch.Tensor, steps: int, cache, cpu: list | None = None
           ) -> tuple[list[float], torch.Tensor, object]:
    """Greedy decode ``steps`` tokens after a 4-token prompt (untimed); per-step seconds, tokens, final cache.

    Only the decoder steps over the 1500 encoder frames are timed (no ``generate``: no logits processors such as
    Whisper's SuppressTokens, whose ``torch.isin`` would weigh the same on both sides). ``cpu`` receives the
    per-step process CPU seconds (all threads)."""
    b = enc.shape[0]
    ids = torch.tensor([[1, 5, 6, 7]]).expand(b, 4)
    o = model(encoder_outputs=(enc,), decoder_input_ids=ids, **{CACHE_KW: cache}, use_cache=True)
    cache, tok, times, toks = getattr(o, CACHE_KW), o.logits[:, -1].argmax(-1, keepdim=True), [], []
    for _ in range(steps):
        c0, t0 = time.process_time(), time.perf_counter()
        o = model(encoder_outputs=(enc,), decoder_input_ids=tok, **{CACHE_KW: cache}, use_cache=True)
        tok = o.logits[:, -1].argmax(-1, keepdim=True)
        times.append(time.perf_counter() - t0)
        if cpu is not None:
            cpu.append(time.process_time() - c0)
        cache = getattr(o, CACHE_KW)
        toks.append(tok)
    return times, torch.cat(toks, 1), cache


def read_bytes(name: str, cache, enc: torch.Tensor, layers: int) -> int:
    """Cached bytes one decode step reads: HF every K/V tensor; kvslim its self-attention rows + E once per layer."""
    if name == "hf":
        return hf_cache_nbytes(cache)
    return int(cache.self_attention_cache.nbytes) + layers * enc.numel() * enc.element_size()


def run(batches: list[int], steps: int, trials: int, vocab: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    models = {"hf": build(vocab)}
    models["kvslim"] = copy.deepcopy(models["hf"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = kvslim.apply(models["kvslim"], "slim")
    dec = models["hf"].model.decoder
    wbytes = weight_bytes(dec)
    layers = models["hf"].config.decoder_layers
    bw = measure_bandwidth(nbytes=1 << 29, trials=5)
    rows = []
    for b in batches:
        enc = torch.randn(b, 1500, 384, generator=torch.Generator().manual_seed(b))

        def make(name):
            return None if name == "hf" else kvslim.make_cache(models["kvslim"], max_length=4 + steps + 1)

        for name in CONFIGS:  # warm-up (and the op's first-use build, outside every timing)
            decode(models[name], enc, 2, make(name))
        per = {name: [] for name in CONFIGS}
        cpu = {name: [] for name in CONFIGS}
        ratios, toks, caches = [], {}, {}
        for t in range(trials):
            order = CONFIGS if t % 2 == 0 else CONFIGS[::-1]
            for name in order:
                steps_cpu = []
                times, toks[name], caches[name] = decode(models[name], enc, steps, make(name), steps_cpu)
                per[name].append(statistics.median(times))
                cpu[name].append(statistics.median(steps_cpu))
            ratios.append(per["hf"][-1] / per["kvslim"][-1])
        res = {}
        for name in CONFIGS:
            step = statistics.median(per[name])
            cache_bytes = hf_cache_nbytes(caches[name])
            moved = wbytes + read_bytes(name, caches[name], enc, layers)
            res[name] = {"step_s": step, "step_s_trials": per[name], "tokens_per_s": b / step,
                         "cpu_s_per_step": statistics.median(cpu[name]), "cpu_s_per_step_trials": cpu[name],
                         "cache_bytes": cache_bytes, "cache_bytes_per_sequence": cache_bytes // b,
                         "bytes_per_step": moved, "gbps": moved / step / 1e9,
                         "roofline_fraction": moved / step / 1e9 / bw["roofline_gbps"]}
            print(f"batch {b:3d} {name:7s} {b / step:9.1f} tok/s  step {step * 1e3:8.1f} ms  "
                  f"cpu {res[name]['cpu_s_per_step'] * 1e3:8.1f} ms  "
                  f"cache {cache_bytes / 2**20:9.1f} MiB  {100 * res[name]['roofline_fraction']:5.1f}% roofline",
                  flush=True)
        same = torch.equal(toks["hf"], toks["kvslim"])
        ctx = 4 + steps
        rows.append({"batch": b, "context_tokens": ctx, "encoder_frames": 1500, "tokens_identical": same,
                     "speedup": statistics.median(ratios), "speedup_trials": ratios,
                     "cpu_speedup": statistics.median(h / k for h, k in zip(cpu["hf"], cpu["kvslim"])),
                     "memory_ratio": res["hf"]["cache_bytes"] / res["kvslim"]["cache_bytes"],
                     "plan_bytes": plan.cache_bytes(ctx, b), "plan_dense_bytes": plan.dense_bytes(ctx, b), **res})
        print(f"batch {b:3d} kvslim / HF speed (median of {trials} interleaved trials): {rows[-1]['speedup']:.2f}x  "
              f"(CPU time {rows[-1]['cpu_speedup']:.2f}x)  "
              f"tokens identical: {same}", flush=True)
    full = kvslim.plan_config(models["hf"].config, "slim", dtype="float32")
    return {"benchmark": "bench_whisper", "model": "whisper-tiny shapes (d 384, h 6, 4 decoder layers), vocab "
            f"{vocab}, float32, random init", "device": "cpu", "threads": threads, "steps": steps, "trials": trials,
            "interleaved": True, "op_isa": encdec_decode.isa(), "bandwidth": bw, "decoder_weight_bytes": wbytes,
            "rows": rows,
            "ratio_at_448_tokens": full.dense_bytes(448) / full.cache_bytes(448),
            "ratio_cross_only": full.dense_fixed_bytes / full.layers[0].fixed_bytes,
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "python": platform.python_version()},
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                     cwd=Path(__file__).parent).stdout.strip(),
            "cpu": platform.processor() or platform.machine(),
            "note": "shared 2-core machine under load from other jobs: absolute times are noisy, use the ratios"}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [str(r["batch"]) for r in rows]
    x = range(len(rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.bar([i - 0.2 for i in x], [r["hf"]["tokens_per_s"] for r in rows], 0.4, label="HF EncoderDecoderCache")
    a.bar([i + 0.2 for i in x], [r["kvslim"]["tokens_per_s"] for r in rows], 0.4, label="kvslim slim (E once)")
    for i, r in enumerate(rows):
        a.text(i + 0.2, r["kvslim"]["tokens_per_s"], f"{r['speedup']:.2f}×", ha="center", va="bottom", fontsize=8)
    a.set_xticks(list(x), labels)
    a.set_xlabel("batch")
    a.set_ylabel("decode tokens/s (median, interleaved)")
    a.set_yscale("log")
    a.legend()
    b.bar([i - 0.2 for i in x], [r["hf"]["cache_bytes_per_sequence"] / 2**20 for r in rows], 0.4, label="HF")
    b.bar([i + 0.2 for i in x], [r["kvslim"]["cache_bytes_per_sequence"] / 2**20 for r in rows], 0.4, label="kvslim")
    b.set_xticks(list(x), labels)
    b.set_xlabel("batch")
    b.set_ylabel("context memory per sequence (MiB)")
    b.legend()
    fig.suptitle(f"Whisper-tiny shapes, 1500 encoder frames, {result['device']} {result['threads']} threads "
                 f"(op: {result['op_isa']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=OUT / "bench_whisper", help="JSON and PNG path (no suffix)")
    a = p.parse_args()
    result = run(a.batches, a.steps, a.trials, a.vocab, a.threads)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    plot(result, a.out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k not in ("rows", "bandwidth")}, indent=1))


if __name__ == "__main__":
    main()
