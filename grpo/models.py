"""The policy model and every use the trainer makes of its weights.

:class:`Policy` wraps the language model so that sampling, per-token log-probs and the fused GRPO loss
all run inside one module's ``forward`` (the module DDP and FSDP2 wrap); :func:`unwrap` finds the
transformers model inside any wrapper (DDP, FSDP2, ``Policy``, peft). :func:`prepare_model` puts a
model on its device with the run's checkpointing and attention, and wraps it for the run's data
parallelism. The loss reads the last hidden states (:func:`completion_hidden`) and the ``lm_head``
weight (:func:`lm_head`), with the head's own logit transform (:func:`head_transform`).

The trainer (``grpo.trainer``) and the rollout engines (``grpo.rollout``) both import this module; it
imports neither.
"""

from __future__ import annotations

import copy
import importlib.util
from typing import Any, Callable, Optional, TypeVar, Union

import torch

from grpo_kernels import fused_linear_grpo_loss, fused_linear_token_logprobs
from grpo_kernels.options import IGNORE_INDEX

from . import activations, distributed, lora, packing
from .precision import autocast

# A micro-batch: ``grpo.trainer.UpdateBatch`` rows (padded) or a ``packing.PackedMicroBatch`` (one packed row).
MicroBatch = Any
# ``cfg`` below is a ``grpo.config.GRPOConfig``, named rather than imported: the config imports the rollout
# engines (grpo.rollout's registry gives its rollout_engine choices), which import this module.
T = TypeVar("T")


def default_device() -> torch.device:
    if distributed.world_size() > 1:
        return distributed.device()  # this rank's GPU
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def attention_implementation(device: torch.device) -> str:
    """``flash_attention_2`` on CUDA when flash-attn is installed, ``sdpa`` otherwise."""
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def load_model(name_or_path: str, device: Optional[torch.device] = None, dtype: torch.dtype = torch.float32,
               tokenizer=None):
    """A causal LM (weights in ``dtype``) and its (left-padding) tokenizer from a local path or a hub name.

    tokenizer: one already loaded from ``name_or_path`` (the CLI's, from its checks), returned as it is:
    a second copy would cost its bytes again (tens of MiB at a 150k vocabulary) for the rest of the run,
    since glibc keeps the first's freed heap."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = device or default_device()
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, padding_side="left")
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(
        name_or_path, attn_implementation=attention_implementation(device), dtype=dtype
    )
    return model, tokenizer


class Policy(torch.nn.Module):
    """The language model, with every use the trainer makes of its weights a method run inside ``forward``.

    The uses are methods: :meth:`generate` samples, :meth:`logps` returns per-token log-probs and :meth:`loss`
    the fused GRPO loss; both of the distribution the rollouts sample from (``cfg.temperature``, then the
    engine's kept sets replayed, ``mb.sampling_mask``, or ``cfg.top_k`` / ``cfg.top_p`` recomputed:
    :func:`truncation`; -inf for a token outside the truncated set, which the loss then leaves out). They
    are called through the module, the method given unbound: ``policy(Policy.logps, mb, cfg, device)``,
    where ``policy`` is this module or its DDP / FSDP2 wrapper. DDP syncs gradients, and FSDP2 gathers
    sharded weights (``lm_head.weight`` included, which the fused loss reads directly), only around a
    wrapped module's ``forward`` (its ``__call__`` hooks): so this module is the one they wrap, and
    ``forward(task, ...)`` runs ``task(self, ...)`` there. (A DDP wrapper has no attribute ``logps``, and a
    direct ``policy.logps(...)`` would run outside the hooks: the call names the method instead.)
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, task: Union[Callable[..., T], str], *args: Any, **kwargs: Any) -> T:
        """``task(self, *args, **kwargs)``, inside the wrapper's forward: ``task`` one of :data:`TASKS`
        (``Policy.generate``, ``Policy.logps``, ``Policy.loss``), or its name (the older spelling)."""
        method = TASKS_BY_NAME.get(task) if isinstance(task, str) else task
        if method not in TASKS:
            raise TypeError(f"Policy's task must be one of {[t.__qualname__ for t in TASKS]} (or its name), got {task!r}")
        return method(self, *args, **kwargs)

    def generate(self, **kwargs: Any) -> torch.Tensor:
        """The language model's ``generate(**kwargs)``: [B, P + T] int64 token ids."""
        return self.model.generate(**kwargs)

    def logps(self, mb: "MicroBatch", cfg: "GRPOConfig", device: torch.device) -> torch.Tensor:
        """[B, T] float32 (a padded micro-batch) or [1, L] (a packed one): each target token's log-prob under the
        sampling distribution (``cfg``'s temperature and truncation: :func:`truncation`), 0 where ``mb.loss_mask``
        is 0."""
        weight, bias = lm_head(self.model)
        with autocast(device, cfg.bf16):
            hidden = completion_hidden(self.model, mb)
        targets = torch.where(mb.loss_mask.bool(), mb.completion_ids, torch.full_like(mb.completion_ids, IGNORE_INDEX))
        # the distribution the engine sampled from: the temperature and the truncation of the rollouts
        return fused_linear_token_logprobs(
            hidden, weight, targets, bias=bias, temperature=cfg.temperature, **truncation(mb, cfg),
            chunk_size=cfg.chunk_size, backend=cfg.backend, **head_transform(self.model),
        )

    def loss(self, mb: "MicroBatch", cfg: "GRPOConfig", device: torch.device, **loss_kwargs: Any):
        """``grpo_kernels.fused_linear_grpo_loss`` of the micro-batch (``GRPOLossOutput``: the loss and its metrics)
        with ``cfg``'s options and the model's head transform; ``loss_kwargs`` override them (the trainer's
        normalisers)."""
        weight, bias = lm_head(self.model)
        with autocast(device, cfg.bf16):
            hidden = completion_hidden(self.model, mb)
        options = {**cfg.loss_options(), **truncation(mb, cfg), **head_transform(self.model), **loss_kwargs}  # (the caller's win)
        if isinstance(mb, packing.PackedMicroBatch):
            options["segment_ids"] = mb.segment_ids  # one row, several sequences
        if mb.rollout_logps is None:  # (an engine that reports no log-probs: nothing to correct)
            options["rollout_correction"] = None
        return fused_linear_grpo_loss(
            hidden, weight, mb.completion_ids, mb.advantages, mb.loss_mask, bias=bias,
            old_logps=mb.old_logps, ref_logps=mb.ref_logps, rollout_logps=mb.rollout_logps, **options,
        )


# what Policy.forward runs: its methods, given unbound (the name: the older spelling, policy("logps", ...))
TASKS = (Policy.generate, Policy.logps, Policy.loss)
TASKS_BY_NAME = {task.__name__: task for task in TASKS}


def truncation(mb: "MicroBatch", cfg: "GRPOConfig") -> dict[str, Any]:
    """The loss's keywords for the rollouts' truncation: the engine's kept sets replayed when the micro-batch
    has them (``sampling_mask``: one set per target position; top_k / top_p then off, as the loss requires),
    else ``cfg.top_k`` / ``cfg.top_p`` recomputed from the trainer's logits."""
    if mb.sampling_mask is not None:
        return dict(top_k=None, top_p=None, sampling_mask=mb.sampling_mask)
    return dict(top_k=cfg.top_k, top_p=cfg.top_p)


def as_policy(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` if it is a (wrapped) ``Policy``, else a ``Policy`` around it (sharing its weights)."""
    return model if isinstance(distributed.unwrap_ddp(model), Policy) else Policy(model)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers language model inside a (DDP-wrapped) ``Policy`` (and inside a peft model, whose
    adapter layers it then holds)."""
    model = distributed.unwrap_ddp(model)
    return lora.base_of(model.model if isinstance(model, Policy) else model)


def prepare_model(model: torch.nn.Module, cfg: "GRPOConfig", device: torch.device, frozen: bool = False) -> torch.nn.Module:
    """The ``Policy`` to train (or, ``frozen``, to score with): on its device, wrapped for ``cfg.distributed``,
    with the run's gradient checkpointing, activation offload, MLP chunks and fused RMSNorms
    (``grpo.activations``) and packed attention.

    Under DDP the returned module trains ``model`` itself; under FSDP2 it trains a sharded copy, and
    ``train`` copies the result back into ``model`` at the end.
    """
    if cfg.distributed != "fsdp" or distributed.world_size() == 1:
        model.to(device)  # (FSDP2 moves each rank's shards there itself)
    if cfg.gradient_checkpointing and not frozen:
        kwargs = {"use_reentrant": False}  # (non-reentrant: what the offload's hooks and the MLP chunks compose with)
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if cfg.activation_offload:  # each checkpointed layer input in host memory (a no-op on a CPU)
            activations.offload_checkpointed_inputs(model, device)
    if cfg.mlp_chunk_tokens is not None:  # each decoder layer's MLP over token chunks (the frozen reference's too)
        activations.chunk_mlps(model, cfg.mlp_chunk_tokens)
    if cfg.fused_norm:  # each known RMSNorm through grpo_kernels.rms_norm (an unknown model: an INFO line)
        activations.fuse_norms(model, activations.norm_backend(cfg.backend))
    if cfg.padding_free:  # attention that keeps packed sequences apart (flash-attn varlen, or packed SDPA)
        packing.use_packed_attention(model)
    model.config.use_cache = True  # for generate; the training forward passes use_cache=False
    return distributed.wrap(Policy(model), cfg.distributed, device, frozen=frozen)


def make_reference_model(model: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of the policy as it is now (used when ``beta > 0``)."""
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


class ReferenceWithoutAdapters(Policy):
    """The reference policy of a LoRA run: the policy itself, called with its adapters disabled (peft's
    ``disable_adapter``), so the reference costs no memory. The policy is not a submodule: its weights
    are held (and checkpointed) once."""

    def __init__(self, policy: torch.nn.Module) -> None:
        torch.nn.Module.__init__(self)
        object.__setattr__(self, "policy", policy)  # (the DDP / FSDP2-wrapped policy: FSDP2 gathers its shards)

    def forward(self, task: Union[Callable[..., T], str], *args: Any, **kwargs: Any) -> T:
        with lora.adapters_disabled(distributed.unwrap_ddp(self.policy).model):
            return self.policy(task, *args, **kwargs)


def completion_hidden(model, batch: MicroBatch) -> torch.Tensor:
    """The last hidden states that predict the completion tokens (final norm applied): [B, T, H], or
    [1, L, H] for a packed micro-batch (each position predicts the token its layout says)."""
    model = unwrap(model)
    if isinstance(batch, packing.PackedMicroBatch):
        return packing.packed_forward(model, batch.layout)
    position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)  # as generate numbers left-padded rows
    out = model.base_model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=position_ids, use_cache=False
    )
    return out.last_hidden_state[:, batch.prompt_len - 1 : -1]


def head_transform(model) -> dict[str, Any]:
    """What the model's own head does to its logits before the softmax, for the fused loss to do the
    same: final-logit soft-capping (Gemma-2/3 ``final_logit_softcapping``) and a logit scale (Cohere
    ``logit_scale``). Without them the loss's log-probs would not be the sampling policy's."""
    return head_settings(unwrap(model).config)


def head_settings(config) -> dict[str, Any]:
    """:func:`head_transform` from a model's transformers config (before its weights load)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    out: dict[str, Any] = {}
    if getattr(text, "final_logit_softcapping", None):
        out["softcap"] = float(text.final_logit_softcapping)
    if getattr(text, "logit_scale", None) not in (None, 1, 1.0):
        out["logit_scale"] = float(text.logit_scale)
    return out


def lm_head(model) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    head = unwrap(model).get_output_embeddings()
    return head.weight, getattr(head, "bias", None)
