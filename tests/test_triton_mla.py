"""The Triton MLA decode kernels (``kernels/triton/mla_decode.py``, DeepSeek's absorbed decode over the latent cache)
against the pure-torch twin and the float64 formula ``attention.mla.attend_reference`` under ``TRITON_INTERPRET=1``
(CPU tensors; on a GPU machine run with ``TRITON_INTERPRET=0`` to test the compiled kernels on CUDA tensors); the
dispatch by ``KVSLIM_BACKEND``; ``torch.compile(fullgraph=True)`` of the registered op; tiny DeepSeek-V3 / V2-Lite
models with ``mla`` generating HF's greedy tokens through the kernels."""

from __future__ import annotations

import math
import os
from dataclasses import replace

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (tests/conftest.py sets it first)

import pytest  # noqa: E402
import torch  # noqa: E402
from test_mla_model import _generate, _logit_err, _prompt, deepseek  # noqa: E402
from tolerances import LOGIT_ATOL, assert_close, assert_error_ratio, assert_rel_close, max_err  # noqa: E402
from triton_aot import compile_for_sm90, kernel_device  # noqa: E402

import kvslim  # noqa: E402
from kvslim.attention import mla  # noqa: E402
from kvslim.kernels import backend  # noqa: E402
from kvslim.kernels import mla_decode as kernel  # noqa: E402

triton = pytest.importorskip("triton")
from kvslim.kernels.triton import mla_decode as tk  # noqa: E402

F32, F64 = torch.float32, torch.float64
DEVICE = kernel_device()  # CPU tensors under the interpreter, else CUDA; skips the module otherwise
pytestmark = pytest.mark.usefixtures("kernel_dev")  # stage 1 of gpu_check selects only such tests (issue 42)

DK, DV, DR = 16, 24, 64  # rope dim 64 as in V2/V3; the rank (512 there) scaled down per case



@pytest.fixture
def launches(monkeypatch):
    """The number of Triton launches (the registered op looks ``launch`` up at call time)."""
    calls = []
    original = tk.launch
    monkeypatch.setattr(tk, "launch", lambda *a, **k: calls.append(a[2].shape) or original(*a, **k))
    return calls


def _case(b, h, dc, t, lengths, dtype, seed):
    """Random MLA inputs with rows past each sequence's length (and ``mask`` there) NaN-poisoned."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=F64)  # noqa: E731
    kv_b = r(h * (DK + DV), dc) / math.sqrt(dc)
    w64 = mla.absorb(kv_b, h, DK, DV, scale=(DK + DR) ** -0.5 * 1.3, dtype=F64)
    q_nope, q_pe = r(b, h, 1, DK), r(b, h, 1, DR)
    c_kv, k_pe = r(b, t, dc).to(dtype), r(b, t, DR).to(dtype)  # the cache, rounded to its dtype
    mask = torch.zeros(b, t)
    mask[0, 3] = float("-inf")
    mask[-1, :2] = torch.finfo(F32).min  # HF's left padding
    mask[1, 7] = -2.5
    for i, n in enumerate(lengths.tolist()):
        c_kv[i, n:] = k_pe[i, n:] = mask[i, n:] = float("nan")
    return q_nope, q_pe, c_kv, k_pe, mask, w64


def _ref64(q_nope, q_pe, c_kv, k_pe, mask, w64, lengths):
    """float64 ``attend_reference`` per sequence over its live rows only: (B, H, dv)."""
    outs = []
    for i, n in enumerate(lengths.tolist()):
        m = mask[i:i + 1, :n].double()[:, None, None]  # (1, 1, 1, n) additive
        outs.append(mla.attend_reference(q_nope[i:i + 1], q_pe[i:i + 1], c_kv[i:i + 1, :n].double(),
                                         k_pe[i:i + 1, :n].double(), w64, m))
    return torch.cat(outs)[:, :, 0]


def _q_abs(q_nope, w64):
    return torch.matmul(q_nope, w64.w_uk)[:, :, 0].float()  # (B, H, dc)


def _out(u, w64):
    return torch.einsum("bhc,hcd->bhd", u.double().cpu(), w64.w_uv_t)  # u W_UV^T: (B, H, dv)


@pytest.mark.parametrize("h,dc", [(4, 64), (16, 128), (20, 96)])  # 20 heads: two head blocks, the second partial
@pytest.mark.parametrize("splits", [1, 3, 0])
def test_kernel_matches_twin_and_float64(h, dc, splits, launches, monkeypatch):
    """Ragged lengths (one not a multiple of the row block), NaN rows and mask past them, −inf / finfo.min / finite
    mask entries, forced 1 and 3 splits and the automatic choice: kernel == twin == float64 formula (fp32 cache)."""
    monkeypatch.setenv(backend.ENV, "triton")
    lengths = torch.tensor([150, 37, 96])
    q_nope, q_pe, c_kv, k_pe, mask, w64 = _case(3, h, dc, 160, lengths, F32, seed=h + dc)
    args = (_q_abs(q_nope, w64), q_pe[:, :, 0].float(), c_kv, k_pe)
    dev = tuple(x.to(DEVICE) for x in args) + (lengths.to(DEVICE), mask.to(DEVICE))
    u, lse = kernel.mla_decode(*dev, w64.scale, splits)
    assert len(launches) == 1 and u.device == DEVICE and u.dtype == lse.dtype == F32
    u_twin, lse_twin = kernel.reference(*args, lengths, mask, w64.scale)
    assert torch.isfinite(u).all() and torch.isfinite(lse).all()
    assert_rel_close(u.cpu(), u_twin, F32, "u vs twin")
    assert_rel_close(lse.cpu(), lse_twin, F32, "lse vs twin")
    assert_close(_out(u, w64), _ref64(q_nope, q_pe, c_kv, k_pe, mask, w64, lengths), F32, "out vs float64")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_cache_within_twice_the_torch_path_error(dtype, monkeypatch):
    """bf16/fp16 cache: the kernel's error against float64 (same rounded cache) ≤ 2× that of today's torch path in the
    same dtype (``attend_elided``) + floor: the error-ratio rule."""
    monkeypatch.setenv(backend.ENV, "triton")
    b, h, dc, t = 2, 16, 128, 200
    lengths = torch.tensor([t, t])
    q_nope, q_pe, c_kv, k_pe, _, w64 = _case(b, h, dc, t, lengths, dtype, seed=5)
    mask = torch.zeros(b, 1, 1, t, dtype=torch.bool).logical_not_()
    mask[1, ..., :4] = False  # a left-padded sequence (HF's boolean mask)
    ref = _ref64(q_nope, q_pe, c_kv, k_pe, torch.zeros(b, t).masked_fill(~mask[:, 0, 0], float("-inf")), w64,
                 lengths)
    w = mla.absorb(w64.kv_b.to(dtype), h, DK, DV, w64.scale)  # fp32 absorbed weights, as apply() keeps them
    qn, qp = q_nope.to(dtype), q_pe.to(dtype)
    base = mla.attend_elided(qn, qp, c_kv, k_pe, w, mask)[:, :, 0]
    w_dev = replace(w, kv_b=w.kv_b.to(DEVICE), w_uk=w.w_uk.to(DEVICE), w_uv_t=w.w_uv_t.to(DEVICE))
    opt = mla.attend_decode(*(x.to(DEVICE) for x in (qn, qp, c_kv, k_pe)), w_dev, mask.to(DEVICE))[:, :, 0]
    assert opt.dtype == dtype
    assert_error_ratio(opt.cpu(), base, ref, dtype, f"{dtype} kernel")


def test_padding_rows_never_read(monkeypatch):
    """NaN or huge values past ``lengths`` change nothing, bit for bit; a sequence with no row gives u = 0, lse = −inf
    (no NaN), like the twin."""
    monkeypatch.setenv(backend.ENV, "triton")
    lengths = torch.tensor([40, 0, 65])
    q_nope, q_pe, c_kv, k_pe, mask, w64 = _case(3, 4, 64, 96, lengths, F32, seed=3)
    args = [x.to(DEVICE) for x in (_q_abs(q_nope, w64), q_pe[:, :, 0].float(), c_kv, k_pe, lengths, mask)]
    u, lse = kernel.mla_decode(*args, w64.scale, 2)
    for i, n in enumerate(lengths.tolist()):
        args[2][i, n:], args[3][i, n:], args[5][i, n:] = 1e30, -1e30, 5.0
    u2, lse2 = kernel.mla_decode(*args, w64.scale, 2)
    assert torch.equal(u, u2) and torch.equal(lse, lse2)
    assert torch.isfinite(u).all() and (u[1] == 0).all() and (lse[1] == float("-inf")).all()
    u_twin, lse_twin = kernel.reference(*(a.cpu() for a in args), w64.scale)
    assert torch.equal(lse_twin[1], lse[1].cpu()) and (u_twin[1] == 0).all()


def test_compiles_fullgraph(monkeypatch, launches):
    """``torch.compile(fullgraph=True)`` traces a decode step through the dispatch (``kernel_decodes``, the backend
    choice) and the registered op (fake impl): the same result as eager, both through the launcher."""
    monkeypatch.setenv(backend.ENV, "triton")
    lengths = torch.tensor([64, 64])
    q_nope, q_pe, c_kv, k_pe, _, w64 = _case(2, 4, 64, 64, lengths, F32, seed=9)
    w = mla.absorb(w64.kv_b.float().to(DEVICE), 4, DK, DV, w64.scale)
    mask = torch.ones(2, 1, 1, 64, dtype=torch.bool)
    mask[1, ..., :5] = False
    args = [x.to(DEVICE) for x in (q_nope.float(), q_pe.float(), c_kv, k_pe, mask)]

    def step(qn, qp, c, kp, m):
        assert mla.kernel_decodes(qn, c, m)
        return mla.attend_decode(qn, qp, c, kp, w, m) * 2

    eager = step(*args)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
    assert torch.equal(eager, compiled) and len(launches) == 2
    assert_close(eager.cpu() / 2, mla.attend_elided(*(a.cpu() for a in args[:4]), mla.absorb(w64.kv_b.float(), 4, DK,
                 DV, w64.scale), mask), F32, "compiled step vs attend_elided")


def test_dispatch_by_backend(monkeypatch, launches):
    """CPU default and ``KVSLIM_BACKEND=torch``: the twin; ``cpp``: the twin with one warning (no C++ op for MLA);
    ``triton`` without the interpreter on CPU: refused by name; uncovered inputs: the twin with one warning."""
    x = [a.to(DEVICE) for a in (torch.randn(1, 4, 32), torch.randn(1, 4, 16), torch.randn(1, 20, 32),
                                torch.randn(1, 20, 16))]
    twin = kernel.reference(*(a.cpu() for a in x))
    monkeypatch.setattr(backend, "_warned", set())
    monkeypatch.setenv(backend.ENV, "torch")
    assert torch.equal(kernel.mla_decode(*x)[0].cpu(), twin[0]) and not launches
    monkeypatch.setenv(backend.ENV, "cpp")
    with pytest.warns(UserWarning, match="no C.. op"):
        assert kernel.backend_for(DEVICE) == "torch"
    monkeypatch.setenv(backend.ENV, "triton")
    grad = x[2].clone().requires_grad_()
    backend._warned.clear()  # one warning per family and process
    with pytest.warns(UserWarning, match="grad"):
        kernel.mla_decode(x[0], x[1], grad, x[3])
    assert not launches
    kernel.mla_decode(*x)
    assert len(launches) == 1
    if DEVICE.type == "cpu":
        monkeypatch.delenv(backend.ENV)
        assert kernel.backend_for("cpu") == "torch"
        monkeypatch.setenv(backend.ENV, "triton")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            kernel.mla_decode(*x)


@pytest.mark.parametrize("bad,name", [
    (dict(c_kv=torch.randn(2, 10, 16)), "c_kv"), (dict(k_pe=torch.randn(2, 10, 8)), "k_pe"),
    (dict(q_abs=torch.randn(2, 4)), "q_abs"), (dict(lengths=torch.tensor([3, 4], dtype=torch.int32)), "lengths"),
    (dict(mask=torch.zeros(2, 9)), "mask"), (dict(mask=torch.zeros(3, 10)), "mask"),
])
def test_bad_input_named(bad, name):
    good = dict(q_abs=torch.randn(2, 4, 32), q_pe=torch.randn(2, 4, 16), c_kv=torch.randn(2, 10, 32),
                k_pe=torch.randn(2, 10, 16), lengths=None, mask=None)
    with pytest.raises(ValueError, match=name):
        kernel.mla_decode(**{**good, **bad})


@pytest.mark.parametrize("name,impl", [("v3", "elided"), ("v2-lite", "absorbed")])
def test_generate_through_the_kernel_matches_hf(name, impl, monkeypatch, launches):
    """``KVSLIM_BACKEND=triton``: every decode step of every layer runs the Triton launcher; fp32 greedy tokens are
    HF's own (its cache and attention), logits within the fp32 contract."""
    model = deepseek(name).to(DEVICE)
    ids = _prompt().to(DEVICE)
    ref = _generate(model, ids, new=8)
    monkeypatch.setenv(backend.ENV, "triton")
    kvslim.apply(model, "mla", impl=impl)
    out = _generate(model, ids, new=8)
    assert len(launches) == 7 * model.config.num_hidden_layers  # 7 decode steps (the prefill stays torch)
    assert torch.equal(out.sequences, ref.sequences), f"{name}: tokens differ from HF"
    assert _logit_err(out, ref) <= LOGIT_ATOL[F32]


def test_padded_batch_and_quantized_latents_through_the_kernel(monkeypatch, launches):
    """A left-padded batch (HF's decode mask into the op) matches HF; ``bits=8`` (rows dequantized by the cache,
    then the same kernel) matches the torch path of the same cache."""
    from conftest import padded_batch

    ids, att = (x.to(DEVICE) for x in padded_batch(batch=2, length=10))
    model = deepseek("v3", attn_implementation="eager").to(DEVICE)
    ref = _generate(model, ids, new=6, attention_mask=att)
    monkeypatch.setenv(backend.ENV, "triton")
    kvslim.apply(model, "mla")
    out = _generate(model, ids, new=6, attention_mask=att)
    assert launches and torch.equal(out.sequences, ref.sequences) and _logit_err(out, ref) <= LOGIT_ATOL[F32]
    kvslim.apply(model, "mla", bits=8, group_size=16)
    quant = _generate(model, ids, new=6, attention_mask=att)
    monkeypatch.setenv(backend.ENV, "torch")
    n = len(launches)
    twin = _generate(model, ids, new=6, attention_mask=att)
    assert len(launches) == n and torch.equal(quant.sequences, twin.sequences)
    assert max(max_err(a, b) for a, b in zip(quant.logits, twin.logits)) <= LOGIT_ATOL[F32]


AOT = r'''
from kvslim.kernels.triton import mla_decode as tm

# the real V2/V3 latent (dc 512, rope 64) in bf16 and fp32
for dt in ("bf16", "fp32"):
    types = dict(QA="*fp32", QP="*" + dt, C="*" + dt, KP="*" + dt, LENGTHS="*i64", MASK="*fp32", PO="*fp32",
                 PL="*fp32", scale="fp32")
    build(tm._mla_stage1, types, dict(DC=512, DR=64, C_PAD=512, R_PAD=64, BLOCK_H=tm.BLOCK_H, BLOCK_N=32,
          HALF=dt != "fp32", UPCAST=False, HAS_LENGTHS=True, HAS_MASK=True), 4, 2)
build(tm._mla_stage2, dict(PO="*fp32", PL="*fp32", OUT="*fp32", LSE="*fp32"), dict(DC=512, C_PAD=512, S_PAD=64), 4, 2)
'''


def test_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter runs the kernels as Python; this compiles them to a cubin for sm_90 (Triton's bundled ptxas,
    no GPU needed), so code that only the compiler rejects fails here too."""
    compile_for_sm90(AOT)
