"""Large cache buffers are advised onto transparent huge pages; the advice never changes contents."""

from __future__ import annotations

import sys

import pytest
import torch

import kvslim
from kvslim.caches import hugepages

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux-only")


def vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping that holds ``address`` (from /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@linux
def test_large_buffer_is_advised_and_small_one_is_not():
    big = hugepages.empty(64 << 20, dtype=torch.uint8, device="cpu")
    inner = (big.data_ptr() + hugepages.PAGE - 1) & -hugepages.PAGE
    assert "hg" in vm_flags(inner)
    small = hugepages.empty(1 << 20, dtype=torch.uint8, device="cpu")
    assert not hugepages.advise(small)  # (its flags may still say hg: the allocator can reuse advised memory)


@linux
def test_dense_and_quantized_caches_live_on_advised_pages():
    from conftest import tiny_model

    model = tiny_model("llama", kv_heads=4)
    for method in ("dense", "int8"):
        kvslim.apply(model, method)
        try:
            cache = kvslim.make_cache(model, max_length=1 << 18)  # reserved, touched only as it fills
            model(input_ids=torch.randint(1, 128, (1, 8)), past_key_values=cache, use_cache=True)
            data = cache.layers[0].k_store.data
            assert data.untyped_storage().nbytes() >= hugepages.MIN_BYTES, data.shape
            assert "hg" in vm_flags((data.data_ptr() + hugepages.PAGE - 1) & -hugepages.PAGE), method
        finally:
            kvslim.restore(model)


def test_env_switch_turns_the_advice_off(monkeypatch):
    calls = []
    monkeypatch.setattr(hugepages, "_madvise", lambda: lambda *args: calls.append(args) or 0)
    hugepages.empty(64 << 20, dtype=torch.uint8, device="cpu")
    assert len(calls) == 1  # the stand-in is reached without the switch
    monkeypatch.setenv("KVSLIM_HUGEPAGES", "0")
    t = hugepages.empty(64 << 20, dtype=torch.uint8, device="cpu")
    assert not hugepages.advise(t) and len(calls) == 1


def test_contents_and_dtype_are_those_of_torch_empty():
    t = hugepages.empty(4, 1 << 20, dtype=torch.float32, device="cpu")
    assert t.shape == (4, 1 << 20) and t.dtype == torch.float32 and t.is_contiguous()
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).view_as(t))
    assert torch.equal(t.flatten()[:5], torch.arange(5, dtype=torch.float32))
    assert not hugepages.advise(torch.empty(0))
