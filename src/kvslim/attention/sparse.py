"""Sparse decode attention (issue 43): score a layer's pages against the step's query, attend over the chosen rows.

A single-token step of a layer with :class:`~kvslim.caches.sparse.SparseSpec` whose paged region holds more pages
than the budget allows hands attention a :class:`~kvslim.caches.sparse.SparseKV` (marker tensors, like the fused
quantized path). Per sequence and KV head (one choice for the G query heads of the group):

    score_p = Σ_g (q_g · c_p + |q_g| · r_p)                  (the box bound of the page's keys, fp32)
    pages   = top-(k) of score (page 0 forced when it holds the sinks), sorted
    rows    = the pages' rows, then the rest of the region (the newest part of a page, the window rows inside it)

and attends over exactly those rows plus the layer's tail (sinks and full-precision window, the step's token) with
the math a full read uses (dense: SDPA with packed GQA queries; coded layers: the fused decode op over the gathered
codes, no dequantized copy; anything else: :func:`reference`). All on the device: no host synchronisation.

:func:`reference` is the twin: the layer's own full reads (dequantized), the same rows gathered, fp32 softmax.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.nn.functional as F

from ..caches.sparse import SparseKV
from ..caches.turbo import TurboStore
from . import quant


def page_scores(q: torch.Tensor, centre: torch.Tensor, radius: torch.Tensor) -> torch.Tensor:
    """(B, H, G, D) queries against (B, H, P, D) page boxes -> (B, H, P) fp32 scores summed over the group."""
    c, r = centre.float(), radius.float()
    s = torch.einsum("bhgd,bhpd->bhgp", q, c) + torch.einsum("bhgd,bhpd->bhgp", q.abs(), r)
    return s.sum(dim=2)


def select(h: SparseKV, q: torch.Tensor) -> torch.Tensor:
    """Region rows a step reads: (B, H, R) int64 on the device, ascending (``q``: (B, H, G, D) fp32)."""
    st, spec = h.stats, h.stats.spec
    p, n_pages = spec.page, h.pages
    kept = st.kept
    if spec.select == "prompt" and kept is not None and kept[1] <= n_pages:
        idx, since = kept
        new = torch.arange(since, n_pages, device=q.device).expand(*idx.shape[:2], n_pages - since)
        idx = torch.cat((idx, new), dim=-1)
    else:
        scores = page_scores(q, st.centre[:, :, :n_pages], st.radius[:, :, :n_pages])
        if spec.sinks_in_pages:
            scores[..., 0] = float("inf")
        idx = scores.topk(min(spec.pages, n_pages), dim=-1).indices.sort(dim=-1).values
        if spec.select == "prompt":
            st.kept = (idx, n_pages)
    b, hk, k = idx.shape
    rows = (idx[..., None] * p + torch.arange(p, device=q.device)).reshape(b, hk, k * p)
    rest = torch.arange(n_pages * p, h.n, device=q.device).expand(b, hk, h.n - n_pages * p)
    return torch.cat((rows, rest), dim=-1)


def decode(h: SparseKV, query: torch.Tensor, attention_mask: torch.Tensor | None,
           scaling: float | None) -> torch.Tensor:
    """Attention output (B, 1, H, D) in the query's dtype for a step's query (B, H, 1, D)."""
    b, heads, _, d = query.shape
    hk = h.fused.k.data.shape[1] if h.fused is not None else h.keys.shape[1]
    q = query.float().reshape(b, hk, heads // hk, d)
    rows = select(h, q)
    if h.fused is not None and attention_mask is None:
        out = _coded(h, rows, query, scaling)
        if out is not None:
            return out
    if h.fused is None:
        return _dense(h, rows, query, attention_mask, scaling)
    return reference(h, query, attention_mask, scaling, rows)


def _gathered(store, rows: torch.Tensor):
    """A shallow copy of ``store`` whose tensors hold only ``rows`` (B, H, R) of its slots (codes, scales,
    zero-points: R rows each, the per-row bytes of the format, never dequantized)."""
    out = copy.copy(store)
    out.set_tensors([t.gather(2, rows[..., None].expand(*rows.shape, t.shape[-1])) for t in store.tensors()])
    return out


def _coded(h: SparseKV, rows: torch.Tensor, query: torch.Tensor, scaling) -> torch.Tensor | None:
    """The fused decode op over the gathered codes (``None``: a format whose op reads per-slot tables, e.g.
    RoPE-centred turbo keys, goes to the twin)."""
    f = h.fused
    if isinstance(f.k, TurboStore) and f.k.spec.rope_centred:
        return None
    g = dataclasses.replace(f, k=_gathered(f.k, rows), v=_gathered(f.v, rows), n=rows.shape[-1], lengths=None)
    return quant.decode(g, query, None, scaling)


def _temporal(h: SparseKV, rows: torch.Tensor, total: int) -> torch.Tensor:
    """Region rows (B, H, R) -> positions in the layer's temporal order (B, H, R + outside rows): the sinks before
    the region, the chosen rows, everything after the region (the window, the step's token)."""
    b, hk, _ = rows.shape
    off = h.stats.offset
    dev = rows.device
    head = torch.arange(off, device=dev).expand(b, hk, off)
    tail = torch.arange(off + h.n, total, device=dev).expand(b, hk, total - off - h.n)
    return torch.cat((head, rows + off, tail), dim=-1)


def _gather_rows(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return x.gather(2, pos[..., None].expand(*pos.shape, x.shape[-1]))


def _mask_rows(attention_mask, pos: torch.Tensor, total: int) -> torch.Tensor | None:
    """HF's decode mask -> additive fp32 (B|1, H, 1, R) over the gathered positions (or ``None``)."""
    mask = quant.additive_mask(attention_mask, total)
    if mask is None:
        return None
    if mask is False:
        raise ValueError("sparse decode: an attention mask of this shape is not supported (one query token, "
                         f"(B, 1, 1, {total}) expected), got {tuple(attention_mask.shape)}")
    b, hk, r = pos.shape
    return mask[:, None, :].expand(mask.shape[0], hk, total).gather(2, pos.expand(mask.shape[0], hk, r))[:, :, None]


def _dense(h: SparseKV, rows: torch.Tensor, query: torch.Tensor, attention_mask, scaling) -> torch.Tensor:
    """A dense layer: SDPA over the gathered rows, the G query heads of a KV head packed as query rows (the dense
    full read's packed-GQA path)."""
    total = h.keys.shape[2]
    pos = _temporal(h, rows, total)
    k, v = _gather_rows(h.keys, pos), _gather_rows(h.values, pos)  # (B, Hk, R', D)
    b, heads, _, d = query.shape
    hk = k.shape[1]
    packed = query.reshape(b, hk, heads // hk, d)
    mask = _mask_rows(attention_mask, pos, total)
    if mask is not None:
        mask = mask.to(query.dtype)
    out = F.scaled_dot_product_attention(packed, k, v, attn_mask=mask, scale=scaling)  # (B, Hk, G, D)
    return out.reshape(b, heads, 1, v.shape[-1]).transpose(1, 2).contiguous()


def reference(h: SparseKV, query: torch.Tensor, attention_mask, scaling, rows: torch.Tensor | None = None
              ) -> torch.Tensor:
    """The twin: the layer's full reads (dequantized; ``FusedKV.materialize``), the chosen rows gathered, fp32
    softmax attention. ``rows``: the region rows to read (default: :func:`select`'s choice)."""
    keys, values = h.fused.materialize() if h.fused is not None else (h.keys, h.values)
    b, heads, _, d = query.shape
    hk, total = keys.shape[1], keys.shape[2]
    scaling = d ** -0.5 if scaling is None else float(scaling)
    q = query.float().reshape(b, hk, heads // hk, d)
    if rows is None:
        rows = select(h, q)
    pos = _temporal(h, rows, total)
    k, v = _gather_rows(keys, pos).float(), _gather_rows(values, pos).float()
    scores = torch.einsum("bhgd,bhtd->bhgt", q, k) * scaling
    mask = _mask_rows(attention_mask, pos, total)
    if mask is not None:
        scores = scores + mask
    out = torch.einsum("bhgt,bhtd->bhgd", torch.softmax(scores, dim=-1), v)
    return out.reshape(b, 1, heads, d).to(query.dtype)
