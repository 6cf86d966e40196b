"""Plain-PyTorch GRPO: the executable spec, written the way trainers write it today.

Materialise ``log_softmax((logits.float() - max) / T)`` over the whole vocabulary, gather the targets, then
apply the objective (``grpo_kernels.objective``). Every kernel in this package is tested against
these functions, and every benchmark compares with them; ``tests/spec64.py`` states the same maths
independently in float64. Same signatures as the public functions, without ``backend``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from . import _validation as V
from . import objective
from .kernels.torch_rows import floor_logp
from .objective import GRPOLossOutput
from .options import IGNORE_INDEX, LogitTransform, grpo_keywords, split_grpo_keywords


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
    return_entropy: bool = False,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
):
    """``log_softmax(z)[target]`` the way trainers write it, ``z`` the transformed logits
    (``options.LogitTransform``: ``softcap * tanh(logit_scale * logits / softcap) / temperature``).

    logits [..., V] fp16/bf16/fp32; targets [...] int32/int64. Returns float32 [...] (and the
    entropy of ``softmax(z)``, float32 [...], if ``return_entropy``). Positions whose target is
    ``ignore_index`` give 0 and no gradient; their logits are never read.
    """
    logits = V.check_logits(logits)
    targets = V.check_token_ids(targets, logits.shape[:-1], "targets")
    ignore_index, return_entropy = V.check_ignore_index(ignore_index), V.check_flag("return_entropy", return_entropy)
    transform = LogitTransform(temperature, softcap, logit_scale)
    V.check_ids_in_range(targets, logits.shape[-1], ignore_index, "targets")
    return _token_logprobs(logits, targets, transform, ignore_index, return_entropy)


def _token_logprobs(logits, targets, transform: LogitTransform, ignore_index, return_entropy):
    valid = targets != ignore_index
    # Rows without a target are replaced by zeros before any arithmetic (a select, so a NaN there
    # reaches neither the outputs nor the gradient).
    logits = torch.where(valid.unsqueeze(-1), logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
    z = logits.float()
    slope = transform.logit_scale / transform.temperature
    if transform.softcap is not None:
        z = transform.softcap * torch.tanh(z * transform.logit_scale / transform.softcap)
        slope = 1.0 / transform.temperature
    # Shift by the row max before the slope: log_softmax is shift-invariant (the detached max changes
    # no value or gradient), and a finite logit near FLT_MAX over T < 1 would overflow to inf first.
    z = z - z.amax(-1, keepdim=True).detach()
    log_probs = torch.log_softmax(z * slope, dim=-1)
    safe_targets = torch.where(valid, targets, torch.zeros_like(targets)).long()
    logp = log_probs.gather(-1, safe_targets.unsqueeze(-1)).squeeze(-1)
    logp = torch.where(valid, floor_logp(logp), torch.zeros_like(logp))
    if not return_entropy:
        return logp
    probs = log_probs.exp()
    # p*log p is 0 where p == 0 (a -inf logit); masking log p rather than the product keeps the
    # gradient finite there, while a NaN row still gives NaN (NaN * 0 is NaN).
    finite_log_probs = torch.where(probs > 0, log_probs, torch.zeros_like(log_probs))
    entropy = -(probs * finite_log_probs).sum(-1)
    entropy = torch.where(valid, entropy, torch.zeros_like(entropy))
    return logp, entropy


@grpo_keywords
def grpo_loss(
    logits: torch.Tensor,
    completion_ids: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: Optional[torch.Tensor] = None,
    **grpo_kwargs: Any,
) -> GRPOLossOutput:
    """GRPO loss from logits [B, T, V] with full fp32 ``log_softmax`` (every keyword: ``docs/api.md``)."""
    logits = V.check_logits(logits)
    inputs, options = split_grpo_keywords(grpo_kwargs, "grpo_loss")
    V.check_grpo_inputs(logits.shape, completion_ids, advantages, completion_mask, inputs, options)
    mask = objective.effective_mask(completion_ids, completion_mask)
    ids = objective.masked_ids(completion_ids, mask)
    V.check_ids_in_range(ids, logits.shape[-1], IGNORE_INDEX, "completion_ids")
    logp, entropy = _token_logprobs(logits, ids, options.transform, IGNORE_INDEX, True)
    return objective.grpo_loss_from_logprobs(logp, entropy, advantages, mask, inputs, options)


# --------------------------------------------------------------------------------------------------
# fused-linear variants: here the logits are materialised, as a trainer's lm_head does
# --------------------------------------------------------------------------------------------------
def _project(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], valid: torch.Tensor) -> torch.Tensor:
    """``hidden @ weight.T + bias``, with the rows that have no target zeroed first (never read)."""
    hidden = torch.where(valid.unsqueeze(-1), hidden, torch.zeros((), dtype=hidden.dtype, device=hidden.device))
    return torch.nn.functional.linear(hidden, weight, bias)


def fused_linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
    return_entropy: bool = False,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
):
    """``token_logprobs(hidden @ weight.T + bias, targets)``; hidden [..., H], weight [V, H]."""
    V.check_linear(hidden, weight, bias)
    targets = V.check_token_ids(targets, hidden.shape[:-1], "targets", "hidden")
    ignore_index = V.check_ignore_index(ignore_index)
    return token_logprobs(
        _project(hidden, weight, bias, targets != ignore_index), targets, temperature=temperature,
        ignore_index=ignore_index, return_entropy=return_entropy, softcap=softcap, logit_scale=logit_scale,
    )


@grpo_keywords
def fused_linear_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    completion_ids: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: Optional[torch.Tensor] = None,
    *,
    bias: Optional[torch.Tensor] = None,
    **grpo_kwargs: Any,
) -> GRPOLossOutput:
    """``grpo_loss(hidden @ weight.T + bias, ...)``; hidden [B, T, H], weight [V, H]."""
    V.check_linear(hidden, weight, bias)
    inputs, options = split_grpo_keywords(grpo_kwargs, "fused_linear_grpo_loss")
    V.check_grpo_inputs(hidden.shape, completion_ids, advantages, completion_mask, inputs, options, "hidden")
    valid = objective.effective_mask(completion_ids, completion_mask) != 0
    return grpo_loss(_project(hidden, weight, bias, valid), completion_ids, advantages, completion_mask, **grpo_kwargs)
