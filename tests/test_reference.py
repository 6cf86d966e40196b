"""grpo_kernels.reference against the independent float64 spec (tests/spec64.py) and worked examples."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import B, H, T, V, assert_close64, batch
from grpo_cases import OPTION_CASES, build_kwargs, make_batch
from spec64 import grpo64, logprobs64

import grpo_kernels as gk
from grpo_kernels import objective as O
from grpo_kernels import reference as R
from grpo_kernels.options import GRPOInputs, GRPOOptions

@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_reference_grpo_loss_matches_float64(loss_type, case):
    batch = make_batch(list(OPTION_CASES).index(case))
    logits, ids, mask = batch[:3]
    advantages, kw = build_kwargs(OPTION_CASES[case], batch)
    if loss_type == "dr_grpo":
        kw["max_completion_length"] = 9
    if loss_type == "dapo" and case == "old":
        kw["num_items_in_batch"] = 31
    x = logits.clone().requires_grad_()
    out = R.grpo_loss(x, ids, advantages, mask, loss_type=loss_type, **kw)
    out.loss.backward()

    x64 = logits.double().requires_grad_()
    loss64, logp64, metrics64 = grpo64(x64, ids, advantages, mask, loss_type=loss_type, **kw)
    loss64.backward()

    assert out.loss.dtype == torch.float32 and out.loss.dim() == 0
    assert_close64(out.loss, loss64, what="loss")
    assert_close64(out.per_token_logps, logp64, what="per_token_logps")
    assert not out.per_token_logps.requires_grad
    assert_close64(x.grad, x64.grad, scale=x64.grad.abs().max().item(), what="grad")
    assert set(out.metrics) == set(metrics64)
    for name, value in metrics64.items():
        assert_close64(out.metrics[name], value, what=name)
    assert x.grad[1].abs().max() == 0  # the empty sequence gets no gradient


def test_reference_token_logprobs_matches_float64():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 11, 97, generator=g) * 3
    logits[0, 0, :40] = float("-inf")  # padded vocabulary entries
    targets = torch.randint(40, 97, (5, 11), generator=g)
    targets[2, 3] = -100
    x = logits.clone().requires_grad_()
    lp, ent = R.token_logprobs(x, targets, temperature=0.8, return_entropy=True)
    x64 = logits.double().requires_grad_()
    lp64, ent64 = logprobs64(x64, targets, 0.8)
    assert_close64(lp, lp64, what="logp")
    assert_close64(ent, ent64, what="entropy")
    w1, w2 = torch.randn(5, 11, generator=g), torch.randn(5, 11, generator=g)
    ((lp * w1).sum() + (ent * w2).sum()).backward()
    ((lp64 * w1).sum() + (ent64 * w2).sum()).backward()
    assert torch.isfinite(x.grad).all()
    assert_close64(x.grad, x64.grad, scale=x64.grad.abs().max().item(), what="grad")
    assert lp[2, 3] == 0 and ent[2, 3] == 0 and x.grad[2, 3].abs().max() == 0


def _kl_to_log_diff(kl: float) -> float:
    """Solve exp(d) - d - 1 = kl for d > 0 (bisection)."""
    lo, hi = 0.0, 5.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if math.exp(mid) - mid - 1 < kl else (lo, mid)
    return (lo + hi) / 2


@pytest.mark.parametrize(
    "ratio, adv, kl, objective",
    [(1.15, 1.414, 0.05, 1.6241), (1.35, 1.414, 0.18, 1.6896), (0.88, -0.707, 0.04, -0.6238), (0.65, -0.707, 0.22, -0.5744)],
)
def test_worked_example_of_clipped_objective(ratio, adv, kl, objective):
    """The seeds' example: eps = 0.2, beta = 0.04, objective = min(r*A, clip(r)*A) - beta*kl."""
    logp = torch.tensor([[-1.0]])
    old = logp - math.log(ratio)
    ref = logp + _kl_to_log_diff(kl)
    loss, _, kl_t, _ = O.per_token_loss(
        logp, torch.zeros_like(logp), torch.tensor([adv]), torch.ones_like(logp),
        GRPOInputs(old_logps=old, ref_logps=ref), GRPOOptions(beta=0.04, eps_low=0.2, eps_high=0.2),
    )
    assert kl_t.item() == pytest.approx(kl, rel=1e-5)
    assert -loss.item() == pytest.approx(objective, abs=5e-5)


def test_reference_supports_double_backward():
    logits, ids, mask, adv, *_ = batch(8)
    x = logits.clone().requires_grad_()
    (g,) = torch.autograd.grad(gk.grpo_loss(x, ids, adv, mask, backend="reference").loss, x, create_graph=True)
    assert g.requires_grad


def test_reference_functions_check_their_flags_too():
    logits, ids, *_ = batch(14)
    with pytest.raises(TypeError, match="return_entropy"):
        gk.reference.token_logprobs(logits, ids, return_entropy="no")
    with pytest.raises(TypeError, match="ignore_index"):
        gk.reference.fused_linear_token_logprobs(torch.randn(B, T, H), torch.randn(V, H), ids, ignore_index=None)


# ---------------------------------------------------------------- the sampler's distribution
@pytest.mark.parametrize("top_k,top_p", [(4, None), (None, 0.7), (5, 0.5), (1, None), (None, 1e-7), (12, 0.95)])
def test_reference_kept_set_is_spec64s(top_k, top_p):
    """kept_tokens (vLLM's rule as vLLM writes it: a stable ascending sort, fp32 cumulative sums) keeps the
    tokens spec64's loop keeps, ties included (a half-integer grid: ties at the k-th value and elsewhere)."""
    g = torch.Generator().manual_seed(31)
    y = (torch.randn(6, 23, generator=g) * 2).round() / 2
    z = (y - y.amax(-1, keepdim=True)) / 0.8
    kept = R.kept_tokens(y, z, top_k, top_p)
    from spec64 import vllm_kept64

    for row in range(6):
        assert torch.equal(kept[row], vllm_kept64(y[row].double() / 0.8, top_k, top_p)), row


def test_reference_sampled_logprobs_nan_row_stays_nan_and_double_backward():
    """A NaN in a row makes its truncated log-prob and entropy NaN (the kept set would drop it); the
    reference differentiates twice through the truncated distribution (the kept set a constant)."""
    g = torch.Generator().manual_seed(32)
    logits = torch.randn(2, 3, 11, generator=g, dtype=torch.float64).float()
    logits[1, 2, 4] = float("nan")
    targets = logits.nan_to_num(-1e9).argmax(-1)
    logp, entropy = R.token_logprobs(logits, targets, top_k=3, top_p=0.8, return_entropy=True)
    assert torch.isnan(logp[1, 2]) and torch.isnan(entropy[1, 2])
    assert torch.isfinite(logp[0]).all() and torch.isfinite(entropy[:, :2]).all()
    x = logits[0].clone().requires_grad_()
    lp, ent = R.token_logprobs(x, targets[0], top_k=3, top_p=0.8, return_entropy=True)
    (g1,) = torch.autograd.grad((lp + ent).sum(), x, create_graph=True)
    (g2,) = torch.autograd.grad(g1.square().sum(), x)
    assert torch.isfinite(g2).all() and g2.abs().sum() > 0


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
def test_a_temperature_tensor_gets_no_gradient_on_any_backend(backend):
    """docs/api.md: gradients flow to the logits (hidden states and weight from hidden states) only. A
    per-sequence temperature that requires grad is a constant of every backend, the spec's included: its
    ``.grad`` stays None, and the logits' / hidden states' gradients are float64's under that temperature."""
    g = torch.Generator().manual_seed(46)
    b, t, v, h = 3, 5, 37, 8
    logits = torch.randn(b, t, v, generator=g) * 2
    ids = torch.randint(0, v, (b, t), generator=g)
    w = torch.randn(b, t, generator=g)
    temps = torch.rand(b, generator=g) + 0.5
    x64 = logits.double().requires_grad_()
    logp64 = torch.log_softmax(x64 / temps.double()[:, None, None], -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    (logp64 * w).sum().backward()

    temperature = temps.clone().requires_grad_()
    x = logits.clone().requires_grad_()
    logp = gk.token_logprobs(x, ids, temperature=temperature, backend=backend)
    (logp * w).sum().backward()
    assert temperature.grad is None
    assert_close64(logp, logp64, what="logp")
    assert_close64(x.grad, x64.grad, scale=x64.grad.abs().max().item(), what="grad")

    adv = torch.randn(b, generator=g)
    x = logits.clone().requires_grad_()
    gk.grpo_loss(x, ids, adv, temperature=temperature, loss_type="grpo", backend=backend).loss.backward()
    x_detached = logits.clone().requires_grad_()
    gk.grpo_loss(x_detached, ids, adv, temperature=temps, loss_type="grpo", backend=backend).loss.backward()
    assert temperature.grad is None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    torch.testing.assert_close(x.grad, x_detached.grad, rtol=0, atol=0)

    hidden64 = torch.randn(b, t, h, generator=g).double()  # (float32 values, held in float64)
    weight64 = torch.randn(v, h, generator=g).double()
    hidden = hidden64.float().requires_grad_()
    h64 = hidden64.clone().requires_grad_()
    z64 = h64 @ weight64.T
    lp64 = torch.log_softmax(z64 / temps.double()[:, None, None], -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    (lp64 * w).sum().backward()
    lp = gk.fused_linear_token_logprobs(hidden, weight64.float(), ids, temperature=temperature, backend=backend)
    (lp * w).sum().backward()
    assert temperature.grad is None
    assert_close64(lp, lp64, what="fused-linear logp")
    assert_close64(hidden.grad, h64.grad, scale=h64.grad.abs().max().item(), what="d hidden")
