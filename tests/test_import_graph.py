"""The package's Python import graph has no cycle (issue 28).

Every module under ``src/kvslim`` is parsed with ``ast``; every ``import`` / ``from … import`` statement, at any
depth (function-level imports included: they are a circle too, just a deferred one), becomes an edge to the
module it names, relative imports resolved against the importing module's package. ``from pkg import name``
points at ``pkg.name`` when that is a module, else at ``pkg`` (its ``__init__``). A parent package is not an
implicit edge (``import a.b`` runs ``a/__init__`` first, but a package ``__init__`` that re-exports its modules
would otherwise make every module a cycle with it). Imports under ``if TYPE_CHECKING:`` are edges too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "kvslim"


def _modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``root/package`` (``pkg/__init__.py`` is ``pkg``)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute module that ``from <level dots><name> import …`` in ``module`` names."""
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in its body)."""
    modules = _modules(root, package)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, is_package, node.level, node.module)
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in modules else base)
            for t in targets:
                while t and t not in modules:  # ``import kvslim.caches.storage.x`` -> the longest module prefix
                    t = t.rpartition(".")[0]
                if t and t != module:
                    graph[module].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # recursion depth ≤ the number of modules (~100)
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_graph_sees_relative_and_function_level_imports(tmp_path):
    """The checker itself: a circle closed by a function-level relative import is found; a package that
    re-exports its modules is not a circle by itself."""
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("from .sub.b import g\n\ndef f():\n    return g()\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def g():\n    from .. import a\n    return a\n")
    graph = import_graph(tmp_path, "p")
    assert graph["p"] == {"p.a"} and graph["p.a"] == {"p.sub.b"} and graph["p.sub.b"] == {"p.a"}
    assert cycles(graph) == [["p.a", "p.sub.b"]]
    (pkg / "sub" / "b.py").write_text("def g():\n    return 1\n")
    assert cycles(import_graph(tmp_path, "p")) == []


def test_no_import_cycle_in_kvslim():
    graph = import_graph()
    assert len(graph) > 50 and "kvslim.caches.storage" in graph["kvslim.caches.base"]
    found = cycles(graph)
    if found:
        pytest.fail("import cycles in src/kvslim:\n" + "\n".join(" <-> ".join(c) for c in found))
