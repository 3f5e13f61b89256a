"""A sparse decode step's page choice in one call: ``torch.ops.kvslim.sparse_select``.

Per sequence and KV head: score the first ``n_pages`` page boxes (fp16/fp32 values, or the library's int8 codes
with fp16 scales) against the group's G query heads in fp32 (each
head's bound made a log-softmax over the pages, combined over the heads by ``logsumexp``:
:func:`kvslim.attention.sparse.page_scores`), keep the ``k`` best (page 0 forced when ``force_first``), ascending,
then append the pages ``[n_pages, n_pages + rest)`` (the region's rest, read whole). In torch that is a dozen small
ops per layer per step (concatenation, products, two reductions, ``topk``, ``sort``, index arithmetic), each a
parallel region costing more than its arithmetic on a CPU; the op is one region over B·H. :func:`reference` is
the twin (the torch ops). Source: ``csrc/sparse_select.cpp``, built by :func:`kvslim.kernels.build.load_ops`.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from . import backend
from .build import load_ops

FAMILY = "sparse_select"


@functools.cache
def available() -> bool:
    """Whether ``torch.ops.kvslim.sparse_select`` is built and loaded (one warning from the build if not)."""
    return load_ops(FAMILY)


def values(boxes: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    """(B, H, P, 2D) boxes as fp32 values: fp16/fp32 converted, int8 codes times their fp16 ``scales``
    (B, H, ≥ P, 2D / group), one per ``group`` channels (the op's conversion, product for product). ``ValueError``
    for int8 boxes without scales, scales beside value boxes, or scales of another shape (the op's checks)."""
    check_scales(boxes, scales)
    if scales is None:
        return boxes.float()
    d2 = boxes.shape[-1]
    group = d2 // scales.shape[-1]
    return boxes.float() * scales[:, :, :boxes.shape[2]].float().repeat_interleave(group, dim=-1)


def scores(q: torch.Tensor, boxes: torch.Tensor, scaling: float, scales: torch.Tensor | None = None) -> torch.Tensor:
    """(B, H, G, D) fp32 queries, (B, H, P, 2D) boxes ``[c | r]`` (with ``scales``: int8 codes, :func:`values`)
    -> (B, H, P) fp32: each head's bound ``q·c + |q|·r`` (fp32, the boxes converted as read) scaled, log-softmax
    over the pages, logsumexp over the group."""
    bound = torch.matmul(torch.cat((q, q.abs()), dim=-1), values(boxes, scales).transpose(-1, -2))  # (B, H, G, P)
    return torch.log_softmax(bound * scaling, dim=-1).logsumexp(dim=2)


def check_scales(boxes: torch.Tensor, scales: torch.Tensor | None) -> None:
    """``ValueError`` (the op's checks) for int8 boxes without scales, scales beside value boxes, or scales of
    another shape than (B, H, ≥ pages, 2D / group) fp16 with a group dividing D."""
    if (boxes.dtype == torch.int8) != (scales is not None):
        raise ValueError(f"sparse_select: int8 boxes need scales and only they take them, got {boxes.dtype} boxes "
                         f"{'with' if scales is not None else 'without'} scales")
    if scales is None:
        return
    d2 = boxes.shape[-1]
    if (scales.dim() != 4 or scales.dtype != torch.float16 or scales.shape[:2] != boxes.shape[:2]
            or scales.shape[2] < boxes.shape[2] or not 2 <= scales.shape[3] <= d2 or d2 % scales.shape[3]
            or (d2 // 2) % (d2 // scales.shape[3])):
        raise ValueError(f"sparse_select: scales must be fp16 (B, H, >= pages, 2D / group) with a group dividing "
                         f"D={d2 // 2}, got {tuple(scales.shape)} {scales.dtype} for boxes {tuple(boxes.shape)}")


def reference(q: torch.Tensor, boxes: torch.Tensor, n_pages: int, k: int, scaling: float, force_first: bool,
              rest: int, first: torch.Tensor | None = None, force: torch.Tensor | None = None,
              scales: torch.Tensor | None = None) -> torch.Tensor:
    """The op's twin: (B, H, min(k, n_pages) + rest) int64, the chosen pages ascending then the rest. ``first``
    (B,) int64 / ``force`` (B,) bool (a left-padded batch): only pages from ``first[b]`` on are candidates (the
    softmax over pages taken over them), page ``first[b]`` forced where ``force[b]``. ``scales``: int8 boxes'
    (:func:`values`)."""
    if first is None:
        s = scores(q, boxes[:, :, :n_pages], scaling, scales)
        if force_first and n_pages:
            s[..., 0] = float("inf")
    else:
        pad = torch.arange(n_pages, device=q.device)[None, :] < first[:, None]  # (B, P)
        bound = torch.matmul(torch.cat((q, q.abs()), dim=-1), values(boxes[:, :, :n_pages], scales).transpose(-1, -2))
        bound = (bound * scaling).masked_fill(pad[:, None, None], float("-inf"))
        s = torch.log_softmax(bound, dim=-1).logsumexp(dim=2)  # (B, H, P), padding pages -inf
        force_first_visible(s, first, force)
    return top_pages(s, k, n_pages, rest)


def force_first_visible(s: torch.Tensor, first: torch.Tensor, force: torch.Tensor) -> None:
    """Scores (B, H, P) of a left-padded step: page ``first[b]`` set to ``+inf`` (always chosen) where
    ``force[b]``, in place."""
    b = s.shape[0]
    hit = first.view(b, 1, 1).expand(b, s.shape[1], 1)
    s.scatter_(2, hit, torch.where(force.view(b, 1, 1), float("inf"), s.gather(2, hit)))


def top_pages(s: torch.Tensor, k: int, n_pages: int, rest: int) -> torch.Tensor:
    """Scores (B, H, n_pages) -> the ``k`` best pages ascending, then ``rest`` pages after the candidates."""
    idx = s.topk(min(k, n_pages), dim=-1).indices.sort(dim=-1).values
    if rest:
        after = torch.arange(n_pages, n_pages + rest, device=s.device).expand(*idx.shape[:2], rest)
        idx = torch.cat((idx, after), dim=-1)
    return idx


def applies(q: torch.Tensor, boxes: torch.Tensor, scales: torch.Tensor | None = None) -> bool:
    """CPU tensors (fp32 queries, fp16/fp32 boxes or int8 boxes with fp16 scales, unit last strides), not under
    tracing, op built."""
    return (not torch.compiler.is_compiling() and q.device.type == "cpu" and boxes.device.type == "cpu"
            and q.dtype == torch.float32 and boxes.stride(-1) == 1 and available()
            and (boxes.dtype in (torch.float16, torch.float32) if scales is None else
                 boxes.dtype == torch.int8 and scales.dtype == torch.float16 and scales.stride(-1) == 1))


def sparse_select(q: torch.Tensor, boxes: torch.Tensor, n_pages: int, k: int, scaling: float, force_first: bool,
                  rest: int = 0, first: torch.Tensor | None = None, force: torch.Tensor | None = None,
                  scales: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`reference` through the C++ op where it applies (:func:`applies`); on CUDA (and under
    ``KVSLIM_BACKEND=triton`` with ``TRITON_INTERPRET=1``) the scores from one Triton kernel
    (``kernels/triton/sparse_select.py``; a left-padded batch's ``first`` / ``force`` included), then the twin's
    ``topk``; else through the twin."""
    if backend.forced() != "triton" and applies(q, boxes, scales):
        return torch.ops.kvslim.sparse_select(q.contiguous(), boxes, int(n_pages), int(k), float(scaling),
                                              bool(force_first), int(rest), first, force, scales)
    if _triton_scores(q, boxes, scales):
        from .triton.sparse_select import page_scores  # imports Triton: only when a call takes this path

        _check_shapes(q, boxes, n_pages, k, rest)
        check_scales(boxes, scales)
        _check_padding(q, first, force)
        s = page_scores(q, boxes, n_pages, scaling, scales, first)
        if first is not None:
            force_first_visible(s, first, force)
        elif force_first and n_pages:
            s[..., 0] = float("inf")
        return top_pages(s, k, n_pages, rest)
    return reference(q, boxes, n_pages, k, scaling, force_first, rest, first, force, scales)


def _check_shapes(q: torch.Tensor, boxes: torch.Tensor, n_pages: int, k: int, rest: int) -> None:
    """``ValueError`` (the op's checks) for queries that are not (B, H, G, D) fp32, boxes not (B, H, ≥ n_pages, 2D)
    with unit last stride and a box dtype the scores take, or a page count, ``k`` or ``rest`` out of range."""
    if q.dim() != 4 or q.dtype != torch.float32:
        raise ValueError(f"sparse_select: q must be a (B, H, G, D) fp32 tensor, got {tuple(q.shape)} {q.dtype}")
    b, h, _, d = q.shape
    if (boxes.dim() != 4 or tuple(boxes.shape[:2]) != (b, h) or boxes.shape[3] != 2 * d or boxes.stride(-1) != 1
            or boxes.dtype not in (torch.int8, torch.float16, torch.float32)):
        raise ValueError(f"sparse_select: boxes must be (B, H, pages, 2D) fp16/fp32/int8 with unit last stride for q "
                         f"{tuple(q.shape)}, got {tuple(boxes.shape)} {boxes.dtype}")
    if not 0 <= n_pages <= boxes.shape[2] or k < 1 or rest < 0:
        raise ValueError(f"sparse_select: n_pages={n_pages} must lie in [0, {boxes.shape[2]}] (the boxes' pages), "
                         f"k={k} >= 1 and rest={rest} >= 0")


def _check_padding(q: torch.Tensor, first: torch.Tensor | None, force: torch.Tensor | None) -> None:
    """``ValueError`` (the op's checks, less the one on ``first``'s values, which would wait for the device) unless
    ``first`` (B,) int64 and ``force`` (B,) bool come together."""
    if (first is None) != (force is None):
        raise ValueError("sparse_select: first and force come together")
    b = q.shape[0]
    if first is not None and (first.dtype != torch.int64 or tuple(first.shape) != (b,) or force.dtype != torch.bool
                              or tuple(force.shape) != (b,)):
        raise ValueError(f"sparse_select: first must be int64 (B={b},) and force bool (B,), got "
                         f"{tuple(first.shape)} {first.dtype} and {tuple(force.shape)} {force.dtype}")


def _triton_scores(q: torch.Tensor, boxes: torch.Tensor, scales: torch.Tensor | None) -> bool:
    """Whether the Triton scores take this call: the backend for the queries' device is Triton, unit last strides."""
    if torch.compiler.is_compiling() or backend.pick(q.device, available() and q.device.type == "cpu") != "triton":
        return False
    return boxes.stride(-1) == 1 and (scales is None or scales.stride(-1) == 1)


@dataclasses.dataclass(frozen=True)
class PageChoice:
    """A page list for a decode op to choose in its own call (the int8/int4, low-bit and turbo C++ ops take it:
    one call scores the pages, keeps the best and attends through them; any other backend chooses here first,
    :func:`resolve`): the step's queries ``q`` (B, Hk, G, D) fp32 in the model's basis, the layer's ``boxes`` /
    ``scales``, ``n_pages`` candidates, the ``k`` best (page 0 forced when ``force_first``) ascending, then ``rest``
    pages after the candidates (:func:`sparse_select`'s arguments); ``chosen`` (B, Hk, min(k, n_pages)) int64: a
    buffer the chosen part is copied into (``select="prompt"``)."""

    q: torch.Tensor
    boxes: torch.Tensor
    scales: torch.Tensor | None
    n_pages: int
    k: int
    force_first: bool
    rest: int = 0
    chosen: torch.Tensor | None = None

    def op_args(self) -> tuple:
        """The decode ops' trailing arguments (``sel_q, boxes, box_scales, sel_pages, sel_k, sel_force, sel_rest,
        chosen``)."""
        return (self.q.contiguous(), self.boxes, self.scales, int(self.n_pages), int(self.k), bool(self.force_first),
                int(self.rest), self.chosen)

    def in_call(self) -> bool:
        """Whether a C++ decode op can choose in its call (what :func:`applies` asks of the selection op)."""
        return applies(self.q, self.boxes, self.scales)


NO_CHOICE = (None, None, None, 0, 0, False, 0, None)


def resolve(choice: PageChoice | None, pages: torch.Tensor | None, scaling: float) -> torch.Tensor | None:
    """The page list a decode backend that does not choose in its call reads: ``pages`` as given, or ``choice``
    made here (:func:`sparse_select`, the ``chosen`` buffer written). ``ValueError`` for both at once."""
    if choice is None:
        return pages
    _exclusive(pages)
    listed = sparse_select(choice.q, choice.boxes, choice.n_pages, choice.k, scaling, choice.force_first, choice.rest,
                           scales=choice.scales)
    if choice.chosen is not None:
        choice.chosen.copy_(listed[..., :choice.chosen.shape[-1]])
    return listed


def op_args(choice: PageChoice | None, pages: torch.Tensor | None) -> tuple:
    """The C++ decode ops' selection arguments for ``choice`` (none without one)."""
    if choice is None:
        return NO_CHOICE
    _exclusive(pages)
    return choice.op_args()


def _exclusive(pages: torch.Tensor | None) -> None:
    if pages is not None:
        raise ValueError("pages and select exclude each other (a page list, or the boxes to choose one from)")
