"""What the GPU machine's environment (torch 2.11, no C++ toolchain) found (issue 42), kept small and fast: each test
failed there on the old code. The full compiled paths run in test_capturable_slim.py, test_cuda_graphs.py and the
replica (scripts/gpu_env.sh)."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from conftest import tiny_model

import kvslim
from kvslim.adapters import generate
from kvslim.caches.fused import FusedKV
from kvslim.kernels import backend, build, quant_decode, quant_decode_lowbit, turbo_decode

pytestmark = pytest.mark.usefixtures("one_thread")


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="eager", fullgraph=True)


@torch.no_grad()
def test_patched_slim_attention_traces_with_fullgraph():
    """Failure 1: the first line of every slim attention call (the class forward bound to the module) must trace;
    torch 2.11's dynamo refused ``function.__get__``. A call without a slim cache runs that line, then HF's own
    forward."""
    model = tiny_model("llama", kv_heads=4, num_hidden_layers=1, attn_implementation="sdpa")
    kvslim.apply(model, "slim")
    try:
        attn = model.model.layers[0].self_attn
        x = torch.randn(1, 5, 64)
        pos = torch.arange(5)[None]
        emb = model.model.rotary_emb(x, pos)
        want = attn(x, position_embeddings=emb, attention_mask=None)[0]
        got = _compiled(lambda x: attn(x, position_embeddings=emb, attention_mask=None)[0])(x)
        torch.testing.assert_close(got, want)
    finally:
        kvslim.restore(model)
        torch._dynamo.reset()


@torch.no_grad()
def test_patched_whisper_attention_traces_with_fullgraph():
    """Failure 1 in ``adapters/encdec_patch.py``: Whisper-slim's self- and cross-attention patches."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=64, num_mel_bins=8, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=8,
        max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kvslim.apply(model, "slim")
    try:
        layer = model.model.decoder.layers[0]
        x, enc = torch.randn(2, 3, 32), torch.randn(2, 8, 32)
        for attn, kw in ((layer.self_attn, {}), (layer.encoder_attn, {"key_value_states": enc})):
            want = attn(x, **kw)[0]
            got = _compiled(lambda x, attn=attn, kw=kw: attn(x, **kw)[0])(x)
            torch.testing.assert_close(got, want)
    finally:
        kvslim.restore(model)
        torch._dynamo.reset()


@pytest.mark.parametrize("ring", [None, (0, 1)])
def test_fused_token_count_is_an_int_under_symbolic_shapes(ring):
    """Failure 2: ``FusedKV.tokens`` with a symbolic ``n`` (a growing cache under ``torch.compile``): torch 2.11
    refuses a SymInt minus a Python bool (``BooleanAtom not allowed in this context``)."""

    def f(x, tail):
        read = FusedKV(k=None, v=None, n=x.shape[0], k_tail=tail, v_tail=tail, materialize=None, ring=ring)
        return x.new_zeros(read.tokens)

    tail = torch.zeros(1, 1, 2, 4)
    for n in (5, 7):  # the second length makes n symbolic (automatic dynamic shapes)
        got = torch.compile(f, backend="eager", fullgraph=True, dynamic=True)(torch.zeros(n), tail)
        assert got.shape == (n - (ring is not None) + 2,)
    torch._dynamo.reset()


FAMILIES = (quant_decode, quant_decode_lowbit, turbo_decode)


@pytest.fixture
def no_toolchain(monkeypatch):
    """The C++ build made impossible (no compiler), with fresh memos for the test's duration (the process's own
    are put back after it): nothing is built or warned about before the test."""
    monkeypatch.delenv("KVSLIM_NO_KERNELS", raising=False)  # the replica sets it: the C++ build not tried at all
    monkeypatch.setattr(build, "_compiler", lambda: None)
    monkeypatch.setattr(build, "_warned", set())
    fresh = functools.cache(build.load_ops.__wrapped__)
    monkeypatch.setattr(build, "load_ops", fresh)
    for fam in FAMILIES:
        monkeypatch.setattr(fam, "load_ops", fresh)
        monkeypatch.setattr(fam, "available", functools.cache(fam.available.__wrapped__))


METHODS = {"int8": {}, "int4": {}, "int2": {}, "int3": {}, "turbo3": {}, "turbo2": {}}


def test_cuda_decode_needs_no_cpp_build(no_toolchain, monkeypatch):
    """Failure 4: with no C++ compiler, a cache for a model on CUDA still reads codes in the kernels (fused decode on)
    and each family's dispatch picks Triton for CUDA tensors; nothing is built or warned about. (CPU only: the
    model's device is what ``make_cache`` is told.)"""
    pytest.importorskip("triton")
    monkeypatch.delenv(backend.ENV, raising=False)
    monkeypatch.setattr(generate, "_device_type", lambda model: "cuda", raising=False)  # old code: no seam, CPU
    model = tiny_model("llama", kv_heads=2, num_hidden_layers=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for method, opts in METHODS.items():
            kvslim.apply(model, method, **opts)
            try:
                cache = kvslim.make_cache(model, max_length=64)
                assert all(layer.fused_decode for layer in cache.layers if hasattr(layer, "fused_decode")), method
                assert any(hasattr(layer, "fused_decode") for layer in cache.layers), method
            finally:
                kvslim.restore(model)
        picks = {quant_decode._backend("cuda"), quant_decode_lowbit._backend("cuda")}
    assert picks == {"triton"}
    assert backend.pick("cuda", cpp_available=False) == "triton"
    assert not [w for w in caught if "kvslim" in str(w.message)], [str(w.message) for w in caught]
    assert not build._warned


def test_missing_toolchain_is_reported_once_on_first_cpu_use(no_toolchain, monkeypatch):
    """On CPU the same cache falls back to the twins (fused decode off), with one warning for every family."""
    monkeypatch.delenv(backend.ENV, raising=False)
    model = tiny_model("llama", kv_heads=2, num_hidden_layers=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for method in ("int4", "int2", "turbo3"):
            kvslim.apply(model, method)
            try:
                cache = kvslim.make_cache(model, max_length=64)
                assert not any(getattr(layer, "fused_decode", False) for layer in cache.layers), method
            finally:
                kvslim.restore(model)
    msgs = [str(w.message) for w in caught if "C++" in str(w.message)]
    assert len(msgs) == 1 and "no C++ compiler" in msgs[0] and "Triton" in msgs[0], msgs


@pytest.mark.parametrize("forced", ["torch", "triton"])
def test_a_forced_backend_reads_the_codes_without_the_cpp_build(forced, no_toolchain, monkeypatch):
    """``KVSLIM_BACKEND`` set: decode steps hand the forced backend the codes (the twin, or Triton's interpreter on
    CPU tensors), with or without the C++ build: never a silent switch to the unfused reads."""
    if forced == "triton":
        pytest.importorskip("triton")
    monkeypatch.setenv(backend.ENV, forced)
    model = tiny_model("llama", kv_heads=2, num_hidden_layers=1)
    kvslim.apply(model, "int4")
    try:
        cache = kvslim.make_cache(model, max_length=64)
        assert all(layer.fused_decode for layer in cache.layers if hasattr(layer, "fused_decode"))
    finally:
        kvslim.restore(model)


def test_missing_ninja_is_reported_once(monkeypatch, tmp_path):
    """No ninja (a compiler present): the build is not tried, one warning for every family, the twin."""
    monkeypatch.setenv("KVSLIM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KVSLIM_NO_KERNELS", raising=False)
    monkeypatch.setattr(build, "_ninja", lambda: False)
    monkeypatch.setattr(build, "_compiler", lambda: "/usr/bin/g++")
    monkeypatch.setattr(build, "_warned", set())
    monkeypatch.setattr(build, "load_ops", functools.cache(build.load_ops.__wrapped__))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert build.load_ops("encdec_decode", ("-DKVSLIM_TEST_NO_NINJA",)) is False
        assert build.load_ops("slim_decode", ("-DKVSLIM_TEST_NO_NINJA",)) is False
    msgs = [str(w.message) for w in caught if "ninja" in str(w.message)]
    assert len(msgs) == 1, msgs


def test_model_device_type():
    assert generate._device_type(tiny_model("llama", num_hidden_layers=1)) == "cpu"


def test_interpreted_kernel_takes_loop_bounds_computed_in_the_kernel():
    """Failure 5: Triton 3.6's interpreter turned a kernel scalar into a loop bound with ``int(array)``, which
    NumPy >= 2.4 refuses; the int4 kernel's ``for s0 in range(start, end, BLOCK_N)`` (bounds from ``lengths``)
    failed. Interpreter only: the compiled kernels are the same."""
    pytest.importorskip("triton")
    if not backend.interpreting():
        pytest.skip("runs Triton's interpreter (TRITON_INTERPRET=1, as tests/conftest.py sets)")
    from kvslim.kernels.triton import quant_decode as tq
    from kvslim.ops.quant import quantize

    gen = torch.Generator().manual_seed(0)
    kc, ks = quantize(torch.randn(2, 1, 40, 64, generator=gen), 4, 32, torch.float32)
    vc, vs = quantize(torch.randn(2, 1, 40, 64, generator=gen), 4, 32, torch.float32)
    q = torch.randn(2, 1, 2, 64, generator=gen)
    args = (q, kc, ks, None, vc, vs, None, 4, 32, 0, 40, torch.tensor([40, 17]), None, None, None, 0.125)
    out, lse = tq.launch(*args, splits=2)
    ref, ref_lse = quant_decode.reference(*args, scores="exact", values="exact")
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
