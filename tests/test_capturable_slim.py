"""Slim attention's caches made capturable (issue 33, caches/slim.py on caches/capture.py): with ``max_length`` the
K-/V-/X-rows live in a fixed buffer, the stored length on the device, and a decode step reads the whole buffer
(HF's whole-buffer mask; the slim kernels get ``lengths``). Under ``torch.compile(fullgraph=True, dynamic=False)``
(CPU: ``backend="eager"``, tracing and guards without code generation) each variant compiles once and decodes 64
steps with the greedy tokens of the ordinary eager cache, fp32 logits within the summation-order tolerance
(tests/tolerances.py); a Whisper decoder (X-cache self-attention, E shared by cross-attention) too. Past
``max_length``: an ordinary cache grows eagerly, a capturable one refuses an eager step by name with nothing written,
a graph step writes nothing and the next host call raises naming ``max_length``."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import compile_static as _compiled
from conftest import (
    decode_greedy,
    eager_step_past_max_length_is_refused,
    generate_eager_and_compiled,
    graph_step_past_max_length,
    padded_batch,
    tiny_model,
)
from conftest import unique_graphs as _graphs
from tolerances import assert_rel_close
from torch._dynamo.utils import counters

import kvslim
from kvslim.adapters.compat import CACHE_KW
from kvslim.caches.slim import SlimLayer

STEPS = 64
PROMPT = 24
#: model family and slim options: the K-cache through the C++ option-2 op (RoPE raw); int8 rows stored rotated
#: through the torch path; GPT-2's X-cache through the encdec op
CASES = {"k": ("llama", dict(cache="k", rank=0)),
         "k-int8-rotated-torch": ("llama", dict(cache="k", rank=0, bits=8, group_size=16, rope_storage="rotated",
                                                kernel="torch")),
         "x-gpt2": ("gpt2", dict(cache="x"))}

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(kind: str = "llama", **opts):
    model = tiny_model(kind, kv_heads=4, num_hidden_layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # random weights: slim's measured error warns
        kvslim.apply(model, "slim", **(opts or CASES["k"][1]))
    return model


def _decode(model, step, cache, prompt: int = PROMPT, steps: int = STEPS):
    return decode_greedy(model, step, cache, prompt, steps)




@pytest.mark.parametrize("case", list(CASES))
def test_slim_compiles_once_and_decodes_64_steps_with_eager_tokens(case):
    kind, opts = CASES[case]
    model = _model(kind, **opts)
    ordinary = kvslim.make_cache(model)  # grows; Python-int length
    eager, eager_logits = _decode(model, model, ordinary)
    cache = kvslim.make_cache(model, max_length=PROMPT + STEPS + 8, capturable=True)
    assert cache.is_compileable is True and all(isinstance(layer, SlimLayer) for layer in cache.layers)
    got, logits = _decode(model, _compiled(model), cache)
    graphs = _graphs()
    assert graphs == 1, f"{case}: {graphs} graphs over {STEPS} steps ({dict(counters['recompiles'])})"
    assert torch.equal(eager, got)
    assert_rel_close(logits, eager_logits, torch.float32, f"{case}: compiled capturable vs eager")
    assert cache.get_seq_length() == PROMPT + STEPS  # read back once after the graph steps
    layer = cache.layers[0]
    assert int(layer.length_t[0]) == PROMPT + STEPS and not bool(layer.overflow)
    assert cache.nbytes == ordinary.nbytes  # the same rows held
    cache.check_finite()  # no position jump, no overflow


def test_hf_generate_compile_path_with_a_left_padded_batch():
    """``model.generate`` with HF's compile path and a capturable slim cache, on a left-padded batch (shifted RoPE
    positions per sequence, a padding mask over the whole buffer): one graph, eager generation's tokens."""
    model = _model()
    ids, mask = padded_batch(2, 12)
    eager, got, graphs, cache = generate_eager_and_compiled(model, ids, 24, 12 + 32, attention_mask=mask)
    assert torch.equal(eager, got)
    assert graphs == 1, f"{graphs} graphs for 23 compiled decode steps"
    assert cache.layers[0].shifted  # the padded sequence's keys are rotated at their own positions


def test_graph_step_past_max_length_is_refused_by_name_and_writes_nothing():
    model = _model()
    cache = kvslim.make_cache(model, max_length=PROMPT + 3, capturable=True)
    # fills the cache to max_length, then one graph step past it
    layer, unchanged, graphs = graph_step_past_max_length(model, cache, PROMPT, 3)
    assert unchanged
    assert int(layer.length_t[0]) == PROMPT + 3 and graphs == 1
    with pytest.raises(ValueError, match=f"max_length={PROMPT + 3}"):
        cache.check_finite()
    with pytest.raises(ValueError, match=f"max_length={PROMPT + 3}"):  # every eager call until reset
        cache.get_seq_length()
    cache.reset()
    assert cache.get_seq_length() == 0


def test_capturable_slim_refuses_an_eager_step_past_max_length_by_name():
    model = _model()
    cache = kvslim.make_cache(model, max_length=PROMPT + 2, capturable=True)
    _decode(model, model, cache, steps=2)
    assert eager_step_past_max_length_is_refused(model, cache, PROMPT + 2)
    assert cache.get_seq_length() == PROMPT + 2


def test_ordinary_slim_cache_past_max_length_grows_with_unchanged_tokens():
    model = _model()
    short = _decode(model, model, kvslim.make_cache(model, max_length=PROMPT + 4), steps=12)
    grown = _decode(model, model, kvslim.make_cache(model), steps=12)
    assert torch.equal(short[0], grown[0]) and torch.equal(short[1], grown[1])


def _whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    cfg = WhisperConfig(vocab_size=100, num_mel_bins=16, d_model=64, encoder_layers=1, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                        decoder_ffn_dim=128, max_source_positions=16, max_target_positions=96, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, init_std=0.3)
    model = WhisperForConditionalGeneration(cfg).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kvslim.apply(model, "slim")
    return model


def _decode_whisper(model, step, cache, enc: torch.Tensor):
    ids = torch.tensor([[1, 5, 6, 7]]).expand(2, 4)
    toks, logits = [], []
    with torch.no_grad():
        out = model(encoder_outputs=(enc,), decoder_input_ids=ids, use_cache=True, **{CACHE_KW: cache})
        cache, tok = getattr(out, CACHE_KW), out.logits[:, -1:].argmax(-1)
        for i in range(STEPS):
            pos = torch.full((2, 1), 4 + i, dtype=torch.long)
            out = step(encoder_outputs=(enc,), decoder_input_ids=tok, decoder_position_ids=pos, use_cache=True,
                       **{CACHE_KW: cache})
            tok = out.logits[:, -1:].argmax(-1).clone()
            toks.append(tok)
            logits.append(out.logits[:, -1].clone())
    return torch.cat(toks, dim=1), torch.stack(logits, dim=1), cache


def test_whisper_slim_decoder_compiles_once_and_decodes_64_steps():
    """A tiny Whisper with ``slim`` (the planner's self-attention rows, E once for every cross-attention layer): the
    self-attention half is the capturable part (E has a fixed size once written)."""
    model = _whisper()
    enc = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(3))
    eager, eager_logits, _ = _decode_whisper(model, model, kvslim.make_cache(model), enc)
    cache = kvslim.make_cache(model, max_length=4 + STEPS + 4, capturable=True)
    assert cache.is_compileable is True
    got, logits, cache = _decode_whisper(model, _compiled(model), cache, enc)
    graphs = _graphs()
    assert graphs == 1, f"{graphs} graphs over {STEPS} steps ({dict(counters['recompiles'])})"
    assert torch.equal(eager, got)
    assert_rel_close(logits, eager_logits, torch.float32, "whisper compiled capturable vs eager")
    assert cache.self_attention_cache.get_seq_length() == 4 + STEPS


def test_stage_2_compiled_slim_row_fills_a_capturable_cache():
    """``kvslim bench``/gpu_check stage 2: the compiled slim row's cache is built ``capturable=True`` and filled
    through the layers' own writes (static path: rows at the device length)."""
    from kvslim.bench import cuda

    model = tiny_model("llama", kv_heads=4, num_hidden_layers=2)
    assert "slim" in cuda.CAPTURABLE
    cache = cuda.fill(model, "kvslim-slim", 2, 40, 8, capturable=True)
    try:
        assert cache.is_compileable is True
        assert int(cache.layers[0].length_t[0]) == cache.get_seq_length() == 40
    finally:
        kvslim.restore(model)
