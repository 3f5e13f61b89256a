"""Measure the memory bandwidth this process can reach: the roofline for memory-bound decode."""

from __future__ import annotations

import statistics
import time

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(device: str | torch.device = "cpu", nbytes: int = 1 << 30, trials: int = 10) -> dict:
    """Best GB/s (1e9 bytes/s) over ``trials`` of a full read (``sum``) and of a copy (read + write).

    Returns:
        ``{"read_gbps", "copy_gbps", "roofline_gbps", "read_gbps_median"}``; the roofline is the better of the
        best read and best copy rates (decode mostly reads); the best, not the median, since a roofline is
        what the machine can reach.
    """
    device = torch.device(device)
    n = nbytes // 4
    a = torch.ones(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    reads, copies = [], []
    for _ in range(trials + 1):
        _sync(device)
        t0 = time.perf_counter()
        a.sum()
        _sync(device)
        t1 = time.perf_counter()
        b.copy_(a)
        _sync(device)
        t2 = time.perf_counter()
        reads.append(nbytes / (t1 - t0) / 1e9)
        copies.append(2 * nbytes / (t2 - t1) / 1e9)
    read, copy = max(reads[1:]), max(copies[1:])
    return {"read_gbps": read, "copy_gbps": copy, "roofline_gbps": max(read, copy),
            "read_gbps_median": statistics.median(reads[1:])}
