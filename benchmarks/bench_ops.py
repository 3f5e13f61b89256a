"""The decode attention ops alone, one layer: where the time goes and how close each is to its roofline.

Per op, one decode step of one layer (fp32, ``--threads`` threads, interleaved trials, medians):

- ``sdpa``: torch's ``scaled_dot_product_attention`` over a dense K/V cache (B, h, n, dk) — what kvslim's dense
  cache uses; compared with a plain streaming read of the same bytes (``read``: ``K.sum() + V.sum()``), the best a
  fused dense kernel could do. This is the measurement behind "keep SDPA" (issue 9 item 4).
- ``slim``: ``kvslim::slim_decode`` over a K-only slim cache (B, n, h·dk), raw RoPE applied on the fly, then the
  per-head ``W_KV`` maps (the full option-2 attention of one layer), and ``slim-op``: the op alone.
- ``encdec``: ``kvslim::encdec_decode`` over a Whisper-tiny encoder output (B, 1500, 384), 6 heads; against
  ``encdec-sdpa``: SDPA over the per-layer K/V HF caches instead.

Reported: wall ms (median of interleaved trials), CPU ms of the whole process (threads' busy time, spinning
included), bytes read, GB/s, fraction of the measured streaming-read bandwidth, and GFMA/s of the arithmetic
each op must do. The machine is shared: use the ratios and the CPU times.

    .venv/bin/python benchmarks/bench_ops.py                      # 8k x 8 Llama-100M layer + Whisper batch 1/64
    .venv/bin/python benchmarks/bench_ops.py --context 1024 --batch 1 --trials 5
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvslim.kernels import encdec_decode, slim_decode

RESULTS = Path(__file__).resolve().parent / "results"


def llama_layer(batch: int, context: int, h: int = 12, dk: int = 64) -> dict:
    """Callables for one decode step of one MHA layer; with bytes read and FMAs done."""
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(batch, h, context, dk, generator=g) for _ in range(2))
    q = torch.randn(batch, h, 1, dk, generator=g)
    rows = torch.randn(batch, context, h * dk, generator=g)
    ang = torch.arange(context, dtype=torch.float32)[:, None] * torch.rand(dk // 2, generator=g)
    cos, sin = torch.cat((ang, ang), -1).cos()[None], torch.cat((ang, ang), -1).sin()[None]
    maps = torch.randn(h, h * dk, dk, generator=g) / (h * dk) ** 0.5  # W_KV,j (h, c, dk)

    def slim_full():
        u, _ = slim_decode.slim_decode(q[:, :, 0], rows, cos, sin, None, None, dk ** -0.5, False)
        return torch.bmm(u.transpose(0, 1), maps)  # "bhc,hck->hbk"

    kv_bytes, row_bytes = 2 * k.numel() * 4, rows.numel() * 4
    return {
        "sdpa": (lambda: F.scaled_dot_product_attention(q, k, v), kv_bytes, 2 * batch * h * context * dk),
        "read": (lambda: (k.sum(), v.sum()), kv_bytes, 0),
        "slim": (slim_full, row_bytes + maps.numel() * 4,
                 batch * context * (h * dk + h * h * dk) + batch * h * h * dk * dk),
        "slim-op": (lambda: slim_decode.slim_decode(q[:, :, 0], rows, cos, sin, None, None, dk ** -0.5, False),
                    row_bytes, batch * context * (h * dk + h * h * dk)),
    }


def whisper_layer(batch: int, frames: int = 1500, d: int = 384, h: int = 6) -> dict:
    """Cross-attention of one Whisper-tiny decoder layer: shared E through the op, or HF's per-layer K/V + SDPA."""
    g = torch.Generator().manual_seed(0)
    enc = torch.randn(batch, frames, d, generator=g)
    qt = torch.randn(batch, h, d, generator=g) / d
    k, v = (torch.randn(batch, h, frames, d // h, generator=g) for _ in range(2))
    q = torch.randn(batch, h, 1, d // h, generator=g)
    return {
        "encdec": (lambda: encdec_decode.encdec_decode(qt, enc), enc.numel() * 4, 2 * batch * frames * h * d),
        "encdec-sdpa": (lambda: F.scaled_dot_product_attention(q, k, v), 2 * k.numel() * 4,
                        2 * batch * h * frames * (d // h)),
    }


def measure(ops: dict, trials: int, reps: int) -> dict:
    """Interleaved: trial t runs every op ``reps`` times (order rotating); per op the median over all calls."""
    names = list(ops)
    wall = {n: [] for n in names}
    cpu = {n: [] for n in names}
    for n in names:  # warm-up (first use of an op loads its build: never timed)
        ops[n][0]()
    for t in range(trials):
        for n in names[t % len(names):] + names[:t % len(names)]:
            for _ in range(reps):
                w0, c0 = time.perf_counter(), time.process_time()
                ops[n][0]()
                wall[n].append(time.perf_counter() - w0)
                cpu[n].append(time.process_time() - c0)
    out = {}
    for n in names:
        w, c = statistics.median(wall[n]), statistics.median(cpu[n])
        _, nbytes, fma = ops[n]
        out[n] = {"wall_ms": 1e3 * w, "cpu_ms": 1e3 * c, "bytes": nbytes, "gbps": nbytes / w / 1e9,
                  "gfma_per_s": fma / w / 1e9}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--whisper-batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_ops.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    slim_decode.available(), encdec_decode.available()  # build or load before any timing
    rec = {"benchmark": "bench_ops", "threads": args.threads, "trials": args.trials, "reps": args.reps,
           "isa": slim_decode.isa(), "torch": torch.__version__, "python": platform.python_version(),
           "note": "shared 2-core machine under load from other jobs: compare ratios within one run", "groups": {}}
    groups = {f"llama-layer {args.context}x{args.batch}": llama_layer(args.batch, args.context)}
    groups.update({f"whisper-cross 1500x{b}": whisper_layer(b) for b in args.whisper_batches})
    for gname, ops in groups.items():
        res = measure(ops, args.trials, args.reps)
        base = res.get("read")
        for n, r in res.items():
            if base is not None:
                r["fraction_of_read_bw"] = r["gbps"] / base["gbps"]
            print(f"{gname:24s} {n:12s} wall {r['wall_ms']:8.2f} ms  cpu {r['cpu_ms']:8.2f} ms  "
                  f"{r['gbps']:6.2f} GB/s  {r['gfma_per_s']:6.2f} GFMA/s"
                  + (f"  {100 * r['fraction_of_read_bw']:.0f}% of read" if base else ""), flush=True)
        rec["groups"][gname] = res
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rec, indent=2))


if __name__ == "__main__":
    main()
