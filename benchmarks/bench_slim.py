"""Decode throughput of slim attention (K-only cache, option 2) against the dense kvslim cache, same run.

Model: the ~100M-parameter MHA Llama of ``kvslim bench`` (d 768, 12 layers, 12 heads of 64, random weights, fp32,
2 threads). Caches are filled with synthetic rows instead of a prefill (decode cost depends only on what is
cached). Configurations: ``dense`` (kvslim dense cache + SDPA), ``slim-option2`` (K-only cache through the C++ op
``kvslim::slim_decode``), ``slim-option2-torch`` (the same cache through the torch path); the two slim ones share
one cache. They run interleaved (trial t runs every configuration, order rotating), each trial's figure is the
median step time, and the ratio to dense is the median of the per-trial ratios. % roofline: (weights + cache bytes
read per step) ÷ measured bandwidth, over the step time. A profile of one step per configuration says where the
time goes. Writes benchmarks/results/bench_slim.json and .png (tokens/s against context, per method).

    .venv/bin/python benchmarks/bench_slim.py                                   # 1k-8k × batch 8, and 1k × 1
    .venv/bin/python benchmarks/bench_slim.py --points 1024x1 --steps 3 --trials 3   # a quick look
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

import kvslim
from kvslim.adapters.compat import CACHE_KW
from kvslim.bench.decode import mha_100m, weight_bytes
from kvslim.bench.roofline import measure_bandwidth
from kvslim.kernels import slim_decode as kernel

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = ("dense", "slim-option2", "slim-option2-torch")


def build_models(configs: tuple[str, ...]) -> dict:
    """One model per configuration (same weights)."""
    base = mha_100m()
    models = {}
    for name in configs:
        m = copy.deepcopy(base)
        with warnings.catch_warnings():  # random weights: the fp32 K-cache error is measured, not hidden
            warnings.simplefilter("ignore")
            if name == "dense":
                kvslim.apply(m, "dense")
            else:
                kvslim.apply(m, "slim", cache="k", rank=0, kernel="torch" if name.endswith("-torch") else "auto")
        models[name] = m
    return models


def filled_cache(model, name: str, batch: int, context: int, room: int):
    """A cache of ``context`` synthetic tokens per sequence (N(0, 1) rows), with ``room`` more."""
    cfg = model.config
    h, dk = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    cache = kvslim.make_cache(model, max_length=context + room)
    g = torch.Generator().manual_seed(1)
    pos = torch.arange(context)[None].expand(batch, -1)
    for i, layer in enumerate(cache.layers):
        if name == "dense":
            k = torch.randn(batch, h, context, dk, generator=g)
            cache.update(k, torch.randn(batch, h, context, dk, generator=g), i)
        else:
            layer.write(torch.randn(batch, context, layer.width, generator=g), pos)
    return cache


@torch.inference_mode()
def decode(model, cache, batch: int, steps: int, cpu: list | None = None) -> list[float]:
    """Seconds per decode step; positions continue from the cache length. ``cpu`` receives the per-step process
    CPU seconds (all threads)."""
    tok = torch.zeros(batch, 1, dtype=torch.long)
    times = []
    for _ in range(steps):
        n = cache.get_seq_length()
        pos = torch.full((batch, 1), n)
        c0, t0 = time.process_time(), time.perf_counter()
        out = model(tok, position_ids=pos, **{CACHE_KW: cache}, use_cache=True, cache_position=torch.tensor([n]))
        tok = out.logits[:, -1:].argmax(-1)
        times.append(time.perf_counter() - t0)
        if cpu is not None:
            cpu.append(time.process_time() - c0)
    return times


@torch.inference_mode()
def profile_step(model, cache, batch: int) -> dict:
    """ms per op (self CPU time) in one decode step, largest first (top 8)."""
    from torch.profiler import ProfilerActivity, profile

    n = cache.get_seq_length()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(torch.zeros(batch, 1, dtype=torch.long), position_ids=torch.full((batch, 1), n),
              **{CACHE_KW: cache}, use_cache=True, cache_position=torch.tensor([n]))
    ev = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]
    return {e.key: round(e.self_cpu_time_total / 1e3, 2) for e in ev}


def run_point(models: dict, batch: int, context: int, steps: int, trials: int, bw: float, wbytes: int) -> dict:
    room = (trials + 2) * steps + 4
    CONFIGS = tuple(models)  # noqa: N806 - the configurations of this run, in order
    caches = {"dense": filled_cache(models["dense"], "dense", batch, context, room)}
    slim = filled_cache(models["slim-option2"], "slim", batch, context, room)  # shared by both slim configs
    caches.update({name: slim for name in CONFIGS if name != "dense"})
    for name in CONFIGS:  # warm-up (first use of the op: built earlier, loaded here; never timed)
        decode(models[name], caches[name], batch, 1)
    per = {name: [] for name in CONFIGS}
    cpu = {name: [] for name in CONFIGS}
    for t in range(trials):
        order = CONFIGS[t % len(CONFIGS):] + CONFIGS[:t % len(CONFIGS)]
        for name in order:
            steps_cpu = []
            per[name].append(statistics.median(decode(models[name], caches[name], batch, steps, steps_cpu)))
            cpu[name].append(statistics.median(steps_cpu))
    prof = {name: profile_step(models[name], caches[name], batch) for name in CONFIGS}
    out = {"context": context, "batch": batch, "configs": {}}
    for name in CONFIGS:
        step = statistics.median(per[name])
        cache_bytes = int(caches[name].nbytes)
        moved = wbytes + cache_bytes
        ratios = [d / s for d, s in zip(per["dense"], per[name])]
        out["configs"][name] = {
            "step_s": step, "step_s_trials": per[name], "tokens_per_s": batch / step, "cache_bytes": cache_bytes,
            "bytes_per_step": moved, "gbps": moved / step / 1e9, "roofline_fraction": moved / step / 1e9 / bw,
            "speed_vs_dense": statistics.median(ratios), "speed_vs_dense_trials": ratios,
            "cpu_s_per_step": statistics.median(cpu[name]),
            "cpu_speed_vs_dense": statistics.median(d / s for d, s in zip(cpu["dense"], cpu[name])),
            "profile_ms_one_step": prof[name]}
        r = out["configs"][name]
        print(f"{context:6d} x {batch:2d}  {name:19s} {r['tokens_per_s']:8.2f} tok/s  step {1e3 * step:7.1f} ms  "
              f"x dense {r['speed_vs_dense']:.2f} (cpu {r['cpu_speed_vs_dense']:.2f})  cache {cache_bytes / 2**30:.2f} GiB  "
              f"{100 * r['roofline_fraction']:.0f}% roofline", flush=True)
    del caches
    gc.collect()
    return out


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    sweep = [p for p in record["points"] if p["batch"] == record["sweep_batch"]]
    for name in record["configs"]:
        xs = [p["context"] for p in sweep]
        a.plot(xs, [p["configs"][name]["tokens_per_s"] for p in sweep], marker="o", label=name)
    a.set_xscale("log", base=2)
    a.set_xlabel("context (tokens)")
    a.set_ylabel("tokens/s (batch total, median)")
    a.set_title(f"decode, batch {record['sweep_batch']}, fp32, 12×768 MHA Llama ({record['op_isa']})")
    a.legend()
    last = max(sweep, key=lambda p: p["context"]) if sweep else record["points"][-1]
    prof = last["configs"]["slim-option2"]["profile_ms_one_step"]
    b.barh(list(prof), list(prof.values()), color="tab:orange")
    b.set_xlabel("ms (self CPU, one step, all layers)")
    b.set_title(f"slim-option2 step at {last['context']} × {last['batch']}: where the time goes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", nargs="+", default=["1024x8", "2048x8", "4096x8", "8192x8", "1024x1"],
                    help="context x batch")
    ap.add_argument("--steps", type=int, default=4, help="timed decode steps per configuration per trial")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS,
                    help="configurations to time (dense and slim-option2 always run: the ratios are to dense)")
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_slim")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernel.available()  # build (or load) the op before anything is timed
    configs = tuple(c for c in CONFIGS if c in ("dense", "slim-option2") or c in args.configs)
    models = build_models(configs)
    wbytes = weight_bytes(models["dense"])
    bw = measure_bandwidth(nbytes=1 << 29, trials=5)
    points = []
    for spec in args.points:
        context, batch = (int(x) for x in spec.split("x"))
        points.append(run_point(models, batch, context, args.steps, args.trials, bw["roofline_gbps"], wbytes))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    record = {
        "benchmark": "bench_slim", "dtype": "float32", "threads": args.threads, "steps": args.steps,
        "trials": args.trials, "interleaved": True, "op_isa": kernel.isa(),
        "model": "kvslim.bench.decode.mha_100m: Llama d768 L12 h12 (MHA) random weights", "bandwidth": bw,
        "weight_bytes": wbytes, "configs": list(configs), "sweep_batch": 8, "points": points,
        "versions": {"torch": torch.__version__, "python": platform.python_version(), "kvslim": kvslim.__version__},
        "commit": commit, "machine": platform.processor() or platform.machine(),
        "note": "shared 2-core machine under load from other jobs: absolute times are noisy, use the ratios"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=2))
    plot(record, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
