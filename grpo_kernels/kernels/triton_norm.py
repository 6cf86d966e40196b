"""Triton RMSNorm kernels: the normalised rows in one read of ``x``, and their gradient in one read of ``(x, dy)``.

RMSNorm (Zhang & Sennrich, 2019, "Root Mean Square Layer Normalization") of a row ``x`` [H]::

    r = 1 / sqrt(mean(x^2) + eps)        n = x * r                 (all fp32)
    llama-style  y = w * cast(n)          (cast to x's dtype first, then times the weight; y in promote(x, w))
    gemma-style  y = cast(n * (1 + w))    (Gemma's 1 + w, multiplied in fp32, then cast to x's dtype)

The two styles differ in where the rounding to x's dtype happens, as transformers' ``LlamaRMSNorm`` and
``GemmaRMSNorm`` do; the kernels round at the same place, so their values are transformers' to the
rounding of ``r`` (a different summation order of ``mean(x^2)``).

Backward, with ``g = w`` (llama) or ``1 + w`` (gemma) and the cast's gradient the identity::

    dn = dy * g
    dx = r * (dn - n * mean(dn * n))      (d n_j / d x_i = r (delta_ij - n_i n_j / H))
    dw = sum over rows of dy * cast(n)    (llama; gemma: dy * n)

Only ``r`` [N] (fp32) is kept from the forward, besides ``x`` and ``w``. Rows are tiles of
``[BLOCK_R, BLOCK_H]`` (a whole row in one tile, several short rows per program: Qwen3's per-head
``q_norm`` has rows of 128); row offsets are int64. ``dw``: each backward program walks a contiguous
range of row tiles and writes one fp32 partial sum [H]; the launcher adds the partials (fp32).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

# A tile of at most this many elements: a 4096-wide row is one tile, 128-wide rows come 32 to a tile.
_TILE = 4096
_MAX_ROWS_PER_TILE = 32


@triton.jit
def rms_norm_fwd_kernel(X, W, Y, RSTD, n_rows, H, stride_x, stride_y, eps,
                        GEMMA: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    row_ok = rows < n_rows
    col_ok = cols < H
    ok = row_ok[:, None] & col_ok[None, :]
    x_raw = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0)
    x = x_raw.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / H + eps)
    n = x * rstd[:, None]
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    if GEMMA:
        y = n * (1.0 + w)[None, :]
    else:
        y = n.to(x_raw.dtype).to(tl.float32) * w[None, :]  # (the cast to x's dtype before the weight)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=ok)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def rms_norm_bwd_kernel(DY, X, W, RSTD, DX, DW_PARTIAL, n_rows, H, stride_dy, stride_x, stride_dx, tiles_per_program,
                        GEMMA: tl.constexpr, WANT_DX: tl.constexpr, WANT_DW: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < H
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    if GEMMA:
        g = 1.0 + w
    else:
        g = w
    dw = tl.zeros([BLOCK_H], dtype=tl.float32)
    for t in range(0, tiles_per_program):
        rows = (pid * tiles_per_program + t) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
        row_ok = rows < n_rows
        ok = row_ok[:, None] & col_ok[None, :]
        x_raw = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        n = x_raw.to(tl.float32) * rstd[:, None]
        if WANT_DW:
            if GEMMA:
                dw += tl.sum(dy * n, axis=0)
            else:
                dw += tl.sum(dy * n.to(x_raw.dtype).to(tl.float32), axis=0)
        if WANT_DX:
            dn = dy * g[None, :]
            c = tl.sum(dn * n, axis=1) / H
            dx = rstd[:, None] * (dn - n * c[:, None])
            tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=ok)
    if WANT_DW:
        tl.store(DW_PARTIAL + pid * H + cols, dw, mask=col_ok)


def _tile(hidden: int) -> Tuple[int, int]:
    """(BLOCK_R, BLOCK_H): a whole row per tile row, several rows per tile when rows are short."""
    block_h = triton.next_power_of_2(hidden)
    return max(1, min(_MAX_ROWS_PER_TILE, _TILE // block_h)), block_h


def _programs(device: torch.device) -> int:
    """How many backward programs share the rows (each writes one fp32 partial of ``dw``)."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # (the interpreter: a few programs, so the partial sums are exercised)


def forward_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool,
                 out_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(y [N, H] out_dtype, rstd [N] fp32)`` for rows ``x`` [N, H] (last dim contiguous), ``weight`` [H]."""
    n_rows, hidden = x.shape
    y = torch.empty((n_rows, hidden), dtype=out_dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows == 0:
        return y, rstd
    block_r, block_h = _tile(hidden)
    rms_norm_fwd_kernel[(triton.cdiv(n_rows, block_r),)](
        x, weight, y, rstd, n_rows, hidden, x.stride(0), y.stride(0), eps,
        GEMMA=gemma, BLOCK_R=block_r, BLOCK_H=block_h)
    return y, rstd


def backward_rows(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, gemma: bool,
                  want_dx: bool, want_dw: bool) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(dx [N, H] in x's dtype, dw [H] in weight's dtype)`` (None where not wanted) from ``dy`` [N, H]
    (last dim contiguous) and the forward's ``rstd``."""
    n_rows, hidden = x.shape
    dx = torch.empty_like(x, memory_format=torch.contiguous_format) if want_dx else None
    if n_rows == 0 or not (want_dx or want_dw):
        return dx, (torch.zeros_like(weight) if want_dw else None)
    block_r, block_h = _tile(hidden)
    tiles = triton.cdiv(n_rows, block_r)
    programs = min(tiles, _programs(x.device))
    tiles_per_program = triton.cdiv(tiles, programs)
    programs = triton.cdiv(tiles, tiles_per_program)
    partial = torch.empty((programs, hidden), dtype=torch.float32, device=x.device) if want_dw else rstd
    rms_norm_bwd_kernel[(programs,)](
        dy, x, weight, rstd, dx if want_dx else x, partial, n_rows, hidden, dy.stride(0), x.stride(0),
        dx.stride(0) if want_dx else 0, tiles_per_program,
        GEMMA=gemma, WANT_DX=want_dx, WANT_DW=want_dw, BLOCK_R=block_r, BLOCK_H=block_h)
    dw = partial.sum(0).to(weight.dtype) if want_dw else None
    return dx, dw
