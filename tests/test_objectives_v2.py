"""Contract v2: TRL's other objectives (luspo, cispo, sapo, vespo), the bias-corrected KL, the new
clip metrics, and packed rows (``segment_ids``), on every backend, against the float64 spec."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, assert_close64
from grpo_cases import build_kwargs, make_batch
from spec64 import grpo64

import grpo_kernels as gk

BACKENDS = ["reference", "torch", "triton"]
ALL_LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"]

CASES = {
    "on_policy": dict(),
    "old_ref_beta": dict(use_old=True, use_ref=True, beta=0.04),
    "bias_corrected_kl": dict(use_old=True, use_ref=True, beta=0.1, use_bias_correction_kl=True),
    "is_ratio": dict(use_old=True, use_is=True),
    "is_ratio_per_sequence": dict(use_old=True, use_is="column"),
    "per_token_adv": dict(use_old=True, adv_per_token=True, entropy_coef=0.01),
    "gspo": dict(use_old=True, use_ref=True, beta=0.02, importance_sampling_level="sequence"),
    "params": dict(use_old=True, eps_high=0.28, sapo_temperature_pos=0.7, sapo_temperature_neg=1.3,
                   vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.0, vespo_lambda_neg=1.0),
}


def run(logits, ids, advantages, mask, backend, **kw):
    x = logits.detach().clone().to(DEVICE).requires_grad_()
    kw = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    out = gk.grpo_loss(x, ids.to(DEVICE), advantages.to(DEVICE), mask.to(DEVICE), backend=backend, **kw)
    out.loss.backward()
    return out, x.grad


def check_against_spec(out, grad, logits, ids, advantages, mask, kw, dtype=torch.float32):
    x64 = logits.double().requires_grad_()
    loss64, logp64, metrics64 = grpo64(x64, ids, advantages, mask, **kw)
    loss64.backward()
    assert_close64(out.loss, loss64, what="loss")
    assert_close64(out.per_token_logps, logp64, scale=10, what="per_token_logps")
    assert_close64(grad, x64.grad, dtype, scale=(0.1 if dtype == torch.float32 else 1e-3) * x64.grad.abs().max().item(), what="grad")
    assert set(out.metrics) == set(metrics64)
    for name, value in metrics64.items():
        assert_close64(out.metrics[name], value, what=name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_type", ["luspo", "cispo", "sapo", "vespo"])
@pytest.mark.parametrize("case", list(CASES))
def test_trl_objectives_match_float64(backend, loss_type, case):
    batch = make_batch(200 + list(CASES).index(case), V=131)
    logits, ids, mask = batch[:3]
    advantages, kw = build_kwargs(CASES[case], batch)
    kw["loss_type"] = loss_type
    if loss_type == "cispo":
        kw["eps_high"] = 1.3  # cispo's cap on the ratio (ScaleRL recommends 5; 1.3 makes it bind here)
    out, grad = run(logits, ids, advantages, mask, backend, **kw)
    check_against_spec(out, grad, logits, ids, advantages, mask, kw)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_bias_corrected_kl_and_clip_extremes(backend, loss_type):
    batch = make_batch(17, dtype=torch.bfloat16, V=131)
    logits, ids, mask = batch[:3]
    advantages, kw = build_kwargs(CASES["bias_corrected_kl"], batch)
    kw.update(loss_type=loss_type, eps_high=0.28, delta=1.6)
    out, grad = run(logits, ids, advantages, mask, backend, **kw)
    check_against_spec(out, grad, logits, ids, advantages, mask, kw, dtype=torch.bfloat16)
    assert out.metrics["clip_ratio/high_max"] >= out.metrics["clip_ratio/high_mean"] >= 0
    assert 0 <= out.metrics["clip_ratio/low_min"] <= out.metrics["clip_ratio/low_mean"] + 1e-6


def pack(batch_tensors, mask, lengths_per_row):
    """Pack the rows of a padded [B, T] batch into fewer rows: returns packed tensors and segment ids.

    ``lengths_per_row`` lists, for each packed row, which padded rows go into it (in order)."""
    b, t = mask.shape
    width = max(sum(t for _ in rows) for rows in lengths_per_row)
    packed = []
    for x in batch_tensors:
        shape = (len(lengths_per_row), width) + tuple(x.shape[2:])
        packed.append(torch.zeros(shape, dtype=x.dtype))
    seg = torch.full((len(lengths_per_row), width), -1, dtype=torch.long)
    pmask = torch.zeros(len(lengths_per_row), width)
    for r, rows in enumerate(lengths_per_row):
        pos = 0
        for s, src in enumerate(rows):
            for x, p in zip(batch_tensors, packed):
                p[r, pos:pos + t] = x[src]
            seg[r, pos:pos + t] = 10 * s + 3  # any ids: only equality within a row matters
            pmask[r, pos:pos + t] = mask[src]
            pos += t
    return packed, pmask, seg


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_type", ALL_LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_packed_rows_equal_the_padded_batch(backend, loss_type, level):
    """segment_ids: several sequences per row give the padded batch's loss, gradients and metrics."""
    g = torch.Generator().manual_seed(5)
    b, t, v = 4, 6, 37
    logits = torch.randn(b, t, v, generator=g) * 2
    ids = torch.randint(0, v, (b, t), generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.3).float()
    mask[:, 0] = 1  # every sequence keeps a token (an all-masked sequence does not exist when packed)
    adv = torch.randn(b, generator=g).unsqueeze(-1).expand(b, t).contiguous()
    old = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0] + 0.3 * torch.randn(b, t, generator=g)
    ref = old + 0.2 * torch.randn(b, t, generator=g)
    is_ratio = torch.rand(b, t, generator=g) + 0.5
    kw = dict(loss_type=loss_type, beta=0.05, importance_sampling_level=level, eps_high=0.28, max_completion_length=t,
              use_bias_correction_kl=loss_type == "dapo")
    padded, padded_grad = run(logits, ids, adv, mask, backend, old_logps=old, ref_logps=ref, is_ratio=is_ratio, **kw)

    layout = [[0, 2], [1], [3]]
    (p_logits, p_ids, p_adv, p_old, p_ref, p_is), p_mask, seg = pack([logits, ids, adv, old, ref, is_ratio], mask, layout)
    p_mask[2, t:] = 0  # row 2 has one sequence and trailing padding
    p_ids[1, t:] = 10**6  # padding ids are never read
    p_old[1, t:] = float("nan")
    packed, packed_grad = run(p_logits, p_ids, p_adv, p_mask, backend, old_logps=p_old, ref_logps=p_ref, is_ratio=p_is,
                              segment_ids=seg, **kw)
    assert_close64(packed.loss, padded.loss.double(), what="loss")
    for r, rows in enumerate(layout):
        for s, src in enumerate(rows):
            got = packed_grad[r, s * t:(s + 1) * t]
            assert_close64(got, padded_grad[src].double(), scale=0.1 * padded_grad.abs().max().item(), what="grad")
            assert_close64(packed.per_token_logps[r, s * t:(s + 1) * t], padded.per_token_logps[src].double(), what="logp")
    assert set(packed.metrics) == set(padded.metrics)
    for name in padded.metrics:
        assert_close64(packed.metrics[name], padded.metrics[name].double(), what=name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "vespo"])
def test_packed_rows_match_float64_spec(backend, loss_type):
    g = torch.Generator().manual_seed(8)
    b, t, v = 2, 9, 29
    logits = torch.randn(b, t, v, generator=g)
    ids = torch.randint(0, v, (b, t), generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.2).float()
    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2], [5, 5, 5, 5, 5, 7, 7, 7, 7]])
    adv = torch.randn(b, t, generator=g)
    old = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0] + 0.3 * torch.randn(b, t, generator=g)
    kw = dict(loss_type=loss_type, old_logps=old, segment_ids=seg, importance_sampling_level="sequence")
    out, grad = run(logits, ids, adv, mask, backend, **kw)
    check_against_spec(out, grad, logits, ids, adv, mask, kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_takes_segment_ids(backend):
    g = torch.Generator().manual_seed(9)
    b, t, h, v = 2, 8, 5, 23
    hidden, weight = torch.randn(b, t, h, generator=g), torch.randn(v, h, generator=g)
    ids = torch.randint(0, v, (b, t), generator=g)
    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [4, 4, 4, 4, 4, 4, 4, 4]])
    adv = torch.randn(b, t, generator=g)
    kw = dict(loss_type="grpo", segment_ids=seg, importance_sampling_level="sequence")
    hl = hidden.clone().requires_grad_()
    out = gk.fused_linear_grpo_loss(hl.to(DEVICE), weight.to(DEVICE), ids.to(DEVICE), adv.to(DEVICE), backend=backend,
                                    **{k: (x.to(DEVICE) if isinstance(x, torch.Tensor) else x) for k, x in kw.items()})
    out.loss.backward()
    h64 = hidden.double().requires_grad_()
    loss64, _, _ = grpo64(h64 @ weight.double().T, ids, adv, None, **kw)
    loss64.backward()
    assert_close64(out.loss, loss64, what="loss")
    assert_close64(hl.grad, h64.grad, scale=0.1 * h64.grad.abs().max().item(), what="grad hidden")


def test_segment_ids_are_validated():
    logits, ids, adv = torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), torch.randn(2, 3)
    with pytest.raises(ValueError, match="segment_ids"):
        gk.grpo_loss(logits, ids, adv, segment_ids=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="segment_ids"):
        gk.grpo_loss(logits, ids, adv, segment_ids=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="advantages"):
        gk.grpo_loss(logits, ids, adv[:, 0], segment_ids=torch.zeros(2, 3, dtype=torch.long))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "vespo"])
def test_packed_row_without_loss_tokens(backend, loss_type):
    """A packed micro-batch whose sequences have no loss token (a trainer's filler, a masked-out
    truncated completion alone in its row): loss 0, zero gradient, finite metrics."""
    logits = torch.randn(1, 6, 11).to(DEVICE).requires_grad_()
    ids = torch.randint(0, 11, (1, 6)).to(DEVICE)
    out = gk.grpo_loss(logits, ids, torch.randn(1, 6).to(DEVICE), torch.zeros(1, 6).to(DEVICE), backend=backend,
                       loss_type=loss_type, segment_ids=torch.tensor([[0, 0, 0, 1, 1, 1]]).to(DEVICE),
                       importance_sampling_level="sequence")
    out.loss.backward()
    assert out.loss.item() == 0 and (logits.grad == 0).all()
    assert all(torch.isfinite(v) or k.endswith(("_min", "_max")) for k, v in out.metrics.items())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_type", ALL_LOSS_TYPES)
def test_fused_linear_gradient_in_forward_every_objective(backend, loss_type):
    """The fused-linear path (gradient formed in the forward for token-local objectives, recomputed
    for vespo) with packed rows, soft-capping and the bias-corrected KL, against float64."""
    g = torch.Generator().manual_seed(11)
    b, t, h, v = 2, 7, 5, 23
    hidden, weight = torch.randn(b, t, h, generator=g), torch.randn(v, h, generator=g) * 2
    ids = torch.randint(0, v, (b, t), generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.2).float()
    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [3, 3, 3, 3, 3, 3, 3]])
    adv = torch.randn(b, t, generator=g)
    logp_now = torch.log_softmax(10.0 * torch.tanh(hidden @ weight.T / 10.0), -1).gather(-1, ids[..., None])[..., 0]
    old = logp_now + 0.3 * torch.randn(b, t, generator=g)
    ref = logp_now + 0.2 * torch.randn(b, t, generator=g)
    kw = dict(loss_type=loss_type, old_logps=old, ref_logps=ref, beta=0.05, use_bias_correction_kl=True, softcap=10.0,
              segment_ids=seg, eps_high=1.3 if loss_type == "cispo" else 0.28, entropy_coef=0.01)
    hl, wl = hidden.clone().to(DEVICE).requires_grad_(), weight.clone().to(DEVICE).requires_grad_()
    out = gk.fused_linear_grpo_loss(hl, wl, ids.to(DEVICE), adv.to(DEVICE), mask.to(DEVICE), backend=backend, chunk_size=4,
                                    **{k: (x.to(DEVICE) if isinstance(x, torch.Tensor) else x) for k, x in kw.items()})
    (out.loss * 2.5).backward()  # an incoming gradient other than 1
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    loss64, _, metrics64 = grpo64(h64 @ w64.T, ids, adv, mask, **kw)
    (loss64 * 2.5).backward()
    assert_close64(out.loss, loss64, what="loss")
    assert_close64(hl.grad, h64.grad, scale=0.1 * h64.grad.abs().max().item(), what="grad hidden")
    assert_close64(wl.grad, w64.grad, scale=0.1 * w64.grad.abs().max().item(), what="grad weight")
    for name, value in metrics64.items():
        assert_close64(out.metrics[name], value, what=name)
