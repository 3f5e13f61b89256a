"""The token protocol step by step in one forward pass (``kvslim.stepwise.compare_specs_steps``) gives what the
call-by-call run gives (``compare_steps``): per step the same NLL, KL and top-1, and the bytes the cache holds
(``layer_nbytes``) after every scored call, window flushes, sinks, smoothing factors and rings included."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from test_evaluate_parallel import _gemma3
from tolerances import PROTOCOL_ONE_PASS_RTOL
from transformers import DynamicCache

from kvslim.caches import KVSlimCache
from kvslim.evaluate_parallel import layer_specs_of
from kvslim.methods import METHODS
from kvslim.stepwise import compare_specs_steps, compare_steps

PLANS = {
    "int4": dict(residual=16, sink=2, key_channel_group=16, group_size=16),
    "int2": dict(residual=32, key_channel_group=16, group_size=16),
    "int8": {},  # smoothed per-token keys: fp32 factors fixed by the prefill
    "turbo3": dict(residual=16, sink=2, flush=8, outliers=8, rotation="orthogonal"),  # + the outlier permutation
}


def _compare(model, ids, plans, steps, reference=DynamicCache):
    makers = {k: (lambda p=p: KVSlimCache([x.factory(None) for x in p.layers], plan=p)) for k, p in plans.items()}
    a = compare_steps(model, ids, makers, steps=steps, reference=reference)
    b = compare_specs_steps(model, ids, {k: layer_specs_of(p) for k, p in plans.items()}, steps=steps)
    for k in plans:
        x, y = a[k], b[k]
        assert torch.equal(x.held, y.held), k
        assert x.nbytes.tolist() == y.nbytes.tolist(), k  # measured from the tensors vs counted from the specs
        assert len(set(x.nbytes.tolist())) > 2, k  # the bytes move (flushes, growth): not a constant
        torch.testing.assert_close(y.nll, x.nll, rtol=PROTOCOL_ONE_PASS_RTOL, atol=1e-9)
        torch.testing.assert_close(y.ref_nll, x.ref_nll, rtol=PROTOCOL_ONE_PASS_RTOL, atol=1e-9)
        torch.testing.assert_close(y.kl, x.kl, rtol=1e-4, atol=1e-12)
        assert torch.equal(y.top1, x.top1), k
        assert (x.nll - x.ref_nll).abs().max() > 1e-7, k  # lossy: the comparison is not vacuous
        assert y.delta_ppl_ci() == pytest.approx(x.delta_ppl_ci(), rel=1e-4, abs=1e-9)


@torch.inference_mode()
def test_one_pass_steps_equal_call_by_call_append_only():
    model = tiny_model("llama", dtype=torch.float64, max_position_embeddings=1024).eval()
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(3))
    plans = {k: METHODS[k].plan_model(model, **o) for k, o in PLANS.items()}
    plans["turbo3 pre-RoPE keys"] = METHODS["turbo3"].plan_model(model, prerope_keys=True, **PLANS["turbo3"])
    _compare(model, ids, plans, steps=60)


@torch.inference_mode()
def test_one_pass_steps_equal_call_by_call_rings():
    model = _gemma3()  # 3 sliding layers (W 48) in rings, one full layer
    ids = torch.randint(2, 128, (1, 200), generator=torch.Generator().manual_seed(4))
    plans = {"int4": METHODS["int4"].plan_model(model, residual=8, key_channel_group=8, sink=2),
             "int8": METHODS["int8"].plan_model(model)}
    _compare(model, ids, plans, steps=60, reference=lambda: DynamicCache(config=model.config))


def test_refused_by_name():
    model = tiny_model("llama").eval()
    ids = torch.randint(0, 128, (1, 80))
    with pytest.raises(ValueError, match="specs must name"):
        compare_specs_steps(model, ids, {}, steps=10)
    with pytest.raises(ValueError, match="ids must be"):
        compare_specs_steps(model, ids[0], {"x": []}, steps=10)
    with pytest.raises(ValueError, match="block"):
        compare_specs_steps(model, ids, {"x": []}, steps=10, block=0)
    with pytest.raises(ValueError, match="one .key, value. spec per layer"):
        compare_specs_steps(model, ids, {"x": []}, steps=10)
