"""Turbo codes made capturable (issue 33, caches/capture_residual.py with a ``TurboStore``): sinks and a ring window
in full precision, flushes decided on the device, the window kept in the codes' basis one row per step, and every
fitted parameter (channel means — RoPE-centred for turbo3 —, outlier channels, smoothing) fitted by the eager
prefill, so a compiled step only codes. The 64-step compile-once runs of the three defaults are in
tests/test_capturable_all.py; here: the layout against the eager one step by step, the fused op on the static
handle, HF's compile path, pre-RoPE keys (unfused) compiled, and the refusals (a graph step before the fit, past
``max_length``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import (
    assert_static_fused_step_matches_unfused,
    compile_static,
    decode_greedy,
    eager_step_past_max_length_is_refused,
    generate_eager_and_compiled,
    graph_step_past_max_length,
    tiny_model,
    unique_graphs,
)
from tolerances import assert_rel_close
from torch._dynamo.utils import counters

import kvslim
from kvslim.attention import quant
from kvslim.caches.capture_residual import StaticResidualStore
from kvslim.caches.turbo import TurboStore

#: a small window: a flush every 4 tokens behind 2 sinks
SMALL = dict(residual=8, flush=4, sink=2)
METHODS = ("turbo4", "turbo3", "turbo2")

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(method: str, layers: int = 2, **opts):
    model = tiny_model("llama", kv_heads=2, num_hidden_layers=layers, head_dim=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kvslim.apply(model, method, **opts)
    return model


@pytest.mark.parametrize("method", METHODS)
def test_small_window_state_equals_the_eager_layout_step_by_step(method):
    """The same keys and values through both layouts (a 12-token prefill, then 40 single-token updates: the graph's
    ops, run eagerly): after every update each position decodes to the eager layout's values (same fit, same codes)
    and as many tokens are coded."""
    model = _model(method, **SMALL)
    n = 12 + 40 + 4
    ref, cache = kvslim.make_cache(model, max_length=n), kvslim.make_cache(model, max_length=n, capturable=True)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for i, s in enumerate([12] + [1] * 40):
            k, v = torch.randn(2, 2, s, 32, generator=g) + 0.5, torch.randn(2, 2, s, 32, generator=g)
            ref.update(k, v, 0)
            cache.update(k, v, 0)
            length = ref.get_seq_length()
            assert cache.get_seq_length() == length
            for a, b in ((cache.layers[0].k_store, ref.layers[0].k_store),
                         (cache.layers[0].v_store, ref.layers[0].v_store)):
                assert isinstance(a.inner, TurboStore) and a.fitted
                assert_rel_close(a.read_positions(n)[:, :, :length], b.read(0, length), torch.float32, f"update {i}")
                assert a.flushed == b.inner.flushed == 4 * max(0, (length - 2 - 8 + 3) // 4)
                coded = a.flushed
                assert torch.equal(a.inner.data[:, :, :coded], b.coded.data[:, :, :coded]), f"codes, update {i}"
    assert cache.nbytes == ref.nbytes
    k = cache.layers[0].k_store.inner
    assert k.mean is not None and k.frozen is not None  # fitted in the prefill, moves kept


def test_a_capturable_turbo_step_hands_the_fused_op_its_codes():
    """RoPE-centred turbo3: the static handle (whole coded buffer with ``columns``, the window in the codes' basis)
    attends as its unfused reads do, and an eager capturable decode runs the fused op."""
    model = _model("turbo3", **SMALL)
    cache = kvslim.make_cache(model, max_length=48, capturable=True)
    cache.enable_fused_decode()  # on already where the C++ op is built; the handle is under test, not the op
    calls = []
    op = quant.turbo_decode

    lengths = []

    def counted(*args, **kw):
        calls.append(args[8])  # n: the coded slots of the buffer
        lengths.append(kw["lengths"].clone())  # the coded tokens the op reads: the rest of the buffer is skipped
        return op(*args, **kw)

    quant.turbo_decode = counted
    try:
        decode_greedy(model, model, cache, 24, 6)
    finally:
        quant.turbo_decode = op
    assert calls and set(calls) == {cache.layers[0].k_store.capacity}
    assert all(t.dtype == torch.int64 and t.shape == (2,) for t in lengths)
    assert max(int(t.max()) for t in lengths) < calls[0]  # never the whole buffer here (48 slots, 30 tokens)
    assert int(lengths[-1][0]) == int(cache.layers[-1].k_store.flushed_t) > 0  # the last layer's coded tokens
    layer = cache.layers[1]
    h = assert_static_fused_step_matches_unfused(layer, 32)
    assert h.k_tail_rotated and h.v_tail_rotated
    assert torch.equal(h.lengths, layer.k_store.flushed_t.expand(2))


def test_prerope_keys_compile_once_through_the_unfused_reads():
    """Pre-RoPE keys (an option; not fused): coded and read by device positions, one graph over 20 steps (5
    flushes), eager's tokens."""
    model = _model("turbo3", layers=1, prerope_keys=True, **SMALL)
    eager_cache = kvslim.make_cache(model, max_length=24 + 20 + 4)
    eager, eager_logits = decode_greedy(model, model, eager_cache, 24, 20)
    cache = kvslim.make_cache(model, max_length=24 + 20 + 4, capturable=True)
    got, logits = decode_greedy(model, compile_static(model), cache, 24, 20)
    graphs = unique_graphs()
    assert graphs == 1, f"{graphs} graphs over 20 steps ({dict(counters['recompiles'])})"
    assert torch.equal(eager, got)
    assert_rel_close(logits, eager_logits, torch.float32, "pre-RoPE turbo3, compiled vs eager")
    assert cache.layers[0].k_store.coded is None  # no coded-basis window: the keys are read, not fused


def test_hf_generate_compile_path_with_turbo3():
    """``model.generate`` with HF's compile path and a capturable turbo3 default cache: one graph for every decode
    step (the first flush, at position 128, among them), tokens equal eager generation's."""
    model = _model("turbo3", layers=1)
    ids = torch.randint(1, 128, (2, 110), generator=torch.Generator().manual_seed(3))
    eager, got, graphs, cache = generate_eager_and_compiled(model, ids, 24, 110 + 32)
    assert torch.equal(eager, got)
    assert graphs == 1, f"{graphs} graphs for 23 compiled decode steps"
    assert isinstance(cache.layers[0].k_store, StaticResidualStore) and cache.layers[0].k_store.flushed == 64


def test_a_graph_step_before_the_fit_is_refused_by_name():
    """A prefill of no more tokens than the sinks leaves nothing to fit the channel means on: the compiled step
    refuses (dynamo reports the ValueError it raised while tracing; nothing ran, nothing written)."""
    model = _model("turbo3", layers=1)
    cache = kvslim.make_cache(model, max_length=64, capturable=True)
    with pytest.raises(Exception, match="fits its channel means .* eagerly with more than sink=4 tokens"):
        decode_greedy(model, compile_static(model), cache, 3, 1)
    unique_graphs()
    store = cache.layers[0].k_store
    assert not store.fitted and int(cache.layers[0].length_t[0]) == 3 and store.flushed == 0


def test_graph_step_past_max_length_is_refused_by_name_and_writes_nothing():
    model = _model("turbo2", layers=1, **SMALL)
    cache = kvslim.make_cache(model, max_length=24 + 3, capturable=True)
    # fills the cache to max_length (a flush on the way), then one graph step past it
    layer, unchanged, graphs = graph_step_past_max_length(model, cache, 24, 3,
                                                          lambda s: s.tensors() + s.device_state())
    assert unchanged
    assert int(layer.length_t[0]) == 27 and graphs == 1
    with pytest.raises(ValueError, match="max_length=27"):
        cache.check_finite()


def test_capturable_turbo_refuses_an_eager_step_past_max_length_by_name():
    model = _model("turbo4", layers=1, **SMALL)
    cache = kvslim.make_cache(model, max_length=24 + 2, capturable=True)
    decode_greedy(model, model, cache, 24, 2)
    assert eager_step_past_max_length_is_refused(model, cache, 26)
    assert cache.get_seq_length() == 26
