"""A fused RMSNorm, forward and backward: what a decoder keeps for its norms' backward, cut to ``x`` and one fp32 per row.

    rms_norm(x, weight, eps)                  # LlamaRMSNorm / Qwen2RMSNorm / Qwen3RMSNorm / MistralRMSNorm
    rms_norm(x, weight, eps, gemma=True)      # GemmaRMSNorm / Gemma2RMSNorm / Gemma3RMSNorm: (1 + weight)
    RMSNorm(hidden_size, eps, gemma=False)    # the module (its weight: ones, or zeros for gemma)

transformers' RMSNorm modules are a few elementwise PyTorch ops; autograd keeps, for their backward,
the fp32 cast of ``x``, the normalised rows and their cast (llama-style), ``4.5 x N x H x 4`` bytes at
the backward's height for a bf16 ``x`` (``grpo.plan``). :class:`RMSNormFunction` keeps ``x`` (which the
layer keeps anyway), the weight and ``rstd`` [N] fp32, and computes the backward in one pass
(``kernels/triton_norm.py`` has the formulas; ``kernels/torch_norm.py`` is the CPU path, over blocks of
rows). Values: transformers' to the rounding of ``1 / sqrt(mean(x^2) + eps)`` (bit for bit on the CPU
path); gradients in fp32, returned in the inputs' dtypes.

Public API (``docs/api.md``, "RMSNorm" and "Public modules").
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from . import _validation as V
from .bounds import at_least, check_value
from .kernels import torch_norm

NORM_BACKENDS = ("auto", "triton", "torch")  # the backend names rms_norm takes
EPS = at_least(0.0)  # eps' range (0 allowed, as transformers allows it)


def _rows_module(backend: str, device: torch.device):
    """The kernels module for a backend name and the tensors' device: "auto" is Triton on CUDA, and on a
    CPU when Triton runs in its interpreter (``backends.triton_interprets``), else the torch path."""
    if backend == "auto":
        from .backends import triton_interprets

        backend = "triton" if device.type == "cuda" or (device.type == "cpu" and triton_interprets()) else "torch"
    if backend == "triton":
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"backend='triton' needs CUDA tensors (or CPU tensors under TRITON_INTERPRET=1), got {device}")
        from .kernels import triton_norm

        return triton_norm
    return torch_norm


def out_dtype(x_dtype: torch.dtype, w_dtype: torch.dtype, gemma: bool) -> torch.dtype:
    """The output's dtype as transformers' modules give it: llama-style ``w * cast(n)`` promotes the two;
    gemma-style ``cast(n * (1 + w))`` has ``x``'s."""
    return x_dtype if gemma else torch.promote_types(x_dtype, w_dtype)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` [..., H] as rows [N, H] with a unit last stride (a view where it can be, else a copy)."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


class RMSNormFunction(torch.autograd.Function):
    """``y = rms_norm(x, weight, eps)``: x [..., H] (fp16/bf16/fp32), weight [H] -> y [..., H].

    Saves ``x``, ``weight`` and ``rstd`` [N] fp32; the backward reads them once more and writes ``dx``
    (x's dtype) and, when the weight needs it, ``dw`` (weight's dtype, summed in fp32). First order only.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool, rows) -> torch.Tensor:
        y, rstd = rows.forward_rows(_rows(x), weight, eps, gemma, out_dtype(x.dtype, weight.dtype, gemma))
        ctx.save_for_backward(x, weight, rstd)  # (x itself, not a view made here: the layer keeps x anyway)
        ctx.gemma, ctx.rows = gemma, rows
        return y.view(x.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        x2, dy2 = _rows(x), _rows(dy)
        dx, dw = ctx.rows.backward_rows(dy2, x2, weight, rstd, ctx.gemma, ctx.needs_input_grad[0],
                                        ctx.needs_input_grad[1])
        return (dx.view(dy.shape) if dx is not None else None), dw, None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, gemma: bool = False,
             backend: str = "auto") -> torch.Tensor:
    """Root-mean-square normalisation of the last dimension (Zhang & Sennrich, 2019), fused.

    x [..., H] fp16/bf16/fp32; weight [H] (any float dtype, on x's device); ``eps`` >= 0 added to
    ``mean(x^2)`` (``config.rms_norm_eps``). ``gemma=False``: ``weight * cast_x(x * r)`` in
    ``promote(x, weight)``'s dtype (Llama, Qwen2, Qwen3, Mistral); ``gemma=True``: ``cast_x(x * r *
    (1 + weight))`` in x's dtype (Gemma 1-3), with ``r = 1 / sqrt(mean(x^2) + eps)`` in fp32.
    Differentiable in ``x`` and ``weight`` (first order). ``backend``: one of :data:`NORM_BACKENDS`.
    ``TypeError`` / ``ValueError`` naming the argument for bad input, before anything runs.
    """
    V.check_tensor("x", x)
    V.check_tensor("weight", weight)
    gemma = V.check_flag("gemma", gemma)
    eps = check_value("eps", eps, float, bounds=EPS)
    backend = check_value("backend", backend, str, choices=NORM_BACKENDS)
    if x.dtype not in V.FLOAT_DTYPES:
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if weight.dtype not in V.FLOAT_DTYPES:
        raise TypeError(f"weight must be float16, bfloat16 or float32, got {weight.dtype}")
    if x.dim() == 0 or weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must have shape [H] = [{x.shape[-1] if x.dim() else '?'}] (x's last dimension), "
                         f"got {list(weight.shape)} for x {list(x.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight must be on x's device {x.device}, got {weight.device}")
    return RMSNormFunction.apply(x, weight, eps, gemma, _rows_module(backend, x.device))


class RMSNorm(torch.nn.Module):
    """``rms_norm`` with its weight: ones (llama-style) or zeros (``gemma``: the scale is ``1 + weight``),
    as the transformers modules initialise theirs; ``eps``, ``gemma`` and ``backend`` as :func:`rms_norm`."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, gemma: bool = False, backend: str = "auto",
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        hidden_size = V.check_positive_int("hidden_size", hidden_size)
        self.eps = check_value("eps", eps, float, bounds=EPS)
        self.gemma = V.check_flag("gemma", gemma)
        self.backend = check_value("backend", backend, str, choices=NORM_BACKENDS)
        init = torch.zeros if self.gemma else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, gemma=self.gemma, backend=self.backend)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, gemma={self.gemma}"


# Public API (docs/api.md, "Public modules"): the names other packages may import from this module.
__all__ = ["rms_norm", "RMSNorm", "RMSNormFunction", "NORM_BACKENDS"]
