"""Final-logit soft-capping (Gemma-2/3) and logit scale (Cohere), with their gradients, on every
backend and the fused-linear path, against float64."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, assert_close64
from spec64 import grpo64, logprobs64

import grpo_kernels as gk

BACKENDS = ["reference", "torch", "triton"]
TRANSFORMS = [dict(softcap=30.0), dict(softcap=5.0, temperature=0.7), dict(logit_scale=0.0625), dict(softcap=8.0, logit_scale=2.5, temperature=1.3)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("transform", TRANSFORMS, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_token_logprobs_with_transform(backend, dtype, transform):
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(3, 5, 257, generator=g) * 12).to(dtype)  # large enough for the cap to bend
    ids = torch.randint(0, 257, (3, 5), generator=g)
    ids[1, 2] = -100
    x = logits.clone().to(DEVICE).requires_grad_()
    lp, ent = gk.token_logprobs(x, ids.to(DEVICE), return_entropy=True, backend=backend, **transform)
    w = torch.randn(3, 5, generator=g)
    (lp * w.to(DEVICE) + ent).sum().backward()
    x64 = logits.double().requires_grad_()
    lp64, ent64 = logprobs64(x64, ids, **transform)
    (lp64 * w.double() + ent64).sum().backward()
    assert_close64(lp, lp64, scale=10, what="logp")
    assert_close64(ent, ent64, scale=10, what="entropy")
    assert_close64(x.grad, x64.grad, dtype, scale=0.1 * x64.grad.abs().max().item(), what="grad")
    assert (x.grad[1, 2] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_grpo_loss_with_softcap(backend, loss_type):
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 6, 101, generator=g) * 10
    ids = torch.randint(0, 101, (2, 6), generator=g)
    adv, old = torch.randn(2, generator=g), torch.randn(2, 6, generator=g) * 0.2 - 4
    kw = dict(loss_type=loss_type, old_logps=old, softcap=15.0, logit_scale=0.8, temperature=0.9, entropy_coef=0.01)
    x = logits.clone().to(DEVICE).requires_grad_()
    out = gk.grpo_loss(x, ids.to(DEVICE), adv.to(DEVICE), backend=backend, **{k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()})
    out.loss.backward()
    x64 = logits.double().requires_grad_()
    loss64, _, _ = grpo64(x64, ids, adv, None, **kw)
    loss64.backward()
    assert_close64(out.loss, loss64, what="loss")
    assert_close64(x.grad, x64.grad, scale=0.1 * x64.grad.abs().max().item(), what="grad")


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_with_softcap(backend):
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(2, 7, 8, generator=g), torch.randn(61, 8, generator=g) * 3
    ids = torch.randint(0, 61, (2, 7), generator=g)
    h = hidden.clone().to(DEVICE).requires_grad_()
    w = weight.clone().to(DEVICE).requires_grad_()
    lp, ent = gk.fused_linear_token_logprobs(h, w, ids.to(DEVICE), softcap=10.0, logit_scale=1.5, return_entropy=True,
                                             chunk_size=5, backend=backend)
    (lp + ent).sum().backward()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    lp64, ent64 = logprobs64(h64 @ w64.T, ids, softcap=10.0, logit_scale=1.5)
    (lp64 + ent64).sum().backward()
    assert_close64(lp, lp64, scale=10, what="logp")
    assert_close64(h.grad, h64.grad, scale=0.1 * h64.grad.abs().max().item(), what="grad hidden")
    assert_close64(w.grad, w64.grad, scale=0.1 * w64.grad.abs().max().item(), what="grad weight")


@pytest.mark.parametrize("name, value", [("softcap", 0.0), ("softcap", -1.0), ("softcap", float("inf")), ("logit_scale", 0.0), ("logit_scale", float("nan"))])
def test_bad_transforms_are_refused(name, value):
    with pytest.raises(ValueError, match=name):
        gk.token_logprobs(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), **{name: value})
    with pytest.raises(ValueError, match=name):
        gk.GRPOLoss(**{name: value})
