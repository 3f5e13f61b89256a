"""Sparse decode on a capturable cache (``kvslim.make_cache(model, max_length=N, capturable=True)``; issue 48 item 3):
page boxes written on the device by static steps (``PageStats.write_static``), the page table and the rows each
sequence reads decided on the device (``attention/sparse_static.static_table``), the ops reading the table in place
(``decode_static``). Against the eager layer's boxes bit for bit, against eager sparse decode end to end (the same
pages: logits to fp32 reordering, the same tokens), against its own twin (``static_reference``), under HF's compile
path (one graph for every step) and with a left-padded batch."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import decode_greedy, generate_eager_and_compiled, padded_batch, tiny_model
from tolerances import assert_rel_close

import kvslim
from kvslim.adapters.compat import CACHE_KW
from kvslim.attention import sparse_static as static
from kvslim.caches.sparse import sparse_of

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT, STEPS = 400, 12
#: page 16 (64 where the KIVI key groups are 64 tokens): ~6 pages chosen of ~17 candidates at these lengths
METHODS = [("dense", {}), ("int8", {}), ("int4", {}), ("int4", dict(residual=0, sink=0, key_channel_group=0)),
           ("int2", dict(sparse_page=64)), ("turbo3", {})]


def _model(method: str, **opts):
    model = tiny_model("llama", kv_heads=2, num_hidden_layers=2)
    opts = {"sparse_budget": 256, "sparse_page": 16, "sparse_dense_layers": 0, **opts}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kvslim.apply(model, method, **opts)
    return model


def _spy_tables(monkeypatch) -> list:
    """Every static step's (rows read per sequence, tokens visible) as ``static_table`` computes them."""
    seen = []
    real = static.static_table

    def spy(h, *a, **k):
        out = real(h, *a, **k)
        seen.append((out.rows.clone(), h.length.clone()))
        return out

    monkeypatch.setattr(static, "static_table", spy)
    return seen


def _static_step(method: str, opts: dict, seed: int):
    """A capturable cache of ``method`` after a PROMPT-token prefill and one step of random keys: (its static sparse
    handle, a step query (2, 4, 1, 16))."""
    model = _model(method, **opts)
    cache = kvslim.make_cache(model, max_length=PROMPT + 8, capturable=True)
    cache.enable_sparse_decode()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        cache.update(torch.randn(2, 2, PROMPT, 16, generator=g), torch.randn(2, 2, PROMPT, 16, generator=g), 0)
        k, _ = cache.update(torch.randn(2, 2, 1, 16, generator=g), torch.randn(2, 2, 1, 16, generator=g), 0)
    h = sparse_of(k)
    assert h is not None and h.static
    return h, torch.randn(2, 4, 1, 16, generator=g)


@pytest.mark.parametrize("score", ["minmax", "meanstd"])
@pytest.mark.parametrize("method", ["dense", "int4"])
def test_static_steps_write_the_eager_layers_boxes(method, score):
    """The same keys through an eager layer and a capturable one (a 37-token prefill, then 70 single steps across
    four page ends): after every step the complete pages' int8 boxes, their scales and μ are bit for bit the eager
    layer's (int4: the paged region starts behind its 4 sinks)."""
    model = _model(method, sparse_score=score)
    n = 37 + 70
    ref, cap = kvslim.make_cache(model), kvslim.make_cache(model, max_length=n, capturable=True)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for s in [37] + [1] * 70:
            k, v = torch.randn(2, 2, s, 16, generator=g) * 3, torch.randn(2, 2, s, 16, generator=g)
            ref.update(k, v, 0)
            cap.update(k, v, 0)
            a, b = cap.layers[0].page_stats, ref.layers[0].page_stats
            assert a.complete == b.complete
            c = b.complete
            assert torch.equal(a.boxes[:, :, :c], b.boxes[:, :, :c])
            assert torch.equal(a.scales[:, :, :c], b.scales[:, :, :c])
            if c:
                assert torch.equal(a.mu, b.mu)
    assert c == (n - ref.layers[0].page_stats.offset) // 16 >= 5


@pytest.mark.parametrize("method, opts", METHODS)
def test_capturable_sparse_decode_matches_eager_sparse(method, opts, monkeypatch):
    """Greedy decoding with a capturable cache past the budget: every step is a static sparse step reading fewer
    rows than the context, and the tokens and logits are eager sparse decode's (the same pages; the sums reordered
    at most)."""
    model = _model(method, **opts)
    want_tokens, want_logits = decode_greedy(model, model, kvslim.make_cache(model), PROMPT, STEPS)
    tables = _spy_tables(monkeypatch)
    cache = kvslim.make_cache(model, max_length=PROMPT + STEPS + 1, capturable=True)
    tokens, logits = decode_greedy(model, model, cache, PROMPT, STEPS)
    assert len(tables) == 2 * STEPS  # two layers, every step
    assert all(bool((rows < length - 100).all()) for rows, length in tables)  # ~half the context or less
    assert torch.equal(tokens, want_tokens)
    assert_rel_close(logits, want_logits, torch.float32, f"{method} {opts}")


@pytest.mark.parametrize("kv_heads", [1, 4])
def test_auto_budget_and_group_sizes(kv_heads, monkeypatch):
    """``sparse_budget="auto"`` on a capturable cache takes its pages from the budget at ``max_length`` (here more
    than the context: every row read, as the eager step's full read reads them) — eager's tokens and logits; MQA
    (one KV head for four query heads) and MHA."""
    model = tiny_model("llama", kv_heads=kv_heads, num_hidden_layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kvslim.apply(model, "int8", sparse_budget="auto", sparse_page=16, sparse_dense_layers=0)
    want_tokens, want_logits = decode_greedy(model, model, kvslim.make_cache(model), PROMPT, STEPS, batch=1)
    tables = _spy_tables(monkeypatch)
    cache = kvslim.make_cache(model, max_length=PROMPT + STEPS + 1, capturable=True)
    tokens, logits = decode_greedy(model, model, cache, PROMPT, STEPS, batch=1)
    assert len(tables) == 2 * STEPS and all(bool((rows == length - 1).all()) for rows, length in tables)
    assert torch.equal(tokens, want_tokens)
    assert_rel_close(logits, want_logits, torch.float32, f"auto, {kv_heads} KV heads")


@pytest.mark.parametrize("method, opts", METHODS + [("int4", dict(key_bits=8))])
def test_static_step_equals_its_twin(method, opts):
    """One static step through the ops (pages read in place, rows cut per sequence) equals
    ``static_reference`` (the layer's full static reads, the same rows gathered, fp32 softmax); a store the op
    declines (int4 with 8-bit keys) goes through the twin."""
    h, q = _static_step(method, opts, 6)
    with torch.no_grad():
        real, twin = static.static_reference, []
        static.static_reference = lambda *a, **kw: twin.append(1) or real(*a, **kw)
        try:
            out = static.decode_static(h, q, None, 0.25)
        finally:
            static.static_reference = real
        ref = real(h, q, None, 0.25)
    assert len(twin) == ("key_bits" in opts)  # the ops read the table, but for the store they decline
    assert_rel_close(out, ref, torch.float32, f"{method} {opts}")


@pytest.mark.parametrize("method, opts", [("int4", {}), ("int8", {}), ("turbo3", {})])
def test_a_mask_with_holes_is_honoured(method, opts):
    """A mask that hides rows inside the candidate pages and inside the region's rest (not what ``generate``
    builds, but a mask a caller may pass): a partly hidden page is never chosen, the rest's hidden rows are masked
    in the op's one-row-per-sequence mask, so the op equals the twin (which applies the whole mask by position);
    no hidden row is read."""
    h, q = _static_step(method, opts, 8)
    with torch.no_grad():
        mask = torch.ones(2, 1, 1, h.tokens, dtype=torch.bool)
        mask[:, ..., PROMPT + 1:] = False  # the future
        mask[0, ..., 100:110] = False  # inside candidate pages
        mask[1, ..., 380:386] = False  # inside the region's rest
        t = static.static_table(h, q.reshape(2, 2, 2, 16), mask, 0.25)
        pos, live = static._static_positions(h, t.table, t.rows)
        hidden = ~mask[:, 0, 0][:, None].expand(2, 2, -1).gather(2, pos)
        assert (hidden & live).any()  # the rest's hidden rows are listed (masked), and
        chosen = t.table[:, :, :int(t.valid.min())]
        assert not ((chosen >= (100 - h.stats.offset) // 16) & (chosen <= (109 - h.stats.offset) // 16))[0].any()
        out = static.decode_static(h, q, mask, 0.25)
        ref = static.static_reference(h, q, mask, 0.25)
    assert_rel_close(out, ref, torch.float32, method)


@pytest.mark.parametrize("method, opts", [("int4", {}), ("int8", {}), ("int2", dict(sparse_page=64)),
                                          ("turbo3", {})])
def test_static_step_on_the_triton_backend(method, opts, monkeypatch):
    """The same static step under ``KVSLIM_BACKEND=triton`` (``TRITON_INTERPRET=1``: the kernels a GPU runs: the page
    scores from one kernel over each row's candidate range, a count it reads on the device; the decode kernels
    reading the table in place, rows cut by ``lengths`` or, turbo, by the mask) equals the twin, which scores in
    torch: the same table, unmasked and left-padded."""
    pytest.importorskip("triton")
    from kvslim.kernels.triton import sparse_select as ts

    monkeypatch.setenv("KVSLIM_BACKEND", "triton")
    scored, real_scores = [], ts.page_scores
    monkeypatch.setattr(ts, "page_scores", lambda *a, **kw: scored.append(a[6]) or real_scores(*a, **kw))
    h, q = _static_step(method, opts, 7)
    with torch.no_grad():
        real, twin = static.static_reference, []
        monkeypatch.setattr(static, "static_reference", lambda *a, **kw: twin.append(1) or real(*a, **kw))
        mask = torch.ones(2, 1, 1, h.tokens, dtype=torch.bool)
        mask[..., PROMPT + 1:] = False
        mask[1, ..., :70] = False  # row 1 left-padded over four pages and a half
        outs = [static.decode_static(h, q, m, 0.25) for m in (None, mask)]
        assert not twin and len(scored) == 2 and all(last is not None for last in scored)  # the kernels took it
        monkeypatch.setenv("KVSLIM_BACKEND", "torch")
        refs = [real(h, q, m, 0.25) for m in (None, mask)]
    for out, ref in zip(outs, refs):
        assert_rel_close(out, ref, torch.float32, f"{method} {opts}")


@pytest.mark.parametrize("method, backend", [("int4", None), ("dense", None), ("int4", "triton")])
def test_hf_compile_path_one_graph_for_every_sparse_step(method, backend, monkeypatch):
    """``model.generate`` through HF's compile path with a capturable sparse cache: one graph for all 23 compiled
    steps (page ends crossed, the table's contents changing), the tokens eager sparse decode gives; the cache's
    steps are static sparse steps reading about half the context (one more step, eagerly, after them). Under
    ``KVSLIM_BACKEND=triton`` the graph holds the Triton page scores and decode kernels (custom ops), as on a GPU."""
    if backend:
        pytest.importorskip("triton")
        monkeypatch.setenv("KVSLIM_BACKEND", backend)
    model = _model(method)
    ids = torch.randint(1, 128, (2, PROMPT), generator=torch.Generator().manual_seed(3))
    eager, got, graphs, cache = generate_eager_and_compiled(model, ids, 24, PROMPT + 32)
    assert torch.equal(eager, got)
    assert graphs == 1, f"{graphs} graphs for 23 compiled decode steps"
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        k, _ = cache.update(torch.randn(2, 2, 1, 16, generator=g), torch.randn(2, 2, 1, 16, generator=g), 0)
        h = sparse_of(k)
        assert h is not None and h.static
        rows = static.static_table(h, torch.randn(2, 2, 2, 16, generator=g), None, 0.25).rows
    assert bool((rows < h.length - 150).all()) and int(h.length[0]) == PROMPT + 24


@pytest.mark.parametrize("method", ["int4", "int8", "dense"])
def test_left_padded_batch_matches_eager_sparse(method, monkeypatch):
    """A left-padded batch (HF's whole-buffer mask): padding pages never chosen, the padded row's first visible
    page stands in for its sinks, as the eager sparse step does; the same greedy tokens and logits."""
    model = _model(method)
    ids, mask = padded_batch(3, PROMPT)
    mask[2, :150], ids[2, :150] = 0, 0  # one row padded across many pages
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, **kw)
        tables = _spy_tables(monkeypatch)
        cache = kvslim.make_cache(model, max_length=PROMPT + 9, capturable=True)
        got = model.generate(ids, attention_mask=mask, **{CACHE_KW: cache}, **kw)
    assert len(tables) == 2 * 7
    assert torch.equal(got.sequences, want.sequences)
    assert_rel_close(torch.stack(got.logits), torch.stack(want.logits), torch.float32, method)


def test_sparse_select_prompt_is_refused_with_capturable():
    model = _model("int4", sparse_select="prompt")
    with pytest.raises(ValueError, match="sparse_select='prompt'"):
        kvslim.make_cache(model, max_length=64, capturable=True)
    cache = kvslim.make_cache(model, max_length=64)  # not capturable: its eager steps keep the choice
    assert cache.layers[0].sparse.select == "prompt"
