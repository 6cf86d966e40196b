"""An independent float64 statement of ../shared/API.md, written for the tests.

It shares no code with ``grpo_kernels``: the reductions are spelled out per sequence, the entropy
comes from ``lse - sum p*z`` rather than ``-sum p log p``, and everything runs in float64 so its own
rounding is far below any tolerance we check. Gradients come from float64 autograd through it.
"""

from __future__ import annotations

from typing import Optional

import torch


def logprobs64(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, ignore_index: int = -100):
    """(logp, entropy) float64 [...]; 0 where the target is ignore_index."""
    z = logits.double() / temperature
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
    logprobs=None,
):
    """(loss, per-token logp, metrics) in float64, from logits [B, T, V] (or precomputed (logp, H))."""
    b, t = ids.shape
    m = torch.ones(b, t, dtype=torch.float64) if mask is None else mask.double()
    m = m * (ids != -100).double()
    ids = torch.where(m != 0, ids, -100)
    logp, ent = logprobs64(logits, ids, temperature) if logprobs is None else logprobs
    eps_high = eps_low if eps_high is None else eps_high
    adv = advantages.double()
    adv = adv[:, None].expand(b, t) if adv.dim() == 1 else adv
    old = logp.detach() if old_logps is None else old_logps.double()
    if importance_sampling_level == "sequence":
        lengths = m.sum(1).clamp(min=1)
        seq = ((logp - old) * m).sum(1) / lengths
        log_ratio = seq[:, None].expand(b, t)
    else:
        log_ratio = logp - old
    ratio = torch.exp(log_ratio)
    r1 = torch.minimum(ratio, torch.tensor(float(delta), dtype=torch.float64)) if delta is not None else ratio
    r2 = ratio.clamp(1 - eps_low, 1 + eps_high)
    pg = -torch.minimum(r1 * adv, r2 * adv)
    if is_ratio is not None:
        pg = pg * is_ratio.double().expand(b, t)
    loss_t = pg
    kl = None
    if ref_logps is not None:
        d = ref_logps.double() - logp
        kl = torch.exp(d) - d - 1
        loss_t = loss_t + beta * kl
    loss_t = loss_t - entropy_coef * ent

    total = (loss_t * m).sum()
    if loss_type == "grpo":
        per_seq = [(loss_t[i] * m[i]).sum() / max(m[i].sum().item(), 1.0) for i in range(b)]
        loss = torch.stack(per_seq).mean()
    elif loss_type == "bnpo":
        loss = total / max(m.sum().item(), 1.0)
    elif loss_type == "dr_grpo":
        loss = total / (b * (t if max_completion_length is None else max_completion_length))
    else:
        n = max(m.sum().item(), 1.0) if num_items_in_batch is None else float(num_items_in_batch)
        loss = total / n

    count = max(m.sum().item(), 1.0)
    low = ((ratio < 1 - eps_low) & (adv < 0)).double()
    high = ((ratio > 1 + eps_high) & (adv > 0)).double()
    metrics = {
        "entropy": (ent * m).sum() / count,
        "clip_ratio/low_mean": (low * m).sum() / count,
        "clip_ratio/high_mean": (high * m).sum() / count,
        "clip_ratio/region_mean": (torch.maximum(low, high) * m).sum() / count,
    }
    if kl is not None:
        metrics["kl"] = (kl * m).sum() / count
    return loss, logp * (m != 0), {k: v.detach() for k, v in metrics.items()}
