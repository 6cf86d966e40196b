"""grpo/optim/triton_adamw.py: the one-pass fp32-master-weight AdamW kernel (CUDA's; on the CPU
through Triton's interpreter) against an independent float64 AdamW and torch.optim.AdamW on fp32 copies
given the same 16-bit gradients, to fp32 rounding; the weights written as the masters rounded to nearest
even, exactly; every option; a found inf; the launcher's argument checks. Sizes around the kernel's block
(several programs, a ragged last one). ~2 s on the interpreter.
"""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE, adamw64_step, assert_close64, poison_

from grpo.optim import triton_adamw

SIZES = (1, 37, triton_adamw.BLOCK + 3)
CASES = {
    "decay": dict(weight_decay=0.1, amsgrad=False, maximize=False, grad_scale=None, beta1=0.9),
    "amsgrad-maximize-scaled": dict(weight_decay=0.0, amsgrad=True, maximize=True, grad_scale=8.0, beta1=0.8),
}
HYPER = dict(lr=2e-2, beta2=0.99, eps=1e-8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_the_kernel_matches_torchs_adamw_and_float64_adamw(dtype, case):
    opts = CASES[case]
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(n, generator=g) for n in SIZES]
    masters = [t.to(DEVICE) for t in start]
    moments = [[torch.zeros(n, device=DEVICE) for n in SIZES] for _ in range(3)]  # exp_avg, exp_avg_sq, max_exp_avg_sq
    weights = [torch.empty(n, dtype=dtype, device=DEVICE) for n in SIZES]
    counters = [torch.tensor(0.0, device=DEVICE) for _ in SIZES]
    plain = [torch.nn.Parameter(t.clone()) for t in start]
    torchs = torch.optim.AdamW(plain, lr=HYPER["lr"], betas=(opts["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                               weight_decay=opts["weight_decay"], amsgrad=opts["amsgrad"], maximize=opts["maximize"],
                               foreach=False)
    ref = [[t.double() for t in start]] + [[torch.zeros(n, dtype=torch.float64) for n in SIZES] for _ in range(3)]
    hyper = dict(HYPER, beta1=opts["beta1"], weight_decay=opts["weight_decay"], amsgrad=opts["amsgrad"],
                 maximize=opts["maximize"])
    scale = opts["grad_scale"]
    for k in range(1, 4):
        grads = [(torch.randn(n, generator=g) * (scale or 1.0)).to(dtype) for n in SIZES]
        for w in weights:
            poison_(w)
        torch._foreach_add_(counters, 1)
        triton_adamw.master_adamw_step(masters, moments[0], moments[1], moments[2] if opts["amsgrad"] else None,
                                       [x.to(DEVICE) for x in grads], weights, counters,
                                       grad_scale=None if scale is None else torch.tensor(scale, device=DEVICE), **hyper)
        for p, grad in zip(plain, grads):
            p.grad = grad.float() / (scale or 1.0)  # (torch's AdamW takes the unscaled gradient)
        torchs.step()
        for i, grad in enumerate(grads):
            new = adamw64_step(*(r[i] for r in ref), grad.double(), k, grad_scale=scale or 1.0, **hyper)
            for r, value in zip(ref, new):
                r[i] = value
        for w, master in zip(weights, masters):  # every weight written: the master rounded to nearest even
            assert torch.equal(w, master.to(dtype))
    for i, (master, p) in enumerate(zip(masters, plain)):
        assert_close64(master, ref[0][i], torch.float32, what=f"master {i} vs float64")
        assert_close64(master, p.detach().double(), torch.float32, what=f"master {i} vs torch.optim.AdamW")
        assert_close64(moments[0][i], torchs.state[p]["exp_avg"].double(), torch.float32, what="exp_avg")
        v, v_ref = moments[1][i], torchs.state[p]["exp_avg_sq"].double()
        assert_close64(v, v_ref, torch.float32, scale=float(v_ref.abs().max()), what="exp_avg_sq")


def test_a_found_inf_writes_nothing():
    masters = [torch.randn(40, device=DEVICE)]
    moments = [[torch.zeros(40, device=DEVICE)] for _ in range(2)]
    before = [t.clone() for t in (masters[0], *moments[0], *moments[1])]
    weights = [torch.full((40,), 3.0, dtype=torch.bfloat16, device=DEVICE)]
    triton_adamw.master_adamw_step(masters, *moments, None, [torch.randn(40, device=DEVICE).bfloat16()], weights,
                                   [torch.tensor(1.0, device=DEVICE)], found_inf=torch.tensor(1.0, device=DEVICE),
                                   beta1=0.9, weight_decay=0.1, amsgrad=False, maximize=False, **HYPER)
    assert all(torch.equal(a, b) for a, b in zip((masters[0], *moments[0], *moments[1]), before))
    assert bool((weights[0] == 3.0).all())


def test_bad_arguments_are_refused_by_name():
    masters = [torch.randn(8, device=DEVICE)]
    moments = [[torch.zeros(8, device=DEVICE)] for _ in range(2)]
    kw = dict(beta1=0.9, weight_decay=0.0, amsgrad=False, maximize=False, **HYPER)
    with pytest.raises(TypeError, match=r"weights\[0\]"):
        triton_adamw.master_adamw_step(masters, *moments, None, [torch.zeros(8, device=DEVICE).bfloat16()],
                                       [torch.zeros(8, device=DEVICE).half()], [torch.tensor(1.0, device=DEVICE)], **kw)
    with pytest.raises(TypeError, match=r"exp_avg_sqs\[0\]"):
        triton_adamw.master_adamw_step(masters, moments[0], [moments[1][0].double()], None,
                                       [torch.zeros(8, device=DEVICE).bfloat16()],
                                       [torch.zeros(8, device=DEVICE).bfloat16()], [torch.tensor(1.0, device=DEVICE)], **kw)
