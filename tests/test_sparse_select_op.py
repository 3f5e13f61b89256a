"""``kvslim::sparse_select`` (a sparse step's page choice in one call) against its torch twin and a float64
oracle: the same pages, on fp16 and fp32 boxes, with and without page 0 forced, with the region's rest listed."""

from __future__ import annotations

import pytest
import torch

from kvslim.kernels import sparse_select as ss


def _oracle(q, boxes, n_pages, k, scaling, force_first):
    d = q.shape[-1]
    box = boxes[:, :, :n_pages].double()
    q64 = q.double()
    bound = torch.einsum("bhgd,bhpd->bhgp", q64, box[..., :d]) + torch.einsum("bhgd,bhpd->bhgp", q64.abs(),
                                                                            box[..., d:])
    s = torch.log_softmax(bound * scaling, -1).logsumexp(2)
    if force_first:
        s[..., 0] = float("inf")
    return s.topk(k, -1).indices.sort(-1).values


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("force_first", [True, False])
@pytest.mark.parametrize("shape", [(1, 2, 7, 64, 512, 30), (3, 4, 1, 32, 97, 5), (2, 1, 4, 16, 40, 39)])
def test_op_matches_twin_and_float64(dtype, force_first, shape):
    if not ss.available():
        pytest.skip("C++ op not built")
    b, h, g, d, pages, k = shape
    gen = torch.Generator().manual_seed(sum(shape))
    boxes = torch.randn(b, h, pages + 9, 2 * d, generator=gen)  # capacity beyond the pages in use
    boxes[..., d:] = boxes[..., d:].abs()
    boxes[..., :3] += 150.0  # Qwen-like shared key offsets on a few channels
    boxes = boxes.to(dtype)
    q = torch.randn(b, h, g, d, generator=gen)
    q[..., :3] += 20.0
    scaling = d ** -0.5
    rest = 3
    got = torch.ops.kvslim.sparse_select(q, boxes, pages, k, scaling, force_first, rest)
    twin = ss.reference(q, boxes, pages, k, scaling, force_first, rest)
    assert got.dtype == torch.int64 and got.shape == (b, h, k + rest)
    assert torch.equal(got, twin)
    assert torch.equal(got[..., :k], _oracle(q, boxes, pages, k, scaling, force_first))
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
