"""The dtype the policy's weights are held in (``GRPOConfig.model_dtype``), and AdamW on 16-bit weights.

``model_dtype="bfloat16"`` holds the weights in bf16 (2 bytes a parameter instead of 4); the loss's
statistics (row max, log-sum, entropy, the objective) stay fp32 inside ``grpo_kernels``. What the
optimizer steps:

- LoRA (``use_peft``): the adapters are fp32 (peft casts 16-bit adapter weights up when it adds them),
  the frozen base is bf16, and plain AdamW steps the adapters. No master copy is needed.
- full fine-tuning: AdamW straight on bf16 weights loses the update. bf16 keeps 8 significant bits, so
  an update smaller than 2^-9 of a weight rounds away entirely: at the learning rates GRPO uses
  (1e-6 .. 1e-5, each AdamW step moves a weight by about ``lr``) nearly every update of a weight
  of size ~0.01 or more is lost (``tests/test_lora.py`` shows it). So :class:`MasterWeightAdamW` keeps
  fp32 master copies of the 16-bit trainable parameters (4 bytes each, on top of AdamW's 8), steps
  them with torch's AdamW and rounds the result into the bf16 weights once per step.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Iterable, Optional

import torch

MODEL_DTYPES = ("float32", "bfloat16")
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def autocast(device: torch.device, bf16: bool):
    """bf16 autocast on CUDA when asked for (``GRPOConfig.bf16``); fp32 otherwise. The trainer's forward
    passes and Hugging Face generation use it."""
    if device.type == "cuda" and bf16:
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


def torch_dtype(name: str) -> torch.dtype:
    """``torch.float32`` / ``torch.bfloat16`` for a ``model_dtype`` name."""
    if name not in _TORCH_DTYPES:
        raise ValueError(f"model_dtype must be one of {MODEL_DTYPES}, got {name!r}")
    return _TORCH_DTYPES[name]


def check_device_supports(name: str, device: torch.device) -> None:
    """``ValueError`` naming ``model_dtype`` when ``device`` cannot compute in that dtype (bf16 on a
    GPU before Ampere). A CPU computes bf16 (slowly without AVX512-BF16/AMX)."""
    if name == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise ValueError(
            f"model_dtype='bfloat16' (--model-dtype bfloat16): the GPU {device} has no bf16 support (before "
            "Ampere); use --model-dtype float32"
        )


def cast_model(model: torch.nn.Module, name: str) -> torch.nn.Module:
    """``model`` with its floating-point weights and buffers in ``model_dtype`` (in place; no copy when
    they already are)."""
    dtype = torch_dtype(name)
    if any(p.dtype != dtype for p in model.parameters() if p.is_floating_point()):
        model.to(dtype)
    return model


class MasterWeightAdamW(torch.optim.AdamW):
    """torch's AdamW (Loshchilov & Hutter, decoupled weight decay) on fp32 master copies of the 16-bit
    parameters it is given; fp32 parameters are stepped as they are.

    ``step`` copies each 16-bit gradient into its master's fp32 gradient, runs AdamW on the masters and
    rounds them into the parameters. ``param_groups`` (the learning rate) are the inner AdamW's;
    ``state_dict`` adds the masters (``"master_weights"``, in parameter order), so a resumed run
    continues from the same fp32 values rather than from the rounded weights.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], **kwargs) -> None:
        self.model_params = list(params)
        masters = [p if p.dtype == torch.float32 else p.detach().float().requires_grad_() for p in self.model_params]
        super().__init__(masters, **kwargs)
        self._pairs = [(p, m) for p, m in zip(self.model_params, masters) if m is not p]

    @torch.no_grad()
    def step(self, closure=None) -> Optional[float]:
        for p, master in self._pairs:
            master.grad = None if p.grad is None else p.grad.float()
        loss = super().step(closure)
        for p, master in self._pairs:
            p.copy_(master)  # rounded to the parameter's dtype, once per step
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p, _ in self._pairs:
            p.grad = None

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["master_weights"] = [master.detach().clone() for _, master in self._pairs]
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        masters = state_dict.pop("master_weights", None)
        super().load_state_dict(state_dict)
        if masters is None:  # written by a run without masters: start them from the weights
            masters = [p.detach().float() for p, _ in self._pairs]
        if len(masters) != len(self._pairs):
            raise ValueError(f"the checkpoint holds {len(masters)} master weights for {len(self._pairs)} 16-bit parameters")
        with torch.no_grad():
            for (_, master), saved in zip(self._pairs, masters):
                master.copy_(saved)
