"""grpo/optim/cpu_adamw.py (and master_adamw.py's argument checks): the one-pass fp32-master-weight
AdamW on the CPU against an independent float64 AdamW and, bit for bit, torch's fused AdamW on the fp32
masters given the 16-bit gradients; every option that changes the arithmetic; sizes that leave a scalar
tail at every vector width; two threads over several blocks. Tiny tensors: ~1 s, plus one compile of the
library (~2 s) where its cache (``$GRPO_KERNELS_CACHE`` or ``~/.cache/grpo_kernels``) is cold.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import adamw64_step, assert_close64, poison_

from grpo.optim import cpu_adamw

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(shutil.which("g++") is None, reason="no g++: the library cannot be built here")]

SIZES = (1, 15, 37, 211)  # (awkward: a scalar tail at widths 4, 8 and 16; 1 is all tail)
CASES = {
    "decay": dict(weight_decay=0.1, amsgrad=False, maximize=False, grad_scale=None, beta1=0.9),
    "amsgrad-maximize-scaled": dict(weight_decay=0.0, amsgrad=True, maximize=True, grad_scale=8.0, beta1=0.9),
    "lerp-from-the-gradient": dict(weight_decay=0.05, amsgrad=False, maximize=False, grad_scale=None, beta1=0.3),
}
HYPER = dict(lr=2e-2, beta2=0.99, eps=1e-8)


def state(sizes, generator) -> list[list[torch.Tensor]]:
    """Masters, exp_avg, exp_avg_sq, max_exp_avg_sq (fresh AdamW state: zero moments)."""
    return [[torch.randn(n, generator=generator) for n in sizes]] + [[torch.zeros(n) for n in sizes] for _ in range(3)]


def run_against_torch(sizes, dtype, case, steps: int = 4, seed: int = 0):
    """``steps`` steps of the library and of torch._fused_adamw_ (and a float64 AdamW) on the same
    gradients; the 16-bit weights are poisoned before every step. Returns (ours, torch's, float64's)."""
    g = torch.Generator().manual_seed(seed)
    ours = state(sizes, g)
    theirs = [[t.clone() for t in ts] for ts in ours]
    ref = [[t.double() for t in ts] for ts in ours]
    weights = [torch.empty(n, dtype=dtype) for n in sizes]
    counters, their_counters = [torch.tensor(0.0) for _ in sizes], [torch.tensor(0.0) for _ in sizes]
    hyper = dict(HYPER, beta1=case["beta1"], weight_decay=case["weight_decay"], amsgrad=case["amsgrad"],
                 maximize=case["maximize"])
    scale = None if case["grad_scale"] is None else torch.tensor(case["grad_scale"])
    for k in range(1, steps + 1):
        grads = [(torch.randn(n, generator=g) * (case["grad_scale"] or 1.0)).to(dtype) for n in sizes]
        for w in weights:
            poison_(w)
        torch._foreach_add_(counters, 1)
        torch._foreach_add_(their_counters, 1)
        cpu_adamw.master_adamw_step(*ours[:3], ours[3] if case["amsgrad"] else None, grads, weights, counters,
                                    grad_scale=scale, **hyper)
        torch._fused_adamw_(*theirs[:1], [x.float() for x in grads], *theirs[1:3], theirs[3] if case["amsgrad"] else [],
                            their_counters, grad_scale=scale, **hyper)
        for i, grad in enumerate(grads):
            ref_i = adamw64_step(*(r[i] for r in ref), grad.double(), k, grad_scale=case["grad_scale"] or 1.0, **hyper)
            for r, value in zip(ref, ref_i):
                r[i] = value
        for w, master in zip(weights, ours[0]):  # every weight written, as the master rounded to nearest even
            assert torch.equal(w, master.to(dtype))
    return ours, theirs, ref


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_the_step_is_torchs_fused_adamw_bitwise_and_float64_adamw_to_fp32_rounding(dtype, case):
    assert cpu_adamw.library() is not None, cpu_adamw.unavailable_reason()
    ours, theirs, ref = run_against_torch(SIZES, dtype, CASES[case])
    kept = 4 if CASES[case]["amsgrad"] else 3  # (max_exp_avg_sq only with amsgrad)
    for mine, torchs in zip(ours[:kept], theirs[:kept]):
        assert all(torch.equal(a, b) for a, b in zip(mine, torchs))
    for master, expected in zip(ours[0], ref[0]):
        assert_close64(master, expected, torch.float32, what="master")
    for m, expected in zip(ours[1], ref[1]):
        assert_close64(m, expected, torch.float32, what="exp_avg")


def test_two_threads_over_several_blocks_step_every_element():
    """Tensors of several BLOCK-element blocks, split between two threads: bitwise torch's, every weight written."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        sizes = (3 * cpu_adamw.BLOCK + 5, 0, cpu_adamw.BLOCK - 1, 7)  # (an empty tensor among them: no block)
        ours, theirs, _ = run_against_torch(sizes, torch.bfloat16, CASES["decay"], steps=2, seed=1)
    finally:
        torch.set_num_threads(threads)
    for mine, torchs in zip(ours[:3], theirs[:3]):
        assert all(torch.equal(a, b) for a, b in zip(mine, torchs))


def test_a_found_inf_skips_the_step_and_writes_nothing():
    g = torch.Generator().manual_seed(2)
    masters, exp_avgs, exp_avg_sqs, _ = state((37,), g)
    before = [t.clone() for t in (*masters, *exp_avgs, *exp_avg_sqs)]
    weights = [torch.full((37,), 3.0, dtype=torch.bfloat16)]
    cpu_adamw.master_adamw_step(masters, exp_avgs, exp_avg_sqs, None, [torch.randn(37).bfloat16()], weights,
                                [torch.tensor(1.0)], found_inf=torch.tensor(1.0), beta1=0.9, weight_decay=0.1,
                                amsgrad=False, maximize=False, **HYPER)
    assert all(torch.equal(a, b) for a, b in zip((*masters, *exp_avgs, *exp_avg_sqs), before))
    assert bool((weights[0] == 3.0).all())


def test_bad_arguments_are_refused_by_name_before_anything_is_written():
    g = torch.Generator().manual_seed(3)
    masters, exp_avgs, exp_avg_sqs, _ = state((5, 6), g)
    grads = [torch.randn(5).bfloat16(), torch.randn(6).bfloat16()]
    weights = [torch.zeros(5, dtype=torch.bfloat16), torch.zeros(6, dtype=torch.bfloat16)]
    before = [t.clone() for t in (*masters, *exp_avgs, *exp_avg_sqs, *weights)]
    kw = dict(beta1=0.9, weight_decay=0.0, amsgrad=False, maximize=False, **HYPER)
    counters = [torch.tensor(1.0)] * 2
    with pytest.raises(TypeError, match=r"grads\[1\]"):
        cpu_adamw.master_adamw_step(masters, exp_avgs, exp_avg_sqs, None, [grads[0], grads[1].float()], weights, counters, **kw)
    with pytest.raises(ValueError, match="exp_avgs"):
        cpu_adamw.master_adamw_step(masters, exp_avgs[:1], exp_avg_sqs, None, grads, weights, counters, **kw)
    with pytest.raises(ValueError, match=r"weights\[1\]"):
        cpu_adamw.master_adamw_step(masters, exp_avgs, exp_avg_sqs, None, grads,
                                    [weights[0], torch.zeros(12, dtype=torch.bfloat16)[::2]], counters, **kw)
    with pytest.raises(ValueError, match="max_exp_avg_sqs"):
        cpu_adamw.master_adamw_step(masters, exp_avgs, exp_avg_sqs, None, grads, weights, counters, **{**kw, "amsgrad": True})
    assert all(torch.equal(a, b) for a, b in zip((*masters, *exp_avgs, *exp_avg_sqs, *weights), before))


def test_the_steps_live_beside_their_user_only():
    """The fused master-weight AdamW steps are the trainer's (``grpo.optim``): the kernel library has no
    copy of them, and imports nothing of ``grpo``."""
    import importlib.util

    for name in ("master_adamw", "cpu_adamw", "triton_adamw"):
        assert importlib.util.find_spec(f"grpo_kernels.kernels.{name}") is None

