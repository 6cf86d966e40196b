"""Viewing any ``[..., V]`` logits tensor as ``[B, T, V]`` rows without copying when possible."""

from __future__ import annotations

import torch


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """A [B, T, V] view of ``x [..., V]`` whose last dimension is contiguous.

    Strided views such as ``model_logits[:, P-1:-1, :]`` keep their strides (no copy). Only a tensor
    whose last dimension is not contiguous, or whose leading dimensions cannot be merged into two, is
    copied.
    """
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        x = x.contiguous()
    if x.dim() == 1:
        return x.view(1, 1, -1)
    if x.dim() == 2:
        return x.unsqueeze(0)
    if x.dim() == 3:
        return x
    try:
        return x.view(-1, x.shape[-2], x.shape[-1])
    except RuntimeError:
        return x.reshape(-1, x.shape[-2], x.shape[-1])

