"""One prepared command for a lent GPU (issue 33): ``bash scripts/gpu_check.sh [--budget 450]``.

A lent GPU comes with about 15 minutes of device time in all, 1-2 of which start the machine. This
command turns one call of at most ~8 minutes into the figures that matter, most important first:

1. ``correctness``: the Triton kernel tests with ``TRITON_INTERPRET=0``, the sync-debug-mode test and the CUDA-graph
   token test (pytest, in parallel subprocesses), and greedy tokens against HF for every method on a tiny model in
   fp32 and bf16 (in this process);
2. ``mha-1b``: the 1B MHA point at 8k x 8: HF static and kvslim dense / int8 / int4 / int2 / slim, eager and under CUDA
   graphs (:mod:`kvslim.bench.cuda`): step ms, bytes read per step against the copy rate of the same run, graphs
   compiled per kind;
3. ``llama3-8b``: the Llama-3-8B shape at 32k x 4: HF static, kvslim dense / int4 / int2 eager; int4's capacity
   (largest batch) against dense's;
4. ``encdec-mla``: slim on a Whisper-large-v3-shaped decoder at batch 64 vs HF; MLA on the V2-Lite shape at 32k x 1
   vs HF (:mod:`kvslim.bench.gpucheck_models`);
5. ``variants``: with the time left, a sweep of the int4 and int2 decode kernels at point 2 (operand precision of
   their ``tl.dot``: fp32 ``ieee`` / ``tf32x3`` / bf16 operands first, then block sizes and splits; each variant's
   error against float64 beside its time).

Each stage writes ``gpu_check_<stage>.json`` and ``.md`` under every output folder (``$OUT`` when set, and
``benchmarks/results/gpu/``) as soon as it finishes, and the index ``gpu_check.json`` / ``.md`` (all stages so far and
the targets of the earlier GPU issues read off them, :mod:`kvslim.bench.gpucheck_targets`). A stage is not started
when its estimate (:data:`ESTIMATE_S`) exceeds the time left of ``--budget``; a stage that raises (an exception, an
out-of-memory) is recorded with its error and the next stage runs. ``--quick`` runs every stage's code path on tiny
shapes (any device: a CPU test).

Needs only what the GPU machine has: torch, transformers, triton (and pytest for stage 1's tests; without it those
are recorded as not run). Nothing here imports rich, matplotlib, scipy or hypothesis.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from .hostinfo import host

STAGES = ("correctness", "mha-1b", "llama3-8b", "encdec-mla", "variants", "sparse")
#: seconds per stage on an H100 with cold caches (compiles included): the arithmetic is in docs/gpu.md §gpu_check
ESTIMATE_S = {"correctness": 170, "mha-1b": 150, "llama3-8b": 120, "encdec-mla": 90, "variants": 30, "sparse": 240}
#: ``--quick`` (tiny shapes, CPU)
QUICK_ESTIMATE_S = {"correctness": 40, "mha-1b": 20, "llama3-8b": 15, "encdec-mla": 15, "variants": 10,
                    "sparse": 20}
DEFAULT_BUDGET = 450.0
ROOT = Path(__file__).resolve().parents[3]  # the checkout: src/kvslim/bench/gpucheck.py


@dataclass
class Context:
    """What a stage gets: where to run, how small, and the deadline (``time.monotonic``) of the whole check."""

    device: str
    quick: bool
    deadline: float
    progress: object = print
    all_kinds: bool = False  # with quick: every pytest group, every kind compiled in the full check's mode
    results: dict = field(default_factory=dict)  # earlier stages' records, by stage name

    def left(self) -> float:
        return self.deadline - time.monotonic()


def parse_stages(text: str | None) -> tuple[str, ...]:
    if text is None:
        return STAGES
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in names if v not in STAGES]
    if bad or not names:
        raise ValueError(f"--stages: unknown {bad or text!r}; choose from {', '.join(STAGES)}")
    return tuple(s for s in STAGES if s in names)


def _error(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:400] if text else ''}"


def _cleanup(device: str) -> None:
    import torch

    gc.collect()
    try:
        torch._dynamo.reset()
    except Exception:  # noqa: BLE001 - a failed reset must not hide the stage's own record
        pass
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.empty_cache()


def cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and of its finished children (stage 1's pytest runs)."""
    import resource

    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + kids.ru_utime + kids.ru_stime


def run_stage(name: str, ctx: Context) -> dict:
    """Run one stage; its record (``status``: ok / failed / error, ``seconds``, ``cpu_s``: CPU seconds of this
    process and its children, the stage's own fields)."""
    from . import gpucheck_stages

    t0, c0 = time.monotonic(), cpu_seconds()
    try:
        rec = getattr(gpucheck_stages, "stage_" + name.replace("-", "_"))(ctx)
        rec.setdefault("status", "ok")
    except Exception as e:  # noqa: BLE001 - a failing stage is a record; the next stage still runs
        import torch

        rec = {"status": "error", "error": _error(e), "where": traceback.format_exc()[-2000:],
               "out_of_memory": isinstance(e, torch.OutOfMemoryError)}
    finally:
        _cleanup(ctx.device)
    return {"stage": name, **rec, "seconds": time.monotonic() - t0, "cpu_s": cpu_seconds() - c0}


def environment(device: str) -> dict:
    import platform

    import torch
    import transformers

    from .report import environment as base

    env = base()
    # a copied checkout may have no .git: the caller names the commit (docs/gpu.md: KVSLIM_COMMIT=... bash ...)
    env["commit"] = os.environ.get("KVSLIM_COMMIT") or env.get("commit") or None
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        env["triton"] = f"not importable ({_error(e)})"
    env["device"] = device
    env["python"] = platform.python_version()
    if device.startswith("cuda") and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpu_memory_bytes=p.total_memory, sms=p.multi_processor_count,
                   capability=f"{p.major}.{p.minor}", cuda_runtime=torch.version.cuda)
        try:
            env["gpu_free_bytes"] = torch.cuda.mem_get_info(0)[0]
            env["cuda_driver_api"] = torch._C._cuda_getDriverVersion()  # e.g. 13000 for CUDA 13.0
        except Exception as e:  # noqa: BLE001 - a missing figure must not stop the check
            env["gpu_free_bytes"] = f"unknown ({_error(e)})"
    env["transformers"] = transformers.__version__
    env["host"] = host()  # CPU model and flags (amx_*, avx512*), cores, host memory; nvidia-smi's driver
    return env


def write(out_dirs: list[Path], doc: dict, stage: dict | None) -> None:
    """The stage's JSON + Markdown (when ``stage``) and the index, in every folder."""
    from .gpucheck_report import index_markdown, stage_markdown

    for out in out_dirs:
        out.mkdir(parents=True, exist_ok=True)
        if stage is not None:
            (out / f"gpu_check_{stage['stage']}.json").write_text(json.dumps(stage, indent=1, default=str))
            (out / f"gpu_check_{stage['stage']}.md").write_text(stage_markdown(stage) + "\n")
        (out / "gpu_check.json").write_text(json.dumps(doc, indent=1, default=str))
        (out / "gpu_check.md").write_text(index_markdown(doc) + "\n")


def run(stages: tuple[str, ...] = STAGES, budget: float = DEFAULT_BUDGET, quick: bool = False, device: str = "cuda",
        out_dirs: list[Path] | None = None, progress=print, all_kinds: bool = False) -> dict:
    """Run ``stages`` in order within ``budget`` seconds; the index document (also written after every stage).
    ``all_kinds`` (with ``quick``): the replica's CPU mode (scripts/gpu_env.sh): every stage-1 pytest group and every
    stage-2 kind compiled in the full check's compile mode."""
    import torch

    start = time.monotonic()

    threads = torch.get_num_threads()
    if quick and device == "cpu":  # tiny shapes: one intra-op thread (two spin against each other on 2 shared cores)
        torch.set_num_threads(1)
    try:
        return _run(stages, budget, quick, device, out_dirs, progress, start, all_kinds)
    finally:
        torch.set_num_threads(threads)


def _run(stages, budget, quick, device, out_dirs, progress, start, all_kinds=False) -> dict:
    from .gpucheck_targets import targets

    ctx = Context(device=device, quick=quick, deadline=start + budget, progress=progress, all_kinds=all_kinds)
    estimates = QUICK_ESTIMATE_S if quick else ESTIMATE_S
    out_dirs = out_dirs or []
    # the environment first, before any stage (issue 42): what ran, on what host, even if a stage then hangs
    doc = {"command": "scripts/gpu_check.sh " + " ".join(sys.argv[1:]), "budget_s": budget, "quick": quick,
           "all_kinds": all_kinds, "environment": environment(device), "stages": [], "targets": []}
    write(out_dirs, doc, None)
    for name in stages:
        left = ctx.left()
        if estimates[name] > left:
            rec = {"stage": name, "status": "skipped", "estimate_s": estimates[name],
                   "reason": f"budget: {max(0.0, left):.0f} s left of {budget:.0f} s, the stage is estimated at "
                             f"{estimates[name]} s"}
        else:
            progress(f"== stage {name} (estimate {estimates[name]} s, {left:.0f} s left)")
            rec = {**run_stage(name, ctx), "estimate_s": estimates[name]}
        ctx.results[name] = rec
        doc["stages"].append(rec)
        doc["elapsed_s"] = time.monotonic() - start
        doc["cpu_s"] = cpu_seconds()  # since the process started (imports included)
        doc["targets"] = targets(ctx.results)
        write(out_dirs, doc, rec)
        progress(f"== stage {name}: {rec['status']} {rec.get('error') or rec.get('reason') or ''} "
                 f"({rec.get('seconds', 0):.0f} s)")
    return doc


def default_out_dirs(out: str | None, quick: bool) -> list[Path]:
    """``--out``, ``$OUT`` (the device machine's folder that comes back) and, for a real run,
    ``benchmarks/results/gpu/`` of the checkout (``--quick`` writes there only when asked with ``--out``)."""
    dirs = [Path(out)] if out else []
    if os.environ.get("OUT"):
        dirs.append(Path(os.environ["OUT"]))
    if not quick:
        dirs.append(ROOT / "benchmarks" / "results" / "gpu")
    return list(dict.fromkeys(d.resolve() for d in dirs))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__.splitlines()[0])
    p.add_argument("--budget", default=str(DEFAULT_BUDGET), help="seconds: no stage starts whose estimate exceeds "
                   f"the time left (default {DEFAULT_BUDGET:.0f})")
    p.add_argument("--stages", default=None, help=f"comma-separated, from {', '.join(STAGES)} (default all, in order)")
    p.add_argument("--quick", action="store_true", help="tiny shapes: every stage's code path (runs on CPU)")
    p.add_argument("--all-kinds", action="store_true", help="with --quick: every stage-1 pytest group and every "
                   "stage-2 kind compiled in the full check's compile mode (the replica's CPU mode, gpu_env.sh)")
    p.add_argument("--device", default=None, help="cuda (default when torch sees one) or cpu (with --quick)")
    p.add_argument("--out", default=None, help="another output folder (beside $OUT and benchmarks/results/gpu/)")
    args = p.parse_args(argv)
    if args.all_kinds and not args.quick:
        raise ValueError("--all-kinds runs only with --quick (the full check runs every kind already)")
    if args.quick and args.device == "cpu" and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # stage 5's one tiny Triton variant runs interpreted (CPU)
    from ..cli.bench import positive_seconds

    budget = positive_seconds(args.budget, "--budget")
    stages = parse_stages(args.stages)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"--device must be cuda or cpu, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but torch sees no CUDA device")
    if device == "cpu" and not args.quick:
        raise ValueError("--device cpu runs only with --quick (the full shapes need a GPU)")
    doc = run(stages, budget, args.quick, device, default_out_dirs(args.out, args.quick),
              progress=lambda m: print(m, flush=True), all_kinds=args.all_kinds)
    from .gpucheck_report import index_markdown

    print(index_markdown(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
