"""Triton GRPO epilogue: the token-level GRPO loss in the log-prob pass (``grpo_loss_fwd_kernel``).

The row's log-prob and entropy come from the plain rows' device functions (``triton_row_stats``);
then the policy term of the loss mode, picked by its epilogue id (``OBJECTIVE``: the registered
mode's ``loss_modes.LossMode.epilogue``, with ``CLAMP_LOG_RATIO`` its ``clamps_log_ratio``), the KL
estimate and the entropy bonus, each with its derivative written beside it. A new fused mode is a new
``OBJECTIVE`` branch here and its id in its registry entry; ``tests/test_triton_rows.py`` checks each
branch against autograd of the mode's policy term. Launched by ``triton_rows.grpo_forward_rows``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_row_stats import logprob_row, row_factor, store_masked_row


@triton.jit
def grpo_loss_fwd_kernel(
    logits_ptr, stride_b, stride_t, T,
    targets_ptr, advantages_ptr, weights_ptr, kl_weights_ptr, old_logps_ptr, ref_logps_ptr, is_ratio_ptr,
    logp_ptr, entropy_ptr, max_ptr, log_sum_ptr, loss_ptr, coef_logp_ptr, coef_entropy_ptr, kl_ptr, clip_ptr,
    part_m_ptr, part_s_ptr, part_u_ptr, num_splits,
    V, c, c_ln, cap_k, cap, ignore_index, eps_low, eps_high, delta, beta, entropy_coef, sapo_tau_pos, sapo_tau_neg,
    dro_beta, t_rows_ptr,
    BLOCK_V: tl.constexpr, VEC: tl.constexpr, SPLIT: tl.constexpr, SPLITS_PAD: tl.constexpr, PER_ROW_T: tl.constexpr,
    HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr, HAS_IS_RATIO: tl.constexpr, SOFTCAP: tl.constexpr,
    OBJECTIVE: tl.constexpr, BIAS_CORRECTED_KL: tl.constexpr, CLAMP_LOG_RATIO: tl.constexpr,
    KL_ESTIMATOR: tl.constexpr, KL_STRAIGHT_THROUGH: tl.constexpr, KL_WEIGHTED_APART: tl.constexpr,
):
    """The token-level GRPO loss in the same pass as the log-prob.

    Per row: log-prob and entropy, then ratio, the policy term of ``OBJECTIVE`` (TRL's: 0 PPO's
    clipped surrogate, 1 cispo, 2 sapo (also verl's); verl's: 3 vanilla (dual clip), 4 gpg, 5 cispo,
    6 dppo_tv, 7 dppo_kl, 8 dro), the KL estimate of ``KL_ESTIMATOR`` (0 TRL's k3, times the ratio when
    ``BIAS_CORRECTED_KL``; verl's 1 k1, 2 abs, 3 k2, 4 low_var_kl with its clamps; k2's gradient
    when ``KL_STRAIGHT_THROUGH``, verl's "+") and the entropy bonus, times the token's weight in the
    reduction (``objective.token_weights``; the KL times ``kl_weights`` instead when
    ``KL_WEIGHTED_APART``: verl's sapo reduces its policy term by seq-mean-token-mean, the KL by
    loss_agg_mode). ``CLAMP_LOG_RATIO``: verl's clamp of ``logp - old`` to [-20, 20] before the exp.
    Writes the weighted loss (summed by the caller) and ``d loss / d logp`` and ``d loss / d entropy``,
    which the backward kernel scales by the incoming gradient, and what the metrics need: the KL (0
    without reference log-probs) and the clip region (-1 low, +1 high: TRL's ``clip_flags``, ratio <
    1 - eps_low with A < 0 / ratio > 1 + eps_high with A > 0 (cispo: ratio > eps_high); under verl
    the objective's ``low`` / ``high`` flags, those of actor/pg_clipfrac_lower / actor/pg_clipfrac).
    This is the one hand-differentiated copy of ``objective.per_token_loss`` and the flags; each term
    carries its derivative beside it, and ``tests/test_objective.py`` checks them against autograd.
    """
    row = tl.program_id(0).to(tl.int64)
    c = row_factor(c, t_rows_ptr, row, 0, PER_ROW_T)
    c_ln = row_factor(c_ln, t_rows_ptr, row, 1, PER_ROW_T)
    target = tl.load(targets_ptr + row).to(tl.int64)
    if target == ignore_index:
        store_masked_row(row, logp_ptr, entropy_ptr, max_ptr, log_sum_ptr, True)
        tl.store(loss_ptr + row, 0.0)
        tl.store(coef_logp_ptr + row, 0.0)
        tl.store(coef_entropy_ptr + row, 0.0)
        tl.store(kl_ptr + row, 0.0)
        tl.store(clip_ptr + row, tl.zeros((), tl.int8))
    else:
        logp, entropy = logprob_row(logits_ptr, stride_b, stride_t, T, row, target, logp_ptr, entropy_ptr, max_ptr,
                                     log_sum_ptr, part_m_ptr, part_s_ptr, part_u_ptr, num_splits, V, c, c_ln, cap_k, cap,
                                     BLOCK_V, VEC, True, SPLIT, SPLITS_PAD, SOFTCAP)

        adv = tl.load(advantages_ptr + row)
        weight = tl.load(weights_ptr + row)
        if HAS_OLD:
            old = tl.load(old_logps_ptr + row)
        else:
            old = logp  # on-policy: old = sg(logp), so logp - old is 0 with gradient 1; NaN stays NaN
        if CLAMP_LOG_RATIO:
            # ratio = exp(clamp(logp - old, -20, 20)); d ratio / d logp = ratio inside the closed range
            # (a clamp passes the gradient there, as torch.clamp), 0 outside
            log_ratio = logp - old
            ratio = tl.exp(tl.minimum(tl.maximum(log_ratio, -20.0), 20.0))
            d_ratio = tl.where((log_ratio >= -20.0) & (log_ratio <= 20.0), ratio, 0.0)
        else:
            # ratio = exp(logp - old); d ratio / d logp = ratio.
            ratio = tl.exp(logp - old)
            d_ratio = ratio
        if OBJECTIVE == 0:  # PPO's clipped surrogate (grpo, bnpo, dr_grpo, dapo, luspo)
            unclipped = tl.minimum(ratio, delta)  # delta = +inf when unset
            clipped = tl.minimum(tl.maximum(ratio, 1.0 - eps_low), 1.0 + eps_high)
            t1 = unclipped * adv
            t2 = clipped * adv
            # surrogate = -min(t1, t2). d t1 / d ratio = adv inside ratio <= delta (a clamp passes the
            # gradient inside its closed range), d t2 / d ratio = adv inside [1 - eps_low, 1 + eps_high];
            # torch.minimum splits the gradient evenly on a tie (the usual case, inside the clip range).
            d1 = tl.where(ratio <= delta, adv, 0.0)
            d2 = tl.where((ratio >= 1.0 - eps_low) & (ratio <= 1.0 + eps_high), adv, 0.0)
            d_min = tl.where(t1 < t2, d1, tl.where(t2 < t1, d2, 0.5 * (d1 + d2)))
            loss = -tl.minimum(t1, t2)
            # d surrogate / d logp = -(d min / d ratio) * (d ratio / d logp) = -d_min * ratio
            d_logp = -d_min * d_ratio
            low = (ratio < 1.0 - eps_low) & (adv < 0.0)
            high = (ratio > 1.0 + eps_high) & (adv > 0.0)
        elif OBJECTIVE == 1:  # cispo: -sg(min(ratio, eps_high)) * A * logp
            weight_is = tl.minimum(ratio, eps_high)
            loss = -weight_is * adv * logp
            # the capped ratio is detached: d / d logp = -min(ratio, eps_high) * A
            d_logp = -weight_is * adv
            low = ratio != ratio  # False (NaN-safe shape): cispo has no lower clip
            high = (ratio > eps_high) & (adv > 0.0)
        elif OBJECTIVE == 2:  # sapo: -(4 / tau) * sigmoid(tau (ratio - 1)) * A, tau by the sign of A
            tau = tl.where(adv > 0.0, sapo_tau_pos, sapo_tau_neg)
            gate = 1.0 / (1.0 + tl.exp(-tau * (ratio - 1.0)))
            loss = -(4.0 / tau) * gate * adv
            # d sigmoid(y) / dy = gate (1 - gate), dy / d logp = tau * d ratio / d logp:
            # d / d logp = -(4 / tau) * gate (1 - gate) * tau * d_ratio * A = -4 gate (1 - gate) d_ratio A
            d_logp = -4.0 * gate * (1.0 - gate) * d_ratio * adv
            low = ratio != ratio
            high = ratio != ratio
        elif OBJECTIVE == 3:  # verl vanilla: max(-A r, -A clip(r)), and where A < 0 at most -A delta
            loss1 = -adv * ratio
            clipped = tl.minimum(tl.maximum(ratio, 1.0 - eps_low), 1.0 + eps_high)
            loss2 = -adv * clipped
            # d loss1 / d logp = -A d_ratio; d loss2 / d logp = -A d_ratio inside [1 - eps_low, 1 + eps_high]
            d_loss1 = -adv * d_ratio
            d_loss2 = tl.where((ratio >= 1.0 - eps_low) & (ratio <= 1.0 + eps_high), d_loss1, 0.0)
            clip1 = tl.maximum(loss1, loss2)
            # torch.maximum: the larger one's gradient, half each on a tie
            d_clip1 = tl.where(loss1 > loss2, d_loss1, tl.where(loss2 > loss1, d_loss2, 0.5 * (d_loss1 + d_loss2)))
            loss3 = -adv * delta  # a constant: d / d logp = 0
            # min(loss3, clip1) where A < 0: clip1's gradient where it is the smaller, half on a tie
            d_dual = tl.where(clip1 < loss3, d_clip1, tl.where(loss3 < clip1, 0.0, 0.5 * d_clip1))
            loss = tl.where(adv < 0.0, tl.minimum(loss3, clip1), clip1)
            d_logp = tl.where(adv < 0.0, d_dual, d_clip1)
            low = (clip1 > loss3) & (adv < 0.0)
            high = loss2 > loss1
        elif OBJECTIVE == 4:  # verl gpg: -logp A; d / d logp = -A
            loss = -logp * adv
            d_logp = -adv
            low = ratio != ratio
            high = ratio != ratio
        elif OBJECTIVE == 5:  # verl cispo: -sg(clip(r, 1 - eps_low, 1 + eps_high)) A logp
            clipped = tl.minimum(tl.maximum(ratio, 1.0 - eps_low), 1.0 + eps_high)
            loss = -clipped * adv * logp
            # the clipped ratio is detached: d / d logp = -clip(r) A
            d_logp = -clipped * adv
            low = ratio != ratio
            high = ratio != clipped
        elif OBJECTIVE == 8:  # verl dro: -(logp A - dro_beta / 2 (logp - old)^2), no clamp
            log_ratio = logp - old
            loss = -(logp * adv - 0.5 * dro_beta * log_ratio * log_ratio)
            # d / d logp = -A + dro_beta (logp - old)   (old is a constant; on-policy log_ratio = 0)
            d_logp = -adv + dro_beta * log_ratio
            low = ratio != ratio
            high = ratio != ratio
        else:  # DPPO (6: binary TV, 7: binary KL): -A sg(min(r, delta)) logp v, v the detached trust mask
            p = tl.exp(logp)
            p_old = tl.exp(old)
            if OBJECTIVE == 6:  # the probability moved at most eps_high up (A > 0) / eps_low down (A <= 0)
                trusted = tl.where(adv > 0.0, p - p_old <= eps_high, p - p_old >= -eps_low)
            else:  # the binary KL of (p_old, 1 - p_old) to (p, 1 - p) within the threshold, or a move
                # against the advantage's direction
                binary_kl = p_old * (old - logp) + (1.0 - p_old) * tl.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
                trusted = tl.where(adv > 0.0, (binary_kl <= eps_high) | (p <= p_old),
                                   (binary_kl <= eps_low) | (p >= p_old))
            truncated = tl.minimum(ratio, delta)
            v = tl.where(trusted, 1.0, 0.0)
            loss = -adv * truncated * logp * v
            # truncated and v are detached: d / d logp = -A min(r, delta) v
            d_logp = -adv * truncated * v
            low = (ratio > delta) & trusted
            high = v == 0.0
        if HAS_IS_RATIO:
            # loss * is_ratio (a detached weight): d / d logp scales by the same is_ratio
            is_ratio = tl.load(is_ratio_ptr + row)
            loss = loss * is_ratio
            d_logp = d_logp * is_ratio
        kl = 0.0
        d_kl = 0.0
        if HAS_REF:
            ref = tl.load(ref_logps_ptr + row)
            if KL_ESTIMATOR == 0:  # TRL's k3, unclamped
                # k3 = exp(diff) - diff - 1 with diff = ref - logp;
                # d k3 / d logp = -(exp(diff) - 1) = 1 - exp(diff)
                diff = ref - logp
                exp_diff = tl.exp(diff)
                kl = exp_diff - diff - 1.0
                if BIAS_CORRECTED_KL:
                    # kl * ratio: d / d logp = (1 - exp(diff)) * ratio + kl * ratio = -diff * ratio
                    d_kl = -diff * ratio
                    kl = kl * ratio
                else:
                    d_kl = 1.0 - exp_diff
            elif KL_ESTIMATOR == 1:  # k1 = logp - ref; d / d logp = 1
                kl = logp - ref
                d_kl = 1.0
            elif KL_ESTIMATOR == 2:  # abs = |logp - ref|; d / d logp = sign(logp - ref) (0 at 0, as torch)
                x = logp - ref
                kl = tl.abs(x)
                d_kl = tl.where(x > 0.0, 1.0, tl.where(x < 0.0, -1.0, 0.0))
            elif KL_ESTIMATOR == 3:  # k2 = (logp - ref)^2 / 2; d / d logp = logp - ref
                x = logp - ref
                kl = 0.5 * x * x
                d_kl = x
            else:  # low_var_kl: clamp(exp(d) - d - 1, -10, 10), d = clamp(ref - logp, -20, 20)
                diff = ref - logp
                d_c = tl.minimum(tl.maximum(diff, -20.0), 20.0)
                exp_diff = tl.exp(d_c)
                k3 = exp_diff - d_c - 1.0
                kl = tl.minimum(tl.maximum(k3, -10.0), 10.0)
                # d / d logp = (1 - exp(d)) inside both clamps' closed ranges, 0 outside
                inside = (diff >= -20.0) & (diff <= 20.0) & (k3 >= -10.0) & (k3 <= 10.0)
                d_kl = tl.where(inside, 1.0 - exp_diff, 0.0)
            if KL_STRAIGHT_THROUGH:  # verl's "+": the value above, the gradient of k2: logp - ref
                d_kl = logp - ref
        if KL_WEIGHTED_APART:  # (HAS_REF is on: the launcher passes kl_weights only then)
            # entropy bonus -entropy_coef * H: d / d logp = 0, d / d H = -entropy_coef
            loss -= entropy_coef * entropy
            kl_weight = tl.load(kl_weights_ptr + row)
            tl.store(loss_ptr + row, loss * weight + beta * kl * kl_weight)
            tl.store(coef_logp_ptr + row, d_logp * weight + beta * d_kl * kl_weight)
        else:
            if HAS_REF:
                loss += beta * kl
                d_logp += beta * d_kl
            # entropy bonus -entropy_coef * H: d / d logp = 0, d / d H = -entropy_coef
            loss -= entropy_coef * entropy
            tl.store(loss_ptr + row, loss * weight)
            tl.store(coef_logp_ptr + row, d_logp * weight)
        tl.store(coef_entropy_ptr + row, -entropy_coef * weight)
        tl.store(kl_ptr + row, kl)
        tl.store(clip_ptr + row, (high.to(tl.int8) - low.to(tl.int8)).to(tl.int8))
