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
from helpers import DEVICE
from spec64 import logprobs64, verl64, verl_policy_metrics64

import grpo_kernels as gk
from grpo_kernels import objective
from grpo_kernels.options import LOSS_AGG_MODES, GRPOInputs, GRPOOptions

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


# --------------------------------------------------------------------------------------------------
# the Triton epilogue's verl terms (grpo_loss_fwd_kernel): loss, d loss / d logp, KL and clip flags
# against autograd of the registered objective (as tests/test_objective.py for TRL's)
# --------------------------------------------------------------------------------------------------
EPILOGUE_CASES = {
    "vanilla_low_var_kl": dict(loss_mode="vanilla", kl_loss_type="low_var_kl", beta=0.1, delta=1.6),
    # a clip range wider than e^20, A > 0 at log r = 25: the clamp's zero derivative shows
    "vanilla_wide_clamp": dict(loss_mode="vanilla", kl_loss_type="k2", beta=0.0, eps_high=1e9, far_positive=True),
    "vanilla_k3+_is": dict(loss_mode="vanilla", kl_loss_type="k3+", beta=0.1, eps_high=0.28, use_is=True),
    "gpg_k1_on_policy": dict(loss_mode="gpg", kl_loss_type="k1", beta=0.05, on_policy=True),
    "cispo_abs": dict(loss_mode="cispo", kl_loss_type="abs", beta=0.05, eps_low=1.0, eps_high=0.3),
    "cispo_abs+": dict(loss_mode="cispo", kl_loss_type="abs+", beta=0.05, eps_low=0.1, eps_high=0.2),
    "sapo_k2_kl_apart": dict(loss_mode="sapo", kl_loss_type="k2", beta=0.2, sapo_temperature_pos=0.8,
                             sapo_temperature_neg=1.3, loss_agg_mode="token-sum", use_is=True),
    "sapo_on_policy_mse+": dict(loss_mode="sapo", kl_loss_type="mse+", beta=0.2, on_policy=True),
    "dppo_tv_k1+": dict(loss_mode="dppo_tv", kl_loss_type="k1+", beta=0.1, eps_low=0.02, eps_high=0.03, delta=1.2),
    "dppo_kl_low_var_kl+_is": dict(loss_mode="dppo_kl", kl_loss_type="low_var_kl+", beta=0.1, eps_low=0.002,
                                   eps_high=0.003, delta=1.2, use_is=True),
    "dppo_kl_default_cap": dict(loss_mode="dppo_kl", kl_loss_type="kl", beta=0.1, eps_low=0.002, eps_high=0.003),
    "dro_k3": dict(loss_mode="dro", kl_loss_type="k3", beta=0.1, dro_beta=0.7, entropy_coef=0.03),
    "dro_on_policy": dict(loss_mode="dro", kl_loss_type="kl+", beta=0.1, dro_beta=0.7, on_policy=True),
}


@pytest.mark.parametrize("case", list(EPILOGUE_CASES))
def test_triton_epilogue_verl_terms_equal_autograd_of_the_objective(case):
    from grpo_kernels.kernels import triton_rows

    kw = dict(EPILOGUE_CASES[case])
    use_is, on_policy = kw.pop("use_is", False), kw.pop("on_policy", False)
    far_positive = kw.pop("far_positive", False)
    options = GRPOOptions(temperature=0.9, **kw)
    g = torch.Generator().manual_seed(5000 + list(EPILOGUE_CASES).index(case))
    b, t, v = 3, 11, 29
    logits = torch.randn(b, t, v, generator=g) * 2
    ids = torch.randint(0, v, (b, t), generator=g)
    logits[2, 5, ids[2, 5]] = -80.0  # a token of log-prob about -90: an old log-prob 25 above it is one
    mask = torch.ones(b, t)
    logp_now = torch.log_softmax(logits / options.temperature, -1).gather(-1, ids[..., None])[..., 0]
    # ratios over every region (below, inside, above the clip range; above the cap; beyond the +-20
    # clamp), old log-probs <= 0
    old = (logp_now - torch.linspace(-0.7, 0.7, b * t).reshape(b, t)).clamp(max=-1e-3)
    old[2, 4] = logp_now[2, 4] - 25.0
    old[2, 5] = logp_now[2, 5] + 25.0
    ref = logp_now + 0.3 * torch.randn(b, t, generator=g)
    ref[1, 3] = logp_now[1, 3] + 30.0  # beyond low_var_kl's clamps on both sides
    ref[1, 4] = logp_now[1, 4] - 25.0
    adv = torch.randn(b, t, generator=g)
    adv[2, 4], adv[2, 5] = (1.0, -1.0) if far_positive else (-1.0, 1.0)
    is_ratio = torch.rand(b, t, generator=g) + 0.5 if use_is else None
    old_in = None if on_policy else old
    inputs = GRPOInputs(old_logps=old_in, ref_logps=ref, is_ratio=is_ratio)
    sequences = objective.Sequences(mask, None)
    weights = objective.token_weights(mask, options, None, sequences)
    kl_weights = objective.regulariser_weights(mask, options, inputs, sequences)
    apart = not torch.equal(kl_weights, weights)
    assert apart == (case == "sapo_k2_kl_apart")

    out = triton_rows.grpo_forward_rows(
        logits=logits.to(DEVICE), targets=ids.to(DEVICE), advantages=adv.to(DEVICE), weights=weights.to(DEVICE),
        old_logps=None if old_in is None else old_in.to(DEVICE), ref_logps=ref.to(DEVICE),
        is_ratio=None if is_ratio is None else is_ratio.to(DEVICE), temperature=options.temperature, ignore_index=-100,
        eps_low=options.eps_low, eps_high=options.eps_high, delta=options.delta, beta=options.beta,
        entropy_coef=options.entropy_coef, loss_type=options.loss_type, sapo_temperature_pos=options.sapo_temperature_pos,
        sapo_temperature_neg=options.sapo_temperature_neg, loss_mode=options.loss_mode,
        kl_loss_type=options.kl_loss_type, dro_beta=0.0 if options.dro_beta is None else options.dro_beta,
        kl_weights=kl_weights.to(DEVICE) if apart else None,
    )
    loss_k, logp_k, ent_k, _, _, coef_logp_k, coef_ent_k, kl_k, clip_k = (x.cpu() for x in out)

    logp = logp_k.clone().requires_grad_()
    ent = ent_k.clone().requires_grad_()
    terms = objective.policy_terms(logp, ent, adv, mask, inputs, options)
    # verl: the policy term by its weights, beta * KL by loss_agg_mode's; the kernel's own entropy term
    # is weighted like the policy term (the library passes entropy_coef=0 and adds verl's bonus beside it)
    weighted = terms.loss * weights + options.beta * terms.kl * kl_weights - options.entropy_coef * ent * weights
    d_logp, d_ent = torch.autograd.grad(weighted.sum(), (logp, ent), allow_unused=True)
    d_ent = torch.zeros_like(ent) if d_ent is None else d_ent

    assert torch.isfinite(loss_k).all() and torch.isfinite(coef_logp_k).all()
    torch.testing.assert_close(loss_k, weighted.detach(), rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(coef_logp_k, d_logp, rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(coef_ent_k, d_ent, rtol=0, atol=0)
    torch.testing.assert_close(kl_k, terms.kl.detach(), rtol=2e-6, atol=3e-7)
    zero = torch.zeros_like(clip_k)
    expected_clip = ((terms.high.to(torch.int8) if terms.high is not None else zero)
                     - (terms.low.to(torch.int8) if terms.low is not None else zero))
    assert torch.equal(clip_k, expected_clip.to(torch.int8))
    if far_positive:  # the clamped token: value e^20, no gradient through the clamp
        assert loss_k[2, 4] != 0 and coef_logp_k[2, 4] == 0
    elif options.loss_mode in ("vanilla", "dppo_tv", "dppo_kl"):  # the case exercises both flags
        assert (clip_k > 0).any() and (clip_k < 0).any()


def test_triton_launcher_refuses_what_it_has_no_term_for():
    from grpo_kernels.kernels import triton_rows

    x, ids, w = torch.randn(1, 2, 5), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2)
    common = dict(logits=x, targets=ids, advantages=w, weights=w, old_logps=None, ref_logps=w, is_ratio=None,
                  temperature=1.0, ignore_index=-100, eps_low=0.2, eps_high=0.2, delta=None, beta=0.1, entropy_coef=0.0)
    for kw, word in ((dict(loss_mode="gspo"), "loss_mode"), (dict(loss_mode="vanilla", kl_loss_type="full"), "kl_loss_type"),
                     (dict(loss_type="vespo"), "loss_type"), (dict(kl_weights=w), "kl_weights")):
        with pytest.raises(ValueError, match=word):
            triton_rows.grpo_forward_rows(**common, **kw)


# --------------------------------------------------------------------------------------------------
# grpo_loss on the Triton backend: verl's token-local specs fuse (one pass), and equal verl64
# --------------------------------------------------------------------------------------------------
FUSED_CASES = {
    "vanilla_low_var_kl+_far": dict(loss_mode="vanilla", kl_loss_type="low_var_kl+", loss_agg_mode="seq-mean-token-mean"),
    "sapo_k3_entropy": dict(loss_mode="sapo", kl_loss_type="k3", loss_agg_mode="token-mean", tau_pos=0.9, tau_neg=1.2),
    "cispo_abs": dict(loss_mode="cispo", kl_loss_type="abs", clip_ratio_low=1.0, clip_ratio_high=0.3,
                      loss_agg_mode="token-sum"),
    "gpg_k1_global": dict(loss_mode="gpg", kl_loss_type="k1", loss_agg_mode="seq-mean-token-sum-norm", dp_size=2,
                          global_batch_size=5, loss_scale_factor=9),
    "dppo_tv_k2": dict(loss_mode="dppo_tv", kl_loss_type="k2", **MODE_SETTINGS["dppo_tv"]),
    "dppo_kl_k3+_global": dict(loss_mode="dppo_kl", kl_loss_type="k3+", loss_agg_mode="token-mean", dp_size=3,
                               batch_num_tokens=31, **MODE_SETTINGS["dppo_kl"]),
    "dro_mse+_is": dict(loss_mode="dro", kl_loss_type="mse+", loss_agg_mode="seq-mean-token-sum", dro_beta=0.7,
                        is_weights=True),
}


@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_triton_backend_fuses_verl_token_local_specs(case):
    kw = dict(FUSED_CASES[case])
    if kw.pop("is_weights", False):
        kw["rollout_is_weights"] = torch.rand(B, T, generator=torch.Generator().manual_seed(3)) + 0.5
    logits, ids, mask, old, ref, adv = batch(6000 + list(FUSED_CASES).index(case), far=True)
    poisoned = torch.where(mask[..., None] != 0, logits, torch.full((), float("nan")))  # masked: never read
    out, grad = ours(poisoned, ids, adv, mask, backend="triton", old_logps=old, ref_logps=ref, kl_loss_coef=0.1,
                     entropy_coeff=0.02, **kw)
    assert type(out.loss.grad_fn).__name__ == "FusedGRPOLossFunctionBackward"  # the one-pass epilogue
    spec = {"batch_num_tokens": "batch_num_tokens", "rollout_is_weights": "rollout_is_weights"}
    spec_kw = {spec.get(k, k): v for k, v in kw.items() if k != "kl_loss_type"}
    spec_kw = spec_settings(kw["loss_mode"], spec_kw)
    loss64, grad64 = expected(logits, ids, mask, adv, old=old, ref=ref, beta=0.1, entropy_coef=0.02,
                              kl_loss_type=kw["kl_loss_type"], **spec_kw)
    check(out.loss, grad, loss64, grad64)
    assert torch.equal(grad[mask == 0], torch.zeros_like(grad[mask == 0]))
    torch_out, _ = ours(logits, ids, adv, mask, backend="torch", old_logps=old, ref_logps=ref, kl_loss_coef=0.1,
                        entropy_coeff=0.02, **kw)
    assert set(out.metrics) == set(torch_out.metrics)
    for name in out.metrics:
        torch.testing.assert_close(out.metrics[name], torch_out.metrics[name], rtol=1e-5, atol=1e-6, msg=name)


def test_triton_backend_does_not_fuse_verl_batch_level_modes():
    from grpo_kernels import backends

    triton_backend = backends.REGISTRY["triton"]
    assert all(triton_backend.fuses(GRPOOptions(loss_mode=m, dro_beta=0.1))
               for m in ("vanilla", "sapo", "gpg", "cispo", "dppo_tv", "dppo_kl", "dro"))
    assert not any(triton_backend.fuses(GRPOOptions(loss_mode=m)) for m in ("gspo", "clip_cov", "kl_cov", "geo_mean"))
    assert triton_backend.fuses(GRPOOptions(loss_type="dapo")) and not triton_backend.fuses(GRPOOptions(loss_type="vespo"))
