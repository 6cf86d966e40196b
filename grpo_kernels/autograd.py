"""autograd.Functions that bind a backend's row kernels' forward to their backward.

``TokenLogprobs``: logits -> (logp, entropy), saving only the logits (a reference, not a copy) and
three fp32 numbers per row (max, log-sum, entropy). ``FusedGRPOLoss``: logits -> the token-level GRPO
loss in the same single pass (backends whose ``fuses(options)`` is true). ``FusedLinearTokenLogprobs``: hidden,
weight, bias -> (logp, entropy), where each chunk's logits exist only while that chunk is processed,
in the forward and again in the backward.

Each Function receives the backend object (``grpo_kernels.backends``) and calls only its methods.
Backwards are first order: a double backward (``create_graph=True``) raises a RuntimeError instead
of returning a gradient without a graph (use ``backend="reference"`` for higher-order gradients). With ``inplace_backward`` the logits' gradient is written into
the logits buffer and the buffer's version counter is bumped, so autograd raises (instead of using a
corrupted tensor) when anything else saved the logits: an op whose backward needs its output
(``tanh`` soft-capping, ``exp``), or a second backward through the same graph.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from .backends import RowBackend
from .options import LogitTransform


def _first_order(backward: Callable) -> Callable:
    """Refuse ``create_graph=True`` (autograd runs a backward with grad mode on only then)."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "grpo_kernels' fused kernels give first-order gradients only: backward(create_graph=True) / "
                "double backward is not supported; use backend='reference' for higher-order gradients"
            )
        return backward(ctx, *grads)

    return wrapper


def _gradient_buffer(logits: torch.Tensor, inplace_backward: bool) -> torch.Tensor:
    return logits if inplace_backward else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


def _written_in_place(logits: torch.Tensor, out: torch.Tensor) -> None:
    """A kernel wrote into ``logits``: tell autograd, so a later reader of the old values raises."""
    if out is logits:
        torch.autograd.graph.increment_version(logits)


class TokenLogprobs(torch.autograd.Function):
    """(logits [B, T, V], targets [B, T]) -> (logp [B, T], entropy [B, T]), both float32."""

    @staticmethod
    def forward(ctx, logits, targets, backend: RowBackend, transform: LogitTransform, ignore_index: int,
                with_entropy: bool, inplace_backward: bool):
        logp, entropy, row_max, log_sum = backend.forward_rows(logits, targets, transform, ignore_index, with_entropy)
        ctx.set_materialize_grads(False)  # an unused output passes None, not a tensor of zeros
        ctx.save_for_backward(logits, targets, row_max, log_sum, entropy)
        ctx.config = (backend, transform, ignore_index, inplace_backward)
        return logp, entropy

    @staticmethod
    @_first_order
    def backward(ctx, grad_logp, grad_entropy):
        logits, targets, row_max, log_sum, entropy = ctx.saved_tensors
        backend, transform, ignore_index, inplace_backward = ctx.config
        out = _gradient_buffer(logits, inplace_backward)
        backend.backward_rows(logits, targets, row_max, log_sum, entropy, grad_logp, grad_entropy, transform, ignore_index, out)
        _written_in_place(logits, out)
        return out, None, None, None, None, None, None


class FusedGRPOLoss(torch.autograd.Function):
    """Token-level GRPO loss from logits in one pass; the backward is one more pass.

    forward(logits [B, T, V], targets [B, T], advantages, weights [B, T], backend, inputs, options,
    ignore_index, inplace_backward) -> (loss 0-d, logp, entropy, k3 kl [B, T], clip region int8 [B, T]);
    only the loss is differentiable. Saved: the logits (a reference), and five fp32 numbers per token.
    """

    @staticmethod
    def forward(ctx, logits, targets, advantages, weights, backend: RowBackend, inputs, options,
                ignore_index: int, inplace_backward: bool):
        loss, logp, entropy, row_max, log_sum, coef_logp, coef_entropy, kl, clip = backend.grpo_forward_rows(
            logits, targets, advantages, weights, inputs, options, ignore_index
        )
        ctx.save_for_backward(logits, targets, row_max, log_sum, entropy, coef_logp, coef_entropy)
        ctx.config = (backend, options.transform, ignore_index, inplace_backward, options.entropy_coef != 0)
        ctx.mark_non_differentiable(logp, entropy, kl, clip)
        return loss.sum(), logp, entropy, kl, clip

    @staticmethod
    @_first_order
    def backward(ctx, grad_loss, *_grad_non_differentiable):
        logits, targets, row_max, log_sum, entropy, coef_logp, coef_entropy = ctx.saved_tensors
        backend, transform, ignore_index, inplace_backward, has_entropy_term = ctx.config
        out = _gradient_buffer(logits, inplace_backward)
        backend.backward_rows(
            logits, targets, row_max, log_sum, entropy, coef_logp * grad_loss,
            coef_entropy * grad_loss if has_entropy_term else None, transform, ignore_index, out,
        )
        _written_in_place(logits, out)
        return (out,) + (None,) * 8


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
    def forward(ctx, hidden, weight, bias, targets, backend: RowBackend, temperature: float, ignore_index: int,
                with_entropy: bool, chunk_size: int):
        n = hidden.shape[0]
        logp, entropy, row_max, log_sum = (torch.empty(n, dtype=torch.float32, device=hidden.device) for _ in range(4))
        for start in range(0, n, chunk_size):
            rows = slice(start, min(n, start + chunk_size))
            logits = _chunk_logits(hidden[rows], weight, bias)
            stats = backend.forward_rows(logits.unsqueeze(0), targets[rows].unsqueeze(0), temperature, ignore_index, with_entropy)
            for out, value in zip((logp, entropy, row_max, log_sum), stats):
                out[rows] = value[0]
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, bias, targets, row_max, log_sum, entropy)
        ctx.config = (backend, temperature, ignore_index, chunk_size)
        return logp, entropy

    @staticmethod
    @_first_order
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, row_max, log_sum, entropy = ctx.saved_tensors
        backend, temperature, ignore_index, chunk_size = ctx.config
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
            grad_logits = backend.backward_rows(
                logits.unsqueeze(0), targets[rows].unsqueeze(0), row_max[rows].unsqueeze(0), log_sum[rows].unsqueeze(0),
                entropy[rows].unsqueeze(0), g_logp, g_ent, temperature, ignore_index, logits.unsqueeze(0),
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
