"""The Triton turbo decode kernel (``kernels/triton/turbo_decode.py``) against the pure-torch twin and a float64 oracle
under ``TRITON_INTERPRET=1`` (CPU tensors; on a GPU machine run with ``TRITON_INTERPRET=0`` for CUDA tensors), the
dispatch by ``KVSLIM_BACKEND``, and an sm_90 compile of the kernel (Triton's compiler, not its interpreter)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (tests/conftest.py sets it first)

import pytest  # noqa: E402
import torch  # noqa: E402
from test_turbo_decode import _format, _oracle, _oracle_lengths, lengths_case  # noqa: E402
from triton_aot import assert_ids_clamped, compile_for_sm90, kernel_device  # noqa: E402

from kvslim.caches import StoreSpec  # noqa: E402
from kvslim.kernels import turbo_decode as kernel  # noqa: E402

triton = pytest.importorskip("triton")
from kvslim.kernels.triton import turbo_decode as tt  # noqa: E402

DEVICE = kernel_device()
pytestmark = pytest.mark.usefixtures("kernel_dev")  # stage 1 of gpu_check selects only such tests (issue 42)


@pytest.mark.parametrize("spec,tail,masked,biased", [
    (StoreSpec(3, codec="turbo", rotation="hadamard", scale_dtype=torch.float16), True, True, False),
    (StoreSpec(3, codec="turbo", rotation="orthogonal", outliers=16, value_bits=2), False, False, True),
    (StoreSpec(2, codec="turbo", rotation="orthogonal", outliers=8, scale_dtype=torch.bfloat16), True, False, False),
    (StoreSpec(4, codec="turbo", rotation="hadamard", value_bits=3), False, True, False),
    (StoreSpec(3, codec="turbo", rotation="orthogonal", outliers=16, scale_dtype=torch.float16), True, True, True),
])
def test_kernel_matches_the_twin_and_a_float64_oracle(spec, tail, masked, biased):
    ks, vs, keys, values = _format(spec, n=70)  # more than two blocks of 32 tokens
    b, hk, n, d = keys.shape
    g = torch.Generator().manual_seed(6)
    q = torch.randn(b, hk, 3, d, generator=g)
    kt = vt = mask = bias = None
    if tail:
        kt, vt = torch.randn(b, hk, 5, d, generator=g), torch.randn(b, hk, 5, d, generator=g)
    if masked:
        mask = torch.zeros(b, n + (5 if tail else 0))
        mask[0, 3:9] = float("-inf")
    if biased:  # factors of RoPE-centred keys' per-row score term, W = 24, rows past n (only [0, n) is read)
        bias = (2 * torch.randn(b, hk, 3, 24, generator=g), torch.randn(n + 3, 24, generator=g))
    move = (lambda t: None if t is None else t.to(DEVICE))  # noqa: E731
    args = [move(t) for t in (q, ks.data, ks.scale, vs.data, vs.scale)]
    got = tt.turbo_decode_triton(*args, spec.outliers, spec.bits, spec.for_values().bits, kernel.levels(DEVICE), n,
                                 move(kt), move(vt), move(mask), 0.125, *[move(t) for t in (bias or (None, None))])
    ref = kernel.reference(q, ks.data, ks.scale, vs.data, vs.scale, spec.outliers, spec.bits,
                           spec.for_values().bits, n, kt, vt, mask, 0.125, *(bias or (None, None)))
    exact = _oracle(q, keys, values, kt, vt, mask, 0.125, bias)
    for a, r, e in zip(got, ref, exact):
        torch.testing.assert_close(a.cpu().double(), e, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(a.cpu(), r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("spec,lens,tail", [
    (StoreSpec(3, codec="turbo", rotation="orthogonal", outliers=16, value_bits=2, scale_dtype=torch.float16),
     (5, 49), False),
    (StoreSpec(2, codec="turbo", rotation="hadamard", scale_dtype=torch.bfloat16), (0, 70), True),
    (StoreSpec(4, codec="turbo", rotation="hadamard", value_bits=3), (33, 20), True),
])
def test_kernel_lengths_skip_the_slots_past_them(spec, lens, tail):
    """``lengths`` shorter than the buffer (inside one block of 32, across blocks, 0 with a tail, the whole buffer),
    differing across the batch: the kernel equals the twin and the float64 oracle over each sequence's own rows; NaN
    scales and garbage codes past the lengths never reach the result."""
    ks, vs, keys, values = _format(spec, n=70)
    n = keys.shape[2]
    lengths, q, kt, vt, mask, bias, codes = lengths_case(ks, vs, keys, lens, tail, seed=8, groups=3,
                                                         mask_rows=keys.shape[0], masked=(1, 1))
    args = (q, *codes)
    bits = (spec.outliers, spec.bits, spec.for_values().bits)
    move = (lambda t: None if t is None else t.to(DEVICE))  # noqa: E731
    got = tt.turbo_decode_triton(*[move(t) for t in args], *bits, kernel.levels(DEVICE), n, move(kt), move(vt),
                                 move(mask), 0.125, *[move(t) for t in bias], move(lengths))
    ref = kernel.reference(*args, *bits, n, kt, vt, mask, 0.125, *bias, lengths=lengths)
    exact = _oracle_lengths(q, keys, values, kt, vt, mask, 0.125, lengths, bias)
    for a, r, e in zip(got, ref, exact):
        torch.testing.assert_close(a.cpu().double(), e, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(a.cpu(), r, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="lengths"):  # the op's own checks: a value past n, a wrong dtype
        tt.turbo_decode_triton(*[move(t) for t in args], *bits, kernel.levels(DEVICE), n, move(kt), move(vt),
                               move(mask), 0.125, None, None, move(torch.tensor([n + 1, 0])))
    with pytest.raises(ValueError, match="lengths"):
        tt.turbo_decode_triton(*[move(t) for t in args], *bits, kernel.levels(DEVICE), n, move(kt), move(vt),
                               move(mask), 0.125, None, None, move(lengths.int()))


def test_dispatch_by_backend(monkeypatch):
    spec = StoreSpec(3, codec="turbo", rotation="hadamard")
    ks, vs, _, _ = _format(spec, n=20)
    q = torch.randn(2, 2, 1, 64)
    monkeypatch.setenv("KVSLIM_BACKEND", "triton")
    a = kernel.turbo_decode(q, ks.data, ks.scale, vs.data, vs.scale, 0, 3, 3, 20, scaling=0.125)
    monkeypatch.setenv("KVSLIM_BACKEND", "torch")
    b = kernel.turbo_decode(q, ks.data, ks.scale, vs.data, vs.scale, 0, 3, 3, 20, scaling=0.125)
    torch.testing.assert_close(a[0], b[0], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="k_out=64 must be in"):
        tt.check(q, ks.data, ks.scale, vs.data, vs.scale, 64, 3, 3, 20, None, None, None)
    with pytest.raises(ValueError, match="bias_rows must be"):
        tt.check(q, ks.data, ks.scale, vs.data, vs.scale, 0, 3, 3, 20, None, None, None, torch.zeros(2, 2, 1, 8),
                 torch.zeros(19, 8))


@pytest.mark.parametrize("spec,page", [
    (StoreSpec(3, codec="turbo", rotation="orthogonal", outliers=16, scale_dtype=torch.float16), 32),
    (StoreSpec(2, codec="turbo", rotation="hadamard", value_bits=2), 16),
])
def test_page_list_reads_rows_in_place(spec, page):
    """Sparse decode's page list: slot t (and its RoPE-centred bias row) read at stored row pages[b, h, t // page]·
    page + t % page, pages in any order and per head, the last cut by n: the kernel equals the twin over the
    gathered rows (the bias rows gathered per sequence and head), and the dispatch passes the list through."""
    ks, vs, keys, values = _format(spec, n=8 * page)
    b, hk, stored, d = keys.shape
    g = torch.Generator().manual_seed(page)
    pages = torch.stack([torch.stack([torch.randperm(8, generator=g)[:4] for _ in range(hk)]) for _ in range(b)])
    n = 3 * page + page // 2
    q = torch.randn(b, hk, 3, d, generator=g)
    kt, vt = torch.randn(b, hk, 5, d, generator=g), torch.randn(b, hk, 5, d, generator=g)
    bias = (2 * torch.randn(b, hk, 3, 24, generator=g), torch.randn(stored + 3, 24, generator=g))
    bits = (spec.outliers, spec.bits, spec.for_values().bits)
    codes = (ks.data, ks.scale, vs.data, vs.scale)
    from kvslim.kernels.quant_decode import paged_rows

    rows = (pages[..., None] * page + torch.arange(page)).reshape(b, hk, -1)
    ref = kernel.reference(q, *(paged_rows(t, pages, page) for t in codes), *bits, n, kt, vt, None, 0.125, bias[0],
                           bias[1][rows])
    move = (lambda t: None if t is None else t.to(DEVICE))  # noqa: E731
    got = tt.turbo_decode_triton(*(move(t) for t in (q, *codes)), *bits, kernel.levels(DEVICE), n, move(kt), move(vt),
                                 None, 0.125, move(bias[0]), move(bias[1]), None, move(pages), page)
    for a, r in zip(got, ref):
        torch.testing.assert_close(a.cpu(), r, rtol=1e-4, atol=1e-5)
    assert_ids_clamped(lambda ids, _: tt.turbo_decode_triton(
        *(move(t) for t in (q, *codes)), *bits, kernel.levels(DEVICE), n, move(kt), move(vt), None, 0.125,
        move(bias[0]), move(bias[1]), None, move(ids), page), pages, stored // page)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSLIM_BACKEND", "triton")
        out, _ = kernel.turbo_decode(*(move(t) for t in (q, *codes)), *bits, n, move(kt), move(vt), None, 0.125,
                                     move(bias[0]), move(bias[1]), pages=move(pages), page=page)
    torch.testing.assert_close(out.cpu(), ref[0], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="pages must be"):
        tt.check(q, *codes, *bits, n, kt, vt, None, pages=pages[:, :, :2], page=page)
    with pytest.raises(ValueError, match="page must be a power of two ≥ 16"):
        tt.check(q, *codes, *bits, n, kt, vt, None, pages=pages, page=8)


def test_kernel_compiles_for_sm90():
    compile_for_sm90('''
from kvslim.kernels.triton import turbo_decode as tt
types = {name: "*fp32" for name in ("Q", "LEV", "KT", "VT", "MASK", "BAB", "BROWS", "OUT", "LSE")}
types.update({name: "*u8" for name in ("KC", "VC")}, KS="*fp16", VS="*fp16", scaling="fp32", LENGTHS="*i64",
             PAGES="*i64")
for kout, kb in ((0, 3), (16, 3), (8, 2), (0, 4)):
    build(tt._turbo_decode, types, dict(D=64, D_PAD=64, G_PAD=16, BLOCK_N=32, KOUT=kout, KB=kb, VB=kb,
          KBYTES=(kout * (kb + 1) + (64 - kout) * kb) // 8, VBYTES=8 * kb, KPARTS=2 if kout else 1, HAS_TAIL=True,
          HAS_MASK=True, HAS_BIAS=kout > 0, W_PAD=64, HAS_LEN=kout != 8, PAGE=0), 4)
build(tt._turbo_decode, types, dict(D=64, D_PAD=64, G_PAD=16, BLOCK_N=32, KOUT=16, KB=3, VB=3, KBYTES=26, VBYTES=24,
      KPARTS=2, HAS_TAIL=True, HAS_MASK=False, HAS_BIAS=True, W_PAD=64, HAS_LEN=False, PAGE=32), 4)  # a page list
''')
