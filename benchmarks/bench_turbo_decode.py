"""Decode speed of the turbo formats beside int3 and HF's dense cache (issue 35): one interleaved run.

For one model (``--model`` as in bench_quality.py), ``kvslim.bench.decode.measure_group`` times decode steps at
``--context`` tokens for each kind (each on its own copy of the model, caches filled with synthetic tokens, kinds
taking turns A B C A B C … so a burst of load hits all alike; median step time) and reports each kind's median
and its ratio to HF's ``DynamicCache`` and to ``kvslim-int3``. ``kvslim-turbo3`` decodes through the fused op
(``kvslim.turbo_decode``, its window kept in the coded basis across steps); ``kvslim-turbo3-prerope`` (pre-RoPE
keys) through the layers' dequantized reads. Ratios are only comparable within one run.

    .venv/bin/python benchmarks/bench_turbo_decode.py --model smollm2 --context 4096 --threads 1

Writes ``benchmarks/results/bench_turbo_decode[_tag].{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quality import MODELS, RESULTS, load_model  # noqa: E402

from kvslim.bench.decode import measure_group  # noqa: E402

KINDS = "hf-dynamic,kvslim-int3,kvslim-turbo3,kvslim-turbo3-prerope,kvslim-int2,kvslim-turbo2"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kinds", default=KINDS)
    p.add_argument("--tag", default="")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    model, _ = load_model(MODELS[args.model][0])
    kinds = args.kinds.split(",")
    recs = measure_group(model, args.model, kinds, args.batch, args.context, args.steps, args.rounds, 1.0)
    by = {r["method"]: r for r in recs if "step_s_median" in r}
    hf, i3 = by.get("hf-dynamic"), by.get("kvslim-int3")
    lines = [f"{MODELS[args.model][1]}, context {args.context}, batch {args.batch}, {args.rounds} rounds × "
             f"{args.steps} steps interleaved, {args.threads} thread(s); median step time (shared machine: ratios "
             "within this run only)", "",
             "| cache | step ms (median) | tok/s | vs HF dense | vs int3 | cache bytes |", "|---|---|---|---|---|---|"]
    for k in kinds:
        r = by.get(k)
        if r is None:
            lines.append(f"| {k} | skipped | | | | |")
            continue
        s = r["step_s_median"]
        lines.append(f"| {k} | {1e3 * s:.1f} | {r['tokens_per_s']:.1f} | "
                     + (f"{hf['step_s_median'] / s:.2f}× | " if hf else "- | ")
                     + (f"{i3['step_s_median'] / s:.2f}× | " if i3 else "- | ") + f"{r['cache_bytes']:,} |")
    md = "\n".join(lines) + "\n"
    try:
        commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:  # noqa: BLE001 - informational only
        commit = "unknown"
    record = {"model": MODELS[args.model][1], "context": args.context, "batch": args.batch, "steps": args.steps,
              "rounds": args.rounds, "threads": args.threads, "records": recs, "commit": commit,
              "command": "python " + " ".join(sys.argv), "torch": torch.__version__, "machine": platform.machine(),
              "load_avg": list(__import__("os").getloadavg()),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    stem = RESULTS / f"bench_turbo_decode{args.tag}"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1))
    stem.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
