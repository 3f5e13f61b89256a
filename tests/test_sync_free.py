"""No host synchronisation in a decode step, for every method (issue 26, point 4; docs/gpu.md).

A decode step must never read a tensor back to the host: on CUDA that stalls the CPU until the GPU has drained its
queue (the host-bound steps of the H100 probe), and it breaks CUDA-graph capture. On CPU the same calls cost
nothing, so they are *counted*: :class:`SyncCounter` (a ``TorchFunctionMode``) records every call that would
synchronise on a CUDA tensor (``item``, ``bool``, ``int``, ``float``, ``__index__``, ``tolist``, ``nonzero``,
``torch.equal``/``allclose``, ``unique``, ``masked_select``, boolean-mask indexing) and every tensor factory that
kvslim calls without ``device=`` (a CPU tensor meeting CUDA ones: a device mix). Prefill is excluded; several
decode steps (across a residual-window flush) are included; zero is allowed. With CUDA present, the same steps also
run under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import collections
import os
import sys
import warnings

import pytest
import torch
from conftest import tiny_model
from test_mla_model import deepseek
from torch.overrides import TorchFunctionMode

import kvslim
from kvslim.adapters.compat import CACHE_KW

SYNCS = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
         torch.Tensor.__index__, torch.Tensor.tolist, torch.Tensor.nonzero, torch.nonzero, torch.equal,
         torch.Tensor.equal, torch.allclose, torch.Tensor.allclose, torch.unique, torch.Tensor.unique,
         torch.masked_select, torch.Tensor.masked_select, torch.Tensor.is_nonzero, torch.is_nonzero}
FACTORIES = {torch.arange, torch.zeros, torch.ones, torch.full, torch.empty, torch.tensor, torch.as_tensor,
             torch.linspace, torch.eye, torch.randn, torch.rand}
TORCH_DIR = os.path.dirname(torch.__file__)
KVSLIM_DIR = os.path.dirname(kvslim.__file__)


def _caller() -> str | None:
    """``file:line`` of the first frame outside torch that made the call, or ``None`` when that frame is Triton's
    interpreter (it reads tensors back by design; compiled Triton launches do not)."""
    f = sys._getframe(2)
    while f is not None and (f.f_code.co_filename.startswith(TORCH_DIR) or f.f_code.co_filename == __file__):
        f = f.f_back
    if f is None or f"{os.sep}triton{os.sep}" in f.f_code.co_filename:
        return None
    return f"{os.path.relpath(f.f_code.co_filename, os.path.dirname(KVSLIM_DIR))}:{f.f_lineno}"


class SyncCounter(TorchFunctionMode):
    """Counts the calls that synchronise with a CUDA device, and device-less factories called by kvslim."""

    def __init__(self):
        super().__init__()
        self.hits: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = None
        if func in SYNCS:
            what = getattr(func, "__name__", str(func))
        elif func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) > 1:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
                what = f"boolean-mask {func.__name__}"
        elif func in FACTORIES and "device" not in kwargs:
            where = _caller()
            if where is not None and where.startswith("kvslim"):
                self.hits[(f"{func.__name__} without device=", where)] += 1
        if what is not None:
            where = _caller()
            if where is not None:
                self.hits[(what, where)] += 1
        return func(*args, **kwargs)

    def report(self) -> str:
        return "; ".join(f"{n}× {what} at {where}" for (what, where), n in self.hits.most_common())


#: method -> (model builder, apply options): small residual windows and flush groups, so the decode steps below
#: cross a flush into codes (the tokens after a 40-token prompt)
CASES = {
    "dense": (lambda: tiny_model("llama"), {}),
    "window": (lambda: tiny_model("llama"), {"window": 8}),
    "int8": (lambda: tiny_model("llama"), {}),
    "int8-ring": (lambda: tiny_model("llama"), {"window": 8}),
    "int4": (lambda: tiny_model("llama"), {"residual": 8, "flush": 4, "key_channel_group": 4, "sink": 2}),
    "int2": (lambda: tiny_model("llama"), {"residual": 8, "flush": 4, "key_channel_group": 4}),
    "slim": (lambda: tiny_model("llama", kv_heads=4), {"cache": "k", "rank": 0}),
    "mla": (lambda: deepseek("v2-lite"), {}),
}
STEPS = 5


def _method(case: str) -> str:
    return case.split("-")[0]


def _decode(case: str, counter=None, fused: bool = True):
    """Prefill 40 tokens (batch 2), then ``STEPS`` greedy decode steps under ``counter``; returns the tokens."""
    build, opts = CASES[case]
    model = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # slim on random weights warns about its measured error
        kvslim.apply(model, _method(case), **opts)
    cache = kvslim.make_cache(model, max_length=64)
    if not fused:  # the unfused reads (a layer's materialize path)
        for layer in cache.layers:
            if hasattr(layer, "fused_decode"):
                layer.fused_decode = False
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    tokens = []
    with torch.no_grad():
        out = model(ids, use_cache=True, **{CACHE_KW: cache})
        tok = out.logits[:, -1:].argmax(-1)
        positions = [torch.full((2, 1), 40 + i, dtype=torch.long) for i in range(STEPS)]  # made outside the count
        with counter if counter is not None else _null():
            for pos in positions:
                out = model(tok, position_ids=pos, use_cache=True, **{CACHE_KW: cache})
                tok = out.logits[:, -1:].argmax(-1)
                tokens.append(tok)
    return torch.cat(tokens, dim=1), cache


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("case", list(CASES))
def test_decode_steps_never_read_back_to_the_host(case):
    counter = SyncCounter()
    _decode(case, counter)
    assert not counter.hits, f"{case}: host synchronisations in decode steps: {counter.report()}"


@pytest.mark.parametrize("case", ["int8", "int4", "int2"])
def test_unfused_decode_steps_never_read_back_to_the_host(case):
    """The layers' own dequantized reads (what runs where no decode kernel takes the inputs)."""
    counter = SyncCounter()
    _decode(case, counter, fused=False)
    assert not counter.hits, f"{case} unfused: host synchronisations in decode steps: {counter.report()}"


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", ["int4", "int2"])
def test_decode_kernels_of_each_backend_never_read_back(monkeypatch, case, backend):
    """The pure-torch twins and the Triton launchers (interpreted here) that CUDA decode steps run."""
    if backend == "triton":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and not torch.cuda.is_available():
            pytest.skip("the Triton kernels need TRITON_INTERPRET=1 (tests/conftest.py sets it) or CUDA")
    monkeypatch.setenv("KVSLIM_BACKEND", backend)
    counter = SyncCounter()
    _decode(case, counter)
    assert not counter.hits, f"{case} on {backend}: host synchronisations in decode steps: {counter.report()}"


def test_counter_catches_what_it_claims(monkeypatch):
    """Mutation check: a ``.item()`` slipped into every decode step of a cache layer is caught, as are the other
    kinds of read-back and a device-less factory in kvslim code."""
    from kvslim.caches import dense

    real = dense.AppendLayer.update

    def update(self, key_states, value_states, *args, **kwargs):
        key_states.sum().item()  # the mutation: one host read per layer and step
        return real(self, key_states, value_states, *args, **kwargs)

    monkeypatch.setattr(dense.AppendLayer, "update", update)
    counter = SyncCounter()
    _decode("dense", counter)
    assert sum(counter.hits.values()) == STEPS * 3 and {w for w, _ in counter.hits} == {"item"}
    t = torch.arange(4.0)
    with SyncCounter() as c:
        bool(t.any()), t.tolist(), t.nonzero(), t[t > 1], float(t[0]), torch.equal(t, t)
    assert sum(c.hits.values()) == 6, c.report()
    code = compile("torch.arange(3); torch.zeros(2, device='cpu')", os.path.join(KVSLIM_DIR, "caches", "x.py"),
                   "exec")  # as if a kvslim module made a CPU index tensor in a decode step
    with SyncCounter() as c:
        exec(code, {"torch": torch})
        torch.arange(3)  # this file's own call: not kvslim's
    assert list(c.hits) == [("arange without device=", "kvslim/caches/x.py:1")]


@pytest.mark.parametrize("case", list(CASES))
def test_cuda_decode_steps_pass_sync_debug_mode_error(case, cuda_dev):
    """``cuda_dev`` skips without CUDA: torch.cuda.set_sync_debug_mode checks real CUDA synchronisations (the CPU
    counter above is the test that runs everywhere)."""
    build, opts = CASES[case]
    model = build().to(cuda_dev, torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kvslim.apply(model, _method(case), **opts)
    cache = kvslim.make_cache(model, max_length=64)
    ids = torch.randint(1, 128, (2, 40), device=cuda_dev)
    with torch.no_grad():
        tok = model(ids, use_cache=True, **{CACHE_KW: cache}).logits[:, -1:].argmax(-1)
        positions = [torch.full((2, 1), 40 + i, dtype=torch.long, device=cuda_dev) for i in range(STEPS)]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for pos in positions:
                tok = model(tok, position_ids=pos, use_cache=True, **{CACHE_KW: cache}).logits[:, -1:].argmax(-1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    cache.check_finite()


KIVI = dict(bits=4, group_size=16, scale_dtype=torch.float16, asymmetric=True, channel_group=4, residual=8, flush=4)


@pytest.mark.parametrize("spec", [dict(bits=8, group_size=8), KIVI, dict(KIVI, sink=2)], ids=["int8", "kivi", "sinks"])
def test_non_finite_decode_step_is_refused_by_name_at_the_next_host_boundary(spec):
    """A decode step is checked on the device (no host read): the cache says so by name at ``check_finite()`` and
    refuses the next multi-token update (nothing written); ``reset`` clears it."""
    from kvslim.caches import KVSlimCache
    from kvslim.caches.dense import AppendLayer
    from kvslim.caches.storage import StoreSpec

    layer = AppendLayer(StoreSpec(**spec))
    cache = KVSlimCache([layer])
    gen = torch.Generator().manual_seed(0)
    layer.update(torch.randn(1, 2, 13, 16, generator=gen), torch.randn(1, 2, 13, 16, generator=gen))
    layer.update(torch.randn(1, 2, 1, 16, generator=gen), torch.randn(1, 2, 1, 16, generator=gen))
    cache.check_finite()  # finite so far
    v = torch.randn(1, 2, 1, 16, generator=gen)
    v[0, 1, 0, 3] = float("inf")
    with SyncCounter() as counter:
        layer.update(torch.randn(1, 2, 1, 16, generator=gen), v)  # no error, no host read
    assert not counter.hits, counter.report()
    with pytest.raises(ValueError, match="earlier decode step held a non-finite value"):
        cache.check_finite()
    with pytest.raises(ValueError, match="non-finite"):
        layer.update(torch.randn(1, 2, 3, 16, generator=gen), torch.randn(1, 2, 3, 16, generator=gen))
    assert layer.get_seq_length() == 15  # the refused prefill wrote nothing
    layer.reset()
    cache.check_finite()
    layer.update(torch.randn(1, 2, 3, 16, generator=gen), torch.randn(1, 2, 3, 16, generator=gen))


def test_slim_position_jump_in_a_decode_step_is_refused_at_the_next_host_boundary():
    from kvslim.caches import KVSlimCache
    from kvslim.caches.slim import SlimLayer

    layer = SlimLayer("k", 8)
    cache = KVSlimCache([layer])
    layer.write(torch.randn(2, 5, 8), torch.arange(5)[None].expand(2, -1))
    layer.write(torch.randn(2, 1, 8), torch.tensor([[5], [5]]))
    cache.check_finite()
    with SyncCounter() as counter:
        layer.write(torch.randn(2, 1, 8), torch.tensor([[6], [9]]))  # sequence 1 jumps: checked on the device
    assert not counter.hits, counter.report()
    with pytest.raises(ValueError, match="consecutive positions"):
        cache.check_finite()
    with pytest.raises(ValueError, match="consecutive positions"):
        layer.write(torch.randn(2, 2, 8), torch.tensor([[7, 8], [8, 9]]))
