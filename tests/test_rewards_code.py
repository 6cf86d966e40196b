"""Tests for grpo.rewards.code: the code reward's scoring, over honest programs.

Which block is run, assert and stdio tests, the fraction passed, batches in parallel and in order,
argument checks, and failing closed (``None``, logged once) where the sandbox cannot be built.
Attacks on the verdict and containment are tested where the mechanism that stops them lives, the
sandbox and its judge: test_rewards_sandbox.py.
"""

from __future__ import annotations

import logging
import time

import pytest

from grpo import rewards
from grpo.rewards import sandbox as _sandbox
from grpo.rewards import code_reward, code_rewards
from rewards_corpus import DOUBLE, ECHO_SUM


def test_code_reward_asserts():
    tests = ["assert f(2) == 4", "assert f(3) == 6", "assert f(3) == 7", "assert f(0) == 0"]
    assert code_reward(DOUBLE, tests, timeout=5) == 0.75


def test_code_reward_uses_last_block_and_answer_fallback():
    text = "```python\ndef f(x): return 0\n```\nfixed:\n```python\ndef f(x): return 2*x\n```"
    assert code_reward(text, ["assert f(2) == 4"]) == 1.0
    assert code_reward("<answer>def f(x): return 2*x</answer>", ["assert f(2) == 4"]) == 1.0
    assert code_reward("no code", ["assert True"]) == 0.0


def test_code_reward_stdio():
    tests = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5", "output": "10   \n\n"},
             {"input": "1 1", "output": "3"}]
    assert code_reward(ECHO_SUM, tests) == pytest.approx(2 / 3)


def test_code_reward_stdio_whole_output_required():
    prefix = "```python\nprint(1)\nprint(2)\n```"
    assert code_reward(prefix, [{"input": "", "output": "1\n2\n"}]) == 1.0
    assert code_reward(prefix, [{"input": "", "output": "1\n"}]) == 0.0  # extra line
    assert code_reward(prefix, [{"input": "", "output": "1\n2\n3\n"}]) == 0.0  # missing line
    crash = "```python\nprint(1)\nraise SystemExit(3)\n```"
    assert code_reward(crash, [{"input": "", "output": "1"}]) == 0.0  # non-zero exit


def test_code_rewards_batch_is_parallel_and_ordered():
    loop = "```python\nwhile True: pass\n```"
    completions = [DOUBLE, loop, DOUBLE, loop, "nothing", DOUBLE]
    tests = [["assert f(1) == 2"]] * 5 + [None]
    start = time.monotonic()
    out = code_rewards(completions, tests, timeout=1.5, max_workers=6)
    assert out == [1.0, 0.0, 1.0, 0.0, 0.0, None]
    assert time.monotonic() - start < 1.5 * 2 + 2.0  # loops ran side by side


def test_code_rewards_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="tests"):
        code_rewards(["a", "b", "c"], [["assert True"]] * 2)
    with pytest.raises(ValueError, match="tests"):
        code_rewards(["a"], [["assert True"]] * 2)


def test_sandbox_fails_closed(monkeypatch, caplog):
    # A jail that cannot be built scores None (unscorable), logs once, and runs nothing.
    monkeypatch.setattr(_sandbox, "SYS_PIVOT_ROOT", {})
    monkeypatch.setattr(_sandbox.platform, "machine", lambda: "none")
    monkeypatch.setattr(rewards.code, "_sandbox_failure_logged", False)
    real_run = _sandbox.run

    def broken(code, **kw):
        r = real_run("import os\nos._exit(97)", **{**kw, "mode": "stdio"})
        r.error = r.error or "simulated failure"
        return r

    monkeypatch.setattr(_sandbox, "run", broken)
    text = "```python\ndef f(x):\n    return 2 * x\n```"
    with caplog.at_level(logging.ERROR, logger="grpo.rewards"):
        out = code_rewards([text, text], [["assert f(1) == 2"], [{"input": "", "output": ""}]])
    assert out == [None, None]
    assert sum("sandbox cannot be built" in r.getMessage() for r in caplog.records) == 1


def test_trusted_code_reaches_every_form():
    # code_reward, code_rewards (per row) and code_reward_func (a dataset column, optional)
    from rewards_corpus import TRUSTED_PROBLEMS

    p = TRUSTED_PROBLEMS["add"]
    text = f"```python\n{p['solution']}\n```"
    assert code_reward(text, [p["test"]], trusted_code=p["trusted"]) == 1.0
    out = rewards.REWARD_FUNCTIONS["code"](["p"] * 2, [text, text], tests=[[p["test"]]] * 2,
                                           trusted_code=[p["trusted"], None])
    assert out == [1.0, 1.0]
    # Without trusted_code a helper the test calls is the program's (as in Python): a program
    # that redefines poly to return 0 passes. With it, poly is the judge's and the forgery fails.
    poly = TRUSTED_PROBLEMS["poly_root"]
    forged = f"```python\n{poly['forgeries']['poly_is_zero']}\n```"
    assert code_rewards([forged, forged], [[poly["test"]]] * 2,
                        trusted_code=[None, poly["trusted"]]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="trusted_code"):
        code_rewards([forged, forged], [[poly["test"]]] * 2, trusted_code=[None])


def test_unscorable_rows_and_the_check_before_training(capsys):
    from grpo.data import check_reward_columns, reward_columns
    from rewards_corpus import TRUSTED_PROBLEMS

    code_fn = rewards.REWARD_FUNCTIONS["code"]
    assert reward_columns(code_fn) == ["tests"]  # trusted_code is optional
    p = TRUSTED_PROBLEMS["poly_root"]
    rows = [{"prompt": "a", "tests": ["assert f(1) == 2"], "trusted_code": None},
            {"prompt": "b", "tests": ["assert f(1) == 2\nwhile True:\n    break"], "trusted_code": None},
            {"prompt": "c", "tests": None, "trusted_code": None},
            {"prompt": "d", "tests": [p["test"]], "trusted_code": p["trusted"]},
            {"prompt": "e", "tests": ["assert f(1) == 2"], "trusted_code": "import os\n"},
            {"prompt": "f", "tests": ["assert f(2) == 4\nwhile 1:\n    break"], "trusted_code": None},
            {"prompt": "g", "tests": [{"input": "1", "output": "1"}], "trusted_code": None}]
    found = check_reward_columns({"code": code_fn}, ["tests", "trusted_code"], rows)
    assert [r for r, _ in found["code"]] == [1, 2, 4, 5]
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("reward 'code': 4 of 7 rows cannot be judged")
    assert len(printed) == 4  # one line per reason, with its first row
    assert any("2 rows (first: row 1)" in line and "While" in line for line in printed)
    assert any("(first: row 4)" in line and "trusted_code" in line for line in printed)
    check_reward_columns({"code": code_fn}, ["tests"], rows[:1])
    assert capsys.readouterr().out == ""  # nothing to say when every row can be judged
