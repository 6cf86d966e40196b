"""AdamW on fp32 master weights of 16-bit parameters in one Triton kernel (CUDA's fused master-weight step).

Per element: read the bf16 / fp16 gradient, update the fp32 master, ``exp_avg``, ``exp_avg_sq`` (and with
amsgrad ``max_exp_avg_sq``), write the weight as the master rounded to nearest even. Through torch's ops
the same step is three passes over memory (the gradient cast to fp32, ``torch._fused_adamw_``, the master
cast back); here it is one: 14 bytes read and 14 written per element (bf16).

The arithmetic is torch's AdamW (``torch.optim.AdamW``'s documented algorithm; Loshchilov & Hutter 2019,
Algorithm 2), in fp32 as torch's CUDA fused kernel computes it
(aten/src/ATen/native/cuda/fused_adam_utils.cuh, ``_apply_adam_math``)::

    g = grad / grad_scale, negated to maximize
    p = p * (1 - lr * weight_decay)                 (decoupled weight decay)
    m = m + (1 - beta1) * (g - m)                   (exp_avg.lerp_(g, 1 - beta1))
    v = beta2 * v + (1 - beta2) * g * g
    denom = sqrt(v, or v_max = max(v_max, v)) / sqrt(1 - beta2^step) + eps
    p = p - lr / (1 - beta1^step) * m / denom

with IEEE square root and division (``sqrt_rn``, ``div_rn``); the two bias corrections are formed per
parameter in float64 from its step counter on the device (no host sync) and rounded to fp32. Agreement
with torch's AdamW is to fp32 rounding (not bitwise: torch's CUDA kernel rounds some terms differently).

A found inf (torch's AMP ``found_inf`` = 1) masks every load and store: the step writes nothing, as torch's
kernel returns. Offsets are int64 (tensors over 2^31 elements).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from .master_adamw import check_args

BLOCK = 1024
"""Elements per program (a memory-bound elementwise loop: 4 warps, 8 elements per thread)."""


@triton.jit
def _to_weight(p, W_BF16: tl.constexpr, W_DTYPE: tl.constexpr):
    """``p`` (fp32) rounded to nearest even into the weight's dtype. bf16 by its bits, as c10::BFloat16
    rounds (NaN to the quiet NaN 0x7FC0): ``.to(tl.bfloat16)`` rounds so on a GPU, but Triton's CPU
    interpreter truncates, and the tests run there; fp16 by the cast (nearest even on both)."""
    if W_BF16:
        bits = p.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        bits = tl.where(p != p, 0x7FC0, bits)
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return p.to(W_DTYPE)


@triton.jit
def master_adamw_kernel(master_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_sq_ptr, grad_ptr, weight_ptr, scalars_ptr,
                        scale_ptr, inf_ptr, n, decay, lerp_w, beta2, c2, eps, sign,
                        AMSGRAD: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr, W_BF16: tl.constexpr,
                        BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    if HAS_INF:  # (a found inf: no element is in range)
        n = tl.where(tl.load(inf_ptr) == 1.0, 0, n)
    mask = offs < n
    step_size = tl.load(scalars_ptr)  # lr / (1 - beta1^step)
    bc2_sqrt = tl.load(scalars_ptr + 1)  # sqrt(1 - beta2^step)
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = tl.div_rn(g, tl.load(scale_ptr))
    g = g * sign
    p = tl.load(master_ptr + offs, mask=mask, other=0.0) * decay
    m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0)
    m = m + lerp_w * (g - m)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0) * beta2 + c2 * g * g
    second = v
    if AMSGRAD:
        second = tl.maximum(tl.load(max_sq_ptr + offs, mask=mask, other=0.0), v)
        tl.store(max_sq_ptr + offs, second, mask=mask)
    denom = tl.div_rn(tl.sqrt_rn(second), bc2_sqrt) + eps
    p = p - tl.div_rn(step_size * m, denom)
    tl.store(exp_avg_ptr + offs, m, mask=mask)
    tl.store(exp_avg_sq_ptr + offs, v, mask=mask)
    tl.store(master_ptr + offs, p, mask=mask)
    tl.store(weight_ptr + offs, _to_weight(p, W_BF16, weight_ptr.dtype.element_ty), mask=mask)


def master_adamw_step(masters: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
                      exp_avg_sqs: Sequence[torch.Tensor], max_exp_avg_sqs: Optional[Sequence[torch.Tensor]],
                      grads: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], steps: Sequence[torch.Tensor], *,
                      lr: float, beta1: float, beta2: float, weight_decay: float, eps: float, amsgrad: bool,
                      maximize: bool, grad_scale: Optional[torch.Tensor] = None,
                      found_inf: Optional[torch.Tensor] = None) -> None:
    """One AdamW step of the fp32 ``masters`` from the 16-bit ``grads``, the rounded masters written into
    ``weights`` (the tensors: ``master_adamw``'s contract; CUDA tensors, or CPU ones under
    ``TRITON_INTERPRET=1``). ``grad_scale``: a one-element fp32 tensor the gradients are divided by
    (AMP's unscaling; the gradients are left as they are); ``found_inf``: a one-element fp32 tensor, 1
    to skip the step. One launch per tensor; nothing is read back to the host."""
    device_type = masters[0].device.type if len(masters) else "cuda"
    check_args(masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, grads, weights, steps, amsgrad, device_type)
    if not masters:
        return
    # per parameter, on its device, in float64 as torch forms them: (lr / (1 - beta1^step), sqrt(1 - beta2^step))
    s = torch.stack([t.reshape(()) for t in steps]).double()
    scalars = torch.stack([lr / (1 - beta1**s), (1 - beta2**s).sqrt()], dim=1).float().contiguous()
    for i, master in enumerate(masters):
        n = master.numel()
        if n == 0:
            continue
        dummy = scalars[i]  # (a pointer for the arguments a constexpr switch leaves unread)
        master_adamw_kernel[(triton.cdiv(n, BLOCK),)](
            master, exp_avgs[i], exp_avg_sqs[i], max_exp_avg_sqs[i] if amsgrad else dummy, grads[i], weights[i],
            scalars[i], grad_scale if grad_scale is not None else dummy, found_inf if found_inf is not None else dummy,
            n, 1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, eps, -1.0 if maximize else 1.0,
            AMSGRAD=amsgrad, HAS_SCALE=grad_scale is not None, HAS_INF=found_inf is not None,
            W_BF16=weights[i].dtype == torch.bfloat16, BLOCK=BLOCK, num_warps=4)
