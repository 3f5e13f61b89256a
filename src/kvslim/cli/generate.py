"""Answer a prompt with a model and a kvslim cache, optionally continuing a prompt cache file.

``kvslim generate --model M --prompt-cache DOC.kvslim --prompt "question" [--chat] [--max-new-tokens N]``: the
file's tokens (``kvslim cache-prompt``) are the prefix, the question is appended (``--chat``: in the tokenizer's
chat template, as the file was made) and answered greedily; the file is only read, so the same question gives the
same answer every time. ``--text DOC`` (the document as given to ``cache-prompt``, edited or not): the file's
tokens are reused up to the first that differs from DOC's, the rest of DOC and the question prefilled, and the count
reported. Without ``--prompt-cache``: ``--prompt`` alone through ``--method`` (default int4) with its
``--option METHOD.NAME=VALUE`` (e.g. ``int4.sparse_budget=2048``; a prompt cache file carries its own options).
"""

from __future__ import annotations

import argparse

from .eval import BUILTINS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help=f"a local HF folder, a .gguf file, or one of {sorted(BUILTINS)}")
    p.add_argument("--prompt", required=True, help="the question (after the prompt cache's text) or the prompt")
    p.add_argument("--prompt-cache", default=None, metavar="FILE", help="a file of kvslim cache-prompt: its tokens "
                   "are the prefix, its method and options the cache's")
    p.add_argument("--text", default=None, metavar="FILE", help="with --prompt-cache: the document to ask about, "
                   "as given to kvslim cache-prompt --text; the file's tokens are reused up to the first one that "
                   "differs (an edited document) and the rest prefilled (default: the file's own tokens)")
    p.add_argument("--method", default=None, help="without --prompt-cache: the kvslim method (default int4)")
    p.add_argument("--option", action="append", default=[], metavar="METHOD.NAME=VALUE",
                   help="without --prompt-cache: an apply() option of --method (repeatable), e.g. "
                   "int4.sparse_budget=2048 (a prompt cache file carries its own)")
    p.add_argument("--chat", action="store_true", help="ask in the tokenizer's chat template (the prompt cache must "
                   "have been made with --chat)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="answer tokens at most (default 128)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")


def question_ids(tok, prompt: str, chat: bool, meta: dict | None):
    """The question's token ids (1, Q) that follow the prompt cache's tokens (or the whole prompt without one)."""
    from .cache_prompt import chat_parts

    made_chat = bool(((meta or {}).get("extra") or {}).get("chat"))
    if meta is not None and made_chat != chat:
        flag = "with" if made_chat else "without"
        raise ValueError(f"--chat: the prompt cache was made {flag} --chat; ask {flag} --chat (or make the file "
                         "again with kvslim cache-prompt)")
    if meta is None:
        if not chat:
            return tok(prompt, return_tensors="pt", verbose=False).input_ids
        head, tail = chat_parts(tok)
        return tok(head + prompt + tail, return_tensors="pt", add_special_tokens=False, verbose=False).input_ids
    if chat:
        text = prompt + (meta["extra"].get("tail") or "")
    else:  # a new paragraph after the document (its last token was not followed by a separator)
        text = "\n\n" + prompt
    return tok(text, return_tensors="pt", add_special_tokens=False, verbose=False).input_ids


def run(args: argparse.Namespace) -> int:
    import sys
    import time
    import warnings

    if args.max_new_tokens <= 0:
        raise ValueError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if not args.prompt.strip():
        raise ValueError("--prompt: empty; give the question (or the prompt) to answer")
    if args.prompt_cache and args.method:
        raise ValueError("--method: the prompt cache's method is used with --prompt-cache (give one or the other)")
    if args.prompt_cache and args.option:
        raise ValueError("--option: a prompt cache file carries its method's options (give them to kvslim "
                         "cache-prompt --option)")
    method = args.method or "int4"
    from .method_options import parse_method_options

    options = parse_method_options(args.option, [method], among="--method").get(method, {})  # before the model loads
    if args.text and not args.prompt_cache:
        raise ValueError("--text: the document whose cached prefix to reuse goes with --prompt-cache FILE")
    document = None
    if args.text:
        from .eval import read_text

        document = read_text(args.text)  # a missing file is refused before the model loads
    meta = None
    if args.prompt_cache:
        from ..prompt_cache import read_meta

        meta = read_meta(args.prompt_cache)  # a missing or foreign file is refused before the model loads
    import torch

    from .. import api
    from ..adapters.compat import CACHE_KW
    from ..prompt_cache import check_room, load_cache
    from .eval import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    model, tok = load_model(args.model)
    q = question_ids(tok, args.prompt, args.chat, meta)
    t0 = time.perf_counter()
    if meta is not None:
        loaded = load_cache(args.prompt_cache, model)
        if document is None:
            ids = torch.cat([loaded.token_ids, q], dim=1)
        else:
            from .cache_prompt import prompt_ids

            ids = torch.cat([prompt_ids(tok, document, args.chat), q], dim=1)
        check_room(loaded, model, max(0, ids.shape[1] - loaded.token_ids.shape[1] + args.max_new_tokens))
        reused = loaded.common_prefix(ids)
        cache = loaded.cache
    else:
        limit = getattr(model.config, "max_position_embeddings", None)
        if limit is not None and q.shape[1] + args.max_new_tokens > limit:
            raise ValueError(f"--max-new-tokens: {q.shape[1]} prompt tokens + {args.max_new_tokens} exceed the model's "
                             f"max_position_embeddings ({limit}): at most {max(0, limit - q.shape[1])} fit")
        api.apply(model, method, **options)
        ids, cache = q, api.make_cache(model)
    t1 = time.perf_counter()
    eos = tok.eos_token_id
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=eos,
               pad_token_id=eos if eos is not None else 0)
    with torch.no_grad():
        out = loaded.generate(model, ids, **gen) if meta is not None else model.generate(ids, **{CACHE_KW: cache},
                                                                                          **gen)
    t2 = time.perf_counter()
    answer = out[0, ids.shape[1]:]
    print(tok.decode(answer, skip_special_tokens=True).strip())
    if meta is None:
        what = f"{ids.shape[1]:,} prompt tokens"
    else:
        what = (f"reused {reused:,} of the file's {meta['tokens']:,} tokens, prefilled {ids.shape[1] - reused:,} "
                f"(question {q.shape[1]:,})")
    print(f"kvslim generate: {what}, {answer.shape[0]} answer tokens; load {t1 - t0:.2f} s, generate "
          f"{t2 - t1:.1f} s", file=sys.stderr)
    return 0
