"""A calibrated ``per_layer`` dict on disk: ``save_per_layer`` / ``load_per_layer`` (docs/quantization.md §12).

The file is safetensors (loads without executing code): tensor values of the dict (e.g. a turbo layer's
``key_scales``, (KV heads, head dim)) are its tensors, named ``layer.<i>.<option>``, and so are its rectangular
nested lists of finite floats (what ``kvslim.calibrate`` gives a turbo layer as ``key_scales``): float64 tensors,
marked so that they load back as the same lists, float for float. Everything else is JSON in its metadata under
``kvslim``: the dict's plain values, the method and its options, the model it was calibrated for (a name, a hash of
the config fields that fix the attention's shape, and the Frobenius norm of every layer's ``k_proj`` weight, which
tells apart two models of one architecture), the calibration text, its token count and the seconds the calibration
took. Format ``kvslim.per_layer/2``; files of ``/1`` (every list in the JSON) still load. ``load_per_layer(path,
model, method)`` refuses, naming what differs, a file for another method or model, a layer outside the model, or a
file that is not a calibration file.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

FORMAT = "kvslim.per_layer/3"
#: formats read_per_layer reads: /1 kept every list in the JSON metadata, /2 marked only tensor and list values
READABLE = ("kvslim.per_layer/1", "kvslim.per_layer/2", FORMAT)
#: config fields that fix a model's attention (and so what a calibration chose for it); absent ones count as None
IDENTITY_KEYS = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size",
                 "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings", "rope_theta",
                 "rope_scaling", "rope_parameters", "partial_rotary_factor", "sliding_window", "layer_types",
                 "attention_bias")
#: relative tolerance of the k_proj weight norms (a bf16 copy of the same weights differs by ~1e-6 relative)
NORM_RTOL = 1e-3
_TENSOR = "__tensor__"  # /1, /2: the mark of a tensor entry
_LIST = "__list__"  # /2: a float64 tensor that loads back as nested lists of floats


def _float_shape(value) -> list[int] | None:
    """The shape of ``value`` when it is a non-empty rectangular nested list of finite Python floats (what float64
    holds exactly), else None (it stays JSON)."""
    if type(value) is float:
        return [] if math.isfinite(value) else None
    if not isinstance(value, list) or not value:
        return None
    shapes = [_float_shape(v) for v in value]
    first = shapes[0]
    if first is None or any(s != first for s in shapes[1:]):
        return None
    return [len(value), *first]


def config_hash(model) -> str:
    """16 hex digits of SHA-256 over the model's :data:`IDENTITY_KEYS` (JSON, sorted)."""
    cfg = model.config.to_dict()
    fields = {k: cfg.get(k) for k in IDENTITY_KEYS}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def k_norms(model) -> list[float] | None:
    """Per decoder layer, the Frobenius norm of ``self_attn.k_proj.weight`` (float64); None without them."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    try:
        return [float(layer.self_attn.k_proj.weight.detach().double().norm()) for layer in layers]
    except (AttributeError, TypeError):
        return None


def _num_layers(model) -> int:
    cfg = model.config
    return getattr(cfg, "num_hidden_layers", None) or len(model.model.layers)


@dataclass(frozen=True)
class CalibrationFile:
    """What a calibration file holds (:func:`read_per_layer`)."""

    path: str
    per_layer: dict
    method: str
    model: str
    config_hash: str
    num_layers: int
    k_norms: list | None = None
    options: dict = field(default_factory=dict)
    text: str | None = None
    tokens: int | None = None
    seconds: float | None = None

    def check(self, model=None, method: str | None = None, model_name: str | None = None) -> None:
        """``ValueError`` naming ``path`` and what differs when the file is for another ``method`` or ``model``
        (config hash, layer count, or a layer's k_proj norm), or names a layer outside ``model``."""
        if method is not None and method != self.method:
            raise ValueError(f"{self.path}: calibrated for method {self.method!r}, not {method!r}")
        if model is None:
            return
        here = model_name or getattr(model.config, "_name_or_path", "") or model.config.model_type
        if config_hash(model) != self.config_hash:
            raise ValueError(f"{self.path}: calibrated for model {self.model!r} (config {self.config_hash}), not "
                             f"this model {here!r} (config {config_hash(model)})")
        n = _num_layers(model)
        outside = sorted(i for i in self.per_layer if i >= n)
        if outside:
            raise ValueError(f"{self.path}: layer(s) {outside} outside this model's {n} layers")
        if n != self.num_layers:
            raise ValueError(f"{self.path}: calibrated for {self.num_layers} layers, this model has {n}")
        mine = k_norms(model)
        if self.k_norms is not None and mine is not None:
            for i, (a, b) in enumerate(zip(self.k_norms, mine)):
                if abs(a - b) > NORM_RTOL * max(abs(a), abs(b), 1e-30):
                    raise ValueError(f"{self.path}: calibrated for model {self.model!r}, whose layer {i} k_proj "
                                     f"weights differ from this model's {here!r} (norm {a:.6g} vs {b:.6g}): the "
                                     "same architecture, other weights")


def _layers(per_layer, n: int) -> dict[int, dict]:
    if not isinstance(per_layer, dict):
        raise ValueError(f"per_layer must be a dict {{layer index: {{option: value}}}}, got {type(per_layer).__name__}")
    for i, over in per_layer.items():
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n:
            raise ValueError(f"per_layer: layer {i!r} is outside the model's {n} layers (ints 0..{n - 1})")
        if not isinstance(over, dict) or not all(isinstance(k, str) for k in over):
            raise ValueError(f"per_layer[{i}] must be a dict {{option name: value}}, got {over!r}")
    return per_layer


def _json(value, what: str) -> str:
    try:
        return json.dumps(value, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what}: must hold JSON values (numbers, strings, lists, dicts) or tensors, got {e}") from None


def save_per_layer(path, per_layer: dict, model, method: str, *, name: str | None = None, options: dict | None = None,
                   text: str | None = None, tokens: int | None = None, seconds: float | None = None) -> Path:
    """Write ``per_layer`` (e.g. ``kvslim.calibrate(model, ids, method)``) for ``model`` and ``method`` to ``path``
    (safetensors; module docstring). ``name``: the model's name in the file and in refusals (default: its
    ``_name_or_path`` or model type). ``ValueError`` naming the argument, nothing written, on a layer outside the
    model or a value that is neither a tensor nor JSON; the file is written whole or not at all."""
    from safetensors.torch import save_file

    n = _num_layers(model)
    _layers(per_layer, n)
    if not isinstance(method, str) or not method:
        raise ValueError(f"method must be a method name, got {method!r}")
    tensors, plain = {}, {}
    for i, over in sorted(per_layer.items()):
        row = {}
        for key, value in over.items():
            if isinstance(value, torch.Tensor):
                tensors[f"layer.{i}.{key}"] = value.detach().cpu().contiguous().clone()
                row[key] = {"tensor": f"layer.{i}.{key}"}
            elif isinstance(value, list) and _float_shape(value) is not None:
                tensors[f"layer.{i}.{key}"] = torch.tensor(value, dtype=torch.float64)
                row[key] = {"list": f"layer.{i}.{key}"}
            else:
                row[key] = {"json": value}
        plain[str(i)] = row
    meta = {"format": FORMAT, "per_layer": plain, "method": method, "options": dict(options or {}),
            "model": name or getattr(model.config, "_name_or_path", "") or model.config.model_type,
            "config_hash": config_hash(model), "num_layers": n, "k_norms": k_norms(model), "text": text,
            "tokens": tokens, "seconds": seconds}
    blob = _json(meta, "per_layer and options")
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"path: {str(path)!r} is a folder; give a file name")
    if not path.parent.is_dir():
        raise ValueError(f"path: no folder {str(path.parent)!r} to write {path.name!r} into")
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"kvslim": blob})
    tmp.replace(path)
    return path


def read_per_layer(path) -> CalibrationFile:
    """The whole calibration file at ``path`` (:class:`CalibrationFile`); ``FileNotFoundError`` naming a missing
    path, ``ValueError`` naming a file that is not a kvslim calibration file."""
    from safetensors import safe_open

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no calibration file {str(p)!r}")
    try:
        with safe_open(str(p), "pt") as f:
            meta = json.loads((f.metadata() or {}).get("kvslim", "null"))
            if not isinstance(meta, dict) or meta.get("format") not in READABLE:
                raise ValueError("no kvslim per_layer metadata")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        per_layer = {}
        for i, row in meta["per_layer"].items():
            per_layer[int(i)] = {k: _value(v, tensors, meta["format"]) for k, v in row.items()}
        return CalibrationFile(path=str(p), per_layer=dict(sorted(per_layer.items())), method=str(meta["method"]),
                               model=str(meta["model"]), config_hash=str(meta["config_hash"]),
                               num_layers=int(meta["num_layers"]), k_norms=meta.get("k_norms"),
                               options=dict(meta.get("options") or {}), text=meta.get("text"),
                               tokens=meta.get("tokens"), seconds=meta.get("seconds"))
    except Exception as e:  # a foreign safetensors file, another format, a truncated or hand-broken file
        raise ValueError(f"{str(p)!r} is not a kvslim calibration file ({type(e).__name__}: {e}); write one with "
                         "kvslim calibrate or kvslim.save_per_layer") from None


def _value(v, tensors: dict, fmt: str):
    """A per_layer value as saved: /3 tags every value (``json``, ``tensor``, ``list``); /1 and /2 marked tensor
    (and /2 list) entries by a ``__tensor__`` / ``__list__`` key and kept the rest as plain JSON."""
    if fmt == FORMAT:
        if not isinstance(v, dict) or len(v) != 1 or next(iter(v)) not in ("json", "tensor", "list"):
            raise ValueError(f"a /3 value must be one of {{'json': v}}, {{'tensor': name}}, {{'list': name}}, got "
                             f"{str(v)[:80]}")
        (kind, x), = v.items()
        return x if kind == "json" else tensors[x] if kind == "tensor" else _float_list(tensors[x], x)
    if isinstance(v, dict) and _TENSOR in v:
        return tensors[v[_TENSOR]]
    if fmt != READABLE[0] and isinstance(v, dict) and _LIST in v:
        return _float_list(tensors[v[_LIST]], v[_LIST])
    return v


def _float_list(t: torch.Tensor, name: str) -> list:
    if t.dtype != torch.float64:
        raise ValueError(f"list entry {name!r} is {t.dtype}, not torch.float64")
    return t.tolist()


def load_per_layer(path, model=None, method: str | None = None) -> dict[int, dict]:
    """The ``per_layer`` dict saved at ``path`` (tensors as saved), for ``kvslim.apply(model, method,
    per_layer=...)``; checked against ``model`` and ``method`` when given (:meth:`CalibrationFile.check`)."""
    calib = read_per_layer(path)
    calib.check(model, method)
    return calib.per_layer
