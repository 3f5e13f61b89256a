"""Choose a method's per-layer options for your model on a calibration text and write them to a file.

``kvslim calibrate --model PATH_OR_NAME --method int4 --out FILE [--text NAME|FILE] [--tokens 1536]
[--option METHOD.NAME=VALUE ...] [--queries 256]``: ``kvslim.calibrate`` (docs/quantization.md §12) on the first
``--tokens`` tokens of ``--text`` (default: the shipped development text, Botchan, 1,536 tokens, as the
benchmarks calibrate), its ``per_layer`` dict written to ``FILE`` with ``kvslim.save_per_layer`` (safetensors:
the model's identity, method, options, text and token count beside it), and a summary: the layers whose options
changed and the seconds the calibration took (int methods: a key rotation per layer;
turbo methods: key channel scales in every layer). ``kvslim eval / demo / bench --per-layer-file FILE`` run with it.
``--model`` as ``kvslim eval``'s. Bad input is refused before the model is loaded; nothing is written on failure.

``kvslim calibrate --model PATH_OR_NAME --sparse [--tokens 8192] [--out FILE.json]``: ``kvslim.calibrate_sparse``
instead (docs/sparse.md, "Layers the bound cannot rank"): per layer, how often the page rule missed the page a head
attends to, the layers to read in full, and the ``--option METHOD.sparse_dense_layers=[...]`` that runs with them
(``--option`` may set ``sparse_page`` / ``sparse_score``, with ``sparse_budget``); ``--out`` (optional) writes them
as JSON.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .eval import BUILTINS

    p.add_argument("--model", required=True, help=f"a local HF folder, a .gguf file, or one of {sorted(BUILTINS)}")
    p.add_argument("--method", default="int4", help="the method calibrated (int8/int4/int3/int2: per-layer key "
                                                    "rotation; turbo4/turbo3/turbo2: key channel scales; default int4)")
    p.add_argument("--out", default=None, help="the file written (safetensors; with --sparse, JSON and optional)")
    p.add_argument("--sparse", action="store_true", help="choose the layers sparse decode reads in full "
                                                         "(kvslim.calibrate_sparse) instead of per-layer codings")
    p.add_argument("--text", default="botchan", help="a UTF-8 text file, or a shipped text by name (default "
                                                     "botchan, the development text)")
    p.add_argument("--tokens", type=int, default=None, help="calibration tokens: the text's first (default 1536; "
                                                            "with --sparse 8192)")
    p.add_argument("--option", action="append", default=[], metavar="METHOD.NAME=VALUE",
                   help="an apply() option of --method the calibration runs with, e.g. int4.group_size=32 "
                        "(repeatable; recorded in the file)")
    p.add_argument("--queries", type=int, default=256, help="the last queries of the prefill over which each "
                                                            "layer's attention error is measured (default 256)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")


def check_args(args: argparse.Namespace) -> dict:
    """The method's options; ``ValueError`` naming the flag for anything wrong (nothing loaded yet)."""
    from ..calibration import CALIBRATED_METHODS
    from .eval import read_text
    from .method_options import parse_method_options

    if args.tokens is None:
        args.tokens = 8192 if args.sparse else 1536
    if args.sparse:
        from ..methods import METHODS

        if args.method not in METHODS:
            raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {args.method!r}")
    elif args.method not in CALIBRATED_METHODS:
        raise ValueError(f"--method must be one of {', '.join(CALIBRATED_METHODS)}, got {args.method!r}")
    elif args.out is None:
        raise ValueError("--out is required (the per-layer file written), or --sparse")
    options = parse_method_options(args.option, [args.method], among="--method").get(args.method, {})
    if args.sparse:
        extra = sorted(set(options) - {"sparse_budget", "sparse_page", "sparse_score"})
        if extra:
            raise ValueError(f"--option {args.method}.{extra[0]}: --sparse takes sparse_budget, sparse_page and "
                             "sparse_score only")
    for flag, value in (("--tokens", args.tokens), ("--queries", args.queries), ("--threads", args.threads)):
        if value is not None and value <= 0:
            raise ValueError(f"{flag} must be a positive int, got {value}")
    out = Path(args.out) if args.out is not None else None
    if out is not None and out.is_dir():
        raise ValueError(f"--out: {args.out!r} is a folder; give a file name")
    if out is not None and not out.parent.is_dir():
        raise ValueError(f"--out: no folder {str(out.parent)!r} to write {out.name!r} into")
    if not read_text(args.text).strip():
        raise ValueError(f"--text: {args.text!r} is empty")
    return options


def summary(per_layer: dict, n: int) -> str:
    """One line per option: the layers that set it (``rotation -> hadamard: layers 0, 3``), or 'no layer changed'."""
    if not per_layer:
        return f"no layer changed (all {n} keep the method's options)"
    lines = {}
    for i, over in per_layer.items():
        for key, value in over.items():
            if hasattr(value, "shape"):
                shown = f"{key} (a {' x '.join(map(str, value.shape))} tensor)"
            elif isinstance(value, (list, tuple)) and value and isinstance(value[0], (list, tuple)):
                shown = f"{key} ({len(value)} x {len(value[0])} values)"
            else:
                shown = f"{key} -> {value}"
            lines.setdefault(shown, []).append(i)
    return "\n".join(f"  {shown}: " + (f"every layer ({n})" if len(ix) == n > 1 else
                                        f"layer{'s' if len(ix) > 1 else ''} {', '.join(map(str, ix))} ({len(ix)} of {n})")
                     for shown, ix in lines.items())


def run(args: argparse.Namespace) -> int:
    options = check_args(args)
    import time
    import warnings

    import torch

    from ..calibration import calibrate
    from ..per_layer_file import save_per_layer
    from .eval import _check_context, load_model, read_text

    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    model, tok = load_model(args.model)
    _check_context(model, args.tokens, "--tokens")
    ids = tok(read_text(args.text), return_tensors="pt", verbose=False).input_ids
    if ids.shape[1] < args.tokens:
        raise ValueError(f"--text: {args.text!r} has {ids.shape[1]} tokens, fewer than --tokens {args.tokens}")
    ids = ids[:, :args.tokens]
    if args.sparse:
        return _run_sparse(args, options, model, ids)
    t0 = time.perf_counter()
    try:
        per_layer = calibrate(model, ids, args.method, queries=args.queries, **options)
    except ValueError as e:
        raise ValueError(f"--option {args.method} / --tokens / --queries: {e}") from None
    seconds = time.perf_counter() - t0
    n = len(model.model.layers)
    save_per_layer(args.out, per_layer, model, args.method, name=args.model, options=options, text=args.text,
                   tokens=int(ids.shape[1]), seconds=round(seconds, 3))
    print(f"{args.model}: {args.method} calibrated on {ids.shape[1]} tokens of {args.text} in {seconds:.1f} s "
          f"(one prefill and each layer's candidates; model loading not counted)")
    print(summary(per_layer, n))
    print(f"wrote {args.out}: run with --per-layer-file {args.out} (kvslim eval, demo, bench) or "
          f"kvslim.load_per_layer({str(args.out)!r}, model, {args.method!r})")
    return 0


def _run_sparse(args: argparse.Namespace, options: dict, model, ids) -> int:
    """``--sparse``: the page rule's misses per layer, the layers to read in full, the option that runs them."""
    import json
    import time

    from ..calibration_sparse import choose, sparse_miss_rates

    page, score = options.get("sparse_page", 32), options.get("sparse_score", "minmax")
    t0 = time.perf_counter()
    try:
        rates = sparse_miss_rates(model, ids, queries=args.queries, page=page, score=score)
    except ValueError as e:
        raise ValueError(f"--tokens / --queries / --option: {e}") from None
    seconds = time.perf_counter() - t0
    layers = choose(rates)
    print(f"{args.model}: sparse page rule measured on {ids.shape[1]} tokens of {args.text} in {seconds:.1f} s "
          f"(page {page}, {score}; the last {args.queries} queries)")
    print("layer  events  missed")
    for i, (events, missed) in enumerate(rates):
        mark = "  -> read in full" if i in layers else ""
        print(f"{i:5d}  {events:6d}  {missed:6d}" + (f" ({missed / events:.0%})" if events else "") + mark)
    given = "".join(f" --option {args.method}.{k}={options[k]}" for k in ("sparse_page", "sparse_score")
                    if k in options)
    print(f"run with: --option {args.method}.sparse_budget={options.get('sparse_budget', 'auto')}{given} "
          f"--option '{args.method}.sparse_dense_layers={json.dumps(layers).replace(' ', '')}'")  # [..] quoted
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "text": args.text, "tokens": int(ids.shape[1]),
                                              "page": page, "score": score, "queries": args.queries,
                                              "rates": rates, "sparse_dense_layers": layers}) + "\n")
        print(f"wrote {args.out}")
    return 0
