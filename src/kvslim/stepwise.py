"""The token protocol step by step (issue 29): per scored step, each cache's NLL beside the reference's, KL, top-1
agreement and the bytes the cache holds, so that Δppl gets a paired-bootstrap confidence interval and bytes are
counted the same way for every cache (kvslim or HF/quanto, full-precision window included).

:func:`compare_steps` makes the same forward calls as :func:`kvslim.evaluate.compare_caches` in ``"token"`` mode
(prefill ``T − steps − 1`` tokens, then ``steps`` single-token calls, each scored) and reports the same
summary figures, plus :func:`bootstrap_ci` over the per-step NLL differences.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .adapters.compat import CACHE_KW
from .evaluate import cache_nbytes, check_protocol_ids, protocol_segments


def bootstrap_ci(values: torch.Tensor, resamples: int = 1000, level: float = 0.95, seed: int = 0
                 ) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of the mean of ``values`` (n,): ``resamples`` draws of n values with
    replacement (a fixed ``seed``), the ``(1 − level)/2`` and ``(1 + level)/2`` quantiles of their means.

    Paired: pass per-step differences (cache NLL − reference NLL), so both sides of each step stay together.
    """
    if not isinstance(values, torch.Tensor) or values.dim() != 1 or values.numel() < 2:
        raise ValueError(f"values must be a 1-D tensor of at least 2 values, got "
                         f"{tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__}")
    if not isinstance(resamples, int) or isinstance(resamples, bool) or resamples < 10:
        raise ValueError(f"resamples must be an int >= 10, got {resamples!r}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    x = values.detach().to(torch.float64).cpu()
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, x.numel(), (resamples, x.numel()), generator=g)  # (resamples, n)
    means = x[idx].mean(1)
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    lo, hi = torch.quantile(means, q).tolist()
    return lo, hi


@dataclass
class StepQuality:
    """One cache against the reference, step by step (token protocol): tensors of length ``steps``."""

    label: str
    nll: torch.Tensor  # (steps,) float64: −log p(target) under this cache
    ref_nll: torch.Tensor  # (steps,) float64: the same under the reference
    kl: torch.Tensor  # (steps,) float64: KL(reference ‖ cache), nats
    top1: torch.Tensor  # (steps,) bool: argmax equals the reference's
    max_dlogit: float
    nbytes: torch.Tensor  # (steps,) int64: bytes the cache holds after each scored call, measured from tensors
    held: torch.Tensor  # (steps,) int64: tokens in the cache after each scored call
    seconds: float = 0.0

    @property
    def ppl(self) -> float:
        return math.exp(self.nll.mean().item())

    @property
    def ref_ppl(self) -> float:
        return math.exp(self.ref_nll.mean().item())

    @property
    def delta_ppl(self) -> float:
        """ppl / ref_ppl − 1 = exp(mean(nll − ref_nll)) − 1."""
        return math.expm1((self.nll - self.ref_nll).mean().item())

    def delta_ppl_ci(self, resamples: int = 1000, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
        """Paired-bootstrap interval of :attr:`delta_ppl` (over the per-step NLL differences)."""
        lo, hi = bootstrap_ci(self.nll - self.ref_nll, resamples, level, seed)
        return math.expm1(lo), math.expm1(hi)

    @property
    def bytes_end(self) -> int:
        return int(self.nbytes[-1])

    @property
    def bytes_per_token_end(self) -> float:
        return self.bytes_end / int(self.held[-1])

    @property
    def bytes_per_token_avg(self) -> float:
        """Mean over the scored steps of (bytes held / tokens held): a buffer that fills and flushes (quanto's
        residual, kvslim's window) counts at every phase of its cycle."""
        return (self.nbytes.double() / self.held.double()).mean().item()

    def to_dict(self, resamples: int = 1000, seed: int = 0) -> dict:
        lo, hi = self.delta_ppl_ci(resamples, seed=seed)
        return {"label": self.label, "steps": int(self.nll.numel()), "ppl": self.ppl, "ref_ppl": self.ref_ppl,
                "delta_ppl": self.delta_ppl, "delta_ppl_ci95": [lo, hi], "kl": self.kl.mean().item(),
                "top1": self.top1.double().mean().item(), "max_dlogit": self.max_dlogit,
                "tokens_end": int(self.held[-1]), "bytes_end": self.bytes_end,
                "bytes_per_token_end": self.bytes_per_token_end, "bytes_per_token_avg": self.bytes_per_token_avg,
                "bytes_avg": self.nbytes.double().mean().item(), "seconds": self.seconds}


@torch.inference_mode()
def compare_steps(model, ids: torch.Tensor, caches: dict[str, Callable[[], object]], *, steps: int = 512,
                  reference: Callable[[], object] | None = None, min_tokens: int | None = None,
                  measure: Callable[[object], int] = cache_nbytes, progress: bool = False) -> dict[str, StepQuality]:
    """Feed ``ids`` (1, T) through a reference cache and each of ``caches`` in lockstep: a prefill of
    ``T − steps − 1`` tokens, then ``steps`` single-token calls, each one scored against the next token.

    Args:
        model: a causal LM (one model for all caches: storage-only caches).
        ids: (1, T) token ids of real text.
        caches: label -> a function building a fresh cache.
        steps: single-token calls scored.
        reference: builds the reference cache (default ``transformers.DynamicCache``).
        measure: bytes a cache holds (default :func:`kvslim.evaluate.cache_nbytes`), called after every scored
            call.
    Returns:
        label -> :class:`StepQuality`.
    """
    from transformers import DynamicCache

    total = check_protocol_ids(ids, min_tokens)
    if not caches:
        raise ValueError("caches must name at least one cache")
    segments, _ = protocol_segments(total, "token", steps=steps)
    ref_cache = (reference or DynamicCache)()
    built = {label: make() for label, make in caches.items()}
    n = len(segments) - 1
    f64 = dict(dtype=torch.float64)
    rec = {label: dict(nll=torch.zeros(n, **f64), kl=torch.zeros(n, **f64), top1=torch.zeros(n, dtype=torch.bool),
                       nbytes=torch.zeros(n, dtype=torch.int64), maxd=0.0, s=0.0) for label in built}
    ref_nll = torch.zeros(n, **f64)
    held = torch.zeros(n, dtype=torch.int64)
    for i, (a, b) in enumerate(segments):
        piece = ids[:, a:b]
        ref = model(piece, use_cache=True, **{CACHE_KW: ref_cache}, logits_to_keep=1).logits[0, -1].float()  # (V,)
        j = i - 1  # the scored step (the prefill, i = 0, predicts the first target's predecessor only)
        if j >= 0:
            tgt = ids[0, b]
            ref_lp = torch.log_softmax(ref, -1)
            ref_nll[j] = -ref_lp[tgt].double()
            held[j] = b
        for label, cache in built.items():
            t0 = time.perf_counter()
            out = model(piece, use_cache=True, **{CACHE_KW: cache}, logits_to_keep=1).logits[0, -1].float()
            r = rec[label]
            r["s"] += time.perf_counter() - t0
            if j < 0:
                continue
            lp = torch.log_softmax(out, -1)
            r["nll"][j] = -lp[tgt].double()
            r["kl"][j] = (ref_lp.exp() * (ref_lp - lp)).sum().double()
            r["top1"][j] = out.argmax() == ref.argmax()
            r["maxd"] = max(r["maxd"], (out - ref).abs().max().item())
            r["nbytes"][j] = measure(cache)
        if progress and i % 128 == 0:
            print(f"  token: call {i}/{len(segments)}", flush=True)
    return {label: StepQuality(label, r["nll"], ref_nll.clone(), r["kl"], r["top1"], r["maxd"], r["nbytes"],
                               held.clone(), r["s"]) for label, r in rec.items()}


def layer_nbytes(ls, tokens: int, heads: int, dim: int, dtype: torch.dtype, batch: int = 1) -> int:
    """Bytes one layer's cache holds after ``tokens`` appended tokens, from its specs (``evaluate_parallel.LayerSpec``):
    coded rows, the sinks and the full-precision window in ``dtype``, and key smoothing's fp32 factors. Rings
    count what they keep (the last W − 1 rows; or the window plus the ring's coded slots in use). Equals
    :func:`kvslim.evaluate.cache_nbytes` of the cache built from the same specs (``tests/test_stepwise.py``)."""
    total = 0
    for spec in (ls.key, ls.value):
        plain = dim * dtype.itemsize
        row = spec.bytes_per_value_row(dim, dtype) if spec.bits else plain
        if not (spec.bits and spec.residual):  # every token coded (or plain); a ring keeps its last W − 1
            coded = tokens if ls.window is None else min(tokens, ls.window - 1)
            total += row * coded
        else:  # sinks and the window in full precision, the rest coded (a ring: its coded slots in use)
            flushed, sinks = spec.flushed(tokens), min(tokens, spec.sink)
            coded = flushed - sinks if ls.window is None else min(flushed - sinks, ls.ring_slots)
            total += coded * row + (tokens - flushed + sinks) * plain
        if spec.bits and coded:  # key smoothing's fp32 factors, a turbo store's outlier permutation
            total += spec.fixed_bytes(dim)
    return total * batch * heads


@torch.inference_mode()
def compare_specs_steps(model, ids: torch.Tensor, specs: dict[str, object], *, steps: int = 512,
                        block: int = 256) -> dict[str, StepQuality]:
    """:func:`compare_steps` for caches given by per-layer specs (``kvslim.evaluate_parallel``), each in one
    forward pass instead of ``steps`` calls: the token protocol's per-step NLL, KL and top-1 against the dense
    model, and the bytes the cache would hold after each scored call (:func:`layer_nbytes`). Equal to the
    call-by-call figures up to float rounding (``tests/test_stepwise.py``)."""
    from .evaluate_parallel import _checked, check_block, protocol_hidden, score_positions

    check_block(block)
    total = check_protocol_ids(ids, None)
    if not specs:
        raise ValueError("specs must name at least one configuration")
    cfg = model.config
    checked = {label: _checked(s, cfg.num_hidden_layers) for label, s in specs.items()}
    segments, first = protocol_segments(total, "token", steps=steps)
    fed = segments[-1][1]
    positions = torch.arange(first - 1, min(fed, total - 1))  # position p predicts token p + 1
    targets = ids[0, positions + 1]
    held = positions + 1  # tokens in the cache after the call that fed position p
    ids = ids[:, :fed]
    ref_hidden, _ = protocol_hidden(model, ids, None, segments)
    heads = cfg.num_key_value_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype = next(model.parameters()).dtype
    out = {}
    for label, layer_specs in checked.items():
        t0 = time.perf_counter()
        hidden, _ = protocol_hidden(model, ids, layer_specs, segments)
        nll, ref_nll, kl, top1, maxd = score_positions(model, ref_hidden, hidden, positions, targets, block)
        nbytes = torch.tensor([sum(layer_nbytes(ls, int(h), heads, dim, dtype) for ls in layer_specs)
                               for h in held.tolist()], dtype=torch.int64)
        out[label] = StepQuality(label, nll, ref_nll, kl, top1, maxd, nbytes, held.clone(),
                                 time.perf_counter() - t0)
    return out
