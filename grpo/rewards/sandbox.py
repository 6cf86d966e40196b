"""Run untrusted Python from model completions so that its verdict cannot be forged.

**How a verdict is reached** (never inside the program's process):

* *stdin/stdout tests*: the program gets the input on stdin; the harness, outside, compares
  its whole stdout with the expected output and requires exit status 0.
* *assert tests* (:func:`plan_assert_tests`): each test is split into judge logic and
  *probes*. A probe is a part of the test that belongs to the program (its calls, its names,
  attributes and methods of what it returned); it is evaluated in the sandbox after the
  program and its value leaves as one fixed plain value (a record), headed by a per-run
  nonce and written by primitives bound before the program ran. Everything else -- every
  assert of the test, ``==``/``!=``/``<``, chained comparisons, ``in``, ``not``,
  ``and``/``or``, literal methods (``[2].count(...)``), builtins (``len``, ``sorted``,
  ``isinstance`` ...), ``math.isclose``, the test's comprehensions, lambdas and ``for``
  loops of asserts -- runs in a separate *judge* process (a fresh interpreter under memory
  limits, a CPU budget per test and a :data:`JUDGE_SECONDS` wall clock, that never holds an
  object of the program) on the decoded values. The expected values never enter the
  sandbox. A test whose logic would have to run inside (a helper the test defines, a
  comparison whose result is passed to the program, a ``def check(candidate)`` that cannot
  be inlined) is refused. A refusal that is the test's
  own (it is refused when planned without any program) scores None, unscorable, not 0: the
  plain asserts before the refused statement are still judged (one that fails fails the test;
  if they hold the test stays unscorable), so a correct program never scores 0 for it. A
  refusal the program causes (it redefines a builtin the test uses) fails, logged at INFO.
  The trainer's process only ever reads the judge's verdict lines (bounded).
* *values*: a record is exact data, read once by the base type's own C methods: None, bool,
  int, float, complex, str, bytes, bytearray, list, tuple, set, frozenset, dict, range, dict
  views; subclasses of those (IntEnum, namedtuple, Counter, OrderedDict, a ``str`` subclass
  ...) leave as their base's value (an overridden ``__eq__``, ``__iter__``, ``__hash__`` or
  ``__class__`` plays no part); ``Fraction``, ``Decimal``, ``deque`` and naive ``datetime``
  values by their fields; an iterator (a generator) as the values it yields, up to
  :data:`MAX_ITER_ITEMS` or :data:`ITER_SECONDS` (reading past that cut fails the test). An
  object of any other type (the program's own classes, a plain ``Enum``) has no value: its
  probe fails. Lists and str-keyed dicts of scalars travel as JSON (the C codec, bound before
  the program: a million ints decode in a fraction of a second). An identity test between
  non-constants where a side is the program's (``f(xs) is xs``) is one probe, evaluated
  inside: ``is`` cannot be overridden and identity exists only there.
* *what a test binds*: a name the test binds to a judge-side value (``x = 3``,
  ``xs = sorted([3, 1, 2])``) that the program reads is held twice: the judge computes its
  own copy, which is what every assert reads, and the sandbox binds the program's copy in the
  test's own namespace (a dict of the harness, not the program's globals, with the builtins
  as they were before the program ran). A ``global`` statement, ``globals()``, patched
  builtins, ``sys.modules`` or judge modules, or a change in place to what the program was
  handed can only reach the program's copy. Two readings follow when the program could have
  changed a value the test reads again: a value handed to a *statement* of the program
  (``f(xs)`` on its own line: its effect is what the test checks) is read back from the
  sandbox from then on; a value handed to a *probe* (``r = f(xs)``, ``assert f(xs) ...``) is
  read as the test built it (in that statement and after), and in the test's *Python
  reading* (:attr:`AssertPlan.python`) as read back from the sandbox in the statements
  after. Such a test passes only when both readings pass (Python's is the dataset's: a test
  that checks its input was left alone still fails a program that changed it); its Python
  reading failing fails it; one that fails as written but passes in its Python reading (a
  right program that sorts in place, or a forgery that emptied the list) is
  :data:`PYTHON_ONLY`: it counts as failed when another test of the row fails, and makes the
  row None otherwise (:func:`row_score`): never 1.0, never a way out of a wrong program's
  zeros. A name bound
  to the program's value (``s = Stack()``) lives inside; what the test calls or reads on it
  (``s.pop()``) is a probe. A test that imports a module outside the standard library is
  unscorable (the sandbox has none); one whose logic calls a module outside the judge's
  (:data:`JUDGE_MODULES`: it would run inside, where the program can patch it) too.
* *trusted helpers* (``trusted_code``, :func:`check_trusted_code`): the problem's own helper
  definitions (HumanEval's ``poly``, ``encode_cyclic``) run in the judge only. A test's
  calls of those names resolve there, even when the program defines the same names (its
  copies serve only its own code), and their values may be passed into probes
  (``candidate(encode_cyclic(s))``: ``encode_cyclic(s)`` is computed in the judge and sent in).
  The program never sees their source. Trusted code is held to the judge's modules and
  builtins (plus classes and errors), no name or attribute starting with ``_``, modules reduced
  to their public, non-module attributes; bad trusted code makes its row unscorable (logged
  once). A stub (a function with only a docstring) is left out, so a whole prompt may be
  given; a test whose checked function trusted code defines, or that calls nothing of the
  program, is refused (unscorable).
* *traced tests*: a test's own ``for`` loops whose bodies assign, call or nest loops and ifs,
  ifs on judge-side values, and values only the judge computes (trusted helpers,
  ``random`` -- seeded per job, never by the machine -- and names bound to them or in such
  loops) are judged in three runs: the judge's *first stage* runs the test's judge side
  (asserts and whatever depends on the program's values left out) and records every step of
  the program it meets with the values the step reads (:func:`judge_inputs`); the sandbox runs
  those steps in that order in **one** run, each with its values bound (decoded before the
  program runs, fresh objects each time); the judge's second stage reruns the test on the
  probe records, recomputes each step's inputs and requires them to equal what was sent (same
  seeds), else the test is unscorable (``MISS``), never failed.
  Parent-side caps: :data:`MAX_PLAN_PASSES` planning passes (planning runs in the trainer's
  process; a test whose names do not settle is unscorable), :data:`MAX_PROBE_CALLS` step runs
  and :data:`MAX_INPUT_BYTES` of encoded
  inputs per completion (beyond them the test is unscorable), the probe records are read up
  to :data:`MAX_RESULT_BYTES` (the tests whose records lie past that cut fail), each judge
  stage under :data:`JUDGE_SECONDS` (a test's logic under :data:`JUDGE_TEST_SECONDS` of CPU)
  and the sandbox under the caller's ``timeout``: a row takes at most ``timeout`` +
  2 x :data:`JUDGE_SECONDS` plus process starts, whatever the program does. Refused
  (unscorable): inputs, a loop's iterable or an if's test that depend on the program's output
  (a test that feeds the program's values back to it), a value computed per element of a
  comprehension and passed to the program, and a judge-side value handed to a statement of the
  program inside the test's own loops and read again.
* *one hash seed*: the sandbox and both judge stages run under the same ``PYTHONHASHSEED``
  (drawn per completion, apart from ``random``'s seed), and a vector probe iterates its
  iterable in the judge's own form (``enumerate(...)``), so a set of strings is walked in the
  same order on both sides.

**What remains possible** (said plainly): a probe's value is whatever the program returns,
so a forged record is no better than returning that value (a stateful program may return
different values on each call); a method of an object the program returned
(``s.pop()``) is the program's, and so is a helper the test calls without defining or importing
it itself when ``trusted_code`` does not define it (a test's ``poly(...)`` where only the
program defines ``poly``: a program whose ``poly`` returns 0 passes, as in HumanEval's own
harness -- give the prompt as ``trusted_code``); after a test hands a value to a statement
of the program, what it reads of that value is the program's (as in Python); a test that the
program can make pass only in its Python reading scores as described above; but a test using
a builtin or judge module the program redefines is refused. The attacker model for trusted
helpers: the program may define, patch or shadow any name or module
(its own copies of the helpers, ``builtins``, ``math``, ``random``), return objects whose
``__eq__`` lies, search every file, variable and descriptor it can reach for the helpers'
source or the expected values, and count its calls; none of it reaches the judge, which holds
the helpers, computes their values on plain data and compares (tests/rewards_corpus.py's
``TRUSTED_PROBLEMS``; ``JUDGE_FORGERIES`` for the values a test binds). What the trusted
code computes from a probe's value is the data's
own code: the judge runs it unjailed (limits, no I/O builtins, no imports outside its
modules, no ``_`` names), so it is the dataset author's, not the policy's. Not judged (refused):
``try``/``with``/``if``/``while`` statements in a test, helper functions it defines (other than
HumanEval's ``check(candidate)``), and values of the test's own lambdas passed to the program.
Forging a record needs the nonce, which lives only in a local of the bootstrap's frame: a
CPython memory-safety bug that lets pure Python read its own memory would reveal it (the
known routes stay closed: frames -- ``sys._getframe``, tracebacks, generators, and Python
signal handlers, which are handed the running frame --, ``gc``, ``/proc``, ctypes and the
``_test*`` modules, code objects, ``marshal``, native code from the writable ``/tmp``); and
the verdict hardly rests on it: every probe is a value the program could have returned, but
for the read-backs of the Python reading, which can at most make a failed test
:data:`PYTHON_ONLY`.
Refused inside, and
why: new processes and threads (``os.fork``/``exec``/``subprocess``/``multiprocessing``,
``threading.Thread.start``, ``concurrent.futures``: RLIMIT_NPROC and the hook; a stdio
program that runs its ``main`` in a thread for a bigger stack fails), signals to
other processes, Python signal handlers (``signal.signal(s, SIG_DFL / SIG_IGN)`` works; a
callable is refused, and so is a second ``_signal`` module), sockets (``socket``,
``asyncio``'s event loop, ``http``, ``urllib``: no
network exists), ctypes and raw memory, directory descriptors (``tempfile``'s
``TemporaryDirectory``/``NamedTemporaryFile``, ``shutil.rmtree``'s fd walk, ``os.open`` of a
directory) because they would serve as ``dir_fd`` for paths the hook cannot resolve, ``/proc``,
``sys._getframe``/``inspect.currentframe`` and ``traceback`` frame walks (they would reach the
nonce; ``namedtuple``, ``enum``, ``typing`` and ``logging`` cope), and ``marshal`` (the standard
library is imported from source, ``-X pycache_prefix``). Every other pure-Python standard
library module imports and works (tests/rewards_corpus.py: 85 solutions over heapq, bisect,
typing, dataclasses, fractions, random, datetime, decimal, statistics, enum, re, json ...);
third-party packages (numpy) do not exist inside: a program that imports one fails.
``exit()`` and ``quit()`` exist (the site module, left out, would define them).
In every mode the program may print, spin or crash: that only fails its own tests.

**Containment** (``grpo/rewards/sandbox_bootstrap.py`` builds it; the same on every machine, whether
the trainer runs as root or as an ordinary user, via an unprivileged user namespace):

* new mount, PID, network, IPC and UTS namespaces; the filesystem is a fresh read-only tmpfs
  holding read-only nosuid bind mounts of the Python runtime and system libraries only, a
  minimal ``/dev`` (null, zero, random, urandom), no ``/proc``, and a size-capped private
  ``/tmp`` (noexec: nothing written there can be mapped as code) as working directory. The
  project tree, the data, ``/etc``, the home directories and every writable host directory
  are simply not there;
* no capabilities: as root the program runs as uid 65534; otherwise as an unprivileged user
  inside a user namespace whose capabilities ``execve`` dropped; ``no_new_privs`` is set;
* rlimits: address space, file size (stdout included), CPU, no new processes or threads
  (``RLIMIT_NPROC = 0``), 64 descriptors; the wall clock is enforced from outside with SIGKILL
  to the process group, and the sandbox dies with its parent (``PR_SET_PDEATHSIG``);
* an audit hook as a second layer (frame / gc / ``/proc`` / directory-descriptor / process /
  socket / ctypes access refused; its state is immutable and unreachable without frames);
* the interpreters (the sandbox's and the judge's) start with ``-s -S -P -B`` and an
  environment built here: no user site, no ``site`` (no ``sitecustomize``, no ``.pth``), no
  working directory on ``sys.path``, nothing of the trainer's ``PYTHONPATH``,
  ``PYTHONSTARTUP`` or ``PYTHONHOME``; the judge's stdout and stderr go to ``/dev/null``
  (its verdicts travel on a descriptor of their own).

If the namespaces cannot be created the run fails closed: :attr:`RunResult.error` is set and
``grpo.rewards`` scores the completion ``None`` (unscorable) instead of running it unconfined.
"""

from __future__ import annotations

import ast
import builtins
import copy
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
import zlib
from dataclasses import dataclass, field
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
        file_mb: int = DEFAULT_FILE_MB, audit: bool = True, hash_seed: int = 0) -> RunResult:
    """Run ``code`` in the jail. ``mode``: ``"stdio"`` (``stdin`` in, stdout and the exit
    status out) or ``"probes"`` (``run_job`` carries ``tests``, ``nonce`` and ``max_items``:
    the program, then each test's steps; the probe records go to :attr:`RunResult.results`;
    its stdout is discarded: what it prints is nobody's business). ``audit=False`` leaves
    the audit hook out, so tests can check what the OS layers hold alone. ``hash_seed``: the
    run's ``PYTHONHASHSEED`` (the judge's, so that sets iterate alike on both sides).

    ``timeout`` is the wall-clock limit of the whole run, interpreter starts included; the
    process group is killed at that deadline whatever it does.
    """
    if mode not in ("stdio", "probes"):
        raise ValueError(f"mode must be 'stdio' or 'probes', got {mode!r}")
    exe, binds = _runtime()
    source = _bootstrap_source()
    run_job = dict(run_job or {}, mode=mode, code=code, audit=bool(audit))
    job = {"binds": list(binds), "python": exe, "source": source, "run_job": json.dumps(run_job),
           "memory_bytes": int(memory_mb) << 20, "file_bytes": int(file_mb) << 20,
           "tmp_bytes": DEFAULT_TMP_MB << 20, "cpu_seconds": int(math.ceil(timeout)) + 1,
           "sys_pivot_root": _SYS_PIVOT_ROOT.get(platform.machine(), 155),
           "hash_seed": int(hash_seed) % (1 << 32)}
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
                stdin=stdin_fd, stdout=out if mode == "stdio" else subprocess.DEVNULL, stderr=err,
                pass_fds=(job_fd, res_w), cwd="/",
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
MAX_PLAN_PASSES = 24  # planning passes over a completion's tests (names moving inside settle in a few)
MAX_RESULT_BYTES = 8 << 20  # the probe records of one run; more and every test of the run fails
JUDGE_SECONDS = 4.0  # wall clock of a judge process (plain values only: it is fast; the margin is for load)
JUDGE_TEST_SECONDS = 1.0  # CPU time of one test's logic inside the judge (decoding not counted)
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
INPUT = "__grpo_in%d__"  # a value the judge computed, bound inside before a step runs
AT, VAL, STEP = "__grpo_at__", "__grpo_val__", "__grpo_step__"
DUAL = "__grpo_dual__"  # (the judge's copy, the sandbox's copy) of a value handed to the program
_HANDOFF = {"fresh": 0, "probe": 1, "stmt": 2}  # how far the program has had a mirrored name
# Constructs that are test logic: inside the program's process their outcome would be the
# program's to decide, so code that runs there (setup, probes) may not hold them.
_LOGIC = (ast.Compare, ast.BoolOp, ast.IfExp, ast.Lambda, ast.ListComp, ast.SetComp,
          ast.DictComp, ast.GeneratorExp, ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom)


class Refused(Exception):
    """A test whose verdict could not be reached outside the program's process."""


class _Handed(Refused):
    """The test reads a value again after handing it to a statement of the program."""


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


def _names_loaded(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _free_names(node: ast.AST) -> set[str]:
    """Names ``node`` reads from outside it (its own comprehensions' and lambdas' names left out)."""
    bound: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.comprehension):
            bound |= {x.id for x in ast.walk(n.target) if isinstance(x, ast.Name)}
        elif isinstance(n, ast.Lambda):
            bound |= {a.arg for a in ast.walk(n.args) if isinstance(a, ast.arg)}
    return _names_loaded(node) - bound


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


def _statements(body: list) -> list:
    """Every statement of ``body``, those in its loops' and ifs' bodies included."""
    out = []
    for st in body:
        out.append(st)
        if isinstance(st, (ast.For, ast.If, ast.While)):
            out.extend(_statements(st.body) + _statements(st.orelse))
    return out


def _marker(name: str, *args: ast.expr) -> ast.Call:
    return ast.Call(ast.Name(name, ast.Load()), list(args), [])


def _is_call_of(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name


class _Planner:
    """Splits each assert test into harness logic and program-controlled probes.

    An expression is *H* (the judge computes it: constants, the judge's builtins and modules,
    names the test binds to judge-side values, the test's own lambdas and comprehensions, the
    trusted helpers), *P* (the program's: its names and what is called, indexed by attribute
    or called on them) or *M* (judge logic over P parts). Every P part directly under judge
    logic becomes a probe: evaluated inside, its value leaves as plain data, and comparisons,
    membership, ``count``, ``isinstance`` ... run in the judge on that data.

    Some values exist only in the judge (*judge-only*): what the trusted helpers and the
    stateful modules (``random``) compute, and the names a test binds to such values or binds
    in its own loops. A part of a probe or of a statement of the program that reads them is
    computed in the judge and *sent* in: replaced by an input name the sandbox binds before the
    step runs. A test with such inputs, or with steps inside its own loops or ifs, is *traced*:
    the judge runs its judge side first and records every step run (``AssertPlan.pre``).

    A name the test binds at top level to a judge-side value that a step of the program reads
    is *mirrored* (``mirror``): the judge's assignment and the same assignment inside (in the
    test's own namespace there); the judge's reads use its copy, and after a step of the
    program had the name, ``__grpo_dual__(judge copy, read-back probe)`` (a probe) or the
    read-back alone (a statement) -- see the module docstring. A name bound to the program's
    value (``pvalued``) lives inside; calls, attributes and indexing on it are P.
    """

    def __init__(self, program_names: set[str], tests: list[ast.Module],
                 trusted: frozenset = frozenset()):
        self.shadowed = program_names
        self.tests = tests
        self.test_names: set[str] = set()  # names test assignments bind
        self.judge_imports: set[str] = set()
        self.foreign: set[str] = set()  # names the tests' imports of other modules bind
        self.stateful: set[str] = set()  # names bound by the tests' imports of STATEFUL_MODULES
        for tree in tests:
            for st in _statements(tree.body):
                if isinstance(st, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                    for t in (st.targets if isinstance(st, ast.Assign) else [st.target]):
                        self.test_names |= _target_names(t) or set()
                elif isinstance(st, (ast.Import, ast.ImportFrom)):
                    bound = {(a.asname or a.name).partition(".")[0] for a in st.names}
                    if _judge_import(st):
                        self.judge_imports |= bound
                        if _stateful_import(st):
                            self.stateful |= bound
                    else:
                        self.foreign |= bound
        # A name the tests bind themselves is theirs, not the trusted helper's.
        self.trusted = frozenset(trusted) - self.test_names
        self.inside_needed: set[str] = set()
        # Test names bound to the program's values (r = f(1), s = Stack()): what the test
        # calls, reads or indexes on them is the program's, evaluated inside.
        self.pvalued: set[str] = set()
        self.vector: dict | None = None  # the enclosing single-generator comprehension
        self._reset()

    def _reset(self) -> None:
        self.steps: list = []
        self.probes: list = []
        self.vector = None
        self.jnames: set[str] = set()  # this test's judge-only names (its loops', and those bound to judge-only values)
        self.handed: set[str] = set()  # judge-only names handed to a statement of the program
        self.inputs: dict[int, list] = {}  # step -> [(input name, judge-side expression)]
        self.probe_step: dict[int, int] = {}  # probe id -> step
        self.cur_inputs: list = []
        self.depth = 0  # inside the test's own loops / ifs
        self.traced = False
        # Test names bound at top level to judge-side values that the program reads: the
        # judge keeps its copy, the sandbox its own. State: "fresh" (no step of the program
        # has had it since), "probe" (a probe or value-producing statement of the program
        # had it: the judge reads its copy, the Python reading the sandbox's), "stmt" (a
        # statement of the program had it: the test checks what the program did to it, read
        # back from the sandbox). Handoffs in a top-level statement count from the next one.
        self.mirror: dict[str, str] = {}
        self.pending: dict[str, str] = {}
        self.duals = False
        self.foreign_t: set[str] = set(self.foreign)  # plus names bound from such modules' values

    # ---- classification -----------------------------------------------------------------
    def judge_name(self, name: str, local: frozenset) -> bool:
        if name in local:
            return True
        if name in self.mirror:
            return self.mirror[name] != "stmt"
        if name in self.jnames:
            if name in self.handed:
                raise _Handed(f"the test reads {name} after handing it to a statement of the "
                              "program (changes made in place would not be seen)")
            return True
        if name in self.trusted:
            return True  # the problem's own helper: defined in the judge, never the program's
        if name in self.shadowed:
            if name in JUDGE_BUILTINS or name == "math" or name in self.judge_imports:
                # The test's logic would call the program's version of a builtin: refused.
                raise Refused(f"the program redefines {name}, which the test uses")
            return False
        if name in self.test_names:
            return name not in self.inside_needed
        return name in JUDGE_BUILTINS or name in self.judge_imports or name == "math"

    def on_program_value(self, node: ast.AST, local: frozenset) -> bool:
        """``r.upper()``, ``s.pop()``, ``r[0]``, ``r()`` where ``r`` is a test name bound to
        a value of the program: the program's object does it, inside."""
        base = node.func if isinstance(node, ast.Call) else node.value
        return (isinstance(base, ast.Name) and base.id in self.pvalued and base.id not in local
                and base.id not in self.mirror and base.id not in self.jnames)

    def program_part(self, node: ast.AST, local: frozenset) -> bool:
        """Whether ``node`` is a value of the program: a name of its, or what is called,
        indexed or read as an attribute on one."""
        while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
            node = node.func if isinstance(node, ast.Call) else node.value
        if not isinstance(node, ast.Name):
            return False
        if node.id in self.pvalued and node.id not in local:
            return True
        try:
            return not self.judge_name(node.id, local)
        except Refused:
            return False

    def compared_inside(self, node: ast.Compare, local: frozenset) -> bool:
        """An identity test between non-constants where a side is the program's (``f(xs) is
        xs``, ``s.top() is not s.pop()``) is evaluated inside, as one probe: identity exists
        only there, and ``is`` cannot be overridden (no object's method takes part). Every
        other comparison runs in the judge, on the values."""
        operands = [node.left] + node.comparators
        if len(node.ops) != 1 or not isinstance(node.ops[0], (ast.Is, ast.IsNot)):
            return False
        if any(isinstance(o, ast.Constant) for o in operands):
            return False
        return (any(self.program_part(o, local) for o in operands)
                and all(self.program_part(o, local) or isinstance(o, ast.Name) and o.id in self.mirror
                        for o in operands))

    def handoff(self, node: ast.AST, kind: str) -> None:
        """A step of the program (``kind``: "probe" or "stmt") reads the mirrored names in
        ``node``: from the next top-level statement on (at once inside the test's loops and
        ifs), the judge's reads of them follow that (see ``mirror``)."""
        for name in _names_loaded(node) & set(self.mirror):
            if _HANDOFF[kind] > _HANDOFF[self.pending.get(name, "fresh")]:
                self.pending[name] = kind
        if self.depth:
            self.settle()

    def settle(self) -> None:
        for name, kind in self.pending.items():
            if name in self.mirror and _HANDOFF[kind] > _HANDOFF[self.mirror[name]]:
                self.mirror[name] = kind
        self.pending = {}

    def prescan(self, body: list) -> None:
        """Before a top-level loop or if: the handoffs its body makes, by form, count from its
        first statement (a later iteration reads what an earlier one handed over)."""
        live = {n for n, k in self.mirror.items() if k != "stmt"}
        for st in _statements(body):
            if isinstance(st, (ast.For, ast.If, ast.While)):
                continue
            names = set()
            for n in ast.walk(st):
                if isinstance(n, ast.Call) and self.program_part(n.func, frozenset()):
                    names |= _names_loaded(n) & live
            if not names:
                continue
            effect = isinstance(st, ast.Expr) or isinstance(st, (ast.Assign, ast.AugAssign)) and any(
                isinstance(t, (ast.Subscript, ast.Attribute))
                for t in (st.targets if isinstance(st, ast.Assign) else [st.target]))
            for name in names:
                self.pending[name] = "stmt" if effect else max(
                    "probe", self.pending.get(name, "probe"), key=_HANDOFF.__getitem__)
        self.settle()

    def judge_only_names(self) -> set[str]:
        return self.trusted | self.stateful | self.jnames

    def is_h(self, node: ast.AST) -> bool:
        """Whether the judge computes ``node`` (no name of the program in it); never refuses,
        except for a name the test reads after handing it to the program."""
        if any(isinstance(n, (ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom))
               or isinstance(n, (ast.Attribute, ast.Subscript, ast.Call))
               and self.on_program_value(n, frozenset()) for n in ast.walk(node)):
            return False
        try:
            return all(self.judge_name(n, frozenset()) for n in _free_names(node))
        except _Handed:
            raise
        except Refused:
            return False

    def expr(self, node: ast.AST, local: frozenset) -> tuple[str, ast.AST]:
        """(kind, node): P nodes come back as they are, H/M nodes rewritten for the judge."""
        if isinstance(node, ast.Constant):
            return "H", node
        if isinstance(node, ast.Name):
            if node.id not in local and self.mirror.get(node.id) == "probe":
                # The judge's copy as written; the sandbox's, read back now, for the Python
                # reading (AssertPlan.python).
                self.duals = True
                return "H", _marker(DUAL, ast.Name(node.id, ast.Load()),
                                    self.probe(node, local, handoff=False))
            return ("H" if self.judge_name(node.id, local) else "P"), node
        if isinstance(node, (ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom)):
            raise Refused(f"{type(node).__name__} in a test")
        if isinstance(node, ast.Compare) and self.compared_inside(node, local):
            return "P", node
        if isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)) and self.on_program_value(node, local):
            return "P", node
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

    def ship(self, node: ast.AST, local: frozenset = frozenset(), inner: frozenset = frozenset(),
             per_element: bool = False, handing: bool = False) -> ast.AST:
        """``node`` (to be evaluated inside) with its judge-only parts replaced by input names,
        their judge-side expressions kept in ``cur_inputs``. ``local``: the test's own
        comprehension / lambda names around it (a part reading them is not sent: it is refused
        where it is read); ``inner``: names ``node`` binds itself (its own comprehensions,
        evaluated inside); ``per_element``: ``node`` runs once per element of a comprehension,
        where a value sent once could not stand for a call made each time; ``handing``:
        ``node`` belongs to a statement of the program (``handed``)."""
        if not isinstance(node, ast.expr):
            return node
        free = _free_names(node) - local
        if not (free & self.judge_only_names()):
            return node  # nothing judge-only: unchanged (as before traced tests existed)
        storing = isinstance(getattr(node, "ctx", None), (ast.Store, ast.Del))
        if not storing and not (_free_names(node) & (local | inner)) and self.is_h(node):
            if per_element and any(isinstance(n, ast.Call) for n in ast.walk(node)):
                raise Refused("a value the judge would compute for each element of a "
                              "comprehension would be passed to the program")
            name = INPUT % len(self.cur_inputs)
            self.cur_inputs.append((name, node))
            if handing and not isinstance(node, ast.Call):
                self.handed |= _names_loaded(node) & self.jnames
            return ast.copy_location(ast.Name(name, ast.Load()), node)
        if storing and isinstance(node, ast.Name) and node.id in self.jnames:
            raise Refused(f"a statement of the program would bind {node.id}, which the test "
                          "computes in the judge")
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            scope, gens = set(inner), []
            for k, g in enumerate(node.generators):
                it = self.ship(g.iter, local, frozenset(scope), per_element or k > 0, handing)
                scope |= {x.id for x in ast.walk(g.target) if isinstance(x, ast.Name)}
                ifs = [self.ship(c, local, frozenset(scope), True, handing) for c in g.ifs]
                gens.append(ast.comprehension(g.target, it, ifs, g.is_async))
            fz = frozenset(scope)
            if isinstance(node, ast.DictComp):
                return ast.DictComp(self.ship(node.key, local, fz, True, handing),
                                    self.ship(node.value, local, fz, True, handing), gens)
            return type(node)(self.ship(node.elt, local, fz, True, handing), gens)
        if isinstance(node, ast.Lambda):
            args = frozenset(a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg))
            return ast.Lambda(node.args, self.ship(node.body, local, inner | args, True, handing))

        def rebuild(value):
            if isinstance(value, ast.expr) and not isinstance(value, ast.expr_context):
                return self.ship(value, local, inner, per_element, handing)
            if isinstance(value, list):
                return [rebuild(x) for x in value]
            if isinstance(value, ast.keyword):
                return ast.keyword(value.arg, rebuild(value.value))
            return value

        return type(node)(**{f: rebuild(getattr(node, f)) for f in node._fields})

    def add_step(self, step: list) -> int:
        """Append a step of the program (inputs from ``cur_inputs``); returns its index."""
        sid = len(self.steps)
        self.steps.append(step)
        if self.cur_inputs:
            self.inputs[sid] = self.cur_inputs
        if self.cur_inputs or self.depth:
            self.traced = True
        self.cur_inputs = []
        return sid

    def probe(self, node: ast.AST, local: frozenset, handoff: bool = True) -> ast.AST:
        root = node
        while isinstance(root, (ast.Attribute, ast.Subscript, ast.Call)):
            root = root.func if isinstance(root, ast.Call) else root.value
        if isinstance(root, ast.Name) and root.id in self.foreign_t:
            raise Refused(f"the test's logic uses {root.id}, from a module the judge does not "
                          "run (inside, the program could patch it)")
        if handoff:
            self.handoff(node, "probe")
        v = self.vector
        pid = len(self.probes)
        self.cur_inputs = []
        if v is not None and _names_loaded(node) & v["vars"]:
            # A vector probe: the part for every element of the comprehension's iterable.
            node = self.ship(node, local - v["vars"], frozenset(v["vars"]), True)
            it = self.ship(v["iter"], v["outer"], frozenset(), bool(v["outer"]))
            self.reads(node, v["outer"])
            self.reads(it, v["outer"])
            if _names_loaded(node) & (local - v["vars"] - v["outer"]):
                raise Refused("a value of the test's own lambda would be passed to the program")
            # The same form as the judge's loop (``enumerate(<iterable>)``), under the same
            # PYTHONHASHSEED: a set display iterates alike on both sides (a bare ``for x in
            # {...}`` would iterate a frozenset constant, in another order).
            enum = ast.Call(ast.Name("enumerate", ast.Load()), [it], [])
            target = ast.Tuple([ast.Name(v["index"], ast.Store()), _as_store(v["target"])], ast.Store())
            source = ast.unparse(ast.ListComp(node, [ast.comprehension(target, enum, [], 0)]))
            v["used"] = True
            self.probes.append(source)
            self.probe_step[pid] = self.add_step(["probe", pid, source])
            return ast.Subscript(ast.Call(ast.Name(PROBE, ast.Load()), [ast.Constant(pid)], []),
                                 ast.Name(v["index"], ast.Load()), ast.Load())
        node = self.ship(node, local, frozenset(), bool(local))
        self.reads(node, local)
        self.probes.append(ast.unparse(node))
        self.probe_step[pid] = self.add_step(["probe", pid, self.probes[-1]])
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
    def plan(self, tree: ast.Module) -> tuple[list, str, str | None, dict, str | None]:
        """(inside steps, judge source, first-stage source or None, step inputs, Python
        reading or None) of one test; raises Refused with ``self.at`` the index of the refused
        top-level statement."""
        self._reset()
        judge: list[ast.stmt] = []
        for k, st in enumerate(tree.body):
            self.at = k
            judge.extend(self.statement(st))
            self.settle()
        self.at = None
        if not self.probes and _names_loaded(tree) & self.trusted:
            raise Refused("the test reads nothing of the program: trusted_code defines "
                          "every function it calls")

        def source(body: list) -> str:
            return ast.unparse(ast.fix_missing_locations(ast.Module(body=body or [ast.Pass()],
                                                                    type_ignores=[])))

        if not self.traced:
            strict, python = _readings(_strip_steps(judge), self.duals)
            return self.steps, source(strict), None, {}, python and source(python)
        strict, python = _readings(_hoist(judge, self.inputs, self.probe_step), self.duals)
        pre = _first_stage(copy.deepcopy(strict), set(), self.stateful)
        steps = [[s[0], s[-1], [name for name, _ in self.inputs.get(sid, [])]]
                 for sid, s in enumerate(self.steps)]
        return steps, source(strict), source(pre), self.inputs, python and source(python)

    def statement(self, st: ast.stmt) -> list[ast.stmt]:
        """The judge's statements for ``st`` (a step of the program leaves a ``__grpo_step__``
        marker where it runs)."""
        if isinstance(st, ast.Assert):
            k, test = self.child(st.test, frozenset())
            return [ast.Assert(test, None)]
        if isinstance(st, (ast.Import, ast.ImportFrom)):
            for top in _imported_modules(st):
                if top not in _STDLIB:
                    raise Refused(f"the test imports {top}, which the sandbox does not have "
                                  "(the standard library only)")
            out = [self.step_marker(["exec", ast.unparse(st)])]
            if _judge_import(st):
                out.append(st)
            else:
                self.foreign_t |= {(a.asname or a.name).partition(".")[0] for a in st.names}
            return out
        if isinstance(st, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            return self.assignment(st)
        if isinstance(st, ast.Expr):
            call = st.value
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                    and call.func.id == "print" and "print" not in self.shadowed):
                # print's arguments go nowhere the judge reads: run it (for the calls'
                # effects), exempt from the rule on builtins.
                call = self.ship(call, handing=True)
                self.reads(call, frozenset())
                if not self.is_h(call):
                    self.handoff(call, "stmt")
                return [self.step_marker(["exec", ast.unparse(ast.Expr(call))])]
            mirrored = _free_names(call) & set(self.mirror)
            if self.is_h(call) and mirrored:
                # The test's own call on a value the program also holds (xs.append(4)): run in
                # the judge on its copy and in the sandbox on the program's, alike.
                if _free_names(call) & self.judge_only_names():
                    return [st] + self.resend(mirrored)
                _, judged = self.child(call, frozenset())
                return [ast.Expr(judged), self.step_marker(["exec", ast.unparse(ast.Expr(call))])]
            if _free_names(call) & self.judge_only_names() and self.is_h(call):
                return [st]  # a call on judge-side values (xs.append(x), random.seed(1)): the judge's
            call = self.ship(call, handing=True)
            self.inside(call)
            self.handoff(call, "stmt")
            return [self.step_marker(["exec", ast.unparse(ast.Expr(call))])]
        if isinstance(st, ast.For) and not st.orelse:
            if self.depth == 0:
                self.prescan(st.body)
            if self.depth == 0 and all(isinstance(b, (ast.Assert, ast.Pass)) for b in st.body) \
                    and not _free_names(st) & self.judge_only_names():
                return [self.loop(st)]
            return [self.judge_loop(st)]
        if isinstance(st, ast.If):
            if not self.is_h(st.test):
                raise Refused("an if on the program's values in a test")
            if self.depth == 0:
                self.prescan(st.body + st.orelse)
            self.depth += 1
            body = [s for b in st.body for s in self.statement(b)]
            orelse = [s for b in st.orelse for s in self.statement(b)]
            self.depth -= 1
            return [ast.If(st.test, body or [ast.Pass()], orelse)]
        if isinstance(st, (ast.Break, ast.Continue)) and self.depth:
            return [st]
        if isinstance(st, ast.Pass):
            return []
        raise Refused(f"{type(st).__name__} statement in a test (only asserts, "
                      "assignments, imports, calls, loops and ifs are judged)")

    def resend(self, names: set) -> list[ast.stmt]:
        """After a judge-only statement changed mirrored names (``xs.append(random...)``):
        the sandbox's copies are replaced by the judge's, sent in (a traced step)."""
        out = []
        for name in sorted(names):
            self.cur_inputs = [(INPUT % 0, ast.Name(name, ast.Load()))]
            out.append(self.step_marker(["exec", f"{name} = {INPUT % 0}"]))
            self.mirror[name] = "fresh"
            self.pending.pop(name, None)
        return out

    def step_marker(self, step: list) -> ast.stmt:
        return ast.Expr(_marker(STEP, ast.Constant(self.add_step(step))))

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

    def judge_loop(self, st: ast.For) -> ast.stmt:
        """A loop of the test's own that runs in the judge (its body assigns, calls, nests
        loops or ifs, or reads judge-only values): its target and what its body binds to
        judge-side values are judge-only names; each step of the program in it runs once per
        iteration, with the values it reads sent in (a traced test)."""
        names = _target_names(st.target)
        if names is None:
            raise Refused("loop target that is not a name")
        if not self.is_h(st.iter):
            raise Refused("a loop over the program's values whose body is more than asserts")
        self.jnames |= names
        self.handed -= names
        self.depth += 1
        body = [s for b in st.body for s in self.statement(b)]
        self.depth -= 1
        loop = ast.For(_as_store(st.target), st.iter, body or [ast.Pass()], [], None)
        loop.grpo_judge_loop = True
        return loop

    def assignment(self, st: ast.stmt) -> list[ast.stmt]:
        targets = st.targets if isinstance(st, ast.Assign) else [st.target]
        value = st.value
        if value is None:  # a bare annotation
            return []
        names = [_target_names(t) for t in targets]
        if any(n is None for n in names):  # d[k] = v, o.a = v: a mutation of program state
            into = [t for t in targets if isinstance(t, (ast.Subscript, ast.Attribute))]
            mirrored = {n for t in into for n in _names_loaded(t.value) if n in self.mirror
                        and self.mirror[n] != "stmt"}
            if mirrored and all(self.is_h(t.value) for t in into) and self.is_h(value):
                # xs[0] = 5 on a value the test and the program both hold: in both places
                # (or, with a value only the judge computes, the judge's copy sent in again).
                if _free_names(st) & self.judge_only_names():
                    return [st] + self.resend(mirrored)
                _, judged = self.child(value, frozenset())
                self.reads(st, frozenset())
                return [type(st)(**{**{f: getattr(st, f) for f in st._fields}, "value": judged}),
                        self.step_marker(["exec", _stmt_source(st)])]
            if any(isinstance(t, (ast.Subscript, ast.Attribute)) and _names_loaded(t) & self.jnames
                   and self.is_h(t.value) for t in targets):
                if self.is_h(value):
                    return [st]  # xs[i] = v on the test's own judge-side values
                raise Refused("an assignment into a judge-side value from the program's")
            st = _ship_stmt(self, st)
            self.inside(st)
            self.handoff(st, "stmt")
            return [self.step_marker(["exec", ast.unparse(st)])]
        bound = set().union(*names)
        if isinstance(st, ast.AugAssign):
            value = ast.BinOp(ast.Name(st.target.id, ast.Load()), st.op, value)
            targets = [ast.Name(st.target.id, ast.Store())]
        if (self.depth or _free_names(value) & self.judge_only_names()) and self.is_h(value):
            # A value only the judge computes (or one computed in the test's own loop): a
            # judge-only name, sent to the program where a step reads it.
            self.jnames |= bound
            self.handed -= bound
            self.drop_mirror(bound)
            return [ast.Assign([_as_store(t) for t in targets], value, None)]
        if bound & self.inside_needed:
            # The program reads these names: bind them inside.
            if not bound <= self.inside_needed:
                raise Refused("an assignment binds names both the program and the judge need")
            if self.depth == 0 and self.is_h(value) and _mirrorable(value):
                # A judge-side value: the judge computes its own copy (what it reads), the
                # sandbox binds the program's (with the builtins as they were before the
                # program ran). Whatever the program does to its copy -- in place, or by
                # rebinding the name with a global statement -- the judge's is untouched.
                _, judged = self.child(value, frozenset())
                self.reads(value, frozenset())
                self.jnames -= bound
                for name in bound:
                    self.mirror[name] = "fresh"
                    self.pending.pop(name, None)
                return [ast.Assign([_as_store(t) for t in targets], judged, None),
                        self.step_marker(["exec", _stmt_source(ast.Assign(targets, value, None))])]
            value = self.ship(value, handing=True)
            self.inside(value)
            self.handoff(value, "probe")
            self.drop_mirror(bound)
            if not self.is_h(value):
                self.pvalued |= bound
            return [self.step_marker(["exec", _stmt_source(ast.Assign(targets, value, None))])]
        k, v = self.child(value, frozenset())
        self.jnames -= bound
        self.drop_mirror(bound)
        if k != "H":
            self.pvalued |= bound
        return [ast.Assign([_as_store(t) for t in targets], v, None)]

    def drop_mirror(self, names: set) -> None:
        for name in names:
            self.mirror.pop(name, None)
            self.pending.pop(name, None)


class _Reading(ast.NodeTransformer):
    """``__grpo_dual__(judge copy, sandbox copy)`` -> the one or the other."""

    def __init__(self, python: bool):
        self.python = python

    def visit_Call(self, node: ast.Call) -> ast.AST:
        if _is_call_of(node, DUAL):
            return self.visit(node.args[1] if self.python else node.args[0])
        return self.generic_visit(node)


def _readings(stmts: list, duals: bool) -> tuple[list, list | None]:
    """(the test as written, on its own copies; its Python reading, or None without duals)."""
    strict = [_Reading(False).visit(copy.deepcopy(st)) for st in stmts]
    python = [_Reading(True).visit(copy.deepcopy(st)) for st in stmts] if duals else None
    return strict, python


def _mirrorable(value: ast.AST) -> bool:
    """A judge-side value the sandbox may compute for itself: no function of the test's own
    (a lambda would hand the program the test's namespace), nothing that suspends."""
    return not any(isinstance(n, (ast.Lambda, ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom))
                   for n in ast.walk(value))


def _imported_modules(st: ast.stmt) -> set[str]:
    if isinstance(st, ast.Import):
        return {a.name.partition(".")[0] for a in st.names}
    return {(st.module or "").partition(".")[0]} if st.level == 0 else {""}


# What the sandbox can import: the standard library (its interpreter runs without site).
_STDLIB = frozenset(sys.stdlib_module_names)


def _ship_stmt(planner: _Planner, st: ast.stmt) -> ast.stmt:
    """A statement of the program with its judge-only parts sent in (``_Planner.ship``)."""
    def rebuild(value):
        if isinstance(value, ast.expr):
            return planner.ship(value, handing=True)
        if isinstance(value, list):
            return [rebuild(x) for x in value]
        return value

    return type(st)(**{f: rebuild(getattr(st, f)) for f in st._fields})


def _stateful_import(st: ast.stmt) -> bool:
    if isinstance(st, ast.Import):
        return any(a.name.partition(".")[0] in STATEFUL_MODULES for a in st.names)
    return (st.module or "").partition(".")[0] in STATEFUL_MODULES


def _strip_steps(stmts: list) -> list:
    """An untraced test's judge statements without the step markers."""
    out = []
    for st in stmts:
        if isinstance(st, ast.Expr) and _is_call_of(st.value, STEP):
            continue
        if isinstance(st, (ast.For, ast.If)):
            st.body = _strip_steps(st.body) or [ast.Pass()]
            st.orelse = _strip_steps(st.orelse)
        out.append(st)
    return out


class _ProbesToRuns(ast.NodeTransformer):
    def visit_Call(self, node: ast.Call) -> ast.AST:
        if _is_call_of(node, PROBE):
            return _marker(VAL, ast.Name("__grpo_h%d__" % node.args[0].value, ast.Load()))
        return self.generic_visit(node)


def _run_marker(sid: int, is_exec: bool, inputs: dict) -> ast.Call:
    """``__grpo_at__(step, is_statement, lambda: (inputs,))``: the next step run."""
    exprs = [e for _, e in inputs.get(sid, [])]
    thunk = (ast.Lambda(ast.arguments([], [], None, [], [], None, []),
                        ast.Tuple(exprs, ast.Load())) if exprs else ast.Constant(None))
    return _marker(AT, ast.Constant(sid), ast.Constant(is_exec), thunk)


def _hoist(stmts: list, inputs: dict, probe_step: dict) -> list:
    """A traced test's judge statements: before each statement, one ``__grpo_at__`` per step
    run it makes (its probes in order; a statement of the program where it ran), so that
    both judge stages meet the steps in the same order whatever the asserts short-circuit;
    the probes then read ``__grpo_val__`` of their run."""
    out: list[ast.stmt] = []
    for st in stmts:
        if isinstance(st, ast.Expr) and _is_call_of(st.value, STEP):
            out.append(ast.Expr(_run_marker(st.value.args[0].value, True, inputs)))
            continue
        if isinstance(st, ast.For) and getattr(st, "grpo_judge_loop", False):
            loop = ast.For(st.target, st.iter, _hoist(st.body, inputs, probe_step) or [ast.Pass()], [], None)
            loop.grpo_judge_loop = True
            out.append(loop)
            continue
        if isinstance(st, ast.If):
            out.append(ast.If(st.test, _hoist(st.body, inputs, probe_step) or [ast.Pass()],
                              _hoist(st.orelse, inputs, probe_step)))
            continue
        # A simple statement, or a loop of asserts whose probes are vectors: every probe in it
        # runs once, before it.
        pids = sorted({n.args[0].value for n in ast.walk(st) if _is_call_of(n, PROBE)})
        for pid in pids:
            out.append(ast.Assign([ast.Name("__grpo_h%d__" % pid, ast.Store())],
                                  _run_marker(probe_step[pid], False, inputs), None))
        out.append(_ProbesToRuns().visit(st))
    return out


def _untainted(node: ast.AST, tainted: set, what: str) -> None:
    if _names_loaded(node) & tainted or any(_is_call_of(n, VAL) for n in ast.walk(node)):
        raise Refused(f"{what} would depend on the program's output (a test that feeds the "
                      "program's values back to it, or loops on them, is not judged)")


def _first_stage(stmts: list, tainted: set, stateful: set) -> list:
    """The judge's first stage of a traced test (run before the program): its asserts and the
    statements over the program's values (*tainted*: what a probe returned, and every name
    such a statement binds or calls a method of) left out, every step run kept. Refused when
    a step's inputs, a loop's iterable or an if's test would read a tainted name."""
    out: list[ast.stmt] = []
    for st in stmts:
        if isinstance(st, ast.Assign) and _is_call_of(st.value, AT):
            _untainted(st.value, tainted, "the inputs of a step")
            out.append(ast.Expr(st.value))
        elif isinstance(st, ast.Expr) and _is_call_of(st.value, AT):
            _untainted(st.value, tainted, "the inputs of a step")
            out.append(st)
        elif isinstance(st, ast.Assert):
            continue
        elif isinstance(st, (ast.Import, ast.ImportFrom, ast.Pass, ast.Break, ast.Continue)):
            out.append(st)
        elif isinstance(st, ast.For) and getattr(st, "grpo_judge_loop", False):
            _untainted(st.iter, tainted, "a loop's iterable")
            names = _names_loaded(ast.Expr(_as_load(st.target)))
            cur, body = set(tainted), []
            for _ in range(len(_statements(st.body)) + 2):  # what one iteration taints reaches the next
                after = set(cur) - names
                body = _first_stage(st.body, after, stateful)
                if after <= cur:
                    break
                cur |= after
            tainted |= cur
            out.append(ast.For(st.target, st.iter, body or [ast.Pass()], [], None))
        elif isinstance(st, ast.For):
            continue  # a loop of asserts over vector probes (hoisted before it): nothing to run
        elif isinstance(st, ast.If):
            _untainted(st.test, tainted, "an if's test")
            t_body, t_else = set(tainted), set(tainted)
            body = _first_stage(st.body, t_body, stateful)
            orelse = _first_stage(st.orelse, t_else, stateful)
            tainted |= t_body | t_else
            out.append(ast.If(st.test, body or [ast.Pass()], orelse))
        else:  # a judge-side statement
            loaded = _names_loaded(st)
            bound = {n.id for n in ast.walk(st) if isinstance(n, ast.Name)
                     and isinstance(n.ctx, (ast.Store, ast.Del))}
            if loaded & tainted or any(_is_call_of(n, VAL) for n in ast.walk(st)):
                receivers = {n.func.value.id for n in ast.walk(st) if isinstance(n, ast.Call)
                             and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)}
                tainted |= bound | receivers | (loaded & stateful)
                if isinstance(st, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                    for t in (st.targets if isinstance(st, ast.Assign) else [st.target]):
                        if isinstance(t, (ast.Subscript, ast.Attribute)):
                            tainted |= _names_loaded(t)
            else:
                tainted -= bound
                out.append(st)
    return out


def _as_load(t: ast.AST) -> ast.AST:
    if isinstance(t, ast.Name):
        return ast.Name(t.id, ast.Load())
    if isinstance(t, ast.Starred):
        return ast.Starred(_as_load(t.value), ast.Load())
    if isinstance(t, (ast.Tuple, ast.List)):
        return ast.Tuple([_as_load(e) for e in t.elts], ast.Load())
    return t


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
            if not _judge_import(n):
                names = n.module if isinstance(n, ast.ImportFrom) else ", ".join(a.name for a in n.names)
                raise ValueError(f"trusted_code imports {names}: the judge imports only "
                                 f"{', '.join(sorted(JUDGE_MODULES))}")
            defined.update((a.asname or a.name).partition(".")[0] for a in n.names)
    allowed = JUDGE_BUILTINS | TRUSTED_EXTRA_BUILTINS
    for n in ast.walk(tree):
        if (isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in defined
                and n.id not in _BUILTIN_NAMES):
            raise ValueError(f"trusted_code reads {n.id}, which it does not define (the "
                             "function under test is the program's, never trusted code's)")
        name = (n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute)
                else n.name if isinstance(n, (ast.FunctionDef, ast.ClassDef)) else None)
        if name is not None and name.startswith("_"):
            raise ValueError(f"trusted_code reads {name}: names and attributes that start with _ "
                             "are not available in the judge")
        if (isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in _BUILTIN_NAMES
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
    planner = _Planner(shadowed, list(trees.values()), trusted)
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


_SALT = secrets.randbits(62)  # this process's seeds: different from run to run, shared by a group


def _judge_seed(sources: list) -> int:
    """The seed of a completion's judge runs: a function of its judge sources and this
    process's salt, so that the completions of one group get the same random inputs."""
    h = 0
    for src in sources:
        h = (h * 1000003 + zlib.crc32(str(src).encode("utf-8", "surrogatepass"))) % (1 << 61)
    return (h ^ _SALT) % (1 << 31)


def assert_jobs(code: str, tests: list[str], *, timeout: float = 5.0,
                trusted_code: str | None = None, **kw):
    """Assert tests as units of sandboxed work: callables returning ``[(test index, verdict)]``
    with verdict True / False / None (unscorable) / :data:`PYTHON_ONLY` (a row's score:
    :func:`row_score`).

    All tests of a completion share one sandboxed run (``timeout``) that reports the probes'
    values, then one judge run (:data:`JUDGE_SECONDS`) that decides every test on those values;
    traced tests first get a judge run that computes the inputs their steps take
    (:func:`judge_inputs`). A test refused because of the program fails (reason logged at
    INFO); one refused on its own is unscorable (None), unless the asserts before its refused
    statement fail. A callable raises SandboxUnavailable when the jail cannot be built.
    """
    plan = plan_assert_tests(code, tests, trusted_code)
    for i, why in sorted(plan.refused.items()):
        if i in plan.unscorable:
            log.debug("assert test %d unscorable: %s", i, why)
        else:
            log.info("assert test %d refused (scored 0): %s", i, why)
    trusted = None
    if trusted_code is not None and len(plan.unscorable) < len(tests):
        trusted = check_trusted_code(trusted_code)
    judged = [i for i, j in enumerate(plan.judge) if j is not None]

    def job() -> list[tuple[int, bool | None | str]]:
        verdicts: dict[int, bool | None | str] = {
            i: None if i in plan.unscorable else False for i in range(len(tests))}
        runs = list(judged)
        if runs:
            seed = _judge_seed([plan.judge[i] for i in runs] + [trusted_code])
            # Drawn apart from the seed (which the program cannot see): the sandbox's
            # PYTHONHASHSEED is readable inside, and must say nothing about random's inputs.
            hash_seed = secrets.randbelow(1 << 32)
            traced = [i for i in runs if plan.pre[i] is not None]
            traces: dict[int, list] = {}
            if traced:
                traces = judge_inputs([plan.pre[i] for i in traced], trusted=trusted, seed=seed,
                                      ids=traced, hash_seed=hash_seed)
                for i in traced:
                    if i not in traces:
                        verdicts[i] = None  # the test itself failed or asked for too much
                runs = [i for i in runs if plan.pre[i] is None or i in traces]
            jobs_ = [plan.inside[i] if plan.pre[i] is None
                     else dict(plan.inside[i], trace=traces[i]) for i in runs]
            nonce = secrets.token_hex(16)
            r = run(code, mode="probes", timeout=timeout, **kw, hash_seed=hash_seed,
                    run_job={"tests": jobs_, "nonce": nonce, "max_items": MAX_SET_ITEMS,
                             "iter_items": MAX_ITER_ITEMS, "iter_seconds": ITER_SECONDS})
            if r.error is not None:
                raise SandboxUnavailable(r.error)
            passed = judge([plan.judge[i] for i in runs], r.results_bytes, nonce,
                           trusted=trusted, seed=seed, ids=runs, hash_seed=hash_seed,
                           traces={k: traces[i] for k, i in enumerate(runs) if i in traces},
                           python=[plan.python[i] for i in runs])
            for k, i in enumerate(runs):
                verdicts[i] = passed[k]
        for i in plan.prefix:
            if verdicts[i] is not False:
                verdicts[i] = None  # its asserts before the refused statement held: no verdict
        return list(verdicts.items())

    return [job]


# The judge's interpreter: no user site, no site (no sitecustomize, no .pth), no working
# directory on sys.path (-P), bytecode neither read from nor written to the tree (-B); the
# environment is exactly the one given (so not -I, which would drop PYTHONHASHSEED):
# PYTHONPATH, PYTHONSTARTUP, PYTHONHOME and the rest of the trainer's environment never reach it.
JUDGE_FLAGS = ("-s", "-S", "-P", "-B")


def _judge_process(job: dict, data: bytes, stage: str, read_limit: int, seed: int,
                   hash_seed: int) -> tuple[bool, bytes]:
    """Run one judge stage of the bootstrap on ``job`` (with ``data`` as its second
    descriptor, its output on a third); ``(exited cleanly within JUDGE_SECONDS, output up to
    read_limit bytes)``. Its stdout and stderr go to /dev/null: no code the judge runs can
    print a verdict line."""
    exe, _ = _runtime()
    fds: list[int] = []
    try:
        job_fd = _memfd(json.dumps(dict(job, stage=stage, seed=seed)).encode(), "judge")
        fds.append(job_fd)
        res_fd = _memfd(data, "results")
        fds.append(res_fd)
        with tempfile.TemporaryFile() as out:
            out_w = os.open(f"/proc/self/fd/{out.fileno()}", os.O_WRONLY | os.O_APPEND)
            fds.append(out_w)
            proc = subprocess.Popen(
                [exe, *JUDGE_FLAGS, "-c", _bootstrap_source(), "judge", str(job_fd), str(res_fd),
                 str(out_w)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                pass_fds=(job_fd, res_fd, out_w), cwd="/",
                env={"LANG": "C.UTF-8", "PYTHONHASHSEED": str(int(hash_seed) % (1 << 32))},
                start_new_session=True, close_fds=True)
            exited = _end_group(proc, fds, JUDGE_SECONDS)
            out.seek(0)
            text = out.read(read_limit)
    finally:
        for fd in fds:
            os.close(fd)
    return exited and proc.returncode == 0, text


def _judge_job(sources: list[str], trusted: tuple | None, ids: list[int]) -> dict:
    return {"tests": sources, "test_seconds": JUDGE_TEST_SECONDS, "probe": PROBE,
            "builtins": sorted(JUDGE_BUILTINS), "modules": sorted(JUDGE_MODULES),
            "trusted_builtins": sorted(TRUSTED_EXTRA_BUILTINS), "max_items": MAX_SET_ITEMS,
            "trusted": trusted[0] if trusted else None,
            "trusted_names": list(trusted[1]) if trusted else [], "ids": list(ids)}


def judge_inputs(sources: list[str], *, trusted: tuple | None = None, seed: int = 0,
                 ids: list[int] | None = None, hash_seed: int | None = None) -> dict[int, list]:
    """The judge's first stage over traced tests (``AssertPlan.pre`` sources, run before the
    program, never with it): ``{id: [[step, encoded inputs], ...]}`` for each test that ran
    to its end within the caps; a test that raised on its own, asked for more than
    :data:`MAX_PROBE_CALLS` step runs or :data:`MAX_INPUT_BYTES` of inputs (all tests
    together), or did not finish within :data:`JUDGE_SECONDS` is left out (unscorable).
    ``trusted``: :func:`check_trusted_code`'s result; ``hash_seed``: the ``PYTHONHASHSEED``
    shared with the sandbox and the verdict stage (``seed`` when None)."""
    ids = list(range(len(sources))) if ids is None else list(ids)
    job = dict(_judge_job(sources, trusted, ids), max_calls=MAX_PROBE_CALLS,
               max_bytes=MAX_INPUT_BYTES)
    ok, text = _judge_process(job, b"", "inputs", MAX_INPUT_BYTES + 64 * (MAX_PROBE_CALLS + len(ids)) + 4096,
                              seed, seed if hash_seed is None else hash_seed)
    traces: dict[int, list] = {}
    if not ok:
        return traces
    known, calls = set(ids), 0
    pending: dict[int, list] = {}
    for line in text.split(b"\n"):
        parts = line.decode("ascii", errors="replace").split(" ")
        if len(parts) < 2 or not parts[0].isdigit() or int(parts[0]) not in known:
            continue
        t = int(parts[0])
        if parts[1] == "D" and len(parts) == 2 and t not in traces:
            traces[t] = pending.pop(t, [])
        elif parts[1] == "E":
            pending.pop(t, None)
        elif len(parts) == 3 and parts[1].isdigit() and t not in traces:
            calls += 1
            if calls > MAX_PROBE_CALLS:
                return {k: v for k, v in traces.items()}
            pending.setdefault(t, []).append([int(parts[1]), parts[2]])
    return traces


def judge(sources: list[str], results: bytes, nonce: str, *, trusted: tuple | None = None,
          seed: int = 0, ids: list[int] | None = None, traces: dict | None = None,
          python: list | None = None, hash_seed: int | None = None) -> list[bool | None | str]:
    """Run the judge stage of the bootstrap (a fresh interpreter, never the program) on the
    probe records ``results``; one verdict per judge source: True (passed), False, None
    (a traced test whose step runs, recomputed, are not those the program ran: unscorable),
    or :data:`PYTHON_ONLY` (fails as written, passes in its ``python`` reading; see
    :func:`row_score`).
    Anything short of a clean "passed" from the judge within :data:`JUDGE_SECONDS` fails.
    ``traces``: the step runs of the traced tests, by position in ``sources``; ``python``:
    per source, its Python reading (:attr:`AssertPlan.python`) or None. Records past
    :data:`MAX_RESULT_BYTES` are cut: the tests they belong to never finished (fail)."""
    n = len(sources)
    if len(results) > MAX_RESULT_BYTES:
        results = results[:results.rfind(b"\n", 0, MAX_RESULT_BYTES) + 1]
    if nonce.encode() not in results:
        return [False] * n  # not one record of ours: nothing to judge
    ids = list(range(n)) if ids is None else list(ids)
    job = dict(_judge_job(sources, trusted, ids), nonce=nonce,
               traces={str(k): v for k, v in (traces or {}).items()},
               python=list(python) if python is not None else None)
    ok, raw = _judge_process(job, results, "verdict", 24 * n + 64, seed,
                             seed if hash_seed is None else hash_seed)
    verdicts: list[bool | None] = [False] * n
    if not ok:
        return verdicts
    # The judge writes exactly "PASS <i>" / "MISS <i>" / "PYTH <i>" lines (bounded: n lines).
    for line in raw.decode("ascii", errors="replace").split("\n")[:n]:
        head, _, idx = line.partition(" ")
        if head in _VERDICTS and idx.isdigit() and len(idx) < 10 and int(idx) < n:
            verdicts[int(idx)] = _VERDICTS[head]
    return verdicts


PYTHON_ONLY = "python"  # a verdict: the test's two readings disagree (see the module docstring)
_VERDICTS = {"PASS": True, "MISS": None, "PYTH": PYTHON_ONLY}


def row_score(verdicts: list) -> int | None:
    """Tests passed in one completion's verdicts, or None (unscorable). A test unscorable on
    its own (None) makes the row None; a test that passes only in its Python reading
    (:data:`PYTHON_ONLY`: the program changed what it was handed) counts as failed when
    another test fails (else a wrong program could escape its zeros that way) and makes the
    row None otherwise (the right program may be updating in place)."""
    if None in verdicts:
        return None
    if PYTHON_ONLY in verdicts and False not in verdicts:
        return None
    return sum(v is True for v in verdicts)


def capabilities() -> dict:
    """Whether the jail can be built here: ``{"jail": bool, "error": str | None, "root": bool}``."""
    r = run("pass", mode="stdio", timeout=20.0)
    return {"jail": r.error is None and r.returncode == 0, "error": r.error,
            "root": os.geteuid() == 0}
