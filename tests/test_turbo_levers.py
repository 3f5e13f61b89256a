"""Issue 35's levers on the turbo formats: pre-RoPE keys (``prerope_keys``: coded before RoPE, rotated back on
read) and the fused decode's full-precision window kept in the coded basis across steps (``caches/fused.turbo_tail``)."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest
import torch
from conftest import tiny_model

import kvslim
from kvslim.adapters.shape import shape_from_config
from kvslim.caches import StoreSpec, make_store
from kvslim.caches.fused import fusable
from kvslim.caches.turbo import TurboStore
from kvslim.methods import METHODS
from kvslim.methods.turbo import rope_from_model, rope_from_shape
from kvslim.ops.rope import rotate


def _rope_rows(inv: tuple[float, ...], pre: torch.Tensor) -> torch.Tensor:
    """Keys ``pre`` (B, H, T, D) before RoPE -> after RoPE at positions 0 … T − 1 (HF's table)."""
    pos = torch.arange(pre.shape[2]).float()
    f = pos[:, None] * torch.tensor(inv)[None]
    emb = torch.cat((f, f), -1)
    return rotate(pre, emb.cos(), emb.sin())


def _spec(**kw) -> StoreSpec:
    model = tiny_model("llama", hidden_size=128, num_attention_heads=2, kv_heads=2)  # head dim 64
    return replace(METHODS["turbo3"].plan_model(model, prerope_keys=True).layers[0].factory(None).spec, **kw)


def test_prerope_keys_code_the_position_free_part():
    """A key whose pre-RoPE part is one constant per head plus noise: coded before RoPE the constant is the
    centred channel means (fp32) and only the noise is coded; after RoPE it turns with the position and rides
    on every row. Reads return post-RoPE rows either way."""
    spec = _spec(residual=0, sink=0, flush=1)
    g = torch.Generator().manual_seed(0)
    pre = 5 * torch.randn(1, 2, 1, 64, generator=g) + 0.3 * torch.randn(1, 2, 200, 64, generator=g)
    post = _rope_rows(spec.rope, pre)
    errs, nbytes = [], []
    for rope in (None, spec.rope):
        s = make_store(replace(spec, rope=rope), post, 256)
        s.write(0, post[:, :, :120])
        s.write(120, post[:, :, 120:])
        errs.append(((s.read(0, 200) - post).pow(2).sum() / (0.3 ** 2 * post.numel())).item())
        nbytes.append(s.nbytes(200))
    assert errs[1] < 0.1 * errs[0]
    assert nbytes[0] == nbytes[1]  # the RoPE table is computed, not stored
    r = make_store(spec, post, 256).roundtrip(post)
    assert ((r - post).pow(2).sum() / (0.3 ** 2 * post.numel())).item() < 0.1 * errs[0]


def test_prerope_positions_behind_sinks_are_the_tokens_own():
    """Behind sink tokens the coded part starts at slot 0 = position ``sink``: a constant pre-RoPE key is centred
    to its very value (the fitted means equal it, fp32 1e-4), not to a rotated copy."""
    spec = _spec(residual=16, flush=8, sink=4)
    k0 = 3 * torch.randn(1, 2, 1, 64, generator=torch.Generator().manual_seed(1))
    post = _rope_rows(spec.rope, k0.expand(1, 2, 100, 64).clone())
    s = make_store(spec, post, 128)
    s.write(0, post)
    coded = s.coded
    assert isinstance(coded, TurboStore) and coded.position_offset == 4
    torch.testing.assert_close(coded.mean, k0, atol=1e-4, rtol=0)
    torch.testing.assert_close(s.read(0, 100), post, atol=1e-3, rtol=0)


def test_prerope_plan_from_config_and_model_agree_and_pickle():
    model = tiny_model("llama", hidden_size=128, num_attention_heads=2, kv_heads=2)
    assert rope_from_model(model) == rope_from_shape(shape_from_config(model.config))
    plan = kvslim.apply(model, "turbo3", prerope_keys=True)
    spec = plan.layers[0].factory(None).spec
    assert spec.rope == rope_from_model(model) and spec.for_values().rope is None
    assert "prerope-k" in spec.describe()
    again = pickle.loads(pickle.dumps(plan))
    assert again.layers[1].factory(None).spec == plan.layers[1].factory(None).spec
    assert plan.layers[0].bytes_per_token == METHODS["turbo3"].plan_model(model).layers[0].bytes_per_token
    ids = torch.randint(3, 120, (2, 140), generator=torch.Generator().manual_seed(0))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                         return_dict_in_generate=True, pad_token_id=0)
    cache = out.past_key_values
    assert cache.nbytes == plan.cache_bytes(143, batch=2)
    assert not fusable(cache.layers[0].k_store)  # RoPE per decoded row: the layers' reads, not the fused op
    kvslim.restore(model)


@pytest.mark.parametrize("opts,match", [
    (dict(prerope_keys="yes"), "prerope_keys must be True or False"),
])
def test_prerope_bad_options_refused_by_name(opts, match):
    model = tiny_model("llama", kv_heads=2)
    with pytest.raises(ValueError, match=match):
        kvslim.apply(model, "turbo3", **opts)
    assert getattr(model, "_kvslim", None) is None


def test_prerope_refused_without_rope_and_spec_checks():
    with pytest.raises(ValueError, match="prerope_keys=True needs the model's RoPE table.*prerope_keys=False"):
        kvslim.apply(tiny_model("gpt2"), "turbo3", prerope_keys=True)
    with pytest.raises(ValueError, match="rope must be None or a non-empty tuple"):
        StoreSpec(3, codec="turbo", rotation="orthogonal", rope=(1.0, float("nan")))
    with pytest.raises(ValueError, match="rope: 40 frequencies rotate 80 channels"):
        StoreSpec(3, codec="turbo", rotation="orthogonal", rope=(1.0,) * 40).check_dim(64)
    with pytest.raises(ValueError, match="are options of turbo codes"):
        StoreSpec(3, rope=(1.0,))


def test_fused_decode_transforms_one_new_window_row_per_step(monkeypatch):
    """The fused decode keeps the full-precision window in the coded basis: a step moves only its new row there
    (the whole window again only after a flush); the tokens equal the unfused reads'
    (``test_turbo_decode.test_fused_decode_steps_equal_the_unfused_reads``)."""
    model = tiny_model("llama", kv_heads=2)
    kvslim.apply(model, "turbo3", residual=16, flush=8, sink=2)
    rows = []
    original = TurboStore.to_coded_basis

    def counting(self, x, scale_by_channel=False):
        if not scale_by_channel:  # a tail, not the query
            rows.append(x.shape[2])
        return original(self, x, scale_by_channel)

    monkeypatch.setattr(TurboStore, "to_coded_basis", counting)
    ids = torch.randint(3, 120, (1, 40), generator=torch.Generator().manual_seed(0))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=9, do_sample=False,
                         pad_token_id=0, return_dict_in_generate=True)
    assert out.past_key_values.layers[0].fused_decode
    layers = model.config.num_hidden_layers
    # 8 decode steps; per layer keys and values: a flush (after 40 + 8 tokens: window 16 -> 8) redoes the window
    assert len(rows) == 8 * 2 * layers
    assert rows.count(1) >= 6 * 2 * layers and max(rows) <= 18
    kvslim.restore(model)
