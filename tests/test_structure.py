"""The project's module graph has no circle, function-level imports included.

Every ``import`` statement of every module (at any depth: a late import inside a function that dodges a
cycle at load time is still an edge) of ``grpo_kernels``, ``grpo``, ``benchmarks`` and ``tests`` becomes
an edge to the project module it names: ``from .x import y`` to ``x`` (or to ``x.y`` when that is a
module), ``from . import y`` to ``y``, ``import a.b`` to ``a.b``. A circle means that neither module
can be read or changed alone.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Dict, List, Optional, Set

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("grpo_kernels", "grpo", "benchmarks")


def _modules() -> Dict[str, pathlib.Path]:
    """Dotted name -> file, for every project module (tests by their bare names, as pytest imports them)."""
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    for path in (ROOT / "tests").glob("*.py"):
        out[path.stem] = path
    return out


def _resolve(name: str, modules: Dict[str, pathlib.Path]) -> Optional[str]:
    """The longest project module that ``name`` (dotted) starts with, or None (not ours)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def import_graph() -> Dict[str, Set[str]]:
    modules = _modules()
    graph: Dict[str, Set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        package = name if is_package else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: List[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".") if package else []
                    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                targets = [f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in modules else stem for alias in node.names]
            for target in targets:
                resolved = _resolve(target, modules)
                if resolved is not None and resolved != name:
                    graph[name].add(resolved)
    return graph


def circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return found


def test_no_import_cycles():
    graph = import_graph()
    assert "grpo_kernels.functional" in graph and "grpo.trainer" in graph  # (the walk found the project)
    assert circles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    """The check itself: a circle of three and a late (function-level) import are found."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    tree = ast.parse("def f():\n    from .trainer import unwrap\n")
    assert any(isinstance(n, ast.ImportFrom) and n.module == "trainer" for n in ast.walk(tree))
