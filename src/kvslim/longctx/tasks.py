"""Synthetic long-context retrieval tasks in the style of RULER (issue 34), generated from a seed.

Four tasks, each an :class:`Instance`: sentences inserted into filler text at stated depths (one task per
haystack), a question asked after the filler, the start of the answer (so a greedy answer is easy to parse), and the expected items.

=============  ====================================================================================
passkey        one needle ("The pass key is 52841. Remember it. 52841 is the pass key."), one answer
multikey       four needles "The special magic number for <key> is: <n>." with different keys; the
               question names one of them (the other three are distractors)
multivalue     three needles "One of the special magic values for the <city> archive is: <n>."; every
               value must be reported (any order)
vartrack       a chain "VAR ABCDE = 12345." "VAR FGHIJ = VAR ABCDE." "VAR KLMNO = VAR FGHIJ.": every
               variable holding the value must be reported (variable tracking, one chain of two hops)
=============  ====================================================================================

Filler (:func:`filler_units`): ``stdlib-docs`` (default: prose paragraphs of the docstrings of a pinned list of
pure-Python standard-library modules, without digits or code, split into sentences; about 50,000 Qwen2.5 tokens,
none of the quality benchmark's texts) or ``passkey`` (the classic repeated "The grass is green..." filler).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import itertools
import random
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

#: the tasks, in the order haystacks take them in turn (one task per haystack)
TASKS = ("passkey", "multikey", "multivalue", "vartrack")
#: nominal depths (fraction of the context before the task's first inserted sentence)
DEPTHS = (0.05, 0.275, 0.5, 0.725, 0.95)
#: pure-Python standard-library modules whose docstrings make the ``stdlib-docs`` filler (sorted, pinned)
FILLER_MODULES = (
    "argparse", "calendar", "collections", "configparser", "contextlib", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "email.message", "enum", "fractions", "functools", "gettext", "heapq", "html.parser",
    "http.client", "http.cookiejar", "imaplib", "inspect", "ipaddress", "json", "logging", "mailbox",
    "multiprocessing.pool", "optparse", "pathlib", "pickle", "pprint", "queue", "random", "shutil", "smtplib",
    "socketserver", "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading",
    "typing", "unittest.case", "urllib.request", "uuid", "wave", "xml.dom.minidom", "zipfile")
PASSKEY_FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
                  "There and back again.")
FILLERS = ("stdlib-docs", "passkey")
_ADJ = ("amber", "brisk", "calm", "dusty", "eager", "fuzzy", "gentle", "hollow", "icy", "jolly", "keen", "lucky",
        "mellow", "noble", "olive", "proud", "quiet", "rapid", "silver", "tidy", "upper", "vivid", "wild", "young")
_NOUN = ("anchor", "badger", "candle", "dragon", "engine", "falcon", "garden", "harbor", "island", "jacket",
         "kettle", "lantern", "meadow", "needle", "orchard", "pepper", "quarry", "ribbon", "saddle", "tunnel",
         "violin", "walrus", "yogurt", "zipper")


@dataclass(frozen=True)
class Instance:
    """One task instance: ``inserts`` (depth fraction, sentence) laid into the filler; the ``question`` asked after
    it; ``answer_prefix`` starting the assistant's answer; ``expected`` items (any order); ``pattern``: a regular
    expression finding the items in the answer."""

    task: str
    depth: float
    inserts: tuple[tuple[float, str], ...]
    question: str
    answer_prefix: str
    expected: tuple[str, ...]
    pattern: str


def _number(rng: random.Random) -> str:
    return str(rng.randint(10_000, 99_999))


def _keys(rng: random.Random, n: int) -> list[str]:
    pairs = rng.sample(list(itertools.product(_ADJ, _NOUN)), n)
    return [f"{a}-{b}" for a, b in pairs]


_PLACES = ("Lisbon", "Oslo", "Quito", "Nairobi", "Hanoi", "Lima", "Dakar", "Tbilisi", "Riga", "Accra", "Manila",
           "Bogota", "Tunis", "Zagreb", "Muscat", "Havana", "Kigali", "Yerevan", "Sofia", "Helsinki", "Rabat",
           "Minsk", "Doha", "Tallinn")


def _spread(rng: random.Random, n: int) -> list[float]:
    return [rng.uniform(0.02, 0.98) for _ in range(n)]


def passkey(rng: random.Random, depth: float) -> Instance:
    v = _number(rng)
    return Instance("passkey", depth, ((depth, f"The pass key is {v}. Remember it. {v} is the pass key."),),
                    "What is the pass key mentioned in the provided text?",
                    "The pass key mentioned in the provided text is", (v,), r"\b\d{5}\b")


def multikey(rng: random.Random, depth: float) -> Instance:
    keys, values = _keys(rng, 4), [_number(rng) for _ in range(4)]
    depths = [depth] + _spread(rng, 3)
    inserts = tuple((d, f"The special magic number for {k} is: {v}.") for d, k, v in zip(depths, keys, values))
    return Instance("multikey", depth, inserts,
                    f"What is the special magic number for {keys[0]} mentioned in the provided text?",
                    f"The special magic number for {keys[0]} mentioned in the provided text is", (values[0],),
                    r"\b\d{5}\b")


def multivalue(rng: random.Random, depth: float) -> Instance:
    key, values = f"the {rng.choice(_PLACES)} archive", [_number(rng) for _ in range(3)]
    depths = [depth] + _spread(rng, 2)
    inserts = tuple((d, f"One of the special magic values for {key} is: {v}.") for d, v in zip(depths, values))
    return Instance("multivalue", depth, inserts,
                    f"What are all the special magic values for {key} mentioned in the provided text?",
                    f"The special magic values for {key} mentioned in the provided text are:", tuple(values), r"\b\d{5}\b")


def vartrack(rng: random.Random, depth: float) -> Instance:
    names = ["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)) for _ in range(3)]
    v = _number(rng)
    step = (0.99 - depth) / 3
    inserts = ((depth, f"VAR {names[0]} = {v}."), (depth + step, f"VAR {names[1]} = VAR {names[0]}."),
               (depth + 2 * step, f"VAR {names[2]} = VAR {names[1]}."))
    return Instance("vartrack", depth, inserts,
                    f"Find all variables that are assigned the value {v} in the text above.",
                    f"According to the chain of variable assignments in the text above, 3 variables are assigned "
                    f"the value {v}, they are:", tuple(names), r"\b[A-Z]{5}\b")


MAKERS: dict[str, Callable[[random.Random, float], Instance]] = {
    "passkey": passkey, "multikey": multikey, "multivalue": multivalue, "vartrack": vartrack}


def check_tasks(tasks) -> tuple[str, ...]:
    """``tasks`` as a tuple of known task names; ``ValueError`` naming the unknown ones."""
    tasks = tuple(tasks)
    bad = [t for t in tasks if t not in MAKERS]
    if not tasks or bad:
        raise ValueError(f"tasks must name some of {list(TASKS)}, got unknown {bad or 'nothing'}")
    return tasks


def instances(seed: int, length: int, trial: int, tasks=TASKS) -> list[Instance]:
    """The task instance of one haystack (a one-element list), deterministic in ``(seed, length, trial)``: haystack
    ``i`` holds task ``tasks[i % T]`` only (``T`` tasks, in turn), its first sentence at depth
    ``DEPTHS[(i // T + i % T) % len(DEPTHS)]``: the first ``T`` haystacks put the tasks at ``T`` different depths,
    and ``5 T`` haystacks put every task at every depth once.

    One task per haystack: with all four in one haystack the dense cache answered the multi-value and the
    variable-tracking questions with the pass key's and the multi-key's numbers (docs/longctx.md), a failure that
    says nothing about compression."""
    tasks = check_tasks(tasks)
    rng = random.Random(f"kvslim-longctx:{seed}:{length}:{trial}")
    j = trial % len(tasks)
    return [MAKERS[tasks[j]](rng, DEPTHS[(trial // len(tasks) + j) % len(DEPTHS)])]


def _stdlib_docs() -> list[str]:
    with warnings.catch_warnings():  # looking through typing's attributes warns about typing.io / typing.re
        warnings.simplefilter("ignore", DeprecationWarning)
        return _docstring_sentences()


def _docstring_sentences() -> list[str]:
    units = []
    for name in FILLER_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:  # a trimmed Python installation: the filler's SHA-256 in the record says so
            continue
        docs = [inspect.getdoc(mod) or ""]
        for attr, obj in sorted(vars(mod).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            if inspect.isfunction(obj) or inspect.isclass(obj):
                docs.append(inspect.getdoc(obj) or "")
            if inspect.isclass(obj):
                docs += [inspect.getdoc(f) or "" for n, f in sorted(vars(obj).items())
                         if not n.startswith("_") and inspect.isfunction(f)]
        for doc in docs:
            for para in re.split(r"\n\s*\n", doc):
                para = " ".join(para.split())
                if len(para) > 80 and not re.search(r"[0-9]|>>>|[{}\[\]=]|::|\w\.\w+\(|^-", para):
                    units += [s for s in re.split(r"(?<=[.!?])\s+", para) if s]
    return units


_FILLER_CACHE: dict[str, list[str]] = {}


def filler_units(name: str = "stdlib-docs", text: str | None = None) -> list[str]:
    """Filler sentences: ``name`` one of :data:`FILLERS`, or ``text`` (a user's own text, split into sentences;
    ``name`` is then ignored). ``ValueError`` for an unknown name or a text without sentences."""
    if text is not None:
        units = [s for s in re.split(r"(?<=[.!?])\s+|\n\s*\n", " ".join(text.split(" "))) if s.strip()]
        units = [" ".join(s.split()) for s in units]
        if not units:
            raise ValueError("filler text must hold at least one sentence, got an empty text")
        return units
    if name not in FILLERS:
        raise ValueError(f"filler must be one of {list(FILLERS)}, got {name!r}")
    if name == "passkey":
        return list(PASSKEY_FILLER)
    if name not in _FILLER_CACHE:
        _FILLER_CACHE[name] = _stdlib_docs()
    return list(_FILLER_CACHE[name])


def units_sha256(units: list[str]) -> str:
    return hashlib.sha256("\n".join(units).encode("utf-8")).hexdigest()
