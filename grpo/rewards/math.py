"""Math answers: extraction of the final answer and equivalence with the gold answer.

The rules are documented once, in :mod:`grpo.rewards.math_normalize`; SymPy work runs in the
worker processes of :mod:`grpo.rewards.worker`.
"""

from __future__ import annotations

import atexit
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from grpo.rewards import math_normalize as _mn
from grpo.rewards._common import MAX_TEXT_CHARS, as_column, check_timeout, completion_text, last_answer_block
from grpo.rewards.worker import VerifierUnavailable, WorkerError, WorkerPool

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
        end = _mn.matching_brace(rest, start)
        if end < 0:
            return None  # truncated: the model never closed its answer
        return rest[start + 1:end].strip() or None
    if rest[:1].isspace():  # "\boxed 5": the next token
        m = re.match(r"\s+([^\s$]{1,200})", rest)
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
        body = last_answer_block(text)
        if body is not None:
            if _BOX_RE.search(body):
                return _last_box(body)
            return body.strip() or None
        return _last_box(text)
    except Exception:  # noqa: BLE001 - a reward never raises
        return None



# --------------------------------------------------------------------------------------------
# Math workers (grpo.rewards.worker)
# --------------------------------------------------------------------------------------------

_POOL_SIZE = max(1, min(4, os.cpu_count() or 1))
_pool = WorkerPool(_POOL_SIZE)
atexit.register(lambda: _pool.shutdown())


def _forget_pool_in_child() -> None:
    # A forked child (e.g. a DataLoader worker) must not talk over the parent's pipes.
    global _pool
    _pool = WorkerPool(_POOL_SIZE)


os.register_at_fork(after_in_child=_forget_pool_in_child)


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

    Rules (full text in ``grpo.rewards.math_normalize``): structural split first -- sets and lists of
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



def math_accuracy_reward(prompts: Sequence[Any], completions: Sequence[Any], answer: Any = None,
                         *, timeout: float = 5.0, **kwargs: Any) -> list[float | None]:
    """TRL reward: 1.0 / 0.0 per completion; None where the gold answer is missing or
    unparseable, or where no SymPy worker can start (:class:`VerifierUnavailable`, logged once)."""
    timeout = check_timeout(timeout)
    golds = [_gold_answer(a) for a in as_column("answer", answer, len(completions))]

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

