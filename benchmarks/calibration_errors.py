"""Per layer, the attention-output error that ``kvslim.calibrate`` compares: keys rotated or not.

On the development text's prefill (Botchan, 1,536 tokens, fp32), each layer's keys and values are written into the
method's cache layer with and without rotated keys (sinks, window and codes as a run keeps them) and read back; the
error is ``Σ‖softmax(q K̂ᵀ) V̂ − softmax(q Kᵀ) V‖² / Σ‖softmax(q Kᵀ) V‖²`` over the last 256 queries
(``kvslim.calibration.layer_errors``). ``chosen`` is what ``kvslim.calibrate`` returns for that text.

    .venv/bin/python benchmarks/calibration_errors.py --model smollm2|qwen25 --method int4 --threads 1

Writes benchmarks/results/calibration_errors_<model>_<method>.json.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from bench_quality import MODELS, RESULTS, git_commit, load_model

import kvslim
from kvslim import heldout
from kvslim.calibration import layer_errors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("smollm2", "qwen25"), default="smollm2")
    p.add_argument("--method", choices=("int8", "int4", "int3", "int2"), default="int4")
    p.add_argument("--tokens", type=int, default=1536)
    p.add_argument("--queries", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    loader, label = MODELS[args.model]
    model, tok = load_model(loader)
    ids = heldout.text_ids(tok, "botchan", args.tokens)
    t0 = time.time()
    errors = layer_errors(model, ids, args.method, ({"rotation": None}, {"rotation": "hadamard"}), args.queries)
    chosen = kvslim.calibrate(model, ids, args.method, queries=args.queries)
    rec = {"model": label, "method": args.method, "text": "botchan (development)", "tokens": args.tokens,
           "queries": args.queries, "layers": [{"layer": i, "plain": a, "rotated": b, "ratio": b / a}
                                               for i, (a, b) in enumerate(errors)],
           "chosen": {str(k): v for k, v in chosen.items()}, "commit": git_commit(),
           "seconds": round(time.time() - t0, 1)}
    path = RESULTS / f"calibration_errors_{args.model}_{args.method}.json"
    path.write_text(json.dumps(rec, indent=1) + "\n")
    for r in rec["layers"]:
        print(f"layer {r['layer']:2d}: plain {r['plain']:.3e}, rotated {r['rotated']:.3e} (x{r['ratio']:.2f})")
    print(f"rotated layers: {sorted(int(k) for k in rec['chosen'])} -> {path}")


if __name__ == "__main__":
    main()
