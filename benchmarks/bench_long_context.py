"""One GRPO step at long context (pytest-benchmark), padded vs packed vs naive: ``long_context.step`` in a
fresh process (a warm-up step, then the measured one: its time, phases and the process's peak RSS in
``extra_info``). Sets: ``GRPO_LC_SET`` (benchmarks/README.md)."""

from __future__ import annotations

import os

import pytest

from benchmarks import long_context as LC

SETS = {
    "smoke": dict(single=[(128, "packed+gc"), (128, "naive")], group_scale=1 / 64, vocab_size=4096),
    "cpu": dict(single=[(1024, "packed"), (1024, "packed+gc"), (1024, "naive")], group_scale=1 / 32),
    "full": dict(single=[(n, m) for n in (2048, 4096, 8192, 16384, 32768) for m in ("packed", "packed+gc", "naive")],
                 group_scale=1.0),
}
SET = SETS[os.environ.get("GRPO_LC_SET", "cpu")]
CASES = [pytest.param([n], mode, 1.0, id=f"single-{mode}-L{n}") for n, mode in SET["single"]] + [
    pytest.param(LC.group_lengths(8, 2048 * SET["group_scale"], int(16384 * SET["group_scale"])), mode, SET["group_scale"],
                 id=f"group8-{mode}-scale{SET['group_scale']:g}") for mode in ("padded", "packed")]


def cost(params: dict) -> float:
    """A case's work in the units of ``benchmarks.kernels.Case.cost`` (the progress line's ETA): two steps
    through the head and the body, and a process start."""
    tokens = max(params["lengths"]) * len(params["lengths"]) if params["mode"] != "packed" else sum(params["lengths"])
    return 2 * tokens * SET.get("vocab_size", 151936) * 256 * 6 + 3e11


@pytest.mark.parametrize("lengths, mode, scale", CASES)
def test_long_context_step(benchmark, lengths, mode, scale):
    kwargs = dict(mode=mode, steps=2, prompt_tokens=int(LC.PROMPT_TOKENS * scale), vocab_size=SET.get("vocab_size"))
    result = benchmark.pedantic(lambda: LC.measure(lengths, **kwargs), rounds=1, iterations=1)  # (times the whole process)
    if "error" in result:
        pytest.fail(f"{mode} {lengths}: the step in a fresh process failed ({result['error']})")
    benchmark.extra_info.update({k: result.get(k) for k in ("mode", "lengths", "tokens", "step_s", "phases_s", "phases_cpu_s",
                                                            "peak_rss_gib", "threads")}, vocab_size=kwargs["vocab_size"])
