"""The dtype the policy's weights are held in (``GRPOConfig.model_dtype``), and the AdamW that steps them.

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

Either way the step is torch's fused AdamW kernel (``torch.optim.AdamW(fused=True)``: one pass over
each parameter, its gradient and both moments, instead of the foreach path's dozen passes) wherever
torch has one for the parameters' device and dtype (:func:`fused_supported`: CPU and CUDA, every
floating dtype), and the foreach path elsewhere. The state dict is torch's AdamW's either way (plus the
masters), so a checkpoint written by either path resumes on the other: :func:`adamw` keeps the
optimizer's own implementation when it loads one (:func:`keep_implementation`).
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


# The AdamW options that choose how torch computes a step, not what it computes: a checkpoint's values
# of these are the run that wrote it's, and loading it keeps the loading optimizer's own.
IMPLEMENTATION_OPTIONS = ("fused", "foreach")


def fused_supported(params: Iterable[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW kernel takes every one of ``params``: floating point, on a device type
    torch has fused optimizer kernels for (``torch.utils._foreach_utils``' list, the one
    ``torch.optim`` itself checks: CPU, CUDA, ...). False for no parameters."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    devices = set(_get_fused_kernels_supported_devices())
    params = list(params)
    return bool(params) and all(p.is_floating_point() and p.device.type in devices for p in params)


def keep_implementation(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """A ``load_state_dict`` pre-hook: ``state_dict`` with each group's :data:`IMPLEMENTATION_OPTIONS`
    set to ``optimizer``'s own (torch's ``load_state_dict`` would otherwise take the saved ones, so a
    checkpoint written by the foreach path would turn a fused optimizer back into a foreach one). Its
    tensors are untouched: torch then moves each ``step`` counter where the fused kernel reads it
    (a float32 tensor on the parameter's device, instead of the foreach path's CPU one)."""
    groups = state_dict["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        return state_dict  # (torch's own check names the mismatch)
    ours = [{k: g[k] for k in IMPLEMENTATION_OPTIONS if k in g} for g in optimizer.param_groups]
    return {**state_dict, "param_groups": [{**saved, **own} for saved, own in zip(groups, ours)]}


def adamw(params: Iterable[torch.nn.Parameter], **hyper) -> torch.optim.Optimizer:
    """AdamW over ``params`` (``hyper``: ``torch.optim.AdamW``'s ``lr``, ``betas``, ``weight_decay``, ...):
    :class:`MasterWeightAdamW` when any is 16-bit, else ``torch.optim.AdamW``; fused where
    :func:`fused_supported` (for the masters: the fp32 copies), foreach elsewhere. Loading a state dict
    keeps this choice (:func:`keep_implementation`)."""
    params = list(params)
    cls = MasterWeightAdamW if any(p.dtype != torch.float32 for p in params) else torch.optim.AdamW
    # (the masters are fp32 copies on the parameters' devices: the same devices decide)
    fused = fused_supported(params)
    optimizer = cls(params, fused=True, **hyper) if fused else cls(params, **hyper)
    optimizer.register_load_state_dict_pre_hook(keep_implementation)
    return optimizer


class MasterWeightAdamW(torch.optim.AdamW):
    """torch's AdamW (Loshchilov & Hutter, decoupled weight decay) on fp32 master copies of the 16-bit
    parameters it is given; fp32 parameters are stepped as they are.

    ``step`` copies each 16-bit gradient into an fp32 gradient for its master, runs AdamW on the masters
    (fused, when asked: ``fused=True``) and rounds them into the parameters. The fp32 gradients are
    views of one buffer the size of the largest 16-bit parameter, kept between steps: the masters are
    stepped in buckets that fit it (AdamW's update is elementwise, so the result is the one-call one,
    bit for bit). A buffer allocated afresh at every step costs more than the step itself on a CPU (every
    page of it faults in again; ``benchmarks/optimizer_step.py``, results in ``benchmarks/results/``);
    one for all the gradients at once would hold 4 bytes per parameter through the backward pass.
    Gradients that cannot be a view of a plain buffer (FSDP2's sharded ``DTensor``) are cast afresh.

    ``param_groups`` (the learning rate) are the inner AdamW's; ``state_dict`` is torch's AdamW's plus the
    masters (``"master_weights"``, in parameter order), so a resumed run continues from the same fp32
    values rather than from the rounded weights.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], **kwargs) -> None:
        self.model_params = list(params)
        masters = [p if p.dtype == torch.float32 else p.detach().float().requires_grad_() for p in self.model_params]
        super().__init__(masters, **kwargs)
        self._pairs = [(p, m) for p, m in zip(self.model_params, masters) if m is not p]
        self._own = [m for p, m in zip(self.model_params, masters) if m is p]  # fp32 parameters: stepped as they are
        self._largest: dict[torch.device, int] = {}  # per device: the buffer's size
        for p, _ in self._pairs:
            self._largest[p.device] = max(self._largest.get(p.device, 0), p.numel())
        self._buffers: dict[torch.device, torch.Tensor] = {}  # fp32 gradients of one bucket, per device (made at the first step)

    def _buckets(self) -> list[list[tuple[torch.Tensor, torch.Tensor, int]]]:
        """This step's (parameter, master, offset in its device's buffer) with a gradient, in order, cut
        into buckets whose plain gradients fit the buffers; a sharded gradient (offset -1) is cast apart."""
        buckets: list[list] = [[]]
        filled: dict[torch.device, int] = {}
        for p, master in self._pairs:
            if p.grad is None:
                continue
            if type(p.grad) is not torch.Tensor:
                buckets[-1].append((p, master, -1))
                continue
            if filled.get(p.device, 0) + p.numel() > self._largest[p.device]:
                buckets.append([])
                filled = {}
            offset = filled.get(p.device, 0)
            filled[p.device] = offset + p.numel()
            buckets[-1].append((p, master, offset))
        return buckets

    def _adamw_step(self) -> None:
        """torch's AdamW step without torch's optimizer hooks around it: they fire once, around this
        class's ``step`` (torch adds them to ``AdamW.step`` once any plain AdamW exists)."""
        step = torch.optim.AdamW.step
        step = step.__wrapped__ if getattr(step, "hooked", False) else step
        step(self)

    @torch.no_grad()
    def step(self, closure=None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        own_grads = [m.grad for m in self._own]
        for i, bucket in enumerate(self._buckets()):
            for _, master in self._pairs:
                master.grad = None
            for master, grad in zip(self._own, own_grads):  # the fp32 parameters step with the first bucket only
                master.grad = grad if i == 0 else None
            for p, master, offset in bucket:
                if offset < 0:
                    master.grad = p.grad.float()
                    continue
                if p.device not in self._buffers:
                    self._buffers[p.device] = torch.empty(self._largest[p.device], dtype=torch.float32, device=p.device)
                master.grad = self._buffers[p.device][offset : offset + p.numel()].view(p.shape).copy_(p.grad)
            self._adamw_step()
            for p, master, _ in bucket:
                p.copy_(master)  # rounded to the parameter's dtype, once per step
        for _, master in self._pairs:
            master.grad = None  # (views of the buffer, which the next bucket or step overwrites)
        for master, grad in zip(self._own, own_grads):
            master.grad = grad
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
