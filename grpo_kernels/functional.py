"""Public functions: token log-probs and the GRPO loss, from logits or from hidden states.

Each function validates its arguments (``_validation``, and ``options.GRPOOptions`` for the scalar
hyper-parameters), resolves a backend (``backends``), computes per-token log-probs and entropies with
that backend's row kernels (bound to autograd in ``autograd``), then applies the O(tokens) GRPO
maths of ``objective``, so every backend shares one formula. ``backend="reference"`` runs the naive
spec in ``reference`` instead (an ``if`` in each function, once the keywords only the kernels take are
checked). Each signature writes every keyword out, type and default, between marker comments that
``tools/signatures.py`` fills from the declarations (``options.GRPOInputs`` / ``GRPOOptions`` /
``LogitTransform``, ``prepare.LogprobKeywords``); the GRPO ones travel on as one dict, ``grpo_kwargs``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from . import _validation as V
from . import backends, objective, reference, vocab_parallel
from .autograd import (FusedGRPOLossFunction, FusedLinearGRPOLossFunction, FusedLinearTokenLogprobsFunction,
                       ReplayLinearTokenLogprobsFunction, ReplayTokenLogprobsFunction, TokenLogprobsFunction)
from .bounds import OptionError
from .kernels.layout import as_rows
from .objective import GRPOLossOutput
from .options import (BACKENDS, IGNORE_INDEX, NOT_GIVEN, GRPOInputs, GRPOOptions, LogitTransform, NotGiven,
                      user_spelling)
from .prepare import (FP32_LOGITS_DEFAULT, check_logprob_flags, linear_rows, logprob_outputs, logprob_sampling_mask,
                      logprob_targets, prepare_grpo, scatter_rows, take_rows, take_transform)
from .sampling_mask import SamplingMask


def _several_ranks(group: Optional[Any]) -> bool:
    """A vocabulary-parallel call (``vocab_parallel``): a process group of more than one rank. A group of
    one holds the whole vocabulary, and its call is the single-device one."""
    return group is not None and vocab_parallel.world_size(group) > 1


def _vocabulary_shard(process_group, weight, bias, reduce_hidden_grad, backend):
    """(group or None, weight, bias, reduce_hidden_grad) of a fused-linear call: a DTensor head sharded
    over the vocabulary gives its group and local shards (``vocab_parallel.resolve_sharded_head``);
    ``reduce_hidden_grad`` must be a bool, and True only with a group."""
    group = None
    if process_group is not None or vocab_parallel.is_dtensor(weight):
        group, weight, bias = vocab_parallel.resolve_sharded_head(process_group, weight, bias, backend)
    return group, weight, bias, vocab_parallel.check_reduce_hidden_grad(reduce_hidden_grad, group)


def _logprobs_rows(logits, targets, transform: LogitTransform, ignore_index, with_entropy, backend, inplace_backward=False,
                   with_sum_sq=False):
    """(logp, entropy, sum of squared probabilities or a 0-d 0) with the shape of ``targets``; logits
    [..., V] viewed as rows without a copy; ``transform``'s temperature a float or of ``targets``' shape."""
    rows = as_rows(logits)
    logp, entropy, sum_sq = TokenLogprobsFunction.apply(
        rows, targets.reshape(rows.shape[:2]), backend, transform, ignore_index, with_entropy, inplace_backward,
        with_sum_sq,
    )
    return logp.view(targets.shape), entropy.view(targets.shape), sum_sq.view(targets.shape) if with_sum_sq else sum_sq


def _replay_logprobs_rows(logits, targets, transform: LogitTransform, ignore_index, sampling_mask: SamplingMask,
                          with_entropy, backend, inplace_backward=False, with_sum_sq=False):
    """:func:`_logprobs_rows` over each position's kept set (sampling-mask replay; ``sampling_mask`` checked
    against the targets): only the kept entries of the logits are read (``ReplayTokenLogprobsFunction``)."""
    rows = as_rows(logits)
    logp, entropy, sum_sq = ReplayTokenLogprobsFunction.apply(
        rows, targets.reshape(rows.shape[:2]), sampling_mask.token_ids, sampling_mask.offsets, backend, transform,
        ignore_index, with_entropy, inplace_backward, with_sum_sq,
    )
    return logp.view(targets.shape), entropy.view(targets.shape), sum_sq.view(targets.shape) if with_sum_sq else sum_sq


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
    backend: str = "auto",
    process_group: Optional[Any] = None,
    reduce_hidden_grad: bool = False,
):
    """``log_softmax(z)[target]``, float32 [...], without materialising the softmax, where
    ``z = softcap * tanh(logit_scale * logits / softcap) / temperature`` (``logit_scale * logits /
    temperature`` without ``softcap``: Gemma's final-logit soft-capping, Cohere's logit scale).

    logits [..., V] fp16/bf16/fp32 (strided views fine, last dim contiguous); targets [...] int32/int64.
    ``temperature``: a float, or a tensor of shape ``[...]`` (one per token) or ``[...][:1]`` (one per
    sequence), finite and > 0 (a tensor holding a float gives the float's results bitwise).
    ``top_k`` / ``top_p``: the distribution a vLLM sampler draws from, ``softmax(z)`` truncated to the
    top-k, then to the top-p nucleus, and renormalised (vLLM 0.32's rules: ties at the k-th value kept,
    the largest token always kept; ``None``, ``top_k`` 0 / -1 / >= V and ``top_p`` 1 mean off); each a
    number, or a tensor of one value per sequence ``[...][:1]`` (as vLLM takes them per request) or per
    token ``[...]`` (``top_k`` integer, ``top_p`` floating; a row's "off" value leaves it untruncated); a
    target outside the kept set (or a kept one whose logit is -inf) gets ``-inf``, as vLLM's processed
    log-probs (``docs/api.md``).
    Returns ``logp``, or ``(logp,)`` + ``(entropy,)`` if ``return_entropy`` + ``(sum_probs_sq,)`` if
    ``return_sum_probs_sq``: the entropy and the (detached) sum of squared probabilities of the same
    distribution, float32 [...].
    Positions whose target is ``ignore_index`` give 0 and a zero gradient, and their logits are never
    read. Differentiable w.r.t. the logits through the log-prob and the entropy (first order: a double
    backward raises; the kept set is a constant; a -inf log-prob has no gradient); the gradient has
    the logits' dtype.

    ``process_group`` (a ``torch.distributed`` ProcessGroup): vocabulary-parallel, ``logits`` is this
    rank's contiguous shard ``[..., V_r]`` (shards in rank order) and ``targets`` are global ids, the
    same on every rank; the outputs are the whole vocabulary's, on every rank (``vocab_parallel``).
    ``reduce_hidden_grad`` (the fused-linear functions' option) must be False: logits have no ``d hidden``.
    ``sampling_mask`` (a :class:`grpo_kernels.SamplingMask`, one kept set per position of ``targets`` in
    row-major order): the distribution over each position's set instead (replay; only the kept entries
    are read; a target outside its set, or an empty set, gives ``-inf``); excludes ``top_k`` / ``top_p``.
    """
    V.check_choice("backend", backend, BACKENDS)
    kw = check_logprob_flags(ignore_index, return_entropy, return_sum_probs_sq, sampling_mask)
    vocab_parallel.check_reduce_hidden_grad(reduce_hidden_grad, None, from_logits=True)
    if process_group is not None and _several_ranks(group := vocab_parallel.check_group(process_group, backend)):
        return vocab_parallel.token_logprobs(
            logits, targets, group=group, backend=backend, temperature=temperature, softcap=softcap,
            logit_scale=logit_scale, top_k=top_k, top_p=top_p, ignore_index=kw.ignore_index,
            return_entropy=kw.return_entropy, return_sum_probs_sq=kw.return_sum_probs_sq, sampling_mask=kw.sampling_mask)
    if backend == "reference":  # the spec, on the whole vocabulary
        return reference.token_logprobs(
            logits, targets, temperature=temperature, softcap=softcap, logit_scale=logit_scale, top_k=top_k,
            top_p=top_p, ignore_index=kw.ignore_index, return_entropy=kw.return_entropy,
            return_sum_probs_sq=kw.return_sum_probs_sq, sampling_mask=kw.sampling_mask)
    logits = V.check_logits(logits)
    targets, transform = logprob_targets(kw, targets, logits.shape[:-1], logits.shape[-1], logits.device,
                                         temperature=temperature, softcap=softcap, logit_scale=logit_scale,
                                         top_k=top_k, top_p=top_p)
    sampling_mask = logprob_sampling_mask(kw, targets, transform, logits.shape[-1], logits.device)
    row_backend = backends.resolve(backend, logits.device)
    if sampling_mask is not None:
        logp, entropy, sum_sq = _replay_logprobs_rows(logits, targets, transform, kw.ignore_index, sampling_mask,
                                                      kw.return_entropy, row_backend,
                                                      with_sum_sq=kw.return_sum_probs_sq)
        return logprob_outputs(kw, logp, entropy, sum_sq)
    logp, entropy, sum_sq = _logprobs_rows(logits, targets, transform, kw.ignore_index, kw.return_entropy, row_backend,
                                           with_sum_sq=kw.return_sum_probs_sq)
    return logprob_outputs(kw, logp, entropy, sum_sq)


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
    backend: str = "auto",
    inplace_backward: bool = False,
    process_group: Optional[Any] = None,
    reduce_hidden_grad: bool = False,
) -> GRPOLossOutput:
    """The GRPO loss (every objective and reduction of ``docs/api.md``) from logits [B, T, V].

    The GRPO keywords are the fields of ``options.GRPOInputs`` (per-call tensors) and
    ``options.GRPOOptions`` (validated scalars; their help there and in ``docs/api.md``), and verl's
    spellings of them. Returns ``GRPOLossOutput(loss, per_token_logps, metrics)``: a 0-d
    float32 loss, the detached float32 [B, T] log-probs (0 where masked; reuse them as
    ``old_logps``) and 0-d metric tensors. Gradients flow to the logits only: advantages, old/ref
    log-probs and ``is_ratio`` are constants of the loss (detached), on every backend.
    ``inplace_backward=True`` writes the logits' gradient into the logits buffer (for trainers that
    do not reuse the logits), so the loss needs only O(B*T) extra memory; autograd raises if
    anything else still needs the logits' values. ``process_group``: vocabulary-parallel logits
    ``[B, T, V_r]``, as in :func:`token_logprobs`; every output is the whole vocabulary's.
    """
    V.check_choice("backend", backend, BACKENDS)
    inplace_backward = V.check_flag("inplace_backward", inplace_backward)
    vocab_parallel.check_reduce_hidden_grad(reduce_hidden_grad, None, from_logits=True)
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
        if process_group is not None and _several_ranks(group := vocab_parallel.check_group(process_group, backend)):
            return vocab_parallel.grpo_loss(logits, completion_ids, advantages, completion_mask, group=group,
                                            backend=backend, inplace_backward=inplace_backward, grpo_kwargs=grpo_kwargs)
        if backend == "reference":  # the spec, on the whole vocabulary (never in place)
            return reference.grpo_loss(logits, completion_ids, advantages, completion_mask, **grpo_kwargs)
        return _grpo_loss(logits, completion_ids, advantages, completion_mask, grpo_kwargs, backend, inplace_backward)
    except OptionError as e:  # named as the caller spelled it (verl's kl_loss_coef rather than beta)
        if not user_spelling(grpo_kwargs):
            raise
        raise e.respelled(user_spelling(grpo_kwargs)) from None


def _grpo_loss(logits, completion_ids, advantages, completion_mask, grpo_kwargs, backend: str,
               inplace_backward: bool) -> GRPOLossOutput:
    """:func:`grpo_loss` on one device, its keywords checked but the GRPO ones (``grpo_kwargs``)."""
    logits = V.check_logits(logits)
    inputs, options, mask, ids, transform = prepare_grpo("logits", logits.shape, logits.shape[-1], completion_ids,
                                                         advantages, completion_mask, grpo_kwargs)
    if inplace_backward:
        V.check_writable("logits", logits, [("completion_ids", completion_ids), ("advantages", advantages),
                                            ("completion_mask", completion_mask), ("old_logps", inputs.old_logps),
                                            ("ref_logps", inputs.ref_logps), ("is_ratio", inputs.is_ratio),
                                            ("segment_ids", inputs.segment_ids)])
    row_backend = backends.resolve(backend, logits.device)
    if inputs.sampling_mask is not None:  # replay: log-probs over the kept sets, then the shared objective
        logp, entropy, _ = _replay_logprobs_rows(logits, ids, transform, IGNORE_INDEX, inputs.sampling_mask, True,
                                                 row_backend, inplace_backward)
        return objective.grpo_loss_from_logprobs(logp, entropy, advantages, mask, inputs, options)
    if row_backend.fuses(options) and not objective.needs_logprobs_first(options, inputs):
        return _fused_grpo_loss(logits, ids, advantages, mask, row_backend, inputs, options, inplace_backward, transform)
    # Sequence-level terms (GSPO's ratio, vespo's weight), TRL's masks, verl's objectives, a truncation
    # (top-k / top-p: the tokens outside the kept set leave the loss first) and the torch path (no fused
    # epilogue): log-probs from the row kernel, then the O(B*T) maths of the objective.
    logp, entropy, _ = _logprobs_rows(logits, ids, transform, IGNORE_INDEX, True, row_backend, inplace_backward)
    return objective.grpo_loss_from_logprobs(logp, entropy, advantages, mask, inputs, options)


def _fused_grpo_loss(logits, ids, advantages, mask, row_backend, inputs: GRPOInputs, options: GRPOOptions,
                     inplace_backward, transform: LogitTransform) -> GRPOLossOutput:
    """Token-level GRPO on a backend whose kernel computes the loss in the log-prob pass
    (``FusedGRPOLossFunction``); the per-token weights (the reduction) and the metrics come from ``objective``."""
    rows = as_rows(logits)
    sequences = objective.Sequences(mask, inputs.segment_ids)
    # the rollout correction from the old log-probs (needs_logprobs_first is False: nothing reads logp)
    prep = objective.prepare(torch.zeros_like(mask), torch.zeros_like(mask), advantages, mask, inputs, options, sequences)
    call_inputs, inputs = inputs, prep.inputs
    weights = objective.token_weights(mask, options, inputs.num_items_in_batch, sequences, inputs.global_batch_size)
    bonus = objective.entropy_weights(mask, options, inputs, sequences)
    kl_weights = None  # verl: the KL reduced by loss_agg_mode, apart where the policy term's reduction differs
    spec = objective.loss_spec(options)
    if inputs.ref_logps is not None and spec.regulariser_reduction not in (None, spec.reduction):
        kl_weights = objective.regulariser_weights(mask, options, inputs, sequences).reshape(rows.shape[:2])
    adv = objective.per_token_advantages(advantages, mask)
    kernel_inputs = GRPOInputs(  # constants of the loss, masked positions already never read
        old_logps=None if inputs.old_logps is None else inputs.old_logps.detach(),
        ref_logps=None if inputs.ref_logps is None else inputs.ref_logps.detach(),
        is_ratio=None if inputs.is_ratio is None else inputs.is_ratio.detach(),
    )
    loss, logp, entropy, kl, clip = FusedGRPOLossFunction.apply(
        rows, ids.reshape(rows.shape[:2]), adv, weights, None if bonus is None else bonus.reshape(rows.shape[:2]),
        kl_weights, row_backend, kernel_inputs, options, IGNORE_INDEX, inplace_backward, transform,
    )
    logp, entropy, kl, clip = (x.view(ids.shape) for x in (logp, entropy, kl, clip))
    if options.is_verl:  # verl's metrics (per mode, ppo_kl on its log-ratio): the same formulas, no autograd
        with torch.no_grad():
            metrics = objective.grpo_loss_from_logprobs(logp, entropy, advantages, mask, call_inputs, options).metrics
    else:  # reductions of the per-token values the kernel wrote (clip: -1 low, +1 high)
        metrics = objective.loss_metrics(entropy, kl if inputs.ref_logps is not None else None, clip < 0, clip > 0,
                                         mask, options, sequences)
    metrics.update(prep.metrics)
    return GRPOLossOutput(loss, torch.where(mask != 0, logp, torch.zeros_like(logp)).detach(), metrics)


# --------------------------------------------------------------------------------------------------
# fused linear: hidden states and lm_head weight in, the [N, V] logits never exist at once
# --------------------------------------------------------------------------------------------------
def _fused_linear_rows(hidden, weight, bias, targets, transform: LogitTransform, ignore_index, with_entropy, chunk_size,
                       backend, accumulate_in_weight_dtype=False, with_sum_sq=False, fp32_logits=FP32_LOGITS_DEFAULT,
                       sampling_mask: Optional[SamplingMask] = None):
    """(logp, entropy, sum of squared probabilities or a 0-d 0) of ``hidden @ weight.T + bias`` with the
    shape of ``targets``; the backward recomputes each chunk's logits (4 matmuls). Only rows whose
    target is not ``ignore_index`` are read; ``transform``'s temperature a float or of ``targets``' shape."""
    row_backend = backends.resolve(backend, hidden.device)
    rows = linear_rows(hidden, weight, bias, targets, ignore_index, chunk_size, accumulate_in_weight_dtype, fp32_logits)
    if sampling_mask is not None:  # replay: only the kept rows of the weight (ReplayLinearTokenLogprobsFunction)
        kept = sampling_mask if rows.keep is None else sampling_mask.rows(rows.keep)
        logp, entropy, sum_sq = ReplayLinearTokenLogprobsFunction.apply(
            rows.hidden, weight, bias, rows.targets, kept.token_ids, kept.offsets, row_backend,
            take_transform(rows, transform), ignore_index, with_entropy, rows.chunk_size, rows.dtype,
            accumulate_in_weight_dtype, with_sum_sq,
        )
    else:
        logp, entropy, sum_sq = FusedLinearTokenLogprobsFunction.apply(
            rows.hidden, weight, bias, rows.targets, row_backend, take_transform(rows, transform), ignore_index,
            with_entropy, rows.chunk_size, rows.dtype, accumulate_in_weight_dtype, with_sum_sq,
        )
    sum_sq = scatter_rows(rows, sum_sq, targets.shape) if with_sum_sq else sum_sq
    return scatter_rows(rows, logp, targets.shape), scatter_rows(rows, entropy, targets.shape), sum_sq


def _fused_linear_grpo_in_forward(hidden, weight, bias, ids, advantages, mask, inputs: GRPOInputs,
                                  options: GRPOOptions, chunk_size, backend, accumulate_in_weight_dtype,
                                  transform: LogitTransform, fp32_logits: bool = FP32_LOGITS_DEFAULT) -> GRPOLossOutput:
    """Token-level GRPO from hidden states, its gradient formed in the forward (3 matmuls a chunk).

    The per-token coefficients come from autograd over ``objective.per_token_loss`` on fp32 leaf
    tensors of one chunk's log-probs and entropies (O(chunk) work): the objective is written once.
    """
    row_backend = backends.resolve(backend, hidden.device)
    rows = linear_rows(hidden, weight, bias, ids, IGNORE_INDEX, chunk_size, accumulate_in_weight_dtype, fp32_logits)
    shape = ids.shape
    sequences = objective.Sequences(mask, inputs.segment_ids)
    objective.check_spec_inputs(inputs, options, *shape)
    weights = take_rows(rows, objective.token_weights(mask, options, inputs.num_items_in_batch, sequences,
                                                       inputs.global_batch_size), shape)
    regulariser = take_rows(rows, objective.regulariser_weights(mask, options, inputs, sequences), shape)
    bonus = take_rows(rows, objective.entropy_weights(mask, options, inputs, sequences), shape)
    adv = take_rows(rows, objective.per_token_advantages(advantages, mask), shape)
    # the rollout correction's weights, once, before the chunks, when the call's constants give them
    # (with old_logps; any mode, the sequence-level ones included): then they act as is_ratio
    constant_weights = objective.constant_rollout_weights(inputs, mask, options, sequences)
    per_chunk_correction = options.rollout_correction is not None and constant_weights is None
    old, ref, is_ratio, rollout = (take_rows(rows, x, shape) for x in (
        inputs.old_logps, inputs.ref_logps, inputs.is_ratio if constant_weights is None else constant_weights,
        inputs.rollout_logps))

    def chunk_loss_of(logp: torch.Tensor, entropy: torch.Tensor, chunk: slice) -> torch.Tensor:
        """The weighted loss of one chunk's rows from their log-probs and entropies [c] (0-d)."""
        at = lambda x: None if x is None else x[chunk].unsqueeze(0)  # noqa: E731 ([1, c] rows, all valid)
        ones = torch.ones_like(at(adv))
        chunk_is_ratio = at(is_ratio)
        if per_chunk_correction:  # without old_logps: token-level here (is_token_local), from each token's logp
            chunk_is_ratio, _ = objective.rollout_correction(logp.unsqueeze(0), at(old), at(rollout), ones,
                                                             options, objective.Sequences(ones, None))
        terms = objective.policy_terms(
            logp.unsqueeze(0), entropy.unsqueeze(0), at(adv), ones,
            GRPOInputs(old_logps=at(old), ref_logps=at(ref), is_ratio=chunk_is_ratio), options,
        )
        return objective.weighted_loss(terms, entropy.unsqueeze(0), weights[chunk].unsqueeze(0), at(regulariser),
                                       at(bonus), options)

    def coefficients(logp: torch.Tensor, entropy: torch.Tensor, chunk: slice):
        if torch.compiler.is_compiling():
            # dynamo traces torch.func's grad (not torch.autograd.grad); an unused entropy gets zeros, not None
            (g_logp, g_entropy), chunk_loss = torch.func.grad_and_value(chunk_loss_of, argnums=(0, 1))(
                logp.detach(), entropy.detach(), chunk)
            return chunk_loss, g_logp, g_entropy
        with torch.enable_grad():
            logp_leaf = logp.detach().requires_grad_()
            entropy_leaf = entropy.detach().requires_grad_()
            chunk_loss = chunk_loss_of(logp_leaf, entropy_leaf, chunk)
            g_logp, g_entropy = torch.autograd.grad(chunk_loss, (logp_leaf, entropy_leaf), allow_unused=True)
        return chunk_loss.detach(), torch.zeros_like(logp) if g_logp is None else g_logp, g_entropy

    needs_grad = (rows.hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    loss, logp, entropy = FusedLinearGRPOLossFunction.apply(
        rows.hidden, weight, bias, rows.targets, coefficients, row_backend, take_transform(rows, transform),
        IGNORE_INDEX, rows.chunk_size, rows.dtype, needs_grad, accumulate_in_weight_dtype,
        bonus is not None,  # the only term with d loss / d entropy (objective.weighted_loss)
    )
    logp, entropy = scatter_rows(rows, logp, shape), scatter_rows(rows, entropy, shape)
    with torch.no_grad():  # metrics only: the same formulas, no autograd
        metrics = objective.grpo_loss_from_logprobs(logp, entropy, advantages, mask, inputs, options).metrics
    return GRPOLossOutput(loss, torch.where(mask != 0, logp, torch.zeros_like(logp)).detach(), metrics)


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
    chunk_size: Optional[int] = None,
    accumulate_in_weight_dtype: bool = False,
    fp32_logits: bool = FP32_LOGITS_DEFAULT,
    backend: str = "auto",
    process_group: Optional[Any] = None,
    reduce_hidden_grad: bool = False,
):
    """``token_logprobs(hidden @ weight.T + bias, targets)`` a chunk of rows at a time.

    hidden [..., H], weight [V, H] (``lm_head.weight``), bias [V] or None, targets [...]. Returns
    float32 [...] (and the entropy, and the sum of squared probabilities: ``return_entropy``,
    ``return_sum_probs_sq``), of the transformed logits as in :func:`token_logprobs` (``logit_scale``,
    then ``softcap``, then ``temperature``, a float or a tensor ``[...]`` / ``[...][:1]``), truncated by
    ``top_k`` / ``top_p`` as :func:`token_logprobs` truncates them. Gradients flow to hidden, weight and bias (in their dtypes); the
    backward recomputes each chunk's logits. Extra memory: ``chunk_size`` rows of logits (default:
    :func:`grpo_kernels.autograd.default_chunk_size`) plus, with gradients, the fp32 ``d W``
    accumulator, or one in the weight's dtype with ``accumulate_in_weight_dtype=True`` (half the
    memory for a bf16 head); each chunk's contribution is then rounded to bf16 as it is added, an error
    of ~2^-9 * sqrt(number of chunks) of the largest entry (benchmarks/results/accumulate_in_weight_dtype.md).
    Under autocast the matmuls run in autocast's dtype, forward and backward alike; gradients come back
    in each input's dtype. ``fp32_logits`` (default False: the chunk's logits in that dtype, rounded to
    bf16 for a bf16 head, as ``lm_head(hidden)`` gives them): True forms them from fp32 products, never
    rounded to 16 bits (verl's kernel's numerics; a transient fp32 copy of the weight per call;
    ``prepare.FP32_LOGITS_DEFAULT`` has the contract).
    ``process_group``: vocabulary-parallel, ``weight [V_r, H]`` (and ``bias [V_r]``) is this rank's
    shard (a DTensor ``Shard(0)`` on a 1-D mesh implies the group); ``d hidden`` is then this rank's
    partial sum (before the tensor-parallel all-reduce), or the full one with ``reduce_hidden_grad``.
    """
    V.check_choice("backend", backend, BACKENDS)
    kw = check_logprob_flags(ignore_index, return_entropy, return_sum_probs_sq, sampling_mask)
    chunk_size = V.check_chunk_size(chunk_size)
    accumulate_in_weight_dtype = V.check_flag("accumulate_in_weight_dtype", accumulate_in_weight_dtype)
    fp32_logits = V.check_flag("fp32_logits", fp32_logits)
    group, weight, bias, reduce_hidden_grad = _vocabulary_shard(process_group, weight, bias, reduce_hidden_grad,
                                                                backend)
    if _several_ranks(group):
        return vocab_parallel.fused_linear_token_logprobs(
            hidden, weight, targets, bias=bias, group=group, reduce_hidden_grad=reduce_hidden_grad,
            chunk_size=chunk_size, accumulate_in_weight_dtype=accumulate_in_weight_dtype, backend=backend,
            fp32_logits=fp32_logits, temperature=temperature, softcap=softcap, logit_scale=logit_scale, top_k=top_k,
            top_p=top_p, ignore_index=kw.ignore_index, return_entropy=kw.return_entropy,
            return_sum_probs_sq=kw.return_sum_probs_sq, sampling_mask=kw.sampling_mask)
    if backend == "reference":  # the spec: the whole [..., V] logits, then reference.token_logprobs
        return reference.fused_linear_token_logprobs(
            hidden, weight, targets, bias=bias, fp32_logits=fp32_logits, temperature=temperature, softcap=softcap,
            logit_scale=logit_scale, top_k=top_k, top_p=top_p, ignore_index=kw.ignore_index,
            return_entropy=kw.return_entropy, return_sum_probs_sq=kw.return_sum_probs_sq,
            sampling_mask=kw.sampling_mask)
    V.check_linear(hidden, weight, bias)
    targets, transform = logprob_targets(kw, targets, hidden.shape[:-1], weight.shape[0], hidden.device, "hidden",
                                         temperature=temperature, softcap=softcap, logit_scale=logit_scale,
                                         top_k=top_k, top_p=top_p)
    sampling_mask = logprob_sampling_mask(kw, targets, transform, weight.shape[0], hidden.device)
    logp, entropy, sum_sq = _fused_linear_rows(hidden, weight, bias, targets, transform, kw.ignore_index,
                                               kw.return_entropy, chunk_size, backend, accumulate_in_weight_dtype,
                                               kw.return_sum_probs_sq, fp32_logits, sampling_mask)
    return logprob_outputs(kw, logp, entropy, sum_sq)


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
    chunk_size: Optional[int] = None,
    accumulate_in_weight_dtype: bool = False,
    fp32_logits: bool = FP32_LOGITS_DEFAULT,
    backend: str = "auto",
    process_group: Optional[Any] = None,
    reduce_hidden_grad: bool = False,
) -> GRPOLossOutput:
    """``grpo_loss(hidden @ weight.T + bias, ...)`` without the [B*T, V] logits; hidden [B, T, H].

    Takes every GRPO keyword of :func:`grpo_loss`; gradients flow to hidden, weight and bias. When
    autograd needs them (grad mode on and an input requiring grad) and the loss is token-local
    (``objective.is_token_local``: a sequence-level ``rollout_correction`` is, given ``old_logps``), the
    gradient is formed in the forward (3 matmuls a chunk, nothing recomputed) and
    held until ``backward``: ``d hidden`` [N, H] and the ``d W`` accumulator (fp32, or the weight's
    dtype with ``accumulate_in_weight_dtype``), so a second backward through the same graph raises.
    GSPO (``importance_sampling_level="sequence"``) recomputes each chunk's logits in the backward;
    under ``no_grad`` only the forward runs. ``chunk_size`` rows per chunk (default:
    :func:`grpo_kernels.autograd.default_chunk_size`, from N, H, V and the device);
    ``accumulate_in_weight_dtype``, ``fp32_logits``, ``process_group`` and ``reduce_hidden_grad`` as in
    :func:`fused_linear_token_logprobs`.
    """
    V.check_choice("backend", backend, BACKENDS)
    chunk_size = V.check_chunk_size(chunk_size)
    accumulate_in_weight_dtype = V.check_flag("accumulate_in_weight_dtype", accumulate_in_weight_dtype)
    fp32_logits = V.check_flag("fp32_logits", fp32_logits)
    group, weight, bias, reduce_hidden_grad = _vocabulary_shard(process_group, weight, bias, reduce_hidden_grad,
                                                                backend)
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
        if _several_ranks(group):
            return vocab_parallel.fused_linear_grpo_loss(
                hidden, weight, completion_ids, advantages, completion_mask, bias=bias, group=group,
                reduce_hidden_grad=reduce_hidden_grad, chunk_size=chunk_size,
                accumulate_in_weight_dtype=accumulate_in_weight_dtype, backend=backend, grpo_kwargs=grpo_kwargs,
                fp32_logits=fp32_logits)
        if backend == "reference":  # the spec: the whole [B, T, V] logits, then reference.grpo_loss
            return reference.fused_linear_grpo_loss(hidden, weight, completion_ids, advantages, completion_mask,
                                                    bias=bias, fp32_logits=fp32_logits, **grpo_kwargs)
        return _fused_linear_grpo_loss(hidden, weight, bias, completion_ids, advantages, completion_mask, grpo_kwargs,
                                       chunk_size, accumulate_in_weight_dtype, fp32_logits, backend)
    except OptionError as e:  # named as the caller spelled it (verl's kl_loss_coef rather than beta)
        if not user_spelling(grpo_kwargs):
            raise
        raise e.respelled(user_spelling(grpo_kwargs)) from None


def _fused_linear_grpo_loss(hidden, weight, bias, completion_ids, advantages, completion_mask, grpo_kwargs,
                            chunk_size, accumulate_in_weight_dtype, fp32_logits, backend) -> GRPOLossOutput:
    """:func:`fused_linear_grpo_loss` on one device, its keywords checked but the GRPO ones (``grpo_kwargs``)."""
    V.check_linear(hidden, weight, bias)
    inputs, options, mask, ids, transform = prepare_grpo("hidden", hidden.shape, weight.shape[0], completion_ids,
                                                         advantages, completion_mask, grpo_kwargs)
    needs_grad = hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    # (a truncation's tokens outside the kept set leave the loss's normalisers, known only after the
    # log-probs: those calls take the backward that recomputes the logits)
    if (torch.is_grad_enabled() and needs_grad and objective.is_token_local(options, inputs) and not transform.truncates
            and inputs.sampling_mask is None):
        return _fused_linear_grpo_in_forward(hidden, weight, bias, ids, advantages, mask, inputs, options, chunk_size,
                                             backend, accumulate_in_weight_dtype, transform, fp32_logits)
    logp, entropy, _ = _fused_linear_rows(hidden, weight, bias, ids, transform, IGNORE_INDEX, True, chunk_size,
                                          backend, accumulate_in_weight_dtype, fp32_logits=fp32_logits,
                                          sampling_mask=inputs.sampling_mask)
    return objective.grpo_loss_from_logprobs(logp, entropy, advantages, mask, inputs, options)
