"""The GRPO objective: per-token loss, the reductions as per-token weights, and the metrics.

These O(tokens) functions are the one definition every backend uses once it has the per-token
log-probs and entropies (``reference``, the chunked torch path, the fused-linear path, GSPO). The
one other copy is the Triton epilogue in ``kernels/triton_rows.py`` (``grpo_loss_fwd_kernel``),
which evaluates the token-local terms inside the log-prob pass together with their derivatives
written out by hand; ``tests/test_objective.py`` checks its ``d loss / d logp`` against autograd of
:func:`per_token_loss`.

Masked positions (mask 0) are never read: every per-token input passes through a select before any
arithmetic, so a NaN or inf there reaches neither the loss, nor a gradient, nor a metric.

Sequences: without ``segment_ids`` each row is one sequence; with them (packed rows) the tokens of
a row sharing an id are one sequence, and sequences are found among the mask-1 positions only.

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
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import torch

from .options import CLIPPED_LOSS_TYPES, IGNORE_INDEX, GRPOInputs, GRPOOptions


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
def is_token_local(options: GRPOOptions) -> bool:
    """Whether each token's ``d loss / d logp`` and ``d loss / d entropy`` depend on that token and
    constants only: token-level importance sampling and an objective without a sequence weight
    (GSPO's ratio and vespo's weight couple a sequence's tokens). Such a loss can be evaluated inside
    the log-prob pass (``backends.RowBackend.fuses``) and its gradient formed in the forward
    (``functional.fused_linear_grpo_loss``)."""
    return options.importance_sampling_level == "token" and options.loss_type != "vespo"


def per_token_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] or [B, T] advantages -> fp32 [B, 1] or [B, T], 0 where masked (never read there)."""
    adv = advantages.detach().float()
    if adv.dim() == 1:  # one per sequence: kept as a [B, 1] column, read for rows with a valid token
        return _where_valid(mask.amax(-1, keepdim=True), adv.unsqueeze(-1), 0.0)
    return _where_valid(mask, adv, 0.0)


def rollout_weights(is_ratio: Optional[torch.Tensor], mask: torch.Tensor) -> Optional[torch.Tensor]:
    """``is_ratio`` [B, T] or [B, 1] -> fp32 of the same shape, 1 where masked (never read there)."""
    if is_ratio is None:
        return None
    if is_ratio.shape[-1] == 1:  # one per row, read for rows with a valid token
        return _where_valid(mask.amax(-1, keepdim=True), is_ratio, 1.0)
    return _where_valid(mask, is_ratio, 1.0)


def log_importance_ratio(logp: torch.Tensor, old_logps: Optional[torch.Tensor], mask: torch.Tensor, level: str,
                         sequences: Optional[Sequences] = None) -> torch.Tensor:
    """``log(ratio)``: [B, T] per token, or per sequence (GSPO: masked mean of the log-ratio) as
    [B, 1] (rows) or [B, T] (packed). ``old_logps=None`` is on-policy (value 0, gradient 1)."""
    old = logp.detach() if old_logps is None else torch.where(mask != 0, old_logps.detach().float(), logp.detach())
    log_ratio = logp - old
    if level == "sequence":
        sequences = sequences or Sequences(mask, None)
        return sequences.sum(log_ratio * mask) / sequences.lengths()
    return log_ratio


def vespo_weight(log_ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, is_ratio: Optional[torch.Tensor],
                 options: GRPOOptions, sequences: Sequences) -> torch.Tensor:
    """VESPO's detached gamma weight ``phi(w)`` of each position's sequence (TRL's get_gamma_weights)."""
    with torch.no_grad():
        log_w = sequences.sum(torch.clamp(log_ratio, -20.0, 20.0) * mask)
        log_floor = math.log(1e-8)
        if is_ratio is not None:  # the rollout engine's ratio enters w (in log space), not the loss
            log_is = torch.clamp(torch.log(is_ratio), log_floor, 20.0)
            log_w = log_w + (log_is if is_ratio.shape[-1] == 1 else sequences.sum(log_is * mask))
        log_w = torch.clamp(log_w, log_floor, 20.0)
        nonneg = adv >= 0
        k = torch.where(nonneg, options.vespo_k_pos, options.vespo_k_neg)
        lam = torch.where(nonneg, options.vespo_lambda_pos, options.vespo_lambda_neg).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


class TokenTerms(NamedTuple):
    loss: torch.Tensor  # [B, T] fp32, not yet weighted
    ratio: torch.Tensor  # importance ratio: [B, T], or per sequence ([B, 1] / [B, T])
    kl: Optional[torch.Tensor]  # [B, T] k3 KL (bias-corrected when asked), or None without ref_logps
    vespo_phi: Optional[torch.Tensor]  # vespo's detached sequence weight (a metric), else None


def per_token_loss(
    logp: torch.Tensor, entropy: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    inputs: GRPOInputs, options: GRPOOptions, sequences: Optional[Sequences] = None,
) -> TokenTerms:
    """The loss of every token, float32 [B, T] (to be weighted by :func:`token_weights`), with the
    importance ratio and the k3 KL. ``logp`` and ``entropy`` must be 0 where the mask is 0."""
    sequences = sequences or Sequences(mask, inputs.segment_ids)
    adv = per_token_advantages(advantages, mask)
    ratio = torch.exp(log_importance_ratio(logp, inputs.old_logps, mask, options.importance_sampling_level, sequences))
    is_ratio = rollout_weights(inputs.is_ratio, mask)
    vespo_phi = None
    loss_type = options.loss_type
    if loss_type in CLIPPED_LOSS_TYPES:
        clipped = torch.clamp(ratio, 1 - options.eps_low, 1 + options.eps_high)
        unclipped = torch.clamp(ratio, max=options.delta) if options.delta is not None else ratio
        loss = -torch.min(unclipped * adv, clipped * adv)
    elif loss_type == "cispo":
        loss = -torch.clamp(ratio, max=options.eps_high).detach() * adv * logp
    elif loss_type == "sapo":
        tau = torch.where(adv > 0, options.sapo_temperature_pos, options.sapo_temperature_neg)
        loss = -torch.sigmoid(tau * (ratio - 1)) * (4 / tau) * adv
    elif loss_type == "vespo":
        log_ratio_token = log_importance_ratio(logp, inputs.old_logps, mask, "token")
        vespo_phi = vespo_weight(log_ratio_token, adv, mask, is_ratio, options, sequences)
        loss = -vespo_phi * adv * logp
    else:
        raise AssertionError(f"unhandled loss_type {loss_type!r}")  # GRPOOptions validated it
    if is_ratio is not None and loss_type != "vespo":
        loss = loss * is_ratio
    kl = None
    if inputs.ref_logps is not None:
        diff = _where_valid(mask, inputs.ref_logps, 0.0) - logp
        kl = torch.exp(diff) - diff - 1
        if options.use_bias_correction_kl:
            kl = kl * ratio
        if options.beta != 0:
            loss = loss + options.beta * kl
    if options.entropy_coef != 0:
        loss = loss - options.entropy_coef * entropy
    return TokenTerms(loss, ratio, kl, vespo_phi)


def token_weights(mask: torch.Tensor, options: GRPOOptions, num_items_in_batch=None,
                  sequences: Optional[Sequences] = None) -> torch.Tensor:
    """Float32 [B, T]: each token's weight in the reduced loss, so that ``loss = sum(L * weight)``
    (the reduction table in this module's docstring)."""
    loss_type = options.loss_type
    if loss_type in ("grpo", "sapo"):
        sequences = sequences or Sequences(mask, None)
        return mask / (sequences.lengths() * max(sequences.count, 1))
    if loss_type == "bnpo" or (num_items_in_batch is None and loss_type in ("dapo", "cispo", "vespo")):
        return mask / mask.sum().clamp(min=1.0)
    if loss_type in ("dr_grpo", "luspo"):
        count = (sequences or Sequences(mask, None)).count
        length = 1 if loss_type == "luspo" else (mask.shape[1] if options.max_completion_length is None else options.max_completion_length)
        return mask / (max(count, 1) * length)
    if loss_type in ("dapo", "cispo", "vespo"):
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(mask.device, torch.float32).reshape(())
        return mask / num_items_in_batch
    raise AssertionError(f"unhandled loss_type {loss_type!r}")  # GRPOOptions validated it


# --------------------------------------------------------------------------------------------------
# metrics
# --------------------------------------------------------------------------------------------------
def clip_flags(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
               options: GRPOOptions) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(low, high) clip flags as TRL counts them: for the clipped objectives ``r < 1 - eps_low`` with
    ``A < 0`` and ``r > 1 + eps_high`` with ``A > 0``; for cispo (None, ``r > eps_high`` with ``A > 0``)."""
    adv = per_token_advantages(advantages, mask)
    if options.loss_type in CLIPPED_LOSS_TYPES:
        return (ratio < 1 - options.eps_low) & (adv < 0), (ratio > 1 + options.eps_high) & (adv > 0)
    if options.loss_type == "cispo":
        return None, (ratio > options.eps_high) & (adv > 0)
    return None, None


def loss_metrics(entropy: torch.Tensor, kl: Optional[torch.Tensor], low: Optional[torch.Tensor],
                 high: Optional[torch.Tensor], mask: torch.Tensor, options: GRPOOptions,
                 sequences: Optional[Sequences] = None, vespo_phi: Optional[torch.Tensor] = None) -> dict:
    """What TRL logs, as 0-d detached float32 tensors: masked means over completion tokens of
    ``kl`` and ``entropy``; the clip fractions of the flags from :func:`clip_flags` (with
    ``importance_sampling_level="sequence"`` they count sequences, not tokens);
    ``clip_ratio/low_min`` / ``high_max``, the smallest / largest per-sequence clip fraction;
    cispo's ``cispo_clip_ratio`` and vespo's ``vespo/phi_seq_mean``."""
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

        metrics = {}
        if kl is not None:
            metrics["kl"] = token_mean(kl)
        metrics["entropy"] = token_mean(entropy)
        if options.loss_type in CLIPPED_LOSS_TYPES:
            metrics["clip_ratio/low_mean"] = clip_mean(low)
            metrics["clip_ratio/high_mean"] = clip_mean(high)
            metrics["clip_ratio/region_mean"] = clip_mean(low | high)
            low_seq, high_seq = seq_fractions(low), seq_fractions(high)
            if per_sequence_level and not sequences.packed:  # TRL: one flag per row, empty rows included
                low_seq, high_seq = low_seq.nan_to_num(0.0), high_seq.nan_to_num(0.0)
            metrics["clip_ratio/low_min"] = _nan_extreme(low_seq, torch.min)
            metrics["clip_ratio/high_max"] = _nan_extreme(high_seq, torch.max)
        elif options.loss_type == "cispo":
            metrics["cispo_clip_ratio"] = clip_mean(high)
        elif options.loss_type == "vespo":
            if vespo_phi.shape[-1] == 1:  # one weight per row: TRL's mean over rows
                metrics["vespo/phi_seq_mean"] = vespo_phi.sum() / max(vespo_phi.shape[0], 1)
            else:
                metrics["vespo/phi_seq_mean"] = token_mean(vespo_phi)
    return {k: v.detach().float() for k, v in metrics.items()}


def _nan_extreme(values: torch.Tensor, extreme) -> torch.Tensor:
    """min / max over the non-NaN entries; NaN when there are none (as TRL's nanmin / nanmax)."""
    finite = values[~torch.isnan(values)]
    return extreme(finite) if finite.numel() else torch.full((), float("nan"), device=values.device)


def metrics_of_terms(terms: TokenTerms, entropy: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                     options: GRPOOptions, sequences: Sequences) -> dict:
    """:func:`loss_metrics` of :func:`per_token_loss`'s terms."""
    low, high = clip_flags(terms.ratio.detach(), advantages, mask, options)
    return loss_metrics(entropy.detach(), None if terms.kl is None else terms.kl.detach(), low, high, mask, options,
                        sequences, terms.vespo_phi)


def grpo_loss_from_logprobs(logp: torch.Tensor, entropy: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                            inputs: GRPOInputs, options: GRPOOptions) -> GRPOLossOutput:
    """Everything after the log-probs: per-token loss, reduction and metrics (arguments checked)."""
    sequences = Sequences(mask, inputs.segment_ids)
    terms = per_token_loss(logp, entropy, advantages, mask, inputs, options, sequences)
    reduced = (terms.loss * token_weights(mask, options, inputs.num_items_in_batch, sequences)).sum()
    metrics = metrics_of_terms(terms, entropy, advantages, mask, options, sequences)
    per_token_logps = torch.where(mask != 0, logp.detach(), torch.zeros_like(logp))
    return GRPOLossOutput(reduced, per_token_logps, metrics)
