"""The contract shared by the fused fp32-master-weight AdamW steps (``cpu_adamw``: the CPU's, ``triton_adamw``:
CUDA's): which tensors a step takes, checked once here for both.

One step of tensor i: ``masters[i]``, ``exp_avgs[i]``, ``exp_avg_sqs[i]`` (and with ``amsgrad``
``max_exp_avg_sqs[i]``) are fp32 and updated in place; ``grads[i]`` (read only) and ``weights[i]`` (written:
the master rounded to nearest even) are 16-bit (:data:`DTYPES`), of one dtype; all contiguous, on one
device, of ``masters[i].numel()`` elements. ``steps[i]``: the parameter's step counter (a one-element
float32 tensor, torch's fused AdamW's), already incremented, as ``torch.optim.adam._fused_adam`` increments
it before its kernel.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

DTYPES = (torch.bfloat16, torch.float16)
"""The 16-bit weight dtypes the fused steps read and write."""


def check_args(masters: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
               max_exp_avg_sqs: Optional[Sequence[torch.Tensor]], grads: Sequence[torch.Tensor],
               weights: Sequence[torch.Tensor], steps: Sequence[torch.Tensor], amsgrad: bool, device_type: str) -> None:
    """``ValueError`` / ``TypeError`` naming the argument when the tensors break the module's contract
    (checked before anything is written)."""
    count = len(masters)
    if amsgrad and max_exp_avg_sqs is None:
        raise ValueError("amsgrad=True needs max_exp_avg_sqs")
    named = {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "grads": grads, "weights": weights, "steps": steps}
    if amsgrad:
        named["max_exp_avg_sqs"] = max_exp_avg_sqs
    for name, tensors in named.items():
        if len(tensors) != count:
            raise ValueError(f"{name} has {len(tensors)} tensors for {count} masters")
    for i in range(count):
        fp32 = {"masters": masters[i], "exp_avgs": exp_avgs[i], "exp_avg_sqs": exp_avg_sqs[i]}
        if amsgrad:
            fp32["max_exp_avg_sqs"] = max_exp_avg_sqs[i]
        for name, t in fp32.items():
            if t.dtype != torch.float32:
                raise TypeError(f"{name}[{i}] must be float32, got {t.dtype}")
        if grads[i].dtype not in DTYPES or weights[i].dtype != grads[i].dtype:
            raise TypeError(f"grads[{i}] and weights[{i}] must share a dtype of {DTYPES}, got {grads[i].dtype} and "
                            f"{weights[i].dtype}")
        n = masters[i].numel()
        for name, t in {**fp32, "grads": grads[i], "weights": weights[i]}.items():
            if t.device.type != device_type or not t.is_contiguous() or t.numel() != n:
                raise ValueError(f"{name}[{i}] must be a contiguous {device_type} tensor of {n} elements "
                                 f"(got {t.device}, shape {tuple(t.shape)}, contiguous={t.is_contiguous()})")
