"""The one table of tolerances, keyed by dtype, and the error-ratio rule for half precision (STYLE §7)."""

from __future__ import annotations

import torch

#: max |Δ| allowed between an exact kvslim path and its reference, per dtype
ATOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}
#: max |Δ| / max(1, max|reference|) between two exact fp32 paths that only reorder the same arithmetic
RTOL = {torch.float64: 1e-12, torch.float32: 1e-5}
#: end-to-end logits against the same HF model with its ordinary cache (issue contracts: fp32 ≤ 1e-4)
LOGIT_ATOL = {torch.float32: 1e-4}
#: int8 codes written by a compiled decode step against eager's (tests/test_capturable_ring.py): HF's traced code
#: paths leave fp32 activations a last bit off eager's (~1e-7), which can move one int8 code of a token by one step;
#: that token then shifts the logits while it stays in the window (measured ≤ 1.0e-4 on the tiny models, fp32;
#: 3.4e-4 for a value code of a full Gemma-3 layer, 1.9e-5 of a step from its rounding boundary: docs/gpu.md)
CAPTURED_CODES_LOGIT_ATOL = 5e-4
#: absolute floor added to the error-ratio rule so that exact-zero baselines do not demand exact zero
RATIO_FLOOR = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
#: the error-ratio factor: optimized error ≤ FACTOR · baseline error (same dtype) + floor
RATIO_FACTOR = 2.0
#: bf16 generation against HF's bf16 model (Whisper/T5 with slim after ``model.to(torch.bfloat16)``): fraction of
#: equal greedy tokens, position by position (tests/test_whisper_generate.py, docs/encdec.md)
BF16_TOKEN_AGREEMENT = 0.75


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    err = max_err(actual, expected)
    assert err <= ATOL[dtype], f"{what}: max|Δ| {err:.3e} > {ATOL[dtype]:.1e} ({dtype})"


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    """``max|Δ| ≤ RTOL[dtype] · max(1, max|expected|)``: for paths that differ only in summation order."""
    bound = RTOL[dtype] * max(1.0, expected.double().abs().max().item())
    err = max_err(actual, expected)
    assert err <= bound, f"{what}: max|Δ| {err:.3e} > {bound:.1e} ({dtype})"


def assert_error_ratio(optimized: torch.Tensor, baseline: torch.Tensor, reference64: torch.Tensor,
                       dtype: torch.dtype, what: str = "") -> None:
    """``max|opt − ref64| ≤ 2·max|baseline − ref64| + floor`` (baseline: the plain path in the same dtype)."""
    e_opt, e_base = max_err(optimized, reference64), max_err(baseline, reference64)
    bound = RATIO_FACTOR * e_base + RATIO_FLOOR[dtype]
    assert e_opt <= bound, f"{what}: error {e_opt:.3e} > {RATIO_FACTOR}×{e_base:.3e} + floor ({dtype})"


#: documented loss of the lossy cache methods end to end on the tiny random test models of
#: tests/test_compat_matrix.py (fp32; int4 with its window scaled to them): max |Δlogit| against the same HF
#: model with its ordinary cache on the same tokens (measured: int8 ≤ 1.3e-3, int4 ≤ 2.4e-2; docs/compat.md)
LOSSY_LOGIT_ATOL = {"int8": 1e-2, "int4": 1e-1}
#: the fused int8/int4 decode op's ``scores="int8"`` path (query rounded to int8 per 32-channel block, integer
#: products; kernels/quant_decode.py) against the float64 oracle of the exact path: max |Δ| of the attention output on
#: the tests' random codes (q ~ N(0, 1), keys ~ N(0, 4) quantized; measured ≤ 0.08), and of a tiny random Llama's
#: decode logits against the unfused path (tests/test_quant_decode.py)
INT8_SCORES_ATOL = 0.15
INT8_SCORES_LOGIT_ATOL = 5e-2
#: ``values="int8"`` (softmax weight × value scale rounded to uint8 per 16-token sub-block): the op rounds the online
#: softmax's unnormalised weights, the twin the normalised ones; the rounding is scale-invariant except that a weight
#: within float rounding of a tie may round the other way (one weight step, ≤ max w / 127 of its sub-block)
INT8_VALUES_TWIN_ATOL = 2e-2
#: the one-pass protocol (kvslim.evaluate_parallel) against the call-by-call one on a float64 model: same codes,
#: only summation order and HF's float32 RoPE tables differ (relative, on perplexity / KL; absolute on Δlogit)
PROTOCOL_ONE_PASS_RTOL = 1e-4
PROTOCOL_ONE_PASS_ATOL = 1e-4
