"""The GRPO loss's configuration, defined once.

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
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple, TypeVar

import torch

from . import _validation as V

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # PPO's clipped surrogate
# divide by a token count (dapo, cispo, vespo: num_items_in_batch; bnpo: the call's, which a trainer
# splitting a batch into micro-batches turns into dapo's by passing the whole batch's count)
TOKEN_NORMALISED_LOSS_TYPES = ("dapo", "bnpo", "cispo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
BACKENDS = ("auto", "triton", "torch", "reference")
IGNORE_INDEX = -100  # the target id of a position that predicts nothing (as in PyTorch and TRL)


@dataclass(frozen=True)
class LogitTransform:
    """What the softmax sees: ``z = softcap * tanh(logit_scale * logits / softcap) / temperature``
    (``logit_scale * logits / temperature`` when ``softcap`` is None), as Gemma-2/3 (final-logit
    soft-capping) and Cohere (``logit_scale``) compute their logits, then the sampling temperature."""

    temperature: float = 1.0
    softcap: Optional[float] = None
    logit_scale: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "temperature", V.check_temperature(self.temperature))
        if self.softcap is not None:
            object.__setattr__(self, "softcap", V.check_number("softcap", self.softcap))
            if not self.softcap > 0:
                raise ValueError(f"softcap must be > 0 or None, got {self.softcap}")
        object.__setattr__(self, "logit_scale", V.check_number("logit_scale", self.logit_scale))
        if not self.logit_scale > 0:
            raise ValueError(f"logit_scale must be > 0, got {self.logit_scale}")

    @staticmethod
    def of(value: "float | LogitTransform") -> "LogitTransform":
        """A bare temperature, or a transform already."""
        return value if isinstance(value, LogitTransform) else LogitTransform(temperature=value)

    @property
    def is_plain(self) -> bool:
        """Only a temperature (the common case, and the cheapest kernel)."""
        return self.softcap is None and self.logit_scale == 1.0


@dataclass(frozen=True)
class GRPOOptions:
    """Scalar hyper-parameters of the GRPO loss (see ``docs/api.md``). Validated on construction.

    ``eps_high=None`` means ``eps_low`` and is resolved here, so ``options.eps_high`` is always a
    number. All are runtime values for the kernels: a new value compiles no new kernel.
    """

    beta: float = field(default=0.0, metadata={"help": "KL coefficient; > 0 needs ref_logps"})
    eps_low: float = field(default=0.2, metadata={"help": "lower clip: ratio >= 1 - eps_low"})
    eps_high: Optional[float] = field(default=None, metadata={"help": "upper clip: ratio <= 1 + eps_high; None = eps_low"})
    delta: Optional[float] = field(default=None, metadata={"help": "two-sided clipping: the unclipped ratio is capped at delta"})
    temperature: float = field(default=1.0, metadata={"help": "logits are divided by it before the softmax"})
    softcap: Optional[float] = field(default=None, metadata={"help": "final-logit soft-capping: softcap * tanh(z / softcap)"})
    logit_scale: float = field(default=1.0, metadata={"help": "logits are multiplied by it first (Cohere)"})
    loss_type: str = field(default="dapo", metadata={"help": "reduction over tokens", "choices": LOSS_TYPES})
    max_completion_length: Optional[int] = field(default=None, metadata={"help": "dr_grpo's constant; None = T"})
    importance_sampling_level: str = field(
        default="token", metadata={"help": "token ratios, or sequence (GSPO)", "choices": IMPORTANCE_SAMPLING_LEVELS}
    )
    entropy_coef: float = field(default=0.0, metadata={"help": "entropy bonus: the loss subtracts entropy_coef * H"})
    use_bias_correction_kl: bool = field(default=False, metadata={"help": "k3 KL times the importance ratio (TRL)"})
    sapo_temperature_pos: float = field(default=1.0, metadata={"help": "sapo: gate temperature where A > 0"})
    sapo_temperature_neg: float = field(default=1.05, metadata={"help": "sapo: gate temperature where A <= 0"})
    vespo_k_pos: float = field(default=2.0, metadata={"help": "vespo: power k of the gamma weight where A >= 0"})
    vespo_lambda_pos: float = field(default=3.0, metadata={"help": "vespo: decay lambda where A >= 0"})
    vespo_k_neg: float = field(default=3.0, metadata={"help": "vespo: power k where A < 0"})
    vespo_lambda_neg: float = field(default=2.0, metadata={"help": "vespo: decay lambda where A < 0"})

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        set_("beta", V.check_number("beta", self.beta))
        set_("eps_low", V.check_number("eps_low", self.eps_low, low=0.0, high=1.0, high_open=True))
        eps_high = self.eps_low if self.eps_high is None else self.eps_high
        set_("eps_high", V.check_number("eps_high", eps_high, low=0.0))
        if self.delta is not None:
            set_("delta", V.check_number("delta", self.delta))
            if not self.delta > 1 + self.eps_high:
                raise ValueError(f"delta must be > 1 + eps_high = {1 + self.eps_high}, got {self.delta}")
        transform = LogitTransform(self.temperature, self.softcap, self.logit_scale)
        set_("temperature", transform.temperature)
        set_("softcap", transform.softcap)
        set_("logit_scale", transform.logit_scale)
        V.check_choice("loss_type", self.loss_type, LOSS_TYPES)
        V.check_choice("importance_sampling_level", self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
        if self.max_completion_length is not None:
            V.check_positive_int("max_completion_length", self.max_completion_length)
        set_("entropy_coef", V.check_number("entropy_coef", self.entropy_coef))
        if not isinstance(self.use_bias_correction_kl, bool):
            raise TypeError(f"use_bias_correction_kl must be a bool, got {self.use_bias_correction_kl!r}")
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            set_(name, V.check_number(name, getattr(self, name)))
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            set_(name, V.check_number(name, getattr(self, name), low=0.0))

    @property
    def transform(self) -> LogitTransform:
        """The logits' transform before the softmax (temperature, softcap, logit_scale)."""
        return LogitTransform(self.temperature, self.softcap, self.logit_scale)


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


OPTION_NAMES: Tuple[str, ...] = tuple(f.name for f in dataclasses.fields(GRPOOptions))
INPUT_NAMES: Tuple[str, ...] = tuple(f.name for f in dataclasses.fields(GRPOInputs))


def split_grpo_keywords(kwargs: Dict[str, Any], where: str) -> Tuple[GRPOInputs, GRPOOptions]:
    """Flat keywords -> (GRPOInputs, GRPOOptions); an unknown keyword is a TypeError naming it."""
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
