"""The fused C decode kernel of slim attention against its torch twin and a plain per-head reference."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
from tolerances import assert_rel_close

from kvslim.attention.slim import SlimLayerWeights, additive_mask, slim_attention, split_heads
from kvslim.kernels import slim_decode as kernel
from kvslim.ops.rope import rotate, rotate_heads, unrotate


def _table(n: int, r: int, offset: int = 0):
    inv = 1.0 / (10000 ** (torch.arange(0, r, 2, dtype=torch.float32) / r))
    ang = torch.arange(offset, offset + n, dtype=torch.float32)[:, None] * inv
    emb = torch.cat((ang, ang), dim=-1)
    return emb.cos()[None], emb.sin()[None]  # (1, n, R)


def _plain(q, rows, h, dk, mask, scaling, cos, sin, rotated):
    """Per-head reference: rotate (or un-rotate) with ops.rope, softmax, u = s·C, all in float64."""
    e = h * dk
    keys = split_heads(rows[..., :e].double(), h)  # (B, h, n, dk)
    cs = None if cos is None else (cos[:, None].double(), sin[:, None].double())
    k_score = keys if cs is None or rotated else rotate(keys, *cs)
    scores = (q.double() @ k_score.transpose(-1, -2)) * scaling
    if mask is not None:
        scores = scores + mask.double()
    s = torch.softmax(scores, dim=-1)
    src = rows.double()
    if cs is not None and rotated:
        raw = unrotate(keys, *cs).transpose(1, 2).reshape(rows.shape[0], -1, e)
        src = torch.cat((raw, src[..., e:]), dim=-1)
    return s @ src.unsqueeze(1)  # (B, h, 1, c)


def _lib():
    lib = kernel.load()
    if lib is None:
        pytest.skip("no C compiler: the kernel cannot be built here (the torch path is used)")
    return lib


# (B, h, dk, R, extra columns, n): partial rotary, conditioning columns, h % 4 != 0, n % CHUNK != 0, no RoPE;
# the last three hit the kernel's specialised head sizes (dk, R) = (64, 64), (128, 128), (64, 0)
SHAPES = [(2, 4, 16, 16, 0, 300), (3, 6, 32, 16, 8, 700), (1, 5, 8, 8, 3, 257), (2, 4, 16, 0, 0, 513),
          (2, 5, 64, 64, 0, 300), (1, 2, 128, 128, 4, 260), (1, 3, 64, 0, 0, 270)]


@pytest.mark.parametrize("rotated", [False, True])
@pytest.mark.parametrize("b,h,dk,r,extra,n", SHAPES)
def test_kernel_matches_plain_reference(b, h, dk, r, extra, n, rotated):
    lib = _lib()
    g = torch.Generator().manual_seed(n + h)
    e = h * dk
    store = torch.full((b, 1, n + 37, e + extra), float("nan"))  # NaN in the unused slots must stay unread
    store[:, 0, :n] = 2 * torch.randn(b, n, e + extra, generator=g)
    rows = store[:, 0, :n]  # the non-contiguous view a SlimLayer returns
    q = 2 * torch.randn(b, h, 1, dk, generator=g)
    cos, sin = _table(n, r) if r else (None, None)
    pad = torch.ones(b, n, dtype=torch.bool)
    pad[0, :5] = False  # left padding of the first sequence
    mask = additive_mask(pad[:, None, None, :], 1, n, q.device)  # (B, 1, 1, n)
    for m in (None, mask):
        u = kernel.slim_decode(lib, q, rows, m, dk ** -0.5, cos, sin, rotated and bool(r))
        ref = _plain(q, rows, h, dk, m, dk ** -0.5, cos, sin, rotated and bool(r))
        assert torch.isfinite(u).all()
        assert_rel_close(u, ref, torch.float32, "kernel vs float64 reference")


@pytest.mark.parametrize("rotated", [False, True])
def test_kernel_and_torch_path_agree_in_slim_attention(rotated):
    _lib()
    g = torch.Generator().manual_seed(7)
    b, h, dk, n, extra = 2, 4, 16, 400, 4
    e, c = h * dk, h * dk + extra
    rows = torch.randn(b, n, c, generator=g)
    q = torch.randn(b, h, 1, dk, generator=g)
    w = SlimLayerWeights("k", h, dk, c, value_map=torch.randn(h, c, dk, generator=g), rope=True,
                         rope_storage="rotated" if rotated else "raw")
    cos, sin = _table(n, dk, offset=3)
    fused = slim_attention(q, rows, w, None, dk ** -0.5, cos, sin)
    torch_path = slim_attention(q, rows, replace(w, kernel="torch"), None, dk ** -0.5, cos, sin)
    assert_rel_close(fused, torch_path, torch.float32, "kernel vs torch path")
    assert e < c


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("r", [16, 8])
def test_rotate_heads_matches_rotate(inverse, r):
    g = torch.Generator().manual_seed(r)
    b, h, dk, n = 2, 3, 16, 20
    rows = torch.randn(b, n, h * dk + 5, generator=g)
    cos, sin = _table(n, r)
    ref = (unrotate if inverse else rotate)(split_heads(rows[..., :h * dk], h), cos[:, None], sin[:, None])
    out = rotate_heads(rows, h, dk, cos, sin, inverse=inverse)
    assert_rel_close(out, ref.transpose(1, 2).reshape(b, n, h * dk), torch.float32, "rotate_heads vs rotate")


def test_missing_compiler_falls_back_with_a_warning(monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/kvslim-cc")
    monkeypatch.setattr(kernel, "FLAGS", (*kernel.FLAGS, "-DKVSLIM_TEST_FALLBACK"))  # a fresh build key
    kernel.load.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert kernel.load() is None
        assert any("torch path" in str(x.message) for x in caught)
    finally:
        kernel.load.cache_clear()
