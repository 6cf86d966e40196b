"""Group-relative advantages: each completion's reward against the other completions of its prompt.

Rewards arrive flat, ``[P*G]``, prompt-major: completions ``g*G .. g*G+G-1`` answer prompt ``g``.
A NaN reward marks a completion that no reward function could score (every function returned
``None`` for it): it gets advantage 0 and is left out of its group's mean and std, and of the batch
std, so it neither pushes the policy nor shifts the baseline of its siblings.
"""

from __future__ import annotations

import torch

STD_KINDS = ("population", "unbiased")
SCALES = ("group", "batch", "none")


def _masked_std(x: torch.Tensor, valid: torch.Tensor, mean: torch.Tensor, dim: int, unbiased: bool) -> torch.Tensor:
    """Std of the valid entries of ``x`` along ``dim`` (0 where fewer than 2 valid, or 1 for population)."""
    count = valid.sum(dim, keepdim=True).to(x.dtype)
    squares = torch.where(valid, (x - mean) ** 2, torch.zeros_like(x)).sum(dim, keepdim=True)
    denominator = (count - 1) if unbiased else count
    return torch.where(denominator > 0, squares / denominator.clamp(min=1), torch.zeros_like(squares)).sqrt()


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    std: str = "population",
    eps: float = 1e-6,
    scale: str = "group",
) -> torch.Tensor:
    """``(r - mean_group(r)) / (std + eps)`` for every completion; float32 ``[P*G]``.

    rewards [P*G] float, prompt-major (see the module docstring); NaN = unscorable (advantage 0,
    excluded from every statistic). ``std``: ``"population"`` divides the variance by the group size
    G, as the GRPO papers write it; ``"unbiased"`` by G-1, as TRL's ``torch.std`` does. ``scale``:
    ``"group"`` divides by the group's std, ``"batch"`` by the std of all valid rewards in the batch
    (around the batch mean), ``"none"`` does not divide at all (Dr. GRPO).

    >>> group_advantages(torch.tensor([1.5, 0.5, 1.0, 1.5]), 4)
    tensor([ 0.9045, -1.5075, -0.3015,  0.9045])
    """
    if std not in STD_KINDS:
        raise ValueError(f"std must be one of {STD_KINDS}, got {std!r}")
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    rewards = torch.as_tensor(rewards)
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards must have shape [P*G] with G={group_size}, got {list(rewards.shape)}")
    flat = rewards.float()
    r = flat.view(-1, group_size)  # [P, G]
    valid = ~torch.isnan(r)
    zeros = torch.zeros_like(r)
    count = valid.sum(-1, keepdim=True).clamp(min=1).float()
    mean = torch.where(valid, r, zeros).sum(-1, keepdim=True) / count  # [P, 1]
    centered = torch.where(valid, r - mean, zeros)
    unbiased = std == "unbiased"
    if scale == "group":
        centered = centered / (_masked_std(r, valid, mean, -1, unbiased) + eps)
    elif scale == "batch":
        all_valid = valid.view(-1)
        batch_mean = torch.where(all_valid, flat, torch.zeros_like(flat)).sum() / all_valid.sum().clamp(min=1)
        batch_std = _masked_std(flat, all_valid, batch_mean, 0, unbiased)
        centered = centered / (batch_std + eps)
    return centered.reshape(-1)


def zero_signal_groups(rewards: torch.Tensor, group_size: int, atol: float = 1e-6) -> torch.Tensor:
    """Bool ``[P]``: groups whose valid rewards are all equal (or that have fewer than 2 valid ones).

    Their advantages are all 0, so they add no policy gradient, only tokens to the normaliser
    (and KL / entropy terms); the trainer counts them and can drop them from the update.
    """
    r = torch.as_tensor(rewards).float().view(-1, group_size)
    valid = ~torch.isnan(r)
    high = torch.where(valid, r, torch.full_like(r, -float("inf"))).amax(-1)
    low = torch.where(valid, r, torch.full_like(r, float("inf"))).amin(-1)
    return (valid.sum(-1) < 2) | ((high - low) <= atol)
