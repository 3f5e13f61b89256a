"""Where the shared-rows ops spend their time: arithmetic rate in cache against streaming from memory.

The slim option 2 op (``kvslim::slim_decode``, ~100M MHA Llama layer: 12 heads of 64, c = 768, RoPE raw) and the
Whisper cross-attention op (``kvslim::encdec_decode_mapped``: 6 heads, d = 384) run over

- one sequence whose rows stay in L3 between calls (``cache``: slim 1k × 1, 3 MiB; Whisper batch 1, 1500 frames,
  2.25 MiB — the batch-1 targets' shapes), and
- the batched decode shapes of the targets (``stream``: slim 8k × 8, 192 MiB; Whisper batch 64, 141 MiB: the
  rows come from DRAM on every call),

at 1 and 2 threads. Reported per configuration: median wall ms per call, process CPU ms per call (all threads,
spin-waits included), GFLOP/s per wall second and per CPU second (the op's useful arithmetic: scores + the
``softmax · rows`` product), and the rows' bytes per wall second. On a shared machine the per-CPU-second rate is
the figure to compare (it does not count time the thread was descheduled); the wall figures say how the op
scales to 2 threads only on a quiet machine.

    .venv/bin/python benchmarks/profile_shared_rows.py                  # all cases, 1 and 2 threads
    .venv/bin/python benchmarks/profile_shared_rows.py --cases slim-stream --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from kvslim.kernels import encdec_decode, slim_decode


def _slim(batch: int, n: int, h: int = 12, dk: int = 64) -> tuple[Callable[[], object], float, float]:
    g = torch.Generator().manual_seed(0)
    c = h * dk
    q, rows = torch.randn(batch, h, dk, generator=g), torch.randn(batch, n, c, generator=g)
    ang = torch.rand(1, n, dk // 2, generator=g) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    flops = 2.0 * batch * n * (h * dk + h * c)  # scores + u = p · rows

    def call():
        return torch.ops.kvslim.slim_decode(q, rows, cos, sin, None, None, dk ** -0.5, False, 0)

    return call, flops, rows.numel() * 4.0


def _encdec(batch: int, n: int, h: int = 6, d: int = 384, dk: int = 64) -> tuple[Callable[[], object], float, float]:
    g = torch.Generator().manual_seed(0)
    q, enc = torch.randn(batch, h, dk, generator=g), torch.randn(batch, n, d, generator=g)
    w_k, w_v = torch.randn(h, dk, d, generator=g) * 0.05, torch.randn(h, dk, d, generator=g)
    flops = 2.0 * batch * n * 2 * h * d  # scores + u = p · E (the per-head maps are extra, small)

    def call():
        return torch.ops.kvslim.encdec_decode_mapped(q, enc, w_k, w_v, None, None, None, 1.0, False, 0)

    return call, flops, enc.numel() * 4.0


CASES = {
    "slim-cache": lambda: _slim(1, 1024),        # 3 MiB of rows
    "slim-stream": lambda: _slim(8, 8192),       # 192 MiB
    "encdec-cache": lambda: _encdec(1, 1500),    # 2.25 MiB
    "encdec-stream": lambda: _encdec(64, 1500),  # 141 MiB
}


def measure(call: Callable[[], object], reps: int) -> tuple[float, float]:
    """Median wall and process-CPU seconds of ``reps`` calls (two warm-up calls first)."""
    call(), call()
    wall, cpu = [], []
    for _ in range(reps):
        c0, t0 = time.process_time(), time.perf_counter()
        call()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--reps", type=int, default=9)
    a = p.parse_args()
    if not (slim_decode.available() and encdec_decode.available()):
        raise SystemExit("the C++ ops are not built here (no compiler?): nothing to profile")
    print(f"op ISA: {slim_decode.isa()}")
    print(f"{'case':14s} {'thr':>3s} {'wall ms':>9s} {'cpu ms':>9s} {'GFLOP/s':>8s} {'/cpu-s':>7s} {'GB/s':>6s}")
    for name in a.cases:
        call, flops, nbytes = CASES[name]()
        reps = a.reps if flops > 1e9 else a.reps * 20
        for th in a.threads:
            torch.set_num_threads(th)
            wall, cpu = measure(call, reps)
            print(f"{name:14s} {th:3d} {wall * 1e3:9.3f} {cpu * 1e3:9.3f} {flops / wall / 1e9:8.1f} "
                  f"{flops / max(cpu, 1e-9) / 1e9:7.1f} {nbytes / wall / 1e9:6.2f}", flush=True)


if __name__ == "__main__":
    main()
