"""Every method of the registry (``kvslim.methods.METHODS``, default options) has a capturable cache (issue 33):
``kvslim.make_cache(model, max_length=N, capturable=True)`` compiles once under ``torch.compile(fullgraph=True,
dynamic=False)`` (CPU: ``backend="eager"``, tracing and guards without code generation) and decodes 64 steps with
no recompilation and the ordinary eager cache's greedy tokens — or the method is in :data:`REFUSED`, with the
reason, and ``make_cache(..., capturable=True)`` refuses it by name. A method added to the registry without capture
support fails here. One layer per model: tracing dominates (~8 s a method on a shared 2-core machine), the steps
are cheap. Details per family: tests/test_capturable{,_residual,_turbo,_ring,_slim,_mla}.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import compile_static, decode_greedy, tiny_model, unique_graphs
from test_mla_model import deepseek
from tolerances import CAPTURED_CODES_LOGIT_ATOL, max_err
from torch._dynamo.utils import counters

import kvslim
from kvslim.caches.capture_residual import StaticResidualStore
from kvslim.methods import METHODS

STEPS = 64
#: 100 prompt tokens + 64 steps cross the first flush of the residual-window defaults (int4/int3/int2, turbo:
#: 4 sinks + 124 window tokens = position 128); the turbo fits happen in this eager prefill
PROMPT = 100
#: the model a method needs when a tiny Llama does not fit it (``window``: a model's own sliding window)
FAMILY = {"mla": lambda: deepseek("v2-lite", num_hidden_layers=1),
          "window": lambda: tiny_model("mistral", num_hidden_layers=1),
          "slim": lambda: tiny_model("llama", kv_heads=4, num_hidden_layers=1)}  # slim: multi-head attention
#: methods whose default caches cannot be captured, with the reason; ``make_cache(..., capturable=True)`` must
#: refuse them by name (none today: docs/gpu.md lists what stays uncapturable among the non-default options)
REFUSED: dict[str, str] = {}
#: methods whose capturable layout holds exactly the eager layout's bytes (rings keep one slot more)
SAME_BYTES = ("dense", "int8", "int4", "int3", "int2", "turbo4", "turbo3", "turbo2", "mla")

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(name: str):
    model = FAMILY.get(name, lambda: tiny_model("llama", num_hidden_layers=1))()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kvslim.apply(model, name)
    return model


@pytest.mark.parametrize("name", sorted(set(METHODS) - set(REFUSED)))
def test_every_method_compiles_once_and_decodes_64_steps_with_eager_tokens(name):
    model = _model(name)
    ordinary = kvslim.make_cache(model)
    eager, eager_logits = decode_greedy(model, model, ordinary, PROMPT, STEPS)
    cache = kvslim.make_cache(model, max_length=PROMPT + STEPS + 4, capturable=True)
    assert cache.is_compileable is True, f"{name}: not every layer is capturable"
    got, logits = decode_greedy(model, compile_static(model), cache, PROMPT, STEPS)
    recompiles = dict(counters["recompiles"])
    graphs = unique_graphs()
    assert graphs == 1, f"{name}: {graphs} graphs over {STEPS} steps ({recompiles})"
    assert torch.equal(eager, got), f"{name}: compiled capturable tokens differ from eager"
    err = max_err(logits, eager_logits)  # summation order (≤ 1e-6 measured), or one int8/turbo code moved
    assert err <= CAPTURED_CODES_LOGIT_ATOL, f"{name}: logits max|Δ| {err:.3e}"
    assert cache.get_seq_length() == PROMPT + STEPS  # read back once after the graph steps
    if name in SAME_BYTES:
        assert cache.nbytes == ordinary.nbytes
    store = cache.layers[0].k_store
    if isinstance(store, StaticResidualStore):  # sinks + ring window: the first flush ran in a graph step
        assert store.fitted and store.flushed == ordinary.layers[0].k_store.inner.flushed > 0


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_methods_are_refused_by_name(name):
    with pytest.raises(ValueError, match="capturable=True"):
        kvslim.make_cache(_model(name), max_length=64, capturable=True)


def test_the_tables_name_registry_methods():
    assert set(REFUSED) <= set(METHODS) and set(FAMILY) <= set(METHODS) and set(SAME_BYTES) <= set(METHODS)
    assert all(isinstance(reason, str) and reason for reason in REFUSED.values())
