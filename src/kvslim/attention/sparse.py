"""Sparse decode attention: score a layer's pages against the step's query, attend over the chosen rows.

A single-token step of a layer with :class:`~kvslim.caches.sparse.SparseSpec` whose paged region holds more pages
than the budget allows hands attention a :class:`~kvslim.caches.sparse.SparseKV` (marker tensors, like the fused
quantized path). Per sequence and KV head (one choice for the G query heads of the group):

    s_gp    = scaling · (q_g · c_p + |q_g| · r_p)             (each head's bound on the page's best q·k, fp32)
    score_p = logsumexp_g (s_gp − logsumexp_p' s_gp')         (the group's summed estimated attentions, in logs)
    pages   = top-(k) of score (page 0 forced when it holds the sinks), ascending
    rows    = the pages' rows, then the rest of the region (the newest part of a page, the window rows inside it)

(one ``kvslim::sparse_select`` call on CPU) and attends over exactly those rows plus the layer's tail (sinks and
full-precision window, the step's token) with the math a full read uses (int8/int4/int3/int2 and turbo: the C++
op, or on CUDA the Triton kernel, through the page list; dense: SDPA with packed GQA queries over gathered rows;
other coded layers: the fused op over gathered codes; a masked step: only the chosen rows dequantized, fp32
attention with the mask; anything else: :func:`reference`). All on the device: no host synchronisation, no
process-wide state changed.

:func:`reference` is the twin: the layer's own full reads (dequantized), the same rows gathered, fp32 softmax.
"""

from __future__ import annotations

import copy
import dataclasses
import weakref

import torch
import torch.nn.functional as F

from ..caches.sparse import SparseKV
from ..caches.turbo import TurboStore
from ..kernels import sparse_select
from . import quant


def page_scores(q: torch.Tensor, boxes: torch.Tensor, scaling: float, scales: torch.Tensor | None = None
                ) -> torch.Tensor:
    """(B, H, G, D) fp32 queries, (B, H, P, 2D) boxes (int8 with their ``scales``, or values) -> (B, H, P) fp32
    scores, one per page for the KV head's
    group: each query head's bound ``q·c + |q|·r`` (fp32; fp16 products lose the ranking under Qwen-like key
    offsets) made an estimated attention over the pages (a log-softmax at the step's ``scaling``), combined over
    the group as the log of their sum (``logsumexp``: the ranking of the summed attentions, without the underflow
    that ties every page a head does not look at). A head that retrieves (its attention on one page) keeps that
    page near the top however the other heads of its group spread theirs; summing the raw bounds let the group's
    larger-normed heads outvote it (measured: ``benchmarks/bench_sparse_select.py``, docs/sparse.md). The torch
    form; ``kvslim::sparse_select`` computes the same in one call."""
    return sparse_select.scores(q, boxes, scaling, scales)


def select(h: SparseKV, q: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
    """Region rows a step reads: (B, H, R) int64 on the device, ascending (``q``: (B, H, G, D) fp32)."""
    return rows_of(h, select_pages(h, q, scaling))


def select_pages(h: SparseKV, q: torch.Tensor, scaling: float | None = None, rest: int = 0) -> torch.Tensor:
    """The pages a step reads: (B, H, k + rest) int64 on the device, the chosen ``k`` ascending, then the ``rest``
    pages after the candidates (``q``: (B, H, G, D) fp32; ``scaling``: the attention's, default ``D ** -0.5``).
    One ``kvslim::sparse_select`` call on CPU (the torch twin elsewhere). With ``select="prompt"`` the cache hands
    the choice to read (``h.kept``, pages completed since appended) or a buffer of its own to write a new one into."""
    spec = h.stats.spec
    n_pages = h.pages
    if h.kept is not None and not h.choose:
        since = h.stats.kept_pages
        new = torch.arange(since, n_pages + rest, device=q.device).expand(*h.kept.shape[:2], n_pages + rest - since)
        return torch.cat((h.kept, new), dim=-1)
    scaling = q.shape[-1] ** -0.5 if scaling is None else float(scaling)
    idx = sparse_select.sparse_select(q, h.stats.boxes, n_pages, h.k, scaling, spec.sinks_in_pages, rest,
                                      scales=h.stats.scales)
    if h.kept is not None:
        h.kept.copy_(idx[..., :h.kept.shape[-1]])  # the cache's buffer (its shape and page count set by the cache)
    return idx


def rows_of(h: SparseKV, idx: torch.Tensor) -> torch.Tensor:
    """Pages (B, H, k) -> region rows (B, H, k·page + the rest of the region after the candidate pages)."""
    p, n_pages = h.stats.spec.page, h.pages
    b, hk, k = idx.shape
    rows = (idx[..., None] * p + torch.arange(p, device=idx.device)).reshape(b, hk, k * p)
    rest = torch.arange(n_pages * p, h.n, device=idx.device).expand(b, hk, h.n - n_pages * p)
    return torch.cat((rows, rest), dim=-1)


def decode(h: SparseKV, query: torch.Tensor, attention_mask: torch.Tensor | None,
           scaling: float | None) -> torch.Tensor:
    """Attention output (B, 1, H, D) in the query's dtype for a step's query (B, H, 1, D)."""
    if h.static:
        raise ValueError("a capturable layer's sparse step: attention/sparse_static.decode_static reads it")
    b, heads, _, d = query.shape
    hk = h.fused.k.data.shape[1] if h.fused is not None else h.keys.shape[1]
    q = query.float().reshape(b, hk, heads // hk, d)
    p = h.stats.spec.page
    if attention_mask is None and h.fused is not None and _in_place(h.fused, p):
        # int8/int4/int3/int2 and turbo on the C++ ops: one call chooses the pages, lists the region's rest after
        # them and attends through the list (the codes read where they are; other backends choose first)
        lo, extra = h.pages * p, -(-(h.n - h.pages * p) // p)
        listed, k = _page_list(h, q, scaling, extra)
        f = dataclasses.replace(h.fused, n=k * p + h.n - lo, lengths=None, page=p, **listed)
        out = quant.decode(f, query, None, scaling)
        if out is not None:
            return out
        idx = select_pages(h, q, scaling)
        return reference(h, query, None, scaling, rows_of(h, idx), _chosen_reads(h, idx))
    if attention_mask is not None:
        return _masked(h, query, q, attention_mask, scaling)
    idx = select_pages(h, q, scaling)
    picked = _picked(h, idx)
    if h.fused is None:
        return _dense(picked, query, scaling)
    if picked is not None:  # None: a format whose op reads per-slot tables (the twin below)
        out = quant.decode(picked, query, None, scaling)
        if out is not None:  # None: a store the fused op declines (the twin below, over the same rows)
            return out
    return reference(h, query, None, scaling, rows_of(h, idx), _chosen_reads(h, idx))


def _page_list(h: SparseKV, q: torch.Tensor, scaling, rest: int) -> tuple[dict, int]:
    """The page list of an unmasked step through a decode op, and how many pages it reads before the region's
    ``rest``: the choice made earlier (``select="prompt"``: the kept pages and every page completed since, so more
    than the budget's), or the boxes for the op to choose from in its own call (the budget's pages; the choice
    written into the cache's buffer when the cache keeps one)."""
    if h.kept is not None and not h.choose:
        listed = select_pages(h, q, scaling, rest)
        return {"pages": listed}, listed.shape[-1] - rest
    return {"select": sparse_select.PageChoice(q, h.stats.boxes, h.stats.scales, h.pages, h.k,
                                               h.stats.spec.sinks_in_pages, rest, h.kept)}, min(h.k, h.pages)


def _masked(h: SparseKV, query: torch.Tensor, q: torch.Tensor, attention_mask, scaling) -> torch.Tensor:
    """A step with an attention mask (a padded batch): pages wholly masked are never chosen, each row's first
    visible page is forced (its sinks: a left-padded row's real first tokens), and the chosen rows alone are read.
    Left padding (each row's visible pages a suffix) on the C++ ops: one ``sparse_select`` call over each row's
    visible pages, then the op through the page list with the codes in place (:func:`_masked_in_place`); any other
    mask: the selection in torch and the twin over the chosen rows (a coded layer dequantizes only them)."""
    total = h.tokens
    spec, off, p = h.stats.spec, h.stats.offset, h.stats.spec.page
    b = q.shape[0]
    mask, page_seen, first_page = _mask_pages(h, attention_mask, total, b)
    if h.kept is not None and not h.choose:  # select="prompt": the choice made at the first step (no padding page)
        idx = select_pages(h, q, scaling)
        return reference(h, query, attention_mask, scaling, rows_of(h, idx), _chosen_reads(h, idx))
    scaling_f = q.shape[-1] ** -0.5 if scaling is None else float(scaling)
    # the sinks: page 0 where the layer keeps them in its pages, else its own full-precision sinks; a row whose
    # first tokens are padding gets its first visible page instead
    force = torch.full((b,), spec.sinks_in_pages, dtype=torch.bool, device=q.device)
    if off:  # column 0 alone (isfinite over the whole (B, T) mask was ~0.3 ms a layer at 32k × 8)
        force |= ~torch.isfinite(mask.expand(b, total)[:, 0])
    k = min(h.k, h.pages)
    pages = torch.arange(h.pages, device=q.device)
    left = bool((page_seen == (pages[None] >= first_page[:, None])).all()) and bool((h.pages - first_page >= k).all())
    if left:  # left padding: the op's (or its twin's) selection over each row's visible pages
        extra = -(-(h.n - h.pages * p) // p)
        listed = sparse_select.sparse_select(q, h.stats.boxes, h.pages, k, scaling_f, False, extra, first_page, force,
                                             h.stats.scales)
        idx = listed[..., :k]
        if h.kept is not None:  # select="prompt": the cache's buffer, read by the steps after this one
            h.kept.copy_(idx)
        if h.fused is not None and _in_place(h.fused, p):
            out = _masked_in_place(h, query, mask, listed, k, first_page, scaling)
            if out is not None:
                return out
        if h.fused is None:  # dense: the chosen pages' rows gathered, SDPA with the per-sequence mask
            return _masked_dense(h, query, mask, idx, first_page, scaling)
        return reference(h, query, attention_mask, scaling, rows_of(h, idx), _chosen_reads(h, idx))
    scores = page_scores(q, h.stats.boxes[:, :, :h.pages], scaling_f, h.stats.scales)  # (B, H, P)
    scores = scores.masked_fill(~page_seen[:, None], float("-inf"))
    hit = first_page.view(b, 1, 1).expand(b, scores.shape[1], 1)
    now = scores.gather(2, hit)
    scores.scatter_(2, hit, torch.where(force.view(b, 1, 1), torch.full_like(now, float("inf")), now))
    idx = scores.topk(k, dim=-1).indices.sort(dim=-1).values
    if h.kept is not None:
        h.kept.copy_(idx)
    return reference(h, query, attention_mask, scaling, rows_of(h, idx), _chosen_reads(h, idx))


def _mask_pages(h: SparseKV, attention_mask: torch.Tensor, total: int, b: int):
    """A step's mask as the sparse step reads it: ``(additive mask (B|1, total), page_seen (B, P) bool: a page with a
    visible row, first_page (B,) int64: the first such page)``. Computed once per step: the layers of one cache see
    the same mask tensor, so the result is kept in the cache's scratch pool under that tensor's identity, its
    version counter (an inference-mode tensor has none), its storage and the step's layout, the visible length
    among them (one more every step): a mask changed in place between steps is read again; one changed in place
    between the layers of a step is not (HF builds a step's mask once). At 32k × 8 the mask's passes took ~0.9 ms
    a layer."""
    off, p, pages = h.stats.offset, h.stats.spec.page, h.pages
    pool = None if torch.compiler.is_compiling() else h.scratch  # (a traced step recomputes it)
    version = None if pool is None or attention_mask.is_inference() else attention_mask._version
    key = None if pool is None else (version, attention_mask.data_ptr(), tuple(attention_mask.shape), total, off, p,
                                      pages, b)
    if pool is not None:
        hit = pool.memo.get("sparse_mask")
        if hit is not None and hit[0]() is attention_mask and hit[1] == key:
            return hit[2]
    mask = quant.additive_mask(attention_mask, total)
    if mask is False:
        raise ValueError("sparse decode: an attention mask of this shape is not supported (one query token, "
                         f"(B, 1, 1, {total}) expected), got {tuple(attention_mask.shape)}")
    visible = torch.isfinite(mask).expand(b, total)[:, off:off + pages * p].reshape(b, pages, p)
    page_seen = visible.any(-1)  # (B, P): a page with a visible row
    first_page = page_seen.float().argmax(-1)  # (B,): the first page holding a visible row
    out = (mask, page_seen, first_page)
    if pool is not None:
        pool.memo["sparse_mask"] = (weakref.ref(attention_mask), key, out)
    return out


def _masked_in_place(h: SparseKV, query: torch.Tensor, mask: torch.Tensor, listed: torch.Tensor, k: int,
                     first_page: torch.Tensor, scaling) -> torch.Tensor | None:
    """A left-padded step through the C++ op's page list (``listed``: the ``k`` chosen pages ascending, then the
    region's rest), the codes read in place. No head chose a padding page, and a padded row's first visible page
    (the only one partly padding) is forced in every head and so comes first in every head's list: the mask over
    the listed rows is one per sequence (the op's (B, rows) mask): that page's columns, zeros for the other chosen
    pages, the region's rest and the tail as HF's mask has them. (An unpadded row's first listed page, whatever it
    is, is all visible: its columns there are zeros too.)"""
    p, off, n = h.stats.spec.page, h.stats.offset, h.n
    b, total, lo = query.shape[0], h.tokens, h.pages * h.stats.spec.page
    full = mask.expand(b, total)
    logical = _listed_mask(h, full, k, first_page)
    virtual = torch.cat((full[:, :off], logical, full[:, off + n:]), dim=1)  # as HF's mask over the listed rows
    f = dataclasses.replace(h.fused, n=k * p + n - lo, lengths=None, pages=listed, page=p)
    return quant.decode(f, query, virtual, scaling)


def _listed_mask(h: SparseKV, full: torch.Tensor, k: int, first_page: torch.Tensor) -> torch.Tensor:
    """HF's additive mask (B, tokens) over a left-padded step's listed region rows (the ``k`` chosen pages, then the
    region's rest): the first listed page is each sequence's first visible page in every head (the only one partly
    padding; an unpadded row's is all visible either way), the other chosen pages are all visible."""
    p, off, lo = h.stats.spec.page, h.stats.offset, h.pages * h.stats.spec.page
    cols = off + first_page[:, None] * p + torch.arange(p, device=full.device)  # (B, page)
    return torch.cat((full.gather(1, cols), full.new_zeros(full.shape[0], (k - 1) * p), full[:, off + lo:off + h.n]),
                     dim=1)


def _masked_dense(h: SparseKV, query: torch.Tensor, mask: torch.Tensor, idx: torch.Tensor, first_page: torch.Tensor,
                  scaling) -> torch.Tensor:
    """A left-padded step of a dense layer: the chosen pages and every row after them gathered (as an unmasked step
    does), SDPA with the listed rows' mask, one per sequence (:func:`_listed_mask`)."""
    b, total = query.shape[0], h.tokens
    full = mask.expand(b, total)
    k, v = _picked(h, idx)
    rows = torch.cat((_listed_mask(h, full, idx.shape[-1], first_page), full[:, h.n:]), dim=1)  # + the step's token
    heads, d, hk = query.shape[1], query.shape[-1], k.shape[1]
    packed = query.reshape(b, hk, heads // hk, d)
    out = F.scaled_dot_product_attention(packed, k, v, attn_mask=rows[:, None, None, :].to(query.dtype),
                                         scale=scaling)
    return out.reshape(b, heads, 1, v.shape[-1]).transpose(1, 2).contiguous()


def _chosen_reads(h: SparseKV, idx: torch.Tensor):
    """(keys, values) (B, H, R, D) of the rows a step reads, in temporal order (sinks, chosen pages, the region's
    rest, the tail), dequantizing only those rows; ``None`` where only the layer's full reads can say (turbo
    codes, rings)."""
    from ..caches.storage import QuantizedStore

    f = h.fused
    if f is None:
        return None
    if not (isinstance(f.k, QuantizedStore) and isinstance(f.v, QuantizedStore)) or f.ring is not None \
            or f.columns is not None or f.static or f.k_tail is None:
        return None
    p = h.stats.spec.page
    rest = (h.pages * p, h.n)
    n = idx.shape[-1] * p + h.n - rest[0]
    gk, gv = _gathered(f.k, idx, p, rest, None, ""), _gathered(f.v, idx, p, rest, None, "")
    rk, rv = gk.read(0, n).float(), gv.read(0, n).float()
    kt, vt = f.k_tail.float(), f.v_tail.float()
    if f.k_tail_rotated:
        kt = kt @ f.k.rotation.T.float()
    if f.v_tail_rotated:
        vt = vt @ f.v.rotation.T.float()
    lead = f.lead
    return (torch.cat((kt[:, :, :lead], rk, kt[:, :, lead:]), dim=2),
            torch.cat((vt[:, :, :lead], rv, vt[:, :, lead:]), dim=2))


def take_pages(t: torch.Tensor, idx: torch.Tensor, page: int, rest: tuple[int, int], out=None) -> torch.Tensor:
    """``t`` (B, H, slots, X) -> (B, H, k·page + rest rows, X): pages ``idx`` (B, H, k) of ``page`` slots each, then
    slots ``[rest[0], rest[1])`` (page-aligned at ``rest[0]``; the same for every head). One ``index_select`` of whole
    pages (page·X contiguous values each; the rest as pages too, the last one cut) when ``t``'s rows are contiguous
    and its heads page-aligned in a buffer holding the last page, else row by row. ``out``: (ScratchPool, role) to
    gather into a reused buffer (a fresh one page-faults: ~2.5× slower measured here)."""
    b, h, slots, x = t.shape
    s0, s1, s2, s3 = t.stride()
    ps = page * s2
    lo, hi = rest
    k, extra = idx.shape[-1], -(-(hi - lo) // page)
    rows = k * page + hi - lo
    if s3 == 1 and s2 == x and s0 % ps == 0 and s1 % ps == 0 and lo % page == 0:
        n = (b - 1) * (s0 // ps) + (h - 1) * (s1 // ps) + lo // page + extra
        if t.storage_offset() + n * ps <= t.untyped_storage().nbytes() // t.element_size():
            if extra:
                tail = torch.arange(lo // page, lo // page + extra, device=idx.device).expand(b, h, extra)
                idx = torch.cat((idx, tail), dim=-1)
            flat = t.as_strided((n, page * x), (ps, 1))
            base = (torch.arange(b, device=idx.device).view(b, 1, 1) * (s0 // ps)
                    + torch.arange(h, device=idx.device).view(1, h, 1) * (s1 // ps))
            sel = (idx + base).reshape(-1)
            if out is not None and not torch.is_grad_enabled():
                buf = out[0].flat(out[1], sel.numel() * page * x, t.dtype, t.device).view(sel.numel(), page * x)
                picked = torch.index_select(flat, 0, sel, out=buf)
            else:
                picked = flat.index_select(0, sel)
            picked = picked.view(b, h, idx.shape[-1] * page, x)
            return picked[:, :, :rows]
    pages = (idx[..., None] * page + torch.arange(page, device=idx.device)).reshape(b, h, -1)
    after = torch.arange(lo, hi, device=idx.device).expand(b, h, hi - lo)
    return take_rows(t, torch.cat((pages, after), dim=-1))


def take_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``t`` (B, H, slots, X) at ``rows`` (B, H, R) -> (B, H, R, X): one ``index_select`` of whole rows over the
    buffer ``t`` views (a store's whole buffer, or a prefix of its slots; ``torch.gather`` with an expanded index
    ran ~10× slower here)."""
    b, h, slots, x = t.shape
    s0, s1, s2, s3 = t.stride()
    if s3 != 1 or s2 < x or s0 % s2 or s1 % s2:
        return t.gather(2, rows[..., None].expand(*rows.shape, x))
    n = (b - 1) * (s0 // s2) + (h - 1) * (s1 // s2) + slots  # rows of the underlying buffer up to t's last
    flat = t.as_strided((n, x), (s2, 1))
    base = (torch.arange(b, device=rows.device).view(b, 1, 1) * (s0 // s2)
            + torch.arange(h, device=rows.device).view(1, h, 1) * (s1 // s2))
    return flat.index_select(0, (rows + base).reshape(-1)).view(b, h, rows.shape[-1], x)


def _gathered(store, idx: torch.Tensor, page: int, rest: tuple[int, int], scratch, role: str):
    """A shallow copy of ``store`` whose tensors hold only pages ``idx`` and the ``rest`` slots (codes, scales,
    zero-points: the format's own bytes, never dequantized)."""
    out = copy.copy(store)
    out.set_tensors([take_pages(t, idx, page, rest, None if scratch is None else (scratch, f"{role}{i}"))
                     for i, t in enumerate(store.tensors())])
    return out


def _picked(h: SparseKV, idx: torch.Tensor):
    """What the fast paths attend: a coded layer's handle over the gathered codes, a dense layer's gathered (K, V);
    ``None`` for a format whose op reads per-slot tables (RoPE-centred turbo keys: the twin)."""
    p = h.stats.spec.page
    f = h.fused
    if f is None:
        rest, pool = (h.pages * p, h.keys.shape[2]), h.scratch
        return (take_pages(h.keys, idx, p, rest, None if pool is None else (pool, "sparse-k")),  # (B, Hk, R, D)
                take_pages(h.values, idx, p, rest, None if pool is None else (pool, "sparse-v")))
    if isinstance(f.k, TurboStore) and f.k.spec.rope_centred:
        return None
    rest = (h.pages * p, h.n)
    k, v = _gathered(f.k, idx, p, rest, h.scratch, "sparse-k"), _gathered(f.v, idx, p, rest, h.scratch, "sparse-v")
    return dataclasses.replace(f, k=k, v=v, n=idx.shape[-1] * p + rest[1] - rest[0], lengths=None)


def _in_place(f, page: int) -> bool:
    """Whether a kernel reads this layer's codes through a page list (nothing gathered): the C++ ops on CPU, the
    Triton kernels on CUDA (or on CPU under ``KVSLIM_BACKEND=triton`` with ``TRITON_INTERPRET=1``), for int8/int4
    codes of one width (``quant_decode``), asymmetric 2/3-bit codes (``quant_decode_lowbit``) or turbo codes
    (``turbo_decode``, RoPE-centred keys' bias rows by stored row), whole pages in the buffers."""
    from ..caches.storage import QuantizedStore
    from ..kernels import backend
    from ..kernels import quant_decode as qd
    from ..kernels import quant_decode_lowbit as ql
    from ..kernels import turbo_decode as td

    k, v = f.k, f.v
    dev = k.data.device.type
    if isinstance(k, TurboStore) and isinstance(v, TurboStore):  # kvslim.turbo_decode reads pages in place too
        if k.data.shape[2] % page or v.data.shape[2] % page or v.perm is not None or v.channel is not None:
            return False
        cpp = dev == "cpu" and k.dim % 8 == 0 and (k.spec.outliers or 0) % 8 == 0 and td._cpp_available()
        return backend.pick(dev, cpp) in ("cpp", "triton")
    if not (isinstance(k, QuantizedStore) and isinstance(v, QuantizedStore)
            and k.capacity % page == 0 and v.capacity % page == 0):
        return False
    kb, vb = k.spec.bits, v.spec.bits
    if kb == vb and kb in (4, 8):
        return qd._backend(dev) in ("cpp", "triton")
    return (kb in ql.BITS and vb in ql.BITS and k.zero is not None and v.zero is not None
            and ql._backend(dev) in ("cpp", "triton"))


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
    return take_rows(x, pos) if x.shape[:2] == pos.shape[:2] else x.gather(2, pos[..., None].expand(
        *pos.shape, x.shape[-1]))


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


def _dense(kv, query: torch.Tensor, scaling) -> torch.Tensor:
    """A dense layer: SDPA over the chosen pages and every row after them (the rest of the region, the step's
    token), the G query heads of a KV head packed as query rows (the dense full read's packed-GQA path)."""
    k, v = kv
    b, heads, _, d = query.shape
    hk = k.shape[1]
    packed = query.reshape(b, hk, heads // hk, d)
    out = F.scaled_dot_product_attention(packed, k, v, scale=scaling)  # (B, Hk, G, D)
    return out.reshape(b, heads, 1, v.shape[-1]).transpose(1, 2).contiguous()


def reference(h: SparseKV, query: torch.Tensor, attention_mask, scaling, rows: torch.Tensor | None = None,
              reads: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The twin: the layer's full reads (dequantized; ``FusedKV.materialize``), the chosen rows gathered, fp32
    softmax attention. ``rows``: the region rows to read (default: :func:`select`'s choice); ``reads``: the keys
    and values of exactly those rows in temporal order, when the caller has them (nothing else dequantized)."""
    b, heads, _, d = query.shape
    scaling = d ** -0.5 if scaling is None else float(scaling)
    if rows is None:
        hk = h.fused.k.data.shape[1] if h.fused is not None else h.keys.shape[1]
        rows = select(h, query.float().reshape(b, hk, heads // hk, d), scaling)
    total = h.tokens
    pos = _temporal(h, rows, total)
    if reads is None:
        keys, values = h.fused.materialize() if h.fused is not None else (h.keys, h.values)
        k, v = _gather_rows(keys, pos).float(), _gather_rows(values, pos).float()
    else:
        k, v = reads
    hk = k.shape[1]
    q = query.float().reshape(b, hk, heads // hk, d)
    scores = torch.einsum("bhgd,bhtd->bhgt", q, k) * scaling
    mask = _mask_rows(attention_mask, pos, total)
    if mask is not None:
        scores = scores + mask
    out = torch.einsum("bhgt,bhtd->bhgd", torch.softmax(scores, dim=-1), v)
    return out.reshape(b, 1, heads, d).to(query.dtype)
