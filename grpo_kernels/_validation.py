"""Argument checks shared by every backend.

Every public function validates its inputs here, once, before any backend runs, so that bad input
fails with a message naming the argument instead of a silent wrong answer or a crash in a kernel.
Scalar hyper-parameters are checked when ``options.GRPOOptions`` is built; tensors against the
batch shape by :func:`check_grpo_inputs`.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Sequence

import torch

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
    if isinstance(value, (bool, torch.Tensor)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and (value >= high if high_open else value > high):
        raise ValueError(f"{name} must be {'<' if high_open else '<='} {high}, got {value}")
    return value


def check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def check_choice(name: str, value: object, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


def check_temperature(temperature: object) -> float:
    temperature = check_number("temperature", temperature)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return temperature


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


def check_num_items_in_batch(value: Any) -> None:
    """None, a positive finite real number, or a 0-d/1-element numeric tensor holding one."""
    if value is None:
        return
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"num_items_in_batch must be a number or a 1-element tensor, got shape {_shape(value)} {value.dtype}")
        if torch.compiler.is_compiling():
            return
        value = value.item()
    n = check_number("num_items_in_batch", value)
    if not n > 0:
        raise ValueError(f"num_items_in_batch must be > 0, got {n}")


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
        completion_mask = check_tensor("completion_mask", completion_mask)
        if completion_mask.shape != (b, t):
            raise ValueError(f"completion_mask must have shape [{b}, {t}], got {_shape(completion_mask)}")
    check_per_token("old_logps", inputs.old_logps, b, t)
    check_per_token("ref_logps", inputs.ref_logps, b, t)
    check_per_token("is_ratio", inputs.is_ratio, b, t, allow_column=True)
    check_num_items_in_batch(inputs.num_items_in_batch)
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
        raise ValueError(f"beta={options.beta} needs ref_logps [{b}, {t}] (the reference model's log-probs)")


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
