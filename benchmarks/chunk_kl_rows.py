"""Quick development-text screening of kvslim rows by chunked KL (``kvslim.calibration.chunk_kl``).

The dense prefill of 1,536 tokens runs once; each row's cache layers get its keys and values as a prefill call
would write them, then tokens 1,536-2,047 are fed ``--chunk`` tokens per call; the row's score is the mean KL
(dense ‖ row) of the next-token distributions over those 512 positions. With ``--chunk 1`` this is the step
protocol's KL (``tests/test_calibration.py``); with 64 it is cheaper (SmolLM2, Botchan: int4 0.00093, rotated keys
0.00062, layers 15-24 in int8 0.00021 against the one-pass 0.00089 / 0.00056 / 0.00020). A screen, not a result:
rows worth keeping go through ``quality_rows.py``.

    .venv/bin/python benchmarks/chunk_kl_rows.py --model smollm2 --rows rows.json --out quality_dev_<what>.json

``rows.json`` as ``quality_rows.py``'s (``[[label, method, {option: value}], ...]``; an option ``"calibrate": {"text":
"botchan", "tokens": 1536}`` is replaced by ``per_layer=kvslim.calibrate(...)`` on those tokens, as there).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from bench_quality import MODELS, RESULTS, git_commit, load_model

import kvslim
from kvslim import heldout
from kvslim.calibration import chunk_kl, chunk_reference
from kvslim.methods import METHODS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    p.add_argument("--rows", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    loader, label = MODELS[args.model]
    model, tok = load_model(loader)
    ids = heldout.text_ids(tok, "botchan", 2048)
    rows = json.loads(open(args.rows).read())
    t0 = time.time()
    ref = chunk_reference(model, ids, 1536, args.chunk)
    out = []
    for name, method, opts in rows:
        opts = dict(opts)
        if "per_layer" in opts:
            opts["per_layer"] = {int(k): v for k, v in opts["per_layer"].items()}
        cal = opts.pop("calibrate", None)
        if cal is not None:
            cal_ids = heldout.text_ids(tok, cal.get("text", "botchan"), cal.get("tokens", 1536))
            opts["per_layer"] = kvslim.calibrate(model, cal_ids, method, **opts)
        plan = METHODS[method].plan_model(model, **opts)
        out.append({"label": name, "chunk_kl": chunk_kl(model, ref, plan),
                    "coded_bytes_per_token": sum(lp.bytes_per_token for lp in plan.layers),
                    "s": round(time.time() - t0, 1)})
        print(json.dumps(out[-1]), flush=True)
        rec = {"model": label, "text": "botchan", "prefill": 1536, "scored": 512, "chunk": args.chunk,
               "rows_given": rows, "rows": out, "commit": git_commit(),
               "command": f"python benchmarks/chunk_kl_rows.py --model {args.model} --rows <rows_given> "
                          f"--chunk {args.chunk}"}
        (RESULTS / args.out).write_text(json.dumps(rec, indent=1) + "\n")


if __name__ == "__main__":
    main()
