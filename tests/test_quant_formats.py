"""KV quantization formats beyond SPEC §1 (kvslim.ops.quant_formats, caches/storage.py, caches/residual.py):
asymmetric and 2-bit codes against float64 references, per-channel (KIVI) keys, the Hadamard rotation, the
full-precision residual window, option validation, and exact byte accounting against the plan."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvslim
from kvslim.caches.residual import ChannelQuantizedStore, ResidualStore
from kvslim.caches.storage import QuantizedStore, StoreSpec
from kvslim.caches.stores import make_store
from kvslim.ops.quant import dequantize, quantize
from kvslim.ops.quant_formats import (
    dequantize_asym,
    dequantize_sym,
    hadamard,
    pack_codes,
    quantize_asym,
    quantize_sym,
    unpack_codes,
)


def _rows(*shape, seed=0, outlier=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if outlier:
        x[..., 3] = x[..., 3] * 15 + 4  # an outlier channel with an offset, as real keys have
    return x


def _asym_ref64(x: torch.Tensor, bits: int, group: int, params: torch.dtype = torch.float32) -> torch.Tensor:
    """Float64 oracle of the asymmetric format with ``params``-dtype parameters: q·scale + zero per group."""
    gx = x.double().unflatten(-1, (-1, group))
    lo, hi = gx.amin(-1, keepdim=True), gx.amax(-1, keepdim=True)
    scale = ((hi - lo) / (2 ** bits - 1)).to(params).double()
    zero = lo.to(params).double()
    q = torch.round((gx - zero) / scale).clamp(0, 2 ** bits - 1)
    return (q * scale + zero).flatten(-2)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group", [8, 32])
def test_asymmetric_matches_float64_reference_and_half_step_bound(bits, group):
    x = _rows(5, 64)
    codes, scale, zero = quantize_asym(x, bits, group)
    assert codes.dtype == torch.uint8 and codes.shape == (5, 64 * bits // 8)
    assert scale.shape == zero.shape == (5, 64 // group)
    got = dequantize_asym(codes, scale, zero, bits, group).double()
    ref = _asym_ref64(x, bits, group)
    step = scale.double().repeat_interleave(group, -1)
    # codes may differ from the oracle only at exact rounding ties (fp32 vs fp64 division): one step at most
    assert bool(((got - ref).abs() <= step * 1.001).all())
    assert (got - ref).abs().gt(1e-3 * step + 1e-6).float().mean() < 0.01  # beyond fp32 rounding: ties only
    assert bool(((got - x.double()).abs() <= step * (0.5 + 1e-5)).all())  # half a step from the input
    # min and max of every group are represented (up to parameter rounding)
    gx = x.unflatten(-1, (-1, group))
    assert torch.allclose(got.unflatten(-1, (-1, group)).amin(-1), gx.amin(-1).double(), atol=1e-5)


def test_symmetric_2bit_and_spec_formats_agree():
    x = _rows(4, 64)
    for bits in (4, 8):  # the general symmetric path is SPEC §1's, bit for bit
        c1, s1 = quantize_sym(x, bits, 16)
        c2, s2 = quantize(x, bits, 16)
        assert torch.equal(c1, c2) and torch.equal(s1, s2)
        assert torch.equal(dequantize_sym(c1, s1, bits, 16), dequantize(c2, s2, bits, 16))
    c, s = quantize_sym(x, 2, 16)
    q = unpack_codes(c, 2, signed=True)
    assert set(q.unique().tolist()) <= {-1, 0, 1}
    ref = torch.round(x.double().unflatten(-1, (-1, 16)) / s.double().unsqueeze(-1)).clamp(-1, 1)
    assert torch.equal(q.view(4, 4, 16).double(), ref)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_unpack_roundtrip_and_layout(bits):
    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, 2 ** bits, (3, 32), generator=g, dtype=torch.uint8)
    packed = pack_codes(q, bits)
    assert packed.shape == (3, 32 * bits // 8)
    assert torch.equal(unpack_codes(packed, bits, signed=False), q)
    if bits < 8:  # element j of a byte sits in bits [j·b, (j+1)·b): low bits first
        assert int(packed[0, 0]) & ((1 << bits) - 1) == int(q[0, 0])
    if bits == 3:  # 8 codes in 3 bytes: code 8i + j in bits [3j, 3j + 3) of the little-endian 24-bit word
        for i in range(4):
            word = sum(int(packed[1, 3 * i + k]) << (8 * k) for k in range(3))
            assert [(word >> (3 * j)) & 7 for j in range(8)] == q[1, 8 * i:8 * i + 8].tolist()
    signed = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), (3, 32), generator=g, dtype=torch.int8)
    assert torch.equal(unpack_codes(pack_codes(signed, bits), bits, signed=True), signed)


def test_hadamard_is_orthogonal_symmetric_and_refuses_other_sizes():
    for d in (1, 2, 64, 256):
        h = hadamard(d, torch.float64)
        assert torch.allclose(h @ h.T, torch.eye(d, dtype=torch.float64), atol=1e-12)
        assert torch.equal(h, h.T)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(96)


@pytest.mark.parametrize("spec", [
    StoreSpec(8, 64, rotation="hadamard"),
    StoreSpec(4, 32, asymmetric=True, rotation="hadamard"),
    StoreSpec(4, 32, asymmetric=True, rotation="hadamard", channel_group=32, residual=64, flush=32),
])
def test_rotation_reads_back_in_the_original_basis(spec):
    x = _rows(1, 2, 96, 64)
    store = make_store(spec, x, 256)
    store.write(0, x)
    inner = store.inner if isinstance(store, ResidualStore) else store
    r = inner.rotation
    assert r is not None and torch.allclose(r @ r.T, torch.eye(64), atol=1e-6)
    got = store.read(0, 96)
    # the reference: quantize x·R with the same format (no rotation), decode, rotate back with Rᵀ
    plain = make_store(StoreSpec(**{**spec.__dict__, "rotation": None}), x, 256)
    plain.write(0, x @ r)
    assert torch.allclose(got, plain.read(0, 96) @ r.T, atol=1e-5)
    # int8 with rotation is close to the input (identity of the read path, up to int8 rounding)
    if spec.bits == 8:
        assert (got - x).abs().max() < 0.02 * x.abs().max()


def test_rotation_spreads_an_outlier_channel():
    x = _rows(1, 1, 256, 64)
    errs = {}
    for rot in (None, "hadamard"):
        store = make_store(StoreSpec(4, 64, asymmetric=True, rotation=rot), x, 256)
        store.write(0, x)
        errs[rot] = (store.read(0, 256) - x).pow(2).mean().item()
    assert errs["hadamard"] < 0.5 * errs[None]


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_channel_grouped_keys_match_float64_reference(bits):
    g = 16
    x = _rows(2, 3, 64, 32)
    spec = StoreSpec(bits, 32, asymmetric=True, channel_group=g, residual=g, flush=g)
    store = ChannelQuantizedStore(spec, 2, 3, 64, 32, torch.float32, torch.device("cpu"))
    store.write(0, x)
    got = store.read(0, 64).double()
    # oracle: per (token group, channel) min/max over the group's tokens
    xt = x.double().unflatten(2, (-1, g)).transpose(-1, -2)  # (B, H, T/G, D, G)
    ref = _asym_ref64(xt, bits, g).transpose(-1, -2).flatten(2, 3)
    step = store.group_params(store.scale).double().repeat_interleave(g, 2)  # (B, H, T, D)
    assert bool(((got - ref).abs() <= step * 1.001).all())
    assert (got - ref).abs().gt(1e-3 * step + 1e-6).float().mean() < 0.01  # beyond fp32 rounding: ties only
    assert store.scale.shape == (2, 3, 64, 32 // g)
    with pytest.raises(ValueError, match="whole groups"):
        store.write(8, x[:, :, :g])


def test_residual_window_flushes_whole_groups_and_never_requantizes():
    x = _rows(1, 2, 400, 64, seed=3)
    spec = StoreSpec(4, 32, asymmetric=True, channel_group=32, residual=128, flush=32)
    store = make_store(spec, x, 512)
    assert isinstance(store, ResidualStore) and isinstance(store.inner, ChannelQuantizedStore)
    n, snapshots = 0, []
    for s in (200, 1, 1, 5, 60, 1, 70, 62):
        store.write(n, x[:, :, n:n + s])
        n += s
        assert store.flushed == spec.flushed(n) and store.flushed % 32 == 0
        assert 0 <= n - store.flushed <= 128 and (n < 128 or n - store.flushed > 128 - 32)
        # the window reads back exactly; coded history reads back as coded
        got = store.read(0, n)
        assert torch.equal(got[:, :, store.flushed:], x[:, :, store.flushed:n])
        snapshots.append((store.flushed, store.inner.data.clone(), store.inner.scale.clone(),
                          store.inner.zero.clone()))
        exact = (1 * 2 * (store.flushed * spec.bytes_per_value_row(64, torch.float32)
                          + (n - store.flushed) * 64 * 4))
        assert store.nbytes(n) == exact
    # codes of a flushed token never change afterwards
    for (f, data, scale, zero), (_, data2, scale2, zero2) in zip(snapshots, snapshots[1:]):
        assert torch.equal(data[:, :, :f], data2[:, :, :f])
        assert torch.equal(scale[:, :, :f], scale2[:, :, :f]) and torch.equal(zero[:, :, :f], zero2[:, :, :f])
    # a partial read across the boundary equals the slice of a full read
    full = store.read(0, n)
    assert torch.equal(store.read(37, n - 3), full[:, :, 37:n - 3])


def _tiny_llama(head_dim=32):
    cfg = LlamaConfig(vocab_size=97, hidden_size=4 * head_dim, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def test_generate_nbytes_equals_plan_and_window_is_exact():
    model = _tiny_llama()
    ids = torch.randint(0, 97, (2, 150), generator=torch.Generator().manual_seed(0))
    opts = dict(group_size=32, asymmetric=True, residual=64, key_channel_group=16, rotation="hadamard")
    plan = kvslim.apply(model, "int4", **opts)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                         return_dict_in_generate=True)
    cache = out.past_key_values
    n = out.sequences.shape[1] - 1
    assert cache.nbytes == plan.cache_bytes(n, batch=2)
    assert "bits/element" in str(plan) and "≤64 recent tokens" in plan.layers[0].note
    kvslim.restore(model)


@pytest.mark.parametrize("opts, name", [
    (dict(residual=129), "residual"),
    (dict(residual=-1), "residual"),
    (dict(rotation="walsh"), "rotation"),
    (dict(asymmetric="yes"), "asymmetric"),
    (dict(key_channel_group=32, residual=16), "key_channel_group"),
    (dict(key_channel_group=24, residual=48), "key_channel_group"),  # does not divide head_dim 32
    (dict(residual=64, flush=80), "flush"),
    (dict(residual=64, window=128), "residual"),
    (dict(group_size=5), "group_size"),
    (dict(colour="red"), "colour"),
])
def test_bad_options_are_refused_by_name_and_change_nothing(opts, name):
    model = _tiny_llama()
    plan = kvslim.apply(model, "int2", group_size=16)
    attn = model.config._attn_implementation
    with pytest.raises(ValueError, match=name):
        kvslim.apply(model, "int4", **opts)
    assert kvslim.get_plan(model) is plan and model.config._attn_implementation == attn
    kvslim.restore(model)


def test_value_bits_keep_keys_and_values_at_their_own_bits():
    """A layer spec with bits=3, value_bits=2: 3-bit KIVI keys and 2-bit per-token values, each equal to its
    float64 oracle on the flushed tokens, the window exact, bytes as the specs say."""
    from kvslim.caches.dense import AppendLayer

    spec = StoreSpec(3, 16, torch.float16, asymmetric=True, channel_group=32, residual=64, flush=32, value_bits=2)
    assert spec.for_values() == StoreSpec(2, 16, torch.float16, asymmetric=True, residual=64, flush=32)
    k, v = _rows(1, 2, 200, 32, seed=5), _rows(1, 2, 200, 32, seed=6, outlier=False)
    layer = AppendLayer(spec, chunk=64)
    layer.update(k[:, :, :199], v[:, :, :199])
    got_k, got_v = layer.update(k[:, :, 199:], v[:, :, 199:])
    f = spec.flushed(200)
    assert layer.k_store.inner.spec.bits == 3 and layer.v_store.inner.spec.bits == 2 and f == 160
    kt = k[:, :, :f].double().unflatten(2, (-1, 32)).transpose(-1, -2)  # (B, H, T/G, D, G)
    ref_k = _asym_ref64(kt, 3, 32, torch.float16).transpose(-1, -2).flatten(2, 3)
    ref_v = _asym_ref64(v[:, :, :f], 2, 16, torch.float16)
    for got, ref, store in ((got_k, ref_k, layer.k_store.inner), (got_v, ref_v, layer.v_store.inner)):
        err = (got[:, :, :f].double() - ref).abs()
        step = store.scale[:, :, :f].double().max()
        assert err.max() <= 1.001 * step  # a code may differ at exact rounding ties (fp32 vs fp64 division)
        assert err.gt(1e-3 * step).float().mean() < 0.01
    assert torch.equal(got_k[:, :, f:], k[:, :, f:]) and torch.equal(got_v[:, :, f:], v[:, :, f:])
    d = 32
    assert layer.nbytes == 2 * (f * (spec.bytes_per_value_row(d, torch.float32)
                                     + spec.for_values().bytes_per_value_row(d, torch.float32))
                                + 2 * (200 - f) * d * 4)
    with pytest.raises(ValueError, match="value_bits"):
        StoreSpec(3, 16, value_bits=5)
    with pytest.raises(ValueError, match="bits=3 packs 8"):
        StoreSpec(3, 4).check_dim(36)


def test_int2_default_is_three_bit_kivi_keys_and_two_bit_values():
    """``apply(model, "int2")``: 3-bit keys per channel over 64-token groups, 2-bit Hadamard-rotated values per
    token in groups of 64, fp16 scale + zero-point, 4 sink tokens and a 124-token window: 3.00 bits/element
    (docs/quantization.md);
    key_bits=2 gives pure 2-bit keys; bad key_bits / value_rotation refused by name."""
    cfg = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=2)
    plan = kvslim.plan_config(cfg, "int2", dtype="float32")
    lp = plan.layers[0]
    layer = lp.factory(None)
    assert layer.spec == StoreSpec(3, 64, torch.float16, asymmetric=True, channel_group=64, residual=124, flush=64,
                                   value_bits=2, value_rotation="hadamard", sink=4)
    assert layer.value_spec() == StoreSpec(2, 64, torch.float16, asymmetric=True, residual=124, flush=64,
                                           rotation="hadamard", sink=4)
    assert 8 * lp.bytes_per_token / (2 * 3 * 64) == 3.0
    assert ("K int3 asym g64 fp16 kivi-k64 r124/64 sink4, V int2 asym g64 fp16 hadamard r124/64 sink4: "
            "3.00 bits/element" in lp.note)
    pure = kvslim.plan_config(cfg, "int2", dtype="float32", key_bits=2, key_channel_group=32, group_size=32)
    assert pure.layers[0].factory(None).spec.bits == 2 and "value_bits" not in pure.layers[0].note
    for bad in (5, True, "3"):
        with pytest.raises(ValueError, match="key_bits"):
            kvslim.plan_config(cfg, "int2", dtype="float32", key_bits=bad)
    with pytest.raises(ValueError, match="key_bits"):
        kvslim.plan_config(cfg, "dense", dtype="float32", key_bits=3)
    with pytest.raises(ValueError, match="value_rotation"):
        kvslim.plan_config(cfg, "int2", dtype="float32", value_rotation="givens")
    cfg96 = LlamaConfig(hidden_size=576, num_attention_heads=6, num_key_value_heads=3, num_hidden_layers=1)
    plan96 = kvslim.plan_config(cfg96, "int2", dtype="float32")  # head dim 96: the default drops the rotation
    assert plan96.layers[0].factory(None).value_spec().rotation is None
    assert any("value_rotation=None" in n for n in plan96.notes)
    with pytest.raises(ValueError, match="value_rotation='hadamard'"):  # asked for explicitly: refused by name
        kvslim.plan_config(cfg96, "int2", dtype="float32", value_rotation="hadamard")


def test_int4_default_is_kivi_keys_rotated_values_and_sink_tokens():
    """``apply(model, "int4")``: KIVI keys over 32-token groups, Hadamard-rotated values in groups of 64, fp16
    scale + zero-point, the first 4 tokens and a 124-token window in full precision: 4.75 bits/element of codes,
    as the plan prints; an explicit residual=128 leaves no room for the default sinks (noted)."""
    cfg = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=2)
    lp = kvslim.plan_config(cfg, "int4", dtype="float32").layers[0]
    layer = lp.factory(None)
    assert layer.spec == StoreSpec(4, 64, torch.float16, asymmetric=True, channel_group=32, residual=124, flush=32,
                                   value_rotation="hadamard", sink=4)
    assert layer.value_spec().rotation == "hadamard" and layer.value_spec().bits == 4
    assert 8 * lp.bytes_per_token / (2 * 3 * 64) == 4.75
    assert "V int4 asym g64 fp16 hadamard r124/32 sink4: 4.75 bits/element" in lp.note
    assert "the first 4 and ≤124 recent tokens" in lp.note
    plan = kvslim.plan_config(cfg, "int4", dtype="float32", residual=128)
    assert plan.layers[0].factory(None).spec.sink == 0 and any("sink=0" in n for n in plan.notes)
    assert kvslim.plan_config(cfg, "int4", dtype="float32", residual=0, key_channel_group=0).layers[0].factory(
        None).spec.sink == 0


def test_value_rotation_rotates_values_only_and_reads_back_in_the_original_basis():
    spec = StoreSpec(4, 32, torch.float16, asymmetric=True, value_rotation="hadamard")
    assert spec.rotation is None and spec.for_values().rotation == "hadamard"
    assert StoreSpec(4, 32, rotation="hadamard", value_rotation="none").for_values().rotation is None
    x = _rows(1, 2, 40, 64, seed=7)
    plain, rotated = make_store(StoreSpec(4, 32, torch.float16, asymmetric=True), x, 64), \
        make_store(spec.for_values(), x, 64)
    for store in (plain, rotated):
        store.write(0, x)
    err_plain = (plain.read(0, 40) - x).abs().max()
    err_rot = (rotated.read(0, 40) - x).abs().max()
    ref = _asym_ref64(x.double() @ hadamard(64, torch.float64), 4, 32, torch.float16) @ hadamard(64, torch.float64)
    assert (rotated.read(0, 40).double() - ref).abs().max() < 0.2 * err_rot + 1e-4  # oracle in the rotated basis
    assert err_rot < err_plain  # the outlier channel is spread (the reason values are rotated)
    with pytest.raises(ValueError, match="value_rotation"):
        StoreSpec(0, value_rotation="hadamard")


def test_int2_default_is_at_most_three_bits_per_element():
    cfg = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=2)
    plan = kvslim.plan_config(cfg, "int2", dtype="float32")
    lp = plan.layers[0]
    bits = 8 * lp.bytes_per_token / (2 * 3 * 64)
    assert bits <= 3.0 and lp.residual <= 128
    assert isinstance(QuantizedStore, type)


@pytest.mark.parametrize("channel_group", [16, 0])
def test_sink_tokens_stay_exact_and_the_rest_is_a_residual_store_shifted_by_them(channel_group):
    """``sink=S``: tokens [0, S) read back exactly forever; tokens [S, n) read back as a plain residual store fed
    only those tokens (the sinks take no part in any group's range); flush points, bytes and rewinds agree."""
    from kvslim.caches.sink import SinkStore

    x = _rows(1, 2, 300, 32, seed=7)
    x[:, :, 0] *= 40  # a sink-like outlier token: it must not widen the first group's range
    common = dict(asymmetric=True, channel_group=channel_group, residual=48, flush=16)
    spec, plain = StoreSpec(4, 16, torch.float16, sink=3, **common), StoreSpec(4, 16, torch.float16, **common)
    store, ref = make_store(spec, x, 320), make_store(plain, x, 320)
    assert isinstance(store, SinkStore)
    n = 0
    for s in (2, 1, 100, 1, 1, 37, 1, 60):
        store.write(n, x[:, :, n:n + s])
        if n + s > 3:
            ref.write(max(0, n - 3), x[:, :, max(3, n):n + s])
        n += s
        got = store.read(0, n)
        assert torch.equal(got[:, :, :3], x[:, :, :min(n, 3)]) if n >= 3 else torch.equal(got, x[:, :, :n])
        if n > 3:
            assert torch.equal(got[:, :, 3:], ref.read(0, n - 3))
            assert store.flushed == spec.flushed(n) == 3 + ref.flushed
            assert store.nbytes(n) == ref.nbytes(n - 3) + 2 * 3 * 32 * 4
        assert torch.equal(store.read(1, n), got[:, :, 1:])
    store.write(2, x[:, :, 2:5])  # rewind into the sinks: later tokens are forgotten, the sinks rewritten
    assert store.length == 5 and torch.equal(store.read(0, 5), x[:, :, :5])
    with pytest.raises(ValueError, match="past"):
        store.write(9, x[:, :, :1])


def test_sink_option_is_validated_and_shares_the_128_full_precision_tokens():
    from kvslim.methods.storage import StorageOptions

    for bad, name in ((dict(sink=-1, residual=64), "sink"), (dict(sink=True, residual=64), "sink"),
                      (dict(sink=4), "sink"), (dict(sink=8, residual=124), "sink")):
        with pytest.raises(ValueError, match=name):
            StorageOptions(bits=4, **bad)
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)
    spec = kvslim.plan_config(cfg, "int4", dtype="float32", sink=2, residual=64).layers[0].factory(None).spec
    assert spec.sink == 2 and spec.for_values().sink == 2
    with pytest.raises(ValueError, match="sink"):  # a ring keeps no window, so no sinks
        kvslim.plan_config(cfg, "int4", dtype="float32", sink=2, window=64)
    plan = kvslim.plan_config(cfg, "int4", dtype="float32", sink=2, residual=64)
    assert "the first 2 and ≤64 recent tokens" in plan.layers[0].note


def test_generate_with_sinks_nbytes_equals_plan():
    model = _tiny_llama()
    ids = torch.randint(0, 97, (2, 150), generator=torch.Generator().manual_seed(0))
    plan = kvslim.apply(model, "int4", group_size=32, asymmetric=True, residual=60, key_channel_group=16, sink=4)
    try:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                             return_dict_in_generate=True)
        n = out.sequences.shape[1] - 1
        assert out.past_key_values.nbytes == plan.cache_bytes(n, batch=2)
    finally:
        kvslim.restore(model)


def test_int3_default_is_three_bit_keys_and_rotated_values():
    """``apply(model, "int3")``: 3-bit KIVI keys over 64-token groups, 3-bit rotated values in groups of
    64, fp16 scale + zero-point, 4 sinks and a 124-token window: 3.50 bits/element, as the plan prints; codes
    read back within the 3-bit step."""
    cfg = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=2)
    lp = kvslim.plan_config(cfg, "int3", dtype="float32").layers[0]
    layer = lp.factory(None)
    assert layer.spec == StoreSpec(3, 64, torch.float16, asymmetric=True, channel_group=64, residual=124, flush=64,
                                   value_rotation="hadamard", sink=4)
    assert layer.value_spec() == StoreSpec(3, 64, torch.float16, asymmetric=True, residual=124, flush=64,
                                           rotation="hadamard", sink=4)
    assert 8 * lp.bytes_per_token / (2 * 3 * 64) == 3.5
    assert "3.50 bits/element" in lp.note
    x = _rows(1, 2, 192, 64, seed=3)
    store = make_store(layer.value_spec(), x, 256)
    store.write(0, x)  # 192 tokens: 4 sinks, 64 coded, 124 in the window
    assert store.flushed == 68
    err = store.read(0, 192)[:, :, 4:68].float() - x[:, :, 4:68].float()  # the coded tokens
    xr = x[:, :, 4:68].float() @ hadamard(64)  # their rows in the stored (rotated) basis
    half_step = (xr.amax(-1) - xr.amin(-1)) / 7 / 2  # one fp16 group of 64 per row: half a 3-bit step
    assert (err.norm(dim=-1) <= 64 ** 0.5 * half_step * 1.01).all()  # rotation keeps the row's L2 error
    assert err.abs().max() > 0 and torch.equal(store.read(0, 192)[:, :, 68:], x[:, :, 68:])  # window exact
