"""kvslim caches inside Hugging Face ``generate``: same tokens and logits as HF's own cache."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import padded_batch, tiny_model
from tolerances import LOGIT_ATOL, max_err

import kvslim
from kvslim.adapters.compat import CACHE_KW
from kvslim.caches import KVSlimCache

NEW = 64


def _generate(model, ids, mask, **kw):
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=0, **kw)


def _logit_err(a, b) -> float:
    return max(max_err(x, y) for x, y in zip(a.logits, b.logits))


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen2-mixed", "qwen3", "phi3", "gpt2", "mixtral"])
def test_dense_is_exact_in_fp32_with_left_padding(kind):
    model = tiny_model(kind)
    ids, mask = padded_batch()
    ref = _generate(model, ids, mask)
    plan = kvslim.apply(model, "dense")
    out = _generate(model, ids, mask)
    assert isinstance(out.past_key_values, KVSlimCache), "plain generate must use the kvslim cache after apply"
    assert torch.equal(out.sequences, ref.sequences)
    assert _logit_err(out, ref) <= LOGIT_ATOL[torch.float32]
    assert out.past_key_values.nbytes == plan.cache_bytes(ids.shape[1] + NEW - 1, batch=ids.shape[0])


@pytest.mark.parametrize("kind", ["mistral", "qwen2", "qwen2-mixed"])
@pytest.mark.parametrize("prompt_len", [5, 20])  # shorter and longer than the window (8)
def test_window_ring_buffer_is_exact_against_hf_sliding_window(kind, prompt_len):
    model = tiny_model(kind)
    ids, mask = padded_batch(length=prompt_len)
    ref = _generate(model, ids, mask)
    plan = kvslim.apply(model, "window")
    out = _generate(model, ids, mask)
    assert torch.equal(out.sequences, ref.sequences)
    assert _logit_err(out, ref) <= LOGIT_ATOL[torch.float32]
    cache = out.past_key_values
    assert cache.nbytes == plan.cache_bytes(prompt_len + NEW - 1, batch=2)
    ring = [lp for lp in plan.layers if lp.window is not None]
    assert ring and all(lp.window == 8 and lp.exactness == "exact" for lp in ring)


def test_window_memory_flat_over_ten_windows():
    model = tiny_model("mistral")
    kvslim.apply(model, "window")
    cache = kvslim.make_cache(model)
    ids = torch.randint(1, 128, (1, 3))
    model.generate(ids, max_new_tokens=8 * 10, do_sample=False, **{CACHE_KW: cache}, pad_token_id=0)
    per_layer = 2 * 2 * 16 * 4  # K+V, 2 kv heads, head_dim 16, fp32
    assert cache.nbytes == cache.allocated_nbytes == 3 * (8 - 1) * per_layer  # W − 1 rows, as HF


@pytest.mark.parametrize("method,opts,limit", [("int8", {"group_size": 8}, 5e-2), ("int4", {"group_size": 8}, 1.0),
                                               ("int8", {"group_size": 16, "window": 8}, 5e-2)])
def test_quantized_caches_run_in_generate_and_stay_close(method, opts, limit):
    model = tiny_model("mistral")
    ids, mask = padded_batch()
    nxt = torch.randint(1, 128, (2, 4), generator=torch.Generator().manual_seed(5))
    mask2 = torch.cat((mask, torch.ones_like(nxt)), dim=1)
    ref = model(torch.cat((ids, nxt), dim=1), attention_mask=mask2).logits
    plan = kvslim.apply(model, method, **opts)
    cache = kvslim.make_cache(model)
    logits = model(ids, attention_mask=mask, **{CACHE_KW: cache}).logits
    # the prompt attends to its own K/V in full precision: as the dense model
    assert max_err(logits, ref[:, :ids.shape[1]]) < LOGIT_ATOL[torch.float32]
    logits = model(nxt, attention_mask=mask2, **{CACHE_KW: cache}).logits
    err = max_err(logits, ref[:, ids.shape[1]:])  # the next call attends to the quantized prompt
    assert 0 < err < limit, f"{method}: logit error {err}"
    assert cache.nbytes == plan.cache_bytes(ids.shape[1] + 4, batch=2)
    out = _generate(model, ids, mask)
    assert out.sequences.shape == (2, ids.shape[1] + NEW)


def test_window_on_full_attention_model_is_marked_approximate():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="window"):
        kvslim.apply(model, "window")  # no sliding_window in a Llama config: W is required
    plan = kvslim.apply(model, "window", window=8)
    assert {lp.exactness for lp in plan.layers} == {"approximate"}
    assert "approximate" in str(plan)


def test_apply_refuses_bad_input_and_changes_nothing():
    model = tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cases = [(("bogus",), {}, "method"), (("window",), {"window": 0}, "window"),
             (("window",), {"window": -3}, "window"), (("int8",), {"group_size": 5}, "group_size"),
             (("int8",), {"bits": 3}, "bits"), (("int4",), {"scale_dtype": "int8"}, "scale_dtype"),
             (("dense",), {"window": 4}, "window")]
    for args, opts, word in cases:
        with pytest.raises(ValueError, match=word):
            kvslim.apply(model, *args, **opts)
        assert kvslim.get_plan(model) is None and "generate" not in vars(model)
    with pytest.raises(ValueError, match="max_length"):
        kvslim.make_cache(model, max_length=0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_apply_refuses_unsupported_model_with_reason():
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64))
    with pytest.raises(ValueError, match="model_type 'bert'.*supported"):
        kvslim.apply(model, "dense")


def test_apply_refuses_an_untested_transformers_release(monkeypatch):
    """A transformers release outside the tested range is refused by name before anything changes (kvslim patches
    attention modules whose arguments change between releases: 5.24 renamed the cache argument); the installed
    one is in range."""
    import transformers

    kvslim.api.check_transformers()  # the release this suite runs on
    model = tiny_model("llama")
    monkeypatch.setattr(transformers, "__version__", "5.25.0")
    with pytest.raises(RuntimeError, match=r"transformers >= 5\.0, < 5\.25; this is transformers 5\.25\.0"):
        kvslim.apply(model, "slim")
    assert kvslim.get_plan(model) is None and "generate" not in vars(model)
    for bad in ("4.57.1", "6.0.0"):
        with pytest.raises(RuntimeError, match="supports transformers"):
            kvslim.api.check_transformers(bad)


def test_restore_and_reapply():
    model = tiny_model("llama")
    kvslim.apply(model, "int8", group_size=8)
    kvslim.apply(model, "dense")
    assert kvslim.get_plan(model).method == "dense"
    kvslim.restore(model)
    assert kvslim.get_plan(model) is None and "generate" not in vars(model)


def test_gqa_decode_uses_packed_queries_and_restore_puts_sdpa_back():
    model = tiny_model("llama")  # 4 query heads, 2 KV heads
    assert model.config._attn_implementation == "sdpa"
    kvslim.apply(model, "int8", group_size=8)
    assert model.config._attn_implementation == "kvslim_sdpa"
    kvslim.apply(model, "dense")  # re-apply: restore first, then switch again
    assert model.config._attn_implementation == "kvslim_sdpa"
    kvslim.restore(model)
    assert model.config._attn_implementation == "sdpa"
    mha = tiny_model("llama", kv_heads=4)
    kvslim.apply(mha, "dense")
    assert mha.config._attn_implementation == "kvslim_sdpa"  # MHA too: the forced SDPA backends on CUDA


def test_packed_gqa_attention_matches_hf_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kvslim.adapters.sdpa import packed_gqa_sdpa_forward

    class Mod(torch.nn.Module):
        num_key_value_groups = 3
        is_causal = True

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 1, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    ours, _ = packed_gqa_sdpa_forward(Mod(), q, k, v, None, scaling=0.25)
    ref, _ = sdpa_attention_forward(Mod(), q, k, v, None, scaling=0.25)
    assert ours.shape == ref.shape == (2, 1, 6, 16)
    assert max_err(ours, ref) <= 1e-6


@pytest.mark.parametrize("method,opts", [("window", {}), ("int8", {"group_size": 16, "window": 8})])
def test_unpadded_window_decode_reads_the_ring_in_slot_order(method, opts):
    """Without padding, generate lets ring layers skip the temporal-order copy; results match the copy path."""
    model = tiny_model("mistral")
    ids = torch.randint(1, 128, (2, 20), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    ref = _generate(model, ids, mask)
    kvslim.apply(model, method, **opts)
    out = _generate(model, ids, mask)
    assert all(layer.slot_order_ok for layer in out.past_key_values.layers)
    copy_path = kvslim.make_cache(model)  # not declared unpadded: temporal order
    slow = _generate(model, ids, mask, **{CACHE_KW: copy_path})
    assert not any(layer.slot_order_ok for layer in copy_path.layers)
    assert torch.equal(out.sequences, slow.sequences)
    assert _logit_err(out, slow) <= LOGIT_ATOL[torch.float32]
    if method == "window":
        assert torch.equal(out.sequences, ref.sequences) and _logit_err(out, ref) <= LOGIT_ATOL[torch.float32]


@pytest.mark.parametrize("method", ["int4", "slim"])
def test_a_cache_handed_to_generate_under_either_spelling_is_used(method):
    """``generate(..., past_key_values=cache)`` and, from transformers 5.24, ``generate(..., cache=cache)`` (the new
    name; the old one is a deprecated alias there): the same tokens and logits, and the kvslim cache handed over is
    the one that holds the context afterwards."""
    model = tiny_model("llama", kv_heads=4) if method == "slim" else tiny_model("mistral")  # slim needs MHA
    ids, mask = padded_batch()
    with warnings.catch_warnings():  # random weights: slim's fp32 conditioning notice
        warnings.simplefilter("ignore")
        kvslim.apply(model, method)
    spellings = ["past_key_values"] + (["cache"] if CACHE_KW == "cache" else [])
    outs = {}
    for kw in spellings:
        cache = kvslim.make_cache(model)
        with warnings.catch_warnings():  # the old spelling on a release that renamed it: its deprecation notice
            warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
            outs[kw] = _generate(model, ids, mask, **{kw: cache})
        assert cache.get_seq_length() == ids.shape[1] + NEW - 1, kw  # the last token is never fed back
        assert cache.nbytes > 0
    first = outs["past_key_values"]
    for kw, out in outs.items():
        assert torch.equal(out.sequences, first.sequences), kw
        assert _logit_err(out, first) == 0.0, kw
