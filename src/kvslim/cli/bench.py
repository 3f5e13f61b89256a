"""Decode benchmark: kvslim methods against HF DynamicCache and StaticCache in the same run.

``kvslim bench [--models mha-100m,smollm2] [--contexts 1024,4096,8192] [--batches 1,8] [--methods ...]``
At each (model, batch, context) point the methods take turns (``--rounds`` × ``--steps`` steps each, interleaved),
so ratios between methods come from the same stretch of machine time. Writes ``bench_decode.json``, ``bench_decode.png`` and ``bench_decode.md`` under ``--out``.

``kvslim bench --device cuda`` runs the GPU table of issue 26 instead (:mod:`kvslim.bench.cuda`: HF static eager and
compiled, HF dynamic, HF quanto 4-bit, every kvslim method eager and compiled, at the three shapes of the issue;
capacity of the Llama-3-8B shape at 32k): ``bench_gpu.json`` / ``.png`` / ``.md``. ``--quick`` runs that table on
tiny shapes, on any ``--device`` (a CPU test runs it end to end).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..bench.kinds import ALL_KINDS

MODELS = ("mha-100m", "smollm2")


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated positive ints, got {text!r}") from None
    if not values or min(values) <= 0:
        raise ValueError(f"{name} must be comma-separated positive ints, got {text!r}")
    return values


def _names(text: str, allowed: tuple[str, ...], name: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise ValueError(f"{name}: unknown {bad or text!r}; choose from {', '.join(allowed)}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default="mha-100m,smollm2", help=f"comma-separated, from {', '.join(MODELS)}")
    p.add_argument("--contexts", default="1024,4096,8192", help="context lengths (tokens)")
    p.add_argument("--batches", default="1,8", help="batch sizes")
    p.add_argument("--methods", default=",".join(ALL_KINDS), help=f"from {', '.join(ALL_KINDS)}")
    p.add_argument("--option", action="append", default=[], metavar="METHOD.NAME=VALUE",
                   help="an apply() option of one method for every kvslim kind that runs it, e.g. int4.residual=64 "
                        "(repeatable; the CPU table; the spelling of kvslim plan, eval and demo too)")
    from .method_options import add_per_layer_file

    add_per_layer_file(p, "the CPU table (each model of --models is checked against it)")
    p.add_argument("--padded", action="store_true",
                   help="the CPU table: every point of batch > 1 measured twice, as given and left-padded (row r's "
                        "first r·context/(2·batch) tokens padding, an attention mask every step)")
    p.add_argument("--steps", type=int, default=3, help="timed decode steps per method per round")
    p.add_argument("--rounds", type=int, default=3,
                   help="interleaved rounds (A B C A B C ...); the median over rounds × steps is reported")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--out", default="benchmarks/results", help="output folder")
    p.add_argument("--name", default=None, help="base name of the output files (bench_decode; the GPU table: "
                   "bench_gpu, --quick: bench_gpu_quick)")
    p.add_argument("--quick", action="store_true", help="the GPU table on tiny shapes (runs on --device cpu too)")
    p.add_argument("--compile", default=None, choices=("reduce-overhead", "cudagraphs", "default", "eager-backend",
                                                       "none"),
                   help="GPU table: how compiled kinds are compiled (reduce-overhead: CUDA graphs, the default on "
                        "CUDA; eager-backend: dynamo tracing only, the default of --quick on CPU; none)")
    p.add_argument("--no-capacity", action="store_true", help="GPU table: skip the capacity search")
    p.add_argument("--kinds", default=None, help="GPU table: comma-separated kinds (default all: "
                   "hf-static,hf-dynamic,hf-quanto4,kvslim-<method>)")
    p.add_argument("--points", default=None, help="GPU table: comma-separated points (default all: mha-1b (8k x 8), "
                   "llama3.2-1b (8k x 8), llama3-8b (32k x 4); --quick: tiny-mha, tiny-gqa)")
    p.add_argument("--budget", default=None, help="GPU table: seconds; no kind or capacity try starts after them "
                   "(recorded as skipped)")
    p.add_argument("--capacity-kinds", default=None, help="GPU table: kinds of the capacity search (default "
                   "hf-static,kvslim-dense,kvslim-int8,kvslim-int4,kvslim-int2)")


def load_model(name: str, dtype, device: str):
    from ..bench.decode import mha_100m
    from ..models import load_smollm2

    if name == "mha-100m":
        return mha_100m(dtype).to(device)

    return load_smollm2(dtype)[0].to(device)


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.progress import Progress

    from ..bench.decode import measure_group
    from ..bench.report import label, markdown_table, plot, write_json
    from ..bench.roofline import measure_bandwidth
    from ..methods.base import parse_dtype

    if args.device.startswith("cuda") or args.quick:
        if getattr(args, "per_layer_file", None):
            raise ValueError("--per-layer-file: the GPU table (--device cuda, --quick) runs its kinds as they are; "
                             "--per-layer-file sets the CPU table's methods")
        if getattr(args, "padded", False):
            raise ValueError("--padded: the GPU table (--device cuda, --quick) runs its shapes unpadded; --padded "
                             "sets the CPU table's batches")
        if getattr(args, "option", None):
            raise ValueError("--option: the GPU table (--device cuda, --quick) runs its kinds as they are; --option "
                             "sets the CPU table's methods")
        return run_gpu_table(args)
    if args.name is None:
        args.name = "bench_decode"
    models = _names(args.models, MODELS, "--models")
    contexts, batches = _ints(args.contexts, "--contexts"), _ints(args.batches, "--batches")
    kinds = _names(args.methods, ALL_KINDS, "--methods")
    from ..bench.kinds import KVSLIM_KINDS
    from .method_options import parse_method_options

    methods = [m for m in dict.fromkeys(KVSLIM_KINDS[k][0] for k in kinds if k in KVSLIM_KINDS) if m != "dense"]
    options = parse_method_options(getattr(args, "option", None), methods, among="the methods of --methods")
    from .method_options import read_per_layer_file, with_per_layer_file

    calib = read_per_layer_file(getattr(args, "per_layer_file", None), methods, among="the methods of --methods")
    if args.steps <= 0:
        raise ValueError(f"--steps must be a positive int, got {args.steps}")
    if args.rounds <= 0:
        raise ValueError(f"--rounds must be a positive int, got {args.rounds}")
    dtype = parse_dtype(args.dtype, "--dtype")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but torch sees no CUDA device")
    console = Console()
    bandwidth = measure_bandwidth(args.device)
    console.print(f"measured bandwidth: read {bandwidth['read_gbps']:.1f} GB/s, copy {bandwidth['copy_gbps']:.1f} "
                  f"GB/s (roofline {bandwidth['roofline_gbps']:.1f} GB/s), {torch.get_num_threads()} threads")
    records = []
    total = len(models) * len(points(batches, contexts, getattr(args, "padded", False)))
    with Progress(console=console) as progress:
        task = progress.add_task("decode points", total=total)
        for model_name in models:
            model = load_model(model_name, dtype, args.device)
            try:
                model_options = with_per_layer_file(options, calib, model, model_name)
            except ValueError as e:  # e.g. the default --models runs mha-100m too: name the model to leave out
                raise ValueError(f"{e} (--models {model_name}; run the models the file was calibrated for)") from None
            for batch, context, padded in points(batches, contexts, getattr(args, "padded", False)):
                group = measure_group(model, model_name, kinds, batch, context, args.steps, args.rounds,
                                      bandwidth["roofline_gbps"], model_options, padded=padded)
                records += group
                base = next((r for r in group if r["method"] == "kvslim-dense"), None)
                for rec in group:
                    if "skipped" in rec:
                        progress.console.print(f"{model_name:9s} {rec['method']}: not run ({rec['skipped']})")
                        continue
                    vs = f" {rec['tokens_per_s'] / base['tokens_per_s']:5.2f}× dense" if base else ""
                    progress.console.print(
                        f"{model_name:9s} b{batch:<3d} ctx {context:6d} {label(rec):13s} "
                        f"{rec['tokens_per_s']:8.2f} tok/s{vs} {rec['gbps']:6.1f} GB/s "
                        f"({100 * rec['roofline_fraction']:.0f}% roofline)")
                progress.advance(task)
            del model
    out = Path(args.out)
    write_json(out / f"{args.name}.json", records, bandwidth)
    plot(records, out / f"{args.name}.png", bandwidth["roofline_gbps"])
    table = markdown_table(records)
    (out / f"{args.name}.md").write_text(table + "\n")
    console.print(table)
    return 0


def points(batches: list[int], contexts: list[int], padded: bool) -> list[tuple[int, int, bool]]:
    """(batch, context, left-padded) of the CPU table, in order: with ``--padded`` each point of batch > 1 twice,
    as given and left-padded (a batch of one has no padding to add)."""
    return [(b, c, p) for b in batches for c in contexts for p in ((False, True) if padded and b > 1 else (False,))]


def positive_seconds(text, name: str) -> float:
    """``text`` as a positive, finite number of seconds; ``ValueError`` naming ``name`` otherwise."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{name} must be a positive number of seconds, got {text!r}")
    return value


def gpu_settings(args: argparse.Namespace):
    """The :class:`kvslim.bench.cuda.Settings` the flags ask for (``ValueError`` naming a bad flag)."""
    import time

    from ..bench import cuda

    compile_mode = args.compile or ("reduce-overhead" if args.device.startswith("cuda") else "eager-backend")
    kinds = tuple(cuda.Settings().kinds if args.kinds is None else _names(args.kinds, cuda.Settings().kinds,
                                                                            "--kinds"))
    if args.steps <= 0 or args.rounds <= 0:
        raise ValueError(f"--steps and --rounds must be positive ints, got {args.steps}, {args.rounds}")
    table = cuda.QUICK_POINTS if args.quick else cuda.POINTS
    points = None
    if getattr(args, "points", None) is not None:
        names = _names(args.points, tuple(p[0] for p in table), "--points")
        points = tuple(p for p in table if p[0] in names)
    budget = getattr(args, "budget", None)
    deadline = None if budget is None else time.monotonic() + positive_seconds(budget, "--budget")
    cap_kinds = cuda.CAPACITY_KINDS
    if getattr(args, "capacity_kinds", None) is not None:
        cap_kinds = tuple(_names(args.capacity_kinds, cuda.Settings().kinds, "--capacity-kinds"))
    return cuda.Settings(device=args.device, quick=args.quick, steps=args.steps, rounds=args.rounds,
                         compile_mode=None if compile_mode == "none" else compile_mode,
                         capacity=not args.no_capacity, kinds=kinds, points=points, deadline=deadline,
                         capacity_kinds=cap_kinds, **({"max_batch": 16, "cpu_budget": 256 << 10} if args.quick else {}))


def run_gpu_table(args: argparse.Namespace) -> int:
    """``kvslim bench --device cuda`` / ``--quick``: the table of :mod:`kvslim.bench.cuda`, JSON + PNG + Markdown."""
    from rich.console import Console

    from ..bench import cuda
    from ..bench.report import write_json

    settings = gpu_settings(args)
    console = Console()
    doc = cuda.run(settings, progress=console.print)
    name = args.name or ("bench_gpu_quick" if args.quick else "bench_gpu")
    out = Path(args.out)
    write_json(out / f"{name}.json", doc.pop("records"), doc.pop("bandwidth"), extra=doc)
    import json

    full = json.loads((out / f"{name}.json").read_text())
    cuda.plot(full, out / f"{name}.png")
    table = cuda.markdown(full)
    (out / f"{name}.md").write_text(table + "\n")
    console.print(table)
    return 0
