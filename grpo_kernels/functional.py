"""Public functions: token log-probs and the GRPO loss, from logits or from hidden states.

Each function validates its arguments (``_validation``, and ``options.GRPOOptions`` for the scalar
hyper-parameters), resolves a backend (``backends``), computes per-token log-probs and entropies with
that backend's row kernels (bound to autograd in ``autograd``), then applies the O(tokens) GRPO
maths of ``objective``, so every backend shares one formula. ``backend="reference"`` runs the naive
spec in ``reference`` instead.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from . import _validation as V
from . import backends, objective, reference
from .autograd import FusedGRPOLoss, FusedLinearTokenLogprobs, TokenLogprobs, default_chunk_size
from .kernels.layout import as_rows
from .objective import GRPOLossOutput
from .options import BACKENDS, IGNORE_INDEX, GRPOInputs, GRPOOptions, LogitTransform, grpo_keywords, split_grpo_keywords


def _logprobs_rows(logits, targets, transform: LogitTransform, ignore_index, with_entropy, backend, inplace_backward=False):
    """(logp, entropy) with the shape of ``targets``; logits [..., V] viewed as rows without a copy."""
    rows = as_rows(logits)
    logp, entropy = TokenLogprobs.apply(
        rows, targets.reshape(rows.shape[:2]), backend, transform, ignore_index, with_entropy, inplace_backward
    )
    return logp.view(targets.shape), entropy.view(targets.shape)


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
    return_entropy: bool = False,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    backend: str = "auto",
):
    """``log_softmax(z)[target]``, float32 [...], without materialising the softmax, where
    ``z = softcap * tanh(logit_scale * logits / softcap) / temperature`` (``logit_scale * logits /
    temperature`` without ``softcap``: Gemma's final-logit soft-capping, Cohere's logit scale).

    logits [..., V] fp16/bf16/fp32 (strided views fine, last dim contiguous); targets [...] int32/int64.
    With ``return_entropy`` also returns the entropy of ``softmax(z)``, float32 [...].
    Positions whose target is ``ignore_index`` give 0 and a zero gradient, and their logits are never
    read. Differentiable w.r.t. the logits through both outputs (first order: a double backward
    raises); the gradient has the logits' dtype.
    """
    V.check_choice("backend", backend, BACKENDS)
    if backend == "reference":
        return reference.token_logprobs(
            logits, targets, temperature=temperature, ignore_index=ignore_index, return_entropy=return_entropy,
            softcap=softcap, logit_scale=logit_scale,
        )
    logits = V.check_logits(logits)
    targets = V.check_token_ids(targets, logits.shape[:-1], "targets")
    transform = LogitTransform(temperature, softcap, logit_scale)
    V.check_ids_in_range(targets, logits.shape[-1], ignore_index, "targets")
    row_backend = backends.resolve(backend, logits.device)
    logp, entropy = _logprobs_rows(logits, targets, transform, ignore_index, return_entropy, row_backend)
    return (logp, entropy) if return_entropy else logp


def _prepare_grpo(name: str, leading_shape, vocab_size: int, completion_ids, advantages, completion_mask, grpo_kwargs):
    """Validate a GRPO call; -> (inputs, options, mask [B, T] fp32, ids with masked positions ignored)."""
    inputs, options = split_grpo_keywords(grpo_kwargs, "grpo_loss" if name == "logits" else "fused_linear_grpo_loss")
    V.check_grpo_inputs(leading_shape, completion_ids, advantages, completion_mask, inputs, options, name)
    mask = objective.effective_mask(completion_ids, completion_mask)
    ids = objective.masked_ids(completion_ids, mask)
    V.check_ids_in_range(ids, vocab_size, IGNORE_INDEX, "completion_ids")
    return inputs, options, mask, ids


@grpo_keywords
def grpo_loss(
    logits: torch.Tensor,
    completion_ids: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: Optional[torch.Tensor] = None,
    *,
    backend: str = "auto",
    inplace_backward: bool = False,
    **grpo_kwargs: Any,
) -> GRPOLossOutput:
    """GRPO / DAPO / Dr. GRPO / GSPO loss from logits [B, T, V]; every keyword is in ``docs/api.md``.

    The GRPO keywords (``old_logps``, ``ref_logps``, ``is_ratio``, ``num_items_in_batch``, ``beta``,
    ``eps_low``, ``eps_high``, ``delta``, ``temperature``, ``loss_type``, ``max_completion_length``,
    ``importance_sampling_level``, ``entropy_coef``) are the fields of ``options.GRPOInputs`` and
    ``options.GRPOOptions``. Returns ``GRPOLossOutput(loss, per_token_logps, metrics)``: a 0-d
    float32 loss, the detached float32 [B, T] log-probs (0 where masked; reuse them as
    ``old_logps``) and 0-d metric tensors. Gradients flow to the logits only: advantages, old/ref
    log-probs and ``is_ratio`` are constants of the loss (detached), on every backend.
    ``inplace_backward=True`` writes the logits' gradient into the logits buffer (for trainers that
    do not reuse the logits), so the loss needs only O(B*T) extra memory; autograd raises if
    anything else still needs the logits' values.
    """
    V.check_choice("backend", backend, BACKENDS)
    if backend == "reference":
        return reference.grpo_loss(logits, completion_ids, advantages, completion_mask, **grpo_kwargs)
    logits = V.check_logits(logits)
    inputs, options, mask, ids = _prepare_grpo("logits", logits.shape, logits.shape[-1], completion_ids, advantages,
                                               completion_mask, grpo_kwargs)
    row_backend = backends.resolve(backend, logits.device)
    if row_backend.fuses(options):
        return _fused_grpo_loss(logits, ids, advantages, mask, row_backend, inputs, options, inplace_backward)
    # Sequence-level ratios (GSPO) need each sequence's mean log-ratio before any token's loss, and
    # the torch path has no fused epilogue: log-probs from the row kernel, then the O(B*T) maths.
    logp, entropy = _logprobs_rows(logits, ids, options.transform, IGNORE_INDEX, True, row_backend, inplace_backward)
    return objective.grpo_loss_from_logprobs(logp, entropy, advantages, mask, inputs, options)


def _fused_grpo_loss(logits, ids, advantages, mask, row_backend, inputs: GRPOInputs, options: GRPOOptions,
                     inplace_backward) -> GRPOLossOutput:
    """Token-level GRPO on a backend whose kernel computes the loss in the log-prob pass
    (``FusedGRPOLoss``); the per-token weights (the reduction) and the metrics come from ``objective``."""
    rows = as_rows(logits)
    sequences = objective.Sequences(mask, inputs.segment_ids)
    weights = objective.token_weights(mask, options, inputs.num_items_in_batch, sequences)
    adv = objective.per_token_advantages(advantages, mask)
    kernel_inputs = GRPOInputs(  # constants of the loss, masked positions already never read
        old_logps=None if inputs.old_logps is None else inputs.old_logps.detach(),
        ref_logps=None if inputs.ref_logps is None else inputs.ref_logps.detach(),
        is_ratio=None if inputs.is_ratio is None else inputs.is_ratio.detach(),
    )
    loss, logp, entropy, kl, clip = FusedGRPOLoss.apply(
        rows, ids.reshape(rows.shape[:2]), adv, weights, row_backend, kernel_inputs, options, IGNORE_INDEX,
        inplace_backward,
    )
    logp, entropy, kl, clip = (x.view(ids.shape) for x in (logp, entropy, kl, clip))
    # metrics: reductions of the per-token values the kernel wrote (clip: -1 low, +1 high)
    metrics = objective.loss_metrics(entropy, kl if inputs.ref_logps is not None else None, clip < 0, clip > 0, mask,
                                     options, sequences)
    return GRPOLossOutput(loss, torch.where(mask != 0, logp, torch.zeros_like(logp)).detach(), metrics)


# --------------------------------------------------------------------------------------------------
# fused linear: hidden states and lm_head weight in, the [N, V] logits never exist at once
# --------------------------------------------------------------------------------------------------
def _fused_linear_rows(hidden, weight, bias, targets, temperature, ignore_index, with_entropy, chunk_size, backend):
    """(logp, entropy) of ``hidden @ weight.T + bias`` with the shape of ``targets``.

    Only rows whose target is not ``ignore_index`` are projected: the others are never read (a NaN
    hidden state at a padded position changes nothing) and cost nothing.
    """
    if weight.dtype != hidden.dtype:  # e.g. an fp32 lm_head under bf16 autocast: match, as F.linear would
        weight = weight.to(hidden.dtype)
        bias = None if bias is None else bias.to(hidden.dtype)
    row_backend = backends.resolve(backend, hidden.device)
    if chunk_size is None:
        chunk_size = default_chunk_size(weight.shape[0], weight.shape[1], weight.dtype, hidden.device)
    else:
        chunk_size = V.check_positive_int("chunk_size", chunk_size)
    flat_targets = targets.reshape(-1)
    keep = (flat_targets != ignore_index).nonzero().squeeze(-1)
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, keep)
    logp_kept, entropy_kept = FusedLinearTokenLogprobs.apply(
        h, weight, bias, flat_targets.index_select(0, keep), row_backend, temperature, ignore_index, with_entropy,
        chunk_size,
    )
    zeros = torch.zeros(flat_targets.shape, dtype=torch.float32, device=hidden.device)
    logp = zeros.index_put((keep,), logp_kept)
    entropy = zeros.index_put((keep,), entropy_kept)
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
    V.check_choice("backend", backend, BACKENDS)
    if backend == "reference":
        return reference.fused_linear_token_logprobs(
            hidden, weight, targets, bias=bias, temperature=temperature, ignore_index=ignore_index,
            return_entropy=return_entropy,
        )
    V.check_linear(hidden, weight, bias)
    targets = V.check_token_ids(targets, hidden.shape[:-1], "targets", "hidden")
    temperature = V.check_temperature(temperature)
    V.check_ids_in_range(targets, weight.shape[0], ignore_index, "targets")
    logp, entropy = _fused_linear_rows(hidden, weight, bias, targets, temperature, ignore_index, return_entropy, chunk_size, backend)
    return (logp, entropy) if return_entropy else logp


@grpo_keywords
def fused_linear_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    completion_ids: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: Optional[torch.Tensor] = None,
    *,
    bias: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = None,
    backend: str = "auto",
    **grpo_kwargs: Any,
) -> GRPOLossOutput:
    """``grpo_loss(hidden @ weight.T + bias, ...)`` without the [B*T, V] logits; hidden [B, T, H].

    Takes every GRPO keyword of :func:`grpo_loss`; gradients flow to hidden, weight and bias.
    """
    V.check_choice("backend", backend, BACKENDS)
    if backend == "reference":
        return reference.fused_linear_grpo_loss(hidden, weight, completion_ids, advantages, completion_mask, bias=bias,
                                                **grpo_kwargs)
    V.check_linear(hidden, weight, bias)
    inputs, options, mask, ids = _prepare_grpo("hidden", hidden.shape, weight.shape[0], completion_ids, advantages,
                                               completion_mask, grpo_kwargs)
    logp, entropy = _fused_linear_rows(hidden, weight, bias, ids, options.temperature, IGNORE_INDEX, True, chunk_size, backend)
    return objective.grpo_loss_from_logprobs(logp, entropy, advantages, mask, inputs, options)
