"""No import cycle between the modules of ``runcell_celery``.

Every import counts: module-level, inside functions, and under ``TYPE_CHECKING``. A
cycle held together by a late import is still a cycle (and the usual reason for a
``noqa: E402``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import runcell_celery

PACKAGE = Path(runcell_celery.__file__).parent
NAME = "runcell_celery"


def module_name(path: Path) -> str:
    parts = [NAME, *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, modules: set[str]) -> Iterator[str]:
    """The package's modules that ``path`` imports, anywhere in its code."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from . import x`` imports module ``x`` if there is one, else ``base``.
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    return {module_name(path): set(imported(path, modules)) for path in paths}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def a_cycle_through(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One concrete cycle inside ``component``, to name in the failure."""
    members = set(component)
    start = component[0]
    path = [start]
    seen = {start}
    while True:
        step = sorted(graph[path[-1]] & members)
        back = [m for m in step if m == start]
        if back and len(path) > 1:
            return [*path, start]
        fresh = [m for m in step if m not in seen]
        if not fresh:
            nxt = next(m for m in step if m in path)
            return [*path[path.index(nxt) :], nxt]
        path.append(fresh[0])
        seen.add(fresh[0])


def test_the_walk_sees_function_level_and_type_checking_imports() -> None:
    graph = import_graph()
    assert "runcell_celery.config" in graph["runcell_celery.memory"]
    assert len(graph) > 50


def test_no_module_of_the_package_imports_itself_back_through_others() -> None:
    graph = import_graph()
    # A module importing names through its own package's ``__init__`` (which imports
    # it back) is a cycle like any other.
    found = cycles(graph)
    shown = "\n".join(" -> ".join(a_cycle_through(c, graph)) for c in found)
    assert not found, f"import cycles:\n{shown}"


def test_no_late_import_is_excused_with_noqa_e402() -> None:
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in sorted(PACKAGE.rglob("*.py"))
        if "noqa: E402" in path.read_text(encoding="utf-8")
    ]
    assert offenders == []
