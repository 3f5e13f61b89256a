"""kvslim.apply(model, "mla") on tiny random DeepSeek-V2/V3 models: exact against HF, bytes, bad input."""

from __future__ import annotations

import pytest
import torch
from conftest import padded_batch
from tolerances import LOGIT_ATOL, assert_error_ratio, max_err
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    DynamicCache,
)

import kvslim
from kvslim.adapters.compat import CACHE_KW
from kvslim.attention import mla
from kvslim.caches.latent import LatentLayer

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
        "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0}
BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            n_shared_experts=1, num_experts_per_tok=2, n_routed_experts=4, first_k_dense_replace=1,
            max_position_embeddings=256, initializer_range=0.1)
#: scaled-down shapes of the real models (dense first layer, MoE after it, as published)
SHAPES = {
    "v2-lite": ("v2", dict(q_lora_rank=None, topk_method="greedy", rope_parameters=YARN)),
    "v2": ("v2", dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=2, topk_group=1,
                      routed_scaling_factor=16.0, rope_parameters=YARN)),
    "v3": ("v3", dict(q_lora_rank=24, n_group=2, topk_group=1, routed_scaling_factor=2.5, rope_interleave=True,
                      rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0})),
    "v3-halfrot": ("v3", dict(q_lora_rank=None, n_group=2, topk_group=1, rope_interleave=False)),
}
IMPLS = ("decompressed", "compressed", "absorbed", "elided")


pytestmark = pytest.mark.usefixtures("one_thread")


def deepseek(name: str, *, dtype=torch.float32, seed: int = 0, **overrides):
    family, kw = SHAPES[name]
    torch.manual_seed(seed)
    cfg = {**BASE, **kw, **overrides}
    model = (DeepseekV2ForCausalLM(DeepseekV2Config(**cfg)) if family == "v2"
             else DeepseekV3ForCausalLM(DeepseekV3Config(**cfg)))
    return model.to(dtype).eval()


def _prompt(b=1, n=12, seed=1):
    return torch.randint(1, 128, (b, n), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, new=64, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=0, **kw)


def _logit_err(a, b):
    return max(max_err(x, y) for x, y in zip(a.logits, b.logits, strict=True))


@pytest.mark.parametrize("name", list(SHAPES))
def test_fp32_greedy_identical_to_hf_for_64_tokens(name):
    model = deepseek(name)
    ids = _prompt()
    ref = _generate(model, ids)
    for impl in IMPLS:
        plan = kvslim.apply(model, "mla", impl=impl, prefill_threshold=8 if impl == "elided" else None)
        out = _generate(model, ids)
        assert isinstance(out.past_key_values, kvslim.KVSlimCache) and out.past_key_values.plan is plan
        assert torch.equal(out.sequences, ref.sequences), f"{name}/{impl}: tokens differ from HF"
        err = _logit_err(out, ref)
        assert err <= LOGIT_ATOL[torch.float32], f"{name}/{impl}: max|Δlogit| {err:.2e}"
    kvslim.restore(model)


def test_yarn_mscale_is_in_the_scale_we_use():
    model = deepseek("v2")
    attn = model.model.layers[0].self_attn
    plain = (16 + 8) ** -0.5
    assert attn.scaling > plain * 1.01  # YaRN mscale² applied by HF
    kvslim.apply(model, "mla")
    with torch.no_grad():
        model(_prompt())
    from kvslim.adapters import deepseek as adapter
    assert adapter.weights(attn).scale == attn.scaling


def test_latent_cache_holds_exactly_what_hf_caches():
    """HF 5.x caches the latent (c_kv, k_pe), not expanded K/V; ours holds the same tensors bit for bit."""
    model = deepseek("v2-lite")
    ids = _prompt()
    with torch.no_grad():
        hf = DynamicCache(config=model.config)
        model(ids, **{CACHE_KW: hf}, use_cache=True)
        kvslim.apply(model, "mla", impl="compressed")  # HF's own math: every layer's input is bitwise HF's
        ours = kvslim.make_cache(model, max_length=40)
        model(ids, **{CACHE_KW: ours}, use_cache=True)
    for i, layer in enumerate(ours.layers):
        assert isinstance(layer, LatentLayer)
        hk, hv = hf.layers[i].keys, hf.layers[i].values
        assert hk.shape == (1, 1, 12, 32) and hv.shape == (1, 1, 12, 8)  # (B, 1, T, dc), (B, 1, T, dr)
        assert torch.equal(layer.c_kv_store.read(0, 12), hk) and torch.equal(layer.k_pe_store.read(0, 12), hv)


@pytest.mark.parametrize("impl", ["absorbed", "elided"])
def test_decode_never_expands_per_head_kv(impl, monkeypatch):
    calls = []
    original = mla.expand
    monkeypatch.setattr(mla, "expand", lambda c, k, w: calls.append(c.shape[1]) or original(c, k, w))
    model = deepseek("v2")
    kvslim.apply(model, "mla", impl=impl, prefill_threshold=10)
    _generate(model, _prompt(n=12), new=6)
    assert calls == [12] * 3  # the 12-token prefill expands once per layer (≥ threshold); decode never
    calls.clear()
    kvslim.apply(model, "mla", impl=impl, prefill_threshold=None)
    _generate(model, _prompt(n=12), new=6)
    assert calls == []


def test_padded_batch_and_eager_attention_match_hf():
    ids, mask = padded_batch(batch=2, length=10)
    for attn_impl in ("sdpa", "eager"):
        model = deepseek("v3", attn_implementation=attn_impl)
        ref = _generate(model, ids, new=16, attention_mask=mask)
        for impl in ("absorbed", "elided"):
            kvslim.apply(model, "mla", impl=impl, prefill_threshold=None)
            out = _generate(model, ids, new=16, attention_mask=mask)
            assert torch.equal(out.sequences, ref.sequences), f"{attn_impl}/{impl}"
            assert _logit_err(out, ref) <= LOGIT_ATOL[torch.float32], f"{attn_impl}/{impl}"
        kvslim.restore(model)


def test_unused_slots_full_of_nan_change_nothing():
    model = deepseek("v2-lite")
    kvslim.apply(model, "mla")
    ids = _prompt(n=8)
    with torch.no_grad():
        outs = []
        for poison in (False, True):
            cache = kvslim.make_cache(model, max_length=64)
            logits = [model(ids, **{CACHE_KW: cache}, use_cache=True).logits[:, -1]]
            if poison:
                for layer in cache.layers:
                    layer.c_kv_store.data[:, :, 8:] = float("nan")
                    layer.k_pe_store.data[:, :, 8:] = float("nan")
            for t in range(5):
                logits.append(model(torch.tensor([[t + 3]]), **{CACHE_KW: cache}, use_cache=True).logits[:, -1])
            outs.append(torch.cat(logits))
    assert torch.isfinite(outs[1]).all() and torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("impl,bits", [("elided", 0), ("decompressed", 0), ("elided", 8), ("absorbed", 4),
                                       ("compressed", 8)])
def test_plan_bytes_equal_measured_nbytes(impl, bits):
    model = deepseek("v2")
    plan = kvslim.apply(model, "mla", impl=impl, bits=bits, group_size=16)
    for batch in (1, 2):
        out = _generate(model, _prompt(b=batch, n=9), new=7)
        cache = out.past_key_values
        tokens = cache.get_seq_length()
        assert tokens == 15  # the last generated token is never fed back
        assert cache.nbytes == plan.cache_bytes(tokens, batch)
        assert cache.nbytes == batch * tokens * sum(lp.bytes_per_token for lp in plan.layers)
        assert cache.allocated_nbytes >= cache.nbytes
    if bits == 0:  # fp32: latent (dc + dr)·4, decompressed h·(dk + dr + dv)·4
        assert plan.layers[0].bytes_per_token == ((32 + 8) * 4 if impl == "elided" else 4 * (16 + 8 + 16) * 4)
    assert plan.dense_bytes_per_token == 4 * (16 + 8 + 16) * 4


def test_quantized_latents_error_within_the_quantization_bound():
    """c_kv kept int8/int4 (k_pe plain): per element |Δ| ≤ scale/2 of its group; int4 errs more than int8."""
    model = deepseek("v2")
    ids = _prompt(n=16)
    with torch.no_grad():
        kvslim.apply(model, "mla")
        exact = kvslim.make_cache(model)
        first = model(ids[:, :12], **{CACHE_KW: exact}, use_cache=True).logits
        ref = model(ids[:, 12:], **{CACHE_KW: exact}, use_cache=True).logits
        errs = {}
        for bits in (8, 4):
            kvslim.apply(model, "mla", bits=bits, group_size=16)
            quant = kvslim.make_cache(model)
            # a call attends to its own latents in full precision; the next one to the quantized history
            assert max_err(model(ids[:, :12], **{CACHE_KW: quant}, use_cache=True).logits, first) < 1e-5
            errs[bits] = max_err(model(ids[:, 12:], **{CACHE_KW: quant}, use_cache=True).logits, ref)
            # layer 0 sees identical inputs: its stored latent is the exact one, quantized once
            c_exact = exact.layers[0].c_kv_store.read(0, 16)
            store = quant.layers[0].c_kv_store
            bound = store.scale[:, :, :16].repeat_interleave(16, dim=-1) / 2 + 1e-7
            assert ((store.read(0, 16) - c_exact).abs() <= bound).all(), bits
            assert torch.equal(quant.layers[0].k_pe_store.read(0, 16), exact.layers[0].k_pe_store.read(0, 16))
            assert store.data.dtype == (torch.int8 if bits == 8 else torch.uint8)
            assert quant.nbytes < exact.nbytes
    assert 0 < errs[8] < errs[4] and errs[8] < 0.05 * ref.abs().max().item(), errs


@pytest.mark.parametrize("impl", ["compressed", "absorbed", "elided", "decompressed"])
def test_bf16_error_ratio_against_hf(impl):
    """bf16 logits within 2× HF's own bf16 error against a float64 run (dense layers: float64 MoE not needed)."""
    dense = dict(first_k_dense_replace=3)
    ids = _prompt(n=10)
    steps = torch.tensor([[5], [17], [99], [42]])

    def run(model):
        with torch.no_grad():
            cache = DynamicCache(config=model.config) if kvslim.get_plan(model) is None else kvslim.make_cache(model)
            logits = [model(ids, **{CACHE_KW: cache}, use_cache=True).logits]
            logits += [model(t[None], **{CACHE_KW: cache}, use_cache=True).logits for t in steps]
        return torch.cat(logits, dim=1).double()

    ref64 = run(deepseek("v2", dtype=torch.float64, **dense))
    model = deepseek("v2", dtype=torch.bfloat16, **dense)
    hf = run(model)
    kvslim.apply(model, "mla", impl=impl, prefill_threshold=None)
    assert_error_ratio(run(model), hf, ref64, torch.bfloat16, impl)


@pytest.mark.parametrize("options,name", [
    (dict(impl="fast"), "impl"), (dict(bits=3), "bits"), (dict(bits=8, group_size=12), "group_size"),
    (dict(group_size=0), "group_size"), (dict(prefill_threshold=0), "prefill_threshold"),
    (dict(prefill_threshold=1.5), "prefill_threshold"), (dict(chunk=-1), "chunk"),
    (dict(absorb_dtype="float16"), "absorb_dtype"), (dict(bits=8, impl="decompressed"), "bits"),
    (dict(scale_dtype="int8"), "scale_dtype"), (dict(window=4), "window"),
])
def test_bad_options_raise_naming_the_option_and_change_nothing(options, name):
    model = deepseek("v2-lite")
    with pytest.raises(ValueError, match=name):
        kvslim.apply(model, "mla", **options)
    assert kvslim.get_plan(model) is None and "generate" not in vars(model)
    assert all("forward" not in vars(m) for m in model.modules())
    plan = kvslim.apply(model, "mla", impl="absorbed")  # a refused apply leaves a previous one in place
    with pytest.raises(ValueError, match=name):
        kvslim.apply(model, "mla", **options)
    assert kvslim.get_plan(model) is plan


def test_models_without_mla_and_configs_missing_fields_are_refused(tiny):
    llama = tiny("llama")
    with pytest.raises(ValueError, match="model_type 'llama'"):
        kvslim.apply(llama, "mla")
    assert kvslim.get_plan(llama) is None and all("forward" not in vars(m) for m in llama.modules())
    with pytest.raises(ValueError, match="multi-head latent attention"):
        kvslim.plan_config(llama.config, "mla")
    model = deepseek("v2-lite")
    vars(model.config)["qk_rope_head_dim"] = None  # HF's strict config refuses a plain setattr
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        kvslim.apply(model, "mla")
    assert kvslim.get_plan(model) is None and all("forward" not in vars(m) for m in model.modules())
    vars(model.config)["qk_rope_head_dim"] = 8
    vars(model.config)["kv_lora_rank"] = None
    with pytest.raises(ValueError, match="kv_lora_rank"):
        kvslim.apply(model, "mla")


def test_restore_gives_back_hf_forward():
    model = deepseek("v3")
    ids = _prompt()
    ref = _generate(model, ids, new=4)
    kvslim.apply(model, "mla", bits=4, group_size=16)
    kvslim.restore(model)
    assert all("forward" not in vars(m) and not hasattr(m, "_kvslim_mla") for m in model.modules())
    out = _generate(model, ids, new=4)
    assert isinstance(out.past_key_values, DynamicCache)
    assert torch.equal(out.sequences, ref.sequences) and _logit_err(out, ref) == 0
