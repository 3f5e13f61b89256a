"""Issue 28's library defects: a pickled cache that could not continue ``generate``, ``dense`` keeping more than
HF on sliding-window layers, internal errors on wrong model objects, and validation gaps of cache updates.
Tiny random models built from configs; each test failed before its fix."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from conftest import tiny_model
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

import kvslim
from kvslim.adapters.compat import CACHE_KW
from kvslim.caches import fused
from kvslim.caches.base import KVStoreLayer
from kvslim.caches.dense import AppendLayer
from kvslim.caches.storage import StoreSpec
from kvslim.caches.stores import make_store
from kvslim.caches.window import RingLayer
from kvslim.methods import METHODS

pytestmark = pytest.mark.usefixtures("one_thread")


def _gen(model, ids, new, cache=None, **kw):
    extra = {} if cache is None else {CACHE_KW: cache}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                              pad_token_id=0, **extra, **kw)


def _ids(n, seed=1, vocab=120):
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


# -- 1. a pickled cache continues generate ----------------------------------------------------------------------------
#: methods × options small enough that the tiny prompt reaches every part of the format (codes, residual window,
#: sinks); int4's defaults are kept once (a 124-token full-precision window behind 4 sinks: all the tail)
PICKLED = {"int4": {"residual": 8, "key_channel_group": 8}, "int4-defaults": {}, "int8": {},
           "int2": {"residual": 8, "key_channel_group": 8}, "window": {"window": 12}, "slim": {}, "dense": {},
           "turbo3": {"residual": 8, "outliers": 8, "rotation": "orthogonal"}}


@pytest.mark.parametrize("name", sorted(PICKLED))
def test_unpickled_cache_continues_generate_as_the_original(name):
    """Generate, pickle the cache, continue from the original and from the unpickled copy: the same tokens (an
    int4 cache's unpickled sink store read a stale copy of its full-precision window on fused decode steps)."""
    model = tiny_model("llama", kv_heads=4)
    kvslim.apply(model, name.split("-")[0], **PICKLED[name])
    ids = _ids(20)
    first = _gen(model, ids, 6, return_dict_in_generate=True)
    blob = pickle.dumps(first.past_key_values)
    twin = pickle.loads(blob)
    nxt = torch.cat((first.sequences, _ids(2, seed=2)), 1)
    ref = _gen(model, nxt, 8, first.past_key_values)  # the uninterrupted cache
    got = _gen(model, nxt, 8, twin)
    assert torch.equal(got, ref), f"{name}: continuing from the unpickled cache\n{got.tolist()}\n{ref.tolist()}"
    assert twin.nbytes == first.past_key_values.nbytes


def test_unpickled_sink_store_keeps_one_full_precision_tail():
    """The sink store's window is a view of its one full-precision buffer (sinks then window, what a fused decode
    step hands attention as its tail); after pickle and more writes the tail still equals the tokens read back."""
    spec = StoreSpec(4, 16, asymmetric=True, channel_group=8, residual=8, flush=8, sink=4)
    x = torch.randn(1, 2, 30, 16, generator=torch.Generator().manual_seed(0))
    store = make_store(spec, x, 32)
    store.write(0, x[:, :, :17])
    twin = pickle.loads(pickle.dumps(store))
    assert twin.inner.fp.untyped_storage().data_ptr() == twin.fp.untyped_storage().data_ptr()
    for s in (store, twin):
        for t in range(17, 21):
            s.write(t, x[:, :, t:t + 1])
    for s in (store, twin):
        h = fused.append_handle(s, s, 21, x[:, :, 20:21], x[:, :, 20:21], None)
        lead, f = h.lead, s.inner.flushed  # tail = [sinks | window]; window = tokens [sink + f, 21)
        assert torch.equal(h.k_tail[:, :, :lead], x[:, :, :lead])
        assert torch.equal(h.k_tail[:, :, lead:], x[:, :, spec.sink + f:21])
    assert torch.equal(twin.read(0, 21), store.read(0, 21))


def test_deepcopy_and_pickle_drop_derived_buffers():
    """Copies of a cache carry no scratch buffers and no rotated-tail copy keyed by an object id of the original."""
    model = tiny_model("llama", kv_heads=4)
    kvslim.apply(model, "int4", residual=8, key_channel_group=8)
    cache = _gen(model, _ids(20), 4, return_dict_in_generate=True).past_key_values
    for twin in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        layer = twin.layers[0]
        assert layer.scratch_pool.buffers == {}
        assert layer.k_store.rotated_copy is None and layer.v_store.rotated_copy is None


# -- 2. dense follows the model's own layer types ---------------------------------------------------------------------
def _gemma3():
    torch.manual_seed(0)
    return Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=128, intermediate_size=96, num_hidden_layers=3, max_position_embeddings=128, hidden_size=64,
        num_attention_heads=2, num_key_value_heads=1, head_dim=40, sliding_window=8, query_pre_attn_scalar=40,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])).eval()


SLIDING = {"gemma3": _gemma3, "mistral": lambda: tiny_model("mistral"),
           "qwen2-mixed": lambda: tiny_model("qwen2-mixed")}


def _hf_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


@pytest.mark.parametrize("family", sorted(SLIDING))
def test_dense_keeps_what_hf_keeps_on_sliding_layers(family):
    """``dense`` on a model with sliding-window layers: HF's tokens, and no more bytes than HF's own cache (the last
    W − 1 tokens on sliding layers, a ring); its plan says so and counts the same bytes."""
    model = SLIDING[family]()
    ids = _ids(20)
    ref = _gen(model, ids, 10, return_dict_in_generate=True)
    plan = kvslim.apply(model, "dense")
    out = _gen(model, ids, 10, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref.sequences)
    cache, n = out.past_key_values, out.sequences.shape[1] - 1  # the last token is never fed back
    sliding = [lp.index for lp in plan.layers if lp.attention == "sliding"]
    assert sliding and all(isinstance(cache.layers[i], RingLayer) for i in sliding)
    assert all(type(cache.layers[lp.index]) is AppendLayer for lp in plan.layers if lp.attention == "full")
    assert cache.nbytes <= _hf_bytes(ref.past_key_values)
    assert cache.nbytes == plan.cache_bytes(n) == plan.hf_bytes(n)
    for i in sliding:
        lp = plan.layers[i]
        assert (lp.technique, lp.window, lp.exactness) == ("dense+window", 8, "exact")
    assert "model's own window 8" in str(plan)


def test_dense_plan_from_the_config_alone_shows_the_window():
    """``kvslim plan`` (``plan_config``) shows the ring on the sliding layers, with HF's bytes."""
    config = _gemma3().config
    plan = kvslim.plan_config(config, "dense", "float32")
    assert [lp.window for lp in plan.layers] == [8, None, 8]
    assert plan.cache_bytes(4096) == plan.hf_bytes(4096) < plan.dense_bytes(4096)


# -- 3. wrong model objects -------------------------------------------------------------------------------------------
def test_apply_refuses_what_is_not_a_generation_model():
    model = tiny_model("llama")
    for bad, says in ((torch.nn.Linear(3, 3), "torch.nn.modules.linear.Linear"), (None, "got None"),
                      ("gpt2", "from_pretrained('gpt2')"), (model.model, "LlamaModel, a model without a generation")):
        with pytest.raises(ValueError, match="PreTrainedModel with a generation head") as e:
            kvslim.apply(bad, "int4")
        assert says in str(e.value)
        assert kvslim.get_plan(bad) is None
    assert kvslim.get_plan(model.model) is None and "_kvslim_attn_previous" not in vars(model.model)
    for bad in (None, torch.nn.Linear(3, 3), "gpt2"):
        with pytest.raises(ValueError, match="must be a transformers PreTrainedModel"):
            kvslim.make_cache(bad)
    assert isinstance(kvslim.make_cache(model.model), kvslim.KVSlimCache)  # a base model may still run a cache


# -- 4. validation gaps -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_bool_sizes_are_refused_by_name(method):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="group_size must be a positive int, got True"):
        kvslim.apply(model, method, group_size=True)
    with pytest.raises(ValueError, match="chunk must be a positive int, got True"):
        kvslim.apply(model, method, chunk=True)
    assert kvslim.get_plan(model) is None
    with pytest.raises(ValueError, match="group_size must be a positive int, got True"):
        StoreSpec(8, True)
    for bad in (True, False, 0, 2.0):
        with pytest.raises(ValueError, match="max_length must be a positive int or None"):
            kvslim.make_cache(model, max_length=bad)
    with pytest.raises(ValueError, match="max_length"):
        AppendLayer(max_length=True)


#: one layer of each storage family
LAYERS = {"dense": lambda: AppendLayer(), "int8": lambda: AppendLayer(StoreSpec(8, 8)),
          "int4": lambda: AppendLayer(StoreSpec(4, 8, asymmetric=True, channel_group=8, residual=8, flush=8, sink=2)),
          "window": lambda: RingLayer(6), "int8-window": lambda: RingLayer(6, StoreSpec(8, 8))}


def _state(layer: KVStoreLayer):
    """Everything a refused update must leave as it was."""
    stores = [[t.clone() for t in s.tensors()] + ([s.fp.clone()] if hasattr(s, "fp") else [])
              for s in layer._stores()]
    return layer.is_initialized, layer.cumulative_length, stores


def _same(a, b) -> bool:
    """Bit-for-bit (unwritten slots may hold NaN: compared as bytes)."""
    return a[:2] == b[:2] and all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                                  for sa, sb in zip(a[2], b[2]) for x, y in zip(sa, sb))


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_bad_updates_are_refused_by_name_and_change_nothing(kind):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 5, 16, generator=g)
    for first in (True, False):
        layer = LAYERS[kind]()
        if not first:
            layer.update(x, x)
        before = _state(layer)
        bad = {"an integer dtype": ((x * 10).long(), x, "key_states must be a floating-point tensor"),
               "integer values": (x, (x * 10).to(torch.int32), "value_states must be a floating-point tensor"),
               "no tokens": (x[:, :, :0], x[:, :, :0], "hold no tokens"),
               "a device mix": (x, x.to("meta"), "all tensors must be on one device"),
               "another device": (x.to("meta"), x.to("meta"), "holds its tensors on cpu")}
        for what, (k, v, says) in bad.items():
            if first and what == "another device":
                continue
            with pytest.raises(ValueError, match=says):
                layer.update(k, v)
            assert _same(_state(layer), before), f"{kind}: a refused update ({what}) changed the layer"
        layer.update(x, x)  # still works
        assert layer.get_seq_length() == 5 * (2 - first)


def test_cache_update_refuses_a_layer_index_out_of_range():
    model = tiny_model("llama")
    cache = kvslim.make_cache(model)
    x = torch.randn(1, 2, 3, 16)
    for bad in (99, 3, -1, True, "0"):
        with pytest.raises(ValueError, match=r"layer_idx must be an int in \[0, 3\)"):
            cache.update(x, x, bad)
    assert all(not layer.is_initialized for layer in cache.layers)
    cache.update(x, x, 2)
    assert cache.layers[2].get_seq_length() == 3


def test_methods_that_apply_are_still_named():
    """The hint moved from ``methods/base.py`` (which imported the registry: an import circle) to ``kvslim.apply``."""
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64))
    with pytest.raises(ValueError, match="model_type 'bert'.*methods that apply to bert: none"):
        kvslim.apply(model, "dense")
    assert "int4" in METHODS
