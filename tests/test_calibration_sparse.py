"""``kvslim.calibrate_sparse``: the layers whose page bound cannot rank the page a head attends to read in full.

The measurement sees a layer whose keys spread over every channel (every page's box bound about the same, the
attended page ranked at random) and passes one whose attended page stands out; on a real model it reads each
layer's captured queries and keys, and ``apply`` takes its list; bad input is refused by name.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

import kvslim
from kvslim.calibration import capture_qkv
from kvslim.calibration_sparse import RECENT, SINKS, calibrate_sparse, page_misses, sparse_miss_rates


def needle_layer(spread: float, *, pages: int = 80, page: int = 16, queries: int = 8, seed: int = 0):
    """One layer's (q, k): keys uniform in ±``spread`` on every channel, one key (mid-haystack) at 0.7·sign(q)
    that the last ``queries`` queries (both heads of the group) seek: at scaling 1/4 its logit is 11 against
    ~N(0, 1.2²) for the widest spread, so every query head puts nearly all its attention on its page; at spread 1
    the other keys of a page reach ~0.88 on every channel, so the needle's page has the same box as any other."""
    g = torch.Generator().manual_seed(seed)
    d, t = 64, SINKS + RECENT + pages * page + queries
    k = (torch.rand(1, t, d, generator=g) * 2 - 1) * spread
    q = torch.randn(2, t, d, generator=g)
    want = torch.where(torch.rand(d, generator=g) < 0.5, -1.0, 1.0)
    q[:, -queries:] = want
    k[0, SINKS + pages * page // 2 + 3] = 0.7 * want
    return q, k


def test_a_bound_that_cannot_rank_misses_and_a_tight_one_does_not():
    q, k = needle_layer(1.0)
    events, misses = page_misses(q, k, 0.25, queries=8, page=16)
    assert events == 16  # 8 queries × 2 heads, each concentrated on the needle's page
    assert misses >= 10  # chosen an eighth of the time at random: ~14 of 16 missed
    q, k = needle_layer(0.1)
    assert page_misses(q, k, 0.25, queries=8, page=16) == (16, 0)


def test_rates_are_the_layers_captured_queries_and_keys():
    m = tiny_model("llama", kv_heads=2, num_hidden_layers=2, max_position_embeddings=2048, seed=2)
    ids = torch.randint(1, 128, (1, SINKS + RECENT + 64 * 16 + 16), generator=torch.Generator().manual_seed(1))
    rates = sparse_miss_rates(m, ids, queries=16, page=16)
    qkv = capture_qkv(m, ids)
    scaling = m.model.layers[0].self_attn.scaling
    assert rates == [page_misses(q[0], k[0], scaling, queries=16, page=16) for q, k, _ in qkv]
    every = calibrate_sparse(m, ids, queries=16, page=16, threshold=0.0, min_events=0)
    assert every == [i for i, (events, _) in enumerate(rates) if events]
    layers = calibrate_sparse(m, ids, queries=16, page=16)
    plan = kvslim.apply(m, "int4", sparse_budget="auto", sparse_dense_layers=layers)
    try:
        assert [lp.sparse is None for lp in plan.layers] == [i in layers for i in range(2)]
    finally:
        kvslim.restore(m)


@pytest.mark.parametrize("kw, words", [
    (dict(queries=0), "queries must be a positive int"),
    (dict(page=24), "page must be a power of two of at least 16"),
    (dict(fraction=0), "fraction must be in (0, 1]"),
    (dict(score="l2"), "score must be one of ['meanstd', 'minmax']"),
    (dict(threshold=1.5), "threshold must be a number in [0, 1]"),
    (dict(min_events=-1), "min_events must be an int >= 0"),
    (dict(ids=torch.zeros(2000, dtype=torch.long)), "ids must be a (1, T) tensor"),
    (dict(ids=torch.zeros(1, 500, dtype=torch.long)), "ids: 500 tokens are too few"),
])
def test_bad_input_is_refused_by_name(kw, words):
    m = tiny_model("llama", kv_heads=2, num_hidden_layers=1, max_position_embeddings=4096)
    ids = kw.pop("ids", torch.zeros(1, 2500, dtype=torch.long))
    with pytest.raises(ValueError) as e:
        calibrate_sparse(m, ids, **kw)
    assert words in str(e.value)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_captured_keys_are_the_keys_the_cache_receives(kind):
    """``capture_qkv``'s keys and values are what the model hands its cache (post-RoPE; Qwen3's per-head q/k norms
    applied first: before they were left out, so calibrating a Qwen3 or Gemma 3 model measured other keys)."""
    from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

    from kvslim.adapters.compat import CACHE_KW

    if kind == "qwen3":
        torch.manual_seed(0)
        m = Qwen3ForCausalLM(Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)).eval()
    else:
        m = tiny_model("llama", kv_heads=2, num_hidden_layers=2)
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache()
    with torch.no_grad():
        m(ids, use_cache=True, **{CACHE_KW: cache})
    for (_, k, v), layer in zip(capture_qkv(m, ids), cache.layers, strict=True):
        torch.testing.assert_close(k, layer.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, layer.values, rtol=1e-5, atol=1e-5)


def test_cli_prints_and_writes_the_layers(capsys, tmp_path):
    """``kvslim calibrate --sparse``: per-layer events and misses, the layers the rule picks from them, the option
    line that runs them, and the JSON file; ``--out`` stays required without ``--sparse``; other options refused."""
    import json

    from kvslim.calibration_sparse import choose
    from kvslim.cli.main import main

    out = tmp_path / "layers.json"
    assert main(["calibrate", "--model", "smollm2", "--sparse", "--tokens", "1300", "--queries", "16", "--threads",
                 "1", "--option", "int4.sparse_budget=auto", "--option", "int4.sparse_page=16", "--out",
                 str(out)]) == 0
    got = json.loads(out.read_text())
    assert (got["tokens"], got["page"], got["queries"]) == (1300, 16, 16) and len(got["rates"]) == 30
    assert got["sparse_dense_layers"] == choose([tuple(r) for r in got["rates"]])
    printed = capsys.readouterr().out
    line = (f"--option int4.sparse_budget=auto --option int4.sparse_page=16 --option 'int4.sparse_dense_layers="
            f"{json.dumps(got['sparse_dense_layers']).replace(' ', '')}'")  # quoted: a shell globs [..] otherwise
    assert line in printed
    for argv, words in ((["--sparse", "--option", "int4.residual=32"], "--sparse takes sparse_budget"),
                        ([], "--out is required")):
        assert main(["calibrate", "--model", "smollm2", *argv]) == 2  # refused before the model is loaded
        assert words in capsys.readouterr().err
