"""Argument checks shared by every backend.

Every public function validates its inputs here, once, before any backend runs, so that bad input
fails with a message naming the argument instead of a silent wrong answer or a crash in a kernel.
"""

from __future__ import annotations

from typing import Optional

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
BACKENDS = ("auto", "triton", "torch", "reference")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def check_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


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


def check_temperature(temperature: object) -> float:
    if isinstance(temperature, torch.Tensor) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a Python number, got {type(temperature).__name__}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return float(temperature)


def check_backend(backend: object) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend  # type: ignore[return-value]


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


def check_grpo_args(
    b: int,
    t: int,
    advantages: object,
    completion_mask: Optional[object],
    old_logps: Optional[object],
    ref_logps: Optional[object],
    beta: float,
    eps_low: float,
    eps_high: Optional[float],
    delta: Optional[float],
    loss_type: str,
    max_completion_length: Optional[int],
    num_items_in_batch: Optional[object],
    importance_sampling_level: str,
    is_ratio: Optional[object],
    entropy_coef: float,
) -> float:
    """Validate every GRPO option for a [B, T] batch; returns the effective eps_high."""
    advantages = check_tensor("advantages", advantages)
    if not advantages.is_floating_point():
        raise TypeError(f"advantages must be a float tensor, got {advantages.dtype}")
    if advantages.shape not in ((b,), (b, t)):
        raise ValueError(f"advantages must have shape [{b}] (per sequence) or [{b}, {t}] (per token), got {_shape(advantages)}")
    if completion_mask is not None:
        completion_mask = check_tensor("completion_mask", completion_mask)
        if completion_mask.shape != (b, t):
            raise ValueError(f"completion_mask must have shape [{b}, {t}], got {_shape(completion_mask)}")
    check_per_token("old_logps", old_logps, b, t)
    check_per_token("ref_logps", ref_logps, b, t)
    check_per_token("is_ratio", is_ratio, b, t, allow_column=True)
    for name, value in (("beta", beta), ("eps_low", eps_low), ("entropy_coef", entropy_coef)):
        if isinstance(value, torch.Tensor) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a Python number, got {type(value).__name__}")
    if beta != 0 and ref_logps is None:
        raise ValueError(f"beta={beta} needs ref_logps [{b}, {t}] (the reference model's log-probs)")
    if not 0 <= eps_low < 1:
        raise ValueError(f"eps_low must be in [0, 1), got {eps_low}")
    eps_high = eps_low if eps_high is None else eps_high
    if isinstance(eps_high, torch.Tensor) or not isinstance(eps_high, (int, float)) or eps_high < 0:
        raise ValueError(f"eps_high must be a number >= 0 or None, got {eps_high!r}")
    if delta is not None and not delta > 1 + eps_high:
        raise ValueError(f"delta must be > 1 + eps_high = {1 + eps_high}, got {delta}")
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, got {importance_sampling_level!r}"
        )
    if max_completion_length is not None and (not isinstance(max_completion_length, int) or max_completion_length < 1):
        raise ValueError(f"max_completion_length must be a positive int or None, got {max_completion_length!r}")
    if num_items_in_batch is not None:
        n = num_items_in_batch.item() if isinstance(num_items_in_batch, torch.Tensor) and not torch.compiler.is_compiling() else num_items_in_batch
        if isinstance(n, (int, float)) and not n > 0:
            raise ValueError(f"num_items_in_batch must be > 0, got {n}")
    return float(eps_high)
