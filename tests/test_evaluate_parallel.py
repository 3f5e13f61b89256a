"""The one-pass quality protocol (kvslim.evaluate_parallel) gives what feeding the cache call by call gives
(kvslim.evaluate.compare_caches): same perplexity, KL, top-1, max |Δlogit| and bytes, token and chunked modes,
GQA, sliding-window layers, per-layer formats, ring-buffer layers (Gemma-3's own sliding layers, ``window=W``)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from tolerances import PROTOCOL_ONE_PASS_ATOL, PROTOCOL_ONE_PASS_RTOL
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig

from kvslim import api
from kvslim.caches import KVSlimCache, StoreSpec
from kvslim.caches.dense import AppendLayer
from kvslim.caches.window import ResidualRingLayer, RingLayer
from kvslim.evaluate import compare_caches
from kvslim.evaluate_parallel import LayerSpec, compare_specs, layer_specs_of
from kvslim.methods import METHODS

F16 = torch.float16
SPECS = {
    "int8 smooth": StoreSpec(8, 16, smooth=True),
    "int4 asym kivi r64": StoreSpec(4, 16, F16, asymmetric=True, channel_group=16, residual=64, flush=16),
    "int2 asym kivi r32": StoreSpec(2, 16, F16, asymmetric=True, channel_group=16, residual=32, flush=16),
    "int2 hadamard r32": StoreSpec(2, 16, F16, asymmetric=True, rotation="hadamard", residual=32, flush=8),
    "int4 kivi r48 sink3": StoreSpec(4, 16, F16, asymmetric=True, channel_group=16, residual=48, flush=16, sink=3),
}


class _Layer(AppendLayer):
    def __init__(self, kspec: StoreSpec, vspec: StoreSpec):
        super().__init__(kspec, chunk=64)
        self._vspec = vspec

    def value_spec(self) -> StoreSpec:
        return self._vspec


def _check(a, b):
    for label in a:
        x, y = a[label], b[label]
        assert x.scored == y.scored and x.tokens == y.tokens, label
        assert y.ppl == pytest.approx(x.ppl, rel=PROTOCOL_ONE_PASS_RTOL), label
        assert y.ref_ppl == pytest.approx(x.ref_ppl, rel=PROTOCOL_ONE_PASS_RTOL), label
        assert y.kl == pytest.approx(x.kl, rel=PROTOCOL_ONE_PASS_RTOL, abs=1e-12), label
        assert y.top1 == x.top1, label
        assert abs(y.max_dlogit - x.max_dlogit) <= PROTOCOL_ONE_PASS_ATOL, label
        assert y.nbytes == x.nbytes, label
        assert x.kl > 0 or label.startswith("int8"), label  # the comparison is not vacuous


@pytest.mark.parametrize("kind,mode", [("llama", "token"), ("mistral", "chunked")])  # mistral: sliding window 96
def test_one_pass_equals_call_by_call(kind, mode):
    extra = {"sliding_window": 96} if kind == "mistral" else {}
    model = tiny_model(kind, dtype=torch.float64, max_position_embeddings=1024, **extra).eval()
    ids = torch.randint(0, 128, (1, 240), generator=torch.Generator().manual_seed(1))
    n = model.config.num_hidden_layers
    kw = dict(steps=40) if mode == "token" else dict(prefill=96, chunk=32)
    per_layer = {k: [(s, s.for_values())] * n for k, s in SPECS.items()}
    k3v2 = StoreSpec(3, 16, F16, asymmetric=True, channel_group=16, residual=64, flush=16, value_bits=2)
    per_layer["mixed per layer"] = [(k3v2, k3v2.for_values())] + [(SPECS["int2 hadamard r32"],) * 2] * (n - 1)
    makers = {k: (lambda ls=ls: KVSlimCache([_Layer(*s) for s in ls])) for k, ls in per_layer.items()}
    a = compare_caches(model, ids, makers, mode=mode, **kw)
    b = compare_specs(model, ids, per_layer, mode=mode, **kw)
    _check(a, b)


def test_plans_of_the_methods_run_in_one_pass():
    model = tiny_model("llama", max_position_embeddings=1024).eval()
    api.apply(model, "dense")
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(2))
    plans = {m: METHODS[m].plan_model(model, **({"residual": 64} if m != "int8" else {}))
             for m in ("int8", "int4", "int2", "turbo3")}
    a = compare_caches(model, ids, {m: (lambda p=p: KVSlimCache([x.factory(None) for x in p.layers], plan=p))
                                    for m, p in plans.items()}, steps=64)
    b = compare_specs(model, ids, {m: layer_specs_of(p) for m, p in plans.items()}, steps=64)
    for m in plans:  # float32 model: summation order may move a code across a rounding boundary
        assert b[m].kl == pytest.approx(a[m].kl, rel=0.05, abs=1e-6), m
        assert b[m].nbytes == a[m].nbytes, m
    with pytest.raises(ValueError, match="append-only"):
        layer_specs_of(METHODS["slim"].plan_model(tiny_model("llama", kv_heads=4)))  # SlimLayer: K only
    with pytest.raises(ValueError, match="one .* spec per layer"):
        compare_specs(model, ids, {"x": layer_specs_of(plans["int4"])[:1]}, steps=64)


def _gemma3(window: int = 48) -> Gemma3ForCausalLM:
    """3 sliding layers (window 48) then a full one; MQA 4/1, head dim 32; float64."""
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=window,
                           layer_types=["sliding_attention"] * 3 + ["full_attention"], query_pre_attn_scalar=32,
                           max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    return Gemma3ForCausalLM(cfg).to(torch.float64).eval()


RING_PLANS = {  # the methods' formats with windows scaled to the sliding window of 48
    "int8": {},  # quantized RingLayer (smoothed keys: the first write is the prefill's last W − 1 tokens)
    "int4": {"residual": 8, "key_channel_group": 8, "sink": 2},  # ResidualRingLayer; full layer with sinks
    "int2": {"residual": 16, "key_channel_group": 8, "flush": 8},
    "int4 window=32": {"window": 32},  # rings of 32 on every layer (the full one too: HF's mask is causal there)
}


@pytest.mark.parametrize("mode", ["token", "chunked"])
def test_rings_one_pass_equals_call_by_call(mode):
    """Gemma-3's sliding layers in rings (and ``window=32`` rings): one pass = call by call (tokens seen, which
    of them decoded, smoothing of a plain ring's first write, bytes the ring holds)."""
    model = _gemma3()
    ids = torch.randint(2, 128, (1, 240), generator=torch.Generator().manual_seed(1))
    kw = dict(steps=40) if mode == "token" else dict(prefill=96, chunk=32)  # chunks of 32 < W − 1: wrap-around
    plans = {k: METHODS[k.split()[0]].plan_model(model, **o) for k, o in RING_PLANS.items()}
    specs = {k: layer_specs_of(p) for k, p in plans.items()}
    kinds = {k: [type(x.factory(None)) for x in p.layers] for k, p in plans.items()}
    assert kinds["int8"] == [RingLayer] * 3 + [AppendLayer] and kinds["int4"] == [ResidualRingLayer] * 3 + [AppendLayer]
    assert [ls.window for ls in specs["int4 window=32"]] == [32] * 4 and specs["int4"][3].window is None
    a = compare_caches(model, ids, {k: (lambda p=p: KVSlimCache([x.factory(None) for x in p.layers], plan=p))
                                    for k, p in plans.items()}, mode=mode,
                       reference=lambda: DynamicCache(config=model.config), **kw)
    b = compare_specs(model, ids, specs, mode=mode, **kw)
    _check(a, b)
    for k, p in plans.items():
        assert b[k].nbytes == p.cache_bytes(b[k].tokens), k


def test_ring_specs_refused_by_name():
    model = _gemma3()
    ids = torch.randint(2, 128, (1, 240), generator=torch.Generator().manual_seed(1))
    specs = layer_specs_of(METHODS["int4"].plan_model(model, residual=8, key_channel_group=8))
    sink = StoreSpec(4, 16, F16, asymmetric=True, channel_group=8, residual=8, flush=8, sink=2)
    bad = {"sink ring": [LayerSpec(sink, sink.for_values(), 48)] + specs[1:],
           "window 0": [LayerSpec(specs[0].key, specs[0].value, 0)] + specs[1:]}
    for label, layer_specs in bad.items():
        with pytest.raises(ValueError, match="specs"):
            compare_specs(model, ids, {label: layer_specs}, steps=40)
