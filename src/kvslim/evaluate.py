"""Quality and speed measurements shared by ``kvslim demo``, ``kvslim bench``, the benchmarks and the tests.

* :func:`greedy_decode`, :func:`chunked_perplexity`, :func:`chunked_eval`: the demo's helpers.
* The quality protocol of docs/quantization.md, on real long text (:func:`text_ids`: Botchan, shipped):
  :func:`compare_caches` feeds one text through a reference cache (dense) and any number of candidate caches in
  lockstep and reports, over the same scored tokens, perplexity, mean KL divergence from the reference,
  teacher-forced top-1 agreement, max |Δlogit| and bytes per token measured from the cache tensors. Two modes:
  ``"chunked"`` (prefill 512, then 64-token chunks) and ``"token"`` (single-token steps over the last tokens,
  what decoding does). :func:`greedy_agreement` compares free-running greedy continuations.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import resources

import torch

from .adapters.compat import CACHE_KW


@dataclass
class DecodeRun:
    """A greedy decode: new ``tokens`` (B, N), per-step ``logits`` (N, B, V) in fp32, timings, the cache."""

    tokens: torch.Tensor
    logits: torch.Tensor
    prefill_s: float
    decode_s: float
    cache: object

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.tokens.shape[1] - 1
        return self.tokens.shape[0] * steps / self.decode_s if self.decode_s > 0 else float("nan")


@torch.inference_mode()
def greedy_decode(model, ids: torch.Tensor, new_tokens: int, cache, attention_mask=None,
                  forced: torch.Tensor | None = None) -> DecodeRun:
    """Prefill ``ids`` (B, P) into ``cache`` then decode ``new_tokens`` greedily, one token per step.

    With ``forced`` (B, N) the inputs are teacher-forced (so logits of two caches compare position by
    position); the returned tokens are still each step's argmax.
    """
    if new_tokens <= 0:
        raise ValueError(f"new_tokens must be a positive int, got {new_tokens}")
    mask = attention_mask if attention_mask is not None else torch.ones_like(ids)
    pos = (mask.long().cumsum(-1) - 1).clamp_min(0)
    t0 = time.perf_counter()
    out = model(ids, attention_mask=mask, position_ids=pos, use_cache=True, **{CACHE_KW: cache})
    t1 = time.perf_counter()
    logits, tokens = [out.logits[:, -1].float()], [out.logits[:, -1].argmax(-1)]
    next_pos = pos[:, -1:] + 1
    for i in range(new_tokens - 1):
        inp = (forced[:, i] if forced is not None else tokens[-1])[:, None]
        mask = torch.cat((mask, torch.ones_like(inp)), dim=1)
        out = model(inp, attention_mask=mask, position_ids=next_pos, use_cache=True, **{CACHE_KW: cache})
        next_pos = next_pos + 1
        logits.append(out.logits[:, -1].float())
        tokens.append(logits[-1].argmax(-1))
    t2 = time.perf_counter()
    return DecodeRun(torch.stack(tokens, 1), torch.stack(logits), t1 - t0, t2 - t1, cache)


@torch.inference_mode()
def chunked_perplexity(model, ids: torch.Tensor, make_cache, chunk: int = 32) -> float:
    """Perplexity of ``ids`` (1, T) fed in chunks through a fresh cache, so the cached (possibly quantized or
    windowed) history is what later chunks attend to."""
    nll, count = 0.0, 0
    for lp, targets in _chunk_log_probs(model, ids, make_cache, chunk):
        nll -= lp.gather(-1, targets[:, None]).sum().item()
        count += targets.numel()
    return math.exp(nll / count)


@torch.inference_mode()
def chunked_eval(model, ids: torch.Tensor, make_cache, chunk: int = 32) -> tuple[float, torch.Tensor]:
    """:func:`chunked_perplexity` and the logits it scored: ``(perplexity, logits (T - 1, V) float32)``, row ``t``
    predicting token ``t + 1``; two caches fed the same ``ids`` compare logit by logit (teacher-forced). Holds all
    T × V logits: for short texts (the demo's)."""
    nll, rows = 0.0, []
    for lp, targets in _chunk_log_probs(model, ids, make_cache, chunk, logits=rows):
        nll -= lp.gather(-1, targets[:, None]).sum().item()
    logits = torch.cat(rows)
    return math.exp(nll / logits.shape[0]), logits


def _chunk_log_probs(model, ids: torch.Tensor, make_cache, chunk: int, logits: list | None = None):
    """Yield ``(log-probs (n, V), targets (n,))`` of ``ids`` (1, T) fed ``chunk`` tokens at a time through one fresh
    cache: every position but the last predicts the next token (a chunk's first token from the previous chunk's
    last position). With ``logits`` (a list), each scored row's fp32 logits are appended to it in order."""
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 2:
        raise ValueError(f"ids must be (1, T) with T >= 2, got {tuple(ids.shape)}")
    cache = make_cache()
    prev_last = None
    for start in range(0, ids.shape[1], chunk):
        piece = ids[:, start:start + chunk]
        out = model(piece, use_cache=True, **{CACHE_KW: cache}).logits[0].float()  # (n, V)
        rows = out[:-1] if prev_last is None else torch.cat((prev_last, out[:-1]))
        targets = piece[0, 1:] if prev_last is None else piece[0]
        if logits is not None:
            logits.append(rows)
        yield torch.log_softmax(rows, -1), targets
        prev_last = out[-1:]


# ----------------------------------------------------------------------------------------------------------------
# The quality protocol (issue 11, docs/quantization.md)

TEXTS = {"botchan": "data/botchan.txt"}  # shipped public-domain texts; first line names source and licence


def load_text(name: str = "botchan") -> str:
    """A shipped long text without its source line (``TEXTS``)."""
    if name not in TEXTS:
        raise ValueError(f"name must be one of {sorted(TEXTS)}, got {name!r}")
    text = resources.files("kvslim").joinpath(TEXTS[name]).read_text()
    return text.split("\n", 1)[1]


def text_ids(tokenizer, tokens: int, name: str = "botchan") -> torch.Tensor:
    """The first ``tokens`` tokens of a shipped text as (1, tokens) ids; ``ValueError`` (with the length) when
    the text is shorter."""
    ids = tokenizer(load_text(name), return_tensors="pt").input_ids
    if ids.shape[1] < tokens:
        raise ValueError(f"tokens={tokens} exceeds the {ids.shape[1]} tokens of text {name!r}")
    return ids[:, :tokens]


@dataclass
class Quality:
    """One cache against the reference over the same scored tokens (``mode``: ``"chunked"`` or ``"token"``)."""

    label: str
    mode: str
    tokens: int  # tokens fed in all (the cache's context at the end: the last text token is only a target
    #              in token mode)
    scored: int  # predictions scored
    ppl: float
    ref_ppl: float
    kl: float  # mean KL(reference ‖ cache) over scored predictions, nats
    top1: float  # fraction of scored predictions whose argmax equals the reference's
    max_dlogit: float  # max |logit − reference logit| over scored predictions
    nbytes: int  # bytes the cache holds after all tokens, measured from its tensors
    seconds: float = 0.0  # model time of this cache's forward passes

    @property
    def delta_ppl(self) -> float:
        """Relative perplexity change against the reference (0.01 = +1 %)."""
        return self.ppl / self.ref_ppl - 1.0

    @property
    def bytes_per_token(self) -> float:
        return self.nbytes / self.tokens

    def to_dict(self) -> dict:
        return {**asdict(self), "delta_ppl": self.delta_ppl, "bytes_per_token": self.bytes_per_token}


def protocol_segments(total: int, mode: str, prefill: int = 512, chunk: int = 64, steps: int = 1024
                      ) -> tuple[list[tuple[int, int]], int]:
    """The forward calls of a protocol over ``total`` tokens: ``([(start, end), ...], first scored target)``.

    ``"chunked"``: prefill ``[0, prefill)``, then ``chunk``-token calls; targets ``prefill .. total-1``.
    ``"token"``: prefill ``[0, total-steps-1)``, then ``steps`` single-token calls; targets the last ``steps``.
    Every scored prediction of ``"token"`` comes from a single-token call. ``ValueError`` names the argument.
    """
    if mode not in ("chunked", "token"):
        raise ValueError(f"mode must be 'chunked' or 'token', got {mode!r}")
    for name, v in (("prefill", prefill), ("chunk", chunk), ("steps", steps), ("total", total)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if mode == "chunked":
        if total < prefill + chunk:
            raise ValueError(f"text of {total} tokens is shorter than prefill {prefill} + one chunk of {chunk}")
        cuts = [(0, prefill)] + [(a, min(a + chunk, total)) for a in range(prefill, total, chunk)]
        return cuts, prefill
    if total < steps + 2:
        raise ValueError(f"text of {total} tokens is shorter than steps {steps} + 2")
    first = total - steps
    return [(0, first - 1)] + [(t, t + 1) for t in range(first - 1, total - 1)], first


def check_protocol_ids(ids: torch.Tensor, min_tokens: int | None) -> int:
    """Length T of ``ids`` (1, T), refused by name when the shape is wrong or T < ``min_tokens``."""
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"ids must be (1, T), got {tuple(ids.shape)}")
    total = ids.shape[1]
    if min_tokens is not None and total < min_tokens:
        raise ValueError(f"ids has {total} tokens; the protocol needs at least min_tokens={min_tokens}")
    return total


@torch.inference_mode()
def compare_caches(model, ids: torch.Tensor, caches: dict[str, Callable[[], object]], *, mode: str = "token",
                   min_tokens: int | None = None, prefill: int = 512, chunk: int = 64, steps: int = 1024,
                   reference: Callable[[], object] | None = None, progress: bool = False) -> dict[str, Quality]:
    """Feed ``ids`` (1, T) through a reference cache and each of ``caches`` in lockstep (same calls, one cache
    after the other at every call) and compare the scored predictions with the reference's.

    Args:
        model: a causal LM whose forward takes a cache (``cache=``; ``past_key_values=`` before transformers
            5.24); one model for all caches: storage-only caches, or caches that need no attention change.
        ids: (1, T) token ids of real text.
        caches: label -> a function building a fresh cache for that label.
        mode: ``"token"`` or ``"chunked"`` (see :func:`protocol_segments`).
        min_tokens: refuse (``ValueError`` with the text's length) a text shorter than this (protocol: 4,096).
        reference: builds the reference cache; default ``transformers.DynamicCache`` (the model's own).
    Returns:
        label -> :class:`Quality`; the reference's perplexity is each one's ``ref_ppl``.
    """
    from transformers import DynamicCache

    total = check_protocol_ids(ids, min_tokens)
    if not caches:
        raise ValueError("caches must name at least one cache")
    segments, first = protocol_segments(total, mode, prefill, chunk, steps)
    ref_cache = (reference or DynamicCache)()
    built = {label: make() for label, make in caches.items()}
    acc = {label: dict(nll=0.0, kl=0.0, top1=0, maxd=0.0, s=0.0) for label in built}
    ref_nll, scored = 0.0, 0
    for i, (a, b) in enumerate(segments):
        piece = ids[:, a:b]
        p0, p1 = max(a, first - 1), min(b - 1, total - 2)  # scored positions (position p predicts token p+1)
        keep = b - p0 if p0 <= b - 1 else 1  # logits of positions [b - keep, b) only
        n = max(0, p1 - p0 + 1)
        tgt = ids[0, p0 + 1:p0 + 1 + n]
        ref = model(piece, use_cache=True, **{CACHE_KW: ref_cache}, logits_to_keep=keep).logits[0, :n].float()
        if n:
            ref_lp = torch.log_softmax(ref, -1)
            ref_nll -= ref_lp.gather(-1, tgt[:, None]).sum().item()
            ref_top = ref.argmax(-1)
            scored += n
        for label, cache in built.items():
            t0 = time.perf_counter()
            out = model(piece, use_cache=True, **{CACHE_KW: cache}, logits_to_keep=keep).logits[0, :n].float()
            acc[label]["s"] += time.perf_counter() - t0
            if not n:
                continue
            lp = torch.log_softmax(out, -1)
            r = acc[label]
            r["nll"] -= lp.gather(-1, tgt[:, None]).sum().item()
            r["kl"] += (ref_lp.exp() * (ref_lp - lp)).sum().item()
            r["top1"] += int((out.argmax(-1) == ref_top).sum())
            r["maxd"] = max(r["maxd"], (out - ref).abs().max().item())
        if progress and i % 128 == 0:
            print(f"  {mode}: call {i}/{len(segments)}", flush=True)
    ref_ppl = math.exp(ref_nll / scored)
    fed = segments[-1][1]
    return {label: Quality(label, mode, fed, scored, math.exp(r["nll"] / scored), ref_ppl, r["kl"] / scored,
                           r["top1"] / scored, r["maxd"], cache_nbytes(built[label]), r["s"])
            for label, r in acc.items()}


def cache_nbytes(cache) -> int:
    """Bytes a cache holds, measured from its tensors: ``cache.nbytes`` for kvslim caches; for others (HF
    ``DynamicCache``, ``QuantizedCache``) the sum over each layer's tensors, quantized tensor subclasses
    (quanto) unpacked into their inner tensors."""
    if hasattr(cache, "nbytes") and not isinstance(cache, torch.Tensor):
        return int(cache.nbytes)
    total, seen = 0, set()
    for layer in getattr(cache, "layers", []):
        for value in vars(layer).values():
            total += _tensor_bytes(value, seen)
    return total


def _tensor_bytes(value, seen: set) -> int:
    if not isinstance(value, torch.Tensor) or id(value) in seen:
        return 0
    seen.add(id(value))
    if hasattr(value, "__tensor_flatten__") and type(value) is not torch.Tensor:
        names, _ = value.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(value, n), seen) for n in names)
    return value.numel() * value.element_size()


@torch.inference_mode()
def greedy_agreement(model, ids: torch.Tensor, new_tokens: int, make_cache: Callable[[], object],
                     make_reference: Callable[[], object] | None = None) -> dict:
    """Greedy continuations of ``ids`` (1, P) with a reference cache and with ``make_cache()``: the fraction of
    positions whose tokens agree and the index of the first disagreement (``new_tokens`` if none). Greedy
    agreement is chaotic on small models: report it, do not target it."""
    from transformers import DynamicCache

    ref = greedy_decode(model, ids, new_tokens, (make_reference or DynamicCache)()).tokens[0]
    got = greedy_decode(model, ids, new_tokens, make_cache()).tokens[0]
    diff = (ref != got).nonzero()
    return {"agreement": (ref == got).float().mean().item(),
            "first_divergence": int(diff[0, 0]) if diff.numel() else new_tokens, "new_tokens": new_tokens}
