"""Per-layer cache plans: what each layer stores, its exact bytes per token, and how exact it is."""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # rich is imported where a table is drawn: plans work without it (a bare GPU machine)
    from rich.table import Table


@dataclass(frozen=True)
class LayerPlan:
    """One layer's choice.

    Attributes:
        index: decoder layer index.
        technique: what the layer caches (``"dense"``, ``"window"``, ``"int8"``, ``"slim-k"``, ``"mla-latent"``…).
        bytes_per_token: exact bytes stored per token at batch 1 (scales included).
        window: the sliding window W of a ring-buffer layer (it stores the last W − 1 tokens, as HF's
            ``DynamicSlidingWindowLayer``), or ``None`` for an unbounded layer.
        exactness: ``"exact"``, ``"lossy"`` or ``"approximate"`` plus, where measured, the dtype and error.
        error: measured relative error of this layer's choice, when measured.
        note: free text shown in the plan table.
        fixed_bytes: bytes per sequence that do not grow with context (e.g. a shared encoder-output cache).
        residual: most recent tokens kept in full precision (``residual_bytes_per_token`` each) beside codes
            (``bytes_per_token`` each); codes take them ``flush`` at a time (see ``StoreSpec.flushed``).
        ring_codes: a ring with a residual window (``ResidualRingLayer``): its coded token slots (whole groups;
            the full-precision window holds the most recent tokens), ``None`` otherwise.
        attention: ``"sliding"`` or ``"full"``: how the *model* runs this layer (its config's layer types).
        sparse, sparse_offset, sparse_page_bytes: sparse decode (``caches/sparse.py``): the layer's spec, where its
            pages start, and the statistics bytes of one complete page (counted in :meth:`cache_bytes`).
        factory: builds the ``CacheLayerMixin`` for this layer; called with ``max_length`` (or ``None``).
    """

    index: int
    technique: str
    bytes_per_token: int
    window: int | None = None
    exactness: str = "exact"
    error: float | None = None
    note: str = ""
    fixed_bytes: int = 0
    residual: int = 0
    flush: int = 1
    residual_bytes_per_token: int = 0
    ring_codes: int | None = None
    attention: str = "full"
    sparse: Any = None  # caches.sparse.SparseSpec of a layer with sparse decode
    sparse_offset: int = 0  # first token of its paged region (behind full-precision sinks)
    sparse_page_bytes: int = 0  # statistics bytes per complete page per sequence (all KV heads)
    factory: Callable[[int | None], Any] | None = field(default=None, compare=False, repr=False)

    def cache_bytes(self, context: int, batch: int = 1) -> int:
        if context == 0:
            return 0
        if self.sparse is not None:
            pages = max(0, context - self.sparse_offset) // self.sparse.page
            return replace(self, sparse=None).cache_bytes(context, batch) + batch * pages * self.sparse_page_bytes
        if self.ring_codes is not None:  # window in full precision, then the ring's whole coded groups
            coded = self.flush * -(-max(0, context - self.residual) // self.flush)
            return batch * (min(coded, self.ring_codes) * self.bytes_per_token
                            + (context - coded) * self.residual_bytes_per_token + self.fixed_bytes)
        tokens = context if self.window is None else min(context, self.window - 1)  # a ring stores W − 1
        return self._stored(tokens, batch)

    def step_read_bytes(self, context: int, batch: int = 1) -> int:
        """Bytes a single-token decode step reads from this layer after ``context`` tokens: everything, or with
        sparse decode past its budget the rows of ``budget`` tokens (+ at most a page being filled, counted at its
        average: half a page) in the layer's format plus every complete page's statistics (an estimate: which rows
        are coded and which full precision follows :meth:`cache_bytes` at that many tokens)."""
        if self.sparse is None:
            return self.cache_bytes(context, batch)
        plain = replace(self, sparse=None)
        sp = self.sparse
        if sp.step_rows(context, batch) >= context:  # the whole context (within the budget, or auto's short contexts)
            return self.cache_bytes(context, batch)
        rows = sp.budget_at(context) + sp.page // 2
        pages = max(0, context - self.sparse_offset) // self.sparse.page
        return plain.cache_bytes(rows, batch) + batch * pages * self.sparse_page_bytes

    def _stored(self, tokens: int, batch: int) -> int:
        coded = tokens if not self.residual else self.flush * -(-max(0, tokens - self.residual) // self.flush)
        return batch * (coded * self.bytes_per_token + (tokens - coded) * self.residual_bytes_per_token
                        + (self.fixed_bytes if coded else 0))  # fitted by the coded store's first write


@dataclass(frozen=True)
class Plan:
    """A model's cache plan: one :class:`LayerPlan` per layer and the dense baseline to compare with."""

    method: str
    model_type: str
    family: str
    dtype: str
    layers: tuple[LayerPlan, ...]
    dense_bytes_per_token: int  # per layer, batch 1: the model's ordinary K+V cache
    options: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    dense_fixed_bytes: int = 0
    sliding_window: int | None = None  # the model's own window on its ``attention == "sliding"`` layers

    def cache_bytes(self, context: int, batch: int = 1) -> int:
        """Exact bytes the planned cache holds after ``context`` tokens for ``batch`` sequences."""
        return sum(lp.cache_bytes(context, batch) for lp in self.layers)

    def dense_bytes(self, context: int, batch: int = 1) -> int:
        """Bytes of the model's ordinary K+V cache in the same dtype (``dense_bytes_per_token`` is per layer)."""
        return batch * (context * self.dense_bytes_per_token * len(self.layers) + self.dense_fixed_bytes)

    def step_read_bytes(self, context: int, batch: int = 1) -> int:
        """Bytes of cache a single-token decode step reads after ``context`` tokens (all of it without sparse
        decode; :meth:`LayerPlan.step_read_bytes`)."""
        return sum(lp.step_read_bytes(context, batch) for lp in self.layers)

    def ratio(self, context: int) -> float:
        return self.cache_bytes(context) / max(1, self.dense_bytes(context))

    def _hf_layer_bytes(self, lp: LayerPlan, context: int, batch: int) -> int:
        tokens = context
        if lp.attention == "sliding" and self.sliding_window:
            tokens = min(context, self.sliding_window - 1)  # HF's DynamicSlidingWindowLayer
        return batch * tokens * self.dense_bytes_per_token

    def hf_bytes(self, context: int, batch: int = 1) -> int:
        """Bytes of HF's own cache for this model in the plan's dtype (``DynamicCache(config=...)``: the last
        W − 1 tokens on sliding-window layers, every token on the others)."""
        return sum(self._hf_layer_bytes(lp, context, batch) for lp in self.layers) + batch * self.dense_fixed_bytes

    def bytes_by_attention(self, context: int, batch: int = 1) -> dict[str, dict[str, int]]:
        """Per attention type of the model's layers (``"sliding"``, ``"full"``): ``layers``, ``cache_bytes``
        (this plan) and ``hf_bytes`` (HF's own cache, see :meth:`hf_bytes`) after ``context`` tokens."""
        out: dict[str, dict[str, int]] = {}
        for lp in self.layers:
            row = out.setdefault(lp.attention, {"layers": 0, "cache_bytes": 0, "hf_bytes": 0})
            row["layers"] += 1
            row["cache_bytes"] += lp.cache_bytes(context, batch)
            row["hf_bytes"] += self._hf_layer_bytes(lp, context, batch)
        return out

    def to_dict(self) -> dict:
        return {
            "method": self.method, "model_type": self.model_type, "family": self.family, "dtype": self.dtype,
            "options": {k: str(v) for k, v in self.options.items()}, "notes": list(self.notes),
            "dense_bytes_per_token": self.dense_bytes_per_token,
            "layers": [{"index": lp.index, "technique": lp.technique, "bytes_per_token": lp.bytes_per_token,
                        "window": lp.window, "exactness": lp.exactness, "error": lp.error, "note": lp.note,
                        "fixed_bytes": lp.fixed_bytes, "residual": lp.residual, "flush": lp.flush,
                        "residual_bytes_per_token": lp.residual_bytes_per_token, "ring_codes": lp.ring_codes,
                        "attention": lp.attention,
                        "sparse": None if lp.sparse is None else {
                            "budget": lp.sparse.budget, "page": lp.sparse.page, "score": lp.sparse.score,
                            "select": lp.sparse.select, "window": lp.sparse.window,
                            "page_bytes": lp.sparse_page_bytes}} for lp in self.layers],
            "sliding_window": self.sliding_window,
        }

    def table(self, context: int = 4096) -> Table:
        from rich.table import Table

        title = (f"kvslim plan: {self.method} on {self.model_type} ({self.family}, {self.dtype}), "
                 f"{context} tokens: {self.cache_bytes(context):,} B = {self.ratio(context):.3f} × dense")
        if any(lp.attention == "sliding" for lp in self.layers) and self.sliding_window:
            title += f" = {self.cache_bytes(context) / max(1, self.hf_bytes(context)):.3f} × HF's own cache"
        t = Table(title=title)
        for col in ("layers", "technique", "bytes/token", "window", "exactness", "error", "note"):
            t.add_column(col)
        for group in _group_layers(self.layers):
            lp = group[0]
            span = f"{group[0].index}" if len(group) == 1 else f"{group[0].index}-{group[-1].index}"
            err = "" if lp.error is None else f"{lp.error:.2e}"
            t.add_row(span, lp.technique, f"{lp.bytes_per_token:,}", str(lp.window or "-"), lp.exactness, err,
                      lp.note)
        return t

    def __str__(self) -> str:
        from rich.console import Console

        buf = io.StringIO()
        console = Console(file=buf, width=140, force_terminal=False)
        console.print(self.table())
        by = self.bytes_by_attention(4096)
        if "sliding" in by:
            for kind, row in by.items():
                console.print(f"{kind} layers ({row['layers']}): {row['cache_bytes']:,} B at 4096 tokens; HF's own "
                              f"cache {row['hf_bytes']:,} B")
        if any(lp.sparse is not None for lp in self.layers):
            for n in (4096, 32768):
                console.print(f"sparse decode: a single-token step reads {self.step_read_bytes(n):,} of "
                              f"{self.cache_bytes(n):,} cache bytes at {n:,} tokens (batch 1)")
        for n in self.notes:
            console.print(f"note: {n}")
        return buf.getvalue()


def _group_layers(layers: tuple[LayerPlan, ...]) -> list[list[LayerPlan]]:
    """Consecutive layers with identical choices, for a compact table."""
    groups: list[list[LayerPlan]] = []
    for lp in layers:
        if groups and groups[-1][-1].index == lp.index - 1 and _key(groups[-1][-1]) == _key(lp):
            groups[-1].append(lp)
        else:
            groups.append([lp])
    return groups


def _key(lp: LayerPlan) -> tuple:
    return (lp.technique, lp.bytes_per_token, lp.window, lp.exactness, lp.error, lp.note)
