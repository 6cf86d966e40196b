"""Run untrusted Python from model completions so that its verdict cannot be forged.

**How a verdict is reached** (the untrusted program never holds what it would need to fake it):

* *stdin/stdout tests*: the program gets the input on stdin; the harness, outside, compares
  its whole stdout with the expected output and requires exit status 0. The expected output
  never enters the sandbox.
* *value tests* -- assert statements of the forms ``assert E == L`` / ``L == E``, ``E != L``,
  ``E is L`` (``L`` a literal, ``ast.literal_eval``-able), ``math.isclose(E, L, ...)`` and
  ``abs(E - L) < L2`` / ``<=``, optionally after setup statements, where ``E`` is
  *program-controlled*: built only from names the test does not bind, calls of such names or
  of a few builtins whose every result the program could return itself (``len``, ``sorted``,
  ``int`` ...), displays, arithmetic and subscripts -- no comparison, lambda, comprehension or
  helper the test defines, since a forged value would skip that logic. Only ``E`` (and the
  setup) enter the sandbox; its value leaves as tagged JSON of exact builtin types (no custom
  ``__eq__``) and the harness compares it with ``L`` outside. A forged value line is then no
  better than returning that value from the solution, and the program never sees ``L``. All
  value tests of a completion run in one process.
* *statement tests* -- every other test: each runs in its own process, after the code; the test
  passes when, after the statement ran without raising, the harness receives a random nonce
  that exists only in a local variable of the bootstrap's frame. Exiting early, printing, or
  writing to descriptors forges nothing. Inside its asserts, ``==`` / ``!=`` go through a
  guard (:func:`guard_statement`) that refuses to call a custom ``__eq__`` against a plain
  value: an "equal to anything" object fails ``assert r == 2``.

**What remains possible** (said plainly): for statement tests the verdict is in-process, so
(1) a CPython memory-safety bug that lets pure Python read its own memory would reveal the
nonce (the known routes are closed: frames via ``sys._getframe``, tracebacks, generators and
coroutines, ``gc``, ``/proc/self/mem`` (no ``/proc`` is mounted), ctypes and the ``_test*``
modules, building code objects, ``marshal``); and
(2) the program can make the statement itself pass by the usual Python means that the guard
does not cover -- monkeypatching what the test calls (builtins, modules), custom ``__eq__``
on *both* sides of a comparison, a truthy object for a bare ``assert check(x)`` -- as in any
harness that runs the test in the program's process. Value tests close (2) for the common
``assert f(x) == literal`` form. In every mode the program may of course print, spin
or crash: that only fails its own tests.

**Containment** (``grpo/rewards/sandbox_bootstrap.py`` builds it; the same on every machine, whether
the trainer runs as root or as an ordinary user, via an unprivileged user namespace):

* new mount, PID, network, IPC and UTS namespaces; the filesystem is a fresh read-only tmpfs
  holding read-only nosuid bind mounts of the Python runtime and system libraries only, a
  minimal ``/dev`` (null, zero, random, urandom), no ``/proc``, and a size-capped private
  ``/tmp`` as working directory. The project tree, the data,
  ``/etc``, the home directories and every writable host directory are simply not there;
* no capabilities: as root the program runs as uid 65534; otherwise as an unprivileged user
  inside a user namespace whose capabilities ``execve`` dropped; ``no_new_privs`` is set;
* rlimits: address space, file size (stdout included), CPU, no new processes or threads
  (``RLIMIT_NPROC = 0``), 64 descriptors; the wall clock is enforced from outside with SIGKILL
  to the process group, and the sandbox dies with its parent (``PR_SET_PDEATHSIG``);
* an audit hook as a second layer (frame / gc / ``/proc`` / directory-descriptor / process /
  socket / ctypes access refused; its state is immutable and unreachable without frames).

If the namespaces cannot be created the run fails closed: :attr:`RunResult.error` is set and
``grpo.rewards`` scores the completion ``None`` (unscorable) instead of running it unconfined.
"""

from __future__ import annotations

import ast
import builtins
import json
import math
import os
import platform
import secrets
import select
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

DEFAULT_MEMORY_MB = 1024
DEFAULT_FILE_MB = 16
DEFAULT_TMP_MB = 64
MAX_OUTPUT_BYTES = DEFAULT_FILE_MB << 20
MAX_VALUE_BYTES = 1 << 20  # one reported value; bigger ones fail their test
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41, "ppc64le": 203, "s390x": 217}
JAIL_FAILED = 97  # see grpo.rewards.sandbox_bootstrap.JAIL_FAILED


@lru_cache(maxsize=1)
def _bootstrap_source() -> str:
    return resources.files("grpo.rewards").joinpath("sandbox_bootstrap.py").read_text(encoding="utf-8")


@lru_cache(maxsize=1)
def _runtime() -> tuple[str, tuple[str, ...]]:
    """The real interpreter (not a venv shim) and the host paths the jail exposes read-only."""
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    paths = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache",
             prefix, os.path.dirname(os.path.dirname(exe))]
    seen: list[str] = []
    for p in paths:
        if os.path.lexists(p) and p != "/" and not any(p == q or p.startswith(q + "/") for q in seen):
            seen.append(p)
    return exe, tuple(seen)


@dataclass
class RunResult:
    """What one sandboxed run produced. ``error``: the sandbox could not be built (fail closed)."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    results: str = ""
    error: str | None = None


def _wait_exit(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait for the process to exit *without reaping it*; False on timeout.

    Keeping the zombie leader around means its process-group id cannot be recycled before we
    have signalled the group.
    """
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        try:
            proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        readable, _, _ = select.select([pidfd], [], [], max(0.0, timeout))
        return bool(readable)
    finally:
        os.close(pidfd)


def _read_capped(f, limit: int = MAX_OUTPUT_BYTES) -> str:
    f.seek(0)
    return f.read(limit).decode("utf-8", errors="replace")


def _memfd(data: bytes, name: str) -> int:
    fd = os.memfd_create(name, 0)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def run(code: str, *, mode: str, run_job: dict | None = None, stdin: str | None = None,
        timeout: float = 5.0, memory_mb: int = DEFAULT_MEMORY_MB,
        file_mb: int = DEFAULT_FILE_MB, audit: bool = True) -> RunResult:
    """Run ``code`` in the jail. ``mode``: ``"stdio"``, ``"values"`` or ``"statement"``
    (``run_job`` carries ``tests`` / ``statement`` and ``nonce``; see the module docstring).
    ``audit=False`` leaves the audit hook out, so tests can check what the OS layers hold alone.

    ``timeout`` is the wall-clock limit of the whole run, interpreter starts included.
    """
    exe, binds = _runtime()
    source = _bootstrap_source()
    run_job = dict(run_job or {}, mode=mode, code=code, audit=bool(audit))
    job = {"binds": list(binds), "python": exe, "source": source, "run_job": json.dumps(run_job),
           "memory_bytes": int(memory_mb) << 20, "file_bytes": int(file_mb) << 20,
           "tmp_bytes": DEFAULT_TMP_MB << 20, "cpu_seconds": int(math.ceil(timeout)) + 1,
           "sys_pivot_root": _SYS_PIVOT_ROOT.get(platform.machine(), 155)}
    fds: list[int] = []
    try:
        job_fd = _memfd(json.dumps(job).encode(), "job")
        fds.append(job_fd)
        stdin_fd = _memfd((stdin or "").encode("utf-8", errors="replace"), "stdin")
        fds.append(stdin_fd)
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
                tempfile.TemporaryFile() as res:
            # Write-only for the sandbox: it must not read back what it (or the harness) wrote.
            res_w = os.open(f"/proc/self/fd/{res.fileno()}", os.O_WRONLY | os.O_APPEND)
            fds.append(res_w)
            proc = subprocess.Popen(
                [exe, "-I", "-S", "-B", "-c", source, "jail", str(job_fd), str(res_w)],
                stdin=stdin_fd, stdout=out, stderr=err, pass_fds=(job_fd, res_w), cwd="/",
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, start_new_session=True,
                close_fds=True)
            for fd in fds:
                os.close(fd)
            fds.clear()
            exited = _wait_exit(proc, timeout)
            # Kill the whole group whether or not the leader exited: nothing may outlive a run
            # (and the jail's PID 1 dies with its parent, PR_SET_PDEATHSIG).
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
            results = _read_capped(res)
            error = None
            if proc.returncode == JAIL_FAILED:
                error = next((ln[2:] for ln in results.splitlines() if ln.startswith("E ")),
                             "sandbox could not be built")
            return RunResult(returncode=proc.returncode if exited else None,
                             stdout=_read_capped(out), stderr=_read_capped(err, 65536),
                             timed_out=not exited, results=results, error=error)
    finally:
        for fd in fds:
            os.close(fd)


class SandboxUnavailable(RuntimeError):
    """The jail could not be built on this machine; nothing was run."""


# --------------------------------------------------------------------------------------------
# stdin/stdout tests
# --------------------------------------------------------------------------------------------


def outputs_match(actual: str, expected: str) -> bool:
    """Whole-output comparison, line by line, trailing whitespace and final blank lines ignored."""
    def lines(s: str) -> list[str]:
        out = [ln.rstrip() for ln in s.splitlines()]
        while out and not out[-1]:
            out.pop()
        return out

    return lines(actual) == lines(expected)


def run_stdio_test(code: str, stdin: str, expected: str, *, timeout: float = 5.0, **kw) -> bool:
    """Pass when the program exits 0 within the timeout and prints exactly ``expected``.

    Raises SandboxUnavailable when the jail cannot be built.
    """
    r = run(code, mode="stdio", stdin=stdin, timeout=timeout, **kw)
    if r.error is not None:
        raise SandboxUnavailable(r.error)
    return not r.timed_out and r.returncode == 0 and outputs_match(r.stdout, expected)


# --------------------------------------------------------------------------------------------
# Assert tests: split into value tests and statement tests
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ValueTest:
    """``prefix`` runs inside; ``expr``'s value comes out; ``check(value)`` decides outside."""

    prefix: str
    expr: str
    op: str  # "==", "!=", "is", "isclose", "absdiff<", "absdiff<="
    expected: object
    extra: tuple = ()  # isclose: (rel_tol, abs_tol); absdiff: (tolerance,)

    def check(self, value: object) -> bool:
        e = self.expected
        try:
            if self.op == "==":
                return bool(value == e)
            if self.op == "!=":
                return bool(value != e)
            if self.op == "is":
                return value is e
            if self.op == "isclose":
                return math.isclose(value, e, rel_tol=self.extra[0], abs_tol=self.extra[1])
            diff = abs(value - e)
            return bool(diff < self.extra[0] if self.op == "absdiff<" else diff <= self.extra[0])
        except Exception:  # noqa: BLE001 - e.g. comparing a str with a float
            return False


def _literal(node: ast.AST) -> tuple[bool, object]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _is_isclose(func: ast.AST) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr == "isclose"
            and isinstance(func.value, ast.Name) and func.value.id == "math") or (
        isinstance(func, ast.Name) and func.id == "isclose")


# Builtins whose every possible result the program could just as well return itself: a forged
# value of ``len(f(x))`` is no better than a solution returning a list of that length.
_TRANSPARENT_BUILTINS = frozenset({"len", "sorted", "list", "tuple", "set", "frozenset", "dict",
                                   "str", "int", "float", "complex", "round", "abs", "sum", "min",
                                   "max", "bool", "reversed", "repr"})
_BUILTIN_NAMES = frozenset(dir(builtins))


def bound_names(tree: ast.AST) -> set[str]:
    """Every name a piece of test code binds (assignments, defs, imports, parameters ...)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).partition(".")[0] for a in node.names)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            names.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            names.add(node.rest)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            names.update(node.names)
    return names


def program_controlled(node: ast.AST, test_names: set[str]) -> bool:
    """Whether every value ``node`` can take is one the solution could produce directly
    (see the module docstring): then reporting it from inside forges nothing."""
    def ok(n: ast.AST) -> bool:
        if isinstance(n, ast.Constant):
            return True
        if isinstance(n, ast.Name):
            return n.id not in test_names
        if isinstance(n, (ast.List, ast.Tuple, ast.Set)):
            return all(ok(e) for e in n.elts)
        if isinstance(n, ast.Dict):
            return all(k is None or ok(k) for k in n.keys) and all(ok(v) for v in n.values)
        if isinstance(n, ast.Starred):
            return ok(n.value)
        if isinstance(n, ast.UnaryOp):
            return not isinstance(n.op, ast.Not) and ok(n.operand)
        if isinstance(n, ast.BinOp):
            return ok(n.left) and ok(n.right)
        if isinstance(n, ast.Subscript):
            return ok(n.value) and ok(n.slice)
        if isinstance(n, ast.Slice):
            return all(p is None or ok(p) for p in (n.lower, n.upper, n.step))
        if isinstance(n, ast.Attribute):
            return ok(n.value)
        if isinstance(n, ast.Call):
            f = n.func
            if isinstance(f, ast.Name):
                if f.id in test_names or (f.id in _BUILTIN_NAMES and f.id not in _TRANSPARENT_BUILTINS):
                    return False
            elif isinstance(f, ast.Attribute):
                # a method of something the program made, or an attribute of a program name
                if not ok(f.value) or (isinstance(f.value, ast.Name) and f.value.id in _BUILTIN_NAMES):
                    return False
            else:
                return False
            return all(ok(a) for a in n.args) and all(ok(k.value) for k in n.keywords)
        return False  # comparisons, bool ops, lambdas, comprehensions, conditionals, walrus ...

    return ok(node)


def split_test(test: str, test_names: set[str] | None = None) -> ValueTest | None:
    """The value-test reading of an assert test, or None (it runs as a statement test).

    ``test_names``: names bound by any test of the same completion (they share a namespace);
    by default those of ``test`` itself.
    """
    try:
        tree = ast.parse(test)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not tree.body or not isinstance(tree.body[-1], ast.Assert):
        return None
    names = bound_names(tree) if test_names is None else test_names
    found = _split_assert(tree)
    if found is None or not program_controlled(ast.parse(found.expr, mode="eval").body, names):
        return None
    return found


def _split_assert(tree: ast.Module) -> ValueTest | None:
    prefix = ast.unparse(ast.Module(body=tree.body[:-1], type_ignores=[])) if tree.body[:-1] else ""
    t = tree.body[-1].test
    if isinstance(t, ast.Compare) and len(t.ops) == 1:
        left, right, op = t.left, t.comparators[0], t.ops[0]
        op_name = {ast.Eq: "==", ast.NotEq: "!=", ast.Is: "is", ast.Lt: "<", ast.LtE: "<="}.get(type(op))
        if op_name in ("==", "!=", "is"):
            ok_r, lit_r = _literal(right)
            ok_l, lit_l = _literal(left)
            if ok_r and not ok_l:
                expr, lit = left, lit_r
            elif ok_l and not ok_r:
                expr, lit = right, lit_l
            else:
                return None
            if op_name == "is" and lit not in (True, False, None):
                return None
            return ValueTest(prefix, ast.unparse(expr), op_name, lit)
        if op_name in ("<", "<="):
            ok_tol, tol = _literal(right)
            if (ok_tol and isinstance(left, ast.Call) and isinstance(left.func, ast.Name)
                    and left.func.id == "abs" and len(left.args) == 1 and not left.keywords
                    and isinstance(left.args[0], ast.BinOp) and isinstance(left.args[0].op, ast.Sub)):
                a, b = left.args[0].left, left.args[0].right
                ok_b, lit_b = _literal(b)
                ok_a, lit_a = _literal(a)
                if ok_b != ok_a:
                    expr, lit = (a, lit_b) if ok_b else (b, lit_a)
                    return ValueTest(prefix, ast.unparse(expr), "absdiff" + op_name, lit, (tol,))
        return None
    if isinstance(t, ast.Call) and _is_isclose(t.func) and len(t.args) == 2:
        kw = {"rel_tol": 1e-9, "abs_tol": 0.0}
        for k in t.keywords:
            ok, v = _literal(k.value)
            if not ok or k.arg not in kw:
                return None
            kw[k.arg] = v
        (ok_a, lit_a), (ok_b, lit_b) = _literal(t.args[0]), _literal(t.args[1])
        if ok_a == ok_b:
            return None
        expr, lit = (t.args[0], lit_b) if ok_b else (t.args[1], lit_a)
        return ValueTest(prefix, ast.unparse(expr), "isclose", lit, (kw["rel_tol"], kw["abs_tol"]))
    return None


_NO_VALUE = object()


def decode_value(v: object, depth: int = 0) -> object:
    """Inverse of the bootstrap's encoder; raises ValueError on anything malformed."""
    if depth > 100:
        raise ValueError("too deep")
    if v is None or isinstance(v, bool):
        return v
    if not isinstance(v, dict) or len(v) != 1:
        raise ValueError("malformed value")
    (tag, x), = v.items()
    if tag == "i" and isinstance(x, str) and len(x) <= 5000:
        return int(x)
    if tag == "f" and isinstance(x, str) and len(x) <= 64:
        return float(x)
    if tag == "c" and isinstance(x, list) and len(x) == 2:
        return complex(decode_value(x[0], depth + 1), decode_value(x[1], depth + 1))
    if tag == "s" and isinstance(x, str):
        return x
    if tag == "b" and isinstance(x, str):
        return bytes.fromhex(x)
    if tag in ("l", "t", "S", "F") and isinstance(x, list):
        items = [decode_value(i, depth + 1) for i in x]
        return {"l": list, "t": tuple, "S": set, "F": frozenset}[tag](items)
    if tag == "d" and isinstance(x, list):
        return {decode_value(k, depth + 1): decode_value(i, depth + 1) for k, i in x}
    raise ValueError("malformed value")


def _value_results(text: str, n: int) -> list[object]:
    """The reported value of each test (``_NO_VALUE`` when missing, repeated or malformed)."""
    values: list[object] = [_NO_VALUE] * n
    seen = [0] * n
    for line in text.splitlines():
        if len(line) > MAX_VALUE_BYTES:
            continue
        try:
            rec = json.loads(line)
            i = rec["i"]
            if type(i) is not int or not 0 <= i < n:
                continue
            seen[i] += 1
            values[i] = decode_value(rec["v"]) if "v" in rec else _NO_VALUE
        except (ValueError, KeyError, TypeError, RecursionError, MemoryError):
            continue
    return [v if c == 1 else _NO_VALUE for v, c in zip(values, seen)]


def assert_jobs(code: str, tests: list[str], *, timeout: float = 5.0, **kw):
    """Assert tests as units of sandboxed work: callables returning ``[(test index, passed)]``
    (value tests share one run, each statement test gets its own; ``timeout`` per run), for a
    caller to run in parallel. A callable raises SandboxUnavailable when the jail cannot be
    built."""
    names: set[str] = set()
    for t in tests:
        try:
            names |= bound_names(ast.parse(t))
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            pass
    split = [split_test(t, names) for t in tests]
    value_idx = [i for i, s in enumerate(split) if s is not None]
    jobs = []
    if value_idx:
        def values_job() -> list[tuple[int, bool]]:
            payload = {"tests": [[split[i].prefix, split[i].expr] for i in value_idx]}
            r = run(code, mode="values", run_job=payload, timeout=timeout, **kw)
            if r.error is not None:
                raise SandboxUnavailable(r.error)
            got = _value_results(r.results, len(value_idx))
            return [(i, v is not _NO_VALUE and split[i].check(v)) for i, v in zip(value_idx, got)]
        jobs.append(values_job)
    for i, s in enumerate(split):
        if s is None:
            def statement_job(i: int = i) -> list[tuple[int, bool]]:
                statement = guard_statement(tests[i])
                if statement is None:
                    return [(i, False)]
                nonce = secrets.token_hex(16)
                r = run(code, mode="statement", run_job={"statement": statement, "nonce": nonce},
                        timeout=timeout, **kw)
                if r.error is not None:
                    raise SandboxUnavailable(r.error)
                return [(i, not r.timed_out and r.returncode == 0
                         and r.results.splitlines() == [nonce])]
            jobs.append(statement_job)
    return jobs


class _GuardEquality(ast.NodeTransformer):
    """``a == b`` / ``a != b`` inside assert statements -> ``__grpo_eq__(a, b, negate)``."""

    def __init__(self) -> None:
        self.in_assert = 0

    def visit_Assert(self, node: ast.Assert) -> ast.AST:
        self.in_assert += 1
        try:
            return self.generic_visit(node)
        finally:
            self.in_assert -= 1

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        node = self.generic_visit(node)
        if self.in_assert and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Eq, ast.NotEq)):
            negate = ast.Constant(isinstance(node.ops[0], ast.NotEq))
            return ast.copy_location(ast.Call(ast.Name("__grpo_eq__", ast.Load()),
                                              [node.left, node.comparators[0], negate], []), node)
        return node


def guard_statement(test: str) -> str | None:
    """The statement test as the body of ``def __grpo_test__(__grpo_eq__)``, its assert
    equalities routed through the bootstrap's guard (a custom object never equals a plain
    value). The guard arrives as an argument, hence as a local or closure cell of every
    function the test defines: the solution cannot rebind it through its globals. None when
    the test does not parse (it then fails)."""
    try:
        tree = ast.parse(test)
        body = _GuardEquality().visit(tree).body or [ast.Pass()]
        fn = ast.FunctionDef(name="__grpo_test__", args=ast.arguments(
            posonlyargs=[], args=[ast.arg("__grpo_eq__")], vararg=None, kwonlyargs=[],
            kw_defaults=[], kwarg=None, defaults=[]), body=body, decorator_list=[], returns=None,
            type_comment=None)
        module = ast.fix_missing_locations(ast.Module(body=[fn], type_ignores=[]))
        source = ast.unparse(module)
        compile(source, "<test>", "exec")
        return source
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None


def capabilities() -> dict:
    """Whether the jail can be built here: ``{"jail": bool, "error": str | None, "root": bool}``."""
    r = run("pass", mode="stdio", timeout=20.0)
    return {"jail": r.error is None and r.returncode == 0, "error": r.error,
            "root": os.geteuid() == 0}
