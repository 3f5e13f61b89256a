"""Prompt caches as files (issue 44): bytes, save and load time against the prefill a file replaces.

Qwen2.5-Coder-0.5B-Instruct (fp32, dequantized from its GGUF, offline), the first N tokens of Botchan (repeated as
needed). One prefill through HF's ``DynamicCache`` (timed: the prefill a file replaces) fills every method's cache
through its own ``update`` (what a one-call prefill through that cache writes, ``kvslim.longctx.protocol``). Per
method: file bytes and the cache's ``nbytes``, save time, load time with the page cache warm (after one untimed
load) and cold (the file's
pages dropped: ``/proc/sys/vm/drop_caches`` when writable, else ``posix_fadvise(DONTNEED)`` after ``sync``), time to
the first answer token from the file (load + the question + one token) against a prefill of the text plus the
question, and whether ``generate`` after loading gives the never-saved cache's tokens and logits bitwise. Medians
of ``--trials``; one JSON record naming its commit.

    nice -n 5 .venv/bin/python benchmarks/bench_prompt_cache.py --tokens 4096
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from functools import partial
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("dense", "int8", "int4", "int2", "turbo3")
QUESTION = "\n\nQuestion: who is the narrator's only friend at home? Answer:"


def text_ids(tok, n: int) -> torch.Tensor:
    from kvslim.evaluate import load_text

    text = load_text("botchan")
    ids = tok(text, return_tensors="pt").input_ids
    while ids.shape[1] < n:
        ids = torch.cat([ids, ids], dim=1)
    return ids[:, :n]


def drop_page_cache(path: Path) -> str:
    """Evict ``path``'s pages; returns how."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return "posix_fadvise_dontneed"


def timed(fn, trials: int) -> tuple[float, list[float], object]:
    out, times = None, []
    for _ in range(trials):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), times, out


def generate(model, ids, cache, new: int):
    from kvslim.adapters.compat import CACHE_KW

    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=0, **{CACHE_KW: cache})


def run_length(model, tok, n: int, methods, trials: int, new: int, folder: Path) -> list[dict]:
    import kvslim
    from kvslim.longctx.protocol import make_cache_fn, prefill_kv

    ids = text_ids(tok, n)
    q = tok(QUESTION, return_tensors="pt", add_special_tokens=False).input_ids
    full = torch.cat([ids, q], dim=1)
    kvslim.restore(model)
    t = time.perf_counter()
    with torch.no_grad():
        kv = prefill_kv(model, ids)
    prefill_s = time.perf_counter() - t
    print(f"{n} tokens: prefill {prefill_s:.1f} s", file=sys.stderr, flush=True)
    rows = []
    for method in methods:
        kvslim.restore(model)
        kvslim.apply(model, method)
        cache = make_cache_fn(model, method)()
        with torch.no_grad():  # not longctx's fill: inference-mode tensors could not be updated by generate
            for i, (k, v) in enumerate(kv):
                cache.update(k, v, i)
        path = folder / f"{method}_{n}.kvslim"
        save_s, save_all, _ = timed(partial(kvslim.save_cache, cache, path, model, ids), trials)
        size = path.stat().st_size
        want = generate(model, full, cache, new)
        kvslim.load_cache(path, model)  # warm-up: the method's kernels load at the first cache built
        warm_s, warm_all, loaded = timed(partial(kvslim.load_cache, path, model), trials)
        got = generate(model, full, loaded.cache, new)
        same = bool(torch.equal(want.sequences, got.sequences)
                    and all(torch.equal(a, b) for a, b in zip(want.logits, got.logits)))
        cold, how = [], ""
        for _ in range(trials):
            how = drop_page_cache(path)
            t = time.perf_counter()
            kvslim.load_cache(path, model)
            cold.append(time.perf_counter() - t)
        first = []
        for _ in range(trials):
            drop_page_cache(path)
            t = time.perf_counter()
            pc = kvslim.load_cache(path, model)
            generate(model, full, pc.cache, 1)
            first.append(time.perf_counter() - t)
        row = {"tokens": n, "method": method, "file_bytes": size, "cache_nbytes": cache.nbytes,
               "save_s": save_s, "load_warm_s": warm_s, "load_cold_s": statistics.median(cold), "cold_by": how,
               "first_token_from_file_s": statistics.median(first), "prefill_s": prefill_s,
               "generate_after_load_bitwise": same, "new_tokens_compared": new,
               "trials": {"save": save_all, "load_warm": warm_all, "load_cold": cold, "first_token": first}}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "trials"}), file=sys.stderr, flush=True)
        path.unlink()
    dense = next((r["file_bytes"] for r in rows if r["method"] == "dense"), None)
    for r in rows:
        r["file_x_dense"] = None if dense is None else r["file_bytes"] / dense
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="4096", help="comma-separated text lengths (default 4096)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated (default {','.join(METHODS)})")
    p.add_argument("--trials", type=int, default=3, help="timed repeats per figure (median; default 3)")
    p.add_argument("--new-tokens", type=int, default=8, help="answer tokens compared bitwise (default 8)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", default=str(RESULTS / "bench_prompt_cache.json"))
    p.add_argument("--tmp", default=None, help="folder for the files while measured (default: the system's)")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    from kvslim.bench.report import environment
    from kvslim.models import load_qwen25_coder

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_qwen25_coder(torch.float32)
    lengths = [int(x) for x in args.tokens.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    rows = []
    with tempfile.TemporaryDirectory(dir=args.tmp) as folder:
        for n in lengths:
            rows += run_length(model, tok, n, methods, args.trials, args.new_tokens, Path(folder))
    doc = {"environment": environment(), "model": "Qwen2.5-Coder-0.5B-Instruct (fp32, from its GGUF)",
           "text": "Botchan (kvslim.evaluate.load_text), first N tokens", "question": QUESTION,
           "load_average_at_end": os.getloadavg(), "records": rows}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
