"""Sliding-window masks (kvslim.ops.masks) against the seed's listings (seed 001) and a brute-force rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvslim.ops import compressed_true_size, swa_bool_mask, swa_compressed_mask, swa_mask

M = -65536.0
# The seed's example, max(seqLen) = 5, windowSize = 3, written out by hand from its listing.
SEED_5_3 = [
    [0, M, M, M, M],
    [0, 0, M, M, M],
    [0, 0, 0, M, M],
    [M, 0, 0, 0, M],
    [M, M, 0, 0, 0],
]


def seed_python_mask(maxseq: int, window_size: int, fill: float) -> np.ndarray:
    """The seed's Python listing, verbatim."""
    swa_mask = np.ones(shape=[maxseq, maxseq]) * fill
    triu_mask = np.triu(swa_mask, 1)
    tril_mask = np.tril(swa_mask, -window_size)
    swa_mask = triu_mask + tril_mask
    return swa_mask


def seed_cpp_mask(max_seq: int, window: int, fill: float) -> list[list[float]]:
    """The seed's C++ listing transcribed line by line (row stride fixed to max_seq, see masks.py)."""
    mask = [[fill] * max_seq for _ in range(max_seq)]
    for i in range(max_seq):
        offset = i - window + 1 if i >= window else 0
        for j in range(offset, i + 1):
            mask[i][j] = 0.0
    return mask


def seed_python_compressed(window_size: int, head_size: int, fill: float) -> np.ndarray:
    """The seed's compressed-mask Python listing, verbatim (shape (1, 512, 512))."""
    swa_mask = np.ones(shape=(1, 512, 512)) * fill
    pp_n = 128 if head_size <= 128 else 64
    if window_size <= pp_n * 3:
        true_size = window_size
    else:
        if window_size % pp_n == 0:
            true_size = pp_n * 3
        else:
            true_size = pp_n * 2 + window_size % pp_n
    triu_mask = np.triu(swa_mask, 1)
    tril_mask = np.tril(swa_mask, -true_size)
    swa_mask = triu_mask + tril_mask
    return swa_mask


def seed_cpp_compress_window(window: int, embeddim: int) -> int:
    block = 16384 // embeddim // 16 * 16 if embeddim > 128 else 128
    return 2 * block + window % block if window > 3 * block else window


def test_seed_example_float():
    expect = torch.tensor(SEED_5_3, dtype=torch.float32)
    assert torch.equal(swa_mask(5, 3), expect)
    assert torch.equal(torch.from_numpy(seed_python_mask(5, 3, M)).float(), expect)
    assert torch.equal(torch.tensor(seed_cpp_mask(5, 3, M)), expect)


def test_seed_example_one_variant():
    expect = torch.tensor(SEED_5_3) != 0
    assert torch.equal(swa_bool_mask(5, 3), expect)
    assert torch.equal(torch.from_numpy(seed_python_mask(5, 3, 1.0)) == 1.0, expect)
    assert torch.equal(torch.tensor(seed_cpp_mask(5, 3, 1.0)) == 1.0, expect)
    assert torch.equal(swa_mask(5, 3, 1.0), expect.float())


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 24), st.integers(1, 30))
def test_visibility_rule_brute_force(max_seq, window):
    hidden = swa_bool_mask(max_seq, window)
    assert hidden.shape == (max_seq, max_seq) and hidden.dtype == torch.bool
    for i in range(max_seq):
        for j in range(max_seq):
            assert bool(hidden[i, j]) == (not (i - window < j <= i)), (i, j)
    assert torch.equal(torch.from_numpy(seed_python_mask(max_seq, window, 1.0)) == 1.0, hidden)
    assert (~hidden).sum(1).tolist() == [min(i + 1, window) for i in range(max_seq)]


@pytest.mark.parametrize("masked_value", [M, -1e9, float("-inf"), 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_float_and_bool_masks_agree(masked_value, dtype):
    if dtype == torch.float16 and masked_value in (M, -1e9):
        with pytest.raises(ValueError, match="masked_value"):
            swa_mask(7, 3, masked_value, dtype=dtype)
        return
    mask = swa_mask(7, 3, masked_value, dtype=dtype)
    hidden = swa_bool_mask(7, 3)
    assert mask.dtype == dtype
    expect = torch.where(hidden, torch.tensor(masked_value), torch.tensor(0.0)).to(dtype)
    assert torch.equal(mask, expect)


def test_window_at_least_max_seq_is_causal():
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)
    for window in (6, 7, 100):
        assert torch.equal(swa_bool_mask(6, window), causal)


# (window, head_dim) -> (Python rule, C++ rule)
TRUE_SIZE_TABLE = [
    ((100, 128), (100, 100)),
    ((384, 128), (384, 384)),
    ((385, 128), (257, 257)),
    ((512, 128), (384, 256)),    # W % block == 0: Python 3·block, C++ 2·block
    ((4096, 128), (384, 256)),   # Mistral-7B: W = 4096, head_dim 128
    ((4000, 128), (288, 288)),
    ((1000, 64), (360, 360)),
    ((192, 256), (192, 192)),
    ((193, 256), (129, 129)),
    ((256, 256), (192, 128)),
    ((1000, 256), (168, 168)),
    ((240, 192), (176, 240)),    # C++ block 80 for head_dim 192, Python 64
    ((4096, 192), (192, 176)),
    ((128, 512), (128, 64)),     # C++ block 32 for head_dim 512
    ((1, 128), (1, 1)),
]


@pytest.mark.parametrize(("args", "expect"), TRUE_SIZE_TABLE)
def test_compressed_true_size_table(args, expect):
    window, head_dim = args
    assert compressed_true_size(window, head_dim) == expect[0]
    assert compressed_true_size(window, head_dim, rule="cpp") == expect[1]
    assert seed_cpp_compress_window(window, head_dim) == expect[1]


@pytest.mark.parametrize(("window", "head_dim"), [(3, 64), (384, 128), (512, 128), (4000, 128), (300, 256)])
def test_compressed_mask_matches_seed_listing(window, head_dim):
    expect = torch.from_numpy(seed_python_compressed(window, head_dim, M)).float()  # (1, 512, 512)
    got = swa_compressed_mask(window, head_dim)
    assert got.shape == (512, 512)
    assert torch.equal(got.unsqueeze(0), expect)
    ones = torch.from_numpy(seed_python_compressed(window, head_dim, 1.0)).float()
    assert torch.equal(swa_compressed_mask(window, head_dim, masked_value=1.0).unsqueeze(0), ones)


def test_compressed_mask_size_and_cpp_rule():
    small = swa_compressed_mask(4096, 128, size=16)
    assert torch.equal(small, swa_mask(16, 384))
    assert torch.equal(swa_compressed_mask(512, 128, rule="cpp"), swa_mask(512, 256))


@pytest.mark.parametrize(("call", "name"), [
    (lambda: swa_mask(0, 3), "max_seq"),
    (lambda: swa_mask(5, 0), "window"),
    (lambda: swa_mask(5, -2), "window"),
    (lambda: swa_bool_mask(-1, 2), "max_seq"),
    (lambda: swa_bool_mask(4, True), "window"),
    (lambda: swa_bool_mask(4.0, 2), "max_seq"),
    (lambda: swa_mask(4, 2, dtype=torch.int32), "dtype"),
    (lambda: compressed_true_size(0, 128), "window"),
    (lambda: compressed_true_size(8, 0), "head_dim"),
    (lambda: compressed_true_size(8, -64), "head_dim"),
    (lambda: compressed_true_size(8, 64, rule="cuda"), "rule"),
    (lambda: compressed_true_size(8, 2048, rule="cpp"), "head_dim"),
    (lambda: swa_compressed_mask(0, 128), "window"),
    (lambda: swa_compressed_mask(8, 0), "head_dim"),
    (lambda: swa_compressed_mask(8, 128, size=0), "size"),
])
def test_bad_arguments_name_themselves(call, name):
    with pytest.raises(ValueError, match=name):
        call()
