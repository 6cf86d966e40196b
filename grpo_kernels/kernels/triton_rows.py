"""The launchers of the Triton row kernels: ``forward_rows``, ``grpo_forward_rows``, ``backward_rows`` and
``forward_rows_sampled``, with the launch configuration (block, vector width, warps, vocabulary splits)
and the logit transform's kernel arguments.

The kernels live by family: the plain rows (online-softmax row statistics, token log-prob and entropy
forward and backward) in ``triton_row_stats``, the GRPO epilogue (the loss in the log-prob pass) in
``triton_grpo_epilogue``, the sampler's top-k / top-p rows in ``triton_sampler``. Each kernel is a
global of this module, launched by its bare name: the tools that capture the launches
(``tools/aot.py``, the SASS model) replace every ``@triton.jit`` function of this module by a recorder.
``docs/kernels.md`` describes the kernels; the fused GRPO forward's policy term is the loss mode's
epilogue id (``loss_modes``).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import triton

from .. import loss_modes
from ..options import top_k_rows as top_k_rows_of
from .triton_grpo_epilogue import grpo_loss_fwd_kernel
from .triton_row_stats import LN2, LOG2E, row_stats_partial_kernel, token_logprobs_bwd_kernel, token_logprobs_fwd_kernel
from .triton_sampler import sampled_logprobs_fallback_kernel, sampled_logprobs_fwd_kernel

# Tests set this to force the split-vocabulary path (any number of rows) on the CPU interpreter.
SPLITS_OVERRIDE: Optional[int] = None
_MAX_SPLITS = 64
_DEFAULT_SMS = 132  # an H200 / H100 SXM, assumed for meta tensors (AOT compilation, the SASS model)


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
        c = LOG2E.value * scale / temperature
        args = dict(c=c, c_ln=c * LN2.value, inv_temperature=scale / temperature, PER_ROW_T=False, t_rows=None)
    else:
        t = temperature_rows.detach().double().reshape(-1)
        c = (LOG2E.value * scale) / t
        args = dict(c=1.0, c_ln=1.0, inv_temperature=1.0, PER_ROW_T=True,
                    t_rows=torch.stack((c, c * LN2.value, scale / t), -1).float().contiguous())
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
    return (row_max * c + log_sum) * LN2.value


def shift_log_sum(log_sum: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``log_sum`` (bits) of a normaliser ``exp(shift)`` times larger (``shift`` in nats)."""
    return log_sum + shift * LOG2E.value


# grpo_forward_rows' outputs: weighted_loss, logp, entropy, row_max, log_sum, coef_logp, coef_entropy, kl, clip
GRPORows = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                 torch.Tensor, torch.Tensor]
GRPO_ROWS_FLOAT_OUTPUTS = 8  # the first 8 are fp32 [B, T]; clip is int8 [B, T]

# The fused GRPO forward's policy terms (OBJECTIVE constexpr) are the loss modes' epilogue ids
# (loss_modes.LossMode.epilogue, with CLAMP_LOG_RATIO its clamps_log_ratio; None: not fused).
# verl's KL estimators (KL_ESTIMATOR; 0 is TRL's k3); a trailing "+" is KL_STRAIGHT_THROUGH
_VERL_KL_ESTIMATORS = {"kl": 1, "k1": 1, "abs": 2, "mse": 3, "k2": 3, "low_var_kl": 4, "k3": 4}


def fuses_objective(loss_type: Optional[str], loss_mode: Optional[str]) -> bool:
    """Whether ``grpo_forward_rows`` has this objective's term (verl's ``loss_mode`` when given): the
    registered mode has an epilogue id."""
    mode = loss_modes.find(loss_type, loss_mode)
    return mode is not None and mode.fused


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

    mode = loss_modes.find(loss_type, loss_mode)
    if mode is None or not mode.fused:
        vocabulary, name = ("loss_mode", loss_mode) if loss_mode is not None else ("loss_type", loss_type)
        fused = loss_modes.RegisteredNames(vocabulary, lambda m: m.fused)
        raise ValueError(f"{vocabulary} {name!r} has no fused Triton forward (one of {fused})")
    if mode.is_verl:
        kl_name = "low_var_kl" if kl_loss_type is None else kl_loss_type
        kl_base = kl_name[:-1] if kl_name.endswith("+") else kl_name
        if kl_base not in _VERL_KL_ESTIMATORS:
            raise ValueError(f"kl_loss_type {kl_name!r} has no fused Triton forward "
                             f"(one of {tuple(_VERL_KL_ESTIMATORS)}, each also with '+')")
        kl_code, straight_through = _VERL_KL_ESTIMATORS[kl_base], kl_name.endswith("+")
    else:
        if kl_weights is not None or kl_loss_type is not None:
            raise ValueError("kl_weights and kl_loss_type are verl's (loss_mode); TRL's k3 is weighted like the policy term")
        kl_code, straight_through = 0, False
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
        HAS_IS_RATIO=is_ratio is not None, SOFTCAP=tf["SOFTCAP"], OBJECTIVE=mode.epilogue,
        BIAS_CORRECTED_KL=bool(use_bias_correction_kl), CLAMP_LOG_RATIO=mode.clamps_log_ratio, KL_ESTIMATOR=kl_code,
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
