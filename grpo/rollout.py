"""Rollouts: the seam between the trainer and whatever samples completions.

The trainer asks a :class:`Rollout` engine for ``G`` completions of each prompt and gets back a
:class:`Completions` batch (token ids, masks, decoded texts). :class:`HFGenerate` is the engine it
uses unless told otherwise: Hugging Face ``generate`` on the policy being trained. Another engine
(vLLM, SGLang, a remote server) plugs in by implementing ``Rollout.generate`` and being passed as
``grpo.train(..., rollout=engine)``; it must return completions in the same layout, and an engine that
keeps its own copy of the weights syncs them from ``policy`` at the start of ``generate`` (the trainer
calls it once per step, after the previous step's update).

Layout (``B = len(prompts) * G`` rows, prompt-major: rows ``g*G .. g*G+G-1`` answer prompt ``g``):
prompts left-padded to ``P`` positions, completions right-padded to ``T <= max_new_tokens``, the
completion mask covering every token up to and including the first EOS.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence, Union, runtime_checkable

import torch


@dataclass
class Completions:
    """G completions for each of some prompts, prompt-major (rows ``g*G .. g*G+G-1`` share a prompt)."""

    prompt_ids: torch.Tensor  # [B, P] int64, left-padded
    prompt_mask: torch.Tensor  # [B, P] int64, 1 on prompt tokens
    completion_ids: torch.Tensor  # [B, T] int64, right-padded (padding after the first EOS)
    completion_mask: torch.Tensor  # [B, T] int64, 1 up to and including the first EOS
    truncated: torch.Tensor  # [B] bool, no EOS within max_new_tokens
    prompts: list[str]  # [B] each prompt repeated G times
    completions: list[str]  # [B] decoded, special tokens dropped

    @property
    def lengths(self) -> torch.Tensor:
        """[B] int64: completion tokens, EOS included."""
        return self.completion_mask.sum(-1)

    def check(self, rows: int, engine: str = "the rollout engine") -> "Completions":
        """Itself, once its fields agree with the layout above for ``rows`` completions; else ``ValueError``."""
        names = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated")
        for name in names:
            if not isinstance(getattr(self, name), torch.Tensor):
                raise ValueError(f"{engine} returned {name} as {type(getattr(self, name)).__name__}, not a tensor")
        P, T = self.prompt_ids.shape[-1], self.completion_ids.shape[-1]
        for name, expected in zip(names, ((rows, P), (rows, P), (rows, T), (rows, T), (rows,))):
            if tuple(getattr(self, name).shape) != expected:
                raise ValueError(f"{engine} returned {name} of shape {list(getattr(self, name).shape)}, expected {list(expected)}")
        for name in ("prompts", "completions"):
            if len(getattr(self, name)) != rows:
                raise ValueError(f"{engine} returned {len(getattr(self, name))} {name}, expected {rows}")
        return self


@runtime_checkable
class Rollout(Protocol):
    """A rollout engine: samples completions from the current policy."""

    def generate(
        self, policy: torch.nn.Module, prompts: Sequence[str], num_generations: int, *, greedy: bool = False
    ) -> Completions:
        """``num_generations`` completions for each prompt (``greedy``: deterministic decoding, for evaluation).

        ``policy`` is the trainer's ``grpo.trainer.Policy`` (possibly DDP- or FSDP2-wrapped): its
        weights are the ones to sample from. ``policy("generate", **kwargs)`` runs the language
        model's ``generate`` inside the wrapper's forward, where FSDP2 has gathered the weights.
        """
        ...


def completion_mask(completion_ids: torch.Tensor, eos_token_id: Union[int, list[int], None]) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask [B, T] int64: 1 up to and including the first EOS, truncated [B] bool: no EOS at all)."""
    eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
    is_eos = torch.zeros_like(completion_ids, dtype=torch.bool)
    for eos in eos_ids:
        is_eos |= completion_ids == eos
    T = completion_ids.shape[1]
    positions = torch.arange(T, device=completion_ids.device).expand_as(completion_ids)
    first_eos = torch.where(is_eos, positions, torch.full_like(positions, T)).min(-1).values  # [B]
    mask = (positions <= first_eos.unsqueeze(-1)).long()
    return mask, ~is_eos.any(-1)


def autocast(device: torch.device, bf16: bool):
    """bf16 autocast on CUDA when asked for; fp32 otherwise (the trainer's forward passes use it too)."""
    if device.type == "cuda" and bf16:
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


class HFGenerate:
    """Rollouts with Hugging Face ``generate``: sampling at ``temperature`` / ``top_p`` (``top_k`` off).

    tokenizer: pads on the left (``load_model`` and the demo's tokenizer do). eos_token_id: an id or a
    list of ids (chat models end turns with several); None = ``tokenizer.eos_token_id``.
    """

    def __init__(
        self,
        tokenizer,
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        bf16: bool = True,
        eos_token_id: Union[int, list[int], None] = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_new_tokens, self.temperature, self.top_p, self.bf16 = max_new_tokens, temperature, top_p, bf16
        self.eos_token_id = eos_token_id if eos_token_id is not None else tokenizer.eos_token_id

    @torch.no_grad()
    def generate(
        self, policy: torch.nn.Module, prompts: Sequence[str], num_generations: int, *, greedy: bool = False
    ) -> Completions:
        tokenizer = self.tokenizer
        device = next(policy.parameters()).device
        repeated = [p for p in prompts for _ in range(num_generations)]
        enc = tokenizer(repeated, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        if enc.input_ids.shape[1] == 0:
            raise ValueError(f"all {len(prompts)} prompts are empty after tokenization: a completion needs a prompt token to follow")
        was_training = policy.training
        policy.eval()
        sampling = dict(do_sample=True, temperature=self.temperature, top_p=self.top_p, top_k=0)
        with autocast(device, self.bf16):
            out = policy(
                "generate",
                input_ids=enc.input_ids,
                attention_mask=enc.attention_mask,
                max_new_tokens=self.max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=self.eos_token_id,
                use_cache=True,
                **(dict(do_sample=False) if greedy else sampling),
            )
        policy.train(was_training)
        prompt_len = enc.input_ids.shape[1]
        completion_ids = out[:, prompt_len:]
        mask, truncated = completion_mask(completion_ids, self.eos_token_id)
        completion_ids = completion_ids * mask + tokenizer.pad_token_id * (1 - mask)  # pad after EOS
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        return Completions(enc.input_ids, enc.attention_mask, completion_ids, mask, truncated, repeated, texts)


def generation_eos(model: torch.nn.Module, tokenizer) -> Union[int, list[int], None]:
    """The ids that end a completion: the model's generation config's (chat models list several), else the tokenizer's."""
    config: Optional[object] = getattr(model, "generation_config", None)
    return getattr(config, "eos_token_id", None) or tokenizer.eos_token_id
