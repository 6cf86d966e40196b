"""grpo_kernels.modules: the nn.Module wrappers check their configuration when they are built."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import B, H, T, V, batch

import grpo_kernels as gk


def test_misspelt_keywords_fail_at_construction():
    with pytest.raises(TypeError, match="betta"):
        gk.GRPOLoss(betta=0.1)
    with pytest.raises(ValueError, match="loss_type"):
        gk.FusedLinearGRPOLoss(loss_type="gpro")
    with pytest.raises(ValueError, match="backend"):
        gk.GRPOLoss(backend="tirton")
    with pytest.raises(TypeError, match="betta"):
        gk.grpo_loss(torch.randn(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), torch.ones(1), betta=0.1)


@pytest.mark.parametrize("value", ["yes", "False", None, 1])
def test_module_flags_are_checked_when_the_module_is_built(value):
    with pytest.raises(TypeError, match="inplace_backward"):
        gk.GRPOLoss(inplace_backward=value)
    with pytest.raises(TypeError, match="accumulate_in_weight_dtype"):
        gk.FusedLinearGRPOLoss(accumulate_in_weight_dtype=value)
    with pytest.raises(TypeError, match="use_bias_correction_kl"):
        gk.GRPOLoss(use_bias_correction_kl=value)
    with pytest.raises(TypeError, match="use_bias_correction_kl"):
        gk.GRPOOptions(use_bias_correction_kl=value)


@pytest.mark.parametrize("value", [0, -4, 2.5, "8", True, np.float64(3.0)])
def test_chunk_size_is_a_positive_int_when_the_module_is_built_and_at_the_call(value, backend="torch"):
    with pytest.raises(ValueError, match="chunk_size"):
        gk.FusedLinearGRPOLoss(chunk_size=value)
    _, ids, mask, adv, *_ = batch(15)
    with pytest.raises(ValueError, match="chunk_size"):
        gk.fused_linear_grpo_loss(torch.randn(B, T, H), torch.randn(V, H), ids, adv, mask, chunk_size=value, backend="reference")
    with pytest.raises(ValueError, match="chunk_size"):
        gk.fused_linear_token_logprobs(torch.randn(B, T, H), torch.randn(V, H), ids, chunk_size=value, backend=backend)
    assert gk.FusedLinearGRPOLoss(chunk_size=np.int64(4)).config["chunk_size"] == 4


@pytest.mark.parametrize("bad", [dict(top_k=-3), dict(top_p=0.0), dict(top_p=2.0), dict(top_k=1.5),
                                 dict(temperature=torch.tensor([0.5, -1.0]))])
def test_sampling_options_are_checked_when_the_module_is_built(bad):
    name = next(iter(bad))
    with pytest.raises((ValueError, TypeError), match=name):
        gk.GRPOLoss(**bad)
    with pytest.raises((ValueError, TypeError), match=name):
        gk.FusedLinearGRPOLoss(**bad)


def test_module_holds_the_sampling_options():
    """GRPOLoss(top_k=..., top_p=...) is the function with them (per-call keywords override)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 17, generator=g)
    ids = logits.argmax(-1)
    adv = torch.randn(2, generator=g)
    module = gk.GRPOLoss(top_k=4, top_p=0.8, temperature=0.9, backend="torch")
    direct = gk.grpo_loss(logits, ids, adv, top_k=4, top_p=0.8, temperature=0.9, backend="torch")
    held = module(logits, ids, adv)
    assert torch.equal(held.loss, direct.loss) and "sampling/outside_kept_set" in held.metrics
    per_call = module(logits, ids, adv, top_k=None, top_p=None)
    assert "sampling/outside_kept_set" not in per_call.metrics
