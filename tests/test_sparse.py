"""Query-aware sparse decode (issue 43): options, page statistics, selection against a float64 oracle, the fast
paths against the twin, bitwise equality within the budget, end-to-end generate on tiny models."""

from __future__ import annotations

import pytest
import torch
from conftest import padded_batch, tiny_model

import kvslim
from kvslim.attention import sparse as attn
from kvslim.caches.sparse import PageStats, SparseSpec, sparse_of
from kvslim.caches.storage import ScratchPool
from kvslim.methods import METHODS

pytestmark = pytest.mark.usefixtures("no_grad")  # conftest's
METHOD_NAMES = ["dense", "int8", "int4", "int3", "int2", "turbo4", "turbo3", "turbo2"]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _layer(model, method: str, index: int = 2, scratch: bool = False, **options):
    plan = METHODS[method].plan_model(model, **options)
    layer = plan.layers[index].factory(None)
    if scratch:
        layer.scratch_pool = ScratchPool()
    layer.sparse_attention = True
    layer.fused_decode = True
    return layer, plan


def _step(layer, b: int, h: int, d: int, prompt: int, seed: int = 0):
    """Prefill ``prompt`` random tokens (keys with a per-page offset so that pages differ), then one step."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, h, prompt + 1, d, generator=g)
    keys += 3 * torch.randn(b, h, prompt // 16 + 1, d, generator=g).repeat_interleave(16, 2)[:, :, :prompt + 1]
    values = torch.randn(b, h, prompt + 1, d, generator=g)
    layer.update(keys[:, :, :prompt], values[:, :, :prompt])
    k, _ = layer.update(keys[:, :, prompt:], values[:, :, prompt:])
    return keys, values, sparse_of(k)


def _up16(x: torch.Tensor) -> torch.Tensor:
    return (x * (1 + 2.0 ** -10)).clamp(2.0 ** -24, 65504.0).half().double()


def _stored_box(c: torch.Tensor, r: torch.Tensor, group: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (B, H, P, D) centres/radii as the documented int8 box keeps them: ``μ`` = page 0's centre, per
    ``group`` channels an fp16 scale (rounded up) of int8 codes of ``c − μ`` (to nearest) and of the radius grown by
    the centre's rounding (rounded up)."""
    d = c.shape[-1]
    group = group if d % group == 0 else d
    mu = c[:, :, :1]
    cg = (c - mu).unflatten(-1, (d // group, group))
    sc = _up16(cg.abs().amax(-1) / 127)[..., None]
    centre = mu + (torch.round(cg / sc).clamp(-127, 127) * sc).flatten(-2)
    need = ((r + (c - centre).abs()) * (1 + 2.0 ** -10)).unflatten(-1, (d // group, group))
    sr = _up16(need.amax(-1) / 127)[..., None]
    return centre, (torch.ceil(need / sr).clamp(0, 127) * sr).flatten(-2)


def _oracle(h, keys: torch.Tensor, q: torch.Tensor, scaling: float, mat: tuple | None = None) -> torch.Tensor:
    """float64: page statistics from the keys as written, scores, top pages, attention over the full reads'
    rows (B, 1, heads, D)."""
    spec, off = h.stats.spec, h.stats.offset
    b, hk, t, d = keys.shape
    p, npg = spec.page, h.pages
    region = keys[:, :, off:off + npg * p].double().reshape(b, hk, npg, p, d)
    if spec.score == "minmax":
        lo, hi = region.amin(3), region.amax(3)
        c, r = (lo + hi) / 2, (hi - lo) / 2
    else:
        c, r = region.mean(3), region.std(3, unbiased=False)
    c, r = _stored_box(c, r)
    qg = q.double().reshape(b, hk, -1, d)
    bound = torch.einsum("bhgd,bhpd->bhgp", qg, c) + torch.einsum("bhgd,bhpd->bhgp", qg.abs(), r)
    score = torch.softmax(bound * scaling, dim=-1).sum(2).log()  # each head's estimated attention, summed over G
    if spec.sinks_in_pages:
        score[..., 0] = float("inf")
    top = score.topk(min(spec.pages, npg), dim=-1).indices
    full_k, full_v = mat if mat is not None else (h.keys, h.values)
    out = torch.empty(b, hk, qg.shape[2], d, dtype=torch.float64)
    for i in range(b):
        for j in range(hk):
            keep = torch.zeros(t, dtype=torch.bool)
            keep[:off] = True
            for pg in top[i, j].tolist():
                keep[off + pg * p:off + (pg + 1) * p] = True
            keep[off + npg * p:] = True
            kk, vv = full_k[i, j, keep].double(), full_v[i, j, keep].double()
            w = torch.softmax(qg[i, j] @ kk.T * scaling, dim=-1)
            out[i, j] = w @ vv
    return out.reshape(b, 1, -1, d)


@pytest.mark.parametrize("method", METHOD_NAMES)
@pytest.mark.parametrize("score", ["meanstd", "minmax"])
def test_step_matches_float64_oracle(model, method, score):
    """The step's output (C++ op over gathered codes, SDPA over gathered rows, or the twin) equals a float64
    oracle that computes the statistics, the choice and the attention itself (gathered into reused buffers for
    the minmax half)."""
    layer, _ = _layer(model, method, scratch=score == "minmax", sparse_budget=256, sparse_dense_layers=0,
                      sparse_score=score)
    b, hk, d, heads = 2, 2, 16, 4
    keys, _, h = _step(layer, b, hk, d, prompt=700)
    assert h is not None and h.pages > h.stats.spec.pages  # a sparse step
    q = torch.randn(b, heads, 1, d, generator=torch.Generator().manual_seed(5))
    scaling = d ** -0.5
    out = attn.decode(h, q, None, scaling)
    mat = None if h.fused is None else h.fused.materialize()
    ref = _oracle(h, keys, q, scaling, mat)
    assert out.shape == (b, 1, heads, d)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    twin = attn.reference(h, q, None, scaling)
    torch.testing.assert_close(out, twin, atol=2e-5, rtol=1e-5)
    if method in ("int8", "int4", "int3", "int2"):  # the C++ ops read the chosen pages in place (no copy)
        from kvslim.kernels import quant_decode as qd

        assert attn._in_place(h.fused, h.stats.spec.page) == (qd._backend("cpu") == "cpp")
    # the rows read: the budget's pages plus the rest of the region and the tail, never more than budget + page
    rows = attn.select(h, q.float().reshape(b, hk, heads // hk, d))
    read = rows.shape[-1] + h.stats.offset + (h.tokens - h.n - h.stats.offset)
    assert read <= h.stats.spec.budget + h.stats.spec.page
    assert bool((rows[..., 1:] > rows[..., :-1]).all())  # ascending, no row twice
    # always read: the sinks (the rows before the region, or page 0) and the newest spec.window positions
    spec, total = h.stats.spec, h.tokens
    pos = attn._temporal(h, rows, total)
    must = list(range(total - spec.window, total)) + list(range(h.stats.offset))
    if spec.sinks_in_pages:
        must += list(range(spec.page))
    for i in range(b):
        for j in range(hk):
            assert set(must) <= set(pos[i, j].tolist())


def test_masked_step_reads_the_same_rows(model):
    """With an attention mask (padding) the step runs the twin over the same rows; masked rows get no weight."""
    layer, _ = _layer(model, "int4", sparse_budget=256, sparse_dense_layers=0)
    keys, _, h = _step(layer, 2, 2, 16, prompt=700)
    q = torch.randn(2, 4, 1, 16)
    mask = torch.ones(2, 1, 1, h.tokens, dtype=torch.bool)
    out = attn.decode(h, q, mask, 0.25)
    torch.testing.assert_close(out, attn.decode(h, q, None, 0.25), atol=2e-5, rtol=1e-5)
    mask[1, :, :, 500:] = False  # sequence 1 sees only its first 500 tokens
    masked = attn.decode(h, q, mask, 0.25)
    assert torch.isfinite(masked).all()
    torch.testing.assert_close(masked[0], out[0], atol=2e-5, rtol=1e-5)
    assert not torch.allclose(masked[1], out[1])


@pytest.mark.parametrize("score", ["meanstd", "minmax"])
def test_page_boxes(score):
    """Statistics are computed once per page from the keys as written, in any split of the writes (within one
    code step); minmax boxes (int8, rounded outward) contain every key of their page; meanstd centres are the mean
    within half a code step (the scales are per page and 16 channels: one per page and half here, D = 8)."""
    spec = SparseSpec(512, 16, score)
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2, 70, 8, generator=g) * 50
    a, b = PageStats(spec, offset=3), PageStats(spec, offset=3)
    a.write(0, keys)
    for t in range(70):  # one token at a time, as decode steps write
        b.write(t, keys[:, :, t:t + 1])
    assert a.complete == b.complete == (70 - 3) // 16
    assert a.boxes.dtype == torch.int8 and a.scales.dtype == torch.float16
    step = a.scales[:, :, :a.complete, :1].float()  # the centre's code step (one group: D = 8)
    assert bool(((a.centre - b.centre).abs() <= step * 1.001 + 1e-5).all())
    region = keys[:, :, 3:3 + 16 * a.complete].reshape(1, 2, a.complete, 16, 8)
    lo = (a.centre - a.radius)[:, :, :, None]
    hi = (a.centre + a.radius)[:, :, :, None]
    if score == "minmax":
        assert bool((region >= lo).all() and (region <= hi).all())
    else:
        assert bool(((a.centre - region.mean(3)).abs() <= step * 0.5 + 1e-4).all())
        assert float((a.centre - region.mean(3)).abs().max()) > 0  # coded: not the fp32 mean itself


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_within_budget_is_the_full_read_bitwise(model, method, one_thread):
    """A context that fits the budget: logits bitwise equal to the method without sparse decode."""
    ids = torch.randint(0, 128, (2, 150), generator=torch.Generator().manual_seed(3))
    kvslim.apply(model, method)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                         output_scores=True, return_dict_in_generate=True)
    kvslim.apply(model, method, sparse_budget=4096, sparse_dense_layers=0)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                         output_scores=True, return_dict_in_generate=True)
    kvslim.restore(model)
    assert all(torch.equal(a, b) for a, b in zip(ref.scores, out.scores))


@pytest.mark.parametrize("method", ["dense", "int4", "turbo3"])
def test_generate_sparse_end_to_end(model, method, one_thread):
    """Past the budget: generate runs the sparse steps (counted), on a padded batch too; logits stay finite and
    close to the full read (a random tiny model attends broadly, so the budget loses little)."""
    ids = torch.randint(0, 128, (2, 420), generator=torch.Generator().manual_seed(4))
    kvslim.apply(model, method)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                         output_scores=True, return_dict_in_generate=True)
    kvslim.apply(model, method, sparse_budget=256, sparse_dense_layers=2)  # one layer sparse: calls counted below
    calls = []
    original, masked, listed = attn.select_pages, attn._masked, attn._page_list
    attn.select_pages = lambda h, *a, **kw: calls.append(h.pages) or original(h, *a, **kw)
    attn._masked = lambda h, *a: calls.append(h.pages) or masked(h, *a)
    attn._page_list = lambda h, *a: calls.append(h.pages) or listed(h, *a)  # the op's list (or its in-call choice)
    try:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
        pids, pmask = padded_batch(2, 420)
        padded = model.generate(pids, attention_mask=pmask, max_new_tokens=2, do_sample=False,
                                output_scores=True, return_dict_in_generate=True)
    finally:
        attn.select_pages, attn._masked, attn._page_list = original, masked, listed
        kvslim.restore(model)
    assert len(calls) == 2 * 1 + 1 * 1  # 2 decode steps, then 1 (padded), on the one layer past sparse_dense_layers=2
    for a, b in zip(ref.scores, out.scores):
        assert torch.isfinite(b).all()
        assert (a - b).abs().max() < 0.5
    assert all(torch.isfinite(s).all() for s in padded.scores)


def test_select_prompt_keeps_the_choice(model):
    """``select="prompt"``: the first step after a multi-token call chooses (into the cache's buffer, recorded by
    the cache on the host), later steps read that choice whatever their query, a new multi-token call chooses
    again."""
    layer, _ = _layer(model, "dense", sparse_budget=256, sparse_dense_layers=0, sparse_select="prompt")
    _, _, h = _step(layer, 1, 2, 16, prompt=700)
    q1, q2 = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
    assert h.choose and h.kept is not None
    r1 = attn.select(h, q1.reshape(1, 2, 1, 16))
    k, _ = layer.update(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16))  # the next step reads the choice
    h2 = sparse_of(k)
    assert not h2.choose and h2.kept is h.kept
    assert torch.equal(attn.select(h2, q2.reshape(1, 2, 1, 16))[..., :r1.shape[-1]], r1)
    layer.update(torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16))  # a new turn: chosen again
    assert layer.page_stats.kept_pages is None


def test_nbytes_match_the_plan(model):
    for method in ("dense", "int4", "int8"):
        layer, plan = _layer(model, method, sparse_budget=256, sparse_dense_layers=0)
        _step(layer, 1, 2, 16, prompt=700)
        assert layer.page_stats.nbytes() > 0
        assert layer.nbytes == plan.layers[2].cache_bytes(701), method


@pytest.mark.parametrize("options, needle", [
    (dict(sparse_budget=100), "sparse_budget=100"),
    (dict(sparse_budget=2048, sparse_page=48), "sparse_page"),
    (dict(sparse_budget=2048, sparse_page=8), "sparse_page"),
    (dict(sparse_budget=2048, sparse_score="topk"), "sparse_score"),
    (dict(sparse_budget=2048, sparse_select="always"), "sparse_select"),
    (dict(sparse_budget=2048, sparse_dense_layers=7), "sparse_dense_layers"),
    (dict(sparse_budget=2048, sparse_dense_layers=[0, 9]), "sparse_dense_layers"),
    (dict(sparse_page=64), "needs sparse_budget"),
    (dict(sparse_budgte=2048), "allowed: .*'sparse_budget'"),  # a misspelt option lists the sparse ones too
    (dict(sparse_budget=0), "sparse_budget"),
])
def test_bad_input_names_the_option(model, options, needle):
    kvslim.apply(model, "int4")
    before = kvslim.get_plan(model)
    with pytest.raises(ValueError, match=needle):
        kvslim.apply(model, "int4", **options)
    assert kvslim.get_plan(model) is before  # nothing changed
    kvslim.restore(model)


def test_page_must_hold_whole_key_groups():
    from transformers import LlamaConfig

    from kvslim.adapters.shape import shape_from_config

    shape = shape_from_config(LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                          num_hidden_layers=3, vocab_size=128, intermediate_size=128))
    with pytest.raises(ValueError, match="sparse_page=16 must be a multiple of the key groups' 32"):
        METHODS["int4"].plan(shape, torch.float32, sparse_budget=2048, sparse_page=16)
    plan = METHODS["int4"].plan(shape, torch.float32, sparse_budget=2048, sparse_page=32)
    assert plan.layers[2].sparse.pages == (2048 - 128) // 32
    assert all(layer.sparse is not None for layer in plan.layers)  # sparse_dense_layers=0 by default: every layer
    assert {layer.sparse.score for layer in plan.layers} == {"minmax"}  # min/max boxes by default (docs/sparse.md)
    ms = METHODS["int4"].plan(shape, torch.float32, sparse_budget=2048, sparse_score="meanstd")
    assert {layer.sparse.score for layer in ms.layers} == {"meanstd"} and ms.cache_bytes(4096) == plan.cache_bytes(4096)
    two = METHODS["int4"].plan(shape, torch.float32, sparse_budget=2048, sparse_dense_layers=2)
    assert [layer.sparse is None for layer in two.layers] == [True, True, False]
    # what a step reads: everything within the budget, ~budget rows + the statistics past it (kvslim plan prints it)
    assert plan.step_read_bytes(1024) == plan.cache_bytes(1024)
    full = METHODS["int4"].plan(shape, torch.float32)
    assert plan.cache_bytes(32768) > full.cache_bytes(32768)  # the statistics are counted
    sparse_layer = plan.layers[2].step_read_bytes(32768)
    assert sparse_layer < full.layers[2].cache_bytes(32768) / 4  # at page 32 the boxes are over half of it
    assert "a single-token step reads" in str(plan)


def test_sparse_refused_where_it_cannot_run(model):
    with pytest.raises(ValueError, match="sparse_budget"):
        kvslim.apply(model, "window", window=16, sparse_budget=2048)
    with pytest.raises(ValueError, match="sparse_budget"):
        kvslim.apply(model, "int8", window=16, sparse_budget=2048)
    mha = tiny_model("llama", kv_heads=4)
    with pytest.raises(ValueError, match="sparse_budget"):
        kvslim.apply(mha, "slim", sparse_budget=2048)
    kvslim.apply(model, "int4", sparse_budget=512, sparse_select="prompt")
    with pytest.raises(ValueError, match="sparse_select='prompt'"):  # a choice kept on the host: not capturable
        kvslim.make_cache(model, max_length=64, capturable=True)
    kvslim.restore(model)


def test_cli_spelling(model):
    from kvslim.cli.method_options import parse_method_options

    opts = parse_method_options(["int4.sparse_budget=2048", "int4.sparse_score=minmax"], ["int4"])
    assert opts == {"int4": {"sparse_budget": 2048, "sparse_score": "minmax"}}
    with pytest.raises(ValueError, match="sparse_page"):
        parse_method_options(["int4.sparse_budget=2048", "int4.sparse_page=100"], ["int4"])
    # dense takes sparse decode's options (and only those) on every command that runs it (plan, eval, cache-prompt)
    assert parse_method_options(["dense.sparse_budget=512"], ["dense", "int4"]) == {"dense": {"sparse_budget": 512}}
    with pytest.raises(ValueError, match="dense cache takes no options but sparse decode's"):
        parse_method_options(["dense.chunk=8"], ["dense", "int4"])
    with pytest.raises(ValueError, match="sparse_score"):
        parse_method_options(["dense.sparse_budget=512", "dense.sparse_score=max"], ["dense"])
    plan = kvslim.apply(model, "dense", **parse_method_options(["dense.sparse_budget=512"], ["dense"])["dense"])
    assert plan.options == {"sparse_budget": 512}
    kvslim.restore(model)


def _filled_key_value_stores(spec, b: int, h: int, d: int, g: torch.Generator):
    """A key store of ``spec`` and its value store, each filled with 1,024 random rows (B, H, 1024, D); the coded
    inner store where a residual window wraps it."""
    from kvslim.caches.stores import make_store

    stores = []
    for sp in (spec, spec.for_values()):
        st = make_store(sp, torch.zeros(b, h, 1, d), 1024)
        st.write(0, torch.randn(b, h, 1024, d, generator=g))
        stores.append(getattr(st, "inner", st))
    return stores


@pytest.mark.parametrize("kind", ["kivi4", "int8", "int4"])
@pytest.mark.parametrize("backend", ["cpp", "torch", "triton"])
def test_quant_decode_page_list(kind, backend, monkeypatch):
    """``kvslim::quant_decode`` with a page list (rows read in place) equals the op over the same rows gathered
    (C++: every score/value path; the Triton kernels under the interpreter read the rows in place too, the twin a
    gathered copy)."""
    from kvslim.caches.spec import StoreSpec
    from kvslim.kernels import quant_decode as qd

    if backend == "cpp" and not qd.available():
        pytest.skip("C++ op not built")
    monkeypatch.setenv("KVSLIM_BACKEND", backend)
    spec = {"kivi4": StoreSpec(4, 64, torch.float16, asymmetric=True, channel_group=32, residual=64, flush=32),
            "int8": StoreSpec(8, 32), "int4": StoreSpec(4, 32, asymmetric=True)}[kind]
    g = torch.Generator().manual_seed(0)
    b, h, grp, d, page = 2, 3, 2, 64, 64
    k, v = _filled_key_value_stores(spec, b, h, d, g)
    pages = torch.stack([torch.randperm(14, generator=g)[:6].sort().values for _ in range(b * h)]).view(b, h, 6)
    n = 6 * page - 24  # the last page partly read (pages < 14: the residual store has coded 960 of 1,024 rows)
    q = torch.randn(b, h, grp, d, generator=g)
    tensors = (k.data, k.scale, k.zero, v.data, v.scale, v.zero)
    gathered = [None if t is None else qd.paged_rows(t, pages, page) for t in tensors]
    paths = [("exact", "exact"), ("int8", "int8")] if backend == "cpp" else [(None, None)]
    for scores, values in paths:
        out = qd.quant_decode(q, *tensors, spec.bits, spec.group_size, spec.channel_group, n, pages=pages,
                              page=page, scores=scores, values=values)
        ref = qd.quant_decode(q, *gathered, spec.bits, spec.group_size, spec.channel_group, n, scores=scores,
                              values=values)
        torch.testing.assert_close(out[0], ref[0], atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(out[1], ref[1], atol=2e-6, rtol=1e-5)
    if backend == "cpp":
        with pytest.raises(ValueError, match="pages"):
            qd.quant_decode(q, *tensors, spec.bits, spec.group_size, spec.channel_group, n,
                            pages=pages + 100, page=page)


@pytest.mark.parametrize("kivi", [64, 0])
@pytest.mark.parametrize("backend", ["cpp", "torch", "triton"])
def test_quant_decode_lowbit_page_list(kivi, backend, monkeypatch):
    """``kvslim::quant_decode_lowbit`` (int3/int2 codes) with a page list equals the op over the gathered rows."""
    from kvslim.caches.spec import StoreSpec
    from kvslim.kernels import quant_decode_lowbit as ql
    from kvslim.kernels.quant_decode import paged_rows

    if backend == "cpp" and not ql.available():
        pytest.skip("C++ op not built")
    monkeypatch.setenv("KVSLIM_BACKEND", backend)
    spec = StoreSpec(3, 64, torch.float16, asymmetric=True, channel_group=kivi, residual=64 if kivi else 0,
                     flush=64 if kivi else 1, value_bits=2, value_rotation="hadamard")
    g = torch.Generator().manual_seed(1)
    b, h, grp, d, page = 2, 2, 3, 64, 64
    k, v = _filled_key_value_stores(spec, b, h, d, g)
    pages = torch.stack([torch.randperm(14, generator=g)[:5].sort().values for _ in range(b * h)]).view(b, h, 5)
    n = 5 * page - 40
    q = torch.randn(b, h, grp, d, generator=g)
    tensors = (k.data, k.scale, k.zero, v.data, v.scale, v.zero)
    out = ql.quant_decode_lowbit(q, *tensors, 3, 2, 64, kivi, n, pages=pages, page=page)
    ref = ql.quant_decode_lowbit(q, *[paged_rows(t, pages, page) for t in tensors], 3, 2, 64, kivi, n)
    torch.testing.assert_close(out[0], ref[0], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(out[1], ref[1], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("outliers, bias", [(0, False), (16, True)], ids=["turbo4-like", "turbo3-rope-centred"])
@pytest.mark.parametrize("backend", ["cpp", "torch", "triton"])
def test_turbo_decode_page_list(outliers, bias, backend, monkeypatch):
    """``kvslim::turbo_decode`` with a page list (codes, scales and the RoPE-centred bias rows read in place by stored
    row) equals the op over the same rows gathered, with a tail and a mask (issue 48 item 2: turbo3 stops falling
    back to the twin). The Triton kernel reads them in place too; the twin a gathered copy."""
    from kvslim.kernels import turbo_decode as td

    if backend == "cpp" and not td.available():
        pytest.skip("C++ op not built")
    monkeypatch.setenv("KVSLIM_BACKEND", backend)
    g = torch.Generator().manual_seed(0)
    b, h, grp, d, page, stored, k_bits, v_bits, w = 2, 3, 2, 64, 32, 512, 3, 3, 64
    kbytes = (outliers * (k_bits + 1) + (d - outliers) * k_bits) // 8
    k_codes = torch.randint(0, 256, (b, h, stored, kbytes), dtype=torch.uint8, generator=g)
    v_codes = torch.randint(0, 256, (b, h, stored, d * v_bits // 8), dtype=torch.uint8, generator=g)
    k_scale = torch.rand(b, h, stored, 2 if outliers else 1, generator=g).half()
    v_scale = torch.rand(b, h, stored, 1, generator=g).half()
    pages = torch.stack([torch.randperm(stored // page, generator=g)[:5].sort().values
                         for _ in range(b * h)]).view(b, h, 5)
    n, r = 5 * page - 7, 4
    q = torch.randn(b, h, grp, d, generator=g)
    kt, vt = torch.randn(b, h, r, d, generator=g), torch.randn(b, h, r, d, generator=g)
    mask = torch.zeros(b, n + r)
    mask[1, 3:9] = float("-inf")
    ab = torch.randn(b, h, grp, w, generator=g) if bias else None
    rows = torch.randn(stored, w, generator=g) if bias else None
    out = td.turbo_decode(q, k_codes, k_scale, v_codes, v_scale, outliers, k_bits, v_bits, n, kt, vt, mask, 0.125,
                          ab, rows, pages=pages, page=page)
    gathered = [qd_rows(t, pages, page) for t in (k_codes, k_scale, v_codes, v_scale)]
    grows = None
    if bias:
        idx = (pages[..., None] * page + torch.arange(page)).reshape(b, h, -1)
        grows = rows[idx]
    ref = td.reference(q, *gathered, outliers, k_bits, v_bits, n, kt, vt, mask, 0.125, ab, grows)
    torch.testing.assert_close(out[0], ref[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out[1], ref[1], atol=2e-5, rtol=1e-5)
    if backend == "cpp":
        with pytest.raises(ValueError, match="pages"):
            td.turbo_decode(q, k_codes, k_scale, v_codes, v_scale, outliers, k_bits, v_bits, n, kt, vt, mask, 0.125,
                            ab, rows, pages=pages + 100, page=page)


def qd_rows(t, pages, page):
    from kvslim.kernels.quant_decode import paged_rows

    return paged_rows(t, pages, page)


def test_sparse_turbo3_reads_pages_in_place(model, monkeypatch):
    """A sparse turbo3 step (RoPE-centred keys) goes through ``turbo_decode`` with a page list (it fell back to the
    twin) and equals the twin over the same rows."""
    from kvslim.kernels import turbo_decode as td

    if not td.available():
        pytest.skip("C++ op not built")
    layer, _ = _layer(model, "turbo3", sparse_budget=256, sparse_dense_layers=0)
    _, _, h = _step(layer, 2, 2, 16, 700)
    assert h is not None and h.fused is not None
    seen = []
    real = td.turbo_decode
    monkeypatch.setattr(td, "turbo_decode", lambda *a, **k: seen.append(k.get("select")) or real(*a, **k))
    from kvslim.attention import quant as quant_attn

    monkeypatch.setattr(quant_attn, "turbo_decode", td.turbo_decode)
    q = torch.randn(2, 4, 1, 16, generator=torch.Generator().manual_seed(1))
    out = attn.decode(h, q, None, 0.25)
    assert seen and seen[0] is not None, "the step did not read pages in place (the op choosing them in its call)"
    torch.testing.assert_close(out, attn.reference(h, q, None, 0.25), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["int8", "int4", "int3", "int2", "turbo3"])
@pytest.mark.parametrize("select", ["step", "prompt"])
def test_op_chooses_its_pages_in_the_call(model, method, select, monkeypatch):
    """The C++ decode ops choose a step's pages in their own call (``select=PageChoice``): the output equals, bit
    for bit, the two-call path (``kvslim::sparse_select``, then the op through that page list), the Python
    selection never runs, and a ``select="prompt"`` cache's buffer receives the same choice."""
    from kvslim.kernels import quant_decode as qd
    from kvslim.kernels import sparse_select as ss

    if qd._backend("cpu") != "cpp" or not ss.available():
        pytest.skip("C++ ops not built")
    layer, _ = _layer(model, method, sparse_budget=256, sparse_dense_layers=0, sparse_select=select)
    _, _, h = _step(layer, 2, 2, 16, 700)
    assert h is not None and h.fused is not None and h.pages > h.stats.spec.pages
    q = torch.randn(2, 4, 1, 16, generator=torch.Generator().manual_seed(3))
    qg = q.float().reshape(2, 2, 2, 16)
    p = h.stats.spec.page
    extra = -(-(h.n - h.pages * p) // p)
    listed = ss.sparse_select(qg, h.stats.boxes, h.pages, h.k, 0.25, h.stats.spec.sinks_in_pages, extra,
                              scales=h.stats.scales)
    k = listed.shape[-1] - extra
    import dataclasses

    from kvslim.attention import quant as quant_attn

    two = quant_attn.decode(dataclasses.replace(h.fused, n=k * p + h.n - h.pages * p, lengths=None, pages=listed,
                                                page=p), q, None, 0.25)
    calls = []
    monkeypatch.setattr(ss, "sparse_select", lambda *a, **kw: calls.append(1))  # would break the step if called
    if h.kept is not None:
        h.kept.zero_()
    one = attn.decode(h, q, None, 0.25)
    assert calls == [], "the selection ran outside the op"
    assert torch.equal(one, two)
    if select == "prompt":
        assert torch.equal(h.kept, listed[..., :k])


def test_in_call_choice_refuses_bad_input(model):
    """A page list and boxes together, boxes without the queries, a ``chosen`` buffer of another shape: refused by
    name, nothing written."""
    from kvslim.kernels import quant_decode as qd
    from kvslim.kernels import sparse_select as ss

    if qd._backend("cpu") != "cpp" or not ss.available():
        pytest.skip("C++ ops not built")
    layer, _ = _layer(model, "int4", sparse_budget=256, sparse_dense_layers=0)
    _, _, h = _step(layer, 1, 2, 16, 700)
    f, st = h.fused, h.stats
    q = torch.randn(1, 2, 2, 16)
    base = (q, f.k.data, f.k.scale, f.k.zero, f.v.data, f.v.scale, f.v.zero, 4, f.k.spec.group_size,
            f.k.spec.channel_group, 32 * 4, None, None, None, None, 0.25)
    listed = ss.sparse_select(q, st.boxes, h.pages, 4, 0.25, True, 0, scales=st.scales)
    with pytest.raises(ValueError, match="exclude"):
        qd.quant_decode(*base, pages=listed, page=32,
                        select=ss.PageChoice(q, st.boxes, st.scales, h.pages, 4, True))
    op = torch.ops.kvslim.quant_decode
    with pytest.raises(ValueError, match="sel_q"):
        op(*base, page=32, boxes=st.boxes, box_scales=st.scales, sel_pages=h.pages, sel_k=4)
    bad = torch.full((1, 2, 3), -1, dtype=torch.int64)
    with pytest.raises(ValueError, match="chosen"):
        op(*base, page=32, sel_q=q, boxes=st.boxes, box_scales=st.scales, sel_pages=h.pages, sel_k=4,
           sel_force=True, chosen=bad)
    assert bool((bad == -1).all())
    good = torch.full((1, 2, 4), -1, dtype=torch.int64)
    with pytest.raises(ValueError, match="pages"):  # the list's rest reaches past the stored rows: checked later
        op(*base, page=32, sel_q=q, boxes=st.boxes, box_scales=st.scales, sel_pages=h.pages, sel_k=4,
           sel_force=True, sel_rest=10_000, chosen=good)
    assert bool((good == -1).all())  # the buffer is written only once every check passed
    out, _ = op(*base, page=32, sel_q=q, boxes=st.boxes, box_scales=st.scales, sel_pages=h.pages, sel_k=4,
                sel_force=True, chosen=good)
    assert torch.equal(good, listed)
    out, _ = op(*base, page=32, sel_q=q, boxes=st.boxes, box_scales=st.scales, sel_pages=h.pages, sel_k=4,
                sel_force=True)
    ref, _ = op(*base, pages=listed, page=32)
    assert torch.equal(out, ref)


def test_a_step_reads_its_mask_once_for_every_layer(model, monkeypatch):
    """The layers of one cache share a step's view of its attention mask (padding pages, each row's first page):
    computed for the first layer, reused by the next; recomputed for another mask object or after the mask was
    changed in place. Outputs equal a fresh computation."""
    from kvslim.attention import quant as quant_attn

    pool = ScratchPool()
    handles = []
    for index in (1, 2):
        layer, _ = _layer(model, "int4", index=index, sparse_budget=256, sparse_dense_layers=0)
        layer.scratch_pool = pool
        handles.append(_step(layer, 2, 2, 16, 700, seed=index)[2])
    q = torch.randn(2, 4, 1, 16, generator=torch.Generator().manual_seed(2))
    total = handles[0].tokens
    mask = torch.ones(2, 1, 1, total, dtype=torch.bool)
    mask[1, ..., :100] = False  # row 1 left-padded
    seen = []
    real = quant_attn.additive_mask
    monkeypatch.setattr(quant_attn, "additive_mask", lambda m, t: seen.append(m) or real(m, t))

    def views(m):  # how many times the view was computed for mask m
        return sum(x is m for x in seen)

    outs = [attn.decode(h, q, mask, 0.25) for h in handles]
    assert views(mask) == 1  # the second layer reused the first's view
    mask[1, ..., :164] = False  # changed in place: the view is computed again
    again = attn.decode(handles[1], q, mask, 0.25)
    assert views(mask) == 2
    other = mask.clone()
    attn.decode(handles[1], q, other, 0.25)
    assert views(mask) == 2 and views(other) == 1
    pool.memo.clear()
    torch.testing.assert_close(attn.decode(handles[1], q, mask, 0.25), again, atol=0, rtol=0)
    mask[1, ..., :164] = True
    mask[1, ..., :100] = False
    pool.memo.clear()
    torch.testing.assert_close(attn.decode(handles[0], q, mask, 0.25), outs[0], atol=0, rtol=0)
    with torch.inference_mode():  # inference tensors have no version counter (generate and kvslim bench run here)
        frozen = mask.clone()
        assert frozen.is_inference()
        got = [attn.decode(h, q, frozen, 0.25) for h in handles]
    assert views(frozen) == 1
    for a, b in zip(got, outs):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("method", ["int4", "int2", "turbo3"])
def test_prompt_choice_read_after_new_pages(model, method):
    """``select="prompt"``: steps after the choice read the kept pages and every page completed since, through the
    op's page list; the output equals the twin over the same rows (the list is longer than the budget's pages)."""
    layer, _ = _layer(model, method, sparse_budget=256, sparse_dense_layers=0, sparse_select="prompt")
    keys, values, h = _step(layer, 2, 2, 16, 700)
    q = torch.randn(2, 4, 1, 16, generator=torch.Generator().manual_seed(4))
    attn.decode(h, q, None, 0.25)  # the choice, kept
    g = torch.Generator().manual_seed(5)
    for _ in range(70):  # two more pages complete (page 32 or 64 tokens)
        k = torch.randn(2, 2, 1, 16, generator=g)
        h = sparse_of(layer.update(k, torch.randn(2, 2, 1, 16, generator=g))[0])
    assert h is not None and not h.choose and h.pages > h.stats.kept_pages
    out = attn.decode(h, q, None, 0.25)
    torch.testing.assert_close(out, attn.reference(h, q, None, 0.25), atol=2e-5, rtol=1e-5)
