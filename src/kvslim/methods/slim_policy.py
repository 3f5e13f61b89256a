"""Per-layer numerics of slim attention: build each candidate cache's maps in float64, measure its rebuilding
error on calibration activations in the model's dtype, and choose the smallest cache within the budget.

Error metric: relative Frobenius error against float64 of the tensor a technique rebuilds (V for K-caches,
K for the V-cache, both for X and plain K+V), after the storage the cache really does (dtype rounding,
int8/int4). The budget compares it with the plain K+V cache's own error in the same dtype:
``error ≤ max(budget · plain_error, floor)``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch

from ..attention.slim import SlimLayerWeights
from ..caches.spec import StoreSpec
from ..ops.quant import dequantize, quantize
from ..ops.rope import rotate, unrotate
from ..ops.weights import (
    activation_stats,
    column_rms,
    cond,
    conditioned_basis,
    coordinate_rms,
    reconstruction_map,
)

F64 = torch.float64


class PolicyFields(Protocol):
    """What :func:`choose` reads from a method's options."""

    cache: str
    budget: float
    rank: int | None
    basis: str
    bits: int
    group_size: int


@dataclass(frozen=True)
class Policy:
    """The policy fields alone (encoder-decoder slim, whose options have no int8/int4 rows)."""

    cache: str = "auto"
    budget: float = 2.0
    rank: int | None = None
    basis: str = "svd"
    bits: int = 0
    group_size: int = 8


@dataclass
class Candidate:
    """One measured option for a layer."""

    technique: str  # "k", "v", "x", "kv"
    rank: int
    width: int  # cached values per token (kv: 2e)
    error: float
    plain_error: float
    weights: SlimLayerWeights | None = None

    @property
    def ratio(self) -> float:
        return self.error / max(self.plain_error, 1e-300)

    @property
    def label(self) -> str:
        if self.technique == "kv":
            return "kv"
        return f"slim-{self.technique}" + (f"+r{self.rank}" if self.rank else "")


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm().clamp_min(1e-300))


def _store(rows: torch.Tensor, dtype: torch.dtype, spec: StoreSpec) -> torch.Tensor:
    """``rows`` as a cache of ``spec`` would read them back, as fp32."""
    rows = rows.to(dtype)
    if spec.bits:
        codes, scale = quantize(rows, spec.bits, spec.group_size, spec.scale_dtype)
        rows = dequantize(codes, scale, spec.bits, spec.group_size, dtype)
    return rows.float()


class LayerNumerics:
    """Float64 algebra and error measurement for one layer.

    Args:
        pw: the layer's :class:`~kvslim.adapters.llama.ProjectionWeights`.
        x: (N, d) calibration inputs of the attention in the model dtype.
        num_heads, head_dim: h, dk.
        rope: (cos, sin) of the N calibration positions in the model dtype, or ``None`` without RoPE.
        spec: storage of the cache rows (plain or quantized).
    """

    def __init__(self, pw, x: torch.Tensor, num_heads: int, head_dim: int, rope, spec: StoreSpec,
                 rope_storage: str = "raw", decode: str = "option2"):
        self.dtype, self.spec, self.rope, self.rope_storage, self.decode = x.dtype, spec, rope, rope_storage, decode
        self.h, self.dk = num_heads, head_dim
        self.x = x
        def z64(t):
            return None if t is None else t.detach().double().cpu()

        self.wk, self.wv, self.wo = z64(pw.w_k), z64(pw.w_v), z64(pw.w_o)
        self.bk, self.bv, self.bo = z64(pw.b_k), z64(pw.b_v), z64(pw.b_o)
        self.d, self.e = self.wk.shape
        x64 = x.double().cpu()
        self.k64 = x64 @ self.wk + (0 if self.bk is None else self.bk)
        self.v64 = x64 @ self.wv + (0 if self.bv is None else self.bv)
        # the plain cache: K and V computed in the model dtype, stored
        xd = x.cpu()
        kd = xd @ pw.w_k.detach().cpu() + (0 if pw.b_k is None else pw.b_k.detach().cpu())
        vd = xd @ pw.w_v.detach().cpu() + (0 if pw.b_v is None else pw.b_v.detach().cpu())
        self.k_plain, self.v_plain = _store(kd, self.dtype, spec), _store(vd, self.dtype, spec)
        self.plain_k_err, self.plain_v_err = _rel(self.k_plain, self.k64), _rel(self.v_plain, self.v64)
        self.cond_k, self.cond_v = cond(self.wk), cond(self.wv)
        self.sigma = activation_stats(x64)
        self.k_rms = column_rms(x64, self.wk, self.bk)
        self._basis_cache: dict = {}

    # -- weights ---------------------------------------------------------------------------------------------
    def _out_bias(self, c_v: torch.Tensor | None) -> torch.Tensor | None:
        if c_v is None and self.bo is None:
            return None
        b = torch.zeros(self.wo.shape[1], dtype=F64) if self.bo is None else self.bo.clone()
        if c_v is not None:
            b = b + c_v @ self.wo
        return b.float()

    def _per_head(self, m: torch.Tensor) -> torch.Tensor:
        """(c, e) -> (h, c, dk) fp32."""
        return m.reshape(m.shape[0], self.h, self.dk).permute(1, 0, 2).contiguous().float()

    def basis(self, r: int, kind: str) -> torch.Tensor:
        key = kind
        if key not in self._basis_cache:
            self._basis_cache[key] = conditioned_basis(self.wk, self.d, kind, self.sigma, self.k_rms, self.wv)
        full = self._basis_cache[key]  # all d directions, least-represented last
        return full[:, self.d - r:]

    def k_weights(self, r: int = 0, basis: str = "svd"):
        if self.e < self.d:
            raise ValueError(f"K has {self.e} < d={self.d} values per token and cannot rebuild V")
        if r:
            p = self.basis(r, basis)
            src = torch.cat((self.wk, p), dim=1)
            scale = torch.cat((self.k_rms, coordinate_rms(self.sigma, p)))
            m = reconstruction_map(src, self.wv, scale)
        else:
            p, m = None, reconstruction_map(self.wk, self.wv, self.k_rms if self.e > self.d else None)
        c_v = None
        if self.bv is not None or self.bk is not None:
            c_v = (torch.zeros(self.e, dtype=F64) if self.bv is None else self.bv.clone())
            if self.bk is not None:
                c_v = c_v - self.bk @ m[:self.e]
        return SlimLayerWeights("k", self.h, self.dk, self.e + r, value_map=self._per_head(m),
                                value_map_full=m.float(), proj=None if p is None else p.float(),
                                out_bias=self._out_bias(c_v), rope=self.rope is not None,
                                rope_storage=self.rope_storage, decode=self.decode), m, c_v

    def v_weights(self):
        if self.rope is not None:
            raise ValueError("the V-cache rebuilds K, which RoPE rotates by position: not with RoPE")
        m = reconstruction_map(self.wv, self.wk)  # W_VK = W_V⁻¹ W_K
        c_k = None
        if self.bk is not None or self.bv is not None:
            c_k = (torch.zeros(self.e, dtype=F64) if self.bk is None else self.bk.clone())
            if self.bv is not None:
                c_k = c_k - self.bv @ m
        return SlimLayerWeights("v", self.h, self.dk, self.e, score_map=self._per_head(m),
                                out_bias=self._out_bias(None), decode=self.decode), m, c_k

    def x_weights(self):
        if self.rope is not None:
            raise ValueError("the X-cache needs keys without RoPE")
        return SlimLayerWeights("x", self.h, self.dk, self.d, value_map=self._per_head(self.wv),
                                value_map_full=self.wv.float(), score_map=self._per_head(self.wk),
                                out_bias=self._out_bias(self.bv), decode=self.decode)

    # -- measurement -----------------------------------------------------------------------------------------
    def measure_k(self, r: int = 0, basis: str = "svd") -> Candidate:
        w, m, c_v = self.k_weights(r, basis)
        keys = self.k_plain  # (N, e) as stored, fp32
        if self.rope is not None and self.rope_storage == "rotated":  # stored rotated, un-rotated in fp32
            cos, sin = self.rope
            kd = self.k_plain.to(self.dtype).view(-1, self.h, self.dk).transpose(0, 1)  # (h, N, dk)
            stored = _store(rotate(kd, cos, sin).transpose(0, 1).reshape(-1, self.e), self.dtype, self.spec)
            keys = unrotate(stored.view(-1, self.h, self.dk).transpose(0, 1), cos.float(), sin.float())
            keys = keys.transpose(0, 1).reshape(-1, self.e)
        if r:  # z = x·P computed in fp32 from the layer input, stored like the keys
            keys = torch.cat((keys, _store(self.x.float().cpu() @ w.proj, self.dtype, self.spec)), dim=1)
        v_hat = keys.double() @ m.float().double() + (0 if c_v is None else c_v)
        v_hat = v_hat.float().to(self.dtype)  # the head outputs are rounded to the model dtype
        return Candidate("k", r, self.e + r, _rel(v_hat, self.v64), self.plain_v_err, w)

    def measure_v(self) -> Candidate:
        w, m, c_k = self.v_weights()
        k_hat = (self.v_plain.double() @ m.float().double() + (0 if c_k is None else c_k)).float()
        return Candidate("v", 0, self.e, _rel(k_hat, self.k64), self.plain_k_err, w)

    def measure_x(self) -> Candidate:
        w = self.x_weights()
        xs = _store(self.x, self.dtype, self.spec)
        k_hat = (xs.float() @ self.wk.float() + (0 if self.bk is None else self.bk.float())).to(self.dtype)
        v_hat = (xs.float() @ self.wv.float() + (0 if self.bv is None else self.bv.float())).to(self.dtype)
        ratio = max(_rel(k_hat, self.k64) / max(self.plain_k_err, 1e-300),
                    _rel(v_hat, self.v64) / max(self.plain_v_err, 1e-300))
        plain = max(self.plain_k_err, self.plain_v_err)
        return Candidate("x", 0, self.d, ratio * plain, plain, w)

    def plain(self) -> Candidate:
        plain = max(self.plain_k_err, self.plain_v_err)
        return Candidate("kv", 0, 2 * self.e, plain, plain, None)


def rank_ladder(e: int, d: int, multiple: int) -> list[int]:
    """Extra-coordinate counts to try, smallest first: r < e (else K+V is as small) and r ≤ d."""
    base = [8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512, 640, 768, 1024]
    out = sorted({-(-r // multiple) * multiple for r in base})
    return [r for r in out if 0 < r < e and r <= d]


def check_policy_fields(opts) -> None:
    """Validate the fields the decoder-only and encoder-decoder slim options share (``ValueError`` naming one)."""
    if not isinstance(opts.budget, (int, float)) or opts.budget < 1:
        raise ValueError(f"budget must be a number ≥ 1 (a multiple of the plain error), got {opts.budget!r}")
    if opts.floor is not None and (not isinstance(opts.floor, (int, float)) or opts.floor < 0):
        raise ValueError(f"floor must be a non-negative number, got {opts.floor!r}")
    if opts.rank is not None and (not isinstance(opts.rank, int) or isinstance(opts.rank, bool) or opts.rank < 0):
        raise ValueError(f"rank must be a non-negative int or None, got {opts.rank!r}")
    if not isinstance(opts.max_calibration_tokens, int) or opts.max_calibration_tokens < 8:
        raise ValueError(f"max_calibration_tokens must be an int ≥ 8, got {opts.max_calibration_tokens!r}")
    if not isinstance(opts.chunk, int) or opts.chunk <= 0:
        raise ValueError(f"chunk must be a positive int, got {opts.chunk!r}")


def choose(num: LayerNumerics, opts: PolicyFields, floor: float, rope: bool) -> tuple[Candidate, bool]:
    """The layer's choice and whether it is within the budget.

    Args:
        num: the layer's measurements.
        opts: the policy fields (``SlimOptions``, or :class:`Policy` for encoder-decoders).
        floor: relative error always accepted.
        rope: the layer has RoPE on K (no X-/V-cache then).
    """

    def ok(c: Candidate) -> bool:
        return c.error <= max(opts.budget * c.plain_error, floor)

    multiple = opts.group_size if opts.bits else 8
    if opts.cache == "kv":
        return num.plain(), True
    if opts.cache == "x":
        c = num.measure_x()
        return c, ok(c)
    if opts.cache == "v":
        c = num.measure_v()
        return c, ok(c)
    first = []
    if opts.cache == "auto" and not rope:
        first = [num.measure_x()]
        if num.e == num.d:
            first.append(num.measure_v())
    if num.e >= num.d:
        first.append(num.measure_k(opts.rank or 0, opts.basis))
    first.sort(key=lambda c: (c.width, c.ratio))
    for c in first:
        if ok(c):
            return c, True
    if opts.cache == "k" and (opts.rank is not None or num.e < num.d):
        c = first[-1]
        return c, ok(c)
    if opts.rank is None and num.e >= num.d:  # smallest r within budget (error falls with r: bisect)
        ladder, best = rank_ladder(num.e, num.d, multiple), None
        lo, hi = 0, len(ladder) - 1
        while lo <= hi:
            mid = (lo + hi) // 2
            c = num.measure_k(ladder[mid], opts.basis)
            if ok(c):
                best, hi = c, mid - 1
            else:
                lo = mid + 1
        if best is not None:
            return best, True
    if opts.cache == "k":  # forced: best K-cache found, over budget
        return min((c for c in first if c.technique == "k"), key=lambda c: c.error), False
    return num.plain(), True


def weights_to_device(w: SlimLayerWeights, dev: torch.device) -> SlimLayerWeights:
    """``w`` with its tensors moved to ``dev``."""
    moved = {f: getattr(w, f).to(dev) for f in ("value_map", "value_map_full", "score_map", "proj", "out_bias")
             if getattr(w, f) is not None}
    return replace(w, **moved)
