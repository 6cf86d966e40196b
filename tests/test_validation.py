"""Bad input fails early with a ValueError/TypeError that names the argument, on every backend."""

from __future__ import annotations

import pytest
import torch

import grpo_kernels as gk

BACKENDS = ["reference", "torch", "triton"]
B, T, V, H = 2, 3, 11, 8


def good():
    g = torch.Generator().manual_seed(0)
    return dict(
        logits=torch.randn(B, T, V, generator=g),
        completion_ids=torch.randint(0, V, (B, T), generator=g),
        advantages=torch.randn(B, generator=g),
    )


GRPO_CASES = [
    ("logits", dict(logits=torch.randint(0, 5, (B, T, V))), TypeError),
    ("logits", dict(logits=torch.randn(B * T, V)), ValueError),
    ("completion_ids", dict(completion_ids=torch.randn(B, T)), TypeError),
    ("completion_ids", dict(completion_ids=torch.zeros(B, T + 1, dtype=torch.long)), ValueError),
    ("completion_ids", dict(completion_ids=torch.full((B, T), V, dtype=torch.long)), ValueError),
    ("advantages", dict(advantages=torch.randn(B + 1)), ValueError),
    ("advantages", dict(advantages=torch.ones(B, dtype=torch.long)), TypeError),
    ("completion_mask", dict(completion_mask=torch.ones(B, T - 1)), ValueError),
    ("old_logps", dict(old_logps=torch.randn(B)), ValueError),
    ("ref_logps", dict(beta=0.1), ValueError),
    ("loss_type", dict(loss_type="mean"), ValueError),
    ("temperature", dict(temperature=0.0), ValueError),
    ("temperature", dict(temperature=-1.0), ValueError),
    ("delta", dict(delta=1.1, eps_high=0.2), ValueError),
    ("importance_sampling_level", dict(importance_sampling_level="seq"), ValueError),
    ("is_ratio", dict(is_ratio=torch.ones(B, T + 2)), ValueError),
    ("eps_low", dict(eps_low=1.5), ValueError),
    ("num_items_in_batch", dict(num_items_in_batch=0), ValueError),
    ("backend", dict(backend="cuda"), ValueError),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, change, error", GRPO_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(GRPO_CASES)])
def test_grpo_loss_rejects_bad_input(backend, name, change, error):
    args = good()
    kwargs = {"backend": backend}
    for key, value in change.items():
        (args if key in args or key == "completion_mask" else kwargs)[key] = value
    if name == "backend":
        kwargs["backend"] = change["backend"]
    with pytest.raises(error, match=name):
        gk.grpo_loss(args["logits"], args["completion_ids"], args["advantages"], args.get("completion_mask"), **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_logprobs_rejects_bad_input(backend):
    x = torch.randn(B, T, V)
    with pytest.raises(ValueError, match="targets"):
        gk.token_logprobs(x, torch.zeros(B, T + 1, dtype=torch.long), backend=backend)
    with pytest.raises(TypeError, match="targets"):
        gk.token_logprobs(x, torch.zeros(B, T), backend=backend)
    with pytest.raises(TypeError, match="logits"):
        gk.token_logprobs(x.long(), torch.zeros(B, T, dtype=torch.long), backend=backend)
    with pytest.raises(ValueError, match="temperature"):
        gk.token_logprobs(x, torch.zeros(B, T, dtype=torch.long), temperature=0, backend=backend)
    with pytest.raises(ValueError, match="targets"):
        gk.token_logprobs(x, torch.full((B, T), -1, dtype=torch.long), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_rejects_bad_input(backend):
    h, w = torch.randn(B, T, H), torch.randn(V, H)
    ids, adv = torch.randint(0, V, (B, T)), torch.randn(B)
    with pytest.raises(ValueError, match="weight"):
        gk.fused_linear_grpo_loss(h, torch.randn(V, H + 1), ids, adv, backend=backend)
    with pytest.raises(ValueError, match="bias"):
        gk.fused_linear_grpo_loss(h, w, ids, adv, bias=torch.randn(V + 1), backend=backend)
    with pytest.raises(ValueError, match="hidden"):
        gk.fused_linear_grpo_loss(h.view(B * T, H), w, ids, adv, backend=backend)
    with pytest.raises(ValueError, match="targets"):
        gk.fused_linear_token_logprobs(h, w, ids[:, :2], backend=backend)
    with pytest.raises(ValueError, match="ref_logps"):
        gk.fused_linear_grpo_loss(h, w, ids, adv, beta=0.1, backend=backend)


def test_masked_out_of_range_ids_are_never_read():
    """Where the mask is 0 the id may be anything (e.g. a pad id past the vocabulary)."""
    args = good()
    ids = args["completion_ids"].clone()
    ids[0, 2] = 10**6
    mask = torch.ones(B, T)
    mask[0, 2] = 0
    device = "cuda" if torch.cuda.is_available() else "cpu"  # Triton takes CUDA tensors where there is a GPU
    for backend in BACKENDS:
        out = gk.grpo_loss(args["logits"].to(device), ids.to(device), args["advantages"].to(device), mask.to(device), backend=backend)
        assert torch.isfinite(out.loss) and out.per_token_logps[0, 2] == 0
