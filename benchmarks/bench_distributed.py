"""Sequence-parallel decode: 2 ranks × 1 thread against 1 rank × 2 threads on the same machine.

    python benchmarks/bench_distributed.py [--context 8192] [--batch 8] [--steps 5] [--rounds 2]

Launches two local processes (gloo, like ``torchrun --nproc_per_node 2``). On the ~100M MHA Llama of
``kvslim bench`` (fp32, random weights), for each method (dense, int8) and round it runs, one after the other:
A — rank 0 alone with 2 threads, a plain kvslim cache (rank 1 waits in a barrier); B — both ranks with 1 thread
each, the cache sharded by ``kvslim.distributed``. Caches are filled with the same synthetic tokens through
``update`` (as ``kvslim bench``), then ``steps`` greedy decode steps are timed after one warm-up step. Reports per
method: cache bytes per rank, bytes each rank sends per decode step (counted by the collectives), tokens/s
(median step) and the B/A speed ratio; checks that A and B pick the same tokens. Writes
``benchmarks/results/bench_distributed.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def fill(cache, model, batch: int, context: int) -> None:
    """``context`` synthetic tokens per sequence in every layer (same values on every rank; one random K and V
    reused by all layers: decode speed does not depend on the values, and a shared 2-core machine generates
    random numbers slowly)."""
    cfg = model.config
    hkv, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(0)
    k = torch.randn(batch, hkv, context, d, generator=g)
    v = torch.randn(batch, hkv, context, d, generator=g)
    for i in range(cfg.num_hidden_layers):
        cache.update(k, v, i)


@torch.inference_mode()
def decode(model, cache, batch: int, context: int, steps: int, comm=None) -> tuple[list[float], list, list[int]]:
    """Seconds per step (warm-up dropped), chosen tokens per step, bytes sent per step."""
    from kvslim.adapters.compat import CACHE_KW

    tok = torch.zeros(batch, 1, dtype=torch.long)
    times, tokens, sent = [], [], []
    for i in range(steps + 1):
        pos = torch.full((batch, 1), context + i, dtype=torch.long)
        before = (comm.sent_bytes, comm.seconds) if comm is not None else (0, 0.0)
        t0 = time.perf_counter()
        out = model(tok, position_ids=pos, **{CACHE_KW: cache}, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        times.append(time.perf_counter() - t0)
        tokens.append(tok.flatten().tolist())
        if comm is not None:
            sent.append((comm.sent_bytes - before[0], comm.seconds - before[1]))
    return times[1:], tokens, sent[1:]


def collective_alone(comm, batch: int, heads: int, width: int, layers: int, repeats: int = 30) -> float:
    """Median seconds of one decode step's worth of merges (``layers`` all-gathers of the partials) with
    nothing else running: what the collective costs by itself."""
    x = torch.randn(batch, heads, 1, width + 2)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(layers):
            comm.all_gather(x, "collective timing")
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def worker(args) -> None:
    import torch.distributed as dist

    import kvslim
    import kvslim.distributed as kd
    from kvslim.bench.decode import mha_100m

    rank = int(os.environ["RANK"])
    model_a = mha_100m() if rank == 0 else None
    model_b = mha_100m()
    records = []
    for method in args.methods.split(","):
        opts = {"group_size": 64} if method.startswith("int") else {}
        if model_a is not None:
            kvslim.apply(model_a, method, **opts)
        rt = kd.apply(model_b, method, timeout_s=600, **opts)
        rounds = []
        for r in range(args.rounds):
            # A: one rank, two threads (and A1: the same with one thread, to read the noise of a shared machine)
            a = a1 = None
            if rank == 0:
                cache = kvslim.make_cache(model_a, max_length=args.context + 2 * args.steps + 4)
                fill(cache, model_a, args.batch, args.context)
                torch.set_num_threads(2)
                times, toks, _ = decode(model_a, cache, args.batch, args.context, args.steps)
                a = {"step_s": times, "tokens": toks, "cache_bytes": cache.nbytes}
                if args.one_thread_too:  # same cache, one thread (positions continue after A's steps)
                    torch.set_num_threads(1)
                    times, _, _ = decode(model_a, cache, args.batch, args.context + args.steps + 1, args.steps)
                    a1 = {"step_s": times}
                del cache
            dist.barrier()
            # B: two ranks, one thread each
            torch.set_num_threads(1)
            cache = rt.make_cache(args.context + args.steps + 2)
            fill(cache, model_b, args.batch, args.context)
            dist.barrier()
            times, toks, sent = decode(model_b, cache, args.batch, args.context, args.steps, rt.comm)
            alone = collective_alone(rt.comm, args.batch, 12, 64, 12)
            every = rt.comm.all_gather_object({"step_s": times, "cache_bytes": cache.nbytes,
                                               "sent": [b for b, _ in sent], "comm_s": [c for _, c in sent],
                                               "collective_alone_s": alone}, "bench results")
            del cache
            rt.cache = None
            if rank == 0:
                b = {"step_s": [max(e["step_s"][i] for e in every) for i in range(args.steps)],
                     "cache_bytes_per_rank": [e["cache_bytes"] for e in every],
                     "sent_per_step": [e["sent"] for e in every], "tokens": toks,
                     "comm_s_per_step": [e["comm_s"] for e in every],
                     "collective_alone_s": max(e["collective_alone_s"] for e in every)}
                rounds.append({"A": a, "B": b, "A1": a1})
                print(f"[{method} round {r}] A {statistics.median(a['step_s']) * 1e3:.0f} ms/step, "
                      f"B {statistics.median(b['step_s']) * 1e3:.0f} ms/step"
                      + (f", A1 {statistics.median(a1['step_s']) * 1e3:.0f} ms/step" if a1 else ""),
                      file=sys.stderr, flush=True)
            dist.barrier()
        kd.restore(model_b)
        if model_a is not None:
            kvslim.restore(model_a)
        if rank == 0:
            records.append(summarize(method, rounds, args))
    if rank == 0:
        write(records, args)
    kd.close_group()


def summarize(method: str, rounds: list[dict], args) -> dict:
    a_steps = [t for r in rounds for t in r["A"]["step_s"]]
    b_steps = [t for r in rounds for t in r["B"]["step_s"]]
    ratios = [statistics.median(r["A"]["step_s"]) / statistics.median(r["B"]["step_s"]) for r in rounds]
    layers, heads, d = 12, 12, 64
    bound = 2 * layers * args.batch * heads * (d + 2) * 4
    sent = rounds[0]["B"]["sent_per_step"]
    return {
        "method": method, "model": "mha-100m", "dtype": "float32", "context": args.context, "batch": args.batch,
        "steps_per_round": args.steps, "rounds": len(rounds),
        "A": {"config": "1 rank x 2 threads", "tokens_per_s": args.batch / statistics.median(a_steps),
              "step_s_median": statistics.median(a_steps), "cache_bytes": rounds[0]["A"]["cache_bytes"]},
        "B": {"config": "2 ranks x 1 thread", "tokens_per_s": args.batch / statistics.median(b_steps),
              "step_s_median": statistics.median(b_steps),
              "cache_bytes_per_rank": rounds[0]["B"]["cache_bytes_per_rank"],
              "sent_bytes_per_step": sorted({s for per_rank in sent for s in per_rank}),
              "sent_bound": bound,
              "collective_alone_s_per_step": statistics.median(r["B"]["collective_alone_s"] for r in rounds),
              "in_collectives_s_per_step_rank0": statistics.median(
                  t for r in rounds for t in r["B"]["comm_s_per_step"][0])},
        "speed_ratio_B_over_A": statistics.median(a_steps) / statistics.median(b_steps),
        "A1": None if rounds[0]["A1"] is None else {
            "config": "1 rank x 1 thread",
            "tokens_per_s": args.batch / statistics.median([t for r in rounds for t in r["A1"]["step_s"]])},
        "speed_ratio_per_round": ratios,
        "same_tokens": all(r["A"]["tokens"] == r["B"]["tokens"] for r in rounds),
        "raw": rounds,
    }


def write(records: list[dict], args, json_too: bool = True) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "bench_distributed.json"
    if json_too:
        out.write_text(json.dumps({"command": "python benchmarks/bench_distributed.py " + " ".join(sys.argv[1:]),
                                   "machine": f"{os.cpu_count()} CPU cores (shared)", "records": records},
                                  indent=1))
    for r in records:
        print(f"{r['method']}: A {r['A']['tokens_per_s']:.2f} tok/s, B {r['B']['tokens_per_s']:.2f} tok/s, "
              f"B/A {r['speed_ratio_B_over_A']:.2f} (rounds {', '.join(f'{x:.2f}' for x in r['speed_ratio_per_round'])}), "
              f"cache/rank {r['B']['cache_bytes_per_rank']} of {r['A']['cache_bytes']}, "
              f"sent/step {r['B']['sent_bytes_per_step']} (bound {r['B']['sent_bound']}), "
              f"merges alone {r['B'].get('collective_alone_s_per_step', 0) * 1e3:.2f} ms/step, "
              f"in collectives {r['B'].get('in_collectives_s_per_step_rank0', 0) * 1e3:.0f} ms/step, "
              f"same tokens {r['same_tokens']}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["method"] for r in records]
    x = range(len(names))
    ax1.bar([i - 0.27 for i in x], [r["A"]["tokens_per_s"] for r in records], 0.27, label="1 rank × 2 threads")
    ax1.bar(list(x), [r["B"]["tokens_per_s"] for r in records], 0.27, label="2 ranks × 1 thread")
    if all(r.get("A1") for r in records):
        ax1.bar([i + 0.27 for i in x], [r["A1"]["tokens_per_s"] for r in records], 0.27, color="grey",
                label="1 rank × 1 thread")
    ax1.set_xticks(list(x), names)
    ax1.set_ylabel("tokens/s")
    ax1.set_title(f"decode, {args.context} ctx × {args.batch}, ~100M MHA fp32")
    ax1.legend()
    ax2.bar([i - 0.2 for i in x], [r["A"]["cache_bytes"] / 2**30 for r in records], 0.4, label="1 rank")
    ax2.bar([i + 0.2 for i in x], [max(r["B"]["cache_bytes_per_rank"]) / 2**30 for r in records], 0.4,
            label="per rank, 2 ranks")
    ax2.set_xticks(list(x), names)
    ax2.set_ylabel("cache GiB")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "bench_distributed.png", dpi=120)


def launch(args) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", *sys.argv[1:]], env=env))
    return max(p.wait() for p in procs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--methods", default="dense,int8")
    p.add_argument("--one-thread-too", action="store_true", help="also time 1 rank × 1 thread")
    p.add_argument("--replot", action="store_true", help="redraw the PNG from the saved JSON")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.replot:
        records = json.loads((RESULTS / "bench_distributed.json").read_text())["records"]
        args.context, args.batch = records[0]["context"], records[0]["batch"]
        write(records, args, json_too=False)
        return 0
    if args.worker:
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    raise SystemExit(main())
