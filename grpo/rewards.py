"""Rule-based rewards for GRPO: math answers, output format, and sandboxed code.

A wrong rule is trained into the model, so every function here is conservative (a false
positive is a reward hack), bounded in time (a hang stalls the run) and never raises.

Public API (``shared/API.md``)::

    extract_answer(text) -> str | None
    math_equal(pred, gold, *, timeout=5.0) -> bool
    math_accuracy(completion, answer) -> float
    format_reward(completion, *, think_prefilled=False) -> float
    code_reward(completion, tests, *, timeout=5.0) -> float

TRL-style reward functions ``fn(prompts, completions, **columns) -> list[float | None]``:
:func:`math_accuracy_reward`, :func:`format_reward_func`, :func:`code_reward_func`, collected in
:data:`REWARD_FUNCTIONS` under ``"accuracy"``, ``"format"`` and ``"code"``.

How bounded time is achieved for math: SymPy work runs in persistent worker processes (fresh
interpreters started with ``subprocess``, never a fork of the trainer, so torch's threads and the
trainer's ``__main__`` are not copied) that serve requests over a pipe. A request that outlives
its timeout gets its worker killed (SIGKILL) and replaced on the next call, so even a power tower
stuck inside C code costs at most ``timeout``. Calls may come from any thread: each one checks
out a whole worker. Pure numbers never leave the calling process (see
``grpo._math_normalize.fast_equal``).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Sequence

from grpo import _math_normalize as _mn
from grpo import _sandbox

__all__ = [
    "extract_answer", "math_equal", "math_accuracy", "format_reward", "code_reward",
    "code_rewards", "math_accuracy_reward", "format_reward_func", "code_reward_func",
    "REWARD_FUNCTIONS", "completion_text",
]

MAX_TEXT_CHARS = 1_000_000  # completions longer than this are not parsed at all

# --------------------------------------------------------------------------------------------
# Answer extraction and format
# --------------------------------------------------------------------------------------------

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.S)
_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def _last_box(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` / ``\\boxed 5``; None if unclosed."""
    matches = list(_BOX_RE.finditer(text))
    if not matches:
        return None
    rest = text[matches[-1].end():]
    stripped = rest.lstrip()
    if stripped.startswith("{"):
        start = len(rest) - len(stripped)
        end = _mn._matching_brace(rest, start)
        if end < 0:
            return None  # truncated: the model never closed its answer
        return rest[start + 1:end].strip() or None
    if rest[:1].isspace():  # "\boxed 5": the next token
        m = re.match(r"\s+([^\s$]+)", rest)
        return m.group(1) if m else None
    return None


def extract_answer(text: Any) -> str | None:
    """The final answer of a completion, or None.

    The last ``<answer>...</answer>`` block wins (a ``\\boxed`` inside it is unwrapped); without
    one, the last ``\\boxed{...}`` (nested braces, ``\\boxed 5``, ``\\fbox{...}``). An unclosed
    last box (truncated output) gives None rather than an earlier, abandoned answer.
    """
    try:
        text = completion_text(text)
        if not text or len(text) > MAX_TEXT_CHARS:
            return None
        blocks = _ANSWER_RE.findall(text)
        if blocks:
            body = blocks[-1]
            if _BOX_RE.search(body):
                return _last_box(body)
            return body.strip() or None
        return _last_box(text)
    except Exception:  # noqa: BLE001 - a reward never raises
        return None


_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def format_reward(completion: Any, *, think_prefilled: bool = False) -> float:
    """1.0 for exactly ``<think>...</think><answer>...</answer>``, else 0.0.

    Each block appears once, both are non-blank, only whitespace may surround them, and no tag
    appears inside another block. ``think_prefilled=True`` is for chat templates that already
    emitted ``<think>``: the completion starts inside the think block, so it must not contain
    ``<think>`` itself.
    """
    try:
        text = completion_text(completion)
        if not text or len(text) > MAX_TEXT_CHARS:
            return 0.0
        counts = {t: text.count(t) for t in _TAGS}
        expected_open = 0 if think_prefilled else 1
        if counts["<think>"] != expected_open or any(counts[t] != 1 for t in _TAGS[1:]):
            return 0.0
        if think_prefilled:
            think_start = 0
        else:
            head, _, _ = text.partition("<think>")
            if head.strip():
                return 0.0
            think_start = text.index("<think>") + len("<think>")
        think_end = text.index("</think>")
        ans_open = text.index("<answer>")
        ans_close = text.index("</answer>")
        if not think_start <= think_end < ans_open < ans_close:
            return 0.0
        think = text[think_start:think_end]
        between = text[think_end + len("</think>"):ans_open]
        answer = text[ans_open + len("<answer>"):ans_close]
        after = text[ans_close + len("</answer>"):]
        if not think.strip() or not answer.strip() or between.strip() or after.strip():
            return 0.0
        return 1.0
    except Exception:  # noqa: BLE001
        return 0.0


def completion_text(completion: Any) -> str:
    """Text of a completion given as a string or as TRL chat messages."""
    if completion is None:
        return ""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return completion_text(completion.get("content"))
    if isinstance(completion, (list, tuple)):
        if completion and all(isinstance(m, dict) and "role" in m for m in completion):
            assistant = [m for m in completion if m.get("role") == "assistant"] or list(completion)
            return completion_text(assistant[-1].get("content"))
        # content given as parts: [{"type": "text", "text": ...}, ...]
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in completion)
    return str(completion)


# --------------------------------------------------------------------------------------------
# Math workers
# --------------------------------------------------------------------------------------------

_WORKER_SCRIPT = os.path.abspath(_mn.__file__)
_WORKER_MEMORY = 3 << 30  # RLIMIT_AS of a math worker: room for SymPy, not for a blow-up
_STARTUP_TIMEOUT = 120.0  # importing SymPy on a loaded machine; not charged to any request


class _WorkerError(Exception):
    """The worker died, timed out or said something unreadable; it has been killed."""


class _MathWorker:
    """One persistent SymPy process speaking JSON lines over its stdin/stdout."""

    def __init__(self) -> None:
        # subprocess = fork+exec in C: safe from any thread, and the child is a fresh
        # interpreter, so neither torch's threads nor the trainer's __main__ come along.
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-B", _WORKER_SCRIPT, str(os.getpid()), str(_WORKER_MEMORY)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            close_fds=True, start_new_session=True,
        )
        self._buf = b""
        try:
            ready = self._read_line(time.monotonic() + _STARTUP_TIMEOUT)
        except _WorkerError:
            self.kill()
            raise
        if not ready.get("ready"):
            self.kill()
            raise _WorkerError("worker did not start")

    def _read_line(self, deadline: float) -> dict:
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _WorkerError("timeout")
            readable, _, _ = select.select([fd], [], [], left)
            if readable:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise _WorkerError("worker exited")
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        try:
            return json.loads(line)
        except ValueError as e:
            raise _WorkerError("bad reply") from e

    def ask(self, pred: str, gold: str, timeout: float) -> bool | None:
        """Send one comparison; raises _WorkerError (after killing the worker) on any failure."""
        deadline = time.monotonic() + timeout
        try:
            self.proc.stdin.write(json.dumps({"p": pred, "g": gold}).encode() + b"\n")
            self.proc.stdin.flush()
            reply = self._read_line(deadline)
        except (OSError, ValueError, _WorkerError) as e:
            self.kill()
            raise _WorkerError(str(e)) from e
        return reply.get("r")

    def kill(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class _WorkerPool:
    """Up to ``size`` workers; a call checks one out, so concurrent threads never share one."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._idle: list[_MathWorker] = []
        self._all: set[_MathWorker] = set()
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(size)

    def compare(self, pred: str, gold: str, timeout: float) -> bool | None:
        with self._slots:
            with self._lock:
                worker = self._idle.pop() if self._idle else None
            if worker is None:
                worker = _MathWorker()
                with self._lock:
                    self._all.add(worker)
            try:
                result = worker.ask(pred, gold, timeout)
            except _WorkerError:
                with self._lock:
                    self._all.discard(worker)
                raise
            with self._lock:
                self._idle.append(worker)
            return result

    def shutdown(self) -> None:
        with self._lock:
            workers, self._all, self._idle = list(self._all), set(), []
        for w in workers:
            w.kill()


_POOL_SIZE = max(1, min(4, os.cpu_count() or 1))
_pool = _WorkerPool(_POOL_SIZE)
atexit.register(lambda: _pool.shutdown())


def _forget_pool_in_child() -> None:
    # A forked child (e.g. a DataLoader worker) must not talk over the parent's pipes.
    global _pool
    _pool = _WorkerPool(_POOL_SIZE)


os.register_at_fork(after_in_child=_forget_pool_in_child)


def _compare(pred: Any, gold: Any, timeout: float) -> bool | None:
    """True/False, or None when the gold answer cannot be parsed. Never raises."""
    try:
        g = _mn.clean(gold)
        if not g:
            return None
        p = "" if pred is None else _mn.clean(pred)
        if p is None:
            return False  # too long to be an answer
        if p:
            quick = _mn.fast_equal(p, g)
            if quick is not None:
                return quick
        # An empty prediction still goes to the worker, which reports an unparseable gold.
        return _pool.compare(p, g, max(0.05, float(timeout)))
    except Exception:  # noqa: BLE001 - timeouts and dead workers score as "not equal"
        return False


def math_equal(pred: Any, gold: Any, *, timeout: float = 5.0) -> bool:
    """Whether ``pred`` and ``gold`` are the same mathematical answer. Never raises.

    Rules (full text in ``grpo._math_normalize``): structural split first -- sets and lists of
    several answers are unordered, tuples and intervals ordered with matching brackets,
    matrices cell by cell, ``\\pm a`` is the set ``{a, -a}``; ``x = 5`` equals ``5``; equations
    compare up to a constant factor; then SymPy equivalence of the leaves.

    Floats against exact values: decimals are exact rationals (``0.5 == 1/2``). A decimal that
    is not exactly equal still matches when it has at least 4 significant digits and is the
    other value correctly rounded (within half a unit of its last digit) or truncated to its
    number of decimals: ``0.3333 == 1/3``, ``0.6666 == 2/3``, ``1.414 == sqrt(2)``, but
    ``1.415 != sqrt(2)``, ``0.33 != 1/3``, ``3.14 != pi``, and integers are never approximated.

    Bounded: parsing and simplification run in a worker process that is killed after
    ``timeout`` seconds (result False); values that would be enormous (``10^{10^{10}}``) are
    refused before evaluation; inputs over 2000 characters are refused outright.
    """
    return _compare(pred, gold, timeout) is True


def math_accuracy(completion: Any, answer: Any, *, timeout: float = 5.0) -> float:
    """1.0 when the completion's final answer (see :func:`extract_answer`) equals ``answer``.

    ``answer`` may be a bare answer or a worked solution containing ``\\boxed{...}``. A
    completion without a boxed / ``<answer>`` final answer scores 0.0: guessing the last
    number of free text would reward answer-less outputs.
    """
    try:
        pred = extract_answer(completion)
        gold = _gold_answer(answer)
        if pred is None or gold is None:
            return 0.0
        return 1.0 if math_equal(pred, gold, timeout=timeout) else 0.0
    except Exception:  # noqa: BLE001
        return 0.0


def _gold_answer(answer: Any) -> str | None:
    if answer is None:
        return None
    text = completion_text(answer) if not isinstance(answer, (int, float)) else str(answer)
    if _BOX_RE.search(text) or "<answer>" in text:
        return extract_answer(text)
    return text.strip() or None


# --------------------------------------------------------------------------------------------
# Code
# --------------------------------------------------------------------------------------------

_FENCE_RE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.S | re.I)


def extract_code(completion: Any) -> str | None:
    """The last fenced ```python block, else the ``<answer>`` body, else None."""
    text = completion_text(completion)
    if not text or len(text) > MAX_TEXT_CHARS:
        return None
    blocks = _FENCE_RE.findall(text)
    if blocks:
        return blocks[-1]
    answers = _ANSWER_RE.findall(text)
    if answers and answers[-1].strip():
        return answers[-1]
    return None


def _normalise_tests(tests: Any) -> list | None:
    """Tests as a list of str or of {"input", "output"} dicts (a JSON string is accepted)."""
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except ValueError:
            tests = [tests]
    if isinstance(tests, dict) and "input" in tests and "output" in tests:
        ins, outs = tests["input"], tests["output"]
        tests = ([{"input": i, "output": o} for i, o in zip(ins, outs)]
                 if isinstance(ins, list) else [tests])
    if not isinstance(tests, (list, tuple)) or not tests:
        return None
    if all(isinstance(t, str) for t in tests):
        return list(tests)
    if all(isinstance(t, dict) and "input" in t and "output" in t for t in tests):
        return [{"input": str(t["input"]), "output": str(t["output"])} for t in tests]
    return None


def _jobs(code: str, tests: list, timeout: float) -> list[Callable[[], list[bool]]]:
    """Units of sandboxed work: one run for all assert tests, one run per stdin test."""
    if isinstance(tests[0], str):
        return [lambda: _sandbox.run_asserts(code, tests, timeout=timeout)]
    return [lambda t=t: [_sandbox.run_stdio_test(code, t["input"], t["output"], timeout=timeout)]
            for t in tests]


def code_rewards(completions: Sequence[Any], tests: Sequence[Any], *, timeout: float = 5.0,
                 max_workers: int | None = None) -> list[float | None]:
    """Score many completions in parallel (thread pool over sandboxed subprocesses).

    ``tests[i]`` belongs to ``completions[i]``. Returns the fraction of tests passed per
    completion, or None where its tests are missing or malformed. Assert tests run in one
    process per completion (``timeout`` bounds the whole run; tests not reached fail);
    stdin/stdout tests run in one process each (``timeout`` per test).
    """
    units: list[tuple[int, Callable[[], list[bool]]]] = []
    totals: list[int | None] = []
    for i, (completion, test) in enumerate(zip(completions, tests)):
        norm = _normalise_tests(test)
        code = extract_code(completion)
        totals.append(None if norm is None else len(norm))
        if norm is not None and code is not None:
            units.extend((i, job) for job in _jobs(code, norm, float(timeout)))
    passed = [0] * len(totals)

    def run(unit: tuple[int, Callable[[], list[bool]]]) -> tuple[int, int]:
        try:
            return unit[0], sum(unit[1]())
        except Exception:  # noqa: BLE001
            return unit[0], 0

    workers = max_workers or max(2, min(16, 2 * (os.cpu_count() or 1)))
    if units:
        with ThreadPoolExecutor(max_workers=min(workers, len(units))) as ex:
            for i, n in ex.map(run, units):
                passed[i] += n
    return [None if t is None else passed[i] / t for i, t in enumerate(totals)]


def code_reward(completion: Any, tests: Any, *, timeout: float = 5.0) -> float:
    """Fraction of ``tests`` the completion's code passes, run in the sandbox. Never raises.

    The code is the last fenced ```python block, else the ``<answer>`` body. ``tests`` is a
    list of statements (``assert f(2) == 4``; passes when it raises nothing after the code ran)
    or of ``{"input", "output"}`` pairs (stdin in; the whole stdout must equal ``output`` line by
    line with trailing whitespace stripped, and the program must exit 0). See
    ``grpo._sandbox`` for what the sandbox enforces.
    """
    try:
        result = code_rewards([completion], [tests], timeout=timeout)[0]
        return 0.0 if result is None else float(result)
    except Exception:  # noqa: BLE001
        return 0.0


# --------------------------------------------------------------------------------------------
# TRL-style reward functions
# --------------------------------------------------------------------------------------------


def _column(name: str, value: Any, n: int) -> list:
    if value is None:
        return [None] * n
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        return [value] * n
    value = list(value)
    if len(value) != n:
        raise ValueError(f"column {name!r} has {len(value)} rows for {n} completions")
    return value


def math_accuracy_reward(prompts: Sequence[Any], completions: Sequence[Any], answer: Any = None,
                         *, timeout: float = 5.0, **kwargs: Any) -> list[float | None]:
    """TRL reward: 1.0 / 0.0 per completion; None where the gold answer is missing or unparseable."""
    golds = [_gold_answer(a) for a in _column("answer", answer, len(completions))]

    def score(i: int) -> float | None:
        if golds[i] is None:
            return None
        verdict = _compare(extract_answer(completions[i]), golds[i], timeout)
        return None if verdict is None else float(verdict)

    with ThreadPoolExecutor(max_workers=_POOL_SIZE) as ex:
        return list(ex.map(score, range(len(completions))))


def format_reward_func(prompts: Sequence[Any], completions: Sequence[Any], *,
                       think_prefilled: bool = False, **kwargs: Any) -> list[float | None]:
    """TRL reward: :func:`format_reward` per completion."""
    return [format_reward(c, think_prefilled=think_prefilled) for c in completions]


def code_reward_func(prompts: Sequence[Any], completions: Sequence[Any], tests: Any = None, *,
                     timeout: float = 5.0, **kwargs: Any) -> list[float | None]:
    """TRL reward: fraction of tests passed; None where a row has no usable tests."""
    return code_rewards(completions, _column("tests", tests, len(completions)), timeout=timeout)


REWARD_FUNCTIONS: dict[str, Callable[..., list[float | None]]] = {
    "accuracy": math_accuracy_reward,
    "format": format_reward_func,
    "code": code_reward_func,
}
