"""Which pages does a sparse decode step need? Page selection rules measured against the full read on real haystacks.

Reads the haystack prefills that ``bench_longctx.py --prefill-only --kv-dir DIR`` keeps (Qwen2.5-Coder-0.5B, fp32),
answers every question of each haystack through a **dense full-read** cache (question in one call, then greedy
token by token), and records every layer's post-RoPE queries on the way. Then, offline and per selection rule, it
scores the haystack's pages from its keys exactly as a sparse step would (the statistics of
``kvslim.caches.sparse.PageStats``, page 0 forced, the newest rows read outright) and reports, per rule and budget:

* ``mass``: the share of the full read's attention (softmax over every row, per query head) that falls on the rows
  the rule reads, over every layer read sparsely, head and step (mean, and the 1st / 10th percentile);
* ``needle``: at the steps that write the answer, in each layer's **retrieval heads** (the query heads whose full
  read puts ≥ 10 % of its attention on the inserted sentence's rows), whether the rule reads the sentence's pages;
  and the distribution of the sentence's page rank under the rule (median, 90th percentile, worst).

Nothing here decodes sparsely: that is ``bench_longctx.py``'s job (the accuracy of record). This is the seconds-
per-question loop in which rules are compared, on haystacks kept apart from the ones the accuracy is reported on.

    .venv/bin/python benchmarks/bench_sparse_select.py --kv-dir ~/.cache/kvslim/haystacks --seed 1 \\
        --lengths 16384,32768 --trials 2 --stem bench_sparse_select
"""

from __future__ import annotations

import argparse
import json
import random
import warnings
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
RECENT = 128  # rows a dense layer reads outright (kvslim.caches.sparse.RECENT)
RETRIEVAL = 0.10
#: page summaries scored: the box bound on mean ± std, on min/max boxes and on min/max boxes in the keys' principal
#: axes (``pca``: the basis from the haystack's keys, as PageStats takes it from the prompt's), a Gaussian estimate z·‖q ⊙ σ‖ beside
#: the centre's q·c (z = 1, 2, 3), the centre alone
SCORES = ("meanstd", "minmax", "pca", "l2z1", "l2z2", "l2z3", "l2z0")  # a query head is retrieving when the full read puts this much attention on the sentence's rows


def record_queries(model, tok, cache, question, by_token: bool = False) -> tuple[list[dict], str]:
    """Answer ``question`` through ``cache`` (full read) and return every attention call's post-RoPE query:
    ``[{"layer": i, "q": (H, S, D) fp32, "pos": first position}]`` in call order, and the answer text."""
    from kvslim.adapters import sdpa
    from kvslim.longctx.protocol import answer

    calls: list[dict] = []
    inner = sdpa._forward

    def spy(module, query, key, value, *a, **kw):
        calls.append({"layer": module.layer_idx, "q": query[0].detach().float().clone(), "t": key.shape[2]})
        return inner(module, query, key, value, *a, **kw)

    sdpa._forward = spy
    try:
        text, _ = answer(model, tok, cache, question, by_token=by_token)
    finally:
        sdpa._forward = inner
    return calls, text


def boxes(keys: torch.Tensor, page: int, score: str) -> torch.Tensor:
    """(H, T, D) fp32 keys -> (H, P, 2, D) [centre, radius] of the complete pages, as PageStats computes them
    (before its int8 codes): ``kvslim.calibration_sparse.page_boxes`` (min/max for ``minmax`` and ``pca``)."""
    from kvslim.calibration_sparse import page_boxes

    h, t, d = keys.shape
    return page_boxes(keys, page, "minmax" if score in ("minmax", "pca") else "meanstd").view(h, t // page, 2, d)


def principal_axes(x: torch.Tensor) -> torch.Tensor:
    """(H, T, D) keys -> (H, D, D) orthonormal columns: the eigenvectors of the keys' covariance (float64). Boxes
    of the rotated keys ``k·R`` scored with ``q·R`` bound the same ``q·k``, tighter where keys are anisotropic
    (tried 2026-11-29: on the tuning haystacks no better than the model's axes, so not in the library)."""
    xc = x.double() - x.double().mean(dim=1, keepdim=True)
    return torch.linalg.eigh(xc.transpose(-1, -2) @ xc).eigenvectors.float()


def union_pages(s_head: torch.Tensor) -> torch.Tensor:
    """(Hk, G, P) per-head scores -> (Hk, P) a score whose top-k is the round-robin union of the heads' rankings."""
    hk, g, p = s_head.shape
    rank = s_head.argsort(-1, descending=True).argsort(-1).float()  # (Hk, G, P) rank of page p in head g
    best = rank.min(1).values  # the best rank any head of the group gives the page
    return -(best + rank.mean(1) / (p + 1))  # ties by the mean rank


def analyse(calls, kv, length: int, needle: tuple[int, int], answer_calls: set[int], rules, budgets, pages,
            dense_layers: int, scores=SCORES) -> dict:
    """Per (rule, page, budget): attention mass kept and the needle pages' ranks (see the module docstring)."""
    out: dict = {}
    memo: dict = {}
    for i, call in enumerate(calls):
        layer = call["layer"]
        if layer < dense_layers:
            continue
        keys, values = kv[layer]
        q = call["q"][:, -1]  # (H, D): the call's last query (the one that decodes the next token)
        h, d = q.shape
        hk = keys.shape[1]
        g = h // hk
        keys_h = keys[0, :, :length].float()  # (Hk, T, D): the haystack's rows
        scale = d ** -0.5
        # the full read's attention of each query head over the haystack rows (the question's rows left out)
        logits = torch.einsum("hgd,htd->hgt", q.view(hk, g, d), keys_h) * scale  # (Hk, G, T)
        att = torch.softmax(logits, dim=-1)
        lo, hi = needle
        on_needle = att[..., lo:hi].sum(-1)  # (Hk, G)
        answering = i in answer_calls
        for page in pages:
            n_pages = (length - RECENT) // page  # candidate pages: the newest RECENT rows are read outright
            per_page = att[..., : n_pages * page].reshape(hk, g, n_pages, page).sum(-1)  # (Hk, G, P)
            tail_mass = att[..., n_pages * page:].sum(-1)
            needle_pages = sorted({t // page for t in range(lo, hi) if t // page < n_pages})
            exact = logits[..., : n_pages * page].reshape(hk, g, n_pages, page).amax(-1)  # (Hk, G, P)
            for score in scores:
                stats = score if score in ("minmax", "pca") else "meanstd"
                if (layer, "basis") not in memo:
                    memo[(layer, "basis")] = principal_axes(keys_h[:, 4:])  # (Hk, D, D), int4's sinks apart
                basis = memo[(layer, "basis")] if stats == "pca" else None
                if (layer, page, stats) not in memo:
                    memo[(layer, page, stats)] = boxes(keys_h if basis is None else keys_h @ basis, page,
                                                       stats)[:, :n_pages]
                box = memo[(layer, page, stats)]
                c, r = box[:, :, 0], box[:, :, 1]
                qg = q.view(hk, g, d) if basis is None else q.view(hk, g, d) @ basis
                s_head = torch.einsum("hgd,hpd->hgp", qg, c)
                if score in ("meanstd", "minmax", "pca"):  # the box bound: Σ_d |q_d| r_d
                    s_head = s_head + torch.einsum("hgd,hpd->hgp", qg.abs(), r)
                elif score.startswith("l2z"):  # a Gaussian estimate of the page's best q·k: z·sqrt(Σ q_d² r_d²)
                    s_head = s_head + float(score[3:]) * torch.einsum("hgd,hpd->hgp", qg * qg, r * r).sqrt()
                for rule in rules:
                    if score not in ("meanstd", "minmax", "pca") and rule not in ("sum", "softmax"):
                        continue
                    if rule == "union":
                        s = union_pages(s_head)
                    elif rule == "sum":
                        s = s_head.sum(1)
                    elif rule == "max":
                        s = s_head.max(1).values
                    elif rule == "softmax":  # log of the group's summed estimated attentions (no underflow ties)
                        s = torch.log_softmax(s_head * scale, -1).logsumexp(1)
                    elif rule == "exact":
                        s = exact.max(1).values
                    elif rule == "oracle":
                        s = per_page.sum(1)
                    else:
                        raise ValueError(rule)
                    if rule in ("exact", "oracle") and score != "meanstd":
                        continue  # independent of the statistics
                    s = s.clone()
                    s[:, 0] = float("inf")  # page 0 holds the sinks
                    order = s.argsort(-1, descending=True)
                    rank = order.argsort(-1)  # (Hk, P) rank of each page
                    for budget in budgets:
                        k = (budget - RECENT) // page
                        chosen = torch.zeros(hk, n_pages, dtype=torch.bool)
                        chosen.scatter_(1, order[:, :k], True)
                        kept = (per_page * chosen[:, None]).sum(-1) + tail_mass  # (Hk, G)
                        key = f"{score if rule not in ('exact', 'oracle') else '-'}|{rule}|{page}|{budget}"
                        cell = out.setdefault(key, {"mass": [], "hit": [], "rank": [], "layers_missed": set()})
                        cell["mass"] += kept.flatten().tolist()
                        if answering and needle_pages:
                            for kh in range(hk):
                                if (on_needle[kh] >= RETRIEVAL).any():
                                    best = min(int(rank[kh, p]) for p in needle_pages)
                                    cell["rank"].append(best)
                                    cell["hit"].append(best < k)
                                    if best >= k:
                                        cell["layers_missed"].add(layer)
    return out


def summary(cells: dict) -> dict:
    def q(xs, f):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(f * len(xs)))] if xs else None

    out = {}
    for key, c in cells.items():
        out[key] = {"mass_mean": sum(c["mass"]) / max(1, len(c["mass"])), "mass_p01": q(c["mass"], 0.01),
                    "mass_p10": q(c["mass"], 0.10), "needle_hits": sum(c["hit"]), "needle_heads": len(c["hit"]),
                    "rank_median": q(c["rank"], 0.5), "rank_p90": q(c["rank"], 0.9),
                    "rank_max": max(c["rank"]) if c["rank"] else None,
                    "layers_missed": sorted(c["layers_missed"])}
    return out


def _commit() -> str:
    import subprocess

    return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()


def write_record(path: Path, studies: list[str], answers: list[str]) -> None:
    """One JSON record: every study question's summaries (per statistics|rule|page|budget) and the end-to-end
    answers of the tuning runs, with the commit."""
    import subprocess

    commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    questions = [json.loads(line) for f in studies for line in Path(f).read_text().splitlines() if line.strip()]
    runs = {}
    for item in answers:
        label, _, f = item.partition("=")
        runs[label] = [{k: r[k] for k in ("seed", "length", "trial", "method", "task", "correct", "answer",
                                          "expected", "depth_measured", "commit", "question") if k in r}
                       for r in map(json.loads, Path(f).read_text().splitlines()) if r]
    rec = {"commit": commit, "model": "Qwen2.5-Coder-0.5B-Instruct (GGUF dequantized, fp32)",
           "protocol": "tuning haystacks (seeds 1 and 2, kept apart from bench_longctx's seed 0): the study scores "
                       "each rule offline against the full read's attention at every step (module docstring); the "
                       "answers are end-to-end greedy answers through sparse caches, question fed token by token",
           "questions": questions, "answers": runs}
    path.write_text(json.dumps(rec, indent=1))
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-dir", required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--lengths", default="16384,32768")
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--tasks", default="passkey,multikey,multivalue,vartrack")
    p.add_argument("--rules", default="sum,max,softmax,union,exact,oracle")
    p.add_argument("--budgets", default="1024,2048,4096")
    p.add_argument("--pages", default="64,32,16")
    p.add_argument("--dense-layers", type=int, default=2)
    p.add_argument("--scores", default=",".join(SCORES), help=f"page summaries, some of {list(SCORES)}")
    p.add_argument("--by-token", action="store_true",
                   help="feed the question one token per call (as bench_longctx --question-by-token): every "
                        "question token is then a decode step, and the needle is checked at every single-token step")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--stem", default="bench_sparse_select")
    p.add_argument("--record", nargs="+", default=None, metavar="JSONL",
                   help="only write the record benchmarks/results/<stem>.json from these study JSONL files and the "
                        "--answers files (bench_longctx JSONL of the tuning haystacks: end-to-end answers per rule)")
    p.add_argument("--answers", nargs="*", default=[], metavar="LABEL=JSONL",
                   help="with --record: end-to-end answers, each file under a label (e.g. old-rule=old.jsonl)")
    args = p.parse_args()
    if args.record:
        write_record(RESULTS / f"{args.stem}.json", args.record, args.answers)
        return
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import kvslim.models
    from kvslim import api
    from kvslim.longctx import filler_units
    from kvslim.longctx import haystack as hs
    from kvslim.longctx.protocol import correct, fill, make_cache_fn
    from kvslim.longctx.tasks import instances

    model, tok = kvslim.models.load_qwen25_coder(torch.float32)
    api.apply(model, "dense")
    units = filler_units("stdlib-docs")
    make = make_cache_fn(model, "dense")
    rules, budgets, pages = args.rules.split(","), [int(x) for x in args.budgets.split(",")], [
        int(x) for x in args.pages.split(",")]
    log = RESULTS / f"{args.stem}.jsonl"
    done = {(r["seed"], r["length"], r["trial"], r["task"]) for r in map(json.loads, log.read_text().splitlines())} \
        if log.is_file() else set()
    for trial in range(args.trials):
        for n in [int(x) for x in args.lengths.split(",")]:
            path = Path(args.kv_dir).expanduser() / f"kv-{args.seed}-{n}-{trial}.pt"
            if not path.is_file():
                print(f"{path}: not prefilled yet, skipped", flush=True)
                continue
            hay = hs.build(tok, instances(args.seed, n, trial, args.tasks.split(",")), n, units,
                           random.Random(f"kvslim-filler:{args.seed}:{n}:{trial}"))
            saved = torch.load(path, weights_only=True)
            assert torch.equal(saved["ids"], hay.ids), path
            kv = saved["kv"]
            for qn in hay.questions:
                if (args.seed, n, trial, qn.task) in done:
                    continue
                calls, text = record_queries(model, tok, fill(make(), kv), qn, args.by_token)
                ok = correct(text, qn.instance)
                n_layers = len(kv)
                first_step = next(i for i, c in enumerate(calls) if c["q"].shape[1] == 1) if any(
                    c["q"].shape[1] == 1 for c in calls) else len(calls)
                answer_calls = set(range(max(0, first_step - n_layers), len(calls)))  # the question's last + steps
                if args.by_token:  # every call is one token: the question's steps and the answer's
                    answer_calls = set(range(len(calls)))
                lo = qn.positions[0]
                needle = (lo, lo + 24)  # the inserted sentence's first rows (a sentence is 15-25 tokens)
                cells = analyse(calls, kv, n, needle, answer_calls, rules, budgets, pages, args.dense_layers,
                                args.scores.split(","))
                rec = {"commit": _commit(), "seed": args.seed, "length": n, "trial": trial, "task": qn.task,
                       "answer": text,
                       "question": "token by token" if args.by_token else "one call",
                       "dense_correct": ok, "depth": qn.depth_measured,
                       "cells": summary(cells)}
                with open(log, "a") as f:
                    f.write(json.dumps(rec) + "\n")
                s = rec["cells"]
                print(f"{n} #{trial} {qn.task}: dense {'ok' if ok else 'WRONG'} {text!r}", flush=True)
                for key in sorted(s):
                    if key.endswith("|2048") and "|64|" in key:
                        v = s[key]
                        print(f"   {key:28s} mass {v['mass_mean']:.3f} p01 {v['mass_p01']:.3f} needle "
                              f"{v['needle_hits']}/{v['needle_heads']} rank med {v['rank_median']} max "
                              f"{v['rank_max']}", flush=True)


if __name__ == "__main__":
    main()
