"""``kernels/torch_replay.py``: the replay row-kernel contract (the same as ``kernels/triton_replay.py``'s) on raw
CSR input, against ``test_replay.replay64`` (the float64 masked ``log_softmax`` over each set): the four functions
and the dense masked block path, values and gradients."""

from __future__ import annotations

import math
import random

import pytest
import torch

from helpers import assert_close64
from test_replay import V, _loss_of, replay64, targets_for

from grpo_kernels import SamplingMask
from grpo_kernels.kernels import torch_replay


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_torch_replay_contract(softcap):
    """The four functions of ``kernels/torch_replay.py`` on raw CSR input: empty sets (lse -inf, logp -inf,
    entropy 0, no gradient, no NaN), a kept entry whose logit is -inf, a per-row temperature."""
    rng = random.Random(61)
    n, h = 9, 6
    sets = [rng.sample(range(V), rng.choice((0, 1, 3, 12, 40))) for _ in range(n)]
    sets[2] = []
    targets = targets_for(rng, sets)
    mask = SamplingMask.from_lists(sets)
    g = torch.Generator().manual_seed(61)
    hidden, weight = torch.randn(n, h, generator=g), torch.randn(V, h, generator=g)
    temperature = (torch.rand(n, generator=g) + 0.5).float()
    logits = hidden @ weight.t()
    if sets[4]:
        logits[4, sets[4][0]] = -math.inf
    tf = (temperature, softcap, 1.1)
    out = torch_replay.replay_rows_forward(logits, targets, mask.token_ids, mask.offsets, *tf, True, True)
    lp64, ent64, sq64 = replay64(logits.double(), targets, sets, temperature=temperature, softcap=softcap, logit_scale=1.1)
    assert_close64(out[0], lp64, what="logp")
    assert_close64(out[1], ent64, scale=5, what="entropy")
    assert_close64(out[2], sq64, what="sum_sq")
    assert out[3][2] == -math.inf and out[0][2] == -math.inf and out[1][2] == 0
    g_logp = torch.where(torch.isfinite(out[0]), torch.randn(n, generator=g), torch.zeros(n))
    g_ent = torch.randn(n, generator=g)
    d = torch.full_like(logits, float("nan"))
    torch_replay.replay_rows_backward(logits, targets, mask.token_ids, mask.offsets, out[3], out[1], g_logp, g_ent,
                                      *tf, out=d)
    leaf = logits.double().requires_grad_()
    lp64, ent64, _ = replay64(leaf, targets, sets, temperature=temperature, softcap=softcap, logit_scale=1.1)
    _loss_of(lp64, ent64, g_logp.double(), g_ent.double()).backward()
    assert_close64(d, leaf.grad.nan_to_num(), what="d logits")
    lin = torch_replay.replay_linear_forward(hidden, weight, None, targets, mask.token_ids, mask.offsets, *tf, True, True)
    logits_lin = hidden @ weight.t()
    lp64, ent64, _ = replay64(logits_lin.double(), targets, sets, temperature=temperature, softcap=softcap, logit_scale=1.1)
    assert_close64(lin[0], lp64, what="linear logp")
    dh, dw, db = torch_replay.replay_linear_backward(hidden, weight, None, targets, mask.token_ids, mask.offsets, lin[3],
                                                     lin[1], g_logp, g_ent, *tf, True, True, False)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    lp64, ent64, _ = replay64(h64 @ w64.t(), targets, sets, temperature=temperature, softcap=softcap, logit_scale=1.1)
    _loss_of(lp64, ent64, g_logp.double(), g_ent.double()).backward()
    assert_close64(dh, h64.grad, what="d hidden")
    assert_close64(dw, w64.grad, what="d weight")
    assert db is None




@pytest.mark.parametrize("softcap", [None, 2.5])
def test_dense_block_path(softcap):
    """``dense_forward`` / ``dense_backward`` on materialised rows: the same values and ``d x`` as the sparse
    functions, a per-row temperature, a target in no column (another shard's: -1) giving -inf and no one-hot."""
    rng = random.Random(62)
    n = 6
    sets = [rng.sample(range(V), rng.choice((1, 50, V))) for _ in range(n)]
    targets = targets_for(rng, sets)
    targets[3] = -1
    mask = SamplingMask.from_lists(sets)
    g = torch.Generator().manual_seed(62)
    x = torch.randn(n, V, generator=g) * 2
    temperature = (torch.rand(n, generator=g) + 0.5).float()
    tf = (temperature, softcap, 0.9)
    dense = torch_replay.dense_forward(x.clone(), targets, mask.token_ids, mask.offsets, *tf, True, True)
    sparse = torch_replay.replay_rows_forward(x, targets, mask.token_ids, mask.offsets, *tf, True, True)
    for a, b in zip(dense, sparse):
        assert_close64(a, b.double())
    assert dense[0][3] == -math.inf
    g_logp = torch.where(torch.isfinite(dense[0]), torch.randn(n, generator=g), torch.zeros(n))
    g_ent = torch.randn(n, generator=g)
    dx = torch_replay.dense_backward(x.clone(), targets, mask.token_ids, mask.offsets, dense[3], dense[1], g_logp, g_ent, *tf)
    out = torch.full_like(x, float("nan"))
    torch_replay.replay_rows_backward(x, targets, mask.token_ids, mask.offsets, sparse[3], sparse[1], g_logp, g_ent, *tf,
                                      out=out)
    assert_close64(dx, out.double())
