"""The long-context retrieval protocol (issue 34, ``kvslim.longctx``) on tiny models at a few hundred tokens:
tasks deterministic from a seed, every inserted sentence at its stated token position, one shared prefill equal
to a real prefill through each cache (codes and answers token for token; turbo3/turbo2 included: their first write
fits the key means and outlier channels, the same write in both), resume skipping finished cells."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import tiny_model

from kvslim import api
from kvslim.adapters.compat import CACHE_KW
from kvslim.longctx import DEPTHS, filler_units, instances, protocol, wilson
from kvslim.longctx import haystack as hs
from kvslim.longctx.protocol import answer, fill, make_cache_fn, prefill_kv, run, settled
from kvslim.models import load_tiny_mha
from kvslim.optional import quanto_missing

QUANTO = quanto_missing() is None


@pytest.fixture(scope="module")
def tiny_mha():
    model, tok = load_tiny_mha(torch.float32)
    api.apply(model, "dense")
    yield model.eval(), tok
    api.restore(model)


def test_tasks_deterministic_from_seed_one_per_haystack():
    a, b = instances(0, 512, 3), instances(0, 512, 3)
    assert a == b and len(a) == 1
    assert instances(1, 512, 3) != a and instances(0, 512, 7) != a
    firsts = [instances(0, 512, t)[0] for t in range(4)]
    assert [i.task for i in firsts] == ["passkey", "multikey", "multivalue", "vartrack"]  # in turn
    assert len({i.depth for i in firsts}) == 4  # the first four haystacks: four depths
    for task in ("passkey", "vartrack"):  # twenty haystacks: every task at every depth once
        got = [i.depth for t in range(20) for i in instances(0, 512, t) if i.task == task]
        assert sorted(got) == sorted(DEPTHS), (task, got)
    assert [i.task for t in range(4) for i in instances(0, 512, t, ["vartrack", "passkey"])] == [
        "vartrack", "passkey", "vartrack", "passkey"]
    with pytest.raises(ValueError, match="tasks"):
        instances(0, 512, 0, ["passkey", "needle"])


def test_needles_at_their_stated_positions(tiny_mha):
    _, tok = tiny_mha
    units = filler_units()
    assert len(units) > 500 and not any(c.isdigit() for u in units for c in u)  # numbers only in the needles
    insts = [instances(7, 600, t)[0] for t in range(4)]  # every task, in one haystack as build() allows
    h1 = hs.build(tok, insts, 600, units, random.Random(1))
    h2 = hs.build(tok, insts, 600, units, random.Random(1))
    assert h1.ids.shape == (1, 600) and torch.equal(h1.ids, h2.ids)
    for q in h1.questions:
        inst = q.instance
        assert len(q.positions) == len(inst.inserts)
        for pos, (_, sentence) in zip(q.positions, inst.inserts):
            piece = tok(" " + sentence, add_special_tokens=False).input_ids
            assert h1.ids[0, pos:pos + len(piece)].tolist() == piece
        assert abs(q.depth_measured - inst.depth) < 0.12, (inst.task, q.depth_measured, inst.depth)
        assert inst.question in tok.decode(q.ids[0])


def test_settled_and_wilson():
    inst = instances(0, 512, 2)[0]  # multivalue: three values, any order
    a, b, c = inst.expected
    assert settled(f" {a}, {b}", inst) is None  # b may still grow
    assert settled(f" {c}, {a}, {b}.", inst) is True
    assert settled(" 12345, ", inst) is False and settled("1. ", inst) is None  # list numbering is no item
    lo, hi = wilson(5, 5)
    assert hi == 1.0 and lo == pytest.approx(0.5655, abs=1e-3)
    assert wilson(0, 5)[0] == 0.0


def _methods(model):
    out = {"dense": make_cache_fn(model, "dense"),
           "int8": make_cache_fn(model, "int8"),
           "int4": make_cache_fn(model, "int4", residual=16, sink=2, key_channel_group=16, group_size=16),
           "int3": make_cache_fn(model, "int3"),
           "int2": make_cache_fn(model, "int2", residual=32, key_channel_group=16, group_size=16),
           "turbo3": make_cache_fn(model, "turbo3", residual=16, sink=2, flush=8),  # RoPE-centred keys, outliers
           "turbo2": make_cache_fn(model, "turbo2", residual=16, sink=2, flush=8),
           "window 64": make_cache_fn(model, "window", window=64)}
    if QUANTO:
        out["quanto 2-bit"] = make_cache_fn(model, "quanto", nbits=2)
    return out


def _stores(cache) -> list[torch.Tensor]:
    """What each layer's attention reads back of the history: kvslim stores decoded, quanto's codes dequantized."""
    out = []
    for layer in cache.layers:
        if hasattr(layer, "k_store"):
            out += [store.read(0, layer.cumulative_length) for store in layer._stores()]
        else:
            out += [layer._dequantize(layer._quantized_keys), layer._dequantize(layer._quantized_values)]
    return out


@torch.inference_mode()
def test_shared_prefill_equals_real_prefill_token_for_token():
    """One dense prefill, its keys and values written through each cache's ``update``, gives the cache a real
    one-call prefill through it gives (the history as attention reads it back, bitwise) and the same answer logits
    (bitwise) and tokens."""
    model = tiny_model("llama", max_position_embeddings=1024).eval()
    api.apply(model, "dense")
    try:
        g = torch.Generator().manual_seed(0)
        ids, question = torch.randint(0, 128, (1, 200), generator=g), torch.randint(0, 128, (1, 9), generator=g)
        kv = prefill_kv(model, ids)
        for label, make in _methods(model).items():
            real = make()
            model(ids, use_cache=True, **{CACHE_KW: real}, logits_to_keep=1)
            shared = fill(make(), kv)
            for x, y in zip(_stores(real), _stores(shared), strict=True):
                assert torch.equal(x, y), label
            toks = []
            for cache in (real, shared):
                logits, seq = model(question, use_cache=True, **{CACHE_KW: cache}).logits[0, -1], []
                for _ in range(5):
                    seq.append((int(logits.argmax()), logits))
                    logits = model(torch.tensor([[seq[-1][0]]]), use_cache=True, **{CACHE_KW: cache}).logits[0, -1]
                toks.append(seq)
            assert [t for t, _ in toks[0]] == [t for t, _ in toks[1]], label
            for (_, a), (_, b) in zip(*toks):
                assert torch.equal(a, b), label
    finally:
        api.restore(model)


def test_run_appends_per_cell_and_resumes(tiny_mha, tmp_path, monkeypatch):
    model, tok = tiny_mha
    out = tmp_path / "cells.jsonl"
    units = filler_units()
    caches = {"dense": make_cache_fn(model, "dense"), "int4": make_cache_fn(model, "int4")}
    kw = dict(lengths=[200, 240], trials=2, tasks=["passkey", "vartrack"], units=units, out=out, progress=False,
              max_new=1)
    first = run(model, tok, caches, meta={"model": "tiny"}, **kw)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(first) == len(lines) == 2 * 2 * 2  # (2 lengths x 2 haystacks, one task each) x 2 caches
    assert {(r["length"], r["trial"], r["method"], r["task"]) for r in lines} == {
        (n, t, m, ("passkey", "vartrack")[t]) for n in (200, 240) for t in (0, 1) for m in caches}
    order = list(dict.fromkeys((r["trial"], r["length"]) for r in lines))
    assert order == [(0, 200), (0, 240), (1, 200), (1, 240)]  # trial-major: a cut run holds every length
    r = lines[0]
    assert r["model"] == "tiny" and r["length"] == 200 and isinstance(r["correct"], bool)
    assert r["bytes_per_token"] > 0 and r["new_tokens"] >= 1
    calls = []
    monkeypatch.setattr(protocol, "prefill_kv", lambda *a: calls.append(a) or prefill_kv(*a))
    again = run(model, tok, caches, **kw)
    assert calls == [] and len(again) == 8 and out.read_text().count("\n") == 8  # nothing redone
    with open(out, "a") as f:
        f.write('{"length": 200, "trial"')  # a line cut by a killed run is ignored
    run(model, tok, {**caches, "int2": make_cache_fn(model, "int2")}, **kw)
    assert len(calls) == 4  # one prefill per haystack, only for the missing cache
    new = [json.loads(x) for x in out.read_text().splitlines()[9:]]  # after the 8 lines and the cut one
    assert {r["method"] for r in new} == {"int2"} and len(new) == 4


def test_answer_stops_at_max_new(tiny_mha):
    model, tok = tiny_mha
    insts = instances(0, 256, 0, ["passkey"])
    h = hs.build(tok, insts, 256, filler_units(), random.Random(0))
    kv = prefill_kv(model, h.ids)
    text, n = answer(model, tok, fill(make_cache_fn(model, "dense")(), kv), h.questions[0], max_new=4)
    assert 1 <= n <= 4 and isinstance(text, str)


def test_saved_prefill_is_read_back_and_removed(tiny_mha, tmp_path, monkeypatch):
    """``kv_dir``: a haystack's prefill saved by a killed run is read back instead of prefilled again, and removed
    once every cell of the haystack is written."""
    model, tok = tiny_mha
    kw = dict(lengths=[200], trials=1, tasks=["passkey"], units=filler_units(), progress=False, max_new=1)
    caches = {"dense": make_cache_fn(model, "dense")}
    kv_dir = tmp_path / "kv"
    saved = {}
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, path: (saved.setdefault("path", path), real_save(obj, path)))
    first = run(model, tok, caches, out=tmp_path / "a.jsonl", kv_dir=kv_dir, **kw)
    assert saved and list(kv_dir.iterdir()) == []  # saved while the haystack ran, removed after its cells
    # a run killed after the prefill: its file is there; the next run reads it back and prefills nothing
    h = hs.build(tok, instances(0, 200, 0, ["passkey"]), 200, kw["units"], random.Random("kvslim-filler:0:200:0"))
    real_save({"ids": h.ids, "kv": prefill_kv(model, h.ids), "seconds": 1.5}, kv_dir / "kv-0-200-0.pt")
    monkeypatch.setattr(protocol, "prefill_kv", lambda *a: pytest.fail("prefilled again"))
    again = run(model, tok, caches, out=tmp_path / "b.jsonl", kv_dir=kv_dir, **kw)
    assert [r["answer"] for r in again] == [r["answer"] for r in first] and again[0]["prefill_seconds"] == 1.5
    assert list(kv_dir.iterdir()) == []


def test_resumed_cells_are_told_apart_by_seed():
    """A run of another seed must not skip cells a first seed wrote (it skipped seed 3's trials 0 and 1 at 32k
    because seed 0 had written the same length, trial, method and task); records from before the seed was kept
    count as seed 0."""
    from kvslim.longctx.protocol import _key

    r0 = {"length": 32768, "trial": 0, "method": "dense", "task": "passkey", "seed": 0}
    assert _key(r0) != _key({**r0, "seed": 3})
    assert _key({k: v for k, v in r0.items() if k != "seed"}) == _key(r0)
