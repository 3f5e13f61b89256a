"""The fused int8/int4 decode op alone against torch's SDPA over the dense fp32 cache, one layer, at the cache
formats the methods use (``int8``: symmetric g64 fp32 scales + 1 fp token; ``int4``: asymmetric, KIVI keys over 32
tokens, values g64, fp16 parameters, a 100-token fp32 window), each with both score paths (``/exact``: fp32,
``/int8``: int8-rounded query, integer products; ``int4/int8+v8`` adds the integer value path).

``python benchmarks/bench_quant_op.py [--shapes 8x12x1x64x8192,8x3x3x64x8192] [--rounds 9] [--threads 1]``
(B × KV heads × query heads per KV head × head dim × context). Interleaved rounds (dense, int8, int4, ...),
medians, ratios to dense from the same run. With one thread the time is the thread's CPU time
(``time.thread_time``), which a shared, loaded machine does not inflate by descheduling; with more, wall time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvslim.caches.residual import ChannelQuantizedStore
from kvslim.caches.storage import StoreSpec
from kvslim.kernels import quant_decode as kernel
from kvslim.ops.quant import quantize
from kvslim.ops.quant_formats import quantize_asym


def calls(b: int, hk: int, g: int, d: int, n: int) -> dict:
    """name -> zero-argument call for one shape (dense SDPA, int8 op, int4 op)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(b, hk, n, d, generator=gen)
    q = torch.randn(b, hk, g, d, generator=gen)
    dk, dv, sc = x, x.clone(), d ** -0.5
    c8, s8 = quantize(x, 8, 64, torch.float32)
    t1 = torch.randn(b, hk, 1, d, generator=gen)
    spec = StoreSpec(4, 64, torch.float16, asymmetric=True, channel_group=32, residual=128, flush=32)
    ks = ChannelQuantizedStore(spec, b, hk, n, d, torch.float32, torch.device("cpu"))
    ks.write(0, x)
    vc, vs, vz = quantize_asym(x, 4, 64, torch.float16)
    t4 = torch.randn(b, hk, 100, d, generator=gen)
    out = {"dense": lambda: torch.nn.functional.scaled_dot_product_attention(q, dk, dv, scale=sc)}
    for mode in ("exact", "int8"):  # the two score paths (kernels/quant_decode.py)
        out[f"int8/{mode}"] = lambda m=mode: kernel.quant_decode(q, c8, s8, None, c8, s8, None, 8, 64, 0, n, None, t1,
                                                                 t1, None, sc, scores=m)
        out[f"int4/{mode}"] = lambda m=mode: kernel.quant_decode(q, ks.data, ks.scale, ks.zero, vc, vs, vz, 4, 64, 32,
                                                                 n, None, t4, t4, None, sc, scores=m)
    out["int4/int8+v8"] = lambda: kernel.quant_decode(q, ks.data, ks.scale, ks.zero, vc, vs, vz, 4, 64, 32, n, None, t4,
                                                      t4, None, sc, scores="int8", values="int8")
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="8x12x1x64x8192,8x3x3x64x8192,1x12x1x64x1024,1x3x3x64x1024")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    print(f"op isa: {kernel.isa(64)}, {args.threads} thread(s), {'CPU' if args.threads == 1 else 'wall'} time")
    for shape in args.shapes.split(","):
        b, hk, g, d, n = (int(v) for v in shape.split("x"))
        fns = calls(b, hk, g, d, n)
        times = {k: [] for k in fns}
        for f in fns.values():
            f()
        for _ in range(args.rounds):
            for k, f in fns.items():
                t0 = clock()
                f()
                times[k].append(clock() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"B{b} Hk{hk} G{g} D{d} n{n}: " + "  ".join(
            f"{k} {med[k] * 1e3:.2f} ms ({med['dense'] / med[k]:.2f}x)" for k in fns))


if __name__ == "__main__":
    main()
