"""Named kvslim rows (a method and its ``apply`` options, ``per_layer`` included) on one text, in one pass per row.

The token protocol of ``bench_quality.py --texts`` (fp32, 2,049 tokens: prefill 1,536, then 512 single-token steps
scored against the same model with an uncompressed cache), through ``kvslim.stepwise.compare_specs_steps``: Δppl with
its 95 % paired-bootstrap interval, mean KL, top-1, bytes per token averaged over the steps (window included). For
quick decisions on the development text (``--text botchan``) when a lever needs options a suite cannot name (per-layer
plans written out layer by layer).

    .venv/bin/python benchmarks/quality_rows.py --model smollm2 --rows rows.json --out quality_dev_<what>.json

``rows.json``: ``[[label, method, {option: value}], ...]`` (``per_layer`` keys may be strings: JSON has no int keys).
Writes benchmarks/results/<out> (and prints one JSON line per row).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from bench_quality import MODELS, RESULTS, git_commit, load_model

from kvslim import heldout
from kvslim.evaluate_parallel import layer_specs_of
from kvslim.methods import METHODS
from kvslim.stepwise import compare_specs_steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    p.add_argument("--text", default="botchan")
    p.add_argument("--rows", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    loader, label = MODELS[args.model]
    model, tok = load_model(loader)
    ids = heldout.text_ids(tok, args.text, 2049)
    rows = json.loads(open(args.rows).read())
    specs = {}
    for name, method, opts in rows:
        if "per_layer" in opts:
            opts["per_layer"] = {int(k): v for k, v in opts["per_layer"].items()}
        specs[name] = layer_specs_of(METHODS[method].plan_model(model, **opts))
    t0 = time.time()
    out = []
    for name, r in compare_specs_steps(model, ids, specs, steps=512).items():
        lo, hi = r.delta_ppl_ci()
        out.append({"label": name, "delta_ppl": r.delta_ppl, "delta_ppl_ci95": [lo, hi], "kl_mean": r.kl.mean().item(),
                    "top1": r.top1.float().mean().item(),
                    "bytes_per_token_avg": (r.nbytes.double() / r.held.double()).mean().item(), "seconds": r.seconds})
        print(json.dumps(out[-1]), flush=True)
    rec = {"model": label, "text": args.text, "tokens": 2049, "prefill": 1536, "steps": 512, "rows_given": rows,
           "rows": out, "commit": git_commit(), "seconds": round(time.time() - t0, 1),
           "command": f"python benchmarks/quality_rows.py --model {args.model} --text {args.text} --rows <rows_given>"}
    (RESULTS / args.out).write_text(json.dumps(rec, indent=1) + "\n")


if __name__ == "__main__":
    main()
