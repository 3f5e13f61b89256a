"""A sequence with nothing to attend to (``lengths[b] = 0`` and no tail, ``n = 0`` and no tail, or every column
masked) gets ``out`` zeros and ``lse`` −inf from every fused decode op on every backend: the C++ ops on each
instruction set, unsplit and split; the pure-torch twins; the Triton kernels under ``TRITON_INTERPRET=1``. Zeros is
what torch's SDPA gives a fully masked row (the unfused path's attention); the batch's other sequences are
untouched (equal to SDPA on the dequantized rows)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from tolerances import assert_close

from kvslim.caches import StoreSpec, make_store
from kvslim.kernels import backend
from kvslim.kernels import quant_decode as qd
from kvslim.kernels import quant_decode_lowbit as ql
from kvslim.kernels import turbo_decode as td
from kvslim.ops.quant import quantize
from kvslim.ops.quant_formats import quantize_asym

F32 = torch.float32
B, H, G, N, D = 3, 2, 3, 40, 64
INF = float("-inf")


def _int_case(bits: int, asym: bool):
    """``(call(**kw) -> (out, lse), dequantized keys, values)`` of quant_decode on codes of random rows."""
    gen = torch.Generator().manual_seed(bits)
    kx, vx = torch.randn(B, H, N, D, generator=gen), torch.randn(B, H, N, D, generator=gen)
    if asym:
        (kc, ks, kz), (vc, vs, vz) = quantize_asym(kx, bits, 64, torch.float16), quantize_asym(vx, bits, 64, torch.float16)
    else:
        (kc, ks), (vc, vs), kz, vz = quantize(kx, bits, 64, torch.float16), quantize(vx, bits, 64, torch.float16), None, None
    keys, values = qd.dequantize_codes(kc, ks, kz, bits, 64), qd.dequantize_codes(vc, vs, vz, bits, 64)
    codes = (kc, ks, kz, vc, vs, vz, bits, 64, 0)

    def call(fn, n, lengths, mask, tail, splits=0, integer=False):
        kt, vt = tail or (None, None)
        if fn == "twin":
            return qd.reference(Q, *codes, n, lengths, kt, vt, mask, 0.125, "exact", "exact")
        if fn == "op":  # integer: the int8 score and value paths (where the format takes them)
            return torch.ops.kvslim.quant_decode(Q, *codes, n, lengths, kt, vt, mask, 0.125, splits, integer,
                                                 integer, None)
        return qd.quant_decode(Q, *codes, n, lengths, kt, vt, mask, 0.125, splits=splits)

    return call, keys, values


def _lowbit_case(kivi: int):
    """quant_decode_lowbit on random 3-bit key / 2-bit value codes (every byte pattern is a code row), per-token or
    KIVI (per channel over ``kivi`` tokens) key parameters."""
    gen = torch.Generator().manual_seed(kivi)
    nk = -(-N // kivi) * kivi if kivi else N
    kp = D // kivi if kivi else 1

    def params(tokens, per):
        return ((torch.rand(B, H, tokens, per, generator=gen) * 0.5 + 0.05).half(),
                torch.randn(B, H, tokens, per, generator=gen).half())

    kc = torch.randint(0, 256, (B, H, nk, D * 3 // 8), generator=gen, dtype=torch.uint8)
    vc = torch.randint(0, 256, (B, H, N, D * 2 // 8), generator=gen, dtype=torch.uint8)
    (ksc, kz), (vs, vz) = params(nk, kp), params(N, 1)
    keys = ql.dequantize(kc, ksc, kz, 3, 64, kivi)[:, :, :N]
    values = ql.dequantize(vc, vs, vz, 2, 64)
    codes = (kc, ksc, kz, vc, vs, vz, 3, 2, 64, kivi)

    def call(fn, n, lengths, mask, tail, splits=0, integer=False):
        kt, vt = tail or (None, None)
        if fn == "twin":
            return ql.reference(Q, *codes, n, lengths, kt, vt, mask, 0.125)
        if fn == "op":
            return torch.ops.kvslim.quant_decode_lowbit(Q, *codes, n, lengths, kt, vt, mask, 0.125, splits)
        return ql.quant_decode_lowbit(Q, *codes, n, lengths, kt, vt, mask, 0.125, splits=splits)

    return call, keys, values


def _turbo_case(biased: bool):
    spec = StoreSpec(3, codec="turbo", rotation="orthogonal", outliers=16, value_bits=2)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(B, H, N, D, generator=gen)
    ks, vs = make_store(spec, x, N), make_store(spec.for_values(), x, N)
    ks.write(0, x)
    vs.write(0, torch.randn(B, H, N, D, generator=gen))
    keys, values = ks.to_coded_basis(ks.read(0, N)).float(), vs.to_coded_basis(vs.read(0, N)).float()
    bias = (torch.randn(B, H, G, 8, generator=gen), torch.randn(N, 8, generator=gen)) if biased else (None, None)
    codes = (ks.data, ks.scale, vs.data, vs.scale, spec.outliers, 3, 2)

    def call(fn, n, lengths, mask, tail, splits=0, integer=False):
        kt, vt = tail or (None, None)
        if fn == "twin":
            return td.reference(Q, *codes, n, kt, vt, mask, 0.125, *bias, lengths)
        if fn == "op":
            return torch.ops.kvslim.turbo_decode(Q, *codes, td.levels("cpu"), n, kt, vt, mask, 0.125, *bias, splits,
                                                 lengths)
        return td.turbo_decode(Q, *codes, n, kt, vt, mask, 0.125, *bias, lengths)

    return call, keys, values, bias if biased else None


Q = torch.randn(B, H, G, D, generator=torch.Generator().manual_seed(11))

CASES = {"int8": lambda: (*_int_case(8, False), None), "int4 asym": lambda: (*_int_case(4, True), None),
         "lowbit": lambda: (*_lowbit_case(0), None), "lowbit kivi": lambda: (*_lowbit_case(16), None),
         "turbo": lambda: _turbo_case(False), "turbo biased": lambda: _turbo_case(True)}
FAMILY = {"int8": qd, "int4 asym": qd, "lowbit": ql, "lowbit kivi": ql, "turbo": td, "turbo biased": td}

TAIL = (torch.randn(B, H, 4, D, generator=torch.Generator().manual_seed(12)),
        torch.randn(B, H, 4, D, generator=torch.Generator().manual_seed(13)))


def _situations():
    """(name, n, lengths, mask, tail, the empty sequences): nothing coded used and no tail; no coded rows at all;
    every column of one sequence masked (its tail included)."""
    full = torch.zeros(B, N + 4)
    full[1] = INF
    return [("lengths 0, no tail", N, torch.tensor([N, 0, 17]), None, None, [1]),
            ("lengths all 0, no tail", N, torch.tensor([0, 0, 0]), None, None, [0, 1, 2]),
            ("n 0, no tail", 0, None, None, None, [0, 1, 2]),
            ("every column masked", N, torch.tensor([N, 29, 5]), full, TAIL, [1])]


def _sdpa(keys, values, n, lengths, mask, tail, bias):
    """float64 oracle through torch's SDPA (G query heads as G queries of one KV head); a fully masked row: zeros."""
    k, v = keys[:, :, :n].double(), values[:, :, :n].double()
    live = torch.ones(B, n, dtype=torch.bool) if lengths is None else torch.arange(n)[None] < lengths[:, None]
    add = torch.zeros(B, 1, G, n, dtype=torch.float64)
    if bias is not None:
        add = add + 0.125 * torch.einsum("bhgw,tw->bhgt", bias[0].double(), bias[1][:n].double())
    if tail is not None:
        k, v = torch.cat((k, tail[0].double()), 2), torch.cat((v, tail[1].double()), 2)
        live = torch.cat((live, torch.ones(B, tail[0].shape[2], dtype=torch.bool)), 1)
        add = torch.cat((add.expand(B, H, G, n), torch.zeros(B, H, G, tail[0].shape[2], dtype=torch.float64)), 3)
    if mask is not None:
        add = add + mask.double()[:, None, None, :]
    add = add.masked_fill(~live[:, None, None, :], INF)
    if k.shape[2] == 0:
        return torch.zeros(B, H, G, D, dtype=torch.float64)
    return torch.nn.functional.scaled_dot_product_attention(Q.double(), k, v, attn_mask=add, scale=0.125)


def _check_empty(out, lse, empty, what):
    assert torch.equal(out[empty], torch.zeros_like(out[empty])), f"{what}: out of an empty sequence is not zeros"
    assert bool((lse[empty] == INF).all()), f"{what}: lse of an empty sequence is not -inf: {lse[empty]}"
    live = [i for i in range(B) if i not in empty]
    assert torch.isfinite(out[live]).all() and torch.isfinite(lse[live]).all(), f"{what}: a live sequence spoiled"


@pytest.mark.parametrize("case", CASES)
def test_twin_gives_zeros_and_agrees_with_sdpa(case):
    """The pure-torch twins (the reference of every backend): zeros / −inf for the empty sequences, SDPA's result
    (float64, fully masked rows zeros) for all of them."""
    call, keys, values, bias = CASES[case]()
    for name, n, lengths, mask, tail, empty in _situations():
        out, lse = call("twin", n, lengths, mask, tail)
        _check_empty(out, lse, empty, f"{case} twin, {name}")
        assert_close(out.double(), _sdpa(keys, values, n, lengths, mask, tail, bias), F32, f"{case} vs SDPA, {name}")


def _isas(case):
    """(set_isa, the instruction sets the C++ op of ``case``'s family runs here)."""
    fam = FAMILY[case]
    if fam is qd:
        order = ["scalar", "avx2", "avx512", "avx512_vnni"]
        return torch.ops.kvslim.quant_decode_set_isa, order[:order.index(qd.isa(D)) + 1]
    if fam is ql:
        return torch.ops.kvslim.quant_decode_lowbit_set_isa, ["scalar"] + (["avx2"] if ql.isa() == "avx2" else [])
    return td.set_isa, ["scalar"] + (["avx2"] if td.isa() == "avx2" else [])


@pytest.mark.parametrize("case", CASES)
def test_cpp_ops_on_every_isa_split_and_unsplit(case):
    if not FAMILY[case].available():
        pytest.skip("no C++ compiler: the op cannot be built here (its twin is used)")
    call, *_ = CASES[case]()
    set_isa, isas = _isas(case)
    previous = set_isa(isas[-1])
    try:
        for isa in isas:
            set_isa(isa)
            for name, n, lengths, mask, tail, empty in _situations():
                ref, ref_lse = call("twin", n, lengths, mask, tail)
                for splits, integer in ((0, False), (1, False), (3, False), (0, True), (3, True)):
                    if integer and FAMILY[case] is not qd:
                        continue
                    what = f"{case} C++ {isa} splits={splits}{' int8 paths' if integer else ''}, {name}"
                    out, lse = call("op", n, lengths, mask, tail, splits, integer)
                    _check_empty(out, lse, empty, what)
                    if not integer:  # the integer paths round the query / weights: the empty rows are the point
                        assert_close(out, ref, F32, what)
                        assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse)), what
    finally:
        set_isa(previous)


def _no_twin(*args, **kwargs):
    raise AssertionError("the dispatching wrapper fell back to the pure-torch twin")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs `pip install triton`")
@pytest.mark.parametrize("case", ["int8", "lowbit kivi", "turbo biased"])
def test_triton_kernels_under_the_interpreter(case, monkeypatch):
    """``KVSLIM_BACKEND=triton`` with ``TRITON_INTERPRET=1`` (tests/conftest.py): the dispatching wrapper runs the
    Triton kernel (split and unsplit where it takes ``splits``)."""
    if not backend.interpreting():
        pytest.skip("TRITON_INTERPRET=0: the Triton kernels take CUDA tensors only")
    monkeypatch.setenv("KVSLIM_BACKEND", "triton")
    call, *_ = CASES[case]()
    twin = FAMILY[case].reference
    for name, n, lengths, mask, tail, empty in _situations():
        ref, _ = call("twin", n, lengths, mask, tail)
        for splits in ((0,) if FAMILY[case] is td else (0, 3)):
            monkeypatch.setattr(FAMILY[case], "reference", _no_twin)  # the kernel runs, not a fallback to the twin
            out, lse = call("wrapper", n, lengths, mask, tail, splits)
            monkeypatch.setattr(FAMILY[case], "reference", twin)
            _check_empty(out, lse, empty, f"{case} Triton splits={splits}, {name}")
            assert_close(out, ref, F32, f"{case} Triton splits={splits}, {name}")
