"""Predicted gain of a calibrated diagonal scale before the rotation of rotated (turbo) codes, per layer and KV head.

A rotated code spreads its error evenly over the rotated coordinates: coding ``s ⊙ x`` (x: the centred key residual
or the value row) and decoding ``x̂ = (s ⊙ x + ε) / s`` leaves an error ``ε / s`` whose variance per coordinate is
∝ ``Σ_j b_j s_j²`` with ``b_j = E[x_j²]``. Keys: the logit error ``Σ_j q_j ε_j / s_j`` has variance
∝ ``(Σ_j a_j / s_j²)(Σ_j b_j s_j²)`` with ``a_j = E[q_j²]`` summed over the query heads of the KV head. Values: the
error reaches the residual stream through o_proj, weight ``c_j = Σ_h ‖W_o[:, h·D + j]‖²`` over those query heads.
The minimum over s is ``(Σ_j √(a_j b_j))²`` at ``s_j² ∝ √(a_j / b_j)``: a predicted gain
``G = (Σ a)(Σ b) / (Σ √(ab))² ≥ 1`` (the factor by which the expected squared logit / output error falls).

Reported per layer and KV head, development text only (Botchan's first 1,536 tokens, one prefill, fp32):

- ``g_keys``: full-D key scales on turbo3's RoPE-centred residual ``k − RoPE_t(μ)`` (μ: the pre-RoPE channel means);
- ``g_keys_pairs``: one scale per RoPE pair (j, j + D/2);
- ``g_keys_parts``: turbo3's two key parts (D/4 outlier channels at 4 bits, the rest at 3, Lloyd–Max MSE of each),
  the partition fitted by the store on the unscaled residual (largest b) against the one it fits on the scaled
  residual (largest b s², i.e. largest √(ab));
- ``g_keys_plain``: full-D on plainly centred keys (turbo2's default: post-RoPE channel means);
- ``g_values``: full-D value scales.

    .venv/bin/python benchmarks/scaling_gains.py --model smollm2|qwen25 --threads 1

Writes benchmarks/results/scaling_gains_<model>.json. A prediction, not a measurement: the error is assumed white in
the rotated basis and independent of the row (the rows' scale codes it relative to its norm), the queries' and the
o_proj weights' second moments stand for the attention the error meets.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from bench_quality import MODELS, RESULTS, git_commit, load_model

from kvslim import heldout
from kvslim.calibration import capture_qkv
from kvslim.methods.turbo import rope_from_model
from kvslim.ops.rope import rotate, unrotate
from kvslim.ops.turbo import GAUSSIAN_MSE


def gain(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(Σa)(Σb)/(Σ√(ab))² over the last axis (float64)."""
    return a.sum(-1) * b.sum(-1) / (a * b).sqrt().sum(-1) ** 2


def parts_error(a: torch.Tensor, b: torch.Tensor, s2: torch.Tensor, outliers: int, by: torch.Tensor) -> torch.Tensor:
    """Expected logit error of turbo3's key parts (per KV head): Σ_P mse_P / |P| (Σ_P b s²)(Σ_P a / s²), the
    outlier part = the ``outliers`` channels with the largest ``by`` (4 bits), the rest 3 bits."""
    d = a.shape[-1]
    top = by.topk(outliers, dim=-1).indices
    mask = torch.zeros_like(a, dtype=torch.bool).scatter_(-1, top, True)
    out = torch.zeros(a.shape[:-1], dtype=torch.float64)
    for m, w, bits in ((mask, outliers, 4), (~mask, d - outliers, 3)):
        out += GAUSSIAN_MSE[bits] / w * (b * s2 * m).sum(-1) * (a / s2 * m).sum(-1)
    return out


def layer_gains(model, ids: torch.Tensor) -> list[dict]:
    inv = rope_from_model(model)
    t = ids.shape[1]
    freqs = torch.arange(t).float()[:, None] * torch.tensor(inv)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    out = []
    for i, (q, k, v) in enumerate(capture_qkv(model, ids)):
        q, k, v = q[0].double(), k[0].double(), v[0].double()  # (H, T, D), (Hk, T, D)
        hk, d = k.shape[0], k.shape[-1]
        g = q.shape[0] // hk
        a = q.pow(2).mean(1).view(hk, g, d).sum(1)  # (Hk, D)
        mu = unrotate(k.float(), cos, sin).double().mean(1, keepdim=True)  # pre-RoPE channel means
        r = k - rotate(mu.float().expand(hk, t, d), cos, sin).double()
        b = r.pow(2).mean(1)
        b_plain = (k - k.mean(1, keepdim=True)).pow(2).mean(1)
        bv = v.pow(2).mean(1)
        wo = model.model.layers[i].self_attn.o_proj.weight.detach().double()  # (hidden, H·D)
        c = wo.pow(2).sum(0).view(hk, g, d).sum(1)
        h2 = d // 2
        pa, pb = a[:, :h2] + a[:, h2:], b[:, :h2] + b[:, h2:]
        s2 = (a / b).sqrt()
        un = parts_error(a, b, torch.ones_like(a), d // 4, b)
        sc = parts_error(a, b, s2, d // 4, b * s2)
        sc_fixed = parts_error(a, b, s2, d // 4, b)
        out.append({"layer": i, "g_keys": gain(a, b).tolist(), "g_keys_pairs": gain(pa, pb).tolist(),
                    "g_keys_parts": (un / sc).tolist(), "g_keys_parts_fixed_partition": (un / sc_fixed).tolist(),
                    "g_keys_plain": gain(a, b_plain).tolist(), "g_values": gain(c, bv).tolist(),
                    "pair_asymmetry_a": ((a[:, :h2] - a[:, h2:]).abs().sum(-1) / pa.sum(-1)).tolist()})
        print(json.dumps({k_: (round(sum(v_) / len(v_), 3) if isinstance(v_, list) else v_)
                          for k_, v_ in out[-1].items()}), flush=True)
    return out


def summary(rows: list[dict], layers) -> dict:
    keys = [k for k in rows[0] if k.startswith("g_")]
    sel = [r for r in rows if r["layer"] in layers]
    return {k: sum(sum(r[k]) / len(r[k]) for r in sel) / len(sel) for k in keys}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("smollm2", "qwen25"), default="smollm2")
    p.add_argument("--prefill", type=int, default=1536)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    loader, label = MODELS[args.model]
    model, tok = load_model(loader)
    ids = heldout.text_ids(tok, "botchan", args.prefill)
    t0 = time.time()
    with torch.no_grad():
        rows = layer_gains(model, ids)
    n = len(rows)
    rec = {"model": label, "text": "botchan", "tokens": args.prefill, "layers": rows,
           "mean_all_layers": summary(rows, range(n)),
           "mean_layers_15_24": summary(rows, range(15, 25)) if n >= 25 else None,
           "seconds": round(time.time() - t0, 1), "commit": git_commit(),
           "command": f"python benchmarks/scaling_gains.py --model {args.model} --threads {args.threads}"}
    print(json.dumps({k: rec[k] for k in ("mean_all_layers", "mean_layers_15_24")}, indent=1))
    (RESULTS / f"scaling_gains_{args.model}.json").write_text(json.dumps(rec, indent=1) + "\n")


if __name__ == "__main__":
    main()
