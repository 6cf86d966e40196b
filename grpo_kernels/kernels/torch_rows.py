"""Memory-lean PyTorch row kernels: the same maths as the Triton kernels, a block of rows at a time.

Each pass allocates its fp32 working buffers once, a block of rows each (:func:`block_rows`: 4 MiB
on a CPU, 16 MiB elsewhere), and reuses them for every block: two (three under a truncation), so the
extra memory is ``2 * block_rows(V) * V * 4`` bytes instead of a full fp32 ``[N, V]`` copy (or two,
with the softmax). The backward forms the gradient in ``out``'s own rows when ``out`` is fp32.
"""

from __future__ import annotations

import math
from typing import Iterator, NamedTuple, Optional, Tuple, Union

import torch

from ..options import top_k_rows, top_p_on

# Elements per block of rows on a CPU (4 MiB of fp32; at least one row): a pass's working buffers
# then come from the allocator's heap instead of fresh mappings faulted in on every call, and a block
# stays in the cache across the several sweeps of a pass over it (only the first reads memory).
# Measurements: benchmarks/results/block_elements_cpu.md.
BLOCK_ELEMENTS = 1 << 20
# Elsewhere (a GPU, where every op is a launch): 4M elements (16 MiB of fp32) per block, so each op
# still streams megabytes while the working buffers stay small next to the logits themselves.
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


def block_rows(vocab_size: int, device: torch.device) -> int:
    """Rows per block of a row pass: :data:`BLOCK_ELEMENTS` on a CPU, :data:`CHUNK_ELEMENTS` elsewhere."""
    return max(1, (BLOCK_ELEMENTS if device.type == "cpu" else CHUNK_ELEMENTS) // max(vocab_size, 1))


def _buffers(count: int, rows: int, vocab_size: int, device: torch.device) -> list:
    """``count`` flat fp32 working buffers of ``rows`` rows each (a pass's, reused block after block)."""
    return [torch.empty(rows * vocab_size, dtype=torch.float32, device=device) for _ in range(count)]


def _view(buffer: torch.Tensor, shape) -> torch.Tensor:
    """The first elements of a flat working buffer as a block of ``shape``."""
    return buffer[: math.prod(shape)].view(shape)


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


def _capped(x: torch.Tensor, softcap: Optional[float], logit_scale: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """An fp32 copy of a block as the softmax sees it before the slope :func:`_slope`: the raw
    logits, or ``softcap * tanh(logit_scale * x / softcap)`` (transformed in place); written into
    ``out`` (fp32, of x's shape) when given, else a fresh tensor."""
    y = x.to(torch.float32, copy=True) if out is None else out.copy_(x)
    if softcap is not None:
        if logit_scale != 1.0:
            y.mul_(logit_scale)
        y.div_(softcap).tanh_().mul_(softcap)
    return y


Temperature = Union[float, torch.Tensor]  # a float, or one per row: a tensor of the chunk's leading shape


def _per_row(value: torch.Tensor) -> torch.Tensor:
    """A float64 per-row factor as float32 [..., 1] (rounded once: a tensor holding a float gives the
    float's factor, which torch rounds to float32 when it multiplies a float32 tensor by it)."""
    return value.float().unsqueeze(-1)


def _slope(temperature: Temperature, softcap: Optional[float], logit_scale: float):
    """``k`` with ``z = k * y`` (``y`` from :func:`_capped`): ``logit_scale / T``, or ``1 / T`` with a cap;
    a float, or float32 [..., 1] for a tensor of temperatures (formed in float64, as the float is).

    The row max is taken of ``y`` and the shift formed as ``(y - max) * k``, never ``y * k - max * k``:
    a finite logit near FLT_MAX over a temperature below 1 would overflow to inf (and give NaN) the
    other way, as in the Triton kernels, which keep the raw max too.
    """
    scale = 1.0 if softcap is not None else logit_scale
    if isinstance(temperature, torch.Tensor):
        return _per_row(scale / temperature.double())
    return scale / temperature


def _is_one(k) -> bool:
    """Whether a slope or temperature is the float 1 (then the multiplication is skipped: it is exact)."""
    return not isinstance(k, torch.Tensor) and k == 1.0


def _shifted(x: torch.Tensor, row_max: torch.Tensor, temperature: Temperature, softcap: Optional[float],
             logit_scale: float) -> torch.Tensor:
    """``z - max z`` in fp32, a fresh buffer: ``(y - row_max) * k`` (``row_max`` of ``y``, [..., 1])."""
    k = _slope(temperature, softcap, logit_scale)
    y = _capped(x, softcap, logit_scale).sub_(row_max)
    return y if _is_one(k) else y.mul_(k)


def log_normalizer(row_max: torch.Tensor, log_sum: torch.Tensor, temperature: Temperature, softcap: Optional[float],
                   logit_scale: float) -> torch.Tensor:
    """``log sum_j exp(z_j)`` in nats from :func:`forward_rows`' ``row_max`` (of :func:`_capped`, before
    the slope) and ``log_sum``: ``row_max * k + log_sum``."""
    k = _slope(temperature, softcap, logit_scale)
    return row_max * (k.squeeze(-1) if isinstance(k, torch.Tensor) else k) + log_sum


def _chain_rule_(grad: torch.Tensor, x: torch.Tensor, temperature: Temperature, softcap: Optional[float], logit_scale: float,
                 scratch: torch.Tensor) -> None:
    """``grad`` (d loss / d z, fp32) times ``dz / dx = logit_scale * (1 - tanh^2(logit_scale x / softcap)) / temperature``
    (``scratch``: an fp32 buffer of x's shape for the tanh)."""
    if softcap is not None:
        t = scratch.copy_(x).mul_(logit_scale / softcap).tanh_()
        grad.mul_(t.mul_(t).neg_().add_(1.0))
    if logit_scale != 1.0:
        grad.mul_(logit_scale)
    if isinstance(temperature, torch.Tensor):
        grad.div_(_per_row(temperature.double()))
    elif temperature != 1.0:
        grad.div_(temperature)


def kept_mask(y: torch.Tensor, threshold: torch.Tensor, tie_index: torch.Tensor) -> torch.Tensor:
    """Bool [..., V]: the kept set ``y > threshold``, or ``y == threshold`` at an index ``>= tie_index``
    (``threshold`` float32 and ``tie_index`` int [...]: :func:`truncation`'s description of it)."""
    columns = torch.arange(y.shape[-1], device=y.device)
    thr = threshold.unsqueeze(-1)
    return (y > thr) | ((y == thr) & (columns >= tie_index.unsqueeze(-1)))


# rows of candidates first asked of torch.topk for the top-p threshold (multiplied by 4 until they hold it)
_TOP_P_CANDIDATES = 64


Truncation = Union[None, int, float, torch.Tensor]  # a top_k / top_p: a number, or one per row (a tensor)


@torch.no_grad()
def truncation(y: torch.Tensor, e: torch.Tensor, top_k: "Optional[int] | torch.Tensor",
               top_p: "Optional[float] | torch.Tensor"):
    """The kept set of vLLM's top-k then top-p over rows ``y`` [n, V] (the logits before the temperature,
    which order the tokens), with ``e = exp(z - max z)`` [n, V] (the tempered masses): ``(threshold [n]
    float32, tie_index [n] int64)`` for :func:`kept_mask`.

    vLLM 0.32 (``apply_top_k_top_p_pytorch`` in ``vllm/v1/sample/ops/topk_topp_sampler.py``): top-k keeps
    ``y >= `` the k-th largest value (ties kept); top-p, over the masses ``top-k`` kept (total ``S``),
    walks the row in ascending order (ties by index: a stable sort) and drops a token while the mass up
    to and including it is ``<= (1 - p) S``, the largest always kept. Equivalently, in descending order
    (ties by decreasing index) a token is kept iff the mass before it is ``< p S``: a prefix, whose last
    token gives the threshold (its value) and the tie index (its index: the tied tokens it keeps are the
    higher-indexed ones). No sort of the row: ``torch.topk`` gives the largest candidates, asked for
    more until every token not among them is certainly dropped (the candidates' mass reaches ``p S``,
    with whole groups of ties: :data:`_TOP_P_CANDIDATES`, times 4).

    ``top_k`` / ``top_p``: a number (every row), or an [n] tensor, one per row (vLLM's per-request
    values; ``options.top_k_rows`` / ``options.top_p_on`` say which rows each truncates). A row that
    neither truncates keeps everything: ``(-inf, -1)`` (a tie index of -1 marks it, so that a target
    whose logit is -inf keeps the floor of an untruncated row there; ``>= 0`` on every truncating row).
    """
    n, v = y.shape
    low = torch.full((), float("-inf"), device=y.device)
    k_rows = None if not isinstance(top_k, torch.Tensor) else top_k_rows(top_k.reshape(n), v)
    p_rows = None if not isinstance(top_p, torch.Tensor) else top_p.reshape(n)
    if k_rows is not None:
        k_on = k_rows < v
        k_max = int(torch.where(k_on, k_rows, 1).max()) if n else 1  # (one synchronisation)
        # the k-th largest of each row that truncates (a sorted selection of the largest k_max), -inf elsewhere
        top = torch.topk(y, min(k_max, v), dim=-1).values
        kth = torch.where(k_on, top.gather(-1, (torch.where(k_on, k_rows, 1) - 1).unsqueeze(-1)).squeeze(-1), low)
        live = (y >= kth.unsqueeze(-1)) | ~k_on.unsqueeze(-1)
    elif top_k is not None:
        kth = torch.topk(y, top_k, dim=-1, sorted=False).values.amin(-1)  # (a selection, not a sort)
        live = y >= kth.unsqueeze(-1)
    if top_k is not None:
        threshold, tie_index = kth, torch.zeros(n, dtype=torch.int64, device=y.device)
        y = torch.where(live, y, low)
        e = torch.where(live, e, torch.zeros((), device=e.device))
    if top_p is None:
        if k_rows is not None:
            tie_index = torch.where(k_on, tie_index, -1)
        return threshold, tie_index
    if p_rows is None:
        goal = e.sum(-1) * top_p  # p S
        p_on = None
    else:  # (each row's p rounded to float32, as the float is); a row whose top-p is off: a goal of 0
        p_on = top_p_on(p_rows)
        goal = torch.where(p_on, e.sum(-1) * p_rows.float(), 0.0)
    if top_k is None:
        k0 = _TOP_P_CANDIDATES
    elif k_rows is None:
        k0 = max(top_k, int((y > low).sum(-1).max()))
    else:  # what each row's top-k keeps; a row without it starts as a row without top-k
        live_count = torch.where(k_on, (y > low).sum(-1), _TOP_P_CANDIDATES if p_on is None else 0)
        if p_on is not None:
            live_count = torch.where(p_on & ~k_on, _TOP_P_CANDIDATES, live_count)
        k0 = max(k_max, int(live_count.max()) if n else 1)
    k0 = min(v, k0)
    while True:
        values, index = torch.topk(y, k0, dim=-1)
        smallest = values[:, -1:]
        # every token tied with the smallest candidate is one (or they are all, -inf ones aside)
        complete = ((y >= smallest).sum(-1) <= k0) | (smallest.squeeze(-1) == low)
        covered = torch.where(values >= smallest, e.gather(-1, index), 0.0).sum(-1) >= goal
        if p_on is not None:  # (a row without top-p needs no candidates)
            complete = complete | ~p_on
        if k0 == v or bool((complete & covered).all()):
            break
        k0 = min(v, 4 * k0 if bool(complete.all()) else max(4 * k0, int((y >= smallest).sum(-1).max())))
    # descending value, ties by decreasing index: sort by index first, then stably by value
    by_index = index.argsort(dim=-1, descending=True)
    values, index = values.gather(-1, by_index), index.gather(-1, by_index)
    by_value = values.argsort(dim=-1, descending=True, stable=True)
    values, index = values.gather(-1, by_value), index.gather(-1, by_value)
    mass = e.gather(-1, index)
    before = mass.cumsum(-1) - mass  # exclusive
    kept = (before < goal.unsqueeze(-1)) & (values > low)
    kept[:, 0] = True  # the largest is always kept
    last = (kept.sum(-1) - 1).unsqueeze(-1)
    p_threshold, p_tie = values.gather(-1, last).squeeze(-1), index.gather(-1, last).squeeze(-1)
    if p_on is None:
        return p_threshold, p_tie
    # a row without top-p: what top-k kept (or, without either, everything: -inf, -1)
    if top_k is None:
        threshold, tie_index = low.expand(n), torch.full((n,), -1, dtype=torch.int64, device=y.device)
    elif k_rows is not None:
        tie_index = torch.where(k_on, tie_index, -1)
    return torch.where(p_on, p_threshold, threshold), torch.where(p_on, p_tie, tie_index)


class RowStats(NamedTuple):
    """A row backend's forward: float32 [B, T] ``logp`` (-inf for a target outside the kept set),
    ``entropy``, ``row_max`` and ``log_sum`` (what the backward needs), ``sum_probs_sq`` (the sum of
    squared probabilities, or None when not asked) and the kept set of a truncation (``threshold``
    float32, ``tie_index`` int [B, T]; None without one). ``row_max`` / ``log_sum`` / the kept set are
    private to the backend that made them."""

    logp: torch.Tensor
    entropy: torch.Tensor
    row_max: torch.Tensor
    log_sum: torch.Tensor
    sum_probs_sq: Optional[torch.Tensor] = None
    threshold: Optional[torch.Tensor] = None
    tie_index: Optional[torch.Tensor] = None


def _chunk_logprobs(x: torch.Tensor, targets: torch.Tensor, transform: tuple, ignore_index: int, with_entropy: bool,
                    sampling: tuple, work: list):
    """log-prob, entropy, row max and log-sum of one block x [b, t, V]; targets [b, t]; then the sum of
    squared probabilities and the kept set (threshold, tie index), or None each.

    In the working buffers ``work`` (flat fp32, :func:`_buffers`): ``shift = z - max`` (in place) and
    ``e = exp(shift)``. ``row_max`` is the max of :func:`_capped` (before the slope), private to this
    module. With a truncation (``sampling = (top_k, top_p, with_sum_sq)``, each a number or [b, t]) the
    sums run over the kept set (:func:`truncation`), a target outside it gets -inf (and so does a kept
    target whose logit is -inf, where the row truncates: vLLM's value), and a third buffer holds ``y``.
    """
    temperature, softcap, logit_scale = transform
    top_k, top_p, with_sum_sq = sampling
    shift = _capped(x, softcap, logit_scale, _view(work[0], x.shape))
    row_max = shift.amax(-1, keepdim=True)
    k = _slope(temperature, softcap, logit_scale)
    truncates = top_k is not None or top_p is not None
    y = _view(work[2], x.shape).copy_(shift) if truncates else None
    shift.sub_(row_max)
    if not _is_one(k):
        shift.mul_(k)
    e = torch.exp(shift, out=_view(work[1], x.shape))
    valid = targets != ignore_index
    safe = torch.where(valid, targets, torch.zeros_like(targets)).long().unsqueeze(-1)
    threshold = tie_index = in_kept_set = None
    if truncates:
        b, t, v = e.shape
        threshold, tie_index = truncation(y.view(-1, v), e.view(-1, v), top_k, top_p)
        threshold, tie_index = threshold.view(b, t), tie_index.view(b, t)
        kept = kept_mask(y, threshold, tie_index)
        in_kept_set = kept.gather(-1, safe).squeeze(-1) & ~_neg_inf_truncated(y.gather(-1, safe).squeeze(-1), tie_index)
        nan_row = torch.isnan(e).any(-1)  # (a NaN row stays NaN: the kept set would drop the NaN)
        e.masked_fill_(~kept & ~torch.isnan(e), 0.0)
        in_kept_set |= nan_row
        del y
    s = e.sum(-1, keepdim=True)
    log_sum = torch.log(s)
    logp = (shift.gather(-1, safe) - log_sum).squeeze(-1).clamp_(min=_LOWEST)  # see floor_logp
    if in_kept_set is not None:  # outside the kept set: -inf, as vLLM's processed log-probs
        logp = torch.where(in_kept_set, logp, torch.full((), float("-inf")))
    sum_sq = None
    if with_sum_sq:
        sum_sq = (e.square().sum(-1, keepdim=True) / (s * s)).squeeze(-1)
    if with_entropy:
        # H = log s - sum(e * shift) / s; a -inf logit has e = 0 and must add 0, not 0 * -inf, so
        # clamp shift to the lowest finite value (a NaN stays NaN through clamp).
        shift.clamp_(min=_LOWEST)
        entropy = (log_sum - (e.mul_(shift)).sum(-1, keepdim=True) / s).squeeze(-1)
    else:
        entropy = torch.zeros_like(logp)
    keep = lambda t: None if t is None else torch.where(valid, t, torch.zeros((), dtype=t.dtype))  # noqa: E731
    return (keep(logp), keep(entropy), keep(row_max.squeeze(-1)), keep(log_sum.squeeze(-1)), keep(sum_sq),
            threshold, tie_index)


def _neg_inf_truncated(y_target: torch.Tensor, tie_index: torch.Tensor) -> torch.Tensor:
    """Bool: a target whose own (capped) logit is -inf, on a row that truncates (``tie_index >= 0``:
    :func:`truncation`): its log-prob is -inf, as vLLM's, with no gradient (elsewhere the floor)."""
    return (y_target == float("-inf")) & (tie_index >= 0)


def _rows_of(temperature: Temperature, bs: slice, ts: slice) -> Temperature:
    """The temperatures (or top_k / top_p) of a box of rows: a number as it is, a [B, T] tensor's slice."""
    return temperature[bs, ts] if isinstance(temperature, torch.Tensor) else temperature


@torch.no_grad()
def forward_rows(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: Temperature,
    ignore_index: int,
    with_entropy: bool = True,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    top_k: Truncation = None,
    top_p: Truncation = None,
    with_sum_sq: bool = False,
) -> RowStats:
    """logits [B, T, V] (last dim contiguous), targets [B, T] -> :class:`RowStats`, fp32 [B, T].

    Statistics of the transformed logits ``z`` (see :func:`_shifted`), over the kept set of the
    truncation ``top_k`` / ``top_p`` (:func:`truncation`; an int ``top_k < V``, or a tensor of B * T
    values, one per row) when one is given; ``temperature`` a float or a [B, T] tensor. ``row_max`` is
    the max before the slope (:func:`_capped`), for :func:`backward_rows` only."""
    b, t, v = logits.shape
    top_k, top_p = (x.reshape(b, t) if isinstance(x, torch.Tensor) else x for x in (top_k, top_p))
    rows = min(block_rows(v, logits.device), b * t)
    truncates = top_k is not None or top_p is not None
    outputs = [torch.empty(b, t, dtype=torch.float32, device=logits.device) for _ in range(4)]
    outputs += [torch.empty(b, t, dtype=torch.float32, device=logits.device) if with_sum_sq else None]
    outputs += [torch.empty(b, t, dtype=torch.float32, device=logits.device) if truncates else None,
                torch.empty(b, t, dtype=torch.int64, device=logits.device) if truncates else None]
    work = _buffers(3 if truncates else 2, rows, v, logits.device)
    for bs, ts in row_chunks(b, t, max(rows, 1)):
        values = _chunk_logprobs(logits[bs, ts], targets[bs, ts], (_rows_of(temperature, bs, ts), softcap, logit_scale),
                                 ignore_index, with_entropy,
                                 (_rows_of(top_k, bs, ts), _rows_of(top_p, bs, ts), with_sum_sq), work)
        for out, value in zip(outputs, values):
            if out is not None:
                out[bs, ts] = value
    return RowStats(*outputs)


@torch.no_grad()
def backward_rows(
    logits: torch.Tensor,
    targets: torch.Tensor,
    row_max: torch.Tensor,
    log_sum: torch.Tensor,
    entropy: torch.Tensor,
    grad_logp: Optional[torch.Tensor],
    grad_entropy: Optional[torch.Tensor],
    temperature: Temperature,
    ignore_index: int,
    out: torch.Tensor,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    threshold: Optional[torch.Tensor] = None,
    tie_index: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Write ``d loss / d logits`` [B, T, V] into ``out`` (may be ``logits`` itself) and return it.

    ``dz = g_logp * (onehot - p) + g_entropy * (-p * (log p + H))``, times ``dz / dx`` (the
    temperature, softcap and logit scale: :func:`_chain_rule_`), with ``log p = z - max - log_sum``
    from the forward's statistics (no reduction over the row here). A target outside ``[0, V)``
    (other than ``ignore_index``) lies in another rank's vocabulary shard
    (``grpo_kernels.vocab_parallel``): its row has no one-hot term. With a truncation's kept set
    (``threshold``, ``tie_index``: a constant of the step) ``p`` is 0 outside it, and a row whose
    target lies outside it, or whose kept target's own logit is -inf, has no log-prob term (its
    log-prob is -inf: a gradient of 0).

    One sweep per block of rows (:func:`block_rows`), in place: in ``out``'s own rows when ``out`` is
    fp32 (no copy back; the soft-capped chain rule, which reads the logits again, excepted), else in a
    working buffer copied out once, rounded once.
    """
    b, t, v = logits.shape
    rows = min(block_rows(v, logits.device), b * t)
    in_out = out.dtype == torch.float32 and softcap is None
    work = _buffers(1 if in_out else 2, rows, v, logits.device)
    # (an optimisation only: under torch.compile the masks always run, no data-dependent branch)
    all_valid = False if torch.compiler.is_compiling() else bool((targets != ignore_index).all())
    for bs, ts in row_chunks(b, t, max(rows, 1)):
        x = logits[bs, ts]
        tgt = targets[bs, ts]
        valid = tgt != ignore_index
        temp = _rows_of(temperature, bs, ts)
        row_max_ = row_max[bs, ts].unsqueeze(-1)
        log_sum_ = log_sum[bs, ts].unsqueeze(-1)
        in_row = valid & (tgt >= 0) & (tgt < v)
        safe = torch.where(in_row, tgt, torch.zeros_like(tgt)).long().unsqueeze(-1)
        if grad_logp is not None:  # the target's log-prob, read before its row is overwritten
            # The target's g * (1 - p) uses -expm1(log p), accurate when p ~ 1, formed in fp32
            # before the one rounding, so a confident prediction keeps its small gradient.
            log_p_target = _shifted(x.gather(-1, safe), row_max_, temp, softcap, logit_scale) - log_sum_
            y_target = None if threshold is None else _capped(x.gather(-1, safe), softcap, logit_scale).squeeze(-1)
        # log p = (z - max) - log s, in place in one fp32 block (out's rows, or a buffer); p in another
        y = _capped(x, softcap, logit_scale, out[bs, ts] if in_out else _view(work[1], x.shape))
        kept = None if threshold is None else kept_mask(y, threshold[bs, ts], tie_index[bs, ts])
        k = _slope(temperature=temp, softcap=softcap, logit_scale=logit_scale)
        log_p = y.sub_(row_max_)
        if not _is_one(k):
            log_p.mul_(k)
        log_p.sub_(log_sum_)
        p = torch.exp(log_p, out=_view(work[0], x.shape))
        if kept is not None:
            p.masked_fill_(~kept, 0.0)
        if grad_entropy is not None:
            # d H / d z = -p (log p + H); at a -inf logit p = 0, so clamp log p to stay finite.
            log_p.clamp_(min=_LOWEST).add_(entropy[bs, ts].unsqueeze(-1))
            grad = log_p.mul_(p).mul_(-grad_entropy[bs, ts].unsqueeze(-1))
        if grad_logp is not None:
            g = grad_logp[bs, ts].unsqueeze(-1)
            if kept is not None:  # a target outside the kept set: log p = -inf, no gradient through it
                kept_t = kept.gather(-1, safe) & ~_neg_inf_truncated(y_target, tie_index[bs, ts]).unsqueeze(-1)
                g = torch.where(kept_t, g, torch.zeros((), device=g.device))
            target_term = g * -torch.expm1(log_p_target)
            if grad_entropy is not None:
                target_term = target_term + grad.gather(-1, safe)
                grad.addcmul_(p, g, value=-1.0)  # - g p
            else:
                grad = torch.mul(p, -g, out=log_p)  # (-g) p: one pass, the same bits as 0 - g p
            # a row whose target is in another shard keeps its -g p entry at column 0
            target_term = torch.where(in_row.unsqueeze(-1), target_term, grad.gather(-1, safe))
            grad.scatter_(-1, safe, target_term)
        elif grad_entropy is None:
            grad = log_p.zero_()
        _chain_rule_(grad, x, temp, softcap, logit_scale, scratch=p)
        if not all_valid:
            grad.masked_fill_(~valid.unsqueeze(-1), 0.0)  # after the chain rule: a masked row is never read
        if not in_out:
            out[bs, ts] = grad  # (cast to out's dtype once)
    return out


class RowGradient(NamedTuple):
    """What :func:`forward_backward_rows` leaves: per-row log-prob and entropy (float32 [n]) and, when
    the gradient is factored, ``row_scale`` and ``target_grad`` (float32 [n]; else both ``None`` and
    the buffer holds ``d loss / d logits`` itself)."""

    logp: torch.Tensor
    entropy: torch.Tensor
    row_scale: Optional[torch.Tensor] = None
    target_grad: Optional[torch.Tensor] = None


@torch.no_grad()
def forward_backward_rows(logits: torch.Tensor, targets: torch.Tensor, temperature: Temperature, ignore_index: int,
                          coefficients, factored: bool = False) -> RowGradient:
    """Log-prob and entropy of each row, then ``d loss / d logits``, over ``logits`` in place.

    logits [n, V] (contiguous rows the caller owns, any float dtype), targets [n]. After the first
    sweep ``coefficients(logp [n], entropy [n])`` (fp32) gives ``(d loss/d logp [n], d loss/d entropy
    [n] or None)``. The same maths as :func:`forward_rows` then :func:`backward_rows`, over blocks of
    rows (:func:`block_rows`). With ``z`` the logits over the temperature minus the row max,
    ``e = exp(z)``, ``s = sum e``, ``p = e / s``, ``log p = z - log s`` and ``H = log s - sum e z / s``:

        d z = g_logp (onehot - p) - g_entropy p (log p + H) = e (a z + b) + g_logp onehot,
        a = -g_entropy / s,  b = -(g_logp + g_entropy (H - log s)) / s,

    and at the target ``g_logp (1 - p_t) - g_entropy p_t (log p_t + H)`` with ``1 - p_t = -expm1(log p_t)``
    (accurate for a confident token). ``d logits = d z / temperature`` (``temperature``: a float, or float64 [n], one per
    row). Rows whose target is
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
    block = block_rows(v, device)
    fp32 = logits.dtype == torch.float32
    # fp32 logits hold z themselves unless factored (then they take e'); exp needs its own buffer
    # except when it is written straight over fp32 logits
    z_buf = None if fp32 and not factored else torch.empty(min(block, n), v, **f32)
    e_buf = None if fp32 and factored else torch.empty(min(block, n), v, **f32)
    valid = targets != ignore_index
    # (an optimisation only: under torch.compile the masks always run, no data-dependent branch)
    all_valid = False if torch.compiler.is_compiling() else bool(valid.all())
    safe = torch.where(valid, targets, torch.zeros_like(targets)).long().unsqueeze(-1)
    per_row = isinstance(temperature, torch.Tensor)
    # 1 / T (per row: float32 [n, 1], formed in float64 as the float's is), and T for the gradient
    inv_t = _per_row(1.0 / temperature.double()) if per_row else 1.0 / temperature
    t_div = _per_row(temperature.double()) if per_row else temperature

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
        if per_row:
            z.mul_(inv_t[rows])
        elif temperature != 1.0:
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
    g_logp = torch.where(valid, g_logp.float(), zero).unsqueeze(-1) / t_div
    b = -g_logp / sums
    target_term = g_logp * -torch.expm1(logp.unsqueeze(-1))
    if factored and g_entropy is None:
        return RowGradient(logp, entropy, b.squeeze(-1), target_term.squeeze(-1))
    if g_entropy is not None:
        g_entropy = torch.where(valid, g_entropy.float(), zero).unsqueeze(-1) / t_div
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
            if per_row:
                z.mul_(inv_t[rows])
            elif temperature != 1.0:
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


# --------------------------------------------------------------------------------------------------
# a frozen head (no d W: LoRA, or no_grad): the vocabulary in blocks, the logits never a whole row
# --------------------------------------------------------------------------------------------------
# Elements of one [rows, Vb] block of the vocabulary-tiled pass (8 MiB of fp32 on a CPU, 32 MiB
# elsewhere): Vb = this / rows, so the pass holds two or three such buffers instead of [rows, V].
# Measurements: benchmarks/results/lora_vocab_tiles-cpu-20261202.md.
TILE_ELEMENTS = {"cpu": 1 << 21, "other": 1 << 23}
# Narrowest block of the vocabulary (a wide chunk of rows then holds more than TILE_ELEMENTS).
MIN_TILE_COLUMNS = 256


def tile_columns(num_rows: int, vocab_size: int, device: torch.device) -> int:
    """Vb, the vocabulary block of :func:`frozen_head_rows`: :data:`TILE_ELEMENTS` / rows, at least
    :data:`MIN_TILE_COLUMNS`, at most V."""
    budget = TILE_ELEMENTS["cpu" if device.type == "cpu" else "other"]
    return max(1, min(vocab_size, max(MIN_TILE_COLUMNS, budget // max(num_rows, 1))))


def frozen_head_bytes(num_rows: int, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> int:
    """The most bytes :func:`frozen_head_rows` holds for a chunk of ``num_rows`` rows: its [n, Vb] blocks
    (the logits in ``dtype``, fp32 ``e``, an fp32 copy of 16-bit logits), the two fp32 [n, H]
    accumulators and the gradients formed from them (four [n, H] fp32 at the end) and, for a 16-bit head
    with an entropy gradient, an fp32 copy of one [Vb, H] weight block."""
    width = tile_columns(num_rows, vocab_size, device)
    elt = torch.finfo(dtype).bits // 8
    blocks = num_rows * width * (elt + 4 + (0 if elt == 4 else 4))
    return blocks + 6 * num_rows * hidden_size * 4 + (0 if elt == 4 else width * hidden_size * 4)


class FrozenHeadRows(NamedTuple):
    """What :func:`frozen_head_rows` gives for n rows: float32 [n] ``logp``, ``entropy`` (0 unless asked),
    ``row_max`` and ``log_sum`` (as :class:`RowStats`': :func:`backward_rows` reads them), ``sum_probs_sq``
    (or None), and float32 [n, H] ``d logp / d hidden`` and ``d H / d hidden`` (or None each)."""

    logp: torch.Tensor
    entropy: torch.Tensor
    row_max: torch.Tensor
    log_sum: torch.Tensor
    sum_probs_sq: Optional[torch.Tensor]
    grad_logp: Optional[torch.Tensor]
    grad_entropy: Optional[torch.Tensor]


@torch.no_grad()
def frozen_head_rows(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
                     temperature: Temperature, ignore_index: int, with_entropy: bool, with_sum_sq: bool = False,
                     hidden_grads: int = 0, softcap: Optional[float] = None, logit_scale: float = 1.0,
                     columns: Optional[int] = None) -> FrozenHeadRows:
    """Row statistics of ``x = hidden [n, H] @ weight^T [H, V] + bias`` (hidden, weight and bias in one
    compute dtype) and, with ``hidden_grads`` 1 (2), ``d logp / d hidden`` (and ``d H / d hidden``),
    walking the vocabulary in blocks of ``columns`` (default :func:`tile_columns`) with every row at once:
    one read of the weight, memory ``n x Vb`` instead of ``n x V``. For a head without a weight gradient
    (the gradient w.r.t. the weight would need every column's ``d logits``): LoRA, or ``no_grad``.

    With ``y`` the transformed logits before the slope ``k`` (:func:`_capped`, :func:`_slope`) and
    ``c_v = dz_v / dx_v / k`` (1, or ``logit_scale (1 - (y_v / softcap)^2)`` under a soft cap), each row
    keeps over the blocks seen so far the running max ``m`` of ``y`` and, with ``u_v = (y_v - m) k``
    and ``e_v = exp(u_v)``: ``S = sum e``, ``D = sum e u``, ``Q = sum e^2``, and over ``v != t`` (the
    target apart, for an accurate ``1 - p_t``) ``A = sum e_v c_v W_v``, ``B = sum e_v u_v c_v W_v`` [H].
    When a block raises the max to ``m'``, ``u`` shifts by ``d = (m - m') k`` and ``e`` scales by
    ``a = exp(d)``: ``S <- a S``, ``D <- a (D + d S)``, ``Q <- a^2 Q``, ``A <- a A``, ``B <- a (B + d A)``
    (the online softmax's rescaling: Milakov and Gimelshein 2018; flash-attention's
    ``flash_attn/flash_attn_triton.py``, ``_fwd_kernel``'s ``acc_o_scale``). At the end
    ``logp = u_t - log S``, ``H = log S - D / S``, ``sum p^2 = Q / S^2`` and, from
    ``d logp / d z_v = onehot - p_v`` and ``d H / d z_v = -p_v (log p_v + H)`` (``log p_v = u_v - log S``),

        d logp / d h = k [ (1 - p_t) c_t W_t - A / S ]                   (1 - p_t = -expm1(logp))
        d H / d h    = k [ -p_t (logp + H) c_t W_t - (B + (H - log S) A) / S ]

    so the loss's per-token coefficients, known only once the row's statistics are, multiply them.
    ``temperature``: a float or float [n]. Rows whose target is ``ignore_index`` give 0 throughout.
    """
    n, hidden_size = hidden.shape
    v = weight.shape[0]
    device = hidden.device
    f32 = dict(dtype=torch.float32, device=device)
    width = tile_columns(n, v, device) if columns is None else max(1, min(v, columns))
    if hidden_grads >= 2 and hidden.dtype != torch.float32:  # (its fp32 copy of a weight block: as small)
        width = min(width, tile_columns(hidden_size, v, device))
    k = _slope(temperature, softcap, logit_scale)  # float, or float32 [n, 1]
    k_col = k if isinstance(k, torch.Tensor) else torch.full((n, 1), k, **f32)
    valid = targets != ignore_index
    in_row = valid & (targets >= 0) & (targets < v)
    target = targets.long().unsqueeze(-1)
    need_dot = with_entropy or hidden_grads >= 2
    row_max = torch.full((n, 1), float("-inf"), **f32)
    sums, dot, sq, y_target = (torch.zeros(n, 1, **f32) for _ in range(4))  # (the sums over v != t)
    zero = torch.zeros((), **f32)
    acc_a = torch.zeros(n, hidden_size, **f32) if hidden_grads >= 1 else None
    acc_b = torch.zeros(n, hidden_size, **f32) if hidden_grads >= 2 else None
    fp32 = hidden.dtype == torch.float32
    # flat buffers, each block a contiguous [n, c] view of their first n * c elements
    x_buf = torch.empty(n * width, dtype=hidden.dtype, device=device)
    y_buf = None if fp32 else torch.empty(n * width, **f32)  # fp32 logits are transformed in place
    e_buf = torch.empty(n * width, **f32)
    c_buf = torch.empty(n * width, **f32) if softcap is not None and hidden_grads else None
    for v0 in range(0, v, width):
        c = min(width, v - v0)
        w_block = weight[v0:v0 + c]
        x = _view(x_buf, (n, c))
        if bias is None:
            torch.mm(hidden, w_block.t(), out=x)
        else:
            torch.addmm(bias[v0:v0 + c], hidden, w_block.t(), out=x)
        y = _capped(x, softcap, logit_scale, x if fp32 else _view(y_buf, (n, c)))
        here = in_row & (target.squeeze(-1) >= v0) & (target.squeeze(-1) < v0 + c)
        local = (target - v0).clamp_(0, c - 1)
        y_target.copy_(torch.where(here.unsqueeze(-1), y.gather(-1, local), y_target))
        new_max = torch.maximum(row_max, y.amax(-1, keepdim=True))
        # the shift d = (m - m') k of what came before (0 before the first finite max: all sums are 0 then)
        shift = torch.where(row_max == float("-inf"), torch.zeros((), **f32), (row_max - new_max) * k_col)
        scale = shift.exp()
        row_max = new_max
        cap = None
        if c_buf is not None:  # c_v / logit_scale = 1 - tanh^2 = 1 - (y / softcap)^2, before y is shifted
            cap = _view(c_buf, (n, c))
            torch.div(y, softcap, out=cap)
            cap.square_().neg_().add_(1.0)
        # (a block whose rows so far are all -inf, a bias masking tokens: shift by 0, not -inf, so e = 0, not NaN)
        u = y.sub_(torch.where(row_max == float("-inf"), zero, row_max))
        if not _is_one(k):
            u.mul_(k)
        e = torch.exp(u, out=_view(e_buf, (n, c)))
        # the target's entry apart (added at the end): every sum below is over v != t, so 1 - p_t is a
        # sum of the other masses, not 1 minus a rounded p_t, and the accumulators need no correction
        e.scatter_(-1, local, torch.where(here.unsqueeze(-1), zero, e.gather(-1, local)))
        if with_sum_sq:
            sq.mul_(scale.square()).add_(torch.linalg.vecdot(e, e).unsqueeze(-1))
        if need_dot:
            dot.add_(sums * shift).mul_(scale)  # a (D + d S), with the S before this block
        sums.mul_(scale).add_(e.sum(-1, keepdim=True))
        if need_dot:
            # a -inf logit has e = 0 and must add 0, not 0 * -inf (a NaN stays NaN through clamp)
            eu = u.clamp_(min=_LOWEST).mul_(e)
            dot.add_(eu.sum(-1, keepdim=True))
        if not hidden_grads:
            continue
        # d H / d h combines A and B, which cancel (B + (H - log S) A): their products stay fp32 (a 16-bit
        # weight's block converted once for both), where one 16-bit rounding of each would not survive
        w_product = w_block.float() if acc_b is not None else w_block
        if acc_b is not None:  # B <- a (B + d A) + sum_{v != t} e u c W, with the A before this block
            acc_b.addcmul_(acc_a, shift).mul_(scale)
            _add_block_product(acc_b, eu, cap, w_product, x)
        acc_a.mul_(scale)
        _add_block_product(acc_a, e, cap, w_product, x)
        del w_product  # (before the next block's copy exists)
    # the target's own terms: u_t = (y_t - m) k, e_t = exp(u_t); S = rest + e_t
    u_target = torch.where(in_row.unsqueeze(-1), (y_target - row_max) * k_col, zero)
    e_target = torch.where(in_row.unsqueeze(-1), u_target.exp(), zero)
    rest = sums
    sums = rest + e_target
    log_sum = sums.log()
    # log p_t = -log(1 + rest / e_t): accurate as p_t -> 1, where u_t - log S keeps only log S's rounding;
    # u_t - log S for a target far below the max (e_t underflows)
    near = u_target > -64.0
    logp = torch.where(near, -torch.log1p(rest / torch.where(near, e_target, 1.0)), u_target - log_sum)
    logp.clamp_(min=_LOWEST)  # see floor_logp
    keep = lambda t: torch.where(valid, t.squeeze(-1), zero)  # noqa: E731
    entropy = torch.zeros_like(logp)
    if need_dot:  # H = log S - D / S, D = sum e u (a -inf target adds 0, as in the sums)
        entropy = log_sum - (dot + e_target * u_target.clamp(min=_LOWEST)) / sums
    grad_logp = grad_entropy = None
    if hidden_grads:
        w_target = weight.index_select(0, torch.where(in_row, targets, torch.zeros_like(targets)).long()).float()
        c_target = torch.ones_like(y_target) if softcap is None else (1.0 - (y_target / softcap) ** 2) * logit_scale
        if softcap is not None and logit_scale != 1.0:
            acc_a.mul_(logit_scale)
            if acc_b is not None:
                acc_b.mul_(logit_scale)
        c_target = torch.where(in_row.unsqueeze(-1), c_target, zero)  # (a target in another shard: no term)
        mask = valid.unsqueeze(-1)
        grad_logp = torch.where(mask, (w_target * (rest / sums * c_target) - acc_a / sums) * k_col, zero)
        if acc_b is not None:
            target_term = -(e_target / sums) * (logp + entropy) * c_target
            grad_entropy = w_target * target_term - (acc_b + (entropy - log_sum) * acc_a) / sums
            grad_entropy = torch.where(mask, grad_entropy * k_col, zero)
    sum_sq = None
    if with_sum_sq:
        sum_sq = keep((sq + e_target.square()) / sums.square())
    return FrozenHeadRows(keep(logp), keep(entropy), keep(row_max), keep(log_sum), sum_sq, grad_logp, grad_entropy)


def _add_block_product(acc: torch.Tensor, values: torch.Tensor, cap: Optional[torch.Tensor], w_block: torch.Tensor,
                       scratch: torch.Tensor) -> None:
    """``acc [n, H] += (values times the soft cap's factor) @ w_block`` (``values`` fp32 [n, c], modified);
    an fp32 ``w_block`` in fp32, a 16-bit one through ``scratch`` ([n, c], its dtype), the product rounded once."""
    if cap is not None:
        values.mul_(cap)
    if w_block.dtype == torch.float32:
        acc.addmm_(values, w_block)
    else:
        acc.add_(torch.mm(scratch.copy_(values), w_block))
