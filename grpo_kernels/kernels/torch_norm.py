"""RMSNorm in PyTorch ops, over blocks of rows: the CPU path of :mod:`grpo_kernels.norm`.

The same arithmetic as ``triton_norm`` (whose docstring has the formulas and the derivative), written
as transformers' ``LlamaRMSNorm`` / ``GemmaRMSNorm`` write the forward, so on a CPU the values are
theirs bit for bit. Memory: transformers' module, differentiated by autograd, keeps several fp32 copies
of ``x`` [N, H] for its backward (its fp32 cast, the normalised rows, their cast; ``docs/memory.md``);
here every fp32 temporary is one block of at most :data:`BLOCK_ELEMENTS` elements, so the forward
holds its output and ``rstd`` [N] only, and the backward its ``dx`` (in ``x``'s dtype) and ``dw`` [H].
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

# fp32 temporaries of at most this many elements (4 MiB each) at a time
BLOCK_ELEMENTS = 1 << 20


def _blocks(n_rows: int, hidden: int):
    step = max(1, BLOCK_ELEMENTS // max(hidden, 1))
    for start in range(0, n_rows, step):
        yield slice(start, min(start + step, n_rows))


def _f32(t: torch.Tensor) -> torch.Tensor:
    """A new fp32 copy of ``t`` (``.float()`` would return an fp32 ``t`` itself: the in-place ops below
    would then write into the caller's tensor)."""
    return t.to(torch.float32, copy=True)


def forward_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool,
                 out_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(y [N, H] out_dtype, rstd [N] fp32)`` for rows ``x`` [N, H] and ``weight`` [H]."""
    n_rows, hidden = x.shape
    y = torch.empty((n_rows, hidden), dtype=out_dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    scale = 1.0 + weight.float() if gemma else weight
    for rows in _blocks(n_rows, hidden):
        xf = _f32(x[rows])
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        rstd[rows] = r.squeeze(-1)
        n = xf.mul_(r)
        # llama: w * cast(n) in promote(x, w); gemma: cast(n * (1 + w)) (transformers' two orders)
        y[rows] = n.mul_(scale) if gemma else scale * n.to(x.dtype)
    return y, rstd


def backward_rows(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, gemma: bool,
                  want_dx: bool, want_dw: bool) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(dx [N, H] in x's dtype, dw [H] in weight's dtype)`` (None where not wanted)."""
    n_rows, hidden = x.shape
    dx = torch.empty_like(x, memory_format=torch.contiguous_format) if want_dx else None
    dw = torch.zeros(hidden, dtype=torch.float32, device=x.device) if want_dw else None
    g = 1.0 + weight.float() if gemma else weight.float()
    for rows in _blocks(n_rows, hidden):
        r = rstd[rows].unsqueeze(-1)
        n = _f32(x[rows]).mul_(r)
        d = _f32(dy[rows])
        if want_dw:  # d w = sum dy * cast(n) (llama) / dy * n (gemma)
            dw.add_((d * (n if gemma else n.to(x.dtype).float())).sum(0))
        if want_dx:  # d x = r (dn - n mean(dn n)), dn = dy * g
            dn = d.mul_(g)
            c = (dn * n).mean(-1, keepdim=True)
            dx[rows] = dn.sub_(n.mul_(c)).mul_(r)
    return dx, (dw.to(weight.dtype) if want_dw else None)
