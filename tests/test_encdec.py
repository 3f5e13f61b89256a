"""Slim attention on encoder-decoder models: shared encoder-output cross-attention, slim decoder self-attention.

Whisper, T5 (non-square e = 4d), BART built tiny from configs (nothing downloads).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tolerances import LOGIT_ATOL, assert_close, assert_error_ratio
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    MBartConfig,
    MBartForConditionalGeneration,
    T5Config,
    T5ForConditionalGeneration,
    WhisperConfig,
    WhisperForConditionalGeneration,
)

import kvslim
from kvslim.adapters.compat import CACHE_KW
from kvslim.attention.encdec import CrossWeights, reference_cross_attention, shared_cross_attention
from kvslim.caches.encdec import EncDecSlimCache, hf_cache_nbytes

torch.set_num_threads(1)
NEW = 33  # new tokens per generation (≥ 32)


def whisper(seed: int = 0, dtype=torch.float32, **kw) -> WhisperForConditionalGeneration:
    torch.manual_seed(seed)
    cfg = WhisperConfig(**{**dict(vocab_size=100, num_mel_bins=16, d_model=64, encoder_layers=2, decoder_layers=3,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                  decoder_ffn_dim=128, max_source_positions=32, max_target_positions=96,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                                  suppress_tokens=None, begin_suppress_tokens=None), **kw})
    return WhisperForConditionalGeneration(cfg).to(dtype).eval()


def t5(seed: int = 0, **kw) -> T5ForConditionalGeneration:
    torch.manual_seed(seed)  # T5-3B/11B-like aspect: e = h·d_kv = 8·32 = 256 = 4·d
    cfg = T5Config(**{**dict(vocab_size=100, d_model=64, d_kv=32, d_ff=128, num_layers=2, num_decoder_layers=2,
                             num_heads=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1), **kw})
    return T5ForConditionalGeneration(cfg).eval()


def bart(seed: int = 0) -> BartForConditionalGeneration:
    torch.manual_seed(seed)
    cfg = BartConfig(vocab_size=100, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=128)
    return BartForConditionalGeneration(cfg).eval()


def features(batch: int = 2, frames: int = 64, mels: int = 16, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(batch, mels, frames, generator=torch.Generator().manual_seed(3)).to(dtype)


def text_ids(batch: int = 2, length: int = 12) -> torch.Tensor:
    return torch.randint(3, 100, (batch, length), generator=torch.Generator().manual_seed(1))


GEN = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)


@torch.no_grad()
def teacher_forced(model, enc_kwargs: dict, tokens: torch.Tensor, cache) -> tuple[torch.Tensor, object]:
    """Logits (B, T-1, V) of step-by-step decoding of ``tokens`` with ``cache`` (None: HF's own)."""
    enc = model.get_encoder()(**enc_kwargs).last_hidden_state
    mask = enc_kwargs.get("attention_mask")
    out = []
    for t in range(tokens.shape[1] - 1):
        o = model(encoder_outputs=(enc,), attention_mask=mask, decoder_input_ids=tokens[:, t:t + 1],
                  **{CACHE_KW: cache}, use_cache=True)
        cache = o.past_key_values
        out.append(o.logits[:, -1])
    return torch.stack(out, 1), cache


# -- the math --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_shared_cross_attention_matches_reference(dtype):
    g = torch.Generator().manual_seed(0)
    b, h, t, dk, d, n = 2, 4, 3, 8, 24, 10  # e = 32 > d: any head layout works
    q = torch.randn(b, h, t, dk, generator=g, dtype=dtype)
    enc = torch.randn(b, n, d, generator=g, dtype=dtype)
    w_k, w_v = torch.randn(h * dk, d, generator=g, dtype=dtype), torch.randn(h * dk, d, generator=g, dtype=dtype)
    b_k, b_v = torch.randn(h * dk, generator=g, dtype=dtype), torch.randn(h * dk, generator=g, dtype=dtype)
    bias = torch.zeros(b, 1, t, n, dtype=torch.float32)
    bias[1, ..., :3] = torch.finfo(torch.float32).min  # padding of sequence 1
    w = CrossWeights.from_linear(w_k, w_v, b_v, h, 0.3, dtype)
    got = shared_cross_attention(q, enc, w, bias)
    ref = reference_cross_attention(q, enc, w_k, b_k, w_v, b_v, 0.3, bias)  # with the K bias: it drops out
    assert_close(got, ref, dtype, "shared-E cross attention vs K/V reference")


def test_shared_cross_attention_bf16_error_ratio():
    g = torch.Generator().manual_seed(1)
    b, h, t, dk, d, n = 2, 6, 1, 16, 96, 40
    q64, enc64 = torch.randn(b, h, t, dk, generator=g, dtype=torch.float64), torch.randn(b, n, d, generator=g,
                                                                                      dtype=torch.float64)
    w_k = torch.randn(h * dk, d, generator=g, dtype=torch.float64) / d ** 0.5
    w_v, b_v = torch.randn(h * dk, d, generator=g, dtype=torch.float64) / d ** 0.5, torch.randn(h * dk, generator=g,
                                                                                           dtype=torch.float64)
    ref64 = reference_cross_attention(q64, enc64, w_k, None, w_v, b_v, 0.25)
    bf = torch.bfloat16
    q, enc, wk, wv, bv = (z.to(bf) for z in (q64, enc64, w_k, w_v, b_v))
    # the plain path in bf16: K and V as HF's cache holds them (rounded to bf16), attention in bf16
    k = torch.nn.functional.linear(enc, wk).view(b, n, h, dk).transpose(1, 2)
    v = torch.nn.functional.linear(enc, wv, bv).view(b, n, h, dk).transpose(1, 2)
    base = torch.softmax((q @ k.transpose(-1, -2)).float() * 0.25, -1).to(bf) @ v
    opt = shared_cross_attention(q, enc, CrossWeights.from_linear(wk, wv, bv, h, 0.25, torch.float32))
    assert_error_ratio(opt, base, ref64, bf, "shared-E cross attention in bf16")


# -- Whisper ---------------------------------------------------------------------------------------------------
def test_whisper_generate_token_identical_fp32_and_bytes():
    m = whisper()
    x = features()
    with torch.no_grad():
        ref = m.generate(x, **GEN)
    ref_logits, hf_cache = teacher_forced(m, {"input_features": x}, ref, None)
    plan = kvslim.apply(m, "slim")
    assert {lp.technique for lp in plan.layers} <= {"slim-x", "slim-k", "slim-v"}
    with torch.no_grad():
        out = m.generate(x, **GEN)
    assert ref.shape[1] >= NEW and torch.equal(out, ref)
    logits, cache = teacher_forced(m, {"input_features": x}, ref, kvslim.make_cache(m))
    assert isinstance(cache, EncDecSlimCache)
    assert_close(logits, ref_logits, torch.float32, "whisper logits vs HF")
    assert (logits - ref_logits).abs().max() <= LOGIT_ATOL[torch.float32]
    n = cache.get_seq_length()
    assert cache.nbytes == plan.cache_bytes(n, batch=2)  # planner == measured
    assert hf_cache_nbytes(hf_cache) == plan.dense_bytes(n, batch=2)  # HF's EncoderDecoderCache, measured
    # E once: 32 frames × 64 (fp32) per sequence; HF: 3 layers × K+V of 32 frames × 64
    assert cache.cross_attention_cache.nbytes == 2 * 32 * 64 * 4
    assert hf_cache_nbytes(hf_cache.cross_attention_cache) == 2 * 3 * 2 * 32 * 64 * 4


@pytest.mark.parametrize("cache", ["k", "v"])
def test_whisper_forced_caches_exact(cache):
    m = whisper(seed=1)
    x = features(batch=1)
    gen = {**GEN, "max_new_tokens": 16, "min_new_tokens": 16}
    with torch.no_grad():
        ref = m.generate(x, **gen)
    plan = kvslim.apply(m, "slim", cache=cache)
    assert {lp.technique for lp in plan.layers} == {f"slim-{cache}"}
    with torch.no_grad():
        assert torch.equal(m.generate(x, **gen), ref)


def test_whisper_bf16_error_ratio():
    m32 = whisper(seed=2)
    x = features(batch=1)
    with torch.no_grad():
        tokens = m32.generate(x, **{**GEN, "max_new_tokens": 16, "min_new_tokens": 16})
    m64 = whisper(seed=2, dtype=torch.float64)
    ref64, _ = teacher_forced(m64, {"input_features": x.double()}, tokens, None)
    mbf = whisper(seed=2, dtype=torch.bfloat16)
    base, _ = teacher_forced(mbf, {"input_features": x.bfloat16()}, tokens, None)
    kvslim.apply(mbf, "slim")
    opt, _ = teacher_forced(mbf, {"input_features": x.bfloat16()}, tokens, kvslim.make_cache(mbf))
    assert_error_ratio(opt, base, ref64, torch.bfloat16, "whisper bf16 logits")


def _ill_condition(lin: torch.nn.Linear, cond: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    d = lin.weight.shape[1]
    u, _ = torch.linalg.qr(torch.randn(lin.weight.shape[0], d, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    s = torch.logspace(0, -torch.log10(torch.tensor(cond)).item(), d, dtype=torch.float64)
    with torch.no_grad():
        lin.weight.copy_((u * s) @ v.T * lin.weight.norm() / s.norm())


def test_ill_conditioned_w_k_gets_x_cache_and_stays_exact():
    m = whisper(seed=3)
    for i, layer in enumerate(m.model.decoder.layers):  # cond 1e9 like trained Whisper (up to 5e9 measured)
        _ill_condition(layer.self_attn.k_proj, 1e9, i)
        _ill_condition(layer.encoder_attn.k_proj, 1e9, 10 + i)
    x = features(batch=1)
    with torch.no_grad():
        ref = m.generate(x, **GEN)
    plan = kvslim.apply(m, "slim")
    assert all(lp.technique == "slim-x" for lp in plan.layers), [lp.technique for lp in plan.layers]
    assert all(float(lp.note.split("cond W_K ")[1].split(",")[0]) > 1e8 for lp in plan.layers)
    with torch.no_grad():
        assert torch.equal(m.generate(x, **GEN), ref)
    # the K-cache through W_K⁻¹ is measured far over budget in fp32, so it is not what the policy picks
    kvslim.restore(m)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a forced choice is stated in the plan, not warned about
        forced = kvslim.apply(m, "slim", cache="k", rank=0)
    assert all(lp.error > 1e-3 and lp.exactness.startswith("approximate (cache='k')") for lp in forced.layers)


def test_whisper_base_shape_ratio_config_only():
    """Whisper-base shapes (d 512, 8 heads, 6 decoder layers, 1500 frames): exact ratio against HF."""
    cfg = WhisperConfig(d_model=512, decoder_layers=6, encoder_layers=6, decoder_attention_heads=8,
                        encoder_attention_heads=8, max_source_positions=1500, max_target_positions=448)
    plan = kvslim.plan_config(cfg, "slim", dtype="float32")
    n = 448
    ours = 1500 * 512 * 4 + 6 * n * 512 * 4
    hf = 6 * 2 * 512 * 4 * (1500 + n)
    assert plan.cache_bytes(n) == ours and plan.dense_bytes(n) == hf
    assert hf / ours == pytest.approx(5.58, abs=0.01)  # full context; cross-attention alone: 12×
    assert plan.dense_fixed_bytes / plan.layers[0].fixed_bytes == 12


# -- T5 (non-square) and BART ----------------------------------------------------------------------------------
@pytest.mark.parametrize("cache,technique,self_bytes", [("auto", "slim-x", 64 * 4), ("k", "slim-k", 256 * 4)])
def test_t5_nonsquare_token_identical_and_bytes(cache, technique, self_bytes):
    m = t5()
    ids = text_ids()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # padding in the encoder input
    with torch.no_grad():
        ref = m.generate(ids, attention_mask=mask, **GEN)
    ref_logits, hf_cache = teacher_forced(m, {"input_ids": ids, "attention_mask": mask}, ref, None)
    plan = kvslim.apply(m, "slim", cache=cache, encoder_length=ids.shape[1])
    assert {lp.technique for lp in plan.layers} == {technique}
    assert all(lp.bytes_per_token == self_bytes for lp in plan.layers)
    assert any("right inverse" in note and "X-cache" in note for note in plan.notes)  # both options side by side
    with torch.no_grad():
        assert torch.equal(m.generate(ids, attention_mask=mask, **GEN), ref)
    logits, cache_obj = teacher_forced(m, {"input_ids": ids, "attention_mask": mask}, ref, kvslim.make_cache(m))
    assert (logits - ref_logits).abs().max() <= LOGIT_ATOL[torch.float32]
    n = cache_obj.get_seq_length()
    assert cache_obj.nbytes == plan.cache_bytes(n, batch=2)
    assert hf_cache_nbytes(hf_cache) == plan.dense_bytes(n, batch=2)
    # self-attention: X-cache 2r = 8× smaller than K+V, right-inverse K-cache 2×
    assert plan.dense_bytes_per_token / self_bytes == (8 if cache == "auto" else 2)


def test_t5_beam_search_and_bart_generate_exact():
    for model, ids in ((t5(seed=4), text_ids()), (bart(seed=4), text_ids())):
        gen = {**GEN, "max_new_tokens": 12, "min_new_tokens": 12}
        with torch.no_grad():
            greedy, beams = model.generate(ids, **gen), model.generate(ids, num_beams=2, **gen)
        kvslim.apply(model, "slim")
        with torch.no_grad():
            assert torch.equal(model.generate(ids, **gen), greedy)
            assert torch.equal(model.generate(ids, num_beams=2, **gen), beams)


def test_cross_kv_option_and_restore():
    m = bart(seed=5)
    ids = text_ids()
    gen = {**GEN, "max_new_tokens": 8, "min_new_tokens": 8}
    with torch.no_grad():
        ref = m.generate(ids, **gen)
    plan = kvslim.apply(m, "slim", cross="kv", encoder_length=ids.shape[1])
    _, cache = teacher_forced(m, {"input_ids": ids}, ref, kvslim.make_cache(m))
    assert cache.nbytes == plan.cache_bytes(cache.get_seq_length(), batch=2)
    with torch.no_grad():
        assert torch.equal(m.generate(ids, **gen), ref)
    kvslim.restore(m)
    assert not any(hasattr(mod, "_kvslim_original_forward") for mod in m.modules())
    with torch.no_grad():
        assert torch.equal(m.generate(ids, **gen), ref)


# -- bad input -------------------------------------------------------------------------------------------------
def _untouched(model) -> bool:
    return "generate" not in vars(model) and not any(hasattr(x, "_kvslim_original_forward") for x in model.modules())


@pytest.mark.parametrize("options,match", [
    ({"rope_storage": "raw"}, "no RoPE"), ({"bits": 8}, "quantized"), ({"cache": "z"}, "cache must be"),
    ({"cross": "x"}, "cross must be"), ({"colour": 1}, "unknown option"), ({"encoder_length": 0}, "encoder_length"),
])
def test_bad_options_raise_and_change_nothing(options, match):
    m = whisper()
    with pytest.raises(ValueError, match=match):
        kvslim.apply(m, "slim", **options)
    assert _untouched(m)


def test_bad_architectures_raise():
    torch.manual_seed(0)
    mb = MBartForConditionalGeneration(MBartConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1,
                                                   encoder_attention_heads=2, decoder_attention_heads=2,
                                                   encoder_ffn_dim=32, decoder_ffn_dim=32)).eval()
    with pytest.raises(ValueError, match="mbart"):
        kvslim.apply(mb, "slim")
    assert _untouched(mb)
    narrow = t5(d_kv=4)  # e = 8·4 = 32 < d = 64: K cannot rebuild the input
    with pytest.raises(ValueError, match="h·dk = 32"):
        kvslim.apply(narrow, "slim", cache="k")
    assert _untouched(narrow)
    from transformers import LlamaConfig  # an X-cache where RoPE sits between projection and dot product

    with pytest.raises(ValueError, match="RoPE"):
        kvslim.plan_config(LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2), "slim", cache="x")
