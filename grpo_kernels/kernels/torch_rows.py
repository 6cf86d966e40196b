"""Memory-lean PyTorch row kernels: the same maths as the Triton kernels, a chunk of rows at a time.

Only one chunk's fp32 copy of the logits exists at once, so the extra memory is
``chunk_rows * V * 4`` bytes instead of a full fp32 ``[N, V]`` copy (or two, with the softmax).
"""

from __future__ import annotations

from typing import Iterator, Optional, Tuple

import torch

# ~64 MiB of fp32 per chunk: large enough for fast BLAS-like kernels, small next to the logits.
CHUNK_ELEMENTS = 1 << 24


def default_chunk_rows(vocab_size: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab_size)


def row_chunks(b: int, t: int, rows: int) -> Iterator[Tuple[slice, slice]]:
    """Boxes ``(batch slice, time slice)`` of about ``rows`` rows covering a [B, T] grid."""
    if t >= rows:
        for i in range(b):
            for t0 in range(0, t, rows):
                yield slice(i, i + 1), slice(t0, min(t, t0 + rows))
    else:
        per = max(1, rows // max(t, 1))
        for b0 in range(0, b, per):
            yield slice(b0, min(b, b0 + per)), slice(0, t)


def _log_softmax_parts(z: torch.Tensor, row_max: torch.Tensor, log_sum: torch.Tensor) -> torch.Tensor:
    """log p = (z - max) - log sum exp(z - max): more accurate than z - lse for p ~ 1."""
    return (z - row_max.unsqueeze(-1)) - log_sum.unsqueeze(-1)


def _chunk_logprobs(x: torch.Tensor, targets: torch.Tensor, temperature: float, ignore_index: int):
    """log-prob, entropy, row max and log-sum of one chunk x [b, t, V]; targets [b, t]."""
    z = x.float() / temperature
    row_max = z.amax(-1)
    log_sum = torch.log(torch.exp(z - row_max.unsqueeze(-1)).sum(-1))
    log_p = _log_softmax_parts(z, row_max, log_sum)
    valid = targets != ignore_index
    safe = torch.where(valid, targets, torch.zeros_like(targets)).long()
    logp = log_p.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    p = log_p.exp()
    # p * log p is 0 at a -inf logit (p = 0); a NaN row stays NaN.
    entropy = -(p * torch.where(p > 0, log_p, torch.zeros_like(log_p))).sum(-1)
    zero = torch.zeros_like(logp)
    keep = lambda t: torch.where(valid, t, zero)  # noqa: E731
    return keep(logp), keep(entropy), keep(row_max), keep(log_sum)


@torch.no_grad()
def forward_rows(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    ignore_index: int,
    with_entropy: bool = True,
    chunk_rows: Optional[int] = None,
):
    """logits [B, T, V] (last dim contiguous), targets [B, T] -> (logp, entropy, row_max, log_sum), fp32 [B, T]."""
    b, t, v = logits.shape
    rows = chunk_rows or default_chunk_rows(v)
    outputs = [torch.empty(b, t, dtype=torch.float32, device=logits.device) for _ in range(4)]
    for bs, ts in row_chunks(b, t, rows):
        for out, value in zip(outputs, _chunk_logprobs(logits[bs, ts], targets[bs, ts], temperature, ignore_index)):
            out[bs, ts] = value
    return tuple(outputs)


@torch.no_grad()
def backward_rows(
    logits: torch.Tensor,
    targets: torch.Tensor,
    row_max: torch.Tensor,
    log_sum: torch.Tensor,
    entropy: torch.Tensor,
    grad_logp: Optional[torch.Tensor],
    grad_entropy: Optional[torch.Tensor],
    temperature: float,
    ignore_index: int,
    out: torch.Tensor,
    chunk_rows: Optional[int] = None,
) -> torch.Tensor:
    """Write ``d loss / d logits`` [B, T, V] into ``out`` (may be ``logits`` itself) and return it.

    ``dz = g_logp * (onehot - p) + g_entropy * (-p * (log p + H))``, divided by the temperature.
    """
    b, t, v = logits.shape
    rows = chunk_rows or default_chunk_rows(v)
    for bs, ts in row_chunks(b, t, rows):
        tgt = targets[bs, ts]
        valid = tgt != ignore_index
        z = logits[bs, ts].float() / temperature
        log_p = _log_softmax_parts(z, row_max[bs, ts], log_sum[bs, ts])
        p = log_p.exp()
        grad = torch.zeros_like(z)
        if grad_logp is not None:
            g = grad_logp[bs, ts].unsqueeze(-1)
            safe = torch.where(valid, tgt, torch.zeros_like(tgt)).long().unsqueeze(-1)
            is_target = torch.arange(v, device=z.device) == safe
            # The target's term g * (1 - p) uses -expm1(log p), accurate when p ~ 1, and is formed
            # in fp32 before the one rounding, so a confident prediction keeps its small gradient.
            target_term = g * -torch.expm1(log_p.gather(-1, safe))
            grad = torch.where(is_target, target_term, -g * p)
        if grad_entropy is not None:
            h = entropy[bs, ts].unsqueeze(-1)
            plogp = p * torch.where(p > 0, log_p + h, torch.zeros_like(log_p))
            grad -= grad_entropy[bs, ts].unsqueeze(-1) * plogp
        grad = torch.where(valid.unsqueeze(-1), grad, torch.zeros_like(grad)) / temperature
        out[bs, ts] = grad.to(out.dtype)
    return out
