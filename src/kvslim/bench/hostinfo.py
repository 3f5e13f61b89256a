"""The host a GPU check runs on, recorded before any stage (issue 42): CPU model, the SIMD / matrix flags that decide
a CPU backend (``amx_*``, ``avx512*``, ``avx2``, ``fma``, ``f16c``), cores, host memory, and the GPU's driver. Reads
``/proc`` and asks ``nvidia-smi`` (a missing file or tool is a ``None`` field, never an error). No torch import."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess

#: CPU flags kept (prefixes): AMX tiles, AVX-512 families, and the AVX2-era basics
FLAG_PREFIXES = ("amx", "avx512", "avx2", "avx_vnni", "fma", "f16c")


def cpu() -> dict:
    """``model``, ``flags`` (those of :data:`FLAG_PREFIXES`, sorted), ``amx`` / ``avx512`` (whether any such flag),
    ``logical_cores``, ``usable_cores`` (this process's affinity), ``sockets``."""
    model, flags, sockets = None, set(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model is None:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
                elif key == "physical id":
                    sockets.add(value.strip())
    except OSError:
        pass
    kept = sorted(f for f in flags if f.startswith(FLAG_PREFIXES))
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = None
    return {"model": model or platform.processor() or None, "flags": kept,
            "amx": any(f.startswith("amx") for f in kept), "avx512": any(f.startswith("avx512") for f in kept),
            "logical_cores": os.cpu_count(), "usable_cores": usable, "sockets": len(sockets) or None}


def memory() -> dict:
    """Host memory in bytes: ``total`` and ``available`` (``MemAvailable``) from ``/proc/meminfo``."""
    out = {"total_bytes": None, "available_bytes": None}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    out["total_bytes" if key == "MemTotal" else "available_bytes"] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def gpus() -> list[dict] | None:
    """Per GPU as ``nvidia-smi`` reports it (name, memory MiB, driver, compute capability), or ``None`` without
    the tool."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return None
    fields = ("name", "memory.total", "memory.free", "driver_version", "compute_cap")
    try:
        text = subprocess.run([tool, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [[v.strip() for v in line.split(",")] for line in text.splitlines() if line.strip()]
    return [dict(zip(("name", "memory_total_mib", "memory_free_mib", "driver", "compute_capability"), r))
            for r in rows]


def host() -> dict:
    """Everything above: ``{"cpu": ..., "memory": ..., "nvidia_smi": ...}``."""
    return {"cpu": cpu(), "memory": memory(), "nvidia_smi": gpus()}
