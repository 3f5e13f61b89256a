"""Sparse decode on a capturable layer's static path (``caches/capture.py``): :mod:`kvslim.attention.sparse`'s choice
with every shape fixed by the layer's capacity and every decision made on the device, so that
``torch.compile(fullgraph=True)`` traces one graph for every step and a CUDA graph replays it at any length
(docs/sparse.md, "Captured steps"). :func:`static_table` lists the pages, :func:`decode_static` attends through them
(the ops read the table in place), :func:`static_reference` is the twin.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..caches.sparse import SparseKV
from ..caches.turbo import TurboStore
from . import quant
from .sparse import _gather_rows, take_rows


def decode_static(h: SparseKV, query: torch.Tensor, attention_mask: torch.Tensor | None,
                  scaling: float | None) -> torch.Tensor:
    """A static sparse step (a capturable layer, ``caches/capture.py``): :func:`decode`'s choice with every shape
    fixed by the layer's capacity and every decision made on the device, so that ``torch.compile(fullgraph=True)``
    traces it once and a CUDA graph replays it at any length. :func:`static_table` lists the pages; the int8/int4,
    low-bit and turbo ops (C++ or Triton) read them in place, the step's logical rows cut per sequence by
    ``lengths``; a dense layer gathers them for SDPA; anything else goes through :func:`static_reference`."""
    b, heads, _, d = query.shape
    hk = h.stats.boxes.shape[1]
    q = query.float().reshape(b, hk, heads // hk, d)
    scaling = d ** -0.5 if scaling is None else float(scaling)
    t = static_table(h, q, attention_mask, scaling)
    table, rows, mask = t.table, t.rows, t.mask
    p, off = h.stats.spec.page, h.stats.offset
    n = table.shape[-1] * p
    if h.fused is None:
        pos, live = _static_positions(h, table, rows)
        k, v = take_rows(h.keys, pos), take_rows(h.values, pos)
        add = _static_mask(live, mask, pos)
        out = F.scaled_dot_product_attention(query.reshape(b, hk, heads // hk, d), k, v, attn_mask=add.to(query.dtype),
                                             scale=scaling)
        return out.reshape(b, heads, 1, d).transpose(1, 2).contiguous()
    f = h.fused
    logical = torch.zeros(b, n, dtype=torch.float32, device=q.device)
    if mask is not None:  # one row per sequence: the op's mask is (B, rows), the same for every head
        full = mask.expand(b, mask.shape[-1])
        j = torch.arange(n, device=q.device)
        start = (t.valid * p)[:, None]  # the region's rest: the same positions in every head
        rest = (off + t.cand[:, None] * p + j[None] - start).clamp(0, full.shape[-1] - 1)
        logical = torch.where(j[None] >= start, full.gather(1, rest), logical)
        # the chosen pages other than a forced first one are whole visible pages (static_table): zeros; a forced
        # first visible page (a left-padded row's sinks) is first in every head's list: its own columns
        cols = (off + t.first[:, None] * p + torch.arange(p, device=q.device)).clamp(max=full.shape[-1] - 1)
        logical[:, :p] = torch.where(t.forced[:, None], full.gather(1, cols), logical[:, :p])
    tail = torch.zeros(b, f.k_tail.shape[2], dtype=torch.float32, device=q.device)
    if f.columns is not None:  # the sinks and the ring window (caches/capture_residual.py): their own columns
        tcols = f.columns[f.n:]
        picked = tail if mask is None else mask.expand(b, mask.shape[-1])[:, tcols.clamp_min(0)]
        tail = torch.where(tcols[None] >= 0, picked, float("-inf"))
    # rows past a sequence's count are cut by ``lengths`` (the int ops skip them) and, for the turbo op, which
    # takes no lengths beside a page list, by the mask
    turbo = isinstance(f.k, TurboStore)
    if turbo:
        logical = logical.masked_fill(torch.arange(n, device=q.device)[None] >= rows[:, None], float("-inf"))
    g = dataclasses.replace(f, n=n, pages=table, page=p, lengths=None if turbo else rows, columns=None,
                            static=False, listed_mask=torch.cat((logical, tail), dim=1))
    whole = f.k.data.shape[2] % p == 0 and f.v.data.shape[2] % p == 0  # the ops read whole pages
    out = quant.decode(g, query, None, scaling) if whole else None
    return out if out is not None else static_reference(h, query, attention_mask, scaling, (table, rows))


class StaticTable(NamedTuple):
    """:func:`static_table`'s result: ``table`` (B, H, k + E) page ids, ``rows`` (B,) logical rows to read,
    ``first`` (B,) each sequence's first visible page, ``forced`` (B,) whether it is forced (first in every head's
    list), ``valid`` (B,) chosen pages (``min(candidates, k)``), ``cand`` (B,) candidate pages (the region's rest
    starts after them), ``mask`` HF's mask as additive (B|1, tokens) or ``None``."""

    table: torch.Tensor
    rows: torch.Tensor
    first: torch.Tensor
    forced: torch.Tensor
    valid: torch.Tensor
    cand: torch.Tensor
    mask: torch.Tensor | None


def static_table(h: SparseKV, q: torch.Tensor, attention_mask, scaling: float) -> StaticTable:
    """A static step's page table (:class:`StaticTable`).

    With ``L`` the tokens visible at this step, the candidates are the complete pages of :func:`~kvslim.caches.
    sparse.candidate_pages` (``min((L − offset) // page, (L − window) // page)``); under a mask only whole visible
    pages, and a sequence's first visible page where it is forced (the sinks are in the pages, or the row is
    left-padded: its first visible page stands in for them), so that every chosen page but a forced first one is
    attended whole (a left-padded batch chooses among the same pages as :func:`decode`). Every page of the capacity
    is scored (the non-candidates' bounds ``−inf`` before each head's log-softmax, so the candidates' scores are
    :func:`decode`'s) and the ``k`` best kept (``k`` fixed by the budget at ``max_length``). The table: the chosen
    pages ascending, then the pages after the candidates (the region's rest, ``E`` entries: enough for the window
    and a page), then anything (clamped into the buffer); ``rows``: the logical rows to read per sequence,
    ``min(candidates, k)·page`` + the region's rows after the candidates. When the candidates fit ``k`` that is
    every stored row (the full read's rows, not bitwise its sums)."""
    from ..kernels.sparse_select import values

    st, spec = h.stats, h.stats.spec
    p, off, npg, k = spec.page, st.offset, h.pages, h.k
    b, dev = q.shape[0], q.device
    length = h.length
    idx = torch.arange(npg, device=dev)
    n_cand = torch.minimum((length - off).clamp_min(0) // p, (length - spec.window).clamp_min(0) // p)  # (B,)
    cand = idx[None] < n_cand[:, None]  # (B, P)
    total = h.tokens
    mask = quant.additive_mask(attention_mask, total)
    if mask is False:
        raise ValueError("sparse decode: an attention mask of this shape is not supported (one query token, "
                         f"(B, 1, 1, {total}) expected), got {tuple(attention_mask.shape)}")
    first = torch.zeros(b, dtype=torch.int64, device=dev)
    force = torch.full((b,), spec.sinks_in_pages, dtype=torch.bool, device=dev)
    if mask is not None:
        full = mask.expand(b, total)
        region = F.pad(full[:, off:], (0, npg * p - (total - off)), value=float("-inf"))
        visible = torch.isfinite(region).reshape(b, npg, p)
        seen = visible.any(-1)
        first = seen.to(torch.int64).argmax(-1)
        if off:  # a row whose own sinks are padding
            force = force | ~torch.isfinite(full[:, 0])
        forced = force & (cand & seen).gather(1, first[:, None])[:, 0]
        cand = cand & (visible.all(-1) | ((idx[None] == first[:, None]) & forced[:, None]))
    else:
        forced = force & cand[:, 0]
    if _static_triton(q, st.boxes, st.scales):
        # one kernel over [first, candidates) (the int8 boxes converted as loaded: no fp32 copy of the whole
        # capacity's boxes), then the candidates' mask: under a mask with holes (not a left padding) a page inside
        # that range but hidden in part counts in its heads' log-softmax, unlike the eager step; never chosen
        from ..kernels.triton import sparse_select as ts

        lo = first if mask is not None else None
        s = ts.op()(q.contiguous(), st.boxes, npg, scaling, st.scales, lo, n_cand)
        s = torch.where(cand[:, None], s, float("-inf"))
    else:
        bound = torch.matmul(torch.cat((q, q.abs()), dim=-1), values(st.boxes, st.scales).transpose(-1, -2))
        bound = (bound * scaling).masked_fill(~cand[:, None, None], float("-inf"))
        s = torch.where(cand[:, None], torch.log_softmax(bound, dim=-1).logsumexp(dim=2), float("-inf"))  # (B, H, P)
    hit = first.view(b, 1, 1).expand(b, s.shape[1], 1)
    s = s.scatter(2, hit, torch.where(forced.view(b, 1, 1), float("inf"), s.gather(2, hit)))
    top = s.topk(k, dim=-1)
    chosen = torch.where(torch.isneginf(top.values), top.indices + npg, top.indices).sort(dim=-1).values
    extra = -(-(spec.window + p) // p) + 1
    valid = cand.sum(-1).clamp(max=k)
    nv = valid.view(b, 1, 1)
    j = torch.arange(k + extra, device=dev)
    table = torch.where(j < nv, F.pad(chosen, (0, extra)), n_cand.view(b, 1, 1) + (j - nv))
    slots = h.fused.k.data.shape[2] if h.fused is not None else h.keys.shape[2]
    table = table.clamp(0, -(-slots // p) - 1)  # a last page cut by the buffer: read by the twin (decode_static)
    rows = valid * p + (h.stored - n_cand * p).clamp_min(0)
    return StaticTable(table, rows, first, forced, valid, n_cand, mask)


def _static_triton(q: torch.Tensor, boxes: torch.Tensor, scales: torch.Tensor | None) -> bool:
    """Whether a static step scores its pages with the Triton kernel: the queries' device runs Triton (CUDA, or
    ``KVSLIM_BACKEND=triton`` under the interpreter), unit last strides."""
    from ..kernels import backend

    return (backend.pick(q.device, False) == "triton" and boxes.stride(-1) == 1
            and (scales is None or scales.stride(-1) == 1))


def _static_positions(h: SparseKV, table: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A static step's rows in the layer's temporal order, ``(positions (B, H, R) int64, live (B, H, R) bool)``:
    the table's logical rows (region slot + offset; live below ``rows``), then a coded layer's tail (a capturable
    residual layout's sinks and ring by their columns; else the step's own token, at ``length − 1``)."""
    p, off = h.stats.spec.page, h.stats.offset
    b, hk, m = table.shape
    j = torch.arange(m * p, device=table.device)
    live = (j[None] < rows[:, None])[:, None].expand(b, hk, m * p)
    pos = (off + table.repeat_interleave(p, dim=-1) * p + j % p).clamp(max=h.tokens - 1)  # (past it: never live)
    f = h.fused
    if f is None:
        return pos, live
    if f.columns is not None:
        tcols = f.columns[f.n:].view(1, 1, -1).expand(b, hk, -1)
        tpos, tlive = tcols.clamp_min(0), tcols >= 0
    else:
        tpos = (h.length - 1).view(b, 1, 1).expand(b, hk, 1)
        tlive = torch.ones_like(tpos, dtype=torch.bool)
    return torch.cat((pos, tpos), dim=-1), torch.cat((live, tlive), dim=-1)


def _static_mask(live: torch.Tensor, mask: torch.Tensor | None, pos: torch.Tensor) -> torch.Tensor:
    """(B, H, 1, R) additive fp32: ``−inf`` where not ``live``, plus HF's mask at the positions."""
    add = torch.zeros(live.shape, dtype=torch.float32, device=live.device).masked_fill(~live, float("-inf"))
    if mask is not None:
        b, hk, r = pos.shape
        add = add + mask.expand(b, mask.shape[-1])[:, None].expand(b, hk, -1).gather(2, pos)
    return add[:, :, None]


def static_reference(h: SparseKV, query: torch.Tensor, attention_mask, scaling: float | None,
                     listed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The twin of :func:`decode_static`: the layer's static full reads (every position, ``FusedKV.materialize``;
    a dense layer's buffers), the listed rows gathered, fp32 softmax under HF's mask. ``listed``: ``(table, rows)``
    when the caller has them."""
    b, heads, _, d = query.shape
    hk = h.stats.boxes.shape[1]
    q = query.float().reshape(b, hk, heads // hk, d)
    scaling = d ** -0.5 if scaling is None else float(scaling)
    mask = quant.additive_mask(attention_mask, h.tokens)
    if listed is None:
        t = static_table(h, q, attention_mask, scaling)
        table, rows, mask = t.table, t.rows, t.mask
    else:
        table, rows = listed
    pos, live = _static_positions(h, table, rows)
    keys, values = h.fused.materialize() if h.fused is not None else (h.keys, h.values)
    k, v = _gather_rows(keys, pos).float(), _gather_rows(values, pos).float()
    scores = torch.einsum("bhgd,bhtd->bhgt", q, k) * scaling + _static_mask(live, mask, pos)
    out = torch.einsum("bhgt,bhtd->bhgd", torch.softmax(scores, dim=-1), v)
    return out.reshape(b, 1, heads, d).to(query.dtype)
