"""Sliding-window ring layers made capturable (issue 33, caches/capture_ring.py): W slots written at the device
length mod W, the whole ring read every step, HF's mask built over absolute positions (``kv_offset`` a constant 0)
and gathered by kvslim's attention at the positions the slots hold. Under ``torch.compile(fullgraph=True,
dynamic=False)`` (CPU: ``backend="eager"``) each case compiles once and decodes 64 steps (the ring wraps 8 times)
with the ordinary eager cache's greedy tokens, fp32 logits within the summation-order tolerance (tests/tolerances.py;
int8 codes: one code may move, ``CAPTURED_CODES_LOGIT_ATOL``): a Gemma-3-shaped model mixing sliding and full
layers, plain and with int8 codes (smoothed keys), and kvslim's ``window`` on a Llama; Mistral (every layer
sliding) for the limits. Past ``max_length``: as every capturable layer."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import compile_static as _compiled
from conftest import (
    decode_greedy,
    eager_step_past_max_length_is_refused,
    generate_eager_and_compiled,
    graph_step_past_max_length,
    padded_batch,
    tiny_model,
)
from conftest import unique_graphs as _graphs
from tolerances import CAPTURED_CODES_LOGIT_ATOL, RTOL, assert_rel_close, max_err
from torch._dynamo.utils import counters
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

import kvslim
from kvslim.caches.window import RingLayer

STEPS = 64
PROMPT = 12
W = 8

pytestmark = pytest.mark.usefixtures("one_thread")


def gemma3(window: int = W):
    """Gemma-3-shaped: sliding (window 8), full, sliding; MQA 4/1, head dim 32."""
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=window,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                           query_pre_attn_scalar=32, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
                           eos_token_id=None)
    return Gemma3ForCausalLM(cfg).eval()


#: model builder, method, options
CASES = {"mistral-dense": (lambda: tiny_model("mistral", num_hidden_layers=2), "dense", {}),
         "gemma3-dense": (gemma3, "dense", {}),
         "gemma3-int8": (gemma3, "int8", dict(group_size=16)),
         "llama-window": (lambda: tiny_model("llama", num_hidden_layers=2), "window", dict(window=6))}
#: compiled against eager with 64 steps (mistral-dense: the past-max_length tests)
COMPILED = ("gemma3-dense", "gemma3-int8", "llama-window")


def _model(case: str = "mistral-dense"):
    build, method, opts = CASES[case]
    model = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kvslim.apply(model, method, **opts)
    return model


def _decode(model, step, cache, steps: int = STEPS):
    return decode_greedy(model, step, cache, PROMPT, steps)




@pytest.mark.parametrize("case", COMPILED)
def test_rings_compile_once_and_decode_64_steps_with_eager_tokens(case):
    model = _model(case)
    ordinary = kvslim.make_cache(model)
    eager, eager_logits = _decode(model, model, ordinary)
    cache = kvslim.make_cache(model, max_length=PROMPT + STEPS + 4, capturable=True)
    rings = [layer for layer in cache.layers if isinstance(layer, RingLayer)]
    assert rings and cache.is_compileable is True
    got, logits = _decode(model, _compiled(model), cache)
    graphs = _graphs()
    assert graphs == 1, f"{case}: {graphs} graphs over {STEPS} steps ({dict(counters['recompiles'])})"
    assert torch.equal(eager, got)
    if CASES[case][1] == "int8":  # a last-bit activation difference may move one code (tests/tolerances.py)
        err = max_err(logits, eager_logits)
        assert err <= CAPTURED_CODES_LOGIT_ATOL, f"{case}: max|Δ| {err:.3e}"
    else:
        assert_rel_close(logits, eager_logits, torch.float32, f"{case}: compiled capturable vs eager")
    assert cache.get_seq_length() == PROMPT + STEPS
    assert all(layer.k_store.data.shape[2] == layer.window for layer in rings)  # W slots, whatever the length


def test_hf_generate_compile_path_with_a_left_padded_batch():
    """HF's compile path on the Gemma-3 shape: the padding mask reaches the ring's slots through their columns."""
    model = _model("gemma3-int8")
    ids, mask = padded_batch(2, 12)
    eager, got, graphs, _ = generate_eager_and_compiled(model, ids, 24, 12 + 32, attention_mask=mask)
    assert torch.equal(eager, got)
    assert graphs == 1, f"{graphs} graphs for 23 compiled decode steps"


def test_graph_step_past_max_length_is_refused_by_name_and_writes_nothing():
    model = _model()
    cache = kvslim.make_cache(model, max_length=PROMPT + 2, capturable=True)
    layer, unchanged, graphs = graph_step_past_max_length(model, cache, PROMPT, 2)
    assert unchanged and graphs == 1
    assert int(layer.length_t[0]) == PROMPT + 2
    with pytest.raises(ValueError, match=f"max_length={PROMPT + 2}"):
        cache.check_finite()
    with pytest.raises(ValueError, match=f"max_length={PROMPT + 2}"):
        cache.get_seq_length()


def test_past_max_length_eagerly():
    """An ordinary ring ignores ``max_length`` (its memory is the window; tokens unchanged); a capturable one refuses
    a step past it by name, nothing written."""
    model = _model()
    short = _decode(model, model, kvslim.make_cache(model, max_length=PROMPT + 2), steps=10)
    assert torch.equal(short[0], _decode(model, model, kvslim.make_cache(model), steps=10)[0])
    cache = kvslim.make_cache(model, max_length=PROMPT + 1, capturable=True)
    _decode(model, model, cache, steps=1)
    assert eager_step_past_max_length_is_refused(model, cache, PROMPT + 1)
    assert cache.get_seq_length() == PROMPT + 1


def test_what_stays_uncapturable():
    """Rings with a full-precision residual window (int4 with KIVI groups on sliding layers longer than its window)
    keep the eager layout; so does every ring of a model whose attention is not kvslim's (it could not gather the
    mask by column); a capturable ring cannot rewind."""
    model = gemma3(window=48)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kvslim.apply(model, "int4", residual=16, flush=8, key_channel_group=8, sink=0)
    cache = kvslim.make_cache(model, max_length=64, capturable=True)
    assert [layer.can_capture() for layer in cache.layers] == [False, True, False]
    model = tiny_model("mistral", num_hidden_layers=2, attn_implementation="eager")
    kvslim.apply(model, "dense")
    with pytest.raises(ValueError, match="capturable=True: no layer"):
        kvslim.make_cache(model, max_length=64, capturable=True)
    model = _model()
    cache = kvslim.make_cache(model, max_length=64, capturable=True)
    _decode(model, model, cache, steps=1)
    with pytest.raises(ValueError, match="tokens_to_remove=-1"):
        cache.layers[0].crop(-1)


def test_int8_rings_hold_the_eager_codes_in_float64():
    """The int8 difference in fp32 is rounding, not layout: in float64 (activations that agree far below a code's
    rounding boundary) the capturable layout, run eagerly, writes every code the ordinary cache writes, and the
    logits agree within the fp32 scales' rounding (docs/gpu.md: in fp32 one value code of the Gemma-3 case sits
    1.9e-5 of a step from its rounding boundary and moves by one)."""
    build, method, opts = CASES["gemma3-int8"]
    model = build().double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kvslim.apply(model, method, **opts)
    ordinary = kvslim.make_cache(model)
    cache = kvslim.make_cache(model, max_length=PROMPT + STEPS + 4, capturable=True)
    eager, eager_logits = _decode(model, model, ordinary)
    got, logits = _decode(model, model, cache)
    assert torch.equal(eager, got)
    err = max_err(logits, eager_logits)
    assert err <= RTOL[torch.float32], f"float64 logits max|Δ| {err:.3e}"  # scales are fp32
    full = PROMPT + STEPS
    for a, b in zip(ordinary.layers, cache.layers, strict=True):
        for sa, sb in zip(a._stores(), b._stores(), strict=True):
            if isinstance(a, RingLayer):  # slot p mod (W − 1) against p mod W: compare by position
                pos = torch.arange(full - a.window + 1, full)
                ca, cb = sa.data[:, :, pos % (a.window - 1)], sb.data[:, :, pos % a.window]
            else:
                ca, cb = sa.data[:, :, :full], sb.data[:, :, :full]
            assert torch.equal(ca, cb)
