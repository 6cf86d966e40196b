"""Run untrusted Python from model completions so that its verdict cannot be forged.

**How a verdict is reached** (never inside the program's process):

* *stdin/stdout tests*: the program gets the input on stdin; the harness, outside, compares
  its whole stdout with the expected output and requires exit status 0.
* *assert tests* (:func:`plan_assert_tests`): each test is split into judge logic and
  *probes*. A probe is a part of the test that belongs to the program (its calls, its names,
  attributes and methods of what it returned); it is evaluated in the sandbox after the
  program and its value leaves as a record of exact builtin types (None, bool, int, float,
  complex, str, bytes, list, tuple, set, frozenset, dict), headed by a per-run nonce and
  written by primitives bound before the program ran. Everything else -- every assert of the
  test, ``==``/``!=``/``<``, chained comparisons, ``in``, ``is``, ``not``, ``and``/``or``,
  literal methods (``[2].count(...)``), builtins (``len``, ``sorted``, ``isinstance`` ...),
  ``math.isclose``, the test's comprehensions, lambdas and ``for`` loops of asserts -- runs in
  a separate *judge* process (a fresh interpreter under memory/CPU limits and a
  :data:`JUDGE_SECONDS` wall clock that never holds an object of the program) on the decoded
  values. The expected values never enter the sandbox. A test whose logic would have to run
  inside (a helper the test defines, a comparison whose result is passed to the program, a
  ``def check(candidate)``) is refused: it scores 0 and the reason is logged at INFO.
  The trainer's process only ever reads the judge's ``PASS <i>`` lines (bounded).

**What remains possible** (said plainly): a probe's value is whatever the program returns,
so a forged record is no better than returning that value (a stateful program may return
different values on each call); a method of an object the program returned
(``s.pop()``) is the program's, and so is a helper the test calls without defining or importing
it itself (a test's ``isclose(...)`` where the program defines ``isclose``) -- as in Python; but
a test using a builtin or judge module the program redefines is refused. Not judged (refused):
``try``/``with``/``if``/``while`` statements in a test, helper functions it defines (other than
HumanEval's ``check(candidate)``), and values of the test's own lambdas passed to the program. Forging a record needs the nonce, which lives only in a local
of the bootstrap's frame: a CPython memory-safety bug that lets pure Python read its own
memory would reveal it (the known routes stay closed: frames, tracebacks, generators, ``gc``,
``/proc``, ctypes and the ``_test*`` modules, code objects, ``marshal``). Refused inside, and
why: new processes and threads (``os.fork``/``exec``/``subprocess``/``multiprocessing``,
``threading.Thread.start``, ``concurrent.futures``: RLIMIT_NPROC and the hook), signals to
other processes, sockets (``socket``, ``asyncio``'s event loop, ``http``, ``urllib``: no
network exists), ctypes and raw memory, directory descriptors (``tempfile``'s
``TemporaryDirectory``/``NamedTemporaryFile``, ``shutil.rmtree``'s fd walk, ``os.open`` of a
directory) because they would serve as ``dir_fd`` for paths the hook cannot resolve, ``/proc``,
``sys._getframe``/``inspect.currentframe`` and ``traceback`` frame walks (they would reach the
nonce; ``namedtuple``, ``enum``, ``typing`` and ``logging`` cope), and ``marshal`` (the standard
library is imported from source, ``-X pycache_prefix``). Every other pure-Python standard
library module imports and works (tests/rewards_corpus.py: 60 solutions over heapq, bisect,
typing, dataclasses, fractions, random, datetime, decimal, statistics, enum, re, json ...).
In every mode the program may print, spin or crash: that only fails its own tests.

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
import logging
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
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41, "ppc64le": 203, "s390x": 217}
log = logging.getLogger(__name__)
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
    results_bytes: bytes = b""  # the raw result descriptor (capped), for the judge


def _end_group(proc: subprocess.Popen, fds: list, timeout: float) -> bool:
    """Close the parent's copies of the child's descriptors ``fds`` (emptied), wait up to ``timeout``
    seconds for the leader, then kill its whole process group whether or not the leader exited:
    nothing may outlive a run (and the jail's PID 1 dies with its parent, PR_SET_PDEATHSIG).
    The leader is reaped last; True when it exited in time."""
    for fd in fds:
        os.close(fd)
    fds.clear()
    exited = _wait_exit(proc, timeout)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    return exited


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
            exited = _end_group(proc, fds, timeout)
            res.seek(0)
            raw = res.read(MAX_RESULT_BYTES + 1)
            results = raw[:65536].decode("utf-8", errors="replace")
            error = None
            if proc.returncode == JAIL_FAILED:
                error = next((ln[2:] for ln in results.splitlines() if ln.startswith("E ")),
                             "sandbox could not be built")
            return RunResult(returncode=proc.returncode if exited else None,
                             stdout=_read_capped(out), stderr=_read_capped(err, 65536),
                             timed_out=not exited, results=results, error=error,
                             results_bytes=raw)
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
# Assert tests: the test's logic runs in the judge, the program only supplies plain values
# --------------------------------------------------------------------------------------------

MAX_TEST_CHARS = 100_000  # one test string; longer ones are refused
MAX_RESULT_BYTES = 8 << 20  # the probe records of one run; more and every test of the run fails
JUDGE_SECONDS = 2.0  # wall clock of the judge process (plain values only: it is fast)
JUDGE_TEST_SECONDS = 0.5  # one test inside the judge
MAX_SET_ITEMS = 20_000  # a reported set / dict; hash collisions make a big one quadratic
PROBE = "__grpo_probe__"

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
                           "re", "copy"})
# Constructs that are test logic: inside the program's process their outcome would be the
# program's to decide, so code that runs there (setup, probes) may not hold them.
_LOGIC = (ast.Compare, ast.BoolOp, ast.IfExp, ast.Lambda, ast.ListComp, ast.SetComp,
          ast.DictComp, ast.GeneratorExp, ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom)


class Refused(Exception):
    """A test whose verdict could not be reached outside the program's process (it scores 0)."""


@dataclass
class AssertPlan:
    """How the assert tests of one completion are judged.

    ``inside``: per test, the steps the sandbox runs after the program: ``["exec", source]``
    (setup statements) and ``["probe", id, source]`` (an expression whose value is reported).
    ``judge``: per test, the test rewritten to read the probes' values (``__grpo_probe__(id)``),
    run by the judge process on plain values; None where the test is refused, with
    ``refused[i]`` saying why.
    """

    inside: list
    judge: list
    refused: dict


def _names_loaded(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _target_names(t: ast.AST) -> set[str] | None:
    """Names bound by a plain assignment target, None for subscripts / attributes."""
    if isinstance(t, ast.Name):
        return {t.id}
    if isinstance(t, (ast.Tuple, ast.List)):
        out: set[str] = set()
        for e in t.elts:
            sub = _target_names(e.value if isinstance(e, ast.Starred) else e)
            if sub is None:
                return None
            out |= sub
        return out
    return None


class _Planner:
    """Splits each assert test into harness logic and program-controlled probes.

    An expression is *H* (the judge computes it: constants, the judge's builtins and modules,
    names the test binds to judge-side values, the test's own lambdas and comprehensions),
    *P* (the program's: its names and what is called, indexed by attribute or called on them)
    or *M* (judge logic over P parts). Every P part directly under judge logic becomes a probe:
    evaluated inside, its value leaves as plain data, and comparisons, membership, ``count``,
    ``isinstance`` ... run in the judge on that data.
    """

    def __init__(self, program_names: set[str], tests: list[ast.Module]):
        self.shadowed = program_names
        self.tests = tests
        self.test_names: set[str] = set()  # names test assignments bind
        self.judge_imports: set[str] = set()
        for tree in tests:
            for st in tree.body:
                if isinstance(st, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                    for t in (st.targets if isinstance(st, ast.Assign) else [st.target]):
                        self.test_names |= _target_names(t) or set()
                elif isinstance(st, (ast.Import, ast.ImportFrom)):
                    if _judge_import(st):
                        self.judge_imports |= {(a.asname or a.name).partition(".")[0]
                                               for a in st.names}
        self.inside_needed: set[str] = set()
        self.vector: dict | None = None  # the enclosing single-generator comprehension

    # ---- classification -----------------------------------------------------------------
    def judge_name(self, name: str, local: frozenset) -> bool:
        if name in local:
            return True
        if name in self.shadowed:
            if name in JUDGE_BUILTINS or name == "math" or name in self.judge_imports:
                # The test's logic would call the program's version of a builtin: refused.
                raise Refused(f"the program redefines {name}, which the test uses")
            return False
        if name in self.test_names:
            return name not in self.inside_needed
        return name in JUDGE_BUILTINS or name in self.judge_imports or name == "math"

    def expr(self, node: ast.AST, local: frozenset) -> tuple[str, ast.AST]:
        """(kind, node): P nodes come back as they are, H/M nodes rewritten for the judge."""
        if isinstance(node, ast.Constant):
            return "H", node
        if isinstance(node, ast.Name):
            return ("H" if self.judge_name(node.id, local) else "P"), node
        if isinstance(node, (ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom)):
            raise Refused(f"{type(node).__name__} in a test")
        if isinstance(node, ast.Attribute):
            k, v = self.expr(node.value, local)
            if k == "P":
                return "P", node
            return k, ast.Attribute(v, node.attr, ast.Load())
        if isinstance(node, ast.Call):
            kf, f = self.expr(node.func, local)
            if kf == "P":
                return "P", node
            kinds, args, keywords = [kf], [], []
            for a in node.args:
                k, v = self.child(a, local)
                kinds.append(k)
                args.append(v)
            for kw in node.keywords:
                k, v = self.child(kw.value, local)
                kinds.append(k)
                keywords.append(ast.keyword(kw.arg, v))
            return _mix(kinds), ast.Call(f, args, keywords)
        if isinstance(node, ast.Lambda):
            inner = local | {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
            k, body = self.child(node.body, frozenset(inner))
            return k, ast.Lambda(node.args, body)
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            return self.comprehension(node, local)
        # Every other expression is judge logic over its children.
        kinds: list[str] = []

        def rebuild(value):
            if isinstance(value, ast.expr) and not isinstance(value, ast.expr_context):
                k, v = self.child(value, local)
                kinds.append(k)
                return v
            if isinstance(value, list):
                return [rebuild(x) for x in value]
            if isinstance(value, ast.keyword):
                return ast.keyword(value.arg, rebuild(value.value))
            return value

        fields = {name: rebuild(getattr(node, name)) for name in node._fields}
        return _mix(kinds), type(node)(**fields)

    def comprehension(self, node: ast.AST, local: frozenset) -> tuple[str, ast.AST]:
        """The test's own comprehension runs in the judge. With one generator, a program part
        that reads its variable becomes a *vector probe*: ``[part for target in iter]``
        evaluated inside, read back by position (``enumerate`` in the judge)."""
        if any(g.is_async for g in node.generators):
            raise Refused("async comprehension in a test")
        kinds, gens, inner = [], [], set(local)
        saved = self.vector
        single = len(node.generators) == 1
        index = "__grpo_i%d__" % len(local)
        for g in node.generators:
            names = _target_names(g.target)
            if names is None:
                raise Refused("comprehension target that is not a name")
            ki, it = self.child(g.iter, frozenset(inner))
            kinds.append(ki)
            self.vector = ({"vars": names, "outer": frozenset(inner), "target": g.target,
                            "iter": g.iter, "index": index, "used": False} if single else None)
            inner |= names
            ifs = []
            for c in g.ifs:
                kc, vc = self.child(c, frozenset(inner))
                kinds.append(kc)
                ifs.append(vc)
            gens.append([g.target, it, ifs])
        fz = frozenset(inner)
        if isinstance(node, ast.DictComp):
            kk, key = self.child(node.key, fz)
            kv, val = self.child(node.value, fz)
            kinds += [kk, kv]
        else:
            ke, elt = self.child(node.elt, fz)
            kinds.append(ke)
        vector, self.vector = self.vector, saved
        # (the ifs of the single generator were planned with its vector context too)
        comps = [ast.comprehension(_as_store(t), it, ifs, 0) for t, it, ifs in gens]
        if single and vector["used"]:
            t, it, ifs = gens[0]
            comps = [ast.comprehension(ast.Tuple([ast.Name(index, ast.Store()), _as_store(t)],
                                                 ast.Store()),
                                       ast.Call(ast.Name("enumerate", ast.Load()), [it], []), ifs, 0)]
        if isinstance(node, ast.DictComp):
            return _mix(kinds), ast.DictComp(key, val, comps)
        return _mix(kinds), type(node)(elt, comps)

    def child(self, node: ast.AST, local: frozenset) -> tuple[str, ast.AST]:
        """A child of judge logic: a P child becomes a probe (H / M after this)."""
        k, v = self.expr(node, local)
        if k != "P":
            return k, v
        return "M", self.probe(node, local)

    def probe(self, node: ast.AST, local: frozenset) -> ast.AST:
        v = self.vector
        pid = len(self.probes)
        if v is not None and _names_loaded(node) & v["vars"]:
            # A vector probe: the part for every element of the comprehension's iterable.
            self.reads(node, v["outer"])
            self.reads(v["iter"], v["outer"])
            if _names_loaded(node) & (local - v["vars"] - v["outer"]):
                raise Refused("a value of the test's own lambda would be passed to the program")
            source = ast.unparse(ast.ListComp(node, [ast.comprehension(v["target"], v["iter"], [], 0)]))
            v["used"] = True
            self.probes.append(source)
            self.steps.append(["probe", pid, source])
            return ast.Subscript(ast.Call(ast.Name(PROBE, ast.Load()), [ast.Constant(pid)], []),
                                 ast.Name(v["index"], ast.Load()), ast.Load())
        self.reads(node, local)
        self.probes.append(ast.unparse(node))
        self.steps.append(["probe", pid, self.probes[-1]])
        return ast.Call(ast.Name(PROBE, ast.Load()), [ast.Constant(pid)], [])

    def inside(self, node: ast.AST, local: frozenset = frozenset()) -> None:
        """``node`` runs in the program's process: no test logic in it, no judge-local names;
        the test names it reads must exist there."""
        for n in ast.walk(node):
            if isinstance(n, _LOGIC) or (isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not)):
                raise Refused(f"test logic ({type(n).__name__}) would run in the program's process")
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in _BUILTIN_NAMES \
                    and n.func.id not in self.shadowed and any(
                        not self.judge_only(a) for a in n.args + [k.value for k in n.keywords]):
                raise Refused(f"builtin {n.func.id}() over the program's values would run in its process")
        self.reads(node, local)

    def reads(self, node: ast.AST, local: frozenset) -> None:
        """``node`` is evaluated inside (a probe's value is the program's whatever it holds)."""
        used = _names_loaded(node)
        if used & local:
            raise Refused("a value of the test's own loop or lambda would be passed to the program")
        self.inside_needed |= used & self.test_names

    def judge_only(self, node: ast.AST) -> bool:
        """Whether ``node`` reads nothing of the program (constants and judge names only)."""
        return all(n in self.test_names or self.judge_name(n, frozenset())
                   for n in _names_loaded(node))

    # ---- statements -----------------------------------------------------------------------
    def plan(self, tree: ast.Module) -> tuple[list, str]:
        self.steps, self.probes, self.vector = [], [], None
        judge: list[ast.stmt] = []
        for st in tree.body:
            if isinstance(st, ast.Assert):
                k, test = self.child(st.test, frozenset())
                judge.append(ast.Assert(test, None))
            elif isinstance(st, (ast.Import, ast.ImportFrom)):
                self.steps.append(["exec", ast.unparse(st)])
                if _judge_import(st):
                    judge.append(st)
            elif isinstance(st, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                judge.extend(self.assignment(st))
            elif isinstance(st, ast.Expr):
                call = st.value
                if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                        and call.func.id == "print" and "print" not in self.shadowed):
                    # print's arguments go nowhere the judge reads: run it (for the calls'
                    # effects), exempt from the rule on builtins.
                    self.reads(call, frozenset())
                else:
                    self.inside(st.value)
                self.steps.append(["exec", ast.unparse(st)])
            elif isinstance(st, ast.For) and not st.orelse and all(
                    isinstance(b, (ast.Assert, ast.Pass)) for b in st.body):
                judge.append(self.loop(st))
            elif isinstance(st, ast.Pass):
                continue
            else:
                raise Refused(f"{type(st).__name__} statement in a test (only asserts, "
                              "assignments, imports and calls are judged)")
        module = ast.fix_missing_locations(ast.Module(body=judge or [ast.Pass()], type_ignores=[]))
        return self.steps, ast.unparse(module)

    def loop(self, st: ast.For) -> ast.stmt:
        """``for t in iter: assert ...`` in the judge, its program parts as vector probes."""
        names = _target_names(st.target)
        if names is None:
            raise Refused("loop target that is not a name")
        _, it = self.child(st.iter, frozenset())
        index = "__grpo_i0__"
        self.vector = {"vars": names, "outer": frozenset(), "target": st.target,
                       "iter": st.iter, "index": index, "used": False}
        body = []
        for b in st.body:
            if isinstance(b, ast.Assert):
                body.append(ast.Assert(self.child(b.test, frozenset(names))[1], None))
        vector, self.vector = self.vector, None
        target, it_ = _as_store(st.target), it
        if vector["used"]:
            target = ast.Tuple([ast.Name(index, ast.Store()), target], ast.Store())
            it_ = ast.Call(ast.Name("enumerate", ast.Load()), [it], [])
        return ast.For(target, it_, body or [ast.Pass()], [], None)

    def assignment(self, st: ast.stmt) -> list[ast.stmt]:
        targets = st.targets if isinstance(st, ast.Assign) else [st.target]
        value = st.value
        if value is None:  # a bare annotation
            return []
        names = [_target_names(t) for t in targets]
        if any(n is None for n in names):  # d[k] = v, o.a = v: a mutation of program state
            self.inside(st)
            self.steps.append(["exec", ast.unparse(st)])
            return []
        bound = set().union(*names)
        if isinstance(st, ast.AugAssign):
            value = ast.BinOp(ast.Name(st.target.id, ast.Load()), st.op, value)
            targets = [ast.Name(st.target.id, ast.Store())]
        if bound & self.inside_needed:
            # The program reads these names: bind them inside (the judge reads them back).
            if not bound <= self.inside_needed:
                raise Refused("an assignment binds names both the program and the judge need")
            self.inside(value)
            self.steps.append(["exec", _stmt_source(ast.Assign(targets, value, None))])
            return []
        k, v = self.child(value, frozenset())
        return [ast.Assign([_as_store(t) for t in targets], v, None)]


def _stmt_source(st: ast.stmt) -> str:
    return ast.unparse(ast.fix_missing_locations(ast.Module(body=[st], type_ignores=[])))


def _as_store(t: ast.AST) -> ast.AST:
    if isinstance(t, ast.Name):
        return ast.Name(t.id, ast.Store())
    if isinstance(t, ast.Starred):
        return ast.Starred(_as_store(t.value), ast.Store())
    return type(t)([_as_store(e) for e in t.elts], ast.Store())


class _Rename(ast.NodeTransformer):
    def __init__(self, mapping: dict[str, str]):
        self.mapping = mapping

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in self.mapping:
            return ast.copy_location(ast.Name(self.mapping[node.id], node.ctx), node)
        return node


def _inline_checkers(tree: ast.Module) -> ast.Module:
    """HumanEval's form -- ``def check(candidate): assert candidate(...) == ...`` then
    ``check(f)`` -- as the asserts themselves: each top-level call of such a checker with
    plain names is replaced by the checker's body, its parameters renamed to the arguments.
    A checker qualifies when its body holds only asserts, assignments, loops of asserts,
    imports and ``pass`` (anything else stays a definition, which the planner refuses)."""
    allowed = (ast.Assert, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.For, ast.Import,
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
            for b in fn.body:
                body.append(_Rename(mapping).visit(ast.parse(ast.unparse(b)).body[0]))
            continue
        if any(isinstance(n, ast.Name) and n.id in checkers for n in ast.walk(st)):
            return tree  # the checker is used otherwise: keep it (and refuse the test)
        body.append(st)
    return ast.Module(body=body, type_ignores=[])


def _judge_import(st: ast.stmt) -> bool:
    if isinstance(st, ast.Import):
        return all(a.name.partition(".")[0] in JUDGE_MODULES for a in st.names)
    return st.level == 0 and (st.module or "").partition(".")[0] in JUDGE_MODULES and all(
        a.name != "*" for a in st.names)


def _mix(kinds: list[str]) -> str:
    return "H" if all(k == "H" for k in kinds) else "M"


_BUILTIN_NAMES = frozenset(dir(builtins))


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


def plan_assert_tests(code: str, tests: list[str]) -> AssertPlan:
    """The :class:`AssertPlan` of ``tests`` (statements) against ``code``. Never raises."""
    n = len(tests)
    inside: list = [[] for _ in range(n)]
    judge: list = [None] * n
    refused: dict[int, str] = {}
    trees: dict[int, ast.Module] = {}
    for i, t in enumerate(tests):
        if len(t) > MAX_TEST_CHARS:
            refused[i] = "test too long"
            continue
        try:
            tree = ast.parse(t)
        except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
            refused[i] = f"test does not parse ({type(e).__name__})"
            continue
        tree = _inline_checkers(tree)
        if not any(isinstance(st, ast.Assert) or isinstance(st, ast.For) and any(
                isinstance(b, ast.Assert) for b in st.body) for st in tree.body):
            refused[i] = "no top-level assert (or loop of asserts): nothing to judge"
            continue
        trees[i] = tree
    shadowed, imports = top_level_names(code), _program_judge_imports(code)
    planner = _Planner(shadowed, list(trees.values()))
    # What the program imports from the judge's modules (``from math import isclose``) the
    # judge imports too, so a test's logic through those names runs on the real ones.
    planner.judge_imports |= {(a.asname or a.name).partition(".")[0]
                              for st in imports for a in st.names}
    prologue = "".join(ast.unparse(st) + "\n" for st in imports)
    # Names the program reads move from the judge to the inside: plan until that set is stable.
    for _ in range(len(planner.test_names) + 2):
        before = set(planner.inside_needed)
        for i, tree in trees.items():
            try:
                inside[i], judge[i] = planner.plan(tree)
                refused.pop(i, None)
            except (Refused, RecursionError, ValueError, TypeError, AttributeError) as e:
                inside[i], judge[i] = [], None
                refused[i] = str(e) if isinstance(e, Refused) else f"unsupported test ({type(e).__name__})"
        if planner.inside_needed == before:
            break
    judge = [None if j is None else prologue + j for j in judge]
    return AssertPlan(inside=inside, judge=judge, refused=refused)


def _program_judge_imports(code: str) -> list[ast.stmt]:
    """The program's top-level imports from the judge's modules whose names it never rebinds."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return []
    imports = [st for st in tree.body if isinstance(st, (ast.Import, ast.ImportFrom))
               and _judge_import(st)]
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


def assert_jobs(code: str, tests: list[str], *, timeout: float = 5.0, **kw):
    """Assert tests as units of sandboxed work: callables returning ``[(test index, passed)]``.

    All tests of a completion share one sandboxed run (``timeout``) that reports the probes'
    values, then one judge run (:data:`JUDGE_SECONDS`) that decides every test on those values.
    A refused test (:func:`plan_assert_tests`) fails, its reason logged at INFO. A callable
    raises SandboxUnavailable when the jail cannot be built.
    """
    plan = plan_assert_tests(code, tests)
    for i, why in sorted(plan.refused.items()):
        log.info("assert test %d refused (scored 0): %s", i, why)
    judged = [i for i, j in enumerate(plan.judge) if j is not None]

    def job() -> list[tuple[int, bool]]:
        verdicts = dict.fromkeys(range(len(tests)), False)
        if judged:
            nonce = secrets.token_hex(16)
            r = run(code, mode="probes", timeout=timeout, **kw,
                    run_job={"tests": [plan.inside[i] for i in judged], "nonce": nonce})
            if r.error is not None:
                raise SandboxUnavailable(r.error)
            passed = judge([plan.judge[i] for i in judged], r.results_bytes, nonce)
            for k, i in enumerate(judged):
                verdicts[i] = passed[k]
        return list(verdicts.items())

    return [job]


def judge(sources: list[str], results: bytes, nonce: str) -> list[bool]:
    """Run the judge stage of the bootstrap (a fresh interpreter, never the program) on the
    probe records ``results``; one verdict per judge source. Anything short of a clean
    "passed" from the judge within :data:`JUDGE_SECONDS` fails."""
    n = len(sources)
    if len(results) > MAX_RESULT_BYTES or nonce.encode() not in results:
        return [False] * n  # too much to read, or not one record of ours: nothing to judge
    exe, _ = _runtime()
    fds: list[int] = []
    try:
        job = {"tests": sources, "test_seconds": JUDGE_TEST_SECONDS, "probe": PROBE, "nonce": nonce,
               "builtins": sorted(JUDGE_BUILTINS), "modules": sorted(JUDGE_MODULES),
               "max_items": MAX_SET_ITEMS}
        job_fd = _memfd(json.dumps(job).encode(), "judge")
        fds.append(job_fd)
        res_fd = _memfd(results, "results")
        fds.append(res_fd)
        with tempfile.TemporaryFile() as out:
            proc = subprocess.Popen(
                [exe, "-I", "-S", "-B", "-c", _bootstrap_source(), "judge", str(job_fd), str(res_fd)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.DEVNULL,
                pass_fds=(job_fd, res_fd), cwd="/", env={"LANG": "C.UTF-8"},
                start_new_session=True, close_fds=True)
            exited = _end_group(proc, fds, JUDGE_SECONDS)
            out.seek(0)
            text = out.read(16 * n + 64).decode("ascii", errors="replace")
    finally:
        for fd in fds:
            os.close(fd)
    verdicts = [False] * n
    if not exited or proc.returncode != 0:
        return verdicts
    # The judge writes exactly "PASS <i>" lines for the tests that passed (bounded: n lines).
    for line in text.split("\n")[:n]:
        head, _, idx = line.partition(" ")
        if head == "PASS" and idx.isdigit() and len(idx) < 10 and int(idx) < n:
            verdicts[int(idx)] = True
    return verdicts


def capabilities() -> dict:
    """Whether the jail can be built here: ``{"jail": bool, "error": str | None, "root": bool}``."""
    r = run("pass", mode="stdio", timeout=20.0)
    return {"jail": r.error is None and r.returncode == 0, "error": r.error,
            "root": os.geteuid() == 0}
