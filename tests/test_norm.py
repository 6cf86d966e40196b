"""grpo_kernels.norm: the fused RMSNorm's values and gradients against float64, and against transformers' modules.

Both backends: the torch path (CPU) and the Triton kernels under the interpreter (``TRITON_INTERPRET=1``
is set before Triton is imported by conftest's rule, or the Triton cases are skipped), on tiny awkward
shapes (rows of 1, 3, 7, 130 elements; a row count that does not fill a tile; a strided input).
"""

from __future__ import annotations

import pytest
import torch

from grpo_kernels import RMSNorm, rms_norm
from grpo_kernels.backends import triton_interprets
from grpo_kernels.kernels import torch_norm
from helpers import poison_allocations

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not triton_interprets(),
                                                                     reason="Triton runs on CPU only under TRITON_INTERPRET=1"))]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}


def reference64(x: torch.Tensor, w: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    """The exact function in float64 (no intermediate rounding)."""
    x, w = x.double(), w.double()
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return n * (1 + w) if gemma else n * w


def _inputs(shape, dtype, seed, gemma, w_dtype=None):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3 + 0.5).to(dtype)
    w_dtype = w_dtype or dtype
    w = (torch.randn(shape[-1], generator=g) * 0.5 + (0.0 if gemma else 1.0)).to(w_dtype)
    return x, w


def _grads(fn, x, w, dy):
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    y = fn(x, w)
    (y.to(dy.dtype) * dy).sum().backward()
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 5, 130), (37, 3), (200, 5)])
def test_values_and_grads_against_float64(backend, gemma, dtype, shape, monkeypatch):
    poison_allocations(monkeypatch)  # (every output element must be written)
    x, w = _inputs(shape, dtype, seed=hash((shape, gemma)) % 1000, gemma=gemma)
    dy = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    eps = 1e-5
    y, dx, dw = _grads(lambda a, b: rms_norm(a, b, eps, gemma=gemma, backend=backend), x, w, dy)
    y64, dx64, dw64 = _grads(lambda a, b: reference64(a, b, eps, gemma), x.double(), w.double(), dy)
    assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype
    assert torch.isfinite(y).all() and torch.isfinite(dx).all() and torch.isfinite(dw).all()
    torch.testing.assert_close(y.double(), y64, **TOL[dtype])
    # dx = r (dn - n mean(dn n)) cancels (entirely for H = 1, where it is ~eps): the tolerance is relative to
    # the size of its terms, r (|dn| + |n| mean|dn n|), not to the result; dw sums dy * n over the rows: to
    # sum |dy * n|
    x64, w64 = x.double(), w.double()
    r = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    n, dn = x64 * r, dy * ((1 + w64) if gemma else w64)
    dx_scale = r * (dn.abs() + n.abs() * (dn * n).abs().mean(-1, keepdim=True))
    dw_scale = (dy * n).abs().reshape(-1, shape[-1]).sum(0)
    rtol, atol = TOL[dtype]["rtol"], TOL[dtype]["atol"]
    assert ((dx.double() - dx64).abs() <= rtol * dx_scale + atol).all()
    assert ((dw.double() - dw64).abs() <= rtol * dw_scale + atol).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_dtypes_and_strided_input(backend, monkeypatch):
    """A bf16 x with an fp32 weight (llama-style promotes: fp32 output), and an x whose rows are strided."""
    poison_allocations(monkeypatch)
    base, w = _inputs((5, 24), torch.bfloat16, seed=3, gemma=False, w_dtype=torch.float32)
    x = base[:, ::2]  # [5, 12], row stride 24, column stride 2
    w = w[:12].contiguous()
    dy = torch.randn(5, 12, dtype=torch.float64)
    y, dx, dw = _grads(lambda a, b: rms_norm(a, b, 1e-6, backend=backend), x, w, dy)
    assert y.dtype == torch.float32 and dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    y64, dx64, dw64 = _grads(lambda a, b: reference64(a, b, 1e-6, False), x.double(), w.double(), dy)
    torch.testing.assert_close(y.double(), y64, **TOL[torch.bfloat16])
    torch.testing.assert_close(dx.double(), dx64, **TOL[torch.bfloat16])
    torch.testing.assert_close(dw.double(), dw64, rtol=2e-2, atol=5e-2)


def _transformers_norms():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    return [(LlamaRMSNorm, False), (Qwen2RMSNorm, False), (Qwen3RMSNorm, False), (GemmaRMSNorm, True),
            (Gemma3RMSNorm, True)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("index", range(5))
def test_matches_transformers_modules_in_bf16(backend, index):
    """Within bf16 rounding of transformers' own module on the same bf16 inputs (bitwise on the torch path's
    forward, which runs the same ops), gradients included."""
    cls, gemma = _transformers_norms()[index]
    hidden, eps = 48, 1e-6
    ref = cls(hidden, eps=eps).to(torch.bfloat16)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(hidden) * 0.3 + (0.0 if gemma else 1.0))
    x, _ = _inputs((2, 9, hidden), torch.bfloat16, seed=11 + index, gemma=gemma)
    dy = torch.randn(2, 9, hidden, dtype=torch.float64)
    y0, dx0, dw0 = _grads(lambda a, b: torch.func.functional_call(ref, {"weight": b}, (a,)), x, ref.weight, dy)
    y1, dx1, dw1 = _grads(lambda a, b: rms_norm(a, b, eps, gemma=gemma, backend=backend), x, ref.weight, dy)
    assert y1.dtype == y0.dtype and dx1.dtype == dx0.dtype and dw1.dtype == dw0.dtype
    if backend == "torch":
        assert torch.equal(y1, y0)
    y64, dx64, dw64 = _grads(lambda a, b: reference64(a, b, eps, gemma), x.double(), ref.weight.double(), dy)
    for ours, theirs, exact in ((y1, y0, y64), (dx1, dx0, dx64), (dw1, dw0, dw64)):
        torch.testing.assert_close(ours.double(), theirs.double(), rtol=2e-2, atol=3e-2)
        # and ours at least as close to float64 as theirs (to one bf16 ulp of the largest element)
        ulp = exact.abs().max() * 2 ** -7
        assert (ours.double() - exact).abs().max() <= (theirs.double() - exact).abs().max() + ulp


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_weight_and_no_input_grad(backend):
    x, w = _inputs((4, 6), torch.float32, seed=5, gemma=False)
    xg = x.clone().requires_grad_(True)
    rms_norm(xg, w, 1e-6, backend=backend).sum().backward()
    assert xg.grad is not None and torch.isfinite(xg.grad).all()
    wg = w.clone().requires_grad_(True)
    rms_norm(x, wg, 1e-6, backend=backend).sum().backward()
    want = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)).sum(0)
    torch.testing.assert_close(wg.grad.double(), want, rtol=1e-5, atol=1e-5)


def test_torch_path_blocks(monkeypatch):
    """More rows than one block (the block loop and its row slices): y and dx bitwise the single-block
    result, dw (summed block by block) to fp32 rounding."""
    x, w = _inputs((10, 6), torch.float32, seed=9, gemma=True)
    dy = torch.randn(10, 6)
    one = _grads(lambda a, b: rms_norm(a, b, 1e-6, gemma=True, backend="torch"), x, w, dy.double())
    monkeypatch.setattr(torch_norm, "BLOCK_ELEMENTS", 12)  # two rows a block
    many = _grads(lambda a, b: rms_norm(a, b, 1e-6, gemma=True, backend="torch"), x, w, dy.double())
    assert torch.equal(one[0], many[0]) and torch.equal(one[1], many[1])
    torch.testing.assert_close(one[2], many[2], rtol=1e-6, atol=1e-6)


def test_module():
    m = RMSNorm(5, eps=1e-5, gemma=True, backend="torch")
    assert torch.equal(m.weight, torch.zeros(5)) and "gemma=True" in repr(m)
    x = torch.randn(3, 5)
    torch.testing.assert_close(m(x).double(), reference64(x, m.weight.detach(), 1e-5, True))
    assert torch.equal(RMSNorm(4).weight, torch.ones(4))


@pytest.mark.parametrize("call, err, name", [
    (lambda x, w: rms_norm(x.numpy(), w), TypeError, "x"),
    (lambda x, w: rms_norm(x, w, -1.0), ValueError, "eps"),
    (lambda x, w: rms_norm(x, w, 1e-6, gemma="yes"), TypeError, "gemma"),
    (lambda x, w: rms_norm(x, w[:3]), ValueError, "weight"),
    (lambda x, w: rms_norm(x.long(), w), TypeError, "x"),
    (lambda x, w: rms_norm(x, w, backend="cuda"), ValueError, "backend"),
    (lambda x, w: RMSNorm(0), ValueError, "hidden_size"),
])
def test_bad_input(call, err, name):
    x, w = torch.randn(2, 4), torch.ones(4)
    with pytest.raises(err, match=name):
        call(x, w)
