"""Tiny Hugging Face models built from configs (nothing downloads)."""

from __future__ import annotations

import os

# Triton kernels run on CPU tensors through Triton's interpreter; Triton reads this when it is first imported (its own
# @jit helpers such as tl.zeros are decorated then), and torch.compile imports it: set before any test module loads
os.environ.setdefault("TRITON_INTERPRET", "1")
# pytest-xdist (the README's command runs 2 workers on 2 cores): one intra-op thread per worker and per process a
# test starts, so that the workers do not oversubscribe the cores (set before torch is imported)
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              max_position_embeddings=512)


def tiny_model(kind: str, *, kv_heads: int = 2, seed: int = 0, dtype=torch.float32, **overrides):
    """A random-init tiny decoder of family ``kind`` (llama, mistral, qwen2, qwen2-mixed, phi3)."""
    torch.manual_seed(seed)
    kw = dict(COMMON, num_key_value_heads=kv_heads, **overrides)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kw))
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**{"sliding_window": 8, **kw}))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**{"sliding_window": 8, "use_sliding_window": True,
                                                "max_window_layers": 0, **kw}))
    elif kind == "qwen2-mixed":
        model = Qwen2ForCausalLM(Qwen2Config(**{"sliding_window": 8, "use_sliding_window": True,
                                                "max_window_layers": 1, **kw}))
    elif kind == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        model = Qwen3ForCausalLM(Qwen3Config(**{"head_dim": 16, **kw}))
    elif kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=64, n_layer=3, n_head=4, n_positions=512))
    elif kind == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        model = MixtralForCausalLM(MixtralConfig(**{"num_local_experts": 4, "num_experts_per_tok": 2,
                                                   "sliding_window": None, **kw}))
    elif kind == "phi3":
        model = Phi3ForCausalLM(Phi3Config(**{"pad_token_id": 0, **kw}))
    else:
        raise ValueError(kind)
    return model.to(dtype).eval()


def padded_batch(batch: int = 2, length: int = 12, vocab: int = 128, seed: int = 1):
    """Random prompts, left-padded: sequence b has b·3 padding tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for b in range(batch):
        mask[b, : 3 * b] = 0
        ids[b, : 3 * b] = 0
    return ids, mask


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one intra-op thread is faster than two fighting over a shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def no_grad():
    """The test runs under ``torch.no_grad()`` (as ``generate`` does: sparse decode steps only run without autograd)."""
    with torch.no_grad():
        yield


#: options of the calibration tests' int4 runs (small window: a 96-token text has coded keys)
CALIB_OPTS = dict(residual=32, sink=2, key_channel_group=16)


@pytest.fixture(scope="module")
def calib_model(one_thread):
    """The calibration tests' tiny model (llama, 2 KV heads, 3 layers, attention bias)."""
    return tiny_model("llama", kv_heads=2, num_hidden_layers=3, attention_bias=True)


@pytest.fixture(scope="module")
def calib_ids():
    """The calibration tests' text: 96 random token ids, (1, 96)."""
    return torch.randint(1, 128, (1, 96), generator=torch.Generator().manual_seed(3))


@pytest.fixture
def tiny():
    return tiny_model


@pytest.fixture
def kernel_dev() -> torch.device:
    """Where a Triton kernel test runs (tests/triton_aot.kernel_device): CUDA, or CPU tensors under
    ``TRITON_INTERPRET=1``, else a skip. gpu_check's stage 1 selects only tests that use it or ``cuda_dev``
    (tests/test_gpu_check.py checks)."""
    from triton_aot import kernel_device

    return kernel_device()


@pytest.fixture
def cuda_dev() -> torch.device:
    """A CUDA device, or a skip with the reason (CUDA graphs, the sync debug mode): kernel_device(cuda_only=True)."""
    from triton_aot import kernel_device

    return kernel_device(cuda_only=True)


def generate_eager_and_compiled(model, ids: torch.Tensor, new_tokens: int, max_length: int,
                                attention_mask: torch.Tensor | None = None):
    """``model.generate`` greedily, eagerly and then through HF's own compile path (``compile_config``, backend
    ``eager``, fullgraph, static shapes; on CPU ``_compile_all_devices``) with a capturable kvslim cache of
    ``max_length``. Returns (eager tokens, compiled tokens, dynamo's unique graph count, the cache)."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig, GenerationConfig

    import kvslim
    from kvslim.adapters.compat import CACHE_KW

    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    masked = {} if attention_mask is None else {"attention_mask": attention_mask}
    with torch.no_grad():
        eager = model.generate(ids, **kw, **masked)
        compile_config = CompileConfig(fullgraph=True, dynamic=False, backend="eager")
        compile_config._compile_all_devices = True
        cfg = GenerationConfig(compile_config=compile_config, **kw)
        cache = kvslim.make_cache(model, max_length=max_length, capturable=True)
        torch._dynamo.reset()
        counters.clear()
        got = model.generate(ids, generation_config=cfg, **masked, **{CACHE_KW: cache})
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    return eager, got, graphs, cache


def decode_greedy(model, step, cache, prompt: int, steps: int, batch: int = 2):
    """Eager prefill of a random prompt (``batch`` rows), then ``steps`` greedy single-token steps through ``step``
    (the model itself, or a compiled twin); returns (tokens (batch, steps), logits (batch, steps, vocab))."""
    from kvslim.adapters.compat import CACHE_KW

    ids = torch.randint(1, 128, (batch, prompt), generator=torch.Generator().manual_seed(0))
    toks, logits = [], []
    with torch.no_grad():
        tok = model(ids, use_cache=True, **{CACHE_KW: cache}).logits[:, -1:].argmax(-1)
        for i in range(steps):
            pos = torch.full((batch, 1), prompt + i, dtype=torch.long)
            out = step(tok, position_ids=pos, cache_position=pos[0], use_cache=True, **{CACHE_KW: cache}).logits
            tok = out[:, -1:].argmax(-1).clone()
            toks.append(tok)
            logits.append(out[:, -1].clone())
    return torch.cat(toks, dim=1), torch.stack(logits, dim=1)


def compile_static(model):
    """``torch.compile`` with dynamo's state and counters cleared first (backend eager, fullgraph, static shapes)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    return torch.compile(model, backend="eager", fullgraph=True, dynamic=False)


def unique_graphs() -> int:
    """Dynamo's unique graph count since :func:`compile_static`; resets dynamo afterwards."""
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    return graphs


def hide_packages_prelude(absent) -> str:
    """Python source that, run first in a subprocess, makes every top-level package in ``absent`` unimportable
    (``find_spec`` returns None for it), as on a machine that lacks them."""
    return (f"import sys\nABSENT = {tuple(absent)!r}\n"
            "class Hide:\n"
            "    def __init__(self, inner): self.inner = inner\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        return None if name.split('.')[0] in ABSENT else self.inner.find_spec(name, path, target)\n"
            "    def __getattr__(self, a): return getattr(self.inner, a)\n"
            "sys.meta_path[:] = [Hide(f) for f in sys.meta_path]\n")


def _one_step(step, cache, position: int):
    """One decode step of token 1 at ``position`` for both rows, through ``step`` (the model or a compiled twin)."""
    from kvslim.adapters.compat import CACHE_KW

    pos = torch.full((2, 1), position, dtype=torch.long)
    with torch.no_grad():
        return step(torch.ones(2, 1, dtype=torch.long), position_ids=pos, cache_position=pos[0], use_cache=True,
                    **{CACHE_KW: cache})


def graph_step_past_max_length(model, cache, prompt: int, steps: int, state=lambda store: store.tensors()):
    """Compiles ``model`` (:func:`compile_static`), fills the capturable ``cache`` to its ``max_length`` (an eager
    prefill of ``prompt`` tokens, then ``steps`` graph steps), then runs one graph step past it. Returns (layer 0,
    whether every tensor ``state(store)`` gives of layer 0's stores is unchanged by that step, dynamo's unique graph
    count)."""
    step = compile_static(model)
    decode_greedy(model, step, cache, prompt, steps)
    layer = cache.layers[0]
    before = [t.clone() for s in layer._stores() for t in state(s)]
    _one_step(step, cache, prompt + steps)
    graphs = unique_graphs()
    after = [t for s in layer._stores() for t in state(s)]
    return layer, all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), graphs


def eager_step_past_max_length_is_refused(model, cache, position: int) -> bool:
    """An eager step at ``position`` (the capturable ``cache``'s ``max_length``) raises ValueError naming
    ``max_length``; returns whether layer 0's key store is unchanged."""
    store = cache.layers[0].k_store
    kept = [t.clone() for t in store.tensors()]
    with pytest.raises(ValueError, match=f"max_length={position}"):
        _one_step(model, cache, position)
    return all(torch.equal(a, b) for a, b in zip(kept, store.tensors(), strict=True))


def assert_static_fused_step_matches_unfused(layer, head_dim: int, capacity: int = 48, position: int = 30):
    """One more single-token update of a capturable quantized ``layer`` (batch 2, 2 KV heads); the fused handle its
    keys carry (whole buffer with ``columns``) attends (4 query heads, causal at ``position`` over ``capacity``
    columns) as its unfused reads do. Returns the handle for the caller's own checks."""
    from tolerances import assert_rel_close

    from kvslim.attention import quant
    from kvslim.caches import fused

    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 2, 1, head_dim, generator=g), torch.randn(2, 2, 1, head_dim, generator=g)
    with torch.no_grad():
        km, _ = layer.update(k, v)
    h = fused.fused_of(km)
    assert h is not None and h.columns is not None and h.lengths is not None
    q = torch.randn(2, 4, 1, head_dim, generator=g)
    mask = torch.zeros(1, 1, 1, capacity).masked_fill_(torch.arange(capacity) > position, float("-inf"))
    got = quant.decode(h, q, mask, None)
    assert got is not None
    assert_rel_close(got, quant.reference(h, q, mask, None), torch.float32, "fused vs unfused static reads")
    return h
