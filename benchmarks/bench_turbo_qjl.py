"""Does TurboQuant's 1-bit QJL residual sketch pay for attention logits? (issue 35; docs/quantization.md §10)

Rows of D = 64 Gaussian values coded by kvslim's turbo codes (``ops/turbo.py``) and, as the paper's ``_prod``
variant, by (b − 1)-bit codes with the paper's norm scale plus a 1-bit QJL sketch of the residual
(``sign(S·r)`` with S a seeded D×D Gaussian matrix, and ``‖r‖`` in fp16; estimate ``q·r ≈ √(π/2)/D · ‖r‖ ·
(S·q)·sign(S·r)``, unbiased). Reported per format: bits per element, the RMS error of the logits ``q·k`` over
256 random queries × 20,000 rows, and the bias slope (least-squares fit of the estimate on the true logit: 1 is
unbiased). Writes ``benchmarks/results/turbo_qjl.json``.

    python benchmarks/bench_turbo_qjl.py
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from kvslim.ops import turbo

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--out", default=str(RESULTS / "turbo_qjl.json"))
    args = p.parse_args()
    d, g = args.dim, torch.Generator().manual_seed(0)
    x, q = torch.randn(args.rows, d, generator=g), torch.randn(256, d, generator=g)
    true = q @ x.T
    rot = turbo.rotation_matrix("hadamard", d, 1)
    sketch = torch.randn(d, d, generator=torch.Generator().manual_seed(5))

    def mse(bits: int, fit: str = "ls") -> torch.Tensor:
        return turbo.decode(*turbo.encode(x, bits, rot, torch.float16, fit=fit), bits, rot)

    def prod(bits: int) -> torch.Tensor:  # (bits − 1)-bit codes, norm scale, + 1-bit QJL of the residual
        xh = mse(bits - 1, "norm")
        r = x - xh
        signs = torch.sign(r @ sketch.T)
        norm = r.norm(dim=-1).half().float()
        return q @ xh.T + math.sqrt(math.pi / 2) / d * ((q @ sketch.T) @ signs.T) * norm[None, :]

    rows = []
    for label, est, bits in (("turbo3 (3-bit codes, least-squares scale)", q @ mse(3).T, 3 + 16 / d),
                             ("3-bit codes, the paper's norm scale", q @ mse(3, "norm").T, 3 + 16 / d),
                             ("turbo2 (2-bit codes)", q @ mse(2).T, 2 + 16 / d),
                             ("2-bit codes + 1-bit QJL (TurboQuant_prod, 3 bits)", prod(3), 3 + 32 / d),
                             ("turbo4 (4-bit codes)", q @ mse(4).T, 4 + 16 / d),
                             ("3-bit codes + 1-bit QJL (TurboQuant_prod, 4 bits)", prod(4), 4 + 32 / d)):
        err = est - true
        rows.append({"label": label, "bits_per_element": bits, "rms_logit_error": err.pow(2).mean().sqrt().item(),
                     "bias_slope": ((est * true).sum() / (true * true).sum()).item()})
        print(f"{label:52s} {bits:.2f} bits  RMS logit error {rows[-1]['rms_logit_error']:.4f}  "
              f"slope {rows[-1]['bias_slope']:.4f}")
    Path(args.out).write_text(json.dumps({"dim": d, "rows_coded": args.rows, "queries": 256, "rows": rows},
                                         indent=1))


if __name__ == "__main__":
    main()
