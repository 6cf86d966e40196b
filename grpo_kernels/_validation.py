"""Argument checks shared by every backend.

Every public function validates its inputs here, once, before any backend runs, so that bad input
fails with a message naming the argument instead of a silent wrong answer or a crash in a kernel.
Scalar hyper-parameters are checked when ``options.GRPOOptions`` is built, each against its declared
range (``bounds``); tensors against the batch shape by :func:`check_grpo_inputs`. The scalar checks
here are ``bounds.check_value`` too, so every refusal is a ``bounds.OptionError`` naming the argument.
"""

from __future__ import annotations

import numbers
from typing import Any, Optional, Sequence, Tuple

import numpy as np

import torch

from .bounds import Bounds, OptionError, at_least, check_value

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def check_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_number(name: str, value: object, low: Optional[float] = None, high: Optional[float] = None,
                 high_open: bool = False) -> float:
    """A finite real Python/NumPy number (not a bool, not a tensor), optionally within [low, high]."""
    return check_value(name, value, float, bounds=Bounds(low, high, high_open=high_open))


def check_positive_int(name: str, value: object) -> int:
    return check_value(name, value, int, bounds=at_least(1))


def check_flag(name: str, value: object) -> bool:
    """A real bool (Python, NumPy, or a 0-d torch bool tensor), never a truthy string or None.

    ``inplace_backward='False'`` would otherwise be true and overwrite the caller's logits.
    """
    return check_value(name, value, bool)


def check_ignore_index(value: object) -> int:
    """An int (Python or NumPy), not a bool (``True`` would drop every token with id 1), None or float."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"ignore_index must be an int (e.g. -100), got {type(value).__name__} {value!r}")
    return int(value)


def check_chunk_size(value: object) -> Optional[int]:
    """None (chosen from the shapes and the device) or a positive int."""
    return None if value is None else check_positive_int("chunk_size", value)


def _extent(t: torch.Tensor) -> Tuple[int, int]:
    """[first, last] byte addresses a non-empty tensor's elements span in its storage."""
    lo = hi = t.data_ptr()
    for size, stride in zip(t.shape, t.stride()):
        reach = (size - 1) * stride * t.element_size()
        lo, hi = (lo + reach, hi) if reach < 0 else (lo, hi + reach)
    return lo, hi + t.element_size() - 1


def has_internal_overlap(t: torch.Tensor) -> bool:
    """Whether two indices of ``t`` may address one memory location (``expand``, stride 0, or strides
    that make rows interleave), from the sizes and strides alone.

    Sorted by stride, each dimension's stride must exceed the span of all the smaller ones:
    ``stride[i] > sum_{j < i} (size[j] - 1) * stride[j]``. This is sufficient for no overlap; a few
    exotic non-overlapping layouts fail it and are refused too (copy them with ``.contiguous()``).
    """
    dims = sorted((abs(st), sz) for sz, st in zip(t.shape, t.stride()) if sz > 1)
    span = 0
    for stride, size in dims:
        if stride <= span:
            return True
        span += (size - 1) * stride
    return False


def check_writable(name: str, value: torch.Tensor, others: Sequence[Tuple[str, Optional[torch.Tensor]]] = ()) -> None:
    """``value`` is about to be written in place (``inplace_backward``): refuse a tensor whose
    elements alias each other, or that shares memory with another argument ``others`` reads."""
    if value.numel() == 0:
        return
    if has_internal_overlap(value):
        raise ValueError(
            f"{name} with shape {_shape(value)} and strides {list(value.stride())} has elements that share memory "
            f"(an expand()ed or overlapping view): the in-place gradient would overwrite itself. Pass "
            f"{name}.contiguous(), or inplace_backward=False"
        )
    if torch.compiler.is_compiling():
        # no addresses while tracing; nor a need: AOTAutograd functionalizes the in-place write (an
        # out-of-place result copied back at the end), so no other argument can read it midway
        return
    lo, hi = _extent(value)
    storage = value.untyped_storage().data_ptr()
    for other_name, other in others:
        if other is None or other.numel() == 0 or other.untyped_storage().data_ptr() != storage:
            continue
        other_lo, other_hi = _extent(other)
        if other_lo <= hi and lo <= other_hi:
            raise ValueError(
                f"{name} shares memory with {other_name}: the in-place gradient would overwrite {other_name}. "
                f"Pass a copy of one of them, or inplace_backward=False"
            )


def check_choice(name: str, value: object, choices: Sequence[str]) -> str:
    return check_value(name, value, str, choices=choices)


FLOAT32_MAX = torch.finfo(torch.float32).max


def check_transform_factors(temperature: float, softcap: Optional[float], logit_scale: float) -> None:
    """The kernels' float32 factors of the logit transform (``logit_scale / temperature``, or
    ``logit_scale / softcap`` and ``1 / temperature`` with a cap) must be finite: an infinite
    factor times a zero gap (the row's max) would be NaN."""
    if not 1.0 / temperature < FLOAT32_MAX / 4:
        raise OptionError(f"temperature must be > {4 / FLOAT32_MAX:.3g} (1 / temperature must be finite in float32), "
                          f"got {temperature}", "temperature")
    what, value, names = (("logit_scale / temperature", logit_scale / temperature, ("logit_scale", "temperature"))
                          if softcap is None else ("logit_scale / softcap", logit_scale / softcap, ("logit_scale", "softcap")))
    if not value < FLOAT32_MAX / 4:
        raise OptionError(f"{what} must be < {FLOAT32_MAX / 4:.3g} (a finite float32 factor), got {value:.3g}", *names)


def check_logits(logits: object, name: str = "logits") -> torch.Tensor:
    """logits [..., V]: float16/bfloat16/float32 with a contiguous last dimension."""
    logits = check_tensor(name, logits)
    if logits.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be float16, bfloat16 or float32, got {logits.dtype} with shape {_shape(logits)}"
        )
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"{name} must have shape [..., V] with V >= 1, got {_shape(logits)}")
    return logits


def check_token_ids(ids: object, expected_shape: torch.Size, name: str, logits_name: str = "logits") -> torch.Tensor:
    """ids [...] int32/int64 with the leading shape of the logits."""
    ids = check_tensor(name, ids)
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64 token ids, got {ids.dtype}")
    if ids.shape != expected_shape:
        raise ValueError(
            f"{name} must have shape {list(expected_shape)} (the leading dimensions of {logits_name}), "
            f"got {_shape(ids)}"
        )
    return ids


def check_ids_in_range(ids: torch.Tensor, vocab_size: int, ignore_index: int, name: str) -> None:
    """Out-of-range ids would read outside a row in a kernel: refuse them here.

    This costs one device synchronisation; it is skipped while torch.compile traces.
    """
    if ids.numel() == 0 or torch.compiler.is_compiling():
        return
    valid = ids != ignore_index
    bad = valid & ((ids < 0) | (ids >= vocab_size))
    if bool(bad.any()):
        first = ids[bad][0].item()
        raise ValueError(
            f"{name} holds id {first} outside [0, {vocab_size}) (the vocabulary of the logits); "
            f"use ignore_index={ignore_index} for positions without a target"
        )


def check_per_token(name: str, value: Optional[object], b: int, t: int, allow_column: bool = False) -> Optional[torch.Tensor]:
    """A per-token float tensor [B, T] (or [B, 1] when allow_column)."""
    if value is None:
        return None
    value = check_tensor(name, value)
    if not value.is_floating_point():
        raise TypeError(f"{name} must be a float tensor, got {value.dtype}")
    ok = value.shape == (b, t) or (allow_column and value.shape == (b, 1))
    if not ok:
        expected = f"[{b}, {t}]" + (f" or [{b}, 1]" if allow_column else "")
        raise ValueError(f"{name} must have shape {expected}, got {_shape(value)}")
    return value


def check_mask(completion_mask: object, completion_ids: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """completion_mask [B, T] (the shape of completion_ids): bool, int or float per-token weights,
    finite and >= 0 where the id is not ``ignore_index`` (0 = the position is never read; another
    value is the token's weight in the loss, as a mask multiplies each token's loss in TRL).

    A NaN or an infinity would reach the loss and every gradient: refused here (one device sync,
    skipped while torch.compile traces). Where the id is ``ignore_index`` the mask is never read.
    """
    mask = check_tensor("completion_mask", completion_mask)
    if mask.shape != completion_ids.shape:
        raise ValueError(f"completion_mask must have shape {_shape(completion_ids)}, got {_shape(mask)}")
    if mask.is_complex():
        raise TypeError(f"completion_mask must be bool, int or float, got {mask.dtype}")
    if mask.dtype == torch.bool or mask.numel() == 0 or torch.compiler.is_compiling():
        return mask
    bad = mask < 0
    if mask.is_floating_point():
        bad = bad | ~torch.isfinite(mask)
    bad = bad & (completion_ids != ignore_index)
    if bool(bad.any()):
        raise ValueError(f"completion_mask must be finite and >= 0 (a per-token weight; 0 = not read), "
                         f"got {mask[bad][0].item()}")
    return mask


def check_count(name: str, value: Any, bounds: Bounds) -> None:
    """A per-call count (``num_items_in_batch``, ``global_batch_size``): None, a real number within
    ``bounds`` (the field's declared range: > 0, finite), or a 1-element numeric tensor holding one
    (read with one device sync, skipped while torch.compile traces)."""
    if value is None:
        return
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise OptionError(f"{name} must be a number or a 1-element tensor, got shape {_shape(value)} {value.dtype}", name)
        if torch.compiler.is_compiling():
            return
        value = value.item()
    check_value(name, value, float, bounds=bounds)


def check_grpo_inputs(leading_shape: Sequence[int], completion_ids: object, advantages: object,
                      completion_mask: Optional[object], inputs: Any, options: Any, name: str = "logits") -> None:
    """The tensors of a GRPO call against the [B, T, V] logits (or [B, T, H] hidden states)."""
    if len(leading_shape) != 3:
        raise ValueError(f"{name} must have shape [B, T, {'H' if name == 'hidden' else 'V'}], got {list(leading_shape)}")
    b, t = leading_shape[0], leading_shape[1]
    check_token_ids(completion_ids, torch.Size((b, t)), "completion_ids", name)
    advantages = check_tensor("advantages", advantages)
    if not advantages.is_floating_point():
        raise TypeError(f"advantages must be a float tensor, got {advantages.dtype}")
    if advantages.shape not in ((b,), (b, t)):
        raise ValueError(f"advantages must have shape [{b}] (per sequence) or [{b}, {t}] (per token), got {_shape(advantages)}")
    if completion_mask is not None:
        check_mask(completion_mask, completion_ids)
    check_per_token("old_logps", inputs.old_logps, b, t)
    check_per_token("ref_logps", inputs.ref_logps, b, t)
    check_per_token("is_ratio", inputs.is_ratio, b, t, allow_column=True)
    for count in ("num_items_in_batch", "global_batch_size"):
        check_count(count, getattr(inputs, count), type(inputs).__dataclass_fields__[count].metadata["bounds"])
    if inputs.segment_ids is not None:
        segment_ids = check_tensor("segment_ids", inputs.segment_ids)
        if segment_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"segment_ids must be an int32 or int64 tensor, got {segment_ids.dtype}")
        if segment_ids.shape != (b, t):
            raise ValueError(f"segment_ids must have shape [{b}, {t}], got {_shape(segment_ids)}")
        if advantages.shape != (b, t):
            raise ValueError(f"advantages must be per token [{b}, {t}] with segment_ids (one row holds several sequences), got {_shape(advantages)}")
        if inputs.is_ratio is not None and inputs.is_ratio.shape != (b, t):
            raise ValueError(f"is_ratio must be per token [{b}, {t}] with segment_ids, got {_shape(inputs.is_ratio)}")
    if options.beta != 0 and inputs.ref_logps is None:
        raise OptionError(f"beta={options.beta} needs ref_logps [{b}, {t}] (the reference model's log-probs)", "beta")


def check_linear(hidden: object, weight: object, bias: Optional[object]) -> None:
    """hidden [..., H], weight [V, H] (lm_head.weight), bias [V] or None; float dtypes."""
    hidden = check_logits(hidden, "hidden")
    weight = check_logits(weight, "weight")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must have shape [V, {hidden.shape[-1]}] (lm_head.weight), got {list(weight.shape)}")
    if bias is not None:
        bias = check_logits(bias, "bias")
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must have shape [{weight.shape[0]}], got {list(bias.shape)}")
