"""One haystack of ``bench_longctx.py`` again, through variants of one method: is a lost question the format's,
its rotation seed's, or the fused decode path's?

Same protocol and haystack as ``bench_longctx.py`` (seed, length, trial, filler; ``kvslim.longctx.run``), rows:
``METHOD`` (library defaults, fused decode as the benchmark runs it: reproduces its record), ``METHOD unfused``
(the same codes, attention reading the layers' decoded history instead of the fused op), ``METHOD seed S`` (other
rotation seeds), and ``METHOD NAME=VALUE`` rows for single options (``--options``). Records are appended to
``benchmarks/results/<stem>.jsonl`` (resumable), then a table is printed.

    nice -n 10 .venv/bin/python benchmarks/bench_longctx_probe.py --method turbo3 --length 4096 --trial 2 \\
        --seeds 1,2 --options rope_centred_keys=False
"""

from __future__ import annotations

import argparse
import ast
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_longctx import MODELS, RESULTS, git_commit  # noqa: E402


def unfused_maker(model, method: str, **options):
    """An empty cache of ``method`` as ``kvslim.make_cache`` builds it, without the fused decode op: attention
    reads each layer's decoded history (the reference path)."""
    from kvslim.adapters.generate import build_cache
    from kvslim.methods import METHODS

    plan = METHODS[method].plan_model(model, **options)

    def make():
        cache = build_cache(model, plan, None)
        for layer in cache.layers:  # what enable_fused_decode set: decode steps then read the decoded history
            layer.fused_decode = False
        return cache

    return make


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="turbo3")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--trial", type=int, default=2)
    p.add_argument("--seeds", default="1,2", help="other rotation seeds (comma-separated; empty: none)")
    p.add_argument("--options", default="", help="comma-separated NAME=VALUE rows, one option each")
    p.add_argument("--no-unfused", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-dir", default=None)
    p.add_argument("--stem", default="bench_longctx_probe")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import kvslim.models
    from kvslim import api
    from kvslim.longctx import filler_units, run, summarize
    from kvslim.longctx.protocol import make_cache_fn
    from kvslim.longctx.tasks import units_sha256

    loader, label = MODELS["qwen25"]
    model, tok = getattr(kvslim.models, loader)(torch.float32)
    api.apply(model, "dense")
    m = args.method
    caches = {m: make_cache_fn(model, m)}
    if not all(getattr(layer, "fused_decode", False) for layer in caches[m]().layers):
        p.error(f"{m}'s fused decode op is not built here: the default row would not run as the benchmark's did")
    if not args.no_unfused:
        caches[f"{m} unfused"] = unfused_maker(model, m)
    for s in filter(None, args.seeds.split(",")):
        caches[f"{m} seed {int(s)}"] = make_cache_fn(model, m, seed=int(s))
    for item in filter(None, args.options.split(",")):
        name, _, raw = item.partition("=")
        caches[f"{m} {name}={raw}"] = make_cache_fn(model, m, **{name: ast.literal_eval(raw)})
    units = filler_units("stdlib-docs")
    meta = {"model": label, "filler": "stdlib-docs", "filler_sha256": units_sha256(units), "commit": git_commit(),
            "threads": args.threads, "command": "python " + " ".join(sys.argv)}
    records = run(model, tok, caches, lengths=[args.length], trials=args.trial + 1, first_trial=args.trial,
                  seed=0, units=units, out=RESULTS / f"{args.stem}.jsonl", meta=meta, kv_dir=args.kv_dir)
    mine = [r for r in records if r["length"] == args.length and r["trial"] == args.trial]
    for r in mine:
        print(f"{r['method']:32s} {'right' if r['correct'] else 'WRONG':5s} {r['answer']!r}")
    print(summarize(mine))


if __name__ == "__main__":
    main()
