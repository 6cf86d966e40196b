"""Vocabulary-parallel log-probs and GRPO loss: each rank holds a contiguous shard of the vocabulary.

Megatron-style tensor parallelism shards the lm_head over the vocabulary (a column-parallel output
layer): with ``W`` ranks, rank ``r`` holds the logits ``[..., V_r]`` (or ``weight [V_r, H]``) of the
ids ``[start_r, start_r + V_r)``, the shards in rank order, ``V = sum V_r``. The public functions take
``process_group=`` and dispatch here; everything but the row statistics is the single-device code.

The algebra is the split-vocabulary merge of the row kernels (``kernels/triton_rows.py``, few rows),
across ranks instead of across programs. Each rank computes, per token and over its own shard only,
``lse_r = log sum_j exp(z_j)``, the shard's entropy ``H_r`` and, on the rank that owns the target,
``logp_r = z_t - lse_r``. With ``M = max_r lse_r``, ``x_r = lse_r - M <= 0``, ``a_r = exp(x_r)`` and
``S = sum_r a_r`` (so ``lse = M + log S`` and shard ``r`` holds the probability mass ``a_r / S``)::

    logp = (logp_r + x_r)[owner] - log S
    H    = sum_r (a_r / S) (H_r + lse - lse_r) = (sum_r a_r H_r + sum_r a_r (-x_r)) / S + log S

so a call communicates one all-reduce MAX of ``[N]`` and one all-reduce SUM of ``[4, N]`` float32
(``[2, N]`` without entropy): 20 bytes per token, never the logits; the owner's term reaches the
others through the SUM (the other ranks add 0, exactly). Every rank then holds bitwise the same
``logp`` and ``H``, so the loss maths after them (``objective``, autograd through it) is the
single-device code and gives every rank the same loss, metrics and ``d loss / d logp``,
``d loss / d H`` per token.

Backward: no communication. The softmax of the whole vocabulary restricted to a shard is the shard's
softmax with the normaliser ``exp(lse - lse_r)`` times larger (``RowBackend.shift_log_sum``), so the
row kernels' own backward, given the global entropy, writes this shard's slice of the unsharded
gradient; a row whose target lies in another shard is passed the local target ``-1`` (no one-hot
term: ``backward_rows``' contract). For hidden states, ``d hidden = d logits_r @ W_r`` is this rank's
partial sum, as a column-parallel layer's input gradient is before the tensor-parallel all-reduce;
``reduce_hidden_grad=True`` all-reduces it here.

A temperature tensor (per sequence or per token) and ``return_sum_probs_sq`` (one more term of the SUM:
``sum_r a_r^2 q_r / S^2``, ``q_r`` the shard's own sum of squared probabilities) work as on one device.
The sampler's ``top_k`` / ``top_p`` are refused with a ValueError naming them (:func:`refuse_truncation`):
their thresholds need the whole vocabulary's order, a distributed search (counts and masses above a
candidate all-reduced at every step) this module does not do.

Agreement: before any statistics, one all-reduce MAX of ``2 W + 2 K`` int64 (``K`` =
:data:`FINGERPRINT_SLOTS`) gathers every rank's shard size and a fingerprint of the call (shapes,
options, and cheap sums of the targets, advantages, masks and per-token inputs): arguments that
differ across ranks, or that one rank refused, raise the same ValueError on every rank instead of
hanging in a collective or returning a wrong answer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from typing import Any, Iterator, List, NamedTuple, Optional, Tuple

import torch

from . import _validation as V
from . import backends, objective
from .autograd import (FusedLinearTokenLogprobsFunction, ReplaySplit, TokenLogprobsFunction, chunked_row_stats,
                       finite_grad, first_order, gradient_buffer, written_in_place, logprob_forward_outputs,
                       replay_linear_grads, replay_linear_stats, replay_rows_grad, replay_rows_stats)
from .kernels import torch_replay
from .kernels.layout import as_rows
from .objective import GRPOLossOutput
from .options import IGNORE_INDEX, GRPOInputs, LogitTransform
from .prepare import check_sampling_mask_type, linear_rows, prepare_grpo, scatter_rows, take_transform
from .sampling_mask import SamplingMask

# Local target codes handed to the row kernels: a row's target in another rank's shard, and an
# ignored row. Both negative, so no local id (>= 0) collides with them, whatever ignore_index is.
OTHER_SHARD = -1
LOCAL_IGNORE = -2
# Fingerprint slots exchanged by every call (a fixed count: ranks in different calls must still
# exchange tensors of one size, and then disagree loudly).
FINGERPRINT_SLOTS = 24
_FINGERPRINT_MASK = (1 << 62) - 1


def _dist():
    import torch.distributed as dist

    return dist


# --------------------------------------------------------------------------------------------------
# the group, the shard, and the agreement of the ranks
# --------------------------------------------------------------------------------------------------
class VocabShard(NamedTuple):
    """This rank's place in the vocabulary: ids ``[start, start + size)`` of ``vocab_size``."""

    group: Any  # torch.distributed.ProcessGroup
    rank: int
    world_size: int
    start: int
    size: int
    vocab_size: int
    sizes: Tuple[int, ...]  # every rank's shard size, in rank order


def is_dtensor(x: object) -> bool:
    """Whether ``x`` is a ``torch.distributed.tensor.DTensor`` (False where torch has no distributed)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed
        return False
    return isinstance(x, DTensor)


def check_group(process_group: Any, backend: str = "auto") -> Any:
    """``process_group`` once it is a ProcessGroup of an initialised ``torch.distributed`` holding this rank
    (and the backend is not the reference, which computes on the whole vocabulary)."""
    if backend == "reference":
        raise ValueError("backend='reference' computes on the whole vocabulary; it takes no process_group")
    dist = _dist()
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("process_group was given but torch.distributed is not initialised (init_process_group)")
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed.ProcessGroup or None, got {type(process_group).__name__}")
    if dist.get_rank(process_group) < 0:
        raise ValueError("process_group does not contain this rank")
    return process_group


def resolve_sharded_head(process_group: Any, weight: torch.Tensor, bias: Optional[torch.Tensor], backend: str = "auto"):
    """(group or None, local weight, local bias): a DTensor weight sharded on dim 0 over a 1-D mesh
    implies the group (its mesh's) and is replaced by its local shard (differentiable: the gradient
    flows back to the DTensor); a plain weight keeps ``process_group``."""
    if not is_dtensor(weight):
        if is_dtensor(bias):
            raise TypeError("bias is a DTensor but weight is not: shard both over the vocabulary, or neither")
        return (None if process_group is None else check_group(process_group, backend)), weight, bias
    from torch.distributed.tensor import Shard

    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ValueError(
            f"weight is a DTensor with placements {tuple(weight.placements)} on a {mesh.ndim}-D mesh; only a weight "
            "sharded over the vocabulary, Shard(0) on a 1-D mesh, is vocabulary-parallel (gather it otherwise)"
        )
    group = check_group(mesh.get_group(), backend)
    dist = _dist()
    if process_group is not None and (dist.get_process_group_ranks(check_group(process_group, backend))
                                      != dist.get_process_group_ranks(group)):
        raise ValueError("process_group differs from the group of weight's device mesh; pass one of them")
    if bias is not None:
        if not is_dtensor(bias) or bias.device_mesh != mesh or tuple(bias.placements) != (Shard(0),):
            raise ValueError("bias must be a DTensor sharded Shard(0) on weight's device mesh when weight is one")
        bias = bias.to_local()
    return group, weight.to_local(), bias


def world_size(group: Any) -> int:
    return _dist().get_world_size(group)


def _collective_device(group: Any) -> torch.device:
    """Where this group's collectives take tensors: CUDA for NCCL, else the CPU (gloo)."""
    if _dist().get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _hash(value: Any) -> int:
    """A stable 62-bit hash of a value's repr (the same on every rank, unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") >> 2


@torch.no_grad()
def _tensor_fingerprint(x: torch.Tensor) -> torch.Tensor:
    """A cheap position-sensitive sum of a tensor, an int64 scalar on its device (no synchronisation):
    equal tensors give equal fingerprints on every rank of one device type."""
    flat = x.detach().reshape(-1)
    weights = torch.arange(flat.numel(), device=flat.device) % 8191 + 1
    if flat.is_floating_point():  # the bits of a float64 sum
        total = (flat.double() * weights).sum().reshape(1).view(torch.int64).reshape(()) ^ 1
    else:
        total = (flat.long() * weights).sum() ^ 2
    return total & _FINGERPRINT_MASK  # 62 bits: the exchange negates them (no int64 overflow)


class _Agreement:
    """What a rank declares before the collectives: its shard size and named fingerprints."""

    def __init__(self) -> None:
        self.local_size = 0
        self.names: List[str] = []
        self.values: List[Any] = []  # ints, or int64 scalars on the data's device
        self.shard: Optional[VocabShard] = None  # set when the ranks agreed

    def declare(self, name: str, value: Any) -> None:
        """A scalar (hashed) or a tensor (summed) that must be equal on every rank."""
        self.names.append(name)
        self.values.append(_tensor_fingerprint(value) if isinstance(value, torch.Tensor) else _hash(value))

    def fingerprints(self, slots: int) -> torch.Tensor:
        """The declared values as int64 [slots] on the CPU, padded with 0 (one device transfer)."""
        device = next((v.device for v in self.values if isinstance(v, torch.Tensor)), torch.device("cpu"))
        out = torch.zeros(slots, dtype=torch.int64, device=device)
        for i, value in enumerate(self.values):
            out[i] = value
        return out.cpu()


@contextlib.contextmanager
def agreement(group: Any) -> Iterator[_Agreement]:
    """Run a call's local checks inside ``with agreement(group) as agree:`` and declare its
    shard size (``agree.local_size``) and fingerprints there; on leaving, the ranks exchange them
    in one all-reduce, so a check that failed on one rank, or arguments that differ, raise on
    every rank (a local ValueError/TypeError is re-raised where it happened). ``agree.shard`` is
    then this rank's :class:`VocabShard`."""
    dist = _dist()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    agree = _Agreement()
    failure: Optional[BaseException] = None
    try:
        yield agree
    except (TypeError, ValueError) as error:
        failure = error
    k = FINGERPRINT_SLOTS
    if failure is None and len(agree.values) > k:
        raise AssertionError(f"{len(agree.values)} fingerprints, FINGERPRINT_SLOTS is {k}")
    local = torch.zeros(2 * world + 2 * k, dtype=torch.int64)
    local[rank] = agree.local_size if failure is None else 0
    local[world + rank] = 1 if failure is not None else 0
    if failure is None:
        local[2 * world: 2 * world + k] = agree.fingerprints(k)
    local[2 * world + k:] = -local[2 * world: 2 * world + k]
    exchanged = local.to(_collective_device(group))
    dist.all_reduce(exchanged, op=dist.ReduceOp.MAX, group=group)
    exchanged = exchanged.cpu().tolist()
    failed = [r for r in range(world) if exchanged[world + r]]
    if failure is not None:
        raise failure
    if failed:
        raise ValueError(f"the arguments of this vocabulary-parallel call were refused on rank(s) {failed} of the "
                         "process_group (see the error there); they must be valid, and the same, on every rank")
    high, low = exchanged[2 * world: 2 * world + k], exchanged[2 * world + k:]
    differ = [name for i, name in enumerate(agree.names) if high[i] != -low[i]]
    if differ:
        raise ValueError(
            f"vocabulary-parallel arguments differ across the ranks of process_group: {', '.join(differ)}; every "
            "rank passes the same targets, advantages, masks, per-token inputs and options (only its shard differs)"
        )
    sizes = tuple(exchanged[:world])
    if min(sizes) < 1:
        raise ValueError(f"every rank's vocabulary shard must be non-empty, got sizes {list(sizes)}")
    agree.shard = VocabShard(group, rank, world, sum(sizes[:rank]), sizes[rank], sum(sizes), sizes)


def check_targets_in_vocabulary(ids: torch.Tensor, shard: VocabShard, ignore_index: int, name: str) -> None:
    """Targets are global ids: each in exactly one rank's shard (the same check on every rank)."""
    if ids.numel() == 0:
        return
    bad = (ids != ignore_index) & ((ids < 0) | (ids >= shard.vocab_size))
    if bool(bad.any()):
        raise ValueError(
            f"{name} holds id {ids[bad][0].item()} outside every vocabulary shard: the {shard.world_size} ranks' "
            f"shards of sizes {list(shard.sizes)} cover [0, {shard.vocab_size}); use ignore_index={ignore_index} "
            "for positions without a target"
        )


def local_targets(ids: torch.Tensor, shard: VocabShard, ignore_index: int) -> torch.Tensor:
    """Global ids -> this shard's codes: ``id - start`` where the shard owns it, :data:`OTHER_SHARD`
    where another does, :data:`LOCAL_IGNORE` where the id is ``ignore_index``."""
    local = ids.long() - shard.start
    local = torch.where((local >= 0) & (local < shard.size), local, torch.full_like(local, OTHER_SHARD))
    return torch.where(ids == ignore_index, torch.full_like(local, LOCAL_IGNORE), local)


# --------------------------------------------------------------------------------------------------
# the merge of the shards' statistics (the module docstring's formulas)
# --------------------------------------------------------------------------------------------------
def merge_shard_statistics(group: Any, lse: torch.Tensor, logp: torch.Tensor, entropy: torch.Tensor,
                           owned: torch.Tensor, valid: torch.Tensor, with_entropy: bool,
                           sum_sq: Optional[torch.Tensor] = None):
    """Per-token statistics of one shard -> (logp, entropy, shift, sum_sq) of the whole vocabulary.

    ``lse``, ``logp`` (meaningful where ``owned``), ``entropy`` float32 [n]; ``owned`` / ``valid``
    bool [n]; ``sum_sq`` [n] (optional): the shard's sum of squared probabilities of its own softmax,
    ``q_r``, which merges as ``sum_r a_r^2 q_r / S^2`` (shard r's probabilities are its own times
    ``a_r / S``). Returns float32 [n] tensors, bitwise equal on every rank, 0 where not ``valid``;
    ``shift = lse_global - lse_shard`` (for ``RowBackend.shift_log_sum``); the merged sum of squares
    or None. Two all-reduces.
    """
    dist = _dist()
    device = lse.device
    top = lse.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    x = lse - top  # <= 0; exactly 0 on the rank with the largest normaliser
    mass = torch.exp(x)
    zero = torch.zeros((), dtype=torch.float32, device=device)
    # a shard whose logits are all -inf holds no mass: its terms are 0, not 0 * inf
    has_mass = mass > 0
    terms = [mass, torch.where(owned, logp + x, zero)]
    if with_entropy:
        terms += [torch.where(has_mass, mass * entropy, zero), torch.where(has_mass, mass * -x, zero)]
    if sum_sq is not None:
        terms.append(torch.where(has_mass, mass * mass * sum_sq, zero))
    sums = torch.stack(terms)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    log_total = torch.log(sums[0])
    logp = torch.where(valid, sums[1] - log_total, zero)
    if with_entropy:
        entropy = torch.where(valid, (sums[2] + sums[3]) / sums[0] + log_total, zero)
    else:
        entropy = torch.zeros_like(logp)
    shift = torch.where(valid, log_total - x, zero)
    merged_sq = None if sum_sq is None else torch.where(valid, sums[-1] / (sums[0] * sums[0]), zero)
    return logp, entropy, shift, merged_sq


def _shard_row_stats(backend, logits_rows: torch.Tensor, codes: torch.Tensor, transform: LogitTransform,
                     with_entropy: bool, with_sum_sq: bool):
    """The row kernel's forward over one shard: every row not ignored gets its statistics (a row
    whose target is elsewhere is read at local column 0, its log-prob unused)."""
    readable = torch.where(codes == OTHER_SHARD, torch.zeros_like(codes), codes)
    return backend.forward_rows(logits_rows, readable, transform, LOCAL_IGNORE, with_entropy, with_sum_sq)


def _merged(group, backend, codes, transform, with_entropy, stats):
    """The whole vocabulary's (logp, entropy, sum of squared probabilities or None) and the backward's
    shifted ``log_sum``, from one shard's ``RowStats``."""
    lse = backend.log_normalizer(stats.row_max, stats.log_sum, transform)
    owned = codes >= 0
    local_sq = None if stats.sum_probs_sq is None else stats.sum_probs_sq.reshape(-1)
    logp, entropy, shift, sum_sq = merge_shard_statistics(
        group, lse.reshape(-1), stats.logp.reshape(-1), stats.entropy.reshape(-1), owned.reshape(-1),
        (codes != LOCAL_IGNORE).reshape(-1), with_entropy, local_sq)
    shape = codes.shape
    sum_sq = None if sum_sq is None else sum_sq.view(shape)
    return logp.view(shape), entropy.view(shape), sum_sq, backend.shift_log_sum(stats.log_sum, shift.view(shape))


# --------------------------------------------------------------------------------------------------
# autograd
# --------------------------------------------------------------------------------------------------
class VocabParallelTokenLogprobsFunction(torch.autograd.Function):
    """(logits shard [B, T, V_r], codes [B, T] (:func:`local_targets`)) -> (logp, entropy) float32
    [B, T] of the whole vocabulary, equal on every rank. The backward is :class:`TokenLogprobsFunction`'
    (the backend's ``backward_rows``) with the whole vocabulary's normaliser and entropy: this
    shard's slice of the unsharded gradient, no communication."""

    @staticmethod
    def forward(ctx, logits, codes, backend, transform: LogitTransform, with_entropy: bool, inplace_backward: bool,
                group, with_sum_sq: bool = False):
        stats = _shard_row_stats(backend, logits, codes, transform, with_entropy, with_sum_sq)
        logp, entropy, sum_sq, log_sum = _merged(group, backend, codes, transform, with_entropy, stats)
        saved = (logits, codes, stats.row_max, log_sum, entropy, None, None)  # (no truncation here)
        return logprob_forward_outputs(ctx, saved, (backend, transform, LOCAL_IGNORE, inplace_backward), logp, entropy,
                                       sum_sq, with_sum_sq)

    @staticmethod
    @first_order
    def backward(ctx, grad_logp, grad_entropy, _grad_sum_sq=None):
        grad_logits = TokenLogprobsFunction.backward.__wrapped__(ctx, grad_logp, grad_entropy)[0]
        return grad_logits, None, None, None, None, None, None, None


class VocabParallelFusedLinearFunction(torch.autograd.Function):
    """(hidden [n, H], weight shard [V_r, H], bias shard [V_r] | None, codes [n]) -> (logp, entropy)
    float32 [n] of the whole vocabulary. Forward: each chunk's shard logits, the row kernel's
    statistics, then one merge for all n rows. Backward: :class:`FusedLinearTokenLogprobsFunction`' (the
    chunk's logits recomputed, their gradient, ``d hidden`` and ``d W``, ``d b``), with the whole
    vocabulary's normaliser and entropy; ``d hidden`` is this rank's partial sum, all-reduced over
    the group when ``reduce_hidden_grad``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, codes, backend, transform: LogitTransform, with_entropy: bool,
                chunk_size: int, dtype: torch.dtype, accumulate_in_weight_dtype: bool, group,
                reduce_hidden_grad: bool, with_sum_sq: bool = False):
        stats = chunked_row_stats(
            hidden, weight, bias, codes, chunk_size, dtype,
            lambda logits, rows, where: _shard_row_stats(backend, logits, rows, transform.rows(where), with_entropy,
                                                         with_sum_sq))
        logp, entropy, sum_sq, log_sum = _merged(group, backend, codes, transform, with_entropy, stats)
        ctx.reduce = group if reduce_hidden_grad else None
        saved = (hidden, weight, bias, codes, stats.row_max, log_sum, entropy, None, None)
        config = (backend, transform, LOCAL_IGNORE, chunk_size, dtype, accumulate_in_weight_dtype)
        return logprob_forward_outputs(ctx, saved, config, logp, entropy, sum_sq, with_sum_sq)

    @staticmethod
    @first_order
    def backward(ctx, grad_logp, grad_entropy, _grad_sum_sq=None):
        grad_hidden, grad_weight, grad_bias = FusedLinearTokenLogprobsFunction.backward.__wrapped__(ctx, grad_logp, grad_entropy)[:3]
        if ctx.reduce is not None and grad_hidden is not None:
            dist = _dist()
            dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=ctx.reduce)
        return (grad_hidden, grad_weight, grad_bias) + (None,) * 10


# --------------------------------------------------------------------------------------------------
# sampling-mask replay over shards: each rank sums over its shard's kept ids, then the same merge
# --------------------------------------------------------------------------------------------------
def _declare_sampling_mask(agree: _Agreement, sampling_mask: Optional[SamplingMask]) -> None:
    """The kept sets must be the same on every rank (global ids: each rank keeps its shard's part)."""
    if sampling_mask is None:
        agree.declare("sampling_mask", None)
        return
    agree.declare("sampling_mask.token_ids", sampling_mask.token_ids)
    agree.declare("sampling_mask.offsets", sampling_mask.offsets)


def shard_sets(sampling_mask: SamplingMask, shard: VocabShard):
    """(token_ids, offsets) of this shard's part of every set, ids local to the shard (``id - start``), CSR
    order kept; a checked mask of global ids."""
    ids, offsets = sampling_mask.token_ids, sampling_mask.offsets
    inside = (ids >= shard.start) & (ids < shard.start + shard.size)
    row_of = torch_replay.entry_rows(offsets)
    counts = torch.zeros(offsets.numel() - 1, dtype=torch.int64, device=ids.device)
    counts.index_add_(0, row_of[inside], torch.ones_like(row_of[inside]))
    local = torch.zeros_like(offsets)
    torch.cumsum(counts, 0, out=local[1:])
    return ids[inside] - shard.start, local


def _replay_merge(group, split: ReplaySplit, codes: torch.Tensor, global_empty: torch.Tensor, stats,
                  with_entropy: bool, with_sum_sq: bool):
    """The shards' replay statistics over their parts of the sets -> the whole sets' (logp, entropy, sum_sq,
    lse) [n], bitwise equal on every rank (:func:`merge_shard_statistics`); ``lse`` is the whole set's
    where this shard keeps some of it (0 elsewhere: the backward reads no entry there). A position whose
    set is empty on every shard (``global_empty``): ``-inf``, entropy 0, sum 0, as on one device."""
    logp, entropy, sum_sq, lse = stats
    zero = torch.zeros((), dtype=torch.float32, device=lse.device)
    valid = split.valid & ~global_empty
    lse_in = torch.where(global_empty, zero, lse)  # (no shard has mass there: keep the MAX finite)
    logp, entropy, shift, merged_sq = merge_shard_statistics(
        group, lse_in, logp, entropy, codes >= 0, valid, with_entropy, sum_sq if with_sum_sq else None)
    logp = torch.where(split.valid & global_empty, torch.full((), float("-inf"), device=lse.device), logp)
    whole_lse = torch.where(lse > float("-inf"), lse + shift, zero)
    local_lse = torch.where(lse > float("-inf"), lse, zero)
    return logp, entropy, merged_sq if with_sum_sq else torch.zeros_like(logp), whole_lse, local_lse


class VocabParallelReplayFunction(torch.autograd.Function):
    """(logits shard [B, T, V_r], codes [B, T] (:func:`local_targets`), this shard's sets (:func:`shard_sets`),
    global_empty [B*T]) -> (logp, entropy, sum_sq) [B, T] over the whole sets, equal on every rank. Each rank
    replays its shard's kept entries (``autograd.replay_rows_stats``); the merge is the plain path's. The
    backward is the single-device replay's with the whole sets' normaliser and entropy: this shard's slice."""

    @staticmethod
    def forward(ctx, logits, codes, token_ids, offsets, global_empty, backend, transform: LogitTransform,
                with_entropy: bool, inplace_backward: bool, group, with_sum_sq: bool):
        split = ReplaySplit(codes.reshape(-1), token_ids, offsets, logits.shape[-1], LOCAL_IGNORE)
        stats = replay_rows_stats(logits, split, transform, backend, with_entropy, with_sum_sq)
        logp, entropy, sum_sq, lse, local_lse = _replay_merge(group, split, codes.reshape(-1), global_empty, stats,
                                                              with_entropy, with_sum_sq)
        ctx.split = split
        shape = codes.shape
        return logprob_forward_outputs(ctx, (logits, lse, local_lse, entropy, logp),
                                       (backend, transform, inplace_backward),
                                       logp.view(shape), entropy.view(shape), sum_sq.view(shape), with_sum_sq)

    @staticmethod
    @first_order
    def backward(ctx, grad_logp, grad_entropy, _grad_sum_sq=None):
        logits, lse, local_lse, entropy, logp = ctx.saved_tensors
        backend, transform, inplace_backward = ctx.config
        out = gradient_buffer(logits, inplace_backward)
        replay_rows_grad(logits, ctx.split, lse, local_lse, entropy, finite_grad(grad_logp, logp),
                         None if grad_entropy is None else grad_entropy.reshape(-1).float(), transform, backend, out)
        written_in_place(logits, out)
        return (out,) + (None,) * 10


class VocabParallelReplayLinearFunction(torch.autograd.Function):
    """(hidden [n, H], weight shard [V_r, H], bias shard [V_r] | None, codes [n], this shard's sets,
    global_empty [n]) -> (logp, entropy, sum_sq) [n] over the whole sets: each rank reads only its shard's
    kept weight rows (``autograd.replay_linear_stats``), then the merge. Backward: ``d weight`` of the shard,
    ``d hidden`` this rank's partial sum (all-reduced with ``reduce_hidden_grad``)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, codes, token_ids, offsets, global_empty, backend,
                transform: LogitTransform, with_entropy: bool, chunk_size: int, dtype: torch.dtype,
                accumulate_in_weight_dtype: bool, group, reduce_hidden_grad: bool, with_sum_sq: bool):
        split = ReplaySplit(codes, token_ids, offsets, weight.shape[0], LOCAL_IGNORE)
        stats = replay_linear_stats(hidden, weight, bias, split, backend, transform, with_entropy, chunk_size, dtype,
                                    with_sum_sq)
        logp, entropy, sum_sq, lse, local_lse = _replay_merge(group, split, codes, global_empty, stats, with_entropy,
                                                              with_sum_sq)
        ctx.split = split
        ctx.reduce = group if reduce_hidden_grad else None
        return logprob_forward_outputs(
            ctx, (hidden, weight, bias, lse, local_lse, entropy, logp),
            (backend, transform, chunk_size, dtype, accumulate_in_weight_dtype), logp, entropy, sum_sq, with_sum_sq)

    @staticmethod
    @first_order
    def backward(ctx, grad_logp, grad_entropy, _grad_sum_sq=None):
        hidden, weight, bias, lse, local_lse, entropy, logp = ctx.saved_tensors
        backend, transform, chunk_size, dtype, accumulate_in_weight_dtype = ctx.config
        grad_hidden, grad_weight, grad_bias = replay_linear_grads(
            hidden, weight, bias, ctx.split, lse, local_lse, entropy, finite_grad(grad_logp, logp),
            None if grad_entropy is None else grad_entropy.float(), backend, transform, chunk_size, dtype,
            accumulate_in_weight_dtype, tuple(ctx.needs_input_grad[:3]))
        if ctx.reduce is not None and grad_hidden is not None:
            dist = _dist()
            dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=ctx.reduce)
        return (grad_hidden, grad_weight, grad_bias) + (None,) * 13


def _checked_shard_mask(sampling_mask: Optional[SamplingMask], shard: VocabShard, num_positions: int, device):
    """(this shard's sets, global_empty [N]) of the call's checked mask (the same check, and error, on every
    rank: the ranks agreed that their masks are equal), or None."""
    if sampling_mask is None:
        return None
    mask = sampling_mask.check("sampling_mask", num_positions, shard.vocab_size, device)
    return shard_sets(mask, shard), mask.sizes() == 0


# --------------------------------------------------------------------------------------------------
# the public functions' vocabulary-parallel paths (functional.py dispatches here for a group of several ranks)
# --------------------------------------------------------------------------------------------------
_LOGPROB_FINGERPRINT = ("the logits' leading shape", "targets", "temperature/softcap/logit_scale", "ignore_index",
                        "return_entropy", "return_sum_probs_sq", "temperature")


def refuse_truncation(transform: LogitTransform) -> None:
    """top-k / top-p across vocabulary shards is not offered: ValueError naming them (every rank refuses
    alike, inside :func:`agreement`)."""
    if transform.truncates:
        raise ValueError(
            f"top_k={transform.top_k!r} / top_p={transform.top_p!r} with a process_group of several ranks: the "
            "sampler's truncation needs the whole vocabulary's order (its threshold search would all-reduce "
            "counts and masses at every step), which this vocabulary-parallel path does not do; gather the "
            "logits (or the lm_head) and call without process_group, or pass top_k=None and top_p=None")


def _transform_fingerprint(transform: LogitTransform):
    """What must agree across ranks in a transform, a temperature tensor apart (declared as a tensor)."""
    return ("per-row" if transform.per_row else transform.temperature, transform.softcap, transform.logit_scale,
            transform.top_k, transform.top_p)


def _temperature_fingerprint(transform: LogitTransform):
    return transform.temperature if transform.per_row else 0
def _declare_grpo(agree: _Agreement, shape, completion_ids, advantages, completion_mask, inputs: GRPOInputs,
                  options) -> None:
    """Fingerprints of a GRPO call: every field of ``GRPOInputs`` (whatever fields it has) and the options."""
    agree.declare("the leading shape [B, T]", tuple(shape))
    agree.declare("completion_ids", completion_ids)
    agree.declare("advantages", advantages)
    agree.declare("completion_mask", completion_mask)
    for f in dataclasses.fields(inputs):
        if isinstance(getattr(inputs, f.name), SamplingMask):
            _declare_sampling_mask(agree, getattr(inputs, f.name))
        else:
            agree.declare(f.name, getattr(inputs, f.name))
    agree.declare("the GRPO options", tuple((f.name, "per-row" if isinstance(getattr(options, f.name), torch.Tensor)
                                             else getattr(options, f.name)) for f in dataclasses.fields(options)))
    agree.declare("temperature", _temperature_fingerprint(options.transform))


def _logits_rows(logits, ids, shard: VocabShard, transform, ignore_index, with_entropy, backend, inplace_backward,
                 with_sum_sq=False):
    rows = as_rows(logits)
    codes = local_targets(ids.reshape(rows.shape[:2]), shard, ignore_index)
    logp, entropy, sum_sq = VocabParallelTokenLogprobsFunction.apply(rows, codes, backend, transform, with_entropy,
                                                                     inplace_backward, shard.group, with_sum_sq)
    return logp.view(ids.shape), entropy.view(ids.shape), sum_sq.view(ids.shape) if with_sum_sq else None


def _replay_logits_rows(logits, ids, shard: VocabShard, transform, ignore_index, with_entropy, backend,
                        inplace_backward, with_sum_sq, replay):
    """:func:`_logits_rows` over the kept sets (``replay``: this shard's sets, and the empty ones)."""
    rows = as_rows(logits)
    codes = local_targets(ids.reshape(rows.shape[:2]), shard, ignore_index)
    (token_ids, offsets), global_empty = replay
    logp, entropy, sum_sq = VocabParallelReplayFunction.apply(rows, codes, token_ids, offsets, global_empty, backend,
                                                              transform, with_entropy, inplace_backward, shard.group,
                                                              with_sum_sq)
    return logp.view(ids.shape), entropy.view(ids.shape), sum_sq.view(ids.shape) if with_sum_sq else None


def _outputs(logp, entropy, sum_sq, return_entropy, return_sum_probs_sq):
    if not (return_entropy or return_sum_probs_sq):
        return logp
    return (logp,) + ((entropy,) if return_entropy else ()) + ((sum_sq,) if return_sum_probs_sq else ())


def token_logprobs(logits, targets, *, group, temperature, ignore_index, return_entropy, softcap, logit_scale, backend,
                   top_k=None, top_p=None, return_sum_probs_sq=False, sampling_mask=None):
    """``functional.token_logprobs`` over a vocabulary shard (see the module docstring); ``group``: a checked
    process group of more than one rank (``check_group``). A temperature tensor is per token as on one
    device; ``top_k`` / ``top_p`` are refused (:func:`refuse_truncation`)."""
    with agreement(group) as agree:
        logits = V.check_logits(logits)
        targets = V.check_token_ids(targets, logits.shape[:-1], "targets")
        transform = LogitTransform(temperature, softcap, logit_scale, top_k, top_p).for_rows(targets.shape, logits.device)
        refuse_truncation(transform)
        return_entropy = V.check_flag("return_entropy", return_entropy)
        return_sum_probs_sq = V.check_flag("return_sum_probs_sq", return_sum_probs_sq)
        row_backend = backends.resolve(backend, logits.device)
        agree.local_size = logits.shape[-1]
        for name, value in zip(_LOGPROB_FINGERPRINT, (tuple(logits.shape[:-1]), targets, _transform_fingerprint(transform),
                                                      ignore_index, return_entropy, return_sum_probs_sq,
                                                      _temperature_fingerprint(transform))):
            agree.declare(name, value)
        _declare_sampling_mask(agree, check_sampling_mask_type(sampling_mask))
    check_targets_in_vocabulary(targets, agree.shard, ignore_index, "targets")
    replay = _checked_shard_mask(sampling_mask, agree.shard, targets.numel(), logits.device)
    if replay is not None:
        logp, entropy, sum_sq = _replay_logits_rows(logits, targets, agree.shard, transform, ignore_index,
                                                    return_entropy, row_backend, False, return_sum_probs_sq, replay)
        return _outputs(logp, entropy, sum_sq, return_entropy, return_sum_probs_sq)
    logp, entropy, sum_sq = _logits_rows(logits, targets, agree.shard, transform, ignore_index, return_entropy,
                                         row_backend, False, return_sum_probs_sq)
    return _outputs(logp, entropy, sum_sq, return_entropy, return_sum_probs_sq)


def grpo_loss(logits, completion_ids, advantages, completion_mask, *, group, backend, inplace_backward,
              grpo_kwargs) -> GRPOLossOutput:
    """``functional.grpo_loss`` over a vocabulary shard: the shards' merged log-probs and entropies,
    then the single-device objective (``objective.grpo_loss_from_logprobs``); ``group`` as in
    :func:`token_logprobs`."""
    with agreement(group) as agree:
        logits = V.check_logits(logits)
        inputs, options, mask, ids, transform = prepare_grpo("logits", logits.shape, None, completion_ids,
                                                             advantages, completion_mask, grpo_kwargs)
        refuse_truncation(transform)
        row_backend = backends.resolve(backend, logits.device)
        agree.local_size = logits.shape[-1]
        _declare_grpo(agree, logits.shape[:-1], ids, advantages, completion_mask, inputs, options)
    check_targets_in_vocabulary(ids, agree.shard, IGNORE_INDEX, "completion_ids")
    replay = _checked_shard_mask(inputs.sampling_mask, agree.shard, ids.numel(), logits.device)
    if replay is not None:
        logp, entropy, _ = _replay_logits_rows(logits, ids, agree.shard, transform, IGNORE_INDEX, True, row_backend,
                                               inplace_backward, False, replay)
    else:
        logp, entropy, _ = _logits_rows(logits, ids, agree.shard, transform, IGNORE_INDEX, True, row_backend,
                                        inplace_backward)
    return objective.grpo_loss_from_logprobs(logp, entropy, advantages, mask, inputs, options)


def check_reduce_hidden_grad(reduce_hidden_grad: object, group: Any, from_logits: bool = False) -> bool:
    """A bool (``_validation.check_flag``); True only from hidden states (``from_logits``: a call from logits
    has no ``d hidden``) with a group to reduce over (without one it would be silently meaningless)."""
    reduce_hidden_grad = V.check_flag("reduce_hidden_grad", reduce_hidden_grad)
    if reduce_hidden_grad and from_logits:
        raise ValueError("reduce_hidden_grad=True all-reduces d hidden, which only the fused-linear functions "
                         "compute; a call from logits has none (all-reduce the logits' producer's input gradient instead)")
    if reduce_hidden_grad and group is None:
        raise ValueError("reduce_hidden_grad=True all-reduces d hidden over a process_group; none was given "
                         "(and weight is not a DTensor)")
    return reduce_hidden_grad


def _linear_shard_rows(hidden, weight, bias, ids, shard: VocabShard, transform, ignore_index, with_entropy,
                       chunk_size, backend, accumulate_in_weight_dtype, reduce_hidden_grad, with_sum_sq=False,
                       fp32_logits=False, sampling_mask: Optional[SamplingMask] = None):
    row_backend = backends.resolve(backend, hidden.device)
    rows = linear_rows(hidden, weight, bias, ids, ignore_index, chunk_size, accumulate_in_weight_dtype, fp32_logits)
    codes = local_targets(rows.targets, shard, ignore_index)
    if sampling_mask is not None:  # (checked: _checked_shard_mask) the kept rows' sets, then this shard's part
        kept = sampling_mask if rows.keep is None else sampling_mask.rows(rows.keep)
        token_ids, offsets = shard_sets(kept, shard)
        logp, entropy, sum_sq = VocabParallelReplayLinearFunction.apply(
            rows.hidden, weight, bias, codes, token_ids, offsets, kept.sizes() == 0, row_backend,
            take_transform(rows, transform), with_entropy, rows.chunk_size, rows.dtype, accumulate_in_weight_dtype,
            shard.group, reduce_hidden_grad, with_sum_sq,
        )
        sum_sq = scatter_rows(rows, sum_sq, ids.shape) if with_sum_sq else None
        return scatter_rows(rows, logp, ids.shape), scatter_rows(rows, entropy, ids.shape), sum_sq
    logp, entropy, sum_sq = VocabParallelFusedLinearFunction.apply(
        rows.hidden, weight, bias, codes, row_backend, take_transform(rows, transform), with_entropy, rows.chunk_size,
        rows.dtype, accumulate_in_weight_dtype, shard.group, reduce_hidden_grad, with_sum_sq,
    )
    sum_sq = scatter_rows(rows, sum_sq, ids.shape) if with_sum_sq else None
    return scatter_rows(rows, logp, ids.shape), scatter_rows(rows, entropy, ids.shape), sum_sq


def fused_linear_token_logprobs(hidden, weight, targets, *, bias, group, reduce_hidden_grad, temperature,
                                ignore_index, return_entropy, softcap, logit_scale, chunk_size,
                                accumulate_in_weight_dtype, backend, top_k=None, top_p=None,
                                return_sum_probs_sq=False, fp32_logits=False, sampling_mask=None):
    """``functional.fused_linear_token_logprobs`` with this rank's ``weight [V_r, H]`` shard (local
    tensors: ``resolve_sharded_head``); ``group``, the temperature and ``top_k`` / ``top_p`` as in
    :func:`token_logprobs`."""
    fingerprint = ("the hidden states' shape",) + _LOGPROB_FINGERPRINT[1:] + ("reduce_hidden_grad",)
    with agreement(group) as agree:
        V.check_linear(hidden, weight, bias)
        targets = V.check_token_ids(targets, hidden.shape[:-1], "targets", "hidden")
        transform = LogitTransform(temperature, softcap, logit_scale, top_k, top_p).for_rows(targets.shape, hidden.device)
        refuse_truncation(transform)
        return_entropy = V.check_flag("return_entropy", return_entropy)
        return_sum_probs_sq = V.check_flag("return_sum_probs_sq", return_sum_probs_sq)
        agree.local_size = weight.shape[0]
        for name, value in zip(fingerprint, (tuple(hidden.shape), targets, _transform_fingerprint(transform),
                                             ignore_index, return_entropy, return_sum_probs_sq,
                                             _temperature_fingerprint(transform), reduce_hidden_grad)):
            agree.declare(name, value)
        _declare_sampling_mask(agree, check_sampling_mask_type(sampling_mask))
    check_targets_in_vocabulary(targets, agree.shard, ignore_index, "targets")
    if sampling_mask is not None:
        sampling_mask = sampling_mask.check("sampling_mask", targets.numel(), agree.shard.vocab_size, hidden.device)
    logp, entropy, sum_sq = _linear_shard_rows(hidden, weight, bias, targets, agree.shard, transform, ignore_index,
                                               return_entropy, chunk_size, backend, accumulate_in_weight_dtype,
                                               reduce_hidden_grad, return_sum_probs_sq, fp32_logits, sampling_mask)
    return _outputs(logp, entropy, sum_sq, return_entropy, return_sum_probs_sq)


def fused_linear_grpo_loss(hidden, weight, completion_ids, advantages, completion_mask, *, bias, group,
                           reduce_hidden_grad, chunk_size, accumulate_in_weight_dtype, backend,
                           grpo_kwargs, fp32_logits=False) -> GRPOLossOutput:
    """``functional.fused_linear_grpo_loss`` with this rank's ``weight [V_r, H]`` shard: the merged
    log-probs and entropies, then the single-device objective. Every objective takes the backward
    that recomputes each chunk's logits (4 matmuls a chunk): the per-token coefficients need the
    whole vocabulary's statistics, known only after the forward's merge. ``weight``, ``bias`` and ``group``
    as in :func:`fused_linear_token_logprobs`."""
    with agreement(group) as agree:
        V.check_linear(hidden, weight, bias)
        inputs, options, mask, ids, transform = prepare_grpo("hidden", hidden.shape, None, completion_ids,
                                                             advantages, completion_mask, grpo_kwargs)
        refuse_truncation(transform)
        agree.local_size = weight.shape[0]
        _declare_grpo(agree, hidden.shape[:-1], ids, advantages, completion_mask, inputs, options)
        agree.declare("the hidden size", hidden.shape[-1])
        agree.declare("reduce_hidden_grad", reduce_hidden_grad)
    check_targets_in_vocabulary(ids, agree.shard, IGNORE_INDEX, "completion_ids")
    sampling_mask = inputs.sampling_mask
    if sampling_mask is not None:
        sampling_mask = sampling_mask.check("sampling_mask", ids.numel(), agree.shard.vocab_size, hidden.device)
    logp, entropy, _ = _linear_shard_rows(hidden, weight, bias, ids, agree.shard, transform, IGNORE_INDEX, True,
                                          chunk_size, backend, accumulate_in_weight_dtype, reduce_hidden_grad,
                                          fp32_logits=fp32_logits, sampling_mask=sampling_mask)
    return objective.grpo_loss_from_logprobs(logp, entropy, advantages, mask, inputs, options)
