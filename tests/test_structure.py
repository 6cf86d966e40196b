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
PACKAGES = ("grpo_kernels", "grpo", "benchmarks", "tools")


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


def _top_level_names(tree: ast.Module) -> Optional[Set[str]]:
    """Names a module binds at its top level (in if/try/with/for blocks too), or None when it cannot be
    known statically (a star import, a module ``__getattr__``)."""
    names: Set[str] = set()
    blocks = [tree.body]
    while blocks:
        for node in blocks.pop():
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
                if node.name == "__getattr__":
                    return None
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    if alias.name == "*":
                        return None
                    names.add(alias.asname or alias.name.split(".")[0])
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            for field in ("body", "orelse", "finalbody", "handlers"):
                if isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.ExceptHandler)) and getattr(node, field, None):
                    blocks.append(getattr(node, field))
            if isinstance(node, ast.Try):
                blocks.extend(handler.body for handler in node.handlers)
    return names


def missing_module_attributes() -> List[str]:
    """``alias.name`` where ``alias`` is a project module bound by an import (``from .. import
    _validation as V``, ``import grpo.plan as plan``) and the module binds no ``name`` at its top level
    and has no submodule ``name``: an AttributeError waiting for the line to run (a name removed in one
    module and still called from a file whose tests need an optional venv)."""
    modules = _modules()
    bound = {name: _top_level_names(ast.parse(path.read_text(), str(path))) for name, path in modules.items()}
    found = []
    for name, path in modules.items():
        if not name.startswith(("grpo_kernels", "grpo")):
            continue
        is_package = path.name == "__init__.py"
        package = name if is_package else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        aliases: Dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
                stem = ".".join(base + ([node.module] if node.module else [])) if node.level else (node.module or "")
                for alias in node.names:
                    if f"{stem}.{alias.name}" in modules:
                        aliases[alias.asname or alias.name] = f"{stem}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname and alias.name in modules:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                target = aliases[node.value.id]
                names = bound[target]
                if names is not None and node.attr not in names and f"{target}.{node.attr}" not in modules:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr} ({target})")
    return found


def test_every_module_attribute_used_exists():
    assert missing_module_attributes() == []
