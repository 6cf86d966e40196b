"""Tests for grpo.rewards.math: answer extraction, ``math_equal``'s contract and ``math_accuracy``.

``math_equal`` returns a bool within its timeout on any input, never raising; ``extract_answer``
takes the last, innermost, complete box or answer block. The equivalence rules themselves are tested
in test_rewards_math_normalize.py, the SymPy worker in test_rewards_worker.py.
"""

from __future__ import annotations

import time

import pytest

from grpo.rewards import extract_answer, math_accuracy, math_equal
from helpers import SLACK, timed
from rewards_corpus import HOSTILE_MATH


# --------------------------------------------------------------------------------------------
# math_equal on adversarial inputs: bounded time, never raises
# --------------------------------------------------------------------------------------------


ADVERSARIAL = [
    "10^{10^{10}}", "2^{2^{2^{2^{2^{2}}}}}", "9^{9^{9^{9}}}", "(10^{100})!", "1000000!",
    "(" * 300 + "1" + ")" * 300, "{" * 300 + "1" + "}" * 300, r"\frac{" * 200 + "1",
    "", "   ", "garbage ### \\\\ }{", "\\", "$", "1" * 1_000_000, "x" * 1_000_000,
    r"\sqrt{" * 50 + "2" + "}" * 50, "(x+1)^{100000}", r"\begin{pmatrix}1&2", None, 12345,
]


@pytest.mark.parametrize("bad", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_adversarial_inputs_are_bounded(bad):
    start = time.monotonic()
    assert math_equal(bad, "2", timeout=2.0) is False
    assert math_equal("2", bad, timeout=2.0) is False
    assert time.monotonic() - start < 2 * 2.0 + 3.0  # two calls, plus a worker restart


# HOSTILE_MATH (tests/rewards_corpus.py): (prediction, gold) pairs that try to stall the worker.
# Every pair compares not equal but two: the prediction that is its gold spelled the same, and
# the chain ``x=x=...=x=1`` (``x = 5`` equals ``5``, repeated) against ``1``. The two over 2000
# characters are refused before any work.
HOSTILE_EQUAL = {r"9^{9^{9^{9}}}", "x=" * 600 + "1"}


@pytest.mark.parametrize("pred,gold", HOSTILE_MATH, ids=range(len(HOSTILE_MATH)))
def test_hostile_math_pairs_are_bounded(pred, gold):
    math_equal("x + 1", "1 + x", timeout=60.0)  # a warm worker (a timeout before kills one): its start is not timed
    assert timed(lambda: math_equal(pred, gold, timeout=2.0), 2.0 + SLACK) is (pred in HOSTILE_EQUAL)


# --------------------------------------------------------------------------------------------
# Extraction and math_accuracy
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,expected", [
    (r"so \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{1} then \boxed{\{1,\{2\}\}}", r"\{1,\{2\}\}"),
    (r"\boxed{a{b{c}}d}", "a{b{c}}d"),
    (r"$\boxed 5$.", "5"),
    (r"\fbox{7}", "7"),
    ("<answer> 12 </answer>", "12"),
    (r"<answer>so \boxed{3}</answer>", "3"),
    ("<answer>1</answer> later <answer>2</answer>", "2"),
    (r"\boxed{1} and a truncated \boxed{\frac{1}{2", None),
    ("no answer here", None),
    (r"\boxed{}", None),
    ("", None),
    (None, None),
    ([{"role": "assistant", "content": r"\boxed{9}"}], "9"),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_math_accuracy():
    assert math_accuracy(r"so the answer is \boxed{\frac{1}{2}}.", "0.5") == 1.0
    assert math_accuracy("<think>x</think><answer>42</answer>", "42") == 1.0
    assert math_accuracy(r"\boxed{3}", r"The solution gives \boxed{3}.") == 1.0
    assert math_accuracy("the answer is 42", "42") == 0.0  # no final-answer marker
    assert math_accuracy(r"\boxed{41}", "42") == 0.0
    assert math_accuracy(None, "42") == 0.0


def test_nested_and_unbalanced_boxes():
    assert extract_answer(r"\boxed{\boxed{5}}") == "5"  # the innermost, last box
    assert math_accuracy(r"\boxed{\boxed{5}}", "5") == 1.0
    assert math_accuracy(r"\boxed{5}}", "5") == 1.0
    assert math_accuracy(r"\boxed{5", "5") == 0.0
    assert math_accuracy(r"\boxed{4} wait \boxed{5", "4") == 0.0  # truncated last answer
    assert math_accuracy(r"\boxed{1} \boxed{2} \boxed{3}", "2") == 0.0  # the last one counts


def test_issue_hangs_are_gone():
    text = r"\boxed{3 because there are exactly three apples left over!}"
    assert timed(lambda: math_accuracy(text, "3", timeout=1), 1 + SLACK) == 0.0
    assert timed(lambda: extract_answer("<answer>" * 8000), 0.5) is None
    assert timed(lambda: extract_answer("<answer>" * 8000 + "7</answer>"), 0.5) == "7"
