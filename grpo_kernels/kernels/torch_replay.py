"""Sampling-mask replay in plain PyTorch: log-probs over each row's kept set, reading only the kept entries.

The row-kernel contract (``notes``: the same signatures as ``kernels/triton_replay.py``): ``N`` rows, the
kept sets in CSR form (``token_ids [K]`` int64 global ids, ``offsets [N + 1]`` int64), each set ``S_i``
of ``k_i >= 0`` entries. With ``z`` the transformed logits (``options.LogitTransform``)::

    z = softcap * tanh(logit_scale * x / softcap) / T      (softcap None: z = logit_scale * x / T)
    lse_i = logsumexp_{j in S_i} z_j,   p_j = exp(z_j - lse_i)
    logp_i = z_{t_i} - lse_i  if t_i in S_i  else -inf
    H_i = -sum_j p_j log p_j = lse_i - sum_j p_j z_j,    sum_sq_i = sum_j p_j^2

and the backward, per kept entry ``j`` of row ``i`` (``g`` = d loss / d logp_i, ``e`` = d loss / d H_i)::

    dz_j = g ([j == t_i] - p_j) - e p_j (log p_j + H_i)      (d log p_t / d z_j, d H / d z_j = -p_j (log p_j + H))
    dx_j = dz_j dz/dx,   dz/dx = logit_scale (1 - tanh(logit_scale x / softcap)^2) / T   (softcap None: logit_scale / T)

An empty set gives ``lse = -inf``, ``logp = -inf``, ``H = 0``, ``sum_sq = 0`` and no gradient; a kept entry
whose logit is ``-inf`` has ``z = -inf``, ``p = 0`` (vLLM's banned token).

Work is vectorised over the ``K`` entries, never over rows. The fused-linear functions gather the kept
weight rows (and the matching hidden rows) in chunks of entries of at most :data:`ENTRY_CHUNK_BYTES`,
so the forward reads only the kept rows of ``weight``; their backward writes ``d weight`` only on the
kept ids, each id's entries summed in one fixed order (the entries sorted by id once, a stable sort),
with no atomics: the same bits on every run. ``d hidden`` sums each row's entries in CSR order.

Rows with a large set are cheaper dense (:data:`DENSE_ROW_FRACTION`): :func:`dense_forward` /
:func:`dense_backward` do the masked softmax on a block of materialised logits rows; the callers
(``autograd``) send each row one way or the other.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

Temperature = Union[float, torch.Tensor]

# A row whose set holds more than V / DENSE_ROW_FRACTION ids takes the dense masked path. Per kept id the
# sparse path gathers a weight row and a hidden row, three times over forward and backward (6 H scattered
# reads and 3 H multiply-adds at memory speed); the dense path forms the row's V logits in matmuls that
# stream the weight once per chunk of rows, at the machine's matmul rate (6 H V flops a row). On the 2-core
# CPU the fused-linear head with every set of size V/100 took 0.6-0.7x the full pass, at V/20 3x (N = 1024,
# H = 1024, V = 16384, fp32): the two cost the same near k = V/60, so rows above V/64 go dense and replay
# never costs much more than the plain full-vocabulary pass (the dense path is that pass plus a masked
# fill). A GPU gathers at a larger share of its matmul rate, so this errs toward the dense side there.
DENSE_ROW_FRACTION = 64
# Most bytes of one chunk's gathered rows (per gathered operand, fp32): the fused-linear passes gather
# the kept weight rows and their hidden rows a chunk of entries at a time, never all K x H at once, into
# buffers reused chunk after chunk (256 KiB: 64 entries at H = 1,024; the workspace stays a few MiB at
# N = 4,096, V = 151,936, mean set 8, while the gathers still stream megabytes per call).
ENTRY_CHUNK_BYTES = 256 << 10


def dense_rows(sizes: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [N]: the rows whose set is large enough for the dense path (``k_i * DENSE_ROW_FRACTION > V``)."""
    return sizes * DENSE_ROW_FRACTION > vocab_size


# --------------------------------------------------------------------------------------------------
# shared pieces
# --------------------------------------------------------------------------------------------------
def entry_rows(offsets: torch.Tensor) -> torch.Tensor:
    """[K] int64: the row of each entry."""
    n = offsets.numel() - 1
    sizes = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(torch.arange(n, device=offsets.device), sizes,
                                   output_size=int(offsets[-1]) if n else 0)


def _segment_sum(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Per-segment sums of consecutive entries of ``values`` [E] or [E, H] (segments of ``lengths``, 0
    allowed -> 0), in a fixed order: ``segment_reduce`` (a segmented reduction, no atomics) off the CPU;
    on a CPU ``index_add_`` (sequential there, and faster)."""
    if values.device.type == "cpu":
        seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=values.device), lengths,
                                      output_size=values.shape[0])
        out = values.new_zeros((lengths.numel(),) + tuple(values.shape[1:]))
        return out.index_add_(0, seg, values)
    return torch.segment_reduce(values, "sum", lengths=lengths, axis=0, unsafe=True)


def _segment_max(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Per-segment max of [E] (an empty segment: -inf)."""
    return torch.segment_reduce(values, "max", lengths=lengths, unsafe=True)


def _row_factor(temperature: Temperature, logit_scale: float, softcap: Optional[float], rows: Optional[torch.Tensor]):
    """The slope before (``softcap``: after) the cap, per entry: ``logit_scale / T`` (``1 / T`` with a cap),
    in float64 then float32 (a tensor of temperatures gives what each float gives); ``rows`` picks each
    entry's row of a per-row temperature."""
    scale = 1.0 if softcap is not None else logit_scale
    if not isinstance(temperature, torch.Tensor):
        return scale / temperature
    t = temperature.reshape(-1)
    t = t if rows is None else t.index_select(0, rows)
    return (scale / t.double()).float()


def transform(x: torch.Tensor, temperature: Temperature, softcap: Optional[float], logit_scale: float,
              rows: Optional[torch.Tensor] = None, with_slope: bool = False):
    """``z`` (fp32, the shape of ``x``) of raw logits ``x``, and with ``with_slope`` ``dz/dx``; a ``-inf``
    logit gives ``z = -inf`` (under a cap too: a banned token stays banned). ``rows`` [len(x)] maps a flat
    ``x`` [E] to a per-row temperature's rows; for a block ``x`` [c, V] the temperature is [c] (or a float)."""
    x = x.float()
    factor = _row_factor(temperature, logit_scale, softcap, rows)
    if isinstance(factor, torch.Tensor) and x.dim() == 2:
        factor = factor.unsqueeze(-1)
    if softcap is None:
        z = x * factor
        slope = factor
    else:
        th = torch.tanh(x * (logit_scale / softcap))
        z = th * softcap * factor
        slope = (1 - th * th) * (logit_scale * factor) if with_slope else None
    z = torch.where(x == float("-inf"), torch.full((), float("-inf"), device=z.device), z)
    return (z, slope) if with_slope else z


def set_stats(z: torch.Tensor, is_target: torch.Tensor, sizes: torch.Tensor, row_of: torch.Tensor,
              with_entropy: bool, with_sum_sq: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, entropy, sum_sq, lse) [N] fp32 from the kept entries' ``z`` [K] (CSR order), ``is_target`` [K]."""
    n = sizes.numel()
    m = _segment_max(z, sizes) if z.numel() else torch.full((n,), float("-inf"), device=z.device)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # (an empty or all -inf row: no shift)
    shifted = z - m_safe.index_select(0, row_of)
    e = torch.exp(shifted)
    s = _segment_sum(e, sizes)
    lse = m_safe + torch.log(s)  # -inf for an empty row
    in_set = _segment_sum(is_target.float(), sizes) > 0
    z_t = _segment_sum(torch.where(is_target, z, torch.zeros_like(z)), sizes)
    ok = in_set & (z_t > float("-inf"))
    logp = torch.where(ok, z_t - torch.where(ok, lse, torch.zeros_like(lse)),
                       torch.full((), float("-inf"), device=z.device))
    logp = torch.where(torch.isnan(lse) | torch.isnan(z_t), torch.full_like(logp, float("nan")), logp)
    zero = torch.zeros(n, dtype=torch.float32, device=z.device)
    entropy, sum_sq = zero, zero.clone()  # (two buffers: a caller may write rows into each)
    if with_entropy or with_sum_sq:
        s_safe = torch.where(s > 0, s, torch.ones_like(s))
        p = e / s_safe.index_select(0, row_of)
        if with_entropy:
            # H = log s - sum p (z - m): no cancellation between lse and sum p z for large logits
            pz = torch.where(p > 0, p * shifted, torch.zeros_like(p))
            entropy = torch.where(s > 0, torch.log(s_safe) - _segment_sum(pz, sizes), zero)
        if with_sum_sq:
            sum_sq = _segment_sum(p * p, sizes)
    return logp, entropy, sum_sq, lse


def set_grad(z: torch.Tensor, is_target: torch.Tensor, row_of: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
             grad_logp: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor]) -> torch.Tensor:
    """``dz`` [E] fp32 of entries (their ``z``, ``row_of`` indexing the [N] row values)."""
    lse_e = lse.index_select(0, row_of)
    finite = lse_e > float("-inf")
    log_p = torch.where(finite, z - torch.where(finite, lse_e, torch.zeros_like(lse_e)),
                        torch.full((), float("-inf"), device=z.device))
    p = torch.exp(log_p)
    dz = torch.zeros_like(z)
    if grad_logp is not None:
        g = grad_logp.float().index_select(0, row_of)
        dz = g * (is_target.float() - p)
    if grad_entropy is not None:
        ge = grad_entropy.float().index_select(0, row_of)
        # dH/dz_j = -p_j (log p_j + H); 0 where p_j == 0 (log p = -inf there)
        term = torch.where(p > 0, p * (log_p + entropy.index_select(0, row_of)), torch.zeros_like(p))
        dz = dz - ge * term
    return dz


def _boundaries(offsets: torch.Tensor, per_chunk: int) -> list:
    """Chunks of whole segments, ``[(r0, r1, e0, e1)]``, each about ``per_chunk`` entries (a segment
    larger than that alone), from the CSR ``offsets``; one device sync."""
    n = offsets.numel() - 1
    k = int(offsets[-1]) if n else 0
    if n == 0:
        return []
    marks = torch.arange(0, max(k, 1), per_chunk, device=offsets.device)
    starts = torch.searchsorted(offsets[:-1].contiguous(), marks, right=True) - 1
    starts = torch.unique_consecutive(torch.cat([starts.clamp(min=0), starts.new_tensor([n])]))
    rows = starts.tolist()
    if rows[0] != 0:
        rows = [0] + rows
    ends = offsets.index_select(0, torch.tensor(rows, device=offsets.device)).tolist()
    return [(rows[i], rows[i + 1], ends[i], ends[i + 1]) for i in range(len(rows) - 1)]


def _entries_per_chunk(hidden_size: int) -> int:
    return max(1, ENTRY_CHUNK_BYTES // (4 * max(1, hidden_size)))


# --------------------------------------------------------------------------------------------------
# from hidden states: the kept rows of the weight only
# --------------------------------------------------------------------------------------------------
class _Gathers:
    """Reused buffers for gathered rows, ``[per_chunk, H]`` fp32 (and one in the source's dtype when that is
    not fp32): a fresh buffer per chunk would be mapped and faulted in anew each time on a CPU."""

    def __init__(self, per_chunk: int, hidden_size: int, device: torch.device) -> None:
        self.shape, self.device = (per_chunk, hidden_size), device
        self.fp32: dict = {}
        self.raw: dict = {}

    def rows(self, source: torch.Tensor, index: torch.Tensor, slot: str) -> torch.Tensor:
        """``source[index]`` as fp32 [len(index), H], in buffer ``slot``."""
        e = index.numel()
        rows = max(e, self.shape[0])
        if slot not in self.fp32 or self.fp32[slot].shape[0] < e:
            self.fp32[slot] = torch.empty(rows, self.shape[1], dtype=torch.float32, device=self.device)
        out = self.fp32[slot][:e]
        if source.dtype == torch.float32:
            return torch.index_select(source, 0, index, out=out)
        if slot not in self.raw or self.raw[slot].shape[0] < e or self.raw[slot].dtype != source.dtype:
            self.raw[slot] = torch.empty(rows, self.shape[1], dtype=source.dtype, device=self.device)
        return out.copy_(torch.index_select(source, 0, index, out=self.raw[slot][:e]))


def _kept_logits(hidden, weight, bias, ids, rows, gathers: _Gathers) -> torch.Tensor:
    """``x_j = hidden[rows_j] . weight[ids_j] + bias[ids_j]`` [E] fp32 (fp32 products and sums), with the
    gathered weight rows ``w [E, H]`` fp32 (a reused buffer)."""
    w = gathers.rows(weight, ids, "w")
    h = gathers.rows(hidden, rows, "h")
    x = h.mul_(w).sum(-1)  # (the products in h's buffer: w stays for d hidden)
    if bias is not None:
        x = x + bias.index_select(0, ids).float()
    return x, w


def replay_linear_forward(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          targets: torch.Tensor, token_ids: torch.Tensor, offsets: torch.Tensor,
                          temperature: Temperature, softcap: Optional[float], logit_scale: float,
                          with_entropy: bool, with_sum_sq: bool):
    """(logp, entropy, sum_sq, lse) [N] fp32 of ``hidden [N, H] @ weight[S_i]^T (+ bias)`` over each set;
    reads only the kept rows of ``weight`` (and ``bias``), a chunk of entries at a time."""
    n = hidden.shape[0]
    sizes = offsets[1:] - offsets[:-1]
    row_of = entry_rows(offsets)
    z = torch.empty(token_ids.numel(), dtype=torch.float32, device=hidden.device)
    per_chunk = _entries_per_chunk(hidden.shape[1])
    gathers = _Gathers(min(per_chunk, token_ids.numel()), hidden.shape[1], hidden.device)
    for r0, r1, e0, e1 in _boundaries(offsets, per_chunk):
        rows = row_of[e0:e1]
        x, _ = _kept_logits(hidden, weight, bias, token_ids[e0:e1], rows, gathers)
        z[e0:e1] = transform(x, temperature, softcap, logit_scale, rows)
    is_target = token_ids == targets.index_select(0, row_of) if n else torch.zeros(0, dtype=torch.bool)
    return set_stats(z, is_target, sizes, row_of, with_entropy, with_sum_sq)


def replay_linear_backward(hidden, weight, bias, targets, token_ids, offsets, lse, entropy, grad_logp, grad_entropy,
                           temperature, softcap, logit_scale, needs_hidden_grad: bool, needs_weight_grad: bool,
                           needs_bias_grad: bool):
    """(d hidden [N, H] hidden's dtype | None, d weight [V, H] weight's dtype | None, d bias [V] | None).

    Pass 1, entries in CSR order (chunks of whole rows): the kept logits again, ``dz``, ``dx``, and
    ``d hidden_i = sum_{j in S_i} dx_j weight[id_j]`` (fp32, each row's entries in order). Pass 2, the
    entries sorted by id once (stable): ``d weight[v] = sum_{id_j = v} dx_j hidden[row_j]`` per id run, each
    run summed whole in one chunk and written once (no accumulation across launches): deterministic, and
    ``d weight`` is zero off the kept ids."""
    n, hsize = hidden.shape
    sizes = offsets[1:] - offsets[:-1]
    row_of = entry_rows(offsets)
    is_target = token_ids == targets.index_select(0, row_of)
    dx = torch.empty(token_ids.numel(), dtype=torch.float32, device=hidden.device)
    d_hidden = torch.zeros(n, hsize, dtype=hidden.dtype, device=hidden.device) if needs_hidden_grad else None
    per_chunk = _entries_per_chunk(hsize)
    gathers = _Gathers(min(per_chunk, token_ids.numel()), hsize, hidden.device)
    for r0, r1, e0, e1 in _boundaries(offsets, per_chunk):
        rows = row_of[e0:e1]
        x, w = _kept_logits(hidden, weight, bias, token_ids[e0:e1], rows, gathers)
        z, slope = transform(x, temperature, softcap, logit_scale, rows, with_slope=True)
        dz = set_grad(z, is_target[e0:e1], rows, lse, entropy, grad_logp, grad_entropy)
        dx[e0:e1] = dz * slope
        if needs_hidden_grad:
            d_hidden[r0:r1] = _segment_sum(w.mul_(dx[e0:e1].unsqueeze(-1)), sizes[r0:r1]).to(hidden.dtype)
    d_weight = d_bias = None
    if needs_weight_grad or needs_bias_grad:
        order = torch.argsort(token_ids, stable=True)
        ids_sorted = token_ids.index_select(0, order)
        uniq, counts = torch.unique_consecutive(ids_sorted, return_counts=True)
        run_offsets = torch.zeros(uniq.numel() + 1, dtype=torch.int64, device=hidden.device)
        torch.cumsum(counts, 0, out=run_offsets[1:])
        dx_sorted = dx.index_select(0, order)
        if needs_weight_grad:
            d_weight = torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)
            rows_sorted = row_of.index_select(0, order)
            for u0, u1, e0, e1 in _boundaries(run_offsets, per_chunk):
                h = gathers.rows(hidden, rows_sorted[e0:e1], "h").mul_(dx_sorted[e0:e1].unsqueeze(-1))
                d_weight.index_copy_(0, uniq[u0:u1], _segment_sum(h, counts[u0:u1]).to(weight.dtype))
        if needs_bias_grad:
            d_bias = torch.zeros(weight.shape[0], dtype=bias.dtype, device=weight.device)
            d_bias.index_copy_(0, uniq, _segment_sum(dx_sorted, counts).to(bias.dtype))
    return d_hidden, d_weight, d_bias


# --------------------------------------------------------------------------------------------------
# from logits: the kept entries only
# --------------------------------------------------------------------------------------------------
def replay_rows_forward(logits: torch.Tensor, targets: torch.Tensor, token_ids: torch.Tensor, offsets: torch.Tensor,
                        temperature: Temperature, softcap: Optional[float], logit_scale: float, with_entropy: bool,
                        with_sum_sq: bool):
    """(logp, entropy, sum_sq, lse) [N] fp32 over each row's set of ``logits [N, V]`` (any row stride);
    reads only the kept entries."""
    sizes = offsets[1:] - offsets[:-1]
    row_of = entry_rows(offsets)
    z = transform(logits[row_of, token_ids], temperature, softcap, logit_scale, row_of)
    is_target = token_ids == targets.index_select(0, row_of)
    return set_stats(z, is_target, sizes, row_of, with_entropy, with_sum_sq)


def replay_rows_backward(logits, targets, token_ids, offsets, lse, entropy, grad_logp, grad_entropy,
                         temperature, softcap, logit_scale, out: torch.Tensor) -> None:
    """Writes ``d logits`` into ``out [N, V]`` (the whole rows: ``dx`` at the kept entries, 0 elsewhere)."""
    row_of = entry_rows(offsets)
    z, slope = transform(logits[row_of, token_ids], temperature, softcap, logit_scale, row_of, with_slope=True)
    is_target = token_ids == targets.index_select(0, row_of)
    dz = set_grad(z, is_target, row_of, lse, entropy, grad_logp, grad_entropy)
    out.zero_()
    out.index_put_((row_of, token_ids), (dz * slope).to(out.dtype))


# --------------------------------------------------------------------------------------------------
# the dense masked path: a block of rows with large sets, their logits materialised
# --------------------------------------------------------------------------------------------------
def kept_block(token_ids: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [c, V]: the sets of ``c`` rows as a mask."""
    n = offsets.numel() - 1
    keep = torch.zeros(n, vocab_size, dtype=torch.bool, device=token_ids.device)
    keep[entry_rows(offsets), token_ids] = True
    return keep


def _block_targets(targets: torch.Tensor, keep: torch.Tensor):
    """(targets [c, 1] safe to gather, bool [c, 1]: the target is a kept column); a target outside
    ``[0, V)`` (another vocabulary shard's: -1) is in no set."""
    t = targets.long().unsqueeze(-1)
    inside = (t >= 0) & (t < keep.shape[-1])
    t = torch.where(inside, t, torch.zeros_like(t))
    return t, keep.gather(-1, t) & inside


def _masked_z(x: torch.Tensor, keep: torch.Tensor, temperature: Temperature, softcap, logit_scale, with_slope=False):
    out = transform(x, temperature, softcap, logit_scale, with_slope=with_slope)
    z = out[0] if with_slope else out
    z.masked_fill_(~keep, float("-inf"))
    return out


def dense_forward(x: torch.Tensor, targets: torch.Tensor, token_ids: torch.Tensor, offsets: torch.Tensor,
                  temperature: Temperature, softcap: Optional[float], logit_scale: float, with_entropy: bool,
                  with_sum_sq: bool):
    """:func:`replay_rows_forward` on a block of materialised logits ``x [c, V]`` (every entry read):
    the transformed row, ``-inf`` off the set, then the softmax statistics. ``temperature`` a float or [c]."""
    keep = kept_block(token_ids, offsets, x.shape[1])
    z = _masked_z(x, keep, temperature, softcap, logit_scale)
    lse = torch.logsumexp(z, dim=-1)
    t, hit = _block_targets(targets, keep)
    finite = lse > float("-inf")
    lse_safe = torch.where(finite, lse, torch.zeros_like(lse))
    z_t = z.gather(-1, t).squeeze(-1)
    ok = hit.squeeze(-1) & (z_t > float("-inf"))
    logp = torch.where(ok, z_t - lse_safe, torch.full((), float("-inf"), device=x.device))
    logp = torch.where(torch.isnan(lse), lse, logp)
    entropy = sum_sq = torch.zeros_like(lse)
    if with_entropy or with_sum_sq:
        log_p = z.sub_(lse_safe.unsqueeze(-1))  # (z reused: log p, -inf off the set)
        p = torch.exp(log_p)
        if with_sum_sq:
            sum_sq = (p * p).sum(-1)
        if with_entropy:
            entropy = torch.where(finite, -(p.mul_(log_p.masked_fill_(p == 0, 0.0))).sum(-1), torch.zeros_like(lse))
    return logp, entropy, sum_sq, lse


def dense_backward(x: torch.Tensor, targets: torch.Tensor, token_ids: torch.Tensor, offsets: torch.Tensor,
                   lse: torch.Tensor, entropy: torch.Tensor, grad_logp: Optional[torch.Tensor],
                   grad_entropy: Optional[torch.Tensor], temperature: Temperature, softcap: Optional[float],
                   logit_scale: float) -> torch.Tensor:
    """``d x`` [c, V] fp32 of a block of materialised logits (0 off the sets)."""
    keep = kept_block(token_ids, offsets, x.shape[1])
    z, slope = _masked_z(x, keep, temperature, softcap, logit_scale, with_slope=True)
    finite = (lse > float("-inf")).unsqueeze(-1)
    log_p = z.sub_(torch.where(finite, lse.unsqueeze(-1), torch.zeros_like(lse).unsqueeze(-1)))
    log_p.masked_fill_(~finite, float("-inf"))
    p = torch.exp(log_p)
    grad = torch.zeros_like(p)
    if grad_entropy is not None:
        # dH/dz_j = -p_j (log p_j + H), 0 where p_j == 0
        grad = -(p * log_p.masked_fill_(p == 0, 0.0).add_(entropy.unsqueeze(-1))) * grad_entropy.float().unsqueeze(-1)
    if grad_logp is not None:
        g = grad_logp.float().unsqueeze(-1)
        grad.sub_(p * g)
        t, hit = _block_targets(targets, keep)
        grad.scatter_add_(-1, t, torch.where(hit, g, torch.zeros_like(g)))
    return grad.mul_(slope)
