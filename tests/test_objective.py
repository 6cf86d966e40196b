"""The loss spec against float64 restatements of verl's core_algos and TRL 1.16's _compute_loss
(``tests/spec64.py``): every verl loss_mode x loss_agg_mode x KL estimator, TRL's entropy bonus,
top_entropy_quantile, off_policy_mask_threshold and rollout correction, loss and gradients; and the
errors for conflicting or unknown names."""

from __future__ import annotations

import pytest
import torch
import verl_cases as vc
from helpers import loss_and_logits_grad as ours
from spec64 import grpo64, logprobs64, verl64, verl_policy_metrics64

import grpo_kernels as gk
from grpo_kernels import loss_modes, objective
from grpo_kernels.options import KL_LOSS_TYPES, LOSS_AGG_MODES, LOSS_MODES, ROLLOUT_CORRECTIONS, GRPOInputs, GRPOOptions

B, T, V = 3, 6, 13
pytestmark = pytest.mark.timeout(600)


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g) * 2
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.2).float()
    mask[1] = 0  # a fully masked row: verl leaves it out of the sequence count
    logp = torch.log_softmax(logits.double(), -1).gather(-1, ids[..., None])[..., 0]
    old = (logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    ref = (logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    rollout = (logp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    adv = torch.randn(B, T, generator=g)
    return logits, ids, mask, old, ref, rollout, adv


def expected(fn, logits, ids, mask, **kw):
    x = logits.double().requires_grad_()
    ids = torch.where(mask != 0, ids, -100)
    logp, ent = logprobs64(x, ids)
    loss = fn(logp, ent, mask, **kw)
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad


def check(out, grad, loss64, grad64):
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    torch.testing.assert_close(out.loss.detach().cpu().double(), loss64, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), grad64, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("loss_mode", [m for m in LOSS_MODES if m != "clip_cov"])
@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
def test_verl_loss_modes_and_reductions(loss_mode, loss_agg_mode):
    logits, ids, mask, old, ref, _, adv = batch(LOSS_MODES.index(loss_mode) * 7 + LOSS_AGG_MODES.index(loss_agg_mode))
    kw = dict(loss_mode=loss_mode, loss_agg_mode=loss_agg_mode, beta=0.05, entropy_coef=0.01, eps_high=0.28,
              kl_cov_ratio=0.2, tau_pos=0.9, tau_neg=1.2, dro_beta=0.3)
    out, grad = ours(logits, ids, adv, mask, old_logps=old, ref_logps=ref, clip_ratio_c=1.5, **kw)
    loss64, grad64 = expected(
        lambda lp, en, m: verl64(lp, en, torch.where(m != 0, adv.double(), 0.0), m, old=old, ref=ref, loss_mode=loss_mode,
                                 loss_agg_mode=loss_agg_mode, beta=0.05, entropy_coef=0.01, eps_high=0.28, clip_ratio_c=1.5,
                                 kl_cov_ratio=0.2, tau_pos=0.9, tau_neg=1.2, dro_beta=0.3), logits, ids, mask)
    check(out, grad, loss64, grad64)
    assert ("actor/ppo_kl" in out.metrics) == (loss_mode != "gpg") and "actor/entropy" in out.metrics  # gpg logs {}


@pytest.mark.parametrize("kl_loss_type", KL_LOSS_TYPES)
def test_verl_kl_estimators(kl_loss_type):
    logits, ids, mask, old, ref, _, adv = batch(100 + KL_LOSS_TYPES.index(kl_loss_type))
    ref = ref.clone()
    ref[0, 0] = ref[0, 0] - 30.0  # beyond the low_var_kl clamps
    out, grad = ours(logits, ids, adv, mask, old_logps=old, ref_logps=ref, loss_mode="vanilla",
                     kl_loss_type=kl_loss_type, kl_loss_coef=0.1, loss_agg_mode="seq-mean-token-mean")
    loss64, grad64 = expected(
        lambda lp, en, m: verl64(lp, en, torch.where(m != 0, adv.double(), 0.0), m, old=old, ref=ref,
                                 kl_loss_type=kl_loss_type, beta=0.1, loss_agg_mode="seq-mean-token-mean"),
        logits, ids, mask)
    check(out, grad, loss64, grad64)


def test_verl_global_normalisers_and_rollout_weights():
    logits, ids, mask, old, ref, _, adv = batch(200)
    w = torch.rand(B, T) + 0.5
    for mode in LOSS_AGG_MODES:
        for loss_mode in ("vanilla", "geo_mean"):
            out, grad = ours(logits, ids, adv, mask, old_logps=old, loss_mode=loss_mode, loss_agg_mode=mode,
                             rollout_is_weights=w, batch_num_tokens=40, global_batch_size=5, dp_size=2,
                             loss_scale_factor=9)
            loss64, grad64 = expected(
                lambda lp, en, m: verl64(lp, en, torch.where(m != 0, adv.double(), 0.0), m, old=old, loss_mode=loss_mode,
                                         loss_agg_mode=mode, rollout_is_weights=w, dp_size=2, batch_num_tokens=40,
                                         global_batch_size=5, loss_scale_factor=9), logits, ids, mask)
            check(out, grad, loss64, grad64)


def test_verl_clip_cov_drops_the_selected_gradients():
    """clip_cov with every candidate selected (clip_cov_ratio large): verl's random choice is then all."""
    logits, ids, mask, old, _, _, adv = batch(300)
    adv = adv * 3
    out, grad = ours(logits, ids, adv, mask, old_logps=old, loss_mode="clip_cov", clip_cov_ratio=1.0, clip_cov_lb=0.0,
                     clip_cov_ub=1e9)
    x = logits.double().requires_grad_()
    logp, _ = logprobs64(x, torch.where(mask != 0, ids, -100))
    m, a, o = mask.double(), torch.where(mask != 0, adv.double(), 0.0), old.double()
    r = torch.exp(logp - o)
    l1, l2 = -a * r, -a * r.clamp(0.8, 1.2)
    mean = lambda v: (v * m).sum() / (m.sum() + 1e-8)  # noqa: E731
    cov = (a - mean(a)) * (logp.detach() - mean(logp.detach()))
    dropped = (cov > 0) & (m > 0) & ~(l2 > l1)
    assert dropped.any() and (~dropped & (m > 0)).any()
    loss64 = (torch.maximum(l1, l2) * (~dropped).double() * m).sum() / m.sum()
    (grad64,) = torch.autograd.grad(loss64, x)
    check(out, grad, loss64.detach(), grad64)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "sapo"])
def test_trl_entropy_bonus_is_a_token_mean_for_every_loss_type(backend, loss_type):
    logits, ids, mask, old, ref, _, adv = batch(400)
    kw = dict(old_logps=old, ref_logps=ref, beta=0.04, entropy_coef=0.05, loss_type=loss_type)
    out, grad = ours(logits, ids, adv, mask, backend=backend, **kw)
    loss64, grad64 = expected(lambda lp, en, m: grpo64(None, ids, adv, m, logprobs=(lp, en), **kw)[0], logits, ids, mask)
    check(out, grad, loss64, grad64)


@pytest.mark.parametrize("mode", ROLLOUT_CORRECTIONS)
@pytest.mark.parametrize("with_old", [True, False])
def test_trl_rollout_correction(mode, with_old):
    logits, ids, mask, old, _, rollout, adv = batch(500 + ROLLOUT_CORRECTIONS.index(mode))
    kw = dict(rollout_logps=rollout, rollout_correction=mode, rollout_correction_max=1.3, rollout_correction_min=0.8,
              loss_type="dapo", **(dict(old_logps=old) if with_old else {}))
    for backend in ("torch", "triton"):
        out, grad = ours(logits, ids, adv, mask, backend=backend, **kw)
        loss64, grad64 = expected(lambda lp, en, m: grpo64(None, ids, adv, m, logprobs=(lp, en), **kw)[0], logits, ids, mask)
        check(out, grad, loss64, grad64)
        assert "sampling/importance_sampling_ratio/mean" in out.metrics


@pytest.mark.parametrize("bounds", [(None, None), (None, 0.8), (1.3, None)], ids=["unbounded", "floor", "cap"])
@pytest.mark.parametrize("mode", ["token_truncate", "sequence_truncate", "token_mask"])
def test_rollout_correction_with_a_missing_bound(mode, bounds):
    """rollout_correction_max=None is documented as unbounded: with *_truncate and no floor either, the
    ratio is left as it is (it was a crash in torch.clamp); every backend, against the float64 spec."""
    logits, ids, mask, old, _, rollout, adv = batch(520 + ROLLOUT_CORRECTIONS.index(mode))
    kw = dict(rollout_logps=rollout, rollout_correction=mode, rollout_correction_max=bounds[0],
              rollout_correction_min=bounds[1], loss_type="dapo", old_logps=old)
    loss64, grad64 = expected(lambda lp, en, m: grpo64(None, ids, adv, m, logprobs=(lp, en), **kw)[0], logits, ids, mask)
    for backend in ("torch", "reference", "triton") if bounds == (None, None) else ("torch",):
        out, grad = ours(logits, ids, adv, mask, backend=backend, **kw)
        check(out, grad, loss64, grad64)


def test_rollout_correction_equals_the_is_ratio_route():
    """The same loss as today's is_ratio fed TRL's ratio."""
    logits, ids, mask, old, _, rollout, adv = batch(600)
    ratio = torch.exp(((old - rollout) * mask).sum(-1, keepdim=True)).clamp(max=3.0)
    a, _ = ours(logits, ids, adv, mask, old_logps=old, rollout_logps=rollout, rollout_correction="sequence_truncate")
    b, _ = ours(logits, ids, adv, mask, old_logps=old, is_ratio=ratio)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("case", ["top_entropy", "off_policy_rollout", "off_policy_old", "both_grpo"])
def test_trl_masks(case):
    logits, ids, mask, old, ref, rollout, adv = batch(700 + ["top_entropy", "off_policy_rollout", "off_policy_old",
                                                              "both_grpo"].index(case))
    kw = {"top_entropy": dict(top_entropy_quantile=0.4, entropy_coef=0.02, old_logps=old),
          "off_policy_rollout": dict(off_policy_mask_threshold=0.01, rollout_logps=rollout, old_logps=old),
          "off_policy_old": dict(off_policy_mask_threshold=0.01, old_logps=old),
          "both_grpo": dict(loss_type="grpo", top_entropy_quantile=0.5, off_policy_mask_threshold=0.02, old_logps=old,
                            ref_logps=ref, beta=0.03, entropy_coef=0.01)}[case]
    out, grad = ours(logits, ids, adv, mask, **kw)
    loss64, grad64 = expected(lambda lp, en, m: grpo64(None, ids, adv, m, logprobs=(lp, en), **kw)[0], logits, ids, mask)
    check(out, grad, loss64, grad64)


@pytest.mark.parametrize("kw", [
    dict(loss_mode="vanilla", loss_agg_mode="seq-mean-token-sum", kl_loss_type="k3+", beta=0.05, entropy_coef=0.01),
    dict(loss_mode="cispo", eps_low=1.0, eps_high=0.3), dict(loss_mode="sapo", beta=0.02, kl_loss_type="abs"),
    dict(loss_type="grpo", entropy_coef=0.03, rollout_correction="token_mask", rollout_correction_max=1.2),
])
def test_fused_linear_gradient_in_forward_matches_the_reference(kw):
    """The fused-linear path (gradient in the forward for these token-local specs) against the reference."""
    g = torch.Generator().manual_seed(800)
    hidden = torch.randn(B, T, 8, generator=g)
    weight = torch.randn(V, 8, generator=g) * 0.5
    _, ids, mask, old, ref, rollout, adv = batch(801)
    kw = dict(kw, old_logps=old, ref_logps=ref, rollout_logps=rollout) if "rollout_correction" in kw else dict(kw, old_logps=old, ref_logps=ref)
    outs = []
    for backend in ("torch", "reference"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = gk.fused_linear_grpo_loss(h, w, ids, adv, mask, backend=backend, chunk_size=5, **kw)
        outs.append((out.loss.detach(), *torch.autograd.grad(out.loss, [h, w])))
        if backend == "torch":
            assert type(out.loss.grad_fn).__name__ == "FusedLinearGRPOLossFunctionBackward"
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6)


def test_verl_spellings_mean_our_options():
    logits, ids, mask, old, ref, _, adv = batch(900)
    a, ga = ours(logits, ids, adv, mask, old_logps=old, ref_logps=ref, loss_mode="vanilla", clip_ratio_low=0.1,
                 clip_ratio_high=0.3, clip_ratio_c=2.0, kl_loss_coef=0.05, entropy_coeff=0.01)
    b, gb = ours(logits, ids, adv, mask, old_logps=old, ref_logps=ref, loss_mode="vanilla", eps_low=0.1, eps_high=0.3,
                 delta=2.0, beta=0.05, entropy_coef=0.01)
    assert torch.equal(a.loss, b.loss) and torch.equal(ga, gb)


@pytest.mark.parametrize("kw, error, words", [
    (dict(loss_type="grpo", loss_mode="vanilla"), ValueError, ["loss_type", "loss_mode", "vanilla", "dapo"]),
    (dict(loss_mode="ppo"), ValueError, ["loss_mode", "geo_mean"]),
    (dict(loss_mode="vanilla", kl_loss_type="k4"), ValueError, ["kl_loss_type", "low_var_kl"]),
    (dict(loss_mode="vanilla", loss_agg_mode="token-max"), ValueError, ["loss_agg_mode", "seq-mean-token-mean"]),
    (dict(loss_agg_mode="token-mean"), ValueError, ["loss_agg_mode", "loss_mode"]),
    (dict(kl_loss_coef=0.1, beta=0.1), TypeError, ["kl_loss_coef", "beta"]),
    (dict(use_kl_loss=True), TypeError, ["use_kl_loss", "beta"]),
    (dict(loss_mode="vanilla", top_entropy_quantile=0.5), ValueError, ["top_entropy_quantile", "loss_type"]),
    (dict(rollout_correction="token_clip"), ValueError, ["rollout_correction", "token_truncate"]),
    (dict(rollout_correction="token_mask"), ValueError, ["rollout_logps"]),
    (dict(rollout_correction_min=2.0, rollout_correction_max=1.0), ValueError, ["rollout_correction_min"]),
])
def test_bad_names_are_refused_naming_the_keyword(kw, error, words):
    logits, ids, mask, *_ , adv = batch(0)
    with pytest.raises(error) as e:
        gk.grpo_loss(logits, ids, adv, mask, backend="torch", **kw)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_registries_cover_the_names():
    assert set(LOSS_AGG_MODES) <= set(objective.REDUCTIONS) and set(KL_LOSS_TYPES) <= set(objective.KL_ESTIMATORS)
    # every loss mode's reduction is registered (TRL's fixed one; verl's forced one, else loss_agg_mode's)
    assert all(m.reduction in objective.REDUCTIONS for m in loss_modes.REGISTRY.values() if m.reduction is not None)


# --------------------------------------------------------------------------------------------------
# verl 0.9: dppo_tv, dppo_kl, dro x every loss_agg_mode x KL estimators, the global normalisers,
# verl's metrics per mode, the fused-linear path and the modules (tests/verl_cases.py)
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kl_loss_type", vc.KLS)
@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("loss_mode", vc.NEW_MODES)
def test_new_modes_x_reductions_x_kl_match_verl(loss_mode, loss_agg_mode, kl_loss_type):
    seed = 1000 + 100 * vc.NEW_MODES.index(loss_mode) + 10 * LOSS_AGG_MODES.index(loss_agg_mode) + vc.KLS.index(kl_loss_type)
    logits, ids, mask, old, ref, adv = vc.batch(seed, far=kl_loss_type in ("low_var_kl", "k3+"))
    settings = vc.MODE_SETTINGS[loss_mode]
    out, grad = vc.ours(logits, ids, adv, mask, old_logps=old, ref_logps=ref, loss_mode=loss_mode,
                     loss_agg_mode=loss_agg_mode, kl_loss_type=kl_loss_type, kl_loss_coef=0.05, entropy_coeff=0.01,
                     **settings)
    loss64, grad64 = vc.expected(logits, ids, mask, adv, old=old, ref=ref, loss_mode=loss_mode, loss_agg_mode=loss_agg_mode,
                              kl_loss_type=kl_loss_type, beta=0.05, entropy_coef=0.01,
                              **vc.spec_settings(loss_mode, settings))
    vc.check(out.loss, grad, loss64, grad64)
    assert grad[1].abs().max() == 0  # the fully masked row gets no gradient


@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("loss_mode", vc.NEW_MODES + ("vanilla", "sapo", "geo_mean"))
def test_global_normalisers_and_rollout_weights(loss_mode, loss_agg_mode):
    """dp_size = 4 with verl's global counts (batch_num_tokens, global_batch_size), loss_scale_factor,
    rollout_is_weights, entropy and KL: every agg mode scales as verl 0.9's agg_loss."""
    logits, ids, mask, old, ref, adv = vc.batch(2000 + LOSS_AGG_MODES.index(loss_agg_mode))
    w = torch.rand(vc.B, vc.T, generator=torch.Generator().manual_seed(7)) + 0.5
    settings = vc.MODE_SETTINGS.get(loss_mode, {})
    glob = dict(dp_size=4, batch_num_tokens=37, global_batch_size=9, loss_scale_factor=11)
    out, grad = vc.ours(logits, ids, adv, mask, old_logps=old, ref_logps=ref, loss_mode=loss_mode, loss_agg_mode=loss_agg_mode,
                     rollout_is_weights=w, kl_loss_coef=0.1, kl_loss_type="k3", entropy_coeff=0.02, **glob, **settings)
    loss64, grad64 = vc.expected(logits, ids, mask, adv, old=old, ref=ref, loss_mode=loss_mode, loss_agg_mode=loss_agg_mode,
                              rollout_is_weights=w, beta=0.1, kl_loss_type="k3", entropy_coef=0.02,
                              **glob, **vc.spec_settings(loss_mode, settings))
    vc.check(out.loss, grad, loss64, grad64)


def test_seq_mean_token_sum_norm_is_the_09_meaning():
    """0.9: sum over sequences with a token / their count * dp_size / loss_scale_factor (0.8 had no
    sequence count): differs from 0.8's sum / T by the factor 1 / (sequences with a token)."""
    logits, ids, mask, old, _, adv = vc.batch(2100)
    out_norm, _ = vc.ours(logits, ids, adv, mask, old_logps=old, loss_mode="gpg", loss_agg_mode="seq-mean-token-sum-norm")
    out_sum, _ = vc.ours(logits, ids, adv, mask, old_logps=old, loss_mode="gpg", loss_agg_mode="token-sum")
    with_tokens = int((mask.sum(-1) > 0).sum())
    assert with_tokens == vc.B - 1
    torch.testing.assert_close(out_norm.loss, out_sum.loss / with_tokens / vc.T, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("loss_mode", ["dppo_tv", "dppo_kl", "dro", "vanilla", "cispo", "sapo", "gpg"])
def test_verl_policy_metrics_per_mode(loss_mode):
    """The metrics each compute_policy_loss_* returns, no more (gpg: none; dro: ppo_kl), at fp32 rounding,
    with log-ratios beyond the clamp (ppo_kl averages the clamped log-ratio where the mode clamps it)."""
    logits, ids, mask, old, _, adv = vc.batch(3000 + list(vc.MODE_SETTINGS).index(loss_mode), far=True)
    settings = vc.MODE_SETTINGS[loss_mode]
    if loss_mode.startswith("dppo"):
        settings = dict(settings, clip_ratio_c=1.05)  # a cap most ratios above 1 pass: truncated trusted tokens
    out, _ = vc.ours(logits, ids, adv, mask, old_logps=old, loss_mode=loss_mode, **settings)
    logp64, _ = logprobs64(logits.double(), torch.where(mask != 0, ids, -100))
    spec = vc.spec_settings(loss_mode, settings)
    expected_metrics = verl_policy_metrics64(logp64, torch.where(mask != 0, adv.double(), 0.0), mask,
                                             torch.where(mask != 0, old.double(), logp64), loss_mode,
                                             eps_low=spec.get("eps_low", 0.2), eps_high=spec.get("eps_high"),
                                             clip_ratio_c=spec.get("clip_ratio_c", 20.0 if "dppo" in loss_mode else 3.0))
    got = {k: v for k, v in out.metrics.items() if k in loss_modes.VERL_POLICY_METRICS}
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
    logits, ids, mask, old, _, adv = vc.batch(3100, far=True)
    out, grad = vc.ours(logits, ids, adv, mask, old_logps=old, loss_mode=loss_mode, clip_ratio=0.05)
    loss64, grad64 = vc.expected(logits, ids, mask, adv, old=old, loss_mode=loss_mode, eps_low=0.05, clip_ratio_c=20.0)
    vc.check(out.loss, grad, loss64, grad64)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("loss_mode", vc.NEW_MODES)
def test_new_modes_on_every_backend(loss_mode, backend):
    logits, ids, mask, old, ref, adv = vc.batch(3200 + vc.NEW_MODES.index(loss_mode))
    settings = vc.MODE_SETTINGS[loss_mode]
    kw = dict(old_logps=old, ref_logps=ref, loss_mode=loss_mode, loss_agg_mode="seq-mean-token-sum-norm",
              kl_loss_type="k3+", kl_loss_coef=0.05, entropy_coeff=0.01, **settings)
    out, grad = vc.ours(logits, ids, adv, mask, backend=backend, **kw)
    loss64, grad64 = vc.expected(logits, ids, mask, adv, old=old, ref=ref, loss_mode=loss_mode,
                              loss_agg_mode="seq-mean-token-sum-norm", kl_loss_type="k3+", beta=0.05, entropy_coef=0.01,
                              **vc.spec_settings(loss_mode, settings))
    vc.check(out.loss, grad, loss64, grad64)


@pytest.mark.parametrize("loss_mode, loss_agg_mode, kl", [
    ("dppo_tv", "token-sum", "k1"), ("dppo_kl", "seq-mean-token-sum-norm", "low_var_kl+"),
    ("dro", "seq-mean-token-mean", "abs"), ("vanilla", "token-sum", "k2"),
])
def test_fused_linear_new_modes_gradient_in_forward(loss_mode, loss_agg_mode, kl):
    """fused_linear_grpo_loss (the gradient formed in the forward: these modes are token-local) against
    verl64 through float64 logits ``hidden @ weight.T``: loss, d hidden, d weight."""
    g = torch.Generator().manual_seed(4000 + vc.NEW_MODES.index(loss_mode) if loss_mode in vc.NEW_MODES else 4009)
    h_dim = 8
    hidden = torch.randn(vc.B, vc.T, h_dim, generator=g)
    weight = torch.randn(vc.V, h_dim, generator=g) * 0.6
    logits = hidden.double() @ weight.double().T
    _, ids, mask, _, _, adv = vc.batch(4100)
    logp = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
    old = (logp + 0.4 * torch.randn(vc.B, vc.T, generator=g, dtype=torch.float64)).clamp(max=-1e-3).float()
    ref = (logp + 0.4 * torch.randn(vc.B, vc.T, generator=g, dtype=torch.float64)).clamp(max=-1e-3).float()
    settings = vc.MODE_SETTINGS[loss_mode]
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
                    **vc.spec_settings(loss_mode, settings))
    d_h64, d_w64 = torch.autograd.grad(loss64, (h64, w64))
    torch.testing.assert_close(out.loss.detach().double(), loss64.detach(), rtol=1e-5, atol=1e-6)
    for got, want in ((d_h, d_h64), (d_w, d_w64)):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


def test_modules_take_the_new_settings():
    logits, ids, mask, old, _, adv = vc.batch(4200)
    module = gk.GRPOLoss(backend="torch", loss_mode="dro", dro_beta=0.7, loss_agg_mode="token-sum")
    x = logits.clone().requires_grad_()
    out = module(x, ids, adv, mask, old_logps=old)
    (grad,) = torch.autograd.grad(out.loss, x)
    loss64, grad64 = vc.expected(logits, ids, mask, adv, old=old, loss_mode="dro", loss_agg_mode="token-sum", dro_beta=0.7)
    vc.check(out.loss, grad, loss64, grad64)
    with pytest.raises(ValueError, match="dro_beta"):
        gk.GRPOLoss(loss_mode="dro")
    with pytest.raises(ValueError, match="global_batch_size"):
        gk.FusedLinearGRPOLoss(loss_mode="dppo_tv", loss_agg_mode="seq-mean-token-sum", dp_size=2)(
            torch.randn(vc.B, vc.T, 8), torch.randn(vc.V, 8), ids, adv, mask, old_logps=old)


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
    (dict(loss_mode="dppo_tv", clip_ratio_low=-0.1), ValueError, ["clip_ratio_low", ">= 0"]),  # (as the caller spelled it)
])
def test_refused_settings_name_the_keyword(kw, error, words):
    logits, ids, mask, old, _, adv = vc.batch(0)
    with pytest.raises(error) as e:
        gk.grpo_loss(logits, ids, adv, mask, backend="torch", old_logps=old, **kw)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_accepted_verl_settings():
    """What verl accepts: token-sum with dp_size and no global count; a dppo_kl threshold above 1; dro_beta
    under another verl mode (verl's policy_loss holds it, only dro reads it); clip_ratio_c in (1, 1 + eps_high]
    (verl's only check is > 1)."""
    logits, ids, mask, old, _, adv = vc.batch(4300)
    for kw in (dict(loss_mode="gpg", loss_agg_mode="token-sum", dp_size=3), dict(loss_mode="dppo_kl", clip_ratio_high=1.5),
               dict(loss_mode="vanilla", dro_beta=0.3), dict(loss_mode="vanilla", clip_ratio=0.2, clip_ratio_c=1.1)):
        out, grad = vc.ours(logits, ids, adv, mask, old_logps=old, **kw)
        assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    a, ga = vc.ours(logits, ids, adv, mask, old_logps=old, loss_mode="vanilla", dro_beta=0.3)
    b, gb = vc.ours(logits, ids, adv, mask, old_logps=old, loss_mode="vanilla")
    assert torch.equal(a.loss, b.loss) and torch.equal(ga, gb)
    out, grad = vc.ours(logits, ids, adv, mask, old_logps=old, loss_mode="vanilla", clip_ratio=0.2, clip_ratio_c=1.1)
    loss64, grad64 = vc.expected(logits, ids, mask, adv, old=old, loss_mode="vanilla", clip_ratio_c=1.1)
    vc.check(out.loss, grad, loss64, grad64)


# --------------------------------------------------------------------------------------------------
# clip_cov and kl_cov: their selections without data-dependent shapes (torch.compile(fullgraph=True)),
# the values those of the float64 spec; clip_cov's random choice a uniform subset of its candidates
# --------------------------------------------------------------------------------------------------
@pytest.mark.timeout(600)
@pytest.mark.parametrize("loss_mode, kw", [("kl_cov", dict(kl_cov_ratio=0.3, ppo_kl_coef=0.7)),
                                           ("clip_cov", dict(clip_cov_ratio=0.25, clip_cov_lb=-1e9, clip_cov_ub=1e9))])
def test_cov_modes_trace_whole_and_give_the_eager_values(loss_mode, kw):
    torch._dynamo.reset()
    logits, ids, mask, old, _, _, adv = batch(5000 + len(loss_mode))
    x = logits.clone().requires_grad_()
    fn = lambda x: gk.grpo_loss(x, ids, adv, mask, old_logps=old, loss_mode=loss_mode, backend="torch", **kw).loss  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break raises
    torch.manual_seed(3)
    loss_c = compiled(x)
    (grad_c,) = torch.autograd.grad(loss_c, x)
    torch.manual_seed(3)  # (clip_cov's draw: the same stream)
    loss_e = fn(x)
    (grad_e,) = torch.autograd.grad(loss_e, x)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad_c, grad_e, rtol=1e-5, atol=1e-7)
    if loss_mode == "kl_cov":
        loss64, grad64 = expected(lambda lp, en, m: verl64(lp, en, torch.where(m != 0, adv.double(), 0.0), m, old=old,
                                                           loss_mode="kl_cov", **kw), logits, ids, mask)
        check(gk.grpo_loss(x, ids, adv, mask, old_logps=old, loss_mode=loss_mode, backend="torch", **kw),
              grad_e, loss64, grad64)


def test_clip_cov_drops_a_uniform_subset_of_its_candidates():
    """verl draws ``max(int(ratio * sum(mask)), 1)`` of the candidate tokens uniformly (a randperm); here one
    random key per position: every draw drops that many candidates and nothing else, and over many draws
    each candidate about equally often."""
    g = torch.Generator().manual_seed(5100)
    b, t = 4, 8
    logp = torch.randn(b, t, generator=g) * 0.5 - 2
    old = logp + 0.3 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, t, generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.25).float()

    def dropped(ratio: float) -> torch.Tensor:
        options = GRPOOptions(loss_mode="clip_cov", clip_cov_ratio=ratio, clip_cov_lb=-1e9, clip_cov_ub=1e9)
        inputs = objective.PolicyInputs(logp, old, adv, mask, objective.Sequences(mask, None), None, options)
        return loss_modes.find(None, "clip_cov").policy_term(inputs).high

    candidates = dropped(1e9)  # every candidate: the valid tokens the clip leaves alone
    assert 4 < int(candidates.sum()) < int(mask.sum())
    n = max(int(0.1 * float(mask.sum())), 1)
    torch.manual_seed(0)
    draws, counts = 400, torch.zeros(b, t)
    for _ in range(draws):
        d = dropped(0.1)
        assert int(d.sum()) == n and not (d & ~candidates).any()
        counts += d.float()
    share = counts[candidates] / draws
    assert (share - n / int(candidates.sum())).abs().max() < 0.12, share


@pytest.mark.parametrize("mode", ROLLOUT_CORRECTIONS)
def test_a_rollout_correction_is_token_local_given_old_logps(mode):
    """The correction's weights are constants given old_logps (every mode); without them a sequence's
    weight reads its tokens' current log-probs; the options alone do not say, so a sequence mode is not."""
    logits, ids, mask, old, _, rollout, _ = batch(960)
    options = GRPOOptions(loss_type="dapo", rollout_correction=mode)
    with_old, without = GRPOInputs(old_logps=old, rollout_logps=rollout), GRPOInputs(rollout_logps=rollout)
    sequence = mode.startswith("sequence")
    assert objective.is_token_local(options, with_old)
    assert objective.is_token_local(options, without) == objective.is_token_local(options) == (not sequence)
    weights = objective.constant_rollout_weights(with_old, mask, options, objective.Sequences(mask, None))
    logp = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
    assert torch.equal(weights, objective.rollout_correction(logp, old, rollout, mask, options,
                                                             objective.Sequences(mask, None))[0])
    assert weights.shape == ((B, 1) if sequence else (B, T))
    assert objective.constant_rollout_weights(without, mask, options, objective.Sequences(mask, None)) is None
