"""Long-context retrieval through compressed caches (issue 34): kvslim's formats beside HF QuantizedCache (quanto).

Qwen2.5-Coder-0.5B-Instruct (fp32, dequantized from its GGUF), RULER-style tasks generated from a seed
(``kvslim.longctx``: passkey, multi-key, multi-value, variable tracking), filler from the Python standard
library's docstrings. One prefill per haystack fills every cache through the cache's own ``update``; each
question is decoded through the cache (question in one call, then greedy token by token). Accuracy per
(method, length, task) with a Wilson 95 % interval; bytes per token measured from the filled cache's tensors.

Results are appended per (length, trial, method, task) to ``benchmarks/results/<stem>.jsonl``; a rerun skips
what is there (resumable), and ``--report`` rewrites ``<stem>.json``, ``.md`` and ``.png`` from it.

    nice -n 5 .venv/bin/python benchmarks/bench_longctx.py --lengths 4096,8192 --trials 5
    nice -n 5 .venv/bin/python benchmarks/bench_longctx.py --lengths 16384 --trials 5    # appends
    .venv/bin/python benchmarks/bench_longctx.py --report
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import warnings
from pathlib import Path

import torch

from kvslim.optional import quanto_missing

RESULTS = Path(__file__).resolve().parent / "results"
STEM = "bench_longctx"
#: label -> (method, apply() options) for kvslim rows, ("quanto", {"nbits": b}) for HF QuantizedCache rows
MEANSTD = {"sparse_score": "meanstd"}  # the boxes of the rows run before min/max became the default (2026-11-29)
METHOD_ROWS = {  # in the order each haystack runs them (a run stopped mid-haystack keeps the first ones)
    "dense": ("dense", {}),
    "int4": ("int4", {}),
    "int2": ("int2", {}),
    "int3": ("int3", {}),
    "int8": ("int8", {}),
    "turbo3": ("turbo3", {}),  # library defaults (RoPE-centred keys, D/4 outlier key channels; issue 35)
    "turbo2": ("turbo2", {}),
    "quanto 4-bit": ("quanto", {"nbits": 4}),
    "quanto 2-bit": ("quanto", {"nbits": 2}),
    "window 1024": ("window", {"window": 1024}),
    # sparse decode (issue 43, docs/sparse.md): the answer's single-token steps read the chosen pages only; the
    # question (a multi-token call) reads everything. Cells are keyed by these labels: resumable like the others.
    # The rows without "dl0" ran with two layers read in full (the default until 2026-11-29, now 0), pinned here;
    # the rows without "mm" with mean ± std boxes (the default until 2026-11-29, now min/max), pinned too.
    # max(2,048, T/8)
    "sparse int4 auto": ("int4", {"sparse_budget": "auto", "sparse_dense_layers": 2, **MEANSTD}),
    "sparse int4 2048": ("int4", {"sparse_budget": 2048, "sparse_dense_layers": 2, **MEANSTD}),
    "sparse int4 1024": ("int4", {"sparse_budget": 1024, "sparse_dense_layers": 2, **MEANSTD}),
    "sparse int4 4096": ("int4", {"sparse_budget": 4096, "sparse_dense_layers": 2, **MEANSTD}),
    # larger pages: fewer, longer reads (docs/sparse.md)
    "sparse int4 auto p64": ("int4", {"sparse_budget": "auto", "sparse_page": 64, "sparse_dense_layers": 2,
                                      **MEANSTD}),
    "sparse int4 auto p128": ("int4", {"sparse_budget": "auto", "sparse_page": 128, "sparse_dense_layers": 2,
                                       **MEANSTD}),
    # every layer sparse (the library's default since 2026-11-29)
    "sparse int4 auto dl0": ("int4", {"sparse_budget": "auto", "sparse_dense_layers": 0, **MEANSTD}),
    "sparse dense 2048": ("dense", {"sparse_budget": 2048, "sparse_dense_layers": 2, **MEANSTD}),
    "sparse dense 2048 dl0": ("dense", {"sparse_budget": 2048, "sparse_dense_layers": 0, **MEANSTD}),
    "sparse turbo3 2048 dl0": ("turbo3", {"sparse_budget": 2048, "sparse_dense_layers": 0, **MEANSTD}),
    "sparse int4 2048 dl0": ("int4", {"sparse_budget": 2048, "sparse_dense_layers": 0, **MEANSTD}),
    # min/max boxes (Quest's; the default since 2026-11-29), every layer sparse
    "sparse int4 auto mm": ("int4", {"sparse_budget": "auto", "sparse_score": "minmax", "sparse_dense_layers": 0}),
    "sparse int4 2048 mm": ("int4", {"sparse_budget": 2048, "sparse_score": "minmax", "sparse_dense_layers": 0}),
    "sparse int4 1024 mm": ("int4", {"sparse_budget": 1024, "sparse_score": "minmax", "sparse_dense_layers": 0}),
    "sparse dense 2048 mm": ("dense", {"sparse_budget": 2048, "sparse_score": "minmax", "sparse_dense_layers": 0}),
    "sparse int2 2048 mm": ("int2", {"sparse_budget": 2048, "sparse_score": "minmax", "sparse_dense_layers": 0}),
    "sparse turbo3 2048 mm": ("turbo3", {"sparse_budget": 2048, "sparse_score": "minmax", "sparse_dense_layers": 0}),
    # pages of 64 tokens (min/max boxes, every layer sparse)
    "sparse int4 auto mm p64": ("int4", {"sparse_budget": "auto", "sparse_page": 64, "sparse_score": "minmax",
                                         "sparse_dense_layers": 0}),
    "sparse int4 2048 mm p64": ("int4", {"sparse_budget": 2048, "sparse_page": 64, "sparse_score": "minmax",
                                         "sparse_dense_layers": 0}),
    # max(2,048, T/8), the layers kvslim.calibrate_sparse picks on 8,192 tokens of Botchan read in full
    "sparse int4 auto cal": ("int4", {"sparse_budget": "auto", "sparse_dense_layers": "calibrated"}),
    "sparse int4 2048 cal": ("int4", {"sparse_budget": 2048, "sparse_dense_layers": "calibrated"}),
    "sparse int4 1024 cal": ("int4", {"sparse_budget": 1024, "sparse_dense_layers": "calibrated"}),
    "sparse dense auto cal": ("dense", {"sparse_budget": "auto", "sparse_dense_layers": "calibrated"}),
    "sparse turbo3 auto cal": ("turbo3", {"sparse_budget": "auto", "sparse_dense_layers": "calibrated"}),
    "sparse int2 auto cal": ("int2", {"sparse_budget": "auto", "sparse_dense_layers": "calibrated"}),
    "sparse int2 2048": ("int2", {"sparse_budget": 2048, "sparse_dense_layers": 2, **MEANSTD}),
    "sparse int2 1024": ("int2", {"sparse_budget": 1024, "sparse_dense_layers": 2, **MEANSTD}),
    "sparse turbo3 2048": ("turbo3", {"sparse_budget": 2048, "sparse_dense_layers": 2, **MEANSTD}),
    "sparse turbo3 1024": ("turbo3", {"sparse_budget": 1024, "sparse_dense_layers": 2, **MEANSTD}),
}
#: the order of the tables' rows and columns (dense, then kvslim by bytes, each turbo
#: row beside the int row of its bits, then the peer, then eviction)
TABLE_ORDER = ["dense", "int8", "int4", "int3", "turbo3", "int2", "turbo2", "quanto 4-bit", "quanto 2-bit",
               "window 1024", "sparse dense 2048", "sparse int4 auto", "sparse int4 auto p64", "sparse int4 auto p128",
               "sparse int4 auto dl0", "sparse int4 4096", "sparse int4 2048", "sparse int4 1024",
               "sparse int2 2048", "sparse int2 1024", "sparse turbo3 2048", "sparse turbo3 1024",
               "sparse dense 2048 dl0", "sparse turbo3 2048 dl0", "sparse int4 2048 dl0", "sparse int4 auto mm",
               "sparse int4 2048 mm", "sparse int4 1024 mm", "sparse dense 2048 mm", "sparse int2 2048 mm",
               "sparse turbo3 2048 mm", "sparse int4 auto mm p64", "sparse int4 2048 mm p64", "sparse int4 auto cal",
               "sparse int4 2048 cal", "sparse int4 1024 cal", "sparse dense auto cal", "sparse turbo3 auto cal",
               "sparse int2 auto cal"]
#: the label suffix of the rows whose question is fed one token per call (--question-by-token)
BY_TOKEN = " (question by token)"
MODELS = {"qwen25": ("load_qwen25_coder", "Qwen2.5-Coder-0.5B-Instruct (GGUF dequantized, fp32)"),
          "smollm2": ("load_smollm2", "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized, fp32)")}


def cache_makers(model, labels, tok=None) -> dict:
    """label -> a function building an empty cache of that row."""
    from kvslim.longctx.protocol import make_cache_fn

    out = {}
    for label in labels:
        method, options = METHOD_ROWS[label]
        if options.get("sparse_dense_layers") == "calibrated":
            options = {**options, "sparse_dense_layers": calibrated_layers(model, tok)}
            print(f"{label}: layers {list(options['sparse_dense_layers'])} read in full (kvslim.calibrate_sparse)")
        out[label] = make_cache_fn(model, method, **options)
    return out


def calibrated_layers(model, tok, tokens: int = 8192) -> list[int]:
    """``kvslim.calibrate_sparse`` on the first ``tokens`` tokens of the shipped Botchan (never the haystacks'
    filler), kept in ``~/.cache/kvslim`` per model (its type, layers and a fingerprint of its first key projection:
    two models of one architecture do not share a file) and library version (~75 s for Qwen2.5-Coder-0.5B)."""
    import hashlib
    from importlib.resources import files

    from kvslim import __version__, calibrate_sparse

    weights = model.model.layers[0].self_attn.k_proj.weight.detach().float().contiguous()
    mark = hashlib.sha256(weights.numpy().tobytes()).hexdigest()[:12]
    name = f"sparse-layers-{model.config.model_type}-{model.config.num_hidden_layers}-{mark}-{__version__}.json"
    path = Path.home() / ".cache" / "kvslim" / name
    if path.is_file():
        return json.loads(path.read_text())
    ids = tok((files("kvslim.data") / "botchan.txt").read_text(), return_tensors="pt").input_ids[:, :tokens]
    layers = calibrate_sparse(model, ids)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(layers))
    return layers



def git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:  # noqa: BLE001 - informational only
        return "unknown"


def report(stem: Path) -> dict:
    """Rewrite ``stem``.json / .md / .png from the records in ``stem``.jsonl."""
    from kvslim.longctx import summarize
    from kvslim.longctx.protocol import read_jsonl

    records = read_jsonl(stem.with_suffix(".jsonl"))
    if not records:
        raise ValueError(f"{stem.with_suffix('.jsonl')} holds no records")
    rows = summarize(records)
    first = records[0]
    rec = {"model": first.get("model"), "filler": first.get("filler"), "filler_sha256": first.get("filler_sha256"),
           "seed": ", ".join(str(x) for x in sorted({r.get("seed", 0) for r in records})), "commits": sorted({r.get("commit", "?") for r in records}),
           "protocol": "one one-call prefill per haystack fills every cache via its update(); question in one call, "
                       "answer greedy token by token through the cache; exact match of the expected items",
           "lengths": sorted({r["length"] for r in records}),
           "methods": sorted(dict.fromkeys(r["method"] for r in records), key=lambda m: (TABLE_ORDER + [m]).index(m)),
           "records": len(records), "rows": rows, "haystacks": haystacks(records),
           "agreement": agreement(records)}
    stem.with_suffix(".json").write_text(json.dumps(rec, indent=1))
    stem.with_suffix(".md").write_text(markdown(rec))
    plot(rec, stem.with_suffix(".png"))
    return rec


def haystacks(records: list[dict]) -> dict[str, int]:
    """length -> haystacks with a dense record (one question each)."""
    out: dict[str, int] = {}
    for r in records:
        if r["method"] == "dense":
            out[str(r["length"])] = out.get(str(r["length"]), 0) + 1
    return dict(sorted(out.items(), key=lambda x: int(x[0])))


def agreement(records: list[dict]) -> dict[str, dict]:
    """Per method, paired with dense on the same questions (all lengths): questions both answered, same verdict,
    and the questions dense got right that the method got wrong (and the reverse)."""
    dense = {(r.get("seed", 0), r["length"], r["trial"], r["task"]): bool(r["correct"]) for r in records
             if r["method"] == "dense"}
    out: dict[str, dict] = {}
    for r in records:
        key = (r.get("seed", 0), r["length"], r["trial"], r["task"])
        if r["method"] == "dense" or key not in dense:
            continue
        a = out.setdefault(r["method"], {"n": 0, "same": 0, "lost": 0, "gained": 0})
        a["n"] += 1
        a["same"] += dense[key] == bool(r["correct"])
        a["lost"] += dense[key] and not r["correct"]
        a["gained"] += r["correct"] and not dense[key]
    return out


def markdown(rec: dict) -> str:
    lengths, methods = rec["lengths"], rec["methods"]
    cell = {(r["method"], r["length"], r["task"]): r for r in rec["rows"]}
    tasks = sorted({r["task"] for r in rec["rows"]} - {"all"})
    out = [f"{rec['model']}; filler {rec['filler']}; seeds {rec['seed']}; commits {', '.join(rec['commits'])}. "
           f"Accuracy over all tasks with its Wilson 95 % interval (correct/trials), bytes per token measured "
           f"from the filled cache (fp32 model).", "",
           "| cache | " + " | ".join(f"{n:,} tokens" for n in lengths) + " | bytes/token (its longest context) |",
           "|---|" + "---|" * (len(lengths) + 1)]
    for m in methods:
        cells, bpt = [], None
        for n in lengths:
            r = cell.get((m, n, "all"))
            if r is None:
                cells.append("-")
                continue
            bpt = r["bytes_per_token"]  # the longest context's
            lo, hi = r["wilson95"]
            cells.append(f"{100 * r['accuracy']:.0f} % [{100 * lo:.0f}, {100 * hi:.0f}] ({r['correct']}/{r['n']})")
        out.append(f"| {m} | " + " | ".join(cells) + f" | {bpt:,.0f} |")
    out += ["", "Haystacks (one question each) per length: " + ", ".join(
        f"{int(n):,}: {k}" for n, k in rec["haystacks"].items()) + ".", "",
        "Paired with dense (same questions, all lengths): same verdict / questions; lost = dense right, this wrong; "
        "gained = the reverse.", "", "| cache | same verdict | lost | gained |", "|---|---|---|---|"]
    out += [f"| {m} | {a['same']}/{a['n']} | {a['lost']} | {a['gained']} |" for m in methods
            if (a := rec["agreement"].get(m))]
    out += ["", "Per task (correct/trials):", "",
            "| cache | length | " + " | ".join(tasks) + " |", "|---|---|" + "---|" * len(tasks)]
    for m in methods:
        for n in lengths:
            if (m, n, "all") not in cell:
                continue
            out.append(f"| {m} | {n:,} | " + " | ".join(
                f"{cell[(m, n, t)]['correct']}/{cell[(m, n, t)]['n']}" if (m, n, t) in cell else "-" for t in tasks)
                + " |")
    return "\n".join(out) + "\n"


def readme_table(rec: dict) -> str:
    """The README's table: one row per context, one column per method (accuracy over all tasks [Wilson 95 %]
    (correct/asked)), and the bytes per token at the longest context every method reached (``tests/test_docs.py``
    checks it)."""
    cell = {(r["method"], r["length"]): r for r in rec["rows"] if r["task"] == "all"}
    methods = rec["methods"]
    label = {m: m if m.startswith("quanto") else f"kvslim {m}" for m in methods}
    out = ["| context | " + " | ".join(label[m] for m in methods) + " |", "|---|" + "---|" * len(methods)]
    for n in rec["lengths"]:
        cells = []
        for m in methods:
            r = cell.get((m, n))
            lo, hi = r["wilson95"] if r else (0, 0)
            cells.append(f"{100 * r['accuracy']:.0f} % [{100 * lo:.0f}, {100 * hi:.0f}] ({r['correct']}/{r['n']})"
                         if r else "—")
        out.append(f"| {n:,} | " + " | ".join(cells) + " |")
    every = [n for n in rec["lengths"] if all((m, n) in cell for m in methods)]
    top = max(every or rec["lengths"])  # the longest context every row reached: one context for all the bytes
    out.append(f"| bytes/token at {top:,} | " + " | ".join(
        f"{cell[(m, top)]['bytes_per_token']:,.0f}" if (m, top) in cell else "—" for m in methods) + " |")
    return "\n".join(out) + "\n"


def plot(rec: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    rows = [r for r in rec["rows"] if r["task"] == "all"]
    for i, m in enumerate(rec["methods"]):
        pts = sorted((r["length"], r["accuracy"], *r["wilson95"]) for r in rows if r["method"] == m)
        x = [p[0] * (1 + 0.015 * (i - len(rec["methods"]) / 2)) for p in pts]  # small offsets: bars stay apart
        y = [100 * p[1] for p in pts]
        err = [[100 * (p[1] - p[2]) for p in pts], [100 * (p[3] - p[1]) for p in pts]]
        ax.errorbar(x, y, yerr=err, marker="s" if m.startswith("quanto") else "o", capsize=3, label=m,
                    ls="--" if m.startswith("quanto") else "-")
    ax.set_xscale("log", base=2)
    ax.set_xticks(rec["lengths"], [f"{n:,}\n({rec['haystacks'].get(str(n), 0)} haystacks)" for n in rec["lengths"]])
    ax.set_ylim(-5, 105)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("accuracy, all tasks (%), Wilson 95 % interval")
    ax.set_title(f"{(rec['model'] or '').split(' (')[0]}: retrieval through the cache")
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def prefill_only(model, tok, lengths, first_trial, trials, seed, tasks, units, kv_dir: Path) -> None:
    """Prefill every (length, trial) haystack into ``kv_dir`` (``kv-<seed>-<length>-<trial>.pt``, the files
    ``kvslim.longctx.run`` reads back); haystacks already there are skipped (resumable per haystack)."""
    import random
    import time

    from kvslim.longctx import haystack as hs
    from kvslim.longctx.protocol import _prefill_saved
    from kvslim.longctx.tasks import instances

    for trial in range(first_trial, trials):
        for n in lengths:
            name = f"{seed}-{n}-{trial}"
            t0 = time.perf_counter()
            hay = hs.build(tok, instances(seed, n, trial, tasks), n, units,
                           random.Random(f"kvslim-filler:{seed}:{n}:{trial}"))
            _, seconds, path = _prefill_saved(model, hay.ids, kv_dir, name)
            print(f"{name}: prefill {seconds:.0f} s (wall here {time.perf_counter() - t0:.0f} s) -> {path}",
                  flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="4096,8192", help="comma-separated context lengths (tokens)")
    p.add_argument("--trials", type=int, default=3, help="haystacks per length (each asks every task once)")
    p.add_argument("--first-trial", type=int, default=0, help="start at this trial (another process, another --stem)")
    p.add_argument("--methods", default=",".join(METHOD_ROWS),
                   help=f"comma-separated rows of {list(METHOD_ROWS)}")
    p.add_argument("--tasks", default="passkey,multikey,multivalue,vartrack")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", choices=sorted(MODELS), default="qwen25")
    p.add_argument("--filler", default="stdlib-docs")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-dir", default=None, help="save each haystack's prefill here until its cells are written "
                                                   "(a killed run resumes without prefilling it again)")
    p.add_argument("--stem", default=STEM, help="result file stem under benchmarks/results/")
    p.add_argument("--report", action="store_true", help="only rewrite .json/.md/.png from the .jsonl")
    p.add_argument("--keep-kv", action="store_true", help="keep the prefills in --kv-dir after their cells")
    p.add_argument("--question-by-token", action="store_true",
                   help=f"feed the question one token per call (each a decode step: sparse where the cache is); "
                        f"rows labelled '<row>{BY_TOKEN}'")
    p.add_argument("--prefill-only", action="store_true",
                   help="only prefill each haystack into --kv-dir and keep the files (no cells): the sparse selection "
                        "study (benchmarks/bench_sparse_select.py) and later runs read them back")
    args = p.parse_args()
    stem = RESULTS / args.stem
    if args.report:
        rec = report(stem)
        print(markdown(rec) + "\nREADME:\n\n" + readme_table(rec))
        return
    lengths = [int(x) for x in args.lengths.split(",")]
    labels = args.methods.split(",")
    bad = [m for m in labels if m not in METHOD_ROWS]
    if bad:
        p.error(f"--methods: unknown {bad}; expected some of {list(METHOD_ROWS)}")
    if any(METHOD_ROWS[m][0] == "quanto" for m in labels) and quanto_missing():
        print(f"quanto rows left out: {quanto_missing()}")
        labels = [m for m in labels if METHOD_ROWS[m][0] != "quanto"]
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import kvslim.models
    from kvslim import api
    from kvslim.longctx import filler_units, run
    from kvslim.longctx.tasks import units_sha256

    loader, model_label = MODELS[args.model]
    model, tok = getattr(kvslim.models, loader)(torch.float32)
    api.apply(model, "dense")  # the storage methods' attention (packed GQA SDPA); caches differ per row
    units = filler_units(args.filler)
    meta = {"model": model_label, "filler": args.filler, "filler_sha256": units_sha256(units),
            "commit": git_commit(), "threads": args.threads, "torch": torch.__version__,
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "question": "token by token" if args.question_by_token else "one call",
            "command": "python " + " ".join(sys.argv)}
    if args.prefill_only:
        if args.kv_dir is None:
            p.error("--prefill-only needs --kv-dir (where the prefills are kept)")
        prefill_only(model, tok, lengths, args.first_trial, args.trials, args.seed, args.tasks.split(","), units,
                     Path(args.kv_dir))
        return
    RESULTS.mkdir(exist_ok=True)
    caches = cache_makers(model, labels, tok)
    if args.question_by_token:  # its own rows beside the one-call ones (same haystacks, another protocol)
        caches = {f"{label}{BY_TOKEN}": make for label, make in caches.items()}
    run(model, tok, caches, lengths=lengths, trials=args.trials, seed=args.seed,
        tasks=args.tasks.split(","), units=units, out=stem.with_suffix(".jsonl"), meta=meta, first_trial=args.first_trial,
        kv_dir=args.kv_dir, keep_kv=args.keep_kv, by_token=args.question_by_token)
    print(markdown(report(stem)))


if __name__ == "__main__":
    main()
