"""Capturable layouts through the Triton decode kernels under Triton's interpreter: the int4/int2 defaults
(caches/capture_residual.py: ``lengths`` = the coded tokens, the sinks + ring window as the tail, a mask column per
row), turbo3 (the whole coded buffer masked by columns), slim rows and MLA latents (the whole buffer with
``lengths``), each with a padded batch: what a CUDA graph replays on a GPU. Greedy tokens equal the torch twin's and the eager ordinary cache's; logits within the fp32 table
(tests/tolerances.py)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported (tests/conftest.py sets it too)

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import tiny_model  # noqa: E402
from tolerances import assert_close  # noqa: E402

import kvslim  # noqa: E402
from kvslim.adapters.compat import CACHE_KW  # noqa: E402

tq = pytest.importorskip("kvslim.kernels.triton.quant_decode")
tl2 = pytest.importorskip("kvslim.kernels.triton.quant_decode_lowbit")
F32 = torch.float32
PROMPT, NEW = 20, 6
#: small windows (flushes within the 6 new tokens) with sinks; KIVI keys, rotated values, asymmetric codes
CASES = [("int4", tq, dict(residual=8, flush=4, key_channel_group=4, sink=2)),
         ("int2", tl2, dict(residual=8, flush=8, key_channel_group=8, sink=2))]


def _padded_prompt():
    ids = torch.randint(1, 128, (2, PROMPT), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a padded row: its mask columns go through the cache's columns
    return ids, mask


def _through_the_kernel(model, method, opts, module, monkeypatch, coded=None):
    """``generate`` with the ordinary eager cache (torch twin), then a capturable cache on the torch twin and on the
    Triton kernel (interpreter): every decode step of every layer through ``module.launch``, tokens equal, logits
    within the fp32 table. ``coded``: a check of each capturable cache after its run."""
    ids, mask = _padded_prompt()
    calls = []
    launch = module.launch
    monkeypatch.setattr(module, "launch", lambda *a, **k: calls.append(1) or launch(*a, **k))
    kvslim.apply(model, method, **opts)
    try:
        runs = {}
        for name, capturable in (("ordinary", False), ("torch", True), ("triton", True)):
            monkeypatch.setenv("KVSLIM_BACKEND", "torch" if name == "ordinary" else name)
            cache = kvslim.make_cache(model, max_length=PROMPT + NEW + 2, capturable=capturable)
            with torch.no_grad():
                runs[name] = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                                            do_sample=False, pad_token_id=0, output_logits=True,
                                            return_dict_in_generate=True, **{CACHE_KW: cache})
            if capturable and coded is not None:
                coded(cache)
    finally:
        kvslim.restore(model)
    layers = model.config.num_hidden_layers
    assert len(calls) == (NEW - 1) * layers, f"{method}: the Triton kernel ran {len(calls)} times"
    for name in ("torch", "ordinary"):
        assert torch.equal(runs["triton"].sequences, runs[name].sequences), f"{method}: tokens differ from {name}"
        for a, b in zip(runs["triton"].logits, runs[name].logits, strict=True):
            assert_close(a, b, F32, f"{method}: logits triton vs {name}")


def _flushed(cache):
    assert cache.layers[0].k_store.flushed > 0  # codes were read


@pytest.mark.parametrize("method,module,opts", CASES, ids=[c[0] for c in CASES])
def test_capturable_defaults_through_the_triton_kernels(method, module, opts, monkeypatch, one_thread):
    monkeypatch.setenv("KVSLIM_QUANT_SCORES", "exact")  # the twin's exact paths are the kernel's contract
    monkeypatch.setenv("KVSLIM_QUANT_VALUES", "exact")
    model = tiny_model("llama", kv_heads=1, hidden_size=256, num_attention_heads=4, num_hidden_layers=2,
                       attn_implementation="sdpa")
    _through_the_kernel(model, method, opts, module, monkeypatch, _flushed)


def test_capturable_turbo_through_the_triton_kernel(monkeypatch, one_thread):
    """Capturable turbo3 (caches/capture_residual.py with turbo codes: the whole coded buffer masked by columns, the
    window in the codes' basis as the tail, RoPE-centred keys' bias rows, 8 outlier channels of head dim 32) through
    the Triton turbo kernel with a padded batch; then the same decode compiled (dynamo, fullgraph, static shapes):
    the kernel's custom op traced once, the compiled tokens equal the eager ones."""
    from conftest import compile_static, decode_greedy, unique_graphs

    from kvslim.kernels.triton import turbo_decode as tt

    model = tiny_model("llama", num_hidden_layers=2, head_dim=32)
    opts = dict(residual=8, flush=4, sink=2, chunk=32)  # 32 coded slots: one block of the interpreted kernel
    _through_the_kernel(model, "turbo3", opts, tt, monkeypatch, _flushed)
    kvslim.apply(model, "turbo3", **opts)
    monkeypatch.setenv("KVSLIM_BACKEND", "triton")
    eager = decode_greedy(model, model, kvslim.make_cache(model, max_length=PROMPT + 8, capturable=True), PROMPT, 4)
    got = decode_greedy(model, compile_static(model), kvslim.make_cache(model, max_length=PROMPT + 8,
                                                                        capturable=True), PROMPT, 4)
    assert unique_graphs() == 1
    assert torch.equal(eager[0], got[0])
    assert_close(got[1], eager[1], F32, "turbo3 through Triton: compiled vs eager")


def test_capturable_slim_through_the_triton_kernel(monkeypatch, one_thread):
    """A capturable slim K-cache (caches/slim.py: the whole buffer with ``lengths``) through the Triton slim kernel
    with a left-padded batch (RoPE shifted per sequence)."""
    from kvslim.kernels.triton import slim_decode as ts

    _through_the_kernel(tiny_model("llama", kv_heads=4, num_hidden_layers=2), "slim", dict(cache="k", rank=0), ts,
                        monkeypatch)


def test_capturable_mla_through_the_triton_kernel(monkeypatch, one_thread):
    """A capturable MLA latent cache (caches/latent.py: the whole buffer with ``lengths``) through the Triton MLA
    decode kernel with a left-padded batch."""
    from test_mla_model import deepseek

    from kvslim.kernels.triton import mla_decode as tk

    _through_the_kernel(deepseek("v2-lite", num_hidden_layers=2), "mla", {}, tk, monkeypatch)
