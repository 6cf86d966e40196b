"""nn.Module wrappers that hold a GRPO loss configuration."""

from __future__ import annotations

from typing import Any, Optional

import torch

from . import functional
from .reference import GRPOLossOutput


class GRPOLoss(torch.nn.Module):
    """``GRPOLoss(**config)(logits, completion_ids, advantages, completion_mask=None, **per_call)``.

    ``config`` takes any keyword of :func:`grpo_kernels.grpo_loss`; keywords given per call
    (e.g. ``old_logps``, ``ref_logps``, ``num_items_in_batch``) override it.
    """

    def __init__(self, **config: Any) -> None:
        super().__init__()
        self.config = config

    def forward(self, logits: torch.Tensor, completion_ids: torch.Tensor, advantages: torch.Tensor,
                completion_mask: Optional[torch.Tensor] = None, **per_call: Any) -> GRPOLossOutput:
        return functional.grpo_loss(logits, completion_ids, advantages, completion_mask, **{**self.config, **per_call})

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.config.items())


class FusedLinearGRPOLoss(torch.nn.Module):
    """``FusedLinearGRPOLoss(**config)(hidden, weight, completion_ids, advantages, completion_mask=None, bias=None, **per_call)``."""

    def __init__(self, **config: Any) -> None:
        super().__init__()
        self.config = config

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, completion_ids: torch.Tensor,
                advantages: torch.Tensor, completion_mask: Optional[torch.Tensor] = None,
                bias: Optional[torch.Tensor] = None, **per_call: Any) -> GRPOLossOutput:
        return functional.fused_linear_grpo_loss(
            hidden, weight, completion_ids, advantages, completion_mask, bias=bias, **{**self.config, **per_call}
        )

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.config.items())
