"""Prompt-lookup decoding over a compressed cache (issue 49): its verify steps through the fused ops, against plain greedy.

Qwen2.5-Coder-0.5B-Instruct (fp32, from its GGUF, offline); a document of N tokens of Botchan and a request to copy
its opening (the case prompt lookup serves: the answer repeats the prompt's n-grams). The document is prefilled once
per method into a kvslim cache (all but its last token); each run generates ``--new`` tokens greedily on a copy of
that cache through ``PromptCache.generate`` (as a loaded prompt file), plain and with ``prompt_lookup_num_tokens`` (each verify step a multi-token call over the coded history,
then a crop of the rejected tokens), interleaved round by round. Reported: medians, the speedup, and whether the
tokens equal plain greedy's.

    .venv/bin/python benchmarks/bench_assisted.py --tokens 4096 --methods int4,dense
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
REQUEST = "\n\nCopy the first two sentences of the text above exactly, word for word:\n\n"


def run(model, tok, n: int, methods, new: int, lookup: int, rounds: int) -> list[dict]:
    import kvslim
    from kvslim.evaluate import load_text
    from kvslim.prompt_cache import PromptCache, prefill

    doc = tok(load_text("botchan"), return_tensors="pt").input_ids[:, :n]
    ids = torch.cat((doc, tok(REQUEST, return_tensors="pt", add_special_tokens=False).input_ids), 1)
    rows = []
    for method in methods:
        kvslim.restore(model)
        kvslim.apply(model, method)
        cache = kvslim.make_cache(model)
        prefill(model, ids[:, :-1], cache)
        gen = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=tok.eos_token_id)

        def once(kind: str, cache=cache, gen=gen):
            pc = PromptCache(copy.deepcopy(cache), ids[:, :-1], {})  # as a loaded prompt file: its generate
            extra = {"prompt_lookup_num_tokens": lookup} if kind == "lookup" else {}
            with torch.no_grad():
                t = time.perf_counter()
                out = pc.generate(model, ids, **gen, **extra)
                return time.perf_counter() - t, out[0, ids.shape[1]:]

        once("plain"), once("lookup")  # warm-up
        times, tokens = {"plain": [], "lookup": []}, {}
        for r in range(rounds):
            for kind in (("plain", "lookup") if r % 2 == 0 else ("lookup", "plain")):
                s, toks = once(kind)
                times[kind].append(s)
                tokens[kind] = toks
        row = {"tokens": n, "method": method, "new_tokens": new, "prompt_lookup_num_tokens": lookup,
               "plain_s": statistics.median(times["plain"]), "lookup_s": statistics.median(times["lookup"]),
               "speedup": statistics.median(a / b for a, b in zip(times["plain"], times["lookup"])),
               "same_tokens": bool(torch.equal(tokens["plain"], tokens["lookup"])),
               "answer": tok.decode(tokens["plain"][:48]), "trials": times, "load_average": os.getloadavg()}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "trials"}), file=sys.stderr, flush=True)
    kvslim.restore(model)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="document tokens (default 4096)")
    p.add_argument("--methods", default="int4,dense")
    p.add_argument("--new", type=int, default=64, help="answer tokens (default 64)")
    p.add_argument("--lookup", type=int, default=10, help="prompt_lookup_num_tokens (default 10)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS / "bench_assisted.json"))
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    from kvslim.bench.report import environment
    from kvslim.models import load_qwen25_coder

    torch.set_num_threads(args.threads)
    model, tok = load_qwen25_coder(torch.float32)
    rows = run(model, tok, args.tokens, [m for m in args.methods.split(",") if m], args.new, args.lookup,
               args.rounds)
    doc = {"environment": environment(), "model": "Qwen2.5-Coder-0.5B-Instruct (fp32, from its GGUF)",
           "text": "botchan", "request": REQUEST, "threads": args.threads, "command": "python " + " ".join(sys.argv),
           "records": rows}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
