"""The retrieval protocol (issue 34): one prefill per haystack fills every cache; each question is then decoded
through the cache, so every generated token reads the compressed history.

Per haystack (one ``(length, trial)``):

1. one prefill of the haystack through a dense ``DynamicCache``, in one call (SDPA's causal kernel: no
   ``length × length`` score matrix is stored); its per-layer keys and values are kept;
2. for each cache and each question: a fresh cache is filled with those keys and values through the cache's own
   ``update`` (:func:`fill`), the one call a real one-call prefill makes; the cache's own storage then codes them.
   A real prefill hands every layer these same tensors (each call attends to its own keys and values in full
   precision, kvslim and HF ``QuantizedCache`` alike), so the filled cache equals a real prefill through it
   (``tests/test_longctx.py`` checks codes and answers token for token on a tiny model);
3. the question is fed in one call (it reads the compressed haystack), then the answer is decoded greedily token
   by token (:func:`answer`) until it is settled: every expected item found (correct), an item that is not
   expected (wrong), the end of the turn or ``max_new`` tokens (twice the expected answer's tokens + 16).

Results are appended to a JSONL file, one line per ``(length, trial, method, task)``, after each cache's
questions: :func:`run` skips the lines already there, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..adapters.compat import CACHE_KW
from ..evaluate import cache_nbytes
from . import haystack as hs
from .tasks import TASKS, Instance, check_tasks, instances


@torch.inference_mode()
def prefill_kv(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (keys, values) of a one-call prefill of ``ids`` (1, T) through HF's ``DynamicCache``."""
    from transformers import DynamicCache

    cache = DynamicCache()
    model(ids, use_cache=True, **{CACHE_KW: cache}, logits_to_keep=1)
    return [(layer.keys, layer.values) for layer in cache.layers]


@torch.inference_mode()
def fill(cache, kv: list[tuple[torch.Tensor, torch.Tensor]]):
    """``cache`` after one ``update`` per layer with the prefill's keys and values (what a one-call prefill
    through it writes). Returns the cache."""
    for i, (k, v) in enumerate(kv):
        cache.update(k, v, i)
    return cache


def make_cache_fn(model, method: str, **options) -> Callable[[], object]:
    """A function building an empty cache: a kvslim method's ``KVSlimCache`` (``apply()`` options) as
    ``kvslim.make_cache`` builds it (decode steps read the codes through the fused ops when ``model`` runs kvslim's
    attention and the ops are built), or
    ``method="quanto"`` with ``nbits``: HF ``QuantizedCache`` (quanto, groups of 64, a 128-token residual)."""
    if method == "quanto":
        from transformers import QuantizedCache

        from ..optional import quanto_missing

        if quanto_missing():
            raise ValueError(f"method='quanto': HF's QuantizedCache cannot run here: {quanto_missing()}")

        nbits = options["nbits"]
        return lambda: QuantizedCache("quanto", model.config, nbits=nbits, q_group_size=64, residual_length=128)
    from ..adapters.generate import build_cache
    from ..methods import METHODS

    plan = METHODS[method].plan_model(model, **options)
    return lambda: build_cache(model, plan, None)  # what kvslim.make_cache builds: fused decode where it applies


def settled(text: str, inst: Instance) -> bool | None:
    """Whether the answer so far is settled: ``True`` once every expected item appears complete, ``False`` at the
    first complete item that is not expected, ``None`` while undecided. An item is complete when a character that
    cannot extend it follows it."""
    found = [m for m in re.finditer(inst.pattern, text) if m.end() < len(text)]
    items = {m.group() for m in found}
    if items - set(inst.expected):
        return False
    return True if items == set(inst.expected) else None


def correct(text: str, inst: Instance) -> bool:
    """Exact match: the items in the whole answer are exactly the expected ones (any order)."""
    return set(re.findall(inst.pattern, text)) == set(inst.expected)


@torch.inference_mode()
def answer(model, tokenizer, cache, question: hs.Question, max_new: int | None = None,
           by_token: bool = False) -> tuple[str, int]:
    """Greedy answer to ``question`` through ``cache`` (filled with the haystack): the question in one call (or,
    ``by_token``, one token per call: every question token's attention is then a decode step, sparse where the
    cache decodes sparsely), then one token per call until :func:`settled` decides, the turn ends (EOS) or
    ``max_new`` tokens. Returns (answer text, tokens generated)."""
    inst = question.instance
    if max_new is None:  # twice the items and their separators, and 16 more: room for a list or a sentence
        max_new = 2 * len(tokenizer(", ".join(inst.expected), add_special_tokens=False).input_ids) + 16
    stops = {t for t in (tokenizer.eos_token_id, getattr(tokenizer, "pad_token_id", None)) if t is not None}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
    if im_end is not None:
        stops.add(im_end)
    if by_token:
        for i in range(question.ids.shape[1]):
            logits = model(question.ids[:, i:i + 1], use_cache=True, **{CACHE_KW: cache}, logits_to_keep=1).logits[0, -1]
    else:
        logits = model(question.ids, use_cache=True, **{CACHE_KW: cache}, logits_to_keep=1).logits[0, -1]
    out: list[int] = []
    text = ""
    for _ in range(max_new):
        tok = int(logits.argmax())
        if tok in stops:
            break
        out.append(tok)
        text = tokenizer.decode(out, skip_special_tokens=True)
        if settled(text, inst) is not None:
            break
        logits = model(torch.tensor([[tok]]), use_cache=True, **{CACHE_KW: cache}, logits_to_keep=1).logits[0, -1]
    return text, len(out)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a proportion ``k / n`` (95 % for z = 1.96); (0, 1) when ``n`` is 0."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def read_jsonl(path: Path) -> list[dict]:
    """The records of a results file (an unfinished last line, from a run killed mid-write, is skipped)."""
    if not Path(path).is_file():
        return []
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _key(r: dict) -> tuple:
    """A record's cell: (seed, length, trial, method, task); records written before the seed was kept are seed 0."""
    return r.get("seed", 0), r["length"], r["trial"], r["method"], r["task"]


def run(model, tokenizer, caches: dict[str, Callable[[], object]], *, lengths, trials: int, seed: int = 0,
        tasks=TASKS, units: list[str], out: Path | None = None, meta: dict | None = None,
        progress: bool = True, max_new: int | None = None, first_trial: int = 0,
        kv_dir: Path | None = None, keep_kv: bool = False, by_token: bool = False) -> list[dict]:
    """Every ``(length, trial)`` haystack, every cache of ``caches`` (label -> builds an empty cache) and every task:
    one JSONL line each, appended to ``out`` after each cache's questions; lines already in ``out`` are skipped
    (a haystack whose lines are all there is not even built). Returns all records (old and new).
    ``max_new`` caps each answer (default: :func:`answer`'s). Trials run from ``first_trial`` to ``trials − 1``
    (a second process can take later trials into its own file).

    ``meta`` (e.g. model, filler, commit) is copied into every new record. ``kv_dir``: each haystack's prefill is
    saved there until all its cells are written, so a run killed mid-haystack does not prefill it again (and kept
    after them with ``keep_kv``). ``by_token``: the question is fed one token per call (:func:`answer`)."""
    tasks = check_tasks(tasks)
    records = read_jsonl(out) if out is not None else []
    if out is not None and Path(out).is_file() and not Path(out).read_bytes().endswith(b"\n"):
        with open(out, "a") as f:  # a line cut by a killed run: the next records start on their own line
            f.write("\n")
    done = {_key(r) for r in records}
    todo = [(n, t) for t in range(first_trial, trials) for n in lengths  # trial-major: a cut run has every length
            if any((seed, n, t, m, inst.task) not in done for m in caches for inst in instances(seed, n, t, tasks))]
    bar = _bar(len(todo) * len(caches), progress)
    for length, trial in todo:
        insts = instances(seed, length, trial, tasks)
        hay = hs.build(tokenizer, insts, length, units, random.Random(f"kvslim-filler:{seed}:{length}:{trial}"))
        kv, prefill_s, saved = _prefill_saved(model, hay.ids, kv_dir, f"{seed}-{length}-{trial}")
        for label, make in caches.items():
            if all((seed, length, trial, label, q.task) in done for q in hay.questions):
                bar.update(1)
                continue
            lines = []
            for q in hay.questions:
                if (seed, length, trial, label, q.task) in done:
                    continue
                t1 = time.perf_counter()
                cache = fill(make(), kv)
                nbytes = cache_nbytes(cache)
                text, new = answer(model, tokenizer, cache, q, max_new, by_token)
                lines.append({**(meta or {}), "length": length, "trial": trial, "seed": seed, "method": label,
                              "task": q.task, "depth": q.instance.depth, "depth_measured": q.depth_measured,
                              "positions": list(q.positions), "expected": list(q.instance.expected),
                              "answer": text, "correct": correct(text, q.instance), "new_tokens": new,
                              "bytes_per_token": nbytes / length, "prefill_seconds": prefill_s,
                              "seconds": time.perf_counter() - t1})
            if out is not None:
                with open(out, "a") as f:  # one write: processes running other lengths may append beside
                    f.write("".join(json.dumps(line) + "\n" for line in lines))
            records += lines
            bar.set_postfix_str(f"{length} #{trial} {label}: {sum(x['correct'] for x in lines)}/{len(lines)}")
            bar.update(1)
        del kv
        if saved is not None and not keep_kv:
            saved.unlink(missing_ok=True)
    bar.close()
    return records


def _prefill_saved(model, ids: torch.Tensor, kv_dir: Path | None, name: str):
    """(per-layer keys and values, prefill seconds, the file they are saved in or None): read back from
    ``kv_dir`` when an earlier run saved this haystack's prefill (same ids), else prefilled (and saved)."""
    path = None if kv_dir is None else Path(kv_dir) / f"kv-{name}.pt"
    if path is not None and path.is_file():
        try:
            saved = torch.load(path, weights_only=True)
            if torch.equal(saved["ids"], ids):
                return saved["kv"], saved["seconds"], path
        except Exception:  # noqa: BLE001 - a file cut by a killed run: prefill again
            pass
    t0 = time.perf_counter()
    kv = prefill_kv(model, ids)
    seconds = time.perf_counter() - t0
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"ids": ids, "kv": kv, "seconds": seconds}, tmp)
        tmp.replace(path)
    return kv, seconds, path


def summarize(records: list[dict]) -> list[dict]:
    """Accuracy per (method, length, task) and per (method, length) over all tasks (``task`` = "all"): correct
    count, trials, the Wilson 95 % interval and the mean bytes per token."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["method"], r["length"], r["task"]), []).append(r)
        groups.setdefault((r["method"], r["length"], "all"), []).append(r)
    out = []
    for (method, length, task), rs in groups.items():
        k, n = sum(bool(r["correct"]) for r in rs), len(rs)
        lo, hi = wilson(k, n)
        out.append({"method": method, "length": length, "task": task, "correct": k, "n": n, "accuracy": k / n,
                    "wilson95": [lo, hi], "bytes_per_token": sum(r["bytes_per_token"] for r in rs) / n})
    return out


class _Quiet:
    def update(self, n=1):
        pass

    def set_postfix_str(self, s):
        pass

    def close(self):
        pass


def _bar(total: int, progress: bool):
    if not progress:
        return _Quiet()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="longctx cells", unit="cache", dynamic_ncols=True)
