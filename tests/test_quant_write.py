"""The one-call quantized write (``torch.ops.kvslim.quant_write``) against its torch twin: bit-identical codes and
scales (int8/int4, fp32/fp16/bf16 scales, with and without smoothing factors), inf/nan refused with nothing
written, named errors; a store written through it equals one written by the torch path."""

from __future__ import annotations

import pytest
import torch

from kvslim.caches.storage import QuantizedStore, StoreSpec
from kvslim.kernels import quant_write as kernel


def _ops():
    if not kernel.available():
        pytest.skip("no C++ compiler: the op cannot be built here (its twin is used)")


@pytest.mark.parametrize("bits,gs,sdt", [(8, 64, torch.float32), (8, 32, torch.float16), (4, 64, torch.float32),
                                         (4, 16, torch.bfloat16), (4, 32, torch.float16), (8, 80, torch.bfloat16)])
@pytest.mark.parametrize("smooth", [False, True])
def test_bit_identical_to_the_twin(bits, gs, sdt, smooth):
    _ops()
    gen = torch.Generator().manual_seed(bits + gs)
    b, h, s, d, cap = 2, 3, 5, 160 if gs == 80 else 64, 12
    x = torch.randn(b, h, s, d, generator=gen) * torch.logspace(-3, 3, d)  # wide ranges, tiny groups
    x[0, 0, 0, :gs] = 0.0  # an all-zero group: the scale floor
    x[1, 2, 1, :gs] = 1e-30  # underflows the fp16 scale range
    channel = torch.rand(b, h, 1, d, generator=gen) + 0.1 if smooth else None
    width = d if bits == 8 else d // 2
    cdt = torch.int8 if bits == 8 else torch.uint8
    got = (torch.zeros(b, h, cap, width, dtype=cdt), torch.full((b, h, cap, d // gs), 7.0, dtype=sdt))
    want = (got[0].clone(), got[1].clone())
    assert torch.ops.kvslim.quant_write(x, channel, bits, gs, 4, *got)
    assert kernel.reference(x, channel, bits, gs, 4, *want)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1].view(torch.int16 if sdt != torch.float32 else
                                                                     torch.int32),
                                                        want[1].view(torch.int16 if sdt != torch.float32 else
                                                                     torch.int32))
    assert (got[1][:, :, :4] == 7.0).all() and (got[1][:, :, 9:] == 7.0).all()  # other slots untouched


def test_non_finite_rows_write_nothing():
    _ops()
    x = torch.randn(1, 2, 1, 64)
    x[0, 1, 0, 5] = float("inf")
    codes, scale = torch.ones(1, 2, 4, 64, dtype=torch.int8), torch.ones(1, 2, 4, 1)
    assert not torch.ops.kvslim.quant_write(x, None, 8, 64, 0, codes, scale)
    assert (codes == 1).all() and (scale == 1).all()


def test_bad_input_is_refused_by_name():
    _ops()
    x = torch.randn(1, 2, 1, 64)
    codes, scale = torch.zeros(1, 2, 4, 64, dtype=torch.int8), torch.zeros(1, 2, 4, 1)
    with pytest.raises(ValueError, match="slots"):
        torch.ops.kvslim.quant_write(x, None, 8, 64, 4, codes, scale)
    with pytest.raises(ValueError, match="codes"):
        torch.ops.kvslim.quant_write(x, None, 4, 64, 0, codes, scale)
    with pytest.raises(ValueError, match="group_size"):
        torch.ops.kvslim.quant_write(x, None, 8, 48, 0, codes, scale)
    with pytest.raises(ValueError, match="channel"):
        torch.ops.kvslim.quant_write(x, torch.ones(1, 2, 1, 32), 8, 64, 0, codes, scale)


@pytest.mark.parametrize("bits", [8, 4])
def test_store_writes_equal_the_torch_path(bits, monkeypatch):
    """A smoothed store fed a prefill and then single tokens: the same bytes through the op and through torch."""
    _ops()
    gen = torch.Generator().manual_seed(bits)
    spec = StoreSpec(bits, 32, torch.float16, smooth=True)
    steps = [torch.randn(2, 3, 7, 64, generator=gen)] + [torch.randn(2, 3, 1, 64, generator=gen) for _ in range(4)]
    stores = []
    for use_op in (True, False):
        if not use_op:
            monkeypatch.setattr(kernel, "available", lambda: False)
        st = QuantizedStore(spec, 2, 3, 16, 64, torch.float32, torch.device("cpu"))
        pos = 0
        for x in steps:
            st.write(pos, x)
            pos += x.shape[2]
        stores.append(st)
    for a, b in zip(stores[0].tensors(), stores[1].tensors()):
        assert torch.equal(a[:, :, :11].view(torch.uint8), b[:, :, :11].view(torch.uint8))
