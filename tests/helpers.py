"""Shared test helpers, imported explicitly (``from helpers import ...``).

- ``DEVICE``: "cuda" where a GPU is present, else "cpu" (Triton kernels then run through the
  interpreter: ``conftest.py`` sets TRITON_INTERPRET=1 before triton is first imported).
- ``assert_close64``: compare a result with a float64 reference at a tolerance that fits the dtype.
- ``poison_``: fill an output buffer with NaN before a kernel writes it.
- ``tiny_config``: a ``GRPOConfig`` for the trainer tests' tiny model (CPU, "torch" backend).
- ``timed``, ``SLACK``: a call that must return within a wall-clock budget (the rewards tests).
- ``saved_for_backward``: the bytes autograd keeps for backward while a function runs.
"""

from __future__ import annotations

import time
from typing import Any, Callable, TypeVar

import torch

R = TypeVar("R")

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


TINY_RUN = dict(
    seed=0, num_steps=1, prompts_per_step=2, num_generations=4, max_new_tokens=6, learning_rate=1e-3,
    backend="torch", progress=False, plot=False, save_every=0,
)


def tiny_config(tmp_path, **overrides: Any):
    """A ``GRPOConfig`` writing to ``tmp_path / "run"``: one step of 2 prompts x 4 generations of 6
    tokens, the "torch" backend, no progress bar, plot or checkpoint; ``overrides`` replace any field."""
    from grpo.config import GRPOConfig

    return GRPOConfig(**{"output_dir": str(tmp_path / "run"), **TINY_RUN, **overrides})


# The spec's own lists, never retyped here: the concrete backends (every one a test runs on), the
# fused ones, and the four loss types of TRL's first release that most kernel tests sweep (the spec's
# PPO-clipped types but luspo, whose length weighting has tests of its own over all of LOSS_TYPES).
from grpo_kernels.options import BACKENDS as _BACKEND_CHOICES  # noqa: E402
from grpo_kernels.options import CLIPPED_LOSS_TYPES  # noqa: E402

BACKENDS = tuple(b for b in _BACKEND_CHOICES if b != "auto")
KERNEL_BACKENDS = tuple(b for b in BACKENDS if b != "reference")
CORE_LOSS_TYPES = tuple(t for t in CLIPPED_LOSS_TYPES if t != "luspo")


# A small batch for the contract checks: masked positions, and a sequence with no completion token.
B, T, V, H = 3, 5, 13, 6


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T)
    mask[0, 3:] = 0
    mask[1, 0] = 0
    mask[2, :] = 0  # a sequence with no completion token at all
    adv = torch.randn(B, T, generator=g)
    old = torch.randn(B, T, generator=g) * 0.1 - 2.5
    ref = torch.randn(B, T, generator=g) * 0.1 - 2.5
    is_ratio = torch.rand(B, T, generator=g) + 0.5
    return logits, ids, mask, adv, old, ref, is_ratio


SLACK = 2.0  # seconds over its timeout that any reward call may take


def timed(fn: Callable[[], R], budget: float) -> R:
    """``fn()``, asserting that it returned within ``budget`` seconds of wall time."""
    start = time.monotonic()
    out = fn()
    elapsed = time.monotonic() - start
    assert elapsed < budget, f"took {elapsed:.1f}s, budget {budget:.1f}s"
    return out


def loss_and_logits_grad(logits, ids, adv, mask, backend: str = "torch", **kw):
    """``grpo_kernels.grpo_loss`` on a fresh leaf copy of ``logits`` (on DEVICE): (its output, d loss /
    d logits on the CPU)."""
    import grpo_kernels as gk

    x = logits.clone().to(DEVICE).requires_grad_()
    kw = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    out = gk.grpo_loss(x, ids.to(DEVICE), adv.to(DEVICE), mask.to(DEVICE), backend=backend, **kw)
    (grad,) = torch.autograd.grad(out.loss, x)
    return out, grad.cpu()


def saved_for_backward(fn: Callable[[], R], exclude=()) -> tuple[R, int]:
    """(fn(), bytes of the distinct storages autograd saved for backward while it ran), leaving out
    the storages of the tensors in ``exclude`` (a model's parameters)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(kept.values())
