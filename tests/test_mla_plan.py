"""The config-only MLA planner on the shipped DeepSeek configs, and the latent cache layer's storage."""

from __future__ import annotations

import json
from importlib import resources

import pytest
import torch
from transformers import AutoConfig

import kvslim
from kvslim.caches import StoreSpec
from kvslim.caches.latent import LatentLayer

CONFIGS = resources.files("kvslim") / "data" / "configs"
#: published numbers: (file, model_type, hidden, heads, q_lora_rank, layers, decompressed bf16 B/token/layer)
REAL = [("deepseek-v2.json", "deepseek_v2", 5120, 128, 1536, 60, 81_920),
        ("deepseek-v2-lite.json", "deepseek_v2", 2048, 16, None, 27, 10_240),
        ("deepseek-v3.json", "deepseek_v3", 7168, 128, 1536, 61, 81_920)]


def _config(name):
    data = json.loads((CONFIGS / name).read_text())
    return AutoConfig.for_model(**data)  # as `kvslim plan --config` reads it


@pytest.mark.parametrize("name,model_type,hidden,heads,q_lora,layers,dense", REAL)
def test_real_configs_give_published_figures(name, model_type, hidden, heads, q_lora, layers, dense):
    cfg = _config(name)
    assert (cfg.model_type, cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.num_hidden_layers) == (
        model_type, hidden, heads, q_lora, layers)
    assert (cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (512, 128, 64, 128)
    plan = kvslim.plan_config(cfg, "mla", "bfloat16")
    assert len(plan.layers) == layers and plan.dense_bytes_per_token == dense
    assert {lp.bytes_per_token for lp in plan.layers} == {1_152}  # (512 + 64) · 2
    assert {lp.technique for lp in plan.layers} == {"mla-latent"} and plan.options == {}
    assert plan.cache_bytes(4096) == 4096 * layers * 1_152
    assert plan.ratio(4096) == pytest.approx(1_152 / dense)
    assert kvslim.plan_config(cfg, "mla", "bfloat16", impl="decompressed").layers[0].bytes_per_token == dense
    assert kvslim.plan_config(cfg, "mla", "float32").layers[0].bytes_per_token == 2_304
    # int8: 512 codes + 8 fp32 scales + k_pe 64·2; int4: 256 packed bytes + 8 scales + 128
    assert kvslim.plan_config(cfg, "mla", bits=8).layers[0].bytes_per_token == 512 + 32 + 128
    q4 = kvslim.plan_config(cfg, "mla", bits=4, group_size=32)
    assert q4.layers[0].bytes_per_token == 256 + 64 + 128 and q4.layers[0].technique == "mla-latent-int4"
    assert q4.layers[0].exactness == "lossy"
    assert "mla-latent" in str(plan)


def test_v2_moe_fields_as_published():
    v2, lite, v3 = (_config(n) for n, *_ in REAL)
    assert (v2.n_routed_experts, v2.num_experts_per_tok, v2.n_shared_experts, v2.moe_intermediate_size) == (
        160, 6, 2, 1536)
    assert (lite.n_routed_experts, lite.num_experts_per_tok, lite.first_k_dense_replace) == (64, 6, 1)
    assert (v3.n_routed_experts, v3.num_experts_per_tok, v3.first_k_dense_replace, v3.n_group) == (256, 8, 3, 8)
    assert v2.rope_parameters["rope_type"] == "yarn" and v3.rope_parameters["mscale_all_dim"] == 1.0


def test_cli_plan_lists_mla_for_shipped_config():
    cli = pytest.importorskip("kvslim.cli.plan")
    records = cli.method_records(cli.load_config(str(CONFIGS / "deepseek-v2.json")), 4096, 1, torch.bfloat16,
                                 None, 64)
    mla = [r for r in records if r["method"] == "mla"]
    assert mla and mla[0]["applies"] and mla[0]["cache_bytes"] == 4096 * 60 * 1_152
    assert mla[0]["dense_bytes"] == 4096 * 60 * 81_920


def test_planner_refuses_bad_options_naming_them():
    cfg = _config("deepseek-v2-lite.json")
    for opts, name in ((dict(bits=8, group_size=100), "group_size"), (dict(impl="x"), "impl"),
                       (dict(nope=1), "nope")):
        with pytest.raises(ValueError, match=name):
            kvslim.plan_config(cfg, "mla", **opts)


def test_latent_layer_grows_in_chunks_and_keeps_its_contents():
    layer = LatentLayer(StoreSpec(), chunk=4)
    g = torch.Generator().manual_seed(0)
    c, r = torch.randn(2, 1, 6, 32, generator=g), torch.randn(2, 1, 6, 8, generator=g)
    out_c, out_r = layer.update(c[:, :, :3], r[:, :, :3])
    assert layer.c_kv_store.capacity == 4 and out_c.shape == (2, 1, 3, 32)
    out_c, out_r = layer.update(c[:, :, 3:], r[:, :, 3:])
    assert layer.c_kv_store.capacity == 8 and torch.equal(out_c, c) and torch.equal(out_r, r)
    assert layer.get_seq_length() == 6 and layer.get_mask_sizes(1) == (7, 0)
    assert layer.nbytes == 2 * 6 * LatentLayer.bytes_per_token(32, 8, torch.float32)
    assert layer.allocated_nbytes == 2 * 8 * (32 + 8) * 4
    layer.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(layer.c_kv_store.read(0, 6), c.flip(0))
    layer.crop(-2)
    assert layer.get_seq_length() == 4


def test_quantized_latent_layer_keeps_k_pe_in_model_dtype():
    layer = LatentLayer(StoreSpec(4, 16), max_length=10, chunk=8)
    c, r = torch.randn(1, 1, 5, 32, dtype=torch.bfloat16), torch.randn(1, 1, 5, 8, dtype=torch.bfloat16)
    out_c, out_r = layer.update(c, r)
    assert layer.c_kv_store.capacity == 16 and layer.c_kv_store.data.dtype == torch.uint8
    assert layer.k_pe_store.data.dtype == torch.bfloat16 and torch.equal(out_r, r)
    assert out_c.dtype == torch.bfloat16 and torch.equal(out_c, c)  # the call's own tokens: full precision
    assert layer.nbytes == 5 * (16 + 2 * 4 + 8 * 2)
    c2, r2 = torch.randn(1, 1, 1, 32, dtype=torch.bfloat16), torch.randn(1, 1, 1, 8, dtype=torch.bfloat16)
    out_c, out_r = layer.update(c2, r2)  # the history now reads back from int4 codes, k_pe exactly
    assert torch.equal(out_c[:, :, 5:], c2) and torch.equal(out_r, torch.cat([r, r2], 2))
    assert 0 < (out_c[:, :, :5].float() - c.float()).abs().max() < 0.5
