"""Memory-lean PyTorch row kernels: the same maths as the Triton kernels, a chunk of rows at a time.

Only one chunk's fp32 copy of the logits exists at once, so the extra memory is
``default_chunk_rows(V) * V * 4`` bytes (16 MiB) instead of a full fp32 ``[N, V]`` copy (or two, with the softmax).
"""

from __future__ import annotations

from typing import Iterator, Optional, Tuple

import torch

# 4M elements (16 MiB of fp32) per chunk: each op still streams megabytes, while the two or three
# fp32 working buffers of a chunk stay small next to the logits themselves.
CHUNK_ELEMENTS = 1 << 22
_LOWEST = torch.finfo(torch.float32).min


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


def _scaled(x: torch.Tensor, temperature: float, softcap: Optional[float], logit_scale: float) -> torch.Tensor:
    """A fresh fp32 copy of a chunk, transformed in place:
    ``z = softcap * tanh(logit_scale * x / softcap) / temperature`` (no tanh without softcap)."""
    z = x.to(torch.float32, copy=True)
    if logit_scale != 1.0:
        z.mul_(logit_scale)
    if softcap is not None:
        z.div_(softcap).tanh_().mul_(softcap)
    if temperature != 1.0:
        z.div_(temperature)
    return z


def _chain_rule_(grad: torch.Tensor, x: torch.Tensor, temperature: float, softcap: Optional[float], logit_scale: float) -> None:
    """``grad`` (d loss / d z, fp32) times ``dz / dx = logit_scale * (1 - tanh^2(logit_scale x / softcap)) / temperature``."""
    if softcap is not None:
        t = x.to(torch.float32, copy=True).mul_(logit_scale / softcap).tanh_()
        grad.mul_(t.mul_(t).neg_().add_(1.0))
    if logit_scale != 1.0:
        grad.mul_(logit_scale)
    if temperature != 1.0:
        grad.div_(temperature)


def _chunk_logprobs(x: torch.Tensor, targets: torch.Tensor, transform: tuple, ignore_index: int, with_entropy: bool):
    """log-prob, entropy, row max and log-sum of one chunk x [b, t, V]; targets [b, t].

    Two fp32 buffers of the chunk's size: ``shift = z - max`` (in place) and ``e = exp(shift)``.
    """
    shift = _scaled(x, *transform)
    row_max = shift.amax(-1, keepdim=True)
    shift.sub_(row_max)
    e = torch.exp(shift)
    s = e.sum(-1, keepdim=True)
    log_sum = torch.log(s)
    valid = targets != ignore_index
    safe = torch.where(valid, targets, torch.zeros_like(targets)).long().unsqueeze(-1)
    logp = (shift.gather(-1, safe) - log_sum).squeeze(-1)
    if with_entropy:
        # H = log s - sum(e * shift) / s; a -inf logit has e = 0 and must add 0, not 0 * -inf, so
        # clamp shift to the lowest finite value (a NaN stays NaN through clamp).
        shift.clamp_(min=_LOWEST)
        entropy = (log_sum - (e.mul_(shift)).sum(-1, keepdim=True) / s).squeeze(-1)
    else:
        entropy = torch.zeros_like(logp)
    zero = torch.zeros_like(logp)
    keep = lambda t: torch.where(valid, t, zero)  # noqa: E731
    return keep(logp), keep(entropy), keep(row_max.squeeze(-1)), keep(log_sum.squeeze(-1))


@torch.no_grad()
def forward_rows(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    ignore_index: int,
    with_entropy: bool = True,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
):
    """logits [B, T, V] (last dim contiguous), targets [B, T] -> (logp, entropy, row_max, log_sum), fp32 [B, T].

    Statistics of the transformed logits ``z`` (see :func:`_scaled`)."""
    b, t, v = logits.shape
    rows = default_chunk_rows(v)
    outputs = [torch.empty(b, t, dtype=torch.float32, device=logits.device) for _ in range(4)]
    for bs, ts in row_chunks(b, t, rows):
        for out, value in zip(outputs, _chunk_logprobs(logits[bs, ts], targets[bs, ts], (temperature, softcap, logit_scale), ignore_index, with_entropy)):
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
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
) -> torch.Tensor:
    """Write ``d loss / d logits`` [B, T, V] into ``out`` (may be ``logits`` itself) and return it.

    ``dz = g_logp * (onehot - p) + g_entropy * (-p * (log p + H))``, times ``dz / dx`` (the
    temperature, softcap and logit scale: :func:`_chain_rule_`).
    """
    b, t, v = logits.shape
    rows = default_chunk_rows(v)
    for bs, ts in row_chunks(b, t, rows):
        tgt = targets[bs, ts]
        valid = tgt != ignore_index
        # log p = (z - max) - log s, in place in one fp32 buffer; p in a second one.
        log_p = _scaled(logits[bs, ts], temperature, softcap, logit_scale)
        log_p.sub_(row_max[bs, ts].unsqueeze(-1)).sub_(log_sum[bs, ts].unsqueeze(-1))
        p = torch.exp(log_p)
        if grad_entropy is not None:
            # d H / d z = -p (log p + H); at a -inf logit p = 0, so clamp log p to stay finite.
            log_p.clamp_(min=_LOWEST).add_(entropy[bs, ts].unsqueeze(-1))
            grad = log_p.mul_(p).mul_(-grad_entropy[bs, ts].unsqueeze(-1))
        else:
            grad = log_p.zero_()
        if grad_logp is not None:
            g = grad_logp[bs, ts].unsqueeze(-1)
            safe = torch.where(valid, tgt, torch.zeros_like(tgt)).long().unsqueeze(-1)
            # The target's g * (1 - p) uses -expm1(log p), accurate when p ~ 1, formed in fp32
            # before the one rounding, so a confident prediction keeps its small gradient.
            log_p_target = (_scaled(logits[bs, ts].gather(-1, safe), temperature, softcap, logit_scale)
                            - row_max[bs, ts].unsqueeze(-1) - log_sum[bs, ts].unsqueeze(-1))
            target_term = g * -torch.expm1(log_p_target) + grad.gather(-1, safe)
            grad.sub_(p.mul_(g))
            grad.scatter_(-1, safe, target_term)
        _chain_rule_(grad, logits[bs, ts], temperature, softcap, logit_scale)
        grad.masked_fill_(~valid.unsqueeze(-1), 0.0)  # after the chain rule: a masked row is never read
        out[bs, ts] = grad.to(out.dtype)
    return out


# A block of rows whose fp32 working buffers (shifted logits and their exponentials, 2 MiB each)
# stay in the core's cache while the several passes over them run.
BLOCK_ELEMENTS = 1 << 23


@torch.no_grad()
def forward_backward_rows(logits: torch.Tensor, targets: torch.Tensor, temperature: float, ignore_index: int,
                          coefficients) -> Tuple[torch.Tensor, torch.Tensor]:
    """Log-prob and entropy of each row, then ``d loss / d logits`` written over ``logits`` in place.

    logits [n, V] (contiguous rows the caller owns, any float dtype), targets [n]. After the first
    sweep ``coefficients(logp [n], entropy [n])`` (fp32) gives ``(d loss/d logp [n], d loss/d entropy
    [n] or None)``. The same maths as :func:`forward_rows` then :func:`backward_rows`, in fewer passes
    and in blocks of rows that stay in cache. With ``z`` the logits over the temperature minus the row
    max, ``s = sum exp(z)``, ``p = exp(z) / s``, ``log p = z - log s`` and ``H = log s - sum exp(z) z / s``:

        d z = g_logp (onehot - p) - g_entropy p (log p + H) = exp(z) (a z + b) + g_logp onehot,
        a = -g_entropy / s,  b = -(g_logp + g_entropy (H - log s)) / s,

    and at the target ``g_logp (1 - p_t) - g_entropy p_t (log p_t + H)`` with ``1 - p_t = -expm1(log p_t)``
    (accurate for a confident token). ``d logits = d z / temperature``. Rows whose target is
    ``ignore_index`` give 0 and a zero gradient. Returns ``(logp, entropy)`` float32 [n].
    """
    n, v = logits.shape
    device = logits.device
    logp = torch.empty(n, dtype=torch.float32, device=device)
    entropy = torch.empty(n, dtype=torch.float32, device=device)
    row_max = torch.empty(n, 1, dtype=torch.float32, device=device)
    log_sum = torch.empty(n, 1, dtype=torch.float32, device=device)
    block = max(1, BLOCK_ELEMENTS // v)
    in_place = logits.dtype == torch.float32  # fp32 logits hold z between the sweeps
    e_buf = torch.empty(min(block, n), v, dtype=torch.float32, device=device)
    z_buf = None if in_place else torch.empty(min(block, n), v, dtype=torch.float32, device=device)
    valid = targets != ignore_index
    safe = torch.where(valid, targets, torch.zeros_like(targets)).long().unsqueeze(-1)
    all_valid = bool(valid.all())

    def shifted(rows: slice, first: bool) -> torch.Tensor:
        """z = logits / T - max; -inf logits stay -inf (exp gives 0; see the entropy below)."""
        if in_place and not first:
            return logits[rows]  # already z
        z = logits[rows] if in_place else z_buf[: rows.stop - rows.start].copy_(logits[rows])
        if temperature != 1.0:
            z.mul_(1.0 / temperature)
        if first:
            torch.amax(z, -1, keepdim=True, out=row_max[rows])
        return z.sub_(row_max[rows])

    for r0 in range(0, n, block):  # sweep 1: statistics
        rows = slice(r0, min(n, r0 + block))
        z = shifted(rows, True)
        e = torch.exp(z, out=e_buf[: rows.stop - r0])
        s = e.sum(-1, keepdim=True)
        torch.log(s, out=log_sum[rows])
        dot = e.mul_(z).sum(-1, keepdim=True)  # sum e*z in e's buffer (sweep 2 recomputes e)
        bad = torch.isnan(dot).squeeze(-1)
        if bool(bad.any()):
            # A -inf logit has e = 0 and must add 0, not 0 * -inf: those rows again with z clamped to
            # the lowest finite value (rare, so no clamp pass for every row; a NaN logit stays NaN).
            zb = z[bad].clamp(min=_LOWEST)
            dot[bad] = (torch.exp(zb) * zb).sum(-1, keepdim=True)
        entropy[rows] = (log_sum[rows] - dot / s).squeeze(-1)
        logp[rows] = (z.gather(-1, safe[rows]) - log_sum[rows]).squeeze(-1)
    zero = torch.zeros((), dtype=torch.float32, device=device)
    logp, entropy = torch.where(valid, logp, zero), torch.where(valid, entropy, zero)
    g_logp, g_entropy = coefficients(logp, entropy)
    g_logp = torch.where(valid, g_logp.float(), zero).unsqueeze(-1) / temperature
    s = log_sum.exp()
    b = -g_logp / s
    p_t = logp.exp().unsqueeze(-1)
    target_term = g_logp * -torch.expm1(logp.unsqueeze(-1))
    if g_entropy is not None:
        g_entropy = torch.where(valid, g_entropy.float(), zero).unsqueeze(-1) / temperature
        a = -g_entropy / s
        b = b - g_entropy * (entropy.unsqueeze(-1) - log_sum) / s
        target_term = target_term - g_entropy * p_t * (logp + entropy).unsqueeze(-1)
    for r0 in range(0, n, block):  # sweep 2: the gradient, over the logits
        rows = slice(r0, min(n, r0 + block))
        z = shifted(rows, False)
        e = torch.exp(z, out=e_buf[: rows.stop - r0])
        if g_entropy is None:
            grad = torch.mul(e, b[rows], out=z)
        else:  # z clamped: at a -inf logit e = 0 and the term is 0, not 0 * inf
            grad = torch.addcmul(b[rows], z.clamp_(min=_LOWEST), a[rows], out=z).mul_(e)
        grad.scatter_(-1, safe[rows], target_term[rows])
        if not all_valid:
            grad.masked_fill_(~valid[rows].unsqueeze(-1), 0.0)
        if not in_place:
            logits[rows] = grad
    return logp, entropy
