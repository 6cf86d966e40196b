"""Rule-based rewards for GRPO: math answers, output format, and sandboxed code.

A wrong rule is trained into the model, so every function here is conservative (a false
positive is a reward hack), bounded in time (a hang stalls the run) and never raises.

Public API (``docs/api.md``)::

    extract_answer(text) -> str | None
    math_equal(pred, gold, *, timeout=5.0) -> bool
    math_accuracy(completion, answer) -> float
    format_reward(completion, *, think_prefilled=False) -> float
    code_reward(completion, tests, *, timeout=5.0) -> float

TRL-style reward functions ``fn(prompts, completions, **columns) -> list[float | None]``:
:func:`math_accuracy_reward`, :func:`format_reward_func`, :func:`code_reward_func`, collected in
:data:`REWARD_FUNCTIONS` under ``"accuracy"``, ``"format"`` and ``"code"``.

How bounded time is achieved: everything done in the caller's process is linear string work
on length-capped text (no regex that can backtrack: answer and code blocks are found with
``str.find``); SymPy work runs in persistent worker processes (:mod:`grpo.math_worker`: fresh
interpreters, never a fork of the trainer) that are killed (SIGKILL) and replaced when a request
outlives its ``timeout``, so even a power tower stuck inside C code costs at most ``timeout``.
Calls may come from any thread: each one checks out a whole worker. Pure numbers never leave the
calling process (``grpo._math_normalize.fast_equal``).

``timeout`` arguments must be finite and in (0, 1 day] (:func:`check_timeout`): anything else
raises ValueError / TypeError naming ``timeout`` -- a configuration error, never model output.
The other exception is :class:`VerifierUnavailable`, raised by ``math_equal`` /
``math_accuracy`` when no SymPy worker can start (logged once); the TRL-style
``math_accuracy_reward`` turns it into ``None`` (unscorable) instead.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import re
import unicodedata
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Sequence

from grpo import _math_normalize as _mn
from grpo import _sandbox
from grpo.math_worker import VerifierUnavailable, WorkerError, WorkerPool

__all__ = [
    "extract_answer", "math_equal", "math_accuracy", "format_reward", "code_reward",
    "code_rewards", "math_accuracy_reward", "format_reward_func", "code_reward_func",
    "REWARD_FUNCTIONS", "completion_text", "VerifierUnavailable",
]

MAX_TEXT_CHARS = 1_000_000  # completions longer than this are not parsed at all
log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------
# Answer extraction and format
# --------------------------------------------------------------------------------------------

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
        m = re.match(r"\s+([^\s$]{1,200})", rest)
        return m.group(1) if m else None
    return None


def _last_answer_block(text: str) -> str | None:
    """Body of the last ``<answer>...</answer>``: the last close tag and the open tag nearest
    before it (two ``rfind`` calls: linear, where a lazy regex is quadratic on repeated tags)."""
    close = text.rfind("</answer>")
    if close < 0:
        return None
    start = text.rfind("<answer>", 0, close)
    return None if start < 0 else text[start + len("<answer>"):close]


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
        body = _last_answer_block(text)
        if body is not None:
            if _BOX_RE.search(body):
                return _last_box(body)
            return body.strip() or None
        return _last_box(text)
    except Exception:  # noqa: BLE001 - a reward never raises
        return None


_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def format_reward(completion: Any, *, think_prefilled: bool = False) -> float:
    """1.0 for exactly ``<think>...</think><answer>...</answer>``, else 0.0.

    Each block appears once, both hold a visible character (zero-width, format, control and
    combining characters and unicode blanks do not count: see :func:`_visible`), only such
    invisible characters may surround them, and no tag appears inside another block. ``think_prefilled=True`` is for chat templates that already
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
            if _visible(head):
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
        if not _visible(think) or not _visible(answer) or _visible(between) or _visible(after):
            return 0.0
        return 1.0
    except Exception:  # noqa: BLE001
        return 0.0


# Characters that render as nothing: spaces and separators (Z*), format characters such as
# U+200B/U+2060/U+FEFF/U+00AD (Cf), controls (Cc), unassigned/private/surrogates (Cn/Co/Cs),
# combining marks without a base (M*), and the Hangul/Braille blanks that are category Lo/So.
_INVISIBLE_CATEGORIES = ("Z", "C", "M")
_BLANK_LETTERS = frozenset("\u115f\u1160\u3164\uffa0\u2800\u180e\u17b4\u17b5")


def _visible(text: str) -> bool:
    """Whether ``text`` holds a character that is seen when rendered (linear)."""
    for c in text:
        if c not in _BLANK_LETTERS and not unicodedata.category(c).startswith(_INVISIBLE_CATEGORIES):
            return True
    return False


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
# Math workers (grpo.math_worker)
# --------------------------------------------------------------------------------------------

_POOL_SIZE = max(1, min(4, os.cpu_count() or 1))
_pool = WorkerPool(_POOL_SIZE)
atexit.register(lambda: _pool.shutdown())


def _forget_pool_in_child() -> None:
    # A forked child (e.g. a DataLoader worker) must not talk over the parent's pipes.
    global _pool
    _pool = WorkerPool(_POOL_SIZE)


os.register_at_fork(after_in_child=_forget_pool_in_child)

MAX_TIMEOUT = 86_400.0  # seconds; longer is a configuration error, not a budget


def check_timeout(timeout: Any) -> float:
    """``timeout`` as a float; ValueError/TypeError naming it unless finite and in (0, 1 day]."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, got {type(timeout).__name__}")
    t = float(timeout)
    if not (math.isfinite(t) and 0 < t <= MAX_TIMEOUT):
        raise ValueError(f"timeout must be finite, > 0 and <= {MAX_TIMEOUT:g} seconds, got {timeout!r}")
    return t


def _compare(pred: Any, gold: Any, timeout: float) -> bool | None:
    """True/False, or None when the gold answer cannot be parsed.

    Raises only VerifierUnavailable (no worker can start): every other failure of the answer
    (too long, timeout, a crash of the worker) is "not equal".
    """
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
    except Exception:  # noqa: BLE001 - cleaning is bounded string work; a bug is "not equal"
        return False
    try:
        # An empty prediction still goes to the worker, which reports an unparseable gold.
        return _pool.compare(p, g, timeout)
    except WorkerError:
        return False


def math_equal(pred: Any, gold: Any, *, timeout: float = 5.0) -> bool:
    """Whether ``pred`` and ``gold`` are the same mathematical answer.

    Never raises on any ``pred`` / ``gold``; raises ValueError/TypeError for an invalid
    ``timeout`` and :class:`VerifierUnavailable` when no SymPy worker can start.

    Rules (full text in ``grpo._math_normalize``): structural split first -- sets and lists of
    several answers are unordered, tuples and intervals ordered with matching brackets,
    matrices cell by cell, ``\\pm a`` is the set ``{a, -a}``; ``x = 5`` equals ``5``; equations
    compare up to a constant factor; then SymPy equivalence of the leaves.

    Decimals are the exact rationals they spell and equal only equal values (``0.5 == 1/2``,
    ``0.3333 != 1/3``, ``3.000 != 3.0001``); ``h:mm`` answers compare as times; a predicted
    ``x%`` is ``x/100``; units are dropped but never a digit, and digits are never joined across
    spaces.

    Bounded: parsing and simplification run in a worker process that is killed after
    ``timeout`` seconds (result False); values that would be enormous (``10^{10^{10}}``) are
    refused before evaluation; inputs over 2000 characters are refused outright.
    """
    return _compare(pred, gold, check_timeout(timeout)) is True


def math_accuracy(completion: Any, answer: Any, *, timeout: float = 5.0) -> float:
    """1.0 when the completion's final answer (see :func:`extract_answer`) equals ``answer``.

    ``answer`` may be a bare answer or a worked solution containing ``\\boxed{...}``. A
    completion without a boxed / ``<answer>`` final answer scores 0.0: guessing the last
    number of free text would reward answer-less outputs. Raises like :func:`math_equal`.
    """
    timeout = check_timeout(timeout)
    pred = extract_answer(completion)
    gold = _gold_answer(answer)
    if pred is None or gold is None:
        return 0.0
    return 1.0 if _compare(pred, gold, timeout) is True else 0.0


def _gold_answer(answer: Any) -> str | None:
    try:
        if answer is None:
            return None
        text = completion_text(answer) if not isinstance(answer, (int, float)) else str(answer)
        if len(text) > MAX_TEXT_CHARS:
            return None
        if _BOX_RE.search(text) or "<answer>" in text:
            return extract_answer(text)
        return text.strip() or None
    except Exception:  # noqa: BLE001
        return None


# --------------------------------------------------------------------------------------------
# Code
# --------------------------------------------------------------------------------------------

_FENCE_LANGS = ("python3", "python", "py")


def _last_python_block(text: str) -> str | None:
    """Body of the last complete ```python block (linear scan over the fences, no regex).

    Fences pair up left to right: an opening fence is ``` plus a language tag on its line, the
    next ``` closes it.
    """
    last, pos = None, 0
    while True:
        start = text.find("```", pos)
        if start < 0:
            return last
        eol = text.find("\n", start + 3)
        if eol < 0:
            return last
        tag = text[start + 3:eol].strip(" \t").lower()
        end = text.find("```", eol + 1)
        if end < 0:
            return last
        if tag in _FENCE_LANGS:
            last = text[eol + 1:end]
        pos = end + 3


def extract_code(completion: Any) -> str | None:
    """The last fenced ```python block, else the ``<answer>`` body, else None."""
    text = completion_text(completion)
    if not text or len(text) > MAX_TEXT_CHARS:
        return None
    block = _last_python_block(text)
    if block is not None:
        return block
    body = _last_answer_block(text)
    return body if body is not None and body.strip() else None


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


def _jobs(code: str, tests: list, timeout: float) -> list[Callable[[], list[tuple[int, bool]]]]:
    """Units of sandboxed work, each returning ``[(test index, passed)]`` (see ``grpo._sandbox``:
    value tests share one run, statement tests and stdin tests get one run each)."""
    if isinstance(tests[0], str):
        return _sandbox.assert_jobs(code, tests, timeout=timeout)
    return [lambda i=i, t=t: [(i, _sandbox.run_stdio_test(code, t["input"], t["output"],
                                                          timeout=timeout))]
            for i, t in enumerate(tests)]


_sandbox_failure_logged = False


def code_rewards(completions: Sequence[Any], tests: Sequence[Any], *, timeout: float = 5.0,
                 max_workers: int | None = None) -> list[float | None]:
    """Score many completions in parallel (thread pool over sandboxed subprocesses).

    ``tests[i]`` belongs to ``completions[i]``; the two must have the same length (ValueError
    otherwise). Returns the fraction of tests passed per completion, or None where its tests are
    missing or malformed, or where the sandbox cannot be built on this machine (logged once:
    code is never run unconfined). ``timeout`` bounds each sandboxed process.
    """
    timeout = check_timeout(timeout)
    completions, tests = list(completions), list(tests)
    if len(tests) != len(completions):
        raise ValueError(f"tests has {len(tests)} rows for {len(completions)} completions")
    units: list[tuple[int, Callable[[], list[tuple[int, bool]]]]] = []
    totals: list[int | None] = []
    for i, (completion, test) in enumerate(zip(completions, tests)):
        norm = _normalise_tests(test)
        code = extract_code(completion)
        totals.append(None if norm is None else len(norm))
        if norm is not None and code is not None:
            units.extend((i, job) for job in _jobs(code, norm, timeout))
    passed = [0] * len(totals)
    unavailable: set[int] = set()

    def run(unit: tuple[int, Callable[[], list[tuple[int, bool]]]]) -> tuple[int, int | None]:
        global _sandbox_failure_logged
        try:
            return unit[0], sum(ok for _, ok in unit[1]())
        except _sandbox.SandboxUnavailable as e:
            if not _sandbox_failure_logged:
                _sandbox_failure_logged = True
                log.error("grpo.rewards: the code sandbox cannot be built (%s); code rewards "
                          "are unscorable", e)
            return unit[0], None
        except Exception:  # noqa: BLE001 - a failure of one run fails its tests
            return unit[0], 0

    workers = max_workers or max(2, min(16, 2 * (os.cpu_count() or 1)))
    if units:
        with ThreadPoolExecutor(max_workers=min(workers, len(units))) as ex:
            for i, n in ex.map(run, units):
                if n is None:
                    unavailable.add(i)
                else:
                    passed[i] += n
    return [None if t is None or i in unavailable else passed[i] / t
            for i, t in enumerate(totals)]


def code_reward(completion: Any, tests: Any, *, timeout: float = 5.0) -> float:
    """Fraction of ``tests`` the completion's code passes, run in the sandbox.

    The code is the last fenced ```python block, else the ``<answer>`` body. ``tests`` is a
    list of statements (``assert f(2) == 4``; passes when it raises nothing after the code ran)
    or of ``{"input", "output"}`` pairs (stdin in; the whole stdout must equal ``output`` line by
    line with trailing whitespace stripped, and the program must exit 0). See
    ``grpo._sandbox`` for how verdicts are reached and what the sandbox enforces. Never raises
    on any completion; raises ValueError/TypeError for an invalid ``timeout``. Scores 0.0
    where :func:`code_rewards` says None (use ``code_rewards`` to tell them apart).
    """
    result = code_rewards([completion], [tests], timeout=timeout)[0]
    return 0.0 if result is None else float(result)


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
    """TRL reward: 1.0 / 0.0 per completion; None where the gold answer is missing or
    unparseable, or where no SymPy worker can start (:class:`VerifierUnavailable`, logged once)."""
    timeout = check_timeout(timeout)
    golds = [_gold_answer(a) for a in _column("answer", answer, len(completions))]

    def score(i: int) -> float | None:
        if golds[i] is None:
            return None
        try:
            verdict = _compare(extract_answer(completions[i]), golds[i], timeout)
        except VerifierUnavailable:
            return None  # logged once by the worker pool
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
