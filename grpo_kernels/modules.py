"""nn.Module wrappers that hold a GRPO loss configuration (validated when the module is built)."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from . import _validation as V
from . import functional
from .objective import GRPOLossOutput
from .options import BACKENDS, split_grpo_keywords


class _GRPOLossModule(torch.nn.Module):
    """Holds ``config``: GRPO keywords plus ``backend`` (and ``chunk_size`` / ``inplace_backward``
    where the function takes them). Per-call keywords override it."""

    _extra_keywords: tuple = ()
    _function_name: str = ""

    def __init__(self, **config: Any) -> None:
        super().__init__()
        own = {k: config.pop(k) for k in ("backend",) + self._extra_keywords if k in config}
        V.check_choice("backend", own.get("backend", "auto"), BACKENDS)
        for name in ("inplace_backward", "accumulate_in_weight_dtype", "fp32_logits"):
            if name in own:
                own[name] = V.check_flag(name, own[name])
        if "chunk_size" in own:
            own["chunk_size"] = V.check_chunk_size(own["chunk_size"])
        split_grpo_keywords(config, self._function_name)  # raises now, not at the first forward
        self.config: Dict[str, Any] = {**own, **config}

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.config.items())


class GRPOLoss(_GRPOLossModule):
    """``GRPOLoss(**config)(logits, completion_ids, advantages, completion_mask=None, **per_call)``.

    ``config`` takes any keyword of :func:`grpo_kernels.grpo_loss`; keywords given per call
    (e.g. ``old_logps``, ``ref_logps``, ``num_items_in_batch``) override it.
    """

    _extra_keywords = ("inplace_backward", "process_group", "reduce_hidden_grad")
    _function_name = "grpo_loss"

    def forward(self, logits: torch.Tensor, completion_ids: torch.Tensor, advantages: torch.Tensor,
                completion_mask: Optional[torch.Tensor] = None, **per_call: Any) -> GRPOLossOutput:
        return functional.grpo_loss(logits, completion_ids, advantages, completion_mask, **{**self.config, **per_call})


class FusedLinearGRPOLoss(_GRPOLossModule):
    """``FusedLinearGRPOLoss(**config)(hidden, weight, completion_ids, advantages, completion_mask=None, bias=None, **per_call)``."""

    _extra_keywords = ("chunk_size", "accumulate_in_weight_dtype", "fp32_logits", "process_group", "reduce_hidden_grad")
    _function_name = "fused_linear_grpo_loss"

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, completion_ids: torch.Tensor,
                advantages: torch.Tensor, completion_mask: Optional[torch.Tensor] = None,
                bias: Optional[torch.Tensor] = None, **per_call: Any) -> GRPOLossOutput:
        return functional.fused_linear_grpo_loss(
            hidden, weight, completion_ids, advantages, completion_mask, bias=bias, **{**self.config, **per_call}
        )
