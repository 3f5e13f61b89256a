"""``kvslim::sparse_select`` (a sparse step's page choice in one call) against its torch twin and a float64
oracle: the same pages, on fp16 and fp32 boxes and on the library's int8 boxes (codes with fp16 scales per 16
channels), with and without page 0 forced, with the region's rest listed."""

from __future__ import annotations

import pytest
import torch

from kvslim.caches.sparse import box_group, encode_box
from kvslim.kernels import sparse_select as ss


def _boxes(values: torch.Tensor, dtype):
    """(B, H, P, 2D) fp32 [c | r] -> (boxes, scales): as ``dtype``, or (``"int8"``) the library's codes of them
    (page 0's centre the reference)."""
    if dtype != "int8":
        return values.to(dtype), None
    d = values.shape[-1] // 2
    c, r = values[..., :d], values[..., d:]
    return encode_box(c[:, :, :1], c, r, box_group(d))


def case(b: int, h: int, g: int, d: int, pages: int, dtype, seed: int, spare: int = 9):
    """Random queries (B, H, G, D) and boxes of ``pages + spare`` pages (capacity beyond the pages in use) with
    Qwen-like shared offsets on a few channels: ``(q, boxes, scales)`` (:func:`_boxes`)."""
    gen = torch.Generator().manual_seed(seed)
    boxes = torch.randn(b, h, pages + spare, 2 * d, generator=gen)
    boxes[..., d:] = boxes[..., d:].abs()
    boxes[..., :3] += 150.0  # Qwen-like shared key offsets on a few channels
    boxes, scales = _boxes(boxes, dtype)
    q = torch.randn(b, h, g, d, generator=gen)
    q[..., :3] += 20.0
    return q, boxes, scales


def _oracle(q, boxes, n_pages, k, scaling, force_first, scales=None):
    d = q.shape[-1]
    box = ss.values(boxes[:, :, :n_pages], scales).double()
    q64 = q.double()
    bound = torch.einsum("bhgd,bhpd->bhgp", q64, box[..., :d]) + torch.einsum("bhgd,bhpd->bhgp", q64.abs(),
                                                                            box[..., d:])
    s = torch.log_softmax(bound * scaling, -1).logsumexp(2)
    if force_first:
        s[..., 0] = float("inf")
    return s.topk(k, -1).indices.sort(-1).values


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, "int8"])
@pytest.mark.parametrize("force_first", [True, False])
@pytest.mark.parametrize("shape", [(1, 2, 7, 64, 512, 30), (3, 4, 1, 32, 97, 5), (2, 1, 4, 16, 40, 39),
                                   (1, 2, 2, 128, 50, 7), (1, 1, 3, 24, 30, 4)])
def test_op_matches_twin_and_float64(dtype, force_first, shape):
    if not ss.available():
        pytest.skip("C++ op not built")
    b, h, g, d, pages, k = shape
    q, boxes, scales = case(b, h, g, d, pages, dtype, sum(shape))
    scaling = d ** -0.5
    rest = 3
    got = torch.ops.kvslim.sparse_select(q, boxes, pages, k, scaling, force_first, rest, scales=scales)
    twin = ss.reference(q, boxes, pages, k, scaling, force_first, rest, scales=scales)
    assert got.dtype == torch.int64 and got.shape == (b, h, k + rest)
    assert torch.equal(got, twin)
    assert torch.equal(got[..., :k], _oracle(q, boxes, pages, k, scaling, force_first, scales))
    assert torch.equal(got[..., k:], torch.arange(pages, pages + rest).expand(b, h, rest))
    if force_first:
        assert bool((got[..., 0] == 0).all())


def test_op_refuses_bad_input():
    if not ss.available():
        pytest.skip("C++ op not built")
    q, boxes = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 10, 16)
    with pytest.raises(ValueError, match="n_pages"):
        torch.ops.kvslim.sparse_select(q, boxes, 11, 2, 0.3, True, 0)
    with pytest.raises(ValueError, match="boxes"):
        torch.ops.kvslim.sparse_select(q, boxes[..., :8], 10, 2, 0.3, True, 0)
    with pytest.raises(ValueError, match="q must be"):
        torch.ops.kvslim.sparse_select(q.double(), boxes, 10, 2, 0.3, True, 0)
    codes, scales = _boxes(boxes.abs(), "int8")
    with pytest.raises(ValueError, match="need scales"):
        torch.ops.kvslim.sparse_select(q, codes, 10, 2, 0.3, True, 0)
    with pytest.raises(ValueError, match="need scales"):
        torch.ops.kvslim.sparse_select(q, boxes, 10, 2, 0.3, True, 0, scales=scales)
    with pytest.raises(ValueError, match="scales must be"):
        torch.ops.kvslim.sparse_select(q, codes, 10, 2, 0.3, True, 0, scales=scales.float())
    with pytest.raises(ValueError, match="scales must be"):
        torch.ops.kvslim.sparse_select(q, codes, 10, 2, 0.3, True, 0, scales=scales[:, :, :5])
    with pytest.raises(ValueError, match="scales must be"):  # more scales than channels
        torch.ops.kvslim.sparse_select(q, codes, 10, 2, 0.3, True, 0, scales=torch.ones(1, 2, 10, 32).half())


def test_twin_refuses_what_the_op_refuses():
    """The torch twin (used off CPU, under tracing, without the op) refuses the same mismatches as the op instead of
    scoring int8 codes as values or scaling value boxes."""
    q, boxes = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 10, 16).abs()
    codes, scales = _boxes(boxes, "int8")
    with pytest.raises(ValueError, match="need scales"):
        ss.reference(q, codes, 10, 2, 0.3, True, 0)
    with pytest.raises(ValueError, match="need scales"):
        ss.reference(q, boxes, 10, 2, 0.3, True, 0, scales=scales)
    with pytest.raises(ValueError, match="scales must be"):
        ss.reference(q, codes, 10, 2, 0.3, True, 0, scales=scales.float())
    with pytest.raises(ValueError, match="scales must be"):
        ss.reference(q, codes, 10, 2, 0.3, True, 0, scales=scales[:, :, :5])
    with pytest.raises(ValueError, match="scales must be"):
        ss.reference(q, codes, 10, 2, 0.3, True, 0, scales=torch.ones(1, 2, 10, 3).half())


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, "int8"])
def test_padded_rows_choose_among_their_visible_pages(dtype):
    """``first``/``force`` (a left-padded batch): sequence b chooses among pages [first[b], n_pages) only, each
    head's estimated attention normalised over them, page first[b] forced where ``force[b]``; the op equals the twin
    and a float64 oracle, and refuses a row left with fewer than k pages."""
    if not ss.available():
        pytest.skip("C++ op not built")
    b, h, g, d, pages, k, rest = 4, 2, 3, 32, 120, 9, 2
    gen = torch.Generator().manual_seed(7)
    boxes = torch.randn(b, h, pages, 2 * d, generator=gen)
    boxes[..., d:] = boxes[..., d:].abs()
    boxes, scales = _boxes(boxes, dtype)
    q = torch.randn(b, h, g, d, generator=gen)
    first = torch.tensor([0, 5, 37, 111])
    force = torch.tensor([False, True, True, False])
    got = torch.ops.kvslim.sparse_select(q, boxes, pages, k, 0.2, False, rest, first, force, scales)
    assert torch.equal(got, ss.reference(q, boxes, pages, k, 0.2, False, rest, first, force, scales))
    for i in range(b):
        lo = int(first[i])
        sc = None if scales is None else scales[i:i + 1, :, lo:]
        want = _oracle(q[i:i + 1], boxes[i:i + 1, :, lo:], pages - lo, k, 0.2, bool(force[i]), sc) + lo
        assert torch.equal(got[i:i + 1, :, :k], want), i
        assert bool((got[i, :, :k] >= lo).all())
        if force[i]:
            assert bool((got[i, :, 0] == lo).all())
    with pytest.raises(ValueError, match="fewer than k"):
        torch.ops.kvslim.sparse_select(q, boxes, pages, k, 0.2, False, rest, torch.tensor([0, 0, 0, 115]), force,
                                       scales)


@pytest.mark.parametrize("k", [1, 3, 5, 17, 64, 299, 300])
@pytest.mark.parametrize("force_first", [True, False])
def test_ties_go_to_the_lower_page(k, force_first):
    """Exact ties (identical boxes) cut by k: the op (a radix select on the scores' bits) takes every page above the
    k-th score and the lowest pages at it, in ascending order; a float64 ranking by (score, page) says which."""
    if not ss.available():
        pytest.skip("C++ op not built")
    b, h, g, d, pages = 2, 3, 4, 32, 300
    gen = torch.Generator().manual_seed(k)
    q = torch.rand(b, h, g, d, generator=gen) + 0.1  # positive: a larger centre is a larger bound in every head
    level = torch.zeros(pages)
    level[[7, 150, 299, 31]] = torch.tensor([1.0, 2.0, 3.0, 4.0])  # strictly better pages
    level[[0, 2, 64, 200]] = -1.0  # strictly worse ones
    boxes = torch.zeros(b, h, pages + 2, 2 * d)
    boxes[:, :, :pages, :d] = level[:, None]
    got = torch.ops.kvslim.sparse_select(q, boxes, pages, k, d ** -0.5, force_first, 0)
    lvl = level.tolist()
    if force_first:
        lvl[0] = float("inf")
    want = sorted(sorted(range(pages), key=lambda p: (-lvl[p], p))[:k])
    assert got.tolist() == [[want] * h] * b


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, "int8"])
def test_every_instruction_set_chooses_the_same_pages(isa, dtype):
    """The selection's paths (scalar; AVX2 bounds; AVX-512 int8 bounds in blocks of 16 pages and the vectorised
    logsumexp over a GQA group), each capped in turn: the twin's pages and the float64 ranking's, at G 1, 4 and 7
    and head dims 64, 128 and 24 (a dim no vector path takes whole)."""
    if not ss.available():
        pytest.skip("C++ op not built")
    previous = torch.ops.kvslim.sparse_select_set_isa(isa)
    try:
        for b, h, g, d, pages, k in [(2, 3, 1, 64, 301, 17), (1, 2, 7, 64, 130, 9), (1, 2, 4, 128, 77, 11),
                                     (1, 1, 3, 24, 40, 6)]:
            q, boxes, scales = case(b, h, g, d, pages, dtype, 7 * pages + g)
            got = torch.ops.kvslim.sparse_select(q, boxes, pages, k, d ** -0.5, True, 2, scales=scales)
            assert torch.equal(got, ss.reference(q, boxes, pages, k, d ** -0.5, True, 2, scales=scales)), (b, h, g, d)
            assert torch.equal(got[..., :k], _oracle(q, boxes, pages, k, d ** -0.5, True, scales)), (b, h, g, d)
    finally:
        torch.ops.kvslim.sparse_select_set_isa(previous)
    with pytest.raises(ValueError, match="isa must be one of"):
        torch.ops.kvslim.sparse_select_set_isa("sse9")


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("pages,k", [(7, 1), (40, 39), (124, 60), (128, 1), (128, 127), (300, 17), (511, 200),
                                     (1020, 60), (1020, 124), (4000, 3), (777, 500)])
def test_top_pages_of_any_scores_match_a_sort(isa, pages, k):
    """The k best of arbitrary scores — few distinct values (ties cut by k), ±inf, NaN — through the select for few
    pages (under 512, and under 128 at AVX-512), the radix select (AVX2 cap, 512 pages and more) and the AVX-512
    pivot-and-compress select: the pages a sort by (score descending, NaN last, page) takes, ascending. G = 1 with a
    one-hot query makes each page's score its box's first centre exactly."""
    if not ss.available():
        pytest.skip("C++ op not built")
    gen = torch.Generator().manual_seed(pages * 7 + k)
    vals = torch.tensor([-3.0, -0.5, 0.0, 0.25, 0.25, 1.5, 2.0])[torch.randint(0, 7, (2, 2, pages), generator=gen)]
    vals += torch.randn(2, 2, pages, generator=gen) * (torch.rand(2, 2, pages, generator=gen) < 0.3)
    specials = torch.randint(0, pages, (2, 2, 6), generator=gen)
    vals.scatter_(2, specials[..., :2], float("nan"))
    vals.scatter_(2, specials[..., 2:4], float("inf"))
    vals.scatter_(2, specials[..., 4:], float("-inf"))
    d = 16
    boxes = torch.zeros(2, 2, pages, 2 * d)
    boxes[..., 0] = vals
    q = torch.zeros(2, 2, 1, d)
    q[..., 0] = 1.0
    previous = torch.ops.kvslim.sparse_select_set_isa(isa)
    try:
        got = torch.ops.kvslim.sparse_select(q, boxes, pages, k, 1.0, False, 0)
    finally:
        torch.ops.kvslim.sparse_select_set_isa(previous)
    for b in range(2):
        for h in range(2):
            row = vals[b, h].tolist()
            order = sorted(range(pages), key=lambda p: (row[p] != row[p], -row[p] if row[p] == row[p] else 0, p))
            assert got[b, h].tolist() == sorted(order[:k]), (b, h)
