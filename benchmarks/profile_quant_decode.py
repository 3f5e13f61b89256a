"""Where a decode step's time goes: torch.profiler self-CPU per op for one step of kvslim dense / int8 / int4.

``python benchmarks/profile_quant_decode.py [--context 2048] [--batch 8] [--threads 1]`` on the ~100M MHA Llama of
``kvslim bench``; prints the top ops per cache kind (the fused kernel shows as ``kvslim::quant_decode``).
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import profile

from kvslim import api
from kvslim.bench.decode import make_filled_cache, mha_100m, time_decode


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = mha_100m()
    for kind in ("kvslim-dense", "kvslim-int8", "kvslim-int4"):
        cache = make_filled_cache(model, kind, args.batch, args.context, 4)
        time_decode(model, cache, args.batch, args.context, 1)  # warm-up step (not profiled)
        with profile() as prof:
            step = time_decode(model, cache, args.batch, args.context + 2, 1, warmup=0)[0]
        api.restore(model)
        print(f"\n== {kind}: {args.context} x {args.batch}, {args.threads} thread(s), step {step * 1e3:.0f} ms")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=6))
        del cache


if __name__ == "__main__":
    main()
