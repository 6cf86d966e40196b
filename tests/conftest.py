"""Test conventions.

- Without a GPU, Triton kernels run on CPU tensors through Triton's interpreter: TRITON_INTERPRET=1
  must be set before triton is first imported, so it is set here, at collection time.
- ``assert_close64``: compare a result with a float64 reference at a tolerance that fits the dtype.
- ``@pytest.mark.gpu`` tests are skipped without CUDA.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"

# (rtol, atol) for values that went through one rounding to the dtype, relative to O(1) magnitudes.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
    torch.float64: (1e-10, 1e-10),
}


def tolerance(dtype: torch.dtype):
    return TOLERANCES[dtype]


def assert_close64(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype = torch.float32, scale: float = 1.0, what: str = ""):
    """``actual`` against a float64 ``expected``: no NaN unless expected is NaN there, then within
    ``rtol * |expected| + atol * scale`` where the tolerance fits ``dtype``."""
    rtol, atol = TOLERANCES[dtype]
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    assert torch.equal(nan_a, nan_e), f"{what}: NaN pattern differs ({int(nan_a.sum())} vs {int(nan_e.sum())} NaNs)"
    a, e = a[~nan_e], e[~nan_e]
    inf_e = torch.isinf(e)
    assert torch.equal(a[inf_e], e[inf_e]), f"{what}: infinities differ"
    a, e = a[~inf_e], e[~inf_e]
    err = (a - e).abs()
    bound = rtol * e.abs() + atol * scale
    worst = (err - bound).argmax() if err.numel() else None
    assert bool((err <= bound).all()), (
        f"{what}: max error {err.max().item():.3e} (at expected {e[worst].item():.6g}, got {a[worst].item():.6g}), "
        f"rtol={rtol}, atol={atol * scale:.3e}"
    )


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill a buffer with NaN so a kernel that forgets to write an element is caught."""
    return t.fill_(float("nan"))


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
