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

Either way the step is fused wherever torch has a fused AdamW kernel for the parameters' device and
dtype (:func:`fused_supported`: CPU and CUDA, every floating dtype), and the foreach path elsewhere:
fp32 weights take ``torch.optim.AdamW(fused=True)`` (one pass over each parameter, its gradient and both
moments, instead of the foreach path's dozen passes); 16-bit weights take one pass too, a kernel that reads
the 16-bit gradient, updates the fp32 master and moments and writes the rounded weight
(``grpo.optim.cpu_adamw`` on the CPU, bitwise torch's fused AdamW on the masters;
``grpo.optim.triton_adamw`` on CUDA), or torch's ops in three passes where that kernel is
unavailable (no C++ compiler: logged). The state dict is torch's AdamW's on every path (plus the
masters), so a checkpoint written by any path resumes on any other: :func:`adamw` keeps the optimizer's
own implementation when it loads one (:func:`keep_implementation`).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Iterable, Optional

import torch

from .optim import cpu_adamw, triton_adamw
from .optim.master_adamw import DTYPES as FUSED_MASTER_DTYPES

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

    ``step`` runs AdamW on the masters from the 16-bit gradients and rounds the masters into the
    parameters. AdamW's update is elementwise, so the parameters can be stepped in pieces, and the result
    is the one-call one, bit for bit:

    - fused (``fused=True``, every group), with :attr:`native` and a kernel for the device: one pass per
      element (``grpo.optim.cpu_adamw`` on the CPU: torch's fused AdamW arithmetic, bitwise;
      ``grpo.optim.triton_adamw`` on CUDA: to fp32 rounding): the bf16/fp16 gradient is read,
      the master and moments updated and the weight written, rounded to nearest even. No fp32 gradient
      exists at all.
    - fused, without that kernel (no C++ compiler, or :attr:`native` off), or for a 16-bit dtype it does
      not take: torch's ops on cache-sized slices of at most :attr:`slice_elements` elements (small
      parameters share a slice). Each slice runs three passes back to back while its fp32 gradient and
      master are still in cache: the 16-bit gradient into a kept fp32 buffer of one slice, torch's fused
      AdamW kernel (``torch._fused_adamw_``, the call ``torch.optim.adam._fused_adam`` makes) on flat
      views of the slice's master and moments, and the master rounded into the weight. (The two casts are
      passes torch's fused kernel does not fuse: they cost ~0.7x of its step on a CPU, which the one-pass
      kernel saves; ``benchmarks/optimizer_step.py``, results in ``benchmarks/results/``.)
    - otherwise (the foreach path): the fp32 gradients are views of one kept buffer the size of the
      largest 16-bit parameter, and torch's ``AdamW.step`` steps the masters in buckets that fit it.

    The buffers are kept between steps (allocated afresh, every page of it faults in again,
    which costs more than the step on a CPU), and gradients that cannot be a flat view of a plain tensor
    (FSDP2's sharded ``DTensor``, non-contiguous or sparse ones) are cast afresh and stepped whole.
    Parameters without a gradient are skipped, as torch's AdamW skips them (``_init_group`` chooses).

    ``param_groups`` (the learning rate) are the inner AdamW's; ``state_dict`` is torch's AdamW's plus the
    masters (``"master_weights"``, in parameter order), so a resumed run continues from the same fp32
    values rather than from the rounded weights.
    """

    native: bool = True
    """Whether the fused path steps the 16-bit weights with the one-pass kernel where there is one (see
    above); False keeps torch's ops (the slices). The results and the state dict are the same (bitwise on
    the CPU), so this is a choice of speed only: the benchmark sets it to time both."""

    slice_elements: int = 1 << 19
    """Elements of one slice of the fused path (rounded down to a multiple of :attr:`_ALIGN`): its fp32
    gradient and master, 4 MiB, stay in cache (L3) between the passes. 2^18 .. 2^20 measure alike on the
    CPU, 2^19 best or tied at 1 and 2 threads; smaller slices pay per-call overhead (and, threaded, a
    parallel region each), larger ones fall out of cache (``benchmarks/results/``)."""

    _ALIGN = 64
    """Where a parameter may be cut (elements from its start). torch's CPU kernel computes each tensor's
    last ``numel % vector width`` elements in scalar code that rounds ``exp_avg_sq`` differently from its
    vector body (``adam_fused_step_impl``, aten/src/ATen/native/cpu/FusedAdamKernel.cpp; the two forms:
    ``grpo/optim/cpu_adamw.cpp``): a piece that ends elsewhere than at a multiple of the vector
    width (8 floats in torch 2.13's CPU build, 16 possible) would round those elements differently from
    the whole parameter. (CUDA's kernel applies one arithmetic to every element; untested here.)"""

    def __init__(self, params: Iterable[torch.nn.Parameter] | Iterable[dict], **kwargs) -> None:
        """``params``: parameters, or parameter groups (dicts with ``"params"`` and their own AdamW
        options), as ``torch.optim.AdamW`` takes them; ``kwargs``: AdamW's options."""
        groups = list(params)
        if not all(isinstance(g, dict) for g in groups):
            groups = [{"params": groups}]
        groups = [{**g, "params": list(g["params"])} for g in groups]
        self.model_params = [p for g in groups for p in g["params"]]
        masters = [p if p.dtype == torch.float32 else p.detach().float().requires_grad_() for p in self.model_params]
        master_of = {id(p): m for p, m in zip(self.model_params, masters)}
        super().__init__([{**g, "params": [master_of[id(p)] for p in g["params"]]} for g in groups], **kwargs)
        self._pairs = [(p, m) for p, m in zip(self.model_params, masters) if m is not p]
        self._own = [m for p, m in zip(self.model_params, masters) if m is p]  # fp32 parameters: stepped as they are
        self._largest: dict[torch.device, int] = {}  # per device: the foreach path's buffer size
        for p, _ in self._pairs:
            self._largest[p.device] = max(self._largest.get(p.device, 0), p.numel())
        self._buffers: dict[torch.device, torch.Tensor] = {}  # fp32 gradients of one bucket or slice, per device (made at the first step)

    def _buffer(self, device: torch.device, size: int) -> torch.Tensor:
        """The kept fp32 gradient buffer of ``device``, of at least ``size`` elements."""
        if device not in self._buffers or self._buffers[device].numel() < size:
            self._buffers[device] = torch.empty(size, dtype=torch.float32, device=device)
        return self._buffers[device]

    # ------------------------------------------------------------------ the fused path: cache-sized slices
    @staticmethod
    def _sliceable(p: torch.Tensor, master: torch.Tensor) -> bool:
        """Whether ``p``'s gradient, ``p`` and its master can be cut into flat views (plain, dense,
        contiguous tensors); otherwise the gradient is cast afresh and the master stepped whole."""
        grad = p.grad
        return (type(grad) is torch.Tensor and grad.layout == torch.strided and grad.is_contiguous()
                and p.is_contiguous() and master.is_contiguous())

    def _fused_step(self) -> None:
        """One step of every group, fused: the fp32 parameters (and masters stepped whole) through torch's fused
        kernel, the 16-bit parameters in one pass (:meth:`_native_kernel`) or slice by slice."""
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        weights = {id(master): p for p, master in self._pairs}
        sliced: set[int] = set()
        for p, master in self._pairs:
            if p.grad is None:
                master.grad = None
            elif self._sliceable(p, master):
                master.grad = master.detach()  # (a stand-in of the right shape for _init_group; never read)
                sliced.add(id(master))
            else:
                master.grad = p.grad.float()
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
            # torch's own selection (parameters with a gradient) and lazy state initialisation
            self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
            if not params:
                continue
            amsgrad = group["amsgrad"]
            beta1, beta2 = (float(b) if torch.is_tensor(b) else b for b in group["betas"])
            options = {"amsgrad": amsgrad, "beta1": beta1, "beta2": beta2, "weight_decay": group["weight_decay"],
                       "eps": group["eps"], "maximize": group["maximize"]}
            whole: dict[torch.device, list[list]] = {}  # per device: the op's six lists, tensors stepped whole
            pieces: dict[torch.device, list] = {}  # per device: (weight, master, stand-in, exp_avg, exp_avg_sq, max or None, step)
            for i, master in enumerate(params):
                lists = (master, grads[i], exp_avgs[i], exp_avg_sqs[i], max_exp_avg_sqs[i] if amsgrad else None, steps[i])
                if id(master) in sliced:
                    pieces.setdefault(master.device, []).append((weights[id(master)], *lists))
                else:
                    columns = whole.setdefault(master.device, [[] for _ in range(6)])
                    for column, t in zip(columns, lists):
                        if t is not None:
                            column.append(t)
            for device in {*whole, *pieces}:
                lr = group["lr"]
                if torch.is_tensor(lr) and lr.device.type != "cpu":  # (as _fused_adam: a CUDA lr to the device)
                    lr = lr.to(device, non_blocking=True)
                scale = grad_scale.to(device, non_blocking=True) if grad_scale is not None else None
                inf = found_inf.to(device, non_blocking=True) if found_inf is not None else None
                kw = dict(options, lr=lr, grad_scale=scale, found_inf=inf)
                device_steps = [steps[i] for i, m in enumerate(params) if m.device == device]
                # the op reads the step counters; torch's _fused_adam adds 1 before the call, once per
                # parameter (however many slices share the counter)
                torch._foreach_add_(device_steps, 1)
                if device in whole:
                    torch._fused_adamw_(*whole[device], **kw)
                if device in pieces:
                    kernel = self._native_kernel(device)
                    one_pass, rest = [], []  # (the kernel's dtypes; any other 16-bit dtype through torch's ops)
                    for entry in pieces[device]:
                        (one_pass if kernel is not None and entry[0].dtype in FUSED_MASTER_DTYPES else rest).append(entry)
                    if one_pass:
                        weight, master, _, exp_avg, exp_avg_sq, max_sq, step = (list(c) for c in zip(*one_pass))
                        kernel(master, exp_avg, exp_avg_sq, max_sq if amsgrad else None, [w.grad for w in weight],
                               weight, step, lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                               weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=amsgrad,
                               maximize=group["maximize"], grad_scale=scale, found_inf=inf)
                    if rest:
                        self._step_slices(rest, amsgrad, kw)
                if inf is not None:  # (as _fused_adam: a skipped step does not count)
                    torch._foreach_sub_(device_steps, [inf] * len(device_steps))
        for p, master in self._pairs:
            if id(master) not in sliced and p.grad is not None:
                p.copy_(master)  # (the ones stepped whole) rounded to the parameter's dtype
            master.grad = None

    def _native_kernel(self, device: torch.device) -> Optional[Callable]:
        """The one-pass step for ``device`` (``master_adamw_step`` of ``grpo.optim.cpu_adamw`` or
        ``triton_adamw``), or ``None``: :attr:`native` off, no kernel for the device type, or the CPU's
        unavailable (``cpu_adamw.library`` logs why, once)."""
        if not self.native:
            return None
        if device.type == "cpu":
            return cpu_adamw.master_adamw_step if cpu_adamw.library() is not None else None
        if device.type == "cuda":
            return triton_adamw.master_adamw_step
        return None

    def _step_slices(self, entries: list, amsgrad: bool, kw: dict) -> None:
        """The 16-bit parameters of one device and group (``entries``: weight, master, stand-in gradient,
        exp_avg, exp_avg_sq, max_exp_avg_sq or None, step), cut into slices of at most
        :attr:`slice_elements` elements; per slice: gradients into the buffer, one fused call, rounding."""
        size = max(self._ALIGN, self.slice_elements // self._ALIGN * self._ALIGN)
        buffer = self._buffer(entries[0][1].device, size)
        chunk: list[tuple] = []  # (weight, master, exp_avg, exp_avg_sq, max_exp_avg_sq, step, start, end) of this slice
        filled = 0

        def flush() -> None:
            lists = [[] for _ in range(6)]
            offset = 0
            for weight, master, exp_avg, exp_avg_sq, max_sq, step, start, end in chunk:
                n = end - start
                lists[0].append(master.view(-1)[start:end])
                lists[1].append(buffer[offset : offset + n].copy_(weight.grad.view(-1)[start:end]))
                lists[2].append(exp_avg.view(-1)[start:end])
                lists[3].append(exp_avg_sq.view(-1)[start:end])
                if amsgrad:
                    lists[4].append(max_sq.view(-1)[start:end])
                lists[5].append(step)  # (read only: incremented once, before)
                offset += n
            torch._fused_adamw_(*lists, **kw)
            for (weight, _, _, _, _, _, start, end), master_slice in zip(chunk, lists[0]):
                weight.view(-1)[start:end].copy_(master_slice)  # rounded to the parameter's dtype, once per step

        for weight, master, _, exp_avg, exp_avg_sq, max_sq, step in entries:
            start, n = 0, master.numel()
            while start < n:
                # the rest of the parameter, or as much of it as fills the slice, cut at a multiple of
                # _ALIGN from the parameter's start
                end = n if n - start <= size - filled else start + (size - filled) // self._ALIGN * self._ALIGN
                if end > start:
                    chunk.append((weight, master, exp_avg, exp_avg_sq, max_sq, step, start, end))
                    filled += end - start
                    start = end
                if end < n or filled == size:
                    flush()
                    chunk, filled = [], 0
        if chunk:
            flush()

    # ------------------------------------------------------------------ the foreach path: buckets through AdamW.step
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

    def _bucket_step(self) -> None:
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
                buffer = self._buffer(p.device, self._largest[p.device])
                master.grad = buffer[offset : offset + p.numel()].view(p.shape).copy_(p.grad)
            self._adamw_step()
            for p, master, _ in bucket:
                p.copy_(master)  # rounded to the parameter's dtype, once per step
        for _, master in self._pairs:
            master.grad = None  # (views of the buffer, which the next bucket or step overwrites)
        for master, grad in zip(self._own, own_grads):
            master.grad = grad

    @torch.no_grad()
    def step(self, closure=None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if all(group["fused"] for group in self.param_groups):
            self._fused_step()
        else:
            self._bucket_step()
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
