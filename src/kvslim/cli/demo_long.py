"""The demo's main table: a long prompt, so that every method's bytes differ, then a short decode.

One dense prefill of the first ``prompt`` tokens of the development text (Botchan, shipped in ``kvslim/data``)
fills a ``DynamicCache``; each method's own cache then receives the same prompt keys and values through
``Cache.update``, the call attention makes in a prefill (:func:`transplant`: a prefill attends to its own keys and
values in full precision, so its logits are dense's whatever the cache, and one prefill serves every row). From
there each method decodes, one token per call, reading its own stored history:

* ``quality`` tokens teacher-forced on the text's true continuation: perplexity of that continuation (Δppl against
  dense), top-1 agreement with dense's argmax and max |Δlogit| against dense, position by position;
* ``new_tokens`` greedy tokens after that: greedy agreement with dense's tokens, position by position.

Decode tokens/s counts every single-token call of both phases (after a warm-up that loads the method's C++ ops).
Bytes are the cache's exact ``nbytes`` at the end. The ``plan`` of each method is kept for the bytes plot.
"""

from __future__ import annotations

import math
import time

import torch

from .. import api
from ..adapters.compat import CACHE_KW
from ..evaluate import load_text

# (label, method, options): the library's defaults (docs/quantization.md), dense first (the reference)
LONG_RUNS = (("dense", "dense", {}), ("int8", "int8", {}), ("int4", "int4", {}), ("int3", "int3", {}),
             ("int2", "int2", {}))


def text_prefix_ids(tokenizer, tokens: int, name: str = "botchan") -> torch.Tensor:
    """The first ``tokens`` tokens of a shipped text as (1, tokens) ids, tokenizing only a prefix of it (the whole
    novel is longer than some tokenizers' limit, which they warn about); ``ValueError`` when the text is shorter."""
    text = load_text(name)
    chars = 6 * tokens
    while True:
        ids = tokenizer(text[:chars], return_tensors="pt").input_ids
        if ids.shape[1] > tokens or chars >= len(text):  # > tokens: a token cut at the prefix's end is not used
            break
        chars *= 2
    if ids.shape[1] < tokens:
        raise ValueError(f"tokens={tokens} exceeds the {ids.shape[1]} tokens of text {name!r}")
    return ids[:, :tokens]


def transplant(source, cache) -> None:
    """Write every layer's keys and values of ``source`` (a filled HF ``DynamicCache``) into ``cache`` through
    ``cache.update``, as the attention of a prefill would (``tests/test_demo.py`` checks the next logits equal those
    after a real prefill into ``cache``)."""
    for idx, layer in enumerate(source.layers):
        cache.update(layer.keys, layer.values, idx)


@torch.inference_mode()
def _steps(model, cache, first: torch.Tensor, inputs: torch.Tensor | None, n: int):
    """``n`` single-token calls after a prefill whose last logits are ``first`` (1, V): teacher-forced on
    ``inputs`` (1, n - 1) when given, else greedy. Returns (logits (n, V) fp32, tokens (n,), seconds)."""
    logits, tokens = [first], [first.argmax(-1)]
    t0 = time.perf_counter()
    for i in range(n - 1):
        inp = (inputs[:, i] if inputs is not None else tokens[-1])[:, None]
        logits.append(model(inp, use_cache=True, **{CACHE_KW: cache}).logits[:, -1].float())
        tokens.append(logits[-1].argmax(-1))
    return torch.cat(logits), torch.cat(tokens), time.perf_counter() - t0


@torch.inference_mode()
def _warm_up(model, ids: torch.Tensor) -> None:
    """A few tokens through a fresh cache of the applied method: loads its ops (a first use may compile them)."""
    cache = api.make_cache(model)
    model(ids[:, :16], use_cache=True, **{CACHE_KW: cache})
    for _ in range(2):
        model(ids[:, 16:17], use_cache=True, **{CACHE_KW: cache})


@torch.inference_mode()
def measure_long(model, tokenizer, runs, prompt: int, quality: int, new_tokens: int, progress=print,
                 name: str = "model") -> list[dict]:
    """Measure each (label, method, options) of ``runs`` (the first is the reference, normally dense) after one
    ``prompt``-token prefill of the development text; see the module docstring. ``ValueError`` names a bad
    length."""
    from transformers import DynamicCache

    for arg, v, low in (("prompt", prompt, 16), ("quality", quality, 2), ("new_tokens", new_tokens, 2)):
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise ValueError(f"{arg} must be an int >= {low}, got {v!r}")
    ids = text_prefix_ids(tokenizer, prompt + quality)
    prompt_ids, truth = ids[:, :prompt], ids[0, prompt:]
    api.restore(model)
    progress(f"{name}: one dense prefill of {prompt} tokens of Botchan")
    ref = DynamicCache(config=model.config)
    first = model(prompt_ids, use_cache=True, **{CACHE_KW: ref}, logits_to_keep=1).logits[:, -1].float()
    rows, base = [], None
    for i, (label, method, opts) in enumerate(runs):
        progress(f"{name}: {label!r} ({i + 1}/{len(runs)}): {quality} teacher-forced + {new_tokens} greedy tokens")
        plan = api.apply(model, method, **opts)
        _warm_up(model, prompt_ids)
        cache = api.make_cache(model)
        transplant(ref, cache)
        forced, _, t_forced = _steps(model, cache, first, truth[None, :-1], quality)
        # the greedy part starts after the last true token: its logits come from one more teacher-forced call
        nxt = model(truth[None, -1:], use_cache=True, **{CACHE_KW: cache}).logits[:, -1].float()
        _, tokens, t_free = _steps(model, cache, nxt, None, new_tokens)
        nll = -torch.log_softmax(forced, -1).gather(-1, truth[:, None]).mean().item()
        seconds = t_forced + t_free
        row = {"label": label, "method": method, "options": opts, "cache_bytes": cache.nbytes,
               "context": prompt + quality + new_tokens - 1, "prompt_tokens": prompt, "quality_tokens": quality,
               "new_tokens": new_tokens, "decode_tokens_per_s": (quality + new_tokens - 2) / seconds,
               "perplexity": math.exp(nll), "forced_logits": forced, "tokens": tokens,
               "text": tokenizer.decode(tokens, skip_special_tokens=True), "plan": plan}
        row["planned_bytes"] = plan.cache_bytes(row["context"])
        base = base or row
        row |= {"ratio": row["cache_bytes"] / base["cache_bytes"],
                "speed_ratio": row["decode_tokens_per_s"] / base["decode_tokens_per_s"],
                "perplexity_increase": row["perplexity"] / base["perplexity"] - 1,
                "top1_agreement": (forced.argmax(-1) == base["forced_logits"].argmax(-1)).float().mean().item(),
                "max_abs_dlogit": (forced - base["forced_logits"]).abs().max().item(),
                "greedy_agreement": (tokens == base["tokens"]).float().mean().item()}
        rows.append(row)
        del cache
    api.restore(model)
    for r in rows:
        r.pop("forced_logits")
        r["tokens"] = r["tokens"].tolist()
    return rows


def long_caption(rows: list[dict]) -> str:
    r = rows[0]
    return (f"one prefill of {r['prompt_tokens']} tokens of Botchan (development text), then per method "
            f"{r['quality_tokens']} tokens teacher-forced on the true continuation (Δppl, top-1 =, max |Δlogit|) "
            f"and {r['new_tokens']} greedy tokens (greedy =); bytes after all {r['context']} tokens; "
            "=: agreement with dense, position by position; tok/s: every single-token call of both parts")
