"""Method options written on a command line: ``--option METHOD.NAME=VALUE`` (every command that runs or plans a
method: ``kvslim plan``, ``eval``, ``demo``, ``bench``), ``--per-layer 15-24:bits=8``, and the deprecated
``kvslim plan --turbo rope_centred_keys=false`` (= ``--option turbo4/turbo3/turbo2.NAME=VALUE``).

``parse_method_options(["turbo3.residual=64"], methods)`` -> ``{"turbo3": {"residual": 64}}``, each method's options
checked by the method itself before anything is loaded; ``parse_options("a=1,b=false")`` -> ``{"a": 1, "b":
False}``; ``parse_per_layer(["15-24:bits=8", "0:rotation=hadamard"])`` -> the ``per_layer`` dict of
:class:`kvslim.methods.storage.StorageOptions` (``{15: {"bits": 8}, ..., 0: {...}}``). Values: ``true`` /
``false`` (any case), ``none`` for ``rotation``, Python literals (ints, floats, ``None``, dicts), else the text.
``ValueError`` naming the flag on text it cannot read.
"""

from __future__ import annotations

import ast
import sys

OPTION = "--option"


def _value(key: str, text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none" and key == "rotation":  # StorageOptions.rotation: None or "hadamard"
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # text: rotation=hadamard, scale_dtype=float16


def parse_method_options(items: list[str] | None, methods: list[str], check: bool = True,
                         among: str = "--methods") -> dict[str, dict]:
    """``--option METHOD.NAME=VALUE`` items -> ``{method: {name: value}}``; ``ValueError`` naming the item when it
    cannot be read, names a method outside ``methods`` (what the command runs, called ``among`` in the message), an
    option of ``dense`` other than sparse decode's ``sparse_*``, or sets a name twice.
    With ``check``, each method's own option check (names, values) runs now, before any model is loaded (checks that
    need the model's shape run at its plan)."""
    out: dict[str, dict] = {}
    for item in items or ():
        head, eq, raw = item.partition("=")
        method, dot, name = head.strip().partition(".")
        name = name.strip()
        if not eq or not dot or not method or not name or not raw.strip():
            raise ValueError(f"{OPTION}: expected METHOD.NAME=VALUE (e.g. turbo3.residual=64), got {item!r}")
        if method == "dense" and not name.startswith("sparse_"):
            raise ValueError(f"{OPTION} {item!r}: the dense cache takes no options but sparse decode's "
                             "(dense.sparse_budget=N, ...: docs/sparse.md)")
        if method not in methods:
            raise ValueError(f"{OPTION} {item!r}: method {method!r} is not in {among} {list(methods)}")
        opts = out.setdefault(method, {})
        if name in opts:
            raise ValueError(f"{OPTION} {item!r}: {method}.{name} is given twice")
        opts[name] = _value(name, raw.strip())
    if check:
        from ..methods import METHODS

        for method, opts in out.items():
            try:
                METHODS[method].options(**opts)
            except (ValueError, TypeError) as e:
                raise ValueError(f"{OPTION} {method}: {e}") from None
    return out


def deprecated(command: str, flag: str, instead: str) -> None:
    """One line on stderr: ``flag`` still works, ``instead`` is the spelling every command takes."""
    print(f"kvslim {command}: note: {flag} is deprecated (it still works); write {instead}", file=sys.stderr)


def parse_options(text: str, flag: str) -> dict:
    """``KEY=VALUE[,KEY=VALUE...]`` -> dict; ``ValueError`` naming ``flag`` on a part without ``=``."""
    out = {}
    for part in text.split(","):
        key, eq, value = part.strip().partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise ValueError(f"{flag}: expected OPTION=VALUE[,OPTION=VALUE...], got {part.strip()!r} in {text!r}")
        if key in out:
            raise ValueError(f"{flag}: option {key!r} given twice in {text!r}")
        out[key] = _value(key, value)
    return out


def _layers(text: str, spec: str) -> list[int]:
    layers = []
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        try:
            a, b = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise ValueError(f"--per-layer: layers must be indices or ranges like 0,3,15-24, got {text!r} in "
                             f"{spec!r}") from None
        if a < 0 or b < a:
            raise ValueError(f"--per-layer: bad layer range {part.strip()!r} in {spec!r} (indices >= 0, low-high "
                             "with low <= high)")
        layers += range(a, b + 1)
    return layers


def parse_per_layer(specs: list[str] | None) -> dict[int, dict]:
    """``LAYERS:OPTION=VALUE[,...]`` specs (LAYERS: ``3``, ``15-24`` or ``0,3,15-24``) -> ``per_layer`` dict;
    ``ValueError`` naming ``--per-layer`` on unreadable text or a layer given twice."""
    out: dict[int, dict] = {}
    for spec in specs or ():
        layers, colon, options = spec.partition(":")
        if not colon:
            raise ValueError(f"--per-layer: expected LAYERS:OPTION=VALUE[,...] (e.g. 15-24:bits=8), got {spec!r}")
        opts = parse_options(options, "--per-layer")
        for i in _layers(layers, spec):
            if i in out:
                raise ValueError(f"--per-layer: layer {i} given twice")
            out[i] = dict(opts)
    return out


PER_LAYER_FILE = "--per-layer-file"


def add_per_layer_file(p, what: str = "the run") -> None:
    """``--per-layer-file FILE`` on a command's parser (``kvslim eval``, ``demo``, ``bench``)."""
    p.add_argument(PER_LAYER_FILE, default=None, metavar="FILE",
                   help=f"a per_layer file written by kvslim calibrate: its method runs with those per-layer options in "
                        f"{what} (refused for another model or a method not run)")


class FileLayers(dict):
    """A ``per_layer`` dict read from a file: prints as the file's name (row labels), JSON as the dict."""

    source = ""

    def __repr__(self) -> str:
        return f"<{self.source}>"


def read_per_layer_file(path: str | None, methods, among: str = "--methods"):
    """``--per-layer-file``'s :class:`kvslim.per_layer_file.CalibrationFile` (None without the flag), read before
    any model is loaded; ``ValueError`` naming the flag for a missing file, a file that is not a calibration file,
    or one whose method is not among ``methods`` (what the command runs)."""
    if path is None:
        return None
    from ..per_layer_file import read_per_layer

    try:
        calib = read_per_layer(path)
    except (ValueError, FileNotFoundError) as e:
        raise ValueError(f"{PER_LAYER_FILE}: {e}") from None
    if calib.method not in methods:
        raise ValueError(f"{PER_LAYER_FILE} {path!r}: calibrated for method {calib.method!r}, which is not in {among} "
                         f"{list(methods)}")
    return calib


def with_per_layer_file(options: dict[str, dict], calib, model, model_name: str, methods=None) -> dict[str, dict]:
    """``options`` ({method: {name: value}}) with ``calib``'s ``per_layer`` under its method, after checking the file
    against the loaded ``model`` (``ValueError`` naming the flag: another model, a layer outside it). A ``per_layer``
    given with ``--option`` wins layer by layer. Unchanged without a file or when ``methods`` (what runs on this
    model) leaves the file's method out. Options that differ from the calibration's: one note on stderr."""
    if calib is None or (methods is not None and calib.method not in methods):
        return options
    import torch

    try:
        calib.check(model, model_name=model_name)
    except ValueError as e:
        raise ValueError(f"{PER_LAYER_FILE}: {e}") from None
    mine = dict(options.get(calib.method, {}))
    merged = FileLayers({i: {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in over.items()}
                         for i, over in calib.per_layer.items()})
    for i, over in (mine.get("per_layer") or {}).items():
        merged[i] = {**merged.get(i, {}), **over}
    merged.source = calib.path.rsplit("/", 1)[-1]
    ran = {k: v for k, v in mine.items() if k != "per_layer"}
    cal = {k: v for k, v in calib.options.items() if k != "per_layer"}
    if ran != cal:
        print(f"note: {PER_LAYER_FILE} {calib.path}: calibrated with {calib.method} options {cal or 'the defaults'}, "
              f"run with {ran or 'the defaults'}", file=sys.stderr)
    return {**options, calib.method: {**mine, "per_layer": merged}}
