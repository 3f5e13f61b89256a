"""``per_layer``: a quantized method's bits / rotations set layer by layer (docs/quantization.md §11).

Bad input is refused by name with nothing changed; the plan's bytes equal what its cache measures; the plan pickles
with its layers' formats; the one-pass protocol reads each layer's own specs; decode steps take the fused paths
where a layer's format has one, and give the unfused path's tokens everywhere.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from conftest import tiny_model

import kvslim
from kvslim.adapters.compat import CACHE_KW
from kvslim.evaluate_parallel import layer_specs_of
from kvslim.methods import METHODS
from kvslim.stepwise import layer_nbytes


@pytest.fixture(scope="module")
def model(one_thread):
    return tiny_model("llama", kv_heads=2, num_hidden_layers=3)


def _bits(plan):
    out = []
    for spec in layer_specs_of(plan):
        out.append((spec.key.bits, spec.value.bits, spec.key.rotation))
    return out


def test_each_layer_gets_its_own_format(model):
    plan = METHODS["int4"].plan_model(model, per_layer={0: {"bits": 8}, 2: {"rotation": "hadamard"}})
    assert _bits(plan) == [(8, 8, None), (4, 4, None), (4, 4, "hadamard")]
    int8 = METHODS["int4"].plan_model(model, key_bits=8, asymmetric=True)  # every layer K8, values int4
    assert plan.layers[0].bytes_per_token > int8.layers[0].bytes_per_token > plan.layers[1].bytes_per_token
    int2 = METHODS["int2"].plan_model(model, per_layer={1: {"bits": 3}, 2: {"bits": 4, "key_bits": 8}})
    assert _bits(int2) == [(3, 2, None), (3, 3, None), (8, 4, None)]  # bits sets keys too unless key_bits says
    assert "K int3" in int2.layers[1].note and "V int3" in int2.layers[1].note
    same = METHODS["int4"].plan_model(model, per_layer={1: {"bits": 4}})
    assert _bits(same) == _bits(METHODS["int4"].plan_model(model))
    assert [lp.bytes_per_token for lp in same.layers] == [lp.bytes_per_token
                                                          for lp in METHODS["int4"].plan_model(model).layers]


@pytest.mark.parametrize("bad, words", [
    ({3: {"bits": 8}}, "per_layer: layer(s) [3] outside the model's 3 layers"),
    ({0: {"bits": 5}}, "per_layer[0]: bits must be 2, 3, 4 or 8"),
    ({0: {"bits": True}}, "per_layer[0]: bits must be 2, 3, 4 or 8"),
    ({0: {"sink": 2}}, "per_layer[0]: unknown option(s) ['sink']"),
    ({0: {}}, "per_layer[0] must be a non-empty dict"),
    ({-1: {"bits": 8}}, "per_layer: layer indices must be ints >= 0"),
    ({"0": {"bits": 8}}, "per_layer: layer indices must be ints >= 0"),
    ([(0, {"bits": 8})], "per_layer must be a dict"),
    ({0: {"rotation": "haar"}}, "per_layer[0]: rotation must be"),
    ({1: {"key_bits": 7}}, "per_layer[1]: key_bits must be"),
])
def test_bad_per_layer_is_refused_by_name_and_changes_nothing(model, bad, words):
    kvslim.apply(model, "int4")
    try:
        before = kvslim.get_plan(model)
        attn = model.config._attn_implementation
        with pytest.raises(ValueError) as e:
            kvslim.apply(model, "int2", per_layer=bad)
        assert words in str(e.value)
        assert kvslim.get_plan(model) is before and model.config._attn_implementation == attn
    finally:
        kvslim.restore(model)
    with pytest.raises(ValueError, match="unknown option"):
        kvslim.apply(model, "dense", per_layer={0: {"bits": 8}})


def test_plan_bytes_equal_the_measured_cache_and_the_plan_pickles(model):
    plan = METHODS["int2"].plan_model(model, per_layer={0: {"bits": 8}, 1: {"bits": 3}}, residual=12, sink=2,
                                      key_channel_group=8)
    again = pickle.loads(pickle.dumps(plan))
    assert again.options == plan.options and _bits(again) == _bits(plan)
    kvslim.apply(model, "int2", per_layer={0: {"bits": 8}, 1: {"bits": 3}}, residual=12, sink=2, key_channel_group=8)
    try:
        cache = kvslim.make_cache(model)
        ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            model(ids, use_cache=True, **{CACHE_KW: cache})
            for t in range(5):
                model(ids[:, t:t + 1], use_cache=True, **{CACHE_KW: cache})
        assert cache.nbytes == plan.cache_bytes(45)
        cfg = model.config
        specs = layer_specs_of(plan)
        dim = cfg.hidden_size // cfg.num_attention_heads
        assert sum(layer_nbytes(s, 45, cfg.num_key_value_heads, dim, torch.float32) for s in specs) == cache.nbytes
        assert pickle.loads(pickle.dumps(cache)).nbytes == cache.nbytes
    finally:
        kvslim.restore(model)


# (method, per_layer, whether each layer's decode step is fused): equal K/V bits of 4/8 take kvslim.quant_decode,
# 2/3-bit pairs kvslim.quant_decode_lowbit; 8-bit keys beside 4-bit values have no fused op (unfused reads)
CASES = [("int4", {0: {"bits": 8}}, (True, True, True)),
         ("int2", {0: {"bits": 4}, 1: {"bits": 3}}, (True, True, True)),
         ("int4", {2: {"key_bits": 8}}, (True, True, False)),
         ("int4", {1: {"rotation": "hadamard"}}, (True, True, True)),  # keys rotated in one layer only
         ("int2", {0: {"rotation": "hadamard"}, 2: {"rotation": "hadamard"}}, (True, True, True))]


@pytest.mark.parametrize("method, per_layer, fused", CASES)
def test_decode_paths_and_tokens(model, monkeypatch, method, per_layer, fused):
    from kvslim.adapters import sdpa

    monkeypatch.setenv("KVSLIM_QUANT_SCORES", "exact")  # the exact paths are the unfused path's twins
    monkeypatch.setenv("KVSLIM_QUANT_VALUES", "exact")
    taken: list[tuple[int, bool]] = []
    decode = sdpa.quant.decode

    def spy(h, *a):
        out = decode(h, *a)
        taken.append(((h.k.spec.bits, h.v.spec.bits), out is not None))
        return out

    monkeypatch.setattr(sdpa.quant, "decode", spy)
    ids = torch.randint(1, 128, (1, 36), generator=torch.Generator().manual_seed(1))
    kvslim.apply(model, method, per_layer=per_layer, residual=8, sink=2, key_channel_group=8)
    try:
        runs = []
        for on in (True, False):
            cache = kvslim.make_cache(model)
            for layer in cache.layers:
                layer.fused_decode = on
            with torch.no_grad():
                runs.append(model.generate(ids, max_new_tokens=10, do_sample=False, **{CACHE_KW: cache}))
    finally:
        kvslim.restore(model)
    assert torch.equal(runs[0], runs[1])
    plan_bits = [(s.key.bits, s.value.bits) for s in layer_specs_of(
        METHODS[method].plan_model(model, per_layer=per_layer, residual=8, sink=2, key_channel_group=8))]
    seen: dict = {}
    for bits, ok in taken:
        seen.setdefault(bits, set()).add(ok)
    assert taken and all(seen[b] == {f} for b, f in zip(plan_bits, fused))


def test_capturable_cache_gives_the_same_tokens(model):
    """``make_cache(capturable=True)`` builds each layer from its own spec: the tokens equal the eager cache's."""
    ids = torch.randint(1, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    kvslim.apply(model, "int2", per_layer={0: {"bits": 4}, 2: {"rotation": "hadamard"}}, residual=8, sink=2,
                 key_channel_group=8)
    try:
        outs = []
        for capturable in (False, True):
            cache = kvslim.make_cache(model, max_length=64, capturable=capturable)
            with torch.no_grad():
                outs.append(model.generate(ids, max_new_tokens=10, do_sample=False, **{CACHE_KW: cache}))
    finally:
        kvslim.restore(model)
    assert torch.equal(outs[0], outs[1])
