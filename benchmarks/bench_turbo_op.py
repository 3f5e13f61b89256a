"""The fused turbo decode op (``kvslim::turbo_decode``) alone against int3's (``kvslim::quant_decode_lowbit``) on
the same history, one layer, the formats ``apply(model, "turbo3")`` / ``apply(model, "int3")`` store:

* ``int3``: 3-bit KIVI keys over 64 tokens + 3-bit values g64, fp16 parameters;
* ``turbo3``: 3-bit keys with ``D/4`` outlier channels at 4 bits (two part scales a row), 3-bit values, fp16 scales;
* ``turbo3-rope``: the same plus the RoPE-centred score bias (``bias_ab`` (B, Hk, G, D), ``bias_rows`` (n, D):
  one ``[cos | sin]`` row per coded slot, the default turbo3 keys);

each with a 128-row fp32 tail (4 sinks + the 124-token window). Rows written by the library's own stores from the
same random history (the query, value rotations and the bias product outside the op are not timed).

``python benchmarks/bench_turbo_op.py [--shapes 1x3x3x64x4032,8x3x3x64x8064] [--rounds 25] [--threads 1]``
(B × KV heads × query heads per KV head × head dim × coded tokens). Interleaved rounds, one thread's CPU time
(``time.thread_time``: a shared machine's descheduling does not inflate it), minimum and median per call and the
ratio of medians to int3 from the same run. Writes ``benchmarks/results/bench_turbo_op[_tag].{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvslim.caches import StoreSpec, make_store
from kvslim.caches.residual import ChannelQuantizedStore
from kvslim.caches.storage import QuantizedStore
from kvslim.kernels import quant_decode_lowbit as lowbit
from kvslim.kernels import turbo_decode as kernel

CPU = torch.device("cpu")
RESULTS = Path(__file__).resolve().parent / "results"


def calls(b: int, hk: int, g: int, d: int, n: int) -> dict:
    """name -> zero-argument call of each op on one shape."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(b, hk, n, d, generator=gen)
    v = torch.randn(b, hk, n, d, generator=gen)
    q = torch.randn(b, hk, g, d, generator=gen)
    t = torch.randn(b, hk, 128, d, generator=gen)
    sc = d ** -0.5
    s3 = StoreSpec(3, 64, torch.float16, asymmetric=True, channel_group=64, residual=124, flush=64,
                  value_rotation="none")
    k3 = ChannelQuantizedStore(s3, b, hk, n, d, torch.float32, CPU)
    v3 = QuantizedStore(s3.for_values(), b, hk, n, d, torch.float32, CPU)
    k3.write(0, x)
    v3.write(0, v)
    st = StoreSpec(3, codec="turbo", rotation="orthogonal", outliers=d // 4, center=True, scale_dtype=torch.float16)
    kt, vt = make_store(st, x, n), make_store(st.for_values(), v, n)
    kt.write(0, x)
    vt.write(0, v)
    ab = torch.randn(b, hk, g, d, generator=gen) * 0.1
    rows = torch.cat((torch.rand(n, d // 2, generator=gen), torch.rand(n, d // 2, generator=gen)), 1)
    lev = kernel.levels("cpu")
    targs = (q, kt.data, kt.scale, vt.data, vt.scale, d // 4, 3, 3, lev, n, t, t, None, sc)
    return {
        "int3": lambda: torch.ops.kvslim.quant_decode_lowbit(q, k3.data, k3.scale, k3.zero, v3.data, v3.scale,
                                                             v3.zero, 3, 3, 64, 64, n, None, t, t, None, sc, 0),
        "turbo3": lambda: torch.ops.kvslim.turbo_decode(*targs, None, None, 0, None),
        "turbo3-rope": lambda: torch.ops.kvslim.turbo_decode(*targs, ab, rows, 0, None),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="1x3x3x64x4032,8x3x3x64x8064")
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tag", default="")
    p.add_argument("--note", default="", help="what the record measures, e.g. which sources the op was built from")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    assert kernel.available() and lowbit.available(), "the C++ ops are not built"
    head = (f"turbo op isa {kernel.isa()}, int3 op isa {lowbit.isa()}, {args.threads} thread(s), "
            f"{'thread CPU' if args.threads == 1 else 'wall'} time, {args.rounds} interleaved rounds (shared machine: "
            "ratios within this run only)")
    print(head)
    lines = [head, "", "| shape B×Hk×G×D×n | op | min ms | median ms | median vs int3 |", "|---|---|---|---|---|"]
    recs = []
    for shape in args.shapes.split(","):
        b, hk, g, d, n = (int(s) for s in shape.split("x"))
        fns = calls(b, hk, g, d, n)
        times = {k: [] for k in fns}
        for f in fns.values():
            f()  # warm-up
        for _ in range(args.rounds):
            for name, f in fns.items():
                t0 = clock()
                f()
                times[name].append(clock() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        for k, v in times.items():
            rec = {"shape": shape, "op": k, "min_ms": 1e3 * min(v), "median_ms": 1e3 * med[k],
                   "median_vs_int3": med["int3"] / med[k], "runs_ms": [1e3 * s for s in v]}
            recs.append(rec)
            lines.append(f"| {shape} | {k} | {rec['min_ms']:.3f} | {rec['median_ms']:.3f} | "
                         f"{rec['median_vs_int3']:.2f}× |")
            print(lines[-1])
    tag = f"_{args.tag}" if args.tag else ""
    RESULTS.mkdir(exist_ok=True)
    try:
        commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:  # noqa: BLE001 - informational only
        commit = "unknown"
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
            "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
            "turbo_isa": kernel.isa(), "int3_isa": lowbit.isa(), "threads": args.threads, "rounds": args.rounds,
            "load_avg": list(os.getloadavg()), "command": "python " + " ".join(sys.argv), "note": args.note}
    (RESULTS / f"bench_turbo_op{tag}.json").write_text(json.dumps({"meta": meta, "records": recs}, indent=1))
    note = f"\n{args.note}\n" if args.note else ""
    (RESULTS / f"bench_turbo_op{tag}.md").write_text("\n".join(lines) + "\n" + note)


if __name__ == "__main__":
    main()
