"""The quality evaluator (kvslim.evaluate): protocol shapes, short texts refused, metrics against a full-sequence
reference, byte measurement, and a measured quality check of the int4 default against the old format."""

from __future__ import annotations

import inspect
import json
import math

import pytest
import torch
from transformers import DynamicCache

from kvslim import api
from kvslim.adapters.compat import CACHE_KW
from kvslim.caches import KVSlimCache
from kvslim.evaluate import (
    cache_nbytes,
    compare_caches,
    greedy_agreement,
    load_text,
    protocol_segments,
    text_ids,
)
from kvslim.methods import METHODS
from kvslim.models import load_tiny_mha


def test_protocol_segments_match_the_issue():
    cuts, first = protocol_segments(4096, "chunked")
    assert cuts[0] == (0, 512) and all(b - a == 64 for a, b in cuts[1:]) and cuts[-1][1] == 4096
    assert first == 512 and 4096 - first == 3584  # scored predictions
    cuts, first = protocol_segments(4096, "token", steps=1024)
    assert cuts[0] == (0, 4096 - 1024 - 1) and len(cuts) == 1025 and all(b - a == 1 for a, b in cuts[1:])
    assert first == 3072
    with pytest.raises(ValueError, match="shorter"):
        protocol_segments(1000, "token", steps=1024)
    with pytest.raises(ValueError, match="mode"):
        protocol_segments(4096, "greedy")


class _CharTokenizer:
    def __call__(self, text, return_tensors="pt"):
        class Out:
            input_ids = torch.tensor([[ord(c) % 256 for c in text]])
        return Out


def test_text_is_shipped_and_short_texts_are_refused_with_their_length():
    text = load_text("botchan")
    assert "Botchan" not in text.splitlines()[0] or len(text) > 30000  # source line stripped, the novel stays
    assert len(text) > 30000
    n = len(text)
    assert text_ids(_CharTokenizer(), 5000).shape == (1, 5000)
    with pytest.raises(ValueError, match=f"{n} tokens"):
        text_ids(_CharTokenizer(), n + 1)
    with pytest.raises(ValueError, match="name"):
        load_text("moby-dick")


@pytest.fixture(scope="module")
def tiny_trained():
    torch.set_num_threads(1)
    model, tok = load_tiny_mha(torch.float32)
    api.apply(model, "dense")
    ids = tok(inspect.getsource(json.decoder) + inspect.getsource(json.encoder), return_tensors="pt").input_ids
    return model, ids[:, :512]


def _kv(model, method, **opts):
    plan = METHODS[method].plan_model(model, **opts)
    return lambda: KVSlimCache([lp.factory(None) for lp in plan.layers], plan=plan)


def test_compare_caches_against_a_full_sequence_forward(tiny_trained):
    model, ids = tiny_trained
    with torch.inference_mode():
        full = torch.log_softmax(model(ids).logits[0].float(), -1)  # no cache at all
    res = compare_caches(model, ids[:, :400], {"dense": _kv(model, "dense"), "int8": _kv(model, "int8",
                                                                                          group_size=32)},
                         mode="token", steps=64, min_tokens=400)
    d = res["dense"]
    nll = -full[400 - 64 - 1:400 - 1].gather(-1, ids[0, 400 - 64:400, None]).mean().item()
    assert d.scored == 64 and math.isclose(d.ref_ppl, math.exp(nll), rel_tol=1e-4)
    assert abs(d.delta_ppl) < 1e-4 and d.kl < 1e-8 and d.top1 == 1.0 and d.max_dlogit < 1e-3
    i8 = res["int8"]
    assert 0 < i8.kl < 1e-2 and i8.top1 > 0.9
    # bytes measured from the cache tensors equal the plan's exact formula
    plan = METHODS["int8"].plan_model(model, group_size=32)
    assert i8.tokens == 399  # the last token is only a target
    assert i8.nbytes == plan.cache_bytes(399) and d.bytes_per_token == plan.dense_bytes(399) / 399
    chunked = compare_caches(model, ids[:, :400], {"dense": _kv(model, "dense")}, mode="chunked", prefill=128,
                             chunk=64)["dense"]
    nll = -full[127:399].gather(-1, ids[0, 128:400, None]).mean().item()
    assert chunked.scored == 272 and math.isclose(chunked.ref_ppl, math.exp(nll), rel_tol=1e-4)
    with pytest.raises(ValueError, match="399"):
        compare_caches(model, ids[:, :399], {"dense": _kv(model, "dense")}, min_tokens=4096)


def test_cache_nbytes_of_hf_caches_and_greedy_agreement(tiny_trained):
    model, ids = tiny_trained
    cache = DynamicCache()
    with torch.inference_mode():
        model(ids[:, :50], **{CACHE_KW: cache}, use_cache=True)
    cfg = model.config
    assert cache_nbytes(cache) == 50 * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * 32 * 4
    g = greedy_agreement(model, ids[:, :64], 16, _kv(model, "dense"))
    assert g["agreement"] == 1.0 and g["first_divergence"] == 16
