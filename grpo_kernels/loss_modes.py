"""The loss modes: one registered entry per mode carries its whole vocabulary.

A loss mode is a name a caller picks the loss by: TRL's ``loss_type`` (``grpo``, ``dapo``, ...; trl 1.16's
``GRPOTrainer._compute_loss``) or verl's ``loss_mode`` (``vanilla``, ``gspo``, ...; verl 0.9.1's
``core_algos.compute_policy_loss_*``). Each is one :class:`LossMode`, registered by decorating its policy
term, as verl's ``@register_policy_loss`` does::

    @register_loss_mode(loss_mode="gpg", metrics=(), epilogue=4)
    def _verl_gpg(x: PolicyInputs) -> PolicyTerms:
        '''GPG: ``-logp A``.'''
        return PolicyTerms(-x.logp * x.adv.expand_as(x.mask), torch.exp(x.logp - x.old).detach(), None)

The entry holds everything the library says about the mode: its name (and vocabulary), its
reduction (TRL's: fixed by the loss type; verl's: ``loss_agg_mode`` unless the mode forces one), its
clipping kind, whether it is token-local, the metrics it logs, its Triton epilogue id (``None``: not
fused) and its policy term. Every other statement of the vocabulary is read from here:

- ``options``: the choices of ``loss_type`` / ``loss_mode`` (:data:`options.LOSS_TYPES`,
  :data:`options.LOSS_MODES`; so ``GRPOConfig`` and the command lines too), the clipped and
  token-normalised types, the divergence-clipped modes and their ``eps_low`` range, verl's
  ``clip_ratio_c`` defaults: live views (:class:`RegisteredNames`, :class:`RegisteredValues`) of the
  registry, so a mode registered later is a choice at once;
- ``objective``: the policy term, the reduction, token-locality (``is_token_local``), the clip
  flags and the metrics (TRL's and verl's);
- ``kernels/triton_rows.py``: which modes fuse, and the epilogue's ``OBJECTIVE`` id (with
  ``clamps_log_ratio``); the epilogue itself is ``kernels/triton_grpo_epilogue.py``;
- ``grpo`` (the trainer): which TRL types divide by a token count (``TOKEN_NORMALISED_LOSS_TYPES``);
- ``docs/api.md``'s tables (``tests/test_loss_modes.py`` holds them equal to the registry).

A new mode is one decorated function here (or anywhere, before its first use), plus, to run in the
one-pass Triton forward, its branch of ``grpo_loss_fwd_kernel`` under a new epilogue id, checked
against autograd of the policy term by ``tests/test_triton_rows.py``. (One thing is read once, when
``options`` is imported: the modes whose ``eps_low`` may reach 1 or beyond, which ``bounds.option``
copies.)

Each entry has one name in one vocabulary: the modes that share a name across the two (``cispo``,
``sapo``) are different losses (verl's clamps the log-ratio, clips cispo's weight to a range and
forces sapo's reduction), so each vocabulary registers its own; one policy term may back several
entries (TRL's clipped surrogate: grpo, bnpo, dr_grpo, dapo, luspo, which differ in reduction).

This module imports no other module of the package (``options`` imports it for the choices), so the
policy terms, and the few helpers they share, live here; ``objective`` holds the reductions, the KL
estimators, TRL's masks and the metrics. ``options`` is annotated as ``Any``: a ``GRPOOptions``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, NamedTuple, Optional, Tuple

import torch

# --------------------------------------------------------------------------------------------------
# what a policy term reads and returns
# --------------------------------------------------------------------------------------------------
class PolicyInputs(NamedTuple):
    """What an objective reads. ``logp`` [B, T] (differentiable), ``old`` [B, T] (detached; the
    current log-probs where no old ones were given), ``adv`` [B, 1] or [B, T], ``mask`` [B, T],
    ``is_ratio`` (the rollout weights, constants: [B, T] / [B, 1], or None); all 0 (1) where masked."""

    logp: torch.Tensor
    old: torch.Tensor
    adv: torch.Tensor
    mask: torch.Tensor
    sequences: Any  # an objective.Sequences
    is_ratio: Optional[torch.Tensor]
    options: Any  # a GRPOOptions


class PolicyTerms(NamedTuple):
    """A policy term's per-token loss [B, T] (not yet weighted), importance ratio and KL (None: the
    common code adds it), and what some objectives add: clip flags for verl's metrics, and the
    reduced policy loss of an objective that reduces itself (verl's geo_mean), and the values of verl's
    ``actor/ppo_kl``."""

    loss: torch.Tensor
    ratio: torch.Tensor
    kl: Optional[torch.Tensor]
    vespo_phi: Optional[torch.Tensor] = None
    low: Optional[torch.Tensor] = None  # verl's actor/pg_clipfrac_lower flags (None: the metric is 0)
    high: Optional[torch.Tensor] = None  # verl's actor/pg_clipfrac flags (None: 0)
    reduced: Optional[torch.Tensor] = None
    ppo_kl: Optional[torch.Tensor] = None  # [B, T] what verl's actor/ppo_kl averages (-log r, as the mode clamps it)


# --------------------------------------------------------------------------------------------------
# the registry
# --------------------------------------------------------------------------------------------------
LOSS_TYPE, LOSS_MODE = "loss_type", "loss_mode"  # the two vocabularies: the option that names a mode

# Clipping kinds: how a mode bounds its importance ratio (and so what eps_low / eps_high / delta mean).
PPO_CLIP = "ppo"  # PPO's clipped surrogate, the ratio clipped to [1 - eps_low, 1 + eps_high]
DUAL_CLIP = "ppo+dual"  # PPO's, and where A < 0 the loss at most -A delta (verl's clip_ratio_c)
CAPPED_WEIGHT = "capped_weight"  # a detached weight min(r, eps_high) (TRL's cispo)
CLIPPED_WEIGHT = "clipped_weight"  # a detached weight clip(r, 1 - eps_low, 1 + eps_high); eps_low = 1: no floor
DIVERGENCE = "divergence"  # DPPO: eps_low / eps_high are divergence thresholds (any >= 0), delta the weight's cap
LOG_RATIO_CLIP = "log_ratio"  # GMPO: the log-ratio clipped to [-eps_low, eps_high] on the advantage's side
NO_CLIP = "none"
CLIPPINGS = (PPO_CLIP, DUAL_CLIP, CAPPED_WEIGHT, CLIPPED_WEIGHT, DIVERGENCE, LOG_RATIO_CLIP, NO_CLIP)

# The metrics a mode may log besides kl and entropy (``objective.loss_metrics`` / ``verl_metrics``).
TRL_CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                    "clip_ratio/high_max")  # PPO_CLIP's flags
TRL_METRICS = TRL_CLIP_METRICS + ("cispo_clip_ratio", "vespo/phi_seq_mean")
VERL_POLICY_METRICS = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")
# TRL's reductions that divide by a token count (the call's, or num_items_in_batch): a trainer
# splitting a batch into micro-batches passes the whole batch's count (grpo.trainer.loss_normalisation)
TOKEN_COUNT_REDUCTIONS = ("token_mean", "global_token_mean")


@dataclass(frozen=True)
class LossMode:
    """One loss mode: its name, in TRL's vocabulary (``loss_type``) or verl's (``loss_mode``), and
    everything the library derives from it.

    ``policy_term``: ``fn(PolicyInputs) -> PolicyTerms``, the per-token policy loss (its formula in its
    docstring). ``reduction``: TRL's reduction of the type (``objective.REDUCTIONS``); under verl one
    the mode always uses for its policy term (verl's sapo), None for ``loss_agg_mode``. ``clipping``:
    one of :data:`CLIPPINGS`. ``token_local``: each token's loss depends on that token and constants
    only (no sequence or batch coupling). ``weights_by_is_ratio``: the common code multiplies the
    policy term by ``is_ratio`` (else the term uses it). ``metrics``: what it logs besides kl and
    entropy (:data:`TRL_METRICS` / :data:`VERL_POLICY_METRICS`). ``epilogue``: the ``OBJECTIVE`` id of
    its branch in the Triton epilogue (``grpo_loss_fwd_kernel``), None when not fused;
    ``clamps_log_ratio``: that branch reads verl's ``exp(clamp(logp - old, -20, 20))``.
    ``clip_ratio_c``: verl's default ``clip_ratio_c`` (``delta``) for the mode, None where it reads none.
    """

    name: str
    vocabulary: str  # LOSS_TYPE or LOSS_MODE
    policy_term: Callable[["PolicyInputs"], "PolicyTerms"]
    reduction: Optional[str] = None
    clipping: str = NO_CLIP
    token_local: bool = True
    weights_by_is_ratio: bool = True
    metrics: Tuple[str, ...] = ()
    epilogue: Optional[int] = None
    clamps_log_ratio: bool = False
    clip_ratio_c: Optional[float] = None

    @property
    def is_verl(self) -> bool:
        return self.vocabulary == LOSS_MODE

    @property
    def token_normalised(self) -> bool:
        """TRL's: divides by a token count (:data:`TOKEN_COUNT_REDUCTIONS`; dapo, bnpo, cispo, vespo)."""
        return not self.is_verl and self.reduction in TOKEN_COUNT_REDUCTIONS

    @property
    def fused(self) -> bool:
        """Has a branch in the Triton epilogue."""
        return self.epilogue is not None


REGISTRY: Dict[Tuple[str, str], LossMode] = {}  # (vocabulary, name) -> mode, in registration order


def register_loss_mode(*, loss_type: Optional[str] = None, loss_mode: Optional[str] = None,
                       reduction: Optional[str] = None, clipping: str = NO_CLIP, token_local: bool = True,
                       weights_by_is_ratio: bool = True, metrics: Optional[Tuple[str, ...]] = None,
                       epilogue: Optional[int] = None, clamps_log_ratio: bool = False,
                       clip_ratio_c: Optional[float] = None) -> Callable[[Callable], Callable]:
    """Register the decorated policy term ``fn(PolicyInputs) -> PolicyTerms`` as a loss mode named
    ``loss_type`` (TRL's vocabulary: ``reduction`` required) or ``loss_mode`` (verl's: ``metrics``
    defaults to :data:`VERL_POLICY_METRICS`); the other fields are :class:`LossMode`'s. Returns the
    function unchanged, so one term may be registered under several names (TRL's clipped surrogate).
    A name taken in its vocabulary, or a field outside its choices, is a ValueError."""
    if (loss_type is None) == (loss_mode is None):
        raise ValueError("register_loss_mode takes one name: loss_type= (TRL's vocabulary) or loss_mode= (verl's)")
    vocabulary, name = (LOSS_TYPE, loss_type) if loss_mode is None else (LOSS_MODE, loss_mode)
    if (vocabulary, name) in REGISTRY:
        raise ValueError(f"{vocabulary} {name!r} is registered already")
    if vocabulary == LOSS_TYPE and reduction is None:
        raise ValueError(f"loss_type {name!r} needs its reduction (one of objective.REDUCTIONS)")
    if clipping not in CLIPPINGS:
        raise ValueError(f"clipping must be one of {CLIPPINGS}, got {clipping!r}")
    if metrics is None:
        metrics = VERL_POLICY_METRICS if vocabulary == LOSS_MODE else ()
    known = VERL_POLICY_METRICS if vocabulary == LOSS_MODE else TRL_METRICS
    if not set(metrics) <= set(known):
        raise ValueError(f"metrics of a {vocabulary} are among {known}, got {tuple(metrics)}")

    def decorate(fn: Callable) -> Callable:
        REGISTRY[vocabulary, name] = LossMode(name, vocabulary, fn, reduction, clipping, token_local,
                                              weights_by_is_ratio, tuple(metrics), epilogue, clamps_log_ratio,
                                              clip_ratio_c)
        return fn

    return decorate


def unregister_loss_mode(*, loss_type: Optional[str] = None, loss_mode: Optional[str] = None) -> LossMode:
    """Remove a mode (a test's or a plug-in's); returns its entry."""
    key = (LOSS_TYPE, loss_type) if loss_mode is None else (LOSS_MODE, loss_mode)
    return REGISTRY.pop(key)


def find(loss_type: Optional[str], loss_mode: Optional[str]) -> Optional[LossMode]:
    """The mode ``loss_mode`` names (verl's, when given), else the one ``loss_type`` names; None if unregistered."""
    return REGISTRY.get((LOSS_MODE, loss_mode) if loss_mode is not None else (LOSS_TYPE, loss_type))


def of(options: Any) -> LossMode:
    """The mode a ``GRPOOptions`` names (checked when built: it is registered)."""
    mode = find(options.loss_type, options.loss_mode)
    if mode is None:  # (unregistered after the options were built)
        raise ValueError(f"loss_type={options.loss_type!r} / loss_mode={options.loss_mode!r}: no such loss mode")
    return mode


class RegisteredNames(Sequence):
    """The names of one vocabulary's registered modes (those ``where`` accepts), in registration order,
    read from the registry at each use: a tuple that follows the registry (``==`` a tuple of the same
    names, printed as one). ``options.LOSS_TYPES`` and the other name lists are such views."""

    def __init__(self, vocabulary: str, where: Optional[Callable[[LossMode], bool]] = None) -> None:
        self.vocabulary, self.where = vocabulary, where

    def names(self) -> Tuple[str, ...]:
        return tuple(name for (vocabulary, name), mode in REGISTRY.items()
                     if vocabulary == self.vocabulary and (self.where is None or self.where(mode)))

    def __getitem__(self, index):
        return self.names()[index]

    def __len__(self) -> int:
        return len(self.names())

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __contains__(self, name: object) -> bool:
        return name in self.names()

    def __eq__(self, other: object) -> bool:
        return self.names() == tuple(other) if isinstance(other, (tuple, list, RegisteredNames)) else NotImplemented

    __hash__ = None  # type: ignore[assignment]  (it changes with the registry)

    def __add__(self, other) -> Tuple[str, ...]:
        return self.names() + tuple(other)

    def __radd__(self, other) -> Tuple[str, ...]:
        return tuple(other) + self.names()

    def __repr__(self) -> str:
        return repr(self.names())


class RegisteredValues(Mapping):
    """name -> ``value(mode)`` for one vocabulary's registered modes whose value is not None, read from
    the registry at each use (``options.VERL_CLIP_RATIO_C_DEFAULTS``)."""

    def __init__(self, vocabulary: str, value: Callable[[LossMode], Any]) -> None:
        self.vocabulary, self.value = vocabulary, value

    def items_now(self) -> Dict[str, Any]:
        return {name: self.value(mode) for (vocabulary, name), mode in REGISTRY.items()
                if vocabulary == self.vocabulary and self.value(mode) is not None}

    def __getitem__(self, name: str) -> Any:
        return self.items_now()[name]

    def __contains__(self, name: object) -> bool:  # (no try / except KeyError: plain for torch.compile)
        return name in self.items_now()

    def __iter__(self) -> Iterator[str]:
        return iter(self.items_now())

    def __len__(self) -> int:
        return len(self.items_now())

    def __repr__(self) -> str:
        return repr(self.items_now())


# --------------------------------------------------------------------------------------------------
# helpers of the policy terms
# --------------------------------------------------------------------------------------------------
def log_importance_ratio(logp: torch.Tensor, old_logps: Optional[torch.Tensor], mask: torch.Tensor, level: str,
                         sequences: Any = None) -> torch.Tensor:
    """``log(ratio)``: [B, T] per token, or per sequence (GSPO: masked mean of the log-ratio) as
    [B, 1] (rows) or [B, T] (packed; ``sequences``, an ``objective.Sequences``, is read at that
    level only). ``old_logps=None`` is on-policy (value 0, gradient 1)."""
    old = logp.detach() if old_logps is None else torch.where(mask != 0, old_logps.detach().float(), logp.detach())
    log_ratio = logp - old
    if level == "sequence":
        return sequences.sum(log_ratio * mask) / sequences.lengths()
    return log_ratio


def vespo_weight(log_ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, is_ratio: Optional[torch.Tensor],
                 options: Any, sequences: Any) -> torch.Tensor:
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


def _sapo_gate(ratio: torch.Tensor, adv: torch.Tensor, options: Any) -> torch.Tensor:
    tau = torch.where(adv > 0, options.sapo_temperature_pos, options.sapo_temperature_neg)
    return -torch.sigmoid(tau * (ratio - 1)) * (4 / tau) * adv


def _verl_log_ratio(x: PolicyInputs, clamp: bool = True) -> torch.Tensor:
    log_ratio = x.logp - x.old
    return torch.clamp(log_ratio, min=-20.0, max=20.0) if clamp else log_ratio


def _verl_adv(x: PolicyInputs) -> torch.Tensor:
    return x.adv.expand_as(x.mask)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's masked_mean: ``sum(x m) / (sum(m) + 1e-8)``."""
    return (values * mask).sum() / (mask.sum() + 1e-8)


def _dppo(x: PolicyInputs, trusted: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> PolicyTerms:
    """DPPO (arXiv 2602.04879): ``-A sg(min(r, c)) logp`` on the tokens whose probability moved less than
    the divergence threshold in the advantage's direction (``trusted(p, p_old, adv)``, detached), a
    truncated importance weight (``c = delta``, verl's clip_ratio_c, default 20) instead of a dual clip."""
    o, adv = x.options, _verl_adv(x)
    log_ratio = _verl_log_ratio(x)
    ratio = torch.exp(log_ratio)
    truncated = torch.clamp(ratio, max=o.delta).detach()
    with torch.no_grad():
        valid = trusted(torch.exp(x.logp), torch.exp(x.old), adv)
    loss = -adv * truncated * x.logp * valid.float()
    # verl's metrics: pg_clipfrac the untrusted tokens, pg_clipfrac_lower the truncated trusted ones
    return PolicyTerms(loss, ratio, None, low=(ratio > o.delta) & valid, high=~valid, ppo_kl=-log_ratio.detach())


def _covariance(adv: torch.Tensor, logp: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """kl_cov's centred covariance ``(A - mean A)(logp - mean logp)`` [B, T], the means over the valid
    tokens (verl: ``.mean()`` of the valid entries; here masked sums, so that no shape depends on the
    data); 0 at the others."""
    count = valid.sum().clamp(min=1)
    zero = torch.zeros((), dtype=adv.dtype, device=adv.device)
    mean_a = torch.where(valid, adv, zero).sum() / count
    mean_logp = torch.where(valid, logp, zero).sum() / count
    return torch.where(valid, (adv - mean_a) * (logp - mean_logp), zero)


def _first_k(keys: torch.Tensor, eligible: torch.Tensor, k: torch.Tensor, descending: bool) -> torch.Tensor:
    """Bool [B, T]: the ``k`` (a 0-d tensor) eligible positions that come first when ``keys`` are sorted
    (a stable sort over every position, the ineligible last): ``torch.topk`` / an index draw whose size
    is a tensor, so the graph has no data-dependent shape (torch.compile traces it whole)."""
    last = -math.inf if descending else math.inf
    flat = torch.where(eligible, keys, torch.full((), last, dtype=keys.dtype, device=keys.device)).reshape(-1)
    order = torch.sort(flat, descending=descending, stable=True).indices
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return (rank < k).reshape(keys.shape) & eligible


def _verl_count(fraction: float, total: torch.Tensor) -> torch.Tensor:
    """verl's ``max(int(fraction * total), 1)`` as a 0-d tensor, in float64 as Python computes it."""
    return torch.floor(total.double() * fraction).clamp(min=1)


# --------------------------------------------------------------------------------------------------
# TRL's loss types (GRPOTrainer._compute_loss, trl 1.16): each an objective and a reduction
# --------------------------------------------------------------------------------------------------
def _trl_clipped(x: PolicyInputs) -> PolicyTerms:
    """PPO's clipped surrogate ``-min(r A, clip(r) A)``, the ratio capped at ``delta`` (two-sided)."""
    o = x.options
    ratio = torch.exp(log_importance_ratio(x.logp, x.old, x.mask, o.importance_sampling_level, x.sequences))
    clipped = torch.clamp(ratio, 1 - o.eps_low, 1 + o.eps_high)
    unclipped = torch.clamp(ratio, max=o.delta) if o.delta is not None else ratio
    return PolicyTerms(-torch.min(unclipped * x.adv, clipped * x.adv), ratio, None)


_CLIPPED = dict(clipping=PPO_CLIP, metrics=TRL_CLIP_METRICS, epilogue=0)
register_loss_mode(loss_type="grpo", reduction="sequence_mean", **_CLIPPED)(_trl_clipped)
register_loss_mode(loss_type="bnpo", reduction="token_mean", **_CLIPPED)(_trl_clipped)
register_loss_mode(loss_type="dr_grpo", reduction="constant_length", **_CLIPPED)(_trl_clipped)
register_loss_mode(loss_type="dapo", reduction="global_token_mean", **_CLIPPED)(_trl_clipped)
register_loss_mode(loss_type="luspo", reduction="sequence_sum_mean", **_CLIPPED)(_trl_clipped)


@register_loss_mode(loss_type="cispo", reduction="global_token_mean", clipping=CAPPED_WEIGHT, metrics=("cispo_clip_ratio",),
                    epilogue=1)
def _trl_cispo(x: PolicyInputs) -> PolicyTerms:
    """``-sg(min(r, eps_high)) A logp`` (MiniMax-M1)."""
    ratio = torch.exp(log_importance_ratio(x.logp, x.old, x.mask, x.options.importance_sampling_level, x.sequences))
    return PolicyTerms(-torch.clamp(ratio, max=x.options.eps_high).detach() * x.adv * x.logp, ratio, None)


@register_loss_mode(loss_type="sapo", reduction="sequence_mean", epilogue=2)
def _trl_sapo(x: PolicyInputs) -> PolicyTerms:
    """``-(4 / tau) sigmoid(tau (r - 1)) A``, ``tau`` by the sign of ``A``."""
    ratio = torch.exp(log_importance_ratio(x.logp, x.old, x.mask, x.options.importance_sampling_level, x.sequences))
    return PolicyTerms(_sapo_gate(ratio, x.adv, x.options), ratio, None)


@register_loss_mode(loss_type="vespo", reduction="global_token_mean", token_local=False, weights_by_is_ratio=False,
                    metrics=("vespo/phi_seq_mean",))
def _trl_vespo(x: PolicyInputs) -> PolicyTerms:
    """``-sg(phi(w)) A logp``; the rollout weights enter ``w`` (TRL's get_gamma_weights)."""
    ratio = torch.exp(log_importance_ratio(x.logp, x.old, x.mask, x.options.importance_sampling_level, x.sequences))
    log_ratio_token = log_importance_ratio(x.logp, x.old, x.mask, "token")
    phi = vespo_weight(log_ratio_token, x.adv, x.mask, x.is_ratio, x.options, x.sequences)
    return PolicyTerms(-phi * x.adv * x.logp, ratio, None, vespo_phi=phi)


# --------------------------------------------------------------------------------------------------
# verl's loss modes (verl 0.9.1, verl.trainer.ppo.core_algos, compute_policy_loss_*), reduced by
# loss_agg_mode unless the entry forces a reduction
# --------------------------------------------------------------------------------------------------
@register_loss_mode(loss_mode="vanilla", clipping=DUAL_CLIP, epilogue=3, clamps_log_ratio=True, clip_ratio_c=3.0)
def _verl_vanilla(x: PolicyInputs) -> PolicyTerms:
    """PPO with verl's dual clip: ``max(-A r, -A clip(r))``, and where ``A < 0`` at most ``-A c``
    (``c = delta``, verl's clip_ratio_c); the log-ratio clamped to [-20, 20]."""
    o, adv = x.options, _verl_adv(x)
    log_ratio = _verl_log_ratio(x)
    ratio = torch.exp(log_ratio)
    loss1, loss2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - o.eps_low, 1 + o.eps_high)
    clip1 = torch.maximum(loss1, loss2)
    loss3 = -adv * o.delta
    loss = torch.where(adv < 0, torch.min(loss3, clip1), clip1)
    return PolicyTerms(loss, ratio, None, low=(clip1 > loss3) & (adv < 0), high=loss2 > loss1, ppo_kl=-log_ratio.detach())


@register_loss_mode(loss_mode="gspo", clipping=PPO_CLIP, token_local=False)
def _verl_gspo(x: PolicyInputs) -> PolicyTerms:
    """GSPO: the token ratio ``sg(s) * p / sg(p)``, ``s`` the sequence's mean log-ratio, clamped at 10 in
    log space; clipped surrogate without the dual clip; reduced by ``loss_agg_mode`` (verl 0.9.1's
    ``compute_policy_loss_gspo``; 0.9.0 and the GSPO paper always took seq-mean-token-mean)."""
    o, adv = x.options, _verl_adv(x)
    seq_log_ratio = x.sequences.sum((x.logp - x.old) * x.mask) / x.sequences.sum(x.mask).clamp(min=1)
    log_ratio = torch.clamp(x.logp - x.logp.detach() + seq_log_ratio.detach(), max=10.0)
    ratio = torch.exp(log_ratio)
    loss1, loss2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - o.eps_low, 1 + o.eps_high)
    return PolicyTerms(torch.maximum(loss1, loss2), ratio, None, low=None, high=loss2 > loss1,
                       ppo_kl=(x.old - x.logp).detach())


@register_loss_mode(loss_mode="sapo", reduction="seq-mean-token-mean", epilogue=2, clamps_log_ratio=True)
def _verl_sapo(x: PolicyInputs) -> PolicyTerms:
    """SAPO's gate on the clamped token ratio; always seq-mean-token-mean; clip fractions 0."""
    log_ratio = _verl_log_ratio(x)
    ratio = torch.exp(log_ratio)
    return PolicyTerms(_sapo_gate(ratio, _verl_adv(x), x.options), ratio, None, ppo_kl=-log_ratio.detach())


@register_loss_mode(loss_mode="gpg", metrics=(), epilogue=4)
def _verl_gpg(x: PolicyInputs) -> PolicyTerms:
    """GPG: ``-logp A`` (verl logs no policy metric for it)."""
    return PolicyTerms(-x.logp * _verl_adv(x), torch.exp(x.logp - x.old).detach(), None)


@register_loss_mode(loss_mode="clip_cov", clipping=PPO_CLIP, token_local=False, metrics=("actor/pg_clipfrac", "actor/ppo_kl"))
def _verl_clip_cov(x: PolicyInputs) -> PolicyTerms:
    """Clip-Cov: the clipped surrogate (no log-ratio clamp, no dual clip), with the gradient of up to
    ``max(int(clip_cov_ratio * sum(mask)), 1)`` tokens whose centred covariance ``(A - mean A)(logp -
    mean logp)`` lies in (clip_cov_lb, clip_cov_ub) dropped, a uniformly random subset of those
    candidates as verl draws one (``torch.randperm`` there; here one ``torch.rand`` key per position,
    the smallest keys taken, so that no shape depends on the data)."""
    o, adv, valid = x.options, _verl_adv(x), x.mask > 0
    ratio = torch.exp(x.logp - x.old)
    loss1, loss2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - o.eps_low, 1 + o.eps_high)
    with torch.no_grad():
        # (verl's masked_mean here, not kl_cov's plain means over the valid tokens)
        cov = (adv - masked_mean(adv, x.mask)) * (x.logp - masked_mean(x.logp, x.mask))
        candidate = (cov < o.clip_cov_ub) & (cov > o.clip_cov_lb) & valid & ~((loss2 > loss1) & valid)
        keys = torch.rand(adv.shape, device=adv.device)
        dropped = _first_k(keys, candidate, _verl_count(o.clip_cov_ratio, x.mask.sum()), descending=False)
        corr = torch.where(dropped, torch.zeros_like(adv), torch.ones_like(adv))
    return PolicyTerms(torch.maximum(loss1, loss2) * corr, ratio, None, high=dropped,
                       ppo_kl=(x.old - x.logp).detach())


@register_loss_mode(loss_mode="kl_cov", token_local=False, metrics=("actor/ppo_kl",))
def _verl_kl_cov(x: PolicyInputs) -> PolicyTerms:
    """KL-Cov: ``-A r`` (unclipped), plus ``ppo_kl_coef * |logp - old|`` on the
    ``max(1, int(tokens * kl_cov_ratio))`` tokens of largest centred covariance (``torch.topk``'s choice;
    among equal covariances the first in row-major order); actor/ppo_kl is the mean ``|logp - old|``."""
    o, adv = x.options, _verl_adv(x)
    log_ratio = x.logp - x.old
    ratio = torch.exp(log_ratio)
    loss = -adv * ratio
    valid = x.mask > 0
    with torch.no_grad():
        cov = _covariance(adv, x.logp.detach(), valid)
        picked = _first_k(cov, valid, _verl_count(o.kl_cov_ratio, valid.sum()), descending=True)
    loss = torch.where(picked, loss + o.ppo_kl_coef * log_ratio.abs(), loss)
    return PolicyTerms(loss, ratio, None, ppo_kl=log_ratio.abs().detach())


@register_loss_mode(loss_mode="geo_mean", clipping=LOG_RATIO_CLIP, token_local=False, weights_by_is_ratio=False)
def _verl_geo_mean(x: PolicyInputs) -> PolicyTerms:
    """GMPO: ``-A_s exp(mean_t clip_sgn(log r))`` per sequence (the log-ratio clipped to [-eps_low,
    eps_high] on the side the advantage's sign picks), mean over all rows; the rollout weights enter
    as their per-sequence geometric mean. Neither loss_agg_mode nor dp_size reaches it (verl's torch.mean)."""
    o, adv, seqs = x.options, _verl_adv(x), x.sequences
    log_ratio = x.logp - x.old
    sign = torch.sign(adv)
    clamped = torch.clamp(log_ratio, -o.eps_low, o.eps_high)
    clipped = sign * torch.min(sign * log_ratio, sign * clamped)
    lengths = seqs.per_sequence(x.mask)
    ratio = torch.exp(seqs.per_sequence(clipped * x.mask) / (lengths + 1e-8))
    seq_adv = seqs.per_sequence(adv * x.mask) / (lengths + 1e-8)
    loss = -seq_adv * ratio
    if x.is_ratio is not None:
        log_is = torch.log(x.is_ratio.expand_as(x.mask) + 1e-10)
        loss = loss * torch.exp(seqs.per_sequence(log_is * x.mask) / (lengths + 1e-8))
    reduced = loss.sum() / max(loss.numel(), 1)
    changed = log_ratio != clamped
    return PolicyTerms(torch.zeros_like(x.mask), torch.exp(log_ratio).detach(), None,
                       low=changed & (adv < 0), high=changed & (adv > 0), reduced=reduced,
                       ppo_kl=-log_ratio.detach())


@register_loss_mode(loss_mode="cispo", clipping=CLIPPED_WEIGHT, epilogue=5, clamps_log_ratio=True)
def _verl_cispo(x: PolicyInputs) -> PolicyTerms:
    """``-sg(clip(r, 1 - eps_low, 1 + eps_high)) A logp`` on the clamped ratio (eps_low = 1: no floor)."""
    o = x.options
    log_ratio = _verl_log_ratio(x)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - o.eps_low, 1 + o.eps_high)
    return PolicyTerms(-clipped.detach() * _verl_adv(x) * x.logp, ratio, None, high=ratio != clipped,
                       ppo_kl=-log_ratio.detach())


@register_loss_mode(loss_mode="dppo_tv", clipping=DIVERGENCE, epilogue=6, clamps_log_ratio=True, clip_ratio_c=20.0)
def _verl_dppo_tv(x: PolicyInputs) -> PolicyTerms:
    """DPPO-Binary-TV: trusted where ``p - p_old <= eps_high`` (``A > 0``) or ``>= -eps_low`` (``A <= 0``)."""
    o = x.options
    return _dppo(x, lambda p, p_old, adv: torch.where(adv > 0, p - p_old <= o.eps_high, p - p_old >= -o.eps_low))


@register_loss_mode(loss_mode="dppo_kl", clipping=DIVERGENCE, epilogue=7, clamps_log_ratio=True, clip_ratio_c=20.0)
def _verl_dppo_kl(x: PolicyInputs) -> PolicyTerms:
    """DPPO-Binary-KL: the binary KL ``p_old (log p_old - log p) + (1 - p_old) log((1 - p_old + 1e-8) /
    (1 - p + 1e-8))`` at most ``eps_high`` (``A > 0``, or ``p <= p_old``) / ``eps_low`` (``A <= 0``, or
    ``p >= p_old``)."""
    o = x.options

    def trusted(p: torch.Tensor, p_old: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
        binary_kl = p_old * (x.old - x.logp.detach()) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
        return torch.where(adv > 0, (binary_kl <= o.eps_high) | (p <= p_old), (binary_kl <= o.eps_low) | (p >= p_old))

    return _dppo(x, trusted)


@register_loss_mode(loss_mode="dro", metrics=("actor/ppo_kl",), epilogue=8)
def _verl_dro(x: PolicyInputs) -> PolicyTerms:
    """Direct Reward Optimisation: ``-(logp A - dro_beta / 2 (logp - old)^2)`` (no clamp)."""
    log_ratio = x.logp - x.old
    loss = -(x.logp * _verl_adv(x) - 0.5 * x.options.dro_beta * log_ratio.square())
    return PolicyTerms(loss, torch.exp(log_ratio).detach(), None, ppo_kl=-log_ratio.detach())
