"""The GRPO objective: per-token loss, the reductions as per-token weights, and the metrics.

These O(tokens) functions are the one definition every backend uses once it has the per-token
log-probs and entropies (``reference``, the chunked torch path, the fused-linear path, GSPO). The
one other copy is the Triton epilogue in ``kernels/triton_rows.py`` (``grpo_loss_fwd_kernel``),
which evaluates the same token-level terms inside the log-prob pass together with their derivatives
written out by hand; ``tests/test_objective.py`` checks its ``d loss / d logp`` against autograd of
:func:`per_token_loss`.

Masked positions (mask 0) are never read: every per-token input passes through a select before any
arithmetic, so a NaN or inf there reaches neither the loss, nor a gradient, nor a metric.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from .options import GRPOInputs, GRPOOptions, IGNORE_INDEX


class GRPOLossOutput(NamedTuple):
    loss: torch.Tensor  # 0-d float32, differentiable
    per_token_logps: torch.Tensor  # [B, T] float32, detached; 0 where masked
    metrics: dict  # name -> 0-d detached float32 tensor


def effective_mask(completion_ids: torch.Tensor, completion_mask: Optional[torch.Tensor], ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Float32 [B, T] weights: the completion mask, zero wherever the id is ``ignore_index``."""
    mask = (completion_ids != ignore_index).float()
    if completion_mask is not None:
        mask = torch.where(mask != 0, completion_mask.float(), mask)
    return mask


def masked_ids(completion_ids: torch.Tensor, mask: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Ids with every masked position set to ``ignore_index``, so no backend reads them."""
    return torch.where(mask != 0, completion_ids, torch.full_like(completion_ids, ignore_index))


def _where_valid(mask: torch.Tensor, x: Optional[torch.Tensor], fill: float) -> Optional[torch.Tensor]:
    """``x`` (a constant of the loss: detached, fp32) where the mask is on, ``fill`` elsewhere."""
    if x is None:
        return None
    x = x.detach().float()
    return torch.where(mask != 0, x, torch.full((), fill, dtype=torch.float32, device=x.device))


def per_token_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] or [B, T] advantages -> fp32 [B, 1] or [B, T], 0 where masked (never read there)."""
    adv = advantages.detach().float()
    if adv.dim() == 1:  # one per sequence: kept as a [B, 1] column, read for rows with a valid token
        return _where_valid(mask.amax(-1, keepdim=True), adv.unsqueeze(-1), 0.0)
    return _where_valid(mask, adv, 0.0)


def log_importance_ratio(logp: torch.Tensor, old_logps: Optional[torch.Tensor], mask: torch.Tensor, level: str) -> torch.Tensor:
    """``log(ratio)``: [B, T] per token, or [B, 1] per sequence (GSPO: masked mean of the log-ratio).

    ``old_logps=None`` is on-policy: ``logp - logp.detach()`` (value 0, gradient 1).
    """
    old = logp.detach() if old_logps is None else torch.where(mask != 0, old_logps.detach().float(), logp.detach())
    log_ratio = logp - old
    if level == "sequence":
        return (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return log_ratio


def per_token_loss(
    logp: torch.Tensor, entropy: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    inputs: GRPOInputs, options: GRPOOptions,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The GRPO loss of every token, float32 [B, T] (0-weight where masked), plus ratio and k3 KL.

    ``L = -min(r1*A, clamp(ratio, 1-eps_low, 1+eps_high)*A) * is_ratio + beta*kl - entropy_coef*H``
    with ``r1 = min(ratio, delta)`` when ``delta`` is set and ``kl = exp(ref - logp) - (ref - logp) - 1``
    (Schulman's k3 estimator). ``logp`` and ``entropy`` must be 0 where the mask is 0.
    """
    adv = per_token_advantages(advantages, mask)
    ratio = torch.exp(log_importance_ratio(logp, inputs.old_logps, mask, options.importance_sampling_level))
    clipped = torch.clamp(ratio, 1 - options.eps_low, 1 + options.eps_high)
    unclipped = torch.clamp(ratio, max=options.delta) if options.delta is not None else ratio
    loss = -torch.min(unclipped * adv, clipped * adv)
    if inputs.is_ratio is not None:
        loss = loss * _where_valid(mask, inputs.is_ratio.expand_as(mask), 1.0)
    kl = None
    if inputs.ref_logps is not None:
        diff = _where_valid(mask, inputs.ref_logps, 0.0) - logp
        kl = torch.exp(diff) - diff - 1
        if options.beta != 0:
            loss = loss + options.beta * kl
    if options.entropy_coef != 0:
        loss = loss - options.entropy_coef * entropy
    return loss, ratio, kl


def token_weights(mask: torch.Tensor, options: GRPOOptions, num_items_in_batch=None) -> torch.Tensor:
    """Float32 [B, T]: each token's weight in the reduced loss, so that ``loss = sum(L * weight)``.

    grpo: ``m / (B * max(len_b, 1))``; bnpo: ``m / max(sum m, 1)``; dr_grpo: ``m / (B * max_len)``;
    dapo: ``m / num_items_in_batch`` (default ``max(sum m, 1)``).
    """
    b, t = mask.shape
    loss_type = options.loss_type
    if loss_type == "grpo":
        return mask / (mask.sum(-1, keepdim=True).clamp(min=1.0) * b)
    if loss_type == "bnpo" or (loss_type == "dapo" and num_items_in_batch is None):
        return mask / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return mask / (b * (t if options.max_completion_length is None else options.max_completion_length))
    if loss_type == "dapo":
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(mask.device, torch.float32).reshape(())
        return mask / num_items_in_batch
    raise AssertionError(f"unhandled loss_type {loss_type!r}")  # GRPOOptions validated it


def loss_metrics(entropy: torch.Tensor, ratio: torch.Tensor, kl: Optional[torch.Tensor], advantages: torch.Tensor,
                 mask: torch.Tensor, options: GRPOOptions) -> dict:
    """Masked means over completion tokens, as TRL logs them; 0-d detached float32 tensors."""
    with torch.no_grad():
        adv = per_token_advantages(advantages, mask)
        count = mask.sum().clamp(min=1.0)

        def masked_mean(x: torch.Tensor) -> torch.Tensor:
            return (_where_valid(mask, x.float().expand_as(mask), 0.0) * mask).sum() / count

        low = (ratio < 1 - options.eps_low) & (adv < 0)
        high = (ratio > 1 + options.eps_high) & (adv > 0)
        metrics = {}
        if kl is not None:
            metrics["kl"] = masked_mean(kl)
        metrics["entropy"] = masked_mean(entropy)
        metrics["clip_ratio/low_mean"] = masked_mean(low)
        metrics["clip_ratio/high_mean"] = masked_mean(high)
        metrics["clip_ratio/region_mean"] = masked_mean(low | high)
    return {k: v.detach() for k, v in metrics.items()}


def grpo_loss_from_logprobs(logp: torch.Tensor, entropy: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                            inputs: GRPOInputs, options: GRPOOptions) -> GRPOLossOutput:
    """Everything after the log-probs: per-token loss, reduction and metrics (arguments checked)."""
    loss, ratio, kl = per_token_loss(logp, entropy, advantages, mask, inputs, options)
    reduced = (loss * token_weights(mask, options, inputs.num_items_in_batch)).sum()
    metrics = loss_metrics(entropy, ratio, kl, advantages, mask, options)
    per_token_logps = torch.where(mask != 0, logp.detach(), torch.zeros_like(logp))
    return GRPOLossOutput(reduced, per_token_logps, metrics)
