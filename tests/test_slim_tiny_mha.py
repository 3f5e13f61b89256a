"""Slim attention end to end on our trained MHA decoder (kvslim.models.tiny_mha): fp32 identical to HF,
half precision under the error-ratio rule against a float64 copy, and the default plan's memory."""

from __future__ import annotations

import functools

import pytest
import torch
from tolerances import LOGIT_ATOL, assert_error_ratio

import kvslim
from kvslim.adapters.compat import CACHE_KW

tiny_mha = pytest.importorskip("kvslim.models.tiny_mha")
if not (tiny_mha.tiny_mha_path() / "model.safetensors").is_file():
    pytest.skip("tiny MHA weights not shipped", allow_module_level=True)

PROMPT = "def fibonacci(n):\n    a, b = 0, 1\n"


def test_fp32_default_plan_generates_like_hf():
    model, tok = tiny_mha.load_tiny_mha(torch.float32)
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    kw = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, output_logits=True,
              return_dict_in_generate=True)
    ref = model.generate(ids, **kw)
    plan = kvslim.apply(model, "slim", tokenizer=tok)
    out = model.generate(ids, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert (torch.stack(out.logits) - torch.stack(ref.logits)).abs().max() <= LOGIT_ATOL[torch.float32]
    assert plan.ratio(1000) < 0.51 and all(lp.technique.startswith("slim-k") for lp in plan.layers)


def decode_logits(model, ids):
    """Teacher-forced: prefill 24 tokens, then decode the rest one by one; logits of the decode steps."""
    cache = kvslim.make_cache(model)
    model(input_ids=ids[:, :24], **{CACHE_KW: cache}, use_cache=True)
    return torch.cat([model(input_ids=ids[:, i:i + 1], **{CACHE_KW: cache}, use_cache=True).logits
                      for i in range(24, ids.shape[1])], 1)


@functools.cache
def reference64():
    model64, tok = tiny_mha.load_tiny_mha(torch.float64)
    ids = tok(PROMPT * 3, return_tensors="pt")["input_ids"][:, :34]
    return tok, ids, decode_logits(model64, ids)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_default_plan_error_ratio(dtype):
    tok, ids, ref = reference64()
    model, _ = tiny_mha.load_tiny_mha(dtype)
    base = decode_logits(model, ids)
    plan = kvslim.apply(model, "slim", tokenizer=tok)
    opt = decode_logits(model, ids)
    assert plan.ratio(1000) <= 2 / 3  # ≥ 1.5× smaller than K+V
    assert all("exact" in lp.exactness for lp in plan.layers)
    assert_error_ratio(opt, base, ref, dtype, f"default plan {[lp.technique for lp in plan.layers]}")
