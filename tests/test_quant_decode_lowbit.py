"""The fused low-bit decode op (``torch.ops.kvslim.quant_decode_lowbit``: asymmetric 2/3-bit codes, the ``int2``
method) against its pure-torch twin and a float64 oracle; the fused int2 decode path of a transformers Llama against
the unfused one (greedy tokens, logits, a multi-token chunk); memory safety (NaN-poisoned slots past a sequence's
length, named errors, torch.compile of a call to the op, the scalar path)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import assert_close

import kvslim
from kvslim.adapters.compat import CACHE_KW
from kvslim.caches.residual import ChannelQuantizedStore
from kvslim.caches.storage import QuantizedStore, StoreSpec
from kvslim.kernels import quant_decode_lowbit as kernel
from kvslim.ops.quant_formats import unpack_codes

F32 = torch.float32


def _ops():
    if not kernel.available():
        pytest.skip("no C++ compiler: the op cannot be built here (its twin is used)")


def _random_format(b, h, n, d, kb, vb, gs, kivi, sdt, gen):
    """Random codes (every byte pattern is a valid code row) and random scales / zero-points."""
    nk = -(-n // kivi) * kivi if kivi else n
    kp = d // kivi if kivi else d // gs

    def params(tokens, per):
        s = (torch.rand(b, h, tokens, per, generator=gen) * 0.5 + 0.05).to(sdt)
        z = (torch.randn(b, h, tokens, per, generator=gen)).to(sdt)
        return s, z

    kc = torch.randint(0, 256, (b, h, nk, d * kb // 8), generator=gen, dtype=torch.uint8)
    vc = torch.randint(0, 256, (b, h, n, d * vb // 8), generator=gen, dtype=torch.uint8)
    ks, kz = params(nk, kp)
    vs, vz = params(n, d // gs)
    return kc, ks, kz, vc, vs, vz


def _oracle(q, kc, ks, kz, vc, vs, vz, kb, vb, gs, kivi, n, lengths, kt, vt, mask, scaling):
    """float64: codes unpacked, parameters broadcast element by element, masked softmax per sequence."""
    b, h, _, d = q.shape
    kq = unpack_codes(kc, kb, signed=False).double()
    if kivi:  # group i's D parameters over rows [i·g, (i+1)·g): one row of D per group, repeated over its tokens
        s = ks.double().reshape(b, h, -1, d).repeat_interleave(kivi, dim=2)
        z = kz.double().reshape(b, h, -1, d).repeat_interleave(kivi, dim=2)
    else:
        s, z = ks.double().repeat_interleave(gs, dim=3), kz.double().repeat_interleave(gs, dim=3)
    keys = (kq * s[:, :, :kq.shape[2]] + z[:, :, :kq.shape[2]])[:, :, :n]
    values = (unpack_codes(vc, vb, signed=False).double()[:, :, :n] * vs.double().repeat_interleave(gs, 3)[:, :, :n]
              + vz.double().repeat_interleave(gs, 3)[:, :, :n])
    outs, lses = [], []
    for i in range(b):
        ln = n if lengths is None else int(lengths[i])
        k, v, cols = keys[i, :, :ln], values[i, :, :ln], torch.arange(ln)
        if kt is not None:
            k, v = torch.cat((k, kt[i].double()), 1), torch.cat((v, vt[i].double()), 1)
            cols = torch.cat((cols, n + torch.arange(kt.shape[2])))
        sc = torch.einsum("hgd,htd->hgt", q[i].double(), k) * scaling
        if mask is not None:
            sc = sc + mask[min(i, mask.shape[0] - 1), cols].double()
        outs.append(torch.softmax(sc, -1).nan_to_num(0.0) @ v)
        lses.append(torch.logsumexp(sc, -1))
    return torch.stack(outs), torch.stack(lses)


CASES = [  # (head dim, group size, GQA group, key bits, value bits, KIVI token group, scale dtype)
    (64, 64, 1, 3, 2, 64, torch.float16), (64, 32, 3, 3, 2, 64, torch.float16), (64, 64, 7, 2, 2, 32, torch.bfloat16),
    (80, 16, 3, 3, 2, 16, torch.float32), (80, 80, 1, 3, 2, 0, torch.float16), (128, 64, 7, 3, 3, 64, torch.float16),
    (128, 32, 1, 2, 3, 0, torch.float32), (256, 64, 3, 3, 2, 64, torch.float16), (256, 128, 1, 2, 2, 0, torch.bfloat16),
    (16, 16, 3, 3, 2, 16, torch.float32),
]


@pytest.mark.parametrize("d,gs,g,kb,vb,kivi,sdt", CASES)
def test_op_matches_twin_and_float64(d, gs, g, kb, vb, kivi, sdt):
    """Lengths that are no multiple of a block or a token group, different per sequence, masked tokens, a tail;
    forced splits agree with the single pass."""
    _ops()
    gen = torch.Generator().manual_seed(d * 7 + gs + g + kb + vb + kivi)
    b, h, n = 3, 2, 203
    codes = _random_format(b, h, n + 9, d, kb, vb, gs, kivi, sdt, gen)
    q = torch.randn(b, h, g, d, generator=gen)
    lengths = torch.tensor([n, 57, 1])
    kt, vt = torch.randn(b, h, 3, d, generator=gen), torch.randn(b, h, 3, d, generator=gen)
    mask = torch.zeros(b, n + 3)
    mask[0, 5] = mask[1, n + 1] = float("-inf")
    mask[2, 0] = -3.0
    args = (q, *codes, kb, vb, gs, kivi, n, lengths, kt, vt, mask, d ** -0.5)
    oracle, oracle_lse = _oracle(*args)
    ref, ref_lse = kernel.reference(*args)
    assert_close(ref, oracle, F32, "twin vs float64")
    assert_close(ref_lse, oracle_lse, F32, "twin lse vs float64")
    for splits in (0, 1, 3):
        out, lse = kernel.quant_decode_lowbit(*args, splits=splits)
        assert_close(out, oracle, F32, f"op (splits={splits}) vs float64")
        assert_close(lse, oracle_lse, F32, f"op lse (splits={splits}) vs float64")


@pytest.mark.parametrize("kb,vb,d,g,heads,sdt", [(3, 2, 64, 64, 1, torch.float16), (3, 2, 80, 16, 3, torch.float16),
                                                 (2, 2, 128, 32, 7, torch.float32), (3, 3, 256, 64, 3, torch.bfloat16)])
def test_int2_stores_match_the_store_reads(kb, vb, d, g, heads, sdt):
    """The int2 format as kvslim's stores write it (3-bit KIVI keys, 2-bit per-token values): op == twin ==
    attention over the stores' own reads (float64), token groups straddling the kernel's blocks."""
    _ops()
    torch.manual_seed(1)
    b, h, n = 2, 3, 5 * g
    spec = StoreSpec(kb, 16 if d == 80 else 32, sdt, asymmetric=True, channel_group=g, residual=g, flush=g,
                     value_bits=vb)
    ks = ChannelQuantizedStore(spec, b, h, 6 * g, d, F32, torch.device("cpu"))
    vs = QuantizedStore(spec.for_values(), b, h, 6 * g, d, F32, torch.device("cpu"))
    ks.write(0, torch.randn(b, h, n, d))
    vs.write(0, torch.randn(b, h, n, d))
    q = torch.randn(b, h, heads, d)
    lengths = torch.tensor([n - 7, g + 5])
    keys, values = ks.read(0, n).double(), vs.read(0, n).double()
    s = torch.einsum("bhgd,bhtd->bhgt", q.double(), keys) * 0.1
    s[..., n - 7:] = float("-inf")
    s[1, ..., g + 5:] = float("-inf")
    oracle = torch.einsum("bhgt,bhtd->bhgd", s.softmax(-1), values)
    args = (q, ks.data, ks.scale, ks.zero, vs.data, vs.scale, vs.zero, kb, vb, spec.group_size, g, n - 7, lengths)
    ref, _ = kernel.reference(*args, scaling=0.1)
    assert_close(ref, oracle, F32, "twin vs store reads")
    for splits in (0, 2):
        out, _ = kernel.quant_decode_lowbit(*args, scaling=0.1, splits=splits)
        assert_close(out, oracle, F32, f"op vs store reads (splits={splits})")


def test_never_reads_past_a_sequence_length():
    """Scales and zero-points NaN past each sequence's length (whole token groups, and the rest of a partly
    filled group's value rows): the result stays finite and equal to the twin's."""
    _ops()
    gen = torch.Generator().manual_seed(3)
    b, h, n, d = 3, 2, 256, 64
    for kivi in (64, 0):
        kc, ks, kz, vc, vs, vz = _random_format(b, h, n, d, 3, 2, 64, kivi, torch.float16, gen)
        lengths = torch.tensor([70, 128, 0])
        for i, ln in enumerate(lengths.tolist()):
            kfrom = -(-ln // kivi) * kivi if kivi else ln  # KIVI: a started group's parameters are real
            ks[i, :, kfrom:] = kz[i, :, kfrom:] = float("nan")
            vs[i, :, ln:] = vz[i, :, ln:] = float("nan")
        q = torch.randn(b, h, 3, d, generator=gen)
        kt, vt = torch.randn(b, h, 2, d, generator=gen), torch.randn(b, h, 2, d, generator=gen)
        args = (q, kc, ks, kz, vc, vs, vz, 3, 2, 64, kivi, n, lengths, kt, vt)
        ref, _ = kernel.reference(*args)
        for splits in (0, 3):
            out, lse = kernel.quant_decode_lowbit(*args, splits=splits)
            assert torch.isfinite(out).all() and torch.isfinite(lse).all()
            assert_close(out, ref, F32, f"poisoned slots (kivi={kivi}, splits={splits})")


def test_masked_tokens_never_let_nan_parameters_through():
    """A masked (−inf) token whose value parameters are NaN weighs exactly 0."""
    _ops()
    gen = torch.Generator().manual_seed(7)
    kc, ks, kz, vc, vs, vz = _random_format(1, 1, 40, 64, 3, 2, 64, 0, F32, gen)
    vs[0, 0, 11] = vz[0, 0, 11] = float("nan")
    mask = torch.zeros(1, 40)
    mask[0, 11] = float("-inf")
    args = (torch.randn(1, 1, 2, 64, generator=gen), kc, ks, kz, vc, vs, vz, 3, 2, 64, 0, 40, None, None, None, mask)
    out, _ = kernel.quant_decode_lowbit(*args)
    assert torch.isfinite(out).all()
    vs[0, 0, 11] = vz[0, 0, 11] = 0.0
    assert_close(out, kernel.reference(*args)[0], F32, "masked NaN token")


def test_fully_masked_sequence_gives_zeros():
    _ops()
    gen = torch.Generator().manual_seed(4)
    codes = _random_format(2, 1, 64, 64, 3, 2, 64, 64, F32, gen)
    mask = torch.zeros(2, 64)
    mask[1] = float("-inf")
    out, lse = kernel.quant_decode_lowbit(torch.randn(2, 1, 1, 64), *codes, 3, 2, 64, 64, 64, mask=mask)
    assert (out[1] == 0).all() and lse[1].item() == float("-inf") and torch.isfinite(out[0]).all()


@settings(max_examples=15, deadline=None)
@given(d=st.sampled_from([16, 32, 48, 64, 80, 128]), g=st.sampled_from([1, 2, 3, 7]), kb=st.sampled_from([2, 3]),
       vb=st.sampled_from([2, 3]), kivi=st.sampled_from([0, 16]), n=st.integers(1, 300), tail=st.integers(0, 5),
       b=st.integers(1, 3), splits=st.integers(0, 4), seed=st.integers(0, 2 ** 16))
def test_fuzz_op_vs_twin(d, g, kb, vb, kivi, n, tail, b, splits, seed):
    _ops()
    gen = torch.Generator().manual_seed(seed)
    codes = _random_format(b, 2, n, d, kb, vb, 16, kivi, torch.float16, gen)
    q = torch.randn(b, 2, g, d, generator=gen)
    lengths = torch.randint(0, n + 1, (b,), generator=gen)
    kt = vt = None
    if tail:
        kt, vt = torch.randn(b, 2, tail, d, generator=gen), torch.randn(b, 2, tail, d, generator=gen)
    args = (q, *codes, kb, vb, 16, kivi, n, lengths, kt, vt, None, 0.2)
    out, lse = kernel.quant_decode_lowbit(*args, splits=splits)
    ref, ref_lse = kernel.reference(*args)
    assert_close(out, ref, F32, "fuzz out")
    live = torch.isfinite(ref_lse)  # a sequence with nothing to attend to: lse −inf, output zeros
    assert torch.equal(torch.isfinite(lse), live) and (lse[~live] == ref_lse[~live]).all()
    if live.any():
        assert_close(lse[live], ref_lse[live], F32, "fuzz lse")


def test_bad_input_is_refused_by_name():
    _ops()
    gen = torch.Generator().manual_seed(5)
    kc, ks, kz, vc, vs, vz = _random_format(1, 2, 10, 64, 3, 2, 32, 0, F32, gen)
    q = torch.randn(1, 2, 1, 64)
    op = torch.ops.kvslim.quant_decode_lowbit
    with pytest.raises(ValueError, match="group_size"):
        op(q, kc, ks, kz, vc, vs, vz, 3, 2, 24, 0, 10, None, None, None, None, 1.0)
    with pytest.raises(ValueError, match="k_bits"):
        op(q, kc, ks, kz, vc, vs, vz, 4, 2, 32, 0, 10, None, None, None, None, 1.0)
    with pytest.raises(ValueError, match="k_codes"):
        op(q, kc, ks, kz, vc, vs, vz, 3, 2, 32, 0, 11, None, None, None, None, 1.0)
    with pytest.raises(ValueError, match="v_codes"):
        op(q, kc, ks, kz, vc, vs, vz, 3, 3, 32, 0, 10, None, None, None, None, 1.0)
    with pytest.raises(ValueError, match="lengths"):
        op(q, kc, ks, kz, vc, vs, vz, 3, 2, 32, 0, 10, torch.tensor([11]), None, None, None, 1.0)
    with pytest.raises(ValueError, match="mask"):
        op(q, kc, ks, kz, vc, vs, vz, 3, 2, 32, 0, 10, None, None, None, torch.zeros(1, 9), 1.0)
    with pytest.raises(ValueError, match="head dimension"):
        op(torch.randn(1, 2, 1, 40), kc, ks, kz, vc, vs, vz, 3, 2, 8, 0, 10, None, None, None, None, 1.0)
    with pytest.raises(ValueError, match="k_zero"):
        kernel.quant_decode_lowbit(q, kc, ks, None, vc, vs, vz, 3, 2, 32, 0, 10)


def test_torch_compile_of_a_call_to_the_op():
    """The fake impl traces (aot_eager: fake tensors, functionalization) and the compiled call gives the op's result."""
    _ops()
    gen = torch.Generator().manual_seed(6)
    codes = _random_format(2, 2, 64, 64, 3, 2, 64, 64, torch.float16, gen)
    q = torch.randn(2, 2, 3, 64)

    def f(q, kc, ks, kz, vc, vs, vz):
        out, lse = torch.ops.kvslim.quant_decode_lowbit(q, kc, ks, kz, vc, vs, vz, 3, 2, 64, 64, 64, None, None,
                                                        None, None, 0.125)
        return out * 2, lse

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got, want = compiled(q, *codes), f(q, *codes)
    assert_close(got[0], want[0], F32, "compiled out")
    assert_close(got[1], want[1], F32, "compiled lse")


def test_scalar_path_matches_the_twin():
    """The scalar path (CPUs without AVX2 + FMA + F16C; also KVSLIM_ISA=scalar): same results as the twin."""
    _ops()
    previous = torch.ops.kvslim.quant_decode_lowbit_set_isa("scalar")
    try:
        assert kernel.isa() == "scalar"
        gen = torch.Generator().manual_seed(0)
        for d, g, kivi in ((80, 3, 16), (64, 1, 0)):
            b, h, n = 2, 2, 150
            codes = _random_format(b, h, n, d, 3, 2, 16, kivi, torch.float16, gen)
            args = (torch.randn(b, h, g, d, generator=gen), *codes, 3, 2, 16, kivi, n, torch.tensor([150, 33]),
                    torch.randn(b, h, 2, d, generator=gen), torch.randn(b, h, 2, d, generator=gen), None, 0.1)
            for splits in (0, 2):
                assert_close(kernel.quant_decode_lowbit(*args, splits=splits)[0], kernel.reference(*args)[0], F32,
                             f"scalar path d={d} kivi={kivi} splits={splits}")
    finally:
        torch.ops.kvslim.quant_decode_lowbit_set_isa(previous)
    with pytest.raises(ValueError, match="isa"):
        torch.ops.kvslim.quant_decode_lowbit_set_isa("avx512")


def _tiny(kv_heads: int, hidden: int = 256):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("kv_heads,hidden,opts", [
    (4, 256, {}),  # MHA, head dim 64: the int2 default (3-bit KIVI keys g64, 2-bit rotated values, sinks)
    (2, 256, dict(method="int3")),  # GQA: the int3 default (3-bit keys, 3-bit rotated values, sinks, window 124)
    (2, 256, dict(method="int3", rotation="hadamard")),  # rotated keys: the window kept rotated across steps
    (2, 256, dict(key_bits=2, key_channel_group=32, residual=32, group_size=32)),  # GQA, all 2-bit
    (1, 320, dict(key_channel_group=16, residual=48, group_size=16)),  # MQA, head dim 80 (no rotation)
])
def test_greedy_tokens_match_the_unfused_path(kv_heads, hidden, opts, monkeypatch):
    """A real transformers Llama (from a config), padded batch, a prompt long enough to flush token groups into
    codes, 8 new tokens: every decode step takes the op, tokens equal the unfused path's, a decode step's logits
    and a 3-token chunk's (multi-token queries: the unfused reads) agree with it to fp32 rounding."""
    _ops()
    from kvslim.adapters import sdpa

    model = _tiny(kv_heads, hidden)
    ids = torch.randint(0, 256, (2, 196), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    taken = []
    decode = sdpa.quant.decode
    monkeypatch.setattr(sdpa.quant, "decode", lambda *a: taken.append(decode(*a) is not None) or decode(*a))
    opts = dict(opts)
    method = opts.pop("method", "int2")
    kvslim.apply(model, method, **opts)
    try:
        runs = []
        with torch.no_grad():
            for fused in (True, False):
                cache = kvslim.make_cache(model)
                assert all(layer.fused_decode for layer in cache.layers)
                for layer in cache.layers:
                    layer.fused_decode = fused
                out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                     **{CACHE_KW: cache})
                full = torch.cat((mask, torch.ones(2, 8, dtype=mask.dtype)), 1)
                step = model(out[:, -1:], attention_mask=full, **{CACHE_KW: cache}).logits
                full = torch.cat((full, torch.ones(2, 4, dtype=mask.dtype)), 1)
                chunk = model(out[:, -3:], attention_mask=full, **{CACHE_KW: cache}).logits
                runs.append((out, step, chunk))
    finally:
        kvslim.restore(model)
    assert torch.equal(runs[0][0], runs[1][0]), f"{method} {opts}: greedy tokens differ"
    assert_close(runs[0][1], runs[1][1], F32, f"{method} {opts}: decode logits")
    assert_close(runs[0][2], runs[1][2], F32, f"{method} {opts}: 3-token chunk logits")
    assert taken and all(taken)


@pytest.mark.parametrize("method", ["int2", "int3"])
def test_make_cache_turns_fused_decode_on_for_int2(method):
    _ops()
    model = _tiny(4)
    kvslim.apply(model, method)
    try:
        assert all(layer.fused_decode for layer in kvslim.make_cache(model).layers)
    finally:
        kvslim.restore(model)
