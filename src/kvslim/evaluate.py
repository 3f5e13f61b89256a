"""Measurements shared by ``kvslim demo`` and ``kvslim bench``: greedy decode, teacher-forced logits, perplexity."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch


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
    out = model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
    t1 = time.perf_counter()
    logits, tokens = [out.logits[:, -1].float()], [out.logits[:, -1].argmax(-1)]
    next_pos = pos[:, -1:] + 1
    for i in range(new_tokens - 1):
        inp = (forced[:, i] if forced is not None else tokens[-1])[:, None]
        mask = torch.cat((mask, torch.ones_like(inp)), dim=1)
        out = model(inp, attention_mask=mask, position_ids=next_pos, past_key_values=cache, use_cache=True)
        next_pos = next_pos + 1
        logits.append(out.logits[:, -1].float())
        tokens.append(logits[-1].argmax(-1))
    t2 = time.perf_counter()
    return DecodeRun(torch.stack(tokens, 1), torch.stack(logits), t1 - t0, t2 - t1, cache)


@torch.inference_mode()
def chunked_perplexity(model, ids: torch.Tensor, make_cache, chunk: int = 32) -> float:
    """Perplexity of ``ids`` (1, T) fed in chunks through a fresh cache, so the cached (possibly quantized or
    windowed) history is what later chunks attend to."""
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 2:
        raise ValueError(f"ids must be (1, T) with T >= 2, got {tuple(ids.shape)}")
    cache = make_cache()
    nll, count = 0.0, 0
    prev_last = None
    for start in range(0, ids.shape[1], chunk):
        piece = ids[:, start:start + chunk]
        logits = model(piece, past_key_values=cache, use_cache=True).logits.float()
        if prev_last is not None:  # predict this chunk's first token from the previous chunk's last position
            nll -= torch.log_softmax(prev_last, -1)[0, piece[0, 0]].item()
            count += 1
        lp = torch.log_softmax(logits[:, :-1], -1)
        nll -= lp.gather(-1, piece[:, 1:, None]).sum().item()
        count += piece.shape[1] - 1
        prev_last = logits[:, -1]
    return math.exp(nll / count)
