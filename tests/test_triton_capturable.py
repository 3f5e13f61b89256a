"""Capturable layouts through the Triton decode kernels under Triton's interpreter: the int4/int2 defaults
(caches/capture_residual.py: ``lengths`` = the coded tokens, the sinks + ring window as the tail, a mask column per
row), slim rows and MLA latents (the whole buffer with ``lengths``), each with a padded batch: what a CUDA graph
replays on a GPU. Greedy tokens equal the torch twin's and the eager ordinary cache's; logits within the fp32 table
(tests/tolerances.py)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported (tests/conftest.py sets it too)

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import tiny_model  # noqa: E402
from tolerances import assert_close  # noqa: E402

import kvslim  # noqa: E402
from kvslim.adapters.compat import CACHE_KW  # noqa: E402

tq = pytest.importorskip("kvslim.kernels.triton.quant_decode")
tl2 = pytest.importorskip("kvslim.kernels.triton.quant_decode_lowbit")
F32 = torch.float32
PROMPT, NEW = 20, 6
#: small windows (flushes within the 6 new tokens) with sinks; KIVI keys, rotated values, asymmetric codes
CASES = [("int4", tq, dict(residual=8, flush=4, key_channel_group=4, sink=2)),
         ("int2", tl2, dict(residual=8, flush=8, key_channel_group=8, sink=2))]


@pytest.mark.parametrize("method,module,opts", CASES, ids=[c[0] for c in CASES])
def test_capturable_defaults_through_the_triton_kernels(method, module, opts, monkeypatch, one_thread):
    monkeypatch.setenv("KVSLIM_QUANT_SCORES", "exact")  # the twin's exact paths are the kernel's contract
    monkeypatch.setenv("KVSLIM_QUANT_VALUES", "exact")
    model = tiny_model("llama", kv_heads=1, hidden_size=256, num_attention_heads=4, num_hidden_layers=2,
                       attn_implementation="sdpa")
    ids = torch.randint(1, 128, (2, PROMPT), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a padded row: its mask columns go through the cache's columns
    calls = []
    launch = module.launch
    monkeypatch.setattr(module, "launch", lambda *a, **k: calls.append(1) or launch(*a, **k))
    kvslim.apply(model, method, **opts)
    try:
        runs = {}
        for name, capturable in (("eager-default", False), ("torch", True), ("triton", True)):
            monkeypatch.setenv("KVSLIM_BACKEND", "torch" if name == "eager-default" else name)
            cache = kvslim.make_cache(model, max_length=PROMPT + NEW + 2, capturable=capturable)
            with torch.no_grad():
                runs[name] = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                                            do_sample=False, pad_token_id=0, output_logits=True,
                                            return_dict_in_generate=True, **{CACHE_KW: cache})
            if capturable:
                assert cache.layers[0].k_store.flushed > 0  # codes were read
    finally:
        kvslim.restore(model)
    assert len(calls) == (NEW - 1) * 2, f"the Triton kernel ran {len(calls)} times"  # decode steps x layers
    for name in ("torch", "eager-default"):
        assert torch.equal(runs["triton"].sequences, runs[name].sequences), f"{method}: tokens differ from {name}"
        for a, b in zip(runs["triton"].logits, runs[name].logits, strict=True):
            assert_close(a, b, F32, f"{method}: logits triton vs {name}")


def test_capturable_slim_through_the_triton_kernel(monkeypatch, one_thread):
    """A capturable slim K-cache (caches/slim.py: the whole buffer with ``lengths``) through the Triton slim kernel
    with a left-padded batch (RoPE shifted per sequence): tokens equal the torch twin's and the ordinary eager
    cache's, logits within the fp32 table; every decode step of every layer through the kernel."""
    from kvslim.kernels.triton import slim_decode as ts

    model = tiny_model("llama", kv_heads=4, num_hidden_layers=2)
    ids = torch.randint(1, 128, (2, PROMPT), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    calls = []
    launch = ts.launch
    monkeypatch.setattr(ts, "launch", lambda *a, **k: calls.append(1) or launch(*a, **k))
    kvslim.apply(model, "slim", cache="k", rank=0)
    try:
        runs = {}
        for name, capturable in (("ordinary", False), ("torch", True), ("triton", True)):
            monkeypatch.setenv("KVSLIM_BACKEND", "torch" if name == "ordinary" else name)
            cache = kvslim.make_cache(model, max_length=PROMPT + NEW + 2, capturable=capturable)
            with torch.no_grad():
                runs[name] = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                                            do_sample=False, pad_token_id=0, output_logits=True,
                                            return_dict_in_generate=True, **{CACHE_KW: cache})
    finally:
        kvslim.restore(model)
    assert len(calls) == (NEW - 1) * 2, f"the Triton slim kernel ran {len(calls)} times"
    for name in ("torch", "ordinary"):
        assert torch.equal(runs["triton"].sequences, runs[name].sequences), f"slim: tokens differ from {name}"
        for a, b in zip(runs["triton"].logits, runs[name].logits, strict=True):
            assert_close(a, b, F32, f"slim: logits triton vs {name}")


def test_capturable_mla_through_the_triton_kernel(monkeypatch, one_thread):
    """A capturable MLA latent cache (caches/latent.py: the whole buffer with ``lengths``) through the Triton MLA
    decode kernel with a left-padded batch: tokens equal the torch path's and the ordinary eager cache's, logits
    within the fp32 table; every decode step of every layer through the kernel."""
    from test_mla_model import deepseek

    from kvslim.kernels.triton import mla_decode as tk

    model = deepseek("v2-lite", num_hidden_layers=2)
    ids = torch.randint(1, 128, (2, PROMPT), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    calls = []
    launch = tk.launch
    monkeypatch.setattr(tk, "launch", lambda *a, **k: calls.append(1) or launch(*a, **k))
    kvslim.apply(model, "mla")
    try:
        runs = {}
        for name, capturable in (("ordinary", False), ("torch", True), ("triton", True)):
            monkeypatch.setenv("KVSLIM_BACKEND", "torch" if name == "ordinary" else name)
            cache = kvslim.make_cache(model, max_length=PROMPT + NEW + 2, capturable=capturable)
            with torch.no_grad():
                runs[name] = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                                            do_sample=False, pad_token_id=0, output_logits=True,
                                            return_dict_in_generate=True, **{CACHE_KW: cache})
    finally:
        kvslim.restore(model)
    assert len(calls) == (NEW - 1) * 2, f"the Triton MLA kernel ran {len(calls)} times"
    for name in ("torch", "ordinary"):
        assert torch.equal(runs["triton"].sequences, runs[name].sequences), f"mla: tokens differ from {name}"
        for a, b in zip(runs["triton"].logits, runs[name].logits, strict=True):
            assert_close(a, b, F32, f"mla: logits triton vs {name}")
