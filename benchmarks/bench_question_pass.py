"""A call of several new tokens over a compressed cache (issue 49): fused ops against the dequantized read.

A question asked of a prompt file, a chat turn, an assisted-decoding verify step: S new tokens over a stored history.
The fused route (``attention/quant.decode_call``) reads the history's codes once through the decode op with the G·S
query rows of each KV head packed; the dequantized route (the one before it, still taken by long calls over short
histories) decodes the whole history into full precision and runs SDPA. Per method, the cache holds N tokens of
seeded random keys and values written through its ``update`` (the pass's work does not depend on them); a
single-token step, then S-token calls through both routes, interleaved trial by trial (A B C A B C ...), each on a
copy of the cache, ``logits_to_keep=1``. Reported: medians, each call's time as a multiple of the step, the fused
route's speedup, and (``--accuracy``) the call's logits against a dense fp32 cache holding the same keys and values,
beside the same S tokens fed one per call (the single-token path's own error).

    .venv/bin/python benchmarks/bench_question_pass.py --model mha-100m --tokens 16384 --calls 17
    .venv/bin/python benchmarks/bench_question_pass.py --tokens 1024,4096,16384 --calls 4,17,64,256,512   # route
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


@contextlib.contextmanager
def route(fused: bool):
    """Multi-token calls through the fused ops (the library's route) or all through the dequantized read."""
    from kvslim.caches import base

    saved = base.FUSED_CALL_TOKENS, base.FUSED_CALL_HISTORY
    if fused:
        base.FUSED_CALL_TOKENS, base.FUSED_CALL_HISTORY = 10 ** 9, 0
    else:
        base.FUSED_CALL_TOKENS, base.FUSED_CALL_HISTORY = 1, 10 ** 9
    try:
        yield
    finally:
        base.FUSED_CALL_TOKENS, base.FUSED_CALL_HISTORY = saved


def forward(model, cache, ids: torch.Tensor, fused: bool = True, keep: int = 1) -> tuple[float, torch.Tensor]:
    """(wall s, logits) of one call of ``ids`` on a copy of ``cache``."""
    from kvslim.adapters.compat import CACHE_KW

    c = copy.deepcopy(cache)
    with route(fused), torch.no_grad():
        t = time.perf_counter()
        logits = model(ids, use_cache=True, logits_to_keep=keep, **{CACHE_KW: c}).logits
        return time.perf_counter() - t, logits


def filled(model, method: str, kv) -> object:
    import kvslim
    from kvslim.longctx.protocol import make_cache_fn

    kvslim.restore(model)
    kvslim.apply(model, method)
    cache = make_cache_fn(model, method)()
    with torch.no_grad():
        for i, (k, v) in enumerate(kv):
            cache.update(k, v, i)
    return cache


def accuracy(model, method: str, kv, ids: torch.Tensor) -> dict:
    """max|Δ logits| against a dense fp32 cache holding the same history: the S-token call (every position), and
    the same S tokens one per call (every step)."""
    from kvslim.adapters.compat import CACHE_KW

    dense, coded = filled(model, "dense", kv), None
    want_call = forward(model, dense, ids, keep=0)[1]
    want_steps = []
    with torch.no_grad():
        for i in range(ids.shape[1]):
            want_steps.append(model(ids[:, i:i + 1], use_cache=True, **{CACHE_KW: dense}).logits)
    coded = filled(model, method, kv)
    got_call = forward(model, coded, ids, keep=0)[1]
    got_steps = []
    with torch.no_grad():
        for i in range(ids.shape[1]):
            got_steps.append(model(ids[:, i:i + 1], use_cache=True, **{CACHE_KW: coded}).logits)
    e_call = (got_call - want_call).abs().max().item()
    e_steps = max((a - b).abs().max().item() for a, b in zip(got_steps, want_steps))
    return {"call_vs_dense_max_abs": e_call, "steps_vs_dense_max_abs": e_steps,
            "call_error_x_steps_error": e_call / e_steps if e_steps else None}


def run(model, n: int, methods, calls, trials: int, check: bool) -> list[dict]:
    cfg = model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(n)
    kv = [(torch.randn(1, cfg.num_key_value_heads, n, d, generator=g) * 2,
           torch.randn(1, cfg.num_key_value_heads, n, d, generator=g)) for _ in range(cfg.num_hidden_layers)]
    ids = torch.randint(100, min(cfg.vocab_size, 10_000), (1, max(calls)), generator=g)
    rows = []
    for method in methods:
        cache = filled(model, method, kv)
        configs = [("step", 1, True)] + [(f"{s} fused", s, True) for s in calls] + [
            (f"{s} dequantized", s, False) for s in calls]
        for _, s, f in configs:  # warm-up (kernels, tables)
            forward(model, cache, ids[:, :s], f)
        times = {name: [] for name, _, _ in configs}
        for _ in range(trials):
            for name, s, f in configs:  # interleaved
                times[name].append(forward(model, cache, ids[:, :s], f)[0])
        med = {k: statistics.median(v) for k, v in times.items()}
        for s in calls:
            row = {"tokens": n, "method": method, "call_tokens": s, "step_s": med["step"],
                   "fused_s": med[f"{s} fused"], "dequantized_s": med[f"{s} dequantized"],
                   "fused_x_step": med[f"{s} fused"] / med["step"],
                   "dequantized_x_step": med[f"{s} dequantized"] / med["step"],
                   "fused_speedup": statistics.median(a / b for a, b in zip(times[f"{s} dequantized"],
                                                                             times[f"{s} fused"])),
                   "trials": {k: times[k] for k in ("step", f"{s} fused", f"{s} dequantized")},
                   "load_average": os.getloadavg()}
            if check and method != "dense" and s <= 64:  # the error of S steps: S single-token steps per cache
                row.update(accuracy(model, method, kv, ids[:, :s]))
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "trials"}), file=sys.stderr, flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("mha-100m", "qwen25"), default="mha-100m")
    p.add_argument("--tokens", default="16384", help="comma-separated history lengths (default 16384)")
    p.add_argument("--calls", default="17", help="comma-separated new tokens per call (default 17)")
    p.add_argument("--methods", default="int4", help="comma-separated (default int4)")
    p.add_argument("--trials", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--accuracy", action="store_true", help="also the logits against a dense fp32 cache (calls of "
                   "at most 64 tokens)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS / "bench_question_pass.json"))
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    from kvslim.bench.report import environment

    torch.set_num_threads(args.threads)
    if args.model == "mha-100m":
        from kvslim.bench.decode import mha_100m

        model, name = mha_100m(torch.float32).eval(), "mha-100m (12 layers, 12 heads of 64, fp32, random weights)"
    else:
        from kvslim.models import load_qwen25_coder

        model, name = load_qwen25_coder(torch.float32)[0], "Qwen2.5-Coder-0.5B-Instruct (fp32, from its GGUF)"
    calls = [int(x) for x in args.calls.split(",")]
    rows = []
    for n in (int(x) for x in args.tokens.split(",")):
        rows += run(model, n, [m for m in args.methods.split(",") if m], calls, args.trials, args.accuracy)
    doc = {"environment": environment(), "model": name, "batch": 1, "threads": args.threads,
           "cache": "seeded random keys/values through each method's update",
           "command": "python " + " ".join(sys.argv), "records": rows}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
