"""What the judge allows and what one completion's work may cost: the builtins and modules the judge
provides, the caps the planner, the sandbox run and the judge hold to, and the check of trusted code (the
problem's own helpers) against them. :mod:`grpo.rewards.sandbox` says how a verdict is reached.
"""

from __future__ import annotations

import ast
import builtins
from functools import lru_cache

MAX_TEST_CHARS = 100_000  # one test string; longer ones are refused
MAX_PLAN_PASSES = 24  # planning passes over a completion's tests (names moving inside settle in a few)
MAX_RESULT_BYTES = 8 << 20  # the probe records of one run; more and every test of the run fails
JUDGE_SECONDS = 4.0  # wall clock of a judge process (plain values only: it is fast; the margin is for load)
JUDGE_TEST_SECONDS = 1.0  # CPU time of one test's logic inside the judge (decoding not counted)
MAX_SET_ITEMS = 20_000  # a reported set / dict; hash collisions make a big one quadratic

# Builtins the judge provides (on plain values they cannot be fooled); a test that uses one
# the program redefines at top level (``def sum(...)``) is refused.
JUDGE_BUILTINS = frozenset({
    "abs", "all", "any", "ascii", "bin", "bool", "bytes", "chr", "complex", "dict", "divmod",
    "enumerate", "filter", "float", "format", "frozenset", "hex", "int", "isinstance", "iter",
    "len", "list", "map", "max", "min", "next", "oct", "ord", "pow", "range", "repr", "reversed",
    "round", "set", "slice", "sorted", "str", "sum", "tuple", "type", "zip"})
# Pure modules a test may import and use in its own logic (the judge imports them itself).
JUDGE_MODULES = frozenset({"math", "cmath", "collections", "fractions", "decimal", "itertools",
                           "functools", "operator", "string", "statistics", "heapq", "bisect",
                           "re", "copy", "random", "typing", "json", "hashlib", "base64",
                           "binascii", "zlib", "struct", "textwrap", "unicodedata", "datetime",
                           "calendar", "numbers"})
# Judge modules whose values differ from run to run: what a test computes with them is computed
# in the judge only (seeded per job, the same in both judge stages) and sent to the program.
STATEFUL_MODULES = frozenset({"random"})
# Builtins trusted code may use besides JUDGE_BUILTINS (its classes and its errors).
TRUSTED_EXTRA_BUILTINS = frozenset({
    "object", "staticmethod", "classmethod", "property", "super", "callable", "hash",
    "NotImplemented", "Ellipsis", "Exception", "ArithmeticError", "AssertionError",
    "AttributeError", "IndexError", "KeyError", "LookupError", "NotImplementedError",
    "OverflowError", "RuntimeError", "StopIteration", "TypeError", "ValueError",
    "ZeroDivisionError"})
MAX_PROBE_CALLS = 10_000  # step runs (probes and statements) one completion's traced tests may ask for
MAX_ITER_ITEMS = 100_000  # values read from an iterator (a generator) the program returns
ITER_SECONDS = 1.0  # the time spent reading one such iterator; past either cap it is cut
MAX_INPUT_BYTES = 4 << 20  # the encoded inputs of those runs; more and the test is unscorable


def judge_import(st: ast.stmt) -> bool:
    if isinstance(st, ast.Import):
        return all(a.name.partition(".")[0] in JUDGE_MODULES for a in st.names)
    return st.level == 0 and (st.module or "").partition(".")[0] in JUDGE_MODULES and all(
        a.name != "*" for a in st.names)


def stateful_import(st: ast.stmt) -> bool:
    if isinstance(st, ast.Import):
        return any(a.name.partition(".")[0] in STATEFUL_MODULES for a in st.names)
    return (st.module or "").partition(".")[0] in STATEFUL_MODULES


BUILTIN_NAMES = frozenset(dir(builtins))


def check_trusted_code(trusted_code: object) -> tuple[str, tuple[str, ...]] | None:
    """``trusted_code`` checked: ``(source, names it defines)``, or None for None.

    Trusted code is the problem's own helper definitions (for HumanEval-style data, the
    prompt without the function under test); it runs only in the judge, never in the sandbox.
    A function whose body is only a docstring, ``pass``, ``...`` or imports is a declaration
    (the function under test of a whole prompt), not a helper: it is left out. Raises TypeError
    (not a str) or ValueError (too long, does not parse, imports outside
    :data:`JUDGE_MODULES`, reads a builtin outside the judge's, a name or attribute that
    starts with ``_``, or a string with ``__`` in a format field): such a row is unscorable.
    """
    if trusted_code is None:
        return None
    if not isinstance(trusted_code, str):
        raise TypeError(f"trusted_code must be a str or None, got {type(trusted_code).__name__}")
    return _check_trusted(trusted_code)


@lru_cache(maxsize=256)
def _check_trusted(trusted_code: str) -> tuple[str, tuple[str, ...]]:
    if len(trusted_code) > MAX_TEST_CHARS:
        raise ValueError(f"trusted_code is longer than {MAX_TEST_CHARS} characters")
    try:
        tree = ast.parse(trusted_code)
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        raise ValueError(f"trusted_code does not parse ({type(e).__name__}: {e})") from None
    body = [st for st in tree.body if not _declaration(st)]
    tree = ast.Module(body=body, type_ignores=[])
    defined: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
            defined.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(n.name)
        elif isinstance(n, ast.arg):
            defined.add(n.arg)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            if not judge_import(n):
                names = n.module if isinstance(n, ast.ImportFrom) else ", ".join(a.name for a in n.names)
                raise ValueError(f"trusted_code imports {names}: the judge imports only "
                                 f"{', '.join(sorted(JUDGE_MODULES))}")
            defined.update((a.asname or a.name).partition(".")[0] for a in n.names)
    allowed = JUDGE_BUILTINS | TRUSTED_EXTRA_BUILTINS
    for n in ast.walk(tree):
        if (isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in defined
                and n.id not in BUILTIN_NAMES):
            raise ValueError(f"trusted_code reads {n.id}, which it does not define (the "
                             "function under test is the program's, never trusted code's)")
        name = (n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute)
                else n.name if isinstance(n, (ast.FunctionDef, ast.ClassDef)) else None)
        if name is not None and name.startswith("_"):
            raise ValueError(f"trusted_code reads {name}: names and attributes that start with _ "
                             "are not available in the judge")
        if (isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in BUILTIN_NAMES
                and n.id not in allowed and n.id not in defined):
            raise ValueError(f"trusted_code uses {n.id}, which the judge does not provide "
                             "(no input/output, no introspection)")
        if isinstance(n, (ast.AsyncFunctionDef, ast.Await, ast.Global, ast.Nonlocal)):
            raise ValueError(f"trusted_code holds {type(n).__name__}, which the judge does not run")
        if (isinstance(n, ast.Constant) and isinstance(n.value, str) and "{" in n.value
                and "_" in n.value):
            # "{0.__class__}".format(x) reaches what the checks above refuse
            for field_ in n.value.split("{")[1:]:
                head = field_.split("}")[0]
                if ("." in head or "[" in head) and "_" in head:
                    raise ValueError("trusted_code holds a format field that reads an attribute "
                                     f"or item starting with _ ({head[:40]!r})")
    names = tuple(sorted({st.name for st in body if isinstance(st, (ast.FunctionDef, ast.ClassDef))}
                         | {t.id for st in body if isinstance(st, (ast.Assign, ast.AnnAssign))
                            for t in (st.targets if isinstance(st, ast.Assign) else [st.target])
                            for t in ast.walk(t) if isinstance(t, ast.Name)}
                         | {(a.asname or a.name).partition(".")[0] for st in body
                            if isinstance(st, ast.ImportFrom) for a in st.names}))
    return ast.unparse(tree), names


def _declaration(st: ast.stmt) -> bool:
    """A function whose body is only docstrings, ``pass``, ``...`` and imports (a stub)."""
    if not isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    return all(isinstance(b, (ast.Pass, ast.Import, ast.ImportFrom))
               or isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)
               and (isinstance(b.value.value, str) or b.value.value is Ellipsis) for b in st.body)
