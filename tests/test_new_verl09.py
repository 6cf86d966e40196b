"""verl 0.9.0's core_algos against the loss spec (``tests/spec64.py``'s float64 ``verl64``): the new modes
(dppo_tv, dppo_kl, dro) x every loss_agg_mode (token-sum and 0.9's seq-mean-token-sum-norm among
them) x several KL estimators, the global normalisers (dp_size, batch_num_tokens, global_batch_size,
loss_scale_factor), fully masked rows, log-ratios beyond verl's clamps; loss and gradient, on the
logits path (torch and Triton rows), the fused-linear path (gradient in the forward) and the modules;
verl's policy metrics per mode; and the errors for the settings verl refuses.

(New file of the verl09 branch; the lead folds it into the module-mirroring test files.)
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from spec64 import logprobs64, verl64, verl_policy_metrics64

import grpo_kernels as gk
from grpo_kernels import objective
from grpo_kernels.options import LOSS_AGG_MODES, GRPOOptions

B, T, V = 4, 6, 11
NEW_MODES = ("dppo_tv", "dppo_kl", "dro")
KLS = ("k1", "abs", "k2+", "low_var_kl", "k3+")
pytestmark = pytest.mark.timeout(900)

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


def ours(logits, ids, adv, mask, backend="torch", **kw):
    x = logits.clone().to(DEVICE).requires_grad_()
    kw = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    out = gk.grpo_loss(x, ids.to(DEVICE), adv.to(DEVICE), mask.to(DEVICE), backend=backend, **kw)
    (grad,) = torch.autograd.grad(out.loss, x)
    return out, grad.cpu()


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


@pytest.mark.parametrize("kl_loss_type", KLS)
@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("loss_mode", NEW_MODES)
def test_new_modes_x_reductions_x_kl_match_verl(loss_mode, loss_agg_mode, kl_loss_type):
    seed = 1000 + 100 * NEW_MODES.index(loss_mode) + 10 * LOSS_AGG_MODES.index(loss_agg_mode) + KLS.index(kl_loss_type)
    logits, ids, mask, old, ref, adv = batch(seed, far=kl_loss_type in ("low_var_kl", "k3+"))
    settings = MODE_SETTINGS[loss_mode]
    out, grad = ours(logits, ids, adv, mask, old_logps=old, ref_logps=ref, loss_mode=loss_mode,
                     loss_agg_mode=loss_agg_mode, kl_loss_type=kl_loss_type, kl_loss_coef=0.05, entropy_coeff=0.01,
                     **settings)
    loss64, grad64 = expected(logits, ids, mask, adv, old=old, ref=ref, loss_mode=loss_mode, loss_agg_mode=loss_agg_mode,
                              kl_loss_type=kl_loss_type, beta=0.05, entropy_coef=0.01,
                              **spec_settings(loss_mode, settings))
    check(out.loss, grad, loss64, grad64)
    assert grad[1].abs().max() == 0  # the fully masked row gets no gradient


@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("loss_mode", NEW_MODES + ("vanilla", "sapo", "geo_mean"))
def test_global_normalisers_and_rollout_weights(loss_mode, loss_agg_mode):
    """dp_size = 4 with verl's global counts (batch_num_tokens, global_batch_size), loss_scale_factor,
    rollout_is_weights, entropy and KL: every agg mode scales as verl 0.9's agg_loss."""
    logits, ids, mask, old, ref, adv = batch(2000 + LOSS_AGG_MODES.index(loss_agg_mode))
    w = torch.rand(B, T, generator=torch.Generator().manual_seed(7)) + 0.5
    settings = MODE_SETTINGS.get(loss_mode, {})
    glob = dict(dp_size=4, batch_num_tokens=37, global_batch_size=9, loss_scale_factor=11)
    out, grad = ours(logits, ids, adv, mask, old_logps=old, ref_logps=ref, loss_mode=loss_mode, loss_agg_mode=loss_agg_mode,
                     rollout_is_weights=w, kl_loss_coef=0.1, kl_loss_type="k3", entropy_coeff=0.02, **glob, **settings)
    loss64, grad64 = expected(logits, ids, mask, adv, old=old, ref=ref, loss_mode=loss_mode, loss_agg_mode=loss_agg_mode,
                              rollout_is_weights=w, beta=0.1, kl_loss_type="k3", entropy_coef=0.02,
                              **glob, **spec_settings(loss_mode, settings))
    check(out.loss, grad, loss64, grad64)


def test_seq_mean_token_sum_norm_is_the_09_meaning():
    """0.9: sum over sequences with a token / their count * dp_size / loss_scale_factor (0.8 had no
    sequence count): differs from 0.8's sum / T by the factor 1 / (sequences with a token)."""
    logits, ids, mask, old, _, adv = batch(2100)
    out_norm, _ = ours(logits, ids, adv, mask, old_logps=old, loss_mode="gpg", loss_agg_mode="seq-mean-token-sum-norm")
    out_sum, _ = ours(logits, ids, adv, mask, old_logps=old, loss_mode="gpg", loss_agg_mode="token-sum")
    with_tokens = int((mask.sum(-1) > 0).sum())
    assert with_tokens == B - 1
    torch.testing.assert_close(out_norm.loss, out_sum.loss / with_tokens / T, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("loss_mode", ["dppo_tv", "dppo_kl", "dro", "vanilla", "cispo", "sapo", "gpg"])
def test_verl_policy_metrics_per_mode(loss_mode):
    """The metrics each compute_policy_loss_* returns, no more (gpg: none; dro: ppo_kl), at fp32 rounding,
    with log-ratios beyond the clamp (ppo_kl averages the clamped log-ratio where the mode clamps it)."""
    logits, ids, mask, old, _, adv = batch(3000 + list(MODE_SETTINGS).index(loss_mode), far=True)
    settings = MODE_SETTINGS[loss_mode]
    if loss_mode.startswith("dppo"):
        settings = dict(settings, clip_ratio_c=1.05)  # a cap most ratios above 1 pass: truncated trusted tokens
    out, _ = ours(logits, ids, adv, mask, old_logps=old, loss_mode=loss_mode, **settings)
    logp64, _ = logprobs64(logits.double(), torch.where(mask != 0, ids, -100))
    spec = spec_settings(loss_mode, settings)
    expected_metrics = verl_policy_metrics64(logp64, torch.where(mask != 0, adv.double(), 0.0), mask,
                                             torch.where(mask != 0, old.double(), logp64), loss_mode,
                                             eps_low=spec.get("eps_low", 0.2), eps_high=spec.get("eps_high"),
                                             clip_ratio_c=spec.get("clip_ratio_c", 20.0 if "dppo" in loss_mode else 3.0))
    got = {k: v for k, v in out.metrics.items() if k in objective.VERL_POLICY_METRICS}
    assert set(got) == set(expected_metrics), (sorted(got), sorted(expected_metrics))
    for name, value in expected_metrics.items():
        torch.testing.assert_close(got[name].cpu().double(), value, rtol=1e-5, atol=1e-6, msg=name)
    if loss_mode.startswith("dppo"):  # the case has both trusted and untrusted tokens, and truncated ones
        assert 0 < expected_metrics["actor/pg_clipfrac"] < 1 and expected_metrics["actor/pg_clipfrac_lower"] > 0


@pytest.mark.parametrize("loss_mode", ["dppo_tv", "dppo_kl"])
def test_dppo_clip_ratio_c_defaults_to_20(loss_mode):
    """verl's config.get("clip_ratio_c", 20.0) for DPPO (vanilla's default stays 3)."""
    assert GRPOOptions(loss_mode=loss_mode).delta == 20.0 and GRPOOptions(loss_mode="vanilla").delta == 3.0
    assert GRPOOptions(loss_mode="gpg").delta is None
    logits, ids, mask, old, _, adv = batch(3100, far=True)
    out, grad = ours(logits, ids, adv, mask, old_logps=old, loss_mode=loss_mode, clip_ratio=0.05)
    loss64, grad64 = expected(logits, ids, mask, adv, old=old, loss_mode=loss_mode, eps_low=0.05, clip_ratio_c=20.0)
    check(out.loss, grad, loss64, grad64)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("loss_mode", NEW_MODES)
def test_new_modes_on_every_backend(loss_mode, backend):
    logits, ids, mask, old, ref, adv = batch(3200 + NEW_MODES.index(loss_mode))
    settings = MODE_SETTINGS[loss_mode]
    kw = dict(old_logps=old, ref_logps=ref, loss_mode=loss_mode, loss_agg_mode="seq-mean-token-sum-norm",
              kl_loss_type="k3+", kl_loss_coef=0.05, entropy_coeff=0.01, **settings)
    out, grad = ours(logits, ids, adv, mask, backend=backend, **kw)
    loss64, grad64 = expected(logits, ids, mask, adv, old=old, ref=ref, loss_mode=loss_mode,
                              loss_agg_mode="seq-mean-token-sum-norm", kl_loss_type="k3+", beta=0.05, entropy_coef=0.01,
                              **spec_settings(loss_mode, settings))
    check(out.loss, grad, loss64, grad64)


@pytest.mark.parametrize("loss_mode, loss_agg_mode, kl", [
    ("dppo_tv", "token-sum", "k1"), ("dppo_kl", "seq-mean-token-sum-norm", "low_var_kl+"),
    ("dro", "seq-mean-token-mean", "abs"), ("vanilla", "token-sum", "k2"),
])
def test_fused_linear_new_modes_gradient_in_forward(loss_mode, loss_agg_mode, kl):
    """fused_linear_grpo_loss (the gradient formed in the forward: these modes are token-local) against
    verl64 through float64 logits ``hidden @ weight.T``: loss, d hidden, d weight."""
    g = torch.Generator().manual_seed(4000 + NEW_MODES.index(loss_mode) if loss_mode in NEW_MODES else 4009)
    h_dim = 8
    hidden = torch.randn(B, T, h_dim, generator=g)
    weight = torch.randn(V, h_dim, generator=g) * 0.6
    logits = hidden.double() @ weight.double().T
    _, ids, mask, _, _, adv = batch(4100)
    logp = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
    old = (logp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3).float()
    ref = (logp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3).float()
    settings = MODE_SETTINGS[loss_mode]
    glob = dict(dp_size=2, batch_num_tokens=29, global_batch_size=7, loss_scale_factor=10)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = gk.fused_linear_grpo_loss(h, w, ids, adv, mask, backend="torch", chunk_size=5, old_logps=old, ref_logps=ref,
                                    loss_mode=loss_mode, loss_agg_mode=loss_agg_mode, kl_loss_type=kl, kl_loss_coef=0.1,
                                    entropy_coeff=0.02, **glob, **settings)
    assert type(out.loss.grad_fn).__name__ == "FusedLinearGRPOLossFunctionBackward"
    d_h, d_w = torch.autograd.grad(out.loss, (h, w))
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    lp64, ent64 = logprobs64(h64 @ w64.T, torch.where(mask != 0, ids, -100))
    loss64 = verl64(lp64, ent64, torch.where(mask != 0, adv.double(), 0.0), mask, old=old, ref=ref, loss_mode=loss_mode,
                    loss_agg_mode=loss_agg_mode, kl_loss_type=kl, beta=0.1, entropy_coef=0.02, **glob,
                    **spec_settings(loss_mode, settings))
    d_h64, d_w64 = torch.autograd.grad(loss64, (h64, w64))
    torch.testing.assert_close(out.loss.detach().double(), loss64.detach(), rtol=1e-5, atol=1e-6)
    for got, want in ((d_h, d_h64), (d_w, d_w64)):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


def test_modules_take_the_new_settings():
    logits, ids, mask, old, _, adv = batch(4200)
    module = gk.GRPOLoss(backend="torch", loss_mode="dro", dro_beta=0.7, loss_agg_mode="token-sum")
    x = logits.clone().requires_grad_()
    out = module(x, ids, adv, mask, old_logps=old)
    (grad,) = torch.autograd.grad(out.loss, x)
    loss64, grad64 = expected(logits, ids, mask, adv, old=old, loss_mode="dro", loss_agg_mode="token-sum", dro_beta=0.7)
    check(out.loss, grad, loss64, grad64)
    with pytest.raises(ValueError, match="dro_beta"):
        gk.GRPOLoss(loss_mode="dro")
    with pytest.raises(ValueError, match="global_batch_size"):
        gk.FusedLinearGRPOLoss(loss_mode="dppo_tv", loss_agg_mode="seq-mean-token-sum", dp_size=2)(
            torch.randn(B, T, 8), torch.randn(V, 8), ids, adv, mask, old_logps=old)


@pytest.mark.parametrize("kw, error, words", [
    (dict(loss_mode="dro"), ValueError, ["dro_beta", "> 0"]),
    (dict(loss_mode="dro", dro_beta=0.0), ValueError, ["dro_beta"]),
    (dict(loss_mode="dro", dro_beta=-1.0), ValueError, ["dro_beta"]),
    (dict(loss_mode="dro", dro_beta="0.1"), TypeError, ["dro_beta"]),
    (dict(loss_type="grpo", dro_beta=0.1), ValueError, ["dro_beta", "loss_mode"]),
    (dict(dro_beta=0.1), ValueError, ["dro_beta", "loss_mode"]),
    (dict(loss_mode="vanilla", kl_loss_type="full"), ValueError, ["kl_loss_type", "full", "distribution"]),
    (dict(loss_mode="vanilla", kl_loss_type="full+"), ValueError, ["kl_loss_type", "distribution"]),
    (dict(loss_mode="vanilla", dp_size=2), ValueError, ["dp_size", "num_items_in_batch", "batch_num_tokens"]),
    (dict(loss_mode="dppo_kl", dp_size=2, loss_agg_mode="seq-mean-token-sum"), ValueError, ["dp_size", "global_batch_size"]),
    (dict(loss_mode="gpg", dp_size=2, loss_agg_mode="seq-mean-token-mean", batch_num_tokens=10), ValueError,
     ["global_batch_size"]),
    (dict(loss_mode="dro", dro_beta=0.1, dp_size=3, loss_agg_mode="seq-mean-token-sum-norm"), ValueError,
     ["global_batch_size"]),
    (dict(loss_mode="dppo_tv", clip_ratio_c=1.0), ValueError, ["clip_ratio_c", "> 1"]),
    (dict(loss_mode="vanilla", clip_ratio_c=0.9), ValueError, ["clip_ratio_c"]),
    (dict(loss_mode="dppo_tv", clip_ratio_low=-0.1), ValueError, ["eps_low"]),
])
def test_refused_settings_name_the_keyword(kw, error, words):
    logits, ids, mask, old, _, adv = batch(0)
    with pytest.raises(error) as e:
        gk.grpo_loss(logits, ids, adv, mask, backend="torch", old_logps=old, **kw)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_accepted_verl_settings():
    """What verl accepts: token-sum with dp_size and no global count; a dppo_kl threshold above 1; dro_beta
    under another verl mode (verl's policy_loss holds it, only dro reads it); clip_ratio_c in (1, 1 + eps_high]
    (verl's only check is > 1)."""
    logits, ids, mask, old, _, adv = batch(4300)
    for kw in (dict(loss_mode="gpg", loss_agg_mode="token-sum", dp_size=3), dict(loss_mode="dppo_kl", clip_ratio_high=1.5),
               dict(loss_mode="vanilla", dro_beta=0.3), dict(loss_mode="vanilla", clip_ratio=0.2, clip_ratio_c=1.1)):
        out, grad = ours(logits, ids, adv, mask, old_logps=old, **kw)
        assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    a, ga = ours(logits, ids, adv, mask, old_logps=old, loss_mode="vanilla", dro_beta=0.3)
    b, gb = ours(logits, ids, adv, mask, old_logps=old, loss_mode="vanilla")
    assert torch.equal(a.loss, b.loss) and torch.equal(ga, gb)
    out, grad = ours(logits, ids, adv, mask, old_logps=old, loss_mode="vanilla", clip_ratio=0.2, clip_ratio_c=1.1)
    loss64, grad64 = expected(logits, ids, mask, adv, old=old, loss_mode="vanilla", clip_ratio_c=1.1)
    check(out.loss, grad, loss64, grad64)
