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
    w_is = None
    if is_ratio is not None:
        w_is = torch.where(m != 0, is_ratio.double().expand(b, t), 1.0)
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
        loss = loss - entropy_coef * (ent * m).sum() / max(m.sum().item(), 1.0)

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
