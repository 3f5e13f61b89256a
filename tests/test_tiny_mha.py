"""The shipped tiny MHA model: loads offline, is MHA, has learned Python, and generates."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from kvslim.models.tiny_mha import load_tiny_mha, tiny_mha_path

# Held-out Python written for this test (not from the stdlib the model was trained on).
SNIPPET = '''\
def merge_intervals(intervals, gap=0):
    """Merge overlapping intervals.

    Two intervals are merged when they overlap or when the space between
    them is at most ``gap``. The result is sorted by start position.
    """
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda item: item[0])
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = merged[-1]
        if start <= last[1] + gap:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return [tuple(item) for item in merged]


class Counter:
    """Count how often each key was seen."""

    def __init__(self, keys=None):
        self.counts = {}
        if keys is not None:
            for key in keys:
                self.add(key)

    def add(self, key, amount=1):
        if amount < 0:
            raise ValueError("amount must be non-negative")
        self.counts[key] = self.counts.get(key, 0) + amount
        return self.counts[key]

    def most_common(self, n=None):
        items = sorted(self.counts.items(), key=lambda kv: kv[1], reverse=True)
        if n is None:
            return items
        return items[:n]
'''


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_tiny_mha()


def test_files_present():
    path = tiny_mha_path()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"):
        assert (path / name).is_file(), name
    assert (path / "model.safetensors").stat().st_size < 20 * 2**20


def test_config_is_mha(tiny):
    model, tok = tiny
    cfg = model.config
    assert cfg.model_type == "llama"
    assert cfg.num_key_value_heads == cfg.num_attention_heads == 8
    assert cfg.hidden_size == 256 and cfg.num_hidden_layers == 4
    assert cfg.hidden_size // cfg.num_attention_heads == 32
    assert model.dtype == torch.float32
    assert tok.eos_token is not None and tok.pad_token is not None and tok.bos_token is not None
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert len(tok) == cfg.vocab_size


def test_heldout_perplexity(tiny):
    model, tok = tiny
    ids = tok(SNIPPET, return_tensors="pt").input_ids
    assert 200 < ids.shape[1] < 1024
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    ppl = math.exp(loss)
    uniform = model.config.vocab_size
    assert ppl < uniform / 20, f"perplexity {ppl:.1f} vs uniform {uniform}"


def test_greedy_generation_looks_like_python(tiny):
    model, tok = tiny
    ids = tok("def ", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)
    new = out[0, ids.shape[1]:]
    assert new.numel() >= 4
    text = tok.decode(out[0], skip_special_tokens=True)
    assert text.startswith("def ")
    assert text.isascii()
    # Something Python-ish: a call/def parenthesis, a colon, or "self".
    assert any(tok_ in text for tok_ in ("(", ":", "self")), repr(text)
