"""Memory-lean PyTorch row kernels: the same maths as the Triton kernels, a chunk of rows at a time.

Only one chunk's fp32 copy of the logits exists at once, so the extra memory is
``default_chunk_rows(V) * V * 4`` bytes (16 MiB) instead of a full fp32 ``[N, V]`` copy (or two, with the softmax).
"""

from __future__ import annotations

from typing import Iterator, NamedTuple, Optional, Tuple

import torch

# 4M elements (16 MiB of fp32) per chunk: each op still streams megabytes, while the two or three
# fp32 working buffers of a chunk stay small next to the logits themselves.
CHUNK_ELEMENTS = 1 << 22
_LOWEST = torch.finfo(torch.float32).min
# exp(z) is 0 in fp32 below z = -104 (2^-149 is the smallest subnormal): clamping z here changes no
# product e * (a z + b), and keeps a * z finite for any |a| < 1e36 (at -FLT_MAX, |a| > 1 overflowed to inf
# and gave 0 * inf = NaN at a -inf logit).
_Z_FLOOR = -256.0


class _FloorLogp(torch.autograd.Function):
    """``logp.clamp(min=-FLT_MAX)`` with the gradient of ``logp`` itself (identity)."""

    @staticmethod
    def forward(ctx, logp):
        return logp.clamp(min=_LOWEST)

    @staticmethod
    def backward(ctx, grad):
        return grad


def floor_logp(logp: torch.Tensor) -> torch.Tensor:
    """A log-prob below float32's range (a gap of 3e38 over a temperature below 1, or a -inf logit)
    is returned as float32's lowest finite value on every backend, not -inf, so that a ratio
    ``exp(logp - old)`` or ``logp - logp.detach()`` stays finite; the gradient is that of the exact
    log-prob (``(onehot - p) / T``: the row kernels form it from the softmax, not through the clamp).
    NaN stays NaN. Differentiable (the reference's higher-order gradients pass through)."""
    return _FloorLogp.apply(logp)


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


def _capped(x: torch.Tensor, softcap: Optional[float], logit_scale: float) -> torch.Tensor:
    """A fresh fp32 copy of a chunk as the softmax sees it before the slope :func:`_slope`: the raw
    logits, or ``softcap * tanh(logit_scale * x / softcap)`` (transformed in place)."""
    y = x.to(torch.float32, copy=True)
    if softcap is not None:
        if logit_scale != 1.0:
            y.mul_(logit_scale)
        y.div_(softcap).tanh_().mul_(softcap)
    return y


def _slope(temperature: float, softcap: Optional[float], logit_scale: float) -> float:
    """``k`` with ``z = k * y`` (``y`` from :func:`_capped`): ``logit_scale / T``, or ``1 / T`` with a cap.

    The row max is taken of ``y`` and the shift formed as ``(y - max) * k``, never ``y * k - max * k``:
    a finite logit near FLT_MAX over a temperature below 1 would overflow to inf (and give NaN) the
    other way, as in the Triton kernels, which keep the raw max too.
    """
    return (1.0 if softcap is not None else logit_scale) / temperature


def _shifted(x: torch.Tensor, row_max: torch.Tensor, temperature: float, softcap: Optional[float],
             logit_scale: float) -> torch.Tensor:
    """``z - max z`` in fp32, a fresh buffer: ``(y - row_max) * k`` (``row_max`` of ``y``, [..., 1])."""
    k = _slope(temperature, softcap, logit_scale)
    y = _capped(x, softcap, logit_scale).sub_(row_max)
    return y.mul_(k) if k != 1.0 else y


def log_normalizer(row_max: torch.Tensor, log_sum: torch.Tensor, temperature: float, softcap: Optional[float],
                   logit_scale: float) -> torch.Tensor:
    """``log sum_j exp(z_j)`` in nats from :func:`forward_rows`' ``row_max`` (of :func:`_capped`, before
    the slope) and ``log_sum``: ``row_max * k + log_sum``."""
    return row_max * _slope(temperature, softcap, logit_scale) + log_sum


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
    ``row_max`` is the max of :func:`_capped` (before the slope), private to this module.
    """
    temperature, softcap, logit_scale = transform
    shift = _capped(x, softcap, logit_scale)
    row_max = shift.amax(-1, keepdim=True)
    k = _slope(temperature, softcap, logit_scale)
    shift.sub_(row_max)
    if k != 1.0:
        shift.mul_(k)
    e = torch.exp(shift)
    s = e.sum(-1, keepdim=True)
    log_sum = torch.log(s)
    valid = targets != ignore_index
    safe = torch.where(valid, targets, torch.zeros_like(targets)).long().unsqueeze(-1)
    logp = (shift.gather(-1, safe) - log_sum).squeeze(-1).clamp_(min=_LOWEST)  # see floor_logp
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

    Statistics of the transformed logits ``z`` (see :func:`_shifted`); ``row_max`` is the max before
    the slope (:func:`_capped`), for :func:`backward_rows` only."""
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
    temperature, softcap and logit scale: :func:`_chain_rule_`). A target outside ``[0, V)`` (other
    than ``ignore_index``) lies in another rank's vocabulary shard (``grpo_kernels.vocab_parallel``):
    its row has no one-hot term.
    """
    b, t, v = logits.shape
    rows = default_chunk_rows(v)
    for bs, ts in row_chunks(b, t, rows):
        tgt = targets[bs, ts]
        valid = tgt != ignore_index
        # log p = (z - max) - log s, in place in one fp32 buffer; p in a second one.
        log_p = _shifted(logits[bs, ts], row_max[bs, ts].unsqueeze(-1), temperature, softcap, logit_scale)
        log_p.sub_(log_sum[bs, ts].unsqueeze(-1))
        p = torch.exp(log_p)
        if grad_entropy is not None:
            # d H / d z = -p (log p + H); at a -inf logit p = 0, so clamp log p to stay finite.
            log_p.clamp_(min=_LOWEST).add_(entropy[bs, ts].unsqueeze(-1))
            grad = log_p.mul_(p).mul_(-grad_entropy[bs, ts].unsqueeze(-1))
        else:
            grad = log_p.zero_()
        if grad_logp is not None:
            g = grad_logp[bs, ts].unsqueeze(-1)
            in_row = valid & (tgt >= 0) & (tgt < v)
            safe = torch.where(in_row, tgt, torch.zeros_like(tgt)).long().unsqueeze(-1)
            # The target's g * (1 - p) uses -expm1(log p), accurate when p ~ 1, formed in fp32
            # before the one rounding, so a confident prediction keeps its small gradient.
            log_p_target = (_shifted(logits[bs, ts].gather(-1, safe), row_max[bs, ts].unsqueeze(-1), temperature,
                                     softcap, logit_scale) - log_sum[bs, ts].unsqueeze(-1))
            target_term = g * -torch.expm1(log_p_target) + grad.gather(-1, safe)
            grad.sub_(p.mul_(g))
            # a row whose target is in another shard keeps its -g p entry at column 0
            target_term = torch.where(in_row.unsqueeze(-1), target_term, grad.gather(-1, safe))
            grad.scatter_(-1, safe, target_term)
        _chain_rule_(grad, logits[bs, ts], temperature, softcap, logit_scale)
        grad.masked_fill_(~valid.unsqueeze(-1), 0.0)  # after the chain rule: a masked row is never read
        out[bs, ts] = grad.to(out.dtype)
    return out


# Elements per block of rows in the fused pass (4 MiB of fp32; at least one row): the block's exp
# buffer then comes from the allocator's heap instead of a fresh mapping faulted in on every call,
# and the first of the sweeps over a block is the only one that reads memory. Measurements:
# benchmarks/results/block_elements_cpu.md.
BLOCK_ELEMENTS = 1 << 20


class RowGradient(NamedTuple):
    """What :func:`forward_backward_rows` leaves: per-row log-prob and entropy (float32 [n]) and, when
    the gradient is factored, ``row_scale`` and ``target_grad`` (float32 [n]; else both ``None`` and
    the buffer holds ``d loss / d logits`` itself)."""

    logp: torch.Tensor
    entropy: torch.Tensor
    row_scale: Optional[torch.Tensor] = None
    target_grad: Optional[torch.Tensor] = None


@torch.no_grad()
def forward_backward_rows(logits: torch.Tensor, targets: torch.Tensor, temperature: float, ignore_index: int,
                          coefficients, factored: bool = False) -> RowGradient:
    """Log-prob and entropy of each row, then ``d loss / d logits``, over ``logits`` in place.

    logits [n, V] (contiguous rows the caller owns, any float dtype), targets [n]. After the first
    sweep ``coefficients(logp [n], entropy [n])`` (fp32) gives ``(d loss/d logp [n], d loss/d entropy
    [n] or None)``. The same maths as :func:`forward_rows` then :func:`backward_rows`, over blocks of
    rows (:data:`BLOCK_ELEMENTS`). With ``z`` the logits over the temperature minus the row max,
    ``e = exp(z)``, ``s = sum e``, ``p = e / s``, ``log p = z - log s`` and ``H = log s - sum e z / s``:

        d z = g_logp (onehot - p) - g_entropy p (log p + H) = e (a z + b) + g_logp onehot,
        a = -g_entropy / s,  b = -(g_logp + g_entropy (H - log s)) / s,

    and at the target ``g_logp (1 - p_t) - g_entropy p_t (log p_t + H)`` with ``1 - p_t = -expm1(log p_t)``
    (accurate for a confident token). ``d logits = d z / temperature``. Rows whose target is
    ``ignore_index`` give 0 and a zero gradient.

    ``factored=True`` and no entropy gradient (``a = 0``): the gradient is ``b e`` off the target, so
    the buffer is left holding ``e'`` (``e`` with 0 at the target and on ignored rows) and the result
    carries ``row_scale = b / T`` and ``target_grad`` (the target's entry / T):

        d logits = row_scale[:, None] * e' + onehot(targets) * target_grad[:, None],

    which the caller folds into its matmuls (``d hidden = row_scale * (e' @ W) + target_grad * W[t]``),
    saving the pass that would scale the buffer; the target's entry stays the accurate one. One sweep
    reads the logits and writes ``e'``. Otherwise a second sweep writes the gradient (from ``z``, or
    from ``log e`` when ``factored`` was asked but the loss has an entropy term).
    """
    n, v = logits.shape
    device = logits.device
    f32 = dict(dtype=torch.float32, device=device)
    row_max, sums, dot, target_z = (torch.empty(n, 1, **f32) for _ in range(4))
    block = max(1, BLOCK_ELEMENTS // v)
    fp32 = logits.dtype == torch.float32
    # fp32 logits hold z themselves unless factored (then they take e'); exp needs its own buffer
    # except when it is written straight over fp32 logits
    z_buf = None if fp32 and not factored else torch.empty(min(block, n), v, **f32)
    e_buf = None if fp32 and factored else torch.empty(min(block, n), v, **f32)
    valid = targets != ignore_index
    # (an optimisation only: under torch.compile the masks always run, no data-dependent branch)
    all_valid = False if torch.compiler.is_compiling() else bool(valid.all())
    safe = torch.where(valid, targets, torch.zeros_like(targets)).long().unsqueeze(-1)
    inv_t = 1.0 / temperature

    for r0 in range(0, n, block):  # sweep 1: statistics; z (or e') left over the logits
        rows = slice(r0, min(n, r0 + block))
        k = rows.stop - r0
        x = logits[rows]
        # z = (x - max x) / T, in fp32 (over fp32 logits unless factored); the shift before the
        # division, so a finite logit near FLT_MAX at T < 1 does not overflow (as in _slope)
        z = x if fp32 and not factored else z_buf[:k]
        src = x if fp32 else z.copy_(x)  # 16-bit logits: every operation below in fp32
        torch.amax(src, -1, keepdim=True, out=row_max[rows])
        torch.sub(src, row_max[rows], out=z)
        if temperature != 1.0:
            z.mul_(inv_t)
        torch.gather(z, -1, safe[rows], out=target_z[rows])
        e = x if fp32 and factored else e_buf[:k]
        torch.exp(z, out=e)
        torch.sum(e, -1, keepdim=True, out=sums[rows])
        # sum e z: a -inf logit has e = 0 and must add 0, not 0 * -inf, so z is clamped to the lowest
        # finite value first (exp of it is 0 as well; a NaN logit stays NaN)
        z.clamp_(min=_LOWEST)
        if factored:  # e' over the logits; z's buffer takes the product
            torch.sum(z.mul_(e), -1, keepdim=True, out=dot[rows])
            if e is not x:
                x.copy_(e)
            x.scatter_(-1, safe[rows], 0.0)
            if not all_valid:
                x.masked_fill_(~valid[rows].unsqueeze(-1), 0.0)
        else:  # z stays over fp32 logits; e's buffer takes the product (sweep 2 recomputes e)
            torch.sum(e.mul_(z), -1, keepdim=True, out=dot[rows])
    log_sum = sums.log()
    zero = torch.zeros((), **f32)
    logp = torch.where(valid, (target_z - log_sum).squeeze(-1).clamp_(min=_LOWEST), zero)  # see floor_logp
    entropy = torch.where(valid, (log_sum - dot / sums).squeeze(-1), zero)
    g_logp, g_entropy = coefficients(logp, entropy)
    g_logp = torch.where(valid, g_logp.float(), zero).unsqueeze(-1) / temperature
    b = -g_logp / sums
    target_term = g_logp * -torch.expm1(logp.unsqueeze(-1))
    if factored and g_entropy is None:
        return RowGradient(logp, entropy, b.squeeze(-1), target_term.squeeze(-1))
    if g_entropy is not None:
        g_entropy = torch.where(valid, g_entropy.float(), zero).unsqueeze(-1) / temperature
        a = -g_entropy / sums
        b = b - g_entropy * (entropy.unsqueeze(-1) - log_sum) / sums
        target_term = target_term - g_entropy * logp.exp().unsqueeze(-1) * (logp + entropy).unsqueeze(-1)
    for r0 in range(0, n, block):  # sweep 2: the gradient, over the logits
        rows = slice(r0, min(n, r0 + block))
        k = rows.stop - r0
        x = logits[rows]
        if factored:  # x holds e': z = log e' (e' = 0 gives the floor, and a term e' (a z + b) = 0)
            e = x if fp32 else e_buf[:k].copy_(x)
            z = torch.log(e, out=z_buf[:k])
        elif fp32:
            z = x
        else:  # z again from the 16-bit logits (the statistics are the first sweep's)
            z = z_buf[:k].copy_(x).sub_(row_max[rows])
            if temperature != 1.0:
                z.mul_(inv_t)
        if g_entropy is None:
            grad = z.exp_().mul_(b[rows])
        else:  # z clamped: at a -inf logit e = 0 and the term is 0, not 0 * inf
            e = e if factored else torch.exp(z, out=e_buf[:k])
            grad = torch.addcmul(b[rows], z.clamp_(min=_Z_FLOOR), a[rows], out=z).mul_(e)
        grad.scatter_(-1, safe[rows], target_term[rows])
        if not all_valid:
            grad.masked_fill_(~valid[rows].unsqueeze(-1), 0.0)
        if grad is not x:  # (in-place ops return their tensor itself; no data_ptr, which dynamo cannot compare)
            x.copy_(grad)
    return RowGradient(logp, entropy)
