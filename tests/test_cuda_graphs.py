"""Decode steps under ``torch.compile(fullgraph=True)`` with a preallocated cache (issue 26, point 5): tokens equal
to eager. On CPU dynamo traces with ``backend="eager"`` (no code generation: what 2 cores afford); on CUDA the
steps run under ``mode="reduce-overhead"`` (CUDA graphs). A graph break fails ``fullgraph=True`` by name."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import tiny_model

import kvslim
from kvslim.adapters.compat import CACHE_KW

STEPS = 4
CASES = {"dense": {}, "int8": {}, "int4": {"residual": 8, "flush": 4, "key_channel_group": 4, "sink": 2},
         "int2": {"residual": 8, "flush": 4, "key_channel_group": 4}, "slim": {}, "mla": {"impl": "elided"}}
#: slim needs MHA (every query head its own KV head)
KV_HEADS = {"slim": 4}
#: turbo3/turbo2 keep a quarter of the key channels at one more bit from head dim 32 on (16: none)
HEAD_DIM = {"turbo3": 32, "turbo2": 32}


def _tokens(model, step, device):
    cache = kvslim.make_cache(model, max_length=64)
    ids = torch.randint(1, 128, (2, 24), generator=torch.Generator().manual_seed(0)).to(device)
    out = []
    with torch.no_grad():
        tok = model(ids, use_cache=True, **{CACHE_KW: cache}).logits[:, -1:].argmax(-1)
        for i in range(STEPS):
            pos = torch.full((2, 1), 24 + i, dtype=torch.long, device=device)
            tok = step(tok, position_ids=pos, cache_position=pos[0], use_cache=True,
                       **{CACHE_KW: cache}).logits[:, -1:].argmax(-1).clone()
            out.append(tok)
    return torch.cat(out, dim=1)


def _model(method, device="cpu", dtype=torch.float32, **layers):
    """``layers``: ``num_hidden_layers=N`` (default: the tiny model's own)."""
    if method == "mla":
        from test_mla_model import deepseek

        model = deepseek("v3", dtype=dtype, **layers).to(device)
    else:
        model = tiny_model("llama", kv_heads=KV_HEADS.get(method, 2), dtype=dtype, **layers).to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kvslim.apply(model, method, **CASES[method])
    return model


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("method", list(CASES))
def test_fullgraph_decode_steps_give_eager_tokens(method):
    """One layer: dynamo traces every layer alike (and the growing layouts recompile per step), the layers' caches
    are one class."""
    torch._dynamo.reset()
    model = _model(method, num_hidden_layers=1)
    eager = _tokens(model, model, "cpu")
    compiled = _tokens(model, torch.compile(model, backend="eager", fullgraph=True), "cpu")
    torch._dynamo.reset()
    assert torch.equal(eager, compiled)


@pytest.mark.parametrize("method", list(CASES))
def test_reduce_overhead_decode_steps_give_eager_tokens_on_cuda(method, cuda_dev):
    """``cuda_dev`` skips without CUDA: CUDA graphs need a CUDA device (the CPU test above traces the same steps
    with fullgraph=True)."""
    torch._dynamo.reset()
    model = _model(method, cuda_dev, torch.bfloat16)
    eager = _tokens(model, model, cuda_dev)
    compiled = _tokens(model, torch.compile(model, mode="reduce-overhead", fullgraph=True), cuda_dev)
    torch._dynamo.reset()
    assert torch.equal(eager, compiled)


#: capturable formats: plain and per-token codes (caches/capture.py) with ``max_length``; the int4/int2 and turbo
#: defaults (sinks, residual window, KIVI keys, turbo codes fitted in the prefill; caches/capture_residual.py) with
#: ``capturable=True`` and a 120-token prompt, so that the 16 steps cross the first flush (position 128); slim's
#: K-cache (caches/slim.py) and MLA latents on the V2-Lite layout (caches/latent.py), each through its Triton kernel;
#: a ring of 8 (caches/capture_ring.py)
CAPTURABLE = {"dense": ("dense", {}), "int8": ("int8", {}),
              "int4": ("int4", {"residual": 0, "key_channel_group": 0, "sink": 0}),
              "int4-default": ("int4", None), "int2-default": ("int2", None),
              "turbo3-default": ("turbo3", None), "turbo2-default": ("turbo2", None),
              "slim": ("slim", {"cache": "k", "rank": 0}), "mla": ("mla", {}), "window": ("window", {"window": 8})}


@pytest.mark.parametrize("method", list(CAPTURABLE))
def test_capturable_steps_under_cuda_graphs_on_cuda(method, cuda_dev):
    """dynamo + CUDA graphs (``backend="cudagraphs"``) over 16 decode steps of a capturable cache: one graph,
    eager's tokens (bf16, same device). ``cuda_dev`` skips without CUDA (tests/test_capturable.py traces the same
    steps on CPU)."""
    from torch._dynamo.utils import counters

    name, opts = CAPTURABLE[method]
    if name == "mla":
        from test_mla_model import deepseek

        model = deepseek("v2-lite", dtype=torch.bfloat16).to(cuda_dev)
    else:
        extra = {"head_dim": HEAD_DIM[name]} if name in HEAD_DIM else {}
        model = tiny_model("llama", kv_heads=KV_HEADS.get(name, 2), dtype=torch.bfloat16, **extra).to(cuda_dev)
    default = opts is None or name == "window"  # the int4/int2 defaults and rings: capturable=True only
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kvslim.apply(model, name, **(opts or {}))
    prompt = 120 if default else 24
    ids = torch.randint(1, 128, (2, prompt), generator=torch.Generator().manual_seed(0)).to(cuda_dev)

    def run(step, capturable):
        cache = kvslim.make_cache(model, max_length=prompt + 24, capturable=capturable)
        out = []
        with torch.no_grad():
            tok = model(ids, use_cache=True, **{CACHE_KW: cache}).logits[:, -1:].argmax(-1)
            for i in range(16):
                torch.compiler.cudagraph_mark_step_begin()
                pos = torch.full((2, 1), prompt + i, dtype=torch.long, device=cuda_dev)
                tok = step(tok, position_ids=pos, cache_position=pos[0], use_cache=True,
                           **{CACHE_KW: cache}).logits[:, -1:].argmax(-1).clone()
                out.append(tok)
        return torch.cat(out, dim=1)

    eager = run(model, default)  # the same layout eagerly (tests/test_capturable_residual.py: equal to the eager one)
    torch._dynamo.reset()
    counters.clear()
    got = run(torch.compile(model, backend="cudagraphs", fullgraph=True, dynamic=False), default)
    graphs, skips = counters["stats"]["unique_graphs"], dict(counters["inductor"])
    torch._dynamo.reset()
    assert graphs == 1, f"{graphs} graphs ({skips})"
    assert torch.equal(eager, got), skips
