"""grpo_kernels.autograd: the Functions bind forward to backward without going silently wrong: an
in-place gradient over a saved or aliased output raises (and is exact where it is legitimate), the
loss's constants get no gradient, and a double backward raises (the kernels are first-order).
Each case runs on every backend it concerns; the Triton one through the interpreter on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from helpers import BACKENDS, DEVICE, KERNEL_BACKENDS, B, T, V, batch

import grpo_kernels as gk


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("producer", [torch.tanh, torch.exp, torch.sigmoid])
def test_inplace_backward_on_a_saved_output_raises(backend, producer):
    """tanh / exp / sigmoid save their output for the backward: overwriting it must not pass silently."""
    logits, ids, mask, adv, *_ = batch(5)
    x = logits.clone().to(DEVICE).requires_grad_()
    out = gk.grpo_loss(producer(x), ids.to(DEVICE), adv.to(DEVICE), mask.to(DEVICE), backend=backend, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.loss.backward()


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
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


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_double_backward_raises(backend):
    logits, ids, mask, adv, *_ = batch(8)
    x = logits.clone().to(DEVICE).requires_grad_()
    for loss in (
        gk.grpo_loss(x, ids.to(DEVICE), adv.to(DEVICE), mask.to(DEVICE), backend=backend).loss,
        gk.token_logprobs(x, ids.to(DEVICE), backend=backend).sum(),
    ):
        with pytest.raises(RuntimeError, match="first-order"):
            torch.autograd.grad(loss, x, create_graph=True)


def _aliased_views():
    base = torch.randn(1, T, V)
    wide = torch.randn(B * T * V)
    yield "expand over B", base.expand(B, T, V)
    yield "expand over T", torch.randn(B, 1, V).expand(B, T, V)
    yield "rows that overlap", wide.as_strided((B, T, V), (T * 2, 2, 1))  # row stride 2 < V
    yield "a broadcast row", torch.randn(V).expand(B, T, V)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_inplace_backward_refuses_logits_whose_elements_alias(backend):
    """The Triton backward wrote every row's gradient into the one row an expand()ed view has: any
    layout whose elements alias is refused with inplace_backward (out of place it is fine)."""
    _, ids, mask, adv, *_ = batch(11)
    ids, mask, adv = ids.to(DEVICE), mask.to(DEVICE), adv.to(DEVICE)
    for what, view in _aliased_views():
        x = view.to(DEVICE) if DEVICE == "cpu" else view.contiguous().to(DEVICE).as_strided(view.shape, view.stride())
        with pytest.raises(ValueError, match="logits .*share memory"):
            gk.grpo_loss(x, ids, adv, mask, backend=backend, inplace_backward=True)
        if what == "expand over B":
            leaf = torch.randn(1, device=DEVICE, requires_grad=True)
            out = gk.grpo_loss(x * leaf, ids, adv, mask, backend=backend)  # out of place: a gradient, finite
            out.loss.backward()
            assert torch.isfinite(leaf.grad).all(), what
    # logits that share memory with a tensor the loss reads: old_logps inside the logits' storage
    storage = torch.randn(B * T * V + B * T, device=DEVICE)
    logits, old = storage[: B * T * V].view(B, T, V), storage[B * T * V - 1 : B * T * V - 1 + B * T].view(B, T)
    with pytest.raises(ValueError, match="logits shares memory with old_logps"):
        gk.grpo_loss(logits, ids, adv, mask, backend=backend, inplace_backward=True, old_logps=old)
    gk.grpo_loss(logits, ids, adv, mask, backend=backend, inplace_backward=True, old_logps=storage[B * T * V:].view(B, T))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_inplace_backward_on_a_strided_view_is_exact(backend):
    """A view that does not alias (a slice of a larger tensor) still takes its gradient in place."""
    logits, ids, mask, adv, *_ = batch(12)
    big = torch.randn(B, T + 2, V)
    big[:, 1:-1] = logits
    results = []
    for inplace in (False, True):
        leaf = big.clone().to(DEVICE).requires_grad_()
        view = leaf * 1.0  # a non-leaf the gradient may overwrite
        out = gk.grpo_loss(view[:, 1:-1], ids.to(DEVICE), adv.to(DEVICE), mask.to(DEVICE), backend=backend,
                           inplace_backward=inplace)
        out.loss.backward()
        results.append(leaf.grad)
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sum_of_squares_is_detached_and_chunks_agree(backend):
    """The sum of squared probabilities carries no gradient; the fused-linear function's chunks (with a
    per-token temperature and a truncation) give the unchunked values."""
    g = torch.Generator().manual_seed(12)
    hidden = torch.randn(2, 5, 4, generator=g).requires_grad_()
    weight = torch.randn(19, 4, generator=g).requires_grad_()
    targets = torch.randint(0, 19, (2, 5), generator=g)
    temperature = torch.rand(2, 5, generator=g, dtype=torch.float64) + 0.5
    outs = [gk.fused_linear_token_logprobs(hidden, weight, targets, temperature=temperature, top_k=6, top_p=0.9,
                                           return_sum_probs_sq=True, chunk_size=chunk, backend=backend)
            for chunk in (3, 10)]
    assert not outs[0][1].requires_grad
    for a, b in zip(*outs):
        assert torch.equal(torch.isinf(a), torch.isinf(b))
        torch.testing.assert_close(torch.where(torch.isfinite(a), a, 0), torch.where(torch.isfinite(b), b, 0))
