"""The Triton page scores of a sparse step (``kernels/triton/sparse_select.py``) against the torch twin and a float64
oracle under ``TRITON_INTERPRET=1`` (CPU tensors; CUDA tensors on a GPU machine), the dispatch under
``KVSLIM_BACKEND=triton``, and an sm_90 compile of the kernel (Triton's compiler, not its interpreter)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (tests/conftest.py sets it first)

import pytest  # noqa: E402
import torch  # noqa: E402
from test_sparse_select_op import _oracle, case  # noqa: E402
from triton_aot import compile_for_sm90, kernel_device  # noqa: E402

from kvslim.kernels import sparse_select as ss  # noqa: E402

triton = pytest.importorskip("triton")
from kvslim.kernels.triton import sparse_select as ts  # noqa: E402

DEVICE = kernel_device()
pytestmark = pytest.mark.usefixtures("kernel_dev")  # stage 1 of gpu_check selects only such tests (issue 42)


def _case(shape, dtype, seed=0):
    q, boxes, scales = case(*shape, dtype, seed + sum(shape), spare=5)
    return tuple(None if t is None else t.to(DEVICE) for t in (q, boxes, scales))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, "int8"])
@pytest.mark.parametrize("shape", [(1, 2, 7, 64, 300), (2, 3, 1, 32, 70), (1, 1, 4, 24, 33), (1, 2, 2, 128, 40)])
def test_scores_match_the_twin_and_the_pages_a_float64_ranking(dtype, shape):
    """fp32 scores equal the twin's (``sparse_select.scores``) to fp32 rounding, and the pages chosen from them are
    the float64 ranking's, on fp16/fp32 boxes and the library's int8 codes; page counts not a multiple of the block,
    a head dim that is not a power of two, one query head and seven."""
    q, boxes, scales = _case(shape, dtype)
    b, h, g, d, pages = shape
    got = ts.page_scores(q, boxes, pages, d ** -0.5, scales)
    want = ss.scores(q, boxes[:, :, :pages], d ** -0.5, scales)
    # both sum 2D fp32 products of magnitude up to |q|·|box| (the offsets make it ~10³): rounding to ~1e-6 of it
    v = ss.values(boxes[:, :, :pages], scales)
    mag = float((torch.cat((q, q.abs()), -1).abs() @ v.abs().transpose(-1, -2)).max()) * d ** -0.5
    torch.testing.assert_close(got, want, atol=1e-6 * mag, rtol=0)
    k = max(1, pages // 5)
    idx = ss.top_pages(got, k, pages, 0)
    assert torch.equal(idx.cpu(), _oracle(q.cpu(), boxes.cpu(), pages, k, d ** -0.5, False,
                                          None if scales is None else scales.cpu()))


@pytest.mark.parametrize("force_first", [True, False])
def test_backend_triton_routes_the_choice_through_the_kernel(monkeypatch, force_first):
    """Under ``KVSLIM_BACKEND=triton`` the choice (page 0 forced or not, the region's rest listed) comes from the
    kernel's scores and equals the twin's, a left-padded batch's (``first`` / ``force``) too."""
    monkeypatch.setenv("KVSLIM_BACKEND", "triton")
    q, boxes, scales = _case((2, 2, 7, 64, 200), "int8", seed=3)
    calls = []
    real = ts.page_scores
    monkeypatch.setattr(ts, "page_scores", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = ss.sparse_select(q, boxes, 200, 30, 0.125, force_first, 4, scales=scales)
    assert calls == [1]
    assert torch.equal(got, ss.reference(q, boxes, 200, 30, 0.125, force_first, 4, scales=scales))
    first = torch.tensor([0, 50], device=DEVICE)
    force = torch.tensor([False, True], device=DEVICE)
    padded = ss.sparse_select(q, boxes, 200, 30, 0.125, False, 3, first, force, scales)
    assert calls == [1, 1]
    assert torch.equal(padded, ss.reference(q, boxes, 200, 30, 0.125, False, 3, first, force, scales))
    assert (padded[1, :, 0] == 50).all() and (padded[1, :, :30] >= 50).all()  # forced; no padding page chosen
    with pytest.raises(ValueError, match="first and force"):
        ss.sparse_select(q, boxes, 200, 30, 0.125, False, 0, first, None, scales)
    with pytest.raises(ValueError, match="first must be int64"):
        ss.sparse_select(q, boxes, 200, 30, 0.125, False, 0, first.int(), force, scales)


@pytest.mark.parametrize("dtype", [torch.float16, "int8"])
def test_left_padded_scores_match_the_twin(dtype):
    """With ``first`` (a left-padded batch) the kernel's scores are the twin's before its forced page: each row's
    pages before ``first[b]`` ``-inf``, the log-softmax over the rest (rows at 0, mid-block and past a block)."""
    q, boxes, scales = _case((3, 2, 7, 64, 150), dtype, seed=5)
    first = torch.tensor([0, 17, 64], device=DEVICE)
    got = ts.page_scores(q, boxes, 150, 0.125, scales, first)
    b = q.shape[0]
    pad = torch.arange(150, device=DEVICE)[None, :] < first[:, None]
    bound = torch.cat((q, q.abs()), -1) @ ss.values(boxes[:, :, :150], scales).transpose(-1, -2)
    want = torch.log_softmax((bound * 0.125).masked_fill(pad[:, None, None], float("-inf")), -1).logsumexp(2)
    assert torch.isneginf(got[pad[:, None].expand(b, 2, 150)]).all()
    last = torch.tensor([150, 100, 64], device=DEVICE)  # a static step's candidate counts (the last: none)
    cut = ts.page_scores(q, boxes, 150, 0.125, scales, first, last)
    live = ~pad & (torch.arange(150, device=DEVICE)[None] < last[:, None])
    want_cut = torch.log_softmax((bound * 0.125).masked_fill(~live[:, None, None], float("-inf")), -1).logsumexp(2)
    assert torch.isneginf(cut[~live[:, None].expand(b, 2, 150)]).all()
    torch.testing.assert_close(cut[:2], want_cut[:2], atol=1e-6 * float(bound.abs().max()) * 0.125, rtol=0)
    mag = float((torch.cat((q, q.abs()), -1).abs() @ ss.values(boxes[:, :, :150], scales).abs().transpose(-1, -2))
                .max()) * 0.125
    torch.testing.assert_close(got, want, atol=1e-6 * mag, rtol=0)  # as the unpadded scores above


def test_triton_path_refuses_bad_input(monkeypatch):
    """The Triton path checks what the op checks: int8 boxes without scales, boxes of another head dim, a page count
    past the boxes'; refused by name."""
    monkeypatch.setenv("KVSLIM_BACKEND", "triton")
    q, boxes, scales = _case((1, 2, 7, 64, 40), "int8")
    with pytest.raises(ValueError, match="scales"):
        ss.sparse_select(q, boxes, 40, 5, 0.125, True)
    with pytest.raises(ValueError, match="boxes must be"):
        ss.sparse_select(q[..., :32].contiguous(), boxes, 40, 5, 0.125, True, scales=scales)
    with pytest.raises(ValueError, match="n_pages"):
        ss.sparse_select(q, boxes, boxes.shape[2] + 1, 5, 0.125, True, scales=scales)


def test_kernel_compiles_for_sm90():
    compile_for_sm90('''
from kvslim.kernels.triton import sparse_select as ts
types = dict(Q="*fp32", OUT="*fp32", scaling="fp32", SC="*fp16", FIRST="*i64", LAST="*i64")
for box, coded in (("*i8", True), ("*fp16", False), ("*fp32", False)):
    for g, d in ((1, 64), (7, 64), (8, 128), (4, 24)):
        for padded, static in ((False, False), (True, False), (True, True)):
            build(ts._page_scores, {**types, "BOX": box}, dict(G=g, G_PAD=triton.next_power_of_2(g), D=d,
                  D_PAD=triton.next_power_of_2(d), GROUP=16 if d % 16 == 0 else d, CODED=coded, HAS_FIRST=padded,
                  HAS_LAST=static, BLOCK_P=32), 4)
''')
