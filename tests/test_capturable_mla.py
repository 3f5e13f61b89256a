"""MLA latent caches made capturable (issue 33, caches/latent.py on caches/capture.py): with ``max_length`` the
latent ``c_kv`` and ``k_pe`` live in fixed buffers with the length on the device; a decode step reads the whole
buffer under HF's whole-buffer mask (or, where HF skipped it, the causal mask over the buffer), and the MLA op gets
``lengths``. Under ``torch.compile(fullgraph=True, dynamic=False)`` (CPU: ``backend="eager"``) each variant compiles
once and decodes 64 steps with the ordinary eager cache's greedy tokens, fp32 logits within the summation-order
tolerance (tests/tolerances.py). Past ``max_length``: as every capturable layer (tests/test_capturable.py)."""

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
)
from conftest import unique_graphs as _graphs
from test_mla_model import deepseek
from tolerances import assert_rel_close
from torch._dynamo.utils import counters

import kvslim
from kvslim.caches.latent import LatentLayer

STEPS = 64
PROMPT = 24
#: the V2-Lite shape (no query compression, YaRN) with the default elided path; V3 (interleaved RoPE) with int8
#: latents through the absorbed path
CASES = {"v2-lite-elided": ("v2-lite", {}), "v3-absorbed-int8": ("v3", dict(impl="absorbed", bits=8, group_size=16))}

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(name: str = "v2-lite", **opts):
    model = deepseek(name, num_hidden_layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kvslim.apply(model, "mla", **opts)
    return model


def _decode(model, step, cache, steps: int = STEPS):
    return decode_greedy(model, step, cache, PROMPT, steps)




@pytest.mark.parametrize("case", list(CASES))
def test_mla_compiles_once_and_decodes_64_steps_with_eager_tokens(case):
    name, opts = CASES[case]
    model = _model(name, **opts)
    ordinary = kvslim.make_cache(model)
    eager, eager_logits = _decode(model, model, ordinary)
    cache = kvslim.make_cache(model, max_length=PROMPT + STEPS + 8, capturable=True)
    assert cache.is_compileable is True and all(isinstance(layer, LatentLayer) for layer in cache.layers)
    got, logits = _decode(model, _compiled(model), cache)
    graphs = _graphs()
    assert graphs == 1, f"{case}: {graphs} graphs over {STEPS} steps ({dict(counters['recompiles'])})"
    assert torch.equal(eager, got)
    assert_rel_close(logits, eager_logits, torch.float32, f"{case}: compiled capturable vs eager")
    assert cache.get_seq_length() == PROMPT + STEPS and cache.nbytes == ordinary.nbytes


def test_a_capturable_prefill_without_hf_mask_is_causal_over_the_buffer():
    """HF may skip the causal mask of a prefill even for a compileable cache; the latent paths' own causal rule puts
    the queries at the end of the keys, which the whole buffer is not: the adapter builds the buffer's mask
    (without it the capturable cache's eager tokens were wrong)."""
    model = _model()
    eager = _decode(model, model, kvslim.make_cache(model), steps=4)
    got = _decode(model, model, kvslim.make_cache(model, max_length=PROMPT + 8, capturable=True), steps=4)
    assert torch.equal(eager[0], got[0])
    assert_rel_close(got[1], eager[1], torch.float32, "capturable eager vs ordinary")


def test_hf_generate_compile_path_with_a_capturable_latent_cache():
    model = _model()
    ids = torch.randint(1, 128, (2, PROMPT), generator=torch.Generator().manual_seed(3))
    eager, got, graphs, _ = generate_eager_and_compiled(model, ids, 24, PROMPT + 32)
    assert torch.equal(eager, got)
    assert graphs == 1, f"{graphs} graphs for 23 compiled decode steps"


def test_graph_step_past_max_length_is_refused_by_name_and_writes_nothing():
    model = _model()
    cache = kvslim.make_cache(model, max_length=PROMPT + 2, capturable=True)
    layer, unchanged, graphs = graph_step_past_max_length(model, cache, PROMPT, 2)
    assert unchanged and graphs == 1
    with pytest.raises(ValueError, match=f"max_length={PROMPT + 2}"):
        cache.get_seq_length()


def test_past_max_length_eagerly():
    """An ordinary latent cache grows (tokens unchanged); a capturable one refuses by name, nothing written."""
    model = _model()
    short = _decode(model, model, kvslim.make_cache(model, max_length=PROMPT + 4), steps=10)
    assert torch.equal(short[0], _decode(model, model, kvslim.make_cache(model), steps=10)[0])
    cache = kvslim.make_cache(model, max_length=PROMPT + 1, capturable=True)
    _decode(model, model, cache, steps=1)
    assert eager_step_past_max_length_is_refused(model, cache, PROMPT + 1)
    assert cache.get_seq_length() == PROMPT + 1
