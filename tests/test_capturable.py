"""Caches that CUDA graphs can capture (issue 33, caches/capture.py): with ``max_length``, a decode step traced by
dynamo (``fullgraph=True, dynamic=False``) has the same shapes at every length, so each capturable method compiles
once and then decodes 64 steps without a recompilation, with eager's tokens. CPU: dynamo with ``backend="eager"``
(tracing and guards, no code generation: what 2 cores afford; recompilations are decided by the guards, not the
backend). The CUDA-graph run of the same steps is in tests/test_cuda_graphs.py (GPU only)."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import generate_eager_and_compiled, tiny_model
from torch._dynamo.utils import counters

import kvslim
from kvslim.adapters.compat import CACHE_KW

STEPS = 64
PROMPT = 24
PER_TOKEN = dict(residual=0, key_channel_group=0, sink=0)
#: per-token codes (no residual window, no KIVI keys, no sinks); the defaults (dense, int8 among them) compile in
#: tests/test_capturable_all.py
CASES = {"int4": PER_TOKEN, "int3": PER_TOKEN, "int2": PER_TOKEN}

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(method: str, **opts):
    model = tiny_model("llama", kv_heads=2, num_hidden_layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kvslim.apply(model, method, **(CASES.get(method, {}) | opts))
    return model


def _decode(model, step, cache, steps: int = STEPS, batch: int = 2) -> torch.Tensor:
    """Eager prefill of a random prompt, then ``steps`` greedy steps through ``step``; the new tokens."""
    ids = torch.randint(1, 128, (batch, PROMPT), generator=torch.Generator().manual_seed(0))
    out = []
    with torch.no_grad():
        tok = model(ids, use_cache=True, **{CACHE_KW: cache}).logits[:, -1:].argmax(-1)
        for i in range(steps):
            pos = torch.full((batch, 1), PROMPT + i, dtype=torch.long)
            tok = step(tok, position_ids=pos, cache_position=pos[0], use_cache=True,
                       **{CACHE_KW: cache}).logits[:, -1:].argmax(-1).clone()
            out.append(tok)
    return torch.cat(out, dim=1)


def _compiled(model):
    torch._dynamo.reset()
    counters.clear()
    return torch.compile(model, backend="eager", fullgraph=True, dynamic=False)


@pytest.mark.parametrize("method", list(CASES))
def test_compiles_once_and_decodes_64_steps_with_eager_tokens(method):
    model = _model(method)
    eager = _decode(model, model, kvslim.make_cache(model, max_length=PROMPT + STEPS + 8))
    cache = kvslim.make_cache(model, max_length=PROMPT + STEPS + 8)
    assert cache.is_compileable is False  # eager use: today's growing views, HF's causal-skip masks
    got = _decode(model, _compiled(model), cache)
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert graphs == 1, f"{method}: {graphs} graphs over {STEPS} steps ({dict(counters['recompiles'])})"
    assert torch.equal(eager, got)
    assert cache.get_seq_length() == PROMPT + STEPS  # read back once after the graph steps
    assert cache.nbytes > 0  # the accounting reads the length back after graph steps
    layer = cache.layers[0]
    assert int(layer.length_t[0]) == PROMPT + STEPS and not bool(layer.overflow)


def test_a_residual_window_is_capturable_only_when_asked():
    """Without ``capturable=True`` a default int4 or turbo cache keeps the eager layout
    (tests/test_capturable_residual.py and tests/test_capturable_turbo.py have the capturable one)."""
    cache = kvslim.make_cache(_model("int4", residual=16, key_channel_group=8, sink=2), max_length=64)
    assert cache.is_compileable is False
    assert kvslim.make_cache(_model("turbo4"), max_length=64).is_compileable is False


def test_graph_step_past_max_length_is_refused_by_name_and_writes_nothing():
    model = _model("int8")
    cache = kvslim.make_cache(model, max_length=PROMPT + 4)
    step = _compiled(model)
    ids = torch.randint(1, 128, (2, PROMPT), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tok = model(ids, use_cache=True, **{CACHE_KW: cache}).logits[:, -1:].argmax(-1)
        for i in range(4):  # fills the cache to max_length
            pos = torch.full((2, 1), PROMPT + i, dtype=torch.long)
            tok = step(tok, position_ids=pos, cache_position=pos[0], use_cache=True,
                       **{CACHE_KW: cache}).logits[:, -1:].argmax(-1).clone()
        layer = cache.layers[0]
        before = [t[:, :, :PROMPT + 4].clone() for s in layer._stores() for t in s.tensors()]
        pos = torch.full((2, 1), PROMPT + 4, dtype=torch.long)
        step(tok, position_ids=pos, cache_position=pos[0], use_cache=True, **{CACHE_KW: cache})
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    after = [t[:, :, :PROMPT + 4] for s in layer._stores() for t in s.tensors()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert int(layer.length_t[0]) == PROMPT + 4 and graphs == 1
    with pytest.raises(ValueError, match=f"max_length={PROMPT + 4}"):
        cache.check_finite()


def test_eager_steps_past_max_length_grow_as_before():
    model = _model("dense")
    short = _decode(model, model, kvslim.make_cache(model, max_length=PROMPT + 8), steps=16)
    assert torch.equal(short, _decode(model, model, kvslim.make_cache(model), steps=16))


def test_capturable_cache_refuses_an_eager_write_past_max_length_by_name():
    model = _model("dense")
    cache = kvslim.make_cache(model, max_length=PROMPT + 2, capturable=True)
    assert cache.is_compileable is True
    _decode(model, model, cache, steps=2)
    kept = cache.layers[0].k_store.data.clone()
    with pytest.raises(ValueError, match=f"max_length={PROMPT + 2}"), torch.no_grad():
        pos = torch.full((2, 1), PROMPT + 2, dtype=torch.long)
        model(torch.ones(2, 1, dtype=torch.long), position_ids=pos, cache_position=pos[0], use_cache=True,
              **{CACHE_KW: cache})
    assert torch.equal(kept, cache.layers[0].k_store.data) and cache.get_seq_length() == PROMPT + 2


@pytest.mark.parametrize("bad, match", [(dict(max_length=None, capturable=True), "needs max_length"),
                                        (dict(max_length=16, capturable="yes"), "capturable must be")])
def test_bad_capturable_arguments_are_refused_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        kvslim.make_cache(_model("dense"), **bad)


@pytest.mark.parametrize("method", ["dense", "int8"])
def test_hf_generate_compile_path_with_a_capturable_kvslim_cache(method):
    """``model.generate`` with HF's own compile path (``compile_config``; on CPU ``_compile_all_devices``): the
    decode step is compiled once for all new tokens, and the tokens equal eager generation's."""
    model = _model(method)
    ids = torch.randint(1, 128, (2, PROMPT), generator=torch.Generator().manual_seed(3))
    eager, got, graphs, _ = generate_eager_and_compiled(model, ids, 24, PROMPT + 32)
    assert torch.equal(eager, got)
    assert graphs == 1, f"{graphs} graphs for 23 compiled decode steps"
