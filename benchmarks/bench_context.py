"""Decode tokens/s against context length per method (dense, int8, int4, slim, MLA), fp32 on CPU, one run.

Models (random weights, float32, ``--threads`` threads):

- the ~100M MHA Llama of ``kvslim bench`` (d 768, 12 layers, 12 heads of 64): ``dense`` (kvslim dense cache +
  SDPA), ``int8`` / ``int4`` (kvslim grouped caches, group 64, through whatever decode path the library uses
  today), ``slim`` (K-only cache, option 2, the ``kvslim::slim_decode`` op);
- a DeepSeek-V2-shaped model of the same size (d 768, 12 layers, 12 heads, ``kv_lora_rank`` 256, RoPE 32 + 64
  no-RoPE key dims, values 64, dense MLP 2048): ``mla-hf`` (Hugging Face's own DeepseekV2 attention and cache, which
  already stores the latents) and ``mla`` (kvslim's latent cache, absorbed decode). MLA needs an MLA model, so its baseline is that model's HF cache.

Caches are filled with synthetic tokens through each cache's own ``update`` / ``write`` (decode cost does not
depend on the cached values). Per context, the configurations of one model run interleaved (trial t runs all of
them, order rotating; only one model's caches are alive at a time); each trial's figure is the median step time,
the ratio to the model's baseline the median of per-trial ratios. The machine is shared: absolute figures are noisy,
the ratios are the result. Compile (op build) happens before any timing.

    .venv/bin/python benchmarks/bench_context.py                          # 1k-8k, batch 4; JSON + PNG
    .venv/bin/python benchmarks/bench_context.py --contexts 512 1024 --batch 2 --steps 2 --trials 2   # a quick look
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import platform
import statistics
import subprocess
import time
import warnings
from pathlib import Path

import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DynamicCache

import kvslim
from kvslim.adapters.compat import CACHE_KW
from kvslim.bench.decode import make_filled_cache, mha_100m, weight_bytes
from kvslim.bench.roofline import measure_bandwidth
from kvslim.kernels import slim_decode

RESULTS = Path(__file__).resolve().parent / "results"
LLAMA = ("dense", "int8", "int4", "slim")
DEEPSEEK = ("mla-hf", "mla")
BASELINE = {"dense": "dense", "int8": "dense", "int4": "dense", "slim": "dense", "mla-hf": "mla-hf", "mla": "mla-hf"}
KIND = {"dense": "kvslim-dense", "int8": "kvslim-int8", "int4": "kvslim-int4"}


def deepseek_100m() -> DeepseekV2ForCausalLM:
    """A ~100M-parameter DeepSeek-V2-shaped MLA model (no MoE, no q compression), random weights, fp32."""
    torch.manual_seed(0)
    cfg = DeepseekV2Config(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                           num_attention_heads=12, num_key_value_heads=12, kv_lora_rank=256, q_lora_rank=None,
                           qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=8,
                           first_k_dense_replace=12, max_position_embeddings=16384)  # every layer dense: no MoE
    return DeepseekV2ForCausalLM(cfg).eval()


def models() -> dict:
    """One model object per configuration (copies share nothing, weights equal within a family)."""
    llama, ds = mha_100m(), deepseek_100m()
    out = {}
    with warnings.catch_warnings():  # random weights: the fp32 slim error is measured elsewhere, not hidden
        warnings.simplefilter("ignore")
        for name in LLAMA:
            out[name] = copy.deepcopy(llama)
        kvslim.apply(out["slim"], "slim", cache="k", rank=0)
        out["mla-hf"] = ds
        out["mla"] = copy.deepcopy(ds)
        kvslim.apply(out["mla"], "mla")
    return out


def filled(name: str, model, batch: int, context: int, room: int):
    """A cache for configuration ``name`` holding ``context`` synthetic tokens per sequence, ``room`` more."""
    g = torch.Generator().manual_seed(1)
    if name in KIND:  # the method is applied inside (and stays applied for the timing)
        return make_filled_cache(model, KIND[name], batch, context, room)
    if name == "slim":
        cache = kvslim.make_cache(model, max_length=context + room)
        pos = torch.arange(context)[None].expand(batch, -1)
        for layer in cache.layers:
            layer.write(torch.randn(batch, context, layer.width, generator=g), pos)
        return cache
    cfg = model.config  # "mla" and "mla-hf": both hold the latents (HF's DeepSeek cache stores c_kv and k_pe too)
    cache = (kvslim.make_cache(model, max_length=context + room) if name == "mla"
             else DynamicCache(config=cfg))
    for i in range(cfg.num_hidden_layers):
        cache.update(torch.randn(batch, 1, context, cfg.kv_lora_rank, generator=g),
                     torch.randn(batch, 1, context, cfg.qk_rope_head_dim, generator=g), i)
    return cache


def cache_bytes(cache) -> int:
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes)
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


@torch.inference_mode()
def decode(model, cache, batch: int, steps: int) -> list[float]:
    """Seconds per greedy decode step; positions continue from the cache length."""
    tok = torch.zeros(batch, 1, dtype=torch.long)
    times = []
    for _ in range(steps):
        n = cache.get_seq_length()
        t0 = time.perf_counter()
        out = model(tok, position_ids=torch.full((batch, 1), n), **{CACHE_KW: cache}, use_cache=True,
                    cache_position=torch.tensor([n]))
        tok = out.logits[:, -1:].argmax(-1)
        times.append(time.perf_counter() - t0)
    return times


def run_group(names: tuple[str, ...], ms: dict, batch: int, context: int, steps: int, trials: int,
              bw: float) -> dict:
    room = (trials + 1) * steps + 2
    caches = {}
    for name in names:
        caches[name] = filled(name, ms[name], batch, context, room)
        decode(ms[name], caches[name], batch, 1)  # warm-up (op load, first-call allocations): never timed
    per = {name: [] for name in names}
    for t in range(trials):
        for name in names[t % len(names):] + names[:t % len(names)]:
            per[name].append(statistics.median(decode(ms[name], caches[name], batch, steps)))
    out = {}
    for name in names:
        step, base = statistics.median(per[name]), BASELINE[name]
        moved = weight_bytes(ms[name]) + cache_bytes(caches[name])
        out[name] = {"step_s": step, "step_s_trials": per[name], "tokens_per_s": batch / step,
                     "cache_bytes": cache_bytes(caches[name]), "bytes_per_step": moved,
                     "roofline_fraction": moved / step / 1e9 / bw,
                     "speed_vs_baseline": statistics.median(b / s for b, s in zip(per[base], per[name])),
                     "baseline": base}
        r = out[name]
        print(f"{context:6d} x {batch}  {name:7s} {r['tokens_per_s']:8.2f} tok/s  x {base} "
              f"{r['speed_vs_baseline']:.2f}  cache {r['cache_bytes'] / 2**20:8.1f} MiB  "
              f"{100 * r['roofline_fraction']:.0f}% roofline", flush=True)
    del caches
    gc.collect()
    return out


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    xs = [p["context"] for p in record["points"]]
    for name in LLAMA + DEEPSEEK:
        style = "--" if name in DEEPSEEK else "-"
        a.plot(xs, [p["configs"][name]["tokens_per_s"] for p in record["points"]], style, marker="o", label=name)
        if name != BASELINE[name]:
            b.plot(xs, [p["configs"][name]["speed_vs_baseline"] for p in record["points"]], style, marker="o",
                   label=f"{name} / {BASELINE[name]}")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.legend(fontsize=8)
    a.set_ylabel(f"decode tokens/s (batch {record['batch']}, median)")
    a.set_title("solid: 100M MHA Llama; dashed: 100M DeepSeek-V2-shaped (MLA)", fontsize=9)
    b.axhline(1.0, color="grey", lw=0.8)
    b.set_ylabel("speed relative to the same model's baseline")
    b.set_title(f"fp32, {record['threads']} threads, {record['op_isa']}, interleaved (shared, loaded machine)",
                fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="timed decode steps per configuration per trial")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_context")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    slim_decode.available()  # build (or load) the ops before anything is timed
    ms = models()
    bw = measure_bandwidth(nbytes=1 << 28, trials=5)
    points = []
    for ctx in args.contexts:  # JSON and PNG rewritten after every context: a stopped run keeps what it measured
        configs = {}
        for names in (LLAMA, DEEPSEEK):
            configs.update(run_group(names, ms, args.batch, ctx, args.steps, args.trials, bw["roofline_gbps"]))
        points.append({"context": ctx, "configs": configs})
        write(points, args, bw)


def write(points: list[dict], args, bw: dict) -> None:
    record = {"benchmark": "bench_context", "dtype": "float32", "batch": args.batch, "threads": args.threads,
              "steps": args.steps, "trials": args.trials, "interleaved": True, "op_isa": slim_decode.isa(),
              "bandwidth": bw, "points": points,
              "models": {"llama": "kvslim.bench.decode.mha_100m (d768 L12 h12 MHA)",
                         "deepseek": "d768 L12 h12 kv_lora 256 rope 32 nope 64 v 64, dense MLP 2048"},
              "versions": {"torch": torch.__version__, "python": platform.python_version(),
                           "kvslim": kvslim.__version__},
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=Path(__file__).parent).stdout.strip(),
              "note": "shared 2-core machine under load from other jobs: absolute times are noisy, use the ratios"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=2))
    plot(record, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
