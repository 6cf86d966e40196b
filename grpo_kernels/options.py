"""The GRPO loss's configuration, defined once.

Two vocabularies name the same loss spec (``objective``: an objective, a reduction, a KL estimator):
TRL's ``loss_type`` (each name an (objective, reduction) pair, TRL 1.16's ``GRPOTrainer``) and verl's
three axes ``loss_mode`` / ``loss_agg_mode`` / ``kl_loss_type`` (verl's ``core_algos``); giving both
``loss_type`` and ``loss_mode`` is an error. verl's other spellings (``clip_ratio_low``,
``kl_loss_coef``, ``entropy_coeff``, ``rollout_is_weights``, ...) are accepted as keywords and mean
the option :data:`VERL_SPELLINGS` names.

``GRPOOptions`` holds the scalar hyper-parameters (validated when it is built); ``GRPOInputs`` holds
the optional per-call tensors. Both are frozen dataclasses carried from the public functions and
modules through autograd to the kernels. The public functions take their fields as flat keywords:
:func:`grpo_keywords` gives a function the signature ``help()`` shows, generated from these fields,
so an option is added here and nowhere else (plus, if it is token-local, its term in
``objective.per_token_loss`` and the Triton epilogue).
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple, TypeVar, Union

import numpy as np
import torch

from . import _validation as V

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # PPO's clipped surrogate
# divide by a token count (dapo, cispo, vespo: num_items_in_batch; bnpo: the call's, which a trainer
# splitting a batch into micro-batches turns into dapo's by passing the whole batch's count)
TOKEN_NORMALISED_LOSS_TYPES = ("dapo", "bnpo", "cispo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
# verl's names (verl.trainer.ppo.core_algos): policy_loss.loss_mode, loss_agg_mode, kl_loss_type
LOSS_MODES = ("vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "dppo_tv", "dppo_kl", "dro")
# verl modes whose clip_ratio_low / _high are divergence thresholds (DPPO), not a ratio range
DIVERGENCE_CLIP_LOSS_MODES = ("dppo_tv", "dppo_kl")
# verl's clip_ratio_c default by mode (config.get("clip_ratio_c", ...)): vanilla's dual clip, DPPO's
# truncated importance weight; the other modes do not read it
VERL_CLIP_RATIO_C_DEFAULTS = {"vanilla": 3.0, "dppo_tv": 20.0, "dppo_kl": 20.0}
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_LOSS_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "k2+", "mse+", "low_var_kl+", "k3+")
# verl's kl_penalty names that need more than the sampled token's log-probs (here: refused, saying why)
KL_LOSS_TYPES_NEEDING_DISTRIBUTIONS = ("full", "full+")
# TRL's vllm_importance_sampling_mode names
ROLLOUT_CORRECTIONS = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
BACKENDS = ("auto", "triton", "torch", "reference")
IGNORE_INDEX = -100  # the target id of a position that predicts nothing (as in PyTorch and TRL)


# The sampler's truncation (vLLM 0.32's ``SamplingParams``): top_k is an int, 0 or -1 (or >= V) meaning off,
# and top_p is in (0, 1], 1 meaning off. Defined here once: the options' metadata, the validation of every
# function, and the trainer's config (grpo.config) read them.
TOP_K_BOUNDS = (-1, None)
TOP_P_BOUNDS = (0.0, 1.0, True, False)  # (low, high, low_open, high_open): 0 < top_p <= 1
TOP_K_OFF = (0, -1)  # vLLM's values that disable top-k (as None does here)


def check_top_k(top_k: object) -> Optional[int]:
    """None, or an int >= -1 (``TOP_K_BOUNDS``; numpy ints too, never a bool or a float); vLLM's "off"
    values 0 and -1 come back as None. ``top_k >= V`` is off as well (decided per call, where V is known)."""
    if top_k is None:
        return None
    if isinstance(top_k, (bool, np.bool_)) or not isinstance(top_k, numbers.Integral):
        raise TypeError(f"top_k must be an int (or None: off), got {type(top_k).__name__} {top_k!r}")
    if int(top_k) < TOP_K_BOUNDS[0]:
        raise ValueError(f"top_k must be a positive int, or 0 / -1 / None for off (vLLM's values), got {top_k}")
    return None if int(top_k) in TOP_K_OFF else int(top_k)


def check_top_p(top_p: object) -> Optional[float]:
    """None, or a real number in (0, 1] (``TOP_P_BOUNDS``; NaN never is); 1 (vLLM's "off") comes back as None."""
    if top_p is None:
        return None
    low, high, low_open, _ = TOP_P_BOUNDS
    if isinstance(top_p, (bool, torch.Tensor)) or not isinstance(top_p, numbers.Real):
        raise TypeError(f"top_p must be a real number in (0, 1] (or None: off), got {type(top_p).__name__} {top_p!r}")
    value = float(top_p)
    if not (low < value <= high):  # (False for NaN)
        raise ValueError(f"top_p must be in (0, 1] (1 or None: off), got {top_p!r}")
    return None if value == 1.0 else value


def _check_temperature_tensor(temperature: torch.Tensor, softcap: Optional[float], logit_scale: float) -> None:
    """A temperature tensor: floating point, every value finite and > 0 with a finite float32 factor
    (the float's rules, :func:`_validation.check_temperature`). One device synchronisation; its shape
    and device are checked against the call (:meth:`LogitTransform.for_rows`)."""
    if temperature.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"temperature must be a float or a floating-point tensor, got a {temperature.dtype} tensor")
    if temperature.numel() == 0 or temperature.device.type == "meta" or torch.compiler.is_compiling():
        return  # (no values to read: the device is checked against the call's, LogitTransform.for_rows)
    t = temperature.detach().double()
    bad = ~(torch.isfinite(t) & (t > 0))
    if bool(bad.any()):
        raise ValueError(f"temperature must be finite and > 0 everywhere, got {t[bad][0].item()}")
    lowest = float(t.min())
    V.check_temperature(lowest)  # (its 1 / T bound: the largest factor is the smallest temperature's)
    V.check_transform_factors(lowest, softcap, logit_scale)


@dataclass(frozen=True, eq=False)
class LogitTransform:
    """The distribution the log-probs are of: the softmax of
    ``z = softcap * tanh(logit_scale * logits / softcap) / temperature`` (``logit_scale * logits /
    temperature`` when ``softcap`` is None; Gemma-2/3's final-logit soft-capping, Cohere's ``logit_scale``,
    then the sampling temperature), truncated as a vLLM sampler truncates it: ``top_k`` then ``top_p``
    (``None`` = off; vLLM's "off" values are normalised to None here), renormalised.

    ``temperature``: a float, or a tensor (``[B]`` one per sequence, or the call's leading shape, one per
    token): :meth:`for_rows` checks its shape against a call and broadcasts it. A tensor's values are
    read in float64, so a tensor holding the float (float64, or a float32-representable value) gives
    bitwise the float's results. Compared by identity (``eq=False``: it may hold a tensor).
    """

    temperature: Any = 1.0  # float, or a floating-point tensor
    softcap: Optional[float] = None
    logit_scale: float = 1.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None

    def __post_init__(self) -> None:
        if self.softcap is not None:
            object.__setattr__(self, "softcap", V.check_number("softcap", self.softcap))
            if not self.softcap > 0:
                raise ValueError(f"softcap must be > 0 or None, got {self.softcap}")
        object.__setattr__(self, "logit_scale", V.check_number("logit_scale", self.logit_scale))
        if not self.logit_scale > 0:
            raise ValueError(f"logit_scale must be > 0, got {self.logit_scale}")
        if isinstance(self.temperature, torch.Tensor):
            _check_temperature_tensor(self.temperature, self.softcap, self.logit_scale)
        else:
            object.__setattr__(self, "temperature", V.check_temperature(self.temperature))
            V.check_transform_factors(self.temperature, self.softcap, self.logit_scale)
        object.__setattr__(self, "top_k", check_top_k(self.top_k))
        object.__setattr__(self, "top_p", check_top_p(self.top_p))

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

    def top_k_for(self, vocab_size: int) -> Optional[int]:
        """``top_k`` for a vocabulary of ``vocab_size``: None (off) when it keeps every token (``k >= V``)."""
        return None if self.top_k is None or self.top_k >= vocab_size else self.top_k

    def _unchecked(self, **changes: Any) -> "LogitTransform":
        """A copy with ``changes`` (already checked values: a broadcast or a slice of the temperature)."""
        out = object.__new__(LogitTransform)
        for f in dataclasses.fields(self):
            object.__setattr__(out, f.name, changes.get(f.name, getattr(self, f.name)))
        return out

    def for_rows(self, shape, device: Optional[torch.device] = None) -> "LogitTransform":
        """This transform for a call whose tokens have the leading shape ``shape`` (``[..., V]`` logits,
        ``[..., H]`` hidden states, ``[B, T]`` ids): a temperature tensor of shape ``shape`` (one per token)
        or ``shape[:1]`` (one per sequence) becomes a ``shape`` view (a ValueError names ``temperature``
        otherwise, or for another device than ``device``); a float stays as it is."""
        if not self.per_row:
            return self
        t, shape = self.temperature, tuple(shape)
        if device is not None and t.device != torch.device(device):
            raise ValueError(f"temperature is on {t.device}, the logits / hidden states on {device}: pass it on the same device")
        if tuple(t.shape) == shape:
            return self
        if len(shape) >= 1 and tuple(t.shape) == shape[:1]:
            return self._unchecked(temperature=t.reshape(shape[:1] + (1,) * (len(shape) - 1)).expand(shape))
        raise ValueError(f"temperature must be a float, a tensor of shape {list(shape[:1])} (one per sequence) or "
                         f"{list(shape)} (one per token), got shape {list(t.shape)}")

    def rows(self, index) -> "LogitTransform":
        """The transform of some rows of a call (``index``: a slice or int64 indices into its flattened
        tokens): the temperature tensor flattened and indexed; a float stays."""
        if not self.per_row:
            return self
        flat = self.temperature.reshape(-1)
        return self._unchecked(temperature=flat[index] if isinstance(index, slice) else flat.index_select(0, index))


@dataclass(frozen=True)
class GRPOOptions:
    """Scalar hyper-parameters of the GRPO loss (see ``docs/api.md``). Validated on construction.

    ``eps_high=None`` means ``eps_low`` and is resolved here, so ``options.eps_high`` is always a
    number. All are runtime values for the kernels: a new value compiles no new kernel.
    """

    beta: float = field(default=0.0, metadata={"help": "KL coefficient (verl: kl_loss_coef); > 0 needs ref_logps", "bounds": (0.0, None)})
    eps_low: float = field(default=0.2, metadata={"help": "lower clipping range: the ratio is clipped below at 1 - eps_low (verl: clip_ratio_low; 1 only for cispo; dppo_tv / dppo_kl: the divergence threshold where A <= 0)", "bounds": (0.0, 1.0, False, True)})
    eps_high: Optional[float] = field(default=None, metadata={"help": "upper clipping range (None: eps_low); DAPO's clip-higher uses e.g. 0.28 (verl: clip_ratio_high; dppo_tv / dppo_kl: the divergence threshold where A > 0)", "bounds": (0.0, None)})
    delta: Optional[float] = field(default=None, metadata={"help": "two-sided clipping: caps the ratio at delta, which matters where the advantage is negative (> 1 + eps_high; verl: clip_ratio_c, > 1, default 3 under loss_mode='vanilla'; dppo_tv / dppo_kl: the cap of the detached ratio, default 20)", "bounds": (1.0, None, True)})
    temperature: Union[float, torch.Tensor] = field(default=1.0, metadata={"help": "logits are divided by it before the softmax (the sampling temperature); a tensor: [B] one per sequence or [B, T] one per token"})
    softcap: Optional[float] = field(default=None, metadata={"help": "final-logit soft-capping: softcap * tanh(z / softcap)"})
    logit_scale: float = field(default=1.0, metadata={"help": "logits are multiplied by it first (Cohere)"})
    top_k: Optional[int] = field(default=None, metadata={"help": "the sampler's top-k (vLLM's rule, ties at the k-th value kept): log-probs, entropy and loss of the truncated, renormalised distribution; None, 0 or -1: off", "bounds": TOP_K_BOUNDS})
    top_p: Optional[float] = field(default=None, metadata={"help": "the sampler's top-p (nucleus, after top-k; vLLM's rule): log-probs, entropy and loss of the truncated, renormalised distribution; None or 1: off", "bounds": TOP_P_BOUNDS})
    loss_type: str = field(default="dapo", metadata={"help": "TRL's name of the objective and how per-token losses are summed (docs/api.md): the mean of per-sequence means (grpo, sapo), the sum over tokens divided by their count (bnpo; dapo, cispo, vespo: the whole batch's) or by completions * max_completion_length (dr_grpo; luspo: by completions); not with loss_mode", "choices": LOSS_TYPES})
    loss_mode: Optional[str] = field(default=None, metadata={"help": "verl's policy_loss.loss_mode (instead of loss_type)", "choices": LOSS_MODES})
    loss_agg_mode: Optional[str] = field(default=None, metadata={"help": "verl's loss_agg_mode (with loss_mode; None: token-mean)", "choices": LOSS_AGG_MODES})
    kl_loss_type: Optional[str] = field(default=None, metadata={"help": "verl's KL estimator (with loss_mode; None: low_var_kl)", "choices": KL_LOSS_TYPES})
    max_completion_length: Optional[int] = field(default=None, metadata={"help": "dr_grpo's constant (verl: loss_scale_factor of seq-mean-token-sum-norm); None = T", "bounds": (1, None)})
    importance_sampling_level: str = field(
        default="token", metadata={"help": "the importance ratio per token, or per sequence (GSPO)", "choices": IMPORTANCE_SAMPLING_LEVELS}
    )
    entropy_coef: float = field(default=0.0, metadata={"help": "entropy bonus: subtracts entropy_coef times the mean entropy (verl: entropy_coeff)", "bounds": (None, None)})
    use_bias_correction_kl: bool = field(default=False, metadata={"help": "multiply the k3 KL by the importance ratio (TRL's use_bias_correction_kl)"})
    top_entropy_quantile: float = field(default=1.0, metadata={"help": "TRL: the policy loss only on the top quantile of tokens by entropy (1: all)", "bounds": (0.0, 1.0)})
    off_policy_mask_threshold: Optional[float] = field(default=None, metadata={"help": "TRL (DeepSeek-V3.2): drop sequences with A < 0 whose mean KL to the sampling policy exceeds it", "bounds": (0.0, None)})
    rollout_correction: Optional[str] = field(default=None, metadata={"help": "correct for the rollout engine's log-probs (rollout_logps), TRL's vllm_importance_sampling_mode", "choices": ROLLOUT_CORRECTIONS})
    rollout_correction_max: Optional[float] = field(default=3.0, metadata={"help": "rollout correction's cap (None: unbounded)", "bounds": (0.0, None)})
    rollout_correction_min: Optional[float] = field(default=None, metadata={"help": "rollout correction's floor: *_mask drop ratios below it, *_truncate clamp at it", "bounds": (0.0, None)})
    clip_cov_ratio: Optional[float] = field(default=None, metadata={"help": "verl clip_cov: fraction of tokens whose gradient is dropped (None: 0.0002)", "bounds": (0.0, None, True)})
    clip_cov_lb: Optional[float] = field(default=None, metadata={"help": "verl clip_cov: covariance lower bound (None: 1)"})
    clip_cov_ub: Optional[float] = field(default=None, metadata={"help": "verl clip_cov: covariance upper bound (None: 5)"})
    kl_cov_ratio: Optional[float] = field(default=None, metadata={"help": "verl kl_cov: fraction of tokens given the KL penalty (None: 0.0002)", "bounds": (0.0, None, True)})
    ppo_kl_coef: Optional[float] = field(default=None, metadata={"help": "verl kl_cov: coefficient of |log ratio| (None: 1)"})
    dro_beta: Optional[float] = field(default=None, metadata={"help": "verl dro (policy_loss.dro_beta): coefficient of the penalty dro_beta / 2 * (logp - old)^2; > 0, needed by loss_mode='dro'", "bounds": (0.0, None, True)})
    dp_size: int = field(default=1, metadata={"help": "verl's agg_loss dp_size: the loss is multiplied by it (data-parallel ranks averaging gradients); > 1 needs the global normaliser of loss_agg_mode (num_items_in_batch or global_batch_size)", "bounds": (1, None)})
    sapo_temperature_pos: float = field(default=1.0, metadata={"help": "sapo: gate temperature where A > 0 (verl: tau_pos)"})
    sapo_temperature_neg: float = field(default=1.05, metadata={"help": "sapo: gate temperature where A <= 0 (verl: tau_neg)"})
    vespo_k_pos: float = field(default=2.0, metadata={"help": "vespo: power k of the gamma weight where A >= 0"})
    vespo_lambda_pos: float = field(default=3.0, metadata={"help": "vespo: decay lambda where A >= 0"})
    vespo_k_neg: float = field(default=3.0, metadata={"help": "vespo: power k where A < 0"})
    vespo_lambda_neg: float = field(default=2.0, metadata={"help": "vespo: decay lambda where A < 0"})

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        self._resolve_vocabulary(set_)
        set_("beta", V.check_number("beta", self.beta))
        # verl's cispo takes eps_low = 1 for "no lower clamp" (its ratio is then clamped at 0); DPPO's
        # eps_low / eps_high are divergence thresholds, any >= 0
        cispo = self.loss_mode == "cispo"
        divergence = self.loss_mode in DIVERGENCE_CLIP_LOSS_MODES
        set_("eps_low", V.check_number("eps_low", self.eps_low, low=0.0, high=None if divergence else 1.0,
                                       high_open=not cispo))
        if self.delta is None and self.loss_mode in VERL_CLIP_RATIO_C_DEFAULTS:
            set_("delta", VERL_CLIP_RATIO_C_DEFAULTS[self.loss_mode])  # verl's clip_ratio_c default for the mode
        eps_high = self.eps_low if self.eps_high is None else self.eps_high
        set_("eps_high", V.check_number("eps_high", eps_high, low=0.0))
        if self.delta is not None:
            set_("delta", V.check_number("delta", self.delta))
            if self.is_verl and not self.delta > 1:  # verl's assert clip_ratio_c > 1 (a cap, not a range bound)
                raise ValueError(f"delta (verl: clip_ratio_c) must be > 1, got {self.delta}")
            if not self.is_verl and not self.delta > 1 + self.eps_high:
                raise ValueError(f"delta must be > 1 + eps_high = {1 + self.eps_high}, got {self.delta}")
        transform = LogitTransform(self.temperature, self.softcap, self.logit_scale, self.top_k, self.top_p)
        set_("temperature", transform.temperature)
        set_("softcap", transform.softcap)
        set_("logit_scale", transform.logit_scale)
        set_("top_k", transform.top_k)  # (vLLM's "off" values as None)
        set_("top_p", transform.top_p)
        set_("_transform", transform)
        if self.loss_mode is None:
            V.check_choice("loss_type", self.loss_type, LOSS_TYPES)
        V.check_choice("importance_sampling_level", self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
        if self.max_completion_length is not None:
            V.check_positive_int("max_completion_length", self.max_completion_length)
        set_("entropy_coef", V.check_number("entropy_coef", self.entropy_coef))
        set_("use_bias_correction_kl", V.check_flag("use_bias_correction_kl", self.use_bias_correction_kl))
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            set_(name, V.check_number(name, getattr(self, name)))
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            set_(name, V.check_number(name, getattr(self, name), low=0.0))
        set_("top_entropy_quantile", V.check_number("top_entropy_quantile", self.top_entropy_quantile, low=0.0, high=1.0))
        for name in ("off_policy_mask_threshold", "rollout_correction_max", "rollout_correction_min"):
            if getattr(self, name) is not None:
                set_(name, V.check_number(name, getattr(self, name), low=0.0))
        if self.rollout_correction is not None:
            V.check_choice("rollout_correction", self.rollout_correction, ROLLOUT_CORRECTIONS)
        if (self.rollout_correction_min is not None and self.rollout_correction_max is not None
                and self.rollout_correction_min > self.rollout_correction_max):
            raise ValueError(f"rollout_correction_min ({self.rollout_correction_min}) must be <= rollout_correction_max "
                             f"({self.rollout_correction_max})")
        for name, default in VERL_MODE_DEFAULTS.items():
            value = getattr(self, name)
            set_(name, default if value is None else V.check_number(name, value))
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.dro_beta is not None:
            set_("dro_beta", V.check_number("dro_beta", self.dro_beta))
        if self.loss_mode == "dro" and not (self.dro_beta is not None and self.dro_beta > 0):
            raise ValueError(f"loss_mode='dro' needs dro_beta > 0 (verl: policy_loss.dro_beta, the coefficient of "
                             f"dro_beta / 2 * (logp - old)^2), got {self.dro_beta!r}")
        if isinstance(self.dp_size, bool) or not isinstance(self.dp_size, int) or self.dp_size < 1:
            raise ValueError(f"dp_size must be a positive int, got {self.dp_size!r}")

    def _resolve_vocabulary(self, set_: Callable[[str, Any], None]) -> None:
        """TRL's ``loss_type`` or verl's ``loss_mode`` (never both); each side's options only with it."""
        if self.loss_mode is None:
            for name in VERL_ONLY_OPTIONS:
                value = getattr(self, name)
                if value not in (None, _FIELD_DEFAULTS[name], VERL_MODE_DEFAULTS.get(name)):
                    raise ValueError(f"{name}={value!r} is verl's and needs loss_mode (one of {LOSS_MODES}); "
                                     f"with loss_type the reduction and the KL are TRL's")
            return
        V.check_choice("loss_mode", self.loss_mode, LOSS_MODES)
        if self.loss_type not in (None, _FIELD_DEFAULTS["loss_type"]):  # (the default, or resolved already)
            raise ValueError(f"loss_type={self.loss_type!r} and loss_mode={self.loss_mode!r} name the loss twice: pass "
                             f"TRL's loss_type (one of {LOSS_TYPES}) or verl's loss_mode (one of {LOSS_MODES}), not both")
        set_("loss_type", None)  # the loss is named by loss_mode
        set_("loss_agg_mode", "token-mean" if self.loss_agg_mode is None else self.loss_agg_mode)
        V.check_choice("loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        set_("kl_loss_type", "low_var_kl" if self.kl_loss_type is None else self.kl_loss_type)
        if self.kl_loss_type in KL_LOSS_TYPES_NEEDING_DISTRIBUTIONS:
            raise ValueError(f"kl_loss_type={self.kl_loss_type!r} is the exact KL, which needs both models' whole "
                             f"distributions over the vocabulary, not the sampled tokens' log-probs (verl raises "
                             f"NotImplementedError for it too); pick one of {KL_LOSS_TYPES}")
        V.check_choice("kl_loss_type", self.kl_loss_type, KL_LOSS_TYPES)
        for name, allowed in TRL_ONLY_OPTIONS.items():
            if getattr(self, name) != allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is TRL's and needs loss_type; under loss_mode it must "
                                 f"stay {allowed!r} (verl's sequence-level ratio is loss_mode='gspo')")

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
    loss: no gradient flows to them.
    """

    old_logps: Optional[torch.Tensor] = field(default=None, metadata={"help": "[B, T] log-probs of the sampling policy; None = on-policy"})
    ref_logps: Optional[torch.Tensor] = field(default=None, metadata={"help": "[B, T] log-probs of the reference model (KL term)"})
    is_ratio: Optional[torch.Tensor] = field(default=None, metadata={"help": "[B, T] or [B, 1] rollout importance weight, scales the policy term"})
    num_items_in_batch: Any = field(default=None, metadata={"help": "dapo's normaliser: global count of loss tokens"})
    segment_ids: Optional[torch.Tensor] = field(default=None, metadata={"help": "[B, T] int: packed rows, one id per sequence"})
    rollout_logps: Optional[torch.Tensor] = field(default=None, metadata={"help": "[B, T] the rollout engine's log-probs (rollout_correction, off_policy_mask_threshold)"})
    global_batch_size: Any = field(default=None, metadata={"help": "verl: sequences of the global batch (seq-mean-* reductions); None = this call's"})


# verl's mode-specific settings: None means verl's default, filled in by GRPOOptions
VERL_MODE_DEFAULTS = {"clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0, "kl_cov_ratio": 0.0002,
                      "ppo_kl_coef": 1.0}
VERL_ONLY_OPTIONS = ("loss_agg_mode", "kl_loss_type", "dp_size", "dro_beta") + tuple(VERL_MODE_DEFAULTS)
# TRL's options that verl has no counterpart for, and the value that means "off"
TRL_ONLY_OPTIONS = {"top_entropy_quantile": 1.0, "off_policy_mask_threshold": None, "use_bias_correction_kl": False,
                    "importance_sampling_level": "token"}
_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GRPOOptions)}
OPTION_NAMES: Tuple[str, ...] = tuple(f.name for f in dataclasses.fields(GRPOOptions))
INPUT_NAMES: Tuple[str, ...] = tuple(f.name for f in dataclasses.fields(GRPOInputs))


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


def _respell(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """verl's spellings -> ours; ``clip_ratio`` fills eps_low and eps_high; two spellings of one option raise."""
    out = {k: v for k, v in kwargs.items() if k not in VERL_SPELLINGS and k != "clip_ratio"}
    for verl_name, ours in VERL_SPELLINGS.items():
        if verl_name in kwargs:
            if ours in kwargs:
                raise TypeError(f"{verl_name} (verl's name) and {ours} are the same option: pass one of them")
            out[ours] = kwargs[verl_name]
    if "clip_ratio" in kwargs:  # verl: clip_ratio_low / _high default to clip_ratio
        for ours in ("eps_low", "eps_high"):
            if ours in kwargs and "clip_ratio_low" not in kwargs and "clip_ratio_high" not in kwargs:
                raise TypeError(f"clip_ratio (verl's name) and {ours} both set the clip range: pass one of them")
            out.setdefault(ours, kwargs["clip_ratio"])
    return out


def split_grpo_keywords(kwargs: Dict[str, Any], where: str) -> Tuple[GRPOInputs, GRPOOptions]:
    """Flat keywords (ours, or verl's spellings) -> (GRPOInputs, GRPOOptions); an unknown keyword is a
    TypeError naming it."""
    for name, instead in VERL_WITHOUT_EQUIVALENT.items():
        if name in kwargs:
            raise TypeError(f"{where}() got verl's {name!r}, which has no equivalent here: {instead}")
    kwargs = _respell(kwargs)
    if "loss_type" in kwargs and kwargs.get("loss_mode") is not None:
        raise ValueError(f"loss_type={kwargs['loss_type']!r} and loss_mode={kwargs['loss_mode']!r} name the loss twice: "
                         f"pass TRL's loss_type (one of {LOSS_TYPES}) or verl's loss_mode (one of {LOSS_MODES}), not both")
    unknown = [k for k in kwargs if k not in OPTION_NAMES and k not in INPUT_NAMES]
    if unknown:
        raise TypeError(
            f"{where}() got an unexpected keyword argument {unknown[0]!r}; "
            f"GRPO keywords are {', '.join(INPUT_NAMES + OPTION_NAMES)}"
        )
    inputs = GRPOInputs(**{k: v for k, v in kwargs.items() if k in INPUT_NAMES})
    options = GRPOOptions(**{k: v for k, v in kwargs.items() if k in OPTION_NAMES})
    return inputs, options


F = TypeVar("F", bound=Callable[..., Any])


def grpo_keywords(fn: F) -> F:
    """Give ``fn(..., **grpo_kwargs)`` the signature with every GRPOInputs and GRPOOptions field.

    ``help(grpo_loss)`` and ``inspect.signature`` then list the flat keywords, their defaults and
    types, although they are defined once, in the dataclasses above.
    """
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    for cls in (GRPOInputs, GRPOOptions):
        for f in dataclasses.fields(cls):
            params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type))
    fn.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return fn
