"""The sparse-decode options every append-only storage method takes (issue 43, ``caches/sparse.py``).

``sparse_budget`` (tokens a single-token step reads; ``"auto"``: max(2,048, an eighth of the context), and the
whole context below the measured crossover (``caches.sparse.FULL_READ``: ~9.7k tokens for int codes at batch 1,
~4-6k otherwise), the recommended setting; ``None``: off), ``sparse_page`` (tokens per page, a power of
two ≥ 16; default 32, or the KIVI key groups' tokens where they are longer: 64 for int3/int2), ``sparse_score`` (Quest's ``"minmax"``, default since 2026-11-29, or ``"meanstd"``), ``sparse_dense_layers``
(layers read in full: an int N = the first N, default 0, or a list of indices) and ``sparse_select`` (``"step"``,
default, or ``"prompt"``: chosen at the first step after a multi-token call, kept for the answer). Spelled the same
in ``kvslim.apply(model, "int4", sparse_budget=2048)`` and ``--option int4.sparse_budget=2048``.
"""

from __future__ import annotations

from dataclasses import replace

from ..caches.factories import append_factory
from ..caches.sparse import (
    AUTO_FLOOR,
    AUTO_FRACTION,
    FULL_READ,
    RECENT,
    SparseSpec,
    check_sparse_options,
    stats_bytes_per_page,
)
from ..plan import Plan

SPARSE_OPTIONS = ("sparse_budget", "sparse_page", "sparse_score", "sparse_dense_layers", "sparse_select")
DEFAULTS = dict(sparse_budget=None, sparse_page=None, sparse_score="minmax", sparse_dense_layers=0,
                sparse_select="step")
#: the default page: 32 tokens (a 64-token page's mean and spread diluted a pass key's sentence below dozens of
#: pages at 32k; docs/sparse.md), or a layer's KIVI key group where it is longer
PAGE = 32


def split(options: dict) -> tuple[dict, dict]:
    """``options`` -> (the sparse options with their defaults, the rest); ``ValueError`` naming the option for a
    value no layer could take, or a sparse option given without ``sparse_budget``."""
    given = {k: options[k] for k in SPARSE_OPTIONS if k in options}
    rest = {k: v for k, v in options.items() if k not in SPARSE_OPTIONS}
    sp = {**DEFAULTS, **given}
    if sp["sparse_budget"] is None:
        extra = sorted(k for k in given if k != "sparse_budget")
        if extra:
            raise ValueError(f"{extra[0]}={given[extra[0]]!r} needs sparse_budget (the tokens a decode step reads), "
                             "e.g. sparse_budget=2048")
        return sp, rest
    check_sparse_options(sp["sparse_budget"], PAGE if sp["sparse_page"] is None else sp["sparse_page"],
                         sp["sparse_score"], sp["sparse_select"])
    dl = sp["sparse_dense_layers"]
    if isinstance(dl, list):
        dl = sp["sparse_dense_layers"] = tuple(dl)
    ok_int = isinstance(dl, int) and not isinstance(dl, bool) and dl >= 0
    ok_seq = isinstance(dl, tuple) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in dl)
    if not (ok_int or ok_seq):
        raise ValueError(f"sparse_dense_layers must be an int N >= 0 (the first N layers read in full) or a list of "
                         f"layer indices, got {dl!r}")
    if "window" in rest and rest["window"] is not None:
        raise ValueError(f"sparse_budget={sp['sparse_budget']} needs an append-only cache: a ring buffer "
                         f"(window={rest['window']!r}) already reads a bounded window; drop one of them")
    return sp, rest


def dense_layers(sp: dict, num_layers: int) -> set[int]:
    dl = sp["sparse_dense_layers"]
    if isinstance(dl, int):
        if dl > num_layers:
            raise ValueError(f"sparse_dense_layers={dl}: the model has {num_layers} layers (0..{num_layers} layers "
                             "can stay dense)")
        return set(range(dl))
    outside = [i for i in dl if i >= num_layers]
    if outside:
        raise ValueError(f"sparse_dense_layers: layer(s) {outside} outside the model's {num_layers} layers")
    return set(dl)


def layer_spec(sp: dict, store_spec) -> SparseSpec:
    """The :class:`SparseSpec` of a layer stored with ``store_spec`` (its sinks + full-precision window are the
    rows always read; a layer without them reads page 0 and the last :data:`RECENT` tokens outright)."""
    cg = store_spec.channel_group
    page = sp["sparse_page"]
    if page is None:  # the default: PAGE, or the key groups where they are longer
        page = max(PAGE, cg or 0)
    if cg and page % cg:
        raise ValueError(f"sparse_page={page} must be a multiple of the key groups' {cg} tokens "
                         f"(key_channel_group): e.g. sparse_page={max(cg, 64)}")
    own = bool(store_spec.residual)
    auto = sp["sparse_budget"] == "auto"
    kind = "turbo" if store_spec.codec == "turbo" else "int" if store_spec.bits else "dense"
    return SparseSpec(AUTO_FLOOR if auto else sp["sparse_budget"], page, sp["sparse_score"], sp["sparse_select"],
                      fraction=AUTO_FRACTION if auto else 0.0, full_read=FULL_READ[kind],
                      window=store_spec.sink + store_spec.residual if own else RECENT,
                      sinks_in_pages=not (own and store_spec.sink))


def apply(plan: Plan, sp: dict, num_kv_heads: int, head_dim: int) -> Plan:
    """``plan`` with sparse decode on its append-only full-attention layers outside ``sparse_dense_layers``
    (factories, statistics bytes, notes); unchanged without ``sparse_budget``."""
    if sp["sparse_budget"] is None:
        return plan
    dense = dense_layers(sp, len(plan.layers))
    layers, sliding, pages = [], 0, set()
    for lp in plan.layers:
        if lp.window is not None or lp.attention == "sliding" or lp.ring_codes is not None:
            sliding += 1
            layers.append(lp)
            continue
        if lp.index in dense:
            layers.append(lp)
            continue
        spec = lp.factory.keywords["spec"]
        ss = layer_spec(sp, spec)
        note = (f"sparse {'auto' if ss.fraction else ss.budget}/{ss.page} {ss.score}"
                + ("" if ss.select == "step" else " prompt"))
        pages.add(ss.page)
        offset = spec.sink if spec.sink and spec.residual else 0
        layers.append(replace(lp, note=f"{lp.note}; {note}" if lp.note else note, sparse=ss, sparse_offset=offset,
                              sparse_page_bytes=num_kv_heads * stats_bytes_per_page(head_dim),
                              factory=append_factory(spec, lp.factory.keywords["chunk"], sparse=ss)))
    budget = (f"max({AUTO_FLOOR}, {AUTO_FRACTION:g} of the context)" if sp["sparse_budget"] == "auto"
              else sp["sparse_budget"])
    notes = [f"sparse decode: single-token steps read ≤ {budget} tokens (+ a page being filled) per "
             f"layer and KV head, in pages of {'/'.join(map(str, sorted(pages))) or PAGE} scored by "
             f"{sp['sparse_score']}; layers "
             f"{sorted(dense)} read everything (docs/sparse.md)"
             + ("" if dense else "; for retrieval, read in full the layers kvslim.calibrate_sparse(model, ids) "
                                 "picks (sparse_dense_layers=)")]
    if sliding:
        notes.append(f"{sliding} sliding-window layer(s) read their own bounded window (no sparse decode there)")
    return replace(plan, layers=tuple(layers), notes=plan.notes + tuple(notes))
