"""The slim option 2 decode op (``torch.ops.kvslim.slim_decode``) against a float64 oracle, its pure-torch twin and
the torch path of slim attention; memory safety (NaN-poisoned slots, named errors, torch.compile of a model)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from dataclasses import replace

import pytest
import torch
from conftest import padded_batch, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import assert_error_ratio, assert_rel_close

import kvslim
from kvslim.attention.slim import (
    SlimLayerWeights,
    additive_mask,
    option2_partials,
    slim_attention,
    split_heads,
)
from kvslim.kernels import build
from kvslim.kernels import slim_decode as kernel
from kvslim.ops.rope import rotate, rotate_heads, unrotate

F32_MIN = torch.finfo(torch.float32).min


def _ops():
    if not kernel.available():
        pytest.skip("no C++ compiler: the op cannot be built here (its twin is used)")


def _table(n: int, r: int, offset: int = 0):
    inv = 1.0 / (10000 ** (torch.arange(0, r, 2, dtype=torch.float32) / r))
    ang = torch.arange(offset, offset + n, dtype=torch.float32)[:, None] * inv
    emb = torch.cat((ang, ang), dim=-1)
    return emb.cos()[None], emb.sin()[None]  # (1, n, R)


def oracle(q, rows, cos, sin, mask, lengths, scaling, rotated):
    """float64, per sequence, only the rows a sequence owns: (u (B, h, c), lse (B, h))."""
    b, h, dk = q.shape
    e = h * dk
    us, lses = [], []
    for i in range(b):
        n = rows.shape[1] if lengths is None else int(lengths[i])
        src = rows[i, :n].double()  # (n, c)
        keys = src[:, :e].view(n, h, dk).transpose(0, 1)  # (h, n, dk)
        score_keys = keys
        if cos is not None:
            cs, sn = (z[min(i, z.shape[0] - 1), :n].double() for z in (cos, sin))
            if rotated:
                src = torch.cat((unrotate(keys, cs, sn).transpose(0, 1).reshape(n, e), src[:, e:]), dim=1)
            else:
                score_keys = rotate(keys, cs, sn)
        s = (score_keys @ q[i].double()[:, :, None])[..., 0] * scaling  # (h, n)
        if mask is not None:
            s = s + mask[min(i, mask.shape[0] - 1), :n].double()
        lses.append(torch.logsumexp(s, -1))
        us.append(torch.softmax(s, -1) @ src)
    return torch.stack(us), torch.stack(lses)


def _case(b, h, dk, r, extra, n, dtype, seed, pad=True, lengths=True):
    """Rows in a NaN-poisoned store (slots past n, and past each sequence's length), queries, table, mask."""
    g = torch.Generator().manual_seed(seed)
    c = h * dk + extra
    store = torch.full((b, 1, n + 29, c), float("nan"), dtype=dtype)
    store[:, 0, :n] = (2 * torch.randn(b, n, c, generator=g)).to(dtype)
    lens = None
    if lengths and b > 1:
        lens = torch.tensor([n - (7 * i) % max(n - 1, 1) for i in range(b)], dtype=torch.long)
        for i in range(b):
            store[i, 0, int(lens[i]):] = float("nan")
    rows = store[:, 0, :n]  # the strided view a SlimLayer returns
    q = 2 * torch.randn(b, h, dk, generator=g)
    cos, sin = _table(n, r, offset=3) if r else (None, None)
    mask = None
    if pad:
        visible = torch.ones(b, n, dtype=torch.bool)
        visible[0, : min(5, n - 1)] = False  # left padding of the first sequence
        mask = torch.zeros(b, n).masked_fill(~visible, F32_MIN)
    return q, rows, cos, sin, mask, lens


def _check(q, rows, cos, sin, mask, lens, rotated, splits=0):
    scaling = q.shape[-1] ** -0.5
    u, lse = kernel.slim_decode(q, rows, cos, sin, mask, lens, scaling, rotated, splits)
    ref_u, ref_lse = oracle(q, rows, cos, sin, mask, lens, scaling, rotated)
    assert torch.isfinite(u).all() and torch.isfinite(lse).all()
    assert_rel_close(u, ref_u, torch.float32, "op vs float64")
    assert_rel_close(lse, ref_lse, torch.float32, "op lse vs float64")
    tw_u, tw_lse = kernel.reference(q, rows, cos, sin, mask, lens, scaling, rotated)
    assert_rel_close(tw_u, ref_u, torch.float32, "twin vs float64")
    assert_rel_close(tw_lse, ref_lse, torch.float32, "twin lse vs float64")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope", ["none", "raw", "rotated"])
@pytest.mark.parametrize("dk", [64, 80, 128, 256])
def test_op_matches_float64(dk, rope, dtype):
    _ops()
    h, extra = (3, 8) if dk < 256 else (2, 5)
    r = 0 if rope == "none" else (dk if dk != 80 else 48)  # dk 80: partial rotary
    q, rows, cos, sin, mask, lens = _case(3, h, dk, r, extra, 301, dtype, seed=dk)
    _check(q, rows, cos, sin, mask, lens, rope == "rotated")


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
def test_sequence_splits_merge_exactly(splits):
    _ops()
    q, rows, cos, sin, mask, lens = _case(2, 4, 64, 64, 0, 1001, torch.float32, seed=5)
    _check(q, rows, cos, sin, mask, lens, False, splits)


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 3), h=st.integers(1, 7), half=st.integers(1, 40), rfrac=st.sampled_from([0, 0.5, 1]),
       extra=st.integers(0, 9), n=st.integers(1, 300), bf16=st.booleans(), rotated=st.booleans(),
       pad=st.booleans(), lengths=st.booleans(), seed=st.integers(0, 2**16))
def test_op_fuzz(b, h, half, rfrac, extra, n, bf16, rotated, pad, lengths, seed):
    if not kernel.available():
        return
    dk = 2 * half
    r = 2 * int(half * rfrac)
    q, rows, cos, sin, mask, lens = _case(b, h, dk, r, extra, n, torch.bfloat16 if bf16 else torch.float32, seed,
                                          pad=pad and n > 1, lengths=lengths)
    _check(q, rows, cos, sin, mask, lens, rotated and r > 0)


def test_scalar_and_simd_paths_agree():
    """The scalar path (KVSLIM_ISA=scalar, a fresh process) gives the same result as the SIMD one here."""
    _ops()
    code = ("import torch, sys; sys.path.insert(0, 'tests'); from test_slim_kernel import _case, _check; "
            "from kvslim.kernels import slim_decode as k; assert k.isa() == 'scalar', k.isa(); "
            "[_check(*_case(2, 3, dk, r, 3, 77, dt, 1)[:6], rot) for dk, r in ((64, 64), (80, 48), (16, 0)) "
            "for dt in (torch.float32, torch.bfloat16) for rot in (False, True)]")
    env = {**os.environ, "KVSLIM_ISA": "scalar"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]


def test_bad_input_is_refused_by_name():
    _ops()
    q, rows, cos, sin, mask, _ = _case(2, 3, 16, 16, 0, 40, torch.float32, seed=1)
    op = torch.ops.kvslim.slim_decode
    cases = [
        ((q.double(), rows, cos, sin, mask, None, 1.0, False), "q must be float32"),
        ((q[:, :, :8], rows[..., :20], None, None, None, None, 1.0, False), "fewer than h·dk"),
        ((q, rows, cos[:, :10], sin[:, :10], None, None, 1.0, False), "cos must be"),
        ((q, rows, cos, None, None, None, 1.0, False), "cos and sin"),
        ((q, rows, None, None, mask[:, :39], None, 1.0, False), "mask must be"),
        ((q, rows, None, None, None, torch.tensor([40, 41]), 1.0, False), "lengths[1] = 41"),
        ((q, rows, None, None, None, torch.tensor([0, 4]), 1.0, False), "lengths[0] = 0"),
        ((q, rows.half(), None, None, None, None, 1.0, False), "rows must be float32 or bfloat16"),
    ]
    for args, what in cases:
        with pytest.raises(ValueError, match=what.replace("[", r"\[")):
            op(*args)


def test_unsupported_inputs_use_the_twin():
    """fp16 rows and autograd inputs are not the op's: the dispatcher answers through the twin."""
    q, rows, cos, sin, mask, lens = _case(2, 3, 16, 16, 2, 50, torch.float32, seed=3)
    u, _ = kernel.slim_decode(q, rows.half(), cos, sin, mask, lens, 0.25, False)
    ref, _ = oracle(q, rows.half().float(), cos, sin, mask, lens, 0.25, False)
    assert_rel_close(u, ref, torch.float32, "fp16 rows through the twin")
    with torch.enable_grad():
        qg = q.clone().requires_grad_()
        u, _ = kernel.slim_decode(qg, rows, cos, sin, mask, lens, 0.25, False)
        u.sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()


def test_merge_of_shards_is_exact():
    q, rows, cos, sin, mask, _ = _case(2, 4, 16, 16, 3, 200, torch.float32, seed=9, lengths=False)
    full = kernel.slim_decode(q, rows, cos, sin, mask, None, 0.25, False)
    parts = [kernel.slim_decode(q, rows[:, a:z], cos[:, a:z], sin[:, a:z], mask[:, a:z], None, 0.25, False)
             for a, z in ((0, 70), (70, 71), (71, 200))]
    u, lse = kernel.merge(parts)
    assert_rel_close(u, full[0], torch.float32, "merged shards")
    assert_rel_close(lse, full[1], torch.float32, "merged lse")


@pytest.mark.parametrize("rotated", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slim_attention_op_and_torch_path_agree(rotated, dtype):
    """Through slim_attention (K + conditioning columns, per-head W_KV): the op against the torch path; in bf16 by
    the error-ratio rule against float64 (the op keeps fp32 scores, the torch path rounds them to bf16)."""
    _ops()
    g = torch.Generator().manual_seed(7)
    b, h, dk, n, extra = 2, 4, 16, 400, 4
    c = h * dk + extra
    rows = torch.randn(b, n, c, generator=g).to(dtype)
    q = torch.randn(b, h, 1, dk, generator=g).to(dtype)
    w = SlimLayerWeights("k", h, dk, c, value_map=torch.randn(h, c, dk, generator=g), rope=True,
                         rope_storage="rotated" if rotated else "raw")
    cos, sin = (z.to(dtype) for z in _table(n, dk, offset=3))
    pad = torch.ones(b, n, dtype=torch.bool)
    pad[1, :9] = False
    mask = additive_mask(pad[:, None, None, :], 1, n, q.device)
    fused = slim_attention(q, rows, w, mask, dk ** -0.5, cos, sin)
    torch_path = slim_attention(q, rows, replace(w, kernel="torch"), mask, dk ** -0.5, cos, sin)
    if dtype == torch.float32:
        assert_rel_close(fused, torch_path, torch.float32, "op vs torch path")
        return
    u64, _ = oracle(q[:, :, 0].double(), rows.double(), cos.double(), sin.double(), mask[:, 0, 0].double(), None,
                    dk ** -0.5, rotated)
    ref = torch.einsum("bhc,hcd->bhd", u64, w.value_map.double())[:, :, None]
    assert_error_ratio(fused, torch_path, ref, torch.bfloat16, "bf16 op vs torch path")
    u, lse = option2_partials(q, rows, mask, dk ** -0.5, cos, sin, rotated)
    assert u.shape == (b, h, c) and lse.shape == (b, h)


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


def _generate(model, ids, mask, kernel_opt, rope_storage="raw", steps=12):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kvslim.apply(model, "slim", cache="k", rank=0, kernel=kernel_opt, rope_storage=rope_storage)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, do_sample=False, pad_token_id=0)
    kvslim.restore(model)
    return out


@pytest.mark.parametrize("rope_storage", ["raw", "rotated"])
def test_generate_tokens_match_torch_path(rope_storage, one_thread):
    _ops()
    model = tiny_model("llama", kv_heads=4)
    ids, mask = padded_batch(3, 14)
    fused = _generate(model, ids, mask, "auto", rope_storage)
    plain = _generate(model, ids, mask, "torch", rope_storage)
    assert torch.equal(fused, plain)


def test_compiled_model_forward_with_slim_is_memory_safe(one_thread):
    """torch.compile(model.forward) with slim used to corrupt the heap through the old ctypes kernel (exit 134);
    the op has a fake implementation, checks every size, and the tokens match eager decoding."""
    _ops()
    model = tiny_model("llama", kv_heads=4, num_hidden_layers=1)
    ids, mask = padded_batch(2, 10)
    eager = _generate(model, ids, mask, "auto", steps=6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kvslim.apply(model, "slim", cache="k", rank=0)
        torch._dynamo.reset()
        model.forward = torch.compile(model.forward, backend="aot_eager")  # the fake impl + dynamo, no codegen
        try:
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        finally:
            del model.forward
            torch._dynamo.reset()
            kvslim.restore(model)
    assert torch.equal(out, eager)


def test_missing_compiler_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/kvslim-c++")
    flags = ("-DKVSLIM_TEST_FALLBACK",)  # a fresh build key, so nothing cached is reused
    build.load_ops.cache_clear()
    build._warned.discard(kernel.FAMILY)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert build.load_ops(kernel.FAMILY, flags) is False
            assert build.load_ops(kernel.FAMILY, flags) is False
        msgs = [str(x.message) for x in caught if "slim_decode" in str(x.message)]
        assert len(msgs) == 1 and "twin" in msgs[0]
    finally:
        build.load_ops.cache_clear()
    monkeypatch.setattr(kernel, "available", lambda: False)
    q, rows, cos, sin, mask, lens = _case(2, 3, 16, 16, 0, 30, torch.float32, seed=2)
    u, _ = kernel.slim_decode(q, rows, cos, sin, mask, lens, 0.25, False)
    ref, _ = oracle(q, rows, cos, sin, mask, lens, 0.25, False)
    assert_rel_close(u, ref, torch.float32, "twin without a compiler")


# -- encoder-decoder cross-attention over the shared encoder output (torch.ops.kvslim.encdec_decode) -------------

def _enc_oracle(qt, enc, mask, lengths, scaling):
    us, lses = [], []
    for i in range(enc.shape[0]):
        n = enc.shape[1] if lengths is None else int(lengths[i])
        e = enc[i, :n].double()
        s = qt[i].double() @ e.T * scaling  # (h, n)
        if mask is not None:
            s = s + mask[min(i, mask.shape[0] - 1), :n].double()
        lses.append(torch.logsumexp(s, -1))
        us.append(torch.softmax(s, -1) @ e)
    return torch.stack(us), torch.stack(lses)


def _enc_case(b, h, d, n, dtype, seed, pad=True, lengths=True):
    g = torch.Generator().manual_seed(seed)
    store = torch.full((b, n + 11, d), float("nan"), dtype=dtype)
    store[:, :n] = torch.randn(b, n, d, generator=g).to(dtype)
    lens = None
    if lengths and b > 1:
        lens = torch.tensor([n - (5 * i) % max(n - 1, 1) for i in range(b)], dtype=torch.long)
        for i in range(b):
            store[i, int(lens[i]):] = float("nan")
    qt = torch.randn(b, h, d, generator=g) / d ** 0.5
    mask = None
    if pad and n > 1:
        mask = torch.zeros(b, n)
        mask[0, : min(4, n - 1)] = F32_MIN
    return qt, store[:, :n], mask, lens


def _enc_check(qt, enc, mask, lens, splits=0):
    from kvslim.kernels import encdec_decode as ek

    u, lse = ek.encdec_decode(qt, enc, mask, lens, 0.9, splits)
    ref_u, ref_lse = _enc_oracle(qt, enc, mask, lens, 0.9)
    assert torch.isfinite(u).all()
    assert_rel_close(u, ref_u, torch.float32, "encdec op vs float64")
    assert_rel_close(lse, ref_lse, torch.float32, "encdec op lse vs float64")
    tw_u, _ = ek.reference(qt, enc, mask, lens, 0.9)
    assert_rel_close(tw_u, ref_u, torch.float32, "encdec twin vs float64")


def _enc_ops():
    from kvslim.kernels import encdec_decode as ek

    if not ek.available():
        pytest.skip("no C++ compiler: the op cannot be built here (its twin is used)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 80, 128, 256, 384])
def test_encdec_op_matches_float64(d, dtype):
    _enc_ops()
    _enc_check(*_enc_case(3, 6, d, 377, dtype, seed=d))


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_encdec_op_splits(splits):
    _enc_ops()
    _enc_check(*_enc_case(1, 6, 384, 1500, torch.float32, seed=4), splits=splits)


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 3), h=st.integers(1, 8), d=st.integers(1, 140), n=st.integers(1, 200), bf16=st.booleans(),
       pad=st.booleans(), lengths=st.booleans(), seed=st.integers(0, 2**16))
def test_encdec_op_fuzz(b, h, d, n, bf16, pad, lengths, seed):
    from kvslim.kernels import encdec_decode as ek

    if not ek.available():
        return
    _enc_check(*_enc_case(b, h, d, n, torch.bfloat16 if bf16 else torch.float32, seed, pad, lengths))


def test_encdec_op_bad_input_is_refused_by_name():
    _enc_ops()
    qt, enc, mask, _ = _enc_case(2, 3, 16, 40, torch.float32, seed=1)
    op = torch.ops.kvslim.encdec_decode
    for args, what in [((qt[..., :8], enc, None, None, 1.0), "qt must be float32"),
                       ((qt, enc.half(), None, None, 1.0), "enc must be float32 or bfloat16"),
                       ((qt, enc, mask[:, :3], None, 1.0), "mask must be"),
                       ((qt, enc, None, torch.tensor([1, 99]), 1.0), "lengths")]:
        with pytest.raises(ValueError, match=what):
            op(*args)


def test_shared_cross_attention_op_matches_reference():
    """Decode step of the shared-E cross-attention: op path against K/V materialised (float64) and the torch path."""
    _enc_ops()
    from kvslim.attention import encdec

    g = torch.Generator().manual_seed(3)
    b, h, dk, d, n = 3, 6, 64, 384, 500
    w_k, w_v = torch.randn(h * dk, d, generator=g) / d ** 0.5, torch.randn(h * dk, d, generator=g) / d ** 0.5
    b_v = torch.randn(h * dk, generator=g)
    w = encdec.CrossWeights.from_linear(w_k, w_v, b_v, h, 1.0, torch.float32)
    enc = torch.randn(b, n, d, generator=g)
    q = torch.randn(b, h, 1, dk, generator=g) / dk ** 0.5
    bias = torch.zeros(b, 1, 1, n)
    bias[1, ..., :30] = F32_MIN
    ref = encdec.reference_cross_attention(q.double(), enc.double(), w_k.double(), None, w_v.double(),
                                           b_v.double(), 1.0, bias.double())
    for bb in (None, bias):
        fused = encdec.shared_cross_attention(q, enc, w, bb)
        if bb is not None:
            assert_rel_close(fused, ref, torch.float32, "op path vs float64 reference")
        two = encdec.shared_cross_attention(q.expand(b, h, 2, dk), enc, w, bb)[:, :, :1]  # T = 2: torch path
        assert_rel_close(fused, two, torch.float32, "op path vs torch path")


# -- the mapped ops: per-head maps folded into the op (kvslim::slim_decode_mapped, kvslim::encdec_decode_mapped) ---

@pytest.mark.parametrize("splits", [0, 1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope", ["none", "raw", "rotated"])
def test_slim_mapped_op_matches_float64(rope, dtype, splits):
    """out_j = u_j · W_KV,j inside the op: against the float64 oracle mapped in float64, and the twin."""
    _ops()
    h, dk = 5, 64
    q, rows, cos, sin, mask, lens = _case(3, h, dk, 0 if rope == "none" else dk, 7, 409, dtype, seed=11)
    vmap = torch.randn(h, h * dk + 7, 48, generator=torch.Generator().manual_seed(2)) / 20
    rotated, scaling = rope == "rotated", dk ** -0.5
    out, lse = kernel.slim_decode_mapped(q, rows, vmap, cos, sin, mask, lens, scaling, rotated, splits)
    ref_u, ref_lse = oracle(q, rows, cos, sin, mask, lens, scaling, rotated)
    ref = torch.einsum("bhc,hck->bhk", ref_u, vmap.double())
    assert out.shape == (3, h, 48) and torch.isfinite(out).all()
    assert_rel_close(out, ref, torch.float32, "mapped op vs float64")
    assert_rel_close(lse, ref_lse, torch.float32, "mapped op lse vs float64")
    tw, _ = kernel.reference_mapped(q, rows, vmap, cos, sin, mask, lens, scaling, rotated)
    assert_rel_close(tw, ref, torch.float32, "mapped twin vs float64")


def _enc_mapped_case(b, h, dk, dv, d, n, dtype, seed, bias=True):
    qt, enc, mask, lens = _enc_case(b, h, d, n, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(b, h, dk, generator=g)
    w_k = torch.randn(h, dk, d, generator=g) / d ** 0.5
    w_v = torch.randn(h, dv, d, generator=g) / d ** 0.5
    b_v = torch.randn(h, dv, generator=g) if bias else None
    return q, enc, w_k, w_v, b_v, mask, lens


@pytest.mark.parametrize("splits", [0, 1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(6, 64, 64, 384), (3, 20, 12, 70), (8, 64, 64, 512)])
def test_encdec_mapped_op_matches_float64(shape, dtype, splits):
    """Absorbed query, one pass over E, W_V and b_V inside one op: against materialised K/V in float64."""
    _enc_ops()
    from kvslim.kernels import encdec_decode as ek

    h, dk, dv, d = shape
    for bias in (True, False):
        q, enc, w_k, w_v, b_v, mask, lens = _enc_mapped_case(3, h, dk, dv, d, 333, dtype, seed=d + h, bias=bias)
        out, lse = ek.encdec_decode_mapped(q, enc, w_k, w_v, b_v, mask, lens, 0.7, splits=splits)
        qt = torch.einsum("bhk,hkc->bhc", q.double(), w_k.double())
        ref_u, ref_lse = _enc_oracle(qt, enc, mask, lens, 0.7)
        ref = torch.einsum("bhc,hkc->bhk", ref_u, w_v.double()) + (0 if b_v is None else b_v.double())
        assert out.shape == (3, h, dv) and torch.isfinite(out).all()
        assert_rel_close(out, ref, torch.float32, "encdec mapped op vs float64")
        assert_rel_close(lse, ref_lse, torch.float32, "encdec mapped op lse vs float64")
        tw, _ = ek.reference_mapped(q, enc, w_k, w_v, b_v, mask, lens, 0.7)
        assert_rel_close(tw, ref, torch.float32, "encdec mapped twin vs float64")
        w_k_t, w_v_t = (w.transpose(1, 2).contiguous() for w in (w_k, w_v))  # the (h, d, dk) layout of slim's maps
        out_t, _ = ek.encdec_decode_mapped(q, enc, w_k_t, w_v_t, b_v, mask, lens, 0.7, dk_last=True, splits=splits)
        assert_rel_close(out_t, ref, torch.float32, "encdec mapped op, dk_last maps, vs float64")


def test_mapped_ops_refuse_bad_maps_by_name():
    _ops()
    _enc_ops()
    q, rows, cos, sin, mask, lens = _case(2, 3, 16, 16, 4, 50, torch.float32, seed=1)
    vmap = torch.randn(3, 52, 8)
    for bad, what in [(vmap[:2], "value_map must be a float32"), (vmap.double(), "value_map must be a float32"),
                      (vmap[0], "value_map must be")]:
        with pytest.raises(ValueError, match=what):
            torch.ops.kvslim.slim_decode_mapped(q, rows, bad, cos, sin, mask, lens, 1.0, False)
    q, enc, w_k, w_v, b_v, mask, lens = _enc_mapped_case(2, 3, 8, 8, 32, 40, torch.float32, seed=2)
    op = torch.ops.kvslim.encdec_decode_mapped
    for args, what in [((q, enc, w_k[:, :4], w_v, b_v), "w_k must be"), ((q, enc, w_k, w_v[..., :5], b_v), "w_v must"),
                       ((q, enc, w_k, w_v, b_v[:, :3]), "b_v must be"), ((q.double(), enc, w_k, w_v, b_v), "q must")]:
        with pytest.raises(ValueError, match=what):
            op(*args, mask, lens, 1.0)


def test_attention_modules_use_the_mapped_ops(monkeypatch):
    """The decode step of slim (K-cache, option 2, one sequence) and of the shared-E cross-attention goes through
    the mapped op (one op per layer and step), and its output equals the torch path."""
    _ops()
    _enc_ops()
    from kvslim.attention import encdec
    from kvslim.kernels import encdec_decode as ek

    calls = []
    for mod, name in ((kernel, "slim_decode_mapped"), (ek, "encdec_decode_mapped")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    g = torch.Generator().manual_seed(0)
    b, h, dk, n = 2, 4, 32, 90
    vmap = torch.randn(h, h * dk, dk, generator=g) / 10
    w = SlimLayerWeights("k", h, dk, h * dk, value_map=vmap, value_map_full=vmap.permute(1, 0, 2).reshape(h * dk, -1))
    q, cache = torch.randn(b, h, 1, dk, generator=g), torch.randn(b, n, h * dk, generator=g)
    for bq, bc in ((q[:1], cache[:1]), (q, cache)):  # batch 1: the mapped op; batch 2: op + batched W_KV
        fused = slim_attention(bq, bc, w, None, dk ** -0.5)
        torch_path = slim_attention(bq, bc, replace(w, kernel="torch"), None, dk ** -0.5)
        assert_rel_close(fused, torch_path, torch.float32, "mapped slim op vs torch path")
    w_k, w_v = torch.randn(h * dk, 64, generator=g) / 8, torch.randn(h * dk, 64, generator=g) / 8
    cw = encdec.CrossWeights.from_linear(w_k, w_v, torch.randn(h * dk, generator=g), h, 1.0, torch.float32)
    enc = torch.randn(b, n, 64, generator=g)
    one = encdec.shared_cross_attention(q, enc, cw)
    two = encdec.shared_cross_attention(q.expand(b, h, 2, dk), enc, cw)[:, :, :1]  # T = 2: torch path
    assert_rel_close(one, two, torch.float32, "mapped encdec op vs torch path")
    assert calls == ["slim_decode_mapped", "encdec_decode_mapped"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_x_cache_decode_uses_the_mapped_op(dtype, monkeypatch):
    """slim's X-cache decode step (Whisper's self-attention) through kvslim::encdec_decode_mapped (dk_last maps):
    equal to the torch path and to float64, padding mask included; the op is really called."""
    _enc_ops()
    from kvslim.kernels import encdec_decode as ek

    calls = []
    real = ek.encdec_decode_mapped
    monkeypatch.setattr(ek, "encdec_decode_mapped", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(7)
    b, h, dk, d, n = 3, 6, 16, 40, 37
    score_map, value_map = torch.randn(h, d, dk, generator=g) / 4, torch.randn(h, d, dk, generator=g) / 4
    w = SlimLayerWeights("x", h, dk, d, value_map=value_map, value_map_full=value_map.permute(1, 0, 2).reshape(d, -1),
                         score_map=score_map)
    q, cache = torch.randn(b, h, 1, dk, generator=g), torch.randn(b, n, d, generator=g).to(dtype)
    mask = torch.zeros(b, 1, 1, n)
    mask[1, ..., :5] = F32_MIN
    for m in (None, mask):
        fused = slim_attention(q, cache, w, m, 0.3)
        torch_path = slim_attention(q, cache, replace(w, kernel="torch"), m, 0.3)
        assert_rel_close(fused, torch_path, torch.float32, "X-cache op vs torch path")
        s = (torch.einsum("bhk,hck->bhc", q[:, :, 0].double(), score_map.double()) @ cache.double().transpose(1, 2))
        s = s * 0.3 + (0 if m is None else m[:, 0].double())
        ref = torch.einsum("bhc,hck->bhk", torch.softmax(s, -1) @ cache.double(), value_map.double())
        assert_rel_close(fused[:, :, 0], ref, torch.float32, "X-cache op vs float64")
    assert len(calls) == 2
    ok = torch.ops.kvslim.encdec_decode_mapped(q[:, :, 0], cache, score_map, value_map, None, None, None, 1.0, True)
    with pytest.raises(ValueError, match="w_k must be"):  # (h, dk, d) is the other layout
        torch.ops.kvslim.encdec_decode_mapped(q[:, :, 0], cache, score_map.transpose(1, 2).contiguous(), value_map,
                                              None, None, None, 1.0, True)
    assert ok[0].shape == (b, h, dk)
