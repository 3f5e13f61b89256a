"""The question's pass over a prompt cache (issue 44's first token): before and after the multi-token fast paths.

Qwen2.5-Coder-0.5B-Instruct (fp32, from its GGUF, offline); each method's cache filled through its ``update`` with
N tokens of seeded random keys and values (the work of the pass does not depend on the values; no prefill is run);
then a 17-token question in one forward (``logits_to_keep=1``: its last logits are the first answer token), on a
copy of the cache each time. "before" is the same process with the two fast paths swapped for their references
(``unpack_codes_reference`` for the table lookup, HF's ``repeat_kv`` SDPA for the packed rows); before and after
alternate trial by trial (the machine is shared) and their logits are compared bitwise. Wall and process CPU
seconds (CPU: both threads, less sensitive to a neighbour's load); medians; ratios per pair.

    PYTHONPATH=src nice -n 5 python benchmarks/bench_question_pass.py --tokens 4096,8192
"""

from __future__ import annotations

import argparse
import contextlib
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
METHODS = ("dense", "int4", "int2", "turbo3")


@contextlib.contextmanager
def reference_paths(enabled: bool):
    """The code as it was before the fast paths: every module that unpacks codes calls the shift reference, and
    kvslim's SDPA leaves multi-token GQA calls to HF (``repeat_kv``)."""
    from kvslim.adapters import sdpa
    from kvslim.caches import residual
    from kvslim.kernels import quant_decode, quant_decode_lowbit
    from kvslim.ops import quant_formats, turbo

    if not enabled:
        yield
        return
    mods = (quant_formats, residual, turbo, quant_decode, quant_decode_lowbit)
    saved = [m.unpack_codes for m in mods], sdpa.packable_prefix
    for m in mods:
        m.unpack_codes = quant_formats.unpack_codes_reference
    sdpa.packable_prefix = lambda *a: False
    try:
        yield
    finally:
        for m, f in zip(mods, saved[0]):
            m.unpack_codes = f
        sdpa.packable_prefix = saved[1]


def question_pass(model, cache, q: torch.Tensor, before: bool) -> tuple[float, float, torch.Tensor]:
    """(wall s, process CPU s, last logits) of one question pass on a copy of ``cache``."""
    from kvslim.adapters.compat import CACHE_KW

    c = copy.deepcopy(cache)
    with reference_paths(before), torch.no_grad():
        t, cpu = time.perf_counter(), time.process_time()
        logits = model(q, use_cache=True, logits_to_keep=1, **{CACHE_KW: c}).logits
        return time.perf_counter() - t, time.process_time() - cpu, logits


def run(model, n: int, methods, trials: int, question: int) -> list[dict]:
    import kvslim
    from kvslim.longctx.protocol import make_cache_fn

    cfg = model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(n)
    kv = [(torch.randn(1, cfg.num_key_value_heads, n, d, generator=g) * 2,
           torch.randn(1, cfg.num_key_value_heads, n, d, generator=g)) for _ in range(cfg.num_hidden_layers)]
    q = torch.randint(100, 10_000, (1, question), generator=g)
    rows = []
    for method in methods:
        kvslim.restore(model)
        kvslim.apply(model, method)
        cache = make_cache_fn(model, method)()
        with torch.no_grad():
            for i, (k, v) in enumerate(kv):
                cache.update(k, v, i)
        question_pass(model, cache, q, False)  # warm-up (kernels, tables)
        question_pass(model, cache, q, True)
        times = {"before": [], "after": []}
        cpu = {"before": [], "after": []}
        same = True
        for t in range(trials):
            order = ("before", "after") if t % 2 == 0 else ("after", "before")
            got = {}
            for which in order:
                s, c, got[which] = question_pass(model, cache, q, which == "before")
                times[which].append(s)
                cpu[which].append(c)
            same = same and torch.equal(got["before"], got["after"])
        b, a = statistics.median(times["before"]), statistics.median(times["after"])
        ratios = [x / y for x, y in zip(times["before"], times["after"])]
        row = {"tokens": n, "method": method, "question_tokens": question, "before_s": b, "after_s": a,
               "speedup_median_of_pairs": statistics.median(ratios),
               "before_cpu_s": statistics.median(cpu["before"]), "after_cpu_s": statistics.median(cpu["after"]),
               "cpu_speedup_median_of_pairs": statistics.median(x / y for x, y in zip(cpu["before"], cpu["after"])),
               "logits_bitwise_equal": same, "trials": times, "trials_cpu": cpu, "load_average": os.getloadavg()}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "trials"}), file=sys.stderr, flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="4096", help="comma-separated cache lengths (default 4096)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--trials", type=int, default=3, help="before/after pairs per row (default 3)")
    p.add_argument("--question", type=int, default=17, help="question tokens (default 17, bench_prompt_cache's)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=str(RESULTS / "bench_question_pass.json"))
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    from kvslim.bench.report import environment
    from kvslim.models import load_qwen25_coder

    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = load_qwen25_coder(torch.float32)
    rows = []
    for n in (int(x) for x in args.tokens.split(",")):
        rows += run(model, n, [m for m in args.methods.split(",") if m], args.trials, args.question)
    doc = {"environment": environment(), "model": "Qwen2.5-Coder-0.5B-Instruct (fp32, from its GGUF)",
           "cache": "seeded random keys/values through each method's update", "records": rows}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
