"""The four MLA paths (kvslim.attention.mla) against the reference formula and each other, on raw tensors."""

from __future__ import annotations

import math

import pytest
import torch
from tolerances import ATOL, assert_close, assert_error_ratio, max_err

from kvslim.attention import mla

H, DK, DR, DV, DC = 4, 16, 8, 12, 32


pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs(b=2, s=3, t=7, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    kv_b = r(H * (DK + DV), DC) / math.sqrt(DC)
    x = dict(q_nope=r(b, H, s, DK), q_pe=r(b, H, s, DR), c_kv=r(b, t, DC), k_pe=r(b, t, DR))
    return {k: v.to(dtype) for k, v in x.items()}, kv_b


def _weights(kv_b, dtype, absorb_dtype=torch.float32):
    return mla.absorb(kv_b.to(dtype), H, DK, DV, scale=(DK + DR) ** -0.5 * 1.3, dtype=absorb_dtype)


def _reference(x, kv_b, mask=None):
    w64 = _weights(kv_b, torch.float64, torch.float64)
    return mla.attend_reference(*(v.double() for v in x.values()), w64, mask)


def _decompressed(x, w, mask=None):
    k, v = mla.expand(x["c_kv"], x["k_pe"], w)
    return mla.attend_dense(torch.cat((x["q_nope"], x["q_pe"]), dim=-1), k, v, w.scale, mask)


def _latent(fn):
    return lambda x, w, mask=None: fn(**x, w=w, mask=mask)


PATHS = {"decompressed": _decompressed, **{n: _latent(f) for n, f in mla.LATENT_PATHS.items()}}


def _masks(b, s, t):
    keep = torch.ones(b, 1, s, t, dtype=torch.bool)
    keep[..., t - s:] = torch.ones(s, s, dtype=torch.bool).tril()
    keep[1, ..., :2] = False  # sequence 1 is left-padded by two tokens
    additive = torch.zeros(b, 1, s, t).masked_fill(~keep, torch.finfo(torch.float32).min)
    return {"none": None, "bool": keep, "float": additive}


def test_reference_matches_textbook_loop():
    """The reference itself, against a per-head loop written from the paper's formulas (float64)."""
    x, kv_b = _inputs(b=1, s=2, t=5)
    w = _weights(kv_b, torch.float64, torch.float64)
    out = _reference(x, kv_b)
    wkv = kv_b.view(H, DK + DV, DC)
    for h in range(H):
        k = torch.cat((x["c_kv"][0] @ wkv[h, :DK].T, x["k_pe"][0]), dim=-1)  # (T, dk+dr)
        v = x["c_kv"][0] @ wkv[h, DK:].T  # (T, dv)
        q = torch.cat((x["q_nope"][0, h], x["q_pe"][0, h]), dim=-1)  # (S, dk+dr)
        sc = q @ k.T * w.scale
        sc[0, 4] = -math.inf  # query 0 sits at position 3: it cannot see position 4
        assert_close(out[0, h], torch.softmax(sc, -1) @ v, torch.float64, f"head {h}")


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
@pytest.mark.parametrize("impl", list(PATHS))
def test_paths_match_reference_fp64_and_fp32(impl, mask_kind):
    for dtype in (torch.float64, torch.float32):
        x, kv_b = _inputs(dtype=dtype)
        mask = _masks(2, 3, 7)[mask_kind]
        w = _weights(kv_b, dtype, torch.float64 if dtype == torch.float64 else torch.float32)
        out = PATHS[impl](x, w, mask)
        assert out.shape == (2, H, 3, DV) and out.dtype == dtype
        assert_close(out, _reference(x, kv_b, mask), dtype, f"{impl}/{mask_kind}/{dtype}")


@pytest.mark.parametrize("s,t", [(1, 9), (4, 4), (5, 12)])
def test_paths_agree_with_each_other_decode_and_prefill(s, t):
    x, kv_b = _inputs(b=1, s=s, t=t, dtype=torch.float32, seed=3)
    w = _weights(kv_b, torch.float32)
    outs = {n: f(x, w) for n, f in PATHS.items()}
    for n, o in outs.items():
        assert_close(o, outs["compressed"], torch.float32, f"{n} vs compressed s={s} t={t}")


@pytest.mark.parametrize("impl", ["absorbed", "elided", "decompressed"])
def test_bf16_error_ratio_against_hf_style_expansion(impl):
    """bf16: each path's error against float64 stays within 2× the error of HF's own math (compressed) in bf16."""
    x64, kv_b = _inputs(b=2, s=2, t=64, seed=5)
    ref = _reference(x64, kv_b)
    xb = {k: v.to(torch.bfloat16) for k, v in x64.items()}
    wb = _weights(kv_b, torch.bfloat16)
    baseline = PATHS["compressed"](xb, wb)
    out = PATHS[impl](xb, wb)
    assert out.dtype == torch.bfloat16
    assert_error_ratio(out, baseline, ref, torch.bfloat16, impl)


def test_absorbed_weights_are_float32_or_better_and_refuse_half():
    _, kv_b = _inputs()
    w = _weights(kv_b, torch.bfloat16)
    assert w.w_uk.dtype == torch.float32 and w.w_uv_t.dtype == torch.float32 and w.kv_b.dtype == torch.bfloat16
    assert w.w_uk.shape == (H, DK, DC) and w.w_uv_t.shape == (H, DC, DV)
    with pytest.raises(ValueError, match="float32 or float64"):
        mla.absorb(kv_b, H, DK, DV, 1.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rows"):
        mla.absorb(kv_b, H + 1, DK, DV, 1.0)


def test_elided_reads_cache_views_and_ignores_nan_beyond_length():
    """The elided path works on strided views of a larger buffer whose unused slots hold NaN."""
    x, kv_b = _inputs(b=1, s=1, t=6, dtype=torch.float32)
    w = _weights(kv_b, torch.float32)
    buf_c = torch.full((1, 1, 16, DC), math.nan)
    buf_r = torch.full((1, 1, 16, DR), math.nan)
    buf_c[:, 0, :6], buf_r[:, 0, :6] = x["c_kv"], x["k_pe"]
    out = mla.attend_elided(x["q_nope"], x["q_pe"], buf_c[:, 0, :6], buf_r[:, 0, :6], w)
    assert torch.isfinite(out).all()
    assert max_err(out, _reference(x, kv_b)) <= ATOL[torch.float32]
