"""Group-relative advantages: each completion's reward against the other completions of its prompt.

Rewards arrive flat, ``[P*G]``, prompt-major: completions ``g*G .. g*G+G-1`` answer prompt ``g``.
A NaN reward marks a completion that no reward function could score (every function returned
``None`` for it): it gets advantage 0 and is left out of its group's mean and std, and of the batch
std, so it neither pushes the policy nor shifts the baseline of its siblings.

Any finite reward is accepted, however large (a reward function returning 1e39 or 1e300 must not
make an advantage NaN): the statistics are computed in float64 on rewards divided by the largest
magnitude among them, so nothing overflows, and scaled back at the end. The result is float32; with
``scale="group"`` or ``"batch"`` it is always finite, with ``"none"`` it is ``r - mean``, which is
+-inf where that exceeds float32's range (the trainer then skips the update, see ``grpo.trainer``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

STD_KINDS = ("population", "unbiased")
SCALES = ("group", "batch", "none")


def _masked_std(x: torch.Tensor, valid: torch.Tensor, mean: torch.Tensor, dim: int, unbiased: bool) -> torch.Tensor:
    """Std of the valid entries of ``x`` along ``dim`` (0 where fewer than 2 valid, or 1 for population)."""
    count = valid.sum(dim, keepdim=True).to(x.dtype)
    squares = torch.where(valid, (x - mean) ** 2, torch.zeros_like(x)).sum(dim, keepdim=True)
    denominator = (count - 1) if unbiased else count
    return torch.where(denominator > 0, squares / denominator.clamp(min=1), torch.zeros_like(squares)).sqrt()


def _masked_mean(x: torch.Tensor, valid: torch.Tensor, dim: int) -> torch.Tensor:
    count = valid.sum(dim, keepdim=True).clamp(min=1).to(x.dtype)
    return torch.where(valid, x, torch.zeros_like(x)).sum(dim, keepdim=True) / count


def _magnitude(x: torch.Tensor, valid: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """The largest |x| among the valid entries (along ``dim``, kept), or 1 where it is 0 or there are none."""
    size = torch.where(valid, x.abs(), torch.zeros_like(x))
    size = size.amax(dim, keepdim=True) if dim is not None else size.amax()
    return torch.where(size > 0, size, torch.ones_like(size))


def _divide(centered: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    """centered / divisor, and 0 where the divisor is 0 (a group of equal rewards with eps=0: centered is 0 there)."""
    return torch.where(divisor > 0, centered / torch.where(divisor > 0, divisor, torch.ones_like(divisor)), torch.zeros_like(centered))


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    std: str = "population",
    eps: float = 1e-6,
    scale: str = "group",
) -> torch.Tensor:
    """``(r - mean_group(r)) / (std + eps)`` for every completion; float32 ``[P*G]``.

    rewards [P*G] float (any float dtype; lists too), prompt-major (see the module docstring); NaN =
    unscorable (advantage 0, excluded from every statistic); +-inf is refused. ``std``:
    ``"population"`` divides the variance by the group size G, as the GRPO papers write it;
    ``"unbiased"`` by G-1, as TRL's ``torch.std`` does. ``scale``: ``"group"`` divides by the group's
    std, ``"batch"`` by the std of all valid rewards in the batch (around the batch mean), ``"none"``
    does not divide at all (Dr. GRPO).

    >>> group_advantages(torch.tensor([1.5, 0.5, 1.0, 1.5]), 4)
    tensor([ 0.9045, -1.5076, -0.3015,  0.9045])
    """
    if std not in STD_KINDS:
        raise ValueError(f"std must be one of {STD_KINDS}, got {std!r}")
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    rewards = torch.as_tensor(rewards)
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards must have shape [P*G] with G={group_size}, got {list(rewards.shape)}")
    if not (rewards.is_floating_point() or rewards.dtype in (torch.int32, torch.int64, torch.bool)):
        raise TypeError(f"rewards must be a float tensor, got {rewards.dtype}")
    flat = rewards.detach().to(torch.float64)
    infinite = torch.isinf(flat)
    if bool(infinite.any()):
        i = int(torch.nonzero(infinite)[0])
        raise ValueError(f"rewards[{i}] is {flat[i].item()}: a reward must be finite, or NaN for unscorable")
    eps = float(eps)
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    r = flat.view(-1, group_size)  # [P, G]
    valid = ~torch.isnan(r)
    unbiased = std == "unbiased"
    # every statistic on rewards / (their largest magnitude), in [-1, 1]: nothing can overflow
    size = _magnitude(r, valid, -1)  # [P, 1]
    unit = r / size
    centered = torch.where(valid, unit - _masked_mean(unit, valid, -1), torch.zeros_like(unit))  # (r - mean) / size
    if scale == "group":  # (r - mean) / (std + eps) = centered / (std / size + eps / size)
        divisor = _masked_std(unit, valid, _masked_mean(unit, valid, -1), -1, unbiased) + eps / size
        advantages = _divide(centered, divisor)
    elif scale == "batch":  # the same with the batch's std, on rewards / (the batch's largest magnitude)
        all_valid = valid.view(-1)
        batch_size = _magnitude(flat, all_valid)
        batch_unit = flat / batch_size
        divisor = _masked_std(batch_unit, all_valid, _masked_mean(batch_unit, all_valid, 0), 0, unbiased) + eps / batch_size
        advantages = _divide(centered * (size / batch_size), divisor)
    else:
        advantages = centered * size
    return advantages.reshape(-1).float()


def zero_signal_groups(rewards: torch.Tensor, group_size: int, atol: float = 1e-6) -> torch.Tensor:
    """Bool ``[P]``: groups whose valid rewards are all equal (or that have fewer than 2 valid ones).

    Their advantages are all 0, so they add no policy gradient, only tokens to the normaliser
    (and KL / entropy terms); the trainer counts them and can drop them from the update.
    """
    r = torch.as_tensor(rewards).to(torch.float64).view(-1, group_size)
    valid = ~torch.isnan(r)
    high = torch.where(valid, r, torch.full_like(r, -float("inf"))).amax(-1)
    low = torch.where(valid, r, torch.full_like(r, float("inf"))).amin(-1)
    return (valid.sum(-1) < 2) | ((high - low) <= atol)
