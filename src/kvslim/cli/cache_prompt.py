"""Prefill a text once through a kvslim cache and write the compressed cache to a file.

``kvslim cache-prompt --model M --method int4 --text FILE --out DOC.kvslim [--chat] [--option METHOD.NAME=VALUE]
[--chunk 512] [--tokens N]``: the text's tokens (``--chat``: inside the tokenizer's chat template, up to where the
question goes) are prefilled ``--chunk`` tokens at a time with a progress bar, and the cache is written with
``kvslim.save_cache`` (docs/prompt_cache.md); prints tokens, file bytes and seconds. ``kvslim generate --model M
--prompt-cache DOC.kvslim --prompt "question"`` then answers questions about the text without the prefill.
"""

from __future__ import annotations

import argparse

from .eval import BUILTINS, read_text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help=f"a local HF folder, a .gguf file, or one of {sorted(BUILTINS)}")
    p.add_argument("--method", default="int4", help="the kvslim method whose cache is written (default int4)")
    p.add_argument("--option", action="append", default=[], metavar="METHOD.NAME=VALUE",
                   help="an apply() option of --method (repeatable), e.g. int4.group_size=64")
    p.add_argument("--text", required=True, help="a UTF-8 text file, or a text shipped with kvslim by name")
    p.add_argument("--out", required=True, help="the file to write (e.g. doc.kvslim); replaced whole or not at all")
    p.add_argument("--chat", action="store_true", help="put the text in the tokenizer's chat template (a user "
                   "message the question will end); kvslim generate --chat then asks in the same template")
    p.add_argument("--chunk", type=int, default=512, help="prefill tokens per forward pass (default 512)")
    p.add_argument("--tokens", type=int, default=None, help="keep only the text's first N tokens")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")


def chat_parts(tok) -> tuple[str, str]:
    """(head, tail) of the tokenizer's chat template around one user message (a plain layout without one)."""
    from ..longctx.haystack import template

    return template(tok)


def prompt_ids(tok, text: str, chat: bool):
    """The token ids (1, T) a prompt cache holds for ``text``; with ``chat``, the template's head, the text and a
    blank line (the question and the template's tail follow at ``kvslim generate --chat``)."""
    if not chat:
        return tok(text, return_tensors="pt", verbose=False).input_ids
    head, _ = chat_parts(tok)
    return tok(head + text + "\n\n", return_tensors="pt", add_special_tokens=False, verbose=False).input_ids


def run(args: argparse.Namespace) -> int:
    import time
    import warnings
    from pathlib import Path

    out = Path(args.out)
    if args.chunk <= 0:
        raise ValueError(f"--chunk must be a positive number of tokens, got {args.chunk}")
    if args.tokens is not None and args.tokens <= 0:
        raise ValueError(f"--tokens must be positive, got {args.tokens}")
    if out.is_dir() or not out.parent.is_dir():
        raise ValueError(f"--out: {str(out)!r} must be a file name in an existing folder")
    import os

    if not os.access(out.parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise ValueError(f"--out: {str(out)!r} cannot be written (no write permission); choose another folder")
    from .method_options import parse_method_options

    options = parse_method_options(args.option, [args.method], among="--method").get(args.method, {})
    text = read_text(args.text)
    import torch

    from .. import api
    from ..prompt_cache import prefill, save_cache
    from .eval import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    model, tok = load_model(args.model)
    api.apply(model, args.method, **options)
    ids = prompt_ids(tok, text, args.chat)
    if args.tokens is not None:
        ids = ids[:, :args.tokens]
    if ids.shape[1] == 0:
        raise ValueError(f"--text: {args.text!r} holds no tokens; give a text to cache")
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and ids.shape[1] >= limit:
        raise ValueError(f"--text: {ids.shape[1]} tokens, the model's max_position_embeddings is {limit}: leave room "
                         f"for a question (--tokens {limit // 2}, say)")
    cache = api.make_cache(model)
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    t0 = time.perf_counter()
    columns = (TextColumn("prefill"), BarColumn(), TextColumn("{task.completed}/{task.total} tokens"),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task("prefill", total=ids.shape[1])
        prefill(model, ids, cache, args.chunk, lambda done, total: bar.update(task, completed=done))
    t1 = time.perf_counter()
    extra = {"chat": bool(args.chat), "tail": chat_parts(tok)[1] if args.chat else None}
    save_cache(cache, out, model, ids, name=args.model, text=str(args.text), extra=extra)
    t2 = time.perf_counter()
    size = out.stat().st_size
    print(f"{out}: {ids.shape[1]:,} tokens, {args.method}, {size:,} bytes ({size / ids.shape[1]:,.0f} per token; "
          f"cache {cache.nbytes:,} bytes); prefill {t1 - t0:.1f} s, save {t2 - t1:.2f} s")
    return 0
