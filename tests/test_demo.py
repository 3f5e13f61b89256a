"""The demo's measurements on a tiny model: the dense row is its own reference; the others are measured."""

from __future__ import annotations

import math

import torch
from conftest import tiny_model

from kvslim.cli.demo import measure


def test_measure_compares_methods_against_dense():
    model = tiny_model("mistral")
    ids = torch.randint(1, 128, (1, 10), generator=torch.Generator().manual_seed(0))
    text = torch.randint(1, 128, (1, 70), generator=torch.Generator().manual_seed(1))
    runs = (("dense", "dense", {}), ("int8", "int8", {"group_size": 16}), ("window", "window", {}))

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids.tolist()))

    rows = {r["label"]: r for r in measure(model, Tok(), runs, ids, text, 12)}
    dense, int8, window = rows["dense"], rows["int8"], rows["window"]
    assert dense["ratio"] == 1.0 and dense["greedy_agreement"] == 1.0 and dense["max_abs_dlogit"] == 0.0
    assert dense["cache_bytes"] == dense["planned_bytes"] and int8["cache_bytes"] == int8["planned_bytes"]
    assert 0 < int8["max_abs_dlogit"] < 0.1 and int8["ratio"] < 0.35
    assert window["exactness"] == ["exact"] and window["max_abs_dlogit"] < 1e-4  # model's own window 8
    assert all(math.isfinite(r["perplexity"]) and r["decode_tokens_per_s"] > 0 for r in rows.values())
