"""The project's structure: no import circle, ``grpo`` on ``grpo_kernels``' public surface, no private reach.

Three rules, each with a test that feeds its checker a bad import and sees it flagged:
- the module graph has no circle, function-level imports included (below);
- ``grpo`` imports from ``grpo_kernels`` only the public surface (PUBLIC_MODULES, their ``__all__``);
- no module imports another module's ``_private`` name.

Every ``import`` statement of every module (at any depth: a late import inside a function that dodges a
cycle at load time is still an edge) of ``grpo_kernels``, ``grpo``, ``benchmarks`` and ``tests`` becomes
an edge to the project module it names: ``from .x import y`` to ``x`` (or to ``x.y`` when that is a
module), ``from . import y`` to ``y``, ``import a.b`` to ``a.b``. A circle means that neither module
can be read or changed alone. The other two rules are stated where their checkers begin.
"""

from __future__ import annotations

import ast
import pathlib
import re
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


# --------------------------------------------------------------------------------------------------
# The public surface of grpo_kernels, and nobody's private names
#
# ``grpo`` (the trainer) imports from ``grpo_kernels`` only its public surface: a name in the
# ``__all__`` of one of PUBLIC_MODULES (``from grpo_kernels import x`` needs x in
# ``grpo_kernels.__all__``), or one of those modules itself; docs/api.md ("Public modules") lists the
# same modules. And no project module imports another module's ``_private`` name: ``from .autograd
# import _helper`` or ``mod._helper`` through an imported module is an error; a ``_private`` module
# (``grpo_kernels._validation``) is its package's own: importable inside that package, nowhere else.
# Imports at any depth count (a function's late import too). Tests are exempt: they test internals.

PUBLIC_MODULES = ("grpo_kernels", "grpo_kernels.bounds", "grpo_kernels.options", "grpo_kernels.norm",
                  "grpo_kernels.reference", "grpo_kernels.sizing")
CHECKED_PACKAGES = ("grpo_kernels", "grpo", "benchmarks", "tools")  # (for private names; tests are exempt)


def declared_all(tree: ast.Module) -> Optional[List[str]]:
    """A module's top-level ``__all__`` as written (a literal list or tuple of strings), else None."""
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            value = node.value
            if isinstance(value, (ast.List, ast.Tuple)) and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in value.elts):
                return [e.value for e in value.elts]
            return None
    return None


def public_surface() -> Dict[str, Set[str]]:
    """Public module -> the names of its ``__all__``."""
    modules = _modules()
    return {name: set(declared_all(ast.parse(modules[name].read_text())) or ()) for name in PUBLIC_MODULES}


def _is_private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def _imports(tree: ast.Module, name: str, is_package: bool):
    """Each import of a module's source, at any depth: (line, absolute module, imported name or None,
    the name it binds). ``import a.b`` is (line, "a.b", None, "a"); ``import a.b as c`` binds "c";
    ``from .x import y as z`` is (line, "<package>.x", "y", "z")."""
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None, alias.asname or alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            for alias in node.names:
                yield node.lineno, stem, alias.name, alias.asname or alias.name


def _attribute_chains(tree: ast.Module, bound: Dict[str, str]):
    """(line, module, [attr, ...]) for each ``alias.a.b`` whose alias an import bound to a project module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, value = [], node
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in bound:
                yield node.lineno, bound[value.id], chain[::-1]


def _bindings(tree: ast.Module, name: str, is_package: bool, modules) -> Dict[str, str]:
    """Local name -> the project module an import bound it to (``import a.b`` binds ``a`` to ``a``)."""
    bound = {}
    for _, stem, imported, local in _imports(tree, name, is_package):
        if imported is not None:
            target = f"{stem}.{imported}"
        else:  # (``import a.b as c`` binds c to a.b; ``import a.b`` binds a)
            target = stem if local != stem.split(".")[0] else local
        if target in modules:
            bound[local] = target
    return bound


def _references(tree: ast.Module, name: str, is_package: bool, modules):
    """Each place a module's source names a module or a name in one: (line, module, name or None), from
    its imports (``from m import x``: (line, m, x); ``import m``: (line, m, None)) and from the attribute
    paths through the modules they bind (``m.sub.x``: (line, m.sub, None), (line, m.sub, x))."""
    for line, stem, imported, _ in _imports(tree, name, is_package):
        yield line, stem, imported
    for line, module, chain in _attribute_chains(tree, _bindings(tree, name, is_package, modules)):
        for attr in chain:
            if f"{module}.{attr}" not in modules:
                yield line, module, attr
                break
            module = f"{module}.{attr}"
            yield line, module, None


def surface_violations(source: str, name: str, modules, public: Dict[str, Set[str]],
                       is_package: bool = False, library: str = "grpo_kernels") -> List[str]:
    """Where module ``name`` (its ``source``) reaches ``library`` other than through ``public``: an
    import of a module that is not public, of a name not in its module's ``__all__``, or an attribute
    path (``grpo_kernels.autograd.f`` after ``import grpo_kernels``) that leaves the public surface."""
    tree = ast.parse(source)
    found = []

    def inside(module: str) -> bool:
        return module == library or module.startswith(library + ".")

    def check_module(line: int, module: str) -> None:
        if module not in public:
            found.append(f"{name}:{line}: {module} is not a public module of {library}")

    def check_name(line: int, module: str, attr: str) -> None:
        if f"{module}.{attr}" in modules:
            check_module(line, f"{module}.{attr}")
        elif module not in public:
            check_module(line, module)
        elif attr not in public[module]:
            found.append(f"{name}:{line}: {module}.{attr} is not in {module}.__all__")

    for line, module, attr in _references(tree, name, is_package, modules):
        if inside(module) and attr is None:
            check_module(line, module)
        elif inside(module):
            check_name(line, module, attr)
    return sorted(set(found))


def private_violations(source: str, name: str, modules, is_package: bool = False) -> List[str]:
    """Where module ``name`` imports another module's ``_private`` name (``from .m import _f``, ``m._f``
    through an imported module), or a ``_private`` module from outside the package that holds it."""
    tree = ast.parse(source)
    found = []

    def owner_allows(line: int, dotted: str) -> None:
        """Each ``_part`` of a module path belongs to the package above it: only that package may name it."""
        parts = dotted.split(".")
        for i, part in enumerate(parts):
            if _is_private(part) and i:
                package = ".".join(parts[:i])
                if not (name == package or name.startswith(package + ".")):
                    found.append(f"{name}:{line}: {dotted} is private to {package}")
                    return

    def check_name(line: int, module: str, attr: str) -> None:
        if f"{module}.{attr}" in modules:
            owner_allows(line, f"{module}.{attr}")
        elif _is_private(attr) and module != name:
            found.append(f"{name}:{line}: {module}.{attr} is private to {module}")

    for line, module, attr in _references(tree, name, is_package, modules):
        if _resolve(module, modules) is None:
            continue  # (not ours: the standard library's and third parties' names are theirs to judge)
        owner_allows(line, module)
        if attr is not None:
            check_name(line, module, attr)
    return sorted(set(found))


def _project_sources(packages):
    modules = _modules()
    for name, path in sorted(modules.items()):
        if name.split(".")[0] in packages and path.is_relative_to(ROOT / name.split(".")[0]):
            yield name, path, modules


def test_public_modules_declare_their_surface():
    """Each public module has a literal ``__all__`` of names it binds, and docs/api.md lists exactly them."""
    modules = _modules()
    for name in PUBLIC_MODULES:
        tree = ast.parse(modules[name].read_text())
        names = declared_all(tree)
        assert names, f"{name} has no literal __all__"
        assert len(names) == len(set(names)), f"{name}.__all__ repeats a name"
        bound = _top_level_names(tree)
        missing = [n for n in names if n not in bound and f"{name}.{n}" not in modules]
        assert not missing, f"{name}.__all__ names what it does not define or import: {missing}"
    text = (ROOT / "docs" / "api.md").read_text()
    assert "\n## Public modules\n" in text
    section = text.split("\n## Public modules\n", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^- `(grpo_kernels[\w.]*)`", section, flags=re.M))
    assert listed == set(PUBLIC_MODULES)


def test_grpo_uses_only_public_names_of_grpo_kernels():
    public = public_surface()
    found = []
    for name, path, modules in _project_sources(("grpo",)):
        found += surface_violations(path.read_text(), name, modules, public, is_package=path.name == "__init__.py")
    assert found == []


def test_no_module_imports_another_modules_private_name():
    found = []
    for name, path, modules in _project_sources(CHECKED_PACKAGES):
        found += private_violations(path.read_text(), name, modules, is_package=path.name == "__init__.py")
    assert found == []


def test_the_surface_check_finds_an_internal_import():
    """The check itself: each way of reaching past the surface is flagged, the public ways are not."""
    modules, public = _modules(), public_surface()

    def flagged(source: str) -> List[str]:
        return surface_violations(source, "grpo.plan", modules, public)

    assert flagged("from grpo_kernels.autograd import default_chunk_size\n")  # an internal module
    assert flagged("def f():\n    from grpo_kernels.kernels.torch_rows import tile_columns\n")  # a late import
    assert flagged("from grpo_kernels.options import LogitTransform\n")  # a public module, a name not in __all__
    assert flagged("from grpo_kernels import autograd\n")  # an internal module by from-import
    assert flagged("from grpo_kernels import not_a_public_name\n")  # not in grpo_kernels.__all__
    assert flagged("import grpo_kernels.kernels.torch_norm as tn\n")
    assert flagged("import grpo_kernels\nx = grpo_kernels.autograd.default_chunk_size\n")  # an attribute path
    assert flagged("from grpo_kernels import sizing\nx = sizing.tile_columns_of_old\n")
    assert flagged("from grpo_kernels import options\nx = options._respell\n")
    for good in ("from grpo_kernels import grpo_loss, SamplingMask\n",
                 "def f():\n    from grpo_kernels.sizing import default_chunk_size\n",
                 "from grpo_kernels import sizing\nx = sizing.tile_columns\n",
                 "import grpo_kernels\nx = grpo_kernels.grpo_loss, grpo_kernels.options.IGNORE_INDEX\n",
                 "from grpo.config import GRPOConfig\nimport torch._dynamo\n"):
        assert flagged(good) == [], good


def test_the_private_check_finds_a_private_import(tmp_path):
    """The check itself, on sources written to a file: private names are flagged, a package's own
    private module is not."""
    modules = _modules()

    def flagged(source: str, name: str = "grpo_kernels.vocab_parallel") -> List[str]:
        path = tmp_path / "module.py"
        path.write_text(source)
        return private_violations(path.read_text(), name, modules)

    assert flagged("from .autograd import _chunked_row_stats\n")  # the case issue 46 found
    assert flagged("def f():\n    from grpo_kernels.autograd import _x\n")  # late, absolute
    assert flagged("from . import autograd\ny = autograd._helper\n")  # through the module
    assert flagged("from grpo_kernels import _validation\n", name="grpo.trainer")  # a package's private module
    assert flagged("import grpo_kernels._validation\n", name="benchmarks.kernels")
    assert flagged("from grpo_kernels._validation import check_flag\n", name="tools.aot")
    assert flagged("from ._common import _column\n", name="grpo.rewards.code")
    for good, name in (("from . import _validation as V\nV.check_flag\n", "grpo_kernels.vocab_parallel"),
                       ("from .. import _validation as V\n", "grpo_kernels.integrations.verl"),
                       ("from ._host import TESTED as _TESTED\n", "grpo_kernels.integrations.trl"),
                       ("from torch.utils._foreach_utils import _get_fused_kernels_supported_devices\n", "grpo.precision"),
                       ("from . import autograd\ny = autograd.__name__\n", "grpo_kernels.vocab_parallel")):
        assert flagged(good, name) == [], good
