"""Triton sampler rows: log-prob and entropy of the distribution a vLLM sampler draws from (top-k, then
top-p, renormalised) inside the row pass.

``sampled_logprobs_fwd_kernel`` reads the row twice (its statistics, then the candidates above a bound
certified from them) and finds the thresholds on the candidates; ``sampled_logprobs_fallback_kernel``
serves the rows whose candidates did not fit, by narrowing passes; the backward is the plain rows'
(``triton_row_stats.token_logprobs_bwd_kernel``, ``TRUNCATED``: it reads the kept set).
``docs/kernels.md`` has the passes. Launched by ``triton_rows.forward_rows_sampled``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_row_stats import LN2, LOWEST, load_row, merge_slots, row_factor, row_pointer, slot_stats, tile_offsets


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
    tile = tile_offsets(BLOCK_V, VEC)
    count = tl.zeros((), tl.int32)
    for blk in range(0, tl.cdiv(V, BLOCK_V)):
        offs = blk * BLOCK_V + tile
        inside = offs < V
        y = load_row(row_ptr + offs, cap_k, cap, SOFTCAP, mask=inside)
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
    tile = tile_offsets(BLOCK_V, VEC)
    j = tl.arange(0, _NARROW)
    step = tl.maximum((hi - lo + 1) // (_NARROW + 1), 1)
    ts = lo + (j + 1).to(tl.int64) * step
    valid_t = ts <= hi
    acc_n = tl.zeros((R, _NARROW), tl.int32)
    acc_m = tl.zeros((R, _NARROW), tl.float32)
    for blk in range(0, tl.cdiv(V, BLOCK_V)):
        offs = blk * BLOCK_V + tile
        inside = offs < V
        y = load_row(row_ptr + offs, cap_k, cap, SOFTCAP, mask=inside)
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
    tile = tile_offsets(BLOCK_V, VEC)
    s = tl.zeros((R,), tl.float32)
    u = tl.zeros((R,), tl.float32)
    w = tl.zeros((R,), tl.float32)
    n = tl.zeros((R,), tl.int32)
    for blk in range(0, tl.cdiv(V, BLOCK_V)):
        offs = blk * BLOCK_V + tile
        inside = offs < V
        y = load_row(row_ptr + offs, cap_k, cap, SOFTCAP, mask=inside)
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
    """Write a row's outputs from the kept set's (s, u, w) relative to the row max m (as
    ``triton_row_stats.finish_row``)."""
    log2_s = tl.log2(s)
    logp = (y_t - m) * c_ln - log2_s * LN2
    logp = tl.maximum(logp, LOWEST, propagate_nan=tl.PropagateNan.ALL)
    logp = tl.where(kept_t, logp, float("-inf")) + nan_guard  # outside the kept set: -inf, as vLLM's
    tl.store(logp_ptr + row, logp)
    tl.store(max_ptr + row, m)
    tl.store(log_sum_ptr + row, log2_s)
    if WITH_ENTROPY:
        tl.store(entropy_ptr + row, (log2_s - u / s) * LN2 + nan_guard)
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
        row_ptr = row_pointer(logits_ptr, row, T, stride_b, stride_t)
        # pass 1 over the row: each slot's statistics (the slot maxima bound the thresholds:
        # _kth_largest_key, _top_p_certificate), then the row's
        m_slot, s_slot, u_slot, w_slot = slot_stats(row_ptr, 0, tl.cdiv(V, BLOCK_V), V, c, cap_k, cap, BLOCK_V, VEC,
                                                     STATS_ENTROPY, STATS_SQ, SOFTCAP)
        m, s, u, w = merge_slots(m_slot, s_slot, u_slot, w_slot, c, STATS_ENTROPY, STATS_SQ)
        nan_guard = s * 0.0  # NaN when the row holds a NaN (the kept set would drop it)
        y_t = load_row(row_ptr + target, cap_k, cap, SOFTCAP)
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
        row_ptr = row_pointer(logits_ptr, row, T, stride_b, stride_t)
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
        y_t = load_row(row_ptr + target, cap_k, cap, SOFTCAP)
        key_t = _order_key(y_t).to(tl.int64)
        # a kept target whose own logit is -inf: -inf too, as vLLM's log_softmax gives it
        kept_t = ((key_t > v_key) | ((key_t == v_key) & (target >= tie))) & (y_t != float("-inf"))
        _finish_sampled(row, y_t, target, kept_t, m, s, u, w, c_ln, nan_guard, logp_ptr, entropy_ptr, max_ptr,
                        log_sum_ptr, sum_sq_ptr, WITH_ENTROPY, WITH_SQ)
        tl.store(thr_ptr + row, _key_value(v_key))
        tl.store(tie_ptr + row, tie)
