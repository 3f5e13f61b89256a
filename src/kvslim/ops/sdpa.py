"""Which of torch's SDPA backends a kvslim SDPA call may use: the one choice, by device.

On CUDA, torch's own choice made a kvslim dense decode step host-bound on an H100 (48.6 ms against 9.5–9.8 ms
with one backend forced through ``torch.nn.attention.sdpa_kernel``; 1B MHA, 8k × 8, bf16; ``docs/gpu.md``). Every
SDPA call kvslim makes or wraps on CUDA (``adapters/sdpa.py``, ``attention/mla.py``) runs under
:func:`sdpa_context`. Elsewhere torch chooses.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

#: SDPA backends allowed on CUDA; torch picks the first that takes the call in its own priority order among them
#: (flash, then memory-efficient, then math): flash takes no arbitrary mask and only fp16/bf16, memory-efficient
#: takes masks and fp32, math takes anything (correct, slow). cuDNN is left out: it builds an execution plan per
#: sequence length, and a decode step brings a new key length every step (docs/gpu.md).
CUDA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def sdpa_backends(device: torch.device | str) -> list[SDPBackend] | None:
    """The SDPA backends a call on ``device`` may use: :data:`CUDA_BACKENDS` on CUDA, ``None`` (torch's choice)
    elsewhere. Decided from the device alone (no tensor is read, nothing synchronises)."""
    return list(CUDA_BACKENDS) if torch.device(device).type == "cuda" else None


def sdpa_context(device: torch.device | str):
    """A context forcing :func:`sdpa_backends` on SDPA calls for ``device`` (a no-op where it returns ``None``)."""
    backends = sdpa_backends(device)
    return contextlib.nullcontext() if backends is None else sdpa_kernel(backends)
