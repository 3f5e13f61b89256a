"""Would per-layer codebooks calibrated on the development text beat the Lloyd–Max codebook of N(0, 1)? (issue 35)

KVQuant's non-uniform per-layer codebooks, measured before building them into the turbo stores: for each layer,
keys (pre-RoPE, centred, the D/4 largest channels apart at one bit more, as ``turbo3 prerope_keys=True``) and
values of the model on the development text (Botchan, 2,048 tokens) are rotated as the store rotates them
(the layer's own seeded Haar matrices) and normalized per row; a 1-D Lloyd iteration (30 rounds from the N(0, 1)
levels) fits each layer's and part's 2^b levels to those coordinates. Then on each held-out text the rows are
coded both ways (nearest level, least-squares row scale as the store's) and the relative squared error of the
rows, Σ‖x̂ − x‖² / Σ‖x‖² per layer and part, is summed over layers: the error a calibrated codebook would remove
(an upper bound on what it could do for KL: the row error is what attention sees).

    .venv/bin/python benchmarks/bench_turbo_codebooks.py --model smollm2 --threads 1

Writes ``benchmarks/results/turbo_codebooks_<model>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quality import MODELS, RESULTS, git_commit, load_model  # noqa: E402

from kvslim import heldout  # noqa: E402
from kvslim.adapters.compat import CACHE_KW  # noqa: E402
from kvslim.ops import turbo  # noqa: E402
from kvslim.ops.rope import unrotate  # noqa: E402


@torch.inference_mode()
def layer_rows(model, tok, name: str, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (pre-RoPE keys, values), each (1, Hkv, T, D) fp32, of the first ``tokens`` tokens of ``name``."""
    from transformers import DynamicCache

    ids = heldout.text_ids(tok, name, tokens)
    cache = DynamicCache(config=model.config)
    model(ids, **{CACHE_KW: cache}, use_cache=True)
    cos, sin = model.model.rotary_emb(torch.zeros(1), torch.arange(tokens)[None])
    return [(unrotate(layer.keys.float(), cos[0], sin[0]), layer.values.float()) for layer in cache.layers]


def parts(x: torch.Tensor, bits: int, outliers: int, seed: int, fit: torch.Tensor) -> list[tuple]:
    """(rotated rows y, normalized coordinates u, bits) per part, centred and permuted as a TurboStore whose first
    write is ``fit`` (keys: ``outliers`` > 0)."""
    d = x.shape[-1]
    if outliers:
        mu = fit.mean(2, keepdim=True)
        ms = (fit - mu).pow(2).mean(2)
        top = ms.topk(outliers, -1).indices.sort(-1).values
        rest = torch.ones_like(ms, dtype=torch.bool).scatter_(-1, top, False)
        perm = torch.cat((top, rest.nonzero()[:, -1].view(*ms.shape[:2], -1)), -1)
        z = (x - mu).gather(-1, perm[:, :, None].expand(x.shape))
        widths = [(outliers, bits + 1), (d - outliers, bits)]
    else:
        z, widths = x, [(d, bits)]
    out, at = [], 0
    for j, (w, b) in enumerate(widths):
        y = z[..., at:at + w] @ turbo.rotation_matrix("orthogonal", w, 4 * seed + j)
        out.append((y, y * math.sqrt(w) / y.norm(dim=-1, keepdim=True).clamp_min(1e-30), b))
        at += w
    return out


def lloyd(u: torch.Tensor, levels: torch.Tensor, rounds: int = 30) -> torch.Tensor:
    c, u = levels.clone(), u.flatten()
    for _ in range(rounds):
        q = torch.searchsorted((c[1:] + c[:-1]) / 2, u)
        s = torch.zeros_like(c).index_add_(0, q, u)
        n = torch.zeros_like(c).index_add_(0, q, torch.ones_like(u))
        c = torch.where(n > 0, s / n.clamp_min(1), c)
    return c


def rel_error(y: torch.Tensor, u: torch.Tensor, levels: torch.Tensor) -> tuple[float, float]:
    """(Σ‖ŷ − y‖², Σ‖y‖²) with codes = nearest level of u and the least-squares row scale."""
    c = levels[torch.searchsorted((levels[1:] + levels[:-1]) / 2, u.contiguous())]
    s = (y * c).sum(-1, keepdim=True) / (c * c).sum(-1, keepdim=True)
    return (s * c - y).pow(2).sum().item(), y.pow(2).sum().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--prefill", type=int, default=1536, help="tokens of the first write (means, outliers)")
    p.add_argument("--bits", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    model, tok = load_model(MODELS[args.model][0])
    d = model.config.head_dim if getattr(model.config, "head_dim", None) else \
        model.config.hidden_size // model.config.num_attention_heads
    outliers = d // 4
    dev = layer_rows(model, tok, "botchan", args.tokens)
    books = []  # per layer: {"K": [levels per part], "V": [...]}
    for i, (k, v) in enumerate(dev):
        books.append({})
        for role, x, o, seed in (("K", k, outliers, 2 * i), ("V", v, 0, 2 * i + 1)):
            books[-1][role] = [lloyd(u, torch.from_numpy(turbo.lloyd_max(b)[0]).float())
                               for _, u, b in parts(x, args.bits, o, seed, x[:, :, :args.prefill])]
    texts = {}
    for name in heldout.SETS["heldout"]:
        rows = layer_rows(model, tok, name, args.tokens)
        tot = {r: {"gaussian": 0.0, "calibrated": 0.0} for r in ("K", "V")}
        for i, (k, v) in enumerate(rows):
            for role, x, o, seed in (("K", k, outliers, 2 * i), ("V", v, 0, 2 * i + 1)):
                for (y, u, b), cal in zip(parts(x, args.bits, o, seed, x[:, :, :args.prefill]), books[i][role]):
                    for kind, lv in (("gaussian", torch.from_numpy(turbo.lloyd_max(b)[0]).float()),
                                     ("calibrated", cal)):
                        e, n = rel_error(y, u, lv)
                        tot[role][kind] += e / n
        texts[name] = {r: {**t, "change": t["calibrated"] / t["gaussian"] - 1} for r, t in tot.items()}
        print(name, {r: f"{100 * t['change']:+.2f} %" for r, t in texts[name].items()}, flush=True)
    record = {"model": MODELS[args.model][1], "bits": args.bits, "outliers": outliers, "tokens": args.tokens,
              "prefill": args.prefill, "calibration_text": "botchan", "texts": texts,
              "codebooks": [{r: [c.tolist() for c in cs] for r, cs in b.items()} for b in books],
              "command": "python " + " ".join(sys.argv), "commit": git_commit()}
    path = RESULTS / f"turbo_codebooks_{args.model}.json"
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
