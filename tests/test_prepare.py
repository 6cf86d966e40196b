"""grpo_kernels.prepare: the fused-linear option ``fp32_logits`` (how a chunk's logits are formed).

Inputs on a coarse grid (hidden in quarters, weight in eighths, H = 40) make every fp32 sum exact
whatever its order, so the two semantics are told apart exactly: ``fp32_logits=False`` rounds each
logit to bf16 once (``lm_head(hidden)`` of a bf16 model), ``True`` keeps the exact products. Each side
matches float64 of its own semantics to fp32 rounding and is far from the other's.
"""

from __future__ import annotations

import pytest
import torch
from helpers import BACKENDS, DEVICE, TOLERANCES, assert_close64
from spec64 import logprobs64

import grpo_kernels as gk
from grpo_kernels import prepare

N, H, V = 13, 40, 37
TEMPERATURE = 0.7


def coarse_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randint(-8, 9, (N, H), generator=g) / 4).to(torch.bfloat16)
    weight = (torch.randint(-8, 9, (V, H), generator=g) / 8).to(torch.bfloat16)
    targets = torch.randint(0, V, (N,), generator=g)
    return hidden, weight, targets


def reference(hidden, weight, targets, fp32_logits: bool):
    """float64 (logp, entropy) and their gradients w.r.t. hidden / weight of ``sum(logp) + sum(entropy)``;
    ``fp32_logits=False``: the logits rounded to bf16 (straight through, as the kernels differentiate)."""
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    z = h64 @ w64.T
    if not fp32_logits:
        z = z + (z.detach().to(torch.bfloat16).double() - z.detach())
    logp, entropy = logprobs64(z, targets, TEMPERATURE)
    (logp.sum() + entropy.sum()).backward()
    return logp.detach(), entropy.detach(), h64.grad, w64.grad


def far(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    rtol, atol = TOLERANCES[torch.float32]
    return bool(((actual.double() - expected).abs() > rtol * expected.abs() + atol * 4).any())


def test_default_is_the_compute_dtype():
    hidden = torch.zeros(2, 3, dtype=torch.bfloat16)
    assert prepare.FP32_LOGITS_DEFAULT is False
    assert prepare.logits_dtype(hidden, prepare.FP32_LOGITS_DEFAULT) == torch.bfloat16
    assert prepare.logits_dtype(hidden, True) == torch.float32


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp32_logits", [False, True])
def test_fused_linear_token_logprobs_fp32_logits(backend, fp32_logits):
    hidden, weight, targets = coarse_inputs()
    exact = reference(hidden, weight, targets, True)
    rounded = reference(hidden, weight, targets, False)
    want, other = (exact, rounded) if fp32_logits else (rounded, exact)
    h, w = hidden.to(DEVICE).requires_grad_(), weight.to(DEVICE).requires_grad_()
    logp, entropy = gk.fused_linear_token_logprobs(h, w, targets.to(DEVICE), temperature=TEMPERATURE,
                                                   return_entropy=True, chunk_size=5, backend=backend,
                                                   fp32_logits=fp32_logits)
    (logp.sum() + entropy.sum()).backward()
    assert_close64(logp, want[0], torch.float32, scale=4.0, what="log-probs")
    assert_close64(entropy, want[1], torch.float32, scale=4.0, what="entropy")
    assert far(logp, other[0]), "the other semantics would pass too: the test could not fail"
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    assert_close64(h.grad, want[2], torch.bfloat16, scale=want[2].abs().max().item(), what="d hidden")
    assert_close64(w.grad, want[3], torch.bfloat16, scale=want[3].abs().max().item(), what="d weight")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp32_logits", [False, True])
def test_fused_linear_grpo_loss_fp32_logits(backend, fp32_logits):
    """The loss's log-probs (``out.logps``) follow the option too, in the gradient-in-forward path."""
    hidden, weight, targets = coarse_inputs(seed=1)
    exact = reference(hidden, weight, targets, True)[0]
    rounded = reference(hidden, weight, targets, False)[0]
    want, other = (exact, rounded) if fp32_logits else (rounded, exact)
    h, w = hidden.to(DEVICE).requires_grad_(), weight.to(DEVICE).requires_grad_()
    adv = torch.linspace(-1, 1, N).view(1, N)
    out = gk.fused_linear_grpo_loss(h.view(1, N, H), w, targets.view(1, N).to(DEVICE), adv.to(DEVICE),
                                    temperature=TEMPERATURE, chunk_size=4, backend=backend, fp32_logits=fp32_logits)
    out.loss.backward()
    assert_close64(out.per_token_logps.view(N), want, torch.float32, scale=4.0, what="log-probs")
    assert far(out.per_token_logps.view(N), other)
    assert torch.isfinite(h.grad.float()).all() and torch.isfinite(w.grad.float()).all()


def test_fp32_logits_is_a_flag():
    hidden, weight, targets = coarse_inputs()
    for fn in (lambda: gk.fused_linear_token_logprobs(hidden, weight, targets, fp32_logits="yes"),
               lambda: gk.fused_linear_grpo_loss(hidden.view(1, N, H), weight, targets.view(1, N), torch.ones(1, N),
                                                 fp32_logits=1)):
        with pytest.raises(TypeError, match="fp32_logits"):
            fn()
    with pytest.raises(TypeError, match="fp32_logits"):
        gk.FusedLinearGRPOLoss(fp32_logits="no")
