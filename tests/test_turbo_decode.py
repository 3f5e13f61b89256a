"""Fused decode from turbo codes (``kernels/turbo_decode.py``, ``csrc/turbo_decode.cpp``): the C++ op against its
pure-torch twin and a float64 oracle (outlier parts, GQA, tails, masks, every scale dtype), and a model's fused
decode steps against its unfused reads."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

import kvslim
from kvslim.adapters.compat import CACHE_KW
from kvslim.caches import StoreSpec, make_store
from kvslim.kernels import turbo_decode as kernel

pytestmark = pytest.mark.skipif(not kernel.available(), reason="the turbo_decode C++ op is not built here")


def _format(spec: StoreSpec, b=2, hk=2, n=45, d=64, seed=0):
    """Codes of random rows written by the library's own stores, and the rows they decode to (float64)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, hk, n, d, generator=g)
    x[..., 3] *= 12
    ks, vs = make_store(spec, x, n + 3), make_store(spec.for_values(), x, n + 3)  # spare slots past n
    ks.write(0, x)
    vs.write(0, torch.randn(b, hk, n, d, generator=g))
    keys = ks.to_coded_basis(ks.read(0, n).double()).double()  # decoded rows, in the coded basis
    values = vs.to_coded_basis(vs.read(0, n).double()).double()
    return ks, vs, keys, values


def _oracle(q, keys, values, kt, vt, mask, scaling, bias=None):
    """float64 attention; ``bias``: the factors (ab (B, Hk, G, W), rows (≥n, W)) of the coded rows' score term."""
    k, v = keys, values
    n = keys.shape[2]
    if kt is not None:
        k, v = torch.cat((k, kt.double()), 2), torch.cat((v, vt.double()), 2)
    s = torch.einsum("bhgd,bhtd->bhgt", q.double(), k)
    if bias is not None:
        s[..., :n] += torch.einsum("bhgw,tw->bhgt", bias[0].double(), bias[1][:n].double())
    s = s * scaling
    if mask is not None:
        s = s + mask.double()[:, None, None, :]
    return torch.einsum("bhgt,bhtd->bhgd", torch.softmax(s, -1), v), torch.logsumexp(s, -1)


@pytest.fixture(params=["avx2", "scalar"])
def isa(request):
    """Each C++ test on the AVX2 body and on its scalar twin (the same body on plain arrays)."""
    try:
        before = kernel.set_isa(request.param)
    except ValueError:
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    yield request.param
    kernel.set_isa(before)


@pytest.mark.parametrize("spec", [
    StoreSpec(3, codec="turbo", rotation="hadamard", scale_dtype=torch.float16),
    StoreSpec(3, codec="turbo", rotation="orthogonal", outliers=16, value_bits=2, scale_dtype=torch.float32),
    StoreSpec(2, codec="turbo", rotation="orthogonal", outliers=8, smooth=True, center=True,
              scale_dtype=torch.bfloat16),
    StoreSpec(4, codec="turbo", rotation="hadamard", value_bits=3, scale_dtype=torch.float16),
])
@pytest.mark.parametrize("tail,masked,biased", [(False, False, False), (True, True, True)])
def test_op_matches_the_twin_and_a_float64_oracle(spec, tail, masked, biased, isa):
    ks, vs, keys, values = _format(spec, n=301)  # three blocks of 128 tokens, the last one partial
    b, hk, n, d = keys.shape
    g = torch.Generator().manual_seed(5)
    q = torch.randn(b, hk, 3, d, generator=g)  # GQA: 3 query heads per KV head
    kt = vt = mask = bias = None
    if tail:
        kt, vt = torch.randn(b, hk, 7, d, generator=g), torch.randn(b, hk, 7, d, generator=g)
    if masked:
        mask = torch.zeros(b, n + 7)
        mask[1, :5] = float("-inf")
        mask[0, 130:260] = float("-inf")  # a whole block masked for one sequence
    if biased:  # factors of a score term: W = 24 columns, rows longer than n (only [0, n) is read)
        bias = (2 * torch.randn(b, hk, 3, 24, generator=g), torch.randn(n + 2, 24, generator=g))
    args = (q, ks.data, ks.scale, vs.data, vs.scale, spec.outliers, spec.bits, spec.for_values().bits, n, kt, vt,
            mask, 0.125)
    ref = kernel.reference(*args, *(bias or (None, None)))
    exact = _oracle(q, keys, values, kt, vt, mask, 0.125, bias)
    for splits in (0, 3):  # one task per (sequence, KV head), and the sequence split in three (exact merge)
        got = torch.ops.kvslim.turbo_decode(*args[:8], kernel.levels("cpu"), *args[8:], *(bias or (None, None)),
                                            splits)
        for a, r, e in zip(got, ref, exact):
            torch.testing.assert_close(r.double(), e, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(a.double(), e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("g_heads", [1, 2, 4, 7])
def test_op_every_head_group_width(g_heads, isa):
    """Head groups of 1, 2, 3 + 1 and 3 + 3 + 1 query heads (the register tiles), head dim 128, 2-bit values."""
    spec = StoreSpec(3, codec="turbo", rotation="orthogonal", outliers=32, value_bits=2, center=True)
    ks, vs, keys, values = _format(spec, b=1, hk=2, n=200, d=128)
    q = torch.randn(1, 2, g_heads, 128, generator=torch.Generator().manual_seed(2))
    args = (q, ks.data, ks.scale, vs.data, vs.scale, 32, 3, 2, 200, None, None, None, 0.1)
    got = torch.ops.kvslim.turbo_decode(*args[:8], kernel.levels("cpu"), *args[8:])
    exact = _oracle(q, keys, values, None, None, None, 0.1)
    for a, e in zip(got, exact):
        torch.testing.assert_close(a.double(), e, rtol=1e-4, atol=1e-5)


def test_op_refuses_bad_arguments_by_name():
    spec = StoreSpec(3, codec="turbo", rotation="hadamard")
    ks, vs, keys, _ = _format(spec, n=8)
    q = torch.randn(2, 2, 1, 64)
    lv = kernel.levels("cpu")
    with pytest.raises(ValueError, match="k_codes must be"):
        torch.ops.kvslim.turbo_decode(q, ks.data[..., :-1], ks.scale, vs.data, vs.scale, 0, 3, 3, lv, 8, None, None,
                                      None, 1.0)
    with pytest.raises(ValueError, match="k_out must be"):
        torch.ops.kvslim.turbo_decode(q, ks.data, ks.scale, vs.data, vs.scale, 8, 4, 3, lv, 8, None, None, None, 1.0)
    with pytest.raises(ValueError, match="mask must be"):
        torch.ops.kvslim.turbo_decode(q, ks.data, ks.scale, vs.data, vs.scale, 0, 3, 3, lv, 8, None, None,
                                      torch.zeros(1, 3), 1.0)
    with pytest.raises(ValueError, match="bias_ab must be"):
        torch.ops.kvslim.turbo_decode(q, ks.data, ks.scale, vs.data, vs.scale, 0, 3, 3, lv, 8, None, None, None,
                                      1.0, torch.zeros(2, 2, 1, 7), torch.zeros(8, 7))
    with pytest.raises(ValueError, match="bias_rows must be"):
        torch.ops.kvslim.turbo_decode(q, ks.data, ks.scale, vs.data, vs.scale, 0, 3, 3, lv, 8, None, None, None,
                                      1.0, torch.zeros(2, 2, 1, 8), torch.zeros(7, 8))
    with pytest.raises(ValueError, match="isa must be"):
        kernel.set_isa("avx512")


@pytest.mark.parametrize("opts", [dict(residual=8, flush=4, sink=2),
                                  dict(residual=8, outliers=8, rotation="orthogonal", smooth_keys=True, key_bits=3,
                                       center_keys=True)])
def test_fused_decode_steps_equal_the_unfused_reads(opts, monkeypatch):
    """generate through the fused op and through the layers' dequantized reads (``KVSLIM_BACKEND=torch`` still
    fuses, through the twin; the unfused path is ``enable_fused_decode`` off): the same tokens, logits close."""
    model = tiny_model("llama", kv_heads=2)
    kvslim.apply(model, "turbo2", **opts)
    ids = torch.randint(3, 120, (2, 40), generator=torch.Generator().manual_seed(0))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True, output_logits=True)
    fused = model.generate(ids, **kw)
    assert fused.past_key_values.layers[0].fused_decode
    cache = kvslim.make_cache(model)
    for layer in cache.layers:
        layer.fused_decode = False
    plain = model.generate(ids, **{CACHE_KW: cache}, **kw)
    assert torch.equal(fused.sequences, plain.sequences)
    for a, b in zip(fused.logits, plain.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    kvslim.restore(model)


def _oracle_lengths(q, keys, values, kt, vt, mask, scaling, lengths, bias=None):
    """float64 attention per sequence over its first ``lengths[b]`` coded rows then the tail (mask columns alike)."""
    n = keys.shape[2]
    outs, lses = [], []
    for b, ln in enumerate(lengths.tolist()):
        cols = list(range(ln)) + list(range(n, n + (0 if kt is None else kt.shape[2])))
        m = None if mask is None else mask[b if mask.shape[0] > 1 else 0][cols][None]
        bb = None if bias is None else (bias[0][b:b + 1], bias[1])
        o, s = _oracle(q[b:b + 1], keys[b:b + 1, :, :ln], values[b:b + 1, :, :ln],
                       None if kt is None else kt[b:b + 1], None if vt is None else vt[b:b + 1], m, scaling, bb)
        outs.append(o)
        lses.append(s)
    return torch.cat(outs), torch.cat(lses)


def spoil_past(t: torch.Tensor, lengths: torch.Tensor, value) -> torch.Tensor:
    """A copy of (B, Hk, T, ·) ``t`` with every slot past its sequence's length set to ``value`` (never read)."""
    t = t.clone()
    for b, ln in enumerate(lengths.tolist()):
        t[b, :, ln:] = value
    return t


def lengths_case(ks, vs, keys, lens, tail: bool, *, seed: int, groups: int, mask_rows: int, masked: tuple):
    """Inputs of a ``lengths`` case over the codes ``_format`` wrote: (lengths, q with ``groups`` query heads per
    KV head, a 5-row tail or None twice, a (``mask_rows``, n [+ 5]) mask with -inf at ``masked`` = (row, column),
    score-term factors W = 16, the four code/scale tensors spoiled past each sequence's length)."""
    b, hk, n, d = keys.shape
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lens)
    q = torch.randn(b, hk, groups, d, generator=g)
    kt = vt = None
    if tail:
        kt, vt = torch.randn(b, hk, 5, d, generator=g), torch.randn(b, hk, 5, d, generator=g)
    mask = torch.zeros(mask_rows, n + (5 if tail else 0))
    mask[masked] = float("-inf")
    bias = (torch.randn(b, hk, groups, 16, generator=g), torch.randn(n, 16, generator=g))
    codes = (spoil_past(ks.data, lengths, 255), spoil_past(ks.scale, lengths, float("nan")),
             spoil_past(vs.data, lengths, 7), spoil_past(vs.scale, lengths, float("nan")))
    return lengths, q, kt, vt, mask, bias, codes


@pytest.mark.parametrize("spec", [
    StoreSpec(3, codec="turbo", rotation="orthogonal", outliers=16, value_bits=2, scale_dtype=torch.float16),
    StoreSpec(4, codec="turbo", rotation="hadamard", value_bits=3, scale_dtype=torch.bfloat16),
])
@pytest.mark.parametrize("lens,tail", [((5, 200), False), ((0, 140), True), ((301, 77), True)])
def test_op_lengths_skip_the_slots_past_them(spec, lens, tail, isa):
    """``lengths`` shorter than the buffer (inside one block, across blocks, 0 with a tail, the whole buffer),
    differing across the batch: the C++ op and the twin equal the float64 oracle over each sequence's own rows;
    NaN scales and garbage codes past the lengths never reach the result."""
    ks, vs, keys, values = _format(spec, n=301)
    n = keys.shape[2]
    lengths, q, kt, vt, mask, bias, codes = lengths_case(ks, vs, keys, lens, tail, seed=9, groups=2, mask_rows=1,
                                                         masked=(0, 2))
    args = (q, *codes, spec.outliers, spec.bits, spec.for_values().bits, n, kt, vt, mask, 0.125, *bias)
    exact = _oracle_lengths(q, keys, values, kt, vt, mask, 0.125, lengths, bias)
    ref = kernel.reference(*args, lengths=lengths)
    for r, e in zip(ref, exact):
        torch.testing.assert_close(r.double(), e, rtol=1e-4, atol=1e-5)
    for splits in (0, 3):
        got = torch.ops.kvslim.turbo_decode(*args[:8], kernel.levels("cpu"), *args[8:], splits, lengths)
        for a, e in zip(got, exact):
            torch.testing.assert_close(a.double(), e, rtol=1e-4, atol=1e-5)
    got = kernel.turbo_decode(*args, lengths=lengths)  # the dispatching wrapper
    for a, e in zip(got, exact):
        torch.testing.assert_close(a.double(), e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bad,what", [
    (torch.tensor([3]), "shape"), (torch.tensor([[3, 3]]), "shape"), (torch.tensor([3, 3], dtype=torch.int32), "dtype"),
    (torch.tensor([3.0, 3.0]), "dtype"), (torch.tensor([3, 3], device="meta"), "device"),
    (torch.tensor([-1, 3]), "value"), (torch.tensor([3, 9]), "value"),
])
def test_lengths_refused_by_name(bad, what):
    """A wrong shape / dtype / device or a value outside [0, n]: ValueError naming ``lengths`` (the wrapper on every
    backend, and the C++ op itself)."""
    spec = StoreSpec(3, codec="turbo", rotation="hadamard")
    ks, vs, _, _ = _format(spec, n=8)
    q = torch.randn(2, 2, 1, 64)
    args = (q, ks.data, ks.scale, vs.data, vs.scale, 0, 3, 3, 8)
    with pytest.raises(ValueError, match="lengths"):
        kernel.turbo_decode(*args, lengths=bad)
    if what != "device":
        with pytest.raises(ValueError, match="lengths"):
            torch.ops.kvslim.turbo_decode(*args[:8], kernel.levels("cpu"), 8, None, None, None, 1.0, None, None, 0,
                                          bad)
