"""``kvslim.calibrate``: per-layer key rotation chosen on calibration tokens (docs/quantization.md §12).

The choice is the argmin of each layer's attention-output error; a layer whose keys are a large constant offset
(what wrecks rotated keys on Qwen2.5-Coder) keeps them unrotated; the result is a plain dict that ``apply`` takes
and that pickles; bad input is refused by name; the chunked KL that checks a plan equals the one-pass protocol's.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from conftest import CALIB_OPTS as OPTS
from conftest import tiny_model

import kvslim
from kvslim.calibration import calibrate, chunk_kl, chunk_reference, layer_errors
from kvslim.methods import METHODS


def test_choice_is_the_lower_error_and_apply_takes_it(calib_model, calib_ids):
    per_layer = calibrate(calib_model, calib_ids, "int4", queries=32, **OPTS)
    errors = layer_errors(calib_model, calib_ids, "int4", ({"rotation": None}, {"rotation": "hadamard"}), 32, **OPTS)
    assert per_layer == {i: {"rotation": "hadamard"} for i, (a, b) in enumerate(errors) if b < a}
    assert all(e > 0 for row in errors for e in row)
    assert pickle.loads(pickle.dumps(per_layer)) == per_layer
    plan = kvslim.apply(calib_model, "int4", per_layer=per_layer, **OPTS)
    try:
        assert [lp.factory(None).spec.rotation for lp in plan.layers] == [
            per_layer.get(i, {}).get("rotation") for i in range(3)]
    finally:
        kvslim.restore(calib_model)
    assert calibrate(calib_model, calib_ids, "int4", queries=32, **OPTS) == per_layer  # deterministic


def test_constant_offset_keys_stay_unrotated(calib_ids):
    m = tiny_model("llama", kv_heads=2, num_hidden_layers=2, attention_bias=True, seed=1)
    with torch.no_grad():
        m.model.layers[0].self_attn.k_proj.bias[:] = 0
        m.model.layers[0].self_attn.k_proj.bias[::16] = 200.0  # one huge constant channel per head (Qwen2.5 layer 0)
    errors = layer_errors(m, calib_ids, "int4", ({"rotation": None}, {"rotation": "hadamard"}), 32, **OPTS)
    assert errors[0][1] > 1.2 * errors[0][0]
    assert 0 not in calibrate(m, calib_ids, "int4", queries=32, **OPTS)


def test_given_per_layer_is_kept(calib_model, calib_ids):
    given = {0: {"bits": 8}, 1: {"rotation": None}}
    out = calibrate(calib_model, calib_ids, "int4", queries=32, per_layer=given, **OPTS)
    assert out[0]["bits"] == 8 and out[1] == {"rotation": None}
    assert given == {0: {"bits": 8}, 1: {"rotation": None}}


@pytest.mark.parametrize("kw, words", [
    (dict(method="window"), "method must be one of int8, int4, int3, int2, turbo4, turbo3, turbo2"),
    (dict(method="dense"), "method must be one of"),
    (dict(choose="bits"), "choose must be 'rotation' (int methods) or 'key_scales' (turbo methods)"),
    (dict(queries=0), "queries must be a positive int"),
    (dict(queries=True), "queries must be a positive int"),
    (dict(ids=torch.zeros(96)), "ids must be a (1, T) tensor"),
    (dict(ids=torch.zeros(1, 96)), "ids must be a (1, T) tensor"),
    (dict(ids=torch.ones(1, 40, dtype=torch.long)), "ids: 40 tokens are too few"),
    (dict(rotation="haar"), "rotation must be"),
    (dict(per_layer={7: {"bits": 8}}), "per_layer: layer(s) [7] outside"),
])
def test_refusals_by_name(calib_model, calib_ids, kw, words):
    args = dict(ids=calib_ids, method="int4", queries=32, **OPTS)
    args.update(kw)
    with pytest.raises(ValueError) as e:
        calibrate(calib_model, args.pop("ids"), args.pop("method"), **args)
    assert words in str(e.value)


def test_non_finite_and_other_models_refused(calib_ids):
    m = tiny_model("llama", kv_heads=2, num_hidden_layers=2)
    with torch.no_grad():
        m.model.layers[1].self_attn.k_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite queries, keys or values in layer 1"):
        calibrate(m, calib_ids, "int4", queries=32, **OPTS)
    with pytest.raises(ValueError, match="model: calibrate needs Llama-style attention"):
        calibrate(tiny_model("phi3"), calib_ids, "int4", queries=32, **OPTS)
    with pytest.raises(ValueError, match="calibrate covers append-only layers"):
        calibrate(tiny_model("mistral"), calib_ids, "int4", queries=32, **OPTS)


def test_chunk_kl_matches_the_step_protocol(calib_model, calib_ids):
    """Chunks of one token are the step protocol: the chunked KL equals ``compare_steps``' (call by call)."""
    from kvslim.caches import KVSlimCache
    from kvslim.stepwise import compare_steps

    plan = METHODS["int4"].plan_model(calib_model, **OPTS)
    ref = chunk_reference(calib_model, calib_ids[:, :95], 80, chunk=1)  # positions 80..94 predict tokens 81..95
    kl = chunk_kl(calib_model, ref, plan)
    make = lambda: KVSlimCache([lp.factory(None) for lp in plan.layers], plan=plan)  # noqa: E731
    steps = compare_steps(calib_model, calib_ids, {"p": make}, steps=15)["p"]  # prefill 96 - 15 - 1 = 80 tokens
    assert kl > 0
    torch.testing.assert_close(torch.tensor(kl, dtype=torch.float64), steps.kl.mean(), rtol=1e-5, atol=0)
