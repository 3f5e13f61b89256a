"""The SDPA backends kvslim forces on CUDA (ops/sdpa.py): the choice, and that every SDPA call kvslim makes or
wraps enters it. CPU-only: CUDA inputs are fake tensors (``FakeTensorMode``), ``sdpa_kernel`` is recorded."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import tiny_model
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend

import kvslim
from kvslim.adapters import sdpa as adapter
from kvslim.adapters.compat import CACHE_KW
from kvslim.attention import mla
from kvslim.ops import sdpa


def test_cuda_gets_flash_then_efficient_then_math_and_never_cudnn():
    assert sdpa.sdpa_backends("cuda") == [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                          SDPBackend.MATH]
    assert sdpa.sdpa_backends(torch.device("cuda", 1)) == sdpa.sdpa_backends("cuda")
    assert SDPBackend.CUDNN_ATTENTION not in sdpa.sdpa_backends("cuda")  # re-plans for every new key length
    assert sdpa.sdpa_backends("cpu") is None and sdpa.sdpa_backends("meta") is None


@pytest.fixture
def recorded(monkeypatch):
    """The backend lists ``sdpa_kernel`` was entered with; every SDPA call must run inside such a context when one
    was entered for its device (an SDPA call on CUDA outside it fails the test)."""
    calls, inside = [], []
    real = torch.nn.functional.scaled_dot_product_attention

    @contextlib.contextmanager
    def fake_kernel(backends, *args, **kwargs):
        calls.append(list(backends))
        inside.append(True)
        try:
            yield
        finally:
            inside.pop()

    def spy(query, *args, **kwargs):
        assert inside or query.device.type != "cuda", "an SDPA call on CUDA ran outside the forced backends"
        return real(query, *args, **kwargs)

    monkeypatch.setattr(sdpa, "sdpa_kernel", fake_kernel)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


class Mod(torch.nn.Module):
    is_causal = True

    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups = groups


@pytest.mark.parametrize("groups,masked", [(1, False), (1, True), (4, False), (4, True)],
                         ids=["mha", "mha-mask", "gqa-packed", "gqa-mask"])
def test_kvslim_sdpa_enters_the_forced_backends_on_cuda_inputs(recorded, groups, masked):
    with FakeTensorMode():
        q = torch.empty(2, 8, 1, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.empty(2, 8 // groups, 33, 64, device="cuda", dtype=torch.bfloat16)
        mask = torch.ones(2, 1, 1, 33, device="cuda", dtype=torch.bool) if masked else None
        out, _ = adapter.packed_gqa_sdpa_forward(Mod(groups), q, k, k, mask, scaling=0.125)
        assert out.shape == (2, 1, 8, 64)
    assert recorded == [sdpa.sdpa_backends("cuda")]


def test_kvslim_sdpa_leaves_cpu_calls_to_torch(recorded):
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 4, 5, 16)
    adapter.packed_gqa_sdpa_forward(Mod(1), q, k, k, None)
    assert recorded == []


def test_mla_sdpa_enters_the_forced_backends_on_cuda_inputs(recorded):
    with FakeTensorMode():
        q = torch.empty(1, 4, 1, 24, device="cuda", dtype=torch.bfloat16)
        k = torch.empty(1, 4, 9, 24, device="cuda", dtype=torch.bfloat16)
        v = torch.empty(1, 4, 9, 16, device="cuda", dtype=torch.bfloat16)
        mla.attend_dense(q, k, v, 0.2)  # (the masked branch slices with "...", which fake CUDA tensors refuse)
    assert recorded == [sdpa.sdpa_backends("cuda")]


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_dense_method_runs_kvslim_sdpa_on_every_layer(monkeypatch, kv_heads):
    """The dense method (MHA included) goes through kvslim's SDPA, so CUDA decode gets the forced backends."""
    model = tiny_model("llama", kv_heads=kv_heads)
    kvslim.apply(model, "dense")
    assert model.config._attn_implementation == adapter.NAME
    devices = []

    def spy(device):
        devices.append(torch.device(device))
        return contextlib.nullcontext()

    monkeypatch.setattr(adapter, "sdpa_context", spy)
    with torch.no_grad():
        model(torch.randint(1, 128, (1, 5)), use_cache=True, **{CACHE_KW: kvslim.make_cache(model)})
    assert devices == [torch.device("cpu")] * model.config.num_hidden_layers
    kvslim.restore(model)
    assert model.config._attn_implementation == "sdpa"
