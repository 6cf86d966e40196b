"""autograd.Functions that bind the row kernels' forward to their backward.

``TokenLogprobs``: logits -> (logp, entropy), saving only the logits (a reference, not a copy) and
three fp32 numbers per row (max, log-sum, entropy). ``FusedGRPOLoss``: logits -> the token-level GRPO
loss in the same single pass (Triton only). ``FusedLinearTokenLogprobs``: hidden, weight, bias ->
(logp, entropy), where each chunk's logits exist only while that chunk is processed, in the forward
and again in the backward.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Optional

import torch

from .kernels import torch_rows


def triton_rows() -> ModuleType:
    from .kernels import triton_rows as module  # imported lazily: Triton is heavy to import

    return module


def row_kernels(backend: str, device: torch.device) -> ModuleType:
    """The row-kernel module for a resolved backend name ("triton" or "torch")."""
    if backend == "auto":
        interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
        backend = "triton" if device.type == "cuda" or (device.type == "cpu" and interpret) else "torch"
    if backend == "triton":
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise ValueError(
                "backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 (set before importing triton) for CPU tensors"
            )
        return triton_rows()
    if backend == "torch":
        return torch_rows
    raise ValueError(f"backend must be 'auto', 'triton', 'torch' or 'reference', got {backend!r}")


class TokenLogprobs(torch.autograd.Function):
    """(logits [B, T, V], targets [B, T]) -> (logp [B, T], entropy [B, T]), both float32."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, ignore_index, kernels, with_entropy, inplace_backward):
        logp, entropy, row_max, log_sum = kernels.forward_rows(logits, targets, temperature, ignore_index, with_entropy)
        ctx.set_materialize_grads(False)  # an unused output passes None, not a tensor of zeros
        ctx.save_for_backward(logits, targets, row_max, log_sum, entropy)
        ctx.config = (temperature, ignore_index, kernels, inplace_backward)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, targets, row_max, log_sum, entropy = ctx.saved_tensors
        temperature, ignore_index, kernels, inplace_backward = ctx.config
        out = logits if inplace_backward else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        kernels.backward_rows(logits, targets, row_max, log_sum, entropy, grad_logp, grad_entropy, temperature, ignore_index, out)
        return out, None, None, None, None, None, None


class FusedGRPOLoss(torch.autograd.Function):
    """Token-level GRPO loss from logits in one Triton pass; the backward is one more pass.

    forward -> (loss 0-d, logp, entropy, k3 kl [B, T], clip region int8 [B, T]); only the loss is
    differentiable. Saved: the logits (a reference), and five fp32 numbers per token.
    """

    @staticmethod
    def forward(ctx, logits, targets, advantages, weights, old_logps, ref_logps, is_ratio, temperature,
                ignore_index, hyper, inplace_backward):
        eps_low, eps_high, delta, beta, entropy_coef = hyper
        loss, logp, entropy, row_max, log_sum, coef_logp, coef_entropy, kl, clip = triton_rows().grpo_forward_rows(
            logits, targets, advantages, weights, old_logps, ref_logps, is_ratio, temperature, ignore_index,
            eps_low, eps_high, delta, beta, entropy_coef,
        )
        ctx.save_for_backward(logits, targets, row_max, log_sum, entropy, coef_logp, coef_entropy)
        ctx.config = (temperature, ignore_index, inplace_backward, entropy_coef != 0)
        ctx.mark_non_differentiable(logp, entropy, kl, clip)
        return loss.sum(), logp, entropy, kl, clip

    @staticmethod
    def backward(ctx, grad_loss, *_grad_non_differentiable):
        logits, targets, row_max, log_sum, entropy, coef_logp, coef_entropy = ctx.saved_tensors
        temperature, ignore_index, inplace_backward, has_entropy_term = ctx.config
        out = logits if inplace_backward else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        triton_rows().backward_rows(
            logits, targets, row_max, log_sum, entropy, coef_logp * grad_loss,
            coef_entropy * grad_loss if has_entropy_term else None, temperature, ignore_index, out,
        )
        return (out,) + (None,) * 10


def default_chunk_size(vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> int:
    """Rows per chunk for the fused-linear path.

    A chunk holds its logits (in the weight's dtype, overwritten by their gradient) plus, in the
    torch path, fp32 working copies; ~256 MiB on a GPU, ~64 MiB on a CPU keeps that small next to
    the weight and the activations, while each matmul is still large enough to run at full rate.
    """
    budget = (256 if device.type == "cuda" else 64) * 2**20
    per_row = vocab_size * (torch.finfo(dtype).bits // 8 + 4)
    rows = max(16, budget // per_row)
    return 1 << (int(rows).bit_length() - 1)  # a power of two: friendly tile shapes


def _chunk_logits(hidden_chunk, weight, bias):
    return torch.nn.functional.linear(hidden_chunk, weight, bias)


def _accumulate_weight_grad(acc: torch.Tensor, grad_logits: torch.Tensor, hidden: torch.Tensor) -> None:
    """``acc [V, H] fp32 += grad_logits^T @ hidden``, in vocabulary tiles.

    With 16-bit inputs each tile's product is formed by the matmul (fp32 inside) and added to the
    fp32 accumulator; tiling keeps that temporary to a few MiB instead of a second [V, H] copy.
    """
    if grad_logits.dtype == acc.dtype:
        acc.addmm_(grad_logits.t(), hidden)
        return
    tile = max(256, (32 * 2**20) // max(1, hidden.shape[1] * hidden.element_size()))
    for v0 in range(0, acc.shape[0], tile):
        cols = slice(v0, min(acc.shape[0], v0 + tile))
        acc[cols] += grad_logits[:, cols].t() @ hidden


class FusedLinearTokenLogprobs(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], bias [V] | None, targets [N]) -> (logp [N], entropy [N]).

    The forward computes the logits chunk by chunk and keeps only the row max, log-sum and entropy
    per row.
    The backward recomputes each chunk's logits, overwrites them with their gradient (row kernel,
    in place), then ``d hidden = d logits @ W`` and ``d W += d logits^T @ hidden`` (fp32 accumulator).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, ignore_index, kernels, with_entropy, chunk_size):
        n = hidden.shape[0]
        logp, entropy, row_max, log_sum = (torch.empty(n, dtype=torch.float32, device=hidden.device) for _ in range(4))
        for start in range(0, n, chunk_size):
            rows = slice(start, min(n, start + chunk_size))
            logits = _chunk_logits(hidden[rows], weight, bias)
            stats = kernels.forward_rows(logits.unsqueeze(0), targets[rows].unsqueeze(0), temperature, ignore_index, with_entropy)
            for out, value in zip((logp, entropy, row_max, log_sum), stats):
                out[rows] = value[0]
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, bias, targets, row_max, log_sum, entropy)
        ctx.config = (temperature, ignore_index, kernels, chunk_size)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, row_max, log_sum, entropy = ctx.saved_tensors
        temperature, ignore_index, kernels, chunk_size = ctx.config
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        n = hidden.shape[0]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_bias else None
        for start in range(0, n, chunk_size):
            rows = slice(start, min(n, start + chunk_size))
            logits = _chunk_logits(hidden[rows], weight, bias)
            g_logp = None if grad_logp is None else grad_logp[rows].unsqueeze(0)
            g_ent = None if grad_entropy is None else grad_entropy[rows].unsqueeze(0)
            grad_logits = kernels.backward_rows(
                logits.unsqueeze(0), targets[rows].unsqueeze(0), row_max[rows].unsqueeze(0), log_sum[rows].unsqueeze(0),
                entropy[rows].unsqueeze(0),
                g_logp, g_ent, temperature, ignore_index, out=logits.unsqueeze(0),
            )[0]
            if need_hidden:
                grad_hidden[rows] = grad_logits @ weight
            if need_weight:
                _accumulate_weight_grad(grad_weight, grad_logits, hidden[rows])
            if need_bias:
                grad_bias += grad_logits.sum(0, dtype=torch.float32)  # no fp32 copy of the chunk
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None, None, None, None, None, None,
        )
