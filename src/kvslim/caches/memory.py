"""Huge pages for the buffers a sparse decode step reads at random (docs/sparse.md "What a step reads").

A sparse step reads ~60 pages of 32 rows per (sequence, KV head) scattered over the whole history: each page's codes,
scales and zeros sit in six tensors, so at 32k × 8 a step touches ~35k different 4 KB pages per layer, and their
address translations miss the TLB (one int4 layer at 32k × 8, warm: the listed pages 1.02 ms against 0.56 ms for
the same pages laid out in order). Backed by 2 MB pages the same reads take ~0.8 ms. :func:`advise` asks the
kernel for them (``madvise(MADV_HUGEPAGE)``, Linux's "madvise" transparent-huge-page mode) on a freshly allocated,
not yet written CPU buffer; the pages are then allocated 2 MB at a time as they are first written.

The price: a 2 MB page is resident as soon as one of its bytes is written, and a cache's (B, H, capacity, row)
buffers put every sequence and head's first rows 1-2 MB apart, so the whole *allocated* capacity becomes resident
at the first writes, not only the written part. The layers ask for it only when ``max_length`` fixed their capacity
(as HF's ``StaticCache``, which writes all of it at once); a cache that grows keeps 4 KB pages.
``KVSLIM_HUGE_PAGES=0`` turns it off (read at each allocation).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

import torch

HUGE = 2 << 20  # bytes of a transparent huge page on x86-64 and arm64 (4 KB base pages)
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        f = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return f


def enabled() -> bool:
    """Whether :func:`advise` asks for huge pages (``KVSLIM_HUGE_PAGES``, default on; Linux only)."""
    return os.environ.get("KVSLIM_HUGE_PAGES", "1") != "0" and _madvise() is not None


def advise(t: torch.Tensor | None) -> bool:
    """Ask for 2 MB pages under the whole 2 MB-aligned part of ``t``'s storage (CPU; at least one such page).
    Call it before the buffer is written: pages already written keep their 4 KB pages. Returns whether the kernel
    took the advice (False off Linux, on other devices, while torch.compile traces, with ``KVSLIM_HUGE_PAGES=0``, or
    for a small buffer)."""
    if t is None or t.device.type != "cpu" or torch.compiler.is_compiling() or not enabled():
        return False  # (a traced first update keeps 4 KB pages: no foreign call inside a graph)
    start = t.untyped_storage().data_ptr()
    end = start + t.untyped_storage().nbytes()
    lo, hi = -(-start // HUGE) * HUGE, end // HUGE * HUGE
    if hi - lo < HUGE:
        return False
    if _madvise()(lo, hi - lo, _MADV_HUGEPAGE) != 0:
        return False
    _madvise()(lo, hi - lo, _MADV_COLLAPSE)  # pages the allocator reused already written: made huge now (Linux 6.1+)
    return True
