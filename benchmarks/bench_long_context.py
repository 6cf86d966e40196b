"""One GRPO training step at long context (pytest-benchmark): padded vs packed vs the naive path.

The step, the model (4-layer H=256 Qwen2 shape, V=151,936, fp32) and the modes are
``benchmarks/long_context.py``'s. Each case times the step in this process with
``benchmark.pedantic`` (one warm-up step, then ``GRPO_LC_ROUNDS`` rounds, default 1: a step at 2k tokens
takes minutes on a shared CPU) and records the peak RSS of the same step in a fresh process
(``extra_info["peak_rss_gib"]``, and the phase times of that run).

    python -m pytest benchmarks/bench_long_context.py --benchmark-only --benchmark-json=out.json -q
    GRPO_LC_SET=smoke ...        # tiny lengths through every mode, in seconds per case

Sets (``GRPO_LC_SET``, default ``cpu`` without CUDA):
- ``cpu``: one sequence of 2048 and 4096 tokens in ``packed``, ``packed+gc`` and ``naive`` (the naive
  path only at 2048: 4096 needs ~8 GiB); the G = 8 lognormal group at 1/8 scale (median 256, cap
  2048) ``padded`` vs ``packed``. A reduced set: the full 2k-32k sweep and the bisection are
  ``python -m benchmarks.long_context sweep`` / ``bisect``.
- ``full``: 2k-32k single sequences and the full-scale group (hours on this CPU).
- ``smoke`` (CI's ``make bench-ci``): one 128-token sequence ``packed+gc`` and ``naive``, the group at 1/64
  scale ``padded`` and ``packed``, a 4,096-id vocabulary (the real one's embedding, head and AdamW state
  took ~25 s a case on 2 cores; now the fresh process's imports dominate): every mode's code path, no
  measurement.
"""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks import long_context as LC

SETS = {
    "smoke": dict(single=[(128, "packed+gc"), (128, "naive")], group_scale=1 / 64, vocab_size=4096),
    "cpu": dict(single=[(2048, "packed"), (2048, "packed+gc"), (2048, "naive"), (4096, "packed"), (4096, "packed+gc")],
                group_scale=1 / 8),
    "full": dict(single=[(n, m) for n in (2048, 4096, 8192, 16384, 32768) for m in ("packed", "packed+gc", "naive")],
                 group_scale=1.0),
}


def _set() -> dict:
    return SETS[os.environ.get("GRPO_LC_SET", "cpu")]


def _cases():
    s = _set()
    cases = [pytest.param("single", [n], mode, None, id=f"single-{mode}-L{n}") for n, mode in s["single"]]
    scale = s["group_scale"]
    lengths = LC.group_lengths(8, 2048 * scale, int(16384 * scale))
    for mode in ("padded", "packed"):
        cases.append(pytest.param("group", lengths, mode, scale, id=f"group8-{mode}-scale{scale:g}"))
    return cases


@pytest.mark.parametrize("kind, lengths, mode, scale", _cases())
def test_long_context_step(benchmark, kind, lengths, mode, scale):
    from grpo import packing

    base, _, gc = mode.partition("+")
    prompt = LC.PROMPT_TOKENS if scale is None else int(LC.PROMPT_TOKENS * scale)
    max_tokens = max(lengths) if base == "packed" else None
    micro_batch_size = 1 if base != "packed" else None
    vocab_size = _set().get("vocab_size", LC.MODEL_SHAPE["vocab_size"])
    memory = LC.measure(mode, lengths, prompt_tokens=prompt, max_tokens=max_tokens, micro_batch_size=micro_batch_size,
                        vocab_size=vocab_size)
    if "error" in memory:  # the fresh-process step crashed: no peak to record
        pytest.fail(f"{mode} {lengths}: the step in a fresh process failed ({memory['error']})")

    model = LC.build_model(max(lengths), gc == "gc", "sdpa", vocab_size)
    if base == "packed":
        packing.use_packed_attention(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    batch = LC.make_batch(lengths, prompt, model.config.vocab_size)
    step = lambda: LC.train_step(model, optimizer, batch, base, max_tokens, micro_batch_size)  # noqa: E731
    benchmark.pedantic(step, rounds=int(os.environ.get("GRPO_LC_ROUNDS", 1)), iterations=1, warmup_rounds=1)
    benchmark.extra_info.update(
        kind=kind, mode=mode, lengths=lengths, tokens=sum(lengths), model_tokens=memory.get("model_tokens"),
        peak_rss_gib=memory.get("peak_rss_gib"), phases_s={k: memory.get(k) for k in ("forward_s", "loss_s", "backward_s", "optimizer_s")},
        threads=torch.get_num_threads(), vocab_size=vocab_size,
    )
