"""Tests for the grpo.rewards package surface: the TRL-style registry and what every reward promises.

``REWARD_FUNCTIONS`` and its wrappers; every reward bounded in time on long adversarial strings
(never crash or stall the training loop); ``timeout`` checked alike by every function that takes
one. Each source module's own tests are in tests/test_rewards_<module>.py.
"""

from __future__ import annotations

import pytest

from grpo import rewards
from grpo.rewards import (REWARD_FUNCTIONS, code_reward, code_rewards, extract_answer,
                          format_reward, math_accuracy, math_equal)
from helpers import SLACK, timed
from rewards_corpus import DOUBLE, ECHO_SUM


# --------------------------------------------------------------------------------------------
# TRL-style wrappers
# --------------------------------------------------------------------------------------------


def test_reward_function_registry():
    assert set(REWARD_FUNCTIONS) == {"accuracy", "format", "code"}


def test_math_accuracy_reward_wrapper():
    chat = [[{"role": "assistant", "content": r"\boxed{4}"}],
            [{"role": "assistant", "content": r"\boxed{5}"}],
            [{"role": "assistant", "content": r"\boxed{4}"}],
            [{"role": "assistant", "content": "no box"}]]
    out = REWARD_FUNCTIONS["accuracy"](["p"] * 4, chat, answer=["4", "4", None, r"\frac{"])
    assert out == [1.0, 0.0, None, None]


def test_format_reward_wrapper():
    out = REWARD_FUNCTIONS["format"](["p", "p"], ["<think>a</think><answer>b</answer>", "b"])
    assert out == [1.0, 0.0]
    out = REWARD_FUNCTIONS["format"](["p"], ["a</think><answer>b</answer>"], think_prefilled=True)
    assert out == [1.0]


def test_code_reward_wrapper():
    tests = [["assert f(1) == 2"], '[{"input": "2 3", "output": "5"}]', None]
    out = REWARD_FUNCTIONS["code"](["p"] * 3, [DOUBLE, ECHO_SUM, DOUBLE], tests=tests,
                                   trainer_state=None)
    assert out == [1.0, 1.0, None]


# --------------------------------------------------------------------------------------------
# Bounded parsing: every reward on long adversarial strings
# --------------------------------------------------------------------------------------------


N = 64 * 1024
LONG_INPUTS = {
    "answer_tags": "<answer>" * (N // 8),
    "answer_close_tags": "</answer>" * (N // 9),
    "open_boxes": "\\boxed{" * (N // 7),
    "boxed_words": "\\boxed{3 " + "because there are apples " * (N // 25) + "!}",
    "braces": "{" * N + "}" * N,
    "unbalanced": "\\boxed{" + "{" * N,
    "fences": "```python\n" * (N // 10),
    "fence_pairs": "```python\nx\n```" * (N // 15),
    "think_tags": "<think>" * (N // 7),
    "letters_bang": "a " * N + "!",
    "digits_spaces": "1 " * N,
    "text_cmds": "\\text{" * (N // 6),
    "fracs": "\\frac{1}{" * (N // 9),
    "superscripts": "x" + "\u00b2" * N,
    "zero_width": "\u200b" * N,
    "colons": "1:" * N,
    "commas": "1," * N,
    "dots": "5" + "." * N + "x",
    "backslashes": "\\" * N,
    "nested_box": "\\boxed{" * 3000 + "5" + "}" * 3000,
}


@pytest.mark.parametrize("name", sorted(LONG_INPUTS))
def test_every_reward_is_bounded_on_long_input(name):
    s = LONG_INPUTS[name]
    boxed = f"\\boxed{{{s}}}"
    budget = 1.0 + SLACK
    timed(lambda: extract_answer(s), 0.5 + SLACK)
    timed(lambda: format_reward(s), 0.5 + SLACK)
    timed(lambda: format_reward(f"<think>{s}</think><answer>{s}</answer>"), 0.5 + SLACK)
    timed(lambda: rewards.extract_code(s), 0.5 + SLACK)
    assert timed(lambda: math_accuracy(s, "3", timeout=1.0), budget) == 0.0
    assert timed(lambda: math_accuracy(boxed, "3", timeout=1.0), budget) == 0.0
    assert timed(lambda: math_equal(s[:3000], "3", timeout=1.0), budget) is False
    assert timed(lambda: math_equal("3", s[:3000], timeout=1.0), budget) is False
    out = timed(lambda: rewards.math_accuracy_reward(["p"], [boxed], answer=["3"], timeout=1.0),
                 budget)
    assert out == [0.0]
    # No runnable code in these strings (or a harmless one): the sandbox is not the bottleneck.
    timed(lambda: code_reward(s, ["assert f(1) == 2"], timeout=1.0), 1.0 + SLACK)


# --------------------------------------------------------------------------------------------
# Arguments: timeouts
# --------------------------------------------------------------------------------------------


BAD_TIMEOUTS = [float("inf"), float("nan"), -1.0, 0.0, 1e10, 10**12]


@pytest.mark.parametrize("timeout", BAD_TIMEOUTS, ids=repr)
def test_bad_timeout_is_a_value_error(timeout):
    calls = [lambda: math_equal("1", "1", timeout=timeout),
             lambda: math_accuracy(r"\boxed{1}", "1", timeout=timeout),
             lambda: code_reward("```python\npass\n```", ["assert True"], timeout=timeout),
             lambda: code_rewards(["x"], [["assert True"]], timeout=timeout),
             lambda: rewards.math_accuracy_reward(["p"], [r"\boxed{1}"], answer=["1"],
                                                  timeout=timeout)]
    for call in calls:
        with pytest.raises(ValueError, match="timeout"):
            call()


@pytest.mark.parametrize("timeout", [True, "5", None])
def test_timeout_of_wrong_type_is_a_type_error(timeout):
    with pytest.raises(TypeError, match="timeout"):
        math_equal("1", "1", timeout=timeout)


def test_large_valid_timeout_still_scores_correct_answers():
    assert math_equal(r"\frac{2}{4}", "0.5", timeout=86_400) is True
    assert math_equal("(x+1)^2", "x^2+2x+1", timeout=1e4) is True
