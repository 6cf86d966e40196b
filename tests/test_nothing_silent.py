"""Nothing silent (issue 16): masked inputs are never read, in-place gradients cannot go wrong,
constants stay constants, double backward raises, and bad scalars are refused by name.

Each case runs on every backend it concerns; the Triton one through the interpreter on the CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import grpo_kernels as gk
from conftest import DEVICE

BACKENDS = ["reference", "torch", "triton"]
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]
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


def poison_masked(x: torch.Tensor, mask: torch.Tensor, value: float) -> torch.Tensor:
    return torch.where(mask.expand_as(x) != 0, x, torch.full_like(x, value))


def run(backend, logits, ids, adv, mask, **kw):
    x = logits.clone().to(DEVICE).requires_grad_()
    kw = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    out = gk.grpo_loss(x, ids.to(DEVICE), adv.to(DEVICE), mask.to(DEVICE), backend=backend, **kw)
    out.loss.backward()
    return out, x.grad


def assert_same(clean, clean_grad, dirty, dirty_grad):
    assert torch.isfinite(dirty.loss), "loss"
    assert torch.isfinite(dirty_grad).all(), "gradient"
    torch.testing.assert_close(dirty.loss, clean.loss, rtol=0, atol=0)
    torch.testing.assert_close(dirty_grad, clean_grad, rtol=0, atol=0)
    assert clean.metrics.keys() == dirty.metrics.keys()
    for name in clean.metrics:
        assert torch.isfinite(dirty.metrics[name]), name
        torch.testing.assert_close(dirty.metrics[name], clean.metrics[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("poison", [float("nan"), float("-inf"), float("inf")])
def test_masked_per_token_inputs_are_never_read(backend, level, poison):
    """NaN / inf in old_logps, ref_logps, advantages, is_ratio only where the mask is 0 change nothing."""
    logits, ids, mask, adv, old, ref, is_ratio = batch()
    for loss_type in LOSS_TYPES:
        kw = dict(beta=0.05, eps_high=0.28, loss_type=loss_type, importance_sampling_level=level, entropy_coef=0.01)
        clean, clean_grad = run(backend, logits, ids, adv, mask, old_logps=old, ref_logps=ref, is_ratio=is_ratio, **kw)
        dirty, dirty_grad = run(
            backend, logits, ids, poison_masked(adv, mask, poison), mask, old_logps=poison_masked(old, mask, poison),
            ref_logps=poison_masked(ref, mask, poison), is_ratio=poison_masked(is_ratio, mask, poison), **kw,
        )
        assert_same(clean, clean_grad, dirty, dirty_grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_sequence_advantage_of_an_empty_sequence_is_never_read(backend):
    logits, ids, mask, adv, old, _, _ = batch(1)
    adv_seq = adv[:, 0].clone()
    clean, clean_grad = run(backend, logits, ids, adv_seq, mask, old_logps=old, loss_type="grpo")
    adv_seq[2] = float("nan")  # row 2 has no completion token
    dirty, dirty_grad = run(backend, logits, ids, adv_seq, mask, old_logps=old, loss_type="grpo")
    assert_same(clean, clean_grad, dirty, dirty_grad)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_masked_logit_rows_are_never_read(backend, poison):
    logits, ids, mask, adv, old, ref, _ = batch(2)
    clean, clean_grad = run(backend, logits, ids, adv, mask, old_logps=old, ref_logps=ref, beta=0.1)
    dirty_logits = torch.where(mask.unsqueeze(-1) != 0, logits, torch.full_like(logits, poison))
    dirty, dirty_grad = run(backend, dirty_logits, ids, adv, mask, old_logps=old, ref_logps=ref, beta=0.1)
    assert_same(clean, clean_grad, dirty, dirty_grad)
    assert (dirty_grad[mask == 0] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_never_reads_masked_hidden_states(backend):
    logits, ids, mask, adv, old, _, _ = batch(3)
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(B, T, H, generator=g)
    weight, bias = torch.randn(V, H, generator=g), torch.randn(V, generator=g)

    def go(h):
        h = h.clone().to(DEVICE).requires_grad_()
        w, b = weight.clone().to(DEVICE).requires_grad_(), bias.clone().to(DEVICE).requires_grad_()
        out = gk.fused_linear_grpo_loss(h, w, ids.to(DEVICE), adv.to(DEVICE), mask.to(DEVICE), bias=b,
                                        old_logps=old.to(DEVICE), backend=backend, chunk_size=4)
        out.loss.backward()
        return out, (h.grad, w.grad, b.grad)

    clean, clean_grads = go(hidden)
    dirty, dirty_grads = go(torch.where(mask.unsqueeze(-1) != 0, hidden, torch.full_like(hidden, float("nan"))))
    for c, d in zip(clean_grads, dirty_grads):
        assert torch.isfinite(d).all()
        torch.testing.assert_close(d, c, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(dirty.loss, clean.loss, rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("producer", [torch.tanh, torch.exp, torch.sigmoid])
def test_inplace_backward_on_a_saved_output_raises(backend, producer):
    """tanh / exp / sigmoid save their output for the backward: overwriting it must not pass silently."""
    logits, ids, mask, adv, *_ = batch(5)
    x = logits.clone().to(DEVICE).requires_grad_()
    out = gk.grpo_loss(producer(x), ids.to(DEVICE), adv.to(DEVICE), mask.to(DEVICE), backend=backend, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.loss.backward()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("fn", ["grpo_loss", "token_logprobs"])
def test_inplace_backward_twice_raises_and_once_is_exact(backend, fn):
    logits, ids, mask, adv, *_ = batch(6)
    x = logits.clone().to(DEVICE).requires_grad_()
    scaled = x * 1.5  # mul by a constant saves no output: in place is legitimate here
    if fn == "grpo_loss":
        loss = gk.grpo_loss(scaled, ids.to(DEVICE), adv.to(DEVICE), mask.to(DEVICE), backend=backend, inplace_backward=True).loss
    else:
        loss = gk.functional._logprobs_rows(scaled, ids.to(DEVICE), 1.0, -100, True, gk.backends.resolve(backend, x.device), True)[0].sum()
    loss.backward(retain_graph=True)
    x64 = logits.double().requires_grad_()
    if fn == "grpo_loss":
        gk.grpo_loss(x64.float() * 1.5, ids, adv, mask, backend="reference").loss.backward()
    else:
        torch.log_softmax(x64 * 1.5, -1).gather(-1, ids.unsqueeze(-1)).sum().backward()
    torch.testing.assert_close(x.grad.double().cpu(), x64.grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_loss_constants_get_no_gradient_on_any_backend(backend):
    """advantages, old/ref log-probs and is_ratio are constants of the loss (detached) everywhere."""
    logits, ids, mask, adv, old, ref, is_ratio = batch(7)
    consts = [t.clone().to(DEVICE).requires_grad_() for t in (adv, old, ref, is_ratio)]
    x = logits.clone().to(DEVICE).requires_grad_()
    out = gk.grpo_loss(x, ids.to(DEVICE), consts[0], mask.to(DEVICE), old_logps=consts[1], ref_logps=consts[2],
                       is_ratio=consts[3], beta=0.1, backend=backend)
    grads = torch.autograd.grad(out.loss, [x] + consts, allow_unused=True)
    assert grads[0] is not None and all(g is None for g in grads[1:])
    # with only the constants requiring grad, the loss has no graph on every backend
    out = gk.grpo_loss(logits.to(DEVICE), ids.to(DEVICE), consts[0], mask.to(DEVICE), backend=backend)
    assert not out.loss.requires_grad


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_double_backward_raises(backend):
    logits, ids, mask, adv, *_ = batch(8)
    x = logits.clone().to(DEVICE).requires_grad_()
    for loss in (
        gk.grpo_loss(x, ids.to(DEVICE), adv.to(DEVICE), mask.to(DEVICE), backend=backend).loss,
        gk.token_logprobs(x, ids.to(DEVICE), backend=backend).sum(),
    ):
        with pytest.raises(RuntimeError, match="first-order"):
            torch.autograd.grad(loss, x, create_graph=True)


def test_reference_supports_double_backward():
    logits, ids, mask, adv, *_ = batch(8)
    x = logits.clone().requires_grad_()
    (g,) = torch.autograd.grad(gk.grpo_loss(x, ids, adv, mask, backend="reference").loss, x, create_graph=True)
    assert g.requires_grad


BAD_SCALARS = [
    ("num_items_in_batch", np.int64(0), ValueError),
    ("num_items_in_batch", np.float64("nan"), ValueError),
    ("num_items_in_batch", torch.tensor(0.0), ValueError),
    ("num_items_in_batch", torch.tensor([3.0, 4.0]), ValueError),
    ("num_items_in_batch", "7", TypeError),
    ("num_items_in_batch", float("inf"), ValueError),
    ("eps_high", float("nan"), ValueError),
    ("eps_low", float("nan"), ValueError),
    ("beta", float("nan"), ValueError),
    ("beta", torch.tensor(0.1), TypeError),
    ("temperature", float("inf"), ValueError),
    ("temperature", float("nan"), ValueError),
    ("delta", float("inf"), ValueError),
    ("entropy_coef", "0.1", TypeError),
    ("max_completion_length", 0, ValueError),
    ("max_completion_length", 2.5, ValueError),
    ("loss_type", None, ValueError),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, value, error", BAD_SCALARS, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD_SCALARS)])
def test_bad_scalars_are_refused_by_name(backend, name, value, error):
    logits, ids, mask, adv, *_ = batch(9)
    with pytest.raises(error, match=name):
        gk.grpo_loss(logits, ids, adv, mask, backend=backend, **{name: value})


@pytest.mark.parametrize("backend", BACKENDS)
def test_numpy_and_tensor_counts_are_accepted(backend):
    logits, ids, mask, adv, *_ = batch(10)
    ref = gk.grpo_loss(logits, ids, adv, mask, backend=backend, num_items_in_batch=7).loss
    for n in (np.int64(7), np.float32(7), torch.tensor(7), torch.tensor([7.0])):
        torch.testing.assert_close(gk.grpo_loss(logits, ids, adv, mask, backend=backend, num_items_in_batch=n).loss, ref)


def test_misspelt_keywords_fail_at_construction():
    with pytest.raises(TypeError, match="betta"):
        gk.GRPOLoss(betta=0.1)
    with pytest.raises(ValueError, match="loss_type"):
        gk.FusedLinearGRPOLoss(loss_type="gpro")
    with pytest.raises(ValueError, match="backend"):
        gk.GRPOLoss(backend="tirton")
    with pytest.raises(TypeError, match="betta"):
        gk.grpo_loss(torch.randn(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), torch.ones(1), betta=0.1)


@pytest.mark.parametrize("order", ["kernels-then-variable", "triton-then-variable", "variable-then-kernels"])
def test_auto_backend_follows_the_state_triton_runs_in(order):
    """'auto' asks the decorated kernels (ours and Triton's own library) whether they are
    interpreted, not a variable set afterwards (e.g. after TRL imported Triton)."""
    script = textwrap.dedent(f"""
        import os
        os.environ.pop("TRITON_INTERPRET", None)
        if {order == "variable-then-kernels"!r}:
            os.environ["TRITON_INTERPRET"] = "1"
        if {order == "triton-then-variable"!r}:
            import triton.language  # another library imported Triton first
            os.environ["TRITON_INTERPRET"] = "1"  # too late for Triton's own tl.max, tl.sum...
        import torch
        import grpo_kernels as gk
        from grpo_kernels import backends
        from grpo_kernels.kernels import triton_rows
        if {order == "kernels-then-variable"!r}:
            os.environ["TRITON_INTERPRET"] = "1"  # too late: the kernels were compiled for a GPU
        chosen = backends.resolve("auto", torch.device("cpu")).name
        x = torch.randn(2, 3, 7)
        lp = gk.token_logprobs(x, torch.zeros(2, 3, dtype=torch.long))
        assert torch.allclose(lp, torch.log_softmax(x, -1)[..., 0], atol=1e-6)
        print(chosen)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    expected = "triton" if order == "variable-then-kernels" else "torch"
    assert result.stdout.strip().splitlines()[-1] == expected
