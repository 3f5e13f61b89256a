"""The KeyValueCache operator (kvslim.ops.key_value_cache) against a naive per-row reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvslim.ops import allocate_kv_cache, dequantize, key_value_cache, quantize

# ---------------------------------------------------------------------------------------------
# naive reference: one (batch, position, head) row at a time, spelled out from SPEC §1


def ref_index(layout: int, b: int, layer: int, kv: int, t: int, h: int) -> tuple[int, ...]:
    """Index of one cached row: layout 0 (MaxB, L, 2, MaxS, H, ·), layout 1 (L, MaxB, 2, H, MaxS, ·)."""
    return (b, layer, kv, t, h) if layout == 0 else (layer, b, kv, h, t)


def ref_quant_row(row: torch.Tensor, bits: int, group: int, scale_dtype: torch.dtype):
    """row (Dh,) float32 -> (codes: int8 (Dh,) or uint8 (Dh/2,), scales (Dh/G,) in scale_dtype)."""
    m = 2 ** (bits - 1) - 1
    codes, scales = [], []
    for g in range(row.numel() // group):
        chunk = row[g * group:(g + 1) * group]
        s = (chunk.abs().max() / m).clamp_min(torch.finfo(scale_dtype).tiny).to(scale_dtype)
        scales.append(s)
        codes += torch.round(chunk / s.float()).clamp(-m, m).to(torch.int64).tolist()
    if bits == 8:
        stored = torch.tensor(codes, dtype=torch.int8)
    else:
        stored = torch.tensor([(codes[2 * i] & 0xF) | ((codes[2 * i + 1] & 0xF) << 4)
                               for i in range(len(codes) // 2)], dtype=torch.uint8)
    return stored, torch.stack(scales)


def ref_dequant_row(stored: torch.Tensor, scales: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    if bits == 8:
        codes = stored.tolist()
    else:
        codes = []
        for byte in stored.tolist():
            for nib in (byte & 0xF, byte >> 4):
                codes.append(nib - 16 if nib >= 8 else nib)
    q = torch.tensor(codes, dtype=torch.float32)
    return q * scales.float().repeat_interleave(group)


def reference(k, v, starts, cache, scale, *, layer, bits, group, repeat, layout):
    """Writes into ``cache``/``scale`` (modified in place) and returns (key, value)."""
    B, S, H, D = k.shape
    for b in range(B):
        for s in range(S):
            for h in range(H):
                for kv, x in ((0, k), (1, v)):
                    idx = ref_index(layout, b, layer, kv, starts[b] + s, h)
                    if bits == 0:
                        cache[idx] = x[b, s, h]
                    else:
                        cache[idx], scale[idx] = ref_quant_row(x[b, s, h].float(), bits, group, scale.dtype)
    T = max(starts) + S
    out = torch.zeros(2, B, T, H * repeat, D, dtype=k.dtype)
    for kv in (0, 1):
        for b in range(B):
            for t in range(starts[b] + S):
                for h in range(H):
                    idx = ref_index(layout, b, layer, kv, t, h)
                    row = cache[idx] if bits == 0 else ref_dequant_row(cache[idx], scale[idx], bits, group)
                    for r in range(repeat):
                        out[kv, b, t, h * repeat + r] = row.to(k.dtype)
    return out[0], out[1]


# ---------------------------------------------------------------------------------------------
# property test


@st.composite
def configs(draw):
    bits = draw(st.sampled_from([0, 4, 8]))
    group = draw(st.sampled_from([1, 2, 4, 8]))
    head_dim = group * draw(st.integers(1, 3))
    if bits == 4 and head_dim % 2:
        head_dim *= 2
    batch = draw(st.integers(1, 2))
    num_layer = draw(st.integers(1, 3))
    max_seq = draw(st.integers(1, 7))
    seq = draw(st.integers(0, max_seq))
    if draw(st.booleans()):
        start = draw(st.integers(0, max_seq - seq))
    else:  # dynamic batching: one start per sequence
        start = torch.tensor([draw(st.integers(0, max_seq - seq)) for _ in range(batch)])
    return dict(
        bits=bits, group=group, head_dim=head_dim, batch=batch, max_batch=batch + draw(st.integers(0, 1)),
        num_layer=num_layer, layer=draw(st.integers(0, num_layer - 1)), heads=draw(st.integers(1, 2)),
        repeat=draw(st.integers(1, 3)), max_seq=max_seq, seq=seq, start=start,
        layout=draw(st.sampled_from([0, 1])),
        dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
        scale_dtype=draw(st.sampled_from([torch.float32, torch.float16])),
        magnitude=draw(st.sampled_from([1e-3, 1.0, 100.0])), zero_group=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def random_cache(c, gen):
    """A cache (and scale) holding random 'history' everywhere, so reads of old rows are checked too."""
    cache, scale = allocate_kv_cache(c["max_batch"], c["num_layer"], c["max_seq"], c["heads"], c["head_dim"],
                                     dtype=c["dtype"], quant_bit=c["bits"], quant_group=c["group"],
                                     scale_dtype=c["scale_dtype"], cache_layout=c["layout"])
    if c["bits"] == 0:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    else:
        lo, hi = (-127, 128) if c["bits"] == 8 else (0, 256)
        cache.copy_(torch.randint(lo, hi, cache.shape, generator=gen))
        scale.copy_(torch.rand(scale.shape, generator=gen) * 0.1 + 1e-3)
    return cache, scale


@settings(max_examples=80, deadline=None)
@given(configs())
def test_operator_matches_reference(c):
    gen = torch.Generator().manual_seed(c["seed"])
    shape = (c["batch"], c["seq"], c["heads"], c["head_dim"])
    k = (torch.randn(shape, generator=gen) * c["magnitude"]).to(c["dtype"])
    v = (torch.randn(shape, generator=gen) * c["magnitude"]).to(c["dtype"])
    if c["zero_group"]:
        k[..., : c["group"]] = 0  # an all-zero group in every key row
    cache, scale = random_cache(c, gen)
    ref_cache = cache.clone()
    ref_scale = None if scale is None else scale.clone()
    start = c["start"]
    starts = start.tolist() if isinstance(start, torch.Tensor) else [start] * c["batch"]

    key, value = key_value_cache(k, v, start, cache, scale, num_layer=c["num_layer"], layer_idx=c["layer"],
                                 quant_bit=c["bits"], quant_group=c["group"], num_repeat=c["repeat"],
                                 cache_layout=c["layout"])
    ref_key, ref_value = reference(k, v, starts, ref_cache, ref_scale, layer=c["layer"], bits=c["bits"],
                                   group=c["group"], repeat=c["repeat"], layout=c["layout"])

    out_shape = (c["batch"], max(starts) + c["seq"], c["heads"] * c["repeat"], c["head_dim"])
    for got, ref in ((key, ref_key), (value, ref_value)):
        assert got.shape == out_shape and got.dtype == c["dtype"] and got.is_contiguous()
        assert torch.equal(got, ref)
    assert torch.equal(cache, ref_cache)  # every byte: written rows and untouched ones
    if scale is not None:
        assert torch.equal(scale, ref_scale)


# ---------------------------------------------------------------------------------------------
# multi-step use, NaN hygiene, aliasing


def _call(k, v, pos, cache, scale, **kw):
    return key_value_cache(k, v, pos, cache, scale, **kw)


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("bits", [0, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_then_decode_never_requantizes_history(layout, bits, dtype):
    gen = torch.Generator().manual_seed(bits + layout)
    B, H, D, G, L, layer, R = 2, 2, 8, 4, 2, 1, 2
    cache, scale = allocate_kv_cache(3, L, 10, H, D, dtype=dtype, quant_bit=bits, quant_group=G,
                                     scale_dtype=torch.float16, cache_layout=layout)
    kw = dict(num_layer=L, layer_idx=layer, quant_bit=bits, quant_group=G, num_repeat=R, cache_layout=layout)
    chunks, pos = [], 0
    for step, seq in enumerate([5, 1, 1, 1, 1]):
        k = torch.randn(B, seq, H, D, generator=gen).to(dtype) * (step + 1)
        v = torch.randn(B, seq, H, D, generator=gen).to(dtype) * (step + 1)
        before_cache = cache.clone()
        before_scale = None if scale is None else scale.clone()
        key, value = _call(k, v, pos, cache, scale, **kw)
        # only rows [pos, pos + seq) of (layer, first B sequences) changed; all older bytes identical
        changed = torch.zeros_like(cache, dtype=torch.bool)
        idx = (slice(0, B), layer, slice(None), slice(pos, pos + seq)) if layout == 0 else \
            (layer, slice(0, B), slice(None), slice(None), slice(pos, pos + seq))
        changed[idx] = True
        assert torch.equal(cache[~changed], before_cache[~changed])
        if scale is not None:
            s_changed = torch.zeros_like(scale, dtype=torch.bool)
            s_changed[idx] = True
            assert torch.equal(scale[~s_changed], before_scale[~s_changed])
        chunks.append((k, v))
        pos += seq
        assert key.shape == (B, pos, H * R, D)

    # the returned history is each chunk quantized once, when it was written
    def once(x):
        if bits == 0:
            return x
        codes, s = quantize(x, bits, G, torch.float16)
        return dequantize(codes, s, bits, G, dtype)

    expect_k = torch.cat([once(k) for k, _ in chunks], dim=1).repeat_interleave(R, dim=2)
    expect_v = torch.cat([once(v) for _, v in chunks], dim=1).repeat_interleave(R, dim=2)
    assert torch.equal(key, expect_k) and torch.equal(value, expect_v)


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("bits", [0, 4, 8])
@pytest.mark.parametrize("dynamic", [False, True])
def test_nan_filled_unused_slots_do_not_leak(layout, bits, dynamic):
    gen = torch.Generator().manual_seed(7)
    B, H, D, L = 2, 2, 8, 3
    cache, scale = allocate_kv_cache(4, L, 12, H, D, dtype=torch.float32, quant_bit=bits, quant_group=4,
                                     cache_layout=layout)
    if bits == 0:
        cache.fill_(float("nan"))
    else:
        cache.copy_(torch.randint(0, 100, cache.shape, generator=gen))
        scale.fill_(float("nan"))
    kw = dict(num_layer=L, layer_idx=1, quant_bit=bits, quant_group=4, cache_layout=layout, num_repeat=2)
    k = torch.randn(B, 4, H, D, generator=gen)
    key, value = _call(k, -k, 0, cache, scale, **kw)
    assert bool(torch.isfinite(key).all() and torch.isfinite(value).all())
    start = torch.tensor([4, 2]) if dynamic else 4
    if dynamic:  # sequence 1 rewrites positions 2, 3 and never wrote 4..5: padded with zeros, not NaN
        key, value = _call(k[:, :2], k[:, :2], start, cache, scale, **kw)
        assert key.shape == (B, 6, 2 * H, D)
        assert bool((key[1, 4:] == 0).all())
    else:
        key, value = _call(k[:, :1], k[:, :1], start, cache, scale, **kw)
        assert key.shape == (B, 5, 2 * H, D)
    assert bool(torch.isfinite(key).all() and torch.isfinite(value).all())


@pytest.mark.parametrize("layout", [0, 1])
def test_outputs_never_alias_the_cache(layout):
    cache, _ = allocate_kv_cache(2, 1, 6, 2, 4, dtype=torch.float32, cache_layout=layout)
    k = torch.randn(2, 6, 2, 4)  # fills the whole cache: the read slice is the full layer
    key, value = key_value_cache(k, k + 1, 0, cache, cache_layout=layout)
    assert torch.equal(key, k) and torch.equal(value, k + 1)
    cache.zero_()
    assert torch.equal(key, k) and torch.equal(value, k + 1)


def test_gqa_repeat_is_interleaved():
    cache, _ = allocate_kv_cache(1, 1, 4, 2, 2, dtype=torch.float32)
    k = torch.tensor([[[[1.0, 1.0], [2.0, 2.0]]]])  # (1, 1, H=2, 2)
    key, _ = key_value_cache(k, k, 0, cache, num_repeat=3)
    assert key[0, 0, :, 0].tolist() == [1, 1, 1, 2, 2, 2]


def test_zero_length_write_reads_history():
    cache, scale = allocate_kv_cache(1, 1, 4, 1, 8, dtype=torch.float32, quant_bit=8)
    k = torch.randn(1, 3, 1, 8)
    key3, _ = key_value_cache(k, k, 0, cache, scale, quant_bit=8)
    key_again, _ = key_value_cache(k[:, :0], k[:, :0], 3, cache, scale, quant_bit=8)
    assert torch.equal(key3, key_again)


def test_scalar_tensor_start_pos_is_accepted():
    cache, _ = allocate_kv_cache(1, 1, 4, 1, 2, dtype=torch.float32)
    k = torch.ones(1, 1, 1, 2)
    key, _ = key_value_cache(k, k, torch.tensor(2), cache)
    assert key.shape == (1, 3, 1, 2)


# ---------------------------------------------------------------------------------------------
# allocation


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize(("bits", "width", "cache_dtype"), [(0, 8, torch.bfloat16), (8, 8, torch.int8),
                                                            (4, 4, torch.uint8)])
def test_allocate_kv_cache_shapes(layout, bits, width, cache_dtype):
    cache, scale = allocate_kv_cache(3, 2, 5, 4, 8, dtype=torch.bfloat16, quant_bit=bits, quant_group=2,
                                     scale_dtype=torch.float16, cache_layout=layout)
    dims = (3, 2, 2, 5, 4) if layout == 0 else (2, 3, 2, 4, 5)
    assert cache.shape == (*dims, width) and cache.dtype == cache_dtype
    if bits == 0:
        assert scale is None
    else:
        assert scale.shape == (*dims, 4) and scale.dtype == torch.float16


@pytest.mark.parametrize(("kwargs", "name"), [
    (dict(max_batch=0), "max_batch"), (dict(num_layer=0), "num_layer"), (dict(max_seq=-1), "max_seq"),
    (dict(num_heads=0), "num_heads"), (dict(head_dim=0), "head_dim"), (dict(quant_bit=3), "quant_bit"),
    (dict(cache_layout=2), "cache_layout"), (dict(dtype=torch.float64), "dtype"),
    (dict(quant_bit=8, quant_group=3), "quant_group"), (dict(quant_bit=4, head_dim=5, quant_group=1), "quant_bit"),
    (dict(quant_bit=8, scale_dtype=torch.int8), "scale_dtype"),
])
def test_allocate_kv_cache_rejects(kwargs, name):
    args = dict(max_batch=2, num_layer=2, max_seq=4, num_heads=2, head_dim=8, dtype=torch.float32)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        allocate_kv_cache(args.pop("max_batch"), args.pop("num_layer"), args.pop("max_seq"),
                          args.pop("num_heads"), args.pop("head_dim"), **args)


# ---------------------------------------------------------------------------------------------
# bad input: ValueError naming the argument, and nothing written

B, S, H, D, MAXB, L, MAXS = 2, 3, 2, 8, 3, 2, 8


def _base(layout):
    cache, scale = allocate_kv_cache(MAXB, L, MAXS, H, D, dtype=torch.float32, quant_bit=8, quant_group=4,
                                     cache_layout=layout)
    gen = torch.Generator().manual_seed(3)
    cache.copy_(torch.randint(-127, 128, cache.shape, generator=gen))
    scale.copy_(torch.rand(scale.shape, generator=gen))
    k = torch.randn(B, S, H, D, generator=gen)
    return dict(current_key=k, current_value=k.clone(), start_pos=2, cache=cache, scale=scale,
                num_layer=L, layer_idx=1, quant_bit=8, quant_group=4, num_repeat=1, cache_layout=layout)


def _shape(layout, *, maxb=MAXB, layers=L, two=2, maxs=MAXS, heads=H, width=D):
    return (maxb, layers, two, maxs, heads, width) if layout == 0 else (layers, maxb, two, heads, maxs, width)


BAD_CASES = {
    "start_pos past MaxS": (lambda a, lay: a.update(start_pos=6), "start_pos"),
    "start_pos negative": (lambda a, lay: a.update(start_pos=-1), "start_pos"),
    "start_pos float": (lambda a, lay: a.update(start_pos=1.5), "start_pos"),
    "start_pos bool": (lambda a, lay: a.update(start_pos=True), "start_pos"),
    "start_pos tensor past MaxS": (lambda a, lay: a.update(start_pos=torch.tensor([0, 6])), "start_pos"),
    "start_pos tensor negative": (lambda a, lay: a.update(start_pos=torch.tensor([-1, 0])), "start_pos"),
    "start_pos tensor shape": (lambda a, lay: a.update(start_pos=torch.tensor([0, 1, 2])), "start_pos"),
    "start_pos tensor float": (lambda a, lay: a.update(start_pos=torch.tensor([0.0, 1.0])), "start_pos"),
    "layer_idx too big": (lambda a, lay: a.update(layer_idx=2), "layer_idx"),
    "layer_idx negative": (lambda a, lay: a.update(layer_idx=-1), "layer_idx"),
    "num_layer mismatch": (lambda a, lay: a.update(num_layer=3), "num_layer"),
    "num_layer zero": (lambda a, lay: a.update(num_layer=0), "num_layer"),
    "batch > MaxB": (lambda a, lay: a.update(current_key=torch.randn(4, S, H, D),
                                             current_value=torch.randn(4, S, H, D)), "current_key"),
    "group does not divide Dh": (lambda a, lay: a.update(quant_group=3), "quant_group"),
    "group zero": (lambda a, lay: a.update(quant_group=0), "quant_group"),
    "odd Dh with 4 bits": (lambda a, lay: a.update(quant_bit=4, quant_group=1,
                                                   current_key=torch.randn(B, S, H, 5),
                                                   current_value=torch.randn(B, S, H, 5)), "quant_bit"),
    "missing scale": (lambda a, lay: a.update(scale=None), "scale"),
    "scale wrong shape": (lambda a, lay: a.update(scale=torch.ones(_shape(lay, width=4))), "scale"),
    "scale wrong maxs": (lambda a, lay: a.update(scale=torch.ones(_shape(lay, maxs=9, width=2))), "scale"),
    "scale bf16": (lambda a, lay: a.update(scale=a["scale"].clone().to(torch.bfloat16)), "scale"),
    "scale not a tensor": (lambda a, lay: a.update(scale=1.0), "scale"),
    "cache dtype for 8 bits": (lambda a, lay: a.update(quant_bit=8, cache=a["cache"].clone().float()), "cache"),
    "cache dtype for 4 bits": (lambda a, lay: a.update(quant_bit=4), "cache"),
    "cache dtype for 0 bits": (lambda a, lay: a.update(quant_bit=0), "cache"),
    "cache fp16 for fp32 input": (lambda a, lay: a.update(
        quant_bit=0, cache=torch.zeros(_shape(lay), dtype=torch.float16)), "cache"),
    "cache heads": (lambda a, lay: a.update(cache=torch.zeros(_shape(lay, heads=3), dtype=torch.int8)), "cache"),
    "cache width": (lambda a, lay: a.update(cache=torch.zeros(_shape(lay, width=4), dtype=torch.int8)), "cache"),
    "cache kv axis": (lambda a, lay: a.update(cache=torch.zeros(_shape(lay, two=3), dtype=torch.int8)), "cache"),
    "cache 5-D": (lambda a, lay: a.update(cache=torch.zeros(_shape(lay)[1:], dtype=torch.int8)), "cache"),
    "value shape": (lambda a, lay: a.update(current_value=torch.randn(B, S, H, 4)), "current_value"),
    "value dtype": (lambda a, lay: a.update(current_value=a["current_value"].half()), "current_value"),
    "key float64": (lambda a, lay: a.update(current_key=a["current_key"].double(),
                                            current_value=a["current_value"].double()), "current_key"),
    "key int": (lambda a, lay: a.update(current_key=torch.ones(B, S, H, D, dtype=torch.int8),
                                        current_value=torch.ones(B, S, H, D, dtype=torch.int8)), "current_key"),
    "key 3-D": (lambda a, lay: a.update(current_key=torch.randn(S, H, D),
                                        current_value=torch.randn(S, H, D)), "current_key"),
    "quant_bit 2": (lambda a, lay: a.update(quant_bit=2), "quant_bit"),
    "quant_bit 16": (lambda a, lay: a.update(quant_bit=16), "quant_bit"),
    "quant_bit bool": (lambda a, lay: a.update(quant_bit=True), "quant_bit"),
    "num_repeat float": (lambda a, lay: a.update(num_repeat=2.0), "num_repeat"),
    "cache_layout 2": (lambda a, lay: a.update(cache_layout=2), "cache_layout"),
    "num_repeat 0": (lambda a, lay: a.update(num_repeat=0), "num_repeat"),
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_input_raises_and_writes_nothing(case, layout):
    args = _base(layout)
    buffers = [args["cache"], args["scale"]]  # the caller's original buffers
    mutate, name = BAD_CASES[case]
    mutate(args, layout)
    buffers += [args[n] for n in ("cache", "scale") if isinstance(args[n], torch.Tensor)]  # replacements
    before = [_bits(t).clone() for t in buffers]
    with pytest.raises(ValueError, match=name):
        key_value_cache(**args)
    for t, b in zip(buffers, before, strict=True):
        assert torch.equal(_bits(t), b)


def test_integer_like_arguments_are_accepted():
    args = _base(1)
    ref_key, _ = key_value_cache(**{**_base(1), "layer_idx": 1})
    args.update(quant_bit=np.int64(8), layer_idx=torch.tensor(1), cache_layout=np.int32(1),
                num_repeat=np.int64(1), start_pos=np.int64(2))
    key, _ = key_value_cache(**args)
    assert torch.equal(key, ref_key)


def test_base_case_is_valid():
    for layout in (0, 1):
        args = _base(layout)
        key, _ = key_value_cache(**args)
        assert key.shape == (B, 5, H, D)
