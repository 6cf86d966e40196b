"""fused_linear_token_logprobs / fused_linear_grpo_loss against float64, on both kernel backends.

Gradients w.r.t. hidden, weight and bias; fp32 and bf16; every loss type; chunk sizes that do and
do not divide the number of tokens; tied embeddings; a frozen head.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, assert_close64
from spec64 import grpo64, logprobs64

import grpo_kernels as gk
from grpo_kernels import autograd as ga

B, T, H, V = 3, 5, 24, 157  # N = 15 tokens


def make_inputs(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) / H**0.5 * 3).to(dtype)
    bias = (torch.randn(V, generator=g) * 0.5).to(dtype)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.2).float()
    mask[2] = 0
    logits64 = hidden.double() @ weight.double().T + bias.double()
    logp64 = torch.log_softmax(logits64, -1).gather(-1, ids[..., None])[..., 0]
    old = (logp64 + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    ref = (logp64 + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    adv = torch.randn(B, generator=g)
    return hidden, weight, bias, ids, mask, old, ref, adv


def leaves(*tensors):
    return [t.detach().clone().to(DEVICE).requires_grad_() for t in tensors]


def leaves64(*tensors):
    return [t.detach().double().requires_grad_() for t in tensors]


def grad_tol(dtype, expected):
    """Absolute scale for gradients that come out of a matmul: their rounding error is relative to
    the sum of |terms|, so to the largest entry, not to each (possibly cancelled) entry."""
    return (0.1 if dtype == torch.float32 else 1.0) * expected.abs().max().item()


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("chunk_size", [4, 5, 64])  # 4 does not divide N = 15, 5 does, 64 > N
def test_fused_linear_grpo_loss_matches_float64(backend, dtype, loss_type, chunk_size):
    hidden, weight, bias, ids, mask, old, ref, adv = make_inputs(chunk_size, dtype)
    kw = dict(old_logps=old, ref_logps=ref, beta=0.04, entropy_coef=0.01, temperature=0.8, loss_type=loss_type, eps_high=0.28)
    h, w, b = leaves(hidden, weight, bias)
    out = gk.fused_linear_grpo_loss(
        h, w, ids.to(DEVICE), adv.to(DEVICE), mask.to(DEVICE), bias=b, chunk_size=chunk_size, backend=backend,
        **{k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()},
    )
    out.loss.backward()
    h64, w64, b64 = leaves64(hidden, weight, bias)
    loss64, logp64, metrics64 = grpo64(h64 @ w64.T + b64, ids, adv, mask, **kw)
    loss64.backward()
    # bf16: the logits themselves are rounded to bf16 after the matmul, as in any bf16 lm_head
    value_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
    assert_close64(out.loss, loss64, value_dtype, what="loss")
    assert_close64(out.per_token_logps, logp64, value_dtype, scale=5, what="logps")
    for name, got, want in (("hidden", h.grad, h64.grad), ("weight", w.grad, w64.grad), ("bias", b.grad, b64.grad)):
        assert got.dtype == dtype, name
        assert_close64(got, want, dtype, scale=grad_tol(dtype, want), what=f"grad {name}")
    for name in ("kl", "entropy"):
        assert_close64(out.metrics[name], metrics64[name], value_dtype, what=name)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_fused_linear_token_logprobs_and_entropy(backend):
    hidden, weight, bias, ids, *_ = make_inputs(1)
    ids[0, 1] = -100
    h, w = leaves(hidden, weight)
    logp, ent = gk.fused_linear_token_logprobs(h, w, ids.to(DEVICE), return_entropy=True, chunk_size=4, temperature=1.3, backend=backend)
    (logp.sum() + 0.5 * ent.sum()).backward()
    h64, w64 = leaves64(hidden, weight)
    lp64, ent64 = logprobs64(h64 @ w64.T, ids, 1.3)
    (lp64.sum() + 0.5 * ent64.sum()).backward()
    assert_close64(logp, lp64, scale=5, what="logp")
    assert_close64(ent, ent64, scale=5, what="entropy")
    assert_close64(h.grad, h64.grad, scale=grad_tol(torch.float32, h64.grad), what="grad hidden")
    assert_close64(w.grad, w64.grad, scale=grad_tol(torch.float32, w64.grad), what="grad weight")
    assert logp[0, 1] == 0 and h.grad[0, 1].abs().max() == 0


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_tied_embeddings_gradients_add_up(backend):
    """lm_head.weight is also the input embedding: both gradients land on the one parameter."""
    hidden, weight, _, ids, mask, old, _, adv = make_inputs(2)
    ids_in = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))

    def run(w, loss_fn):
        h = torch.tanh(torch.nn.functional.embedding(ids_in.to(w.device), w) + hidden.to(w.device, w.dtype))
        return loss_fn(h, w)

    w = weight.clone().to(DEVICE).requires_grad_()
    on_device = [t.to(DEVICE) for t in (ids, adv, mask, old)]
    run(w, lambda h, w_: gk.fused_linear_grpo_loss(
        h, w_, on_device[0], on_device[1], on_device[2], old_logps=on_device[3], chunk_size=4, backend=backend).loss
    ).backward()
    w64 = weight.double().requires_grad_()
    run(w64, lambda h, w_: grpo64(h @ w_.T, ids, adv, mask, old_logps=old)[0]).backward()
    assert_close64(w.grad, w64.grad, scale=grad_tol(torch.float32, w64.grad), what="tied weight grad")


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_frozen_head_gets_no_weight_gradient(backend, monkeypatch):
    hidden, weight, bias, ids, mask, old, _, adv = make_inputs(3)
    calls = []
    monkeypatch.setattr(ga, "_accumulate_weight_grad", lambda *a: calls.append(1))
    h = hidden.clone().to(DEVICE).requires_grad_()
    w, b, ids_d, adv_d, mask_d, old_d = (t.to(DEVICE) for t in (weight, bias, ids, adv, mask, old))
    out = gk.fused_linear_grpo_loss(h, w, ids_d, adv_d, mask_d, bias=b, old_logps=old_d, chunk_size=4, backend=backend)
    out.loss.backward()
    assert w.grad is None and not calls and h.grad is not None
    h64 = hidden.double().requires_grad_()
    grpo64(h64 @ weight.double().T + bias.double(), ids, adv, mask, old_logps=old)[0].backward()
    assert_close64(h.grad, h64.grad, scale=grad_tol(torch.float32, h64.grad), what="grad hidden")


def test_no_grad_does_no_gradient_work():
    """Under no_grad (old and reference log-probs) nothing is saved for a backward."""
    hidden, weight, _, ids, *_ = make_inputs(4)
    w = weight.clone().requires_grad_()
    with torch.no_grad():
        logp = gk.fused_linear_token_logprobs(hidden, w, ids, chunk_size=4, backend="torch")
    assert logp.grad_fn is None and not logp.requires_grad
    assert_close64(logp, logprobs64(hidden.double() @ weight.double().T, ids)[0], scale=5, what="logp")


def test_default_chunk_size_is_bounded():
    n = ga.default_chunk_size(151936, 4096, torch.bfloat16, torch.device("cuda"))
    assert 16 <= n <= 1024 and n & (n - 1) == 0
    assert ga.default_chunk_size(32000, 512, torch.float32, torch.device("cpu")) * 32000 * 8 <= 64 * 2**20


def test_peak_memory_is_flat_in_tokens():
    """Extra memory of forward + backward is bounded by the chunk, not by N (CPU profiler)."""
    from grpo_kernels.profiling import cpu_peak_extra_bytes

    def peak_extra(n_tokens, fn):
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(1, n_tokens, 32, generator=g, requires_grad=True)
        weight = torch.randn(2000, 32, generator=g, requires_grad=True)
        ids = torch.randint(0, 2000, (1, n_tokens), generator=g)
        adv = torch.randn(1, generator=g)
        return cpu_peak_extra_bytes(lambda: fn(hidden, weight, ids, adv).loss.backward())[0]

    def fused(h, w, i, a):
        return gk.fused_linear_grpo_loss(h, w, i, a, chunk_size=256, backend="torch")

    def reference(h, w, i, a):
        return gk.fused_linear_grpo_loss(h, w, i, a, backend="reference")

    small, large = peak_extra(2048, fused), peak_extra(4096, fused)
    ref_small, ref_large = peak_extra(2048, reference), peak_extra(4096, reference)
    hidden_bytes = 2048 * 32 * 4  # the extra hidden rows and their gradient, per doubling
    assert large - small <= 4 * hidden_bytes + 2**20, (small, large)
    assert ref_large - ref_small > 2048 * 2000 * 4  # the reference grows with N * V
    assert large * 8 <= ref_large, (large, ref_large)
