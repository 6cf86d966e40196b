"""Public functions: token log-probs and the GRPO loss, from logits or from hidden states.

Each function validates its arguments (``_validation``), picks a backend, computes per-token
log-probs and entropies with a fused row kernel (``autograd``), then applies the O(tokens) GRPO maths
that ``reference`` defines, so every backend shares one formula.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _validation as V
from . import reference
from .autograd import FusedGRPOLoss, FusedLinearTokenLogprobs, TokenLogprobs, default_chunk_size, row_kernels
from .kernels.layout import as_rows
from .reference import GRPOLossOutput

IGNORE_INDEX = -100


def _logprobs_rows(logits, targets, temperature, ignore_index, with_entropy, backend, inplace_backward=False):
    """(logp, entropy) with the shape of ``targets``; logits [..., V] viewed as rows without a copy."""
    kernels = row_kernels(backend, logits.device)
    rows = as_rows(logits)
    targets_rows = targets.reshape(rows.shape[:2])
    logp, entropy = TokenLogprobs.apply(rows, targets_rows, temperature, ignore_index, kernels, with_entropy, inplace_backward)
    return logp.view(targets.shape), entropy.view(targets.shape)


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
    return_entropy: bool = False,
    backend: str = "auto",
):
    """``log_softmax(logits / temperature)[target]``, float32 [...], without materialising the softmax.

    logits [..., V] fp16/bf16/fp32 (strided views fine, last dim contiguous); targets [...] int32/int64.
    With ``return_entropy`` also returns the entropy of ``softmax(logits / temperature)``, float32 [...].
    Positions whose target is ``ignore_index`` give 0 and a zero gradient. Differentiable w.r.t. the
    logits through both outputs; the gradient has the logits' dtype.
    """
    backend = V.check_backend(backend)
    if backend == "reference":
        return reference.token_logprobs(
            logits, targets, temperature=temperature, ignore_index=ignore_index, return_entropy=return_entropy
        )
    logits = V.check_logits(logits)
    targets = V.check_token_ids(targets, logits.shape[:-1], "targets")
    temperature = V.check_temperature(temperature)
    V.check_ids_in_range(targets, logits.shape[-1], ignore_index, "targets")
    logp, entropy = _logprobs_rows(logits, targets, temperature, ignore_index, return_entropy, backend)
    return (logp, entropy) if return_entropy else logp


def _grpo_options(kwargs: dict) -> dict:
    """Every keyword of grpo_loss except temperature, backend and inplace_backward."""
    return {k: kwargs[k] for k in (
        "old_logps", "ref_logps", "beta", "eps_low", "eps_high", "delta", "loss_type", "max_completion_length",
        "num_items_in_batch", "importance_sampling_level", "is_ratio", "entropy_coef",
    )}


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
    backend: str = "auto",
    inplace_backward: bool = False,
) -> GRPOLossOutput:
    """GRPO / DAPO / Dr. GRPO / GSPO loss from logits [B, T, V]; see API.md for every option.

    Returns ``GRPOLossOutput(loss, per_token_logps, metrics)``: a 0-d float32 loss, the detached
    float32 [B, T] log-probs (0 where masked; reuse them as ``old_logps``) and 0-d metric tensors.
    ``inplace_backward=True`` writes the logits' gradient into the logits buffer (for trainers that
    do not reuse the logits), so the loss needs only O(B*T) extra memory.
    """
    options = _grpo_options(locals())
    backend = V.check_backend(backend)
    if backend == "reference":
        return reference.grpo_loss(logits, completion_ids, advantages, completion_mask, temperature=temperature, **options)
    logits = V.check_logits(logits)
    options["eps_high"] = reference.check_grpo_inputs(logits.shape, completion_ids, advantages, completion_mask, options)
    temperature = V.check_temperature(temperature)
    mask = reference.effective_mask(completion_ids, completion_mask, IGNORE_INDEX)
    ids = reference.masked_ids(completion_ids, mask, IGNORE_INDEX)
    V.check_ids_in_range(ids, logits.shape[-1], IGNORE_INDEX, "completion_ids")
    kernels = row_kernels(backend, logits.device)
    if hasattr(kernels, "grpo_forward_rows") and importance_sampling_level == "token":
        return _fused_grpo_loss(logits, ids, advantages, mask, temperature, inplace_backward, options)
    # Sequence-level ratios (GSPO) need each sequence's mean log-ratio before any token's loss, and
    # the torch path has no fused epilogue: log-probs from the row kernel, then the O(B*T) maths.
    logp, entropy = _logprobs_rows(logits, ids, temperature, IGNORE_INDEX, True, backend, inplace_backward)
    return reference.grpo_loss_from_logprobs(logp, entropy, advantages, mask, **options)


def _fused_grpo_loss(logits, ids, advantages, mask, temperature, inplace_backward, options) -> GRPOLossOutput:
    """Token-level GRPO on the Triton kernel that computes the loss in the log-prob pass."""
    rows = as_rows(logits)
    weights = reference.token_weights(mask, options["loss_type"], options["max_completion_length"], options["num_items_in_batch"])
    hyper = (options["eps_low"], options["eps_high"], options["delta"], options["beta"], options["entropy_coef"])
    old, ref, is_ratio = options["old_logps"], options["ref_logps"], options["is_ratio"]
    loss, logp, entropy, kl, clip = FusedGRPOLoss.apply(
        rows, ids.reshape(rows.shape[:2]), advantages.detach(), weights, None if old is None else old.detach(),
        None if ref is None else ref.detach(), None if is_ratio is None else is_ratio.detach(), temperature,
        IGNORE_INDEX, hyper, inplace_backward,
    )
    logp, entropy, kl, clip = (x.view(ids.shape) for x in (logp, entropy, kl, clip))
    with torch.no_grad():  # metrics: masked means of the per-token values the kernel wrote
        count = mask.sum().clamp(min=1.0)
        means = {"kl": kl} if ref is not None else {}
        means.update({"entropy": entropy, "clip_ratio/low_mean": clip < 0, "clip_ratio/high_mean": clip > 0,
                      "clip_ratio/region_mean": clip != 0})
        metrics = {k: ((x * mask).sum() / count).detach() for k, x in means.items()}
    return GRPOLossOutput(loss, (logp * (mask != 0)).detach(), metrics)


# --------------------------------------------------------------------------------------------------
# fused linear: hidden states and lm_head weight in, the [N, V] logits never exist at once
# --------------------------------------------------------------------------------------------------
def _fused_linear_rows(hidden, weight, bias, targets, temperature, ignore_index, with_entropy, chunk_size, backend):
    if weight.dtype != hidden.dtype:  # e.g. an fp32 lm_head under bf16 autocast: match, as F.linear would
        weight = weight.to(hidden.dtype)
        bias = None if bias is None else bias.to(hidden.dtype)
    kernels = row_kernels(backend, hidden.device)
    h = hidden.reshape(-1, hidden.shape[-1])
    if chunk_size is None:
        chunk_size = default_chunk_size(weight.shape[0], weight.shape[1], weight.dtype, hidden.device)
    elif not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    logp, entropy = FusedLinearTokenLogprobs.apply(
        h, weight, bias, targets.reshape(-1), temperature, ignore_index, kernels, with_entropy, chunk_size
    )
    return logp.view(targets.shape), entropy.view(targets.shape)


def fused_linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
    return_entropy: bool = False,
    chunk_size: Optional[int] = None,
    backend: str = "auto",
):
    """``token_logprobs(hidden @ weight.T + bias, targets)`` a chunk of rows at a time.

    hidden [..., H], weight [V, H] (``lm_head.weight``), bias [V] or None, targets [...]. Gradients
    flow to hidden, weight and bias; extra memory is bounded by ``chunk_size`` rows of logits.
    """
    backend = V.check_backend(backend)
    if backend == "reference":
        return reference.fused_linear_token_logprobs(
            hidden, weight, targets, bias=bias, temperature=temperature, ignore_index=ignore_index,
            return_entropy=return_entropy,
        )
    reference.check_linear(hidden, weight, bias)
    targets = V.check_token_ids(targets, hidden.shape[:-1], "targets", "hidden")
    temperature = V.check_temperature(temperature)
    V.check_ids_in_range(targets, weight.shape[0], ignore_index, "targets")
    logp, entropy = _fused_linear_rows(hidden, weight, bias, targets, temperature, ignore_index, return_entropy, chunk_size, backend)
    return (logp, entropy) if return_entropy else logp


def fused_linear_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    completion_ids: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: Optional[torch.Tensor] = None,
    *,
    bias: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = None,
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
    backend: str = "auto",
) -> GRPOLossOutput:
    """``grpo_loss(hidden @ weight.T + bias, ...)`` without the [B*T, V] logits; hidden [B, T, H]."""
    options = _grpo_options(locals())
    backend = V.check_backend(backend)
    if backend == "reference":
        return reference.fused_linear_grpo_loss(
            hidden, weight, completion_ids, advantages, completion_mask, bias=bias, temperature=temperature, **options
        )
    reference.check_linear(hidden, weight, bias)
    options["eps_high"] = reference.check_grpo_inputs(hidden.shape, completion_ids, advantages, completion_mask, options)
    temperature = V.check_temperature(temperature)
    mask = reference.effective_mask(completion_ids, completion_mask, IGNORE_INDEX)
    ids = reference.masked_ids(completion_ids, mask, IGNORE_INDEX)
    V.check_ids_in_range(ids, weight.shape[0], IGNORE_INDEX, "completion_ids")
    logp, entropy = _fused_linear_rows(hidden, weight, bias, ids, temperature, IGNORE_INDEX, True, chunk_size, backend)
    return reference.grpo_loss_from_logprobs(logp, entropy, advantages, mask, **options)
