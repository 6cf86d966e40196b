"""The verl 0.9 cases shared by tests/test_objective.py (the loss spec against ``spec64.verl64``) and
tests/test_triton_rows.py (the Triton epilogue's verl terms): fresh random batches with a fully masked
row and log-ratios beyond verl's clamps, the loss and gradient of ours and of the float64 spec."""

from __future__ import annotations

import torch
from helpers import loss_and_logits_grad
from spec64 import logprobs64, verl64

ours = loss_and_logits_grad  # (the tests call vc.ours)
B, T, V = 4, 6, 11
NEW_MODES = ("dppo_tv", "dppo_kl", "dro")
KLS = ("k1", "abs", "k2+", "low_var_kl", "k3+")

# thresholds small enough that each batch has trusted and untrusted tokens (DPPO), a TIS cap that binds
MODE_SETTINGS = {
    "dppo_tv": dict(clip_ratio_low=0.02, clip_ratio_high=0.03, clip_ratio_c=1.2),
    "dppo_kl": dict(clip_ratio_low=0.002, clip_ratio_high=0.003, clip_ratio_c=1.2),
    "dro": dict(dro_beta=0.7),
    "vanilla": dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=1.5),
    "cispo": dict(clip_ratio_low=1.0, clip_ratio_high=0.3),
    "sapo": dict(tau_pos=0.9, tau_neg=1.2),
    "gpg": dict(),
}


def spec_settings(loss_mode: str, settings: dict) -> dict:
    """MODE_SETTINGS in verl64's keywords."""
    names = {"clip_ratio_low": "eps_low", "clip_ratio_high": "eps_high"}
    return {names.get(k, k): v for k, v in settings.items()}


def batch(seed: int, far: bool = False):
    """Fresh random logits, ids, a mask with a fully masked row (1) and a partly masked one, old / ref
    log-probs near the current ones, per-token advantages; ``far``: one token's log-ratio beyond +-20."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g) * 2
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    mask[0, :2] = 1.0
    mask[1] = 0.0
    mask[2, T // 2:] = 0.0
    if far:  # a token of log-prob about -60, so that an old log-prob 25 above it is still a log-prob
        logits[0, 1, ids[0, 1]] = -60.0
    logp = torch.log_softmax(logits.double(), -1).gather(-1, ids[..., None])[..., 0]
    # old / ref: log-probs (<= 0) near the current ones
    old = (logp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3).float()
    ref = (logp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3).float()
    if far:  # |log r| = 25: verl's clamps to [-20, 20] act (and low_var_kl's)
        old[0, 0] = float(logp[0, 0]) - 25.0
        old[0, 1] = float(logp[0, 1]) + 25.0
        ref[0, 1] = float(logp[0, 1]) + 30.0
    adv = torch.randn(B, T, generator=g)
    adv[0, 0], adv[0, 1] = 1.0, -1.0
    return logits, ids, mask, old, ref, adv


def expected(logits, ids, mask, adv, **kw):
    """verl64's loss and its gradient w.r.t. the logits, float64."""
    x = logits.double().requires_grad_()
    logp, ent = logprobs64(x, torch.where(mask != 0, ids, -100))
    loss = verl64(logp, ent, torch.where(mask != 0, adv.double(), 0.0), mask, **kw)
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad


def check(loss, grad, loss64, grad64):
    """fp32 rounding: the loss relative to its size, the gradient relative to the largest entry."""
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    torch.testing.assert_close(loss.detach().cpu().double(), loss64, rtol=1e-5, atol=1e-6)
    scale = grad64.abs().max().item()
    torch.testing.assert_close(grad.double(), grad64, rtol=1e-4, atol=1e-5 * max(scale, 1e-3))
    assert grad64.abs().max() > 0  # the case has a gradient to compare

