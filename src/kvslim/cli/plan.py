"""Bytes per method for any Hugging Face config, loading no weights.

``kvslim plan --config CONFIG.json [--context N] [--batch B] [--dtype D] [--window W] [--group-size G]
[--per-layer 15-24:bits=8] [--option METHOD.NAME=VALUE ...] [--ranks N] [--json]`` (``--turbo OPTION=VALUE,...``:
deprecated, ``--option`` for each of turbo4/turbo3/turbo2)
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from .method_options import OPTION, deprecated, parse_method_options, parse_options, parse_per_layer

# torch, transformers and rich are imported inside the functions: ``kvslim plan --help`` stays instant


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="config.json of a HF model, or a folder holding one")
    p.add_argument("--context", type=int, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    p.add_argument("--dtype", default="bfloat16", help="float32 | float16 | bfloat16 (default bfloat16)")
    p.add_argument("--window", type=int, default=None, help="ring-buffer window for 'window' and int8/int4")
    p.add_argument("--group-size", type=int, default=None,
                   help="quantization group size for int8/int4/int3/int2 (default: the method's, 64 where it "
                        "divides the head dimension)")
    p.add_argument("--per-layer", action="append", default=None, metavar="LAYERS:OPTION=VALUE[,...]",
                   help="int8/int4/int3/int2: options of some layers over the method's (per_layer), e.g. "
                        "15-24:bits=8 or 0,3:rotation=hadamard (options: bits, key_bits, rotation, "
                        "value_rotation); repeatable")
    p.add_argument("--option", action="append", default=[], metavar="METHOD.NAME=VALUE",
                   help="an apply() option of one method, e.g. turbo3.prerope_keys=true or int4.residual=64 "
                        "(repeatable; the spelling of kvslim eval, demo and bench too)")
    p.add_argument("--turbo", default=None, metavar="OPTION=VALUE[,...]",
                   help="deprecated: options of turbo4/turbo3/turbo2 at once (use --option turbo3.NAME=VALUE)")
    p.add_argument("--ranks", type=int, default=None,
                   help="sequence-parallel ranks (kvslim.distributed): also show cache bytes per rank and bytes "
                        "each rank sends per decode step")
    p.add_argument("--json", action="store_true", help="print JSON records instead of a table")


def load_config(path: str | Path):
    """An HF config object from a config.json (or a folder with one), without weights or network."""
    from transformers import AutoConfig

    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ValueError(f"--config: no such file {str(p)!r}")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"--config: {p} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config: {p} holds a JSON {type(data).__name__}, expected an object with a "
                         "'model_type' field")
    if "model_type" not in data:
        raise ValueError(f"--config: {p} has no 'model_type' field")
    check_sizes(data, p)
    try:
        return AutoConfig.for_model(**data)
    except Exception as exc:  # noqa: BLE001 - transformers' validators raise several unrelated types
        why = " ".join(str(exc).split())
        raise ValueError(f"--config: transformers cannot read {p} (model_type {data['model_type']!r}): {why}"
                         ) from None


#: config fields that are counts or sizes (top level, or under ``text_config``)
SIZE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")


def check_sizes(data: dict, path: Path) -> None:
    """``ValueError`` naming the file and field when a size field is not a positive int, or when the hidden size
    is not a multiple of the head count (and no ``head_dim`` says otherwise)."""
    for where, part in (("", data), ("text_config.", data.get("text_config"))):
        if not isinstance(part, dict):
            continue
        for field in SIZE_FIELDS:
            v = part.get(field)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise ValueError(f"--config: {path}: {where}{field} must be a positive int, got {v!r}")
        hidden, heads = part.get("hidden_size"), part.get("num_attention_heads")
        if hidden and heads and part.get("head_dim") is None and hidden % heads:
            raise ValueError(f"--config: {path}: {where}hidden_size {hidden} is not a multiple of "
                             f"{where}num_attention_heads {heads} (and no head_dim is given)")


#: the methods ``--group-size`` and ``--per-layer`` reach; ``--window`` reaches ``window`` and the first two
QUANTIZED = ("int8", "int4", "int3", "int2")
TURBO = ("turbo4", "turbo3", "turbo2")


def method_options(name: str, window: int | None, group_size: int | None, per_layer: dict | None = None,
                   turbo: dict | None = None, options: dict | None = None) -> dict:
    """The options ``kvslim plan``'s flags give method ``name`` (flags left out: the method's defaults);
    ``options``: ``--option``'s {method: {name: value}}, over the other flags' (one option set twice: ValueError)."""
    opts = {}
    if name in ("window", "int8", "int4") and window:
        opts["window"] = window
    if name in QUANTIZED:
        opts |= ({"group_size": group_size} if group_size else {}) | ({"per_layer": per_layer} if per_layer else {})
    if name in TURBO and turbo:
        opts |= turbo
    mine = (options or {}).get(name, {})
    both = sorted(set(opts) & set(mine))
    if both:
        raise ValueError(f"{OPTION} {name}: {', '.join(both)} also set by --window/--group-size/--per-layer/--turbo; "
                         "give it once")
    return opts | mine


def method_records(config, context: int, batch: int, dtype, window: int | None, group_size: int | None,
                   ranks: int | None = None, per_layer: dict | None = None, turbo: dict | None = None,
                   options: dict | None = None) -> list[dict]:
    """One record per registered method: bytes, ratio, or the reason it does not apply (with ``ranks``: also
    the per-rank cache and traffic of a sequence-parallel job, see :mod:`kvslim.distributed.plan`). A
    ``per_layer`` option the method refuses, or a ``turbo`` option no turbo method knows, is a ``ValueError``
    naming the flag, not a row; so is any refusal of a method ``options`` (``--option``) sets, where the method
    applies to the model."""
    from ..adapters.shape import shape_from_config
    from ..api import plan_config
    from ..methods import METHODS

    shape = shape_from_config(config)
    records = []
    for name in METHODS:
        opts = method_options(name, window, group_size, per_layer, turbo, options)
        rec = {"method": name, "model_type": shape.model_type, "family": shape.family, "context": context,
               "batch": batch, "dtype": str(dtype).replace("torch.", "")}
        try:
            plan = plan_config(config, name, dtype, **opts)
        except ValueError as exc:
            if per_layer and "per_layer" in str(exc) and not METHODS[name].not_applicable(shape):
                why = re.sub(r"^per_layer\[(\d+)\]", r"layer \1", str(exc)).removeprefix("per_layer: ")
                raise ValueError(f"--per-layer: {why}") from None
            if turbo and name in TURBO and "unknown option" in str(exc):  # a value one of them refuses: its row
                raise ValueError(f"--turbo: {exc}") from None
            if (options or {}).get(name) and not METHODS[name].not_applicable(shape):
                raise ValueError(f"{OPTION} {name}: {exc}") from None
            rec |= {"applies": False, "reason": str(exc)}
        else:
            rec |= {"applies": True, "cache_bytes": plan.cache_bytes(context, batch),
                    "dense_bytes": plan.dense_bytes(context, batch), "ratio": round(plan.ratio(context), 6),
                    "exactness": sorted({lp.exactness for lp in plan.layers}), "notes": list(plan.notes),
                    "hf_bytes": plan.hf_bytes(context, batch),
                    "step_read_bytes": plan.step_read_bytes(context, batch),
                    "by_attention": plan.bytes_by_attention(context, batch)}
            if ranks is not None:
                from ..distributed.plan import per_rank

                rec |= per_rank(plan, shape, context, batch, ranks)
        records.append(rec)
    return records


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..adapters.shape import shape_from_config
    from ..methods.base import parse_dtype
    from ..units import human_bytes

    if args.context <= 0:
        raise ValueError(f"--context must be a positive int, got {args.context}")
    if args.batch <= 0:
        raise ValueError(f"--batch must be a positive int, got {args.batch}")
    ranks = getattr(args, "ranks", None)
    if ranks is not None and ranks <= 0:
        raise ValueError(f"--ranks must be a positive int, got {ranks}")
    for flag, value in (("--group-size", args.group_size), ("--window", args.window)):
        if value is not None and value <= 0:
            raise ValueError(f"{flag} must be a positive int, got {value}")
    dtype = parse_dtype(args.dtype, "--dtype")
    per_layer = parse_per_layer(getattr(args, "per_layer", None))
    from ..methods import METHODS

    options = parse_method_options(getattr(args, "option", None), list(METHODS), among="the methods")
    turbo = None
    if getattr(args, "turbo", None):
        deprecated("plan", "--turbo OPTION=VALUE", "--option turbo3.OPTION=VALUE, once per turbo method (the "
                   "spelling of plan, eval, demo and bench)")
        turbo = parse_options(args.turbo, "--turbo")
    config = load_config(args.config)
    records = method_records(config, args.context, args.batch, dtype, args.window, args.group_size, ranks,
                             per_layer, turbo, options)
    if args.json:
        print(json.dumps(records, indent=2))
        return 0
    shape = shape_from_config(config)
    table = Table(title=f"{shape.model_type} ({shape.family}, {shape.num_layers} layers), {args.context} tokens × "
                        f"{args.batch}, {args.dtype}")
    extra = ("bytes / rank", "sent / step / rank") if ranks is not None else ()
    if ranks is not None:
        table.title += f", {ranks} ranks"
    sliding = "sliding_attention" in shape.layer_types  # then HF's own cache keeps W − 1 rows there
    by_type = ("sliding layers", "full layers", "× HF's cache") if sliding else ()
    hf = None
    for col in ("method", "cache", "read / step", "× dense", *by_type, *extra, "exactness", "note"):
        table.add_column(col)
    for r in records:
        per = (human_bytes(r["cache_bytes_per_rank"]), human_bytes(r["sent_bytes_per_step"])) if extra and r["applies"] else ()
        if r["applies"]:
            types = ()
            if sliding:
                by = r["by_attention"]
                types = tuple(human_bytes(by[t]["cache_bytes"]) if t in by else "-" for t in ("sliding", "full"))
                types += (f"{r['cache_bytes'] / max(1, r['hf_bytes']):.3f}",)
                hf = by
            table.add_row(r["method"], human_bytes(r["cache_bytes"]), human_bytes(r["step_read_bytes"]),
                          f"{r['ratio']:.3f}", *types, *per,
                          ", ".join(r["exactness"]), "; ".join(r["notes"]))
        else:
            table.add_row(r["method"], "-", "-", "-", *(("-",) * (len(by_type) + len(extra))), "not applicable",
                          r["reason"])
    if sliding and hf:
        table.caption = ("HF's own cache (DynamicCache: W − 1 rows on sliding layers): sliding layers "
                         f"{human_bytes(hf['sliding']['hf_bytes'])}, full layers "
                         f"{human_bytes(hf.get('full', {}).get('hf_bytes', 0))}")
    table.caption = ((table.caption + "\n") if table.caption else "") + \
        "bytes in binary units (1 KiB = 1024 B); read / step: the cache bytes a single-token decode step reads (less than \"cache\" with sparse decode: docs/sparse.md); --json gives the exact counts"
    Console().print(table)
    return 0
