"""The shipped int4/int3/int2 defaults made capturable (issue 33, caches/capture_residual.py): full-precision sinks
and residual window as a ring, flushes decided on the device. Each default compiling once over 64 steps across its
first flush, with the eager default cache's tokens: tests/test_capturable_all.py. Here: the layout against the
eager one step by step, the fused op on the static handle, smoothed keys with a window (fitted in the eager prefill)
under ``torch.compile(fullgraph=True, dynamic=False)`` (CPU: ``backend="eager"``), HF's compile path; past
``max_length`` a graph step is refused by name with nothing written, an eager step of an ordinary cache grows as
before."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import (
    assert_static_fused_step_matches_unfused,
    decode_greedy,
    eager_step_past_max_length_is_refused,
    generate_eager_and_compiled,
    graph_step_past_max_length,
    tiny_model,
)
from conftest import compile_static as _compiled
from tolerances import assert_rel_close
from torch._dynamo.utils import counters

import kvslim

STEPS = 64
#: 100 prompt tokens + 64 steps cross the defaults' first flush (4 sinks + 124 window tokens = position 128)
PROMPT = 100
#: a small window: a flush every 4 steps (sinks, KIVI key groups of 4)
SMALL = dict(residual=8, flush=4, key_channel_group=4, sink=2)

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(method: str, **opts):
    model = tiny_model("llama", kv_heads=2, num_hidden_layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kvslim.apply(model, method, **opts)
    return model


def _decode(model, step, cache, prompt: int = PROMPT, steps: int = STEPS):
    return decode_greedy(model, step, cache, prompt, steps)



def test_small_window_state_equals_the_eager_layout_step_by_step():
    """The same keys and values through both layouts (a 24-token prefill, then 40 single-token updates: the graph's
    ops, run eagerly): after every update each stored position decodes to the same values, bit for bit (same codes,
    same window), and as many tokens are coded (10 flushes of 4)."""
    model = _model("int4", **SMALL)
    n = 24 + 40 + 4
    ref, cache = kvslim.make_cache(model, max_length=n), kvslim.make_cache(model, max_length=n, capturable=True)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for i, s in enumerate([24] + [1] * 40):
            k, v = torch.randn(2, 2, s, 16, generator=g), torch.randn(2, 2, s, 16, generator=g)
            ref.update(k, v, 0)
            cache.update(k, v, 0)
            length = ref.get_seq_length()
            mine, theirs = cache.layers[0], ref.layers[0]
            assert cache.get_seq_length() == length
            for a, b in ((mine.k_store, theirs.k_store), (mine.v_store, theirs.v_store)):
                assert torch.equal(a.read_positions(n)[:, :, :length], b.read(0, length)), f"update {i}"
                assert a.flushed == b.inner.flushed == 4 * max(0, (length - 2 - 8 + 3) // 4)
    assert cache.nbytes == ref.nbytes


def test_a_capturable_decode_step_hands_attention_the_codes():
    """The fused path (``FusedKV`` with ``columns`` and ``lengths``) attends as its unfused reads do."""
    model = _model("int2", **SMALL)
    cache = kvslim.make_cache(model, max_length=48, capturable=True)
    cache.enable_fused_decode()  # on already where the C++ op is built; the handle is under test, not the op
    _decode(model, model, cache, prompt=24, steps=6)
    assert_static_fused_step_matches_unfused(cache.layers[1], 16)


def test_graph_step_past_max_length_is_refused_by_name_and_writes_nothing():
    model = _model("int4", **SMALL)
    cache = kvslim.make_cache(model, max_length=24 + 3, capturable=True)
    # fills the cache to max_length (a flush on the way), then one graph step past it
    layer, unchanged, graphs = graph_step_past_max_length(model, cache, 24, 3, lambda s: s.tensors() + [s.flushed_t])
    assert unchanged
    assert int(layer.length_t[0]) == 27 and graphs == 1
    with pytest.raises(ValueError, match="max_length=27"):
        cache.check_finite()
    with pytest.raises(ValueError, match="max_length=27"):  # any eager call after the refused step, until reset
        cache.get_seq_length()
    cache.reset()
    assert cache.get_seq_length() == 0


def test_eager_default_cache_past_max_length_grows_with_unchanged_tokens():
    model = _model("int4", **SMALL)
    short = _decode(model, model, kvslim.make_cache(model, max_length=24 + 8), prompt=24, steps=20)[0]
    assert torch.equal(short, _decode(model, model, kvslim.make_cache(model), prompt=24, steps=20)[0])


def test_capturable_default_refuses_an_eager_step_past_max_length_by_name():
    model = _model("int4", **SMALL)
    cache = kvslim.make_cache(model, max_length=24 + 2, capturable=True)
    _decode(model, model, cache, prompt=24, steps=2)
    assert eager_step_past_max_length_is_refused(model, cache, 26)
    assert cache.get_seq_length() == 26


def test_smoothed_keys_with_a_window_fit_in_the_eager_prefill():
    """Smoothed per-token keys behind a window (``key_channel_group=0``): the factors are fitted by the eager
    prefill on the first flush group's tokens (the eager layout's first coded write), so a compiled step only codes:
    one graph over 64 steps (16 flushes), eager's tokens, the same factors and codes."""
    model = _model("int4", residual=8, flush=4, key_channel_group=0, sink=0)
    n = 24 + STEPS + 4
    eager_cache = kvslim.make_cache(model, max_length=n)
    eager, eager_logits = _decode(model, model, eager_cache, prompt=24)
    cache = kvslim.make_cache(model, max_length=n, capturable=True)
    got, logits = _decode(model, _compiled(model), cache, prompt=24)
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert graphs == 1, f"{graphs} graphs over {STEPS} steps ({dict(counters['recompiles'])})"
    assert torch.equal(eager, got)
    assert_rel_close(logits, eager_logits, torch.float32, "smoothed keys + window, compiled vs eager")
    assert cache.get_seq_length() == 24 + STEPS  # host copies read back once after the graph steps
    mine, theirs = cache.layers[0].k_store, eager_cache.layers[0].k_store
    assert mine.inner.spec.smooth and torch.equal(mine.inner.channel, theirs.inner.channel)
    assert mine.flushed == theirs.flushed == 80
    assert torch.equal(mine.inner.data[:, :, :80], theirs.inner.data[:, :, :80])


def test_what_stays_uncapturable_is_refused_by_name():
    model = _model("int4", **SMALL)
    cache = kvslim.make_cache(model, max_length=64)
    _decode(model, model, cache, prompt=8, steps=1)
    with pytest.raises(ValueError, match="already hold tokens"):
        cache.set_capturable(True)
    cache = kvslim.make_cache(model, max_length=64, capturable=True)
    _decode(model, model, cache, prompt=8, steps=1)
    with pytest.raises(ValueError, match="tokens_to_remove=-2"):
        cache.layers[0].crop(-2)


def test_hf_generate_compile_path_with_the_int4_default():
    """``model.generate`` with HF's compile path (``compile_config``) and a capturable int4 default cache: one graph
    for every decode step (a flush at position 128 among them), tokens equal eager generation's."""
    model = _model("int4")
    ids = torch.randint(1, 128, (2, 110), generator=torch.Generator().manual_seed(3))
    eager, got, graphs, cache = generate_eager_and_compiled(model, ids, 24, 110 + 32)
    assert torch.equal(eager, got)
    assert graphs == 1, f"{graphs} graphs for 23 compiled decode steps"
    assert cache.layers[0].k_store.flushed > 0
