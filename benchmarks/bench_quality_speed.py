"""Decode speed beside quality: one interleaved ``kvslim.bench`` run per model, joined to a quality result table.

For one model (``--model`` as in bench_quality.py), times decode steps at ``--context`` tokens for HF's
``DynamicCache`` and kvslim's ``int8`` / ``int4`` / ``int2`` defaults (``kvslim.bench.decode.measure_group``: each
kind on its own copy of the model, caches filled with synthetic tokens, kinds taking turns A B C A B C … so a burst
of load hits all alike; median step time), then writes the quality table of ``--quality`` (a bench_quality.py
result JSON, e.g. the merged one) with bytes/token and decode tok/s columns:
``benchmarks/results/bench_quality_speed_<model>.{json,md}``.

    .venv/bin/python benchmarks/bench_quality_speed.py --model gemma3 \\
        --quality benchmarks/results/bench_quality_final_token_merged_gemma3.json

Rows of the quality table are matched to a timed kind by label: ``int8 …(default)`` -> kvslim-int8, ``int4
(default)`` -> kvslim-int4, ``int2 (default)`` -> kvslim-int2; other rows (non-default formats, HF quanto, whose
cache re-quantizes its window each flush) get no speed. Speed ratios are only comparable within one run.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quality import MODELS, RESULTS  # noqa: E402

from kvslim.bench.decode import measure_group  # noqa: E402

KINDS = {"int8 g64 (default)": "kvslim-int8", "int4 (default)": "kvslim-int4", "int2 (default)": "kvslim-int2"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    p.add_argument("--quality", required=True, help="a bench_quality.py result JSON (the rows to join)")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kinds", default="hf-dynamic,kvslim-int8,kvslim-int4,kvslim-int2")
    p.add_argument("--speed-from", default=None, help="reuse the timings of an earlier result of this script "
                                                       "(join them to another quality table without re-timing)")
    args = p.parse_args()
    quality = json.loads(Path(args.quality).read_text())
    loader, label = MODELS[args.model]
    if args.speed_from:
        old = json.loads(Path(args.speed_from).read_text())
        records = old["speed"]
        for k in ("context", "steps", "rounds", "threads"):
            setattr(args, k, old[k])
    else:
        torch.set_num_threads(args.threads)
        warnings.filterwarnings("ignore")
        import kvslim.models

        model, _ = getattr(kvslim.models, loader)(torch.float32)
        records = measure_group(model, args.model, args.kinds.split(","), 1, args.context, args.steps, args.rounds,
                                1.0)
    speed = {r["method"]: r for r in records if "skipped" not in r}
    base = speed.get("hf-dynamic")
    rows = []
    for row in quality["rows"]:
        kind = KINDS.get(row["label"])
        s = speed.get(kind) if kind else None
        rows.append({**row, "tokens_per_s": s["tokens_per_s"] if s else None,
                     "speed_vs_hf": s["tokens_per_s"] / base["tokens_per_s"] if s and base else None})
    out = {"model": label, "quality": args.quality, "quality_command": quality.get("command"),
           "command": "python " + " ".join(sys.argv), "context": args.context, "steps": args.steps,
           "rounds": args.rounds, "threads": args.threads, "speed": records, "rows": rows,
           "ref_ppl": quality["ref_ppl"], "protocol": {k: quality[k] for k in ("mode", "tokens", "steps")}}
    stem = RESULTS / f"bench_quality_speed_{args.model}"
    for r in out["speed"]:
        r.pop("step_s_all", None)
    stem.with_suffix(".json").write_text(json.dumps(out, indent=1))
    stem.with_suffix(".md").write_text(markdown(out))
    print(markdown(out))


def markdown(out: dict) -> str:
    pr = out["protocol"]
    hf = next((r for r in out["speed"] if r["method"] == "hf-dynamic"), None)
    lines = [f"{out['model']}, Botchan, {pr['mode']} mode, {pr['tokens']} tokens, {pr['steps']} single-token steps "
             f"scored; dense perplexity {out['ref_ppl']:.3f}. Decode speed: batch 1 at {out['context']:,} tokens, "
             f"{out['threads']} threads, median of {out['rounds']} interleaved rounds × {out['steps']} steps"
             + (f"; HF DynamicCache {hf['tokens_per_s']:.2f} tok/s" if hf else ""), "",
             "| cache | bits/element (codes+scales) | Δ perplexity | mean KL | top-1 | bytes/token | decode tok/s "
             "| vs HF dense |", "|---|---|---|---|---|---|---|---|"]
    for r in out["rows"]:
        tps = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.2f}"
        rel = "-" if r["speed_vs_hf"] is None else f"{r['speed_vs_hf']:.2f}×"
        lines.append(f"| {r['label']} | {r['bits_per_element']:.2f} | {100 * r['delta_ppl']:+.2f} % | {r['kl']:.4f} "
                     f"| {100 * r['top1']:.1f} % | {r['bytes_per_token']:,.0f} | {tps} | {rel} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
