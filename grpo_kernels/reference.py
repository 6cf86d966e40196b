"""Plain-PyTorch GRPO: the executable spec.

This is what trainers do today: materialise ``log_softmax(logits.float() / T)`` over the whole
vocabulary and gather the targets. Every kernel in this package is tested against these functions,
and every benchmark compares with them. The per-token loss and the reductions
(:func:`per_token_loss`, :func:`reduce_loss`, :func:`loss_metrics`) are O(tokens) and are also the
ones the fast backends use, so each formula is written exactly once.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

from . import _validation as V

Number = Union[int, float]


class GRPOLossOutput(NamedTuple):
    loss: torch.Tensor  # 0-d float32, differentiable
    per_token_logps: torch.Tensor  # [B, T] float32, detached; 0 where masked
    metrics: dict  # name -> 0-d detached float32 tensor


# --------------------------------------------------------------------------------------------------
# log-probs
# --------------------------------------------------------------------------------------------------
def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
):
    """``log_softmax(logits / temperature)[target]`` the way trainers write it.

    logits [..., V] fp16/bf16/fp32; targets [...] int32/int64. Returns float32 [...] (and the
    entropy of ``softmax(logits / temperature)``, float32 [...], if ``return_entropy``). Positions
    whose target is ``ignore_index`` give 0 and no gradient.
    """
    logits = V.check_logits(logits)
    targets = V.check_token_ids(targets, logits.shape[:-1], "targets")
    temperature = V.check_temperature(temperature)
    V.check_ids_in_range(targets, logits.shape[-1], ignore_index, "targets")
    return _token_logprobs(logits, targets, temperature, ignore_index, return_entropy)


def _token_logprobs(logits, targets, temperature, ignore_index, return_entropy):
    valid = targets != ignore_index
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    safe_targets = torch.where(valid, targets, torch.zeros_like(targets)).long()
    logp = log_probs.gather(-1, safe_targets.unsqueeze(-1)).squeeze(-1)
    logp = torch.where(valid, logp, torch.zeros_like(logp))
    if not return_entropy:
        return logp
    probs = log_probs.exp()
    # p*log p is 0 where p == 0 (a -inf logit); masking log p rather than the product keeps the
    # gradient finite there, while a NaN row still gives NaN (NaN * 0 is NaN).
    finite_log_probs = torch.where(probs > 0, log_probs, torch.zeros_like(log_probs))
    entropy = -(probs * finite_log_probs).sum(-1)
    entropy = torch.where(valid, entropy, torch.zeros_like(entropy))
    return logp, entropy


# --------------------------------------------------------------------------------------------------
# GRPO loss: per-token terms, reductions, metrics (shared by every backend)
# --------------------------------------------------------------------------------------------------
def effective_mask(completion_ids: torch.Tensor, completion_mask: Optional[torch.Tensor], ignore_index: int = -100) -> torch.Tensor:
    """Float32 [B, T] weights: the completion mask, zero wherever the id is ``ignore_index``."""
    mask = (completion_ids != ignore_index).float()
    if completion_mask is not None:
        mask = mask * completion_mask.float()
    return mask


def masked_ids(completion_ids: torch.Tensor, mask: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Ids with every masked position set to ``ignore_index``, so no backend reads them."""
    return torch.where(mask != 0, completion_ids, torch.full_like(completion_ids, ignore_index))


def log_importance_ratio(
    logp: torch.Tensor, old_logps: Optional[torch.Tensor], mask: torch.Tensor, level: str
) -> torch.Tensor:
    """``log(ratio)``: [B, T] per token, or [B, 1] per sequence (GSPO: masked mean of the log-ratio)."""
    old = logp.detach() if old_logps is None else old_logps.float()
    log_ratio = logp - old
    if level == "sequence":
        return (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return log_ratio


def per_token_loss(
    logp: torch.Tensor,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    old_logps: Optional[torch.Tensor],
    ref_logps: Optional[torch.Tensor],
    beta: float,
    eps_low: float,
    eps_high: float,
    delta: Optional[float],
    importance_sampling_level: str,
    is_ratio: Optional[torch.Tensor],
    entropy_coef: float,
):
    """The GRPO loss of every token, float32 [B, T] (not yet masked), plus ratio and k3 KL.

    ``L = -min(r1*A, clamp(ratio, 1-eps_low, 1+eps_high)*A) * is_ratio + beta*kl - entropy_coef*H``
    with ``r1 = min(ratio, delta)`` when ``delta`` is set.
    """
    adv = advantages.float()
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    ratio = torch.exp(log_importance_ratio(logp, old_logps, mask, importance_sampling_level))
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    unclipped = torch.clamp(ratio, max=delta) if delta is not None else ratio
    loss = -torch.min(unclipped * adv, clipped * adv)
    if is_ratio is not None:
        loss = loss * is_ratio.detach().float()
    kl = None
    if ref_logps is not None:
        diff = ref_logps.float() - logp
        kl = torch.exp(diff) - diff - 1
        if beta != 0:
            loss = loss + beta * kl
    if entropy_coef != 0:
        loss = loss - entropy_coef * entropy
    return loss, ratio, kl


def token_weights(
    mask: torch.Tensor,
    loss_type: str,
    max_completion_length: Optional[int] = None,
    num_items_in_batch: Optional[Union[Number, torch.Tensor]] = None,
) -> torch.Tensor:
    """Float32 [B, T]: each token's weight in the reduced loss, so that ``loss = sum(L * weight)``.

    grpo: ``m / (B * max(len_b, 1))``; bnpo: ``m / max(sum m, 1)``; dr_grpo: ``m / (B * max_len)``;
    dapo: ``m / num_items_in_batch`` (default ``max(sum m, 1)``).
    """
    b, t = mask.shape
    if loss_type == "grpo":
        return mask / (mask.sum(-1, keepdim=True).clamp(min=1.0) * b)
    if loss_type == "bnpo":
        return mask / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return mask / (b * (t if max_completion_length is None else max_completion_length))
    if loss_type == "dapo":
        if num_items_in_batch is None:
            return mask / mask.sum().clamp(min=1.0)
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(mask.device, torch.float32)
        return mask / num_items_in_batch
    raise ValueError(f"loss_type must be one of {V.LOSS_TYPES}, got {loss_type!r}")


def reduce_loss(
    loss: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    max_completion_length: Optional[int] = None,
    num_items_in_batch: Optional[Union[Number, torch.Tensor]] = None,
) -> torch.Tensor:
    """Reduce [B, T] per-token losses to a 0-d float32 loss (see the table in API.md)."""
    return (loss * token_weights(mask, loss_type, max_completion_length, num_items_in_batch)).sum()


def loss_metrics(
    entropy: torch.Tensor,
    ratio: torch.Tensor,
    kl: Optional[torch.Tensor],
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> dict:
    """Masked means over completion tokens, as TRL logs them; 0-d detached float32 tensors."""
    with torch.no_grad():
        adv = advantages.float()
        if adv.dim() == 1:
            adv = adv.unsqueeze(-1)
        count = mask.sum().clamp(min=1.0)

        def masked_mean(x: torch.Tensor) -> torch.Tensor:
            return (x.float().expand_as(mask) * mask).sum() / count

        low = (ratio < 1 - eps_low) & (adv < 0)
        high = (ratio > 1 + eps_high) & (adv > 0)
        metrics = {}
        if kl is not None:
            metrics["kl"] = masked_mean(kl)
        metrics["entropy"] = masked_mean(entropy)
        metrics["clip_ratio/low_mean"] = masked_mean(low)
        metrics["clip_ratio/high_mean"] = masked_mean(high)
        metrics["clip_ratio/region_mean"] = masked_mean(low | high)
    return {k: v.detach() for k, v in metrics.items()}


def grpo_loss_from_logprobs(
    logp: torch.Tensor,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    old_logps=None,
    ref_logps=None,
    beta: float = 0.0,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    delta=None,
    loss_type: str = "dapo",
    max_completion_length=None,
    num_items_in_batch=None,
    importance_sampling_level: str = "token",
    is_ratio=None,
    entropy_coef: float = 0.0,
) -> GRPOLossOutput:
    """Everything after the log-probs: per-token loss, reduction and metrics (arguments checked)."""
    loss, ratio, kl = per_token_loss(
        logp, entropy, advantages, mask,
        old_logps=old_logps, ref_logps=ref_logps, beta=beta, eps_low=eps_low, eps_high=eps_high,
        delta=delta, importance_sampling_level=importance_sampling_level, is_ratio=is_ratio,
        entropy_coef=entropy_coef,
    )
    reduced = reduce_loss(loss, mask, loss_type, max_completion_length, num_items_in_batch)
    metrics = loss_metrics(entropy, ratio, kl, advantages, mask, eps_low, eps_high)
    per_token_logps = (logp * (mask != 0)).detach()
    return GRPOLossOutput(reduced, per_token_logps, metrics)


def check_grpo_inputs(logits_shape, completion_ids, advantages, completion_mask, kw: dict) -> float:
    """Shared validation of grpo_loss arguments given the [B, T, V] (or [B, T, H]) leading shape."""
    if len(logits_shape) != 3:
        raise ValueError(f"expected a [B, T, V] tensor of logits (or [B, T, H] hidden states), got shape {list(logits_shape)}")
    b, t = logits_shape[0], logits_shape[1]
    V.check_token_ids(completion_ids, torch.Size((b, t)), "completion_ids")
    return V.check_grpo_args(
        b, t, advantages, completion_mask, kw["old_logps"], kw["ref_logps"], kw["beta"], kw["eps_low"],
        kw["eps_high"], kw["delta"], kw["loss_type"], kw["max_completion_length"], kw["num_items_in_batch"],
        kw["importance_sampling_level"], kw["is_ratio"], kw["entropy_coef"],
    )


def grpo_loss(
    logits: torch.Tensor,
    completion_ids: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: Optional[torch.Tensor] = None,
    *,
    old_logps: Optional[torch.Tensor] = None,
    ref_logps: Optional[torch.Tensor] = None,
    beta: float = 0.0,
    eps_low: float = 0.2,
    eps_high: Optional[float] = None,
    delta: Optional[float] = None,
    temperature: float = 1.0,
    loss_type: str = "dapo",
    max_completion_length: Optional[int] = None,
    num_items_in_batch=None,
    importance_sampling_level: str = "token",
    is_ratio: Optional[torch.Tensor] = None,
    entropy_coef: float = 0.0,
) -> GRPOLossOutput:
    """GRPO loss from logits [B, T, V] with full fp32 ``log_softmax`` (see API.md for every option)."""
    logits = V.check_logits(logits)
    options = dict(
        old_logps=old_logps, ref_logps=ref_logps, beta=beta, eps_low=eps_low, eps_high=eps_high,
        delta=delta, loss_type=loss_type, max_completion_length=max_completion_length,
        num_items_in_batch=num_items_in_batch, importance_sampling_level=importance_sampling_level,
        is_ratio=is_ratio, entropy_coef=entropy_coef,
    )
    options["eps_high"] = check_grpo_inputs(logits.shape, completion_ids, advantages, completion_mask, options)
    temperature = V.check_temperature(temperature)
    mask = effective_mask(completion_ids, completion_mask)
    ids = masked_ids(completion_ids, mask)
    V.check_ids_in_range(ids, logits.shape[-1], -100, "completion_ids")
    logp, entropy = _token_logprobs(logits, ids, temperature, -100, True)
    return grpo_loss_from_logprobs(logp, entropy, advantages, mask, **options)


# --------------------------------------------------------------------------------------------------
# fused-linear variants: here the logits are materialised, as a trainer's lm_head does
# --------------------------------------------------------------------------------------------------
def check_linear(hidden, weight, bias) -> None:
    V.check_logits(hidden, "hidden")
    V.check_logits(weight, "weight")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must have shape [V, {hidden.shape[-1]}] (lm_head.weight), got {list(weight.shape)}")
    if bias is not None:
        V.check_logits(bias, "bias")
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must have shape [{weight.shape[0]}], got {list(bias.shape)}")


def _project(hidden, weight, bias):
    return torch.nn.functional.linear(hidden, weight, bias)


def fused_linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    chunk_size: Optional[int] = None,
):
    """``token_logprobs(hidden @ weight.T + bias, targets)``; hidden [..., H], weight [V, H]."""
    check_linear(hidden, weight, bias)
    return token_logprobs(
        _project(hidden, weight, bias), targets, temperature=temperature, ignore_index=ignore_index,
        return_entropy=return_entropy,
    )


def fused_linear_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    completion_ids: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: Optional[torch.Tensor] = None,
    *,
    bias: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = None,
    **kwargs,
) -> GRPOLossOutput:
    """``grpo_loss(hidden @ weight.T + bias, ...)``; hidden [B, T, H], weight [V, H]."""
    check_linear(hidden, weight, bias)
    if hidden.dim() != 3:
        raise ValueError(f"hidden must have shape [B, T, H], got {list(hidden.shape)}")
    return grpo_loss(_project(hidden, weight, bias), completion_ids, advantages, completion_mask, **kwargs)
