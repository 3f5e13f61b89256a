"""Huge pages under a sparse layer's history (caches/memory.py): asked for exactly where documented, checked in the
kernel's own record of the mapping (/proc/self/smaps VmFlags ``hg``)."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaConfig

from kvslim.adapters.shape import shape_from_config
from kvslim.caches import memory
from kvslim.methods import METHODS

pytestmark = [pytest.mark.usefixtures("no_grad"),
              pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage"),
                                 reason="madvise(MADV_HUGEPAGE) needs Linux with transparent huge pages")]


def _advised(t: torch.Tensor) -> bool:
    """Whether the mapping under the first 2 MB-aligned byte of ``t``'s storage carries MADV_HUGEPAGE."""
    addr = -(-t.untyped_storage().data_ptr() // memory.HUGE) * memory.HUGE
    assert addr + memory.HUGE <= t.untyped_storage().data_ptr() + t.untyped_storage().nbytes(), "tensor too small"
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_advise_marks_the_mapping(monkeypatch):
    t = torch.empty(16 << 20, dtype=torch.uint8)
    assert memory.advise(t) and _advised(t)
    t[::4096] = 1  # written after the advice: the data is the caller's as before
    assert int(t[::4096].sum()) == t[::4096].numel()
    monkeypatch.setenv("KVSLIM_HUGE_PAGES", "0")
    u = torch.empty(16 << 20, dtype=torch.uint8)
    assert not memory.advise(u)  # (the kernel's record: a reused mapping may carry an old flag)
    assert not memory.advise(torch.empty(1 << 20, dtype=torch.uint8))  # no whole aligned 2 MB page inside
    assert not memory.advise(None)


def _layer(max_length, budget=2048):
    cfg = LlamaConfig(vocab_size=64, hidden_size=512, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=8)
    plan = METHODS["int4"].plan(shape_from_config(cfg), torch.float32, sparse_budget=budget)
    layer = plan.layers[0].factory(max_length)
    k = torch.randn(2, 8, 8192, 64)  # int4 codes of 4 MB: whole 2 MB pages inside
    layer.update(k, k.clone())
    return layer


@pytest.mark.parametrize("max_length, budget, want", [(8256, 2048, True), (None, 2048, False),
                                                      (8256, None, False)])
def test_sparse_layers_with_max_length_get_huge_pages(monkeypatch, max_length, budget, want):
    """Only a sparse layer (its steps read pages at random) whose capacity ``max_length`` fixed: a growing cache's
    unwritten capacity would become resident. (A freed mapping's flag can outlive it in memory the allocator
    reuses, so "not asked" is checked on the calls, "taken" in the kernel's record.)"""
    asked = []
    real = memory.advise
    monkeypatch.setattr(memory, "advise", lambda t: asked.append(t) or real(t))
    layer = _layer(max_length, budget)
    big = [t for s in layer._stores() for t in s.tensors() if t.untyped_storage().nbytes() >= 2 * memory.HUGE]
    assert len(big) == 2  # the key and value codes
    assert all(any(a is t for a in asked) == want for t in big)
    assert all(_advised(t) for t in big) or not want


def test_no_advice_inside_a_traced_graph():
    """A first update traced by torch.compile must not call into libc (a graph break, an error under fullgraph):
    the advice is skipped there (the traced branch says which way it went; a freed mapping's flag can outlive it in
    memory the allocator reuses, so the kernel's record cannot)."""
    t = torch.ones(16 << 20, dtype=torch.int32)

    @torch.compile(backend="eager", fullgraph=True)
    def traced(x):
        return x.sum() if memory.advise(x) else x[:1].sum()

    assert int(traced(t)) == 1
    assert memory.advise(t)  # eagerly, the same buffer takes it
