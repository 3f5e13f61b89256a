"""Memory and traffic per rank of a sequence-parallel job, from a kvslim plan (what ``kvslim plan --ranks``
prints). Same formulas as the sharded cache: each rank keeps ⌈tokens / N⌉ of every layer's tokens (a ring
buffer's ⌈W / N⌉) plus the per-sequence fixed bytes (e.g. int8 key smoothing factors), which every rank holds."""

from __future__ import annotations

import re
from dataclasses import replace

from ..adapters.shape import ModelShape
from ..plan import LayerPlan, Plan

#: bytes per merged value: the partials travel in fp32 whatever the model dtype
PARTIAL_ITEMSIZE = 4


def merge_width(shape: ModelShape, lp: LayerPlan, project: str = "after") -> int:
    """d_out: the width each query head's partial carries (head_dim; slim K-row e + r, X-row d, V head_dim;
    MLA latent dc; with ``project="before"`` the value maps run before the merge: head_dim / v_head_dim)."""
    t = lp.technique
    if project == "before" and (t.startswith("slim") or t.startswith("mla")):
        return shape.v_head_dim if t.startswith("mla") else shape.head_dim
    if t.startswith("mla-latent"):
        return shape.kv_lora_rank
    if t.startswith("mla"):
        return shape.v_head_dim
    if t.startswith("slim-k"):
        r = re.search(r"\+r(\d+)", t)
        return shape.num_heads * shape.head_dim + (int(r.group(1)) if r else 0)
    if t.startswith("slim-x"):
        return shape.hidden_size
    return shape.head_dim


def merge_how(ranks: int, merge: str = "auto") -> str:
    return ("gather" if ranks <= 3 else "reduce") if merge == "auto" else merge


def per_rank(plan: Plan, shape: ModelShape, context: int, batch: int, ranks: int, merge: str = "auto",
             project: str = "after") -> dict:
    """Cache bytes per rank (the fullest rank), bytes each rank sends per decode step, and the issue's bound
    ``2 · layers · batch · heads · (d_out + 2) · 4``."""
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be a positive int, got {ranks!r}")
    cache = 0
    payload = 0
    for lp in plan.layers:
        tokens = context if lp.window is None else min(context, lp.window - 1)  # live after a step: W − 1
        cache += replace(lp, window=None).cache_bytes(-(-tokens // ranks), batch) if tokens else 0
        payload += batch * shape.num_heads * (merge_width(shape, lp, project) + 2) * PARTIAL_ITEMSIZE
    how = merge_how(ranks, merge)
    sent = 0 if ranks == 1 else (payload * (ranks - 1) if how == "gather" else 2 * (ranks - 1) * payload // ranks)
    return {"ranks": ranks, "merge": how, "cache_bytes_per_rank": cache, "sent_bytes_per_step": sent,
            "sent_bound": 2 * payload}
