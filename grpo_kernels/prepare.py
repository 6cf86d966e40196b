"""A call's arguments made ready for the row kernels, shared by the single-device functions
(``functional``), the vocabulary-parallel ones (``vocab_parallel``) and the spec (``reference``).

:class:`LogprobKeywords` declares the log-prob functions' own keywords (``token_logprobs`` and
``fused_linear_token_logprobs``, public and reference), beside the logit transform's
(``options.LogitTransform``'s fields); each signature writes both out (``tools/signatures.py``).
:func:`check_logprob_flags` and :func:`logprob_targets` check a call's values, :func:`logprob_outputs`
shapes its return.
:func:`prepare_grpo` validates a GRPO call (its flat keywords split into ``GRPOInputs`` and
``GRPOOptions``, the tensors checked against the batch) and gives the effective mask and the ids that
masked positions leave unread. :func:`linear_rows` picks the rows a fused-linear call projects (those
whose target is not ``ignore_index``), its compute dtype and chunk; :func:`scatter_rows` and
:func:`take_rows` (and :func:`take_transform`, for a per-token temperature) move per-token values between
the kept rows and the call's ``[B, T]`` layout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Tuple, Union

import torch

from . import _validation as V
from . import objective
from .autograd import compute_dtype, default_chunk_size
from .options import IGNORE_INDEX, LogitTransform, split_grpo_keywords
from .sampling_mask import SamplingMask


@dataclass(frozen=True)
class LogprobKeywords:
    """The keywords every log-prob function takes besides the logit transform's (their meaning:
    ``functional.token_logprobs``): each declared once, here, with its type and default; a call's
    values checked (:func:`check_logprob_flags`)."""

    ignore_index: int = IGNORE_INDEX
    return_entropy: bool = False
    return_sum_probs_sq: bool = False
    sampling_mask: Optional[SamplingMask] = None


def check_logprob_flags(ignore_index: Any, return_entropy: Any, return_sum_probs_sq: Any,
                        sampling_mask: Any) -> LogprobKeywords:
    """A call's log-prob keywords, ``ignore_index`` an int, the two return flags bools and
    ``sampling_mask`` None or a :class:`SamplingMask`: what is checked before anything else (before a
    vocabulary-parallel dispatch)."""
    return LogprobKeywords(V.check_ignore_index(ignore_index), V.check_flag("return_entropy", return_entropy),
                           V.check_flag("return_sum_probs_sq", return_sum_probs_sq),
                           check_sampling_mask_type(sampling_mask))


def check_sampling_mask_type(sampling_mask: object) -> Optional[SamplingMask]:
    """None or a :class:`SamplingMask` (nested lists: build one with ``SamplingMask.from_lists``)."""
    if sampling_mask is not None and not isinstance(sampling_mask, SamplingMask):
        raise TypeError(f"sampling_mask must be a grpo_kernels.SamplingMask or None, got {type(sampling_mask).__name__} "
                        f"(nested lists of kept ids: SamplingMask.from_lists(sets))")
    return sampling_mask


def check_sampling_mask(sampling_mask: Optional[SamplingMask], transform: LogitTransform, num_positions: int,
                        vocab_size: int, device) -> Optional[SamplingMask]:
    """A call's ``sampling_mask`` checked (``SamplingMask.check``: one set per target position, ids in
    ``[0, vocab_size)``, no duplicate in a set, on ``device``), int64; refused beside a truncation
    (``top_k`` / ``top_p``: the kept sets are given, or derived, not both). Before any kernel runs."""
    sampling_mask = check_sampling_mask_type(sampling_mask)
    if sampling_mask is None:
        return None
    if transform.truncates:
        raise ValueError(f"sampling_mask replays the engine's kept sets; top_k={transform.top_k} / "
                         f"top_p={transform.top_p} would derive them again: pass one or the other")
    return sampling_mask.check("sampling_mask", num_positions, vocab_size, device)


def logprob_targets(kw: LogprobKeywords, targets, leading_shape, vocab_size: int, device, leading_name: str = "logits",
                    *, temperature: Union[float, torch.Tensor], softcap: Optional[float], logit_scale: float,
                    top_k: Union[int, torch.Tensor, None],
                    top_p: Union[float, torch.Tensor, None]) -> Tuple[torch.Tensor, LogitTransform]:
    """(targets checked against the call's leading shape, the call's ``LogitTransform`` for them, its
    values checked); every target in ``[0, vocab_size)`` or ``ignore_index``. ``leading_name`` names the
    tensor whose leading shape it is."""
    targets = V.check_token_ids(targets, leading_shape, "targets", leading_name)
    transform = LogitTransform(temperature=temperature, softcap=softcap, logit_scale=logit_scale, top_k=top_k,
                               top_p=top_p).for_rows(targets.shape, device)
    V.check_ids_in_range(targets, vocab_size, kw.ignore_index, "targets")
    return targets, transform


def logprob_sampling_mask(kw: LogprobKeywords, targets: torch.Tensor, transform: LogitTransform, vocab_size: int,
                          device) -> Optional[SamplingMask]:
    """The call's ``sampling_mask`` checked against its targets (:func:`check_sampling_mask`)."""
    return check_sampling_mask(kw.sampling_mask, transform, targets.numel(), vocab_size, device)


def logprob_outputs(kw: LogprobKeywords, logp, entropy, sum_sq):
    """The log-prob functions' return (contract v4): ``logp`` alone, else ``(logp,)`` then ``entropy`` if
    ``return_entropy``, then ``sum_probs_sq`` if ``return_sum_probs_sq``."""
    if not (kw.return_entropy or kw.return_sum_probs_sq):
        return logp
    return (logp,) + ((entropy,) if kw.return_entropy else ()) + ((sum_sq,) if kw.return_sum_probs_sq else ())


def prepare_grpo(name: str, leading_shape, vocab_size: int, completion_ids, advantages, completion_mask, grpo_kwargs):
    """Validate a GRPO call; -> (inputs, options, mask [B, T] fp32, ids with masked positions ignored,
    the options' transform for the call's [B, T] tokens: a temperature tensor checked and broadcast)."""
    inputs, options = split_grpo_keywords(grpo_kwargs, "grpo_loss" if name == "logits" else "fused_linear_grpo_loss")
    V.check_grpo_inputs(leading_shape, completion_ids, advantages, completion_mask, inputs, options, name)
    transform = options.transform.for_rows(tuple(leading_shape[:2]), completion_ids.device)
    mask = objective.effective_mask(completion_ids, completion_mask)
    ids = objective.masked_ids(completion_ids, mask)
    if vocab_size is not None:  # None: a vocabulary shard, checked against every shard (vocab_parallel)
        V.check_ids_in_range(ids, vocab_size, IGNORE_INDEX, "completion_ids")
        if inputs.sampling_mask is not None:
            inputs = dataclasses.replace(inputs, sampling_mask=check_sampling_mask(
                inputs.sampling_mask, transform, ids.numel(), vocab_size, completion_ids.device))
    return inputs, options, mask, ids, transform


class LinearRows(NamedTuple):
    """The rows a fused-linear call projects, and the call's compute dtype (``autograd.compute_dtype``)."""

    hidden: torch.Tensor  # [n, H]: only the rows whose target is not ignore_index
    targets: torch.Tensor  # [n]
    keep: Optional[torch.Tensor]  # [n] int64 indices into the flattened [N] rows; None = all rows kept
    num_rows: int  # N
    chunk_size: int
    dtype: torch.dtype  # of the matmuls; the Functions cast to it inside, so gradients keep each input's dtype


#: ``fp32_logits``, the fused-linear functions' one option on how a chunk's logits are formed (the
#: public signatures name it; its meaning lives here). False (the default): in the compute dtype
#: (:func:`~grpo_kernels.autograd.compute_dtype`: autocast's, else the hidden states'), so 16-bit
#: operands give 16-bit logits, rounded once, as ``lm_head(hidden)`` of a bf16 model gives them (TRL's and
#: OpenRLHF's heads); then every reduction runs in fp32. True: from the products kept in fp32 (verl's
#: kernel): the operands are upcast to fp32 (a bf16 x bf16 product is exact in fp32), so the logits are
#: never rounded to 16 bits; costs a transient fp32 copy of the weight per call and fp32 chunks.
FP32_LOGITS_DEFAULT = False


def logits_dtype(hidden: torch.Tensor, fp32_logits: bool) -> torch.dtype:
    """The dtype a fused-linear call forms its chunks' logits (and runs its matmuls) in: see
    :data:`FP32_LOGITS_DEFAULT`."""
    return torch.float32 if fp32_logits else compute_dtype(hidden)


def linear_rows(hidden, weight, bias, targets, ignore_index, chunk_size, accumulate_in_weight_dtype,
                fp32_logits: bool = FP32_LOGITS_DEFAULT) -> LinearRows:
    """Keep the rows whose target is not ``ignore_index`` (the others are never read, so a NaN hidden
    state at a padded position changes nothing, and cost nothing); fix the compute dtype and chunk."""
    dtype = logits_dtype(hidden, fp32_logits)
    flat_targets = targets.reshape(-1)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    if torch.compiler.is_compiling():  # a row count set by the data would break the graph: every row stays,
        # those without a target zeroed (so a NaN there still reaches nothing); the kernels skip them
        valid = (flat_targets != ignore_index).unsqueeze(-1)
        flat_hidden, keep = torch.where(valid, flat_hidden, torch.zeros((), dtype=hidden.dtype, device=hidden.device)), None
    else:
        keep = (flat_targets != ignore_index).nonzero().squeeze(-1)
        if keep.numel() == flat_targets.numel():  # nothing to leave out: no copy, no scatter back
            keep = None
        else:
            flat_hidden, flat_targets = flat_hidden.index_select(0, keep), flat_targets.index_select(0, keep)
    if chunk_size is None:
        chunk_size = default_chunk_size(weight.shape[0], weight.shape[1], dtype, hidden.device, flat_targets.numel())
    return LinearRows(flat_hidden, flat_targets, keep, targets.numel(), chunk_size, dtype)


def scatter_rows(rows: LinearRows, kept: torch.Tensor, shape) -> torch.Tensor:
    """Per-row fp32 values of the kept rows -> ``shape``, 0 at the rows left out."""
    if rows.keep is None:
        return kept.view(shape)
    zeros = torch.zeros(rows.num_rows, dtype=kept.dtype, device=kept.device)
    return zeros.index_put((rows.keep,), kept).view(shape)


def take_transform(rows: LinearRows, transform: LogitTransform) -> LogitTransform:
    """The transform of the kept rows: a per-token temperature (of the call's leading shape) taken at
    them, flattened [n]; a float stays."""
    return transform.rows(slice(None) if rows.keep is None else rows.keep)


def take_rows(rows: LinearRows, x: Optional[torch.Tensor], shape) -> Optional[torch.Tensor]:
    """A per-token constant broadcast to ``shape`` [B, T], detached, fp32, at the kept rows: [n]."""
    if x is None:
        return None
    flat = x.detach().float().expand(shape).reshape(-1)
    return flat if rows.keep is None else flat.index_select(0, rows.keep)
