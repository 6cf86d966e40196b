"""``GRPOConfig``: every knob of a run, each documented once, validated when the config is made.

Each field carries its help text, and where it has them its allowed choices and range, in
``dataclasses.field(metadata=...)``. ``__post_init__`` checks every field against them (and the few
rules that tie fields together), and so does every later assignment, so a misspelt ``loss_type`` or a
negative learning rate fails at once with the allowed values in the message, not after the model has
loaded. ``python -m grpo train --help`` prints the same text and choices (``grpo.__main__``).

The loss fields are generated from ``grpo_kernels.options.GRPOOptions`` (:func:`with_loss_fields`):
their names, types, defaults, help, choices and ranges are the loss spec's own, so a new loss option
appears in the functions, the modules, this config and ``--help`` at once. The advantage choice lists
are ``grpo.advantages``'s, and the process kinds ``grpo.distributed``'s: each list lives in one place.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from grpo_kernels.options import BACKENDS, OPTION_NAMES, ROLLOUT_CORRECTIONS, GRPOOptions

from .activations import MIN_CHUNK_TOKENS
from .activations import check_settings as check_activation_settings
from .advantages import SCALES, STD_KINDS
from .distributed import KINDS as DISTRIBUTED_KINDS
from .precision import MODEL_DTYPES


@dataclass(frozen=True)
class Bounds:
    """An interval a number must lie in (NaN never does; infinities only when ``finite`` is False)."""

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False  # low < x, not low <= x
    high_open: bool = False  # x < high, not x <= high
    finite: bool = True

    def holds(self, x: float) -> bool:
        if not isinstance(x, numbers.Integral) and (math.isnan(x) or (self.finite and math.isinf(x))):
            return False  # (an int is finite, and may be too large for a float)
        if self.low is not None and not (x > self.low if self.low_open else x >= self.low):
            return False
        return self.high is None or (x < self.high if self.high_open else x <= self.high)

    def __str__(self) -> str:
        return self.describe()

    def describe(self, integer: bool = False) -> str:
        """E.g. ``">= 0, < 1"``, ``"> 0, finite"``; ``integer``: the value is an int (always finite)."""
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {_number(self.low)}")
        if self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {_number(self.high)}")
        if self.finite and not integer and (self.low is None or self.high is None):
            parts.append("finite")
        return ", ".join(parts)


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 2**53 else f"{x:g}"


def at_least(low: float) -> Bounds:
    return Bounds(low=low)


def above(low: float, finite: bool = True) -> Bounds:
    return Bounds(low=low, low_open=True, finite=finite)


FINITE = Bounds()
ZERO_TO_ONE = Bounds(low=0, high=1, high_open=True)  # [0, 1)


def option(default: Any, help: str, *, choices: Optional[tuple] = None, bounds: Optional[Bounds] = None, why: str = "",
           words: bool = False) -> Any:
    """A config field with its help text, and its choices or range when it has them (``why``: the reason
    for a range that is not obvious, added to the error; ``words``: a comma-separated str field whose
    flag also takes several words, joined with commas)."""
    return field(default=default, metadata={"help": help, "choices": choices, "bounds": bounds, "why": why, "words": words})


# Loss options the trainer sets itself: the sampling temperature is its own field (the loss divides by
# it too), the model gives softcap / logit_scale, max_new_tokens is dr_grpo's length, the trainer
# scales micro-batch losses by the number of ranks (verl's dp_size), and the rollout correction is
# set under TRL's names (vllm_importance_sampling_*, mapped in GRPOConfig._loss_fields).
TRAINER_OWNED_LOSS_OPTIONS = ("temperature", "softcap", "logit_scale", "max_completion_length", "dp_size",
                              "rollout_correction", "rollout_correction_max", "rollout_correction_min")


def _bounds(spec: Optional[tuple]) -> Optional[Bounds]:
    """An option's ``metadata["bounds"]`` ``(low, high[, low_open[, high_open]])`` as a :class:`Bounds`."""
    if spec is None:
        return None
    low, high, *open_ = spec
    return Bounds(low, high, *open_)


def with_loss_fields(after: str):
    """Insert one field per ``GRPOOptions`` field (but :data:`TRAINER_OWNED_LOSS_OPTIONS`) after the
    field ``after``, with the option's type, default and ``metadata`` (help, choices, bounds)."""

    def decorate(cls):
        hints = typing.get_type_hints(GRPOOptions)
        annotations = {}
        for name, hint in cls.__annotations__.items():
            annotations[name] = hint
            if name != after:
                continue
            for f in dataclasses.fields(GRPOOptions):
                if f.name in TRAINER_OWNED_LOSS_OPTIONS:
                    continue
                kind, default = hints[f.name], f.default
                annotations[f.name] = kind
                setattr(cls, f.name, option(default, f.metadata["help"], choices=f.metadata.get("choices"),
                                            bounds=_bounds(f.metadata.get("bounds"))))
        cls.__annotations__ = annotations
        return cls

    return decorate


@dataclass
@with_loss_fields(after="accuracy_reward")
class GRPOConfig:
    """Every knob of a run. The defaults are TRL-like; the demo overrides many of them.

    Fields are checked on construction and on assignment: a wrong type raises ``TypeError``, a value
    outside its choices or range ``ValueError``, both naming the field and what it allows.
    """

    output_dir: str = option("runs/grpo", "where log.jsonl, curves.png and checkpoint.pt go")
    seed: int = option(0, "seeds sampling, the prompt order and the initial RNG states", bounds=Bounds(0, 2**32, high_open=True))
    num_steps: int = option(100, "training steps (one batch of rollouts each)", bounds=at_least(1))
    # rollouts
    prompts_per_step: int = option(8, "prompts per step, over all ranks (the global batch)", bounds=at_least(1))
    num_generations: int = option(
        8, "G: completions sampled per prompt, the group its advantages are relative to", bounds=at_least(2),
        why="a group of one completion is its own baseline, so every advantage would be 0 and GRPO would learn nothing",
    )
    max_new_tokens: int = option(256, "the longest completion, in tokens", bounds=at_least(1))
    temperature: float = option(1.0, "sampling temperature; as in TRL the loss divides the logits by it too", bounds=above(0))
    top_p: float = option(1.0, "nucleus sampling: keep the smallest set of tokens with this much probability", bounds=Bounds(0, 1, low_open=True))
    # rollout engine (grpo.rollout): Hugging Face generate, or vLLM, whose log-probs the loss corrects for.
    # TRL's names and defaults (trl.GRPOConfig 1.16); they set the loss's rollout_correction,
    # rollout_correction_max and rollout_correction_min (_loss_fields).
    use_vllm: bool = option(False, "sample with a vLLM engine in this process (grpo.rollout.VLLMRollout; pip install "
                            "'grpo-kernels[vllm]'), the policy's weights copied into it every step")
    vllm_gpu_memory_utilization: float = option(0.3, "use_vllm on CUDA: the fraction of the GPU's memory the engine takes "
                                                "(weights and KV cache)", bounds=Bounds(0, 1, low_open=True))
    vllm_importance_sampling_correction: bool = option(
        True, "weigh the policy loss by the ratio of the trainer's to the engine's probability of the sampled tokens "
        "(when the engine reports its log-probs: use_vllm); the loss's rollout_correction")
    vllm_importance_sampling_mode: str = option(
        "sequence_mask", "the ratio per token or per sequence (summed log-ratios); one outside [clip_min, clip_max] is "
        "clamped to it (truncate) or gets weight 0 (mask)", choices=ROLLOUT_CORRECTIONS)
    vllm_importance_sampling_clip_max: Optional[float] = option(
        3.0, "the largest ratio kept (None: unbounded; the loss's rollout_correction_max)", bounds=above(0))
    vllm_importance_sampling_clip_min: Optional[float] = option(
        None, "the smallest ratio kept (None: no floor; the loss's rollout_correction_min)", bounds=at_least(0))
    vllm_importance_sampling_cap: Optional[float] = option(
        None, "TRL's older name of vllm_importance_sampling_clip_max: when given, it replaces it", bounds=above(0))
    # rewards and advantages
    reward_weights: Optional[list[float]] = option(None, "one weight per reward function (None: all 1)", bounds=FINITE)
    advantage_std: str = option("population", "the group std: 'population' divides by G (the GRPO papers), 'unbiased' by G-1 (TRL)", choices=STD_KINDS)
    scale_rewards: str = option("group", "divide advantages by the group's std, the batch's, or not at all ('none', Dr. GRPO)", choices=SCALES)
    drop_zero_signal_groups: bool = option(False, "leave groups whose rewards are all equal (advantage 0) out of the update")
    mask_truncated_completions: bool = option(False, "completions without EOS add no loss")
    overlong_buffer: int = option(0, "DAPO's soft overlong penalty over the last this many tokens (0: off)", bounds=at_least(0))
    overlong_penalty: float = option(1.0, "the overlong penalty at max_new_tokens", bounds=at_least(0))
    accuracy_reward: str = option("accuracy", "the reward function also logged as 'accuracy', when there is one")
    # loss: the fields of grpo_kernels.GRPOOptions are inserted here (with_loss_fields), then:
    num_iterations: int = option(1, "mu: optimizer steps on each batch of rollouts", bounds=at_least(1))
    backend: str = option("auto", "grpo_kernels backend for the fused loss", choices=BACKENDS)
    chunk_size: Optional[int] = option(None, "rows of logits the fused loss materialises at once (None: its default)", bounds=at_least(1))
    # optimisation
    learning_rate: float = option(1e-6, "AdamW learning rate (after warm-up)", bounds=at_least(0))
    weight_decay: float = option(0.0, "AdamW weight decay", bounds=at_least(0))
    adam_beta1: float = option(0.9, "AdamW beta1", bounds=ZERO_TO_ONE)
    adam_beta2: float = option(0.99, "AdamW beta2", bounds=ZERO_TO_ONE)
    warmup_steps: int = option(0, "linear learning-rate warm-up, in steps", bounds=at_least(0))
    max_grad_norm: float = option(1.0, "clip the gradient norm to this (inf: measure only)", bounds=above(0, finite=False))
    padding_free: bool = option(True, "pack whole sequences into one row per micro-batch, no padding (grpo.packing); "
                                "attention stays within each sequence")
    max_tokens_per_microbatch: Optional[int] = option(
        None, "padding_free: tokens per packed micro-batch, filled longest first (None: the whole batch in one row)",
        bounds=at_least(1))
    micro_batch_size: Optional[int] = option(None, "padded steps (padding_free off): completions per forward/backward "
                                             "(None: the whole batch)", bounds=at_least(1))
    gradient_checkpointing: bool = option(False, "recompute activations in backward to save memory")
    activation_offload: bool = option(
        False, "gradient_checkpointing: keep each checkpointed layer input in host memory (pinned) between the forward "
        "and its recompute, copied on a side stream with one layer prefetched; on a CPU a no-op (grpo.activations)")
    mlp_chunk_tokens: Optional[int] = option(
        None, "run each decoder layer's MLP over chunks of this many tokens (forward, recompute and backward), so its "
        "intermediate activations exist one chunk at a time (None: whole micro-batches; grpo.activations)",
        bounds=at_least(MIN_CHUNK_TOKENS))
    model_dtype: str = option("float32", "the dtype the policy's weights are held in; bfloat16: the frozen weights in "
                              "bf16, trainable ones with fp32 AdamW master copies (LoRA adapters stay fp32)",
                              choices=MODEL_DTYPES)
    # LoRA adapters through peft (TRL's trl.ModelConfig names); grpo.lora
    use_peft: bool = option(False, "train LoRA adapters only (peft); with beta > 0 the reference is the same model "
                            "with its adapters disabled (no second copy)")
    lora_r: int = option(16, "LoRA rank", bounds=at_least(1))
    lora_alpha: int = option(32, "LoRA alpha (the update is scaled by alpha / r)", bounds=at_least(1))
    lora_dropout: float = option(0.05, "dropout on the adapters' input", bounds=ZERO_TO_ONE)
    lora_target_modules: str = option("all-linear", "modules that get adapters: 'all-linear' (every linear layer but "
                                      "lm_head) or module names, comma-separated (q_proj,v_proj)", words=True)
    bf16: bool = option(True, "bf16 autocast (on CUDA only)")
    # logging and checkpoints
    save_every: int = option(50, "write a checkpoint every this many steps (0: only at the end)", bounds=at_least(0))
    resume: bool = option(False, "continue from output_dir/checkpoint.pt when it exists (a run without it refuses a "
                          "directory that holds a checkpoint)")
    resume_with_changes: bool = option(False, "resume even though settings outside grpo.checkpoint.RESUMABLE_CHANGES "
                                       "(the loss, G, the learning rate, the seed...) differ from the checkpoint's")
    progress: bool = option(True, "show a progress bar")
    plot: bool = option(True, "draw curves.png at the end")
    distributed: str = option("none", "several processes under torchrun: DDP, or FSDP2 (fully_shard)", choices=DISTRIBUTED_KINDS)

    def __post_init__(self) -> None:
        self.validate()
        object.__setattr__(self, "_validated", True)

    def __setattr__(self, name: str, value: Any) -> None:
        """Assignments after construction are checked too; a refused one leaves the config as it was."""
        if not self.__dict__.get("_validated", False):
            object.__setattr__(self, name, value)
            return
        previous = self.__dict__[name]
        object.__setattr__(self, name, value)
        try:
            self.validate()
        except (TypeError, ValueError):
            object.__setattr__(self, name, previous)
            raise

    def validate(self) -> None:
        """Raise ``TypeError`` / ``ValueError`` naming the first field that breaks its type, choices or range."""
        hints = _type_hints()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            _check_type(f.name, value, hints[f.name])
            choices, bounds = f.metadata.get("choices"), f.metadata.get("bounds")
            if choices is not None and value is not None and value not in choices:
                raise ValueError(f"GRPOConfig.{f.name} must be one of {choices}, got {value!r}")
            if bounds is not None and value is not None:
                is_list = isinstance(value, (list, tuple))
                for i, x in enumerate(value if is_list else [value]):
                    if not bounds.holds(x):
                        where = f"{f.name}[{i}]" if is_list else f.name
                        why = f": {f.metadata['why']}" if f.metadata.get("why") else ""
                        raise ValueError(f"GRPOConfig.{where} must be {bounds.describe(_is_int(x))}, got {x!r}{why}")
        # the rules that tie fields together: the loss's own (GRPOOptions), then the trainer's
        try:
            self.grpo_options()
        except (TypeError, ValueError) as e:
            raise type(e)(f"GRPOConfig: {e}") from None
        check_activation_settings(self.mlp_chunk_tokens, self.activation_offload, self.gradient_checkpointing,
                                  spell=lambda name: f"GRPOConfig.{name}")
        if self.overlong_buffer > self.max_new_tokens:
            raise ValueError(f"GRPOConfig.overlong_buffer ({self.overlong_buffer}) must be <= max_new_tokens ({self.max_new_tokens})")
        if not self.lora_target_modules.replace(",", "").strip():
            raise ValueError("GRPOConfig.lora_target_modules must be 'all-linear' or module names (comma-separated), got ''")
        if self.model_dtype != "float32" and self.distributed == "fsdp":
            raise ValueError(f"GRPOConfig.model_dtype={self.model_dtype!r} with distributed='fsdp' is not supported "
                             "(FSDP2 shards need one dtype per unit, and the fp32 master weights are not sharded): "
                             "use distributed='ddp' or model_dtype='float32'")
        if self.use_vllm and self.distributed != "none":
            raise ValueError(f"GRPOConfig.use_vllm runs one engine in a single process: not with distributed={self.distributed!r}")
        per_sequence_correction = self.vllm_importance_sampling_correction and self.vllm_importance_sampling_mode.startswith("sequence")
        if self.use_vllm and self.loss_mode is None and self.loss_type == "vespo" and per_sequence_correction:
            raise ValueError("GRPOConfig.loss_type='vespo' takes a per-token vllm_importance_sampling_mode ('token_truncate' "
                             f"or 'token_mask', as in TRL), got {self.vllm_importance_sampling_mode!r}")
        if self.reward_weights is not None and not self.reward_weights:
            raise ValueError("GRPOConfig.reward_weights must have one weight per reward function, or be None, got []")

    def _loss_fields(self) -> dict[str, Any]:
        """The config's fields that are ``grpo_kernels.GRPOOptions`` fields (same names), and dr_grpo's length."""
        fields = {name: getattr(self, name) for name in OPTION_NAMES if name in self.__dataclass_fields__}
        cap = self.vllm_importance_sampling_clip_max if self.vllm_importance_sampling_cap is None else self.vllm_importance_sampling_cap
        correction = dict(rollout_correction=self.vllm_importance_sampling_mode if self.vllm_importance_sampling_correction else None,
                          rollout_correction_max=cap, rollout_correction_min=self.vllm_importance_sampling_clip_min)
        return {**fields, **correction, "max_completion_length": self.max_new_tokens}

    def grpo_options(self) -> GRPOOptions:
        """The loss spec the config names (``GRPOOptions``: TRL's ``loss_type`` or verl's ``loss_mode``)."""
        return GRPOOptions(**self._loss_fields())

    def loss_options(self) -> dict[str, Any]:
        """The keyword arguments of ``grpo_kernels.fused_linear_grpo_loss`` that come from the config
        (under ``loss_mode`` without ``loss_type``, whose default the field holds: the loss is named once)."""
        fields = self._loss_fields()
        if self.loss_mode is not None:
            del fields["loss_type"]
        return {**fields, "chunk_size": self.chunk_size, "backend": self.backend}


# ------------------------------------------------------------------------------------------ type checks
_HINTS: dict[str, Any] = {}


def _type_hints() -> dict[str, Any]:
    if not _HINTS:
        _HINTS.update(typing.get_type_hints(GRPOConfig))
    return _HINTS


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_type(name: str, value: Any, hint: Any) -> None:
    optional = typing.get_origin(hint) is typing.Union  # Optional[X], the only union a field has
    if optional:
        if value is None:
            return
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is list:
        ok, expected = isinstance(value, (list, tuple)) and all(_is_real(v) for v in value), "a list of numbers"
    else:
        ok = {bool: lambda v: isinstance(v, bool), int: _is_int, float: _is_real, str: lambda v: isinstance(v, str)}[hint](value)
        expected = {bool: "True or False", int: "an int", float: "a number", str: "a str"}[hint]
    if not ok:
        raise TypeError(f"GRPOConfig.{name} must be {expected}{' or None' if optional else ''}, got {value!r} ({type(value).__name__})")
