"""Prompt caches as files (issue 44): ``kvslim.save_cache`` / ``load_cache`` round-trip every cache kind bitwise
(tokens and logits of the continued ``generate`` equal the never-saved cache's, CPU fp32), and bad input is refused
by name with nothing written and the file unchanged."""

from __future__ import annotations

import hashlib
import json
import os
import re

import pytest
import torch
from conftest import tiny_model

import kvslim
from kvslim.adapters.compat import CACHE_KW
from kvslim.prompt_cache import check_room, read_meta

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT, QUESTION, NEW = 100, 7, 6
#: (id, model kind, method, options, max_length, capturable): every cache layer kind of the tiny models
CASES = [
    ("dense", "llama", "dense", {}, None, False),
    ("dense-static", "llama", "dense", {}, 160, False),
    ("dense-capturable", "llama", "dense", {}, 160, True),
    ("int8", "llama", "int8", {}, None, False),
    ("int8-capturable", "llama", "int8", {}, 160, True),
    ("int4", "llama", "int4", {}, None, False),
    ("int4-small-window", "llama", "int4", {"residual": 32, "sink": 2, "key_channel_group": 16}, None, False),
    ("int4-capturable", "llama", "int4", {}, 160, True),
    ("int4-per-token", "llama", "int4", {"residual": 0, "sink": 0, "key_channel_group": 0}, None, False),
    ("int3", "llama", "int3", {}, None, False),
    ("int2", "llama", "int2", {"residual": 32, "sink": 2, "key_channel_group": 16}, None, False),
    ("turbo4", "llama", "turbo4", {}, None, False),
    ("turbo3", "llama", "turbo3", {"residual": 32}, None, False),
    ("turbo3-capturable", "llama", "turbo3", {}, 160, True),
    ("turbo2", "llama", "turbo2", {}, None, False),
    ("turbo3-head-dim-64", "llama-d64", "turbo3", {}, None, False),
    ("window-ring", "mistral", "window", {}, None, False),
    ("window-ring-capturable", "mistral", "window", {}, 160, True),
    ("int4-residual-ring", "mistral", "int4", {"residual": 4, "sink": 0, "key_channel_group": 4}, None, False),
    ("int8-mixed-rings", "qwen2-mixed", "int8", {}, None, False),
    ("slim", "llama-mha", "slim", {}, None, False),
    ("slim-static", "llama-mha", "slim", {}, 160, False),
    # sparse decode's page statistics (issue 43): the context (107+) is past the budget, so the steps read pages
    ("int4-sparse", "llama", "int4", {"residual": 32, "sink": 2, "key_channel_group": 16, "sparse_budget": 64,
                                      "sparse_page": 16, "sparse_dense_layers": 0}, None, False),
    ("turbo3-sparse", "llama", "turbo3", {"residual": 32, "sparse_budget": 64, "sparse_page": 16,
                                          "sparse_dense_layers": 0, "sparse_select": "prompt"}, None, False),
    # a list of layers read in full (kvslim.calibrate_sparse's), as the option is saved in the file
    ("int4-sparse-listed-layers", "llama", "int4", {"residual": 32, "sink": 2, "key_channel_group": 16,
                                                    "sparse_budget": 64, "sparse_page": 16, "sparse_dense_layers": [1]}, None,
     False),
]


def _model(kind: str, **kw):
    if kind == "llama-mha":
        return tiny_model("llama", kv_heads=4, **kw)
    if kind == "llama-d64":  # Qwen2.5's head dim: turbo's 48x48 / 64x64 rotations round by their layout
        return tiny_model("llama", hidden_size=256, num_attention_heads=4, **kw)
    return tiny_model(kind, **kw)


def _ids(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 128, (1, PROMPT), generator=g), torch.randint(1, 128, (1, QUESTION), generator=g)


def _prefill(model, ids, max_length=None, capturable=False):
    cache = kvslim.make_cache(model, max_length=max_length, capturable=capturable)
    with torch.no_grad():
        model(ids, use_cache=True, **{CACHE_KW: cache})
    return cache


def _generate(model, ids, cache):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=0, **{CACHE_KW: cache})


def _assert_same(want, got):
    assert torch.equal(want.sequences, got.sequences)
    assert len(want.logits) == len(got.logits)
    for a, b in zip(want.logits, got.logits):
        assert torch.equal(a, b)


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _saved(tmp_path, kind="llama", method="int4", name="doc.kvslim", **opts):
    model = _model(kind)
    kvslim.apply(model, method, **opts)
    ids, q = _ids()
    cache = _prefill(model, ids)
    return model, ids, q, cache, kvslim.save_cache(cache, tmp_path / name, model, ids)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_round_trip_continues_generate_bitwise(tmp_path, case):
    _, kind, method, options, max_length, capturable = case
    model = _model(kind)
    kvslim.apply(model, method, **options)
    ids, q = _ids()
    cache = _prefill(model, ids, max_length, capturable)
    path = kvslim.save_cache(cache, tmp_path / "p.kvslim", model, ids)
    digest = _sha(path)
    full = torch.cat([ids, q], dim=1)
    want = _generate(model, full, cache)
    loaded = kvslim.load_cache(path, model)
    assert torch.equal(loaded.token_ids, ids) and loaded.meta["method"] == method
    got = _generate(model, full, loaded.cache)
    _assert_same(want, got)
    assert _sha(path) == digest  # the question changed the loaded cache, never the file
    again = _generate(model, full, kvslim.load_cache(path, model).cache)
    _assert_same(want, again)


def test_state_keeps_layouts_views_and_shared_tensors():
    """``caches/state.py`` alone: a transposed tensor loads with its strides, a view stays a view of its base, one
    tensor held twice is one tensor, and a plain dict that looks like a node stays a dict."""
    from kvslim.caches.state import Decoder, Encoder

    base = torch.randn(2, 8, 4)
    q = torch.randn(6, 6).T.clone()  # strides (1, 6): column-major (as a QR factor), no _base
    held = {"qt": q, "win": base[:, 2:], "base": base, "again": q, "node": {"$": "tensor", "v": "x"}}
    enc = Encoder()
    tree = enc.encode(held, "held")
    back = Decoder(dict(enc.tensors)).decode(json.loads(json.dumps(tree)), "held")
    assert back["qt"].stride() == q.stride() and torch.equal(back["qt"], q)
    assert back["again"] is back["qt"] and torch.equal(back["base"], base)
    assert back["win"].data_ptr() == back["base"][:, 2:].data_ptr() and torch.equal(back["win"], base[:, 2:])
    assert back["node"] == {"$": "tensor", "v": "x"}


def test_mla_latent_round_trip(tmp_path):
    from test_mla_model import deepseek

    for impl, bits in (("absorbed", None), ("compressed", 4)):
        model = deepseek("v2-lite")
        kvslim.apply(model, "mla", impl=impl, **({"bits": bits, "group_size": 16} if bits else {}))
        ids, q = _ids()
        cache = _prefill(model, ids[:, :40])
        path = kvslim.save_cache(cache, tmp_path / "mla.kvslim", model, ids[:, :40])
        full = torch.cat([ids[:, :40], q], dim=1)
        want = _generate(model, full, cache)
        _assert_same(want, _generate(model, full, kvslim.load_cache(path, model).cache))


def test_whisper_encoder_output_cache_round_trip(tmp_path):
    """Whisper with slim: the encoder-output cache and the decoder's slim layers come back; teacher-forced logits
    of the continuation are bitwise those of the never-saved cache."""
    from test_whisper_generate import features, whisper

    model = whisper()
    kvslim.apply(model, "slim")
    x = features(batch=1)
    with torch.no_grad():
        enc = model.get_encoder()(x).last_hidden_state
        prefix = torch.tensor([[1, 5, 9, 12]])
        cache = kvslim.make_cache(model)
        model(encoder_outputs=(enc,), decoder_input_ids=prefix, **{CACHE_KW: cache}, use_cache=True)
        path = kvslim.save_cache(cache, tmp_path / "w.kvslim", model, prefix)
        loaded = kvslim.load_cache(path, model).cache
        outs = []
        for c in (cache, loaded):
            logits = [model(encoder_outputs=(enc,), decoder_input_ids=torch.tensor([[t]]), **{CACHE_KW: c},
                            use_cache=True).logits for t in (20, 21, 22)]
            outs.append(torch.cat(logits, dim=1))
    assert torch.equal(outs[0], outs[1])


def test_load_applies_the_files_method_to_a_fresh_model(tmp_path):
    model, ids, q, cache, path = _saved(tmp_path, method="int8")
    want = _generate(model, torch.cat([ids, q], 1), cache)
    fresh = tiny_model("llama")  # same weights (seed 0), no method applied
    loaded = kvslim.load_cache(path, fresh)
    assert kvslim.get_plan(fresh).method == "int8"
    _assert_same(want, _generate(fresh, torch.cat([ids, q], 1), loaded.cache))


def test_file_holds_only_filled_slots_and_its_metadata(tmp_path):
    model, ids, _, cache, path = _saved(tmp_path, method="dense")
    meta = read_meta(path)
    assert meta["tokens"] == PROMPT and meta["method"] == "dense" and meta["identity"]["k_norms"]
    # dense: K and V of 100 tokens, 3 layers, 2 heads x 16 fp32, plus the ids and a small header
    payload = 3 * 2 * PROMPT * 2 * 16 * 4 + PROMPT * 8
    assert payload < os.path.getsize(path) < payload + 16_384


# -- bad input ------------------------------------------------------------------------------------------------------
def test_file_for_another_config_is_refused(tmp_path):
    *_, path = _saved(tmp_path)
    other = tiny_model("llama", num_hidden_layers=2)
    with pytest.raises(ValueError, match=r"not this model .*config .*2 layers.*kvslim cache-prompt"):
        kvslim.load_cache(path, other)
    assert kvslim.get_plan(other) is None  # nothing changed


def test_file_for_other_weights_is_refused(tmp_path):
    *_, path = _saved(tmp_path)
    with pytest.raises(ValueError, match="layer 0 k_proj weights differ.*same architecture, other weights"):
        kvslim.load_cache(path, tiny_model("llama", seed=1))


def test_other_weights_without_k_proj_are_told_by_the_embedding(tmp_path):
    model = tiny_model("gpt2")  # GPT-2: fused c_attn, no k_proj norms; the embedding rows tell the weights apart
    kvslim.apply(model, "dense")
    ids, _ = _ids()
    path = kvslim.save_cache(_prefill(model, ids), tmp_path / "g.kvslim", model, ids)
    assert read_meta(path)["identity"]["k_norms"] is None
    torch.manual_seed(5)
    other = tiny_model("gpt2")
    with torch.no_grad():
        other.get_input_embeddings().weight.mul_(1.5)
    with pytest.raises(ValueError, match="input embedding weights differ"):
        kvslim.load_cache(path, other)


def test_file_for_another_dtype_or_method_is_refused(tmp_path):
    *_, path = _saved(tmp_path)
    with pytest.raises(ValueError, match="in float32, this model is in bfloat16"):
        kvslim.load_cache(path, tiny_model("llama", dtype=torch.bfloat16))
    model = tiny_model("llama")
    kvslim.apply(model, "int8")
    with pytest.raises(ValueError, match=r"a int4 cache .* runs int8 .*kvslim.restore\(model\)"):
        kvslim.load_cache(path, model)


def _rewrite(path, edit, digest: bool = True):
    """Rewrite the file with its metadata passed through ``edit``: a file another writer made (another layout or
    version, its digest valid), or with ``digest=False`` an edit of the header alone."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from kvslim.prompt_cache import _digest

    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
        meta = json.loads(f.metadata()["kvslim"])
    edit(meta)
    if digest:
        meta["digest"] = _digest(tensors, meta)
    save_file(tensors, str(path), metadata={"kvslim": json.dumps(meta)})


def test_unknown_format_version_is_refused(tmp_path):
    *_, path = _saved(tmp_path)
    _rewrite(path, lambda m: m.update(format="kvslim.prompt_cache/99"))
    with pytest.raises(ValueError, match=r"format 'kvslim.prompt_cache/99'.*reads 'kvslim.prompt_cache/2'"):
        kvslim.load_cache(path, tiny_model("llama"))


def test_another_cache_layout_is_refused(tmp_path):
    *_, path = _saved(tmp_path)

    def drop(meta):  # a layer state without an attribute this transformers/kvslim layer has
        meta["cache"]["v"]["layers"]["v"][1]["v"].pop("cumulative_length")
        meta["transformers"] = "4.99.0"

    _rewrite(path, drop)
    fresh = tiny_model("llama")
    with pytest.raises(ValueError, match=r"layer 1 .*lacks \['cumulative_length'\].*transformers 4.99.0.*another cache"):
        kvslim.load_cache(path, fresh)
    assert kvslim.get_plan(fresh) is None  # refused after the plan was made: still nothing applied
    *_, path2 = _saved(tmp_path, name="b.kvslim")
    _rewrite(path2, lambda m: m["cache"]["v"]["layers"]["v"][0].update(cls="kvslim.caches.dense:GoneLayer"))
    with pytest.raises(ValueError, match="no class 'GoneLayer'"):
        kvslim.load_cache(path2, tiny_model("llama"))
    *_, path3 = _saved(tmp_path, name="c.kvslim")
    _rewrite(path3, lambda m: m["cache"]["v"]["layers"]["v"][0].update(cls="os:system"))
    with pytest.raises(ValueError, match="not a kvslim cache class"):
        kvslim.load_cache(path3, tiny_model("llama"))


def test_truncated_and_corrupted_files_are_refused(tmp_path):
    *_, path = _saved(tmp_path)
    blob = path.read_bytes()
    cut = tmp_path / "cut.kvslim"
    cut.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(ValueError, match="not a readable kvslim prompt cache"):
        kvslim.load_cache(cut, tiny_model("llama"))
    flipped = bytearray(blob)
    flipped[-300] ^= 0x55  # a byte of tensor data
    bad = tmp_path / "bad.kvslim"
    bad.write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match="digest of its header and tensors differs"):
        kvslim.load_cache(bad, tiny_model("llama"))
    header = bytearray(blob)
    header[20] = ord("}")  # the JSON header
    (tmp_path / "hdr.kvslim").write_bytes(bytes(header))
    with pytest.raises(ValueError, match="not a readable kvslim prompt cache"):
        kvslim.load_cache(tmp_path / "hdr.kvslim", tiny_model("llama"))
    with pytest.raises(FileNotFoundError, match="no prompt cache file"):
        kvslim.load_cache(tmp_path / "missing.kvslim", tiny_model("llama"))


def test_foreign_safetensors_file_is_refused(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(3)}, str(tmp_path / "w.safetensors"))
    with pytest.raises(ValueError, match="not a kvslim prompt cache"):
        kvslim.load_cache(tmp_path / "w.safetensors", tiny_model("llama"))


@pytest.mark.parametrize("kind,method", [("llama", "dense"), ("mistral", "window"), ("llama", "slim")])
def test_non_finite_cache_is_refused_and_nothing_written(tmp_path, kind, method):
    model = _model("llama-mha" if method == "slim" else kind)
    kvslim.apply(model, method)
    ids, _ = _ids()
    cache = _prefill(model, ids[:, :5])
    cache.layers[1].k_store.data[0, 0, 3, 0] = float("nan")
    path = tmp_path / "doc.kvslim"
    path.write_bytes(b"old answer")
    with pytest.raises(ValueError, match="layer 1 holds a non-finite value"):
        kvslim.save_cache(cache, path, model, ids[:, :5])
    assert path.read_bytes() == b"old answer" and sorted(os.listdir(tmp_path)) == ["doc.kvslim"]


def test_nan_in_unused_slots_is_not_refused(tmp_path):
    model = tiny_model("llama")
    kvslim.apply(model, "dense")
    ids, q = _ids()
    cache = _prefill(model, ids)
    for layer in cache.layers:  # slots past the 100 tokens: never read, never written to the file
        layer.k_store.data[:, :, PROMPT:] = float("nan")
    path = kvslim.save_cache(cache, tmp_path / "p.kvslim", model, ids)
    want = _generate(model, torch.cat([ids, q], 1), cache)
    _assert_same(want, _generate(model, torch.cat([ids, q], 1), kvslim.load_cache(path, model).cache))


def test_bad_save_arguments(tmp_path):
    from transformers import DynamicCache

    model, ids, _, cache, _ = _saved(tmp_path)
    with pytest.raises(ValueError, match="cache must be a kvslim cache"):
        kvslim.save_cache(DynamicCache(), tmp_path / "x.kvslim", model, ids)
    with pytest.raises(ValueError, match="token_ids holds 99 tokens, the cache 100"):
        kvslim.save_cache(cache, tmp_path / "x.kvslim", model, ids[:, 1:])
    with pytest.raises(ValueError, match="token_ids holds 2 sequences, the cache 1"):  # was written: no model loads it
        kvslim.save_cache(cache, tmp_path / "x.kvslim", model, ids.repeat(2, 1))
    with pytest.raises(ValueError, match="no folder"):
        kvslim.save_cache(cache, tmp_path / "nope" / "x.kvslim", model, ids)
    with pytest.raises(ValueError, match="is a folder"):
        kvslim.save_cache(cache, tmp_path, model, ids)
    assert not (tmp_path / "x.kvslim").exists()


def test_question_beyond_the_models_positions_or_the_caches_max_length(tmp_path):
    model = tiny_model("llama", max_position_embeddings=110)
    kvslim.apply(model, "int4")
    ids, _ = _ids()
    path = kvslim.save_cache(_prefill(model, ids), tmp_path / "p.kvslim", model, ids)
    digest = _sha(path)
    loaded = kvslim.load_cache(path, model)
    check_room(loaded, model, 10)
    with pytest.raises(ValueError, match=r"100 tokens; 11 more .* max_position_embeddings \(110\): at most 10"):
        check_room(loaded, model, 11)
    for bad in (-5, 2.5, True, "3"):  # accepted silently before
        with pytest.raises(ValueError, match="new_tokens must be an int >= 0"):
            check_room(loaded, model, bad)
    model = tiny_model("llama")
    kvslim.apply(model, "dense")
    path = kvslim.save_cache(_prefill(model, ids, max_length=120), tmp_path / "s.kvslim", model, ids)
    with pytest.raises(ValueError, match=r"the cache's max_length \(120\): at most 20"):
        check_room(kvslim.load_cache(path, model), model, 21)
    assert _sha(tmp_path / "p.kvslim") == digest


def test_prompt_cache_generate_checks_the_prefix_and_a_used_cache(tmp_path):
    """``PromptCache.generate``: the same tokens as ``model.generate`` over the loaded cache; ids that do not start
    with the file's tokens, of another batch, or adding nothing are refused by name; a cache a previous call
    extended is refused (it gave wrong tokens silently)."""
    model = tiny_model("llama")
    kvslim.apply(model, "int4")
    ids, q = _ids()
    path = kvslim.save_cache(_prefill(model, ids), tmp_path / "p.kvslim", model, ids)
    ref = _generate(model, torch.cat((ids, q), 1), kvslim.load_cache(path, model).cache)
    loaded = kvslim.load_cache(path, model)
    with torch.no_grad():
        out = loaded.generate(model, torch.cat((ids, q), 1), max_new_tokens=NEW, min_new_tokens=NEW,
                              do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    assert torch.equal(out.sequences, ref.sequences)
    with pytest.raises(ValueError, match="previous generate extended it"):
        loaded.generate(model, torch.cat((ids, q), 1), max_new_tokens=2)
    fresh = kvslim.load_cache(path, model)
    other = ids.clone()
    other[0, 7] = (other[0, 7] + 1) % 128
    with pytest.raises(ValueError, match="differ from the prompt cache's tokens at position 7"):
        fresh.generate(model, torch.cat((other, q), 1), max_new_tokens=2, reuse_prefix=False)
    with pytest.raises(ValueError, match=r"input_ids must be \(1, more than"):
        fresh.generate(model, ids, max_new_tokens=2, reuse_prefix=False)
    with pytest.raises(ValueError, match=r"input_ids must be \(1, more than"):
        fresh.generate(model, torch.cat((ids, q), 1).repeat(2, 1), max_new_tokens=2, reuse_prefix=False)
    with pytest.raises(ValueError, match=r"input_ids must be \(1, at least 1 token\)"):
        fresh.generate(model, torch.cat((ids, q), 1).repeat(2, 1), max_new_tokens=2)
    assert fresh.cache.get_seq_length() == ids.shape[1]  # refused calls ran nothing
    kvslim.restore(model)


@pytest.mark.parametrize("method", ["turbo3", "turbo2", "int4"])
def test_loaded_cache_continues_bitwise_with_coded_rows_and_single_steps_first(tmp_path, method):
    """Head dim 64, a prompt long enough to have coded rows behind the full-precision window, then single-token
    steps straight after loading: logits bitwise the never-saved cache's (turbo2/turbo3 drifted 2-4e-7 from the
    second step: tensors read from the file sat unaligned in its buffer)."""
    model = tiny_model("llama", hidden_size=256, num_attention_heads=4)
    kvslim.apply(model, method)
    ids = torch.randint(1, 128, (1, 300), generator=torch.Generator().manual_seed(1))
    cache = _prefill(model, ids)
    path = kvslim.save_cache(cache, tmp_path / "p.kvslim", model, ids)
    loaded = kvslim.load_cache(path, model).cache

    def steps(c):
        out, tok = [], torch.tensor([[5]])
        with torch.no_grad():
            for _ in range(4):
                logits = model(tok, use_cache=True, **{CACHE_KW: c}).logits[0, -1]
                out.append(logits)
                tok = logits.argmax().view(1, 1)
        return out

    assert all(torch.equal(a, b) for a, b in zip(steps(cache), steps(loaded)))
    kvslim.restore(model)


def test_file_mode_follows_the_umask(tmp_path):
    """A prompt cache file gets the mode any new file gets (0644 under umask 022), also when it replaces one (it was
    0600 whatever the umask: replacing a shared file locked others out)."""
    import os
    import stat

    model, ids, _, cache, path = _saved(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~_umask()
    os.chmod(path, 0o644)
    kvslim.save_cache(cache, path, model, ids)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~_umask()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def _umask() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    return 0o022


@pytest.mark.parametrize("edit", ["flushed", "method"])
def test_an_edited_header_is_refused_before_anything_is_built(tmp_path, edit):
    """The digest covers the header: a one-digit edit of the state tree (it loaded, then failed mid-generate) or
    the method (int4 -> int8 applied int8 over an int4 cache) is refused as damaged, the model left unapplied."""
    *_, path = _saved(tmp_path)

    def change(meta):
        if edit == "method":
            meta["method"] = "int8"
            return
        text = json.dumps(meta["cache"])
        m = re.search(r'"flushed": (\d+)', text)
        meta["cache"] = json.loads(text[:m.start(1)] + str(int(m.group(1)) + 1) + text[m.end(1):])

    _rewrite(path, change, digest=False)
    fresh = tiny_model("llama")
    with pytest.raises(ValueError, match="digest of its header and tensors differs"):
        kvslim.load_cache(path, fresh)
    assert kvslim.get_plan(fresh) is None


def test_sizes_in_the_file_are_bounded_by_the_model(tmp_path):
    """A file (its digest valid: another writer's) whose max_length or token count is past the model's positions is
    refused before a cache of that size is built (it was allocated as asked)."""
    *_, path = _saved(tmp_path)
    _rewrite(path, lambda m: m.update(max_length=10 ** 12))
    fresh = tiny_model("llama")
    with pytest.raises(ValueError, match=r"max_length=1000000000000 in the file is beyond the model's"):
        kvslim.load_cache(path, fresh)
    assert kvslim.get_plan(fresh) is None


@pytest.mark.parametrize("method", ["dense", "int4"])
def test_prefix_reuse_trims_to_the_shared_tokens(tmp_path, method):
    """An edited document (tokens from position 60 on differ) and a question: ``PromptCache.generate`` trims the
    file's 100 tokens to the 60 shared ones and prefills the rest. Dense: the tokens of a fresh cache filled with
    the same 60 tokens first, logits within fp32 tolerance (the file's rows came from a 100-token call). A boundary
    token that re-tokenized differently (the file's last) reuses all but it; ids equal to the file's reuse all but
    the one fed."""
    from tolerances import assert_close

    model = tiny_model("llama")
    kvslim.apply(model, method)
    ids, q = _ids()
    path = kvslim.save_cache(_prefill(model, ids), tmp_path / "p.kvslim", model, ids)
    edited = torch.cat((ids[:, :60], torch.randint(1, 128, (1, 30), generator=torch.Generator().manual_seed(9)), q), 1)
    edited[0, 60] = (ids[0, 60] + 1) % 128  # differs right at 60
    loaded = kvslim.load_cache(path, model)
    assert loaded.common_prefix(edited) == 60
    got = loaded.generate(model, edited, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=0)
    assert loaded.cache.get_seq_length() == edited.shape[1] + NEW - 1
    if method == "dense":
        want = _generate(model, edited, _prefill(model, edited[:, :60]))
        assert torch.equal(got.sequences, want.sequences)
        for a, b in zip(got.logits, want.logits):
            assert_close(a, b, torch.float32, "reused prefix vs a fresh one")
    merged = torch.cat((ids[:, :-1], (ids[:, -1:] + 1) % 128, q), 1)
    assert kvslim.load_cache(path, model).common_prefix(merged) == PROMPT - 1
    assert kvslim.load_cache(path, model).common_prefix(ids) == PROMPT - 1
    assert kvslim.load_cache(path, model).common_prefix(torch.cat((ids, q), 1)) == PROMPT
    kvslim.restore(model)


def test_a_ring_cache_is_not_trimmed(tmp_path):
    """Ring-buffer layers cannot rewind past their window: a trim is refused by name and nothing changes."""
    model = tiny_model("llama")
    kvslim.apply(model, "window", window=16)
    ids, q = _ids()
    path = kvslim.save_cache(_prefill(model, ids), tmp_path / "w.kvslim", model, ids)
    loaded = kvslim.load_cache(path, model)
    edited = torch.cat((ids[:, :50], q), 1)
    with pytest.raises(ValueError, match="cannot be trimmed to 50 of its 100 tokens"):
        loaded.generate(model, edited, max_new_tokens=2)
    assert loaded.cache.get_seq_length() == PROMPT
    with pytest.raises(ValueError, match=r"tokens must be an int in \[0, 100\]"):
        loaded.trim(101)
    kvslim.restore(model)


@pytest.mark.parametrize("how", ["prompt_lookup", "assistant"])
def test_assisted_decoding_continues_a_prompt_cache_once(tmp_path, how):
    """transformers' assisted decoding fed its first verify step every id whatever the cache held: a prompt cache
    got its tokens a second time (299 cached + 300 ids -> 606 after 8 new). ``PromptCache.generate`` feeds the ids
    past the cache: the cache ends at the ids + new tokens − 1, with plain greedy's tokens over the same file."""
    model = tiny_model("llama")
    kvslim.apply(model, "int4")
    ids, q = _ids()
    ids = torch.cat([ids[:, :50]] * 2, 1)  # repeats: prompt lookup finds candidates
    path = kvslim.save_cache(_prefill(model, ids), tmp_path / "p.kvslim", model, ids)
    full = torch.cat((ids, q), 1)
    plain = kvslim.load_cache(path, model).generate(model, full, max_new_tokens=NEW, min_new_tokens=NEW,
                                                    do_sample=False, pad_token_id=0)
    loaded = kvslim.load_cache(path, model)
    extra = {"prompt_lookup_num_tokens": 3} if how == "prompt_lookup" else {"assistant_model": tiny_model("llama",
                                                                                                     seed=1)}
    out = loaded.generate(model, full, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0,
                          **extra)
    assert loaded.cache.get_seq_length() == full.shape[1] + NEW - 1
    assert torch.equal(out, plain)
    assert "prepare_inputs_for_generation" not in model.__dict__  # the class's own again
    kvslim.restore(model)


def test_each_layer_cache_loads_on_its_layers_device(tmp_path, monkeypatch):
    """A model split over devices (``device_map``): each cache layer's tensors load on its own layer's device (they
    all went to the first parameter's device). No second device here: ``layer_devices`` is read from a model whose
    layer 1 sits on ``meta``, and a load routed by it puts layer 1's tensors there and layer 0's on the CPU."""
    from kvslim import prompt_cache as pc

    model = tiny_model("llama")
    kvslim.apply(model, "int4")
    ids, _ = _ids()
    path = kvslim.save_cache(_prefill(model, ids), tmp_path / "p.kvslim", model, ids)
    split = tiny_model("llama")
    assert pc.layer_devices(split) is None  # one device: nothing to route
    split.model.layers[1].to("meta")
    devices = pc.layer_devices(split)
    assert [d.type for d in devices] == ["cpu", "meta"] + ["cpu"] * (len(devices) - 2)
    monkeypatch.setattr(pc, "layer_devices", lambda m: devices)  # the load itself needs readable weights
    loaded = kvslim.load_cache(path, model)
    for i, layer in enumerate(loaded.cache.layers):
        kinds = {t.device.type for store in layer._stores() for t in store.tensors()}
        assert kinds == {devices[i].type}, (i, kinds)
    kvslim.restore(model)
