"""The multi-token call over a cache (a question asked of a prompt cache): its fast paths against their references.

* ``unpack_codes`` (table lookup on the CPU) against ``unpack_codes_reference`` (shifts): every byte, every 12-bit
  half word, signed and unsigned, strided and empty inputs; bitwise.
* ``packed_rows_sdpa`` (GQA query heads packed as rows, the mask repeated) against HF's ``sdpa_attention_forward``
  (``repeat_kv`` of the whole history); bitwise, and whole tiny models over a prefix: logits equal to the same
  calls with the packing turned off.
"""

from __future__ import annotations

import types

import pytest
import torch
from conftest import tiny_model
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import kvslim
from kvslim.adapters import sdpa as adapter
from kvslim.adapters.compat import CACHE_KW
from kvslim.ops.quant_formats import unpack_codes, unpack_codes_reference


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_unpack_table_equals_shifts_on_every_byte_pattern(bits, signed):
    if bits == 3:  # every 12-bit value in both halves of a 3-byte word, then random words
        half = torch.arange(4096, dtype=torch.int32)
        words = torch.cat((half, half << 12, torch.randint(0, 1 << 24, (4096,), dtype=torch.int32)))
        packed = torch.stack([(words >> s) & 0xFF for s in (0, 8, 16)], dim=-1).to(torch.uint8).reshape(-1, 24)
    else:
        packed = torch.arange(256, dtype=torch.uint8).repeat(8).reshape(-1, 8 * bits)  # every byte
    cases = [packed, packed.reshape(2, -1, packed.shape[-1])[:, ::3], packed[:0], packed.reshape(4, 1, -1,
                                                                                                packed.shape[-1])]
    for p in cases:
        got, want = unpack_codes(p, bits, signed), unpack_codes_reference(p, bits, signed)
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def _hf(module, q, k, v, mask):
    return sdpa_attention_forward(module, q, k, v, mask, scaling=0.125)[0]


@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
@pytest.mark.parametrize("batch,groups,s,t", [(1, 7, 17, 1041), (2, 2, 5, 300), (1, 4, 2, 33)])
def test_packed_rows_equal_hf_repeat_kv_to_the_last_bits(batch, groups, s, t, mask_kind):
    torch.manual_seed(0)
    module = types.SimpleNamespace(num_key_value_groups=groups, is_causal=True)
    q = torch.randn(batch, 2 * groups, s, 16)
    k, v = torch.randn(batch, 2, t, 16), torch.randn(batch, 2, t, 16)
    allowed = torch.ones(batch, 1, s, t, dtype=torch.bool).tril(t - s)
    allowed[-1, :, :, : t // 3] = False  # a left-padded row: batch rows differ
    mask = allowed if mask_kind == "bool" else torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    assert adapter.packable_prefix(module, q, k, mask, 0.0, {})
    got = adapter.packed_gqa_sdpa_forward(module, q, k, v, mask, scaling=0.125)[0]
    want = _hf(module, q, k, v, mask)
    # bitwise on most shapes; torch's CPU kernel may round the last bit differently for G·S rows than for S (seen at
    # (1, 4, 2, 33) on an AVX-512 machine: 1.2e-7), so at most a few units in the last place of the output's scale
    assert (got - want).abs().max() <= 4 * torch.finfo(torch.float32).eps * want.abs().max()


def test_packed_rows_leave_what_they_do_not_cover_to_hf():
    module = types.SimpleNamespace(num_key_value_groups=2, is_causal=True)
    q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 10, 16)
    mask = torch.ones(1, 1, 3, 10, dtype=torch.bool)
    assert not adapter.packable_prefix(module, q, k, None, 0.0, {})  # HF's is_causal path
    assert not adapter.packable_prefix(module, q, k, mask, 0.1, {})
    assert not adapter.packable_prefix(module, q, k, mask, 0.0, {"position_bias": torch.zeros(1)})
    assert not adapter.packable_prefix(module, q, k, mask.expand(1, 4, 3, 10), 0.0, {})  # per-head mask
    assert not adapter.packable_prefix(types.SimpleNamespace(num_key_value_groups=1), q[:, :2], k, mask, 0.0, {})


@pytest.mark.parametrize("method", ["dense", "int4", "int2", "turbo3"])
def test_a_question_over_a_prefix_gives_the_unpacked_logits_bitwise(monkeypatch, method):
    """A 6-token call over a 40-token prefix (and a decode step after it): the same logits with the packed rows
    as with HF's ``repeat_kv`` path (the packing turned off). Coded caches: with their multi-token calls routed to
    the dequantized read (the route that still serves long calls over short histories; the fused route is
    ``tests/test_fused_call.py``'s)."""
    from kvslim.caches import base

    monkeypatch.setattr(base, "FUSED_CALL_TOKENS", 1)
    monkeypatch.setattr(base, "FUSED_CALL_HISTORY", 10 ** 9)
    model = tiny_model("llama", kv_heads=2)
    kvslim.apply(model, method)
    ids = torch.randint(1, 128, (1, 47))

    def run():
        cache = kvslim.make_cache(model)
        with torch.no_grad():
            model(ids[:, :40], use_cache=True, **{CACHE_KW: cache})
            a = model(ids[:, 40:46], use_cache=True, **{CACHE_KW: cache}).logits
            b = model(ids[:, 46:], use_cache=True, **{CACHE_KW: cache}).logits
        return a, b

    calls = []
    real = adapter.packed_rows_sdpa
    monkeypatch.setattr(adapter, "packed_rows_sdpa", lambda *a: calls.append(1) or real(*a))
    fast = run()
    assert calls, "the packed rows were not taken"
    monkeypatch.setattr(adapter, "packable_prefix", lambda *a: False)
    slow = run()
    kvslim.restore(model)
    assert all(torch.equal(x, y) for x, y in zip(fast, slow))
