"""Sliding-window attention masks (SPEC §2, seed 001, Mistral-style SWA).

Stores nothing; builds masks. Query position ``i`` sees key position ``j`` iff ``i - W < j <= i``
(W keys including itself) — the seed's ``triu(M, 1) + tril(M, -W)`` construction and Hugging Face's
convention. Exact: these are the masks themselves, no approximation.

Compressed mask for block-wise flash kernels: the seed gives two listings that disagree.

* Python listing (implemented here, ``rule="python"``): block ``pp_n = 128 if head_dim <= 128 else 64``;
  ``true_size = W`` if ``W <= 3·pp_n``, else ``3·pp_n`` if ``W % pp_n == 0``, else ``2·pp_n + W % pp_n``.
* C++ listing (``rule="cpp"``, for comparison only): block ``16384 // head_dim // 16 * 16`` when
  ``head_dim > 128`` (so 80 for head_dim 192, 32 for 512, not 64), else 128; and
  ``true_size = 2·block + W % block`` whenever ``W > 3·block`` — i.e. ``2·block`` (not ``3·block``)
  when ``W % block == 0``. For head_dim > 1024 its block is 0 and the listing divides by zero.

Also in the seed: the C++ listing of the *uncompressed* mask indexes rows with
``SWA_COMPRESS_MASK_SIZE`` instead of ``SWA_MASK_SIZE`` (a typo; the intended mask is the Python one).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

DEFAULT_MASKED_VALUE = -65536.0
COMPRESSED_MASK_SIZE = 512

Rule = Literal["python", "cpp"]


def _check_positive(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def swa_bool_mask(max_seq: int, window: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean sliding-window mask, True = hidden (the seed's "1.0" variant as bool).

    Args:
        max_seq: number of query and key positions.
        window: W, keys visible to each query including itself.

    Returns:
        bool tensor (max_seq, max_seq); ``[i, j]`` is False iff ``i - window < j <= i``.
    """
    _check_positive(max_seq, "max_seq")
    _check_positive(window, "window")
    i = torch.arange(max_seq, device=device).unsqueeze(1)  # (S, 1) query positions
    j = torch.arange(max_seq, device=device).unsqueeze(0)  # (1, S) key positions
    return (j > i) | (j <= i - window)


def swa_mask(max_seq: int, window: int, masked_value: float = DEFAULT_MASKED_VALUE, *,
             dtype: torch.dtype = torch.float32,
             device: torch.device | str | None = None) -> torch.Tensor:
    """Additive sliding-window mask: 0 where visible, ``masked_value`` where hidden.

    Returns:
        (max_seq, max_seq) tensor in ``dtype``; equals the seed's ``triu(M, 1) + tril(M, -W)``.
    """
    hidden = swa_bool_mask(max_seq, window, device=device)
    return _additive(hidden, masked_value, dtype)


def compressed_true_size(window: int, head_dim: int, *, rule: Rule = "python") -> int:
    """Effective window of the compressed mask (see the module docstring for both rules).

    Args:
        window: W, the model's sliding window.
        head_dim: per-head embedding size (``head_size`` in the seed).
        rule: ``"python"`` (default, the seed's Python listing) or ``"cpp"`` (its C++ listing).
    """
    _check_positive(window, "window")
    _check_positive(head_dim, "head_dim")
    if rule == "python":
        block = 128 if head_dim <= 128 else 64
        if window <= 3 * block:
            return window
        return 3 * block if window % block == 0 else 2 * block + window % block
    if rule == "cpp":
        block = 16384 // head_dim // 16 * 16 if head_dim > 128 else 128
        if block == 0:
            raise ValueError(f"head_dim={head_dim} gives a zero block size in the C++ rule (needs <= 1024)")
        return 2 * block + window % block if window > 3 * block else window
    raise ValueError(f"rule must be 'python' or 'cpp', got {rule!r}")


def swa_compressed_mask(window: int, head_dim: int, size: int = COMPRESSED_MASK_SIZE, *,
                        masked_value: float = DEFAULT_MASKED_VALUE, rule: Rule = "python",
                        dtype: torch.dtype = torch.float32,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """Fixed-size compressed SWA mask for block-wise flash kernels.

    The sliding-window mask of ``size`` positions built with window ``compressed_true_size(window,
    head_dim)``. The seed's listing returns shape (1, 512, 512); this returns (size, size) — add the
    leading axis with ``unsqueeze(0)`` if a kernel wants it.

    Returns:
        (size, size) tensor in ``dtype``: 0 visible, ``masked_value`` hidden.
    """
    _check_positive(size, "size")
    true_size = compressed_true_size(window, head_dim, rule=rule)
    return swa_mask(size, true_size, masked_value, dtype=dtype, device=device)


def _additive(hidden: torch.Tensor, masked_value: float, dtype: torch.dtype) -> torch.Tensor:
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    finfo = torch.finfo(dtype)
    if math.isfinite(masked_value) and not finfo.min <= masked_value <= finfo.max:
        raise ValueError(f"masked_value={masked_value} does not fit {dtype} (range ±{finfo.max:g}); "
                         "pass a smaller magnitude or -inf")
    out = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
    return out.masked_fill_(hidden, masked_value)


def static_causal_mask(lengths: torch.Tensor, t: int, n: int) -> torch.Tensor:
    """(B, 1, t, n) fp32 additive causal mask over a capturable cache's whole buffer of ``n`` slots (caches/capture.py)
    when ``lengths`` (B,) slots are written, the ``t`` queries being the last ``t`` of them: slot j is visible to query
    i iff ``j ≤ lengths − t + i`` (slots past the length are future positions). For layers that get no mask from HF
    (it may skip a causal mask for a prefill: the queries are then the buffer's first ``t`` slots, not its last)."""
    device = lengths.device
    i = torch.arange(t, device=device)[None, :, None]
    j = torch.arange(n, device=device)[None, None, :]
    hidden = j > lengths[:, None, None] - t + i  # (B, t, n)
    return torch.zeros(hidden.shape, device=device).masked_fill(hidden, torch.finfo(torch.float32).min)[:, None]

