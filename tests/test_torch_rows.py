"""grpo_kernels/kernels/torch_rows.py: the truncation's candidate search (torch.topk, never a sort of the row)."""

from __future__ import annotations

import torch
from spec64 import vllm_kept64

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
