"""Sparse decode (issue 43): one layer's decode attention, sparse against the full read, interleaved.

``mha-100m`` shapes (12 KV heads, head dim 64, fp32), one cache layer of each kind filled with random keys through
its own ``update`` (statistics included), then the attention of one decode step (kvslim's SDPA entry point:
dense → SDPA, int4 → the fused op; sparse → selection + the same math over the chosen rows) timed A B A B ... for
``--rounds`` rounds of ``--reps`` calls each; median per call. Where the paths call kvslim's C++ ops (int4, turbo3),
the same calls are replayed alone in the same rounds (``op_*``: the op without the Python entry point around it).
Writes one JSON record naming its commit.

    python benchmarks/bench_sparse_op.py --contexts 4096 8192 16384 32768 --batches 1 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
import types

import torch
from transformers import LlamaConfig

import kvslim
from kvslim.adapters.sdpa import packed_gqa_sdpa_forward
from kvslim.adapters.shape import shape_from_config
from kvslim.caches.storage import ScratchPool
from kvslim.methods import METHODS

CFG = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
           num_key_value_heads=12, max_position_embeddings=32768)


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def layer_for(method: str, budget: int, page: int, max_length: int | None = None):
    """One cache layer as a cache of ``max_length`` tokens builds it (``kvslim.make_cache(model, max_length)``)."""
    shape = shape_from_config(LlamaConfig(**CFG))
    plan = METHODS[method].plan(shape, torch.float32, sparse_budget=budget, sparse_page=page)
    layer = plan.layers[2].factory(max_length)
    layer.fused_decode = True
    layer.sparse_attention = True
    layer.scratch_pool = ScratchPool()  # as a KVSlimCache gives its layers
    return layer


_FLUSH: list = []


def flush_caches() -> None:
    """Read 96 MB (three times this machine's L3) so that the next call finds the layer in DRAM, as a real step
    does (every other layer's cache is read in between)."""
    if not _FLUSH:
        _FLUSH.append(torch.ones(24 << 20))
    _FLUSH[0].sum()


#: the C++ ops a step's attention calls (sparse_select: a left-padded step's choice before its decode op)
OPS = ("sparse_select", "quant_decode", "quant_decode_lowbit", "turbo_decode")


def op_calls(fn) -> list:
    """The kvslim C++ op calls ``fn()`` makes, as ``(op, args, kwargs)``: replayed by :func:`replay`, they time the
    op alone (the issue's "attention op alone"), without the Python entry point around it. Empty where the path
    calls none (dense: SDPA)."""
    from kvslim.kernels.build import load_ops

    calls, ns, saved = [], torch.ops.kvslim, {}
    for name in OPS:
        load_ops(name)
        op = getattr(ns, name, None)
        if op is None:
            continue
        saved[name] = op

        def spy(*a, _op=op, **k):
            calls.append((_op, a, k))
            return _op(*a, **k)

        ns.__dict__[name] = spy
    try:
        fn()
    finally:
        for name, op in saved.items():
            ns.__dict__[name] = op
    return calls


def replay(calls) -> None:
    for op, a, k in calls:
        op(*a, **k)


def point(method: str, context: int, batch: int, budget, page, rounds: int, reps: int, padded: bool = False,
          cold: bool = False) -> dict:
    layer = layer_for(method, budget, page, context + 2)  # the prefill and the two steps below
    g = torch.Generator().manual_seed(0)
    h, d = CFG["num_key_value_heads"], CFG["hidden_size"] // CFG["num_attention_heads"]
    for s in range(0, context, 4096):  # the prefill, in chunks (as a chunked prefill writes)
        n = min(4096, context - s)
        k = torch.randn(batch, h, n, d, generator=g)
        layer.update(k, torch.randn(batch, h, n, d, generator=g))
    one = torch.randn(batch, h, 1, d, generator=g)
    layer.sparse_attention = False
    k_full, v_full = layer.update(one, one.clone())
    layer.sparse_attention = True
    k_sp, v_sp = layer.update(one, one.clone())
    reads_all = getattr(k_sp, "_kvslim_sparse", None) is None
    # a fixed budget must make a sparse step here; "auto" reads everything below its format's crossover
    # (caches.sparse.FULL_READ): that point times the full read against itself, marked reads_all
    assert not reads_all or budget == "auto", "not a sparse step"
    module = types.SimpleNamespace(num_key_value_groups=1)
    q = torch.randn(batch, CFG["num_attention_heads"], 1, d, generator=g)

    def mask_for(k):  # a left-padded batch: row i's first i/(2B) of the context is padding (HF's bool decode mask)
        if not padded:
            return None
        mask = torch.ones(batch, 1, 1, k.shape[2], dtype=torch.bool)
        for i in range(batch):
            mask[i, ..., :context * i // (2 * batch)] = False
        return mask

    def timed(fn):
        if cold:  # each call timed alone, after the caches were flushed
            total = 0.0
            for _ in range(reps):
                flush_caches()
                t = time.perf_counter()
                fn()
                total += time.perf_counter() - t
            return total / reps * 1e3
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) / reps * 1e3

    def call(k, v, mask):
        return packed_gqa_sdpa_forward(module, q, k, v, mask, scaling=d ** -0.5)

    def run(k, v):
        mask = mask_for(k)
        return timed(lambda: call(k, v, mask))

    run(k_full, v_full), run(k_sp, v_sp)  # warm-up
    calls_full = op_calls(lambda: call(k_full, v_full, mask_for(k_full)))  # one call each
    calls_sp = op_calls(lambda: call(k_sp, v_sp, mask_for(k_sp)))
    raw = bool(calls_full) and bool(calls_sp)
    full, sparse, op_full, op_sparse = [], [], [], []
    for _ in range(rounds):
        full.append(run(k_full, v_full))
        sparse.append(run(k_sp, v_sp))
        if raw:
            op_full.append(timed(lambda: replay(calls_full)))
            op_sparse.append(timed(lambda: replay(calls_sp)))
    f, s = statistics.median(full), statistics.median(sparse)
    rec = {"method": method, "context": context, "batch": batch, "budget": budget, "page": layer.sparse.page,
           "padded": padded, "cold": cold, "reads_all": reads_all,
           "full_ms": round(f, 3), "sparse_ms": round(s, 3), "speedup": round(f / s, 2),
           "full_ms_rounds": [round(x, 3) for x in full], "sparse_ms_rounds": [round(x, 3) for x in sparse],
           "stats_bytes": layer.page_stats.nbytes(), "cache_bytes": layer.nbytes}
    if raw:  # the C++ calls alone, replayed (no Python entry point): the op's own ratio
        of, os_ = statistics.median(op_full), statistics.median(op_sparse)
        rec.update(op_full_ms=round(of, 3), op_sparse_ms=round(os_, 3), op_speedup=round(of / os_, 2),
                   op_calls=[getattr(c[0], "_qualified_op_name", str(c[0])) for c in calls_sp],
                   op_full_ms_rounds=[round(x, 3) for x in op_full],
                   op_sparse_ms_rounds=[round(x, 3) for x in op_sparse])
    print(json.dumps({k: v for k, v in rec.items() if not k.endswith("rounds")}), flush=True)
    return rec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", nargs="+", default=["int4", "dense"])
    p.add_argument("--contexts", nargs="+", type=int, default=[4096, 8192, 16384, 32768])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--budget", default="2048", help="comma-separated: tokens, or auto (max(2,048, an eighth of the "
                   "context))")
    p.add_argument("--page", type=int, default=None, help="tokens per page (default: the library's)")
    p.add_argument("--padded", choices=("no", "yes", "both"), default="no",
                   help="a left-padded batch (row i: its first i/(2B) of the context padding), or both layouts")
    p.add_argument("--cold", choices=("no", "yes", "both"), default="no",
                   help="flush the CPU caches before every timed call (a real step finds the layer in DRAM: every "
                   "other layer was read since), or both")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip", nargs="*", default=[], help="METHOD:CONTEXT:BATCH points to leave out (memory)")
    p.add_argument("--out", default="benchmarks/results/bench_sparse_op.json")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    records = []
    with torch.no_grad():
        for method in a.methods:
            for batch in a.batches:
                for context in a.contexts:
                    if f"{method}:{context}:{batch}" in a.skip:
                        continue
                    for budget in (x if x == "auto" else int(x) for x in a.budget.split(",")):
                        for padded in {"no": (False,), "yes": (True,), "both": (False, True)}[a.padded]:
                            if padded and batch == 1:
                                continue  # one sequence has nothing to pad
                            for cold in {"no": (False,), "yes": (True,), "both": (False, True)}[a.cold]:
                                records.append(point(method, context, batch, budget, a.page, a.rounds, a.reps,
                                                     padded, cold))
    out = {"commit": _commit(), "torch": torch.__version__, "kvslim": kvslim.__version__,
           "machine": platform.machine(), "threads": a.threads, "load_average": os.getloadavg(),
           "shape": "mha-100m layer (12 KV heads x 64, fp32)", "records": records}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
