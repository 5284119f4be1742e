"""Data flows one way (docs/design.md section 2): no import cycle anywhere in ``xengine`` and
``baselines``, and ``xengine`` never imports ``baselines`` (the baselines import xengine; it
names them only by import path in :mod:`xengine.strategies.registry`).

The imports are read from the source with :mod:`ast`, lazy ones inside functions included, so
a cycle hidden in a function body is found too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("xengine", "baselines")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _imported(name: str, path: Path) -> set[str]:
    """Every module name ``name`` imports (absolute or relative, at any depth of the file)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (a name is cut back to the module it is in)."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        deps = set()
        for dep in _imported(name, path):
            while dep and dep not in mods:
                dep = dep.rpartition(".")[0]
            if dep and dep != name:
                deps.add(dep)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_walker_finds_a_cycle_and_a_lazy_import():
    """The checks below can fail: a cycle made by a lazy import inside a function is found."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    src = REPO / "xengine" / "strategies" / "distribute.py"
    assert "xengine.strategies.solve" in _imported("xengine.strategies.distribute", src)


def test_no_import_cycle_in_xengine_and_baselines():
    assert _cycles(_graph()) == []


def test_xengine_never_imports_baselines():
    wrong = sorted(
        (mod, dep)
        for mod, deps in _graph().items()
        if mod.startswith("xengine")
        for dep in deps
        if dep.split(".")[0] == "baselines"
    )
    assert wrong == []


@pytest.mark.parametrize(
    ("lower", "upper"),
    [
        ("xengine.graph", "xengine.profile"),
        ("xengine.graph", "xengine.execute"),
        ("xengine.graph", "xengine.strategies"),
        ("xengine.strategies", "xengine.execute"),
        ("xengine.strategies", "xengine.records"),
        ("xengine.simulate", "xengine.strategies"),
        ("xengine.solvers", "xengine.strategies"),
    ],
)
def test_an_earlier_stage_never_imports_a_later_one(lower, upper):
    """graph -> profile -> problem -> strategies -> simulator -> executor -> records: the stage
    ``lower`` comes first and must not depend on ``upper``."""
    wrong = sorted(
        (mod, dep)
        for mod, deps in _graph().items()
        if mod == lower or mod.startswith(lower + ".")
        for dep in deps
        if dep == upper or dep.startswith(upper + ".")
    )
    assert wrong == []
