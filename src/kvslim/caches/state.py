"""A cache as a tree of plain values and tensors, and back: what ``kvslim.save_cache`` writes (``prompt_cache.py``).

The protocol is the one ``pickle`` and ``copy.deepcopy`` already use on every cache class (caches pickle):
an object's state is ``__getstate__()`` (its ``__dict__`` unless the class says otherwise) and comes back through
``__setstate__`` (e.g. ``SinkStore`` re-making its window a view of ``fp``). What differs from pickle:

* only classes defined under ``kvslim.caches`` are built (by name, ``cls.__new__``): nothing in a file runs code;
* every value is a tagged JSON node (``{"$": kind, ...}``), so no plain value can be mistaken for a tensor, a
  tuple or an object; tensors go to a flat ``{name: tensor}`` dict (safetensors), each once (shared objects and
  tensors are references; a view of a saved contiguous tensor is a view again after loading; a tensor laid out in
  another dimension order, such as a transposed QR factor, is written in memory order and loads with its own
  strides: a matmul's rounding can depend on its operands' layout);
* a layer's ``file_slots()`` (append and ring layers) says how many leading token slots (axis 2) of its stores'
  ``tensors()`` hold data: only those are written, and loading re-allocates the recorded capacity around them
  (zeros, as ``caches/capture.py`` keeps a static layout's free slots), so the buffers have the saved shapes and
  the next write lands where it would have;
* a class's ``file_skip`` names attributes that are not data (a cache's ``plan``): the loader sets them;
* every object node records its class's ``STATE_VERSION`` (1 unless the class says otherwise; a node without one is
  1): a class that keeps an attribute's name but changes what it means bumps it, and a file written at another
  version is refused by name instead of loading silently (``tests/test_state_schema.py`` keeps each class's
  attributes beside its version, so a change of attributes cannot land without a look at it).
"""

from __future__ import annotations

import importlib
import json
import math
import re

import torch

PACKAGE = __package__  # "kvslim.caches"
_LAYER = re.compile(r"\.layers\[(\d+)\]")  # a cache layer's place in a path: cache.layers[3].k_store...
_SCALARS = (type(None), bool, int, float, str)


def state_version(cls: type) -> int:
    """The version of ``cls``'s state (its ``STATE_VERSION``, 1 by default)."""
    return int(getattr(cls, "STATE_VERSION", 1))


class StateError(ValueError):
    """A value this format cannot hold or a node it cannot read; the message names the attribute path."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise StateError(f"unknown dtype {name!r}")
    return dtype


def _memory_order(t: torch.Tensor) -> list[int] | None:
    """For a tensor laid out densely in another dimension order (a transposed QR factor): the permutation that
    makes it contiguous, so that it is written in memory order and loads with its own strides (a matmul's rounding
    can depend on its operands' layout); None for a contiguous tensor or one that is not a permuted dense layout
    (written contiguous)."""
    if t.is_contiguous() or t.dim() < 2:
        return None
    perm = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.shape[d]))
    return perm if t.permute(perm).is_contiguous() else None


class Encoder:
    """One cache (or any tree of kvslim cache objects, lists, dicts, tensors, scalars) -> (tree, tensors)."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self._objects: dict[int, int] = {}  # id(obj) -> reference number
        self._keep: list[object] = []  # keeps encoded objects alive (ids stay unique)
        self._tensor_nodes: dict[int, dict] = {}  # id(tensor) -> its node (a tensor held twice is written once)
        self._trim: dict[int, int] = {}  # id(tensor) -> leading slots (axis 2) worth writing

    def encode(self, value, path: str = "cache"):
        if isinstance(value, float) and not math.isfinite(value):
            return {"$": "float", "v": repr(value)}
        if isinstance(value, _SCALARS):
            return value
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path)
        if isinstance(value, torch.dtype):
            return {"$": "dtype", "v": _dtype_name(value)}
        if isinstance(value, torch.device):
            return {"$": "device", "v": str(value)}
        if isinstance(value, (list, tuple)):
            kind = "list" if isinstance(value, list) else "tuple"
            return {"$": kind, "v": [self.encode(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, dict):
            return {"$": "dict", "v": [[self.encode(k, f"{path} key"), self.encode(v, f"{path}[{k!r}]")]
                                       for k, v in value.items()]}
        return self._object(value, path)

    def _object(self, obj, path: str):
        cls = type(obj)
        if not cls.__module__.startswith(PACKAGE + "."):
            raise StateError(f"{path}: a {cls.__module__}.{cls.__qualname__} is not cache state (only kvslim.caches "
                             "objects, tensors and plain values are written)")
        if id(obj) in self._objects:
            return {"$": "ref", "v": self._objects[id(obj)]}
        ref = self._objects[id(obj)] = len(self._objects)
        self._keep.append(obj)
        slots = obj.file_slots() if callable(getattr(obj, "file_slots", None)) else None
        if slots is not None:
            for store in obj._stores():
                for t in store.tensors():
                    self._trim[id(t)] = slots
        state = obj.__getstate__()
        if not isinstance(state, dict):
            raise StateError(f"{path}: {cls.__qualname__}.__getstate__ gives no dict")
        skip = getattr(cls, "file_skip", ())
        fields = {k: self.encode(v, f"{path}.{k}") for k, v in state.items() if k not in skip}
        return {"$": "obj", "cls": f"{cls.__module__}:{cls.__qualname__}", "ref": ref,
                "ver": state_version(cls), "v": fields}

    def _tensor(self, t: torch.Tensor, path: str):
        if id(t) in self._tensor_nodes:
            return self._tensor_nodes[id(t)]
        slots = self._trim.get(id(t))
        base = t._base
        if slots is not None and t.dim() == 4:
            name = self._add(path, t.detach()[:, :, :slots])
            node = {"$": "tensor", "v": name, "slots": t.shape[2]}
        elif (base is not None and base.is_contiguous() and base.dtype == t.dtype and base._base is None
              and id(base) not in self._trim):
            # a view of another tensor (SinkStore's window behind its sinks): the base once, this as a view of it
            name = self._tensor(base, f"{path}.base")["v"]
            node = {"$": "view", "v": name, "shape": list(t.shape), "stride": list(t.stride()),
                    "offset": t.storage_offset() - base.storage_offset()}
        else:
            perm = _memory_order(t)
            name = self._add(path, t.detach() if perm is None else t.detach().permute(perm))
            node = {"$": "tensor", "v": name} if perm is None else {"$": "tensor", "v": name, "perm": perm}
        self._tensor_nodes[id(t)] = node
        self._keep.append(t)
        return node

    def _add(self, path: str, t: torch.Tensor) -> str:
        """``t`` as a tensor of its own (contiguous, on the CPU, not sharing memory) under a name from ``path``."""
        name = path
        while name in self.tensors:
            name += "'"
        t = t.cpu().contiguous()
        self.tensors[name] = t.clone() if t.untyped_storage().nbytes() != t.numel() * t.element_size() else t
        return name


class Decoder:
    """(tree, tensors) -> objects; tensors and ``torch.device`` values land on ``device``, or, with ``layer_devices``
    (one per layer of a model split over devices, ``device_map``), those under ``layers[i]`` on layer i's."""

    def __init__(self, tensors: dict[str, torch.Tensor], device: torch.device | str = "cpu",
                 layer_devices: list[torch.device] | None = None):
        self.tensors, self.device = tensors, torch.device(device)
        self.layer_devices = layer_devices
        self._objects: dict[int, object] = {}
        self._tensor_objects: dict[str, torch.Tensor] = {}

    def device_for(self, path: str) -> torch.device:
        """The device of what sits at ``path`` (a tensor's name is its path when written)."""
        if self.layer_devices:
            m = _LAYER.search(path)
            if m is not None and int(m.group(1)) < len(self.layer_devices):
                return self.layer_devices[int(m.group(1))]
        return self.device

    def decode(self, node, path: str = "cache"):
        if isinstance(node, _SCALARS):
            return node
        if not isinstance(node, dict) or "$" not in node:
            raise StateError(f"{path}: not a state node: {str(node)[:80]}")
        kind, v = node["$"], node.get("v")
        if kind == "float":
            return float(v)
        if kind == "dtype":
            return _dtype(v)
        if kind == "device":
            return self.device_for(path)
        if kind in ("list", "tuple"):
            out = [self.decode(x, f"{path}[{i}]") for i, x in enumerate(v)]
            return out if kind == "list" else tuple(out)
        if kind == "dict":
            return {self.decode(k, f"{path} key"): self.decode(x, f"{path}[{k!r}]") for k, x in v}
        if kind in ("tensor", "view"):  # the same node twice is the same tensor (one object held twice)
            key = json.dumps(node, sort_keys=True)
            if key not in self._tensor_objects:
                self._tensor_objects[key] = self._tensor(node, path) if kind == "tensor" else self._view(node, path)
            return self._tensor_objects[key]
        if kind == "ref":
            if v not in self._objects:
                raise StateError(f"{path}: reference to object {v}, not defined before")
            return self._objects[v]
        if kind == "obj":
            return self._object(node, path)
        raise StateError(f"{path}: unknown node kind {kind!r}")

    def _view(self, node: dict, path: str) -> torch.Tensor:
        base = self._tensor({"$": "tensor", "v": node["v"]}, path)
        return base.as_strided(node["shape"], node["stride"], base.storage_offset() + node["offset"])

    def _stored(self, name: str, path: str) -> torch.Tensor:
        if name not in self.tensors:
            raise StateError(f"{path}: tensor {name!r} is missing from the file")
        t = self.tensors[name]
        device = self.device_for(name)
        if t.device != device:
            t = self.tensors[name] = t.to(device)
        return t

    def _tensor(self, node: dict, path: str) -> torch.Tensor:
        t = self._stored(node["v"], path)
        perm = node.get("perm")
        if perm is not None:  # written in memory order: back to the original dimension order (a view)
            if sorted(perm) != list(range(t.dim())):
                raise StateError(f"{path}: {perm} is not a permutation of {t.dim()} dimensions")
            return t.permute([perm.index(d) for d in range(t.dim())])
        capacity = node.get("slots")
        if capacity is None:
            return t
        if t.dim() != 4 or capacity < t.shape[2]:
            raise StateError(f"{path}: tensor of shape {tuple(t.shape)} cannot fill {capacity} slots")
        if capacity == t.shape[2]:
            return t
        full = t.new_zeros(t.shape[0], t.shape[1], capacity, t.shape[3])  # zeros: as a static layout's buffers
        full[:, :, :t.shape[2]] = t
        return full

    def _object(self, node: dict, path: str):
        module, _, qualname = str(node.get("cls", "")).partition(":")
        if not module.startswith(PACKAGE + "."):
            raise StateError(f"{path}: class {node.get('cls')!r} is not a kvslim cache class")
        try:
            cls = importlib.import_module(module)
            for part in qualname.split("."):
                cls = getattr(cls, part)
        except (ImportError, AttributeError):
            raise StateError(f"{path}: no class {qualname!r} in {module} (a file from another kvslim)") from None
        if not isinstance(cls, type):
            raise StateError(f"{path}: {node['cls']!r} is not a class")
        written, mine = node.get("ver", 1), state_version(cls)
        if written != mine:
            raise StateError(f"{path}: {qualname} state version {written!r} in the file, this kvslim reads version "
                             f"{mine} (a file from another kvslim)")
        obj = cls.__new__(cls)
        self._objects[node["ref"]] = obj
        state = {k: self.decode(x, f"{path}.{k}") for k, x in node["v"].items()}
        if hasattr(obj, "__setstate__"):
            obj.__setstate__(state)
        else:
            obj.__dict__.update(state)
        return obj
