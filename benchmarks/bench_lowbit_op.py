"""The fused int2 decode op (``kvslim::quant_decode_lowbit``) alone against the int4 op and torch's SDPA over the
dense fp32 cache, one layer, at the formats ``apply(model, "int4")`` / ``apply(model, "int2")`` store:

* ``int4``: asymmetric, KIVI keys over 32 tokens, values g64, fp16 parameters (``kvslim::quant_decode``);
* ``int2``: 3-bit KIVI keys over 64 tokens + 2-bit values g64, fp16 parameters (``kvslim::quant_decode_lowbit``);
* ``int2-unfused``: what int2 decoded through before the op: dequantize the history (the store's own reads), then
  SDPA (``--unfused``; slow);

each with a 100-token fp32 window. Value rotation is a (D × D) product on the query/output outside the op and not
timed here.

``python benchmarks/bench_lowbit_op.py [--shapes 8x12x1x64x8192,8x3x3x64x8192] [--rounds 9] [--threads 1]``
(B × KV heads × query heads per KV head × head dim × context). Interleaved rounds (dense, int4, int2, ...),
medians, ratios to dense from the same run. With one thread the time is the thread's CPU time
(``time.thread_time``), which a shared, loaded machine does not inflate by descheduling; with more, wall time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvslim.caches.residual import ChannelQuantizedStore
from kvslim.caches.storage import QuantizedStore, StoreSpec
from kvslim.kernels import quant_decode as int4_kernel
from kvslim.kernels import quant_decode_lowbit as kernel

CPU = torch.device("cpu")


def stores(spec: StoreSpec, x: torch.Tensor) -> tuple[ChannelQuantizedStore, QuantizedStore]:
    """KIVI key store and per-token value store of ``spec`` holding ``x`` (B, H, n, D) as keys and values."""
    b, h, n, d = x.shape
    ks = ChannelQuantizedStore(spec, b, h, n, d, torch.float32, CPU)
    vs = QuantizedStore(spec.for_values(), b, h, n, d, torch.float32, CPU)
    ks.write(0, x)
    vs.write(0, x)
    return ks, vs


def calls(b: int, hk: int, g: int, d: int, n: int, unfused: bool = False) -> dict:
    """name -> zero-argument call for one shape (dense SDPA, int4 op, int2 op[, int2 unfused])."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(b, hk, n, d, generator=gen)
    q = torch.randn(b, hk, g, d, generator=gen)
    dk, dv, sc = x, x.clone(), d ** -0.5
    t = torch.randn(b, hk, 100, d, generator=gen)
    s4 = StoreSpec(4, 64, torch.float16, asymmetric=True, channel_group=32, residual=128, flush=32, value_rotation="none")
    s2 = StoreSpec(3, 64, torch.float16, asymmetric=True, channel_group=64, residual=128, flush=64, value_bits=2,
                   value_rotation="none")
    k4, v4 = stores(s4, x)
    k2, v2 = stores(s2, x)
    out = {
        "dense": lambda: torch.nn.functional.scaled_dot_product_attention(q, dk, dv, scale=sc),
        "int4": lambda: int4_kernel.quant_decode(q, k4.data, k4.scale, k4.zero, v4.data, v4.scale, v4.zero, 4, 64,
                                                 32, n, None, t, t, None, sc),
        "int2": lambda: kernel.quant_decode_lowbit(q, k2.data, k2.scale, k2.zero, v2.data, v2.scale, v2.zero, 3, 2,
                                                   64, 64, n, None, t, t, None, sc),
    }
    if unfused:
        def int2_unfused():
            keys = torch.cat((k2.read(0, n), t), dim=2)
            values = torch.cat((v2.read(0, n), t), dim=2)
            return torch.nn.functional.scaled_dot_product_attention(q, keys, values, scale=sc)
        out["int2-unfused"] = int2_unfused
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="8x12x1x64x8192,8x3x3x64x8192,1x12x1x64x1024,1x3x3x64x1024")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--unfused", action="store_true", help="also time int2's old path (dequantize, then SDPA)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    print(f"int4 op isa: {int4_kernel.isa(64)}, int2 op isa: {kernel.isa()}, {args.threads} thread(s), "
          f"{'thread CPU' if args.threads == 1 else 'wall'} time")
    for shape in args.shapes.split(","):
        b, hk, g, d, n = (int(v) for v in shape.split("x"))
        fns = calls(b, hk, g, d, n, args.unfused)
        times = {k: [] for k in fns}
        for f in fns.values():
            f()  # warm-up (and the build, outside the timing)
        for _ in range(args.rounds):
            for name, f in fns.items():
                t0 = clock()
                f()
                times[name].append(clock() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        cells = "  ".join(f"{k} {1e3 * v:7.2f} ms ({med['dense'] / v:4.2f}x dense)" for k, v in med.items())
        print(f"{shape:>16}: {cells}  int2/int4 time {med['int2'] / med['int4']:.2f}")


if __name__ == "__main__":
    main()
