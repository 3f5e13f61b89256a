"""Named kvslim rows (a method and its ``apply`` options, ``per_layer`` included) on one text, in one pass per row.

The token protocol of ``bench_quality.py --texts`` (fp32, 2,049 tokens: prefill 1,536, then 512 single-token steps
scored against the same model with an uncompressed cache), through ``kvslim.stepwise.compare_specs_steps``: Δppl with
its 95 % paired-bootstrap interval, mean KL, top-1, bytes per token averaged over the steps (window included). For
quick decisions on the development text (``--text botchan``) when a lever needs options a suite cannot name (per-layer
plans written out layer by layer).

    .venv/bin/python benchmarks/quality_rows.py --model smollm2 --rows rows.json --out quality_dev_<what>.json

``rows.json``: ``[[label, method, {option: value}], ...]`` (``per_layer`` keys may be strings: JSON has no int keys).
An option ``"calibrate": {"text": "botchan", "tokens": 1536}`` replaces itself by ``per_layer=kvslim.calibrate(model,
<the first tokens of that text>, method, **other options)`` (the record keeps the chosen dict). ``--text`` takes a
comma-separated list (one reference pass per text, the rows in one process). Writes benchmarks/results/<out> (and
prints one JSON line per row).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from bench_quality import MODELS, RESULTS, git_commit, load_model

import kvslim
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
    rows = json.loads(open(args.rows).read())
    specs, chosen = {}, {}
    for name, method, opts in rows:
        opts = dict(opts)
        if "per_layer" in opts:
            opts["per_layer"] = {int(k): v for k, v in opts["per_layer"].items()}
        cal = opts.pop("calibrate", None)
        if cal is not None:
            t = time.time()
            cal_ids = heldout.text_ids(tok, cal.get("text", "botchan"), cal.get("tokens", 1536))
            opts["per_layer"] = kvslim.calibrate(model, cal_ids, method, **opts)
            chosen[name] = {"per_layer": {str(k): v for k, v in opts["per_layer"].items()},
                            "seconds": round(time.time() - t, 1), **cal}
            print(json.dumps({"label": name, "calibrated": chosen[name]}), flush=True)
        specs[name] = layer_specs_of(METHODS[method].plan_model(model, **opts))
    t0 = time.time()
    texts = []
    for text in args.text.split(","):
        ids = heldout.text_ids(tok, text, 2049)
        out = []
        for name, r in compare_specs_steps(model, ids, specs, steps=512).items():
            lo, hi = r.delta_ppl_ci()
            out.append({"label": name, "text": text, "delta_ppl": r.delta_ppl, "delta_ppl_ci95": [lo, hi],
                        "kl_mean": r.kl.mean().item(), "top1": r.top1.float().mean().item(),
                        "bytes_per_token_avg": (r.nbytes.double() / r.held.double()).mean().item(),
                        "seconds": r.seconds})
            print(json.dumps(out[-1]), flush=True)
        texts.append({"name": text, "rows": out})
        rec = {"model": label, "text": args.text, "tokens": 2049, "prefill": 1536, "steps": 512, "rows_given": rows,
               "calibrated": chosen, "texts": texts, "commit": git_commit(),
               "seconds": round(time.time() - t0, 1), "partial": len(texts) < len(args.text.split(",")),
               "command": f"python benchmarks/quality_rows.py --model {args.model} --text {args.text} "
                          f"--rows <rows_given>"}
        (RESULTS / args.out).write_text(json.dumps(rec, indent=1) + "\n")  # after every text

if __name__ == "__main__":
    main()
