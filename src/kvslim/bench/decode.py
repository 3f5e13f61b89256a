"""Decode throughput of one (model, cache kind, context, batch) point, against baselines in the same run.

The cache is filled with ``context`` synthetic tokens through each cache's own ``update`` (a real prefill of
8k tokens × batch 8 would take minutes on a CPU and does not change decode speed), then greedy decode steps are
timed one by one; the median step time gives tokens/s.

:func:`measure_group` compares several cache kinds at one point the way a noisy shared machine needs: each kind
gets its own copy of the model (applied once) and its own filled cache, then the kinds take turns, ``rounds``
times ``steps`` steps each (A B C A B C ...), so a burst of load hits every kind alike.
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings
from dataclasses import dataclass

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

from .. import api
from ..adapters.compat import CACHE_KW
from ..adapters.shape import shape_from_config
from ..methods.base import NotApplicable
from .kinds import ALL_KINDS, KVSLIM_KINDS


def mha_100m(dtype: torch.dtype = torch.float32, seed: int = 0) -> LlamaForCausalLM:
    """A ~100M-parameter random Llama-MHA: d 768, 12 layers, 12 heads (head_dim 64), vocab 32000."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=32768)
    return LlamaForCausalLM(cfg).to(dtype).eval()


@dataclass
class Point:
    model: str
    kind: str
    context: int
    batch: int


def make_filled_cache(model, kind: str, batch: int, context: int, steps: int, options: dict | None = None):
    """A cache of ``kind`` holding ``context`` random tokens per sequence, room for ``steps`` more; ``options``
    ({method: {name: value}}, ``kvslim bench --option``) over a kvslim kind's own."""
    shape = shape_from_config(model.config)
    dtype, device = next(model.parameters()).dtype, next(model.parameters()).device
    api.restore(model)
    if kind == "hf-dynamic":
        cache = DynamicCache(config=model.config)
    elif kind == "hf-static":
        cache = StaticCache(config=model.config, max_cache_len=context + steps + 1)
    elif kind in KVSLIM_KINDS:
        method, opts = KVSLIM_KINDS[kind]
        opts = {**opts, **(options or {}).get(method, {})}
        with warnings.catch_warnings():  # random weights: slim's fp32 K-cache error is measured elsewhere
            warnings.simplefilter("ignore")
            api.apply(model, method, **opts)
        cache = api.make_cache(model, max_length=context + steps + 1)
    else:
        raise ValueError(f"kind must be one of {ALL_KINDS}, got {kind!r}")
    g = torch.Generator(device=device).manual_seed(0)
    if kind == "kvslim-slim":  # slim layers store one row per token (K or X), written directly
        pos = torch.arange(context, device=device)[None].expand(batch, -1)
        for layer in cache.layers:
            layer.write(torch.randn(batch, context, layer.width, generator=g, device=device).to(dtype), pos)
        return cache
    for i in range(shape.num_layers):
        k = torch.randn(batch, shape.num_kv_heads, context, shape.head_dim, generator=g, device=device).to(dtype)
        cache.update(k, k.clone(), i)
        del k
    return cache


def weight_bytes(model) -> int:
    """Bytes of parameters read per decode step (tied embeddings counted once; the input embedding row is
    negligible, the LM head reads the whole matrix)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def left_pads(batch: int, context: int) -> list[int]:
    """Padding tokens in front of each row of a left-padded batch (``kvslim bench --padded``): row r's first
    r·context/(2·batch) tokens, from none to just under half the context, as a batch of prompts of unequal lengths
    gets them."""
    return [r * context // (2 * batch) for r in range(batch)]


@torch.inference_mode()
def time_decode(model, cache, batch: int, context: int, steps: int, warmup: int = 1,
                pads: list[int] | None = None) -> list[float]:
    """Seconds per decode step (``warmup`` steps dropped). ``pads``: left padding per row (the first ``pads[r]``
    tokens of row r masked; positions count from its first real token), an attention mask every step."""
    device = next(model.parameters()).device
    tok = torch.zeros(batch, 1, dtype=torch.long, device=device)
    pad = None if pads is None else torch.tensor(pads, dtype=torch.long, device=device)
    times = []
    for i in range(warmup + steps):
        pos = torch.full((batch, 1), context + i, dtype=torch.long, device=device)
        kw = {}
        if pad is not None:
            pos = pos - pad[:, None]
            kw["attention_mask"] = (torch.arange(context + i + 1, device=device)[None] >= pad[:, None]).long()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(tok, position_ids=pos, use_cache=True, **{CACHE_KW: cache}, **kw)
        tok = out.logits[:, -1:].argmax(-1)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times[warmup:]


def measure_point(model, model_name: str, kind: str, batch: int, context: int, steps: int,
                  roofline_gbps: float) -> dict:
    """One JSON record for one kind alone (see :func:`measure_group` to compare kinds)."""
    return measure_group(model, model_name, [kind], batch, context, steps, 1, roofline_gbps)[0]


def measure_group(model, model_name: str, kinds: list[str], batch: int, context: int, steps: int, rounds: int,
                  roofline_gbps: float, options: dict | None = None, padded: bool = False) -> list[dict]:
    """One JSON record per kind: median over ``rounds`` × ``steps`` interleaved decode steps, cache bytes, bytes
    read per step, effective GB/s; a kvslim method that does not apply to ``model`` (:class:`NotApplicable`) gives
    a record with only a ``skipped`` reason; a bad option is a ``ValueError`` naming the kind, before any timing. ``model`` itself is left unapplied; each kind runs on its own copy. ``options``: {method:
    {name: value}} over the kinds' own (``kvslim bench --option``; a record names the options it ran with).
    ``padded``: a left-padded batch (:func:`left_pads`; the records list the pads)."""
    if steps <= 0 or rounds <= 0:
        raise ValueError(f"steps and rounds must be positive ints, got steps={steps}, rounds={rounds}")
    api.restore(model)
    pads = left_pads(batch, context) if padded else None
    room = rounds * (steps + 1) + 1
    runs, skipped = {}, {}
    for kind in kinds:  # every copy and cache is built before any timing
        m = copy.deepcopy(model)
        try:
            cache = make_filled_cache(m, kind, batch, context, room, options)
        except NotApplicable as err:  # the method does not apply to this model (e.g. slim on a GQA model)
            skipped[kind] = str(err)
            continue
        except ValueError as err:  # a bad option (e.g. a per_layer entry past the model's layers): refused
            raise ValueError(f"{kind}: {err}") from None
        runs[kind] = {"model": m, "cache": cache, "pos": context, "times": [], "rounds": [],
                      "bytes": _cache_bytes(cache, context), "read": _read_bytes(cache, context, batch)}
    for r in range(rounds):
        for kind in runs:
            run = runs[kind]
            times = time_decode(run["model"], run["cache"], batch, run["pos"], steps, warmup=1 if r == 0 else 0,
                                pads=pads)
            run["pos"] += steps + (1 if r == 0 else 0)
            run["times"] += times
            run["rounds"].append(statistics.median(times))
    records = [{"method": kind, "model": model_name, "context": context, "batch": batch, "skipped": reason}
               for kind, reason in skipped.items()]
    for kind in list(runs):
        run = runs.pop(kind)
        step = statistics.median(run["times"])
        bytes_per_step = weight_bytes(model) + run["read"]
        gbps = bytes_per_step / step / 1e9
        records.append({"method": kind, "model": model_name,
                        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "context": context,
                        "batch": batch, "steps": steps, "rounds": rounds, "step_s_median": step,
                        "step_s_all": run["times"], "step_s_round_medians": run["rounds"],
                        "tokens_per_s": batch / step, "cache_bytes": run["bytes"], "cache_read_bytes": run["read"],
                        "bytes_per_step": bytes_per_step, "gbps": gbps, "roofline_gbps": roofline_gbps,
                        "roofline_fraction": gbps / roofline_gbps})
        if pads is not None:
            records[-1]["padded"] = pads
        method = KVSLIM_KINDS.get(kind, ("", {}))[0]
        if (options or {}).get(method):
            records[-1]["options"] = {**KVSLIM_KINDS[kind][1], **options[method]}
        del run
    return records


def _read_bytes(cache, context: int, batch: int) -> int:
    """Cache bytes a decode step reads: all of them, or with sparse decode what the plan says a step past the
    budget reads (``Plan.step_read_bytes``)."""
    plan = getattr(cache, "plan", None)
    if plan is not None and any(getattr(lp, "sparse", None) is not None for lp in getattr(plan, "layers", ())):
        return int(plan.step_read_bytes(context, batch))
    return _cache_bytes(cache, context)


def _cache_bytes(cache, context: int) -> int:
    """Live bytes after ``context`` tokens (HF caches: K and V tensors up to ``context``)."""
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes)
    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            per_token = t.numel() // t.shape[2] * t.element_size()
            total += per_token * context
    return total
