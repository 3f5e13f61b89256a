"""Which layers read in full under sparse decode, measured on a calibration text: ``kvslim.calibrate_sparse``.

A sparse step chooses pages by a bound on each page's best ``q·k`` (docs/sparse.md). In some layers of a trained
model that bound cannot rank the pages: the keys spread so widely over a page that every page's box bound is
about the same, and a head that puts nearly all its attention on one page ranks it among the last half. On
Qwen2.5-Coder-0.5B layers 3, 7, 9 and 11 are such layers; reading 9 and 11 in full is what let sparse int4 answer
the two multi-key questions it lost to dense when the question came token by token (docs/sparse.md, "Layers the
bound cannot rank").

The measurement, per layer, over the last ``queries`` queries of one prefill of the calibration text (post-RoPE
queries and keys in fp32, as the cache sees them): the candidate pages of query ``t`` are the complete pages of
rows ``[SINKS, t + 1 − RECENT)`` (what an int4 layer's paged region holds; the first rows are its sinks, the last
:data:`~kvslim.caches.sparse.RECENT` its window); the rule chooses ``max(1, round(fraction · pages))`` of them
(the library's bound on min/max or mean ± std boxes, each head's log-softmax over the pages, their logsumexp over
the GQA group: ``kernels.sparse_select.scores``); an **event** is a query head whose true attention puts at least
``concentrated`` of its weight on one candidate page, a **miss** an event whose page the rule did not choose.
A layer whose misses are at least ``threshold`` of at least ``min_events`` events reads in full.
"""

from __future__ import annotations

import torch

from .caches.sparse import AUTO_FRACTION, RECENT, SCORES

SINKS = 4  # rows before the paged region (the int4/int3/int2/turbo layers' full-precision sinks)
CONCENTRATED = 0.3  # a head's attention on one page that makes it an event
THRESHOLD = 0.3  # a layer missing this share of its events reads in full
MIN_EVENTS = 16  # fewer events say nothing about a layer: it stays sparse
MIN_PAGES = 64  # candidate pages at the first measured query (a choice of an eighth is then 8 pages)


def page_boxes(keys: torch.Tensor, page: int, score: str) -> torch.Tensor:
    """(Hk, T, D) keys -> (Hk, T // page, 2D) fp32 ``[centre | radius]`` of each complete page: min/max boxes
    (``"minmax"``) or mean ± std (``"meanstd"``), as ``PageStats`` computes them before its int8 codes."""
    hk, t, d = keys.shape
    x = keys[:, : t // page * page].float().reshape(hk, t // page, page, d)
    if score == "minmax":
        lo, hi = x.amin(2), x.amax(2)
        return torch.cat(((lo + hi) / 2, (hi - lo) / 2), dim=-1)
    c = x.mean(2)
    return torch.cat((c, (x.pow(2).mean(2) - c * c).clamp_min(0).sqrt()), dim=-1)


def page_misses(q: torch.Tensor, k: torch.Tensor, scaling: float, *, queries: int, page: int = 32,
                fraction: float = AUTO_FRACTION, score: str = "minmax", concentrated: float = CONCENTRATED
                ) -> tuple[int, int]:
    """One layer's ``(events, misses)`` (module docstring) from its post-RoPE queries ``q`` (H, T, D) and keys
    ``k`` (Hk, T, D), H a multiple of Hk, over the last ``queries`` queries."""
    from .kernels.sparse_select import scores

    h, t, d = q.shape
    hk = k.shape[0]
    g = h // hk
    boxes = page_boxes(k[:, SINKS:], page, score)  # (Hk, P, 2D)
    events = misses = 0
    for i in range(max(0, t - queries), t):
        n = (i + 1 - RECENT - SINKS) // page  # candidate pages of query i
        if n < 2:
            continue
        qi = q[:, i].float().view(hk, g, d)
        att = torch.softmax(torch.einsum("hgd,htd->hgt", qi, k[:, :i + 1].float()) * scaling, dim=-1)
        mass = att[..., SINKS:SINKS + n * page].reshape(hk, g, n, page).sum(-1)  # (Hk, G, n)
        s = scores(qi[None], boxes[None, :, :n], scaling)[0]  # (Hk, n)
        chosen = torch.zeros(hk, n, dtype=torch.bool)
        chosen.scatter_(1, s.topk(max(1, round(fraction * n)), dim=-1).indices, True)
        top = mass.max(-1)
        hit = top.values >= concentrated  # (Hk, G)
        events += int(hit.sum())
        misses += int((hit & ~chosen.gather(1, top.indices)).sum())
    return events, misses


def sparse_miss_rates(model, ids: torch.Tensor, *, queries: int = 256, page: int = 32,
                      fraction: float = AUTO_FRACTION, score: str = "minmax") -> list[tuple[int, int]]:
    """Per decoder layer, ``(events, misses)`` of the page rule on the prefill of ``ids`` (module docstring);
    arguments as :func:`calibrate_sparse`."""
    from .calibration import capture_qkv

    _check(model, ids, queries, page, fraction, score)

    def each(i, q, k, v):
        if not (torch.isfinite(q).all() and torch.isfinite(k).all()):
            raise ValueError(f"ids: calibration saw non-finite queries or keys in layer {i}; nothing chosen")
        scaling = getattr(model.model.layers[i].self_attn, "scaling", q.shape[-1] ** -0.5)
        return page_misses(q[0], k[0], scaling, queries=queries, page=page, fraction=fraction, score=score)

    return capture_qkv(model, ids, each)


def calibrate_sparse(model, ids: torch.Tensor, *, queries: int = 256, page: int = 32,
                     fraction: float = AUTO_FRACTION, score: str = "minmax", threshold: float = THRESHOLD,
                     min_events: int = MIN_EVENTS) -> list[int]:
    """The layers of ``model`` whose page choice misses the page a head attends to (module docstring), to read in
    full: ``kvslim.apply(model, "int4", sparse_budget="auto", sparse_dense_layers=calibrate_sparse(model, ids))``.

    One prefill of ``ids`` (post-RoPE queries and keys captured layer by layer, nothing else kept) and, per layer,
    the rule over the last ``queries`` queries: ~75 s for Qwen2.5-Coder-0.5B over 8,192 tokens on 2 CPU cores.
    Measured with 8,192 tokens of the shipped development text (``kvslim/data/botchan.txt``); at 4,096 a layer
    near the threshold (Qwen's layer 7) fell below it.

    Args:
        model: a Llama-style causal LM (``q_proj``/``k_proj``/``v_proj``).
        ids: (1, T) token ids; T must leave at least 64 candidate pages (``4 + 128 + 64·page`` rows) before the
            first measured query.
        queries: the last queries of the prefill measured.
        page, score: the ``sparse_page`` and ``sparse_score`` the layers will run with.
        fraction: the share of candidate pages a step chooses (``sparse_budget="auto"``: an eighth).
        threshold: the share of missed events from which a layer reads in full.
        min_events: events a layer needs before its share counts.
    Raises:
        ValueError naming the argument for anything else.
    """
    if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or not 0 <= threshold <= 1:
        raise ValueError(f"threshold must be a number in [0, 1] (the share of missed events), got {threshold!r}")
    if not isinstance(min_events, int) or isinstance(min_events, bool) or min_events < 0:
        raise ValueError(f"min_events must be an int >= 0, got {min_events!r}")
    return choose(sparse_miss_rates(model, ids, queries=queries, page=page, fraction=fraction, score=score),
                  threshold, min_events)


def choose(rates: list[tuple[int, int]], threshold: float = THRESHOLD, min_events: int = MIN_EVENTS) -> list[int]:
    """The layers of ``rates`` (:func:`sparse_miss_rates`) that read in full: ``misses ≥ threshold · events`` over at
    least ``min_events`` events (and one)."""
    return [i for i, (events, misses) in enumerate(rates)
            if events >= max(min_events, 1) and misses >= threshold * events]


def _check(model, ids, queries, page, fraction, score) -> None:
    from .calibration import check_ids, check_model

    if not isinstance(queries, int) or isinstance(queries, bool) or queries <= 0:
        raise ValueError(f"queries must be a positive int, got {queries!r}")
    if not isinstance(page, int) or isinstance(page, bool) or page < 16 or page & (page - 1):
        raise ValueError(f"page must be a power of two of at least 16 (sparse_page), got {page!r}")
    if not isinstance(fraction, (int, float)) or isinstance(fraction, bool) or not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1] (the share of pages a step chooses), got {fraction!r}")
    if score not in SCORES:
        raise ValueError(f"score must be one of {list(SCORES)}, got {score!r}")
    check_ids(ids)
    need = SINKS + RECENT + MIN_PAGES * page + queries
    if ids.shape[1] < need:
        raise ValueError(f"ids: {ids.shape[1]} tokens are too few: {MIN_PAGES} candidate pages of {page} before "
                         f"the {queries} measured queries need at least {need} (e.g. 8,192 tokens of "
                         f"kvslim/data/botchan.txt)")
    check_model(model, "calibrate_sparse")
