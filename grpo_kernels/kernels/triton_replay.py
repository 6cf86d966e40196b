"""Triton kernels of sampling-mask replay: log-prob, entropy and sum of squared probabilities of the
softmax restricted to each token's kept set, and their gradient, reading only the kept entries.

A truncating sampler (top-k, top-p, ...) draws token ``i`` from ``softmax(z_i)`` restricted to a set ``S_i``
of kept ids (``grpo_kernels.sampling_mask.SamplingMask``: CSR ``token_ids [K]`` / ``offsets [N + 1]``).
Replaying the set (the truncated-sampling correction of Yao et al. 2025, "Your Efficient RL Framework
Secretly Brings You Off-Policy RL Training") needs, per row::

    lse_i = logsumexp_{j in S_i} z_j      log p_i = z_{t_i} - lse_i  (-inf if t_i not in S_i)
    H_i = -sum_j p_j log p_j = lse_i - sum_j p_j z_j      Q_i = sum_j p_j^2

with ``z = softcap tanh(logit_scale x / softcap) / T`` (``logit_scale x / T`` without a cap), ``x`` the
raw logit. Only the kept entries are ever read: from hidden states, ``x_j = h_i . W[id_j] + b[id_j]``
reads ``k_i`` rows of ``lm_head.weight`` (``O(k H)`` per token, never ``O(V H)``); from logits, ``k_i``
elements of the row. ``docs/kernels.md`` ("Sampling-mask replay") has the passes.

Kernels, all with int64 offsets, fp32 arithmetic and runtime transform values (a new temperature,
cap or scale compiles no new kernel; ``PER_ROW_T`` loads a row's ``1 / T`` instead, as ``triton_rows``):

- ``replay_entries_kernel`` (a block of ``BLOCK_E`` entries of the flattened ``[K]``, any rows, so a
  row kept whole over the vocabulary and a one-token row cost their entries, not a program each):
  the raw logit ``x_j`` of each entry, by an fp32 dot product over ``H`` in ``BLOCK_H`` tiles
  (``LINEAR``) or a gather from the logits; stores ``x_j`` (forward) or, with ``GRAD``, the
  coefficient ``dx_j`` of the backward (below).
- ``replay_stats_kernel`` (one program per row): the online logsumexp (Milakov & Gimelshein 2018) over
  the row's ``x_j`` in blocks of ``BLOCK_K``: running ``m = max z``, ``s = sum e^(z - m)``,
  ``u = sum e^(z - m) (z - m)``, ``w = sum e^(2 (z - m))``, every one moved to a new max by the same
  rule; then ``lse = m + ln s``, ``log p = (z_t - m) - ln s`` (not ``z_t - lse``: no rounding of
  ``lse`` on a confident token), ``H = ln s - u / s`` (two terms >= 0: nothing cancels) and
  ``Q = w / s^2``. An empty row (or one whose every ``z`` is -inf) has ``s = 0``: lse = log p = -inf,
  H = Q = 0.
- Backward, per entry (the contract's formula; ``g``, ``e`` the incoming gradients of log p and H)::

      d log p / d z_j = [id_j = t] - p_j          d H / d z_j = -p_j (ln p_j + H)
      dx_j = (g ([id_j = t] - p_j) - e p_j (z_j - lse + H)) * dz/dx_j

  with ``ln p_j = z_j - lse`` from the forward's fp32 ``lse`` (the contract's: a confident target's
  ``1 - p_t``, formed accurately by ``triton_row_stats.one_minus_exp``, still carries ``lse``'s rounding,
  ~``|lse| 2^-24`` absolute) and clamped at -256 before it multiplies ``p`` (``p = 0`` there anyway; no
  ``0 * -inf``). A kept ``x = -inf`` (from
  logits) has ``z = -inf`` (even with a cap, where ``tanh`` would give ``-softcap``), ``p = 0`` and
  ``dx = 0``.
- ``replay_hidden_grad_kernel`` (program ``(row, H tile)``): ``d h_i = sum_j dx_j W[id_j]``, summed in the
  entries' order: deterministic.
- ``replay_weight_grad_kernel``: ``d W[v] = sum_{j: id_j = v} dx_j h_{row(j)}`` (and ``d b[v] = sum dx_j``)
  without atomics. The launcher sorts the entries by id once (stable ``torch.sort``; the end of each run
  of equal ids by ``torch.searchsorted``; ``dx`` and the rows gathered into that order: no host
  synchronisation); program ``p`` owns the run that starts at sorted position ``p`` (the others return
  at once) and sums it in its fixed order over every tile of ``H``, so ``d W`` has the same bits on
  every run. Rows of ``d W`` off the kept ids stay the zeros of its allocation.
- ``replay_scatter_kernel``: the from-logits gradient's kept entries into the output row, after the
  launcher zero-fills it (the coefficients are formed first, so ``out`` may be ``logits`` itself).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from grpo_kernels.kernels.triton_row_stats import LOWEST as _LOWEST
from grpo_kernels.kernels.triton_row_stats import apply_softcap as _softcap
from grpo_kernels.kernels.triton_row_stats import one_minus_exp as _one_minus_exp
from grpo_kernels.kernels.triton_row_stats import row_factor as _row_factor
from grpo_kernels.kernels.triton_row_stats import softcap_slope as _softcap_slope
from grpo_kernels.kernels.triton_rows import transform_args as _transform_args

# ln p below this is 0 in fp32 (e^-104 underflows); the clamp keeps p * ln p at 0, never 0 * -inf.
_LOGP_FLOOR = tl.constexpr(-256.0)

# Tests set this (a dict with any of the keys of _blocks) to force tiny tiles on the CPU interpreter.
BLOCKS_OVERRIDE: Optional[Dict[str, int]] = None

Temperature = Union[float, torch.Tensor]


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------
@triton.jit
def _transform(x, inv_t, cap_k, cap, SOFTCAP: tl.constexpr):
    """(z, y): ``z = y / T`` of the raw fp32 logits ``x``, ``y = cap tanh(cap_k x)`` with ``SOFTCAP`` (else
    ``y = x``; the launcher folds the logit scale into ``inv_t``). A -inf logit stays -inf: an entry
    the engine never could sample, whatever the cap."""
    y = x
    if SOFTCAP:
        y = _softcap(x, cap_k, cap)
    z = tl.where(x == float("-inf"), float("-inf"), y * inv_t)
    return z, y


@triton.jit
def _entry_grad(x, ids, rows, targets_ptr, lse_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr, t_rows_ptr,
                mask, inv_t, cap_k, cap, SOFTCAP: tl.constexpr, PER_ROW_T: tl.constexpr,
                HAS_GRAD_LOGP: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr):
    """``dx_j`` of a block of entries (raw fp32 logits ``x``, their ids and rows): see the module docstring."""
    inv_t = _row_factor(inv_t, t_rows_ptr, rows, 2, PER_ROW_T)
    z, y = _transform(x, inv_t, cap_k, cap, SOFTCAP)
    lse = tl.load(lse_ptr + rows, mask=mask, other=0.0)
    q = z - lse  # ln p_j (lse = -inf only for a row whose every z is -inf: those entries get dx = 0 below)
    q = tl.maximum(q, _LOGP_FLOOR, propagate_nan=tl.PropagateNan.ALL)
    p = tl.exp(q)
    dz = tl.zeros_like(x)
    if HAS_GRAD_LOGP:
        g = tl.load(grad_logp_ptr + rows, mask=mask, other=0.0)
        target = tl.load(targets_ptr + rows, mask=mask, other=-1).to(tl.int64)
        # d log p / d z_j = [j = t] - p_j; the target's 1 - p_t accurate near p_t = 1
        dz += g * tl.where(ids == target, _one_minus_exp(q), -p)
    if HAS_GRAD_ENTROPY:
        e = tl.load(grad_entropy_ptr + rows, mask=mask, other=0.0)
        entropy = tl.load(entropy_ptr + rows, mask=mask, other=0.0)
        # d H / d z_j = -p_j (ln p_j + H)
        dz += -e * p * (q + entropy)
    if SOFTCAP:
        # dz/dx = logit_scale (1 - (y / cap)^2) / T, logit_scale = cap * cap_k
        dz = dz * _softcap_slope(y, cap * cap_k, cap)
    return tl.where(z == float("-inf"), 0.0, dz * inv_t)  # (no cap: dz/dx = logit_scale / T = inv_t)


# --------------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------------
@triton.jit
def replay_entries_kernel(
    src_ptr, stride_src, weight_ptr, stride_w, bias_ptr, ids_ptr, entry_rows_ptr, out_ptr, K, H,
    targets_ptr, lse_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr, t_rows_ptr, inv_t, cap_k, cap,
    LINEAR: tl.constexpr, HAS_BIAS: tl.constexpr, GRAD: tl.constexpr, SOFTCAP: tl.constexpr,
    PER_ROW_T: tl.constexpr, HAS_GRAD_LOGP: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Entries ``[pid * BLOCK_E, (pid + 1) * BLOCK_E)`` of the flattened kept sets: their raw logit ``x_j``
    (fp32) into ``out`` [K], or with ``GRAD`` their ``dx_j``.

    ``LINEAR``: ``src`` is the hidden states [N, H] and ``x_j = h_{row(j)} . W[id_j] (+ b[id_j])``, the
    weight (and bias) rounded to the hidden states' dtype (the matmul's) and the products summed in
    fp32 over ``BLOCK_H`` tiles of ``H``. Else ``src`` is the logits [N, V] and ``x_j = src[row(j), id_j]``.
    """
    e = tl.program_id(0).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
    mask = e < K
    ids = tl.load(ids_ptr + e, mask=mask, other=0).to(tl.int64)
    rows = tl.load(entry_rows_ptr + e, mask=mask, other=0).to(tl.int64)
    if LINEAR:
        acc = tl.zeros((BLOCK_E, BLOCK_H), tl.float32)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            m2 = mask[:, None] & (h < H)[None, :]
            hid = tl.load(src_ptr + rows[:, None] * stride_src + h[None, :], mask=m2, other=0.0)
            w = tl.load(weight_ptr + ids[:, None] * stride_w + h[None, :], mask=m2, other=0.0)
            acc += hid.to(tl.float32) * w.to(hid.dtype).to(tl.float32)
        x = tl.sum(acc, 1)
        if HAS_BIAS:
            x += tl.load(bias_ptr + ids, mask=mask, other=0.0).to(src_ptr.dtype.element_ty).to(tl.float32)
    else:
        x = tl.load(src_ptr + rows * stride_src + ids, mask=mask, other=0.0).to(tl.float32)
    if GRAD:
        x = _entry_grad(x, ids, rows, targets_ptr, lse_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr, t_rows_ptr,
                        mask, inv_t, cap_k, cap, SOFTCAP, PER_ROW_T, HAS_GRAD_LOGP, HAS_GRAD_ENTROPY)
    tl.store(out_ptr + e, x, mask=mask)


@triton.jit
def replay_stats_kernel(
    x_ptr, ids_ptr, offsets_ptr, targets_ptr, logp_ptr, entropy_ptr, sum_sq_ptr, lse_ptr, t_rows_ptr,
    inv_t, cap_k, cap,
    SOFTCAP: tl.constexpr, PER_ROW_T: tl.constexpr, WITH_ENTROPY: tl.constexpr, WITH_SQ: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Row ``pid``: the online logsumexp over its entries' raw logits ``x`` [K] (fp32, from
    ``replay_entries_kernel``), then (log p, H, Q, lse) stored; H and Q are 0 unless asked."""
    row = tl.program_id(0).to(tl.int64)
    inv_t = _row_factor(inv_t, t_rows_ptr, row, 2, PER_ROW_T)
    lo = tl.load(offsets_ptr + row).to(tl.int64)
    hi = tl.load(offsets_ptr + row + 1).to(tl.int64)
    target = tl.load(targets_ptr + row).to(tl.int64)
    m = tl.full((), _LOWEST, tl.float32)  # -FLT_MAX, not -inf: m - m_new stays finite (never -inf + inf)
    s = tl.zeros((), tl.float32)
    u = tl.zeros((), tl.float32)
    w = tl.zeros((), tl.float32)
    z_t = tl.full((), float("-inf"), tl.float32)
    for j0 in range(lo, hi, BLOCK_K):
        j = j0 + tl.arange(0, BLOCK_K)
        mask = j < hi
        ids = tl.load(ids_ptr + j, mask=mask, other=-1).to(tl.int64)
        x = tl.load(x_ptr + j, mask=mask, other=float("-inf"))
        z, _ = _transform(x, inv_t, cap_k, cap, SOFTCAP)
        z = tl.where(mask, z, float("-inf"))
        z_t = tl.maximum(z_t, tl.max(tl.where(ids == target, z, float("-inf")), 0))
        m_new = tl.maximum(m, tl.max(z, 0))
        # the old sums move to the new max: times e^dd, dd <= 0, clamped so that alpha * dd is 0, not NaN
        dd = tl.maximum(m - m_new, _LOWEST)
        alpha = tl.exp(dd)
        shift = tl.maximum(z - m_new, _LOWEST, propagate_nan=tl.PropagateNan.ALL)  # -inf -> -FLT_MAX: e = 0
        ex = tl.exp(shift)
        if WITH_ENTROPY:
            # u is relative to the max: moving it by dd adds dd to every shift, i.e. dd * s
            u = u * alpha + (alpha * dd) * s + tl.sum(ex * shift, 0)
        if WITH_SQ:
            w = w * (alpha * alpha) + tl.sum(ex * ex, 0)
        s = s * alpha + tl.sum(ex, 0)
        m = m_new
    ln_s = tl.log(s)  # -inf for an empty row
    nonempty = s != 0.0  # (NaN counts as non-empty: it stays NaN)
    lse = tl.where(nonempty, m + ln_s, float("-inf"))
    # below float32's range (a 3e38 gap): its lowest finite value, as triton_rows; an absent target: -inf
    logp = tl.maximum((z_t - m) - ln_s, _LOWEST, propagate_nan=tl.PropagateNan.ALL)
    # (a NaN logit makes s NaN, whatever the maxima kept: the row's log p stays NaN even if it was the target)
    logp = tl.where((z_t == float("-inf")) & (s == s), float("-inf"), logp)
    entropy = 0.0
    if WITH_ENTROPY:
        entropy = tl.where(nonempty, ln_s - u / s, 0.0)
    sum_sq = 0.0
    if WITH_SQ:
        sum_sq = tl.where(nonempty, w / (s * s), 0.0)
    tl.store(logp_ptr + row, logp)
    tl.store(entropy_ptr + row, entropy)
    tl.store(sum_sq_ptr + row, sum_sq)
    tl.store(lse_ptr + row, lse)


@triton.jit
def replay_hidden_grad_kernel(
    dx_ptr, weight_ptr, stride_w, ids_ptr, offsets_ptr, grad_ptr, stride_grad, H,
    BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Program (row, H tile): ``d h_i = sum_j dx_j W[id_j]`` (the weight rounded to the hidden states'
    dtype, as in the forward's product), summed in fp32 in the row's entry order; an empty row gets 0."""
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h < H
    lo = tl.load(offsets_ptr + row).to(tl.int64)
    hi = tl.load(offsets_ptr + row + 1).to(tl.int64)
    acc = tl.zeros((BLOCK_K, BLOCK_H), tl.float32)
    for j0 in range(lo, hi, BLOCK_K):
        j = j0 + tl.arange(0, BLOCK_K)
        mask = j < hi
        ids = tl.load(ids_ptr + j, mask=mask, other=0).to(tl.int64)
        dx = tl.load(dx_ptr + j, mask=mask, other=0.0)
        w = tl.load(weight_ptr + ids[:, None] * stride_w + h[None, :], mask=mask[:, None] & h_mask[None, :], other=0.0)
        acc += dx[:, None] * w.to(grad_ptr.dtype.element_ty).to(tl.float32)
    tl.store(grad_ptr + row * stride_grad + h, tl.sum(acc, 0).to(grad_ptr.dtype.element_ty), mask=h_mask)


@triton.jit
def replay_weight_grad_kernel(
    dx_ptr, hidden_ptr, stride_h, sorted_ids_ptr, run_end_ptr, rows_ptr, grad_w_ptr, stride_gw, grad_b_ptr, H,
    WITH_WEIGHT: tl.constexpr, WITH_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Program ``p`` (a position of the entries sorted by id; ``dx`` and ``rows`` in that order): if a run of
    equal ids starts there, ``d W[id] = sum dx_j h_{row(j)}`` over the run, ``BLOCK_R`` entries at a time in
    its (stable-sorted) order, for every ``BLOCK_H`` tile of ``H``; fp32, stored in the weight's dtype, and
    ``d b[id] = sum dx_j``. Other programs return at once. One program per row of ``d W`` and a fixed order
    in every sum: the same bits on every run."""
    p = tl.program_id(0).to(tl.int64)
    vid = tl.load(sorted_ids_ptr + p).to(tl.int64)
    prev = tl.load(sorted_ids_ptr + tl.maximum(p - 1, 0)).to(tl.int64)
    if (p == 0) | (prev != vid):
        end = tl.load(run_end_ptr + p)
        if WITH_WEIGHT:
            for h0 in range(0, H, BLOCK_H):
                h = h0 + tl.arange(0, BLOCK_H)
                h_mask = h < H
                acc = tl.zeros((BLOCK_R, BLOCK_H), tl.float32)
                for q0 in range(p, end, BLOCK_R):  # (the run's dx and rows stay in L1 across the H tiles)
                    q = q0 + tl.arange(0, BLOCK_R)
                    mask = q < end
                    dx = tl.load(dx_ptr + q, mask=mask, other=0.0)
                    rows = tl.load(rows_ptr + q, mask=mask, other=0).to(tl.int64)
                    hid = tl.load(hidden_ptr + rows[:, None] * stride_h + h[None, :],
                                  mask=mask[:, None] & h_mask[None, :], other=0.0)
                    acc += dx[:, None] * hid.to(tl.float32)
                tl.store(grad_w_ptr + vid * stride_gw + h, tl.sum(acc, 0).to(grad_w_ptr.dtype.element_ty), mask=h_mask)
        if WITH_BIAS:
            acc_b = tl.zeros((BLOCK_R,), tl.float32)
            for q0 in range(p, end, BLOCK_R):
                q = q0 + tl.arange(0, BLOCK_R)
                acc_b += tl.load(dx_ptr + q, mask=q < end, other=0.0)
            tl.store(grad_b_ptr + vid, tl.sum(acc_b, 0).to(grad_b_ptr.dtype.element_ty))


@triton.jit
def replay_scatter_kernel(dx_ptr, ids_ptr, entry_rows_ptr, out_ptr, stride_out, K, BLOCK_E: tl.constexpr):
    """``out[row(j), id_j] = dx_j`` in ``out``'s dtype for a block of entries (ids are unique within a row:
    no two entries write one element)."""
    e = tl.program_id(0).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
    mask = e < K
    ids = tl.load(ids_ptr + e, mask=mask, other=0).to(tl.int64)
    rows = tl.load(entry_rows_ptr + e, mask=mask, other=0).to(tl.int64)
    dx = tl.load(dx_ptr + e, mask=mask, other=0.0)
    tl.store(out_ptr + rows * stride_out + ids, dx.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------------
# launchers (the contract of docs / notes: same signatures as kernels/torch_replay.py)
# --------------------------------------------------------------------------------------------------
def _blocks(hidden_size: int, dtype: torch.dtype) -> Dict[str, int]:
    """Tile sizes. The entries kernel: ``BLOCK_E`` = 32 entries by ``BLOCK_H`` = 256 bytes of each row (128
    bf16 / 64 fp32 elements: two 16-byte vectors per thread of 4 warps, per operand; the mean kept set is ~8,
    the median 2, so entries of several rows share a tile). The statistics: a row's entries ``BLOCK_K`` =
    32 at a time. The gradient kernels: ``BLOCK_R`` = 8 entries (of a row, or of a run of one id) by
    ``BLOCK_HG`` = 1 KB of each row (512 bf16 / 256 fp32), so a typical set or run is one tile deep and
    each thread still has 128 bytes of loads in flight. (From the sm_90a SASS of the entries kernel: ~70 KB
    of loads in flight per SM with 5 CTAs, above an H200's ~25 KB latency-bandwidth product per SM.)"""
    size = torch.empty((), dtype=dtype).element_size()
    h = triton.next_power_of_2(max(hidden_size, 1))
    out = dict(BLOCK_E=32, BLOCK_H=min(256 // size, h), BLOCK_K=32, BLOCK_R=8, BLOCK_HG=min(1024 // size, h))
    if BLOCKS_OVERRIDE:
        out.update(BLOCKS_OVERRIDE)
    return out


def _transform_launch(temperature: Temperature, softcap: Optional[float], logit_scale: float) -> dict:
    """The kernels' transform arguments (``inv_t``, ``cap_k``, ``cap``, ``t_rows``, ``SOFTCAP``, ``PER_ROW_T``)
    from ``triton_rows.transform_args`` (the one place their float64 factors are formed)."""
    if isinstance(temperature, torch.Tensor):
        tf = _transform_args(1.0, softcap, logit_scale, temperature)
    else:
        tf = _transform_args(float(temperature), softcap, logit_scale)
    return dict(inv_t=tf["inv_temperature"], cap_k=tf["cap_k"], cap=tf["cap"], t_rows=tf["t_rows"],
                SOFTCAP=tf["SOFTCAP"], PER_ROW_T=tf["PER_ROW_T"])


def _entry_rows(offsets: torch.Tensor, num_entries: int) -> torch.Tensor:
    """[K] int64: the row of each entry (no host synchronisation: K is the ids' length)."""
    n = offsets.numel() - 1
    return torch.repeat_interleave(torch.arange(n, device=offsets.device), offsets.diff(), output_size=num_entries)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _entries(src: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], token_ids: torch.Tensor,
             entry_rows: torch.Tensor, tf: dict, blocks: Dict[str, int], grad: Optional[dict] = None) -> torch.Tensor:
    """``replay_entries_kernel`` over all K entries: [K] fp32 raw logits, or with ``grad`` (the row
    tensors and flags of the backward) their ``dx``."""
    k = token_ids.numel()
    out = torch.empty(k, dtype=torch.float32, device=src.device)
    if k == 0:
        return out
    linear = weight is not None
    stand_in = out  # for every absent pointer: never read (its constexpr flag is off)
    t_rows = stand_in if tf["t_rows"] is None else tf["t_rows"]
    g = grad or {}
    replay_entries_kernel[(triton.cdiv(k, blocks["BLOCK_E"]),)](
        src, src.stride(0), weight if linear else stand_in, weight.stride(0) if linear else 0,
        stand_in if bias is None else bias, token_ids, entry_rows, out, k, src.shape[1] if linear else 0,
        g.get("targets", stand_in), g.get("lse", stand_in), g.get("entropy", stand_in),
        g.get("grad_logp", stand_in), g.get("grad_entropy", stand_in), t_rows, tf["inv_t"], tf["cap_k"], tf["cap"],
        LINEAR=linear, HAS_BIAS=bias is not None, GRAD=grad is not None, SOFTCAP=tf["SOFTCAP"],
        PER_ROW_T=tf["PER_ROW_T"], HAS_GRAD_LOGP="grad_logp" in g, HAS_GRAD_ENTROPY="grad_entropy" in g,
        BLOCK_E=blocks["BLOCK_E"], BLOCK_H=blocks["BLOCK_H"] if linear else 1, num_warps=4,
    )
    return out


def _stats(x: torch.Tensor, targets: torch.Tensor, token_ids: torch.Tensor, offsets: torch.Tensor, tf: dict,
           blocks: Dict[str, int], with_entropy: bool, with_sum_sq: bool) -> Tuple[torch.Tensor, ...]:
    n = offsets.numel() - 1
    outputs = [torch.empty(n, dtype=torch.float32, device=offsets.device) for _ in range(4)]
    if n == 0:
        return tuple(outputs)
    logp, entropy, sum_sq, lse = outputs
    replay_stats_kernel[(n,)](
        x, token_ids, offsets, targets, logp, entropy, sum_sq, lse, logp if tf["t_rows"] is None else tf["t_rows"],
        tf["inv_t"], tf["cap_k"], tf["cap"],
        SOFTCAP=tf["SOFTCAP"], PER_ROW_T=tf["PER_ROW_T"], WITH_ENTROPY=bool(with_entropy), WITH_SQ=bool(with_sum_sq),
        BLOCK_K=blocks["BLOCK_K"], num_warps=1,
    )
    return logp, entropy, sum_sq, lse


def _grad_rows(targets: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor, grad_logp: Optional[torch.Tensor],
               grad_entropy: Optional[torch.Tensor]) -> dict:
    """The per-row tensors ``_entry_grad`` reads; an absent gradient is left out (its flag off)."""
    g = dict(targets=targets.contiguous(), lse=lse.float().contiguous())
    if grad_logp is not None:
        g["grad_logp"] = grad_logp.float().contiguous()
    if grad_entropy is not None:
        g["grad_entropy"] = grad_entropy.float().contiguous()
        g["entropy"] = entropy.float().contiguous()
    return g


def replay_linear_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    targets: torch.Tensor,
    token_ids: torch.Tensor,
    offsets: torch.Tensor,
    temperature: Temperature,
    softcap: Optional[float],
    logit_scale: float,
    with_entropy: bool,
    with_sum_sq: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, entropy, sum_sq, lse), fp32 [N] each, of the kept sets from the hidden states.

    hidden [N, H] (fp32 / bf16 / fp16), weight [V, H] (rounded to hidden's dtype for the product),
    bias [V] or None, targets [N] int, token_ids [K] int, offsets [N + 1] int64 (CSR, validated by the
    caller), temperature a float or a tensor [N]. Reads ``weight`` only at the kept ids; entropy and
    sum_sq are zeros unless asked.
    """
    hidden, weight = _last_dim_contiguous(hidden), _last_dim_contiguous(weight)
    token_ids, offsets = token_ids.contiguous(), offsets.contiguous()
    blocks = _blocks(hidden.shape[1], hidden.dtype)
    tf = _transform_launch(temperature, softcap, logit_scale)
    entry_rows = _entry_rows(offsets, token_ids.numel())
    x = _entries(hidden, weight, None if bias is None else bias.contiguous(), token_ids, entry_rows, tf, blocks)
    return _stats(x, targets.contiguous(), token_ids, offsets, tf, blocks, with_entropy, with_sum_sq)


def replay_linear_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    targets: torch.Tensor,
    token_ids: torch.Tensor,
    offsets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logp: Optional[torch.Tensor],
    grad_entropy: Optional[torch.Tensor],
    temperature: Temperature,
    softcap: Optional[float],
    logit_scale: float,
    needs_hidden_grad: bool,
    needs_weight_grad: bool,
    needs_bias_grad: bool,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(d_hidden [N, H] in hidden's dtype, d_weight [V, H] in weight's, d_bias [V] in bias's), each None
    unless asked; ``lse`` / ``entropy`` [N] from :func:`replay_linear_forward`, ``grad_logp`` /
    ``grad_entropy`` [N] or None (0). d_weight and d_bias are zero off the kept ids and deterministic."""
    hidden, weight = _last_dim_contiguous(hidden), _last_dim_contiguous(weight)
    token_ids, offsets = token_ids.contiguous(), offsets.contiguous()
    bias = None if bias is None else bias.contiguous()
    n, h = hidden.shape
    k = token_ids.numel()
    blocks = _blocks(h, hidden.dtype)
    tf = _transform_launch(temperature, softcap, logit_scale)
    entry_rows = _entry_rows(offsets, k)
    dx = _entries(hidden, weight, bias, token_ids, entry_rows, tf, blocks,
                  grad=_grad_rows(targets, lse, entropy, grad_logp, grad_entropy))
    d_hidden = d_weight = d_bias = None
    if needs_hidden_grad:
        d_hidden = torch.empty_like(hidden)
        if n > 0:
            replay_hidden_grad_kernel[(n, triton.cdiv(h, blocks["BLOCK_HG"]))](
                dx, weight, weight.stride(0), token_ids, offsets, d_hidden, d_hidden.stride(0), h,
                BLOCK_K=blocks["BLOCK_R"], BLOCK_H=blocks["BLOCK_HG"], num_warps=4,
            )
    with_bias = needs_bias_grad and bias is not None
    if needs_weight_grad:
        d_weight = torch.zeros_like(weight)
    if with_bias:
        d_bias = torch.zeros_like(bias)
    if (needs_weight_grad or with_bias) and k > 0:
        # one stable sort by id: each run of equal ids is summed by one program, in entry order
        sorted_ids, order = torch.sort(token_ids, stable=True)
        run_end = torch.searchsorted(sorted_ids, sorted_ids, right=True)
        replay_weight_grad_kernel[(k,)](
            dx[order], hidden, hidden.stride(0), sorted_ids, run_end, entry_rows[order],
            dx if d_weight is None else d_weight, d_weight.stride(0) if needs_weight_grad else 0,
            dx if d_bias is None else d_bias, h,
            WITH_WEIGHT=bool(needs_weight_grad), WITH_BIAS=with_bias, BLOCK_R=blocks["BLOCK_R"],
            BLOCK_H=blocks["BLOCK_HG"], num_warps=4,
        )
    return d_hidden, d_weight, d_bias


def replay_rows_forward(
    logits: torch.Tensor,
    targets: torch.Tensor,
    token_ids: torch.Tensor,
    offsets: torch.Tensor,
    temperature: Temperature,
    softcap: Optional[float],
    logit_scale: float,
    with_entropy: bool,
    with_sum_sq: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, entropy, sum_sq, lse), fp32 [N] each, of the kept sets from logits [N, V] (any row stride,
    last dim contiguous): reads only the kept entries of each row."""
    logits = _last_dim_contiguous(logits)
    token_ids, offsets = token_ids.contiguous(), offsets.contiguous()
    blocks = _blocks(1, logits.dtype)
    tf = _transform_launch(temperature, softcap, logit_scale)
    x = _entries(logits, None, None, token_ids, _entry_rows(offsets, token_ids.numel()), tf, blocks)
    return _stats(x, targets.contiguous(), token_ids, offsets, tf, blocks, with_entropy, with_sum_sq)


def replay_rows_backward(
    logits: torch.Tensor,
    targets: torch.Tensor,
    token_ids: torch.Tensor,
    offsets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logp: Optional[torch.Tensor],
    grad_entropy: Optional[torch.Tensor],
    temperature: Temperature,
    softcap: Optional[float],
    logit_scale: float,
    out: torch.Tensor,
) -> None:
    """Write ``d loss / d logits`` into ``out`` [N, V] (logits' dtype, last dim contiguous; may be
    ``logits`` itself): ``dx`` at the kept entries, 0 everywhere else."""
    if out.stride(-1) != 1:
        raise ValueError("out must have a contiguous last dimension")
    logits = _last_dim_contiguous(logits)
    token_ids, offsets = token_ids.contiguous(), offsets.contiguous()
    k = token_ids.numel()
    blocks = _blocks(1, logits.dtype)
    tf = _transform_launch(temperature, softcap, logit_scale)
    entry_rows = _entry_rows(offsets, k)
    dx = _entries(logits, None, None, token_ids, entry_rows, tf, blocks,
                  grad=_grad_rows(targets, lse, entropy, grad_logp, grad_entropy))
    out.zero_()  # after the coefficients are formed: out may be the logits
    if k > 0:
        replay_scatter_kernel[(triton.cdiv(k, blocks["BLOCK_E"]),)](
            dx, token_ids, entry_rows, out, out.stride(0), k, BLOCK_E=blocks["BLOCK_E"], num_warps=1,
        )
