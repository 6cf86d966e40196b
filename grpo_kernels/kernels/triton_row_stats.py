"""Triton row kernels, the plain rows: token log-prob and entropy from logits in one read (the online-softmax
row statistics), and their gradient; their device functions are shared by the GRPO epilogue
(``triton_grpo_epilogue``) and the sampler (``triton_sampler``). The launchers: ``triton_rows``.

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
float64 by the launchers as the float's factors are (``triton_rows.transform_args``).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOWEST = tl.constexpr(-3.4028234663852886e38)  # -FLT_MAX: the clamp that stands in for -inf
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# log2 p below this is 0 in fp32 anyway (2^-150 rounds to 0); clamping there keeps b * log2 p finite.
_LOG2P_FLOOR = tl.constexpr(-256.0)


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------
@triton.jit
def row_pointer(base, row, T, stride_b, stride_t):
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
def apply_softcap(x, k, cap):
    """Final-logit soft-capping ``cap * tanh(k * x)`` (``k = logit_scale / cap``), accurate near 0:
    ``tanh |a| = (1 - e^{-2|a|}) / (1 + e^{-2|a|})`` with the accurate ``1 - e^y``. NaN stays NaN."""
    a = x * k
    e = one_minus_exp(-2.0 * tl.abs(a))
    t = e / (2.0 - e)
    return cap * tl.where(a < 0.0, -t, t)


@triton.jit
def load_row(ptr, cap_k, cap, SOFTCAP: tl.constexpr, mask=None):
    """Logits as the softmax sees them before the temperature: raw, or soft-capped (the logit scale
    without a cap is folded into the temperature by the launchers). Masked lanes are -inf."""
    if mask is None:
        x = tl.load(ptr).to(tl.float32)
        if SOFTCAP:
            x = apply_softcap(x, cap_k, cap)
    else:
        x = tl.load(ptr, mask=mask, other=float("-inf")).to(tl.float32)
        if SOFTCAP:  # tanh(-inf) = -1 would give the lanes past V a probability: keep them -inf
            x = tl.where(mask, apply_softcap(x, cap_k, cap), float("-inf"))
    return x


@triton.jit
def softcap_slope(y, cap_scale, cap):
    """d y / d x of ``y = cap * tanh(k x)``: ``logit_scale * (1 - (y / cap)^2)`` (``cap_scale = cap * k``)."""
    t = y / cap
    return cap_scale * (1.0 - t * t)


@triton.jit
def tile_offsets(BLOCK_V: tl.constexpr, VEC: tl.constexpr):
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
def merge_slots(m, s, u, w, c, WITH_ENTROPY: tl.constexpr, WITH_SQ: tl.constexpr):
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
def slot_stats(row_ptr, blk_lo, blk_hi, V, c, cap_k, cap, BLOCK_V: tl.constexpr, VEC: tl.constexpr,
                WITH_ENTROPY: tl.constexpr, WITH_SQ: tl.constexpr, SOFTCAP: tl.constexpr):
    """Each slot's (m, s, u, w) [BLOCK_V / VEC] over the row's blocks [blk_lo, blk_hi) (block k = elements
    [k, k+1) * BLOCK_V), not yet merged.

    Whole blocks are read without a mask; a block that crosses V (only ever the row's last) is
    peeled off after the loop. Block starts are multiples of the constexpr BLOCK_V, so the
    compiler knows every vector is 16-byte aligned.
    """
    R: tl.constexpr = BLOCK_V // VEC
    tile = tile_offsets(BLOCK_V, VEC)
    m = tl.full((R,), LOWEST, tl.float32)
    s = tl.zeros((R,), tl.float32)
    u = tl.zeros((R,), tl.float32)
    w = tl.zeros((R,), tl.float32)
    blk_hi = tl.minimum(blk_hi, tl.cdiv(V, BLOCK_V))  # the last split may be short
    blk_full = tl.minimum(blk_hi, V // BLOCK_V)
    for blk in range(blk_lo, blk_full):
        x = load_row(row_ptr + blk * BLOCK_V + tile, cap_k, cap, SOFTCAP)
        m, s, u, w = _slot_update(x, m, s, u, w, c, WITH_ENTROPY, WITH_SQ)
    if blk_full < blk_hi:
        offs = blk_full * BLOCK_V + tile
        x = load_row(row_ptr + offs, cap_k, cap, SOFTCAP, mask=offs < V)
        m, s, u, w = _slot_update(x, m, s, u, w, c, WITH_ENTROPY, WITH_SQ)
    return m, s, u, w


@triton.jit
def _chunk_stats(row_ptr, blk_lo, blk_hi, V, c, cap_k, cap, BLOCK_V: tl.constexpr, VEC: tl.constexpr,
                 WITH_ENTROPY: tl.constexpr, SOFTCAP: tl.constexpr):
    """(m, s, u) of the row's blocks [blk_lo, blk_hi): :func:`slot_stats`, merged."""
    m, s, u, w = slot_stats(row_ptr, blk_lo, blk_hi, V, c, cap_k, cap, BLOCK_V, VEC, WITH_ENTROPY, False, SOFTCAP)
    m, s, u, _ = merge_slots(m, s, u, w, c, WITH_ENTROPY, False)
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
        m, s, u, _ = merge_slots(pm, ps, pu, ps, c, WITH_ENTROPY, False)
    else:
        m, s, u = _chunk_stats(row_ptr, 0, tl.cdiv(V, BLOCK_V), V, c, cap_k, cap, BLOCK_V, VEC, WITH_ENTROPY, SOFTCAP)
    return m, s, u


@triton.jit
def finish_row(row_ptr, target, m, s, u, c_ln, cap_k, cap, WITH_ENTROPY: tl.constexpr, SOFTCAP: tl.constexpr):
    """(logp, entropy, log2 s) in nats / nats / bits from the row's statistics and its target logit;
    ``c_ln = c ln 2`` (the slope in nats, formed once, in float64, by the launcher)."""
    log2_s = tl.log2(s)
    x_target = load_row(row_ptr + target, cap_k, cap, SOFTCAP)
    # (x_t - m) / T in nats, not in bits: a logit gap near FLT_MAX stays finite at T = 1.
    logp = (x_target - m) * c_ln - log2_s * LN2
    # below float32's range (a 3e38 gap at T < 1): its lowest finite value, not -inf, as every backend
    logp = tl.maximum(logp, LOWEST, propagate_nan=tl.PropagateNan.ALL)
    entropy = 0.0
    if WITH_ENTROPY:
        entropy = (log2_s - u / s) * LN2
    return logp, entropy, log2_s


@triton.jit
def store_masked_row(row, logp_ptr, entropy_ptr, max_ptr, log_sum_ptr, WITH_ENTROPY: tl.constexpr):
    """A masked row's log-prob outputs: nothing is read, everything is 0."""
    tl.store(logp_ptr + row, 0.0)
    tl.store(max_ptr + row, 0.0)
    tl.store(log_sum_ptr + row, 0.0)
    if WITH_ENTROPY:
        tl.store(entropy_ptr + row, 0.0)


@triton.jit
def logprob_row(
    logits_ptr, stride_b, stride_t, T, row, target, logp_ptr, entropy_ptr, max_ptr, log_sum_ptr,
    part_m_ptr, part_s_ptr, part_u_ptr, num_splits, V, c, c_ln, cap_k, cap,
    BLOCK_V: tl.constexpr, VEC: tl.constexpr, WITH_ENTROPY: tl.constexpr, SPLIT: tl.constexpr, SPLITS_PAD: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """A kept row's log-prob of ``target``, entropy (``WITH_ENTROPY``), max and log2 sum, stored; returns
    (logp, entropy) for the GRPO epilogue. The forward of both ``token_logprobs_fwd_kernel`` and
    ``grpo_loss_fwd_kernel``."""
    row_ptr = row_pointer(logits_ptr, row, T, stride_b, stride_t)
    m, s, u = _row_summary(row_ptr, row, V, c, cap_k, cap, part_m_ptr, part_s_ptr, part_u_ptr, num_splits,
                           BLOCK_V, VEC, WITH_ENTROPY, SPLIT, SPLITS_PAD, SOFTCAP)
    logp, entropy, log2_s = finish_row(row_ptr, target, m, s, u, c_ln, cap_k, cap, WITH_ENTROPY, SOFTCAP)
    tl.store(logp_ptr + row, logp)
    tl.store(max_ptr + row, m)
    tl.store(log_sum_ptr + row, log2_s)
    if WITH_ENTROPY:
        tl.store(entropy_ptr + row, entropy)
    return logp, entropy


# --------------------------------------------------------------------------------------------------
# kernels (launched by triton_rows.forward_rows / backward_rows)
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
        row_ptr = row_pointer(logits_ptr, row, T, stride_b, stride_t)
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
        store_masked_row(row, logp_ptr, entropy_ptr, max_ptr, log_sum_ptr, WITH_ENTROPY)
    else:
        logprob_row(logits_ptr, stride_b, stride_t, T, row, target, logp_ptr, entropy_ptr, max_ptr, log_sum_ptr,
                     part_m_ptr, part_s_ptr, part_u_ptr, num_splits, V, c, c_ln, cap_k, cap,
                     BLOCK_V, VEC, WITH_ENTROPY, SPLIT, SPLITS_PAD, SOFTCAP)


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
    row_ptr = row_pointer(logits_ptr, row, T, stride_b, stride_t)
    grad_row_ptr = row_pointer(grad_ptr, row, T, grad_stride_b, grad_stride_t)
    tile = tile_offsets(BLOCK_V, VEC)
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
        b = -g_entropy * LN2
        cap_scale = cap * cap_k  # the logit scale, dy/dx at 0 with soft-capping
        # A target outside [0, V) lies in another rank's vocabulary shard (grpo_kernels.vocab_parallel):
        # the row gets the softmax part of its gradient only.
        in_row = (target >= 0) & (target < V)
        # Read before the loop: with out = logits (in-place backward) the loop overwrites it.
        y_t = load_row(row_ptr + tl.where(in_row, target, 0), cap_k, cap, SOFTCAP)
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
            x = load_row(row_ptr + offs, cap_k, cap, SOFTCAP)
            grad = _grad_tile(x, m, log2_s, c, a, b, HAS_GRAD_ENTROPY)
            if TRUNCATED:
                grad = tl.where((x > thr) | ((x == thr) & (offs >= tie)), grad, 0.0)
            if SOFTCAP:
                grad = grad * softcap_slope(x, cap_scale, cap)
            tl.store(grad_row_ptr + offs, grad.to(grad_ptr.dtype.element_ty))
        if blk_full < blk_hi:
            offs = blk_full * BLOCK_V + tile
            x = load_row(row_ptr + offs, cap_k, cap, SOFTCAP, mask=offs < V)
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
            target_grad = g_logp * one_minus_exp(q_t * LN2)
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
