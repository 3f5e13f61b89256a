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
    cannot be read, names a method outside ``methods`` (what the command runs, called ``among`` in the message) or
    ``dense`` (the reference), or sets a name twice.
    With ``check``, each method's own option check (names, values) runs now, before any model is loaded (checks that
    need the model's shape run at its plan)."""
    out: dict[str, dict] = {}
    for item in items or ():
        head, eq, raw = item.partition("=")
        method, dot, name = head.strip().partition(".")
        name = name.strip()
        if not eq or not dot or not method or not name or not raw.strip():
            raise ValueError(f"{OPTION}: expected METHOD.NAME=VALUE (e.g. turbo3.residual=64), got {item!r}")
        if method == "dense":
            raise ValueError(f"{OPTION} {item!r}: the dense cache takes no options")
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
