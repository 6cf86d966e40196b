"""grpo_kernels/kernels/torch_rows.py: the truncation's candidate search (torch.topk, never a sort of the row), and the
row passes in blocks of rows against float64."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close64, peak_new_bytes, poison_
from spec64 import logprobs64, vllm_kept64

from grpo_kernels.kernels import torch_rows


def test_truncation_asks_for_more_candidates_until_the_nucleus_is_in(monkeypatch):
    """A flat row (a nucleus of dozens of tokens) from a single candidate, and a tie group larger than the
    candidates: the search grows (x4, then to the whole tie group) and ends on vLLM's kept set."""
    monkeypatch.setattr(torch_rows, "_TOP_P_CANDIDATES", 1)
    g = torch.Generator().manual_seed(4)
    y = torch.cat([torch.randn(1, 60, generator=g) * 0.1,  # flat: the nucleus holds most tokens
                   torch.full((1, 60), 0.0)], 0)  # all tied
    y[1, :7] = 1.0
    z = (y - y.amax(-1, keepdim=True)) / 0.9
    e = torch.exp(z)
    for top_k, top_p in ((None, 0.9), (None, 0.5), (20, 0.6)):
        threshold, tie = torch_rows.truncation(y, e, top_k, top_p)
        kept = torch_rows.kept_mask(y, threshold, tie)
        for row in range(2):
            assert torch.equal(kept[row], vllm_kept64(z[row].double(), top_k, top_p)), (top_k, top_p, row)
        assert kept.sum() > 20


def test_truncation_keeps_the_top_k_ties_and_the_maximum():
    y = torch.tensor([[0.0, 2.0, 1.0, 1.0, 1.0, -3.0]])
    e = torch.exp(y - 2.0)
    threshold, tie = torch_rows.truncation(y, e, 2, None)  # the 2nd largest is tied three times: all kept
    assert torch_rows.kept_mask(y, threshold, tie).tolist() == [[False, True, True, True, True, False]]
    threshold, tie = torch_rows.truncation(y, e, None, 1e-9)  # a tiny nucleus: the maximum alone
    assert torch_rows.kept_mask(y, threshold, tie).tolist() == [[False, True, False, False, False, False]]


@pytest.mark.parametrize("shape", [(2, 5), (5, 2)], ids=["blocks-split-T", "blocks-of-whole-rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("softcap", [None, 4.0], ids=["plain", "softcap"])
def test_row_passes_in_blocks_match_float64(shape, dtype, softcap, monkeypatch):
    """forward_rows, then backward_rows from its row max and log-sum, in blocks of 3 rows that do not
    divide the [B, T] grid (buffers reused, the last block partial), against float64 autograd: a
    per-row temperature, a logit scale, an ignored row, an entropy gradient. fp32: the gradient formed
    in the logits' own rows (``out`` is ``logits``); bf16: into a NaN-poisoned ``out``."""
    v = 37
    monkeypatch.setattr(torch_rows, "BLOCK_ELEMENTS", 3 * v)
    g = torch.Generator().manual_seed(11)
    b, t = shape
    logits = (torch.randn(b, t, v, generator=g) * 3).to(dtype)
    targets = torch.randint(0, v, (b, t), generator=g)
    targets[1, 1] = -100
    temperature = 0.5 + torch.rand(b, t, generator=g)
    g_logp, g_ent = torch.randn(b, t, generator=g), torch.randn(b, t, generator=g)
    z64 = logits.double().requires_grad_()
    lp64, ent64 = logprobs64(z64, targets, temperature.double()[..., None], softcap=softcap, logit_scale=1.3)
    ((lp64 * g_logp.double()).sum() + (ent64 * g_ent.double()).sum()).backward()

    stats = torch_rows.forward_rows(logits, targets, temperature, -100, softcap=softcap, logit_scale=1.3)
    assert_close64(stats.logp, lp64, scale=5, what="logp")
    assert_close64(stats.entropy, ent64, scale=5, what="entropy")
    x = logits.clone()
    out = x if dtype == torch.float32 else poison_(torch.empty_like(x))
    grad = torch_rows.backward_rows(x, targets, stats.row_max, stats.log_sum, stats.entropy, g_logp, g_ent, temperature,
                                    -100, out, softcap=softcap, logit_scale=1.3)
    assert grad.data_ptr() == out.data_ptr() and grad.dtype == dtype
    assert_close64(grad, z64.grad, dtype, scale=0.1 * z64.grad.abs().max().item(), what="d logits")
    assert grad[1, 1].abs().max() == 0


def _frozen_head_case(n: int, v: int, h: int, dtype, seed: int):
    """hidden [n, h], weight [v, h] whose rows grow in norm along the vocabulary (so later blocks raise
    the running max: the rescaling is exercised), a bias, targets with one ignored row (n > 1) and
    one confident row (its target's logit far above the rest)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) / h**0.5 * torch.linspace(0.5, 3.0, v).unsqueeze(-1)
    bias = torch.randn(v, generator=g) * 0.5
    targets = torch.randint(0, v, (n,), generator=g)
    if n > 2:
        targets[1] = -100
        targets[2] = v - 1
        hidden[2] = weight[v - 1] * (20 / weight[v - 1].square().sum())  # confident: 1 - p_t ~ 1e-6
    return hidden.to(dtype), weight.to(dtype), bias.to(dtype), targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("transform", ["plain", "per_row", "softcap", "scale"])
@pytest.mark.parametrize("n, columns", [(6, 16), (1, 40), (6, 157)])  # 157 = V: one block; 16, 40 do not divide V
def test_frozen_head_rows_match_float64(dtype, transform, n, columns):
    """The vocabulary walked in blocks (online max and sums, the hidden-gradient accumulators rescaled
    as the max grows) against float64 autograd through the whole [n, V] logits: logp, entropy, the sum
    of squared probabilities, ``d logp / d h`` and ``d H / d h`` per row; ignored rows give 0."""
    v, h = 157, 12
    hidden, weight, bias, targets = _frozen_head_case(n, v, h, dtype, seed=n + columns)
    g = torch.Generator().manual_seed(1)
    temperature = {"per_row": 0.5 + torch.rand(n, generator=g)}.get(transform, 0.7)
    softcap = 4.0 if transform == "softcap" else None
    logit_scale = {"softcap": 1.5, "scale": 0.8}.get(transform, 1.0)
    h64 = hidden.double().requires_grad_()
    logits64 = h64 @ weight.double().T + bias.double()
    if dtype != torch.float32:  # the bf16 head rounds its logits to bf16, as any bf16 lm_head
        logits64 = logits64 + (logits64.to(dtype).double() - logits64).detach()
    temp64 = temperature.double()[:, None] if isinstance(temperature, torch.Tensor) else temperature
    lp64, ent64 = logprobs64(logits64, targets, temp64, softcap=softcap, logit_scale=logit_scale)
    z64 = logits64 * logit_scale
    z64 = (z64 if softcap is None else softcap * torch.tanh(z64 / softcap)) / temp64
    sq64 = torch.softmax(z64, -1).square().sum(-1)
    (d_logp64,) = torch.autograd.grad(lp64.sum(), h64, retain_graph=True)
    (d_ent64,) = torch.autograd.grad(ent64.sum(), h64)

    out = torch_rows.frozen_head_rows(hidden, weight, bias, targets, temperature, -100, True, True, 2,
                                      softcap=softcap, logit_scale=logit_scale, columns=columns)
    value = torch.float32 if dtype == torch.float32 else torch.bfloat16
    assert_close64(out.logp, lp64, value, scale=5, what="logp")
    assert_close64(out.entropy, ent64, value, scale=5, what="entropy")
    valid = targets != -100
    assert_close64(out.sum_probs_sq[valid], sq64[valid], value, what="sum p^2")
    for got, want, what in ((out.grad_logp, d_logp64, "d logp/d h"), (out.grad_entropy, d_ent64, "d H/d h")):
        assert got.dtype == torch.float32
        assert_close64(got, want, value, scale=0.1 * want.abs().max().item(), what=what)
    if n > 2:
        assert out.logp[1] == 0 and out.entropy[1] == 0 and out.grad_logp[1].abs().max() == 0
        assert out.grad_entropy[1].abs().max() == 0 and out.sum_probs_sq[1] == 0
        if dtype == torch.float32:  # the confident row's small gradient, relative to itself
            assert_close64(out.grad_logp[2], d_logp64[2], scale=0.1 * d_logp64[2].abs().max().item(), what="confident")
    # its row statistics are the row pass's: backward_rows reads them
    stats = torch_rows.forward_rows((hidden.float() @ weight.float().T + bias.float()).to(dtype)[None], targets[None],
                                    temperature if isinstance(temperature, float) else temperature[None], -100,
                                    softcap=softcap, logit_scale=logit_scale)
    assert_close64(out.row_max, stats.row_max[0].double(), what="row max")
    assert_close64(out.log_sum, stats.log_sum[0].double(), scale=5, what="log sum")


def test_frozen_head_rows_nan_and_neg_inf():
    """A NaN logit makes its row NaN and no other; a block of -inf logits (a bias masking tokens) before
    any finite one adds nothing (no NaN from rescaling an empty block)."""
    v, h = 40, 6
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(3, h, generator=g), torch.randn(v, h, generator=g)
    bias = torch.zeros(v)
    bias[:10] = float("-inf")
    targets = torch.tensor([12, 30, 5])
    hidden[1, 0] = float("nan")
    out = torch_rows.frozen_head_rows(hidden, weight, bias, targets, 1.0, -100, True, False, 2, columns=10)
    logits = hidden.double() @ weight.double().T + bias.double()
    lp64, ent64 = logprobs64(logits, targets)
    assert torch.isnan(out.logp[1]) and torch.isnan(out.grad_logp[1]).all()
    rows = [0, 2]
    assert_close64(out.logp[0], lp64[0], scale=5, what="logp")
    assert_close64(out.entropy[rows], ent64[rows], scale=5, what="entropy")
    assert out.logp[2] == torch.finfo(torch.float32).min  # a target at -inf: the floor (floor_logp)
    assert torch.isfinite(out.grad_logp[rows]).all() and torch.isfinite(out.grad_entropy[rows]).all()


@pytest.mark.parametrize("n, h, v, dtype, grads", [(64, 16, 3000, torch.float32, 1), (64, 16, 3000, torch.float32, 2),
                                                   (40, 8, 9000, torch.bfloat16, 2)], ids=str)
def test_frozen_head_bytes_is_what_the_pass_holds(monkeypatch, n, h, v, dtype, grads):
    """The memory plan's term for a frozen head (``frozen_head_bytes``) against the bytes the pass's tensors
    hold at its peak, with blocks narrower than V. (Tensors: a BLAS's own scratch is not the term's, and
    varies by CPU; oneDNN's bf16 matmul on an AMX CPU takes ~220 KB a call, as much as this shape's blocks.)"""
    monkeypatch.setitem(torch_rows.TILE_ELEMENTS, "cpu", 1 << 16)
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(n, h, generator=g).to(dtype), torch.randn(v, h, generator=g).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    assert torch_rows.tile_columns(n, v, torch.device("cpu")) < v
    got = peak_new_bytes(lambda: torch_rows.frozen_head_rows(hidden, weight, None, targets, 1.0, -100, True, False, grads))[1]
    planned = torch_rows.frozen_head_bytes(n, v, h, dtype, torch.device("cpu"))
    assert 0.9 * planned <= got <= 1.05 * planned, (got, planned)
