"""grpo-kernels: fused GRPO log-probs and losses that never materialise the full softmax.

    token_logprobs(logits, targets)                      # log softmax(logits / T)[target], fp32
    grpo_loss(logits, completion_ids, advantages, mask)  # -> GRPOLossOutput(loss, per_token_logps, metrics)
    fused_linear_grpo_loss(hidden, lm_head.weight, ...)  # the [tokens, vocab] logits never exist
    rms_norm(x, weight, eps, gemma=False)                # a decoder's RMSNorm, fwd + bwd fused (grpo_kernels.norm)

``grpo_kernels.reference`` holds the plain-PyTorch spec with the same signatures; ``docs/api.md`` is the
user-facing API reference. Public API: the names below, and the ``__all__`` of the modules that
``docs/api.md`` lists under "Public modules" (``options``, ``bounds``, ``norm``, ``reference``,
``sizing``); everything else is internal (``tests/test_structure.py`` holds ``grpo`` to this).
"""

from .functional import fused_linear_grpo_loss, fused_linear_token_logprobs, grpo_loss, token_logprobs
from .modules import FusedLinearGRPOLoss, GRPOLoss
from .norm import RMSNorm, rms_norm
from .objective import GRPOLossOutput
from .options import GRPOInputs, GRPOOptions
from .sampling_mask import SamplingMask

__all__ = [
    "token_logprobs",
    "grpo_loss",
    "fused_linear_token_logprobs",
    "fused_linear_grpo_loss",
    "GRPOLoss",
    "FusedLinearGRPOLoss",
    "GRPOLossOutput",
    "GRPOOptions",
    "GRPOInputs",
    "SamplingMask",
    "rms_norm",
    "RMSNorm",
]
__version__ = "0.1.0"
