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


# --------------------------------------------------------------------------------------------------
# a frozen head (LoRA, no_grad): the fused-linear Functions walk the vocabulary in blocks
# --------------------------------------------------------------------------------------------------
def _tiny_tiles(monkeypatch):
    """Blocks of 30 elements (7 columns for a chunk of 4 rows: V = 157 is 22 blocks and one of 3), and
    no chunk of [c, V] logits allowed (the row path's chunks raise), every float allocation NaN-poisoned."""
    from grpo_kernels import autograd as ga
    from grpo_kernels.kernels import torch_rows
    from helpers import poison_allocations

    monkeypatch.setattr(torch_rows, "TILE_ELEMENTS", {"cpu": 30, "other": 30})
    monkeypatch.setattr(torch_rows, "MIN_TILE_COLUMNS", 1)

    def no_row_chunk(*args, **kwargs):
        raise AssertionError("a frozen head formed a chunk's whole [c, V] logits")

    monkeypatch.setattr(ga, "_logit_chunks", no_row_chunk)
    poison_allocations(monkeypatch)


def _frozen_head(seed: int, n_rows: int, vocab: int = 157, width: int = 12):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, n_rows, width, generator=g)
    weight = torch.randn(vocab, width, generator=g) / width**0.5 * torch.linspace(0.5, 3.0, vocab).unsqueeze(-1)
    bias = torch.randn(vocab, generator=g) * 0.5
    ids = torch.randint(0, vocab, (1, n_rows), generator=g)
    return hidden, weight, bias, ids, g


@pytest.mark.parametrize("transform", [dict(temperature=0.8), dict(softcap=4.0, logit_scale=1.5, temperature=1.2),
                                       dict(logit_scale=0.7)], ids=["temperature", "softcap", "scale"])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_frozen_head_grpo_loss_in_vocabulary_blocks_matches_float64(monkeypatch, transform, loss_type):
    """fused_linear_grpo_loss with a frozen weight and bias (torch backend): loss, log-probs, entropy
    metric and d hidden against float64 through the whole logits; an entropy bonus (d H / d h), a KL,
    masked tokens, chunks of 4 rows over 9 (the last of 1)."""
    from spec64 import grpo64

    hidden, weight, bias, ids, g = _frozen_head(7, 9)
    mask = torch.ones(1, 9)
    mask[0, 3] = 0
    logits64 = hidden.double() @ weight.double().T + bias.double()
    logp64 = torch.log_softmax(logits64, -1).gather(-1, ids[..., None])[..., 0]
    old = (logp64 + 0.2 * torch.randn(1, 9, generator=g, dtype=torch.float64)).float()
    ref = (logp64 + 0.2 * torch.randn(1, 9, generator=g, dtype=torch.float64)).float()
    adv = torch.randn(1, generator=g)
    kw = dict(old_logps=old, ref_logps=ref, beta=0.04, entropy_coef=0.05, loss_type=loss_type, **transform)
    _tiny_tiles(monkeypatch)
    h = hidden.clone().requires_grad_()
    out = gk.fused_linear_grpo_loss(h, weight, ids, adv, mask, bias=bias, chunk_size=4, backend="torch", **kw)
    out.loss.backward()
    h64 = hidden.double().requires_grad_()
    loss64, lp64, metrics64 = grpo64(h64 @ weight.double().T + bias.double(), ids, adv, mask, **kw)
    loss64.backward()
    from helpers import assert_close64

    assert_close64(out.loss, loss64, what="loss")
    assert_close64(out.per_token_logps, lp64, scale=5, what="logps")
    assert_close64(out.metrics["entropy"], metrics64["entropy"], what="entropy")
    assert_close64(h.grad, h64.grad, scale=0.1 * h64.grad.abs().max().item(), what="grad hidden")
    assert h.grad[0, 3].abs().max() == 0


@pytest.mark.parametrize("n_rows, dtype", [(1, torch.float32), (9, torch.float32), (9, torch.bfloat16)], ids=str)
def test_frozen_head_logprobs_in_vocabulary_blocks_match_float64(monkeypatch, n_rows, dtype):
    """fused_linear_token_logprobs with a frozen head: the forward's statistics (log-prob, entropy, sum of
    squared probabilities) and the backward's d hidden (the vocabulary in blocks again, each block's
    targets local to it) against float64; a per-row temperature, a soft cap, an ignored row; one row;
    bf16 (the reference's logits rounded to bf16 as the head's are, d hidden back in bf16)."""
    from helpers import assert_close64
    from spec64 import logprobs64

    hidden, weight, bias, ids, g = _frozen_head(n_rows + 3, n_rows)
    hidden, weight, bias = hidden.to(dtype), weight.to(dtype), bias.to(dtype)
    if n_rows > 1:
        ids[0, 4] = -100
    temperature = 0.6 + torch.rand(1, n_rows, generator=g)
    g_logp, g_ent = torch.randn(1, n_rows, generator=g), torch.randn(1, n_rows, generator=g)
    kw = dict(softcap=5.0, logit_scale=1.3)
    _tiny_tiles(monkeypatch)
    h = hidden.clone().requires_grad_()
    logp, ent, sum_sq = gk.fused_linear_token_logprobs(h, weight, ids, bias=bias, return_entropy=True,
                                                       return_sum_probs_sq=True, chunk_size=4, temperature=temperature,
                                                       backend="torch", **kw)
    ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
    h64 = hidden.double().requires_grad_()
    logits64 = h64 @ weight.double().T + bias.double()
    if dtype != torch.float32:
        logits64 = logits64 + (logits64.to(dtype).double() - logits64).detach()
    t64 = temperature.double()[..., None]
    lp64, ent64 = logprobs64(logits64, ids, t64, **kw)
    ((lp64 * g_logp.double()).sum() + (ent64 * g_ent.double()).sum()).backward()
    z64 = 5.0 * torch.tanh(logits64.detach() * 1.3 / 5.0) / t64
    sq64 = torch.where(ids != -100, torch.softmax(z64, -1).square().sum(-1), torch.zeros((), dtype=torch.float64))
    value = torch.float32 if dtype == torch.float32 else torch.bfloat16
    assert_close64(logp, lp64, value, scale=5, what="logp")
    assert_close64(ent, ent64, value, scale=5, what="entropy")
    assert_close64(sum_sq, sq64, value, what="sum p^2")
    assert h.grad.dtype == dtype
    assert_close64(h.grad, h64.grad, dtype, scale=0.1 * h64.grad.abs().max().item(), what="grad hidden")


def test_frozen_head_with_truncation_keeps_the_row_path(monkeypatch):
    """top_k / top_p need the whole row's order: a frozen head keeps the chunks of rows for them."""
    from grpo_kernels.kernels import torch_rows
    from helpers import assert_close64

    def refuse(*args, **kwargs):
        raise AssertionError("the vocabulary was tiled under a truncation")

    monkeypatch.setattr(torch_rows, "frozen_head_rows", refuse)
    hidden, weight, _, ids, _ = _frozen_head(5, 6)
    h = hidden.clone().requires_grad_()
    logp = gk.fused_linear_token_logprobs(h, weight, ids, top_k=20, chunk_size=4, backend="torch")
    logp.sum().backward()
    want = gk.token_logprobs(hidden @ weight.T, ids, top_k=20, backend="reference")
    assert_close64(logp, want.double(), scale=5, what="logp")
    assert torch.isfinite(h.grad).all()
