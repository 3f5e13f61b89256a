"""The fused int8/int4 decode op (``torch.ops.kvslim.quant_decode``) against its pure-torch twin and a float64
oracle; the fused decode path of quantized caches against the unfused one (greedy tokens, logits); memory
safety (NaN-poisoned slots past a sequence's length, named errors, torch.compile of a call to the op)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import INT8_SCORES_ATOL, INT8_SCORES_LOGIT_ATOL, INT8_VALUES_TWIN_ATOL, assert_close

import kvslim
from kvslim.adapters.compat import CACHE_KW
from kvslim.caches.residual import ChannelQuantizedStore
from kvslim.caches.storage import QuantizedStore, StoreSpec
from kvslim.kernels import quant_decode as kernel
from kvslim.ops.quant import quantize
from kvslim.ops.quant_formats import quantize_asym

F32 = torch.float32


def _ops():
    if not kernel.available():
        pytest.skip("no C++ compiler: the op cannot be built here (its twin is used)")


def _codes(b, h, n, d, bits, gs, asym, sdt, gen):
    x = torch.randn(b, h, n, d, generator=gen) * 2
    if asym:
        return quantize_asym(x, bits, gs, sdt)
    c, s = quantize(x, bits, gs, sdt)
    return c, s, None


def _oracle(q, kc, ks, kz, vc, vs, vz, bits, gs, kivi, n, lengths, kt, vt, mask, scaling):
    """float64: the values the codes stand for, masked softmax attention, token by token sequence."""
    keys = kernel.dequantize_codes(kc[:, :, :-(-n // kivi) * kivi if kivi else n], ks[:, :, :-(-n // kivi) * kivi
                                   if kivi else n], None if kz is None else kz[:, :, :-(-n // kivi) * kivi if kivi
                                   else n], bits, gs, kivi)[:, :, :n].double()
    values = kernel.dequantize_codes(vc[:, :, :n], vs[:, :, :n], None if vz is None else vz[:, :, :n], bits,
                                     gs).double()
    b = q.shape[0]
    outs = []
    for i in range(b):
        ln = n if lengths is None else int(lengths[i])
        k, v = keys[i, :, :ln], values[i, :, :ln]
        cols = torch.arange(ln)
        if kt is not None:
            k, v = torch.cat((k, kt[i].double()), 1), torch.cat((v, vt[i].double()), 1)
            cols = torch.cat((cols, n + torch.arange(kt.shape[2])))
        s = torch.einsum("hgd,htd->hgt", q[i].double(), k) * scaling
        if mask is not None:
            s = s + mask[min(i, mask.shape[0] - 1), cols].double()
        outs.append(torch.softmax(s, -1).nan_to_num(0.0) @ v)
    return torch.stack(outs)


CASES = [  # (head dim, group size, GQA group, bits, asymmetric, scale dtype)
    (64, 32, 1, 8, False, torch.float32), (64, 64, 3, 4, False, torch.float16),
    (64, 32, 7, 4, True, torch.bfloat16), (80, 16, 1, 4, False, torch.float32),
    (80, 40, 3, 8, True, torch.float16), (128, 128, 1, 4, True, torch.float32),
    (128, 64, 7, 8, False, torch.bfloat16), (128, 32, 3, 4, False, torch.float32),
    (256, 128, 3, 8, False, torch.float32), (256, 64, 1, 4, True, torch.float16),
    (36, 12, 3, 4, False, torch.float32), (36, 18, 1, 8, True, torch.float32),  # scalar path (D % 8 != 0)
]


@pytest.mark.parametrize("scores", ["exact", "int8"])
@pytest.mark.parametrize("d,gs,g,bits,asym,sdt", CASES)
def test_op_matches_twin_and_float64(d, gs, g, bits, asym, sdt, scores):
    """Odd lengths, different lengths per sequence, a masked token, a tail; forced splits agree. Exact scores: op
    and twin equal the float64 oracle; int8 scores: the op equals its twin (same query rounding), both within the
    documented loss of the oracle (exactly equal where the format keeps exact scores)."""
    _ops()
    gen = torch.Generator().manual_seed(d * 7 + gs + g + bits)
    b, h, n = 3, 2, 131
    kc, ks, kz = _codes(b, h, n + 9, d, bits, gs, asym, sdt, gen)
    vc, vs, vz = _codes(b, h, n + 9, d, bits, gs, asym, sdt, gen)
    q = torch.randn(b, h, g, d, generator=gen)
    lengths = torch.tensor([n, 57, 1])
    kt, vt = torch.randn(b, h, 3, d, generator=gen), torch.randn(b, h, 3, d, generator=gen)
    mask = torch.zeros(b, n + 3)
    mask[0, 5] = mask[1, n + 1] = float("-inf")
    mask[2, 40] = -3.0
    args = (q, kc, ks, kz, vc, vs, vz, bits, gs, 0, n, lengths, kt, vt, mask, d ** -0.5)
    ref, ref_lse = kernel.reference(*args, scores=scores, values="exact")
    oracle = _oracle(*args)
    lossy = scores == "int8" and kernel.int_scores_apply(bits, asym, d, gs, 0)
    err = (ref.double() - oracle).abs().max().item()
    assert err <= (INT8_SCORES_ATOL if lossy else 1e-4), f"twin ({scores}) vs float64: {err:.3e}"
    for splits in (0, 1, 3):
        out, lse = kernel.quant_decode(*args, splits=splits, scores=scores, values="exact")
        assert_close(out, ref, F32, f"op (splits={splits}, {scores}) vs twin")
        assert_close(lse, ref_lse, F32, f"lse (splits={splits}, {scores})")
        if not lossy:
            assert_close(out, oracle, F32, f"op (splits={splits}) vs float64")


@pytest.mark.parametrize("bits,asym,sdt,d,g,heads", [
    (8, False, torch.float32, 64, 32, 2), (4, True, torch.float16, 64, 32, 2), (4, False, torch.bfloat16, 64, 32, 2),
    (4, True, torch.float16, 80, 40, 3), (8, True, torch.float16, 128, 32, 7), (4, True, torch.float32, 256, 64, 1),
    (4, True, torch.float16, 128, 16, 3)])
def test_kivi_keys_match_the_store_reads(bits, asym, sdt, d, g, heads):
    """Per-channel keys over token groups (ChannelQuantizedStore): op == twin == attention over the store's reads
    (token groups that straddle the kernel's blocks, GQA head chunks)."""
    _ops()
    torch.manual_seed(1)
    b, h, n = 2, 3, 3 * g
    spec = StoreSpec(bits, 32 if d % 32 == 0 else 16, sdt, asymmetric=asym, channel_group=g, residual=g, flush=g)
    ks = ChannelQuantizedStore(spec, b, h, 4 * g, d, F32, torch.device("cpu"))
    vs = QuantizedStore(spec.for_values(), b, h, 4 * g, d, F32, torch.device("cpu"))
    ks.write(0, torch.randn(b, h, n, d))
    vs.write(0, torch.randn(b, h, n, d))
    q = torch.randn(b, h, heads, d)
    lengths = torch.tensor([n - 7, g + 5])
    for splits in (0, 2):
        args = (q, ks.data, ks.scale, ks.zero, vs.data, vs.scale, vs.zero, bits, spec.group_size, g, n - 7, lengths)
        out, _ = kernel.quant_decode(*args, scaling=0.1, splits=splits, scores="exact")
        ref, _ = kernel.reference(*args, scaling=0.1, scores="exact")
        out8, _ = kernel.quant_decode(*args, scaling=0.1, splits=splits, scores="int8")
        ref8, _ = kernel.reference(*args, scaling=0.1, scores="int8")
        assert_close(out8, ref8, F32, f"int8 scores: op vs twin (splits={splits})")
        keys, values = ks.read(0, n).double(), vs.read(0, n).double()
        s = torch.einsum("bhgd,bhtd->bhgt", q.double(), keys) * 0.1
        s[..., n - 7:] = float("-inf")
        s[1, ..., g + 5:] = float("-inf")
        oracle = torch.einsum("bhgt,bhtd->bhgd", s.softmax(-1), values)
        assert_close(ref, oracle, F32, "twin vs store reads")
        assert_close(out, oracle, F32, f"op vs store reads (splits={splits})")
        assert (ref8.double() - oracle).abs().max().item() <= INT8_SCORES_ATOL


@pytest.mark.parametrize("bits,d,g,values", [(4, 64, 3, "int8"), (4, 64, 1, "exact"), (8, 128, 7, "exact"),
                                              (4, 128, 2, "int8")])
def test_rotated_value_codes_are_taken_back_inside_the_op(bits, d, g, values):
    """Values coded as v·R (Hadamard): with ``v_unrot`` = Rᵀ the op rotates the coded tokens' weighted sum back
    itself and adds the tail in the values' own basis. op == twin, both == float64 attention over the store's
    reads (original basis) and the raw tail, for forced splits and ragged lengths; a wrong ``v_unrot`` is refused
    by name."""
    _ops()
    gen = torch.Generator().manual_seed(bits + d + g)
    b, h, n = 3, 2, 150
    spec = StoreSpec(bits, 64, torch.float16, asymmetric=True, rotation="hadamard")
    ks = QuantizedStore(StoreSpec(bits, 64, torch.float16, asymmetric=True), b, h, n, d, F32, torch.device("cpu"))
    vs = QuantizedStore(spec, b, h, n, d, F32, torch.device("cpu"))
    ks.write(0, torch.randn(b, h, n, d, generator=gen))
    vs.write(0, torch.randn(b, h, n, d, generator=gen) * 2)
    assert vs.unrotation is not None and torch.equal(vs.unrotation, vs.rotation.T)
    q = torch.randn(b, h, g, d, generator=gen)
    kt, vt = torch.randn(b, h, 5, d, generator=gen), torch.randn(b, h, 5, d, generator=gen)
    lengths = torch.tensor([n, 61, 2])
    args = (q, ks.data, ks.scale, ks.zero, vs.data, vs.scale, vs.zero, bits, 64, 0, n, lengths, kt, vt, None, 0.125)
    ref, _ = kernel.reference(*args, scores="exact", values=values, v_unrot=vs.unrotation)
    keys, vals = ks.read(0, n).double(), vs.read(0, n).double()  # reads: the original basis
    oracle = []
    for i, ln in enumerate(lengths.tolist()):
        k, v = torch.cat((keys[i, :, :ln], kt[i].double()), 1), torch.cat((vals[i, :, :ln], vt[i].double()), 1)
        oracle.append(torch.softmax(torch.einsum("hgd,htd->hgt", q[i].double(), k) * 0.125, -1) @ v)
    oracle = torch.stack(oracle)
    lossy = values == "int8" and kernel.int_values_apply(bits, True, d, 64)
    err = (ref.double() - oracle).abs().max().item()
    assert err <= (INT8_SCORES_ATOL if lossy else 1e-4), f"twin vs float64: {err:.3e}"
    for splits in (0, 1, 3):
        out, _ = kernel.quant_decode(*args, splits=splits, scores="exact", values=values, v_unrot=vs.unrotation)
        err = (out - ref).abs().max().item()
        assert err <= (INT8_VALUES_TWIN_ATOL if lossy else 1e-5), f"op vs twin (splits={splits}): {err:.3e}"
        if not lossy:
            assert_close(out, oracle, F32, f"op (splits={splits}) vs float64")
    wrong, _ = kernel.quant_decode(*args, scores="exact", values=values)  # the rotation left in: far off
    assert (wrong.double() - oracle).abs().max().item() > 0.1
    for bad in (torch.eye(d + 1), torch.eye(d, dtype=torch.float64), torch.ones(d)):
        with pytest.raises(ValueError, match="v_unrot must be a float32 CPU tensor of shape"):
            kernel.quant_decode(*args, v_unrot=bad)
        with pytest.raises(ValueError, match="v_unrot must be a float32 CPU tensor of shape"):  # the op's own check
            torch.ops.kvslim.quant_decode(q, ks.data, ks.scale, ks.zero, vs.data, vs.scale, vs.zero, bits, 64, 0, n,
                                          lengths, kt, vt, None, 0.125, 0, False, False, bad)


def test_never_reads_past_a_sequence_length():
    """Scales and zero-points NaN past each sequence's length: the result stays finite and equal to the twin's."""
    _ops()
    gen = torch.Generator().manual_seed(3)
    b, h, n, d = 2, 2, 70, 64
    for bits, asym in ((8, False), (4, True)):
        kc, ks, kz = _codes(b, h, n, d, bits, 32, asym, F32, gen)
        vc, vs, vz = _codes(b, h, n, d, bits, 32, asym, F32, gen)
        lengths = torch.tensor([33, 64])
        for t in (ks, vs) + ((kz, vz) if asym else ()):
            t[0, :, 33:] = float("nan")
            t[1, :, 64:] = float("nan")
        q = torch.randn(b, h, 3, d, generator=gen)
        args = (q, kc, ks, kz, vc, vs, vz, bits, 32, 0, n, lengths)
        for scores in ("exact", "int8"):
            out, lse = kernel.quant_decode(*args, splits=3, scores=scores)
            ref, _ = kernel.reference(*args, scores=scores)
            assert torch.isfinite(out).all() and torch.isfinite(lse).all()
            assert_close(out, ref, F32, f"int{bits} poisoned slots ({scores})")


@pytest.mark.parametrize("d,g,gs", [(64, 3, 64), (128, 7, 64), (256, 1, 128), (64, 1, 32), (80, 3, 80)])
def test_int8_values_match_twin_and_stay_close_to_float64(d, g, gs):
    """values="int8" (uint8 weights per 16-token sub-block × unsigned int4 codes): op == twin across splits, ragged
    lengths with NaN-poisoned parameters past them, masked tokens and a tail; within the documented loss of the
    float64 oracle (formats it does not take: exactly the exact path)."""
    _ops()
    gen = torch.Generator().manual_seed(d + g)
    b, h, n = 3, 2, 157
    kc, ks, kz = _codes(b, h, n, d, 4, gs, True, torch.float16, gen)
    vc, vs, vz = _codes(b, h, n, d, 4, gs, True, torch.float16, gen)
    lengths = torch.tensor([n, 61, 17])
    for i, ln in enumerate(lengths.tolist()):
        for t in (ks, kz, vs, vz):
            t[i, :, ln:] = float("nan")
    q = torch.randn(b, h, g, d, generator=gen)
    kt, vt = torch.randn(b, h, 2, d, generator=gen), torch.randn(b, h, 2, d, generator=gen)
    mask = torch.zeros(b, n + 2)
    mask[0, 3] = mask[1, 40] = float("-inf")
    args = (q, kc, ks, kz, vc, vs, vz, 4, gs, 0, n, lengths, kt, vt, mask, d ** -0.5)
    ref, _ = kernel.reference(*args, scores="exact", values="int8")
    oracle = _oracle(*args)
    err = (ref.double() - oracle).abs().max().item()
    lossy = kernel.int_values_apply(4, True, d, gs)
    assert err <= (INT8_SCORES_ATOL if lossy else 1e-4), f"twin vs float64: {err:.3e}"
    for splits in (0, 2):
        for scores in ("exact", "int8"):
            out, lse = kernel.quant_decode(*args, splits=splits, scores=scores, values="int8")
            want, want_lse = kernel.reference(*args, scores=scores, values="int8")
            assert torch.isfinite(out).all()
            err = (out - want).abs().max().item()
            assert err <= (INT8_VALUES_TWIN_ATOL if lossy else 1e-4), f"op vs twin (splits={splits}, {scores}): {err}"
            assert_close(lse, want_lse, F32, "lse")


@pytest.mark.parametrize("kivi,g,d,asym", [(32, 3, 64, True), (32, 1, 64, True), (32, 2, 64, False), (0, 2, 64, True),
                                          (64, 7, 64, True), (32, 3, 128, True), (0, 1, 192, True)])
def test_every_instruction_set_gives_the_twins_result(kivi, g, d, asym):
    """Each path the CPU has (scalar, AVX2, AVX-512, AVX-512 VNNI; ``quant_decode_set_isa``) on the integer score and
    value paths, KIVI keys and per-token keys, NaN-poisoned slots past ragged lengths: every one within the twin's
    tolerance, and AVX-512 with and without VNNI bit-identical (the same integer sums, the same float code)."""
    _ops()
    gen = torch.Generator().manual_seed(kivi + g)
    b, h, n = 3, 2, 197
    x = torch.randn(b, h, 256, d, generator=gen) * 2  # slots past n: a whole KIVI group and more
    spec = StoreSpec(4, 64, torch.float16, asymmetric=asym, channel_group=kivi, residual=128, flush=kivi) if kivi else None
    if kivi:
        ks_store = ChannelQuantizedStore(spec, b, h, 256, d, F32, torch.device("cpu"))
        ks_store.write(0, x)
        kc, ks, kz = ks_store.data, ks_store.scale, ks_store.zero
    else:
        kc, ks, kz = _codes(b, h, 256, d, 4, 64, True, torch.float16, gen)
    vc, vs, vz = _codes(b, h, 256, d, 4, 64, asym, torch.float16, gen)
    lengths = torch.tensor([n, 70, 5])
    for i, ln in enumerate(lengths.tolist()):
        for t in [p for p in ((vs, vz) if kivi else (ks, kz, vs, vz)) if p is not None]:
            t[i, :, ln:] = float("nan")
    q = torch.randn(b, h, g, d, generator=gen)
    kt, vt = torch.randn(b, h, 4, d, generator=gen), torch.randn(b, h, 4, d, generator=gen)
    args = (q, kc, ks, kz, vc, vs, vz, 4, 64, kivi, n, lengths, kt, vt, None, d ** -0.5)
    want, _ = kernel.reference(*args, scores="int8", values="int8")
    best = kernel.isa(d)
    order = ["scalar", "avx2", "avx512", "avx512_vnni"]
    outs = {}
    previous = torch.ops.kvslim.quant_decode_set_isa(best)
    try:
        for isa in order[:order.index(best) + 1]:
            torch.ops.kvslim.quant_decode_set_isa(isa)
            assert kernel.isa(d) == isa
            outs[isa], _ = kernel.quant_decode(*args, splits=2, scores="int8", values="int8")
            err = (outs[isa] - want).abs().max().item()
            assert err <= INT8_VALUES_TWIN_ATOL, f"{isa}: op vs twin {err:.3e}"
    finally:
        torch.ops.kvslim.quant_decode_set_isa(previous)
    assert kernel.isa(d) == best
    if "avx512_vnni" in outs:
        assert torch.equal(outs["avx512"], outs["avx512_vnni"]), "VNNI changed the integer sums"
    with pytest.raises(ValueError, match="isa must be one of"):
        torch.ops.kvslim.quant_decode_set_isa("avx10")


def test_fully_masked_sequence_gives_zeros():
    _ops()
    gen = torch.Generator().manual_seed(4)
    kc, ks, _ = _codes(2, 1, 20, 64, 8, 64, False, F32, gen)
    mask = torch.zeros(2, 20)
    mask[1] = float("-inf")
    out, lse = kernel.quant_decode(torch.randn(2, 1, 1, 64), kc, ks, None, kc, ks, None, 8, 64, 0, 20, mask=mask)
    assert (out[1] == 0).all() and lse[1].item() == float("-inf") and torch.isfinite(out[0]).all()


@settings(max_examples=12, deadline=None)
@given(d=st.sampled_from([32, 48, 64, 80, 128, 256]), g=st.sampled_from([1, 2, 3, 7]), bits=st.sampled_from([4, 8]),
       asym=st.booleans(), n=st.integers(1, 300), tail=st.integers(0, 5), b=st.integers(1, 3),
       splits=st.integers(0, 4), seed=st.integers(0, 2 ** 16), gs=st.sampled_from([16, 32, 64]),
       scores=st.sampled_from(["exact", "int8"]), values=st.sampled_from(["exact", "int8"]))
def test_fuzz_op_vs_twin(d, g, bits, asym, n, tail, b, splits, seed, gs, scores, values):
    _ops()
    gen = torch.Generator().manual_seed(seed)
    gs = gs if d % gs == 0 else 16
    kc, ks, kz = _codes(b, 2, n, d, bits, gs, asym, F32, gen)
    vc, vs, vz = _codes(b, 2, n, d, bits, gs, asym, F32, gen)
    q = torch.randn(b, 2, g, d, generator=gen)
    lengths = torch.randint(1, n + 1, (b,), generator=gen)
    kt = vt = None
    if tail:
        kt, vt = torch.randn(b, 2, tail, d, generator=gen), torch.randn(b, 2, tail, d, generator=gen)
    args = (q, kc, ks, kz, vc, vs, vz, bits, gs, 0, n, lengths, kt, vt, None, 0.2)
    out, lse = kernel.quant_decode(*args, splits=splits, scores=scores, values=values)
    ref, ref_lse = kernel.reference(*args, scores=scores, values=values)
    if values == "int8" and kernel.int_values_apply(bits, asym, d, gs):
        assert (out - ref).abs().max().item() <= INT8_VALUES_TWIN_ATOL
    else:
        assert_close(out, ref, F32, "fuzz out")
    assert_close(lse, ref_lse, F32, "fuzz lse")


def test_bad_input_is_refused_by_name():
    _ops()
    gen = torch.Generator().manual_seed(5)
    kc, ks, _ = _codes(1, 2, 10, 64, 8, 32, False, F32, gen)
    q = torch.randn(1, 2, 1, 64)
    with pytest.raises(ValueError, match="group_size"):
        torch.ops.kvslim.quant_decode(q, kc, ks, None, kc, ks, None, 8, 48, 0, 10, None, None, None, None, 1.0)
    with pytest.raises(ValueError, match="k_codes"):
        torch.ops.kvslim.quant_decode(q, kc, ks, None, kc, ks, None, 8, 32, 0, 11, None, None, None, None, 1.0)
    with pytest.raises(ValueError, match="codes must be"):
        torch.ops.kvslim.quant_decode(q, kc.view(torch.uint8), ks, None, kc, ks, None, 8, 32, 0, 10, None, None,
                                      None, None, 1.0)
    with pytest.raises(ValueError, match="lengths"):
        torch.ops.kvslim.quant_decode(q, kc, ks, None, kc, ks, None, 8, 32, 0, 10, torch.tensor([11]), None, None,
                                      None, 1.0)
    with pytest.raises(ValueError, match="mask"):
        torch.ops.kvslim.quant_decode(q, kc, ks, None, kc, ks, None, 8, 32, 0, 10, None, None, None,
                                      torch.zeros(1, 9), 1.0)


def test_torch_compile_of_a_call_to_the_op():
    """The fake impl traces (aot_eager: fake tensors, functionalization) and the compiled call gives the op's result."""
    _ops()
    gen = torch.Generator().manual_seed(6)
    kc, ks, _ = _codes(2, 2, 40, 64, 4, 32, False, F32, gen)
    q = torch.randn(2, 2, 3, 64)

    def f(q, kc, ks):
        out, lse = torch.ops.kvslim.quant_decode(q, kc, ks, None, kc, ks, None, 4, 32, 0, 40, None, None, None, None,
                                                 0.125)
        return out * 2, lse

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got, want = compiled(q, kc, ks), f(q, kc, ks)
    assert_close(got[0], want[0], F32, "compiled out")
    assert_close(got[1], want[1], F32, "compiled lse")


def _tiny(kv_heads: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


FORMATS = [("int8", {}), ("int4", {}),
           ("int4", dict(asymmetric=True, scale_dtype="float16", key_channel_group=32, residual=64, group_size=32)),
           ("int4", dict(rotation="hadamard", residual=32)), ("int8", dict(window=16)),
           ("int4", dict(window=64, asymmetric=True)),
           ("int4", dict(asymmetric=True, key_channel_group=32, residual=32, group_size=32, sink=4))]


def _cache(model, fused: bool):
    """``kvslim.make_cache`` (which turns fused decode on for kvslim's attention), then fused decode on or off."""
    cache = kvslim.make_cache(model)
    assert all(layer.fused_decode for layer in cache.layers)
    for layer in cache.layers:
        layer.fused_decode = fused
    return cache


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_greedy_tokens_match_the_unfused_path(kv_heads, monkeypatch):
    """Padded batch, 12 new tokens: every decode step takes the kernel, tokens equal the unfused path's, and a
    decode step's logits agree with it to fp32 rounding (windows shorter and longer than the context)."""
    _ops()
    from kvslim.adapters import sdpa

    monkeypatch.setenv("KVSLIM_QUANT_SCORES", "exact")  # the exact paths are the unfused path's twins
    monkeypatch.setenv("KVSLIM_QUANT_VALUES", "exact")
    model = _tiny(kv_heads)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    taken = []
    decode = sdpa.quant.decode
    monkeypatch.setattr(sdpa.quant, "decode", lambda *a: taken.append(decode(*a) is not None) or decode(*a))
    for method, opts in FORMATS:
        if kv_heads == 2 and method == "int8" and opts:
            continue
        kvslim.apply(model, method, **opts)
        try:
            with torch.no_grad():
                runs = []
                for fused in (True, False):
                    cache = _cache(model, fused)
                    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                         **{CACHE_KW: cache})
                    step = model(out[:, -1:], attention_mask=torch.cat((mask, torch.ones(2, 12, dtype=mask.dtype)),
                                                                       1), **{CACHE_KW: cache}).logits
                    runs.append((out, step))
        finally:
            kvslim.restore(model)
        assert torch.equal(runs[0][0], runs[1][0]), f"{method} {opts}: greedy tokens differ"
        assert_close(runs[0][1], runs[1][1], F32, f"{method} {opts}: decode logits")
    assert taken and all(taken)


def test_make_cache_turns_fused_decode_on_only_for_kvslim_attention():
    _ops()
    model = _tiny(4)
    kvslim.apply(model, "int8")
    try:
        assert all(layer.fused_decode for layer in kvslim.make_cache(model).layers)
    finally:
        kvslim.restore(model)
    kvslim.apply(model, "dense")
    try:
        assert not any(layer.fused_decode for layer in kvslim.make_cache(model).layers)
    finally:
        kvslim.restore(model)


def test_isa_names_a_path():
    assert kernel.isa(64) in ("avx512_vnni", "avx512", "avx2", "scalar", "twin")


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_int8_scores_stay_close_to_the_unfused_path(kv_heads, monkeypatch):
    """The integer paths (int8-rounded query; weights for int4 values) end to end: a padded batch decodes through the kernel with
    logits within the documented loss of the unfused (exact) path, formats whose keys take integer scores
    (int8 g64, int4 KIVI asymmetric, int4 old format) and one that does not (head dim 64 with 32-channel int4
    groups keeps exact scores)."""
    _ops()
    monkeypatch.delenv("KVSLIM_QUANT_SCORES", raising=False)
    monkeypatch.delenv("KVSLIM_QUANT_VALUES", raising=False)
    assert kernel.default_scores(4) == kernel.default_values(4) == "int8"  # 4-bit codes: integer paths by default
    assert kernel.default_scores(8) == kernel.default_values(8) == "exact"
    monkeypatch.setenv("KVSLIM_QUANT_SCORES", "int8")  # int8 codes too, through the override
    model = _tiny(kv_heads)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    full = torch.cat((mask, torch.ones(2, 1, dtype=mask.dtype)), 1)
    for method, opts in [("int8", {}), ("int4", {}), FORMATS[2], ("int4", dict(asymmetric=False, residual=0,
                                                                            key_channel_group=0, value_rotation="none",
                                                                            scale_dtype="float32"))]:
        kvslim.apply(model, method, **opts)
        try:
            with torch.no_grad():
                logits = []
                for fused in (True, False):
                    cache = _cache(model, fused)
                    model(ids, attention_mask=mask, **{CACHE_KW: cache})
                    logits.append(model(ids[:, -1:], attention_mask=full, **{CACHE_KW: cache}).logits)
        finally:
            kvslim.restore(model)
        err = (logits[0] - logits[1]).abs().max().item()
        assert err <= INT8_SCORES_LOGIT_ATOL, f"{method} {opts}: max|Δlogit| {err:.3e}"


def test_score_path_names_are_checked():
    with pytest.raises(ValueError, match="scores"):
        kernel.quant_decode(torch.zeros(1, 1, 1, 64), *([None] * 6), 8, 64, 0, 0, scores="int4")
    with pytest.raises(ValueError, match="scores"):
        kernel.reference(torch.zeros(1, 1, 1, 64), *([None] * 6), 8, 64, 0, 0, scores="fp8")
