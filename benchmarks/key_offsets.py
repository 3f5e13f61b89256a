"""Per layer, how much of the keys is a constant offset: the statistic that picks which layers' keys to rotate.

A Hadamard rotation before KIVI's per-channel groups helps SmolLM2 and wrecks Qwen2.5-Coder (docs/quantization.md
§9, §11). On the development text's prefill (Botchan, 1,536 tokens, fp32) this script measures, per layer and KV
head, the keys as the key projection writes them (before RoPE): the fraction of their energy that is the per-channel
mean (``offset_energy`` = Σ_c mean_c² / Σ_c mean_square_c), their RMS, the largest |k|, and the key projection's bias
norm per head when it has one. A layer whose offset carries ≥ ``--threshold`` of the energy (default 0.98: between
SmolLM2's largest, 0.945, and Qwen2.5-Coder's five offset layers, 0.986-0.9999) is listed in ``offset_layers``:
RoPE turns that offset with the position, so inside a 32- or 64-token KIVI group it sweeps a
range; unrotated it lives in two channels, rotated it spreads over every channel's range.

    .venv/bin/python benchmarks/key_offsets.py --model smollm2|qwen25 --threads 1

Writes benchmarks/results/key_offsets_<model>.json (the layers the ``int_per_layer`` suite of bench_quality.py keeps
unrotated).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from bench_quality import MODELS, RESULTS, git_commit, load_model

from kvslim import heldout


def key_statistics(model, ids: torch.Tensor) -> list[dict]:
    """Per layer: offset energy, RMS, max |k| (max over heads) of the key projection's output over ``ids``."""
    cfg = model.config
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    keys: dict[int, torch.Tensor] = {}
    hooks = [layer.self_attn.k_proj.register_forward_hook(
        lambda mod, inp, out, i=i: keys.__setitem__(i, out[0].detach()))
        for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    out = []
    for i in range(len(model.model.layers)):
        k = keys[i].view(keys[i].shape[0], -1, dim)  # (T, H, D)
        mean, ms = k.mean(0), (k ** 2).mean(0)  # (H, D)
        bias = model.model.layers[i].self_attn.k_proj.bias
        out.append({"layer": i, "offset_energy": ((mean ** 2).sum(1) / ms.sum(1)).max().item(),
                    "rms": ms.mean(1).sqrt().max().item(), "max_abs": k.abs().max().item(),
                    "bias_norm_per_head": None if bias is None else bias.view(-1, dim).norm(dim=1).tolist()})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("smollm2", "qwen25"), default="smollm2")
    p.add_argument("--prefill", type=int, default=1536)
    p.add_argument("--threshold", type=float, default=0.98)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    loader, label = MODELS[args.model]
    model, tok = load_model(loader)
    t0 = time.time()
    ids = heldout.text_ids(tok, "botchan", args.prefill)
    stats = key_statistics(model, ids)
    rec = {"model": label, "text": "botchan (development)", "tokens": args.prefill, "threshold": args.threshold,
           "offset_layers": [s["layer"] for s in stats if s["offset_energy"] >= args.threshold],
           "layers": stats, "commit": git_commit(), "seconds": round(time.time() - t0, 1)}
    path = RESULTS / f"key_offsets_{args.model}.json"
    path.write_text(json.dumps(rec, indent=1) + "\n")
    for s in stats:
        print(f"layer {s['layer']:2d}: offset energy {s['offset_energy']:.3f}, rms {s['rms']:6.2f}, "
              f"max |k| {s['max_abs']:7.1f}")
    print(f"offset layers (>= {args.threshold}): {rec['offset_layers']} -> {path}")


if __name__ == "__main__":
    main()
