"""A completion's assert tests planned (:func:`plan_assert_tests`): each test parsed (HumanEval's
``check(candidate)`` inlined, constant set displays built at run time), split by the planner against the
program until the names that live inside settle, and gathered in an :class:`AssertPlan`; a test's own
refusals (planned without a program: unscorable) told apart from the ones the program causes.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from functools import lru_cache

from .planner import Refused, Planner
from .policy import MAX_PLAN_PASSES, MAX_TEST_CHARS, judge_import, check_trusted_code


@dataclass
class AssertPlan:
    """How the assert tests of one completion are judged.

    ``inside``: per test, the steps the sandbox runs after the program: ``["exec", source]``
    (setup statements) and ``["probe", id, source]`` (an expression whose value is reported);
    for a *traced* test (``pre[i]`` is not None) a dict ``{"steps": [[kind, source, input
    names]]}`` to which the judge's first stage adds the ``trace`` of step runs.
    ``judge``: per test, the test rewritten to read the probes' values (``__grpo_probe__(id)``,
    or ``__grpo_val__`` of a step run for a traced test), run by the judge process on plain
    values; None where the test is refused, with ``refused[i]`` saying why.
    ``pre``: per test, the judge's first stage (the test's judge-side statements, each step of
    the program replaced by a record of the inputs it takes), None for an untraced test.
    ``unscorable``: the refused tests whose refusal is the test's own (planned without any
    program): they score None, not 0. ``prefix``: the unscorable tests judged on the asserts
    before their refused statement (``judge[i]`` is that prefix): failing it fails the test,
    passing it leaves the test unscorable. ``python``: per test, None, or its *Python
    reading*: the judge source where the values the test bound and handed to the program in
    an earlier statement are read back from the sandbox (what Python would see after the
    program changed them in place); a test that fails as written (``judge[i]``, on the
    test's own copies) but passes this way is unscorable.
    """

    inside: list
    judge: list
    refused: dict
    pre: list = field(default_factory=list)
    unscorable: dict = field(default_factory=dict)
    prefix: set = field(default_factory=set)
    python: list = field(default_factory=list)


class _Rename(ast.NodeTransformer):
    def __init__(self, mapping: dict[str, str]):
        self.mapping = mapping

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in self.mapping:
            return ast.copy_location(ast.Name(self.mapping[node.id], node.ctx), node)
        return node


SET_ELEMENT = "__grpo_e__"  # the variable of the set comprehension a constant set display becomes


class _RuntimeConstantSets(ast.NodeTransformer):
    """A set display of constants, ``{'ab', 'cd', 'ef'}`` (or of constant tuples, ``{(1, 'a'), (2, 'b')}``), as
    ``{e for e in ('ab', 'cd', 'ef')}``.

    CPython compiles such a display (three items or more, or any in a ``for``/``in`` position) to a
    frozenset constant, and the constants of a compilation are merged, which rebuilds a frozenset
    from its own iteration order: its order then depends on what else that compilation holds. A
    test split between the sandbox (its probes) and the judge (its other side) is compiled twice,
    differently, so the two sides of ``[f(w) for w in {...}] == [g(w) for w in {...}]`` could
    iterate the set in two orders under one ``PYTHONHASHSEED``, failing a correct program (plain
    Python compiles the test once: both sides share one constant). A set built at run time from a
    tuple inserts in the tuple's order: one order on both sides, whatever the compilation."""

    def visit_Set(self, node: ast.Set) -> ast.AST:
        self.generic_visit(node)
        if not node.elts or not all(_folds_to_constant(e) for e in node.elts):
            return node  # (a display with a name or a starred item is built at run time already)
        comp = ast.SetComp(ast.Name(SET_ELEMENT, ast.Load()), [ast.comprehension(
            ast.Name(SET_ELEMENT, ast.Store()), ast.Tuple(node.elts, ast.Load()), [], 0)])
        return ast.copy_location(comp, node)


def _folds_to_constant(node: ast.AST) -> bool:
    """Whether CPython's compiler folds ``node`` into one constant: constants, and tuples and arithmetic
    of them (``(1, 'a')``, ``-2``)."""
    return all(isinstance(n, (ast.Constant, ast.Tuple, ast.UnaryOp, ast.BinOp, ast.unaryop, ast.operator,
                              ast.expr_context)) for n in ast.walk(node))


def _runtime_constant_sets(tree: ast.Module) -> ast.Module:
    """``tree`` with its constant set displays built at run time (:class:`_RuntimeConstantSets`)."""
    return ast.fix_missing_locations(_RuntimeConstantSets().visit(tree))  # (the same Module, its notes kept)


def _inline_checkers(tree: ast.Module) -> ast.Module:
    """HumanEval's form -- ``def check(candidate): assert candidate(...) == ...`` then
    ``check(f)`` -- as the asserts themselves: each top-level call of such a checker with
    plain names is replaced by the checker's body, its parameters renamed to the arguments.
    A checker qualifies when its body holds only asserts, assignments, loops, ifs, calls,
    imports and ``pass`` (anything else stays a definition, which the planner refuses). The
    names passed to checkers are kept in ``grpo_candidates`` of the result."""
    allowed = (ast.Assert, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.For, ast.If, ast.Import,
               ast.ImportFrom, ast.Pass, ast.Expr)
    checkers = {st.name: st for st in tree.body
                if isinstance(st, ast.FunctionDef) and not st.decorator_list
                and not st.args.vararg and not st.args.kwarg and not st.args.kwonlyargs
                and not st.args.posonlyargs and not st.args.defaults
                and all(isinstance(b, allowed) for b in st.body)
                and not any(isinstance(n, (ast.Return, ast.Yield, ast.YieldFrom, ast.Global,
                                           ast.Nonlocal)) for n in ast.walk(st))}
    if not checkers:
        return tree
    body: list[ast.stmt] = []
    candidates: set[str] = set()
    for st in tree.body:
        if isinstance(st, ast.FunctionDef) and st.name in checkers:
            continue
        call = st.value if isinstance(st, ast.Expr) else None
        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                and call.func.id in checkers and not call.keywords
                and all(isinstance(a, ast.Name) for a in call.args)
                and len(call.args) == len(checkers[call.func.id].args.args)):
            fn = checkers[call.func.id]
            mapping = {p.arg: a.id for p, a in zip(fn.args.args, call.args)}
            candidates |= set(mapping.values())
            for b in fn.body:
                body.append(_Rename(mapping).visit(ast.parse(ast.unparse(b)).body[0]))
            continue
        if any(isinstance(n, ast.Name) and n.id in checkers for n in ast.walk(st)):
            return tree  # the checker is used otherwise: keep it (and refuse the test)
        body.append(st)
    module = ast.Module(body=body, type_ignores=[])
    module.grpo_candidates = candidates
    return module


def top_level_names(code: str) -> set[str]:
    """Names the program binds at module level (those shadow the judge's builtins), bar its
    plain top-level imports of the judge's modules (the same objects in both places)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return set()
    names: set[str] = set()
    judged = {(a.asname or a.name).partition(".")[0]  # the judge binds these to the same objects
              for st in _program_judge_imports(code) for a in st.names}
    for st in tree.body:
        for n in ast.walk(st):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                names.add(n.id)
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).partition(".")[0] for a in n.names)
    return names - judged


def _parse_tests(tests: list[str], trusted: frozenset) -> tuple[dict, dict]:
    """``({i: inlined tree}, {i: reason})``: the tests as statements, or why they cannot be."""
    trees: dict[int, ast.Module] = {}
    refused: dict[int, str] = {}
    for i, t in enumerate(tests):
        if not isinstance(t, str):
            refused[i] = "test is not a str"
            continue
        if len(t) > MAX_TEST_CHARS:
            refused[i] = "test too long"
            continue
        try:
            tree = ast.parse(t)
        except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
            refused[i] = f"test does not parse ({type(e).__name__})"
            continue
        tree = _runtime_constant_sets(_inline_checkers(tree))
        checked = getattr(tree, "grpo_candidates", set()) & trusted
        if checked:
            refused[i] = (f"trusted_code defines {min(checked)}, the function the test checks "
                          "(leave the function under test out of trusted_code)")
            continue
        if not _has_assert(tree.body):
            refused[i] = "no top-level assert (or loop of asserts): nothing to judge"
            continue
        trees[i] = tree
    return trees, refused


def _has_assert(body: list) -> bool:
    return any(isinstance(st, ast.Assert) or isinstance(st, ast.For) and _has_assert(st.body)
               for st in body)


def _plan_trees(code: str, trees: dict, n: int, trusted: frozenset
                ) -> tuple[list, list, list, dict, dict, list]:
    """(inside, judge, pre, refused, refused_at, python) of the parsed tests ``trees`` against
    ``code``."""
    inside: list = [[] for _ in range(n)]
    judge: list = [None] * n
    pre: list = [None] * n
    python: list = [None] * n
    refused: dict[int, str] = {}
    refused_at: dict[int, int | None] = {}
    shadowed, imports = top_level_names(code), _program_judge_imports(code)
    planner = Planner(shadowed, list(trees.values()), trusted)
    # What the program imports from the judge's modules (``from math import isclose``) the
    # judge imports too, so a test's logic through those names runs on the real ones.
    planner.judge_imports |= {(a.asname or a.name).partition(".")[0]
                              for st in imports for a in st.names}
    prologue = "".join(ast.unparse(st) + "\n" for st in imports)
    # Names the program reads move from the judge to the inside: plan until that set is stable.
    for _ in range(min(2 * len(planner.test_names) + 2, MAX_PLAN_PASSES)):
        before = (set(planner.inside_needed), set(planner.pvalued))
        for i, tree in trees.items():
            planner.at = None
            try:
                steps, j, p, _, py = planner.plan(tree)
                inside[i], judge[i], pre[i] = (steps if p is None else {"steps": steps}), j, p
                python[i] = py
                refused.pop(i, None)
                refused_at.pop(i, None)
            except (Refused, RecursionError, ValueError, TypeError, AttributeError) as e:
                inside[i], judge[i], pre[i], python[i] = [], None, None, None
                refused[i] = str(e) if isinstance(e, Refused) else f"unsupported test ({type(e).__name__})"
                refused_at[i] = planner.at
        if (planner.inside_needed, planner.pvalued) == before:
            break
    else:
        if (planner.inside_needed, planner.pvalued) != before:
            # The names that live inside did not settle (a long chain of names, each read by
            # the next): planning stays bounded in the trainer's process; not judged.
            for i in trees:
                inside[i], judge[i], pre[i], python[i] = [], None, None, None
                refused[i] = f"the test's names did not settle in {MAX_PLAN_PASSES} planning passes"
                refused_at[i] = None
    judge = [None if j is None else prologue + j for j in judge]
    pre = [None if p is None else prologue + p for p in pre]
    python = [None if p is None else prologue + p for p in python]
    return inside, judge, pre, refused, refused_at, python


@lru_cache(maxsize=256)
def _own_refusals(tests: tuple, trusted: frozenset) -> tuple[dict, dict]:
    """What the tests alone (planned without a program) cannot be judged for, and where:
    ``({i: reason}, {i: prefix tree or None})``. Cached: a group's completions share tests."""
    trees, refused = _parse_tests(list(tests), trusted)
    _, _, _, own, at, _ = _plan_trees("", trees, len(tests), trusted)
    prefixes = {}
    for i, k in at.items():
        body = trees[i].body[:k] if k is not None else []
        prefixes[i] = ast.Module(body=body, type_ignores=[]) if _has_assert(body) else None
    refused.update(own)
    return refused, prefixes


def plan_assert_tests(code: str, tests: list[str], trusted_code: str | None = None) -> AssertPlan:
    """The :class:`AssertPlan` of ``tests`` (statements) against ``code``. Never raises.

    ``trusted_code``: the problem's own helpers (checked by :func:`check_trusted_code`; bad
    trusted code makes every test unscorable). A test refused when planned without any
    program is the test's own limit (``unscorable``, None); one refused only with this
    program is the program's doing (it fails, as when it redefines a builtin the test uses).
    Plain asserts before the refused statement of an unscorable test are still judged
    (``prefix``): one that fails fails the test; if they pass, the test stays unscorable.
    """
    tests = [t if isinstance(t, str) else None for t in tests]
    n = len(tests)
    try:
        checked = check_trusted_code(trusted_code)
    except (TypeError, ValueError) as e:
        reasons = dict.fromkeys(range(n), str(e))
        return AssertPlan(inside=[[] for _ in range(n)], judge=[None] * n, refused=dict(reasons),
                          pre=[None] * n, unscorable=reasons, python=[None] * n)
    trusted = frozenset(checked[1]) if checked else frozenset()
    own, prefixes = _own_refusals(tuple(tests), trusted)
    trees, refused = _parse_tests(tests, trusted)
    prefix = set()
    for i in own:
        trees.pop(i, None)
        if prefixes.get(i) is not None:
            trees[i] = prefixes[i]
            prefix.add(i)
    inside, judge, pre, mine, _, python = _plan_trees(code, trees, n, trusted)
    refused.update(mine)
    for i in own:
        if i in mine:
            prefix.discard(i)  # its prefix is refused with this program: the program's doing
        else:
            refused[i] = own[i]
    unscorable = {i: own[i] for i in own if i not in mine}
    return AssertPlan(inside=inside, judge=judge, refused=refused, pre=pre,
                      unscorable=unscorable, prefix=prefix, python=python)


def unscorable_tests(tests: list[str], trusted_code: str | None = None) -> dict[int, str]:
    """The tests no program can be judged on, and why (planned without a program: what
    ``code_rewards`` scores None whatever the completion). Never raises."""
    try:
        checked = check_trusted_code(trusted_code)
    except (TypeError, ValueError) as e:
        return dict.fromkeys(range(len(tests)), str(e))
    own, _ = _own_refusals(tuple(tests), frozenset(checked[1]) if checked else frozenset())
    return dict(own)


def _program_judge_imports(code: str) -> list[ast.stmt]:
    """The program's top-level imports from the judge's modules whose names it never rebinds."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return []
    imports = [st for st in tree.body if isinstance(st, (ast.Import, ast.ImportFrom))
               and judge_import(st)]
    counts: dict[str, int] = {}
    for n in ast.walk(tree):
        bound: list[str] = []
        if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
            bound = [n.id]
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound = [n.name]
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            bound = [(a.asname or a.name).partition(".")[0] for a in n.names]
        elif isinstance(n, (ast.Global, ast.Nonlocal)):
            bound = list(n.names)
        elif isinstance(n, ast.arg):
            bound = [n.arg]
        for b in bound:
            counts[b] = counts.get(b, 0) + 1
    return [st for st in imports
            if all(counts.get((a.asname or a.name).partition(".")[0], 0) == 1 for a in st.names)]
