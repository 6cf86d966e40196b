"""Tests for grpo.rewards.worker: the SymPy worker processes behind ``math_equal``.

A request that outlives its timeout kills its worker, and the next call gets a fresh one; calls from
many threads each check out a whole worker; a worker that cannot start is logged once and raises
``VerifierUnavailable`` (unscorable, never a silent "wrong").
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from grpo import rewards
from grpo.rewards import math_equal
from grpo.rewards import worker as math_worker


def test_timeout_kills_worker_and_recovers():
    # A distinct symbolic comparison (not cached) with an absurdly small budget must give up,
    # and the next call must work on a fresh worker.
    start = time.monotonic()
    assert math_equal(r"\frac{x^{3}+7x}{\sin(x)+\cos(x)^{4}}", r"\tan(x)+17y", timeout=0.01) is False
    assert time.monotonic() - start < 2.0
    assert math_equal("(a+b)^2", "a^2+2ab+b^2", timeout=10.0) is True


def test_math_equal_from_many_threads():
    pairs = [(r"\frac{\sqrt{8}}{2}", r"\sqrt2", True), ("(x-1)^2", "x^2-2x+1", True),
             ("2^{10}", "1024", True), (r"\frac13", "0.3", False)] * 4
    with ThreadPoolExecutor(max_workers=8) as ex:
        results = list(ex.map(lambda c: math_equal(c[0], c[1], timeout=10.0), pairs))
    assert results == [e for _, _, e in pairs]


def test_worker_start_failure_is_logged_once_and_unscorable(monkeypatch, caplog):
    monkeypatch.setattr(math_worker, "LAUNCH", "raise SystemExit('no sympy here')")
    monkeypatch.setattr(rewards.math, "_pool", math_worker.WorkerPool(1))
    with caplog.at_level(logging.ERROR, logger="grpo.rewards.worker"):
        out = rewards.math_accuracy_reward(["p"] * 2, [r"\boxed{x+1}", r"\boxed{1+x}"],
                                           answer=["x+1", "x+1"])
        with pytest.raises(math_worker.VerifierUnavailable, match="no sympy here"):
            math_equal("x+1", "1+x")
    # x+1 == x+1 is decided in-process; 1+x needs SymPy, which is unavailable: None, not 0.
    assert out == [1.0, None]
    assert sum("failed to start" in r.getMessage() for r in caplog.records) == 1
