"""Cache layers against a naive concatenating reference; ring-buffer bounds; exact byte accounting."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import assert_close

from kvslim.caches import AppendLayer, RingLayer, StoreSpec
from kvslim.ops.quant import dequantize, quantize


def _chunks(total: int, sizes: list[int]) -> list[int]:
    out, left = [], total
    for s in sizes:
        if left <= 0:
            break
        out.append(min(s, left))
        left -= out[-1]
    if left > 0:
        out.append(left)
    return out


def _nan_fill(layer) -> None:
    """Poison every preallocated slot so any read of an unwritten slot shows up as NaN."""
    for store in layer._stores():
        for t in store.tensors():
            if t.is_floating_point():
                t.fill_(float("nan"))


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(st.integers(1, 9), min_size=1, max_size=8), chunk=st.integers(1, 16),
       heads=st.integers(1, 3), dim=st.sampled_from([4, 8]))
def test_append_layer_matches_concatenation(steps, chunk, heads, dim):
    layer = AppendLayer(StoreSpec(), chunk=chunk)
    ref_k = ref_v = None
    for i, s in enumerate(steps):
        k, v = torch.randn(2, heads, s, dim), torch.randn(2, heads, s, dim)
        if i == 0:
            layer.lazy_initialization(k, v)
            _nan_fill(layer)
        ok, ov = layer.update(k, v)
        ref_k = k if ref_k is None else torch.cat((ref_k, k), 2)
        ref_v = v if ref_v is None else torch.cat((ref_v, v), 2)
        assert torch.equal(ok, ref_k) and torch.equal(ov, ref_v)
    assert layer.get_seq_length() == sum(steps)
    assert layer.nbytes == 2 * 2 * heads * sum(steps) * dim * 4


def _window_reference(all_k: torch.Tensor, c: int, s: int, w: int) -> torch.Tensor:
    """Keys visible to queries at positions [c, c+s): the last min(c, w-1) past ones plus the new ones."""
    past = min(c, w - 1)
    return all_k[:, :, c - past: c + s]


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.integers(1, 12), min_size=1, max_size=10), window=st.integers(1, 10))
def test_ring_layer_returns_visible_tokens_in_temporal_order(steps, window):
    layer = RingLayer(window)
    total = sum(steps)
    all_k, all_v = torch.randn(1, 2, total, 4), torch.randn(1, 2, total, 4)
    c = 0
    for i, s in enumerate(steps):
        k, v = all_k[:, :, c:c + s], all_v[:, :, c:c + s]
        if i == 0:
            layer.lazy_initialization(k, v)
            _nan_fill(layer)
        kv_len, kv_off = layer.get_mask_sizes(s)
        ok, ov = layer.update(k, v)
        ref_k = _window_reference(all_k, c, s, window)
        assert torch.equal(ok, ref_k)
        assert torch.equal(ov, _window_reference(all_v, c, s, window))
        assert (kv_len, kv_off) == (ref_k.shape[2], c - min(c, window - 1))
        c += s
        assert layer.get_seq_length() == c
        assert layer.stored_tokens() == min(c, window - 1)  # HF keeps W − 1 rows too


def test_ring_memory_is_flat_after_window_for_ten_windows():
    w = 16
    layer = RingLayer(w, StoreSpec(bits=8, group_size=4))
    sizes = []
    for _ in range(10 * w):
        layer.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
        sizes.append((layer.nbytes, layer.allocated_nbytes))
    assert len({s for s in sizes[w - 1:]}) == 1, "bytes must not grow after W tokens"
    assert sizes[-1][0] == sizes[-1][1]


def test_ring_bytes_equal_hf_sliding_layer():
    """The ring stores W − 1 rows, as HF's ``DynamicSlidingWindowLayer`` (the current token is attended as given)."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    w, g = 6, torch.Generator().manual_seed(1)
    ours, hf = RingLayer(w), DynamicSlidingWindowLayer(w)
    for s in (4, 1, 3, 1, 1, 1, 9, 1, 1):
        k, v = torch.randn(2, 3, s, 8, generator=g), torch.randn(2, 3, s, 8, generator=g)
        got, ref = ours.update(k, v), hf.update(k, v)
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
        assert ours.nbytes == hf.keys.nbytes + hf.values.nbytes
    assert ours.allocated_nbytes == ours.nbytes == 2 * 2 * 3 * (w - 1) * 8 * 4  # the buffers: W − 1 rows


@pytest.mark.parametrize("window", [1, 2, 5])
def test_fused_ring_step_attends_what_its_unfused_twin_reads(window):
    """Fused decode on a W − 1-slot ring: the step's token takes the slot of position c−W+1, which the step still
    attends (from the tail, read before the write). Its reads equal an unfused ring's, and the kernel's attention
    over the codes equals attention over those reads under a random padding mask."""
    from kvslim.attention import quant
    from kvslim.caches.fused import fused_of
    from kvslim.kernels import quant_decode as kernel

    if not kernel.available():
        pytest.skip("no C++ compiler: the op cannot be built here")
    g = torch.Generator().manual_seed(0)
    fused, plain = RingLayer(window, StoreSpec(8, 4)), RingLayer(window, StoreSpec(8, 4))
    fused.fused_decode = True
    with torch.no_grad():
        k, v = torch.randn(2, 2, 3, 8, generator=g), torch.randn(2, 2, 3, 8, generator=g)
        fused.update(k, v), plain.update(k, v)
        for step in range(3 * window + 2):
            k, v = torch.randn(2, 2, 1, 8, generator=g), torch.randn(2, 2, 1, 8, generator=g)
            mk, _ = fused.update(k, v)
            ref_k, ref_v = plain.update(k, v)
            h = fused_of(mk)
            if window == 1:  # nothing stored: the step attends its own token only
                assert h is None and torch.equal(mk, k)
                continue
            assert h is not None and h.tokens == ref_k.shape[2] == min(3 + step, window - 1) + 1
            got_k, got_v = h.materialize()
            assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)
            q = torch.randn(2, 4, 1, 8, generator=g)
            mask = torch.rand(2, 1, 1, h.tokens, generator=g) < 0.7
            mask[..., -1] = True
            assert_close(quant.decode(h, q, mask, None), quant.reference(h, q, mask, None), torch.float32,
                         f"step {step}")


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_append_never_requantizes_history(bits):
    layer = AppendLayer(StoreSpec(bits=bits, group_size=8), chunk=4)
    first = torch.randn(1, 2, 5, 16) * 10
    layer.update(first, first)
    codes0 = layer.k_store.data[:, :, :5].clone()
    scale0 = layer.k_store.scale[:, :, :5].clone()
    for _ in range(20):  # many appends, forcing buffer growth, with much larger magnitudes
        x = torch.randn(1, 2, 1, 16) * 1000
        k, _ = layer.update(x, x)
    assert torch.equal(layer.k_store.data[:, :, :5], codes0)
    assert torch.equal(layer.k_store.scale[:, :, :5], scale0)
    c, s = quantize(first, bits, 8)
    assert torch.equal(k[:, :, :5], dequantize(c, s, bits, 8))


@pytest.mark.parametrize("bits,limit", [(8, 0.27), (4, 0.15)])
def test_quantized_bytes_against_fp32_dense(bits, limit):
    """Group 64, fp32 scales: 1.0625 (int8) and 0.5625 (int4) bytes per value vs 4 for fp32."""
    x = torch.randn(2, 4, 100, 64)
    dense, quant = AppendLayer(), AppendLayer(StoreSpec(bits=bits, group_size=64))
    dense.update(x, x)
    quant.update(x, x)
    per_value = quant.nbytes / (2 * x.numel())
    assert per_value == {8: 1.0625, 4: 0.5625}[bits]
    assert quant.nbytes / dense.nbytes <= limit


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantized_read_matches_roundtrip(dtype):
    layer = AppendLayer(StoreSpec(bits=8, group_size=16, scale_dtype=torch.float16))
    x = torch.randn(1, 3, 7, 32).to(dtype)
    k, _ = layer.update(x, x)
    assert torch.equal(k, x)  # a call attends to its own keys in full precision
    k, _ = layer.update(x[:, :, :1], x[:, :, :1])  # ... and to the history as stored
    c, s = quantize(x, 8, 16, torch.float16)
    assert k.dtype == dtype
    assert_close(k[:, :, :7], dequantize(c, s, 8, 16, dtype), dtype, "int8 read")


def test_layer_refuses_mismatched_update_and_changes_nothing():
    layer = AppendLayer()
    layer.update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))
    before = layer.k_store.data.clone()
    with pytest.raises(ValueError, match="key_states"):
        layer.update(torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8))
    with pytest.raises(ValueError, match="key_states"):
        layer.update(torch.randn(1, 2, 1, 8, dtype=torch.float64), torch.randn(1, 2, 1, 8, dtype=torch.float64))
    assert layer.get_seq_length() == 3 and torch.equal(before[:, :, :3], layer.k_store.data[:, :, :3])
    with pytest.raises(ValueError, match="window"):
        RingLayer(0)
    with pytest.raises(ValueError, match="bits"):
        StoreSpec(bits=5)  # 2, 3, 4 and 8 are formats (3: the int2 default keys)
    with pytest.raises(ValueError, match="group_size"):
        AppendLayer(StoreSpec(bits=8, group_size=5)).update(torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8))


def test_key_smoothing_bounds_error_with_outlier_channels_and_survives_batch_ops():
    """Keys with one huge channel: per-channel smoothing keeps the other channels' error small."""
    torch.manual_seed(0)
    k = torch.randn(2, 2, 40, 64)
    k[..., 3] *= 200.0  # an outlier channel, as in RoPE'd keys of trained models
    errs = {}
    for smooth in (False, True):
        layer = AppendLayer(StoreSpec(bits=4, group_size=64, smooth=smooth))
        out, _ = layer.update(k[:, :, :30], k[:, :, :30])
        out, _ = layer.update(k[:, :, 30:], k[:, :, 30:])
        errs[smooth] = (out - k)[..., torch.arange(64) != 3].abs().max().item()
        if smooth:
            assert layer.k_store.channel.shape == (2, 2, 1, 64) and layer.v_store.spec.smooth is False
            assert layer.nbytes == 2 * 2 * 40 * (32 + 4) * 2 + 2 * 2 * 64 * 4
            layer.reorder_cache(torch.tensor([1, 0]))
            again, _ = layer.update(k[1:2].expand(2, -1, -1, -1)[:, :, :1].contiguous(),
                                    k[:, :, :1].contiguous())
            assert torch.allclose(again[0, :, :30], out[1, :, :30])  # (tokens 30.. were returned unquantized)
    assert errs[True] < errs[False] / 1.5, errs
    old = layer.k_store.channel.clone()
    layer.reset()  # a new sequence fits its own smoothing factors
    assert layer.k_store.channel is None and layer.nbytes == 0
    layer.update(k[:, :, :3] * 0.01, k[:, :, :3])
    assert layer.k_store.channel.max() < old.max() / 5  # sqrt smoothing: ~1.8x here, outlier 200x


@pytest.mark.parametrize("bits,smooth", [(8, False), (4, False), (8, True), (4, True)])
@torch.no_grad()  # scratch reads are for inference; with autograd on the cache allocates as usual
def test_scratch_reads_are_bit_identical_and_reuse_one_buffer(bits, smooth):
    from kvslim.caches import KVSlimCache

    torch.manual_seed(0)
    spec = StoreSpec(bits=bits, group_size=16, smooth=smooth)
    plain = [AppendLayer(spec, chunk=8) for _ in range(2)]
    pooled = KVSlimCache([AppendLayer(spec, chunk=8) for _ in range(2)])
    for step in (5, 1, 1, 9):
        for i in range(2):
            k, v = torch.randn(2, 3, step, 32), torch.randn(2, 3, step, 32)
            rk, rv = plain[i].update(k, v)
            pk, pv = pooled.update(k, v, i)
            assert torch.equal(pk, rk) and torch.equal(pv, rv)
    buffers = pooled.layers[0].scratch_pool.buffers
    assert set(buffers) == {"k", "v"} and pooled.layers[1].scratch_pool is pooled.layers[0].scratch_pool
    assert pk.untyped_storage().data_ptr() == buffers["k"].untyped_storage().data_ptr()


@pytest.mark.parametrize("sink", [0, 3])
def test_rotated_tail_follows_every_change_of_the_window(sink):
    """Fused decode keeps a rotated copy of a rotated value store's full-precision tail and rotates only the new
    rows on each step; after appends, flushes, a rewind, a reorder and a reset it equals tail·R recomputed."""
    from kvslim.caches.fused import rotated_tail
    from kvslim.caches.storage import StoreSpec
    from kvslim.caches.stores import make_store

    spec = StoreSpec(4, 16, asymmetric=True, rotation="hadamard", residual=8, flush=4, sink=sink)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 40, 16, generator=gen)
    store = make_store(spec, x, 48)
    rot = (store.coded if sink else store.inner).rotation

    def check(where):
        r = store.length - store.flushed + min(store.length, sink)  # sinks, then the window
        got, rotated = rotated_tail(store, r)
        assert rotated
        assert_close(got, store.fp[:, :, :r].float() @ rot, torch.float32, where)

    store.write(0, x[:, :, :5])
    check("prefill")
    for t in range(5, 30):  # single-token steps through several flushes
        store.write(t, x[:, :, t:t + 1])
        check(f"step {t}")
    store.write(29, x[:, :, 30:32])  # rewind by one (as after a crop) and a longer tail than before
    check("rewind")
    store.write(31, x[:, :, 32:33])
    check("after rewind")
    store.map_sequences(lambda t: t.flip(0))  # beam reorder
    check("reorder")
    store.write(29, x[:, :, 33:34])
    check("after reorder")
    store.reset()
    store.write(0, x[:, :, 34:36])
    check("reset")
