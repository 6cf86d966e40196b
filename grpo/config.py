"""``GRPOConfig``: every knob of a run, each documented once, validated when the config is made.

Each field is declared with ``grpo_kernels.bounds.option``: its help text and, where it has them, its
allowed choices and range, in ``dataclasses.field(metadata=...)``. ``validate`` checks every field
against its declaration (``bounds.declarations``: the same check the loss's options, the command lines
and the public functions use), then the few rules that tie fields together, on construction and on
every later assignment, so a misspelt ``loss_type`` or a negative learning rate fails at once with the
allowed values in the message, not after the model has loaded. ``python -m grpo train --help`` prints
the same text, choices and ranges (``grpo.__main__``).

The loss fields are generated from ``grpo_kernels.options.GRPOOptions`` (:func:`with_loss_fields`):
their names, types, defaults, help, choices and ranges are the loss spec's own (the same objects), so a
new loss option appears in the functions, the modules, this config and ``--help`` at once. The loss
options the trainer sets under other names (TRL's ``vllm_importance_sampling_*`` for the rollout
correction, ``temperature``) take the option's declaration with :func:`grpo_kernels.bounds.like`, and
an error of the loss spec names the config's field (:meth:`GRPOConfig.loss_spelling`). The advantage
choice lists are ``grpo.advantages``'s, the process kinds ``grpo.distributed``'s, and the rollout engines
``grpo.rollout``'s registry (``rollout_engine``: each engine also refuses its own combinations,
``RolloutEngine.check_config``; ``use_vllm`` is TRL's spelling of ``rollout_engine="vllm"``): each list lives
in one place. "Off" is None: ``top_k`` / ``top_p`` take TRL's and vLLM's spellings of "off" (0, -1, 1.0)
and store None (``grpo.rollout.TRUNCATION_OFF_AS_NONE``).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Optional

from grpo_kernels.bounds import (FINITE, ZERO_TO_ONE, Bounds, OptionError, above, at_least, declarations, like,
                                 option)
from grpo_kernels.options import BACKENDS, OPTION_FIELDS, OPTION_NAMES, GRPOOptions

from .activations import MLP_CHUNK_TOKENS, check_offload
from .advantages import SCALES, STD_KINDS
from .distributed import KINDS as DISTRIBUTED_KINDS
from .memory import RELEASE_POLICIES
from .precision import MODEL_DTYPES
from .rollout import DEFAULT_ENGINE, ENGINES, TRUNCATION_OFF_AS_NONE, VLLM_ENGINE, engine_class


# Loss options the trainer sets itself: the sampling settings are its own fields (temperature, top_k,
# top_p: the rollout engines sample with them and every log-prob of the loss is taken under them), the
# model gives softcap / logit_scale, max_new_tokens is dr_grpo's length, the trainer
# scales micro-batch losses by the number of ranks (verl's dp_size), and the rollout correction is
# set under TRL's names (vllm_importance_sampling_*, mapped in GRPOConfig._loss_fields).
TRAINER_OWNED_LOSS_OPTIONS = ("temperature", "top_k", "top_p", "softcap", "logit_scale", "max_completion_length",
                              "dp_size", "rollout_correction", "rollout_correction_max", "rollout_correction_min")
# ... and the config's fields that set them (each declared like the option: grpo_kernels.bounds.like)
CONFIG_FIELDS_OF = {"temperature": ("temperature",), "top_k": ("top_k",), "top_p": ("top_p",),
                    "max_completion_length": ("max_new_tokens",),
                    "rollout_correction": ("vllm_importance_sampling_mode",),
                    "rollout_correction_max": ("vllm_importance_sampling_clip_max", "vllm_importance_sampling_cap"),
                    "rollout_correction_min": ("vllm_importance_sampling_clip_min",)}


def with_loss_fields(after: str):
    """Insert one field per ``GRPOOptions`` field (but :data:`TRAINER_OWNED_LOSS_OPTIONS`) after the
    field ``after``, with the option's type, default and declaration (help, choices, range: the same
    objects, ``bounds.like``)."""

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
                annotations[f.name] = hints[f.name]
                setattr(cls, f.name, like(f))
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
    max_new_tokens: int = like(OPTION_FIELDS["max_completion_length"], 256, "the longest completion, in tokens (the "
                               "loss's max_completion_length)")
    temperature: float = like(OPTION_FIELDS["temperature"], help="sampling temperature; as in TRL the loss divides the logits "
                              "by it too")
    top_k: Optional[int] = like(OPTION_FIELDS["top_k"], None, "sampling: only the k most likely tokens (ties at the k-th "
                                "kept; None: off, and TRL's 0 and vLLM's -1 are stored as None); every log-prob of the "
                                "loss is the truncated distribution's too")
    top_p: Optional[float] = like(OPTION_FIELDS["top_p"], None, "nucleus sampling (after top_k): keep the smallest set of "
                                  "tokens with this much probability (None: off, and TRL's 1.0 is stored as None); every "
                                  "log-prob of the loss is the truncated distribution's too")
    sampling_replay: bool = option(
        True, "when the rollouts truncate (top_k / top_p): every log-prob of the loss (the policy's, the old and the "
        "reference) is taken over the set of tokens the engine kept at each position (Completions.sampling_mask), "
        "where the engine reports them; off, or an engine that does not: the loss recomputes the truncation from "
        "its own logits")
    # rollout engine (grpo.rollout's registry, grpo.rollout.register_engine): Hugging Face generate, or vLLM,
    # whose log-probs the loss corrects for. Each engine refuses what it cannot run (RolloutEngine.check_config).
    # The vllm_* fields are TRL's names and defaults (trl.GRPOConfig 1.16); they set the loss's
    # rollout_correction, rollout_correction_max and rollout_correction_min (_loss_fields).
    rollout_engine: str = option(DEFAULT_ENGINE, "what samples the completions: 'hf' (Hugging Face generate on the "
                                 "policy: grpo.rollout.HFGenerate), 'vllm' (a vLLM engine in this process, the policy's "
                                 "weights copied into it every step: grpo.rollout.VLLMRollout; pip install "
                                 "'grpo-kernels[vllm]'), or an engine registered with grpo.rollout.register_engine",
                                 choices=ENGINES.keys())
    use_vllm: bool = option(False, "TRL's spelling of rollout_engine='vllm' (kept equal to it: True sets it, and a "
                            "rollout_engine other than 'hf' or 'vllm' with use_vllm=True is refused)")
    vllm_gpu_memory_utilization: float = option(0.3, "use_vllm on CUDA: the fraction of the GPU's memory the engine takes "
                                                "(weights and KV cache)", bounds=Bounds(0, 1, low_open=True))
    vllm_importance_sampling_correction: bool = option(
        True, "weigh the policy loss by the ratio of the trainer's to the engine's probability of the sampled tokens "
        "(when the engine reports its log-probs: use_vllm); the loss's rollout_correction")
    vllm_importance_sampling_mode: str = like(
        OPTION_FIELDS["rollout_correction"], "sequence_mask", "the ratio per token or per sequence (summed log-ratios); "
        "one outside [clip_min, clip_max] is clamped to it (truncate) or gets weight 0 (mask); the loss's rollout_correction")
    vllm_importance_sampling_clip_max: Optional[float] = like(
        OPTION_FIELDS["rollout_correction_max"], 3.0, "the largest ratio kept (None: unbounded; the loss's "
        "rollout_correction_max)")
    vllm_importance_sampling_clip_min: Optional[float] = like(
        OPTION_FIELDS["rollout_correction_min"], None, "the smallest ratio kept (None: no floor; the loss's "
        "rollout_correction_min)")
    vllm_importance_sampling_cap: Optional[float] = like(
        OPTION_FIELDS["rollout_correction_max"], None, "TRL's older name of vllm_importance_sampling_clip_max: when "
        "given, it replaces it")
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
    gradient_checkpointing: bool = option(True, "recompute each decoder layer's activations in backward instead of "
                                          "keeping them (TRL's default too)")
    activation_offload: bool = option(
        False, "gradient_checkpointing: keep each checkpointed layer input in host memory (pinned) between the forward "
        "and its recompute, copied on a side stream with one layer prefetched; on a CPU a no-op (grpo.activations)")
    mlp_chunk_tokens: Optional[int] = option(
        None, "run each decoder layer's MLP over chunks of this many tokens (forward, recompute and backward), so its "
        "intermediate activations exist one chunk at a time (None: whole micro-batches; grpo.activations)",
        bounds=MLP_CHUNK_TOKENS)
    fused_norm: bool = option(True, "each RMSNorm of a known decoder (Llama, Qwen2/3, Mistral, Gemma; Qwen3's q/k "
                              "norms) through grpo_kernels.rms_norm: its backward keeps x and one fp32 per row; "
                              "other models: left as they are, with an INFO line (grpo.activations.fuse_norms)")
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
    release_memory: str = option(
        "always", "glibc: give freed heap back to the OS: 'never' (glibc's default: it stays in the process for "
        "later allocations), 'phases' (malloc_trim at the end of each phase of a step), 'always' (also every "
        "buffer of 64 KiB or more mapped alone and unmapped when freed: the lowest peak, slower; process-wide); "
        "grpo.memory", choices=RELEASE_POLICIES)
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
        for name, value in self._engine_choice(self.use_vllm, self.rollout_engine).items():
            object.__setattr__(self, name, value)
        self.validate()
        object.__setattr__(self, "_validated", True)

    def __setattr__(self, name: str, value: Any) -> None:
        """Assignments after construction are checked too; a refused one leaves the config as it was. "Off" is
        stored as None: ``top_p`` 1.0 (TRL's), ``top_k`` 0 (TRL's) or -1 (vLLM's); ``use_vllm`` and
        ``rollout_engine`` are kept equal (:meth:`_engine_choice`)."""
        if name in TRUNCATION_OFF_AS_NONE:
            value = _off_as_none(name, value)
        if not self.__dict__.get("_validated", False):
            object.__setattr__(self, name, value)
            return
        changes = {name: value}
        if name in ("use_vllm", "rollout_engine"):
            pair = {"use_vllm": self.use_vllm, "rollout_engine": self.rollout_engine, name: value}
            changes = self._engine_choice(**pair, assigned=name)
        previous = {key: self.__dict__[key] for key in changes}
        for key, new in changes.items():
            object.__setattr__(self, key, new)
        try:
            self.validate()
        except (TypeError, ValueError):
            for key, old in previous.items():
                object.__setattr__(self, key, old)
            raise

    @staticmethod
    def _engine_choice(use_vllm: Any, rollout_engine: Any, assigned: Optional[str] = None) -> dict[str, Any]:
        """``{use_vllm, rollout_engine}`` as stored, from TRL's ``use_vllm`` and the engine's name: ``use_vllm=True``
        is ``rollout_engine='vllm'`` (``'hf'``, the default, reads as unset); another engine with it is refused,
        naming both. Assigning ``rollout_engine`` sets ``use_vllm`` to match; assigning ``use_vllm=False`` to a
        vLLM config goes back to the default engine."""
        declared = declarations(GRPOConfig)
        declared["use_vllm"].check(use_vllm, name="GRPOConfig.use_vllm", convert=False)
        declared["rollout_engine"].check(rollout_engine, name="GRPOConfig.rollout_engine", convert=False)
        if assigned == "rollout_engine":
            return {"rollout_engine": rollout_engine, "use_vllm": rollout_engine == VLLM_ENGINE}
        if use_vllm:
            if rollout_engine not in (DEFAULT_ENGINE, VLLM_ENGINE):
                raise OptionError(f"GRPOConfig.use_vllm=True is TRL's spelling of rollout_engine={VLLM_ENGINE!r}, but "
                                  f"rollout_engine={rollout_engine!r}: set one of the two", "GRPOConfig.use_vllm",
                                  "rollout_engine")
            return {"use_vllm": True, "rollout_engine": VLLM_ENGINE}
        if assigned == "use_vllm" and rollout_engine == VLLM_ENGINE:
            return {"use_vllm": False, "rollout_engine": DEFAULT_ENGINE}
        return {"use_vllm": rollout_engine == VLLM_ENGINE, "rollout_engine": rollout_engine}

    def validate(self) -> None:
        """Raise ``TypeError`` / ``ValueError`` (``grpo_kernels.bounds.OptionTypeError`` / ``OptionError``)
        naming the first field that breaks its type, choices or range, then a rule that ties fields together."""
        declared = declarations(GRPOConfig)
        # every field against its declaration (loss_mode first: the loss's ranges under a mode differ)
        declared["loss_mode"].check(self.loss_mode, name="GRPOConfig.loss_mode", convert=False)
        for d in declared.values():
            d.check(getattr(self, d.name), name=f"GRPOConfig.{d.name}", loss_mode=self.loss_mode, convert=False)
        # the rules that tie fields together: the loss's own (GRPOOptions, in the config's names), then the trainer's
        self.grpo_options()
        rule = lambda message, *names: OptionError(message, *(f"GRPOConfig.{names[0]}",) + names[1:])  # noqa: E731
        try:  # (grpo.activations' rule, in the config's names)
            check_offload(self.activation_offload, self.gradient_checkpointing)
        except OptionError as e:
            raise e.respelled({"gradient_checkpointing": "GRPOConfig.gradient_checkpointing"},
                              first="GRPOConfig.activation_offload") from None
        if self.overlong_buffer > self.max_new_tokens:
            raise rule(f"GRPOConfig.overlong_buffer ({self.overlong_buffer}) must be <= max_new_tokens "
                       f"({self.max_new_tokens})", "overlong_buffer", "max_new_tokens")
        if not self.lora_target_modules.replace(",", "").strip():
            raise rule("GRPOConfig.lora_target_modules must be 'all-linear' or module names (comma-separated), got ''",
                       "lora_target_modules")
        if self.model_dtype != "float32" and self.distributed == "fsdp":
            raise rule(f"GRPOConfig.model_dtype={self.model_dtype!r} with distributed='fsdp' is not supported "
                       "(FSDP2 shards need one dtype per unit, and the fp32 master weights are not sharded): "
                       "use distributed='ddp' or model_dtype='float32'", "model_dtype", "distributed")
        engine_class(self.rollout_engine).check_config(self)  # what the engine refuses (grpo.rollout.RolloutEngine)
        if self.reward_weights is not None and not self.reward_weights:
            raise rule("GRPOConfig.reward_weights must have one weight per reward function, or be None, got []",
                       "reward_weights")

    def sequence_correction_refused(self) -> bool:
        """vespo's weight takes the rollout correction per token (TRL): a sequence-level
        ``vllm_importance_sampling_mode`` is refused under it whenever the correction is on and the
        engine reports its log-probs (:meth:`check_sequence_correction`)."""
        return (self.loss_mode is None and self.loss_type == "vespo" and self.vllm_importance_sampling_correction
                and self.vllm_importance_sampling_mode.startswith("sequence"))

    def check_sequence_correction(self, engine: str, reports_sampling_logps: Optional[bool]) -> None:
        """The rule of :meth:`sequence_correction_refused` for the rollout engine ``engine``, from its declaration
        ``reports_sampling_logps`` (``grpo.rollout.Rollout``: False, it never reports log-probs, passes): an
        ``OptionError`` naming ``vllm_importance_sampling_mode`` and ``loss_type``. Its one statement: the vLLM
        engine's check (``VLLMRollout.check_config``) and ``grpo.train``'s, for an engine passed in, call it."""
        if reports_sampling_logps is False or not self.sequence_correction_refused():
            return
        hint = "" if reports_sampling_logps else ": declare reports_sampling_logps = False on it if it never does"
        raise OptionError(f"GRPOConfig.vllm_importance_sampling_mode must be per token ('token_truncate' or 'token_mask') "
                          f"with loss_type='vespo' (as in TRL) when the rollout engine may report its log-probs "
                          f"({engine}{hint}), got {self.vllm_importance_sampling_mode!r}",
                          "GRPOConfig.vllm_importance_sampling_mode", "loss_type")

    def loss_spelling(self) -> dict[str, str]:
        """``GRPOOptions`` names -> this config's fields that set them (the others have the same name)."""
        spelling = {option: fields[0] for option, fields in CONFIG_FIELDS_OF.items()}
        if self.vllm_importance_sampling_cap is not None:  # (TRL's older name, which then sets the cap)
            spelling["rollout_correction_max"] = "vllm_importance_sampling_cap"
        return spelling

    def _loss_fields(self) -> dict[str, Any]:
        """The config's fields that are ``grpo_kernels.GRPOOptions`` fields (same names), and dr_grpo's length."""
        fields = {name: getattr(self, name) for name in OPTION_NAMES if name in self.__dataclass_fields__}
        cap = self.vllm_importance_sampling_clip_max if self.vllm_importance_sampling_cap is None else self.vllm_importance_sampling_cap
        correction = dict(rollout_correction=self.vllm_importance_sampling_mode if self.vllm_importance_sampling_correction else None,
                          rollout_correction_max=cap, rollout_correction_min=self.vllm_importance_sampling_clip_min)
        return {**fields, **correction, "max_completion_length": self.max_new_tokens}

    def grpo_options(self, **model_settings: Any) -> GRPOOptions:
        """The loss spec the config names (``GRPOOptions``: TRL's ``loss_type`` or verl's ``loss_mode``);
        ``model_settings``: what the model's head sets (``softcap``, ``logit_scale``: ``grpo.models.head_transform``).
        A refusal names the config's field (``GRPOConfig.vllm_importance_sampling_clip_max``, not the loss's name)."""
        try:
            return GRPOOptions(**{**self._loss_fields(), **model_settings})
        except OptionError as e:
            spelling = self.loss_spelling()
            first = e.names[0] if e.names else ""
            raise e.respelled(spelling, first=f"GRPOConfig.{spelling.get(first, first)}"
                              if first not in model_settings else None) from None

    def loss_options(self) -> dict[str, Any]:
        """The keyword arguments of ``grpo_kernels.fused_linear_grpo_loss`` that come from the config
        (under ``loss_mode`` without ``loss_type``: the loss is named once)."""
        fields = self._loss_fields()
        if self.loss_mode is not None:
            del fields["loss_type"]
        return {**fields, "chunk_size": self.chunk_size, "backend": self.backend}


def _off_as_none(name: str, value: Any) -> Any:
    """``value`` of the sampler's truncation field ``name`` checked against its declaration, TRL's and vLLM's
    "off" as None (``grpo.rollout.TRUNCATION_OFF_AS_NONE``); an error names ``GRPOConfig.<name>``."""
    try:
        return TRUNCATION_OFF_AS_NONE[name](value)
    except OptionError as e:
        raise e.respelled({}, first=f"GRPOConfig.{name}") from None


def settings_as_stored(saved: dict[str, Any]) -> dict[str, Any]:
    """A config saved as a dict (``dataclasses.asdict``: a checkpoint's), its values as a ``GRPOConfig`` stores
    them today: the sampler's "off" as None (a checkpoint from before held ``top_p=1.0``). A value its
    declaration refuses is left as it was (then it differs, and says so)."""
    out = dict(saved)
    for name in TRUNCATION_OFF_AS_NONE:
        if name in out:
            try:
                out[name] = TRUNCATION_OFF_AS_NONE[name](out[name])
            except (TypeError, ValueError):
                pass
    return out
