"""autograd.Functions that bind a backend's row kernels' forward to their backward.

``TokenLogprobsFunction``: logits -> (logp, entropy), saving only the logits (a reference, not a copy) and
three fp32 numbers per row (max, log-sum, entropy). ``FusedGRPOLossFunction``: logits -> the token-level GRPO
loss in the same single pass (backends whose ``fuses(options)`` is true). ``FusedLinearTokenLogprobsFunction``: hidden,
weight, bias -> (logp, entropy), where each chunk's logits exist only while that chunk is processed,
in the forward and again in the backward (4 matmuls). ``FusedLinearGRPOLossFunction``: hidden, weight, bias
-> a token-level loss whose gradient is formed in the forward (3 matmuls, nothing recomputed) and
handed over by the backward. :func:`default_chunk_size` sizes their chunks from N, H, V and the device.
A head without weight or bias gradient (LoRA, ``no_grad``) on a backend that ``tiles_vocabulary``
(torch, without top-k/top-p) never forms a chunk's [c, V] logits: each chunk walks the vocabulary in
blocks (``backend.frozen_head_rows``; :func:`_tiled_row_stats`, :func:`_tiled_loss_rows`,
:func:`_tiled_hidden_grad`).

Each Function receives the backend object (``grpo_kernels.backends``) and calls only its methods.
Backwards are first order: a double backward (``create_graph=True``) raises a RuntimeError instead
of returning a gradient without a graph (use ``backend="reference"`` for higher-order gradients).
With ``inplace_backward`` the logits' gradient is written into the logits buffer and the buffer's version counter is bumped, so autograd raises (instead of using a
corrupted tensor) when anything else saved the logits: an op whose backward needs its output
(``tanh`` soft-capping, ``exp``), or a second backward through the same graph.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Dict, Iterator, NamedTuple, Optional, Protocol, Tuple

import torch

from .backends import RowBackend
from .kernels import torch_replay, torch_rows
from .kernels.torch_rows import RowGradient, RowStats, tile_columns
from .options import LogitTransform
from .sampling_mask import SamplingMask


def first_order(backward: Callable) -> Callable:
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


def gradient_buffer(logits: torch.Tensor, inplace_backward: bool) -> torch.Tensor:
    return logits if inplace_backward else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


def written_in_place(logits: torch.Tensor, out: torch.Tensor) -> None:
    """A kernel wrote into ``logits``: tell autograd, so a later reader of the old values raises."""
    if out is logits:
        torch.autograd.graph.increment_version(logits)


def logprob_forward_outputs(ctx, saved: tuple, config: tuple, logp: torch.Tensor, entropy: torch.Tensor,
                            sum_sq: torch.Tensor, with_sum_sq: bool):
    """The tail of a log-prob Function's forward: keep ``saved`` for the backward and ``config`` in
    ``ctx.config``; return (logp, entropy, the sum of squared probabilities, or unless ``with_sum_sq`` a
    0-d 0), the third without gradient. Unused outputs reach the backward as None (not zeros)."""
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*saved)
    ctx.config = config
    sum_sq = sum_sq if with_sum_sq else logp.new_zeros(())
    ctx.mark_non_differentiable(sum_sq)
    return logp, entropy, sum_sq


class TokenLogprobsFunction(torch.autograd.Function):
    """(logits [B, T, V], targets [B, T]) -> (logp [B, T], entropy [B, T], sum of squared probabilities
    [B, T] or, unless ``with_sum_sq``, a 0-d 0), float32; the third has no gradient. Under a truncation
    (``transform.top_k`` / ``top_p``) the kept set the forward found is saved with the statistics: a
    constant of the backward."""

    @staticmethod
    def forward(ctx, logits, targets, backend: RowBackend, transform: LogitTransform, ignore_index: int,
                with_entropy: bool, inplace_backward: bool, with_sum_sq: bool = False):
        stats = backend.forward_rows(logits, targets, transform, ignore_index, with_entropy, with_sum_sq)
        return logprob_forward_outputs(
            ctx, (logits, targets, stats.row_max, stats.log_sum, stats.entropy, stats.threshold, stats.tie_index),
            (backend, transform, ignore_index, inplace_backward), stats.logp, stats.entropy, stats.sum_probs_sq,
            with_sum_sq)

    @staticmethod
    @first_order
    def backward(ctx, grad_logp, grad_entropy, _grad_sum_sq=None):
        logits, targets, row_max, log_sum, entropy, threshold, tie_index = ctx.saved_tensors
        backend, transform, ignore_index, inplace_backward = ctx.config
        out = gradient_buffer(logits, inplace_backward)
        backend.backward_rows(logits, targets, row_max, log_sum, entropy, grad_logp, grad_entropy, transform, ignore_index,
                              out, threshold, tie_index)
        written_in_place(logits, out)
        return out, None, None, None, None, None, None, None


class FusedGRPOLossFunction(torch.autograd.Function):
    """Token-level GRPO loss from logits in one pass; the backward is one more pass.

    forward(logits [B, T, V], targets [B, T], advantages, weights [B, T], entropy_weights [B, T] or None,
    kl_weights [B, T] or None, backend, inputs, options, ignore_index, inplace_backward) -> (loss 0-d,
    logp, entropy, kl [B, T], clip region int8 [B, T]); only the loss is differentiable. The kernel
    evaluates the policy and KL terms weighted by ``weights`` (the KL by ``kl_weights`` when given:
    verl's sapo); the entropy bonus ``-sum(entropy_weights * H)`` (TRL's token mean whatever the policy
    term's reduction; verl's loss_agg_mode) is added here, its ``d / d H`` beside the kernel's.
    Saved: the logits (a reference), and five fp32 numbers per token.
    """

    @staticmethod
    def forward(ctx, logits, targets, advantages, weights, entropy_weights, kl_weights, backend: RowBackend, inputs,
                options, ignore_index: int, inplace_backward: bool, transform: Optional[LogitTransform] = None):
        transform = options.transform if transform is None else transform  # (a per-row temperature as the rows)
        loss, logp, entropy, row_max, log_sum, coef_logp, coef_entropy, kl, clip = backend.grpo_forward_rows(
            logits, targets, advantages, weights, inputs, options, ignore_index, entropy_coef=0.0, kl_weights=kl_weights,
            transform=transform,
        )
        loss = loss.sum()
        if entropy_weights is not None:
            loss = loss - (entropy_weights * entropy).sum()
            coef_entropy = -entropy_weights.float()
        ctx.save_for_backward(logits, targets, row_max, log_sum, entropy, coef_logp, coef_entropy)
        ctx.config = (backend, transform, ignore_index, inplace_backward, entropy_weights is not None)
        ctx.mark_non_differentiable(logp, entropy, kl, clip)
        return loss, logp, entropy, kl, clip

    @staticmethod
    @first_order
    def backward(ctx, grad_loss, *_grad_non_differentiable):
        logits, targets, row_max, log_sum, entropy, coef_logp, coef_entropy = ctx.saved_tensors
        backend, transform, ignore_index, inplace_backward, has_entropy_term = ctx.config
        out = gradient_buffer(logits, inplace_backward)
        backend.backward_rows(
            logits, targets, row_max, log_sum, entropy, coef_logp * grad_loss,
            coef_entropy * grad_loss if has_entropy_term else None, transform, ignore_index, out,
        )
        written_in_place(logits, out)
        return (out,) + (None,) * 11


# --------------------------------------------------------------------------------------------------
# fused linear: hidden states and lm_head weight in, a chunk of rows' logits at a time
# --------------------------------------------------------------------------------------------------
# Flop per byte of memory traffic a matmul needs to run at the machine's rate (its "balance"), used
# by default_chunk_size. CUDA: taken from datasheets (predicted, not measured); CPU: an effective
# figure fitted by `python -m benchmarks.kernels compare --chunks` (the per-call cost a skinny chunk fails to amortise).
# The measurements: benchmarks/results/chunk_size_cpu.md.
MACHINE_BALANCE = {"cuda": 200.0, "cpu": 172.0}
# Most bytes one chunk's logits may take (they are overwritten by their gradient in place): next to
# the fp32 d W accumulator and the activations this stays small (1 GiB at V = 152k is 3.5k bf16 rows).
CHUNK_LOGITS_BUDGET = {"cuda": 1 << 30, "cpu": 256 << 20}
# Most rows in a chunk. CPU: past ~1k rows the matmuls run no faster and the logits buffer only
# grows (benchmarks/results/chunk_size_cpu.md); GPU: loose (the budget decides), not measured.
MAX_CHUNK_ROWS = {"cuda": 16384, "cpu": 1024}
MIN_CHUNK_ROWS = 64


def default_chunk_size(vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                       num_tokens: Optional[int] = None) -> int:
    """Rows per chunk for the fused-linear path, from V, H, the compute dtype, the device and N.

    Each chunk of ``c`` rows runs three matmuls against the [V, H] weight: logits ``[c, H] @ [H, V]``,
    ``d hidden = d logits @ W`` and ``d W += d logits^T @ h``. The skinniest is the last: it reads and
    writes the [V, H] accumulator (``acc`` bytes an element, fp32: 4) for ``2 c`` flops an element,
    and reads the ``[c, V]`` gradient (``elt`` bytes). With ``V >> c`` its flops per byte are
    ``2 c H / (c elt + 2 H acc)``; it runs at the machine's rate when that reaches the machine's
    balance ``R`` (:data:`MACHINE_BALANCE`), i.e. when

        ``c >= 2 R H acc / (2 H - R elt)``                                        (rate rule)

    (the logits matmul, ``2 c H / ((c + H) elt)`` flops per byte, then reaches ``R`` too). When
    ``2 H <= R elt`` no chunk reaches ``R`` (a small head is bound by memory) and the budget decides.
    Then, the caps: ``c * V * elt <= CHUNK_LOGITS_BUDGET[device]`` (256 MiB on a CPU, 1 GiB on a GPU)
    and ``c <= MAX_CHUNK_ROWS[device]`` (1,024 on a CPU), at least :data:`MIN_CHUNK_ROWS`.
    Last, with ``num_tokens`` the ``N`` rows are split into ``ceil(N / c)`` equal chunks (multiples
    of 16), so no small remainder chunk runs at a low rate.

    Examples (fp32, CPU, R = 172): V = 32,000, H = 512 -> 2,097 rows by the rate rule, 1,024 (the row
    cap); H = 1,024 -> 1,037, so 1,024 again, a 4,096-token batch -> 4 chunks of 1,024; V = 151,936 ->
    441 (the memory cap), 1,024 tokens -> 3 chunks of 352. bf16 on a GPU (R = 200, predicted):
    H = 4,096, V = 151,936 -> 842 rows (~244 MiB of logits), 16,384 tokens -> 20 chunks of 832.
    """
    kind = "cuda" if device.type == "cuda" else "cpu"
    elt = torch.finfo(dtype).bits // 8
    acc = 4  # d W accumulates in fp32
    balance = MACHINE_BALANCE[kind]
    cap = max(MIN_CHUNK_ROWS, min(MAX_CHUNK_ROWS[kind], CHUNK_LOGITS_BUDGET[kind] // (vocab_size * elt)))
    denominator = 2 * hidden_size - balance * elt
    rows = cap if denominator <= 0 else min(cap, max(MIN_CHUNK_ROWS, math.ceil(2 * balance * hidden_size * acc / denominator)))
    if num_tokens is not None and num_tokens > 0:
        chunks = math.ceil(num_tokens / rows)
        rows = min(rows, 16 * math.ceil(math.ceil(num_tokens / chunks) / 16))
    return int(rows)


def compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype of a call's matmuls: autocast's when autocast is on for the device, else hidden's.

    The fused-linear Functions receive it, record it, and run their forward and backward with
    autocast off, casting weight, bias and each chunk of hidden states to it themselves (as
    ``torch.amp.custom_fwd``/``custom_bwd`` carry autocast's state into the backward): a backward
    that recomputes logits does it in the forward's dtype, so the softmax gradient sums to zero, and
    the gradients accumulate in fp32 and come back in each input's own dtype.
    """
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden.dtype


def _chunk_logits(hidden_chunk, weight, bias, buffer: torch.Tensor) -> torch.Tensor:
    """``hidden_chunk @ weight.T + bias`` written into the first rows of ``buffer``, one [chunk, V]
    buffer reused by every chunk of a call: a fresh one per chunk would be mapped and faulted in anew
    by the allocator each time (hundreds of MiB on a CPU)."""
    out = buffer[: hidden_chunk.shape[0]]
    if bias is None:
        return torch.mm(hidden_chunk, weight.t(), out=out)
    return torch.addmm(bias, hidden_chunk, weight.t(), out=out)


def _logit_chunks(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], chunk_size: int,
                  dtype: torch.dtype) -> Iterator[Tuple[slice, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(rows, h, w, logits)`` per chunk of ``chunk_size`` of the n rows of ``hidden [n, H]``: the chunk's
    slice, its hidden ``h [r, H]`` and the weight ``w [V, H]`` in ``dtype``, and its ``logits [r, V] = h @ w^T
    + bias``, written into one buffer that every chunk reuses (:func:`_chunk_logits`): a chunk's logits are
    valid until the next is drawn. The callers run the loop with autocast off (the dtype is chosen)."""
    n = hidden.shape[0]
    w, b = _operands(weight, bias, dtype)
    buffer = torch.empty(min(n, chunk_size), w.shape[0], dtype=w.dtype, device=w.device)
    for start in range(0, n, chunk_size):
        rows = slice(start, min(n, start + chunk_size))
        h = hidden[rows].to(dtype)
        yield rows, h, w, _chunk_logits(h, w, b, buffer)


_ADDMM_OUT_DTYPE: Dict[Tuple[str, torch.dtype], bool] = {}


def addmm_out_dtype_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(acc_fp32, a, b, out_dtype=torch.float32, out=acc)`` works for 16-bit
    ``a``/``b`` on this device (CUDA in recent torch; not on a CPU). Tried once and remembered."""
    key = (device.type, dtype)
    if key not in _ADDMM_OUT_DTYPE:
        ok = False
        try:
            a = torch.ones(2, 3, dtype=dtype, device=device)
            acc = torch.ones(2, 2, dtype=torch.float32, device=device)
            torch.addmm(acc, a, a.t(), out_dtype=torch.float32, out=acc)
            ok = bool((acc == 4).all())
        except (RuntimeError, TypeError, NotImplementedError):
            ok = False
        _ADDMM_OUT_DTYPE[key] = ok
    return _ADDMM_OUT_DTYPE[key]


def _accumulate_weight_grad(acc: torch.Tensor, grad_logits: torch.Tensor, hidden: torch.Tensor, first: bool = False) -> None:
    """``acc [V, H] += grad_logits^T @ hidden`` (``=`` for the ``first`` chunk, when ``acc`` is unset).

    Same dtype (fp32 everywhere, or a weight-dtype accumulator): one ``mm``/``addmm_`` into ``acc``.
    A 16-bit chunk into an fp32 accumulator: ``addmm(..., out_dtype=float32)`` where the device has
    it (the product stays fp32 inside the matmul, no copy), else in vocabulary tiles, each tile's
    product a temporary of a few MiB instead of a second [V, H] copy.
    """
    if first and grad_logits.dtype == acc.dtype:
        torch.mm(grad_logits.t(), hidden, out=acc)  # no zero-fill, no read of the accumulator
        return
    if first:
        acc.zero_()
    if grad_logits.dtype == acc.dtype:
        acc.addmm_(grad_logits.t(), hidden)
        return
    if addmm_out_dtype_supported(acc.device, grad_logits.dtype):
        torch.addmm(acc, grad_logits.t(), hidden, out_dtype=torch.float32, out=acc)
        return
    tile = max(256, (32 * 2**20) // max(1, hidden.shape[1] * 4))
    for v0 in range(0, acc.shape[0], tile):
        cols = slice(v0, min(acc.shape[0], v0 + tile))
        acc[cols] += grad_logits[:, cols].t() @ hidden


def _new_weight_grad(weight: torch.Tensor, accumulate_in_weight_dtype: bool, num_rows: int) -> torch.Tensor:
    """The d W accumulator: unset (the first chunk writes it), or zeros when there are no rows."""
    dtype = weight.dtype if accumulate_in_weight_dtype else torch.float32
    make = torch.empty if num_rows > 0 else torch.zeros
    return make(weight.shape, dtype=dtype, device=weight.device)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """[n] -> [1, n]: the row kernels take [B, T] rows."""
    return x.unsqueeze(0)


def _operands(weight: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype):
    """The weight and bias in the compute dtype (no copy when they have it already)."""
    return weight.to(dtype), None if bias is None else bias.to(dtype)


def chunked_row_stats(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      targets: torch.Tensor, chunk_size: int, dtype: torch.dtype,
                      row_stats: Callable[[torch.Tensor, torch.Tensor, slice], RowStats]) -> RowStats:
    """The forward's chunk loop: the logits ``hidden [n, H] @ weight^T [H, V] + bias`` are formed
    ``chunk_size`` rows at a time in ``dtype`` (autocast off, one reused buffer, never all n rows) and
    reduced at once by ``row_stats(logits [1, r, V], targets [1, r], rows)`` (``rows``: the chunk's
    slice of the n rows) to a ``RowStats`` of [1, r] tensors (its None fields stay None). Returns the
    ``RowStats`` of all n rows, [n] each."""
    n = hidden.shape[0]
    stats: Optional[list] = None
    with torch.autocast(hidden.device.type, enabled=False):
        for rows, _, _, logits in _logit_chunks(hidden, weight, bias, chunk_size, dtype):
            chunk = row_stats(_as_rows(logits), _as_rows(targets[rows]), rows)
            if stats is None:
                stats = [None if x is None else torch.empty(n, dtype=x.dtype, device=hidden.device) for x in chunk]
            for out, value in zip(stats, chunk):
                if out is not None:
                    out[rows] = value[0]
    if stats is None:  # no rows
        empty = torch.empty(0, dtype=torch.float32, device=hidden.device)
        return RowStats(empty, empty, empty, empty)
    return RowStats(*stats)


def _tiled_row_stats(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
                     chunk_size: int, dtype: torch.dtype, backend: RowBackend, transform: LogitTransform,
                     ignore_index: int, with_entropy: bool, with_sum_sq: bool) -> RowStats:
    """:func:`chunked_row_stats` for a head without a weight gradient: each chunk's statistics from
    ``backend.frozen_head_rows`` (the vocabulary in blocks; never a chunk's whole [c, V] logits)."""
    n = hidden.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    logp, entropy, row_max, log_sum = (torch.empty(n, **f32) for _ in range(4))
    sum_sq = torch.empty(n, **f32) if with_sum_sq else None
    with torch.autocast(hidden.device.type, enabled=False):
        w, b = _operands(weight, bias, dtype)
        for start in range(0, n, chunk_size):
            rows = slice(start, min(n, start + chunk_size))
            out = backend.frozen_head_rows(hidden[rows].to(dtype), w, b, targets[rows], transform.rows(rows),
                                           ignore_index, with_entropy, with_sum_sq)
            logp[rows], entropy[rows], row_max[rows], log_sum[rows] = out.logp, out.entropy, out.row_max, out.log_sum
            if with_sum_sq:
                sum_sq[rows] = out.sum_probs_sq
    return RowStats(logp, entropy, row_max, log_sum, sum_sq)


def _block_targets(targets: torch.Tensor, start: int, width: int, ignore_index: int) -> torch.Tensor:
    """Targets as indices into the vocabulary block ``[start, start + width)``: a target elsewhere
    becomes an index outside ``[0, width)`` (``backward_rows`` reads it as another shard's: no one-hot
    term), never ``ignore_index`` by accident; ``ignore_index`` stays."""
    outside = -1 if ignore_index != -1 else width
    local = targets - start
    inside = (local >= 0) & (local < width)
    return torch.where(targets == ignore_index, targets,
                       torch.where(inside, local, torch.full((), outside, dtype=targets.dtype, device=targets.device)))


def _tiled_hidden_grad(grad_hidden: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                       bias: Optional[torch.Tensor], targets: torch.Tensor, stats: tuple, grads: tuple,
                       backend: RowBackend, transform: LogitTransform, ignore_index: int, chunk_size: int,
                       dtype: torch.dtype) -> None:
    """``d hidden`` [n, H] of the log-prob Function when the head has no gradient: per chunk of rows,
    the vocabulary in blocks (``torch_rows.tile_columns``); each block's logits, their gradient from
    the forward's whole-row statistics (``backend.backward_rows``, the block's targets local to it),
    then ``d hidden += d logits_block @ W_block`` (fp32). Memory: a [c, Vb] block, not [c, V]."""
    row_max, log_sum, entropy = stats
    grad_logp, grad_entropy = grads
    n, v = hidden.shape[0], weight.shape[0]
    with torch.autocast(hidden.device.type, enabled=False):
        w, b = _operands(weight, bias, dtype)
        for start in range(0, n, chunk_size):
            rows = slice(start, min(n, start + chunk_size))
            h = hidden[rows].to(dtype)
            r = h.shape[0]
            width = tile_columns(r, v, hidden.device)
            buffer = torch.empty(r * width, dtype=dtype, device=hidden.device)  # flat: each block a contiguous view
            in_place = grad_hidden.dtype == torch.float32
            acc = grad_hidden[rows] if in_place else torch.empty(r, h.shape[1], dtype=torch.float32, device=h.device)
            g_logp = None if grad_logp is None else _as_rows(grad_logp[rows])
            g_ent = None if grad_entropy is None else _as_rows(grad_entropy[rows])
            for v0 in range(0, v, width):
                c = min(width, v - v0)
                w_block = w[v0:v0 + c]
                logits = _chunk_logits(h, w_block, None if b is None else b[v0:v0 + c], buffer[: r * c].view(r, c))
                grad_logits = backend.backward_rows(
                    _as_rows(logits), _as_rows(_block_targets(targets[rows], v0, c, ignore_index)),
                    _as_rows(row_max[rows]), _as_rows(log_sum[rows]), _as_rows(entropy[rows]), g_logp, g_ent,
                    transform.rows(rows), ignore_index, _as_rows(logits))[0]
                if acc.dtype != grad_logits.dtype:  # a 16-bit block's product, summed in fp32
                    product = grad_logits @ w_block
                    if v0 == 0:
                        acc.copy_(product)
                    else:
                        acc.add_(product)
                elif v0 == 0:
                    torch.mm(grad_logits, w_block, out=acc)
                else:
                    acc.addmm_(grad_logits, w_block)
            if not in_place:
                grad_hidden[rows] = acc


def _hand_over(grad: Optional[torch.Tensor], dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
    """An accumulated gradient in its input's dtype (rounded once, at the end)."""
    return None if grad is None or dtype is None else grad.to(dtype)


class FusedLinearTokenLogprobsFunction(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], bias [V] | None, targets [N]) -> (logp [N], entropy [N]).

    For ``fused_linear_token_logprobs`` and GSPO, whose per-token gradients are known only after the
    forward. The forward computes the logits chunk by chunk in ``dtype`` (the call's compute dtype,
    :func:`compute_dtype`; autocast is off inside) and keeps only the row max, log-sum and entropy
    per row. The backward recomputes each chunk's logits in the same recorded dtype, overwrites them
    with their gradient (row kernel, in place), then ``d hidden = d logits @ W`` and
    ``d W += d logits^T @ h`` (fp32 accumulator, or the weight's dtype with
    ``accumulate_in_weight_dtype``): 4 matmuls. Gradients come back in each input's own dtype.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, backend: RowBackend, transform: LogitTransform, ignore_index: int,
                with_entropy: bool, chunk_size: int, dtype: torch.dtype, accumulate_in_weight_dtype: bool = False,
                with_sum_sq: bool = False):
        if not any(ctx.needs_input_grad[1:3]) and backend.tiles_vocabulary(transform):  # frozen head, or no_grad
            stats = _tiled_row_stats(hidden, weight, bias, targets, chunk_size, dtype, backend, transform, ignore_index,
                                     with_entropy, with_sum_sq)
        else:
            stats = chunked_row_stats(
                hidden, weight, bias, targets, chunk_size, dtype,
                lambda logits, tgt, rows: backend.forward_rows(logits, tgt, transform.rows(rows), ignore_index,
                                                               with_entropy, with_sum_sq))
        return logprob_forward_outputs(
            ctx, (hidden, weight, bias, targets, stats.row_max, stats.log_sum, stats.entropy, stats.threshold,
                  stats.tie_index),
            (backend, transform, ignore_index, chunk_size, dtype, accumulate_in_weight_dtype), stats.logp,
            stats.entropy, stats.sum_probs_sq, with_sum_sq)

    @staticmethod
    @first_order
    def backward(ctx, grad_logp, grad_entropy, _grad_sum_sq=None):
        hidden, weight, bias, targets, row_max, log_sum, entropy, threshold, tie_index = ctx.saved_tensors
        backend, transform, ignore_index, chunk_size, dtype, accumulate_in_weight_dtype = ctx.config
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        n = hidden.shape[0]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = _new_weight_grad(weight, accumulate_in_weight_dtype, n) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_bias else None
        if need_hidden and not need_weight and not need_bias and threshold is None and backend.tiles_vocabulary(transform):
            _tiled_hidden_grad(grad_hidden, hidden, weight, bias, targets, (row_max, log_sum, entropy),
                               (grad_logp, grad_entropy), backend, transform, ignore_index, chunk_size, dtype)
            return (grad_hidden,) + (None,) * 11
        with torch.autocast(hidden.device.type, enabled=False):
            for rows, h, w, logits in _logit_chunks(hidden, weight, bias, chunk_size, dtype):
                g_logp = None if grad_logp is None else _as_rows(grad_logp[rows])
                g_ent = None if grad_entropy is None else _as_rows(grad_entropy[rows])
                kept = (None, None) if threshold is None else (_as_rows(threshold[rows]), _as_rows(tie_index[rows]))
                grad_logits = backend.backward_rows(
                    _as_rows(logits), _as_rows(targets[rows]), _as_rows(row_max[rows]), _as_rows(log_sum[rows]),
                    _as_rows(entropy[rows]), g_logp, g_ent, transform.rows(rows), ignore_index, _as_rows(logits), *kept,
                )[0]
                if need_hidden:
                    _write_hidden_grad(grad_hidden[rows], grad_logits, w)
                if need_weight:
                    _accumulate_weight_grad(grad_weight, grad_logits, h, first=rows.start == 0)
                if need_bias:
                    grad_bias += grad_logits.sum(0, dtype=torch.float32)  # no fp32 copy of the chunk
        return (
            grad_hidden,
            _hand_over(grad_weight, weight.dtype),
            _hand_over(grad_bias, None if bias is None else bias.dtype),
            None, None, None, None, None, None, None, None, None,
        )


def _write_hidden_grad(out: torch.Tensor, grad_logits: torch.Tensor, weight: torch.Tensor) -> None:
    """``out [c, H] = grad_logits @ weight``; straight into ``out`` when the dtypes agree."""
    if out.dtype == grad_logits.dtype:
        torch.mm(grad_logits, weight, out=out)
    else:
        out.copy_(grad_logits @ weight)


def _scaled_rows(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [c, H] * scale[:, None]`` in x's dtype (formed in fp32)."""
    return x * scale[:, None] if x.dtype == torch.float32 else (x.float() * scale[:, None]).to(x.dtype)


def _add_factored_grads(rows: RowGradient, e: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                        targets: torch.Tensor, ignore_index: int, grad_hidden: Optional[torch.Tensor],
                        grad_weight: Optional[torch.Tensor], first: bool) -> None:
    """The matmuls of one chunk whose gradient is in factored form (``kernels.torch_rows.RowGradient``):
    ``d logits = s[:, None] * e' + onehot(t) * g[:, None]`` with ``s = rows.row_scale``,
    ``g = rows.target_grad`` and ``e'`` [c, V] the buffer (0 at each target), so

        d hidden = s * (e' @ W) + g * W[t]              (a row scaling of the product, a gather of W)
        d W     += e'^T @ (s * h) + scatter_add_t(g * h) (the scaling moves onto h's rows)

    The same sums as ``d logits @ W`` and ``d logits^T @ h`` without the pass that scales ``e'``;
    each target's entry is added apart, as the accurate ``g`` (no ``1 - p`` cancellation)."""
    s, g = rows.row_scale, rows.target_grad
    t = torch.where(targets != ignore_index, targets, torch.zeros_like(targets)).long()
    if grad_hidden is not None:
        same = grad_hidden.dtype == e.dtype == torch.float32
        prod = torch.mm(e, weight, out=grad_hidden) if same else (e @ weight).float()
        prod.mul_(s[:, None]).addcmul_(weight.index_select(0, t).float(), g[:, None])
        if prod is not grad_hidden:
            grad_hidden.copy_(prod)
    if grad_weight is not None:
        _accumulate_weight_grad(grad_weight, e, _scaled_rows(h, s), first=first)
        grad_weight.index_add_(0, t, (h.float() * g[:, None]).to(grad_weight.dtype))


class LossCoefficients(Protocol):
    """``(logp [n], entropy [n], rows) -> (loss of these rows 0-d, d loss/d logp [n], d loss/d entropy [n] | None)``,
    float32; ``rows`` is the slice of the N rows they are (to read per-token constants)."""

    def __call__(self, logp: torch.Tensor, entropy: torch.Tensor, rows: slice) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        ...


class FusedLinearGRPOLossFunction(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], bias [V] | None, targets [N]) -> (loss 0-d, logp [N], entropy [N]).

    For a loss whose gradient w.r.t. each token's log-prob and entropy depends on that token (and
    constants) only, e.g. every token-level GRPO loss: the gradient is formed in the forward, in three
    matmuls, nothing recomputed. Per chunk of rows, in ``dtype`` (the call's compute dtype, autocast
    off inside): ``logits = h @ W^T (+ b)`` -> the backend's ``forward_backward_rows``: log-prob,
    entropy, then ``coefficients`` (the objective's ``d loss / d logp`` and ``d loss / d entropy``
    for these rows), then ``d logits`` written over the logits -> ``d hidden[rows] = d logits @ W``,
    ``d W += d logits^T @ h``, ``d b += sum d logits``. Without a bias gradient the row pass may
    leave ``d logits`` in factored form (``e'`` over the logits, a row scale and the target's entry
    apart: :func:`_add_factored_grads`), which the two gradient matmuls absorb (one pass over the
    chunk fewer; the torch backend does, the Triton one writes ``d logits``). Held until the
    backward: ``d hidden`` [N, H] (hidden's dtype), ``d W`` [V, H] (fp32, or the weight's dtype
    with ``accumulate_in_weight_dtype``) and ``d b`` [V] fp32; the backward multiplies them by the incoming gradient and hands them over,
    in each input's dtype (no copy when it is the accumulator's). So a second backward through the same
    graph (``retain_graph=True``) raises instead of silently returning a consumed buffer.

    ``logp`` and ``entropy`` are outputs without gradient (for metrics and ``per_token_logps``).
    ``entropy_grad``: whether ``coefficients`` may give a ``d loss / d entropy`` (an entropy bonus);
    the vocabulary-tiled path of a frozen head forms ``d H / d hidden`` only then (it raises if an
    undeclared one comes).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, coefficients: LossCoefficients, backend: RowBackend,
                transform: LogitTransform, ignore_index: int, chunk_size: int, dtype: torch.dtype,
                needs_grad: Tuple[bool, bool, bool], accumulate_in_weight_dtype: bool = False,
                entropy_grad: bool = True):
        need_hidden, need_weight, need_bias = needs_grad
        n = hidden.shape[0]
        device = hidden.device
        logp, entropy = (torch.empty(n, dtype=torch.float32, device=device) for _ in range(2))
        loss = torch.zeros((), dtype=torch.float32, device=device)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = _new_weight_grad(weight, accumulate_in_weight_dtype, n) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=device) if need_bias else None
        if not need_weight and not need_bias and backend.tiles_vocabulary(transform):  # a frozen head (LoRA)
            _tiled_loss_rows(hidden, weight, bias, targets, coefficients, backend, transform, ignore_index, chunk_size,
                             dtype, grad_hidden, entropy_grad, (loss, logp, entropy))
        else:
            _chunked_loss_rows(hidden, weight, bias, targets, coefficients, backend, transform, ignore_index, chunk_size,
                               dtype, (grad_hidden, grad_weight, grad_bias), (loss, logp, entropy))
        ctx.grads = (grad_hidden, grad_weight, grad_bias)
        ctx.out_dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(logp, entropy)
        return loss, logp, entropy

    @staticmethod
    @first_order
    def backward(ctx, grad_loss, _grad_logp, _grad_entropy):
        if ctx.grads is None:
            raise RuntimeError(
                "fused_linear_grpo_loss formed its gradient in the forward and handed it to the first backward; "
                "a second backward through the same graph (retain_graph=True) is not supported: recompute the loss"
            )
        grads, ctx.grads = ctx.grads, None  # the buffers now belong to the caller: no copy, no second use
        out = []
        for grad, dtype in zip(grads, ctx.out_dtypes):
            # (skipped for the common 1 on a CPU, where reading it costs nothing; never while compiling)
            unit = not torch.compiler.is_compiling() and grad_loss.device.type == "cpu" and grad_loss.item() == 1.0
            if grad is not None and not unit:
                grad.mul_(grad_loss)  # in the accumulator's dtype (fp32 for d W and d b), before rounding
            out.append(_hand_over(grad, dtype))
        return (*out,) + (None,) * 10


def _tiled_loss_rows(hidden, weight, bias, targets, coefficients: LossCoefficients, backend: RowBackend,
                     transform: LogitTransform, ignore_index: int, chunk_size: int, dtype: torch.dtype,
                     grad_hidden: Optional[torch.Tensor], entropy_grad: bool, outputs: tuple) -> None:
    """:class:`FusedLinearGRPOLossFunction`'s forward for a head without weight or bias gradient: per
    chunk of rows, ``backend.frozen_head_rows`` gives the log-probs, entropies and ``d logp / d h``
    (and ``d H / d h`` when ``entropy_grad``) walking the vocabulary in blocks; the loss's
    coefficients then combine them: ``d hidden = g_logp d logp/d h + g_entropy d H/d h``. Same FLOPs
    as the row chunks' three matmuls less ``d W`` (plus one [c, Vb] x [Vb, H] product per block for
    the entropy term); memory [c, Vb] instead of [c, V]. Fills ``outputs`` = (loss 0-d, logp [N],
    entropy [N]) and ``grad_hidden``."""
    loss, logp, entropy = outputs
    grads = (2 if entropy_grad else 1) if grad_hidden is not None else 0
    with torch.autocast(hidden.device.type, enabled=False):
        w, b = _operands(weight, bias, dtype)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, min(hidden.shape[0], start + chunk_size))
            out = backend.frozen_head_rows(hidden[rows].to(dtype), w, b, targets[rows], transform.rows(rows),
                                           ignore_index, True, False, grads)
            logp[rows], entropy[rows] = out.logp, out.entropy
            chunk_loss, g_logp, g_entropy = coefficients(out.logp, out.entropy, rows)
            loss.add_(chunk_loss)
            if grad_hidden is None:
                continue
            if g_entropy is not None and out.grad_entropy is None and not torch.compiler.is_compiling():
                raise RuntimeError("fused_linear_grpo_loss: the loss has an entropy gradient its caller did not declare "
                                   "(entropy_grad=False)")
            grad = out.grad_logp.mul_(g_logp.float().unsqueeze(-1))
            if g_entropy is not None and out.grad_entropy is not None:
                grad.addcmul_(out.grad_entropy, g_entropy.float().unsqueeze(-1))
            grad_hidden[rows] = grad


def _chunked_loss_rows(hidden, weight, bias, targets, coefficients: LossCoefficients, backend: RowBackend,
                       transform: LogitTransform, ignore_index: int, chunk_size: int, dtype: torch.dtype,
                       grads: tuple, outputs: tuple) -> None:
    """:class:`FusedLinearGRPOLossFunction`'s forward by chunks of rows (each chunk's [c, V] logits,
    overwritten by their gradient): fills ``outputs`` = (loss, logp, entropy) and ``grads`` =
    (d hidden, d W, d b), each None when not wanted."""
    loss, logp, entropy = outputs
    grad_hidden, grad_weight, grad_bias = grads
    need_hidden, need_weight, need_bias = (g is not None for g in grads)
    with torch.autocast(hidden.device.type, enabled=False):
        # each chunk's logits are overwritten by their gradient below
        for rows, h, w, grad_logits in _logit_chunks(hidden, weight, bias, chunk_size, dtype):

            def chunk_coefficients(lp, ent, rows=rows):
                chunk_loss, g_logp, g_entropy = coefficients(lp, ent, rows)
                loss.add_(chunk_loss)
                return g_logp, g_entropy

            # factored unless the bias needs its gradient (a plain column sum of d logits)
            out = backend.forward_backward_rows(grad_logits, targets[rows], transform.rows(rows), ignore_index,
                                                chunk_coefficients, factored=not need_bias)
            logp[rows], entropy[rows] = out.logp, out.entropy
            if out.row_scale is not None:
                _add_factored_grads(out, grad_logits, h, w, targets[rows], ignore_index,
                                    grad_hidden[rows] if need_hidden else None,
                                    grad_weight if need_weight else None, first=rows.start == 0)
                continue
            if need_hidden:
                _write_hidden_grad(grad_hidden[rows], grad_logits, w)
            if need_weight:
                _accumulate_weight_grad(grad_weight, grad_logits, h, first=rows.start == 0)
            if need_bias:
                grad_bias += grad_logits.sum(0, dtype=torch.float32)


# --------------------------------------------------------------------------------------------------
# sampling-mask replay: log-probs over each position's kept set (kernels/torch_replay.py's contract)
# --------------------------------------------------------------------------------------------------
class ReplaySplit:
    """A call's kept sets split by row size (``torch_replay.DENSE_ROW_FRACTION``): the sparse rows' sets
    in CSR form (the dense and the target-less rows' sets emptied, so the sparse kernels skip those rows),
    and the dense rows' indices with their own sets. ``valid`` [n]: rows with a target (``targets`` may
    hold -1, a target in another vocabulary shard: in no set here). ``vocab_size``: the logits' columns."""

    def __init__(self, targets: torch.Tensor, token_ids: torch.Tensor, offsets: torch.Tensor, vocab_size: int,
                 ignore_index: int) -> None:
        self.valid = targets != ignore_index
        self.targets = torch.where(self.valid, targets, torch.zeros_like(targets)).long()
        sizes = offsets[1:] - offsets[:-1]
        dense = self.valid & torch_replay.dense_rows(sizes, vocab_size)
        sparse = self.valid & ~dense
        num_sparse, self.num_dense = (int(x) for x in torch.stack([sparse.sum(), dense.sum()]).tolist())
        k = token_ids.numel()
        # the sparse rows' sets (the whole CSR when every row is sparse: no copy); each entry's kind by a bool
        # [K] repeat of its row's (no int64 row index of every entry: K can be N x V)
        if num_sparse == sparse.numel():
            self.token_ids, self.offsets = token_ids, offsets
        else:
            self.token_ids = (token_ids[torch.repeat_interleave(sparse, sizes, output_size=k)] if num_sparse
                              else token_ids[:0])
            self.offsets = torch.zeros_like(offsets)
            torch.cumsum(torch.where(sparse, sizes, torch.zeros_like(sizes)), 0, out=self.offsets[1:])
        # the dense rows' sets, in their order
        self.dense = dense.nonzero().squeeze(-1) if self.num_dense else dense.new_zeros(0, dtype=torch.int64)
        self.dense_sizes = sizes.index_select(0, self.dense)
        self.dense_offsets = torch.zeros(self.num_dense + 1, dtype=torch.int64, device=offsets.device)
        torch.cumsum(self.dense_sizes, 0, out=self.dense_offsets[1:])
        if self.num_dense == dense.numel():  # every row dense: the whole CSR
            self.dense_ids = token_ids
        elif self.num_dense:
            self.dense_ids = token_ids[torch.repeat_interleave(dense, sizes, output_size=k)]
        else:
            self.dense_ids = token_ids[:0]
        self.dense_stats: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # (row_max, log_sum) [D], the forward's
        self.vocab_size = vocab_size

    def dense_blocks(self, rows_per_block: int):
        """``DenseBlock`` per block of at most ``rows_per_block`` dense rows (one device sync for the bounds)."""
        if not self.num_dense:
            return
        starts = list(range(0, self.num_dense, rows_per_block)) + [self.num_dense]
        bounds = self.dense_offsets[torch.tensor(starts, device=self.dense_offsets.device)].tolist()
        for b in range(len(starts) - 1):
            start, stop, e0, e1 = starts[b], starts[b + 1], bounds[b], bounds[b + 1]
            yield DenseBlock(slice(start, stop), self.dense[start:stop], self.dense_ids[e0:e1],
                             self.dense_sizes[start:stop], self.dense_offsets[start:stop + 1] - e0)


# Most entries whose cells one step of DenseBlock.dropped indexes at once (a bounded int64 temporary:
# whole-vocabulary sets hold N x V ids)
_CELL_STEP = 1 << 21


class DenseBlock(NamedTuple):
    """A block of the dense rows: ``part`` its slice of them, ``index`` their rows, their sets (``ids``,
    ``sizes``, and in CSR form ``offsets``)."""

    part: slice
    index: torch.Tensor
    ids: torch.Tensor
    sizes: torch.Tensor
    offsets: torch.Tensor

    def dropped(self, x: torch.Tensor) -> torch.Tensor:
        """Bool like ``x [c, V]``: the cells off the sets. On a CPU one ``index_fill_`` of each row's own ids
        into its row (no per-entry temporary: K can be N x V); elsewhere (a launch per row would dominate)
        each entry's cell of the flattened block, its row times V plus its id, formed a bounded step of
        rows at a time."""
        c, v = x.shape
        drop = torch.ones(x.shape, dtype=torch.bool, device=x.device)
        bounds = self.offsets.tolist()
        if x.device.type == "cpu":
            ids = self.ids.long()  # (index_fill_ takes int64 indices; no copy when they are)
            for r in range(c):
                drop[r].index_fill_(0, ids[bounds[r]:bounds[r + 1]], False)
            return drop
        flat = drop.view(-1)
        r0 = 0
        while r0 < c:
            r1 = r0 + 1
            while r1 < c and bounds[r1 + 1] - bounds[r0] <= _CELL_STEP:
                r1 += 1
            cells = torch.repeat_interleave(torch.arange(r0, r1, device=x.device) * v, self.sizes[r0:r1],
                                            output_size=bounds[r1] - bounds[r0])
            flat.index_fill_(0, cells.add_(self.ids[bounds[r0]:bounds[r1]]), False)
            r0 = r1
        return drop


_OUTSIDE = -1  # the target of a dense row whose target is not in its set (backward_rows: no one-hot term)
_NO_IGNORE = -2  # (dense rows all have targets)


def _kept_targets(targets: torch.Tensor, drop: torch.Tensor):
    """(targets [c, 1] safe to gather, bool [c, 1]: the target is a kept column of the block) from the
    block's ``drop`` mask (a target outside ``[0, V)``, another shard's -1, in no set)."""
    t = targets.long().unsqueeze(-1)
    inside = (t >= 0) & (t < drop.shape[-1])
    t = torch.where(inside, t, torch.zeros_like(t))
    return t, inside & ~drop.gather(-1, t)


def _dense_block_stats(x: torch.Tensor, block: DenseBlock, split: ReplaySplit, transform: LogitTransform,
                       backend: RowBackend, with_entropy: bool, with_sum_sq: bool):
    """(logp, entropy, sum_sq, lse) [c] of a block of dense rows, their logits ``x [c, V]`` materialised
    (overwritten). Without a soft cap the ids off a set are set to ``-inf`` in place and the backend's plain
    row pass runs on them (``z = slope x`` keeps ``-inf``): the full-vocabulary pass's cost and kernel, plus
    one masked fill; its ``(row_max, log_sum)`` are kept for the backward. With a cap (``tanh(-inf)`` is
    finite) ``torch_replay.dense_forward``."""
    targets = split.targets.index_select(0, block.index)
    tf = transform.rows(block.index)
    if transform.softcap is not None:
        return torch_replay.dense_forward(x, targets, block.ids, block.offsets, *_transform_args(transform, block.index),
                                          with_entropy=with_entropy, with_sum_sq=with_sum_sq)
    drop = block.dropped(x)
    x.masked_fill_(drop, float("-inf"))
    t, hit = _kept_targets(targets, drop)
    hit = hit.squeeze(-1) & (x.gather(-1, t).squeeze(-1) > float("-inf"))  # (a kept -inf logit: out too)
    stats = backend.forward_rows(x.unsqueeze(0), torch.where(hit, t.squeeze(-1), 0).unsqueeze(0), tf, _NO_IGNORE,
                                 with_entropy, with_sum_sq)
    if split.dense_stats is None:
        f32 = dict(dtype=torch.float32, device=x.device)
        split.dense_stats = (torch.empty(split.num_dense, **f32), torch.empty(split.num_dense, **f32))
    split.dense_stats[0][block.part], split.dense_stats[1][block.part] = stats.row_max[0], stats.log_sum[0]
    lse = backend.log_normalizer(stats.row_max, stats.log_sum, tf)[0]
    logp = torch.where(hit, stats.logp[0], torch.full((), float("-inf"), device=x.device))
    zeros = torch.zeros_like(lse)
    return (logp, stats.entropy[0] if with_entropy else zeros,
            stats.sum_probs_sq[0] if with_sum_sq else zeros, lse)


def _dense_block_grad(x: torch.Tensor, block: DenseBlock, split: ReplaySplit, lse: torch.Tensor, lse_forward,
                      entropy: torch.Tensor, g_logp, g_ent, transform: LogitTransform, backend: RowBackend):
    """``d x`` of a block of dense rows (``x [c, V]`` their logits, overwritten by the gradient where the
    backend writes in place): the masked logits through the backend's ``backward_rows`` with the normaliser
    ``lse`` (the forward's ``lse_forward`` shifted: another vocabulary shard's mass), or, with a soft cap,
    ``torch_replay.dense_backward`` (fp32)."""
    index = block.index
    targets = split.targets.index_select(0, index)
    g = None if g_logp is None else g_logp.index_select(0, index)
    e = None if g_ent is None else g_ent.index_select(0, index)
    if transform.softcap is not None:
        return torch_replay.dense_backward(x, targets, block.ids, block.offsets, lse.index_select(0, index),
                                           entropy.index_select(0, index), g, e, *_transform_args(transform, index))
    drop = block.dropped(x)
    x.masked_fill_(drop, float("-inf"))
    t, hit = _kept_targets(targets, drop)
    hit = hit.squeeze(-1) & (x.gather(-1, t).squeeze(-1) > float("-inf"))
    row_max, log_sum = (s[block.part] for s in split.dense_stats)
    log_sum = backend.shift_log_sum(log_sum, lse.index_select(0, index) - lse_forward.index_select(0, index))
    rows = x.unsqueeze(0)
    backend.backward_rows(rows, torch.where(hit, t.squeeze(-1), _OUTSIDE).unsqueeze(0), row_max.unsqueeze(0),
                          log_sum.unsqueeze(0), entropy.index_select(0, index).unsqueeze(0),
                          None if g is None else g.unsqueeze(0), None if e is None else e.unsqueeze(0),
                          transform.rows(index), _NO_IGNORE, rows)
    return x


def _replay_temperature(transform: LogitTransform, index=None):
    """The replay kernels' temperature: a float, or float32 [n] (of the rows ``index`` picks)."""
    if not transform.per_row:
        return transform.temperature
    flat = transform.temperature.reshape(-1)
    flat = flat if index is None else (flat[index] if isinstance(index, slice) else flat.index_select(0, index))
    return flat.to(torch.float32).contiguous()


def _transform_args(transform: LogitTransform, index=None) -> tuple:
    return _replay_temperature(transform, index), transform.softcap, transform.logit_scale


def finite_grad(grad_logp: Optional[torch.Tensor], logp: torch.Tensor) -> Optional[torch.Tensor]:
    """``grad_logp`` [n] fp32 with 0 where the log-prob is -inf (a target outside its set: no gradient)."""
    if grad_logp is None:
        return None
    logp = logp.reshape(-1)
    return torch.where(logp > float("-inf"), grad_logp.reshape(-1).float(), torch.zeros((), device=logp.device))


def _flat_views(rows: torch.Tensor):
    """``(slice of the n = B * T rows, [r, V] view)`` of logits rows ``[B, T, V]``: one view when the
    leading dimensions merge without a copy, else one per sequence (each [T, V], any row stride)."""
    b, t, v = rows.shape
    try:
        return [(slice(0, b * t), rows.view(b * t, v))]
    except RuntimeError:
        return [(slice(i * t, (i + 1) * t), rows[i]) for i in range(b)]


def _csr_slice(token_ids: torch.Tensor, offsets: torch.Tensor, rows: slice):
    """The sets of a contiguous range of rows, offsets rebased."""
    off = offsets[rows.start:rows.stop + 1]
    lo, hi = int(off[0]), int(off[-1])
    return token_ids[lo:hi], off - lo


def replay_outputs(split: ReplaySplit, logp, entropy, sum_sq):
    """Rows without a target: 0 everywhere (their sets were emptied: -inf / 0 came out)."""
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    return tuple(torch.where(split.valid, x, zero) for x in (logp, entropy, sum_sq))


def replay_rows_stats(logits: torch.Tensor, split: ReplaySplit, transform: LogitTransform, backend: RowBackend,
                      with_entropy: bool, with_sum_sq: bool):
    """(logp, entropy, sum_sq, lse) [n] fp32 over the sets of logits rows ``[B, T, V]``: the sparse rows by
    ``backend.replay()`` (reading only the kept entries), the dense ones a block of rows at a time."""
    n, t, v = split.valid.numel(), logits.shape[1], logits.shape[-1]
    f32 = dict(dtype=torch.float32, device=logits.device)
    stats = [torch.empty(n, **f32) for _ in range(4)]
    kernels = backend.replay()
    for rows, view in _flat_views(logits):
        ids, off = _csr_slice(split.token_ids, split.offsets, rows)
        out = kernels.replay_rows_forward(view, split.targets[rows], ids, off, *_transform_args(transform, rows),
                                          with_entropy=with_entropy, with_sum_sq=with_sum_sq)
        for buffer, value in zip(stats, out):
            buffer[rows] = value
    for block in split.dense_blocks(torch_rows.block_rows(v, logits.device)):
        x = logits[block.index // t, block.index % t]  # (a copy: masked in place)
        out = _dense_block_stats(x, block, split, transform, backend, with_entropy, with_sum_sq)
        for buffer, value in zip(stats, out):
            buffer[block.index] = value
    return tuple(stats)


def replay_rows_grad(logits: torch.Tensor, split: ReplaySplit, lse: torch.Tensor, lse_forward: torch.Tensor,
                     entropy: torch.Tensor, g_logp: Optional[torch.Tensor], g_ent: Optional[torch.Tensor],
                     transform: LogitTransform, backend: RowBackend, out: torch.Tensor) -> None:
    """``d logits`` into ``out`` (the shape of ``logits [B, T, V]``, or ``logits`` itself): the dense rows'
    first (an in-place buffer is about to lose their logits), then every row's by the sparse kernels (the
    whole rows written: 0 off the sets), then the dense rows'. ``lse``: the normaliser of each set (another
    shard's mass included), ``lse_forward`` the forward's own."""
    t, v = logits.shape[1], logits.shape[-1]
    dense = []
    for block in split.dense_blocks(torch_rows.block_rows(v, logits.device)):
        x = logits[block.index // t, block.index % t]
        dx = _dense_block_grad(x, block, split, lse, lse_forward, entropy, g_logp, g_ent, transform, backend)
        dense.append((block.index, dx.to(out.dtype)))
    kernels = backend.replay()
    flat_out = None if out is logits else out.view(-1, v)
    for rows, source in _flat_views(logits):
        ids, off = _csr_slice(split.token_ids, split.offsets, rows)
        kernels.replay_rows_backward(
            source, split.targets[rows], ids, off, lse[rows], entropy[rows],
            None if g_logp is None else g_logp[rows], None if g_ent is None else g_ent[rows],
            *_transform_args(transform, rows), out=source if flat_out is None else flat_out[rows])
    for index, dx in dense:
        out[index // t, index % t] = dx


class ReplayTokenLogprobsFunction(torch.autograd.Function):
    """(logits [B, T, V], targets [B, T], the kept sets' token_ids [K] / offsets [B*T + 1]) -> (logp, entropy,
    sum of squared probabilities or a 0-d 0) [B, T] fp32 over each position's set: sampling-mask replay.

    Sparse rows go to ``backend.replay()``'s row kernels (only the kept entries of the logits are read);
    rows with a large set (``torch_replay.DENSE_ROW_FRACTION``) to the dense masked path, a block of rows
    at a time. Saved: the logits (a reference), the sets, and two fp32 numbers per row (lse, entropy)."""

    @staticmethod
    def forward(ctx, logits, targets, token_ids, offsets, backend: RowBackend, transform: LogitTransform,
                ignore_index: int, with_entropy: bool, inplace_backward: bool, with_sum_sq: bool):
        split = ReplaySplit(targets.reshape(-1), token_ids, offsets, logits.shape[-1], ignore_index)
        logp, entropy, sum_sq, lse = replay_rows_stats(logits, split, transform, backend, with_entropy, with_sum_sq)
        logp, entropy, sum_sq = replay_outputs(split, logp, entropy, sum_sq)
        ctx.split = split
        shape = targets.shape
        return logprob_forward_outputs(ctx, (logits, lse, entropy, logp), (backend, transform, inplace_backward),
                                       logp.view(shape), entropy.view(shape), sum_sq.view(shape), with_sum_sq)

    @staticmethod
    @first_order
    def backward(ctx, grad_logp, grad_entropy, _grad_sum_sq=None):
        logits, lse, entropy, logp = ctx.saved_tensors
        backend, transform, inplace_backward = ctx.config
        out = gradient_buffer(logits, inplace_backward)
        replay_rows_grad(logits, ctx.split, lse, lse, entropy, finite_grad(grad_logp, logp),
                         None if grad_entropy is None else grad_entropy.reshape(-1).float(), transform, backend, out)
        written_in_place(logits, out)
        return (out,) + (None,) * 9


def replay_linear_stats(hidden, weight, bias, split: ReplaySplit, backend: RowBackend, transform: LogitTransform,
                        with_entropy: bool, chunk_size: int, dtype: torch.dtype, with_sum_sq: bool):
    """(logp, entropy, sum_sq, lse) [n] fp32 over the sets of ``hidden [n, H] @ weight^T (+ bias)``: the sparse
    rows by ``backend.replay()`` (only the kept rows of the weight read), the dense ones ``chunk_size`` rows
    of logits at a time. Matmuls in ``dtype``, autocast off."""
    with torch.autocast(hidden.device.type, enabled=False):
        w, b = _operands(weight, bias, dtype)
        stats = backend.replay().replay_linear_forward(
            hidden.to(dtype), w, b, split.targets, split.token_ids, split.offsets, *_transform_args(transform),
            with_entropy=with_entropy, with_sum_sq=with_sum_sq)
        for block in split.dense_blocks(chunk_size):
            x = torch.nn.functional.linear(hidden.index_select(0, block.index).to(dtype), w, b)
            out = _dense_block_stats(x, block, split, transform, backend, with_entropy, with_sum_sq)
            for buffer, value in zip(stats, out):
                buffer[block.index] = value
    return stats


def replay_linear_grads(hidden, weight, bias, split: ReplaySplit, lse, lse_forward, entropy, g_logp, g_ent,
                        backend: RowBackend,
                        transform: LogitTransform, chunk_size: int, dtype: torch.dtype,
                        accumulate_in_weight_dtype: bool, needs: Tuple[bool, bool, bool]):
    """(d hidden, d weight, d bias), each None unless ``needs`` it, in the inputs' dtypes: the sparse rows'
    from ``backend.replay()`` (``d weight`` only on the kept ids, deterministic), the dense rows' from their
    recomputed logits (``d hidden = dx @ W``, ``d W += dx^T @ h``, fp32 or, with
    ``accumulate_in_weight_dtype``, the weight's dtype), summed."""
    need_hidden, need_weight, need_bias = needs
    sparse = split.token_ids.numel() > 0  # (else the sparse kernels have no weight rows to write: no [V, H] zeros)
    with torch.autocast(hidden.device.type, enabled=False):
        w, b = _operands(weight, bias, dtype)
        grad_hidden, grad_weight, grad_bias = backend.replay().replay_linear_backward(
            hidden.to(dtype), w, b, split.targets, split.token_ids, split.offsets, lse, entropy, g_logp, g_ent,
            *_transform_args(transform), needs_hidden_grad=need_hidden, needs_weight_grad=need_weight and sparse,
            needs_bias_grad=need_bias and sparse)
        if split.num_dense:
            acc_dtype = weight.dtype if accumulate_in_weight_dtype else torch.float32
            acc = None
            if need_weight:  # the sparse rows' d weight is the accumulator when it has its dtype (no second [V, H])
                acc = (grad_weight if grad_weight is not None and grad_weight.dtype == acc_dtype
                       else _new_weight_grad(weight, accumulate_in_weight_dtype, split.num_dense))
            first = acc is not grad_weight  # (a new accumulator: the first block writes it, no zero-fill)
            bias_acc = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_bias else None
            for block in split.dense_blocks(chunk_size):
                index = block.index
                h = hidden.index_select(0, index).to(dtype)
                dx = _dense_block_grad(torch.nn.functional.linear(h, w, b), block, split, lse, lse_forward, entropy,
                                       g_logp, g_ent, transform, backend)
                if need_bias:
                    bias_acc += dx.sum(0, dtype=torch.float32)
                dx = dx.to(dtype)
                if need_hidden:
                    grad_hidden.index_copy_(0, index, (dx @ w).to(grad_hidden.dtype))
                if need_weight:
                    _accumulate_weight_grad(acc, dx, h, first=first)
                first = False
            if need_weight:
                if grad_weight is not None and acc is not grad_weight:
                    acc.add_(grad_weight.to(acc.dtype))
                grad_weight = acc
            if need_bias:
                grad_bias = bias_acc if grad_bias is None else bias_acc.add_(grad_bias.float())
        if need_weight and grad_weight is None:  # no kept id at all
            grad_weight = torch.zeros_like(weight)
        if need_bias and grad_bias is None:
            grad_bias = torch.zeros_like(bias)
    return (None if grad_hidden is None else grad_hidden.to(hidden.dtype), _hand_over(grad_weight, weight.dtype),
            _hand_over(grad_bias, None if bias is None else bias.dtype))


class ReplayLinearTokenLogprobsFunction(torch.autograd.Function):
    """(hidden [n, H], weight [V, H], bias [V] | None, targets [n], the kept sets token_ids [K] / offsets
    [n + 1]) -> (logp, entropy, sum of squared probabilities or a 0-d 0) [n] fp32: sampling-mask replay
    from hidden states, the [n, V] logits never formed for the sparse rows.

    Sparse rows: ``backend.replay()``'s fused-linear kernels (only the kept rows of the weight are read;
    ``d weight`` written only on them, deterministically). Rows with a large set: the dense masked path,
    ``chunk_size`` rows of logits at a time (the plain fused-linear pass's cost), forward and, recomputed,
    backward (:func:`replay_linear_stats`, :func:`replay_linear_grads`)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, token_ids, offsets, backend: RowBackend,
                transform: LogitTransform, ignore_index: int, with_entropy: bool, chunk_size: int,
                dtype: torch.dtype, accumulate_in_weight_dtype: bool, with_sum_sq: bool):
        split = ReplaySplit(targets, token_ids, offsets, weight.shape[0], ignore_index)
        logp, entropy, sum_sq, lse = replay_linear_stats(hidden, weight, bias, split, backend, transform, with_entropy,
                                                         chunk_size, dtype, with_sum_sq)
        logp, entropy, sum_sq = replay_outputs(split, logp, entropy, sum_sq)
        ctx.split = split
        return logprob_forward_outputs(
            ctx, (hidden, weight, bias, lse, entropy, logp),
            (backend, transform, chunk_size, dtype, accumulate_in_weight_dtype), logp, entropy, sum_sq, with_sum_sq)

    @staticmethod
    @first_order
    def backward(ctx, grad_logp, grad_entropy, _grad_sum_sq=None):
        hidden, weight, bias, lse, entropy, logp = ctx.saved_tensors
        backend, transform, chunk_size, dtype, accumulate_in_weight_dtype = ctx.config
        grads = replay_linear_grads(hidden, weight, bias, ctx.split, lse, lse, entropy, finite_grad(grad_logp, logp),
                                    None if grad_entropy is None else grad_entropy.float(), backend, transform,
                                    chunk_size, dtype, accumulate_in_weight_dtype, tuple(ctx.needs_input_grad[:3]))
        return grads + (None,) * 11
