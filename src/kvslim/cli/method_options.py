"""Method options written on a command line: ``--per-layer 15-24:bits=8`` and ``--turbo rope_centred_keys=false``.

``parse_options("a=1,b=false")`` -> ``{"a": 1, "b": False}`` (values: ``true`` / ``false``, ints, ``none`` for
``rotation``, else the string); ``parse_per_layer(["15-24:bits=8", "0:rotation=hadamard"])`` -> the
``per_layer`` dict of :class:`kvslim.methods.storage.StorageOptions` (``{15: {"bits": 8}, ..., 0: {...}}``).
What the options mean and which values they take is checked by the method itself; this only reads the text,
``ValueError`` naming the flag on text it cannot read.
"""

from __future__ import annotations


def _value(key: str, text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none" and key == "rotation":  # StorageOptions.rotation: None or "hadamard"
        return None
    try:
        return int(text)
    except ValueError:
        return text


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
