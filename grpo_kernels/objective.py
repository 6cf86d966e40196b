"""The GRPO objective: per-token loss, the reductions as per-token weights, and the metrics.

These O(tokens) functions are the one definition every backend uses once it has the per-token
log-probs and entropies (``reference``, the chunked torch path, the fused-linear path, GSPO). The
one other copy is the Triton epilogue in ``kernels/triton_grpo_epilogue.py`` (``grpo_loss_fwd_kernel``),
which evaluates the token-local terms inside the log-prob pass together with their derivatives
written out by hand; ``tests/test_objective.py`` checks its ``d loss / d logp`` against autograd of
:func:`per_token_loss`.

Masked positions (mask 0) are never read: every per-token input passes through a select before any
arithmetic, so a NaN or inf there reaches neither the loss, nor a gradient, nor a metric.

Sequences: without ``segment_ids`` each row is one sequence; with them (packed rows) the tokens of
a row sharing an id are one sequence, and sequences are found among the mask-1 positions only.

The policy terms are registered, one entry per loss mode with its whole vocabulary (reduction,
clipping, token-locality, metrics, Triton epilogue id), in ``loss_modes.py``; this module reads them
from there (:func:`loss_spec`, ``loss_modes.of``) and holds the reductions, the KL estimators, TRL's
masks and the metrics.

Objectives (``loss_type``; TRL's ``GRPOTrainer._compute_loss`` in trl 1.16 defines the same ones):
- grpo, bnpo, dr_grpo, dapo, luspo: PPO's clipped surrogate ``-min(r*A, clip(r)*A)`` (DeepSeekMath's
  GRPO; DAPO's clip-higher via ``eps_high``; two-sided clipping via ``delta``).
- cispo (MiniMax-M1 / ScaleRL): ``-sg(min(r, eps_high)) * A * logp``, a REINFORCE term whose
  importance weight is capped and detached.
- sapo (Soft Adaptive Policy Optimization): ``-(4 / tau) * sigmoid(tau * (r - 1)) * A`` with
  ``tau = sapo_temperature_pos`` where ``A > 0``, else ``sapo_temperature_neg``.
- vespo: ``-sg(phi(w)) * A * logp`` with the sequence weight ``w = exp(sum_t clamp(log r_t, -20, 20)
  [+ sum_t log is_ratio_t])`` clamped in log space to ``[log 1e-8, 20]`` and the gamma weight
  ``phi(w) = exp(lambda + k log w - lambda w)`` (``k, lambda`` by the sign of ``A``; ``phi(1) = 1``).
The k3 KL ``exp(ref - logp) - (ref - logp) - 1`` (Schulman) is added as ``beta * kl``, times the
importance ratio when ``use_bias_correction_kl``. ``is_ratio`` scales the policy term (for vespo it
enters ``w`` instead, as in TRL).
Reductions, with ``S`` sequences: grpo and sapo ``mean_s(sum_{t in s} L m / max(|s|, 1))``; bnpo
``sum L m / max(sum m, 1)``; dr_grpo ``sum L m / (S * max_completion_length)``; luspo the same
with length 1; dapo, cispo and vespo ``sum L m / num_items_in_batch`` (default ``max(sum m, 1)``).

verl's objectives (``loss_mode``: vanilla, gspo, sapo, gpg, cispo, clip_cov, kl_cov, geo_mean, dppo_tv,
dppo_kl, dro), reductions (``loss_agg_mode``) and KL estimators (``kl_loss_type``) are those of verl
0.9.1's ``core_algos`` (``compute_policy_loss_*``, ``agg_loss``, ``kl_penalty``), each registered
(objectives in ``loss_modes.py``, the others below) with its formula in its docstring
(``docs/api.md`` tabulates them). 0.9.1 differs from 0.9.0 in one place: GSPO's policy term is
reduced by ``loss_agg_mode`` (0.9.0 forced seq-mean-token-mean); sapo still forces seq-mean-token-mean.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import torch

from . import loss_modes
from .loss_modes import CAPPED_WEIGHT, PPO_CLIP, LossMode, PolicyInputs, PolicyTerms, masked_mean
from .options import IGNORE_INDEX, GRPOInputs, GRPOOptions


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


# --------------------------------------------------------------------------------------------------
# sequences: rows, or the segments of packed rows
# --------------------------------------------------------------------------------------------------
class Sequences:
    """Which sequence each position of a [B, T] batch belongs to.

    ``Sequences(mask, None)``: row ``b`` is sequence ``b`` (``count = B``). ``Sequences(mask,
    segment_ids)``: each distinct (row, id) among the mask-1 positions is a sequence (``count = S``).
    """

    def __init__(self, mask: torch.Tensor, segment_ids: Optional[torch.Tensor]) -> None:
        self.mask = mask
        self.packed = segment_ids is not None
        if not self.packed:
            self.count = mask.shape[0]
            return
        b, t = mask.shape
        valid = mask != 0
        rows = torch.arange(b, device=mask.device).unsqueeze(-1).expand(b, t)
        pairs = torch.stack((rows[valid], segment_ids[valid].long()), -1)
        unique, inverse = torch.unique(pairs, dim=0, return_inverse=True)
        self.count = unique.shape[0]
        self.index = torch.zeros(b, t, dtype=torch.long, device=mask.device).masked_scatter(valid, inverse)

    def per_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """``sum_{t in s} x`` for each sequence: [B] (rows) or [S] (packed); ``x`` is 0 where masked."""
        if not self.packed:
            return x.sum(-1)
        out = torch.zeros(self.count, dtype=x.dtype, device=x.device)
        return out.index_add(0, self.index[self.mask != 0], x[self.mask != 0])

    def broadcast(self, per_seq: torch.Tensor) -> torch.Tensor:
        """A value per sequence back onto positions: [B, 1] (rows) or [B, T] (packed)."""
        if not self.packed:
            return per_seq.unsqueeze(-1)
        if self.count == 0:  # no position has a sequence: nothing to spread (every weight is 0 there);
            # + the empty sum keeps the result in the graph, so the loss still has a (zero) gradient
            return torch.zeros(self.mask.shape, dtype=per_seq.dtype, device=per_seq.device) + per_seq.sum()
        return per_seq[self.index]

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Each position's sequence total of ``x`` (0 where masked): [B, 1] or [B, T]."""
        if not self.packed:
            return x.sum(-1, keepdim=True)
        return self.broadcast(self.per_sequence(x))

    def lengths(self) -> torch.Tensor:
        """Each position's sequence token count (the mask's sum), at least 1: [B, 1] or [B, T]."""
        return self.sum(self.mask).clamp(min=1.0)


# --------------------------------------------------------------------------------------------------
# per-token loss
# --------------------------------------------------------------------------------------------------
def per_token_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] or [B, T] advantages -> fp32 [B, 1] or [B, T], 0 where masked (never read there)."""
    adv = advantages.detach().float()
    if adv.dim() == 1:  # one per sequence: kept as a [B, 1] column, read for rows with a valid token
        return _where_valid((mask != 0).any(-1, keepdim=True), adv.unsqueeze(-1), 0.0)
    return _where_valid(mask, adv, 0.0)


def rollout_weights(is_ratio: Optional[torch.Tensor], mask: torch.Tensor) -> Optional[torch.Tensor]:
    """``is_ratio`` [B, T] or [B, 1] -> fp32 of the same shape, 1 where masked (never read there)."""
    if is_ratio is None:
        return None
    if is_ratio.shape[-1] == 1:  # one per row, read for rows with a valid token
        return _where_valid((mask != 0).any(-1, keepdim=True), is_ratio, 1.0)
    return _where_valid(mask, is_ratio, 1.0)


class TokenTerms(NamedTuple):
    loss: torch.Tensor  # [B, T] fp32, not yet weighted: the policy term (and, under loss_type, beta * KL)
    ratio: torch.Tensor  # importance ratio: [B, T], or per sequence ([B, 1] / [B, T])
    kl: Optional[torch.Tensor]  # [B, T] the KL estimate (k3 under loss_type), or None without ref_logps
    vespo_phi: Optional[torch.Tensor]  # vespo's detached sequence weight (a metric), else None


# --------------------------------------------------------------------------------------------------
# the registries of reductions and KL estimators (the loss modes' registry: loss_modes.py)
# --------------------------------------------------------------------------------------------------
class ReductionInputs(NamedTuple):
    mask: torch.Tensor
    sequences: "Sequences"
    options: GRPOOptions
    num_items_in_batch: Any
    global_batch_size: Any


REDUCTIONS: Dict[str, Callable[[ReductionInputs], torch.Tensor]] = {}


def register_reduction(name: str):
    """Register ``fn(ReductionInputs) -> weights [B, T]``, so that a reduced loss is ``sum(L * weights)``."""

    def decorate(fn):
        REDUCTIONS[name] = fn
        return fn

    return decorate


KL_ESTIMATORS: Dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {}


def register_kl(*names: str):
    """Register a KL estimator ``fn(logp, ref) -> [B, T]`` under each of ``names``."""

    def decorate(fn):
        for name in names:
            KL_ESTIMATORS[name] = fn
        return fn

    return decorate


# TRL's loss types: (objective, reduction)
def _as_number(x, device) -> Any:
    return x.to(device, torch.float32).reshape(()) if isinstance(x, torch.Tensor) else x


# ---- TRL's reductions (GRPOTrainer._compute_loss, trl 1.16)
@register_reduction("sequence_mean")  # grpo, sapo: mean over sequences of each one's token mean
def _sequence_mean(r: ReductionInputs) -> torch.Tensor:
    return r.mask / (r.sequences.lengths() * max(r.sequences.count, 1))


@register_reduction("token_mean")  # bnpo: the call's token mean
def _token_mean(r: ReductionInputs) -> torch.Tensor:
    return r.mask / r.mask.sum().clamp(min=1.0)


@register_reduction("constant_length")  # dr_grpo: sum / (sequences * max_completion_length)
def _constant_length(r: ReductionInputs) -> torch.Tensor:
    length = r.mask.shape[1] if r.options.max_completion_length is None else r.options.max_completion_length
    return r.mask / (max(r.sequences.count, 1) * length)


@register_reduction("sequence_sum_mean")  # luspo: sum / sequences
def _sequence_sum_mean(r: ReductionInputs) -> torch.Tensor:
    return r.mask / max(r.sequences.count, 1)


@register_reduction("global_token_mean")  # dapo, cispo, vespo: sum / num_items_in_batch
def _global_token_mean(r: ReductionInputs) -> torch.Tensor:
    if r.num_items_in_batch is None:
        return _token_mean(r)
    return r.mask / _as_number(r.num_items_in_batch, r.mask.device)


# ---- verl's agg_loss (verl 0.9.1, verl.trainer.ppo.core_algos): fully masked sequences are left out
# of the sequence count; num_items_in_batch is verl's batch_num_tokens, global_batch_size its own;
# every mode is multiplied by dp_size, and with dp_size > 1 the mode's global normaliser must be given
# (as verl raises). Where verl divides 0 by 0 (no token at all) the loss here is 0, not NaN.
def _verl_sequence_count(r: ReductionInputs) -> Any:
    if r.global_batch_size is not None:
        return _as_number(r.global_batch_size, r.mask.device)
    if r.options.dp_size > 1:
        raise ValueError(f"loss_agg_mode={r.options.loss_agg_mode!r} with dp_size={r.options.dp_size} needs "
                         f"global_batch_size (the global batch's sequence count), as verl's agg_loss")
    has_tokens = (r.sequences.per_sequence(r.mask) > 0).sum()
    return has_tokens.clamp(min=1).float()


@register_reduction("token-mean")  # sum L m / batch_num_tokens * dp_size
def _verl_token_mean(r: ReductionInputs) -> torch.Tensor:
    if r.num_items_in_batch is None and r.options.dp_size > 1:
        raise ValueError(f"loss_agg_mode='token-mean' with dp_size={r.options.dp_size} needs num_items_in_batch "
                         f"(verl: batch_num_tokens, the global batch's loss-token count), as verl's agg_loss")
    count = r.mask.sum().clamp(min=1.0) if r.num_items_in_batch is None else _as_number(r.num_items_in_batch, r.mask.device)
    return r.mask / count * r.options.dp_size


@register_reduction("token-sum")  # sum L m * dp_size (ranks averaging gradients then sum the global batch)
def _verl_token_sum(r: ReductionInputs) -> torch.Tensor:
    return r.mask * r.options.dp_size


@register_reduction("seq-mean-token-sum")  # sum_s (sum_t L m) / G * dp_size
def _verl_seq_mean_token_sum(r: ReductionInputs) -> torch.Tensor:
    return r.mask / _verl_sequence_count(r) * r.options.dp_size


@register_reduction("seq-mean-token-mean")  # sum_s (sum_t L m / (len_s + 1e-8)) / G * dp_size
def _verl_seq_mean_token_mean(r: ReductionInputs) -> torch.Tensor:
    lengths = r.sequences.sum(r.mask) + 1e-8  # verl's epsilon, not a clamp
    return r.mask / lengths / _verl_sequence_count(r) * r.options.dp_size


@register_reduction("seq-mean-token-sum-norm")  # seq-mean-token-sum / loss_scale_factor (verl >= 0.9)
def _verl_seq_mean_token_sum_norm(r: ReductionInputs) -> torch.Tensor:
    scale = r.mask.shape[-1] if r.options.max_completion_length is None else r.options.max_completion_length
    return _verl_seq_mean_token_sum(r) / scale


# ---- verl's KL estimators (core_algos.kl_penalty; J. Schulman, "Approximating KL divergence")
@register_kl("kl", "k1")
def _kl_k1(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return logp - ref


@register_kl("abs")
def _kl_abs(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (logp - ref).abs()


@register_kl("mse", "k2", "mse+", "k2+")  # k2's gradient is already the unbiased one: "+" changes nothing
def _kl_k2(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref).square()


@register_kl("low_var_kl", "k3")
def _kl_k3_clamped(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    d = torch.clamp(ref - logp, min=-20, max=20)
    return torch.clamp(torch.exp(d) - d - 1, min=-10, max=10)


def _straight_through(estimator: Callable) -> Callable:
    """verl's "+" variants: the value of ``estimator``, the gradient of k2."""

    def fn(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        k2 = 0.5 * (logp - ref).square()
        return k2 - k2.detach() + estimator(logp, ref).detach()

    return fn


for _name in ("kl", "k1", "abs", "low_var_kl", "k3"):
    KL_ESTIMATORS[_name + "+"] = _straight_through(KL_ESTIMATORS[_name])


def trl_k3(logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """TRL's KL: k3 without verl's clamps."""
    diff = ref - logp
    return torch.exp(diff) - diff - 1


# --------------------------------------------------------------------------------------------------
# the loss spec of a call, and the extra TRL masks and the rollout correction
# --------------------------------------------------------------------------------------------------
class LossSpec(NamedTuple):
    mode: LossMode  # the registered mode: its policy term, token-locality, metrics, epilogue
    reduction: str  # of the policy term
    regulariser_reduction: Optional[str]  # of the KL and entropy terms under loss_mode; None: TRL's rules


def loss_spec(options: GRPOOptions) -> LossSpec:
    """The (mode, reduction, KL/entropy reduction) that ``loss_type`` or ``loss_mode`` names: TRL's type
    fixes its reduction; verl's mode reduces by ``loss_agg_mode`` unless it forces one (sapo)."""
    mode = loss_modes.of(options)
    if not mode.is_verl:
        return LossSpec(mode, mode.reduction, None)
    return LossSpec(mode, mode.reduction or options.loss_agg_mode, options.loss_agg_mode)


def is_token_local(options: GRPOOptions, inputs: Optional[GRPOInputs] = None) -> bool:
    """Whether each token's ``d loss / d logp`` and ``d loss / d entropy`` depend on that token and
    constants only: token-level importance sampling, an objective without a sequence or batch
    coupling (GSPO's ratio, vespo's weight, clip_cov's and kl_cov's selections, geo_mean), and none
    of TRL's masks that need every token first (top_entropy_quantile, off_policy_mask_threshold).
    A sequence-level rollout correction couples a sequence's tokens through ``exp(sum_s (old -
    rollout))``, with ``old`` the current log-probs when the call has no ``old_logps``; given them
    (``inputs``, the call's tensors), its weights are constants (:func:`constant_rollout_weights`),
    so such a call is token-local; without ``inputs`` (a question about the options alone) it is not.
    Such a loss can be evaluated inside the log-prob pass (``backends.RowBackend.fuses``) and its
    gradient formed in the forward (``functional.fused_linear_grpo_loss``)."""
    sequence_correction = (options.rollout_correction or "").startswith("sequence")
    return (options.importance_sampling_level == "token" and loss_modes.of(options).token_local
            and options.top_entropy_quantile == 1.0 and options.off_policy_mask_threshold is None
            and not (sequence_correction and (inputs is None or inputs.old_logps is None)))


def needs_logprobs_first(options: GRPOOptions, inputs: GRPOInputs) -> bool:
    """Whether a call's constants (TRL's masks, the rollout correction without old log-probs) need the
    current log-probs or entropies of every token before any token's loss."""
    return (options.top_entropy_quantile < 1.0 or options.off_policy_mask_threshold is not None
            or (options.rollout_correction is not None and inputs.old_logps is None))


def rollout_correction(logp: torch.Tensor, old_logps: Optional[torch.Tensor], rollout_logps: torch.Tensor,
                       mask: torch.Tensor, options: GRPOOptions, sequences: "Sequences") -> Tuple[torch.Tensor, dict]:
    """TRL's vLLM importance-sampling correction: ``exp(old - rollout)`` per token [B, T], or per
    sequence of its summed difference ([B, 1] / [B, T] packed), then truncated to [min, max] or
    zeroed outside it; ``old`` defaults to the detached current log-probs. A rollout log-prob that is
    NaN (the engine could not score the token) counts as no difference. Returns (ratio, metrics)."""
    with torch.no_grad():
        old = logp.detach() if old_logps is None else torch.where(mask != 0, old_logps.detach().float(), logp.detach())
        rollout = rollout_logps.detach().float()
        diff = torch.where(mask != 0, old - rollout, torch.zeros((), device=mask.device)).nan_to_num(nan=0.0)
        sequence_level = options.rollout_correction.startswith("sequence")
        ratio = torch.exp(sequences.sum(diff) if sequence_level else diff)
        low, high = options.rollout_correction_min, options.rollout_correction_max
        if options.rollout_correction.endswith("truncate"):
            if low is not None or high is not None:  # (None and None: unbounded both ways, nothing to clamp)
                ratio = torch.clamp(ratio, min=low, max=high)
        else:
            outside = (ratio < (-math.inf if low is None else low)) | (ratio > (math.inf if high is None else high))
            ratio = ratio.masked_fill(outside, 0.0)
        valid = mask != 0
        delta = (old - rollout).abs()
        delta_on = valid & ~torch.isnan(delta)  # TRL leaves out the tokens the engine could not score
        if sequence_level:
            values = ratio.expand_as(mask) if sequences.packed else ratio
            on = valid if sequences.packed else torch.ones_like(ratio, dtype=torch.bool)
            if sequences.packed:  # one value per sequence: each sequence's tokens share it
                values = sequences.broadcast(sequences.per_sequence(ratio * mask) / sequences.per_sequence(mask).clamp(min=1))
        else:
            values, on = ratio, valid
        metrics = {
            "sampling/sampling_logp_difference/mean": _masked_stat(delta, delta_on, "mean"),
            "sampling/sampling_logp_difference/max": _masked_stat(delta, delta_on, "max"),
            "sampling/importance_sampling_ratio/min": _masked_stat(values, on, "min"),
            "sampling/importance_sampling_ratio/mean": _masked_stat(values, on, "mean"),
            "sampling/importance_sampling_ratio/max": _masked_stat(values, on, "max"),
        }
    return ratio, metrics


def constant_rollout_weights(inputs: GRPOInputs, mask: torch.Tensor, options: GRPOOptions,
                             sequences: "Sequences") -> Optional[torch.Tensor]:
    """The rollout correction's weights of a call that gives ``old_logps``, from its constants alone:
    :func:`rollout_correction` of ``old_logps`` and ``rollout_logps`` (the current log-probs are not
    read: ``old`` replaces them at every mask-1 position, and a mask-0 one adds nothing), so the
    same tensor, bit for bit, as the call's own correction after its log-probs. [B, T] (token
    level, or packed sequences) or [B, 1]; None without a correction or without ``old_logps``."""
    if options.rollout_correction is None or inputs.old_logps is None:
        return None
    unread = torch.zeros_like(mask)  # (stands in for the current log-probs where the mask is 0)
    return rollout_correction(unread, inputs.old_logps, inputs.rollout_logps, mask, options, sequences)[0]


def _masked_stat(values: torch.Tensor, on: torch.Tensor, kind: str) -> torch.Tensor:
    """mean / min / max of ``values`` where ``on``; 0 where nothing is on (as TRL logs an empty set).
    Masked rather than indexed, so no shape depends on the data (torch.compile needs no graph break)."""
    count = on.sum()
    if kind == "mean":
        out = torch.where(on, values, torch.zeros((), device=values.device)).sum() / count.clamp(min=1)
    else:
        fill = math.inf if kind == "min" else -math.inf
        picked = torch.where(on, values, torch.full((), fill, device=values.device))
        out = picked.amin() if kind == "min" else picked.amax()
    return torch.where(count > 0, out, torch.zeros((), device=values.device))


def off_policy_mask(logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, inputs: GRPOInputs,
                    options: GRPOOptions, sequences: "Sequences") -> torch.Tensor:
    """TRL's off-policy sequence mask (DeepSeek-V3.2): 1 where ``A >= 0`` or the sequence's mean
    ``sampling - logp`` is at most the threshold, else 0; the sampling log-probs are ``rollout_logps``,
    else ``old_logps``, else the detached current ones (the mask then keeps everything)."""
    with torch.no_grad():
        sampling = inputs.rollout_logps if inputs.rollout_logps is not None else inputs.old_logps
        sampling = logp.detach() if sampling is None else sampling.detach().float()
        kl = torch.where(mask != 0, sampling - logp.detach(), torch.zeros((), device=mask.device)).nan_to_num(nan=0.0)
        mean_kl = sequences.sum(kl * mask) / sequences.lengths()
        return ((adv >= 0) | (mean_kl <= options.off_policy_mask_threshold)).float()


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """TRL's entropy mask (Beyond the 80/20 Rule): 1 at the tokens whose entropy is at least the
    ``1 - quantile`` quantile (``torch.quantile``, linear) of the completion tokens' entropies."""
    with torch.no_grad():
        valid = (mask != 0).reshape(-1)
        # torch.quantile's linear interpolation over the valid entries, written with a sort so that no
        # shape depends on the data (the invalid entries sort last, as +inf)
        values = torch.where(valid, entropy.detach().float().reshape(-1), torch.full((), math.inf, device=mask.device))
        ordered = values.sort().values
        count = valid.sum()
        position = (1 - quantile) * (count - 1).clamp(min=0).float()
        below = position.floor().long()
        above = position.ceil().long()
        v_below, v_above = ordered.gather(0, below.reshape(1))[0], ordered.gather(0, above.reshape(1))[0]
        threshold = torch.lerp(v_below, v_above, position - below.float())
        keep = (entropy.detach() * mask >= threshold) & (mask != 0)
        return torch.where(count > 0, keep, torch.zeros_like(keep)).float()


# --------------------------------------------------------------------------------------------------
# per-token loss
# --------------------------------------------------------------------------------------------------
def per_token_loss(
    logp: torch.Tensor, entropy: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    inputs: GRPOInputs, options: GRPOOptions, sequences: Optional[Sequences] = None,
    policy_mask: Optional[torch.Tensor] = None,
) -> TokenTerms:
    """:func:`policy_terms` as :class:`TokenTerms` (loss, ratio, kl, vespo_phi)."""
    return TokenTerms(*policy_terms(logp, entropy, advantages, mask, inputs, options, sequences, policy_mask)[:4])


def policy_terms(
    logp: torch.Tensor, entropy: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    inputs: GRPOInputs, options: GRPOOptions, sequences: Optional[Sequences] = None,
    policy_mask: Optional[torch.Tensor] = None,
) -> PolicyTerms:
    """The policy loss of every token, float32 [B, T] (to be weighted by :func:`token_weights`), with the
    importance ratio and the KL estimate. Under ``loss_type`` the loss includes ``beta * k3`` (as TRL
    adds it before reducing); under ``loss_mode`` the KL term is reduced apart (:func:`reduce_loss`).
    ``policy_mask`` (TRL's off-policy and entropy masks, [B, 1] / [B, T]) scales the policy term
    only. The entropy bonus is not here: it has its own weights (:func:`entropy_weights`).
    ``logp`` and ``entropy`` must be 0 where the mask is 0."""
    sequences = sequences or Sequences(mask, inputs.segment_ids)
    adv = per_token_advantages(advantages, mask)
    mode = loss_modes.of(options)
    is_ratio = rollout_weights(inputs.is_ratio, mask)
    old = logp.detach() if inputs.old_logps is None else torch.where(mask != 0, inputs.old_logps.detach().float(), logp.detach())
    terms = mode.policy_term(PolicyInputs(logp, old, adv, mask, sequences, is_ratio, options))
    loss = terms.loss
    if policy_mask is not None:
        loss = loss * policy_mask
    if is_ratio is not None and mode.weights_by_is_ratio:
        loss = loss * is_ratio
    kl = None
    if inputs.ref_logps is not None:
        ref = _where_valid(mask, inputs.ref_logps, 0.0)
        if options.is_verl:
            kl = KL_ESTIMATORS[options.kl_loss_type](logp, ref)
        else:
            diff = ref - logp
            kl = torch.exp(diff) - diff - 1
            if options.use_bias_correction_kl:
                kl = kl * terms.ratio
            if options.beta != 0:
                loss = loss + options.beta * kl
    return terms._replace(loss=loss, kl=kl)


def token_weights(mask: torch.Tensor, options: GRPOOptions, num_items_in_batch=None,
                  sequences: Optional[Sequences] = None, global_batch_size=None) -> torch.Tensor:
    """Float32 [B, T]: each token's weight in the reduced policy loss, so that ``loss = sum(L * weight)``
    (the reduction table in this module's docstring)."""
    sequences = sequences or Sequences(mask, None)
    return REDUCTIONS[loss_spec(options).reduction](
        ReductionInputs(mask, sequences, options, num_items_in_batch, global_batch_size))


def regulariser_weights(mask: torch.Tensor, options: GRPOOptions, inputs: GRPOInputs,
                        sequences: Sequences) -> Optional[torch.Tensor]:
    """Under ``loss_mode``: the weights of the KL and entropy terms (``loss_agg_mode``'s, as verl's
    ``ppo_loss`` reduces them); None under ``loss_type`` (TRL's rules)."""
    name = loss_spec(options).regulariser_reduction
    if name is None:
        return None
    return REDUCTIONS[name](ReductionInputs(mask, sequences, options, inputs.num_items_in_batch, inputs.global_batch_size))


def entropy_weights(mask: torch.Tensor, options: GRPOOptions, inputs: GRPOInputs, sequences: Sequences,
                    entropy_mask: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """``u`` [B, T] with the entropy bonus ``-entropy_coef * sum(H * u)``; None when ``entropy_coef`` is 0.
    TRL: the token mean over the completion mask times the entropy mask, for every loss type;
    verl: ``loss_agg_mode``'s weights."""
    if options.entropy_coef == 0:
        return None
    verl = regulariser_weights(mask, options, inputs, sequences)
    if verl is not None:
        return verl * options.entropy_coef
    effective = mask if entropy_mask is None else mask * entropy_mask
    return effective / effective.sum().clamp(min=1.0) * options.entropy_coef


def weighted_loss(terms: PolicyTerms, entropy: torch.Tensor, policy_weights: torch.Tensor,
                  kl_weights: Optional[torch.Tensor], bonus_weights: Optional[torch.Tensor],
                  options: GRPOOptions) -> torch.Tensor:
    """The reduced loss: ``sum(L w)`` (or the objective's own reduction), ``+ beta sum(KL w_kl)``
    under ``loss_mode``, ``- sum(H u)`` for the entropy bonus."""
    reduced = getattr(terms, "reduced", None)
    loss = reduced if reduced is not None else (terms.loss * policy_weights).sum()
    if kl_weights is not None and terms.kl is not None and options.beta != 0:
        loss = loss + options.beta * (terms.kl * kl_weights).sum()
    if bonus_weights is not None:
        loss = loss - (entropy * bonus_weights).sum()
    return loss


# --------------------------------------------------------------------------------------------------
# metrics
# --------------------------------------------------------------------------------------------------
def clip_flags(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
               options: GRPOOptions) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(low, high) clip flags as TRL counts them, by the type's clipping (``loss_modes``): PPO's clipped
    surrogate ``r < 1 - eps_low`` with ``A < 0`` and ``r > 1 + eps_high`` with ``A > 0``; a capped weight
    (cispo) (None, ``r > eps_high`` with ``A > 0``); else, and under ``loss_mode`` (verl's flags are the
    policy term's own), (None, None)."""
    adv = per_token_advantages(advantages, mask)
    clipping = None if options.is_verl else loss_modes.of(options).clipping
    if clipping == PPO_CLIP:
        return (ratio < 1 - options.eps_low) & (adv < 0), (ratio > 1 + options.eps_high) & (adv > 0)
    if clipping == CAPPED_WEIGHT:
        return None, (ratio > options.eps_high) & (adv > 0)
    return None, None


def loss_metrics(entropy: torch.Tensor, kl: Optional[torch.Tensor], low: Optional[torch.Tensor],
                 high: Optional[torch.Tensor], mask: torch.Tensor, options: GRPOOptions,
                 sequences: Optional[Sequences] = None, vespo_phi: Optional[torch.Tensor] = None) -> dict:
    """What TRL logs, as 0-d detached float32 tensors: masked means over completion tokens of
    ``kl`` and ``entropy``; the clip fractions of the flags from :func:`clip_flags` (with
    ``importance_sampling_level="sequence"`` they count sequences, not tokens);
    ``clip_ratio/low_min`` / ``high_max``, the smallest / largest per-sequence clip fraction;
    cispo's ``cispo_clip_ratio`` and vespo's ``vespo/phi_seq_mean``: those of the loss type's
    ``metrics`` (``loss_modes``; none under ``loss_mode``: :func:`verl_metrics`)."""
    with torch.no_grad():
        sequences = sequences or Sequences(mask, None)
        count = mask.sum().clamp(min=1.0)
        per_sequence_level = options.importance_sampling_level == "sequence"

        def token_mean(x: torch.Tensor) -> torch.Tensor:
            return (_where_valid(mask, x.float().expand_as(mask), 0.0) * mask).sum() / count

        def seq_fractions(flag: torch.Tensor) -> torch.Tensor:
            """Each sequence's fraction of flagged tokens; NaN for a sequence without tokens."""
            flagged = sequences.per_sequence(_where_valid(mask, flag.float().expand_as(mask), 0.0) * mask)
            return flagged / sequences.per_sequence(mask)

        def clip_mean(flag: torch.Tensor) -> torch.Tensor:
            if not per_sequence_level:
                return token_mean(flag)
            return seq_fractions(flag).nan_to_num(0.0).sum() / max(sequences.count, 1)

        def seq_extreme(flag: torch.Tensor, extreme) -> torch.Tensor:
            fractions = seq_fractions(flag)
            if per_sequence_level and not sequences.packed:  # TRL: one flag per row, empty rows included
                fractions = fractions.nan_to_num(0.0)
            return _nan_extreme(fractions, extreme)

        def vespo_mean() -> torch.Tensor:
            if vespo_phi.shape[-1] == 1:  # one weight per row: TRL's mean over rows
                return vespo_phi.sum() / max(vespo_phi.shape[0], 1)
            return token_mean(vespo_phi)

        trl_metrics = {  # each metric a loss type may log (loss_modes.TRL_METRICS), computed if it does
            "clip_ratio/low_mean": lambda: clip_mean(low),
            "clip_ratio/high_mean": lambda: clip_mean(high),
            "clip_ratio/region_mean": lambda: clip_mean(low | high),
            "clip_ratio/low_min": lambda: seq_extreme(low, torch.min),
            "clip_ratio/high_max": lambda: seq_extreme(high, torch.max),
            "cispo_clip_ratio": lambda: clip_mean(high),
            "vespo/phi_seq_mean": vespo_mean,
        }
        metrics = {}
        if kl is not None:
            metrics["kl"] = token_mean(kl)
        metrics["entropy"] = token_mean(entropy)
        if not options.is_verl:
            for name in loss_modes.of(options).metrics:
                metrics[name] = trl_metrics[name]()
    return {k: v.detach().float() for k, v in metrics.items()}


def _nan_extreme(values: torch.Tensor, extreme) -> torch.Tensor:
    """min / max over the non-NaN entries; NaN when there are none (as TRL's nanmin / nanmax)."""
    # masked, not indexed: no data-dependent shape (torch.compile traces it without a graph break)
    nan = torch.isnan(values)
    fill = math.inf if extreme is torch.min else -math.inf
    if values.numel() == 0:
        return torch.full((), float("nan"), device=values.device)
    out = extreme(torch.where(nan, torch.full((), fill, device=values.device), values))
    return torch.where(nan.all(), torch.full((), float("nan"), device=values.device), out)


def verl_metrics(terms: PolicyTerms, entropy: torch.Tensor, mask: torch.Tensor, options: GRPOOptions,
                 regulariser: torch.Tensor) -> dict:
    """What verl's actor logs, as 0-d detached tensors: the policy metrics the mode's
    ``compute_policy_loss_*`` returns (``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``:
    masked means, 0 where the mode has no such flag), and ``actor/entropy`` and ``actor/kl_loss`` reduced
    by ``loss_agg_mode``."""
    with torch.no_grad():
        logs = loss_modes.of(options).metrics
        zero = torch.zeros((), device=mask.device)
        flags = {"actor/pg_clipfrac": terms.high, "actor/pg_clipfrac_lower": terms.low, "actor/ppo_kl": terms.ppo_kl}
        metrics = {name: zero if flags[name] is None else masked_mean(_where_valid(mask, flags[name].float(), 0.0), mask)
                   for name in logs}
        metrics["actor/entropy"] = (entropy.detach() * regulariser).sum()
        if terms.kl is not None:
            metrics["actor/kl_loss"] = (terms.kl.detach() * regulariser).sum()
    return metrics


def metrics_of_terms(terms: PolicyTerms, entropy: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                     options: GRPOOptions, sequences: Sequences) -> dict:
    """:func:`loss_metrics` of :func:`per_token_loss`'s terms."""
    low, high = clip_flags(terms.ratio.detach(), advantages, mask, options)
    return loss_metrics(entropy.detach(), None if terms.kl is None else terms.kl.detach(), low, high, mask, options,
                        sequences, terms.vespo_phi)


class Prepared(NamedTuple):
    """A call's inputs after TRL's masks and the rollout correction: ``inputs.is_ratio`` holds the
    corrected ratio; ``policy_mask`` scales the policy term, ``entropy_mask`` the bonus too."""

    inputs: GRPOInputs
    policy_mask: Optional[torch.Tensor]
    entropy_mask: Optional[torch.Tensor]
    metrics: dict


def check_spec_inputs(inputs: GRPOInputs, options: GRPOOptions, b: int, t: int) -> None:
    """The per-call tensors the chosen options need (ValueError naming the keyword)."""
    if options.rollout_correction is not None:
        if inputs.rollout_logps is None:
            raise ValueError(f"rollout_correction={options.rollout_correction!r} needs rollout_logps [{b}, {t}] "
                             f"(the rollout engine's log-probs)")
        if inputs.is_ratio is not None:
            raise ValueError("is_ratio and rollout_correction both weight the policy term: pass one of them")
        if options.loss_type == "vespo" and options.rollout_correction.startswith("sequence"):
            raise ValueError("vespo takes a token-level rollout_correction ('token_truncate' or 'token_mask'), as in TRL")
    for name in ("rollout_logps",):
        x = getattr(inputs, name)
        if x is not None and (not isinstance(x, torch.Tensor) or tuple(x.shape) != (b, t) or not x.is_floating_point()):
            raise ValueError(f"{name} must be a float tensor of shape [{b}, {t}], got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")


def prepare(logp: torch.Tensor, entropy: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
            inputs: GRPOInputs, options: GRPOOptions, sequences: Sequences) -> Prepared:
    """TRL's off-policy and entropy masks and the rollout correction of a call (all constants of the loss)."""
    check_spec_inputs(inputs, options, *mask.shape)
    metrics = {}
    if options.rollout_correction is not None:
        ratio, metrics = rollout_correction(logp, inputs.old_logps, inputs.rollout_logps, mask, options, sequences)
        inputs = GRPOInputs(**{**{k: getattr(inputs, k) for k in inputs.__dataclass_fields__}, "is_ratio": ratio})
    policy_mask = entropy_mask = None
    if options.off_policy_mask_threshold is not None:
        policy_mask = off_policy_mask(logp, per_token_advantages(advantages, mask), mask, inputs, options, sequences)
    if options.top_entropy_quantile < 1.0:
        entropy_mask = high_entropy_mask(entropy, mask, options.top_entropy_quantile)
        policy_mask = entropy_mask if policy_mask is None else policy_mask * entropy_mask
    return Prepared(inputs, policy_mask, entropy_mask, metrics)


OUTSIDE_KEPT_SET = "sampling/outside_kept_set"


def leave_out_outside_kept_set(logp: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor,
                               inputs: GRPOInputs) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Under a truncation (``top_k`` / ``top_p``) or a replay (``sampling_mask``), the tokens outside a
    distribution's kept set leave the loss.

    A token whose log-prob is ``-inf`` (the current one, or the given ``old_logps``, ``ref_logps`` or
    ``rollout_logps``: a policy under which the sampler could not have drawn it) would give an infinite
    ratio or KL: it is masked out, as if its mask were 0 (every reduction and metric then leaves it
    out), its log-prob and entropy replaced by 0 through a select (no gradient reaches its logits).
    Returns ``(logp, entropy, mask, share)``: ``share`` the 0-d fraction of the mask's tokens left out
    (:data:`OUTSIDE_KEPT_SET`), weighted as the mask weighs them."""
    valid = mask != 0
    outside = logp.detach() == float("-inf")
    for given in (inputs.old_logps, inputs.ref_logps, inputs.rollout_logps):
        if given is not None:
            outside = outside | (given.detach() == float("-inf")).expand_as(outside)
    outside = outside & valid
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    share = (torch.where(outside, mask, zero).sum() / mask.sum().clamp(min=1.0)).detach().float()  # (as every token mean)
    return (torch.where(outside, zero, logp), torch.where(outside, zero, entropy),
            torch.where(outside, torch.zeros_like(mask), mask), share)


def grpo_loss_from_logprobs(logp: torch.Tensor, entropy: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                            inputs: GRPOInputs, options: GRPOOptions) -> GRPOLossOutput:
    """Everything after the log-probs: per-token loss, reduction and metrics (arguments checked).
    Under a truncation the tokens outside a kept set leave the loss first
    (:func:`leave_out_outside_kept_set`; metric :data:`OUTSIDE_KEPT_SET`); ``per_token_logps`` keeps
    their -inf."""
    given_logp, given_mask, outside_share = logp, mask, None
    if options.transform.truncates or inputs.sampling_mask is not None:
        logp, entropy, mask, outside_share = leave_out_outside_kept_set(logp, entropy, mask, inputs)
    sequences = Sequences(mask, inputs.segment_ids)
    prep = prepare(logp, entropy, advantages, mask, inputs, options, sequences)
    inputs = prep.inputs
    terms = policy_terms(logp, entropy, advantages, mask, inputs, options, sequences, prep.policy_mask)
    weights = token_weights(mask, options, inputs.num_items_in_batch, sequences, inputs.global_batch_size)
    regulariser = regulariser_weights(mask, options, inputs, sequences)
    bonus = entropy_weights(mask, options, inputs, sequences, prep.entropy_mask)
    reduced = weighted_loss(terms, entropy, weights, regulariser, bonus, options)
    metrics = metrics_of_terms(terms, entropy, advantages, mask, options, sequences)
    if options.is_verl:
        metrics.update(verl_metrics(terms, entropy, mask, options, regulariser))
    metrics.update({k: v.detach().float() for k, v in prep.metrics.items()})
    if outside_share is not None:
        metrics[OUTSIDE_KEPT_SET] = outside_share
    per_token_logps = torch.where(given_mask != 0, given_logp.detach(), torch.zeros_like(given_logp))
    return GRPOLossOutput(reduced, per_token_logps, metrics)
