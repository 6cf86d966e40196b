"""The GRPO loss's configuration, defined once.

Two vocabularies name the same loss spec (``objective``: an objective, a reduction, a KL estimator):
TRL's ``loss_type`` (each name an (objective, reduction) pair, TRL 1.16's ``GRPOTrainer``) and verl's
three axes ``loss_mode`` / ``loss_agg_mode`` / ``kl_loss_type`` (verl's ``core_algos``); giving both
``loss_type`` and ``loss_mode`` is an error. verl's other spellings (``clip_ratio_low``,
``kl_loss_coef``, ``entropy_coeff``, ``rollout_is_weights``, ...) are accepted as keywords and mean
the option :data:`VERL_SPELLINGS` names.

``GRPOOptions`` holds the scalar hyper-parameters (each declared once, with its range or choices, by
``bounds.option``, and validated against that declaration when it is built); ``GRPOInputs`` holds
the optional per-call tensors. Both are frozen dataclasses carried from the public functions and
modules through autograd to the kernels. The public functions take their fields as flat keywords,
written out in each signature with their types and defaults (what ``help()``, a reader and a static
analyser see alike); ``tools/signatures.py`` writes those blocks from the fields here and
``tests/test_signatures.py`` holds every public signature equal to them, so an option is added here
(plus, if it is token-local, its term in ``objective.per_token_loss`` and the Triton epilogue) and the
signatures follow. An error names an option as the caller spelled it (verl's ``clip_ratio_low`` for
``eps_low``: :func:`split_grpo_keywords` and :func:`user_spelling` re-word ``bounds.OptionError``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch

from . import _validation as V
from . import loss_modes
from .sampling_mask import SamplingMask
from .bounds import (FINITE, FRACTION, UNIT_INTERVAL, ZERO_TO_ONE, OptionError, OptionTypeError, above, at_least,
                     declarations, fields_by_name, option)

# The loss modes' names and what they imply, read from their registry (loss_modes.REGISTRY, one entry
# per mode) at each use: a mode registered later is a choice at once.
LOSS_TYPES = loss_modes.RegisteredNames(loss_modes.LOSS_TYPE)  # TRL's loss_type names
CLIPPED_LOSS_TYPES = loss_modes.RegisteredNames(loss_modes.LOSS_TYPE, lambda m: m.clipping == loss_modes.PPO_CLIP)
# divide by a token count (dapo, cispo, vespo: num_items_in_batch; bnpo: the call's, which a trainer
# splitting a batch into micro-batches turns into dapo's by passing the whole batch's count)
TOKEN_NORMALISED_LOSS_TYPES = loss_modes.RegisteredNames(loss_modes.LOSS_TYPE, lambda m: m.token_normalised)
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
# verl's names (verl.trainer.ppo.core_algos): policy_loss.loss_mode, loss_agg_mode, kl_loss_type
LOSS_MODES = loss_modes.RegisteredNames(loss_modes.LOSS_MODE)
# verl modes whose clip_ratio_low / _high are divergence thresholds (DPPO), not a ratio range
DIVERGENCE_CLIP_LOSS_MODES = loss_modes.RegisteredNames(loss_modes.LOSS_MODE,
                                                        lambda m: m.clipping == loss_modes.DIVERGENCE)
# verl's clip_ratio_c default by mode (config.get("clip_ratio_c", ...)): vanilla's dual clip, DPPO's
# truncated importance weight; the other modes do not read it
VERL_CLIP_RATIO_C_DEFAULTS = loss_modes.RegisteredValues(loss_modes.LOSS_MODE, lambda m: m.clip_ratio_c)
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_LOSS_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "k2+", "mse+", "low_var_kl+", "k3+")
# verl's kl_penalty names that need more than the sampled token's log-probs (here: refused, saying why)
KL_LOSS_TYPES_NEEDING_DISTRIBUTIONS = ("full", "full+")
# TRL's vllm_importance_sampling_mode names
ROLLOUT_CORRECTIONS = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
BACKENDS = ("auto", "triton", "torch", "reference")
IGNORE_INDEX = -100  # the target id of a position that predicts nothing (as in PyTorch and TRL)


# Each option's declaration (bounds.option): its help, its choices or range, checked here (bounds.declarations),
# by grpo.GRPOConfig, by the command lines generated from the config and by the public functions.
# The logit transform's three are declared once and shared by LogitTransform and GRPOOptions.
_TEMPERATURE = dict(help="logits are divided by it before the softmax", bounds=above(0))
_SOFTCAP = dict(help="final-logit soft-capping: softcap * tanh(z / softcap)", bounds=above(0))
_LOGIT_SCALE = dict(help="logits are multiplied by it first (Cohere)", bounds=above(0))
# DPPO's eps_low / eps_high are divergence thresholds, any >= 0; a clipped detached weight (verl's
# cispo) takes eps_low = 1 for "no lower clamp" (its ratio is then clamped at 0). (A snapshot of the
# modes registered when this module is imported: bounds.option copies it.)
_DIVERGENCE_THRESHOLD = at_least(0)
_EPS_LOW_UNDER = {**{mode: UNIT_INTERVAL for mode in loss_modes.RegisteredNames(
                      loss_modes.LOSS_MODE, lambda m: m.clipping == loss_modes.CLIPPED_WEIGHT)},
                  **{mode: _DIVERGENCE_THRESHOLD for mode in DIVERGENCE_CLIP_LOSS_MODES}}


# The sampler's truncation (vLLM 0.32's SamplingParams): top_k an int, 0 or -1 (or >= V) meaning off,
# top_p in (0, 1], 1 meaning off; declared once here and shared by LogitTransform and GRPOOptions (the
# trainer's config and the rollout engines read the same declarations).
_TOP_K = dict(help="the sampler's top-k (vLLM's rule: ties at the k-th value kept): log-probs, entropy and loss of the "
              "truncated, renormalised distribution; None, 0 or -1 (vLLM's values) or >= V: off", bounds=at_least(-1))
_TOP_P = dict(help="the sampler's top-p nucleus, after top-k (vLLM's rule): log-probs, entropy and loss of the "
              "truncated, renormalised distribution; None or 1: off", bounds=FRACTION)
TOP_K_OFF = (0, -1)  # vLLM's values that disable top-k (as None does here)
# LogitTransform's fields that may also be a tensor of one value per sequence or per token (vLLM takes
# the three per request), and how their error messages name the number they otherwise are
ROW_FIELDS = ("temperature", "top_k", "top_p")
_ROW_FIELD_NUMBER = {"temperature": "a float", "top_k": "an int", "top_p": "a float"}
# (the public functions' annotations of those fields: the number or a tensor; tests/test_signatures.py)
ROW_FIELD_ANNOTATIONS = {"temperature": "Union[float, torch.Tensor]", "top_k": "Union[int, torch.Tensor, None]",
                         "top_p": "Union[float, torch.Tensor, None]"}


@dataclass(frozen=True, eq=False)
class LogitTransform:
    """The distribution the log-probs are of: the softmax of
    ``z = softcap * tanh(logit_scale * logits / softcap) / temperature`` (``logit_scale * logits /
    temperature`` when ``softcap`` is None; Gemma-2/3's final-logit soft-capping, Cohere's ``logit_scale``,
    then the sampling temperature), truncated as a vLLM sampler truncates it: ``top_k`` then ``top_p``
    (``None`` = off; vLLM's "off" values are normalised to None here), renormalised.

    ``temperature``, ``top_k``, ``top_p`` (:data:`ROW_FIELDS`): each a number, or a tensor (``[B]`` one
    per sequence, as vLLM takes them per request, or the call's leading shape, one per token), each value
    within the number's declared range (``top_k`` an integer tensor, 0 / -1 / ``>= V`` off for its row;
    ``top_p`` a floating one, 1 off for its row): :meth:`for_rows` checks its shape against a call and
    broadcasts it. A tensor's values are read once, when the transform is built (one device
    synchronisation each; a truncation tensor whose every value is "off" becomes None). A temperature
    tensor's values are read in float64, ``top_p``'s rounded to float32 as the float is, so a tensor
    holding the number (float64, or a float32-representable value) gives bitwise the number's results.
    Compared by identity (``eq=False``: it may hold a tensor).
    """

    temperature: float = option(1.0, **_TEMPERATURE)  # (or a tensor: checked apart, _check_temperature_tensor)
    softcap: Optional[float] = option(None, **_SOFTCAP)
    logit_scale: float = option(1.0, **_LOGIT_SCALE)
    top_k: Optional[int] = option(None, **_TOP_K)  # (or a tensor: checked apart, _check_truncation_tensor)
    top_p: Optional[float] = option(None, **_TOP_P)  # (likewise)

    def __post_init__(self) -> None:
        for declared in _TRANSFORM_DECLARATIONS.values():
            if declared.name in ROW_FIELDS and isinstance(getattr(self, declared.name), torch.Tensor):
                continue
            object.__setattr__(self, declared.name, declared.check(getattr(self, declared.name)))
        if isinstance(self.temperature, torch.Tensor):
            _check_temperature_tensor(self.temperature, self.softcap, self.logit_scale)
        else:
            V.check_transform_factors(self.temperature, self.softcap, self.logit_scale)
        if isinstance(self.top_k, torch.Tensor):
            object.__setattr__(self, "top_k", _check_truncation_tensor("top_k", self.top_k))
        else:
            object.__setattr__(self, "top_k", None if self.top_k in TOP_K_OFF else self.top_k)
        if isinstance(self.top_p, torch.Tensor):
            object.__setattr__(self, "top_p", _check_truncation_tensor("top_p", self.top_p))
        else:
            object.__setattr__(self, "top_p", None if self.top_p == 1.0 else self.top_p)

    @staticmethod
    def of(value: "float | LogitTransform") -> "LogitTransform":
        """A bare temperature, or a transform already."""
        return value if isinstance(value, LogitTransform) else LogitTransform(temperature=value)

    @property
    def is_plain(self) -> bool:
        """Only a float temperature (the common case, and the cheapest kernel)."""
        return self.softcap is None and self.logit_scale == 1.0 and not self.truncates and not self.per_row

    @property
    def truncates(self) -> bool:
        """Whether a top-k or top-p truncation is on (then a target may lie outside the kept set)."""
        return self.top_k is not None or self.top_p is not None

    @property
    def per_row(self) -> bool:
        """Whether the temperature is a tensor (one value per row of the kernels)."""
        return isinstance(self.temperature, torch.Tensor)

    @property
    def truncates_per_row(self) -> bool:
        """Whether ``top_k`` or ``top_p`` is a tensor (one value per row of the kernels)."""
        return isinstance(self.top_k, torch.Tensor) or isinstance(self.top_p, torch.Tensor)

    def top_k_for(self, vocab_size: int) -> "Optional[int] | torch.Tensor":
        """``top_k`` for a vocabulary of ``vocab_size``: None (off) when it keeps every token (``k >= V``);
        a tensor as it is (its rows' "off" values: :func:`top_k_rows`)."""
        if isinstance(self.top_k, torch.Tensor):
            return self.top_k
        return None if self.top_k is None or self.top_k >= vocab_size else self.top_k

    def _unchecked(self, **changes: Any) -> "LogitTransform":
        """A copy with ``changes`` (already checked values: a broadcast or a slice of the temperature)."""
        out = object.__new__(LogitTransform)
        for f in dataclasses.fields(self):
            object.__setattr__(out, f.name, changes.get(f.name, getattr(self, f.name)))
        return out

    def for_rows(self, shape, device: Optional[torch.device] = None) -> "LogitTransform":
        """This transform for a call whose tokens have the leading shape ``shape`` (``[..., V]`` logits,
        ``[..., H]`` hidden states, ``[B, T]`` ids): a tensor of :data:`ROW_FIELDS` (temperature, top_k,
        top_p) of shape ``shape`` (one per token) or ``shape[:1]`` (one per sequence) becomes a ``shape``
        view (a ValueError names the field otherwise, or for another device than ``device``); a number
        stays as it is."""
        shape, changes = tuple(shape), {}
        for name in ROW_FIELDS:
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                continue
            if device is not None and t.device != torch.device(device):
                raise OptionError(f"{name} is on {t.device}, the logits / hidden states on {device}: pass it on the "
                                  f"same device", name)
            if tuple(t.shape) == shape:
                continue
            if len(shape) >= 1 and tuple(t.shape) == shape[:1]:
                changes[name] = t.reshape(shape[:1] + (1,) * (len(shape) - 1)).expand(shape)
                continue
            raise OptionError(f"{name} must be {_ROW_FIELD_NUMBER[name]}, a tensor of shape {list(shape[:1])} (one per "
                              f"sequence) or {list(shape)} (one per token), got shape {list(t.shape)}", name)
        return self._unchecked(**changes) if changes else self

    def rows(self, index) -> "LogitTransform":
        """The transform of some rows of a call (``index``: a slice or int64 indices into its flattened
        tokens): each tensor of :data:`ROW_FIELDS` flattened and indexed; a number stays."""
        changes = {}
        for name in ROW_FIELDS:
            t = getattr(self, name)
            if isinstance(t, torch.Tensor):
                flat = t.reshape(-1)
                changes[name] = flat[index] if isinstance(index, slice) else flat.index_select(0, index)
        return self._unchecked(**changes) if changes else self


def _check_temperature_tensor(temperature: torch.Tensor, softcap: Optional[float], logit_scale: float) -> None:
    """A temperature tensor: floating point, every value within the float's declared range (finite,
    > 0) with a finite float32 factor (``_validation.check_transform_factors``). One device
    synchronisation; its shape and device are checked against the call (:meth:`LogitTransform.for_rows`)."""
    if temperature.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise OptionTypeError(f"temperature must be a float or a floating-point tensor, got a {temperature.dtype} "
                              f"tensor", "temperature")
    if temperature.dim() == 0:  # (a float's job: one value for every row)
        raise OptionTypeError(f"temperature must be a float, or a tensor of one value per sequence [B] or per token "
                              f"[B, T]; got a 0-d tensor {temperature!r}: pass float(temperature)", "temperature")
    if temperature.numel() == 0 or temperature.device.type == "meta" or torch.compiler.is_compiling():
        return  # (no values to read: the device is checked against the call's, LogitTransform.for_rows)
    t = temperature.detach().double()
    bad = ~(torch.isfinite(t) & (t > 0))
    if bool(bad.any()):
        raise OptionError(f"temperature must be finite and > 0 everywhere, got {t[bad][0].item()}", "temperature")
    V.check_transform_factors(float(t.min()), softcap, logit_scale)  # (the largest factor: the smallest T)


def _check_truncation_tensor(name: str, values: torch.Tensor) -> Optional[torch.Tensor]:
    """A ``top_k`` (integer) or ``top_p`` (floating) tensor, one value per row: every value within the
    number's declaration (``_TOP_K`` / ``_TOP_P``: the same bounds), read once (one device
    synchronisation); None when every value is vLLM's "off" (``top_k`` 0 / -1, ``top_p`` 1: the number's
    None). Its shape and device are checked against the call (:meth:`LogitTransform.for_rows`)."""
    integer = name == "top_k"
    number = _ROW_FIELD_NUMBER[name]
    if integer and (values.dtype == torch.bool or values.dtype.is_floating_point or values.dtype.is_complex):
        raise OptionTypeError(f"top_k must be an int or an integer tensor, got a {values.dtype} tensor", name)
    if not integer and not values.dtype.is_floating_point:
        raise OptionTypeError(f"top_p must be a float or a floating-point tensor, got a {values.dtype} tensor", name)
    if values.dim() == 0:  # (a number's job: one value for every row)
        raise OptionTypeError(f"{name} must be {number}, or a tensor of one value per sequence [B] or per token "
                              f"[B, T]; got a 0-d tensor {values!r}: pass {values.item()!r}", name)
    if values.numel() == 0 or values.device.type == "meta" or torch.compiler.is_compiling():
        return values  # (no values to read: the device is checked against the call's, LogitTransform.for_rows)
    bounds = _TRANSFORM_DECLARATIONS[name].bounds
    v = values.detach().long() if integer else values.detach().double()
    ok = torch.ones_like(v, dtype=torch.bool) if integer else torch.isfinite(v)
    if bounds.low is not None:
        ok &= v > bounds.low if bounds.low_open else v >= bounds.low
    if bounds.high is not None:
        ok &= v < bounds.high if bounds.high_open else v <= bounds.high
    off = torch.isin(v, torch.tensor(TOP_K_OFF, device=v.device)) if integer else v == 1.0  # (vLLM's "off")
    any_bad, all_off = torch.stack(((~ok).any(), off.all())).tolist()  # (the one synchronisation)
    if any_bad:
        raise OptionError(f"{name} must be {bounds.describe(integer)} everywhere, got {v[~ok][0].item()!r}", name)
    return None if all_off else values


def top_k_rows(top_k: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int64 per-row ``k`` of a ``top_k`` tensor for a vocabulary of ``vocab_size``, every "off" value
    (0, -1, ``>= V``) as ``V``: the rule, in one place, by which the row kernels tell a row's top-k off
    (``k == V``, which keeps every token) from on (``0 < k < V``)."""
    k = top_k.long()
    return torch.where((k > 0) & (k < vocab_size), k, torch.full((), vocab_size, dtype=torch.int64, device=k.device))


def top_p_on(top_p: torch.Tensor) -> torch.Tensor:
    """Bool per-row: whether a row's ``top_p`` truncates (< 1; 1 is vLLM's "off")."""
    return top_p < 1.0


def check_top_k(top_k: Any) -> Optional[int]:
    """``top_k`` checked against its declaration (an int >= -1, or None), vLLM's "off" values 0 and -1 as
    None; for the callers outside the loss (the rollout engines, the TRL head)."""
    top_k = _TRANSFORM_DECLARATIONS["top_k"].check(top_k)
    return None if top_k in TOP_K_OFF else top_k


def check_top_p(top_p: Any) -> Optional[float]:
    """``top_p`` checked against its declaration (in (0, 1], or None), 1 (vLLM's "off") as None."""
    top_p = _TRANSFORM_DECLARATIONS["top_p"].check(top_p)
    return None if top_p == 1.0 else top_p


@dataclass(frozen=True)
class GRPOOptions:
    """Scalar hyper-parameters of the GRPO loss (see ``docs/api.md``). Validated on construction.

    Each field is declared once (``bounds.option``: help, choices, range, and a range that differs
    under a ``loss_mode``); ``__post_init__`` checks every field against its declaration in one loop,
    then the rules that tie fields together, each once. ``eps_high=None`` means ``eps_low`` and is
    resolved here, so ``options.eps_high`` is always a number; ``loss_type=None`` means ``"dapo"``
    unless ``loss_mode`` names the loss. All are runtime values for the kernels: a new value compiles
    no new kernel.

    A new option is one field here, e.g. ``min_p: Optional[float] = option(None, "min-p sampling",
    bounds=FRACTION)``; ``GRPOConfig``, its flags and the functions' keywords follow.
    """

    beta: float = option(0.0, "KL coefficient (verl: kl_loss_coef); > 0 needs ref_logps", bounds=at_least(0))
    eps_low: float = option(0.2, "lower clipping range: the ratio is clipped below at 1 - eps_low (verl: clip_ratio_low; "
                            "1 only for cispo; dppo_tv / dppo_kl: the divergence threshold where A <= 0)",
                            bounds=ZERO_TO_ONE, bounds_under=_EPS_LOW_UNDER)
    eps_high: Optional[float] = option(None, "upper clipping range (None: eps_low); DAPO's clip-higher uses e.g. 0.28 "
                                       "(verl: clip_ratio_high; dppo_tv / dppo_kl: the divergence threshold where A > 0)",
                                       bounds=at_least(0))
    delta: Optional[float] = option(None, "two-sided clipping: caps the ratio at delta, which matters where the advantage "
                                    "is negative (> 1 + eps_high; verl: clip_ratio_c, > 1, default 3 under "
                                    "loss_mode='vanilla'; dppo_tv / dppo_kl: the cap of the detached ratio, default 20)",
                                    bounds=above(1))
    temperature: float = option(1.0, **_TEMPERATURE)  # (or a [B] / [B, T] tensor: LogitTransform checks it)
    softcap: Optional[float] = option(None, **_SOFTCAP)
    logit_scale: float = option(1.0, **_LOGIT_SCALE)
    top_k: Optional[int] = option(None, **_TOP_K)
    top_p: Optional[float] = option(None, **_TOP_P)
    loss_type: Optional[str] = option(
        None, "TRL's name of the objective and how per-token losses are summed (docs/api.md): the mean of per-sequence "
        "means (grpo, sapo), the sum over tokens divided by their count (bnpo; dapo, cispo, vespo: the whole batch's) or "
        "by completions * max_completion_length (dr_grpo; luspo: by completions); None: dapo, unless loss_mode names "
        "the loss (never both)", choices=LOSS_TYPES)
    loss_mode: Optional[str] = option(None, "verl's policy_loss.loss_mode (instead of loss_type)", choices=LOSS_MODES)
    loss_agg_mode: Optional[str] = option(None, "verl's loss_agg_mode (with loss_mode; None: token-mean)",
                                          choices=LOSS_AGG_MODES)
    kl_loss_type: Optional[str] = option(
        None, "verl's KL estimator (with loss_mode; None: low_var_kl)", choices=KL_LOSS_TYPES,
        refused={name: "the exact KL needs both models' whole distributions over the vocabulary, not the sampled "
                 f"tokens' log-probs (verl raises NotImplementedError for it too); pick one of {KL_LOSS_TYPES}"
                 for name in KL_LOSS_TYPES_NEEDING_DISTRIBUTIONS})
    max_completion_length: Optional[int] = option(None, "dr_grpo's constant (verl: loss_scale_factor of "
                                                  "seq-mean-token-sum-norm); None = T", bounds=at_least(1))
    importance_sampling_level: str = option("token", "the importance ratio per token, or per sequence (GSPO)",
                                            choices=IMPORTANCE_SAMPLING_LEVELS)
    entropy_coef: float = option(0.0, "entropy bonus: subtracts entropy_coef times the mean entropy (verl: entropy_coeff)",
                                 bounds=FINITE)
    use_bias_correction_kl: bool = option(False, "multiply the k3 KL by the importance ratio (TRL's use_bias_correction_kl)")
    top_entropy_quantile: float = option(1.0, "TRL: the policy loss only on the top quantile of tokens by entropy (1: all)",
                                         bounds=UNIT_INTERVAL)
    off_policy_mask_threshold: Optional[float] = option(
        None, "TRL (DeepSeek-V3.2): drop sequences with A < 0 whose mean KL to the sampling policy exceeds it",
        bounds=at_least(0))
    rollout_correction: Optional[str] = option(
        None, "correct for the rollout engine's log-probs (rollout_logps), TRL's vllm_importance_sampling_mode",
        choices=ROLLOUT_CORRECTIONS)
    rollout_correction_max: Optional[float] = option(3.0, "rollout correction's cap (None: unbounded)", bounds=at_least(0))
    rollout_correction_min: Optional[float] = option(
        None, "rollout correction's floor: *_mask drop ratios below it, *_truncate clamp at it (None: none)",
        bounds=at_least(0))
    clip_cov_ratio: Optional[float] = option(None, "verl clip_cov: fraction of tokens whose gradient is dropped "
                                             "(None: 0.0002; above 1: every candidate, as in verl)", bounds=above(0))
    clip_cov_lb: Optional[float] = option(None, "verl clip_cov: covariance lower bound (None: 1)", bounds=FINITE)
    clip_cov_ub: Optional[float] = option(None, "verl clip_cov: covariance upper bound (None: 5)", bounds=FINITE)
    kl_cov_ratio: Optional[float] = option(None, "verl kl_cov: fraction of tokens given the KL penalty (None: 0.0002; "
                                           "at most 1: verl's top-k of more tokens than there are fails)", bounds=FRACTION)
    ppo_kl_coef: Optional[float] = option(None, "verl kl_cov: coefficient of |log ratio| (None: 1)", bounds=FINITE)
    dro_beta: Optional[float] = option(None, "verl dro (policy_loss.dro_beta): coefficient of the penalty dro_beta / 2 * "
                                       "(logp - old)^2; > 0, needed by loss_mode='dro'", bounds=above(0))
    dp_size: int = option(1, "verl's agg_loss dp_size: the loss is multiplied by it (data-parallel ranks averaging "
                          "gradients); > 1 needs the global normaliser of loss_agg_mode (num_items_in_batch or "
                          "global_batch_size)", bounds=at_least(1))
    sapo_temperature_pos: float = option(1.0, "sapo: gate temperature where A > 0 (verl: tau_pos)", bounds=above(0))
    sapo_temperature_neg: float = option(1.05, "sapo: gate temperature where A <= 0 (verl: tau_neg)", bounds=above(0))
    vespo_k_pos: float = option(2.0, "vespo: power k of the gamma weight where A >= 0", bounds=at_least(0))
    vespo_lambda_pos: float = option(3.0, "vespo: decay lambda where A >= 0", bounds=at_least(0))
    vespo_k_neg: float = option(3.0, "vespo: power k where A < 0", bounds=at_least(0))
    vespo_lambda_neg: float = option(2.0, "vespo: decay lambda where A < 0", bounds=at_least(0))

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        # every field against its declaration, loss_mode first (some ranges depend on it)
        set_("loss_mode", OPTION_DECLARATIONS["loss_mode"].check(self.loss_mode))
        for declared in OPTION_DECLARATIONS.values():
            if declared.name in ROW_FIELDS and isinstance(getattr(self, declared.name), torch.Tensor):
                continue  # (a tensor of temperatures, top_k or top_p: checked by LogitTransform below)
            set_(declared.name, declared.check(getattr(self, declared.name), loss_mode=self.loss_mode))
        # the rules that tie fields together, each once
        self._resolve_vocabulary(set_)
        if self.delta is None and self.loss_mode in VERL_CLIP_RATIO_C_DEFAULTS:
            set_("delta", VERL_CLIP_RATIO_C_DEFAULTS[self.loss_mode])  # verl's clip_ratio_c default for the mode
        if self.eps_high is None:
            set_("eps_high", self.eps_low)
        if not self.is_verl and self.delta is not None and not self.delta > 1 + self.eps_high:
            # (under loss_mode delta is verl's clip_ratio_c, a cap of its own: its declared range, > 1)
            raise OptionError(f"delta must be > 1 + eps_high = {1 + self.eps_high}, got {self.delta}", "delta", "eps_high")
        transform = LogitTransform(self.temperature, self.softcap, self.logit_scale, self.top_k, self.top_p)
        set_("top_k", transform.top_k)  # (vLLM's "off" values as None)
        set_("top_p", transform.top_p)
        set_("_transform", transform)
        low, high = self.rollout_correction_min, self.rollout_correction_max
        if low is not None and high is not None and low > high:
            raise OptionError(f"rollout_correction_min ({low}) must be <= rollout_correction_max ({high})",
                              "rollout_correction_min", "rollout_correction_max")
        for name, default in VERL_MODE_DEFAULTS.items():
            if getattr(self, name) is None:
                set_(name, default)
        if self.loss_mode == "dro" and self.dro_beta is None:
            raise OptionError("loss_mode='dro' needs dro_beta > 0 (verl: policy_loss.dro_beta, the coefficient of "
                              "dro_beta / 2 * (logp - old)^2), got None", "dro_beta", "loss_mode")

    def _resolve_vocabulary(self, set_: Callable[[str, Any], None]) -> None:
        """TRL's ``loss_type`` or verl's ``loss_mode`` (never both); each side's options only with it."""
        if self.loss_mode is None:
            for name in VERL_ONLY_OPTIONS:
                value = getattr(self, name)
                if value not in (None, _FIELD_DEFAULTS[name], VERL_MODE_DEFAULTS.get(name)):
                    raise OptionError(f"{name}={value!r} is verl's and needs loss_mode (one of {LOSS_MODES}); "
                                      f"with loss_type the reduction and the KL are TRL's", name, "loss_mode")
            if self.loss_type is None:
                set_("loss_type", DEFAULT_LOSS_TYPE)
            return
        if self.loss_type is not None:
            raise OptionError(f"loss_type={self.loss_type!r} and loss_mode={self.loss_mode!r} name the loss twice: pass "
                              f"TRL's loss_type (one of {LOSS_TYPES}) or verl's loss_mode (one of {LOSS_MODES}), not both",
                              "loss_type", "loss_mode")
        set_("loss_agg_mode", "token-mean" if self.loss_agg_mode is None else self.loss_agg_mode)
        set_("kl_loss_type", "low_var_kl" if self.kl_loss_type is None else self.kl_loss_type)
        for name, allowed in TRL_ONLY_OPTIONS.items():
            if getattr(self, name) != allowed:
                raise OptionError(f"{name}={getattr(self, name)!r} is TRL's and needs loss_type; under loss_mode it must "
                                  f"stay {allowed!r} (verl's sequence-level ratio is loss_mode='gspo')", name, "loss_mode")

    @property
    def is_verl(self) -> bool:
        """Named in verl's vocabulary (``loss_mode``): verl's reductions, KL estimators and clamps."""
        return self.loss_mode is not None

    @property
    def transform(self) -> LogitTransform:
        """The distribution the log-probs are of: the logits' transform (temperature, softcap,
        logit_scale) and the sampler's truncation (top_k, top_p); checked once, when the options were built."""
        return self.__dict__["_transform"]


@dataclass(frozen=True)
class GRPOInputs:
    """Optional per-call tensors of the GRPO loss; shapes are checked against the batch later.

    ``old_logps`` / ``ref_logps`` [B, T], ``is_ratio`` [B, T] or [B, 1], ``num_items_in_batch`` a
    positive number or 0-d tensor, ``segment_ids`` [B, T] int (packed rows: the tokens of a row that
    share an id form one sequence; ids at mask-0 positions are never read). All are constants of the
    loss: no gradient flows to them. The two counts' ranges are declared here (``bounds``) and checked
    with the tensors (``_validation.check_grpo_inputs``).
    """

    old_logps: Optional[torch.Tensor] = field(default=None, metadata={"help": "[B, T] log-probs of the sampling policy; None = on-policy"})
    ref_logps: Optional[torch.Tensor] = field(default=None, metadata={"help": "[B, T] log-probs of the reference model (KL term)"})
    is_ratio: Optional[torch.Tensor] = field(default=None, metadata={"help": "[B, T] or [B, 1] rollout importance weight, scales the policy term"})
    num_items_in_batch: Any = field(default=None, metadata={"help": "dapo's normaliser: global count of loss tokens",
                                                            "bounds": above(0)})
    segment_ids: Optional[torch.Tensor] = field(default=None, metadata={"help": "[B, T] int: packed rows, one id per sequence"})
    rollout_logps: Optional[torch.Tensor] = field(default=None, metadata={"help": "[B, T] the rollout engine's log-probs (rollout_correction, off_policy_mask_threshold)"})
    global_batch_size: Any = field(default=None, metadata={"help": "verl (with loss_mode): sequences of the global batch "
                                                           "(seq-mean-* reductions); None = this call's",
                                                           "bounds": above(0)})
    sampling_mask: Optional[SamplingMask] = field(default=None, metadata={"help": "the rollout engine's kept sets, one per "
                                                  "[B, T] position (SamplingMask): log-probs over each set (replay)"})


DEFAULT_LOSS_TYPE = "dapo"  # what loss_type=None means without loss_mode (TRL's default)
# verl's mode-specific settings: None means verl's default, filled in by GRPOOptions
VERL_MODE_DEFAULTS = {"clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0, "kl_cov_ratio": 0.0002,
                      "ppo_kl_coef": 1.0}
VERL_ONLY_OPTIONS = ("loss_agg_mode", "kl_loss_type", "dp_size", "dro_beta") + tuple(VERL_MODE_DEFAULTS)
VERL_ONLY_INPUTS = ("global_batch_size",)  # per-call values only verl's reductions read (refused under loss_type)
# TRL's options that verl has no counterpart for, and the value that means "off"
TRL_ONLY_OPTIONS = {"top_entropy_quantile": 1.0, "off_policy_mask_threshold": None, "use_bias_correction_kl": False,
                    "importance_sampling_level": "token"}
_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GRPOOptions)}
_DEFAULTS = {f.name: f.default for cls in (GRPOInputs, GRPOOptions) for f in dataclasses.fields(cls)}
OPTION_NAMES: Tuple[str, ...] = tuple(f.name for f in dataclasses.fields(GRPOOptions))
INPUT_NAMES: Tuple[str, ...] = tuple(f.name for f in dataclasses.fields(GRPOInputs))
OPTION_FIELDS = fields_by_name(GRPOOptions)  # name -> dataclasses.Field: each option's declaration
OPTION_DECLARATIONS = declarations(GRPOOptions)  # name -> bounds.Declaration (read once, here)
_TRANSFORM_DECLARATIONS = declarations(LogitTransform)


class NotGiven:
    """The default of a keyword whose every value, None included, means something: verl's spellings of our
    options (None is a value there, refused or meant as ours means it), the verl keys refused by name, and
    a module's per-call keywords (left out: the module's value; ``modules``)."""

    def __repr__(self) -> str:
        return "NOT_GIVEN"


NOT_GIVEN = NotGiven()  # (the one instance: compared by identity)

# verl's spellings of our options (actor config keys and core_algos arguments)
VERL_SPELLINGS = {
    "clip_ratio_low": "eps_low", "clip_ratio_high": "eps_high", "clip_ratio_c": "delta", "kl_loss_coef": "beta",
    "entropy_coeff": "entropy_coef", "rollout_is_weights": "is_ratio", "tau_pos": "sapo_temperature_pos",
    "tau_neg": "sapo_temperature_neg", "loss_scale_factor": "max_completion_length",
    "batch_num_tokens": "num_items_in_batch",
}
# verl keys that have no equivalent here, and what to do instead
VERL_WITHOUT_EQUIVALENT = {
    "use_kl_loss": "pass beta (kl_loss_coef) > 0 and ref_logps",
    "calculate_entropy": "the entropy is always computed (metrics['entropy'])",
    "policy_loss": "pass its keys (loss_mode, clip_cov_ratio, ...) as keywords",
    "global_batch_info": "pass num_items_in_batch (batch_num_tokens), global_batch_size and dp_size",
}


def _given(kwargs: Mapping[str, Any], name: str) -> bool:
    """Whether a call's keywords set ``name``: one of verl's spellings when it is not :data:`NOT_GIVEN`;
    one of ours when it differs from its declared default (a signature cannot tell a default passed from
    one left out, so ``eps_low=0.2`` beside ``clip_ratio_low`` reads as not given)."""
    value = kwargs.get(name, NOT_GIVEN)
    if value is NOT_GIVEN or name not in _DEFAULTS:
        return value is not NOT_GIVEN
    default = _DEFAULTS[name]
    return value is not default and not (type(value) is type(default) and value == default)


def _respell(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """verl's spellings -> ours; ``clip_ratio`` fills eps_low and eps_high; two spellings of one option raise."""
    out = {k: v for k, v in kwargs.items() if k not in VERL_SPELLINGS and k != "clip_ratio"}
    for verl_name, ours in VERL_SPELLINGS.items():
        if _given(kwargs, verl_name):
            if _given(kwargs, ours):
                raise TypeError(f"{verl_name} (verl's name) and {ours} are the same option: pass one of them")
            out[ours] = kwargs[verl_name]
    if _given(kwargs, "clip_ratio"):  # verl: clip_ratio_low / _high default to clip_ratio
        for ours, verl_name in (("eps_low", "clip_ratio_low"), ("eps_high", "clip_ratio_high")):
            if _given(kwargs, ours) and not (_given(kwargs, "clip_ratio_low") or _given(kwargs, "clip_ratio_high")):
                raise TypeError(f"clip_ratio (verl's name) and {ours} both set the clip range: pass one of them")
            if not (_given(kwargs, ours) or _given(kwargs, verl_name)):
                out[ours] = kwargs["clip_ratio"]
    return out


def split_grpo_keywords(kwargs: Dict[str, Any], where: str) -> Tuple[GRPOInputs, GRPOOptions]:
    """A call's flat GRPO keywords (ours, and verl's spellings: :data:`NOT_GIVEN` for one not given) -> (GRPOInputs,
    GRPOOptions); an unknown keyword is a TypeError naming it, as is a verl key without an equivalent
    (:data:`VERL_WITHOUT_EQUIVALENT`, saying what to pass). A refused value raises
    :class:`bounds.OptionError` naming it as the caller spelled it (:func:`user_spelling`)."""
    for name, instead in VERL_WITHOUT_EQUIVALENT.items():
        if _given(kwargs, name):
            raise TypeError(f"{where}() got verl's {name!r}, which has no equivalent here: {instead}")
    try:
        ours = _respell({k: v for k, v in kwargs.items() if k not in VERL_WITHOUT_EQUIVALENT})
        unknown = [k for k in ours if k not in OPTION_NAMES and k not in INPUT_NAMES]
        if unknown:
            raise TypeError(
                f"{where}() got an unexpected keyword argument {unknown[0]!r}; "
                f"GRPO keywords are {', '.join(INPUT_NAMES + OPTION_NAMES)}"
            )
        inputs = GRPOInputs(**{k: v for k, v in ours.items() if k in INPUT_NAMES})
        options = GRPOOptions(**{k: v for k, v in ours.items() if k in OPTION_NAMES})
        if not options.is_verl:
            for name in VERL_ONLY_INPUTS:
                if getattr(inputs, name) is not None:
                    raise OptionError(f"{name} is verl's (its seq-mean-* reductions read it) and needs loss_mode (one of "
                                      f"{LOSS_MODES}); under loss_type the batch's counts are num_items_in_batch and "
                                      f"the call's sequences", name, "loss_mode")
    except OptionError as e:
        raise e.respelled(user_spelling(kwargs)) from None
    return inputs, options


def user_spelling(kwargs: Mapping[str, Any]) -> Dict[str, str]:
    """Our option names -> the names the caller used for them in ``kwargs`` (verl's where it used verl's)."""
    spelling = {ours: verl for verl, ours in VERL_SPELLINGS.items() if _given(kwargs, verl)}
    if _given(kwargs, "clip_ratio"):
        for ours, verl in (("eps_low", "clip_ratio_low"), ("eps_high", "clip_ratio_high")):
            if not (_given(kwargs, ours) or _given(kwargs, verl)):
                spelling[ours] = "clip_ratio"
    return spelling


# Public API (docs/api.md, "Public modules"): the option declarations and the vocabulary a trainer's
# config is generated from; the names other packages may import from this module.
__all__ = ["GRPOOptions", "GRPOInputs", "OPTION_NAMES", "OPTION_FIELDS", "INPUT_NAMES", "BACKENDS", "IGNORE_INDEX",
           "LOSS_TYPES", "LOSS_MODES", "TOKEN_NORMALISED_LOSS_TYPES", "check_top_k", "check_top_p"]
