"""Triton row kernels: token log-prob and entropy from logits in one read, and their gradient.

Rows are ``[B, T, V]`` logits addressed by ``(b, t)`` strides (a slice of a larger tensor is read in
place); row offsets are int64, so ``N * V > 2**31`` indexes correctly.

Forward (one read of the row). A block of the row is a ``[BLOCK_V / VEC, VEC]`` tile: each tile row is one
16-byte vector, and each thread owns whole tile rows ("slots"). Every slot keeps its own running
statistics over the vocabulary loop, all fp32, in base 2 with ``c = log2(e) / T``::

    m = max x    s = sum 2^((x - m) c)    u = sum 2^((x - m) c) * (x - m) c

so the loop has no block-wide reduction (no shuffles, no barrier): the slots are merged once per row
by the same online-softmax rule that merges two blocks. Then ``log p = (x_t - m) c - log2 s`` (in
bits; never ``z - lse``, whose rounding of ``lse`` would cost a confident token its gradient) and
``H = ln s - ln 2 * u / s``: both terms are >= 0, so nothing cancels. The target logit is read once.
The main loop reads whole blocks without a mask; the partial last block is peeled off after it.

Why ``(x - m) * c`` and not one FFMA ``x * c - m * c``: the FFMA form is exact only up to the
rounding of ``m * c``, which is harmless for ordinary logits but is ~1e25 for logits near 1e32 and
overflows ``2^`` (the row's own maximum would get p = inf). ``x - m`` is exact near the maximum,
so the maximum gets exactly ``2^0 = 1`` at any magnitude, up to the bf16/fp32 maximum.

-inf logits need no per-element select: the exponent is clamped at -FLT_MAX with a NaN-propagating
max (``2^-FLT_MAX = 0`` and ``0 * -FLT_MAX = 0``, where ``0 * -inf`` would be NaN), and a NaN logit
still makes its row NaN.

The row keeps ``row_max`` (the maximum raw logit, not divided by T) and ``log_sum`` (``log2 s``):
both private to this module's backward, which recomputes ``log2 p`` from them block by block, as
``p * (a + b * log2 p)`` with per-row ``a`` and ``b``, and writes the gradient in the output's
dtype; the target's exact ``g * (1 - p)`` (from an accurate ``1 - p``) is written once after the loop.

Few rows (the fused-linear path's chunks of ~256 rows): each row's vocabulary is split over several
programs (``row_stats_partial_kernel`` writes each chunk's ``(m, s, u)``), and the forward kernel
then merges the partials instead of reading the row; the backward simply gets a 2-D grid.

A temperature per row (``PER_ROW_T``): each kernel loads its row's ``(c, c ln 2, 1 / T)``, formed in
float64 by the launchers as the float's factors are (``transform_args``). The sampler's distribution
(top-k, top-p; ``forward_rows_sampled``): ``sampled_logprobs_fwd_kernel`` reads the row twice (its
statistics, then the candidates above a bound certified from them) and finds the thresholds on the
candidates; ``sampled_logprobs_fallback_kernel`` serves the rows whose candidates did not fit, by
narrowing passes; the backward reads the kept set (``TRUNCATED``). ``docs/kernels.md`` has the passes.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..options import top_k_rows as top_k_rows_of

LOWEST = tl.constexpr(-3.4028234663852886e38)  # -FLT_MAX: the clamp that stands in for -inf
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)
# log2 p below this is 0 in fp32 anyway (2^-150 rounds to 0); clamping there keeps b * log2 p finite.
_LOG2P_FLOOR = tl.constexpr(-256.0)

# Tests set this to force the split-vocabulary path (any number of rows) on the CPU interpreter.
SPLITS_OVERRIDE: Optional[int] = None
_MAX_SPLITS = 64
_DEFAULT_SMS = 132  # an H200 / H100 SXM, assumed for meta tensors (AOT compilation, the SASS model)


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------
@triton.jit
def _row_pointer(base, row, T, stride_b, stride_t):
    b = row // T
    t = row - b * T
    return base + b * stride_b + t * stride_t


@triton.jit
def row_factor(value, t_rows_ptr, row, K: tl.constexpr, PER_ROW_T: tl.constexpr):
    """Factor ``K`` of the temperature factors ``(c, c ln 2, 1 / T)`` (0, 1, 2): with ``PER_ROW_T`` the row's
    own, row ``row`` of ``t_rows`` [rows, 3] (:func:`transform_args`), else the launch's ``value``."""
    if PER_ROW_T:
        value = tl.load(t_rows_ptr + 3 * row + K)
    return value


@triton.jit
def one_minus_exp(x):
    """1 - exp(x) for x <= 0, accurate near 0 (a confident token's 1 - p), like -expm1(x)."""
    series = -x * (1.0 + x * (0.5 + x * (1.0 / 6.0 + x * (1.0 / 24.0 + x * (1.0 / 120.0)))))
    return tl.where(x > -0.125, series, 1.0 - tl.exp(x))


@triton.jit
def soft_capped(x, k, cap):
    """Final-logit soft-capping ``cap * tanh(k * x)`` (``k = logit_scale / cap``), accurate near 0:
    ``tanh |a| = (1 - e^{-2|a|}) / (1 + e^{-2|a|})`` with the accurate ``1 - e^y``. NaN stays NaN."""
    a = x * k
    e = one_minus_exp(-2.0 * tl.abs(a))
    t = e / (2.0 - e)
    return cap * tl.where(a < 0.0, -t, t)


@triton.jit
def _load_row(ptr, cap_k, cap, SOFTCAP: tl.constexpr, mask=None):
    """Logits as the softmax sees them before the temperature: raw, or soft-capped (the logit scale
    without a cap is folded into the temperature by the launchers). Masked lanes are -inf."""
    if mask is None:
        x = tl.load(ptr).to(tl.float32)
        if SOFTCAP:
            x = soft_capped(x, cap_k, cap)
    else:
        x = tl.load(ptr, mask=mask, other=float("-inf")).to(tl.float32)
        if SOFTCAP:  # tanh(-inf) = -1 would give the lanes past V a probability: keep them -inf
            x = tl.where(mask, soft_capped(x, cap_k, cap), float("-inf"))
    return x


@triton.jit
def softcap_slope(y, cap_scale, cap):
    """d y / d x of ``y = cap * tanh(k x)``: ``logit_scale * (1 - (y / cap)^2)`` (``cap_scale = cap * k``)."""
    t = y / cap
    return cap_scale * (1.0 - t * t)


@triton.jit
def _tile(BLOCK_V: tl.constexpr, VEC: tl.constexpr):
    """Offsets of a block as a [BLOCK_V / VEC, VEC] tile: tile row r is the 16-byte vector at r * VEC."""
    return tl.arange(0, BLOCK_V // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]


@triton.jit
def _slot_update(x, m, s, u, w, c, WITH_ENTROPY: tl.constexpr, WITH_SQ: tl.constexpr):
    """Fold a [BLOCK_V / VEC, VEC] tile of raw fp32 logits into the per-slot (m, s, u, w), one per tile row;
    ``w = sum 2^(2 (x - m) c)`` (the squared probabilities' sum) with ``WITH_SQ``, else ``w`` as given."""
    m_new = tl.maximum(m, tl.max(x, 1))  # in-thread: a slot is one thread's 16-byte vector
    # The old sums move to the new max: 2^dd with dd <= 0; clamped so a -FLT_MAX start or a huge
    # jump gives alpha = 0 and alpha * dd = 0 (never 0 * -inf).
    dd = tl.maximum((m - m_new) * c, LOWEST)
    alpha = tl.exp2(dd)
    shift = tl.maximum((x - m_new[:, None]) * c, LOWEST, propagate_nan=tl.PropagateNan.ALL)
    e = tl.exp2(shift)
    s_new = s * alpha + tl.sum(e, 1)
    if WITH_ENTROPY:
        # u is relative to the slot's max: moving it by dd adds dd to every shift, i.e. dd * s.
        u = u * alpha + (alpha * dd) * s + tl.sum(e * shift, 1)
    if WITH_SQ:
        w = w * (alpha * alpha) + tl.sum(e * e, 1)  # (squares move by alpha^2)
    return m_new, s_new, u, w


@triton.jit
def _merge(m, s, u, w, c, WITH_ENTROPY: tl.constexpr, WITH_SQ: tl.constexpr):
    """Merge per-slot (or per-chunk) statistics [K] into the row's (m, s, u, w): the same rule as above
    (``w`` scaled by ``a^2``; 0 without ``WITH_SQ``, as ``u`` without ``WITH_ENTROPY``)."""
    m_row = tl.max(m, 0)
    dd = tl.maximum((m - m_row) * c, LOWEST)
    a = tl.exp2(dd)
    s_row = tl.sum(a * s, 0)
    u_row = 0.0
    w_row = 0.0
    if WITH_ENTROPY:
        u_row = tl.sum(a * u + (a * dd) * s, 0)
    if WITH_SQ:
        w_row = tl.sum((a * a) * w, 0)
    return m_row, s_row, u_row, w_row


@triton.jit
def _slot_stats(row_ptr, blk_lo, blk_hi, V, c, cap_k, cap, BLOCK_V: tl.constexpr, VEC: tl.constexpr,
                WITH_ENTROPY: tl.constexpr, WITH_SQ: tl.constexpr, SOFTCAP: tl.constexpr):
    """Each slot's (m, s, u, w) [BLOCK_V / VEC] over the row's blocks [blk_lo, blk_hi) (block k = elements
    [k, k+1) * BLOCK_V), not yet merged.

    Whole blocks are read without a mask; a block that crosses V (only ever the row's last) is
    peeled off after the loop. Block starts are multiples of the constexpr BLOCK_V, so the
    compiler knows every vector is 16-byte aligned.
    """
    R: tl.constexpr = BLOCK_V // VEC
    tile = _tile(BLOCK_V, VEC)
    m = tl.full((R,), LOWEST, tl.float32)
    s = tl.zeros((R,), tl.float32)
    u = tl.zeros((R,), tl.float32)
    w = tl.zeros((R,), tl.float32)
    blk_hi = tl.minimum(blk_hi, tl.cdiv(V, BLOCK_V))  # the last split may be short
    blk_full = tl.minimum(blk_hi, V // BLOCK_V)
    for blk in range(blk_lo, blk_full):
        x = _load_row(row_ptr + blk * BLOCK_V + tile, cap_k, cap, SOFTCAP)
        m, s, u, w = _slot_update(x, m, s, u, w, c, WITH_ENTROPY, WITH_SQ)
    if blk_full < blk_hi:
        offs = blk_full * BLOCK_V + tile
        x = _load_row(row_ptr + offs, cap_k, cap, SOFTCAP, mask=offs < V)
        m, s, u, w = _slot_update(x, m, s, u, w, c, WITH_ENTROPY, WITH_SQ)
    return m, s, u, w


@triton.jit
def _chunk_stats(row_ptr, blk_lo, blk_hi, V, c, cap_k, cap, BLOCK_V: tl.constexpr, VEC: tl.constexpr,
                 WITH_ENTROPY: tl.constexpr, SOFTCAP: tl.constexpr):
    """(m, s, u) of the row's blocks [blk_lo, blk_hi): :func:`_slot_stats`, merged."""
    m, s, u, w = _slot_stats(row_ptr, blk_lo, blk_hi, V, c, cap_k, cap, BLOCK_V, VEC, WITH_ENTROPY, False, SOFTCAP)
    m, s, u, _ = _merge(m, s, u, w, c, WITH_ENTROPY, False)
    return m, s, u


@triton.jit
def _row_summary(
    row_ptr, row, V, c, cap_k, cap, part_m_ptr, part_s_ptr, part_u_ptr, num_splits,
    BLOCK_V: tl.constexpr, VEC: tl.constexpr, WITH_ENTROPY: tl.constexpr, SPLIT: tl.constexpr, SPLITS_PAD: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """The row's (m, s, u): read from the logits, or merged from the partial kernel's chunks."""
    if SPLIT:
        k = tl.arange(0, SPLITS_PAD)
        base = row * num_splits
        pm = tl.load(part_m_ptr + base + k, mask=k < num_splits, other=LOWEST)
        ps = tl.load(part_s_ptr + base + k, mask=k < num_splits, other=0.0)
        pu = ps
        if WITH_ENTROPY:
            pu = tl.load(part_u_ptr + base + k, mask=k < num_splits, other=0.0)
        m, s, u, _ = _merge(pm, ps, pu, ps, c, WITH_ENTROPY, False)
    else:
        m, s, u = _chunk_stats(row_ptr, 0, tl.cdiv(V, BLOCK_V), V, c, cap_k, cap, BLOCK_V, VEC, WITH_ENTROPY, SOFTCAP)
    return m, s, u


@triton.jit
def _finish_row(row_ptr, target, m, s, u, c_ln, cap_k, cap, WITH_ENTROPY: tl.constexpr, SOFTCAP: tl.constexpr):
    """(logp, entropy, log2 s) in nats / nats / bits from the row's statistics and its target logit;
    ``c_ln = c ln 2`` (the slope in nats, formed once, in float64, by the launcher)."""
    log2_s = tl.log2(s)
    x_target = _load_row(row_ptr + target, cap_k, cap, SOFTCAP)
    # (x_t - m) / T in nats, not in bits: a logit gap near FLT_MAX stays finite at T = 1.
    logp = (x_target - m) * c_ln - log2_s * _LN2
    # below float32's range (a 3e38 gap at T < 1): its lowest finite value, not -inf, as every backend
    logp = tl.maximum(logp, LOWEST, propagate_nan=tl.PropagateNan.ALL)
    entropy = 0.0
    if WITH_ENTROPY:
        entropy = (log2_s - u / s) * _LN2
    return logp, entropy, log2_s


@triton.jit
def _store_masked_row(row, logp_ptr, entropy_ptr, max_ptr, log_sum_ptr, WITH_ENTROPY: tl.constexpr):
    """A masked row's log-prob outputs: nothing is read, everything is 0."""
    tl.store(logp_ptr + row, 0.0)
    tl.store(max_ptr + row, 0.0)
    tl.store(log_sum_ptr + row, 0.0)
    if WITH_ENTROPY:
        tl.store(entropy_ptr + row, 0.0)


@triton.jit
def _logprob_row(
    logits_ptr, stride_b, stride_t, T, row, target, logp_ptr, entropy_ptr, max_ptr, log_sum_ptr,
    part_m_ptr, part_s_ptr, part_u_ptr, num_splits, V, c, c_ln, cap_k, cap,
    BLOCK_V: tl.constexpr, VEC: tl.constexpr, WITH_ENTROPY: tl.constexpr, SPLIT: tl.constexpr, SPLITS_PAD: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """A kept row's log-prob of ``target``, entropy (``WITH_ENTROPY``), max and log2 sum, stored; returns
    (logp, entropy) for the GRPO epilogue. The forward of both ``token_logprobs_fwd_kernel`` and
    ``grpo_loss_fwd_kernel``."""
    row_ptr = _row_pointer(logits_ptr, row, T, stride_b, stride_t)
    m, s, u = _row_summary(row_ptr, row, V, c, cap_k, cap, part_m_ptr, part_s_ptr, part_u_ptr, num_splits,
                           BLOCK_V, VEC, WITH_ENTROPY, SPLIT, SPLITS_PAD, SOFTCAP)
    logp, entropy, log2_s = _finish_row(row_ptr, target, m, s, u, c_ln, cap_k, cap, WITH_ENTROPY, SOFTCAP)
    tl.store(logp_ptr + row, logp)
    tl.store(max_ptr + row, m)
    tl.store(log_sum_ptr + row, log2_s)
    if WITH_ENTROPY:
        tl.store(entropy_ptr + row, entropy)
    return logp, entropy


# --------------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------------
@triton.jit
def row_stats_partial_kernel(
    logits_ptr, stride_b, stride_t, T,
    targets_ptr, part_m_ptr, part_s_ptr, part_u_ptr,
    V, c, cap_k, cap, ignore_index, num_splits, blocks_per_split, t_rows_ptr,
    BLOCK_V: tl.constexpr, VEC: tl.constexpr, WITH_ENTROPY: tl.constexpr, SOFTCAP: tl.constexpr,
    PER_ROW_T: tl.constexpr,
):
    """Program (row, split): the (m, s, u) of one chunk of a row's vocabulary, for few rows."""
    row = tl.program_id(0).to(tl.int64)
    c = row_factor(c, t_rows_ptr, row, 0, PER_ROW_T)  # (a temperature per sequence or token)
    split = tl.program_id(1)
    target = tl.load(targets_ptr + row).to(tl.int64)
    if target != ignore_index:  # a masked row is never read; the merge kernel writes its zeros
        row_ptr = _row_pointer(logits_ptr, row, T, stride_b, stride_t)
        blk_lo = split * blocks_per_split
        m, s, u = _chunk_stats(row_ptr, blk_lo, blk_lo + blocks_per_split, V, c, cap_k, cap, BLOCK_V, VEC, WITH_ENTROPY,
                               SOFTCAP)
        out = row * num_splits + split
        tl.store(part_m_ptr + out, m)
        tl.store(part_s_ptr + out, s)
        if WITH_ENTROPY:
            tl.store(part_u_ptr + out, u)


@triton.jit
def token_logprobs_fwd_kernel(
    logits_ptr, stride_b, stride_t, T,
    targets_ptr, logp_ptr, entropy_ptr, max_ptr, log_sum_ptr,
    part_m_ptr, part_s_ptr, part_u_ptr, num_splits,
    V, c, c_ln, cap_k, cap, ignore_index, t_rows_ptr,
    BLOCK_V: tl.constexpr, VEC: tl.constexpr, WITH_ENTROPY: tl.constexpr, SPLIT: tl.constexpr, SPLITS_PAD: tl.constexpr,
    SOFTCAP: tl.constexpr, PER_ROW_T: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = row_factor(c, t_rows_ptr, row, 0, PER_ROW_T)
    c_ln = row_factor(c_ln, t_rows_ptr, row, 1, PER_ROW_T)
    target = tl.load(targets_ptr + row).to(tl.int64)
    if target == ignore_index:
        _store_masked_row(row, logp_ptr, entropy_ptr, max_ptr, log_sum_ptr, WITH_ENTROPY)
    else:
        _logprob_row(logits_ptr, stride_b, stride_t, T, row, target, logp_ptr, entropy_ptr, max_ptr, log_sum_ptr,
                     part_m_ptr, part_s_ptr, part_u_ptr, num_splits, V, c, c_ln, cap_k, cap,
                     BLOCK_V, VEC, WITH_ENTROPY, SPLIT, SPLITS_PAD, SOFTCAP)


@triton.jit
def grpo_loss_fwd_kernel(
    logits_ptr, stride_b, stride_t, T,
    targets_ptr, advantages_ptr, weights_ptr, kl_weights_ptr, old_logps_ptr, ref_logps_ptr, is_ratio_ptr,
    logp_ptr, entropy_ptr, max_ptr, log_sum_ptr, loss_ptr, coef_logp_ptr, coef_entropy_ptr, kl_ptr, clip_ptr,
    part_m_ptr, part_s_ptr, part_u_ptr, num_splits,
    V, c, c_ln, cap_k, cap, ignore_index, eps_low, eps_high, delta, beta, entropy_coef, sapo_tau_pos, sapo_tau_neg,
    dro_beta, t_rows_ptr,
    BLOCK_V: tl.constexpr, VEC: tl.constexpr, SPLIT: tl.constexpr, SPLITS_PAD: tl.constexpr, PER_ROW_T: tl.constexpr,
    HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr, HAS_IS_RATIO: tl.constexpr, SOFTCAP: tl.constexpr,
    OBJECTIVE: tl.constexpr, BIAS_CORRECTED_KL: tl.constexpr, CLAMP_LOG_RATIO: tl.constexpr,
    KL_ESTIMATOR: tl.constexpr, KL_STRAIGHT_THROUGH: tl.constexpr, KL_WEIGHTED_APART: tl.constexpr,
):
    """The token-level GRPO loss in the same pass as the log-prob.

    Per row: log-prob and entropy, then ratio, the policy term of ``OBJECTIVE`` (TRL's: 0 PPO's
    clipped surrogate, 1 cispo, 2 sapo (also verl's); verl's: 3 vanilla (dual clip), 4 gpg, 5 cispo,
    6 dppo_tv, 7 dppo_kl, 8 dro), the KL estimate of ``KL_ESTIMATOR`` (0 TRL's k3, times the ratio when
    ``BIAS_CORRECTED_KL``; verl's 1 k1, 2 abs, 3 k2, 4 low_var_kl with its clamps; k2's gradient
    when ``KL_STRAIGHT_THROUGH``, verl's "+") and the entropy bonus, times the token's weight in the
    reduction (``objective.token_weights``; the KL times ``kl_weights`` instead when
    ``KL_WEIGHTED_APART``: verl's sapo reduces its policy term by seq-mean-token-mean, the KL by
    loss_agg_mode). ``CLAMP_LOG_RATIO``: verl's clamp of ``logp - old`` to [-20, 20] before the exp.
    Writes the weighted loss (summed by the caller) and ``d loss / d logp`` and ``d loss / d entropy``,
    which the backward kernel scales by the incoming gradient, and what the metrics need: the KL (0
    without reference log-probs) and the clip region (-1 low, +1 high: TRL's ``clip_flags``, ratio <
    1 - eps_low with A < 0 / ratio > 1 + eps_high with A > 0 (cispo: ratio > eps_high); under verl
    the objective's ``low`` / ``high`` flags, those of actor/pg_clipfrac_lower / actor/pg_clipfrac).
    This is the one hand-differentiated copy of ``objective.per_token_loss`` and the flags; each term
    carries its derivative beside it, and ``tests/test_objective.py`` checks them against autograd.
    """
    row = tl.program_id(0).to(tl.int64)
    c = row_factor(c, t_rows_ptr, row, 0, PER_ROW_T)
    c_ln = row_factor(c_ln, t_rows_ptr, row, 1, PER_ROW_T)
    target = tl.load(targets_ptr + row).to(tl.int64)
    if target == ignore_index:
        _store_masked_row(row, logp_ptr, entropy_ptr, max_ptr, log_sum_ptr, True)
        tl.store(loss_ptr + row, 0.0)
        tl.store(coef_logp_ptr + row, 0.0)
        tl.store(coef_entropy_ptr + row, 0.0)
        tl.store(kl_ptr + row, 0.0)
        tl.store(clip_ptr + row, tl.zeros((), tl.int8))
    else:
        logp, entropy = _logprob_row(logits_ptr, stride_b, stride_t, T, row, target, logp_ptr, entropy_ptr, max_ptr,
                                     log_sum_ptr, part_m_ptr, part_s_ptr, part_u_ptr, num_splits, V, c, c_ln, cap_k, cap,
                                     BLOCK_V, VEC, True, SPLIT, SPLITS_PAD, SOFTCAP)

        adv = tl.load(advantages_ptr + row)
        weight = tl.load(weights_ptr + row)
        if HAS_OLD:
            old = tl.load(old_logps_ptr + row)
        else:
            old = logp  # on-policy: old = sg(logp), so logp - old is 0 with gradient 1; NaN stays NaN
        if CLAMP_LOG_RATIO:
            # ratio = exp(clamp(logp - old, -20, 20)); d ratio / d logp = ratio inside the closed range
            # (a clamp passes the gradient there, as torch.clamp), 0 outside
            log_ratio = logp - old
            ratio = tl.exp(tl.minimum(tl.maximum(log_ratio, -20.0), 20.0))
            d_ratio = tl.where((log_ratio >= -20.0) & (log_ratio <= 20.0), ratio, 0.0)
        else:
            # ratio = exp(logp - old); d ratio / d logp = ratio.
            ratio = tl.exp(logp - old)
            d_ratio = ratio
        if OBJECTIVE == 0:  # PPO's clipped surrogate (grpo, bnpo, dr_grpo, dapo, luspo)
            unclipped = tl.minimum(ratio, delta)  # delta = +inf when unset
            clipped = tl.minimum(tl.maximum(ratio, 1.0 - eps_low), 1.0 + eps_high)
            t1 = unclipped * adv
            t2 = clipped * adv
            # surrogate = -min(t1, t2). d t1 / d ratio = adv inside ratio <= delta (a clamp passes the
            # gradient inside its closed range), d t2 / d ratio = adv inside [1 - eps_low, 1 + eps_high];
            # torch.minimum splits the gradient evenly on a tie (the usual case, inside the clip range).
            d1 = tl.where(ratio <= delta, adv, 0.0)
            d2 = tl.where((ratio >= 1.0 - eps_low) & (ratio <= 1.0 + eps_high), adv, 0.0)
            d_min = tl.where(t1 < t2, d1, tl.where(t2 < t1, d2, 0.5 * (d1 + d2)))
            loss = -tl.minimum(t1, t2)
            # d surrogate / d logp = -(d min / d ratio) * (d ratio / d logp) = -d_min * ratio
            d_logp = -d_min * d_ratio
            low = (ratio < 1.0 - eps_low) & (adv < 0.0)
            high = (ratio > 1.0 + eps_high) & (adv > 0.0)
        elif OBJECTIVE == 1:  # cispo: -sg(min(ratio, eps_high)) * A * logp
            weight_is = tl.minimum(ratio, eps_high)
            loss = -weight_is * adv * logp
            # the capped ratio is detached: d / d logp = -min(ratio, eps_high) * A
            d_logp = -weight_is * adv
            low = ratio != ratio  # False (NaN-safe shape): cispo has no lower clip
            high = (ratio > eps_high) & (adv > 0.0)
        elif OBJECTIVE == 2:  # sapo: -(4 / tau) * sigmoid(tau (ratio - 1)) * A, tau by the sign of A
            tau = tl.where(adv > 0.0, sapo_tau_pos, sapo_tau_neg)
            gate = 1.0 / (1.0 + tl.exp(-tau * (ratio - 1.0)))
            loss = -(4.0 / tau) * gate * adv
            # d sigmoid(y) / dy = gate (1 - gate), dy / d logp = tau * d ratio / d logp:
            # d / d logp = -(4 / tau) * gate (1 - gate) * tau * d_ratio * A = -4 gate (1 - gate) d_ratio A
            d_logp = -4.0 * gate * (1.0 - gate) * d_ratio * adv
            low = ratio != ratio
            high = ratio != ratio
        elif OBJECTIVE == 3:  # verl vanilla: max(-A r, -A clip(r)), and where A < 0 at most -A delta
            loss1 = -adv * ratio
            clipped = tl.minimum(tl.maximum(ratio, 1.0 - eps_low), 1.0 + eps_high)
            loss2 = -adv * clipped
            # d loss1 / d logp = -A d_ratio; d loss2 / d logp = -A d_ratio inside [1 - eps_low, 1 + eps_high]
            d_loss1 = -adv * d_ratio
            d_loss2 = tl.where((ratio >= 1.0 - eps_low) & (ratio <= 1.0 + eps_high), d_loss1, 0.0)
            clip1 = tl.maximum(loss1, loss2)
            # torch.maximum: the larger one's gradient, half each on a tie
            d_clip1 = tl.where(loss1 > loss2, d_loss1, tl.where(loss2 > loss1, d_loss2, 0.5 * (d_loss1 + d_loss2)))
            loss3 = -adv * delta  # a constant: d / d logp = 0
            # min(loss3, clip1) where A < 0: clip1's gradient where it is the smaller, half on a tie
            d_dual = tl.where(clip1 < loss3, d_clip1, tl.where(loss3 < clip1, 0.0, 0.5 * d_clip1))
            loss = tl.where(adv < 0.0, tl.minimum(loss3, clip1), clip1)
            d_logp = tl.where(adv < 0.0, d_dual, d_clip1)
            low = (clip1 > loss3) & (adv < 0.0)
            high = loss2 > loss1
        elif OBJECTIVE == 4:  # verl gpg: -logp A; d / d logp = -A
            loss = -logp * adv
            d_logp = -adv
            low = ratio != ratio
            high = ratio != ratio
        elif OBJECTIVE == 5:  # verl cispo: -sg(clip(r, 1 - eps_low, 1 + eps_high)) A logp
            clipped = tl.minimum(tl.maximum(ratio, 1.0 - eps_low), 1.0 + eps_high)
            loss = -clipped * adv * logp
            # the clipped ratio is detached: d / d logp = -clip(r) A
            d_logp = -clipped * adv
            low = ratio != ratio
            high = ratio != clipped
        elif OBJECTIVE == 8:  # verl dro: -(logp A - dro_beta / 2 (logp - old)^2), no clamp
            log_ratio = logp - old
            loss = -(logp * adv - 0.5 * dro_beta * log_ratio * log_ratio)
            # d / d logp = -A + dro_beta (logp - old)   (old is a constant; on-policy log_ratio = 0)
            d_logp = -adv + dro_beta * log_ratio
            low = ratio != ratio
            high = ratio != ratio
        else:  # DPPO (6: binary TV, 7: binary KL): -A sg(min(r, delta)) logp v, v the detached trust mask
            p = tl.exp(logp)
            p_old = tl.exp(old)
            if OBJECTIVE == 6:  # the probability moved at most eps_high up (A > 0) / eps_low down (A <= 0)
                trusted = tl.where(adv > 0.0, p - p_old <= eps_high, p - p_old >= -eps_low)
            else:  # the binary KL of (p_old, 1 - p_old) to (p, 1 - p) within the threshold, or a move
                # against the advantage's direction
                binary_kl = p_old * (old - logp) + (1.0 - p_old) * tl.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
                trusted = tl.where(adv > 0.0, (binary_kl <= eps_high) | (p <= p_old),
                                   (binary_kl <= eps_low) | (p >= p_old))
            truncated = tl.minimum(ratio, delta)
            v = tl.where(trusted, 1.0, 0.0)
            loss = -adv * truncated * logp * v
            # truncated and v are detached: d / d logp = -A min(r, delta) v
            d_logp = -adv * truncated * v
            low = (ratio > delta) & trusted
            high = v == 0.0
        if HAS_IS_RATIO:
            # loss * is_ratio (a detached weight): d / d logp scales by the same is_ratio
            is_ratio = tl.load(is_ratio_ptr + row)
            loss = loss * is_ratio
            d_logp = d_logp * is_ratio
        kl = 0.0
        d_kl = 0.0
        if HAS_REF:
            ref = tl.load(ref_logps_ptr + row)
            if KL_ESTIMATOR == 0:  # TRL's k3, unclamped
                # k3 = exp(diff) - diff - 1 with diff = ref - logp;
                # d k3 / d logp = -(exp(diff) - 1) = 1 - exp(diff)
                diff = ref - logp
                exp_diff = tl.exp(diff)
                kl = exp_diff - diff - 1.0
                if BIAS_CORRECTED_KL:
                    # kl * ratio: d / d logp = (1 - exp(diff)) * ratio + kl * ratio = -diff * ratio
                    d_kl = -diff * ratio
                    kl = kl * ratio
                else:
                    d_kl = 1.0 - exp_diff
            elif KL_ESTIMATOR == 1:  # k1 = logp - ref; d / d logp = 1
                kl = logp - ref
                d_kl = 1.0
            elif KL_ESTIMATOR == 2:  # abs = |logp - ref|; d / d logp = sign(logp - ref) (0 at 0, as torch)
                x = logp - ref
                kl = tl.abs(x)
                d_kl = tl.where(x > 0.0, 1.0, tl.where(x < 0.0, -1.0, 0.0))
            elif KL_ESTIMATOR == 3:  # k2 = (logp - ref)^2 / 2; d / d logp = logp - ref
                x = logp - ref
                kl = 0.5 * x * x
                d_kl = x
            else:  # low_var_kl: clamp(exp(d) - d - 1, -10, 10), d = clamp(ref - logp, -20, 20)
                diff = ref - logp
                d_c = tl.minimum(tl.maximum(diff, -20.0), 20.0)
                exp_diff = tl.exp(d_c)
                k3 = exp_diff - d_c - 1.0
                kl = tl.minimum(tl.maximum(k3, -10.0), 10.0)
                # d / d logp = (1 - exp(d)) inside both clamps' closed ranges, 0 outside
                inside = (diff >= -20.0) & (diff <= 20.0) & (k3 >= -10.0) & (k3 <= 10.0)
                d_kl = tl.where(inside, 1.0 - exp_diff, 0.0)
            if KL_STRAIGHT_THROUGH:  # verl's "+": the value above, the gradient of k2: logp - ref
                d_kl = logp - ref
        if KL_WEIGHTED_APART:  # (HAS_REF is on: the launcher passes kl_weights only then)
            # entropy bonus -entropy_coef * H: d / d logp = 0, d / d H = -entropy_coef
            loss -= entropy_coef * entropy
            kl_weight = tl.load(kl_weights_ptr + row)
            tl.store(loss_ptr + row, loss * weight + beta * kl * kl_weight)
            tl.store(coef_logp_ptr + row, d_logp * weight + beta * d_kl * kl_weight)
        else:
            if HAS_REF:
                loss += beta * kl
                d_logp += beta * d_kl
            # entropy bonus -entropy_coef * H: d / d logp = 0, d / d H = -entropy_coef
            loss -= entropy_coef * entropy
            tl.store(loss_ptr + row, loss * weight)
            tl.store(coef_logp_ptr + row, d_logp * weight)
        tl.store(coef_entropy_ptr + row, -entropy_coef * weight)
        tl.store(kl_ptr + row, kl)
        tl.store(clip_ptr + row, (high.to(tl.int8) - low.to(tl.int8)).to(tl.int8))


@triton.jit
def token_logprobs_bwd_kernel(
    logits_ptr, stride_b, stride_t, T,
    grad_ptr, grad_stride_b, grad_stride_t,
    targets_ptr, max_ptr, log_sum_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr,
    V, c, inv_temperature, cap_k, cap, ignore_index, blocks_per_split, t_rows_ptr, thr_ptr, tie_ptr,
    BLOCK_V: tl.constexpr, VEC: tl.constexpr, HAS_GRAD_LOGP: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr,
    SOFTCAP: tl.constexpr, PER_ROW_T: tl.constexpr, TRUNCATED: tl.constexpr,
):
    """Program (row, split): d loss / d logits over one chunk of the row (the whole row: 1 split).

    With q = log2 p = (x - m) c - log2 s and g_l, g_H the incoming gradients of logp and H:
        d logp / d z_j = [j = t] - p_j,   d H / d z_j = -p_j (ln p_j + H),   z = x / T
    so d loss / d x_j = p_j (a + b q_j) + [j = t] g_l / T with the per-row constants
        a = -(g_l + g_H H) / T,   b = -g_H ln 2 / T.
    The loop writes p_j (a + b q_j) everywhere; the target's exact value, with its accurate 1 - p,
    is written once after it. With soft-capping, x above is ``y = cap tanh(k x)`` and each element
    is further multiplied by ``dy / dx = logit_scale (1 - (y / cap)^2)``.

    ``TRUNCATED``: the forward's kept set (``y > thr``, or ``y == thr`` at an index ``>= tie``: a
    constant of the step) holds the distribution; p = 0 outside it, and a target outside it (or a kept
    one whose logit is -inf, on a row that truncates: ``tie >= 0``) has log-prob -inf and no log-prob
    gradient (``g_l`` = 0).
    """
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    c = row_factor(c, t_rows_ptr, row, 0, PER_ROW_T)
    inv_temperature = row_factor(inv_temperature, t_rows_ptr, row, 2, PER_ROW_T)
    target = tl.load(targets_ptr + row).to(tl.int64)
    row_ptr = _row_pointer(logits_ptr, row, T, stride_b, stride_t)
    grad_row_ptr = _row_pointer(grad_ptr, row, T, grad_stride_b, grad_stride_t)
    tile = _tile(BLOCK_V, VEC)
    blk_lo = split * blocks_per_split
    blk_hi = tl.minimum(blk_lo + blocks_per_split, tl.cdiv(V, BLOCK_V))
    blk_full = tl.minimum(blk_hi, V // BLOCK_V)
    if target == ignore_index:
        zeros = tl.zeros((BLOCK_V // VEC, VEC), tl.float32).to(grad_ptr.dtype.element_ty)
        for blk in range(blk_lo, blk_hi):
            offs = blk * BLOCK_V + tile
            tl.store(grad_row_ptr + offs, zeros, mask=offs < V)
    else:
        m = tl.load(max_ptr + row)
        log2_s = tl.load(log_sum_ptr + row)
        g_logp = 0.0
        if HAS_GRAD_LOGP:
            g_logp = tl.load(grad_logp_ptr + row) * inv_temperature
        g_entropy = 0.0
        entropy = 0.0
        if HAS_GRAD_ENTROPY:
            g_entropy = tl.load(grad_entropy_ptr + row) * inv_temperature
            entropy = tl.load(entropy_ptr + row)
        a = -(g_logp + g_entropy * entropy)
        b = -g_entropy * _LN2
        cap_scale = cap * cap_k  # the logit scale, dy/dx at 0 with soft-capping
        # A target outside [0, V) lies in another rank's vocabulary shard (grpo_kernels.vocab_parallel):
        # the row gets the softmax part of its gradient only.
        in_row = (target >= 0) & (target < V)
        # Read before the loop: with out = logits (in-place backward) the loop overwrites it.
        y_t = _load_row(row_ptr + tl.where(in_row, target, 0), cap_k, cap, SOFTCAP)
        q_t = (y_t - m) * c - log2_s
        thr = 0.0
        tie = 0
        kept_t = in_row
        if TRUNCATED:
            thr = tl.load(thr_ptr + row)
            tie = tl.load(tie_ptr + row)
            kept_t = (y_t > thr) | ((y_t == thr) & (target >= tie))
            # a target outside the kept set (or kept with a -inf logit, where the row truncates: tie >= 0):
            # log p = -inf, a constant; only the entropy has a gradient
            g_logp = tl.where(kept_t & ((y_t != float("-inf")) | (tie < 0)), g_logp, 0.0)
            a = -(g_logp + g_entropy * entropy)
        for blk in range(blk_lo, blk_full):
            offs = blk * BLOCK_V + tile
            x = _load_row(row_ptr + offs, cap_k, cap, SOFTCAP)
            grad = _grad_tile(x, m, log2_s, c, a, b, HAS_GRAD_ENTROPY)
            if TRUNCATED:
                grad = tl.where((x > thr) | ((x == thr) & (offs >= tie)), grad, 0.0)
            if SOFTCAP:
                grad = grad * softcap_slope(x, cap_scale, cap)
            tl.store(grad_row_ptr + offs, grad.to(grad_ptr.dtype.element_ty))
        if blk_full < blk_hi:
            offs = blk_full * BLOCK_V + tile
            x = _load_row(row_ptr + offs, cap_k, cap, SOFTCAP, mask=offs < V)
            grad = _grad_tile(x, m, log2_s, c, a, b, HAS_GRAD_ENTROPY)
            if TRUNCATED:
                grad = tl.where((x > thr) | ((x == thr) & (offs >= tie)), grad, 0.0)
            if SOFTCAP:
                grad = grad * softcap_slope(x, cap_scale, cap)
            tl.store(grad_row_ptr + offs, grad.to(grad_ptr.dtype.element_ty), mask=offs < V)
        if in_row & (target >= blk_lo * BLOCK_V) & (target < blk_hi * BLOCK_V):
            # Another thread may have written the target's loop value: order its store first.
            tl.debug_barrier()
            p_t = tl.exp2(q_t)
            # g_l (1 - p_t) / T plus the entropy part p_t (b q_t - g_H H / T), never g_l - g_l p_t
            target_grad = g_logp * one_minus_exp(q_t * _LN2)
            if HAS_GRAD_ENTROPY:
                q_t = tl.maximum(q_t, _LOG2P_FLOOR, propagate_nan=tl.PropagateNan.ALL)  # as in the loop
                target_grad += p_t * (b * q_t - g_entropy * entropy)
            if SOFTCAP:
                target_grad = target_grad * softcap_slope(y_t, cap_scale, cap)
            if TRUNCATED:  # outside the kept set its p is 0: no term at all
                target_grad = tl.where(kept_t, target_grad, 0.0)
            tl.store(grad_row_ptr + target, target_grad.to(grad_ptr.dtype.element_ty))


@triton.jit
def _grad_tile(x, m, log2_s, c, a, b, HAS_GRAD_ENTROPY: tl.constexpr):
    """p (a + b log2 p) for a [BLOCK_V / VEC, VEC] tile of raw fp32 logits; 0 for -inf logits, NaN for NaN."""
    q = (x - m) * c - log2_s  # log2 p: x - m exact near the max, then one FFMA
    if HAS_GRAD_ENTROPY:
        # A clamp, not a select: p = 0 below the floor anyway, and b * q stays finite (no 0 * inf).
        q = tl.maximum(q, _LOG2P_FLOOR, propagate_nan=tl.PropagateNan.ALL)
        return tl.exp2(q) * (a + b * q)
    return tl.exp2(q) * a


# --------------------------------------------------------------------------------------------------
# the sampler's distribution: top-k / top-p inside the row pass (forward_rows_sampled)
# --------------------------------------------------------------------------------------------------
# Keys: each float32 value as an int32 in the same order (NaN above +inf), so that thresholds are
# searched over integers: every bracket halves (or splits in NC + 1) exactly, and ends on a value.
_KEY_LOWEST = tl.constexpr(-2139095041)  # the key of -inf
_KEY_HIGHEST = tl.constexpr(2139095040)  # the key of +inf
# candidate thresholds evaluated by one narrowing pass over the row (the fallback's bracket shrinks
# _NARROW + 1 = 9-fold a pass: 11 passes from any 32-bit bracket to one value, fewer from a certified one)
_NARROW = tl.constexpr(8)
# a certificate of the top-p threshold must clear p S by this share of S (the sums' rounding: ~1e-6 S)
_CERTIFICATE_MARGIN = tl.constexpr(1e-4)


@triton.jit
def _order_key(y):
    """int32 keys in the order of float32 values y (-0.0 as +0.0; NaN above +inf): flip the magnitude
    bits of negatives. The map is its own inverse (:func:`_key_value`)."""
    bits = tl.where(y == 0.0, 0.0, y).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _key_value(key):
    """The float32 value of a key (int32 or an int64 in int32's range)."""
    k = key.to(tl.int32)
    return (k ^ ((k >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _kth_largest_key(keys, valid, k, lo, hi):
    """The largest key t in [lo, hi] (int64) with ``count(valid & keys >= t) >= k``, by bisection over the
    integers (``lo`` must satisfy it): the k-th largest of ``keys`` when lo, hi bracket it."""
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        ok = tl.sum((valid & (keys >= mid)).to(tl.int32), 0) >= k
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def _mass_threshold_key(keys, mass, lo, hi, above, goal):
    """The largest key t in [lo, hi] with ``above + sum(mass[keys >= t]) >= goal`` (``lo`` must satisfy
    it; ``mass`` is 0 where not valid). A float32 tree sum of non-negative terms is monotone in each of
    them, so the predicate is monotone in t as evaluated, and the bisection exact for it."""
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        ok = above + tl.sum(tl.where(keys >= mid, mass, 0.0), 0) >= goal
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def _top_p_certificate(m_slot, s_slot, m, c, per_slot, goal, total):
    """A key t that certainly lies at or below the top-p threshold (the largest with a certified
    ``mass(y >= t) >= goal``; :data:`_KEY_LOWEST` if none), from pass 1's slots alone: a slot holds at
    least ``q(max_r)`` above t when its max is, and at least ``s_r - per_slot q(t)`` (its other
    elements each weigh less than ``q(t)``). Bisection on the key."""
    q_slot = tl.exp2(tl.maximum((m_slot - m) * c, LOWEST))
    s_rel = s_slot * q_slot  # the slot's sum relative to the row's max
    k_slot = _order_key(m_slot).to(tl.int64)
    lo = tl.full((), _KEY_LOWEST, tl.int64)
    hi = _order_key(m).to(tl.int64)
    need = goal + _CERTIFICATE_MARGIN * total
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        q_mid = tl.exp2(tl.maximum((_key_value(mid) - m) * c, LOWEST))
        bound = tl.maximum(tl.where(k_slot >= mid, q_slot, 0.0), s_rel - per_slot * q_mid)
        ok = tl.sum(tl.maximum(bound, 0.0), 0) >= need
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def _compact(row_ptr, V, lo, cap_k, cap, cand_ptr, BLOCK_V: tl.constexpr, VEC: tl.constexpr, CAP: tl.constexpr,
             SOFTCAP: tl.constexpr):
    """Pass 2: write the row's elements with key >= lo to the row's scratch as ``key << 32 | index``
    (int64: one store, and ordered by value then index), in index order, the first CAP of them;
    returns how many there are (more than CAP: they did not fit). Positions come from a scan of the
    block's flags (deterministic); a block without any is skipped."""
    tile = _tile(BLOCK_V, VEC)
    count = tl.zeros((), tl.int32)
    for blk in range(0, tl.cdiv(V, BLOCK_V)):
        offs = blk * BLOCK_V + tile
        inside = offs < V
        y = _load_row(row_ptr + offs, cap_k, cap, SOFTCAP, mask=inside)
        flag = inside & (_order_key(y).to(tl.int64) >= lo)
        flag_i = flag.to(tl.int32)
        per_slot = tl.sum(flag_i, 1)
        found = tl.sum(per_slot, 0)
        if found > 0:
            pos = count + (tl.cumsum(per_slot, 0) - per_slot)[:, None] + (tl.cumsum(flag_i, 1) - flag_i)
            fits = flag & (pos < CAP)
            tl.store(cand_ptr + pos, (_order_key(y).to(tl.int64) << 32) | offs.to(tl.int64), mask=fits)
            count += found
    return count


@triton.jit
def _narrow_pass(row_ptr, V, lo, hi, tie_key, m, c, cap_k, cap, BLOCK_V: tl.constexpr, VEC: tl.constexpr,
                 SOFTCAP: tl.constexpr, MODE: tl.constexpr):
    """One fallback pass: the bracket [lo, hi] (int64) split by _NARROW thresholds ``t_j``; returns
    (t_j [_NARROW] int64, f(t_j) [_NARROW], valid_j): MODE 0 the count of keys >= t_j, 1 their mass
    ``sum 2^((y - m) c)``, 2 the count of the elements whose key is ``tie_key`` at an index >= t_j."""
    R: tl.constexpr = BLOCK_V // VEC
    tile = _tile(BLOCK_V, VEC)
    j = tl.arange(0, _NARROW)
    step = tl.maximum((hi - lo + 1) // (_NARROW + 1), 1)
    ts = lo + (j + 1).to(tl.int64) * step
    valid_t = ts <= hi
    acc_n = tl.zeros((R, _NARROW), tl.int32)
    acc_m = tl.zeros((R, _NARROW), tl.float32)
    for blk in range(0, tl.cdiv(V, BLOCK_V)):
        offs = blk * BLOCK_V + tile
        inside = offs < V
        y = _load_row(row_ptr + offs, cap_k, cap, SOFTCAP, mask=inside)
        key = _order_key(y).to(tl.int64)
        if MODE == 2:
            value = tl.where(inside & (key == tie_key), offs.to(tl.int64), -1)
        else:
            value = tl.where(inside, key, _KEY_LOWEST - 1)
        if MODE == 1:
            e = tl.exp2(tl.maximum((y - m) * c, LOWEST))
        for i in tl.static_range(_NARROW):  # one threshold at a time: no [R, VEC, _NARROW] temporary
            ge = value >= lo + (i + 1) * step
            if MODE == 1:
                acc_m += tl.where(j == i, tl.sum(tl.where(ge, e, 0.0), 1)[:, None], 0.0)
            else:
                acc_n += tl.where(j == i, tl.sum(ge.to(tl.int32), 1)[:, None], 0)
    return ts, tl.sum(acc_n, 0), tl.sum(acc_m, 0), valid_t


@triton.jit
def _narrow(row_ptr, V, lo, hi, target, tie_key, m, c, cap_k, cap, BLOCK_V: tl.constexpr, VEC: tl.constexpr,
            SOFTCAP: tl.constexpr, MODE: tl.constexpr):
    """The fallback search: the largest t in [lo, hi] with f(t) >= target (f as in :func:`_narrow_pass`;
    ``lo`` must satisfy it), by passes over the row that each split the bracket in _NARROW + 1."""
    while lo < hi:
        ts, n, mass, valid_t = _narrow_pass(row_ptr, V, lo, hi, tie_key, m, c, cap_k, cap, BLOCK_V, VEC, SOFTCAP, MODE)
        if MODE == 1:
            ok = mass >= target
        else:
            ok = n >= target
        ok = ok & valid_t
        lo = tl.maximum(lo, tl.max(tl.where(ok, ts, lo), 0))
        hi = tl.minimum(hi, tl.min(tl.where(valid_t & ~ok, ts - 1, hi), 0))
    return lo


@triton.jit
def _above_pass(row_ptr, V, v_key, m, c, cap_k, cap, BLOCK_V: tl.constexpr, VEC: tl.constexpr, SOFTCAP: tl.constexpr):
    """The fallback's last pass: (s, u, w) of the elements with key > v_key, and the count at v_key."""
    R: tl.constexpr = BLOCK_V // VEC
    tile = _tile(BLOCK_V, VEC)
    s = tl.zeros((R,), tl.float32)
    u = tl.zeros((R,), tl.float32)
    w = tl.zeros((R,), tl.float32)
    n = tl.zeros((R,), tl.int32)
    for blk in range(0, tl.cdiv(V, BLOCK_V)):
        offs = blk * BLOCK_V + tile
        inside = offs < V
        y = _load_row(row_ptr + offs, cap_k, cap, SOFTCAP, mask=inside)
        key = _order_key(y).to(tl.int64)
        shift = tl.maximum((y - m) * c, LOWEST)
        e = tl.where(inside & (key > v_key), tl.exp2(shift), 0.0)
        s += tl.sum(e, 1)
        u += tl.sum(e * shift, 1)
        w += tl.sum(e * e, 1)
        n += tl.sum((inside & (key == v_key)).to(tl.int32), 1)
    return tl.sum(s, 0), tl.sum(u, 0), tl.sum(w, 0), tl.sum(n, 0)


@triton.jit
def _finish_sampled(row, y_t, target, kept_t, m, s, u, w, c_ln, nan_guard, logp_ptr, entropy_ptr, max_ptr,
                    log_sum_ptr, sum_sq_ptr, WITH_ENTROPY: tl.constexpr, WITH_SQ: tl.constexpr):
    """Write a row's outputs from the kept set's (s, u, w) relative to the row max m (as :func:`_finish_row`)."""
    log2_s = tl.log2(s)
    logp = (y_t - m) * c_ln - log2_s * _LN2
    logp = tl.maximum(logp, LOWEST, propagate_nan=tl.PropagateNan.ALL)
    logp = tl.where(kept_t, logp, float("-inf")) + nan_guard  # outside the kept set: -inf, as vLLM's
    tl.store(logp_ptr + row, logp)
    tl.store(max_ptr + row, m)
    tl.store(log_sum_ptr + row, log2_s)
    if WITH_ENTROPY:
        tl.store(entropy_ptr + row, (log2_s - u / s) * _LN2 + nan_guard)
    if WITH_SQ:
        tl.store(sum_sq_ptr + row, w / (s * s) + nan_guard)


@triton.jit
def _tie_count(need_mass, q, n_tie):
    """How many of the ``n_tie`` tokens tied at the top-p threshold vLLM keeps: ``c = ceil((p S - M) / q)``
    (``need_mass = p S - M``, M the mass above them, q each one's), at least 1 and at most ``n_tie``: in
    ascending order a tied token with r tied ones after it stays iff ``M + r q < p S``."""
    need = tl.minimum(tl.maximum(need_mass / q, 0.0), n_tie.to(tl.float32))
    return tl.maximum(tl.minimum(tl.ceil(need).to(tl.int32), n_tie), 1)


@triton.jit
def _sampled_row(row, row_ptr, target, y_t, m_slot, s_slot, m, s, nan_guard, V, c, c_ln, cap_k, cap, top_k, top_p,
                 k_on, p_on, logp_ptr, entropy_ptr, max_ptr, log_sum_ptr, sum_sq_ptr, thr_ptr, tie_ptr, overflow_ptr,
                 cand_ptr, BLOCK_V: tl.constexpr, VEC: tl.constexpr, CAP: tl.constexpr, WITH_ENTROPY: tl.constexpr,
                 WITH_SQ: tl.constexpr, SOFTCAP: tl.constexpr, HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr,
                 PER_ROW: tl.constexpr):
    """Steps 2 to 4 of :func:`sampled_logprobs_fwd_kernel` for a row that truncates, from pass 1's slots
    ``(m_slot, s_slot)`` and the row's ``(m, s)``. ``PER_ROW``: ``top_k`` / ``top_p`` are the row's own and
    ``k_on`` / ``p_on`` (runtime) say which of them is on (the other keeps everything); otherwise every
    row's are on."""
    R: tl.constexpr = BLOCK_V // VEC
    key_max = _order_key(m).to(tl.int64)
    # 2. the certified bound (an empty slot's max is -FLT_MAX: a bound there certifies nothing)
    key_floor = _order_key(tl.full((), LOWEST, tl.float32)).to(tl.int64)
    per_slot = (tl.cdiv(V, BLOCK_V) * VEC).to(tl.float32)
    if HAS_TOP_K:
        k_slot = _order_key(m_slot).to(tl.int64)
        lo = _kth_largest_key(k_slot, m_slot == m_slot, top_k, tl.min(k_slot, 0), key_max)
        lo = tl.where((top_k <= R) & (lo > key_floor), lo, _KEY_LOWEST)
        if PER_ROW:  # a row whose top-k is off: top-p's certificate, or no bound
            if HAS_TOP_P:
                lo = tl.where(k_on, lo, _top_p_certificate(m_slot, s_slot, m, c, per_slot, top_p * s, s))
            else:
                lo = tl.where(k_on, lo, _KEY_LOWEST)
    else:
        lo = _top_p_certificate(m_slot, s_slot, m, c, per_slot, top_p * s, s)
    # 3. the candidates
    base = row * CAP
    n_cand = _compact(row_ptr, V, lo, cap_k, cap, cand_ptr + base, BLOCK_V, VEC, CAP, SOFTCAP)
    tl.debug_barrier()  # the scratch this program wrote, visible to all its threads
    j = tl.arange(0, CAP)
    cv = j < n_cand
    packed = tl.load(cand_ptr + base + j, mask=cv, other=0)
    ck = tl.where(cv, (packed >> 32).to(tl.int32), _KEY_LOWEST)  # (past n_cand: -inf, below every bound)
    ci = (packed & 0xFFFFFFFF).to(tl.int32)
    cy = _key_value(ck)
    ce = tl.where(cv, tl.exp2(tl.maximum((cy - m) * c, LOWEST)), 0.0)
    fits = n_cand <= CAP
    v_key = lo
    if HAS_TOP_K:
        v_key = _kth_largest_key(ck, cv, top_k, lo, key_max)
        if PER_ROW:
            v_key = tl.where(k_on, v_key, lo)
    tie = tl.zeros((), tl.int32)
    if HAS_TOP_P:
        if p_on:
            if HAS_TOP_K:
                total = tl.sum(tl.where(ck >= v_key, ce, 0.0), 0)  # S, what top-k keeps
                if PER_ROW:
                    total = tl.where(k_on, total, s)
                goal = top_p * total  # p S
            else:
                goal = top_p * s
            # the bound must hold on what the search sees (else the certificate was rounded away)
            fits = fits & (tl.sum(tl.where(ck >= v_key, ce, 0.0), 0) >= goal)
            v_key = _mass_threshold_key(ck, ce, v_key, key_max, 0.0, goal)
            n_tie = tl.sum((ck == v_key).to(tl.int32), 0)
            q = tl.exp2(tl.maximum((_key_value(v_key) - m) * c, LOWEST))
            keep_ties = _tie_count(goal - tl.sum(tl.where(ck > v_key, ce, 0.0), 0), q, n_tie)
            if keep_ties < n_tie:  # the keep_ties highest-indexed of them
                tie = _kth_largest_key(ci.to(tl.int64), cv & (ck == v_key), keep_ties, tl.full((), 0, tl.int64),
                                       tl.full((), V - 1, tl.int64)).to(tl.int32)
    if fits:
        kept_c = cv & ((ck > v_key) | ((ck == v_key) & (ci >= tie)))
        s = tl.sum(tl.where(kept_c, ce, 0.0), 0)
        u = tl.sum(tl.where(kept_c, ce * tl.maximum((cy - m) * c, LOWEST), 0.0), 0)
        w = tl.sum(tl.where(kept_c, ce * ce, 0.0), 0)
        key_t = _order_key(y_t).to(tl.int64)
        # a kept target whose own logit is -inf: -inf too, as vLLM's log_softmax gives it
        kept_t = ((key_t > v_key) | ((key_t == v_key) & (target >= tie))) & (y_t != float("-inf"))
        _finish_sampled(row, y_t, target, kept_t, m, s, u, w, c_ln, nan_guard, logp_ptr, entropy_ptr, max_ptr,
                        log_sum_ptr, sum_sq_ptr, WITH_ENTROPY, WITH_SQ)
        tl.store(thr_ptr + row, _key_value(v_key))
        tl.store(tie_ptr + row, tie)
        tl.store(overflow_ptr + row, tl.zeros((), tl.int8))
    else:  # 4. for the fallback kernel: the row's max, sum and bound
        tl.store(max_ptr + row, m)
        tl.store(thr_ptr + row, s)
        tl.store(tie_ptr + row, lo.to(tl.int32))
        tl.store(overflow_ptr + row, tl.full((), 1, tl.int8))


@triton.jit
def sampled_logprobs_fwd_kernel(
    logits_ptr, stride_b, stride_t, T,
    targets_ptr, logp_ptr, entropy_ptr, max_ptr, log_sum_ptr, sum_sq_ptr, thr_ptr, tie_ptr, overflow_ptr,
    cand_ptr, t_rows_ptr, k_rows_ptr, p_rows_ptr,
    V, c, c_ln, cap_k, cap, ignore_index, top_k, top_p,
    BLOCK_V: tl.constexpr, VEC: tl.constexpr, CAP: tl.constexpr, WITH_ENTROPY: tl.constexpr,
    WITH_SQ: tl.constexpr, SOFTCAP: tl.constexpr, PER_ROW_T: tl.constexpr, HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr, PER_ROW_KP: tl.constexpr,
):
    """Log-prob, entropy and sum of squared probabilities of the distribution a vLLM sampler draws from:
    ``softmax(z)`` over the kept set of top-k then top-p, renormalised (``kernels.torch_rows.truncation``
    states the rule; vLLM 0.32's ``apply_top_k_top_p_pytorch``). One program per row, with ``CAP``
    candidates of int64 scratch (``cand_ptr``). With ``k(y)`` the order-preserving int key of a value
    (:func:`_order_key`):

    1. Pass 1 (the row read): each slot's max and ``s = sum 2^((y - m) c)`` (and u, w untruncated).
    2. A certified lower bound ``lo`` of the threshold from the slots alone: top-k, the k-th largest
       slot max (k slots hold an element at least that large; k <= slots); top-p alone, the largest key
       whose certified mass at and above reaches ``p s`` (:func:`_top_p_certificate`).
    3. Pass 2 (the row read again): the elements with key >= lo written to scratch (:func:`_compact`).
       If at most CAP, every threshold is found on them by bisection over the keys (registers, no
       more reads): top-k's k-th largest value ``tau``; then top-p's ``v*``, the largest value whose
       mass at and above reaches ``p S`` (S: the mass top-k keeps), and of the tokens tied at ``v*`` the
       ``c`` highest-indexed (:func:`_tie_count`): the tie index. The kept set's ``(s, u, w)`` and the
       target's membership follow from the candidates: two reads of the row in all.
    4. Otherwise (a bound too loose: top_k above the slots, a nucleus of more than CAP tokens) the row
       is flagged in ``overflow_ptr`` with its max, ``s`` and ``lo`` (in ``max``, ``thr``, ``tie``), for
       ``sampled_logprobs_fallback_kernel``.
    Writes ``logp`` (-inf for a target outside the kept set, and for a kept target whose own logit is
    -inf, as vLLM's), entropy, ``row_max``, ``log_sum`` (log2 of the kept sum), ``sum_sq``, and the kept
    set as ``(thr, tie)``: ``y > thr``, or ``y == thr`` at an index ``>= tie``, for the backward. A NaN
    in the row makes its outputs NaN.

    ``PER_ROW_KP``: each row loads its own ``top_k`` (int32, ``V`` where its top-k is off) and ``top_p``
    (float32, 1 where off) from ``k_rows_ptr`` / ``p_rows_ptr`` (runtime values: no recompilation per
    value). A row whose both are off is the untruncated softmax (pass 1's statistics, its target's
    floor as without a truncation), with the kept set ``(-inf, -1)``: everything (a tie of -1 marks a
    row that does not truncate, which the backward then treats as such).
    """
    row = tl.program_id(0).to(tl.int64)
    TRUNC: tl.constexpr = HAS_TOP_K or HAS_TOP_P
    # truncated: the kept set's sums come later (a row of PER_ROW_KP may keep everything: pass 1's then)
    STATS_ENTROPY: tl.constexpr = WITH_ENTROPY and (not TRUNC or PER_ROW_KP)
    STATS_SQ: tl.constexpr = WITH_SQ and (not TRUNC or PER_ROW_KP)
    target = tl.load(targets_ptr + row).to(tl.int64)
    if target == ignore_index:
        tl.store(logp_ptr + row, 0.0)
        tl.store(max_ptr + row, 0.0)
        tl.store(log_sum_ptr + row, 0.0)
        if WITH_ENTROPY:
            tl.store(entropy_ptr + row, 0.0)
        if WITH_SQ:
            tl.store(sum_sq_ptr + row, 0.0)
        if TRUNC:
            tl.store(thr_ptr + row, 0.0)
            tl.store(tie_ptr + row, 0)
            tl.store(overflow_ptr + row, tl.zeros((), tl.int8))
    else:
        c = row_factor(c, t_rows_ptr, row, 0, PER_ROW_T)
        c_ln = row_factor(c_ln, t_rows_ptr, row, 1, PER_ROW_T)
        row_ptr = _row_pointer(logits_ptr, row, T, stride_b, stride_t)
        # pass 1 over the row: each slot's statistics (the slot maxima bound the thresholds:
        # _kth_largest_key, _top_p_certificate), then the row's
        m_slot, s_slot, u_slot, w_slot = _slot_stats(row_ptr, 0, tl.cdiv(V, BLOCK_V), V, c, cap_k, cap, BLOCK_V, VEC,
                                                     STATS_ENTROPY, STATS_SQ, SOFTCAP)
        m, s, u, w = _merge(m_slot, s_slot, u_slot, w_slot, c, STATS_ENTROPY, STATS_SQ)
        nan_guard = s * 0.0  # NaN when the row holds a NaN (the kept set would drop it)
        y_t = _load_row(row_ptr + target, cap_k, cap, SOFTCAP)
        if not TRUNC:
            _finish_sampled(row, y_t, target, target == target, m, s, u, w, c_ln, nan_guard, logp_ptr, entropy_ptr,
                            max_ptr, log_sum_ptr, sum_sq_ptr, WITH_ENTROPY, WITH_SQ)
        elif PER_ROW_KP:
            row_k = tl.load(k_rows_ptr + row)
            row_p = tl.load(p_rows_ptr + row)
            k_on = row_k < V
            p_on = row_p < 1.0
            if k_on | p_on:
                _sampled_row(row, row_ptr, target, y_t, m_slot, s_slot, m, s, nan_guard, V, c, c_ln, cap_k, cap,
                             row_k, row_p, k_on, p_on, logp_ptr, entropy_ptr, max_ptr, log_sum_ptr, sum_sq_ptr,
                             thr_ptr, tie_ptr, overflow_ptr, cand_ptr, BLOCK_V, VEC, CAP, WITH_ENTROPY, WITH_SQ,
                             SOFTCAP, HAS_TOP_K, HAS_TOP_P, True)
            else:  # neither truncates this row: the whole softmax
                _finish_sampled(row, y_t, target, target == target, m, s, u, w, c_ln, nan_guard, logp_ptr,
                                entropy_ptr, max_ptr, log_sum_ptr, sum_sq_ptr, WITH_ENTROPY, WITH_SQ)
                tl.store(thr_ptr + row, float("-inf"))
                tl.store(tie_ptr + row, tl.full((), -1, tl.int32))
                tl.store(overflow_ptr + row, tl.zeros((), tl.int8))
        else:
            _sampled_row(row, row_ptr, target, y_t, m_slot, s_slot, m, s, nan_guard, V, c, c_ln, cap_k, cap, top_k,
                         top_p, True, True, logp_ptr, entropy_ptr, max_ptr, log_sum_ptr, sum_sq_ptr, thr_ptr, tie_ptr,
                         overflow_ptr, cand_ptr, BLOCK_V, VEC, CAP, WITH_ENTROPY, WITH_SQ, SOFTCAP, HAS_TOP_K,
                         HAS_TOP_P, False)


@triton.jit
def sampled_logprobs_fallback_kernel(
    logits_ptr, stride_b, stride_t, T,
    targets_ptr, logp_ptr, entropy_ptr, max_ptr, log_sum_ptr, sum_sq_ptr, thr_ptr, tie_ptr, overflow_ptr,
    t_rows_ptr, k_rows_ptr, p_rows_ptr, V, c, c_ln, cap_k, cap, top_k, top_p,
    BLOCK_V: tl.constexpr, VEC: tl.constexpr, WITH_ENTROPY: tl.constexpr, WITH_SQ: tl.constexpr,
    SOFTCAP: tl.constexpr, PER_ROW_T: tl.constexpr, HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr,
    PER_ROW_KP: tl.constexpr,
):
    """The rows ``sampled_logprobs_fwd_kernel`` flagged (every other program returns at once): the same
    thresholds found exactly by passes over the row that split the bracket at :data:`_NARROW`
    thresholds each, counting (top-k) or summing the mass (top-p) above them (:func:`_narrow`, 9-fold
    a pass), then one pass for the kept set's sums above the threshold and the count at it
    (:func:`_above_pass`); the tie index, if top-p splits a tie, by the same passes over the indices.
    Up to 11 passes a threshold over a 32-bit bracket (fewer from a certified one), plus one.
    ``PER_ROW_KP``: the row's own top_k / top_p, as in the forward kernel (a flagged row truncates; of
    its two, one may be off: a top-k off starts top-p from the whole row)."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(overflow_ptr + row) != 0:
        c = row_factor(c, t_rows_ptr, row, 0, PER_ROW_T)
        c_ln = row_factor(c_ln, t_rows_ptr, row, 1, PER_ROW_T)
        target = tl.load(targets_ptr + row).to(tl.int64)
        row_ptr = _row_pointer(logits_ptr, row, T, stride_b, stride_t)
        m = tl.load(max_ptr + row)
        s = tl.load(thr_ptr + row)
        lo = tl.load(tie_ptr + row).to(tl.int64)
        nan_guard = s * 0.0
        key_max = _order_key(m).to(tl.int64)
        zero = tl.zeros((), tl.int64)
        p_on = True
        if PER_ROW_KP:
            top_k = tl.load(k_rows_ptr + row)
            top_p = tl.load(p_rows_ptr + row)
            p_on = top_p < 1.0
        v_key = lo
        if HAS_TOP_K:
            if PER_ROW_KP:
                v_key = tl.full((), _KEY_LOWEST, tl.int64)  # (top-k off: everything, and top-p over the row)
                if top_k < V:
                    v_key = _narrow(row_ptr, V, lo, key_max, top_k, zero, m, c, cap_k, cap, BLOCK_V, VEC, SOFTCAP, 0)
            else:
                v_key = _narrow(row_ptr, V, lo, key_max, top_k, zero, m, c, cap_k, cap, BLOCK_V, VEC, SOFTCAP, 0)
        above_s, above_u, above_w, n_tie = _above_pass(row_ptr, V, v_key, m, c, cap_k, cap, BLOCK_V, VEC, SOFTCAP)
        keep_ties = n_tie
        tie = tl.zeros((), tl.int32)
        if HAS_TOP_P:
            if p_on:
                if HAS_TOP_K:
                    total = above_s + n_tie.to(tl.float32) * tl.exp2(tl.maximum((_key_value(v_key) - m) * c, LOWEST))
                    start = v_key
                else:
                    total = s
                    start = tl.full((), _KEY_LOWEST, tl.int64)
                goal = top_p * total
                v_key = _narrow(row_ptr, V, start, key_max, goal, zero, m, c, cap_k, cap, BLOCK_V, VEC, SOFTCAP, 1)
                above_s, above_u, above_w, n_tie = _above_pass(row_ptr, V, v_key, m, c, cap_k, cap, BLOCK_V, VEC,
                                                               SOFTCAP)
                q = tl.exp2(tl.maximum((_key_value(v_key) - m) * c, LOWEST))
                keep_ties = _tie_count(goal - above_s, q, n_tie)
                if keep_ties < n_tie:
                    tie = _narrow(row_ptr, V, zero, tl.full((), V - 1, tl.int64), keep_ties, v_key, m, c, cap_k, cap,
                                  BLOCK_V, VEC, SOFTCAP, 2).to(tl.int32)
        shift_v = tl.maximum((_key_value(v_key) - m) * c, LOWEST)
        q_v = tl.exp2(shift_v)
        ties = keep_ties.to(tl.float32)
        s = above_s + ties * q_v
        u = above_u + ties * q_v * shift_v
        w = above_w + ties * q_v * q_v
        y_t = _load_row(row_ptr + target, cap_k, cap, SOFTCAP)
        key_t = _order_key(y_t).to(tl.int64)
        # a kept target whose own logit is -inf: -inf too, as vLLM's log_softmax gives it
        kept_t = ((key_t > v_key) | ((key_t == v_key) & (target >= tie))) & (y_t != float("-inf"))
        _finish_sampled(row, y_t, target, kept_t, m, s, u, w, c_ln, nan_guard, logp_ptr, entropy_ptr, max_ptr,
                        log_sum_ptr, sum_sq_ptr, WITH_ENTROPY, WITH_SQ)
        tl.store(thr_ptr + row, _key_value(v_key))
        tl.store(tie_ptr + row, tie)


# --------------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------------
def launch_config(vocab_size: int, dtype: torch.dtype, rows: int, sms: int = _DEFAULT_SMS) -> Tuple[int, int, int]:
    """(BLOCK_V, VEC, num_warps) for a row length, logits dtype and number of rows.

    VEC elements make one 16-byte vector; each thread holds two vectors per block (two 16-byte loads
    in flight, ~32 registers with the statistics), so 4-warp CTAs fit 16 per SM and keep ~64 KB per
    SM in flight, above HBM's latency-bandwidth product (~21-28 KB per SM on an H200). With fewer rows
    than 16 CTAs per SM (then each row is also split), a CTA of 16 warps puts the same bytes in
    flight per SM from a quarter of the CTAs. Small rows get a smaller block.
    """
    vec = 16 // torch.empty((), dtype=dtype).element_size()
    num_warps = 4 if rows >= 16 * sms else 16
    vectors = triton.next_power_of_2(triton.cdiv(vocab_size, vec))
    num_warps = max(1, min(num_warps, vectors // 64))
    return min(2 * 32 * num_warps, vectors) * vec, vec, num_warps


def _sm_count(device: torch.device) -> int:
    """SMs of a CUDA device; meta and CPU tensors (AOT, the model, the interpreter) assume an H200."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _DEFAULT_SMS



def choose_splits(rows: int, n_blocks: int, num_warps: int, device: torch.device) -> Tuple[int, int]:
    """(splits, blocks_per_split) for each row's vocabulary: 1 when the rows alone fill the GPU.

    Aim for about as many CTAs as fit on the GPU at once (64 warps per SM), never a chunk of less
    than two blocks (the combine step must stay small next to the reads).
    """
    if SPLITS_OVERRIDE is not None:
        splits = max(1, min(int(SPLITS_OVERRIDE), n_blocks))
    else:
        resident = _sm_count(device) * max(1, 64 // num_warps)
        splits = 1 if rows >= resident else min(_MAX_SPLITS, max(1, n_blocks // 2), math.ceil(resident / rows))
    per_split = math.ceil(n_blocks / splits)
    return math.ceil(n_blocks / per_split), per_split


def transform_args(temperature: float, softcap: Optional[float], logit_scale: float,
                    temperature_rows: Optional[torch.Tensor] = None) -> dict:
    """Kernel arguments of the logit transform ``softcap * tanh(logit_scale * x / softcap) / T``.

    Without a cap the logit scale folds into the temperature (``c = log2(e) * scale / T``) and the
    kernels compile exactly as without it; with one, ``cap_k = scale / softcap`` and ``cap``.
    ``c_ln = c ln 2`` (the slope in nats) is formed here in float64, once. ``temperature_rows`` (one
    temperature per row, any float dtype): the factors ``(c, c ln 2, 1 / T)`` per row, a float32 [rows, 3]
    tensor (``t_rows``) formed in float64 by the very expressions of the float case, so a row's factors
    equal the float's bitwise (a float argument reaches a kernel as float32); ``PER_ROW_T`` tells the
    kernels to load them.
    """
    scale = logit_scale if softcap is None else 1.0
    if temperature_rows is None:
        c = _LOG2E.value * scale / temperature
        args = dict(c=c, c_ln=c * _LN2.value, inv_temperature=scale / temperature, PER_ROW_T=False, t_rows=None)
    else:
        t = temperature_rows.detach().double().reshape(-1)
        c = (_LOG2E.value * scale) / t
        args = dict(c=1.0, c_ln=1.0, inv_temperature=1.0, PER_ROW_T=True,
                    t_rows=torch.stack((c, c * _LN2.value, scale / t), -1).float().contiguous())
    if softcap is None:
        return dict(args, cap_k=0.0, cap=1.0, SOFTCAP=False)
    return dict(args, cap_k=logit_scale / softcap, cap=float(softcap), SOFTCAP=True)


def _per_row_pointer(tf: dict, stand_in: torch.Tensor) -> torch.Tensor:
    """The per-row factors of a launch (``t_rows``), or a never-read stand-in."""
    return stand_in if tf["t_rows"] is None else tf["t_rows"]


def log_normalizer(row_max: torch.Tensor, log_sum: torch.Tensor, temperature: float, softcap: Optional[float],
                   logit_scale: float, temperature_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``log sum_j exp(z_j)`` in nats from this module's ``row_max`` (raw or capped logits) and
    ``log_sum`` (bits): ``ln 2 * (row_max * c + log2 s)``."""
    tf = transform_args(temperature, softcap, logit_scale, temperature_rows)
    c = tf["c"] if tf["t_rows"] is None else tf["t_rows"][:, 0].view(row_max.shape)
    return (row_max * c + log_sum) * _LN2.value


def shift_log_sum(log_sum: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``log_sum`` (bits) of a normaliser ``exp(shift)`` times larger (``shift`` in nats)."""
    return log_sum + shift * _LOG2E.value


# grpo_forward_rows' outputs: weighted_loss, logp, entropy, row_max, log_sum, coef_logp, coef_entropy, kl, clip
GRPORows = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                 torch.Tensor, torch.Tensor]
GRPO_ROWS_FLOAT_OUTPUTS = 8  # the first 8 are fp32 [B, T]; clip is int8 [B, T]

# The fused GRPO forward's policy terms (OBJECTIVE constexpr): TRL's loss types, and verl's token-local
# loss modes (vespo's weight, gspo's ratio, clip_cov's / kl_cov's selections and geo_mean are not).
_OBJECTIVES = {"grpo": 0, "bnpo": 0, "dr_grpo": 0, "dapo": 0, "luspo": 0, "cispo": 1, "sapo": 2}
_VERL_OBJECTIVES = {"sapo": 2, "vanilla": 3, "gpg": 4, "cispo": 5, "dppo_tv": 6, "dppo_kl": 7, "dro": 8}
# verl's modes whose log-ratio is clamped to [-20, 20] before the exp (CLAMP_LOG_RATIO)
_CLAMPED_LOG_RATIO = ("sapo", "vanilla", "cispo", "dppo_tv", "dppo_kl")
# verl's KL estimators (KL_ESTIMATOR; 0 is TRL's k3); a trailing "+" is KL_STRAIGHT_THROUGH
_VERL_KL_ESTIMATORS = {"kl": 1, "k1": 1, "abs": 2, "mse": 3, "k2": 3, "low_var_kl": 4, "k3": 4}


def fuses_objective(loss_type: Optional[str], loss_mode: Optional[str]) -> bool:
    """Whether ``grpo_forward_rows`` has this objective's term (verl's ``loss_mode`` when given)."""
    return loss_mode in _VERL_OBJECTIVES if loss_mode is not None else loss_type in _OBJECTIVES


def _partials(logits, targets, c, cap_k, cap, SOFTCAP, ignore_index, with_entropy, block, vec, num_warps, t_rows=None):
    """Launch the split-vocabulary partial kernel when rows are few; returns the merge arguments."""
    b, t, v = logits.shape
    rows = b * t
    splits, per_split = choose_splits(rows, triton.cdiv(v, block), num_warps, logits.device)
    if splits == 1:
        dummy = torch.empty(1, dtype=torch.float32, device=logits.device)
        return dict(part_m_ptr=dummy, part_s_ptr=dummy, part_u_ptr=dummy, num_splits=1, SPLIT=False, SPLITS_PAD=1)
    part = torch.empty(3, rows, splits, dtype=torch.float32, device=logits.device)
    row_stats_partial_kernel[(rows, splits)](
        logits, logits.stride(0), logits.stride(1), t,
        targets, part[0], part[1], part[2],
        v, c, cap_k, cap, ignore_index, splits, per_split, part if t_rows is None else t_rows,
        BLOCK_V=block, VEC=vec, WITH_ENTROPY=with_entropy, SOFTCAP=SOFTCAP, PER_ROW_T=t_rows is not None,
        num_warps=num_warps,
    )
    return dict(part_m_ptr=part[0], part_s_ptr=part[1], part_u_ptr=part[2], num_splits=splits, SPLIT=True,
                SPLITS_PAD=triton.next_power_of_2(splits))


def forward_rows(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    ignore_index: int,
    with_entropy: bool = True,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    temperature_rows: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, T, V] (last dim contiguous), targets [B, T] -> (logp, entropy, row_max, log_sum).

    All fp32 [B, T], of ``softmax(softcap * tanh(logit_scale * logits / softcap) / temperature)``
    (no tanh without ``softcap``); ``temperature_rows`` [B, T] (or None): a temperature per row instead
    of ``temperature``. ``row_max`` (the largest, soft-capped, logit of the row) and
    ``log_sum`` (``log2 sum 2^((x - row_max) c)``) are what ``backward_rows`` needs to recompute the
    softmax; they are private to this module (``torch_rows`` keeps its own).
    """
    b, t, v = logits.shape
    targets = targets.contiguous()
    logp = torch.empty(b, t, dtype=torch.float32, device=logits.device)
    entropy = torch.empty_like(logp)
    row_max = torch.empty_like(logp)
    log_sum = torch.empty_like(logp)
    if b * t == 0:
        return logp, entropy, row_max, log_sum
    block, vec, num_warps = launch_config(v, logits.dtype, b * t, _sm_count(logits.device))
    tf = transform_args(temperature, softcap, logit_scale, temperature_rows)
    t_rows = _per_row_pointer(tf, logp)
    split = _partials(logits, targets, tf["c"], tf["cap_k"], tf["cap"], tf["SOFTCAP"], ignore_index, with_entropy,
                      block, vec, num_warps, tf["t_rows"])
    token_logprobs_fwd_kernel[(b * t,)](
        logits, logits.stride(0), logits.stride(1), t,
        targets, logp, entropy, row_max, log_sum,
        split.pop("part_m_ptr"), split.pop("part_s_ptr"), split.pop("part_u_ptr"), split.pop("num_splits"),
        v, tf["c"], tf["c_ln"], tf["cap_k"], tf["cap"], ignore_index, t_rows,
        BLOCK_V=block, VEC=vec, WITH_ENTROPY=with_entropy, SOFTCAP=tf["SOFTCAP"], PER_ROW_T=tf["PER_ROW_T"],
        num_warps=1 if split["SPLIT"] else num_warps, **split,
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
    loss_type: Optional[str] = "dapo",
    use_bias_correction_kl: bool = False,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    loss_mode: Optional[str] = None,
    kl_loss_type: Optional[str] = None,
    dro_beta: float = 0.0,
    kl_weights: Optional[torch.Tensor] = None,
    temperature_rows: Optional[torch.Tensor] = None,
) -> GRPORows:
    """One pass of the token-level GRPO loss; per-token inputs are [B], [B, 1] or [B, T].

    ``loss_type`` picks TRL's policy term (the clipped surrogate, cispo or sapo; the reduction is in
    ``weights``) and the KL is TRL's k3; vespo, whose weight is sequence-level, is not fused. With
    ``loss_mode`` (verl's; ``loss_type`` is then not read) the policy term is verl's (sapo, vanilla,
    gpg, cispo, dppo_tv, dppo_kl, dro; ``delta`` is clip_ratio_c, ``dro_beta`` dro's coefficient) and
    the KL is ``kl_loss_type`` (default low_var_kl), weighted by ``kl_weights`` [B, T] where given
    (the KL's reduction differs from the policy term's: verl's sapo), else by ``weights``.
    Every argument is a tensor, a str, a float or a bool (torch.library custom-op schemas take them).

    Returns ``(weighted_loss, logp, entropy, row_max, log_sum, coef_logp, coef_entropy, kl, clip)``,
    [B, T]: fp32 except ``clip`` (int8: -1 low-clipped, +1 high-clipped, 0 neither). The reduced loss
    is ``weighted_loss.sum()`` and its gradient w.r.t. the logits is the row backward with
    ``grad_logp = coef_logp * g`` and ``grad_entropy = coef_entropy * g``; ``kl`` (the estimate, 0
    without ``ref_logps``) and ``clip`` make the metrics masked means. Masked rows give zeros.
    """
    b, t, v = logits.shape
    outputs = [torch.empty(b, t, dtype=torch.float32, device=logits.device) for _ in range(GRPO_ROWS_FLOAT_OUTPUTS)]
    outputs.append(torch.empty(b, t, dtype=torch.int8, device=logits.device))
    if b * t == 0:
        return tuple(outputs)
    loss, logp, entropy, row_max, log_sum, coef_logp, coef_entropy, kl, clip = outputs
    weights = weights.float().contiguous()
    targets = targets.contiguous()

    def per_token(x: Optional[torch.Tensor]) -> torch.Tensor:
        """[B], [B, 1] or [B, T] -> contiguous fp32 [B, T]; an absent input passes a never-read stand-in."""
        if x is None:
            return weights
        return (x.unsqueeze(-1) if x.dim() == 1 else x).float().expand(b, t).contiguous()

    if loss_mode is not None:
        if loss_mode not in _VERL_OBJECTIVES:
            raise ValueError(f"loss_mode {loss_mode!r} has no fused Triton forward (one of {tuple(_VERL_OBJECTIVES)})")
        kl_name = "low_var_kl" if kl_loss_type is None else kl_loss_type
        kl_base = kl_name[:-1] if kl_name.endswith("+") else kl_name
        if kl_base not in _VERL_KL_ESTIMATORS:
            raise ValueError(f"kl_loss_type {kl_name!r} has no fused Triton forward "
                             f"(one of {tuple(_VERL_KL_ESTIMATORS)}, each also with '+')")
        objective_code, kl_code = _VERL_OBJECTIVES[loss_mode], _VERL_KL_ESTIMATORS[kl_base]
        straight_through, clamp_log_ratio = kl_name.endswith("+"), loss_mode in _CLAMPED_LOG_RATIO
    else:
        if loss_type not in _OBJECTIVES:
            raise ValueError(f"loss_type {loss_type!r} has no fused Triton forward (one of {tuple(_OBJECTIVES)})")
        if kl_weights is not None or kl_loss_type is not None:
            raise ValueError("kl_weights and kl_loss_type are verl's (loss_mode); TRL's k3 is weighted like the policy term")
        objective_code, kl_code, straight_through, clamp_log_ratio = _OBJECTIVES[loss_type], 0, False, False
    kl_apart = kl_weights is not None and ref_logps is not None
    block, vec, num_warps = launch_config(v, logits.dtype, b * t, _sm_count(logits.device))
    tf = transform_args(temperature, softcap, logit_scale, temperature_rows)
    t_rows = _per_row_pointer(tf, weights)
    split = _partials(logits, targets, tf["c"], tf["cap_k"], tf["cap"], tf["SOFTCAP"], ignore_index, True,
                      block, vec, num_warps, tf["t_rows"])
    grpo_loss_fwd_kernel[(b * t,)](
        logits, logits.stride(0), logits.stride(1), t,
        targets, per_token(advantages), weights, per_token(kl_weights if kl_apart else None),
        per_token(old_logps), per_token(ref_logps), per_token(is_ratio),
        logp, entropy, row_max, log_sum, loss, coef_logp, coef_entropy, kl, clip,
        split.pop("part_m_ptr"), split.pop("part_s_ptr"), split.pop("part_u_ptr"), split.pop("num_splits"),
        v, tf["c"], tf["c_ln"], tf["cap_k"], tf["cap"], ignore_index, eps_low, eps_high,
        float("inf") if delta is None else delta, beta, entropy_coef, sapo_temperature_pos, sapo_temperature_neg,
        float(dro_beta), t_rows,
        BLOCK_V=block, VEC=vec, PER_ROW_T=tf["PER_ROW_T"], HAS_OLD=old_logps is not None, HAS_REF=ref_logps is not None,
        HAS_IS_RATIO=is_ratio is not None, SOFTCAP=tf["SOFTCAP"], OBJECTIVE=objective_code,
        BIAS_CORRECTED_KL=bool(use_bias_correction_kl), CLAMP_LOG_RATIO=clamp_log_ratio, KL_ESTIMATOR=kl_code,
        KL_STRAIGHT_THROUGH=straight_through, KL_WEIGHTED_APART=kl_apart,
        num_warps=1 if split["SPLIT"] else num_warps, **split,
    )
    return loss, logp, entropy, row_max, log_sum, coef_logp, coef_entropy, kl, clip


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
    temperature_rows: Optional[torch.Tensor] = None,
    threshold: Optional[torch.Tensor] = None,
    tie_index: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Write ``d loss / d logits`` [B, T, V] into ``out`` (may be ``logits`` itself) and return it.

    ``temperature_rows``: as in :func:`forward_rows`; ``threshold`` / ``tie_index`` [B, T]: the kept set
    of :func:`forward_rows_sampled` (its distribution's gradient; None: the whole softmax)."""
    b, t, v = logits.shape
    if b * t == 0:
        return out
    block, vec, num_warps = launch_config(v, logits.dtype, b * t, _sm_count(logits.device))
    splits, per_split = choose_splits(b * t, triton.cdiv(v, block), num_warps, logits.device)
    tf = transform_args(temperature, softcap, logit_scale, temperature_rows)
    dummy = row_max  # stands in for an absent gradient; never read (the constexpr flag is off)
    t_rows = _per_row_pointer(tf, dummy)
    truncated = threshold is not None
    token_logprobs_bwd_kernel[(b * t, splits)](
        logits, logits.stride(0), logits.stride(1), t,
        out, out.stride(0), out.stride(1),
        targets.contiguous(), row_max.contiguous(), log_sum.contiguous(), entropy.contiguous(),
        dummy if grad_logp is None else grad_logp.float().contiguous(),
        dummy if grad_entropy is None else grad_entropy.float().contiguous(),
        v, tf["c"], tf["inv_temperature"], tf["cap_k"], tf["cap"], ignore_index, per_split, t_rows,
        threshold.contiguous() if truncated else dummy, tie_index.contiguous() if truncated else dummy,
        BLOCK_V=block, VEC=vec, HAS_GRAD_LOGP=grad_logp is not None, HAS_GRAD_ENTROPY=grad_entropy is not None,
        SOFTCAP=tf["SOFTCAP"], PER_ROW_T=tf["PER_ROW_T"], TRUNCATED=truncated, num_warps=num_warps,
    )
    return out


# Tests set this to force a small candidate scratch (a power of 2): the fallback then runs on tiny rows.
SAMPLING_CAPACITY_OVERRIDE: Optional[int] = None
# candidates per thread (registers while the thresholds are searched; scratch of CAP * 8 bytes per row)
_CANDIDATES_PER_THREAD = 4

# forward_rows_sampled's outputs: logp, entropy, row_max, log_sum, sum_sq, threshold (fp32), tie_index (int32)
SAMPLED_ROWS_OUTPUTS = 7


def sampling_capacity(num_warps: int) -> int:
    """Candidates a row of :func:`forward_rows_sampled` holds (its scratch, CAP, a power of 2)."""
    if SAMPLING_CAPACITY_OVERRIDE is not None:
        return int(SAMPLING_CAPACITY_OVERRIDE)
    return _CANDIDATES_PER_THREAD * 32 * num_warps


def forward_rows_sampled(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    ignore_index: int,
    with_entropy: bool = True,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    temperature_rows: Optional[torch.Tensor] = None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    with_sum_sq: bool = False,
    top_k_rows: Optional[torch.Tensor] = None,
    top_p_rows: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, T, V], targets [B, T] -> (logp, entropy, row_max, log_sum, sum_sq, threshold, tie_index)
    [B, T] of the distribution a vLLM sampler draws from (``sampled_logprobs_fwd_kernel``, then
    ``sampled_logprobs_fallback_kernel`` for the rows it flags): the transform of :func:`forward_rows`,
    then ``top_k`` (None, or < V) and ``top_p`` (None, or < 1), renormalised. ``logp`` is -inf for a
    target outside the kept set (and for a kept target whose logit is -inf); ``sum_sq`` (sum of squared
    probabilities; zeros unless ``with_sum_sq``) and ``threshold`` (float32) / ``tie_index`` (int32: the
    kept set, for :func:`backward_rows`; zeros without a truncation) come last. ``row_max`` and
    ``log_sum`` (of the kept set) are :func:`backward_rows`' as in :func:`forward_rows`.

    ``top_k_rows`` / ``top_p_rows`` (B * T values, any integer / float dtype; instead of ``top_k`` /
    ``top_p``): one per row, vLLM's per-request values, each row's "off" values as vLLM's
    (``options.top_k_rows``, ``options.top_p_on``); a row that neither truncates is the plain softmax,
    with the kept set ``(-inf, -1)``. The values are loaded by the kernels (no host synchronisation,
    no recompilation per value); ``top_p`` is rounded to float32, as the float is.
    """
    b, t, v = logits.shape
    device = logits.device
    targets = targets.contiguous()
    per_row = top_k_rows is not None or top_p_rows is not None
    has_top_k = top_k_rows is not None or (top_k is not None and 0 < top_k < v)
    has_top_p = top_p_rows is not None or (top_p is not None and top_p < 1.0)
    truncates = has_top_k or has_top_p
    # every row of what is asked is written (torch.empty); what is not asked is zeros
    written = (True, with_entropy, True, True, with_sum_sq, truncates, truncates)
    outputs = [(torch.empty if w else torch.zeros)(b, t, dtype=torch.int32 if i == SAMPLED_ROWS_OUTPUTS - 1 else
                                                  torch.float32, device=device) for i, w in enumerate(written)]
    rows = b * t
    if rows == 0:
        return tuple(outputs)
    logp, entropy, row_max, log_sum, sum_sq, threshold, tie_index = outputs
    block, vec, num_warps = launch_config(v, logits.dtype, rows, _sm_count(device))
    cap_n = sampling_capacity(num_warps)
    scratch = torch.empty(rows * cap_n if truncates else 1, dtype=torch.int64, device=device)
    overflow = torch.empty(rows if truncates else 1, dtype=torch.int8, device=device)
    tf = transform_args(temperature, softcap, logit_scale, temperature_rows)
    t_rows = _per_row_pointer(tf, logp)
    shared = dict(BLOCK_V=block, VEC=vec, WITH_ENTROPY=with_entropy, WITH_SQ=with_sum_sq, SOFTCAP=tf["SOFTCAP"],
                  PER_ROW_T=tf["PER_ROW_T"], HAS_TOP_K=has_top_k, HAS_TOP_P=has_top_p, PER_ROW_KP=per_row,
                  num_warps=num_warps)
    if per_row:  # both per row (a number, or None, repeated): int32 k (V where off), float32 p (1 where off)
        k_arg, p_arg = v, 1.0
        k_rows = (torch.full((rows,), top_k if has_top_k and top_k_rows is None else v, dtype=torch.int64,
                             device=device) if top_k_rows is None else top_k_rows_of(top_k_rows.reshape(rows), v))
        k_rows = k_rows.to(torch.int32).contiguous()
        p_rows = (torch.full((rows,), top_p if top_p is not None else 1.0, dtype=torch.float32, device=device)
                  if top_p_rows is None else top_p_rows.reshape(rows).float().contiguous())
    else:
        k_arg, p_arg = int(top_k) if has_top_k else v, float(top_p) if has_top_p else 1.0
        k_rows = p_rows = logp  # never read
    sampled_logprobs_fwd_kernel[(rows,)](
        logits, logits.stride(0), logits.stride(1), t,
        targets, logp, entropy, row_max, log_sum, sum_sq, threshold, tie_index, overflow,
        scratch, t_rows, k_rows, p_rows,
        v, tf["c"], tf["c_ln"], tf["cap_k"], tf["cap"], ignore_index, k_arg, p_arg, CAP=cap_n, **shared,
    )
    if truncates:  # (launched always: no host synchronisation; a row not flagged returns at once)
        sampled_logprobs_fallback_kernel[(rows,)](
            logits, logits.stride(0), logits.stride(1), t,
            targets, logp, entropy, row_max, log_sum, sum_sq, threshold, tie_index, overflow,
            t_rows, k_rows, p_rows, v, tf["c"], tf["c_ln"], tf["cap_k"], tf["cap"], k_arg, p_arg, **shared,
        )
    return logp, entropy, row_max, log_sum, sum_sq, threshold, tie_index
