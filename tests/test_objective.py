"""The Triton epilogue is the one hand-differentiated copy of the objective: its per-token loss,
``d loss / d logp``, ``d loss / d entropy``, KL and clip flags must equal ``objective``'s, with the
derivatives from autograd of ``objective.per_token_loss``."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

from grpo_kernels import objective
from grpo_kernels.options import GRPOInputs, GRPOOptions

CASES = {
    "clip": dict(loss_type="dapo", eps_high=0.28),
    "clip_delta_beta": dict(loss_type="grpo", eps_high=0.28, delta=1.4, beta=0.05),
    "bias_corrected_kl": dict(loss_type="bnpo", beta=0.1, use_bias_correction_kl=True),
    "entropy_is_ratio": dict(loss_type="dr_grpo", entropy_coef=0.03, use_is=True),
    "cispo": dict(loss_type="cispo", eps_high=1.25, beta=0.02),
    "sapo": dict(loss_type="sapo", sapo_temperature_pos=0.8, sapo_temperature_neg=1.3, use_is=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_triton_epilogue_equals_autograd_of_the_objective(case):
    from grpo_kernels.kernels import triton_rows

    kw = dict(CASES[case])
    use_is = kw.pop("use_is", False)
    options = GRPOOptions(temperature=0.9, **kw)
    g = torch.Generator().manual_seed(list(CASES).index(case))
    b, t, v = 3, 11, 29
    logits = torch.randn(b, t, v, generator=g) * 2
    ids = torch.randint(0, v, (b, t), generator=g)
    mask = torch.ones(b, t)
    logp_now = torch.log_softmax(logits / options.temperature, -1).gather(-1, ids[..., None])[..., 0]
    # ratios spread over every region (below, inside and above the clip range; above delta / the cap)
    old = logp_now - torch.linspace(-0.7, 0.7, b * t).reshape(b, t)
    ref = logp_now + 0.3 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, t, generator=g)
    is_ratio = torch.rand(b, t, generator=g) + 0.5 if use_is else None
    inputs = GRPOInputs(old_logps=old, ref_logps=ref, is_ratio=is_ratio)
    weights = objective.token_weights(mask, options)

    out = triton_rows.grpo_forward_rows(
        logits=logits.to(DEVICE), targets=ids.to(DEVICE), advantages=adv.to(DEVICE), weights=weights.to(DEVICE),
        old_logps=old.to(DEVICE), ref_logps=ref.to(DEVICE), is_ratio=None if is_ratio is None else is_ratio.to(DEVICE),
        temperature=options.temperature, ignore_index=-100, eps_low=options.eps_low, eps_high=options.eps_high,
        delta=options.delta, beta=options.beta, entropy_coef=options.entropy_coef, loss_type=options.loss_type,
        use_bias_correction_kl=options.use_bias_correction_kl, sapo_temperature_pos=options.sapo_temperature_pos,
        sapo_temperature_neg=options.sapo_temperature_neg,
    )
    loss_k, logp_k, ent_k, _, _, coef_logp_k, coef_ent_k, kl_k, clip_k = (x.cpu() for x in out)

    logp = logp_k.clone().requires_grad_()
    ent = ent_k.clone().requires_grad_()
    terms = objective.per_token_loss(logp, ent, adv, mask, inputs, options)
    # the kernel's own entropy term is weighted like the policy term (the library passes entropy_coef=0
    # and adds TRL's token-mean bonus beside the kernel: objective.entropy_weights)
    weighted = terms.loss * weights - options.entropy_coef * ent * weights
    d_logp, d_ent = torch.autograd.grad(weighted.sum(), (logp, ent), allow_unused=True)
    d_ent = torch.zeros_like(ent) if d_ent is None else d_ent

    torch.testing.assert_close(loss_k, weighted.detach(), rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(coef_logp_k, d_logp, rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(coef_ent_k, d_ent, rtol=0, atol=0)
    # exp(d) - d - 1 is formed from O(1) terms: its rounding is absolute, a few ulp of 1
    torch.testing.assert_close(kl_k, terms.kl.detach(), rtol=2e-6, atol=3e-7)
    low, high = objective.clip_flags(terms.ratio.detach(), adv, mask, options)
    expected_clip = high.to(torch.int8) - (low.to(torch.int8) if low is not None else 0) if high is not None else torch.zeros_like(clip_k)
    assert torch.equal(clip_k, expected_clip.to(torch.int8))
    if options.loss_type in ("dapo", "cispo"):
        assert (clip_k != 0).any(), "the case must exercise a clip region"
