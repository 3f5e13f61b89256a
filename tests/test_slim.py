"""Slim attention end to end: fp32 generate identical to HF (tokens and logits), left padding, bytes, refusals."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import padded_batch, tiny_model
from tolerances import LOGIT_ATOL
from transformers import GPT2Config, GPT2LMHeadModel

import kvslim
from kvslim.adapters.compat import CACHE_KW
from kvslim.caches.slim import SlimLayer

NEW = 64


def tiny_gpt2(seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=128, n_embd=64, n_layer=3, n_head=4, n_positions=256, pad_token_id=0)
    return GPT2LMHeadModel(cfg).to(dtype).eval()


def make(kind: str):
    return tiny_gpt2() if kind == "gpt2" else tiny_model(kind, kv_heads=4)


def greedy(model, ids, mask=None, new=NEW):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack(out.logits)


@functools.cache
def reference(kind: str):
    """One model per family and its HF greedy run (computed once; tests restore the model afterwards)."""
    model = make(kind)
    ids = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(3))
    seq, logits = greedy(model, ids)
    return model, ids, seq, logits


# (family, options, new tokens): every family runs the full 64 tokens once; variants run a shorter prefix
CASES = [("llama", {"cache": "k", "rank": 0}, NEW), ("phi3", {"cache": "k", "rank": 0}, NEW),
         ("gpt2", {}, NEW), ("gpt2", {"cache": "k", "rank": 0}, 24), ("gpt2", {"cache": "v"}, 24),
         ("llama", {"cache": "k", "rank": 0, "rope_storage": "rotated"}, 24),
         ("llama", {"cache": "k", "rank": 0, "decode": "option1"}, 24), ("llama", {"cache": "k", "rank": 16}, 24),
         ("llama", {"cache": "k", "rank": 0, "kernel": "torch"}, 24),
         ("llama", {"cache": "k", "rank": 0, "rope_storage": "rotated", "kernel": "torch"}, 24)]


@pytest.mark.filterwarnings("ignore:slim layer")
@pytest.mark.parametrize("kind,opts,new", CASES,
                         ids=[f"{k}-{'-'.join(map(str, o.values())) or 'auto'}" for k, o, _ in CASES])
def test_fp32_generate_matches_hf(kind, opts, new):
    model, ids, ref_seq, ref_logits = reference(kind)
    plan = kvslim.apply(model, "slim", **opts)
    try:
        seq, logits = greedy(model, ids, new=new)
    finally:
        kvslim.restore(model)
    assert torch.equal(seq, ref_seq[:, :ids.shape[1] + new])
    err = (logits - ref_logits[:new]).abs().max().item()
    assert err <= LOGIT_ATOL[torch.float32], f"max|Δlogit| {err:.2e}"
    assert all(lp.technique.startswith("slim") for lp in plan.layers)
    assert plan.cache_bytes(100) < plan.dense_bytes(100)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_left_padded_batch(kind):
    model = make(kind)
    ids, mask = padded_batch(batch=3, length=10)
    ids[2, -1] = 5  # the longest-padded row
    ref_seq, ref_logits = greedy(model, ids, mask, new=16)
    kvslim.apply(model, "slim", cache="k", rank=0)
    seq, logits = greedy(model, ids, mask, new=16)
    assert torch.equal(seq, ref_seq)
    assert (logits - ref_logits).abs().max().item() <= LOGIT_ATOL[torch.float32]


def test_cache_holds_only_the_plan_and_bytes_match():
    model = make("llama")
    plan = kvslim.apply(model, "slim", cache="k", rank=0)
    cache = kvslim.make_cache(model)
    ids = torch.randint(1, 128, (2, 9))
    model(input_ids=ids, **{CACHE_KW: cache}, use_cache=True)
    model(input_ids=ids[:, :1], **{CACHE_KW: cache}, use_cache=True)
    assert all(isinstance(layer, SlimLayer) for layer in cache.layers)
    assert cache.get_seq_length() == 10
    assert cache.nbytes == plan.cache_bytes(10, batch=2)
    assert plan.cache_bytes(10) * 2 == plan.dense_bytes(10)  # exactly half of K+V
    e, itemsize = 64, 4
    assert plan.dense_bytes_per_token == 2 * e * itemsize
    assert all(lp.bytes_per_token == e * itemsize for lp in plan.layers)


def test_decode_step_reads_no_projection_it_does_not_store():
    """A K-only decode step projects q and k only: v_proj's weight is not read (prefill still needs all three)."""
    model = make("llama")
    kvslim.apply(model, "slim", cache="k", rank=0)
    calls = {"k_proj": 0, "v_proj": 0}
    for attn in (layer.self_attn for layer in model.model.layers):
        for name in calls:
            getattr(attn, name).register_forward_hook(lambda *_, n=name: calls.__setitem__(n, calls[n] + 1))
    cache = kvslim.make_cache(model)
    ids = torch.randint(1, 128, (1, 6))
    model(input_ids=ids, **{CACHE_KW: cache}, use_cache=True)
    layers = len(model.model.layers)
    assert calls == {"k_proj": layers, "v_proj": layers}
    model(input_ids=ids[:, :1], **{CACHE_KW: cache}, use_cache=True)
    assert calls == {"k_proj": 2 * layers, "v_proj": layers}


def test_conditioned_plan_bytes_match_measured():
    model = make("llama")
    plan = kvslim.apply(model, "slim", cache="k", rank=16)
    assert {lp.technique for lp in plan.layers} == {"slim-k+r16"}
    cache = kvslim.make_cache(model)
    model(input_ids=torch.randint(1, 128, (1, 7)), **{CACHE_KW: cache}, use_cache=True)
    assert cache.nbytes == plan.cache_bytes(7) == 7 * 3 * (64 + 16) * 4


def test_restore_gives_back_hf_attention():
    model = make("gpt2")
    ids = torch.randint(1, 128, (1, 8))
    ref = model(ids).logits
    kvslim.apply(model, "slim", cache="k")
    assert "forward" in vars(model.transformer.h[0].attn)
    kvslim.restore(model)
    assert "forward" not in vars(model.transformer.h[0].attn)
    assert torch.equal(model(ids).logits, ref)


def test_user_hf_cache_falls_back_to_plain_attention():
    from transformers import DynamicCache

    model = make("llama")
    ids = torch.randint(1, 128, (1, 8))
    ref = model.generate(ids, max_new_tokens=8, do_sample=False)
    kvslim.apply(model, "slim", cache="k")
    out = model.generate(ids, max_new_tokens=8, do_sample=False, **{CACHE_KW: DynamicCache()})
    assert torch.equal(out, ref)


def test_gqa_and_mqa_are_refused_with_a_reason():
    for kv in (2, 1):
        model = tiny_model("llama", kv_heads=kv)
        with pytest.raises(ValueError, match="multi-head attention"):
            kvslim.apply(model, "slim")
        assert "forward" not in vars(model.model.layers[0].self_attn)
    with pytest.raises(ValueError, match="multi-head attention"):
        kvslim.plan_config(tiny_model("llama", kv_heads=2).config, "slim")


def test_bad_options_are_refused():
    model = make("llama")
    with pytest.raises(ValueError, match="RoPE"):
        kvslim.apply(model, "slim", cache="x")
    with pytest.raises(ValueError, match="cache"):
        kvslim.apply(model, "slim", cache="q")
    with pytest.raises(ValueError, match="budget"):
        kvslim.apply(model, "slim", budget=0.5)
    with pytest.raises(ValueError, match="unknown option"):
        kvslim.apply(model, "slim", ranks=3)
    assert "forward" not in vars(model.model.layers[0].self_attn)


def test_config_only_plan():
    plan = kvslim.plan_config(tiny_gpt2().config, "slim", dtype="bfloat16")
    assert {lp.technique for lp in plan.layers} == {"slim-x"}
    assert plan.ratio(100) == 0.5
    assert "not measured" in plan.layers[0].exactness
