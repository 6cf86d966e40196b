"""An independent float64 statement of docs/api.md (the loss contract), written for the tests.

It shares no code with ``grpo_kernels``: the reductions are spelled out per sequence, the entropy
comes from ``lse - sum p*z`` rather than ``-sum p log p``, and everything runs in float64 so its own
rounding is far below any tolerance we check. Gradients come from float64 autograd through it.
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def logprobs64(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, ignore_index: int = -100,
               softcap=None, logit_scale: float = 1.0):
    """(logp, entropy) float64 [...]; 0 where the target is ignore_index.

    The softmax sees ``softcap * tanh(logit_scale * logits / softcap) / temperature``."""
    z = logits.double() * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    valid = targets != ignore_index
    index = torch.where(valid, targets, 0).long()
    logp = z.gather(-1, index.unsqueeze(-1)).squeeze(-1) - lse
    p = torch.softmax(z, dim=-1)
    # sum p*z with 0 * -inf counted as 0
    pz = torch.where(p > 0, p * torch.where(torch.isinf(z), 0.0, z), p * 0.0)
    entropy = lse - pz.sum(-1)
    zero = torch.zeros((), dtype=torch.float64)
    return torch.where(valid, logp, zero), torch.where(valid, entropy, zero)


def sequences64(m: torch.Tensor, segment_ids=None):
    """The sequences of a [B, T] batch as lists of (b, t) positions: rows, or the distinct (row, id)
    among the mask-1 positions of packed rows."""
    b, t = m.shape
    if segment_ids is None:
        return [[(i, j) for j in range(t)] for i in range(b)]
    groups = {}
    for i in range(b):
        for j in range(t):
            if m[i, j] != 0:
                groups.setdefault((i, int(segment_ids[i, j])), []).append((i, j))
    return [groups[k] for k in sorted(groups)]


def grpo64(
    logits: torch.Tensor,
    ids: torch.Tensor,
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    *,
    old_logps=None,
    ref_logps=None,
    beta=0.0,
    eps_low=0.2,
    eps_high=None,
    delta=None,
    temperature=1.0,
    loss_type="dapo",
    max_completion_length=None,
    num_items_in_batch=None,
    importance_sampling_level="token",
    is_ratio=None,
    entropy_coef=0.0,
    use_bias_correction_kl=False,
    sapo_temperature_pos=1.0,
    sapo_temperature_neg=1.05,
    vespo_k_pos=2.0,
    vespo_lambda_pos=3.0,
    vespo_k_neg=3.0,
    vespo_lambda_neg=2.0,
    segment_ids=None,
    softcap=None,
    logit_scale=1.0,
    logprobs=None,
    top_entropy_quantile=1.0,
    off_policy_mask_threshold=None,
    rollout_logps=None,
    rollout_correction=None,
    rollout_correction_max=3.0,
    rollout_correction_min=None,
):
    """(loss, per-token logp, metrics) in float64, from logits [B, T, V] (or precomputed (logp, H)).

    Loops over sequences, as TRL's GRPOTrainer._compute_loss (trl 1.16) states each objective."""
    b, t = ids.shape
    m = torch.ones(b, t, dtype=torch.float64) if mask is None else mask.double()
    m = m * (ids != -100).double()
    ids = torch.where(m != 0, ids, -100)
    logp, ent = logprobs64(logits, ids, temperature, softcap=softcap, logit_scale=logit_scale) if logprobs is None else logprobs
    eps_high = eps_low if eps_high is None else eps_high
    adv = advantages.double()
    adv = adv[:, None].expand(b, t) if adv.dim() == 1 else adv
    adv = torch.where(m != 0, adv, 0.0)
    old = logp.detach() if old_logps is None else torch.where(m != 0, old_logps.double(), logp.detach())
    seqs = sequences64(m, segment_ids)
    token_log_ratio = logp - old
    if importance_sampling_level == "sequence":
        log_ratio = torch.zeros(b, t, dtype=torch.float64)
        for s in seqs:
            i, j = zip(*s)
            mean = (token_log_ratio[i, j] * m[i, j]).sum() / max(m[i, j].sum().item(), 1.0)
            log_ratio = log_ratio.index_put((torch.tensor(i), torch.tensor(j)), mean.expand(len(s)))
    else:
        log_ratio = token_log_ratio
    ratio = torch.exp(log_ratio)
    if rollout_correction is not None:  # TRL's vLLM importance sampling, old defaulting to the current
        is_ratio = trl_is_ratio64(old, rollout_logps, m, rollout_correction, rollout_correction_max,
                                  rollout_correction_min)
    w_is = None
    if is_ratio is not None:
        w_is = torch.where(m != 0, is_ratio.double().expand(b, t), 1.0)
    policy_mask = torch.ones(b, t, dtype=torch.float64)
    if off_policy_mask_threshold is not None:
        sampling = rollout_logps if rollout_logps is not None else (old_logps if old_logps is not None else logp.detach())
        sampling = torch.where(m != 0, sampling.double(), 0.0)
        policy_mask = policy_mask * trl_off_policy_mask64(adv, logp, sampling, m, off_policy_mask_threshold)
    entropy_mask = None
    if top_entropy_quantile < 1.0:
        entropy_mask = trl_entropy_mask64(ent, m, top_entropy_quantile)
        policy_mask = policy_mask * entropy_mask
    extra = {}
    if loss_type == "cispo":
        pg = -torch.clamp(ratio, max=eps_high).detach() * adv * logp
    elif loss_type == "sapo":
        tau = torch.where(adv > 0, sapo_temperature_pos, sapo_temperature_neg).double()
        pg = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv
    elif loss_type == "vespo":
        phi = torch.zeros(b, t, dtype=torch.float64)
        for s in seqs:
            i, j = zip(*s)
            lw = (token_log_ratio[i, j].detach().clamp(-20, 20) * m[i, j]).sum()
            if is_ratio is not None and is_ratio.shape[-1] == 1:  # one ratio per sequence: counted once
                lw = lw + torch.log(is_ratio.double()[i[0], 0]).clamp(math.log(1e-8), 20)
            elif is_ratio is not None:  # TRL sums the token log-ratios of the rollout engine
                lw = lw + (torch.log(w_is[i, j]).clamp(math.log(1e-8), 20) * m[i, j]).sum()
            lw = lw.clamp(math.log(1e-8), 20)
            for (ii, jj) in s:
                k = vespo_k_pos if adv[ii, jj] >= 0 else vespo_k_neg
                lam = vespo_lambda_pos if adv[ii, jj] >= 0 else vespo_lambda_neg
                phi[ii, jj] = math.exp(lam + k * lw.item() - lam * math.exp(lw.item()))
        extra["phi"] = phi
        pg = -phi * adv * logp
    else:
        r1 = torch.minimum(ratio, torch.tensor(float(delta), dtype=torch.float64)) if delta is not None else ratio
        r2 = ratio.clamp(1 - eps_low, 1 + eps_high)
        pg = -torch.minimum(r1 * adv, r2 * adv)
    pg = pg * policy_mask
    if w_is is not None and loss_type != "vespo":
        pg = pg * w_is
    loss_t = pg
    kl = None
    if ref_logps is not None:
        d = torch.where(m != 0, ref_logps.double(), 0.0) - logp
        kl = torch.exp(d) - d - 1
        if use_bias_correction_kl:
            kl = kl * ratio
        loss_t = loss_t + beta * kl

    total = (loss_t * m).sum()
    n_seq = max(len(seqs), 1)
    if loss_type in ("grpo", "sapo"):
        per_seq = []
        for s in seqs:
            i, j = zip(*s)
            per_seq.append((loss_t[i, j] * m[i, j]).sum() / max(m[i, j].sum().item(), 1.0))
        loss = torch.stack(per_seq).sum() / n_seq if per_seq else total * 0
    elif loss_type == "bnpo":
        loss = total / max(m.sum().item(), 1.0)
    elif loss_type == "dr_grpo":
        loss = total / (n_seq * (t if max_completion_length is None else max_completion_length))
    elif loss_type == "luspo":
        loss = total / n_seq
    else:
        n = max(m.sum().item(), 1.0) if num_items_in_batch is None else float(num_items_in_batch)
        loss = total / n
    if entropy_coef != 0:  # TRL 1.16: the bonus is the token mean of the entropy, for every loss type
        em = m if entropy_mask is None else m * entropy_mask
        loss = loss - entropy_coef * (ent * em).sum() / max(em.sum().item(), 1.0)

    count = max(m.sum().item(), 1.0)
    metrics = {"entropy": (ent * m).sum() / count}
    if kl is not None:
        metrics["kl"] = (kl * m).sum() / count

    def fractions(flag):
        out = []
        for s in seqs:
            i, j = zip(*s)
            n_tok = m[i, j].sum().item()
            out.append((flag[i, j] * m[i, j]).sum().item() / n_tok if n_tok else float("nan"))
        return torch.tensor(out, dtype=torch.float64)

    def clip_mean(flag):
        if importance_sampling_level == "sequence":
            return fractions(flag).nan_to_num(0.0).sum() / n_seq
        return (flag * m).sum() / count

    if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        low = ((ratio < 1 - eps_low) & (adv < 0)).double()
        high = ((ratio > 1 + eps_high) & (adv > 0)).double()
        metrics["clip_ratio/low_mean"] = clip_mean(low)
        metrics["clip_ratio/high_mean"] = clip_mean(high)
        metrics["clip_ratio/region_mean"] = clip_mean(torch.maximum(low, high))
        low_f, high_f = fractions(low), fractions(high)
        if importance_sampling_level == "sequence" and segment_ids is None:
            low_f, high_f = low_f.nan_to_num(0.0), high_f.nan_to_num(0.0)
        low_f, high_f = low_f[~torch.isnan(low_f)], high_f[~torch.isnan(high_f)]
        metrics["clip_ratio/low_min"] = low_f.min() if low_f.numel() else torch.tensor(float("nan"))
        metrics["clip_ratio/high_max"] = high_f.max() if high_f.numel() else torch.tensor(float("nan"))
    elif loss_type == "cispo":
        metrics["cispo_clip_ratio"] = clip_mean(((ratio > eps_high) & (adv > 0)).double())
    elif loss_type == "vespo":
        if advantages.dim() == 1 and segment_ids is None:  # one weight per row, TRL's row mean
            # (an empty row: w = 1, so phi = 1; otherwise any of its valid positions holds the row's phi)
            metrics["vespo/phi_seq_mean"] = torch.stack([
                extra["phi"][i][m[i] != 0][0] if m[i].sum() else torch.tensor(1.0, dtype=torch.float64) for i in range(b)
            ]).mean()
        else:
            metrics["vespo/phi_seq_mean"] = (extra["phi"] * m).sum() / count
    return loss, logp * (m != 0), {k: v.detach() for k, v in metrics.items()}


# ------------------------------------------------------------------------------------------------------
# verl 0.9.1 (verl.trainer.ppo.core_algos: compute_policy_loss_*, agg_loss, kl_penalty; workers'
# ppo_loss), restated in float64 over [B, T] tensors, row by row where verl reduces rows. 0.9.1 reduces
# gspo's policy term by loss_agg_mode (0.9.0: always seq-mean-token-mean); sapo keeps seq-mean-token-mean.
# ------------------------------------------------------------------------------------------------------
def verl_agg64(mat, m, mode, dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None):
    rows = [(mat[i] * m[i]).sum() for i in range(m.shape[0])]
    lengths = [m[i].sum() for i in range(m.shape[0])]
    with_tokens = sum(1 for n in lengths if n > 0)
    if mode == "token-mean":
        n = m.sum() if batch_num_tokens is None else batch_num_tokens
        return sum(rows) / max(float(n), 1.0) * dp_size
    if mode == "token-sum":
        return sum(rows) * dp_size
    g = max(with_tokens, 1) if global_batch_size is None else global_batch_size
    if mode == "seq-mean-token-sum":
        return sum(r for r, n in zip(rows, lengths) if n > 0) / g * dp_size
    if mode == "seq-mean-token-mean":
        return sum(r / (n + 1e-8) for r, n in zip(rows, lengths) if n > 0) / g * dp_size
    if mode == "seq-mean-token-sum-norm":  # 0.9: the seq-mean-token-sum, then / loss_scale_factor
        seq_mean = sum(r for r, n in zip(rows, lengths) if n > 0) / g * dp_size
        return seq_mean / (m.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    raise ValueError(mode)


def verl_kl64(logp, ref, kind):
    base = kind.rstrip("+")
    if base in ("kl", "k1"):
        value = logp - ref
    elif base == "abs":
        value = (logp - ref).abs()
    elif base in ("mse", "k2"):
        value = 0.5 * (logp - ref) ** 2
    else:
        d = (ref - logp).clamp(-20, 20)
        value = (torch.exp(d) - d - 1).clamp(-10, 10)
    if kind.endswith("+") and base not in ("mse", "k2"):
        k2 = 0.5 * (logp - ref) ** 2
        value = k2 - k2.detach() + value.detach()
    return value


def verl64(logp, ent, adv, m, *, old=None, ref=None, loss_mode="vanilla", loss_agg_mode="token-mean",
           kl_loss_type="low_var_kl", beta=0.0, entropy_coef=0.0, eps_low=0.2, eps_high=None, clip_ratio_c=3.0,
           tau_pos=1.0, tau_neg=1.05, rollout_is_weights=None, dp_size=1, batch_num_tokens=None,
           global_batch_size=None, loss_scale_factor=None, ppo_kl_coef=1.0, kl_cov_ratio=0.0002, dro_beta=None):
    """verl's ppo_loss in float64 from per-token log-probs ``logp`` [B, T] (differentiable), entropies,
    advantages [B, T]: policy loss by loss_mode, minus entropy_coef * agg(entropy), plus beta * agg(kl)."""
    m = m.double()
    eps_high = eps_low if eps_high is None else eps_high
    old = logp.detach() if old is None else old.double()
    agg = lambda x, mode=loss_agg_mode: verl_agg64(x, m, mode, dp_size, batch_num_tokens, global_batch_size,  # noqa: E731
                                                 loss_scale_factor)
    a = adv.double()
    if loss_mode in ("vanilla", "sapo", "cispo", "dppo_tv", "dppo_kl"):
        ratio = torch.exp((logp - old).clamp(-20, 20))
    if loss_mode == "vanilla":
        l1 = -a * ratio
        l2 = -a * ratio.clamp(1 - eps_low, 1 + eps_high)
        c1 = torch.maximum(l1, l2)
        pg = torch.where(a < 0, torch.minimum(-a * clip_ratio_c, c1), c1)
    elif loss_mode == "gspo":
        seq = torch.stack([((logp[i] - old[i]) * m[i]).sum() / max(m[i].sum().item(), 1.0) for i in range(m.shape[0])])
        r = torch.exp((logp - logp.detach() + seq.detach()[:, None]).clamp(max=10.0))
        pg = torch.maximum(-a * r, -a * r.clamp(1 - eps_low, 1 + eps_high))
    elif loss_mode == "sapo":
        tau = torch.where(a > 0, tau_pos, tau_neg).double()
        pg = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * a
    elif loss_mode == "gpg":
        pg = -logp * a
    elif loss_mode in ("dppo_tv", "dppo_kl"):
        pg = -a * ratio.clamp(max=clip_ratio_c).detach() * logp * dppo_trusted64(logp, old, a, loss_mode, eps_low, eps_high)
    elif loss_mode == "dro":
        pg = -(logp * a - 0.5 * dro_beta * (logp - old) ** 2)
    elif loss_mode == "cispo":
        pg = -ratio.clamp(1 - eps_low, 1 + eps_high).detach() * a * logp
    elif loss_mode == "kl_cov":
        lr = logp - old
        pg = -a * torch.exp(lr)
        valid = [(i, j) for i in range(m.shape[0]) for j in range(m.shape[1]) if m[i, j] > 0]
        if valid:
            av = torch.tensor([a[i, j].item() for i, j in valid], dtype=torch.float64)
            lv = torch.tensor([logp[i, j].item() for i, j in valid], dtype=torch.float64)
            cov = (av - av.mean()) * (lv - lv.mean())
            k = max(1, int(len(valid) * kl_cov_ratio))
            picked = sorted(range(len(valid)), key=lambda q: -cov[q].item())[:k]
            extra = torch.zeros_like(pg)
            for q in picked:
                i, j = valid[q]
                extra = extra.index_put((torch.tensor([i]), torch.tensor([j])), ppo_kl_coef * lr[i, j].abs().reshape(1))
            pg = pg + extra
    elif loss_mode == "geo_mean":
        rows = []
        for i in range(m.shape[0]):
            n = m[i].sum()
            lr = logp[i] - old[i]
            s = torch.sign(a[i])
            clipped = s * torch.minimum(s * lr, s * lr.clamp(-eps_low, eps_high))
            seq_adv = (a[i] * m[i]).sum() / (n + 1e-8)
            loss_i = -seq_adv * torch.exp((clipped * m[i]).sum() / (n + 1e-8))
            if rollout_is_weights is not None:
                loss_i = loss_i * torch.exp((torch.log(rollout_is_weights[i].double() + 1e-10) * m[i]).sum() / (n + 1e-8))
            rows.append(loss_i)
        pg_loss = torch.stack(rows).mean()
    else:
        raise ValueError(loss_mode)
    if loss_mode != "geo_mean":
        if rollout_is_weights is not None:
            pg = pg * rollout_is_weights.double()
        pg_loss = agg(pg, "seq-mean-token-mean" if loss_mode == "sapo" else loss_agg_mode)
    loss = pg_loss
    if entropy_coef != 0:
        loss = loss - entropy_coef * agg(ent)
    if ref is not None and beta != 0:
        loss = loss + beta * agg(verl_kl64(logp, ref.double(), kl_loss_type))
    return loss


def dppo_trusted64(logp, old, a, loss_mode, eps_low, eps_high):
    """DPPO's trust mask, element by element: 1.0 where the token's probability moved less than the
    threshold in the advantage's direction (TV: the probability difference; KL: the binary KL)."""
    logp, old, a = logp.detach(), old.detach(), a.detach()  # a mask: constants of the loss
    out = torch.zeros_like(logp, dtype=torch.float64)
    for i in range(logp.shape[0]):
        for j in range(logp.shape[1]):
            lp, lo, adv = float(logp[i, j]), float(old[i, j]), float(a[i, j])
            p, q = math.exp(lp), math.exp(lo)
            if loss_mode == "dppo_tv":
                ok = (p - q <= eps_high) if adv > 0 else (p - q >= -eps_low)
            else:
                arg = (1 - q + 1e-8) / (1 - p + 1e-8)  # NaN where a "probability" exceeds 1 (compares False)
                bkl = q * (lo - lp) + (1 - q) * math.log(arg) if arg > 0 else float("nan")
                ok = (bkl <= eps_high or p <= q) if adv > 0 else (bkl <= eps_low or p >= q)
            out[i, j] = 1.0 if ok else 0.0
    return out


def verl_policy_metrics64(logp, adv, m, old, loss_mode, eps_low=0.2, eps_high=None, clip_ratio_c=3.0):
    """The policy metrics verl's compute_policy_loss_<loss_mode> returns (masked means, 1e-8 in the
    denominator), for the token-local modes."""
    eps_high = eps_low if eps_high is None else eps_high
    m, a, lp, old = m.double(), adv.double(), logp.detach().double(), old.double()
    mean = lambda v: (v * m).sum() / (m.sum() + 1e-8)  # noqa: E731
    lr = (lp - old).clamp(-20, 20)
    r = torch.exp(lr)
    if loss_mode == "gpg":
        return {}
    if loss_mode == "dro":
        return {"actor/ppo_kl": mean(old - lp)}
    out = {"actor/ppo_kl": mean(-lr)}
    if loss_mode == "vanilla":
        l1, l2 = -a * r, -a * r.clamp(1 - eps_low, 1 + eps_high)
        out["actor/pg_clipfrac"] = mean((l2 > l1).double())
        out["actor/pg_clipfrac_lower"] = mean(((torch.maximum(l1, l2) > -a * clip_ratio_c) & (a < 0)).double())
    elif loss_mode in ("dppo_tv", "dppo_kl"):
        trusted = dppo_trusted64(lp, old, a, loss_mode, eps_low, eps_high)
        out["actor/pg_clipfrac"] = mean(1 - trusted)
        out["actor/pg_clipfrac_lower"] = mean((r > clip_ratio_c).double() * trusted)
    elif loss_mode == "cispo":
        out["actor/pg_clipfrac"] = mean((r != r.clamp(1 - eps_low, 1 + eps_high)).double())
        out["actor/pg_clipfrac_lower"] = torch.zeros((), dtype=torch.float64)
    elif loss_mode == "sapo":
        out["actor/pg_clipfrac"] = out["actor/pg_clipfrac_lower"] = torch.zeros((), dtype=torch.float64)
    return out


# ------------------------------------------------------------------------------------------------------
# TRL 1.16's extra terms (GRPOTrainer._compute_loss / _generate_and_score_completions)
# ------------------------------------------------------------------------------------------------------
def trl_is_ratio64(old, rollout, m, mode, clip_max=3.0, clip_min=None):
    """vllm_importance_sampling_ratio: exp(old - sampling) per token or per row, truncated or masked."""
    diff = torch.nan_to_num((old.double() - rollout.double()) * m.double(), nan=0.0)
    r = torch.exp(diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff)
    if mode.endswith("truncate"):
        return r if clip_min is None and clip_max is None else r.clamp(min=clip_min, max=clip_max)
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    return r.masked_fill((r < lo) | (r > hi), 0.0)


def trl_off_policy_mask64(adv_col, logp, sampling, m, threshold):
    kl = torch.nan_to_num(sampling.double() - logp.detach(), nan=0.0)
    mean = (kl * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1.0)
    return ((adv_col >= 0) | (mean <= threshold)).double()


def trl_entropy_mask64(ent, m, quantile):
    values = ent.detach()[m.bool()]
    if values.numel() == 0:
        return torch.zeros_like(ent)
    thr = torch.quantile(values, 1 - quantile)
    return ((ent.detach() * m >= thr) & m.bool()).double()
