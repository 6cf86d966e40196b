"""grpo_kernels/kernels/torch_rows.py: the truncation's candidate search (torch.topk, never a sort of the row), and the
row passes in blocks of rows against float64."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close64, poison_
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
