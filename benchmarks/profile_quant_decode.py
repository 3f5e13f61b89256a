"""Where a decode step's time goes: torch.profiler self-CPU per op for one step of kvslim dense / int8 / int4.

``python benchmarks/profile_quant_decode.py [--model mha-100m|smollm2] [--context 8192] [--batch 8] [--threads 2]``
prints, per cache kind, the step time, the top ops by self CPU time and a split of the step into parts:
the fused attention op (``kvslim::quant_decode``), dense attention (SDPA), the cache write (``kvslim::quant_write``
and other cache ops), the linear layers (matmuls: projections, MLP, LM head), and the rest (norms, RoPE, Python glue:
the step's wall time minus every op's self time). Self times sum over the step's threads only when one thread runs.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvslim import api
from kvslim.bench.decode import make_filled_cache, time_decode
from kvslim.cli.bench import load_model

PARTS = {  # part -> op names whose self time it gets (first match wins)
    "fused attention op": ("kvslim::quant_decode", "kvslim::slim", "kvslim::shared"),
    "dense attention (SDPA)": ("aten::_scaled_dot_product", "aten::scaled_dot_product"),
    "cache write": ("kvslim::quant_write", "aten::copy_", "aten::index_copy", "aten::slice_scatter"),
    "linear (matmul)": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"),
}


def split(prof, wall_us: float) -> dict[str, float]:
    """Self-CPU microseconds per part; ``other ops`` the rest of the ops, ``python/untraced`` wall − all ops."""
    out = {k: 0.0 for k in PARTS} | {"other ops": 0.0}
    for ev in prof.key_averages():
        part = next((p for p, names in PARTS.items() if any(ev.key.startswith(n) for n in names)), "other ops")
        out[part] += ev.self_cpu_time_total
    out["python/untraced"] = max(0.0, wall_us - sum(out.values()))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="mha-100m", choices=("mha-100m", "smollm2"))
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kinds", default="kvslim-dense,kvslim-int8,kvslim-int4")
    p.add_argument("--rows", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, torch.float32, "cpu")
    for kind in args.kinds.split(","):
        cache = make_filled_cache(model, kind, args.batch, args.context, 4)
        time_decode(model, cache, args.batch, args.context, 1)  # warm-up step (not profiled)
        plain = time_decode(model, cache, args.batch, args.context + 2, 1, warmup=0)[0]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            time_decode(model, cache, args.batch, args.context + 3, 1, warmup=0)
            wall = time.perf_counter() - t0
        api.restore(model)
        print(f"\n== {args.model} {kind}: {args.context} x {args.batch}, {args.threads} thread(s): step "
              f"{plain * 1e3:.0f} ms unprofiled, {wall * 1e3:.0f} ms profiled")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
        for part, us in split(prof, wall * 1e6).items():
            print(f"  {part:24s} {us / 1e3:8.1f} ms  {100 * us / (wall * 1e6):5.1f} %")
        del cache


if __name__ == "__main__":
    main()
