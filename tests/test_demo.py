"""The demo's measurements on a tiny model: the dense row is its own reference; the others are measured."""

from __future__ import annotations

import math

import pytest
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
    # dense keeps the model's window (the last 7 tokens per layer, as HF): int8's fixed per-sequence key-smoothing
    # factors weigh in beside 7 coded rows
    assert 0 < int8["max_abs_dlogit"] < 0.1 and int8["ratio"] < 0.4
    assert window["exactness"] == ["exact"] and window["max_abs_dlogit"] < 1e-4  # model's own window 8
    assert all(math.isfinite(r["perplexity"]) and r["decode_tokens_per_s"] > 0 for r in rows.values())


def test_measure_keeps_a_methods_first_decode_step_out_of_its_speed(monkeypatch):
    """A method's first decode step may build its C++ ops (minutes on a fresh machine): the demo warms each method
    up before it times it. The decode timer here is a counted clock, not the wall: every forward call adds 1 ms and
    the first single-token step after each ``apply`` adds 1,000 s. Timed with the warm-up inside, 11 steps would
    read ≤ 0.011 tokens/s; kept out, exactly 1,000 tokens/s. No wall time is read, so a loaded machine cannot
    fail it."""
    import types

    from kvslim import api, evaluate

    model = tiny_model("mistral")
    clock = {"now": 0.0, "pending": False}
    applied = api.apply

    def apply(*args, **kwargs):
        clock["pending"] = True
        return applied(*args, **kwargs)

    def tick(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        clock["now"] += 1e-3
        if clock["pending"] and ids is not None and ids.shape[1] == 1:
            clock["pending"] = False
            clock["now"] += 1000.0

    monkeypatch.setattr(api, "apply", apply)
    monkeypatch.setattr(evaluate, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"]))
    model.register_forward_pre_hook(tick, with_kwargs=True)
    ids = torch.randint(1, 128, (1, 10), generator=torch.Generator().manual_seed(0))
    text = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    runs = (("dense", "dense", {}), ("int8", "int8", {"group_size": 16}))
    rows = measure(model, type("Tok", (), {"decode": lambda self, ids, skip_special_tokens=True: ""})(), runs, ids,
                   text, 12)
    for r in rows:  # 11 timed single-token steps at 1 ms each
        assert r["decode_tokens_per_s"] == pytest.approx(1000.0), (r["label"], r["decode_tokens_per_s"])


# -- the long-prompt table (kvslim.cli.demo_long) -------------------------------------------------------------------

class CharTok:
    """A character tokenizer for the tiny models (ids 1..127)."""

    def __call__(self, text, return_tensors="pt"):
        return type("Enc", (), {"input_ids": torch.tensor([[ord(c) % 127 + 1 for c in text]])})()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(int(i)) for i in ids)


LOWBIT = {"group_size": 16, "residual": 16, "key_channel_group": 8}  # the defaults, scaled to a 96-token prompt


@pytest.mark.parametrize("method,opts", [("int4", LOWBIT), ("int2", LOWBIT)])
def test_transplanted_prompt_equals_a_real_prefill(method, opts):
    """The demo prefills once (dense, HF DynamicCache) and writes those keys/values into each method's cache with
    ``Cache.update``: the next decode steps give the logits (fp32, 1e-5) and bytes of a real prefill into that
    cache."""
    from transformers import DynamicCache

    from kvslim import api
    from kvslim.adapters.compat import CACHE_KW
    from kvslim.cli.demo_long import transplant

    model = tiny_model("llama")
    ids = torch.randint(1, 128, (1, 100), generator=torch.Generator().manual_seed(2))
    ref = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(ids[:, :96], **{CACHE_KW: ref})
        api.apply(model, method, **opts)
        real, moved = api.make_cache(model), api.make_cache(model)
        model(ids[:, :96], **{CACHE_KW: real})
        transplant(ref, moved)
        for t in range(96, 100):
            a = model(ids[:, t:t + 1], **{CACHE_KW: real}).logits
            b = model(ids[:, t:t + 1], **{CACHE_KW: moved}).logits
            assert (a - b).abs().max().item() < 1e-5, t
    assert real.nbytes == moved.nbytes and moved.get_seq_length() == 100
    api.restore(model)


def test_measure_long_rows():
    from kvslim.cli.demo_long import measure_long

    model = tiny_model("llama")
    runs = (("dense", "dense", {}), ("int8", "int8", {"group_size": 16}), ("int4", "int4", LOWBIT))
    rows = {r["label"]: r for r in measure_long(model, CharTok(), runs, 96, 8, 4, progress=lambda _: None)}
    dense, int8, int4 = rows["dense"], rows["int8"], rows["int4"]
    assert dense["ratio"] == 1.0 and dense["perplexity_increase"] == 0.0 and dense["max_abs_dlogit"] == 0.0
    assert dense["top1_agreement"] == dense["greedy_agreement"] == 1.0 and dense["speed_ratio"] == 1.0
    assert all(r["cache_bytes"] == r["planned_bytes"] for r in rows.values())
    assert int4["cache_bytes"] < dense["cache_bytes"] and int8["cache_bytes"] < dense["cache_bytes"]
    assert 0 < int4["max_abs_dlogit"] and all(0 <= r["top1_agreement"] <= 1 for r in rows.values())
    assert dense["context"] == 96 + 8 + 4 - 1 and len(dense["tokens"]) == 4 and dense["decode_tokens_per_s"] > 0
    with pytest.raises(ValueError, match="quality"):
        measure_long(model, CharTok(), runs, 96, 1, 4)


def test_demo_lengths_put_smollm2_int4_under_a_third_of_dense():
    """At the demo's default lengths (2,000-token prompt + 64 + 32 - 1), SmolLM2's planned bytes: int4 <= 0.35x
    dense (issue 36's target) and every method below the one with more bits."""
    from transformers import LlamaConfig

    from kvslim.api import plan_config
    from kvslim.cli.demo_long import LONG_RUNS

    config = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         intermediate_size=1536, vocab_size=49152, head_dim=64)
    context = 2000 + 64 + 32 - 1
    sizes = [plan_config(config, m, "float32", **o).cache_bytes(context) for _, m, o in LONG_RUNS]
    assert [label for label, _, _ in LONG_RUNS] == ["dense", "int8", "int4", "int3", "int2"]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
    assert sizes[2] <= 0.35 * sizes[0], sizes


def test_demo_table_fits_120_columns_with_its_notes_under_it():
    from rich.console import Console

    from kvslim.cli.demo import WIDTH, print_table

    row = {"label": "int4", "cache_bytes": 17_879_040, "ratio": 0.192, "perplexity_increase": 0.0123,
           "top1_agreement": 0.97, "greedy_agreement": 0.5, "max_abs_dlogit": 1.23, "decode_tokens_per_s": 25.3,
           "speed_ratio": 0.91, "exactness": ["approximate (int4 keys per channel, values per token) " * 3],
           "note": ""}
    console = Console(width=WIDTH, record=True)
    print_table(console, "SmolLM2-135M-Instruct (GQA 9/3, fp32, CPU): KV cache after a long prompt",
                [dict(row, label="dense", ratio=1.0), row], "a caption " * 30)
    text = console.export_text()
    assert max(map(len, text.splitlines())) <= WIDTH
    assert "17.1 MiB" in text and "17,879,040" not in text and "int4: approximate" in text


def test_demo_says_in_one_line_when_kernels_cannot_be_built(monkeypatch):
    import importlib

    from kvslim import kernels
    from kvslim.cli.demo import kernel_line

    for family in ("quant_decode", "quant_write"):
        monkeypatch.setattr(importlib.import_module(f"kvslim.kernels.{family}"), "available", lambda: False)
    line = kernel_line(["dense", "int4", "int8"])
    assert line.count("\n") == 0 and "twins" in line and "quant_decode" in line
    assert kernels.FAMILIES["int4"] and kernel_line(["dense"]) is None
