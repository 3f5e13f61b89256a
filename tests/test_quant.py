"""Grouped symmetric quantization (kvslim.ops.quant): round-trip bound, scale rule, int4 packing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvslim.ops import (
    check_quant_args,
    compute_scale,
    dequantize,
    pack_int4,
    qmax,
    quantize,
    quantize_with_scale,
    unpack_int4,
)

FP32_TINY = torch.finfo(torch.float32).tiny


@st.composite
def grouped_rows(draw):
    bits = draw(st.sampled_from([4, 8]))
    group = draw(st.sampled_from([1, 2, 4, 8]))
    n_groups = draw(st.integers(1, 4))
    head_dim = group * n_groups
    if bits == 4 and head_dim % 2:
        head_dim *= 2
    rows = draw(st.integers(1, 3))
    magnitude = draw(st.sampled_from([1e-30, 1e-3, 1.0, 1e3, 1e30]))
    values = draw(st.lists(st.floats(-1.0, 1.0, width=32), min_size=rows * head_dim,
                           max_size=rows * head_dim))
    x = torch.tensor(values, dtype=torch.float32).view(rows, head_dim) * magnitude
    return x, bits, group


@settings(max_examples=100, deadline=None)
@given(grouped_rows())
def test_round_trip_error_at_most_half_a_step(case):
    x, bits, group = case
    codes, scale = quantize(x, bits, group)
    assert codes.dtype == (torch.int8 if bits == 8 else torch.uint8)
    assert codes.shape[-1] == (x.shape[-1] if bits == 8 else x.shape[-1] // 2)
    assert scale.shape == (*x.shape[:-1], x.shape[-1] // group) and scale.dtype == torch.float32
    x_hat = dequantize(codes, scale, bits, group)
    err = (x - x_hat).abs().unflatten(-1, (-1, group))  # (rows, D/G, G)
    bound = scale.unsqueeze(-1) * (0.5 + 1e-5)  # fp32 slack for x/s and q*s rounding
    assert bool((err <= bound).all()), (err - bound).max()
    q = unpack_int4(codes) if bits == 4 else codes
    assert int(q.abs().max()) <= qmax(bits)  # never the asymmetric code -2^(bits-1)


@settings(max_examples=60, deadline=None)
@given(grouped_rows(), st.sampled_from([torch.float32, torch.float16]))
def test_scale_rule_max_abs_over_qmax_clamped_at_eps(case, scale_dtype):
    x, bits, group = case
    scale = compute_scale(x, bits, group, scale_dtype)
    expect = x.abs().unflatten(-1, (-1, group)).amax(-1) / qmax(bits)
    info = torch.finfo(scale_dtype)  # clamped high too: an fp16 scale saturates instead of overflowing to inf
    expect = expect.clamp(info.tiny, info.max).to(scale_dtype)
    assert scale.dtype == scale_dtype
    torch.testing.assert_close(scale, expect, rtol=0, atol=0)
    assert bool((scale > 0).all())


@settings(max_examples=60, deadline=None)
@given(grouped_rows())
def test_group_maximum_maps_to_the_extreme_code(case):
    x, bits, group = case
    codes, scale = quantize(x, bits, group)
    q = (unpack_int4(codes) if bits == 4 else codes).unflatten(-1, (-1, group))  # (rows, D/G, G)
    idx = x.abs().unflatten(-1, (-1, group)).argmax(-1, keepdim=True)
    q_at_max = q.gather(-1, idx).squeeze(-1).abs()
    unclamped = scale > FP32_TINY
    assert bool((q_at_max[unclamped] == qmax(bits)).all())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
def test_all_zero_groups(bits, scale_dtype):
    x = torch.zeros(3, 16)
    x[1, 8:] = torch.linspace(-1, 1, 8)  # one non-zero group beside zero groups
    codes, scale = quantize(x, bits, 8, scale_dtype)
    assert bool(torch.isfinite(scale).all()) and bool((scale > 0).all())
    zero_groups = torch.ones(3, 2, dtype=torch.bool)
    zero_groups[1, 1] = False
    assert bool((scale[zero_groups] == torch.finfo(scale_dtype).tiny).all())
    x_hat = dequantize(codes, scale, bits, 8)
    assert bool((x_hat.unflatten(-1, (2, 8))[zero_groups] == 0).all())
    assert bool(torch.isfinite(x_hat).all())


def test_int4_pack_unpack_all_nibble_pairs():
    nibbles = torch.arange(-8, 8, dtype=torch.int8)  # all 16 codes
    lo, hi = torch.meshgrid(nibbles, nibbles, indexing="ij")
    q = torch.stack((lo.flatten(), hi.flatten()), dim=-1).flatten()  # (512,) every (even, odd) pair
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (256,)
    assert sorted(packed.tolist()) == list(range(256))  # bijection onto bytes
    assert torch.equal(unpack_int4(packed), q)
    all_bytes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(pack_int4(unpack_int4(all_bytes)), all_bytes)


def test_int4_low_nibble_holds_even_index():
    assert pack_int4(torch.tensor([1, 2], dtype=torch.int8)).tolist() == [0x21]
    assert pack_int4(torch.tensor([-1, 0], dtype=torch.int8)).tolist() == [0x0F]
    assert pack_int4(torch.tensor([0, -8], dtype=torch.int8)).tolist() == [0x80]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_quantize_in_fp32(dtype):
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0)).to(dtype)
    codes, scale = quantize(x, 8, 8)
    assert torch.equal(codes, quantize(x.float(), 8, 8)[0])
    assert dequantize(codes, scale, 8, 8, dtype).dtype == dtype


def test_quantize_with_scale_matches_quantize():
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    for bits in (4, 8):
        codes, scale = quantize(x, bits, 4)
        assert torch.equal(quantize_with_scale(x, scale, bits, 4), codes)


@pytest.mark.parametrize(("head_dim", "bits", "group", "name"), [
    (8, 2, 4, "bits"), (8, 16, 4, "bits"), (8, 8, 3, "group_size"), (8, 8, 0, "group_size"),
    (7, 4, 7, "bits"), (7, 4, 1, "bits"),
])
def test_check_quant_args_names_the_argument(head_dim, bits, group, name):
    with pytest.raises(ValueError, match=name):
        check_quant_args(head_dim, bits, group)
    with pytest.raises(ValueError):
        check_quant_args(head_dim, bits, group, bits_name="quant_bit", group_name="quant_group")
