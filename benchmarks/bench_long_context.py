"""One GRPO training step at long context (pytest-benchmark): padded vs packed vs the naive path.

The step, the model and the modes are ``benchmarks/long_context.py``'s. Each case times the step in this
process (one warm-up step, then ``GRPO_LC_ROUNDS`` rounds, default 1) and records the peak RSS of the
same step in a fresh process (``extra_info["peak_rss_gib"]``, with that run's phase times).

Sets (``GRPO_LC_SET``, default ``cpu``): ``cpu`` (``make bench`` on 2 cores, minutes): one sequence of
1,024 tokens ``packed``, ``packed+gc`` and ``naive``, the G = 8 lognormal group at 1/32 scale ``padded``
vs ``packed``; ``full``: 2k-32k single sequences and the full-scale group (hours on a CPU); ``smoke``:
128 tokens, the group at 1/64 scale, a 4,096-id vocabulary (every mode's code path, no measurement).
"""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks import long_context as LC

SETS = {
    "smoke": dict(single=[(128, "packed+gc"), (128, "naive")], group_scale=1 / 64, vocab_size=4096),
    "cpu": dict(single=[(1024, "packed"), (1024, "packed+gc"), (1024, "naive")], group_scale=1 / 32),
    "full": dict(single=[(n, m) for n in (2048, 4096, 8192, 16384, 32768) for m in ("packed", "packed+gc", "naive")],
                 group_scale=1.0),
}


def _set() -> dict:
    return SETS[os.environ.get("GRPO_LC_SET", "cpu")]


def _cases():
    s = _set()
    cases = [pytest.param("single", [n], mode, None, id=f"single-{mode}-L{n}") for n, mode in s["single"]]
    lengths = LC.group_lengths(8, 2048 * s["group_scale"], int(16384 * s["group_scale"]))
    return cases + [pytest.param("group", lengths, mode, s["group_scale"], id=f"group8-{mode}-scale{s['group_scale']:g}")
                    for mode in ("padded", "packed")]


def cost(params: dict) -> float:
    """A case's work in the units of ``benchmarks.kernels.Case.cost`` (for the progress line's ETA): three
    steps (a fresh process's, the warm-up, the timed one) through the head and the body, and a start-up."""
    vocab = _set().get("vocab_size", LC.MODEL_SHAPE["vocab_size"])
    tokens = max(params["lengths"]) * len(params["lengths"]) if params["mode"] != "packed" else sum(params["lengths"])
    return 3 * tokens * vocab * 256 * 3 * 2 + 2e12


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
