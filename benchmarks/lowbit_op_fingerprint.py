"""A fingerprint of ``kvslim::quant_decode_lowbit``'s outputs over a sweep of inputs, to show that a change of the
C++ body moved code only (as ``turbo_op_fingerprint.py`` does for turbo): SHA-256 of the exact bytes of ``out`` and
``lse`` per call, over key/value bits 2/3, KIVI keys (token groups 32) and per-token keys, value groups 16/64,
G = 1-7 query heads, head dims 64/128, lengths of 0-301 coded tokens, fp32/fp16/bf16 parameters, tail, mask,
per-sequence lengths, splits 0/1/3, and every instruction set the op has here (avx2, scalar). Value parameters of
masked tokens and every parameter past a sequence's length are NaN (the op must never let them through).

    .venv/bin/python benchmarks/lowbit_op_fingerprint.py --out /tmp/before.json
    .venv/bin/python benchmarks/lowbit_op_fingerprint.py --out /tmp/after.json --compare /tmp/before.json

Codes are random bytes (every code value), scales random positive, zero-points random; nothing here is timed.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from turbo_op_fingerprint import digest, report  # the hash, the record and the comparison

from kvslim.kernels import quant_decode_lowbit as kernel

FORMATS = [(3, 2), (2, 2), (3, 3), (2, 3)]  # (k_bits, v_bits)
NAN = float("nan")


def cases():
    for (kb, vb), kivi, gs, g, d, n, sdt in itertools.product(FORMATS, (0, 32), (16, 64), (1, 2, 3, 7), (64, 128),
                                                              (0, 1, 45, 128, 301),
                                                              (torch.float32, torch.float16, torch.bfloat16)):
        for tail, masked, lens in ((False, False, False), (True, True, True), (False, True, False),
                                   (True, False, True)):
            yield kb, vb, kivi, gs, g, d, n, sdt, tail, masked, lens


def call(kb, vb, kivi, gs, g, d, n, sdt, tail, masked, lens, splits, seed):
    gen = torch.Generator().manual_seed(seed)
    b, hk = 2, 2
    nk = -(-n // kivi) * kivi if kivi else n
    kp = d // kivi if kivi else d // gs
    kc = torch.randint(0, 256, (b, hk, nk, d * kb // 8), generator=gen, dtype=torch.uint8)
    vc = torch.randint(0, 256, (b, hk, n, d * vb // 8), generator=gen, dtype=torch.uint8)
    ks = torch.rand(b, hk, nk, kp, generator=gen) * 0.5 + 0.05
    kz = torch.randn(b, hk, nk, kp, generator=gen)
    vs = torch.rand(b, hk, n, d // gs, generator=gen) * 0.5 + 0.05
    vz = torch.randn(b, hk, n, d // gs, generator=gen)
    q = torch.randn(b, hk, g, d, generator=gen)
    r = 7 if tail else 0
    kt = torch.randn(b, hk, r, d, generator=gen) if tail else None
    vt = torch.randn(b, hk, r, d, generator=gen) if tail else None
    mask = None
    if masked:
        mask = torch.zeros(b, n + r)
        mask[1, : min(5, n)] = float("-inf")
        mask[0, 130:260] = float("-inf")
        for i in range(b):
            off = mask[i, :n] == float("-inf")
            vs[i, :, off] = vz[i, :, off] = NAN
    lengths = None
    if lens:
        lengths = torch.tensor([n, max(0, n - 40)])
        for i, ln in enumerate(lengths.tolist()):
            kfrom = -(-ln // kivi) * kivi if kivi else ln  # KIVI: a started group's parameters are real
            ks[i, :, kfrom:] = kz[i, :, kfrom:] = NAN
            vs[i, :, ln:] = vz[i, :, ln:] = NAN
    ks, kz, vs, vz = (x.to(sdt) for x in (ks, kz, vs, vz))
    return torch.ops.kvslim.quant_decode_lowbit(q, kc, ks, kz, vc, vs, vz, kb, vb, gs, kivi, n, lengths, kt, vt, mask,
                                                0.125, splits)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--compare", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    assert kernel.available(), "the quant_decode_lowbit op is not built"
    isas = ["scalar"]
    try:
        torch.ops.kvslim.quant_decode_lowbit_set_isa("avx2")
        if kernel.isa() == "avx2":
            isas.insert(0, "avx2")
    except (RuntimeError, ValueError):
        pass
    got, nonfinite = {}, 0
    for isa in isas:
        torch.ops.kvslim.quant_decode_lowbit_set_isa(isa)
        for i, c in enumerate(cases()):
            for splits in (0, 1, 3):
                out, lse = call(*c, splits, seed=i)
                nonfinite += int(not torch.isfinite(out).all())
                got[f"{isa}|{'|'.join(map(str, c))}|s{splits}"] = digest(out, lse)
    report(got, isas, args.out, args.compare, {"nonfinite_outputs": nonfinite},
           f"; calls with a non-finite output: {nonfinite}")


if __name__ == "__main__":
    main()
