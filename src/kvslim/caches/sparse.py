"""Query-aware sparse decode (Quest-class): per-page key statistics kept beside an append-only cache.

What it stores: for every complete page of ``page`` tokens of a layer's paged region, per sequence and KV head, a
box ``[c − r, c + r]`` around the page's post-RoPE keys (``c``, ``r``: (D,) each), computed once when the page's
last token is written, from the keys as given to ``update`` (full precision, before any quantization), and kept as
int8 codes with one fp16 scale per :data:`BOX_GROUP` channels: ``c`` relative to ``μ``, the centre of the layer's
first page (per sequence and KV head, fp32: Qwen-like keys carry offsets of hundreds on a few channels, shared by
every token, which would otherwise set every page's scale), ``r`` rounded up so that the box still contains what it
was computed from. A bound ``q·(μ + c) + |q|·r`` shifts by the same ``q·μ`` on every page of a query head, so the
ranking is the ranking of ``q·c + |q|·r`` (what the op scores). Memory: 2·D int8 + 2·D/16 fp16 per page per KV
head (``2.25·D/page`` bytes per token and head: at the default page 32, 5.2-5.8 % of an int4 cache's bytes, 0.9 % of an
fp32 one; fp16 boxes took 9.8 %; docs/sparse.md). Lossy only in what a step reads (exact when the context fits the
budget).

A decode step scores page p for each query head q_g of a KV head's group with the box bound
``Σ_d max(q_gd·(c−r)_d, q_gd·(c+r)_d) = q_g·c + |q_g|·r`` (Quest, ICML 2024, with ``score="minmax"``: c ± r = the
elementwise min/max; ``"meanstd"``: c = the mean, r = the standard deviation), combines the heads' estimated
attentions and reads the best pages: :mod:`kvslim.attention.sparse`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .fused import markers

SCORES = ("meanstd", "minmax")
SELECTS = ("step", "prompt")
#: rows always read outright by a layer that keeps no full-precision window of its own (dense, int8): the most
#: recent ``RECENT`` tokens (the int4/int3/int2/turbo defaults keep 4 sinks + 124 recent tokens = 128 outright)
RECENT = 128
MIN_PAGE = 16
FP16_MAX = 65504.0
#: channels per fp16 scale of the int8 boxes (a head dim that 16 does not divide: one scale per half)
BOX_GROUP = 16
#: ``sparse_budget="auto"``: a step reads max(AUTO_FLOOR, AUTO_FRACTION × the context) tokens. At 32k a fixed 2,048
#: lost pass keys its full read found (docs/sparse.md); 4,096 (an eighth) kept every one measured
AUTO_FLOOR = 2048
AUTO_FRACTION = 0.125
#: ``sparse_budget="auto"`` reads everything (the full read, bit for bit) while its candidate pages are at most this
#: many times the pages it would choose, per format, at batch 1 and at larger batches: where choosing cost more than
#: reading all. The crossovers measured on one mha-100m layer (12 KV heads × 64, fp32), budget 2,048, caches cold,
#: 2 threads (docs/sparse.md "Where sparse starts to pay"): int4 ~9.7k tokens at batch 1 (candidates ~5.0× its 60
#: pages), ~4.7k at batch 8 (2.4×); dense fp32 ~5.8k / ~5.5k (3.0× / 2.8×); turbo3 just above 4k at batch 1 (2×),
#: below 4k at batch 8 (sparse 1.28× the full read there: only what fits the budget is read whole). int8/int3/int2
#: take int4's (not measured apart).
FULL_READ = {"int": (5.0, 2.4), "dense": (3.0, 2.8), "turbo": (2.0, 1.0)}


@dataclass(frozen=True)
class SparseSpec:
    """One layer's sparse decode: read at most ``budget`` rows per single-token step (plus the part of a page not
    yet complete), in pages of ``page`` tokens, chosen by ``score``; ``select``: ``"step"`` (a new choice each step)
    or ``"prompt"`` (chosen at the first step after a multi-token call, kept for the answer; pages completed since
    are read whole). ``sinks_in_pages``: the layer keeps no full-precision sinks, so page 0 is always read (it holds
    the attention sinks); ``window``: rows always read after the pages (the layer's sinks + full-precision window,
    else :data:`RECENT`). ``fraction`` > 0: the budget grows with the context, a step of T tokens reads
    ``max(budget, fraction·T)`` rows (``sparse_budget="auto"``), and everything while its candidates are at most
    ``full_read`` (batch 1, larger batches) times its pages (:data:`FULL_READ`)."""

    budget: int
    page: int = 32
    score: str = "minmax"
    select: str = "step"
    window: int = RECENT
    sinks_in_pages: bool = True
    fraction: float = 0.0
    full_read: tuple[float, float] = FULL_READ["int"]  # with fraction: FULL_READ of the layer's format

    def __post_init__(self) -> None:
        check_sparse_options(self.budget, self.page, self.score, self.select)
        if self.pages < 1 + self.sinks_in_pages:
            sinks = "page 0 (the sinks) + " if self.sinks_in_pages else ""
            need = self.window + (1 + self.sinks_in_pages) * self.page
            raise ValueError(f"sparse_budget={self.budget} is smaller than what every step reads: {sinks}the "
                             f"{self.window} window rows + one page of {self.page} = {need} tokens; take "
                             f"sparse_budget={need} or more")

    @property
    def pages(self) -> int:
        """Pages a step reads at the floor budget (page 0 included when it holds the sinks)."""
        return (self.budget - self.window) // self.page

    def budget_at(self, tokens: int) -> int:
        """The rows a step over ``tokens`` visible tokens may read: ``budget``, or with ``fraction``
        ``max(budget, fraction·tokens)``."""
        return max(self.budget, int(self.fraction * tokens))

    def step_pages(self, tokens: int) -> int:
        """Pages a step over ``tokens`` visible tokens reads: those of :meth:`budget_at` past the window."""
        return (self.budget_at(tokens) - self.window) // self.page

    def reads_all(self, pages: int, tokens: int, batch: int = 1) -> bool:
        """Whether a step of ``batch`` sequences over ``tokens`` visible tokens with ``pages`` candidate pages reads
        everything (the full read, bit for bit): when the candidates fit the step's pages, and with ``fraction``
        (``"auto"``) also while they are at most ``full_read`` times them (:data:`FULL_READ`: there choosing cost
        more than reading all)."""
        k = self.step_pages(tokens)
        if not self.fraction:
            return pages <= k
        return pages <= self.full_read[0 if batch == 1 else 1] * k

    def step_rows(self, tokens: int, batch: int = 1) -> int:
        """Rows a step of ``batch`` sequences over ``tokens`` tokens reads at most: ``tokens`` where
        :meth:`reads_all` (its whole context; the candidates counted as a layer whose window is :attr:`window` has
        them), else the step's budget plus the part of a page not yet complete."""
        if self.reads_all(max(0, (tokens - self.window) // self.page), tokens, batch):
            return tokens
        return self.budget_at(tokens) + self.page - 1

    def stats_bytes_per_token(self, dim: int) -> float:
        """Bytes of statistics per token and KV head (2·D int8 codes and their fp16 scales per page)."""
        return stats_bytes_per_page(dim) / self.page


def stats_bytes_per_page(dim: int) -> int:
    """Bytes of one page's box per KV head: 2·D int8 codes and their fp16 scales."""
    return 2 * dim + 2 * (2 * dim // box_group(dim))


def box_group(dim: int) -> int:
    """Channels per scale of a head dim's int8 boxes."""
    return BOX_GROUP if dim % BOX_GROUP == 0 else dim


def check_sparse_options(budget, page, score, select) -> None:
    """``ValueError`` naming the option for a value sparse decode cannot take (the checks that need no layer)."""
    if budget != "auto" and (not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0):
        raise ValueError(f"sparse_budget must be a positive int (tokens read per decode step) or 'auto' (max("
                         f"{AUTO_FLOOR}, {AUTO_FRACTION:g} of the context)), got {budget!r}")
    if not isinstance(page, int) or isinstance(page, bool) or page < MIN_PAGE or page & (page - 1):
        raise ValueError(f"sparse_page must be a power of two of at least {MIN_PAGE} (tokens per page), got "
                         f"{page!r}; e.g. 64")
    if score not in SCORES:
        raise ValueError(f"sparse_score must be one of {list(SCORES)}, got {score!r}")
    if select not in SELECTS:
        raise ValueError(f"sparse_select must be one of {list(SELECTS)}, got {select!r}")


def candidate_pages(n: int, tail: int, spec: SparseSpec, complete: int) -> int:
    """Complete pages of a region of ``n`` rows that are candidates, ``tail``: every row a step reads outright
    besides the region (the layer's sinks, its full-precision window, the step's token). The newest rows up to
    ``spec.window`` read outright in all (the tail counted) and the rows of a page not yet complete are not
    candidates, so a step reads at most ``spec.budget + spec.page − 1`` rows."""
    return max(0, min(complete, (n + tail - spec.window) // spec.page))


def _scale_up(x: torch.Tensor) -> torch.Tensor:
    """fp32 ≥ 0 -> the fp16 at least as large (round to nearest of x·(1 + 2⁻¹⁰): fp16's half-ulp is ≤ 2⁻¹¹ of it),
    at least fp16's smallest subnormal."""
    return (x * (1 + 2.0 ** -10)).clamp(2.0 ** -24, FP16_MAX).half()


def encode_box(mu: torch.Tensor, c: torch.Tensor, r: torch.Tensor, group: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 centre ``c`` / radius ``r`` (..., D) -> (codes (..., 2D) int8, scales (..., 2D/group) fp16) of
    ``[c − μ | r]``: the centre rounded to nearest, the radius rounded up after absorbing the centre's rounding as
    the fp32 box ``μ + c' ± r'`` reads it, so that box contains ``[c − r, c + r]``."""
    d = c.shape[-1]
    cg = (c - mu).unflatten(-1, (d // group, group))
    sc = _scale_up(cg.abs().amax(-1) / 127)
    cq = torch.round(cg / sc.float()[..., None]).clamp(-127, 127)
    centre = mu + (cq * sc.float()[..., None]).flatten(-2)  # the fp32 centre a reader rebuilds
    need = (r + (c - centre).abs()) * (1 + 2.0 ** -10)
    ng = need.unflatten(-1, (d // group, group))
    sr = _scale_up(ng.amax(-1) / 127)
    rq = torch.ceil(ng / sr.float()[..., None]).clamp(0, 127)
    codes = torch.cat((cq.flatten(-2), rq.flatten(-2)), dim=-1).to(torch.int8)
    return codes, torch.cat((sc, sr), dim=-1)


class PageStats:
    """Per-page key boxes of one layer: ``boxes`` (B, H, pages, 2D) int8 codes of ``[centre − μ | radius]`` with
    ``scales`` (B, H, pages, 2D/group) fp16 (:func:`encode_box`), ``mu`` (B, H, D) fp32 the first page's centre;
    page p = tokens ``[offset + p·page, offset + (p+1)·page)``; the running sums of the page being filled are kept
    in fp32 (``acc``: (B, H, 2, D): sum and sum of squares, or min and max). ``offset``: the first token of the
    paged region (a layer's full-precision sinks stay out of the pages)."""

    STATE_VERSION = 2  # 1: fp16 boxes [centre | radius], no scales, no μ

    def __init__(self, spec: SparseSpec, offset: int = 0):
        self.spec, self.offset = spec, offset
        self.boxes: torch.Tensor | None = None  # (B, H, pages, 2D) int8: [centre − μ | radius] codes per page
        self.scales: torch.Tensor | None = None  # (B, H, pages, 2D/group) fp16
        self.mu: torch.Tensor | None = None  # (B, H, D) fp32: the first page's centre
        self.acc: torch.Tensor | None = None
        self.length = 0  # tokens of the paged region written (complete pages = length // page)
        # select="prompt": the pages chosen at the first step after a multi-token call (B, H, k) int64, a buffer the
        # cache owns (attention writes the choice into it), and the page count then (host); None: choose again
        self.kept: torch.Tensor | None = None
        self.kept_pages: int | None = None
        self.broken = False  # a rewind into a page with no reader: statistics incomplete until reset (reads all)

    @property
    def complete(self) -> int:
        return self.length // self.spec.page

    def reset(self) -> None:
        self.length = 0
        self.kept_pages = None
        self.broken = False

    def choice(self, pages: int, batch: int, heads: int, device: torch.device, k: int
               ) -> tuple[torch.Tensor | None, bool]:
        """What a step of ``pages`` candidate pages does with ``select="prompt"``: ``(kept pages, False)`` to read
        the choice made earlier (pages completed since are read whole), ``(buffer, True)`` to choose and write the
        choice into the cache's buffer (recorded here, on the host, before attention runs), ``(None, False)`` for
        ``select="step"``."""
        if self.spec.select != "prompt":
            return None, False
        if self.kept_pages is not None and self.kept_pages <= pages:
            return self.kept, False
        k = min(k, pages)
        if self.kept is None or self.kept.shape != (batch, heads, k) or self.kept.device != device:
            self.kept = torch.zeros(batch, heads, k, dtype=torch.int64, device=device)
        self.kept_pages = pages
        return self.kept, True

    def rewind(self, tokens: int, reader=None) -> None:
        """Forget everything from token ``tokens`` on (a crop). Complete pages before it stay. A rewind into a page
        rebuilds that page's running sums from its rows, ``reader(start, end)`` -> keys (B, H, end − start, D) of
        the layer (full precision where the layer keeps them: the residual window, a dense cache; else its
        dequantized rows); without a reader the layer reads everything (``broken``) until it is reset."""
        keep = max(0, tokens - self.offset)
        self.kept_pages = None
        if keep >= self.length:
            return
        first = keep // self.spec.page * self.spec.page
        self.length = first
        if keep == first:
            return
        if reader is None or self.broken or self.acc is None:
            self.broken = True
            return
        self.write(self.offset + first, reader(self.offset + first, self.offset + keep))

    def values(self) -> torch.Tensor:
        """The complete pages' boxes as fp32 ``[centre | radius]`` (B, H, complete, 2D), μ added back."""
        from ..kernels.sparse_select import values

        n, d = self.complete, self.boxes.shape[-1] // 2
        v = values(self.boxes[:, :, :n], self.scales)
        v[..., :d] += self.mu[:, :, None]
        return v

    @property
    def centre(self) -> torch.Tensor:
        return self.values()[..., :self.boxes.shape[-1] // 2]

    @property
    def radius(self) -> torch.Tensor:
        return self.values()[..., self.boxes.shape[-1] // 2:]

    def _grow(self, b: int, h: int, d: int, pages: int, device: torch.device) -> None:
        if self.boxes is None or self.boxes.shape[:2] != (b, h) or self.boxes.shape[3] != 2 * d:
            cap = max(pages, 16)
            self.boxes = torch.zeros(b, h, cap, 2 * d, dtype=torch.int8, device=device)
            self.scales = torch.zeros(b, h, cap, 2 * d // box_group(d), dtype=torch.float16, device=device)
            self.acc = torch.zeros(b, h, 2, d, dtype=torch.float32, device=device)
            self.mu = None
        elif pages > self.boxes.shape[2]:
            cap = max(pages, self.boxes.shape[2] * 3 // 2)
            for name in ("boxes", "scales"):
                old = getattr(self, name)
                new = old.new_zeros(b, h, cap, old.shape[3])
                new[:, :, :old.shape[2]] = old
                setattr(self, name, new)

    def write(self, start: int, keys: torch.Tensor) -> None:
        """Account for ``keys`` (B, H, S, D), tokens ``[start, start + S)`` of the sequence (appended in order;
        a ``start`` before the paged length rewinds to it)."""
        p = self.spec.page
        lo = max(start, self.offset) - self.offset  # first paged token of this write
        hi = start + keys.shape[2] - self.offset
        if hi <= lo:
            return
        if lo < self.length:
            self.rewind(lo + self.offset)
        if lo != self.length:  # a write that skips tokens, or a rewind into a page without a reader
            self.broken = True
        if self.broken:
            return
        b, h, _, d = keys.shape
        x = keys[:, :, lo + self.offset - start:].float()  # (B, H, hi - lo, D)
        self._grow(b, h, d, hi // p + 1, keys.device)
        pos = lo
        while pos < hi:
            page_end = (pos // p + 1) * p
            take = min(hi, page_end) - pos
            part = x[:, :, pos - lo:pos - lo + take]
            first = pos % p == 0
            self._accumulate(part, first)
            pos += take
            if pos == page_end:
                self._finish(pos // p - 1)
        self.length = hi

    def allocate(self, b: int, h: int, d: int, pages: int, device: torch.device) -> list[torch.Tensor]:
        """Buffers for ``pages`` pages allocated now and kept (a layer whose ``max_length`` fixes its capacity; the
        static path of ``caches/capture.py`` writes them in place), ``μ`` zeroed until the first page sets it.
        Returns them (their addresses are marked static for CUDA graphs)."""
        self._grow(b, h, d, pages, device)
        if self.mu is None:
            self.mu = torch.zeros(b, h, d, dtype=torch.float32, device=device)
        return [self.boxes, self.scales, self.acc, self.mu]

    def write_static(self, pos: torch.Tensor, keys: torch.Tensor, ok: torch.Tensor | None = None) -> None:
        """One token ``keys`` (B, H, 1, D) at position ``pos`` (a one-element int64 device tensor): the running sums
        of its page and that page's box updated on the device with :meth:`write`'s arithmetic, no host integer read
        (the static path of a capturable layer, ``caches/capture.py``; needs :meth:`allocate`). The box of a page
        not yet complete is written too (no step chooses it before its last token: :func:`candidate_pages`), so the
        last token of a page leaves the box :meth:`write` leaves. ``ok`` (one-element bool): where false nothing
        changes (a refused graph step). The host ``length`` is the caller's to keep (:meth:`sync`)."""
        p = self.spec.page
        r = pos.reshape(1) - self.offset
        valid = r >= 0 if ok is None else (r >= 0) & ok.reshape(1)
        idx = r.clamp_min(0) // p
        first = r % p == 0
        x = keys[:, :, 0].float()
        lo, hi = self.acc[:, :, 0], self.acc[:, :, 1]
        if self.spec.score == "minmax":
            a, b = torch.where(first, x, torch.minimum(lo, x)), torch.where(first, x, torch.maximum(hi, x))
        else:
            a, b = torch.where(first, x, lo + x), torch.where(first, x * x, hi + x * x)
        self.acc.copy_(torch.where(valid, torch.stack((a, b), dim=2), self.acc))
        c, rad = self._box(a, b)
        self.mu.copy_(torch.where(valid & (idx == 0), c, self.mu))  # the first page's centre, as _finish sets it
        codes, scales = encode_box(self.mu, c, rad, box_group(c.shape[-1]))
        for buf, new in ((self.boxes, codes), (self.scales, scales)):
            buf.index_copy_(2, idx, torch.where(valid, new[:, :, None], buf.index_select(2, idx)))

    def sync(self, tokens: int) -> None:
        """The host ``length`` after static writes: ``tokens`` of the layer written (in order, from token 0)."""
        self.length = max(0, tokens - self.offset)

    def _accumulate(self, part: torch.Tensor, first: bool) -> None:
        if self.spec.score == "minmax":
            mn, mx = part.amin(dim=2), part.amax(dim=2)
            if first:
                self.acc[:, :, 0], self.acc[:, :, 1] = mn, mx
            else:
                self.acc[:, :, 0] = torch.minimum(self.acc[:, :, 0], mn)  # (no out= into a strided slice: dynamo
                self.acc[:, :, 1] = torch.maximum(self.acc[:, :, 1], mx)  # refuses it in a traced step)
            return
        s, s2 = part.sum(dim=2), (part * part).sum(dim=2)
        if first:
            self.acc[:, :, 0], self.acc[:, :, 1] = s, s2
        else:
            self.acc[:, :, 0] += s
            self.acc[:, :, 1] += s2

    def _box(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A complete page's fp32 centre and radius (B, H, D) from its running sums (min and max, or Σk and Σk²)."""
        if self.spec.score == "minmax":
            c, r = (a + b) * 0.5, (b - a) * 0.5
            return c, torch.maximum(r, torch.maximum(b - c, c - a))  # the fp32 midpoint's rounding
        n = self.spec.page
        c = a / n
        return c, (b / n - c * c).clamp_min(0).sqrt()

    def _finish(self, index: int) -> None:
        c, r = self._box(self.acc[:, :, 0], self.acc[:, :, 1])
        if self.mu is None:  # the reference every later page's centre is coded against
            self.mu = c.clone()
        elif index == 0:
            self.mu.copy_(c)  # in place: a static layer's buffer keeps its address
        codes, scales = encode_box(self.mu, c, r, box_group(c.shape[-1]))
        self.boxes[:, :, index] = codes
        self.scales[:, :, index] = scales

    def map_sequences(self, fn) -> None:
        for name in ("boxes", "scales", "mu", "acc"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, fn(t))
        self.kept_pages = None

    def nbytes(self) -> int:
        """Bytes of the complete pages' statistics (the running sums of the page being filled and ``μ`` not
        counted: a fixed 3·D fp32 per head, like the smoothing factors)."""
        if self.boxes is None:
            return 0
        b, h, _, d2 = self.boxes.shape
        return b * h * self.complete * (d2 + self.scales.shape[-1] * 2)

    def allocated_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.boxes, self.scales, self.mu, self.acc) if t is not None)


@dataclass
class SparseKV:
    """What a sparse decode step hands attention (carried by marker tensors like :class:`~kvslim.caches.fused.
    FusedKV`): the layer's statistics and either the fused handle of a coded layer (``fused``) or a dense layer's
    full keys/values (``keys``/``values``: (B, H, T, D) views, no copy). ``n``: rows of the paged region (coded
    history or, dense, the history before the step's token), slot ``j`` = token ``stats.offset + j`` (temporal
    position ``offset + j`` of the layer's full reads); ``pages``: the complete pages that are candidates (the
    newest ``spec.window`` rows, tail included, are read outright)."""

    stats: PageStats
    n: int
    pages: int
    fused: object | None = None
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    scratch: object | None = None  # the cache's ScratchPool: reused buffers for the gathered pages
    kept: torch.Tensor | None = None  # select="prompt": the chosen pages (B, H, k), to read or to write
    choose: bool = True  # choose the pages (and write them into ``kept`` when it is given)
    read: int = 0  # pages to choose at this step (SparseSpec.step_pages); 0: the spec's floor
    #: the static path of a capturable layer (``caches/capture.py``, ``attention/sparse_static.decode_static``): ``n`` and
    #: ``pages`` are the whole buffer's slots and pages, ``length`` (B,) the tokens visible at this step (its own
    #: included) and ``stored`` (B,) the region rows held in ``fused``'s stores (or dense ``keys``), on the device
    static: bool = False
    length: torch.Tensor | None = None
    stored: torch.Tensor | None = None

    @property
    def k(self) -> int:
        """Pages chosen at this step."""
        return self.read or self.stats.spec.pages

    @property
    def tokens(self) -> int:
        """HF's key length: the visible tokens (a static dense step: ``n``, its ``max_length``; its ``keys`` are the
        whole buffers)."""
        if self.fused is not None:
            return self.fused.tokens
        return self.n if self.static else self.keys.shape[2]


SPARSE_ATTR = "_kvslim_sparse"


def sparse_of(key: torch.Tensor) -> SparseKV | None:
    return getattr(key, SPARSE_ATTR, None)


def sparse_markers(h: SparseKV, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two NaN zero-stride (B, H, tokens, D) tensors carrying ``h`` (and its fused handle, if any)."""
    return markers(h, like, SPARSE_ATTR)
