"""GRPO, top to bottom: rollouts -> rewards -> group advantages -> an update with the fused loss.

One training step:
  1. take ``prompts_per_step`` prompts and sample ``num_generations`` (G) completions for each with a
     rollout engine (``grpo.rollout``: the one ``rollout_engine`` names, Hugging Face ``generate`` unless
     told otherwise, e.g. ``"vllm"``, TRL's ``use_vllm``; or an engine ``train`` is given); an engine that
     reports its own log-probs gets TRL's importance-sampling correction of the policy loss: the loss's
     ``rollout_correction``, fed ``rollout_logps``);
  2. score every completion with weighted reward functions ``fn(prompts, completions, **columns)``
     (``None`` = unscorable), and turn the rewards into group-relative advantages;
  3. update the policy: its last hidden states and ``lm_head`` weight go to
     ``grpo_kernels.fused_linear_grpo_loss``, so the [tokens, vocab] logits never exist. The batch is
     cut into micro-batches whose gradients accumulate; the normalisers count the tokens and the
     sequences of the whole batch (``policy_loss``), under TRL's ``loss_type`` and verl's
     ``loss_mode``. With ``num_iterations > 1`` the batch is reused, against the ``old_logps``
     recorded before its first update; with ``beta > 0`` a frozen reference model adds a KL term
     (with LoRA, ``use_peft``: the policy with its adapters disabled, ``grpo.lora``).
  4. log one JSON line, and now and then write a checkpoint (``grpo.checkpoint``) from which a run
     resumes exactly.

The knobs are ``GRPOConfig``'s (``grpo.config``); the prompt order is ``grpo.data``'s.

Nothing non-finite gets through: a reward that is not a finite number counts as unscorable (``None``)
with a warning naming the function and row (``score``); advantages are computed overflow-free
(``grpo.advantages``); an optimizer step whose loss or gradient norm is not finite is skipped and
counted in the log line's ``skipped_updates`` (``update``); and ``grpo.checkpoint`` refuses to write
non-finite weights. Bad rows fail before the run starts (``grpo.data.check_rows``).

Shapes: ``B`` completions in a step (``prompts_per_step * G``), ``P`` prompt positions (left padded),
``T`` completion positions (right padded), ``H`` hidden size, ``V`` vocabulary.

Under torchrun with ``distributed="ddp"`` or ``"fsdp"`` (FSDP2), every rank runs this same loop on its
own share of a step's prompts (whole prompts: a group never straddles ranks); the few places that
differ call ``grpo.distributed``, whose helpers do nothing in a single process: rewards are gathered so
that advantages and logs see the whole batch, ``batch_totals`` all-reduces the normalisers,
``policy_loss`` scales each rank's loss so that the averaged gradients are the single-process ones,
and checkpoints gather full state for rank 0 to write.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import resource
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import torch
from tqdm.auto import tqdm

from grpo_kernels import SamplingMask
from grpo_kernels.bounds import OptionError
from grpo_kernels.options import TOKEN_NORMALISED_LOSS_TYPES, GRPOOptions

from . import activations, checkpoint, distributed, lora, packing, plan, precision
from .memory import PhaseMemory
from .advantages import group_advantages, zero_signal_groups
from .config import GRPOConfig
from .data import check_reward_columns, check_rows, columns_of, prompts_for_step, shard_for_rank
from .logs import LossMetrics, RunLog, ZeroSignalWatch
from .plot import plot_in_subprocess
from .models import (Policy, ReferenceWithoutAdapters, as_policy, completion_hidden, default_device, head_transform,  # noqa: F401
                     lm_head, load_model, make_reference_model, prepare_model, unwrap)
from .rollout import Completions, Rollout, engine_class

RewardFn = Callable[..., Sequence[Optional[float]]]


# --------------------------------------------------------------------------------------------------
# the optimizer and the rollout engine (the model itself: grpo.models)
# --------------------------------------------------------------------------------------------------
def make_optimizer(model: torch.nn.Module, cfg: GRPOConfig) -> torch.optim.Optimizer:
    """AdamW on the trainable parameters, fused where torch has the kernel; 16-bit ones get fp32 master
    copies (``grpo.precision.adamw``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return precision.adamw(params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay)


def default_rollout(model: torch.nn.Module, tokenizer, cfg: GRPOConfig) -> Rollout:
    """The engine ``cfg.rollout_engine`` names (``grpo.rollout.ENGINES``), built from the config by its
    ``from_config``: Hugging Face ``generate`` (``"hf"``) or a vLLM engine (``"vllm"``), each with the config's
    sampling settings, reporting the kept sets it drew from with ``sampling_replay``."""
    return engine_class(cfg.rollout_engine).from_config(model, tokenizer, cfg)


def learning_rate(step: int, cfg: GRPOConfig) -> float:
    """Linear warm-up, then constant: a pure function of the step, so resuming needs no scheduler state."""
    return cfg.learning_rate * min(1.0, (step + 1) / max(1, cfg.warmup_steps))


# --------------------------------------------------------------------------------------------------
# rewards and advantages
# --------------------------------------------------------------------------------------------------
def reward_name(fn: RewardFn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def reward_number(value: Any) -> Optional[float]:
    """A reward value as a float, or None when it is not a number.

    A number is anything ``float()`` takes through its own ``__float__`` (so not a ``str``): Python and
    NumPy ints, floats and bools (``np.array(..) == 1`` gives ``numpy.bool_``: True is 1.0, False 0.0),
    ``Fraction``, ``Decimal``, and one-element tensors and arrays.
    """
    try:
        if callable(getattr(value, "item", None)):  # tensors, arrays and NumPy scalars: their one element
            value = value.item()
        if not hasattr(type(value), "__float__"):
            return None
        return float(value)
    except OverflowError:  # an int beyond float64: not finite, so unscorable (with a warning)
        return math.inf if value > 0 else -math.inf
    except (TypeError, ValueError, RuntimeError):  # e.g. a tensor of several values, a complex
        return None


def score(reward_fns: Mapping[str, RewardFn], rollout: Completions, columns: dict[str, list]) -> tuple[torch.Tensor, torch.Tensor]:
    """(rewards [B, F] float64, one column per function; nonfinite [F] int64, per function).

    Each function returns one value per completion: a real number (``reward_number``: any numeric type,
    bools as 0 / 1, a one-element tensor) or ``None`` (unscorable), which becomes NaN. A number that is not finite (+-inf, NaN) is
    not a score either: it is treated as unscorable too, counted in ``nonfinite`` and reported in a
    ``RuntimeWarning`` naming the function and the first such row, so it never reaches an advantage.
    Rewards stay float64, so a huge finite one (1e39) is a score, not an overflow. A value of any other
    type (a str, a list) is a bug in the function: ``TypeError`` naming it and the row.
    """
    B = len(rollout.completions)
    per_fn, nonfinite = torch.full((B, len(reward_fns)), math.nan, dtype=torch.float64), []
    for j, (name, fn) in enumerate(reward_fns.items()):
        values = fn(rollout.prompts, rollout.completions, **columns)
        try:
            if isinstance(values, (str, bytes, Mapping)):
                raise TypeError
            values = list(values)  # (a tuple, an array or a tensor of B values will do)
        except TypeError:
            raise TypeError(f"reward function {name!r} must return a list of {B} floats or None, got {type(values).__name__}") from None
        if len(values) != B:
            raise ValueError(f"reward function {name!r} returned {len(values)} values for {B} completions")
        bad = []
        for i, v in enumerate(values):
            if v is None:
                continue
            x = reward_number(v)
            if x is None:
                raise TypeError(f"reward function {name!r} returned {v!r} ({type(v).__name__}) for row {i}: expected a number or None")
            if math.isfinite(x):
                per_fn[i, j] = x
            else:
                bad.append(i)
        if bad:
            i = bad[0]
            warnings.warn(
                f"reward function {name!r} returned {reward_number(values[i])} for row {i} (prompt {rollout.prompts[i][:60]!r}); "
                f"{len(bad)} values of this step were not finite: treated as unscorable (None)",
                RuntimeWarning, stacklevel=2,
            )
        nonfinite.append(len(bad))
    return per_fn, torch.tensor(nonfinite, dtype=torch.int64)


def overlong_penalty(lengths: torch.Tensor, cfg: GRPOConfig) -> torch.Tensor:
    """DAPO's soft overlong punishment [B]: 0 up to ``max - buffer`` tokens, then down linearly to ``-penalty``."""
    if cfg.overlong_buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    start = cfg.max_new_tokens - cfg.overlong_buffer
    excess = (lengths.float().cpu() - start).clamp(min=0) / cfg.overlong_buffer
    return -cfg.overlong_penalty * excess.clamp(max=1.0)


def total_reward(per_fn: torch.Tensor, weights: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """Weighted sum over functions that scored [B] float64; NaN where none did (such completions get advantage 0).

    A sum too large for float64 (rewards near 1e308) is unscorable too, with a ``RuntimeWarning``.
    """
    per_fn = per_fn.to(torch.float64)
    unscorable = torch.isnan(per_fn).all(-1)
    total = torch.nansum(per_fn * weights.to(torch.float64), dim=-1) + penalty.to(torch.float64)
    overflow = ~unscorable & ~torch.isfinite(total)
    if bool(overflow.any()):
        warnings.warn(f"the weighted reward of row {int(torch.nonzero(overflow)[0])} overflows float64: treated as unscorable", RuntimeWarning, stacklevel=2)
    return torch.where(unscorable | overflow, torch.full_like(total, math.nan), total)


# --------------------------------------------------------------------------------------------------
# the policy's log-probs and the loss, from hidden states (no full logits)
# --------------------------------------------------------------------------------------------------
@dataclass
class UpdateBatch:
    """What the loss needs, row-aligned; ``rows(idx)`` slices out a micro-batch."""

    input_ids: torch.Tensor  # [B, P+T] prompt then completion
    attention_mask: torch.Tensor  # [B, P+T]
    prompt_len: int  # P
    completion_ids: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T] the completion mask, less masked-out truncated completions
    advantages: torch.Tensor  # [B]
    old_logps: Optional[torch.Tensor] = None  # [B, T]
    ref_logps: Optional[torch.Tensor] = None  # [B, T]
    rollout_logps: Optional[torch.Tensor] = None  # [B, T] the rollout engine's log-probs (rollout_correction)
    # B * T kept sets, row-major over [B, T]: the engine's (Completions.sampling_mask), replayed by every
    # log-prob of the loss (GRPOConfig.sampling_replay); None: the loss truncates with cfg.top_k / top_p
    sampling_mask: Optional[SamplingMask] = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def sequences_in_loss(self) -> int:
        """The sequences a call's per-sequence reduction divides by: every row (as ``grpo_kernels`` counts
        unpacked rows, those without a loss token included)."""
        return len(self)

    def rows(self, idx: torch.Tensor) -> "UpdateBatch":
        pick = lambda t: None if t is None else t[idx]  # noqa: E731
        T = self.completion_ids.shape[1]
        positions = (idx.to(torch.int64).unsqueeze(-1) * T + torch.arange(T, device=idx.device)).reshape(-1)  # their sets
        return UpdateBatch(
            pick(self.input_ids), pick(self.attention_mask), self.prompt_len, pick(self.completion_ids),
            pick(self.loss_mask), pick(self.advantages), pick(self.old_logps), pick(self.ref_logps), pick(self.rollout_logps),
            None if self.sampling_mask is None else self.sampling_mask.rows(positions),
        )

    def micro_batches(self, size: Optional[int]) -> list["UpdateBatch"]:
        size = size or max(len(self), 1)
        return [self.rows(torch.arange(i, min(i + size, len(self)))) for i in range(0, len(self), size)]

    def filler(self) -> "UpdateBatch":
        """One row shaped like this batch's that adds nothing: no loss tokens, advantage 0."""
        zeros = lambda t: None if t is None else t.new_zeros((1, *t.shape[1:]))  # noqa: E731
        sets = self.sampling_mask
        return UpdateBatch(
            zeros(self.input_ids), zeros(self.attention_mask) + 1, self.prompt_len, zeros(self.completion_ids),
            zeros(self.loss_mask), zeros(self.advantages), zeros(self.old_logps), zeros(self.ref_logps), zeros(self.rollout_logps),
            None if sets is None else SamplingMask(sets.token_ids[:0], sets.offsets.new_zeros(self.completion_ids.shape[1] + 1)),
        )


MicroBatch = Union[UpdateBatch, packing.PackedMicroBatch]


def micro_batches(batch: UpdateBatch, cfg: GRPOConfig) -> list[MicroBatch]:
    """The batch as micro-batches: packed rows of at most ``max_tokens_per_microbatch`` tokens
    (``padding_free``), or ``micro_batch_size`` padded rows; then fillers up to as many as the rank
    with the most has: under FSDP2 every forward gathers weights, so all ranks make the same calls."""
    if cfg.padding_free:
        chunks, filler = packing.pack_batch(batch, cfg.max_tokens_per_microbatch), packing.filler_micro_batch(batch)
    else:
        chunks, filler = batch.micro_batches(cfg.micro_batch_size), batch.filler()
    return chunks + [filler] * (distributed.all_reduce(len(chunks), "max") - len(chunks))


@torch.no_grad()
def completion_logps(model, batch: UpdateBatch, cfg: GRPOConfig, device: torch.device) -> torch.Tensor:
    """Per-token log-probs [B, T] float32 of the completions under ``model`` (old policy or reference)."""
    policy = as_policy(model)
    mbs = micro_batches(batch, cfg)
    chunks = [policy(Policy.logps, mb, cfg, device) for mb in mbs]
    if cfg.padding_free:  # back to the padded [B, T] layout (fillers have no sequence)
        real = [(mb, c) for mb, c in zip(mbs, chunks) if len(mb)]
        return packing.unpack_values([mb for mb, _ in real], [c for _, c in real]) if real else batch.loss_mask.new_zeros(batch.loss_mask.shape, dtype=torch.float32)
    return torch.cat(chunks)[: len(batch)]  # (less any fillers)


@dataclass(frozen=True)
class BatchTotals:
    """The whole batch's counts, over every micro-batch and every rank: what a micro-batch's loss is
    normalised by, so that the micro-batch losses of all ranks sum to the batch's loss."""

    tokens: torch.Tensor  # loss tokens, at least 1 (TRL's num_items_in_batch, verl's batch_num_tokens)
    rows: int  # sequences, those without a loss token included (TRL's per-sequence denominators)
    sequences: int  # sequences with a loss token (verl's global_batch_size)
    ranks: int  # data-parallel ranks, whose gradients DDP and FSDP2 average (verl's dp_size)


def batch_totals(batch: UpdateBatch) -> BatchTotals:
    """This rank's share of the batch -> the whole batch's :class:`BatchTotals` (all-reduced)."""
    return BatchTotals(
        tokens=distributed.all_reduce(batch.loss_mask.sum().float()).clamp(min=1.0),
        rows=int(distributed.all_reduce(len(batch))),
        sequences=int(distributed.all_reduce(int((batch.loss_mask.sum(-1) > 0).sum()))),
        ranks=distributed.world_size(),
    )


def loss_normalisation(mb: MicroBatch, totals: BatchTotals, options: GRPOOptions) -> tuple[dict[str, Any], float]:
    """(keywords of the loss, factor its result is multiplied by) for one micro-batch, one rule per vocabulary.

    verl (``loss_mode``), as verl's ``ppo_loss`` passes its ``global_batch_info``: the batch's token
    count (``batch_num_tokens``), its sequences with a loss token (``global_batch_size``) and the ranks
    (``dp_size``) go to the loss, which reduces the policy term, the KL and the entropy bonus by
    ``loss_agg_mode`` against them and multiplies by ``dp_size``; the factor is 1.

    TRL (``loss_type``): the token-normalised types (dapo, cispo, vespo; bnpo as dapo) divide by the
    batch's token count; the others divide by the call's sequences, which the factor
    ``mb.sequences_in_loss / totals.rows`` turns into the batch's. The entropy bonus is the batch's
    mean token entropy (TRL's bonus is a per-call token mean: ``coef * H_mb * n_mb / tokens``, divided
    by the factor). Then times the ranks, whose gradients are averaged.
    """
    if options.is_verl:
        return {"num_items_in_batch": totals.tokens, "global_batch_size": totals.sequences, "dp_size": totals.ranks}, 1.0
    per_token = options.loss_type in TOKEN_NORMALISED_LOSS_TYPES
    share = 1.0 if per_token else mb.sequences_in_loss / totals.rows
    tokens = float(mb.loss_mask.sum())
    entropy_coef = options.entropy_coef * tokens / (float(totals.tokens) * share) if tokens and options.entropy_coef else 0.0
    keywords = {"loss_type": "dapo" if options.loss_type == "bnpo" else options.loss_type,
                "num_items_in_batch": totals.tokens, "entropy_coef": entropy_coef}
    return keywords, share * totals.ranks


def policy_loss(model, mb: MicroBatch, totals: BatchTotals, cfg: GRPOConfig, device: torch.device):
    """The GRPO loss of one micro-batch, scaled so that the micro-batch losses of all ranks sum to the
    batch's loss (:func:`loss_normalisation`), and the loss's metrics of the micro-batch."""
    keywords, factor = loss_normalisation(mb, totals, cfg.grpo_options())
    out = as_policy(model)(Policy.loss, mb, cfg, device, **keywords)
    return out.loss * factor, out.metrics


def update(model, optimizer, batch: UpdateBatch, cfg: GRPOConfig, device: torch.device,
           memory: Optional[PhaseMemory] = None) -> dict[str, float]:
    """``num_iterations`` optimizer steps on one batch, each accumulating gradients over micro-batches;
    ``memory`` closes the phases ``backward`` (forward, loss, backward, clipping) and ``optimizer``.

    Under data parallelism ``batch`` is this rank's share (possibly empty); the logs are global.
    An iteration whose loss (on any rank) or gradient norm is not finite does not step the optimizer:
    AdamW would carry a NaN into every weight and its moments. It is counted in ``skipped_updates``
    and reported in a ``RuntimeWarning``; its loss / grad_norm are logged as they were (null in JSON).
    """
    totals = batch_totals(batch)
    params = [p for p in model.parameters() if p.requires_grad]
    metrics = LossMetrics(sequence_mean_metrics(cfg))
    losses, grad_norms, skipped = [], [], 0
    for _ in range(cfg.num_iterations):
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        chunks = micro_batches(batch, cfg)
        for i, mb in enumerate(chunks):
            with distributed.no_grad_sync(model, skip=i < len(chunks) - 1):  # DDP: all-reduce once, at the end
                loss, mb_metrics = policy_loss(model, mb, totals, cfg, device)
                loss.backward()
            loss_sum += loss.item()
            metrics.add(mb_metrics, tokens=float(mb.loss_mask.sum()), sequences=mb.sequences_in_loss)
        grad_norms.append(total_norm(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)))
        losses.append(loss_sum)
        if memory is not None:
            memory.mark("backward")
        if distributed.all_reduce(float(not (math.isfinite(loss_sum) and math.isfinite(grad_norms[-1]))), "max"):
            skipped += 1  # (every rank skips: the gradient norm is global, the flag all-reduced)
            optimizer.zero_grad(set_to_none=True)
            warnings.warn(f"optimizer step skipped: the loss ({loss_sum}) or gradient norm ({grad_norms[-1]}) is not finite", RuntimeWarning, stacklevel=2)
            continue
        optimizer.step()
        if memory is not None:
            memory.mark("optimizer")
    logs, losses = metrics.reduce(losses, iterations=cfg.num_iterations)  # (over every rank)
    logs.update(loss=sum(losses) / len(losses), grad_norm=sum(grad_norms) / len(grad_norms), skipped_updates=skipped)
    return logs


def sequence_mean_metrics(cfg: GRPOConfig) -> frozenset:
    """The loss's metrics that are means over sequences, not tokens, under ``cfg`` (so the micro-batches'
    values are weighted by their sequences): TRL's clip fractions with a per-sequence ratio, and the
    rollout correction's ratio per sequence."""
    keys = set()
    if cfg.importance_sampling_level == "sequence":
        keys |= {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"}
    if (cfg.grpo_options().rollout_correction or "").startswith("sequence"):
        keys.add("sampling/importance_sampling_ratio/mean")
    return frozenset(keys)


def total_norm(norm: torch.Tensor) -> float:
    """``clip_grad_norm_``'s result as a float (a replicated DTensor under FSDP2)."""
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


# --------------------------------------------------------------------------------------------------
# one step: sample, score, update, log
# --------------------------------------------------------------------------------------------------
def train_step(
    step: int,
    model,
    ref_model,
    rollout_engine: Rollout,
    optimizer,
    rows: list[dict[str, Any]],
    reward_fns: Mapping[str, RewardFn],
    cfg: GRPOConfig,
    device: torch.device,
    memory: Optional[PhaseMemory] = None,
) -> dict[str, Any]:
    """Rollouts, rewards, advantages and the update for one batch of prompts; returns the step's log.

    memory: the run's :class:`grpo.memory.PhaseMemory` (``grpo.train``'s); None: one for this step that
    never resets the resident set's high-water mark (so a caller's own measurement of the step stands),
    whose ``memory/<phase>_mb`` are then the process's peak at each phase's end."""
    start = time.perf_counter()
    clock = PhaseClock(device)
    memory = memory if memory is not None else PhaseMemory(cfg.release_memory, reset=False)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(step, cfg)

    # 1. rollouts, for this rank's share of the step's prompts (all of them in a single process)
    batch_rows, rollout = sample(step, model, rollout_engine, rows, cfg)
    clock.lap("generate")
    memory.mark("generation")

    # 2. rewards -> group-relative advantages
    scores = score_rollout(reward_fns, rollout, batch_rows, cfg)
    clock.lap("score")
    memory.mark("scoring")

    # 3. the update: the loss's batch, the ratios' denominators, then the optimizer steps
    batch = update_batch(rollout, scores, cfg, device)
    update_logs: dict[str, float] = {}
    if distributed.all_reduce(batch.loss_mask.sum()) > 0:  # (then every rank updates, even with no rows)
        add_denominators(batch, model, ref_model, cfg, device)
        clock.lap("logps")
        memory.mark("logps")
        model.train()
        update_logs = update(model, optimizer, batch, cfg, device, memory)
    clock.lap("update")

    # 4. the step's log, over every rank's completions
    return step_log(step, rollout, scores, batch, update_logs, list(reward_fns), clock, time.perf_counter() - start,
                    cfg, device, memory)


def sample(step: int, model, rollout_engine: Rollout, rows: list[dict[str, Any]],
           cfg: GRPOConfig) -> tuple[list[dict[str, Any]], Completions]:
    """(this rank's rows of the step's prompts, their ``num_generations`` completions each). The policy is
    put in eval mode: sampling, and the log-probs scored before the update, run without dropout (LoRA's)."""
    G = cfg.num_generations
    indices = prompts_for_step(len(rows), step, cfg.prompts_per_step, cfg.seed)
    batch_rows = [rows[i] for i in shard_for_rank(indices, distributed.rank(), distributed.world_size())]
    model.eval()
    rollout = rollout_engine.generate(model, [r["prompt"] for r in batch_rows], G)
    engine = type(rollout_engine).__name__
    if rollout.sampling_logps is not None and getattr(rollout_engine, "reports_sampling_logps", None) is False:
        raise ValueError(f"{engine} declares reports_sampling_logps = False but returned sampling_logps: the run's "
                         f"checks trusted the declaration (grpo.rollout.Rollout)")
    return batch_rows, rollout.check(len(batch_rows) * G, engine)


@dataclass(frozen=True)
class Scores:
    """A step's rewards; ``B`` is this rank's completions."""

    per_fn: torch.Tensor  # [B, F] float64, one column per reward function, NaN = unscorable
    nonfinite: torch.Tensor  # [F] int64: values each function returned that were not finite
    penalty: torch.Tensor  # [B] DAPO's overlong penalty
    rewards: torch.Tensor  # [every rank's B] float64 weighted totals, in rank order; NaN = unscorable
    advantages: torch.Tensor  # [B] this rank's group-relative advantages
    zero_signal: torch.Tensor  # [B / G] bool: groups whose rewards are all equal


def score_rollout(reward_fns: Mapping[str, RewardFn], rollout: Completions, batch_rows: list[dict[str, Any]],
                  cfg: GRPOConfig) -> Scores:
    """Every completion scored by every reward function, weighted into one reward, then advantages within
    each group. The advantages see every rank's rewards, in rank order (the single-process batch), so
    that "batch" scaling sees them all; each group lies within one rank, which keeps its own rows."""
    G = cfg.num_generations
    per_fn, nonfinite = score(reward_fns, rollout, columns_of(batch_rows, G))
    weights = torch.tensor(cfg.reward_weights or [1.0] * len(reward_fns), dtype=torch.float64)
    penalty = overlong_penalty(rollout.lengths, cfg)
    rewards = total_reward(per_fn, weights, penalty)  # [B]
    all_rewards = distributed.all_gather(rewards)
    mine = slice(distributed.rank() * len(rewards), (distributed.rank() + 1) * len(rewards))
    advantages = group_advantages(all_rewards, G, std=cfg.advantage_std, scale=cfg.scale_rewards)[mine]
    return Scores(per_fn, nonfinite, penalty, all_rewards, advantages, zero_signal_groups(rewards, G))


def update_batch(rollout: Completions, scores: Scores, cfg: GRPOConfig, device: torch.device) -> UpdateBatch:
    """What the loss reads: prompt and completion ids, the loss mask (less truncated completions with
    ``mask_truncated_completions``), the advantages, the engine's log-probs and, with ``sampling_replay``, the
    sets of tokens it drew each token from (when it truncated and reports them); only the groups that carry
    a signal with ``drop_zero_signal_groups``."""
    loss_mask = rollout.completion_mask.clone()
    if cfg.mask_truncated_completions:
        loss_mask[rollout.truncated] = 0
    batch = UpdateBatch(
        input_ids=torch.cat([rollout.prompt_ids, rollout.completion_ids], 1),
        attention_mask=torch.cat([rollout.prompt_mask, rollout.completion_mask], 1),
        prompt_len=rollout.prompt_ids.shape[1],
        completion_ids=rollout.completion_ids,
        loss_mask=loss_mask,
        advantages=scores.advantages.to(device),
        # every log-prob of the loss over the engine's kept sets, not a truncation recomputed from the trainer's
        # logits, which differ from the engine's by rounding and may keep another set (GRPOConfig.sampling_replay)
        sampling_mask=rollout.sampling_mask.to(device) if cfg.sampling_replay and rollout.sampling_mask is not None else None,
    )
    kept = torch.arange(len(batch))
    if cfg.drop_zero_signal_groups:
        kept = torch.nonzero(~scores.zero_signal.repeat_interleave(cfg.num_generations)).squeeze(-1)
        batch = batch.rows(kept)
    # the engine's and the trainer's log-probs of the sampled tokens differ: given the engine's
    # (rollout_logps) the loss corrects for it (rollout_correction, TRL's vllm_importance_sampling_mode),
    # and TRL's off-policy mask takes them as the sampling policy's
    if rollout.sampling_logps is not None:
        batch.rollout_logps = rollout.sampling_logps[kept.to(rollout.sampling_logps.device)].to(device)
    return batch


def add_denominators(batch: UpdateBatch, model, ref_model, cfg: GRPOConfig, device: torch.device) -> None:
    """The ratios' denominators, before any update and without dropout: the old policy's log-probs (with
    ``num_iterations > 1``, or when correcting for the engine, which sampled with these weights) and the
    reference model's (``beta > 0``)."""
    correct = batch.rollout_logps is not None and cfg.grpo_options().rollout_correction is not None
    if cfg.num_iterations > 1 or correct:
        batch.old_logps = completion_logps(model, batch, cfg, device)
    if ref_model is not None:
        batch.ref_logps = completion_logps(ref_model, batch, cfg, device)


def step_log(step: int, rollout: Completions, scores: Scores, batch: UpdateBatch, update_logs: dict[str, float],
             reward_names: list[str], clock: "PhaseClock", step_time: float, cfg: GRPOConfig,
             device: torch.device, memory: PhaseMemory) -> dict[str, Any]:
    """The step's log line, over every rank's completions (memory: the largest rank's)."""
    rewards = scores.rewards
    per_fn, penalty, zero_signal, lengths, truncated = (
        distributed.all_gather(t)
        for t in (scores.per_fn, scores.penalty, scores.zero_signal.float(), rollout.lengths.float(), rollout.truncated.float())
    )
    nonfinite = distributed.all_reduce(scores.nonfinite)
    scored = rewards[~torch.isnan(rewards)]
    return {
        "step": step + 1,
        "reward": float(scored.mean()) if scored.numel() else math.nan,
        "reward_std": float(scored.std()) if scored.numel() > 1 else 0.0,
        **reward_logs(per_fn, nonfinite, reward_names, penalty, cfg),
        "unscorable_frac": float(torch.isnan(rewards).float().mean()),
        "zero_signal_groups": int(zero_signal.sum()),
        "zero_signal_frac": float(zero_signal.float().mean()),
        "updated_completions": distributed.all_reduce(len(batch)),
        "completion_length/mean": float(lengths.mean()),
        "completion_length/max": float(lengths.max()),
        "truncated_frac": float(truncated.mean()),
        **update_logs,  # loss, grad_norm, skipped_updates, kl, entropy, clip ratios (absent when nothing was updated)
        "lr": learning_rate(step, cfg),
        "step_time": step_time,
        "generate_time": clock.times["time/generate"],
        **clock.times,  # time/generate, time/score, time/logps (old and reference), time/update (loss, backward, optimizer)
        "tokens_per_s": float(lengths.sum()) / step_time,  # completion tokens sampled and trained on
        "peak_memory_mb": distributed.all_reduce(peak_memory_mb(device, memory), "max"),
        **{k: distributed.all_reduce(v, "max") for k, v in memory.record().items()},  # memory/<phase>_mb (grpo.memory)
        "sample": rollout.prompts[0] + rollout.completions[0],
    }


def reward_logs(per_fn: torch.Tensor, nonfinite: torch.Tensor, names: list[str], penalty: torch.Tensor, cfg: GRPOConfig) -> dict[str, float]:
    """Mean and std of every reward function (over the completions it scored), its count of non-finite
    values (treated as unscorable), and "accuracy"."""
    logs = {}
    for j, name in enumerate(names):
        col = per_fn[:, j]
        col = col[~torch.isnan(col)]
        logs[f"rewards/{name}/mean"] = float(col.mean()) if col.numel() else math.nan
        logs[f"rewards/{name}/std"] = float(col.std()) if col.numel() > 1 else 0.0
        logs[f"rewards/{name}/nonfinite"] = int(nonfinite[j])
        if name == cfg.accuracy_reward:
            logs["accuracy"] = logs[f"rewards/{name}/mean"]
    if cfg.overlong_buffer > 0:
        logs["rewards/overlong/mean"] = float(penalty.mean())
    return logs


class PhaseClock:
    """Seconds spent in each phase of a step, as ``{"time/<phase>": s}``; on CUDA a lap first waits for
    the queued work, so that a phase is charged with its own kernels (benchmarks/trainer_step.py reads these)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.last, self.times = device, time.perf_counter(), {}

    def lap(self, phase: str) -> float:
        """The seconds since the previous lap (or the start), recorded as ``time/<phase>``."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.times[f"time/{phase}"], self.last = now - self.last, now
        return self.times[f"time/{phase}"]


def peak_memory_mb(device: torch.device, memory: Optional[PhaseMemory] = None) -> float:
    """Peak GPU memory allocated in this step, or the process's peak resident memory on CPU (``memory``'s,
    which counts across its resets of the high-water mark; else ``ru_maxrss``)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rusage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return max(memory.process_peak_mb, rusage) if memory is not None and memory.available else rusage


# --------------------------------------------------------------------------------------------------
# the loop
# --------------------------------------------------------------------------------------------------
def as_named(reward_fns: Union[Mapping[str, RewardFn], Sequence[RewardFn]]) -> dict[str, RewardFn]:
    """``{name: fn}`` from a mapping or a list (named by ``__name__``; two of one name are an error, not one dropped)."""
    named = list(reward_fns.items()) if isinstance(reward_fns, Mapping) else [(reward_name(fn), fn) for fn in reward_fns]
    if not named:
        raise ValueError("reward_fns is empty: GRPO needs at least one reward function")
    for name, fn in named:
        if not callable(fn):
            raise TypeError(f"reward function {name!r} is not callable: {fn!r}")
    names = [name for name, _ in named]
    if len(set(names)) != len(names):
        raise ValueError(f"reward functions share a name ({names}): pass a {{name: fn}} dict")
    return dict(named)


def setup_training(model: torch.nn.Module, cfg: GRPOConfig, device: torch.device):
    """(model, policy, ref_policy, optimizer): the weights cast to ``cfg.model_dtype``, LoRA adapters
    added with ``use_peft`` (``model`` is then the peft model), the policy to train, the reference
    (None with ``beta = 0``; the policy with its adapters off under LoRA; else a frozen copy) and AdamW.

    This is where a run changes the caller's model: every check that can refuse the run comes before
    it (:func:`check_run`; the LoRA targets against the model's modules again here, before the cast)."""
    precision.check_device_supports(cfg.model_dtype, device)
    if cfg.use_peft:
        lora.check_targets(model, cfg)
    model = precision.cast_model(model, cfg.model_dtype)
    if cfg.use_peft:  # (initialised from the RNG; DDP / FSDP2 then give every rank rank 0's)
        model = lora.add_adapters(model, cfg)
    policy = prepare_model(model, cfg, device)
    if cfg.beta <= 0:
        ref_policy = None
    elif cfg.use_peft:
        ref_policy = ReferenceWithoutAdapters(policy)
    else:
        ref_policy = prepare_model(make_reference_model(model), cfg, device, frozen=True)
    return model, policy, ref_policy, make_optimizer(policy, cfg)


@dataclass
class RunChecks:
    """What :func:`check_run` found: the reward functions by name, and the checkpoint to resume from
    (read and checked; None for a fresh run)."""

    reward_fns: dict[str, RewardFn]
    resume_state: Optional[dict[str, Any]]


def check_run(cfg: GRPOConfig, rows: list[dict[str, Any]], reward_fns: Union[Mapping[str, RewardFn], Sequence[RewardFn]], *,
              model: Optional[torch.nn.Module] = None, tokenizer=None, rollout: Optional[Rollout] = None,
              device: Optional[torch.device] = None) -> RunChecks:
    """Every check of a run that needs no weights, before anything loads, is created or changes.

    ``model``: the caller's model (only its config, module names and shapes are read), or a meta-device
    skeleton built from its config (``python -m grpo train`` before the weights load). Checks: the config
    and the engine's types; LoRA (peft installed, targets that exist and are linear, not the head); MLP
    chunks (``mlp`` modules to chunk); the rows and the reward functions (their columns, weights); vLLM
    installed; the ranks dividing the batch; the device's dtype; the loss with the model's own logit
    transform; vespo's per-token correction
    against an engine passed in that may report log-probs (the config's engine checked its own combinations
    when the config was made: ``grpo.rollout.RolloutEngine.check_config``), the packages the config's
    engine needs; the prompts' lengths against the engine's context; the
    output directory (no checkpoint of an earlier run unless resuming, no live run holding it) and, when
    resuming, the checkpoint (readable, a grpo checkpoint, the same settings, the same model's weights).
    Raises ``TypeError`` / ``ValueError`` / ``FileExistsError`` / ``checkpoint.OutputDirInUse`` naming the
    option, file or directory. ``grpo.train`` calls it first; calling it again changes nothing."""
    if not isinstance(cfg, GRPOConfig):
        raise TypeError(f"cfg must be a grpo.GRPOConfig, got {type(cfg).__name__}")
    if rollout is not None and not isinstance(rollout, Rollout):
        raise TypeError(f"rollout must implement grpo.rollout.Rollout (a generate method), got {type(rollout).__name__}")
    lora.check_flags(cfg)  # peft installed
    if cfg.use_peft and model is not None:
        lora.check_targets(model, cfg)  # (names and types only: nothing changes)
    if cfg.mlp_chunk_tokens is not None and model is not None and not activations.mlp_modules(model):
        raise OptionError(f"mlp_chunk_tokens: {type(unwrap(model)).__name__} has no decoder layer with an `mlp` module "
                          "to chunk", "mlp_chunk_tokens")
    columns = check_rows(rows)
    engine = engine_class(cfg.rollout_engine)
    if rollout is None:
        engine.require()  # (the packages it needs: vLLM's)
    named = as_named(reward_fns)
    if cfg.reward_weights is not None and len(cfg.reward_weights) != len(named):
        raise OptionError(f"reward_weights has {len(cfg.reward_weights)} entries for {len(named)} reward functions",
                          "reward_weights")
    check_reward_columns(named, columns, rows)  # and plans every row's tests: prints what cannot be judged
    ranks = distributed.launched_ranks()
    if cfg.prompts_per_step % ranks:
        raise OptionError(f"prompts_per_step={cfg.prompts_per_step} must be a multiple of the {ranks} ranks", "prompts_per_step")
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision.check_device_supports(cfg.model_dtype, device)
    if model is not None:  # the loss as the run will call it: the config's options and the model's head transform
        cfg.grpo_options(**head_transform(model))
    # an engine passed in, by its declaration (the config's own engine said what it refuses when the config was made)
    if rollout is not None and cfg.sequence_correction_refused():
        cfg.check_sequence_correction(type(rollout).__name__, getattr(rollout, "reports_sampling_logps", None))
    prompts = [row["prompt"] for row in rows]
    if rollout is not None and callable(getattr(rollout, "check_prompts", None)):  # an engine with a context limit
        rollout.check_prompts(prompts)
    elif rollout is None and tokenizer is not None and model is not None:  # (the engine, before it starts)
        engine.check_prompts_before_start(cfg, model, tokenizer, prompts)
    checkpoint.check_output_dir(cfg.output_dir, cfg.resume)  # a fresh run never replaces an earlier one's checkpoint
    if os.environ.get("RANK", "0") == "0":  # (the rank that will take the lock; the others would race its probe)
        checkpoint.check_not_in_use(cfg.output_dir)
    state, path = None, checkpoint.path_in(cfg.output_dir)
    if cfg.resume and os.path.exists(path):
        state = checkpoint.read(path)
        checkpoint.check_resumable(state, path, model, dataclasses.asdict(cfg),
                                   allow_changes=cfg.resume_with_changes)
    return RunChecks(named, state)


@contextlib.contextmanager
def run_lock(output_dir: str, main_process: bool) -> Iterator[checkpoint.RunLock]:
    """``checkpoint.RunLock`` on the main process, every rank learning whether it was taken, so that all
    refuse together (``checkpoint.OutputDirInUse``) rather than the others waiting for rank 0."""
    lock, refused = checkpoint.RunLock(output_dir, enabled=main_process), None
    try:
        lock.__enter__()
    except checkpoint.OutputDirInUse as e:
        refused = e
    if distributed.all_reduce(int(refused is not None), "max"):
        raise refused or checkpoint.OutputDirInUse(f"{output_dir} is in use by another training run (rank 0 could not "
                                                   f"take its lock)")
    try:
        yield lock
    finally:
        lock.__exit__(None, None, None)


def set_seed(seed: int) -> None:
    import numpy as np

    seed %= 2**32  # (numpy's range; the trainer adds the rank to the configured seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train(
    model,
    tokenizer,
    rows: list[dict[str, Any]],
    reward_fns: Union[Mapping[str, RewardFn], Sequence[RewardFn]],
    cfg: GRPOConfig,
    device: Optional[torch.device] = None,
    rollout: Optional[Rollout] = None,
) -> list[dict[str, Any]]:
    """Run GRPO for ``cfg.num_steps`` steps (resuming when asked); returns every step's log.

    rows: ``{"prompt": str, ...}``; the other columns reach each reward function as keyword lists.
    reward_fns: ``{name: fn}`` or a list (named by ``__name__``); ``fn(prompts, completions, **columns)``
    returns one ``float | None`` per completion.

    rollout: the engine that samples completions (``grpo.rollout``); None = Hugging Face ``generate``
    on the policy, with ``cfg``'s sampling settings.

    Under torchrun, with ``cfg.distributed`` "ddp" or "fsdp", every rank calls this with the same
    arguments; ``cfg.prompts_per_step`` (the global batch) is split evenly among the ranks.

    The weights are cast to ``cfg.model_dtype`` in place. With ``cfg.use_peft`` peft adds LoRA adapters
    to ``model`` in place (``grpo.lora``), only they train, and the run ends by writing them to
    ``output_dir/adapter``. A run that refuses (:func:`check_run`: every check that needs no weights,
    the output directory and the checkpoint to resume included) does so before any of that: the model
    is left as it was, and no directory, lock or engine is created.
    """
    checks = check_run(cfg, rows, reward_fns, model=model, tokenizer=tokenizer, rollout=rollout, device=device)
    reward_fns = checks.reward_fns
    # nothing has loaded, been created or changed yet: from here on the run takes the output directory,
    # starts its rollout engine and then changes the model (casts it, adds adapters)
    distributed.setup(cfg.distributed)
    device = device or default_device()
    main_process = distributed.is_main_process()
    # every phase's peak resident memory, for the log (grpo.memory); on leaving, also when the run raises or
    # stops on SIGTERM, the high-water mark goes back to the run's peak for whoever measures this process
    with PhaseMemory(cfg.release_memory) as memory:
        set_seed(cfg.seed + distributed.rank())  # each rank samples its own completions
        start_step, checkpoint_path = 0, checkpoint.path_in(cfg.output_dir)
        # one run per output directory (rank 0 holds the lock); SIGTERM ends the run after the current
        # step, with a checkpoint
        with run_lock(cfg.output_dir, main_process), checkpoint.StopOnSigterm() as sigterm:
            checkpoint.check_output_dir(cfg.output_dir, cfg.resume)  # (again, under the lock)
            if rollout is None:  # (a vLLM engine starts from the model's config alone, before the model changes)
                rollout = default_rollout(model, tokenizer, cfg)
                if callable(getattr(rollout, "check_prompts", None)):  # (the engine's own context length)
                    rollout.check_prompts([row["prompt"] for row in rows])
            model, policy, ref_policy, optimizer = setup_training(model, cfg, device)
            ref_weights = None if cfg.use_peft else ref_policy  # what a checkpoint holds of the reference
            if checks.resume_state is not None:
                start_step = checkpoint.restore(checks.resume_state, checkpoint_path, policy, ref_weights, optimizer)
            log = RunLog(os.path.join(cfg.output_dir, "log.jsonl"), enabled=main_process, resume_step=start_step or None)
            zero_signal = ZeroSignalWatch(log.records)
            if main_process:  # the predicted peak of a step, term by term (grpo.plan)
                plan.log_for_run(unwrap(policy).config, cfg, plan.micro_batch_tokens(rows, tokenizer, cfg, distributed.world_size()),
                                 device.type)
            memory.mark("setup")  # (from the process's start: the model's loading included; in the first step's record)

            bar = tqdm(range(start_step, cfg.num_steps), initial=start_step, total=cfg.num_steps,
                       disable=not (cfg.progress and main_process), desc="GRPO", dynamic_ncols=True)
            for step in bar:
                record = train_step(step, policy, ref_policy, rollout, optimizer, rows, reward_fns, cfg, device, memory)
                record.update(zero_signal.update(record))
                record = log.write(record)
                postfix = {k: f"{record[k]:.3f}" for k in ("reward", "accuracy", "kl") if record.get(k) is not None}
                if "warning" in record:
                    postfix["no signal"] = f"{record['zero_signal_steps']} steps"
                    if record["zero_signal_steps"] == zero_signal.patience and main_process:
                        warnings.warn(record["warning"], RuntimeWarning, stacklevel=2)
                bar.set_postfix(postfix)
                done = step + 1
                stopping = sigterm.agreed()
                if done == cfg.num_steps or (cfg.save_every and done % cfg.save_every == 0) or stopping:
                    checkpoint.save(checkpoint_path, done, policy, ref_weights, optimizer, dataclasses.asdict(cfg))
                    memory.mark("save")  # (the log's writing included) added to the step's record, after the fact
                    log.amend({k: distributed.all_reduce(v, "max") for k, v in memory.record().items()})
                if stopping:
                    bar.close()
                    sigterm.exit(checkpoint_path, done)
            bar.close()
        distributed.copy_back(policy, model)  # FSDP2 trained a sharded copy
        if cfg.use_peft and main_process:
            lora.save_adapter(model, cfg.output_dir, tokenizer)
        if cfg.plot and main_process:  # (matplotlib in another process: it never adds to this one's peak)
            plot_in_subprocess(log.records, os.path.join(cfg.output_dir, "curves.png"))
    return log.records
