"""Symmetric grouped int8/int4 quantization of new rows straight into a store's slots: ``torch.ops.kvslim.quant_write``.

A decode step writes one token per layer into its key and value stores. In torch that is a dozen small ops
(smoothing, per-group max, scale rounding, division, rounding, packing, two slice copies, a finiteness check);
the op does it in one call with the same fp32 arithmetic (:func:`kvslim.ops.quant.quantize`), so the codes and
scales are bit-identical. :func:`reference` is the torch twin; :func:`quant_write` dispatches. Source:
``csrc/quant_write.cpp``, built by :func:`kvslim.kernels.build.load_ops`.
"""

from __future__ import annotations

import functools

import torch

from ..ops.quant import quantize
from .build import load_ops

FAMILY = "quant_write"


@functools.cache
def available() -> bool:
    """Whether ``torch.ops.kvslim.quant_write`` is built and loaded (one warning from the build if not)."""
    return load_ops(FAMILY)


def reference(x: torch.Tensor, channel: torch.Tensor | None, bits: int, group_size: int, start: int,
              codes: torch.Tensor, scale: torch.Tensor) -> bool:
    """The op's twin: ``False`` (nothing written) if ``x`` (B, H, S, D) holds inf/nan, else quantize ``x / channel``
    (``channel`` (B|1, H|1, 1, D) fp32 or ``None``) into ``codes``/``scale`` slots ``[start, start + S)``."""
    if not bool(torch.isfinite(x).all()):
        return False
    y = x.float() if channel is None else x.float() / channel
    c, s = quantize(y, bits, group_size, scale.dtype)
    codes[:, :, start:start + x.shape[2]] = c
    scale[:, :, start:start + x.shape[2]] = s
    return True


def applies(x: torch.Tensor, codes: torch.Tensor) -> bool:
    """Whether the op takes these tensors: fp32 CPU rows, no autograd, not under ``torch.compile`` tracing."""
    # tracing first: dynamo cannot trace the build's file checks behind available() (a graph break)
    return (not torch.compiler.is_compiling() and x.device.type == "cpu" and codes.device.type == "cpu"
            and x.dtype == torch.float32 and not (torch.is_grad_enabled() and x.requires_grad) and available())


def quant_write(x: torch.Tensor, channel: torch.Tensor | None, bits: int, group_size: int, start: int,
                codes: torch.Tensor, scale: torch.Tensor) -> bool:
    """:func:`reference` through the C++ op where it applies (:func:`applies`), else through the twin."""
    if applies(x, codes):
        return torch.ops.kvslim.quant_write(x, channel, int(bits), int(group_size), int(start), codes, scale)
    return reference(x, channel, bits, group_size, start, codes, scale)
