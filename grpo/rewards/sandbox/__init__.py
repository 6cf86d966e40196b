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

**Containment** (``bootstrap.py`` builds it; the same on every machine, whether
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

**Where it lives**: :mod:`.policy` (what the judge allows, the caps, the check of trusted code),
:mod:`.jail` (one run in the jail; the stdin/stdout tests), :mod:`.planner` (one assert test split
between the judge and the program), :mod:`.assert_plan` (a completion's tests planned),
:mod:`.verdicts` (the judge, a completion's jobs, a row's score) and ``bootstrap.py`` (the program
the jail and the judge run, read as text and passed to ``python -c``: never imported). This module
re-exports every name they define (the sandbox was one module, ``grpo/rewards/sandbox.py``, and its
names, private ones included, stay where they were); ``grpo/rewards/sandbox_bootstrap.py``, the
bootstrap's former path, is a link to ``bootstrap.py``.
"""

from __future__ import annotations

# The standard modules the one-module sandbox held as attributes (``sandbox.platform``, ``sandbox.secrets``).
import ast  # noqa: F401
import builtins  # noqa: F401
import copy  # noqa: F401
import json  # noqa: F401
import logging  # noqa: F401
import math  # noqa: F401
import os  # noqa: F401
import platform  # noqa: F401
import secrets  # noqa: F401
import select  # noqa: F401
import signal  # noqa: F401
import subprocess  # noqa: F401
import sys
import tempfile  # noqa: F401
import types
import zlib  # noqa: F401
from dataclasses import dataclass, field  # noqa: F401
from functools import lru_cache  # noqa: F401
from importlib import resources  # noqa: F401

from . import assert_plan, jail, planner, policy, verdicts
from .assert_plan import SET_ELEMENT, AssertPlan, plan_assert_tests, top_level_names, unscorable_tests  # noqa: F401
from .jail import (DEFAULT_FILE_MB, DEFAULT_MEMORY_MB, DEFAULT_TMP_MB, JAIL_FAILED, MAX_OUTPUT_BYTES,  # noqa: F401
                   SYS_PIVOT_ROOT, RunResult, SandboxUnavailable, bootstrap_source, capabilities, end_group, memfd,
                   outputs_match, run, run_stdio_test, runtime)
from .planner import AT, DUAL, INPUT, PROBE, STEP, VAL, Planner, Refused  # noqa: F401
from .policy import (BUILTIN_NAMES, ITER_SECONDS, JUDGE_BUILTINS, JUDGE_MODULES, JUDGE_SECONDS,  # noqa: F401
                     JUDGE_TEST_SECONDS, MAX_INPUT_BYTES, MAX_ITER_ITEMS, MAX_PLAN_PASSES, MAX_PROBE_CALLS,
                     MAX_RESULT_BYTES, MAX_SET_ITEMS, MAX_TEST_CHARS, STATEFUL_MODULES, TRUSTED_EXTRA_BUILTINS,
                     check_trusted_code, judge_import, stateful_import)
from .verdicts import JUDGE_FLAGS, PYTHON_ONLY, assert_jobs, judge, judge_inputs, log, row_score  # noqa: F401

_MODULES = (policy, jail, planner, assert_plan, verdicts)
_UNSET = object()


class _Package(types.ModuleType):
    """This package's module type: assigning one of its names (``monkeypatch.setattr(sandbox, "run", f)``,
    ``sandbox.MAX_RESULT_BYTES = n``) assigns it in each of its modules that holds the same binding, so that
    their code sees the new value, as the code of the one-module sandbox did."""

    def __setattr__(self, name: str, value: object) -> None:
        old = self.__dict__.get(name, _UNSET)
        if old is not _UNSET:
            for module in _MODULES:
                if module.__dict__.get(name, _UNSET) is old:
                    setattr(module, name, value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
