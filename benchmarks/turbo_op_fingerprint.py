"""A fingerprint of ``kvslim::turbo_decode``'s outputs over a sweep of inputs, to show that a change of the C++ body
moved code only: SHA-256 of the exact bytes of ``out`` and ``lse`` per call, over key/value bits 2-4, outlier
widths, G = 1-7 query heads, head dims 64/128, lengths of 0-301 coded tokens, fp32/fp16/bf16 scales, tail, mask,
RoPE-style bias, per-sequence lengths, splits 0/1/3, and every instruction set the op has here (avx2, scalar).

    .venv/bin/python benchmarks/turbo_op_fingerprint.py --out /tmp/before.json
    .venv/bin/python benchmarks/turbo_op_fingerprint.py --out /tmp/after.json --compare /tmp/before.json

Codes are random bytes (every code value of every width), scales random positive; nothing here is timed.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import sys

import torch

from kvslim.kernels import turbo_decode as kernel

FORMATS = [(2, 0, 2), (2, 8, 2), (3, 0, 3), (3, 16, 3), (3, 32, 2), (4, 0, 4), (4, 0, 3)]  # (k_bits, k_out, v_bits)


def digest(out: torch.Tensor, lse: torch.Tensor) -> str:
    """SHA-256 of the exact bytes of one call's outputs."""
    return hashlib.sha256(out.numpy().tobytes() + lse.numpy().tobytes()).hexdigest()


def report(got: dict[str, str], isas: list[str], path: str, compare: str | None, extra: dict | None = None,
           note: str = "") -> None:
    """Write ``got`` (call key -> :func:`digest`) and its overall hash to ``path``, print them (with ``note``), and
    with ``compare`` (an earlier record) print how many calls differ and exit 1 if any does or the keys differ."""
    total = hashlib.sha256("".join(f"{k}={v}" for k, v in sorted(got.items())).encode()).hexdigest()
    with open(path, "w") as f:
        json.dump({"calls": len(got), "isas": isas, "sha256": total, **(extra or {}), "each": got}, f, indent=0)
    print(f"{len(got)} calls ({', '.join(isas)}): {total}{note}")
    if compare:
        with open(compare) as f:
            before = json.load(f)["each"]
        diff = [k for k in got if before.get(k) != got[k]]
        print(f"differ from {compare}: {len(diff)} of {len(got)}" + ("" if not diff else f" e.g. {diff[:5]}"))
        sys.exit(1 if diff or set(before) != set(got) else 0)


def cases():
    for (kb, ko, vb), g, d, n, sdt in itertools.product(FORMATS, (1, 2, 3, 4, 7), (64, 128), (0, 1, 45, 128, 301),
                                                      (torch.float32, torch.float16, torch.bfloat16)):
        if ko >= d:
            continue
        for tail, masked, biased, lens in ((False, False, False, False), (True, True, True, True),
                                           (True, False, True, False), (False, True, False, True)):
            yield kb, ko, vb, g, d, n, sdt, tail, masked, biased, lens


def call(kb, ko, vb, g, d, n, sdt, tail, masked, biased, lens, splits, seed):
    gen = torch.Generator().manual_seed(seed)
    b, hk = 2, 2
    kbytes, vbytes = (ko * (kb + 1) + (d - ko) * kb) // 8, d * vb // 8
    kc = torch.randint(0, 256, (b, hk, n + 2, kbytes), generator=gen, dtype=torch.uint8)
    vc = torch.randint(0, 256, (b, hk, n + 2, vbytes), generator=gen, dtype=torch.uint8)
    ks = (torch.rand(b, hk, n + 2, 2 if ko else 1, generator=gen) + 0.1).to(sdt)
    vs = (torch.rand(b, hk, n + 2, 1, generator=gen) + 0.1).to(sdt)
    q = torch.randn(b, hk, g, d, generator=gen)
    r = 7 if tail else 0
    kt = torch.randn(b, hk, r, d, generator=gen) if tail else None
    vt = torch.randn(b, hk, r, d, generator=gen) if tail else None
    mask = None
    if masked:
        mask = torch.zeros(b, n + r)
        mask[1, : min(5, n)] = float("-inf")
        mask[0, 130:260] = float("-inf")
    ab = rows = None
    if biased:
        ab, rows = torch.randn(b, hk, g, 64, generator=gen), torch.randn(n + 3, 64, generator=gen)
    lengths = torch.tensor([n, max(0, n - 40)]) if lens else None
    return torch.ops.kvslim.turbo_decode(q, kc, ks, vc, vs, ko, kb, vb, kernel.levels("cpu"), n, kt, vt, mask, 0.125,
                                         ab, rows, splits, lengths)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--compare", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    assert kernel.available(), "the turbo_decode op is not built"
    isas = ["scalar"]
    try:
        kernel.set_isa("avx2")
        isas.insert(0, "avx2")
    except ValueError:
        pass
    got = {}
    for isa in isas:
        kernel.set_isa(isa)
        for i, c in enumerate(cases()):
            for splits in (0, 1, 3):
                out, lse = call(*c, splits, seed=i)
                got[f"{isa}|{'|'.join(map(str, c))}|s{splits}"] = digest(out, lse)
    report(got, isas, args.out, args.compare)


if __name__ == "__main__":
    main()
