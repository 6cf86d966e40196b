"""Code reward: the completion's Python run against tests in the sandbox (:mod:`grpo.rewards.sandbox`)."""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from grpo.rewards import sandbox as _sandbox
from grpo.rewards._common import MAX_TEXT_CHARS, as_column, check_timeout, completion_text, last_answer_block

log = logging.getLogger("grpo.rewards")

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
    body = last_answer_block(text)
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


def _jobs(code: str, tests: list, timeout: float, trusted_code: str | None
          ) -> list[Callable[[], list[tuple[int, bool | None | str]]]]:
    """Units of sandboxed work, each returning ``[(test index, verdict)]`` (True, False, or None
    where the test cannot be judged); see ``grpo.rewards.sandbox``: assert tests share one run,
    stdin tests get one run each. ``trusted_code`` applies to assert tests only."""
    if isinstance(tests[0], str):
        return _sandbox.assert_jobs(code, tests, timeout=timeout, trusted_code=trusted_code)
    return [lambda i=i, t=t: [(i, _sandbox.run_stdio_test(code, t["input"], t["output"],
                                                          timeout=timeout))]
            for i, t in enumerate(tests)]


_sandbox_failure_logged = False
_bad_trusted_logged: set[str] = set()


def _trusted_ok(trusted_code: Any) -> bool:
    """Whether a row's ``trusted_code`` is usable; a bad one is logged once per reason."""
    try:
        _sandbox.check_trusted_code(trusted_code)
        return True
    except (TypeError, ValueError) as e:
        if str(e) not in _bad_trusted_logged and len(_bad_trusted_logged) < 1000:
            _bad_trusted_logged.add(str(e))
            log.error("grpo.rewards: %s; the rows with this trusted_code are unscorable", e)
        return False


def code_rewards(completions: Sequence[Any], tests: Sequence[Any], *, timeout: float = 5.0,
                 max_workers: int | None = None,
                 trusted_code: Sequence[str | None] | None = None) -> list[float | None]:
    """Score many completions in parallel (thread pool over sandboxed subprocesses).

    ``tests[i]`` (and ``trusted_code[i]``, when given) belong to ``completions[i]``; the lengths
    must match (ValueError otherwise). Returns the fraction of tests passed per completion, or
    None (unscorable: the trainer gives such a completion no advantage) where its tests are
    missing or malformed, where one of its tests cannot be judged whatever the program (the
    planner refuses it on its own, or its judge side fails: see :func:`unscorable_rows`),
    where its only shortfall is a test that passes only on what the program left in a value
    the test handed it (``grpo.rewards.sandbox.row_score``: beside a failed test it counts as
    failed),
    where its ``trusted_code`` is bad (not a str, does not parse, does I/O or imports outside
    the judge's modules: logged once), or where the sandbox cannot be built on this machine
    (logged once: code is never run unconfined). ``timeout`` bounds each sandboxed process.
    ``trusted_code``: per row, the problem's own helper definitions, defined in the judge,
    where the tests' calls of those names resolve (see ``grpo.rewards.sandbox``).
    """
    timeout = check_timeout(timeout)
    completions, tests = list(completions), list(tests)
    if len(tests) != len(completions):
        raise ValueError(f"tests has {len(tests)} rows for {len(completions)} completions")
    trusted = as_column("trusted_code", trusted_code, len(completions))
    units: list[tuple[int, Callable[[], list[tuple[int, bool | None | str]]]]] = []
    totals: list[int | None] = []
    for i, (completion, test) in enumerate(zip(completions, tests)):
        norm = _normalise_tests(test)
        if norm is not None and isinstance(norm[0], str) and not _trusted_ok(trusted[i]):
            norm = None
        code = extract_code(completion)
        totals.append(None if norm is None else len(norm))
        if norm is not None and code is not None:
            units.extend((i, job) for job in _jobs(code, norm, timeout, trusted[i]))
        elif norm is not None and isinstance(norm[0], str) and _sandbox.unscorable_tests(norm, trusted[i]):
            totals[-1] = None  # no code, but no program could be judged on these tests either
    passed = [0] * len(totals)
    unscorable: set[int] = set()

    def run(unit: tuple[int, Callable[[], list[tuple[int, bool | None | str]]]]) -> tuple[int, int | None]:
        global _sandbox_failure_logged
        try:
            return unit[0], _sandbox.row_score([ok for _, ok in unit[1]()])
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
                    unscorable.add(i)
                else:
                    passed[i] += n
    return [None if t is None or i in unscorable else passed[i] / t
            for i, t in enumerate(totals)]


def unscorable_rows(tests: Sequence[Any], trusted_code: Sequence[str | None] | None = None
                    ) -> list[tuple[int, str]]:
    """``[(row, reason)]`` for the rows that :func:`code_rewards` scores None whatever the
    completion: tests missing or malformed, bad ``trusted_code``, or a test the planner
    refuses on its own (the first such test's reason). Nothing is run: the trainer calls this
    on every row before the first step."""
    tests = list(tests)
    trusted = as_column("trusted_code", trusted_code, len(tests))
    out = []
    for i, test in enumerate(tests):
        norm = _normalise_tests(test)
        if norm is None:
            out.append((i, "no usable tests (missing, empty or malformed)"))
            continue
        if not isinstance(norm[0], str):
            continue
        try:
            _sandbox.check_trusted_code(trusted[i])
        except (TypeError, ValueError) as e:
            out.append((i, f"bad trusted_code: {e}"))
            continue
        refused = _sandbox.unscorable_tests(norm, trusted[i])
        if refused:
            k = min(refused)
            out.append((i, f"a test cannot be judged: {refused[k]}"))
    return out


def code_reward(completion: Any, tests: Any, *, timeout: float = 5.0,
                trusted_code: str | None = None) -> float:
    """Fraction of ``tests`` the completion's code passes, run in the sandbox.

    The code is the last fenced ```python block, else the ``<answer>`` body. ``tests`` is a
    list of assert tests (``assert f(2) == 4``, several asserts, setup lines, loops: every
    assert must hold, judged outside the program on the plain values it returns; a test whose
    logic would have to run inside the program is refused) or of ``{"input", "output"}``
    pairs (stdin in; the whole stdout must equal ``output`` line by line with trailing
    whitespace stripped, and the program must exit 0). ``trusted_code``: the problem's own
    helper definitions (for HumanEval-style data, the prompt without the function under
    test), run in the judge only: the tests' calls of those names resolve there, never to
    the program's copies. See ``grpo.rewards.sandbox`` for how verdicts are reached and what
    the sandbox enforces. Never raises on any completion; raises ValueError/TypeError for an
    invalid ``timeout``. Scores 0.0 where :func:`code_rewards` says None (use
    ``code_rewards`` to tell them apart).
    """
    result = code_rewards([completion], [tests], timeout=timeout, trusted_code=[trusted_code])[0]
    return 0.0 if result is None else float(result)


def code_reward_func(prompts: Sequence[Any], completions: Sequence[Any], tests: Any = None, *,
                     trusted_code: Any = None, timeout: float = 5.0,
                     **kwargs: Any) -> list[float | None]:
    """TRL reward: fraction of tests passed; None where a row cannot be judged (see
    :func:`code_rewards`). Columns: ``tests`` and, optional, ``trusted_code``."""
    n = len(completions)
    return code_rewards(completions, as_column("tests", tests, n), timeout=timeout,
                        trusted_code=as_column("trusted_code", trusted_code, n))


def _unscorable_data_rows(rows: Sequence[Any]) -> list[tuple[int, str]]:
    return unscorable_rows([row.get("tests") for row in rows],
                           [row.get("trusted_code") for row in rows])


# The trainer's checks before the first step (grpo.data.check_reward_columns) read these:
# a column the rows may leave out, and the rows no completion can be judged on.
code_reward_func.optional_columns = frozenset({"trusted_code"})
code_reward_func.unscorable_rows = _unscorable_data_rows
