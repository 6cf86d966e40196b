"""Triton row kernels: token log-prob and entropy from logits in one read, and their gradient.

One program per row (a 1-D grid, so any number of rows). The forward walks the vocabulary in blocks
with an online logsumexp: a running max ``m``, the rescaled sum ``s = sum exp(z - m)`` and
``u = sum exp(z - m) * (z - m)``, all fp32. Then ``log p = (z - m) - log s`` (never ``z - lse``,
whose rounding of ``lse`` would cost a confident token its gradient) and the entropy is
``H = log s - u / s``: both terms are >= 0, so nothing cancels. The target logit is read once, on
its own. The row keeps ``m`` and ``log s``; the backward recomputes ``p`` from them block by block
and writes the gradient in the output's dtype. Offsets are int64 so ``N * V > 2**31`` indexes correctly, and rows are addressed by
``(b, t)`` strides so a ``[B, T, V]`` slice of a larger tensor is read in place.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

# Smaller than any finite fp32 logit, so the running max starts finite: exp(m_old - m_new) and
# (m_old - m_new) * s stay well defined, and -inf logits simply contribute exp(-inf) = 0.
_LOWEST = tl.constexpr(-3.4028234663852886e38)


@triton.jit
def _row_pointer(base, row, T, stride_b, stride_t):
    b = row // T
    t = row - b * T
    return base + b * stride_b + t * stride_t


@triton.jit
def _one_minus_exp(x):
    """1 - exp(x) for x <= 0, accurate near 0 (a confident token's 1 - p), like -expm1(x)."""
    series = -x * (1.0 + x * (0.5 + x * (1.0 / 6.0 + x * (1.0 / 24.0 + x * (1.0 / 120.0)))))
    return tl.where(x > -0.125, series, 1.0 - tl.exp(x))


@triton.jit
def _row_softmax_stats(row_ptr, V, inv_temperature, BLOCK_V: tl.constexpr, WITH_ENTROPY: tl.constexpr):
    """One read of a row: (m, log s, entropy) of z = logits * inv_temperature, online over blocks."""
    m = tl.full((), _LOWEST, tl.float32)
    s = tl.zeros((), tl.float32)
    u = tl.zeros((), tl.float32)
    cols = tl.arange(0, BLOCK_V).to(tl.int64)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        z = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_temperature
        m_new = tl.maximum(m, tl.max(z, 0))
        shift = z - m_new
        e = tl.exp(shift)
        alpha = tl.exp(m - m_new)
        s_old = s
        s = s * alpha + tl.sum(e, 0)
        if WITH_ENTROPY:
            # A -inf logit adds 0 (not 0 * -inf); a NaN one still adds NaN.
            e_shift = tl.where(z == float("-inf"), 0.0, e * shift)
            u = alpha * (u + (m - m_new) * s_old) + tl.sum(e_shift, 0)
        m = m_new
    log_s = tl.log(s)
    return m, log_s, log_s - u / s


@triton.jit
def token_logprobs_fwd_kernel(
    logits_ptr, stride_b, stride_t, T,
    targets_ptr, logp_ptr, entropy_ptr, max_ptr, log_sum_ptr,
    V, inv_temperature, ignore_index,
    BLOCK_V: tl.constexpr, WITH_ENTROPY: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(targets_ptr + row).to(tl.int64)
    if target == ignore_index:
        # Masked rows: nothing is read, everything is 0.
        tl.store(logp_ptr + row, 0.0)
        tl.store(max_ptr + row, 0.0)
        tl.store(log_sum_ptr + row, 0.0)
        if WITH_ENTROPY:
            tl.store(entropy_ptr + row, 0.0)
    else:
        row_ptr = _row_pointer(logits_ptr, row, T, stride_b, stride_t)
        m, log_s, entropy = _row_softmax_stats(row_ptr, V, inv_temperature, BLOCK_V, WITH_ENTROPY)
        z_target = tl.load(row_ptr + target).to(tl.float32) * inv_temperature
        tl.store(logp_ptr + row, (z_target - m) - log_s)
        tl.store(max_ptr + row, m)
        tl.store(log_sum_ptr + row, log_s)
        if WITH_ENTROPY:
            tl.store(entropy_ptr + row, entropy)


@triton.jit
def grpo_loss_fwd_kernel(
    logits_ptr, stride_b, stride_t, T,
    targets_ptr, advantages_ptr, weights_ptr, old_logps_ptr, ref_logps_ptr, is_ratio_ptr,
    logp_ptr, entropy_ptr, max_ptr, log_sum_ptr, loss_ptr, coef_logp_ptr, coef_entropy_ptr,
    V, inv_temperature, ignore_index, eps_low, eps_high, delta, beta, entropy_coef,
    BLOCK_V: tl.constexpr, HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr, HAS_IS_RATIO: tl.constexpr,
):
    """The token-level GRPO loss in the same pass as the log-prob.

    Per row: log-prob and entropy, then ratio, clipped surrogate, k3 KL and entropy bonus, times the
    token's weight in the reduction (``reference.token_weights``). Writes the weighted loss (summed by
    the caller) and ``d loss / d logp`` and ``d loss / d entropy``, which the backward kernel scales
    by the incoming gradient. The formulas are ``reference.per_token_loss``'s, differentiated by hand.
    """
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(targets_ptr + row).to(tl.int64)
    if target == ignore_index:
        tl.store(logp_ptr + row, 0.0)
        tl.store(entropy_ptr + row, 0.0)
        tl.store(max_ptr + row, 0.0)
        tl.store(log_sum_ptr + row, 0.0)
        tl.store(loss_ptr + row, 0.0)
        tl.store(coef_logp_ptr + row, 0.0)
        tl.store(coef_entropy_ptr + row, 0.0)
    else:
        row_ptr = _row_pointer(logits_ptr, row, T, stride_b, stride_t)
        m, log_s, entropy = _row_softmax_stats(row_ptr, V, inv_temperature, BLOCK_V, True)
        z_target = tl.load(row_ptr + target).to(tl.float32) * inv_temperature
        logp = (z_target - m) - log_s
        tl.store(logp_ptr + row, logp)
        tl.store(entropy_ptr + row, entropy)
        tl.store(max_ptr + row, m)
        tl.store(log_sum_ptr + row, log_s)

        adv = tl.load(advantages_ptr + row)
        weight = tl.load(weights_ptr + row)
        if HAS_OLD:
            ratio = tl.exp(logp - tl.load(old_logps_ptr + row))
        else:
            ratio = tl.exp(logp - logp)  # on-policy: 1, d ratio / d logp = 1; NaN stays NaN
        unclipped = tl.minimum(ratio, delta)  # delta = +inf when unset
        clipped = tl.minimum(tl.maximum(ratio, 1.0 - eps_low), 1.0 + eps_high)
        t1 = unclipped * adv
        t2 = clipped * adv
        # d/d ratio of each branch: a clamp passes the gradient inside its closed range, and
        # torch.minimum splits it evenly on a tie (the usual case, inside the clip range).
        d1 = tl.where(ratio <= delta, adv, 0.0)
        d2 = tl.where((ratio >= 1.0 - eps_low) & (ratio <= 1.0 + eps_high), adv, 0.0)
        d_min = tl.where(t1 < t2, d1, tl.where(t2 < t1, d2, 0.5 * (d1 + d2)))
        loss = -tl.minimum(t1, t2)
        d_logp = -d_min * ratio
        if HAS_IS_RATIO:
            is_ratio = tl.load(is_ratio_ptr + row)
            loss = loss * is_ratio
            d_logp = d_logp * is_ratio
        if HAS_REF:
            diff = tl.load(ref_logps_ptr + row) - logp
            exp_diff = tl.exp(diff)
            loss += beta * (exp_diff - diff - 1.0)
            d_logp += beta * (1.0 - exp_diff)
        loss -= entropy_coef * entropy
        tl.store(loss_ptr + row, loss * weight)
        tl.store(coef_logp_ptr + row, d_logp * weight)
        tl.store(coef_entropy_ptr + row, -entropy_coef * weight)


@triton.jit
def token_logprobs_bwd_kernel(
    logits_ptr, stride_b, stride_t, T,
    grad_ptr, grad_stride_b, grad_stride_t,
    targets_ptr, max_ptr, log_sum_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr,
    V, inv_temperature, ignore_index,
    BLOCK_V: tl.constexpr, HAS_GRAD_LOGP: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(targets_ptr + row).to(tl.int64)
    row_ptr = _row_pointer(logits_ptr, row, T, stride_b, stride_t)
    grad_row_ptr = _row_pointer(grad_ptr, row, T, grad_stride_b, grad_stride_t)
    cols = tl.arange(0, BLOCK_V).to(tl.int64)
    if target == ignore_index:
        zeros = tl.zeros((BLOCK_V,), tl.float32)
        for start in range(0, V, BLOCK_V):
            offs = start + cols
            tl.store(grad_row_ptr + offs, zeros.to(grad_ptr.dtype.element_ty), mask=offs < V)
    else:
        m = tl.load(max_ptr + row)
        log_s = tl.load(log_sum_ptr + row)
        g_logp = 0.0
        g_entropy = 0.0
        entropy = 0.0
        if HAS_GRAD_LOGP:
            g_logp = tl.load(grad_logp_ptr + row) * inv_temperature
        # The target's term g * (1 - p), formed once in fp32 from an accurate 1 - p.
        z_target = tl.load(row_ptr + target).to(tl.float32) * inv_temperature
        target_term = g_logp * _one_minus_exp((z_target - m) - log_s)
        if HAS_GRAD_ENTROPY:
            g_entropy = tl.load(grad_entropy_ptr + row) * inv_temperature
            entropy = tl.load(entropy_ptr + row)
        for start in range(0, V, BLOCK_V):
            offs = start + cols
            in_row = offs < V
            z = tl.load(row_ptr + offs, mask=in_row, other=float("-inf")).to(tl.float32) * inv_temperature
            log_p = (z - m) - log_s
            p = tl.exp(log_p)
            grad = tl.where(offs == target, target_term, -g_logp * p)
            if HAS_GRAD_ENTROPY:
                grad -= tl.where(z == float("-inf"), 0.0, g_entropy * p * (log_p + entropy))
            tl.store(grad_row_ptr + offs, grad.to(grad_ptr.dtype.element_ty), mask=in_row)


def launch_config(vocab_size: int, dtype: torch.dtype) -> Tuple[int, int]:
    """(BLOCK_V, num_warps) for a vocabulary size and logits dtype.

    A block is 16 elements per thread at most, so each thread issues a few 16-byte loads per
    iteration and the running reductions are amortised over many elements without spilling.
    """
    block = 8192 if dtype in (torch.float16, torch.bfloat16) else 4096
    block = max(16, min(block, triton.next_power_of_2(vocab_size)))
    num_warps = 16 if block >= 8192 else 8 if block >= 2048 else 4
    return block, num_warps


def forward_rows(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    ignore_index: int,
    with_entropy: bool = True,
    chunk_rows: Optional[int] = None,
):
    """logits [B, T, V] (last dim contiguous), targets [B, T] -> (logp, entropy, row_max, log_sum).

    All fp32 [B, T]; ``row_max`` and ``log_sum`` (max of z = logits / T and log sum exp(z - max))
    are what the backward needs to recompute the softmax.
    """
    b, t, v = logits.shape
    targets = targets.contiguous()
    logp = torch.empty(b, t, dtype=torch.float32, device=logits.device)
    entropy = torch.empty_like(logp)
    row_max = torch.empty_like(logp)
    log_sum = torch.empty_like(logp)
    if b * t == 0:
        return logp, entropy, row_max, log_sum
    block, num_warps = launch_config(v, logits.dtype)
    token_logprobs_fwd_kernel[(b * t,)](
        logits, logits.stride(0), logits.stride(1), t,
        targets, logp, entropy, row_max, log_sum,
        v, 1.0 / temperature, ignore_index,
        BLOCK_V=block, WITH_ENTROPY=with_entropy, num_warps=num_warps,
    )
    return logp, entropy, row_max, log_sum


def grpo_forward_rows(
    logits: torch.Tensor,
    targets: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    old_logps: Optional[torch.Tensor],
    ref_logps: Optional[torch.Tensor],
    is_ratio: Optional[torch.Tensor],
    temperature: float,
    ignore_index: int,
    eps_low: float,
    eps_high: float,
    delta: Optional[float],
    beta: float,
    entropy_coef: float,
):
    """One pass of the token-level GRPO loss; per-token inputs are [B], [B, 1] or [B, T].

    Returns ``(weighted_loss, logp, entropy, row_max, log_sum, coef_logp, coef_entropy)``, fp32
    [B, T]: the reduced loss is ``weighted_loss.sum()`` and its gradient w.r.t. the logits is the row
    backward with ``grad_logp = coef_logp * g`` and ``grad_entropy = coef_entropy * g``.
    """
    b, t, v = logits.shape
    outputs = [torch.empty(b, t, dtype=torch.float32, device=logits.device) for _ in range(7)]
    if b * t == 0:
        return tuple(outputs)
    loss, logp, entropy, row_max, log_sum, coef_logp, coef_entropy = outputs
    weights = weights.float().contiguous()

    def per_token(x: Optional[torch.Tensor]) -> torch.Tensor:
        """[B], [B, 1] or [B, T] -> contiguous fp32 [B, T]; an absent input passes a never-read stand-in."""
        if x is None:
            return weights
        return (x.unsqueeze(-1) if x.dim() == 1 else x).float().expand(b, t).contiguous()

    block, num_warps = launch_config(v, logits.dtype)
    grpo_loss_fwd_kernel[(b * t,)](
        logits, logits.stride(0), logits.stride(1), t,
        targets.contiguous(), per_token(advantages), weights,
        per_token(old_logps), per_token(ref_logps), per_token(is_ratio),
        logp, entropy, row_max, log_sum, loss, coef_logp, coef_entropy,
        v, 1.0 / temperature, ignore_index, eps_low, eps_high,
        float("inf") if delta is None else delta, beta, entropy_coef,
        BLOCK_V=block, HAS_OLD=old_logps is not None, HAS_REF=ref_logps is not None,
        HAS_IS_RATIO=is_ratio is not None, num_warps=num_warps,
    )
    return loss, logp, entropy, row_max, log_sum, coef_logp, coef_entropy


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
    """Write ``d loss / d logits`` [B, T, V] into ``out`` (may be ``logits`` itself) and return it."""
    b, t, v = logits.shape
    if b * t == 0:
        return out
    block, num_warps = launch_config(v, logits.dtype)
    dummy = row_max  # stands in for an absent gradient; never read (the constexpr flag is off)
    token_logprobs_bwd_kernel[(b * t,)](
        logits, logits.stride(0), logits.stride(1), t,
        out, out.stride(0), out.stride(1),
        targets.contiguous(), row_max.contiguous(), log_sum.contiguous(), entropy.contiguous(),
        dummy if grad_logp is None else grad_logp.float().contiguous(),
        dummy if grad_entropy is None else grad_entropy.float().contiguous(),
        v, 1.0 / temperature, ignore_index,
        BLOCK_V=block, HAS_GRAD_LOGP=grad_logp is not None, HAS_GRAD_ENTROPY=grad_entropy is not None,
        num_warps=num_warps,
    )
    return out
