"""Which implementation of an op family runs for a call: the device seam.

Every op family (``kernels/<family>.py``) has up to three implementations of one contract:

* ``"cpp"``: the C++ op (``csrc/``), CPU tensors only;
* ``"triton"``: the Triton kernels (``kernels/triton/<family>.py``), CUDA tensors; with ``TRITON_INTERPRET=1`` they
  also run on CPU tensors through Triton's interpreter (how CI runs the GPU code path without a GPU);
* ``"torch"``: the pure-torch twin, the reference for both, on any device.

:func:`pick` chooses, per call, from the tensors' device: CUDA → ``triton`` (when Triton imports), CPU → ``cpp``
(when the family's op is built), else ``torch``. ``KVSLIM_BACKEND=triton|cpp|torch`` overrides the choice for every
family; a value it cannot honour is refused by name (never a silent fallback to another backend). A family whose
forced backend does not cover a particular input (a head dim, a dtype) still runs the twin, with one warning per
process (:func:`warn_fallback`).
"""

from __future__ import annotations

import importlib.util
import os
import warnings

import torch

ENV = "KVSLIM_BACKEND"
BACKENDS = ("triton", "cpp", "torch")


#: whether the triton package is present (a lookup, nothing imported); a module constant, not an ``lru_cache``d
#: call, so that dynamo reads it as a constant inside a compiled decode step (and does not warn)
_TRITON_PRESENT = importlib.util.find_spec("triton") is not None


def triton_installed() -> bool:
    """Whether ``import triton`` can work here (the package is present; nothing is imported)."""
    return _TRITON_PRESENT


def interpreting() -> bool:
    """Whether Triton kernels run through the interpreter (``TRITON_INTERPRET=1``), on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def forced() -> str | None:
    """The backend ``KVSLIM_BACKEND`` forces, or ``None`` when it is unset or empty.

    Raises:
        ValueError: an unknown value, or ``triton`` without Triton installed.
    """
    value = os.environ.get(ENV, "").strip().lower()
    if not value:
        return None
    if value not in BACKENDS:
        raise ValueError(f"{ENV} must be one of {BACKENDS} (or unset for the choice by device), got {value!r}")
    if value == "triton" and not triton_installed():
        raise ValueError(f"{ENV}=triton, but Triton is not installed here: pip install triton (a CUDA torch ships "
                         f"it), or unset {ENV}")
    return value


def pick(device: torch.device | str, cpp_available: bool) -> str:
    """The backend for a call whose tensors live on ``device``.

    Args:
        device: the device of the call's tensors (all of them on one device; the caller checks).
        cpp_available: whether the family's C++ op is built and loaded here.

    Returns:
        ``"triton"``, ``"cpp"`` or ``"torch"``.

    Raises:
        ValueError: ``KVSLIM_BACKEND`` names a backend that cannot run on ``device`` (``cpp`` on CUDA tensors,
            ``triton`` on CPU tensors without ``TRITON_INTERPRET=1``, ``cpp`` without a built op).
    """
    kind = torch.device(device).type
    want = forced()
    if want == "torch":
        return "torch"
    if want == "triton":
        if kind == "cpu" and not interpreting():
            raise ValueError(f"{ENV}=triton on CPU tensors needs TRITON_INTERPRET=1 (Triton's interpreter); "
                             "without it Triton kernels run on CUDA tensors only")
        return "triton"
    if want == "cpp":
        if kind != "cpu":
            raise ValueError(f"{ENV}=cpp, but the C++ ops take CPU tensors only (these are on {kind}); "
                             f"use {ENV}=triton or torch, or unset it")
        if not cpp_available:
            raise ValueError(f"{ENV}=cpp, but the C++ ops are not built here (no compiler?): "
                             "run `python -m kvslim.kernels.build`, or unset it")
        return "cpp"
    if kind == "cuda" and triton_installed():
        return "triton"
    if kind == "cpu" and cpp_available:
        return "cpp"
    return "torch"


def decode_kernel_runs(device_type: str, cpp_available) -> bool:
    """Whether a decode step should hand an op family its codes (fused decode) for tensors on ``device_type``.

    ``KVSLIM_BACKEND`` set: yes, the forced backend runs them (or refuses by name at the call; never a silent
    unfused read). Otherwise by device: on CUDA the Triton kernels, which need Triton and no C++ build (no compiler,
    no ninja); elsewhere the C++ op (CPU tensors only), asked for through ``cpp_available()`` only here, so that a
    CUDA model never builds it nor warns about it."""
    if forced() is not None:
        return True
    if device_type == "cuda":
        return triton_installed()
    return bool(cpp_available())


_warned: set[str] = set()


def warn_fallback(family: str, why: str) -> None:
    """One warning per process and family: the chosen kernel does not take this input, the twin runs."""
    if family in _warned:
        return
    _warned.add(family)
    warnings.warn(f"kvslim: {family}: {why}; the pure-torch twin runs instead (correct, slower)", stacklevel=3)


def same_device(what: str, *tensors: torch.Tensor | None) -> torch.device:
    """The one device of ``tensors`` (``None`` entries skipped); a mix (a CUDA cache with a CPU query) is refused.

    Raises:
        ValueError: naming ``what`` and the devices found.
    """
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        found = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(f"{what}: all tensors must be on one device, got {found} (move the cache and the model "
                         "together: cache.to(device))")
    return next(iter(devices)) if devices else torch.device("cpu")


def check_lengths(name: str, lengths: torch.Tensor | None, q: torch.Tensor, n: int) -> None:
    """``lengths``: ``None`` or an int64 (B,) tensor on ``q``'s device with values in [0, n]. The values are read
    (one host sync) only eagerly: not while dynamo traces nor while a CUDA graph captures (the kernels clamp).

    Raises:
        ValueError: naming ``lengths`` and what was expected.
    """
    if lengths is None:
        return
    b = q.shape[0]
    if (not isinstance(lengths, torch.Tensor) or lengths.dtype != torch.int64 or lengths.dim() != 1
            or lengths.shape[0] != b or lengths.device != q.device):
        got = (f"{lengths.dtype} {tuple(lengths.shape)} on {lengths.device}" if isinstance(lengths, torch.Tensor)
               else type(lengths).__name__)
        raise ValueError(f"{name}: lengths must be an int64 tensor of shape (B={b},) on {q.device}, got {got}")
    if torch.compiler.is_compiling() or (lengths.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    bad = (lengths < 0) | (lengths > n)
    if bool(bad.any()):
        raise ValueError(f"{name}: lengths must lie in [0, n={n}], got {lengths.tolist()}")
