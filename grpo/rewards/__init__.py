"""Rule-based rewards for GRPO: math answers, output format, and sandboxed code.

A wrong rule is trained into the model, so every function here is conservative (a false
positive is a reward hack), bounded in time (a hang stalls the run) and never raises.

Public API (``docs/api.md``)::

    extract_answer(text) -> str | None
    math_equal(pred, gold, *, timeout=5.0) -> bool
    math_accuracy(completion, answer) -> float
    format_reward(completion, *, think_prefilled=False) -> float
    code_reward(completion, tests, *, timeout=5.0, trusted_code=None) -> float

TRL-style reward functions ``fn(prompts, completions, **columns) -> list[float | None]``:
:func:`math_accuracy_reward`, :func:`format_reward_func`, :func:`code_reward_func`, collected in
:data:`REWARD_FUNCTIONS` under ``"accuracy"``, ``"format"`` and ``"code"``.

How bounded time is achieved: everything done in the caller's process is linear string work
on length-capped text (no regex that can backtrack: answer and code blocks are found with
``str.find``); SymPy work runs in persistent worker processes (:mod:`grpo.rewards.worker`: fresh
interpreters, never a fork of the trainer) that are killed (SIGKILL) and replaced when a request
outlives its ``timeout``, so even a power tower stuck inside C code costs at most ``timeout``.
Calls may come from any thread: each one checks out a whole worker. Pure numbers never leave the
calling process (``grpo.rewards.math_normalize.fast_equal``).

``timeout`` arguments must be finite and in (0, 1 day] (:func:`check_timeout`): anything else
raises ValueError / TypeError naming ``timeout`` -- a configuration error, never model output.
The other exception is :class:`VerifierUnavailable`, raised by ``math_equal`` /
``math_accuracy`` when no SymPy worker can start (logged once); the TRL-style
``math_accuracy_reward`` turns it into ``None`` (unscorable) instead.
"""

from __future__ import annotations

from typing import Callable

from grpo.rewards._common import MAX_TEXT_CHARS, check_timeout, completion_text
from grpo.rewards.code import code_reward, code_reward_func, code_rewards, extract_code
from grpo.rewards.format import format_reward, format_reward_func
from grpo.rewards.math import (extract_answer, math_accuracy, math_accuracy_reward, math_equal)
from grpo.rewards.worker import VerifierUnavailable

__all__ = [
    "extract_answer", "math_equal", "math_accuracy", "format_reward", "code_reward",
    "code_rewards", "math_accuracy_reward", "format_reward_func", "code_reward_func",
    "REWARD_FUNCTIONS", "completion_text", "VerifierUnavailable",
]

REWARD_FUNCTIONS: dict[str, Callable[..., list[float | None]]] = {
    "accuracy": math_accuracy_reward,
    "format": format_reward_func,
    "code": code_reward_func,
}
