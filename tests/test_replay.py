"""Sampling-mask replay (``sampling_mask=``): log-probs, entropies and losses over each position's kept set.

Everything is checked against :func:`replay64`, an independent float64 restatement (the masked
``log_softmax`` over the set, on the whole row of logits, a Python loop over positions), values and
gradients (float64 autograd through it), on every backend (``triton`` through the interpreter, tiny
shapes), by both routes (the sparse kernels, and the dense masked path of the large sets; ``route``
forces one or the other through ``torch_replay.DENSE_ROW_FRACTION``). The kernel-level contract of
``kernels/torch_replay.py`` has its own checks here too (the Triton module has ``tests/test_triton_replay.py``).
Two gloo ranks with uneven vocabulary shards: the spawned test at the end.
"""

from __future__ import annotations

import math
import os
import random
import tempfile
import time
import traceback
from typing import List, Optional

import pytest
import torch
import torch.multiprocessing as mp

from helpers import BACKENDS, assert_close64, leave_gloo_worker
from spec64 import grpo64

import grpo_kernels as gk
from grpo_kernels import SamplingMask
from grpo_kernels.kernels import torch_replay

V = 203  # not a multiple of any block size
SPARSE_SIZES = tuple(k for k in (1, 2, 3, 5, 12) if not k * torch_replay.DENSE_ROW_FRACTION > V)
DENSE_SIZES = (13, 60, V)  # V: the whole vocabulary


@pytest.fixture(params=["auto", "sparse", "dense"])
def route(request, monkeypatch):
    """Which path the rows take: by size (auto), or every row sparse / dense."""
    if request.param == "sparse":
        monkeypatch.setattr(torch_replay, "DENSE_ROW_FRACTION", 0)
    elif request.param == "dense":
        monkeypatch.setattr(torch_replay, "DENSE_ROW_FRACTION", V + 1)
    return request.param


# ------------------------------------------------------------------------------- the float64 statement
def replay64(logits: torch.Tensor, targets: torch.Tensor, sets: List[List[int]], temperature=1.0, softcap=None,
             logit_scale: float = 1.0, ignore_index: int = -100):
    """(logp, entropy, sum of squared probabilities) float64 of the targets' shape: ``softmax(z)`` restricted
    to each position's set (``sets``: flat, row-major), ``z = softcap * tanh(logit_scale * x / softcap) / T``
    (a ``-inf`` logit stays ``-inf``). logp ``-inf`` for a target outside its set (or an empty set, entropy 0);
    0 at ``ignore_index``. Differentiable through logp and the entropy."""
    x = logits.double()
    z = x * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if isinstance(temperature, torch.Tensor):
        t = temperature.double()
        z = z / t.reshape(t.shape + (1,) * (targets.dim() - t.dim())).expand(targets.shape).unsqueeze(-1)
    else:
        z = z / temperature
    z = torch.where(x == -math.inf, torch.full_like(z, -math.inf), z)
    v = z.shape[-1]
    flat, tflat = z.reshape(-1, v), targets.reshape(-1)
    logps, ents, sqs = [], [], []
    for i in range(flat.shape[0]):
        zero = flat[i].nan_to_num().sum() * 0.0
        kept = [j for j in sets[i] if flat[i][j].item() != -math.inf]
        target = int(tflat[i])
        if target == ignore_index or not kept:
            lp = zero if target == ignore_index else zero - math.inf
            logps.append(lp), ents.append(zero), sqs.append(zero.detach())
            continue
        zk = flat[i][kept]
        lse = torch.logsumexp(zk, 0)
        p = torch.exp(zk - lse)
        logps.append(flat[i][target] - lse if target in kept else zero - math.inf)
        ents.append(lse - (p * zk).sum())
        sqs.append((p * p).sum().detach())
    shape = targets.shape
    return torch.stack(logps).reshape(shape), torch.stack(ents).reshape(shape), torch.stack(sqs).reshape(shape)


def random_sets(rng: random.Random, n: int, sizes=SPARSE_SIZES + DENSE_SIZES, vocab: int = V) -> List[List[int]]:
    return [rng.sample(range(vocab), rng.choice(sizes)) for _ in range(n)]


def targets_for(rng: random.Random, sets: List[List[int]], vocab: int = V, outside: float = 0.2) -> torch.Tensor:
    """A target in its set, or (a share ``outside``) one outside it."""
    out = []
    for s in sets:
        if s and rng.random() >= outside:
            out.append(rng.choice(s))
        else:
            rest = [j for j in range(vocab) if j not in set(s)]
            out.append(rng.choice(rest) if rest else rng.choice(s))
    return torch.tensor(out)


def case(seed: int, b: int = 2, t: int = 5, vocab: int = V, sizes=SPARSE_SIZES + DENSE_SIZES):
    """(sets, targets [b, t]) with ignored positions whose sets are empty, and at least one target outside."""
    rng = random.Random(seed)
    sets = random_sets(rng, b * t, sizes, vocab)
    targets = targets_for(rng, sets, vocab).view(b, t)
    targets[0, 0] = -100
    sets[0] = []  # an ignored position with an empty set
    targets[1, t - 1] = -100  # an ignored position with a set (never read)
    rest = [j for j in range(vocab) if j not in set(sets[1])]
    if rest:
        targets.view(-1)[1] = rest[0]  # outside its set
    return sets, targets


def _loss_of(logp, entropy, g, e):
    """sum(g logp + e H) over the finite log-probs (a -inf one sends no gradient)."""
    finite = torch.isfinite(logp)
    return (torch.where(finite, logp, torch.zeros_like(logp)) * g).sum() + (entropy * e).sum()


# ------------------------------------------------------------------------------------ token_logprobs
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transform", ["plain", "tensor_temperature", "softcap"])
def test_token_logprobs_matches_float64(backend, dtype, transform, route):
    if backend != "torch" and (route != "auto" or dtype != torch.float32 and transform != "plain"):
        pytest.skip("the routes and dtypes are the torch backend's matrix; the others run the default route")
    sets, targets = case(1)
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(2, 5, V, generator=g) * 3).to(dtype)
    kw = dict(temperature=0.7)
    if transform == "tensor_temperature":
        kw["temperature"] = torch.rand(2, 5, generator=g) + 0.5
    if transform == "softcap":
        kw.update(softcap=4.0, logit_scale=1.3)
    lp64, ent64, sq64 = replay64(logits.double().requires_grad_(), targets, sets, **kw)
    leaf = logits.clone().requires_grad_()
    mask = SamplingMask.from_lists([sets[:5], sets[5:]])
    logp, ent, sq = gk.token_logprobs(leaf, targets, sampling_mask=mask, return_entropy=True,
                                      return_sum_probs_sq=True, backend=backend, **kw)
    assert logp.dtype == torch.float32 and logp.shape == targets.shape
    assert_close64(logp, lp64, what="logp")
    assert_close64(ent, ent64, what="entropy", scale=5)
    assert_close64(sq, sq64, what="sum_sq")
    assert torch.isinf(logp).sum() >= 1, "a target outside its set gives -inf"
    grad_g, grad_e = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
    _loss_of(logp, ent, grad_g, grad_e).backward()
    leaf64 = logits.double().requires_grad_()
    lp64, ent64, _ = replay64(leaf64, targets, sets, **kw)
    _loss_of(lp64, ent64, grad_g.double(), grad_e.double()).backward()
    assert leaf.grad.dtype == dtype
    assert_close64(leaf.grad, leaf64.grad, dtype, what="d logits")
    # off the sets, and at ignored positions, the gradient is exactly 0
    kept = torch.zeros(10, V, dtype=torch.bool)
    for i, s in enumerate(sets):
        kept[i, s] = targets.view(-1)[i] != -100
    assert leaf.grad.view(10, V)[~kept].abs().max() == 0


def test_only_kept_entries_are_read(route):
    """NaN everywhere off the sets changes nothing (the kernels read only the kept entries; the dense path
    masks the row before any sum)."""
    sets, targets = case(3)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, V, generator=g)
    poisoned = logits.clone()
    kept = torch.zeros(10, V, dtype=torch.bool)
    for i, s in enumerate(sets):
        kept[i, s] = True
    poisoned.view(10, V)[~kept] = float("nan")
    mask = SamplingMask.from_lists(sets)
    clean = gk.token_logprobs(logits, targets, sampling_mask=mask, return_entropy=True, backend="torch")
    dirty = gk.token_logprobs(poisoned, targets, sampling_mask=mask, return_entropy=True, backend="torch")
    for a, b in zip(clean, dirty):
        assert torch.equal(a, b)


def test_whole_vocabulary_sets_equal_the_plain_softmax(route):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 4, V, generator=g)
    targets = torch.randint(0, V, (3, 4), generator=g)
    mask = SamplingMask.from_lists([[list(range(V))[::-1]] * 4] * 3)
    replay = gk.token_logprobs(logits, targets, sampling_mask=mask, return_entropy=True, backend="torch", temperature=0.9)
    plain = gk.token_logprobs(logits, targets, return_entropy=True, backend="torch", temperature=0.9)
    for a, b in zip(replay, plain):
        assert_close64(a, b.double())


def test_single_token_sets():
    """A set of one id: log-prob 0 (the target) or -inf, entropy 0, sum of squares 1, no gradient."""
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(1, 4, V, generator=g, requires_grad=True)
    targets = torch.tensor([[3, 7, 9, 11]])
    mask = SamplingMask.from_lists([[[3], [7], [10], [0]]])
    logp, ent, sq = gk.token_logprobs(logits, targets, sampling_mask=mask, return_entropy=True,
                                      return_sum_probs_sq=True, backend="torch")
    assert logp.tolist() == [[0.0, 0.0, -math.inf, -math.inf]]
    assert ent.abs().max() == 0 and sq.tolist() == [[1.0] * 4]
    _loss_of(logp, ent, torch.ones(1, 4), torch.ones(1, 4)).backward()
    assert logits.grad.abs().max() == 0


def test_strided_logits_view_and_inplace_backward():
    """The logits a causal LM gives (``model_logits[:, P-1:-1]``: rows that do not merge into one view) and
    ``inplace_backward`` give the same values and gradient."""
    sets, targets = case(7)
    g = torch.Generator().manual_seed(7)
    model_logits = torch.randn(2, 8, V, generator=g)
    adv = torch.randn(2, generator=g)
    mask = SamplingMask.from_lists(sets)
    ids = targets.clamp(min=0)
    cmask = (targets != -100).float()
    out = {}
    for how in ("contiguous", "view", "inplace"):
        base = model_logits.clone().requires_grad_()
        logits = base[:, 2:7] if how == "view" else base[:, 2:7].clone()
        if how == "inplace":
            logits = base[:, 2:7].detach().clone().requires_grad_()
            leaf = logits
        else:
            leaf = base
        res = gk.grpo_loss(logits * 1 if how == "inplace" else logits, ids, adv, cmask, sampling_mask=mask,
                           backend="torch", inplace_backward=how == "inplace")
        res.loss.backward()
        grad = leaf.grad if how == "inplace" else leaf.grad[:, 2:7]
        out[how] = (res.loss.detach(), grad.clone())
    for how in ("view", "inplace"):
        assert torch.allclose(out[how][0], out["contiguous"][0], atol=1e-6)
        assert torch.allclose(out[how][1], out["contiguous"][1], atol=1e-6)


# ------------------------------------------------------------------------------ fused-linear log-probs
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_linear_token_logprobs_matches_float64(backend, dtype, bias, route):
    if backend != "torch" and (route != "auto" or dtype != torch.float32):
        pytest.skip("the routes and dtypes are the torch backend's matrix")
    sets, targets = case(11, sizes=SPARSE_SIZES + DENSE_SIZES[:-1])  # (some ids in no set)
    g = torch.Generator().manual_seed(11)
    h = 16
    hidden = torch.randn(2, 5, h, generator=g).to(dtype)
    weight = (torch.randn(V, h, generator=g) / 2).to(dtype)
    b = (torch.randn(V, generator=g)).to(dtype) if bias else None
    temperature = torch.rand(2, generator=g) + 0.5  # one per sequence
    kw = dict(temperature=temperature, softcap=5.0)
    leaves = [x.clone().requires_grad_() for x in (hidden, weight) + ((b,) if bias else ())]
    mask = SamplingMask.from_lists([sets[:5], sets[5:]])
    logp, ent = gk.fused_linear_token_logprobs(leaves[0], leaves[1], targets, bias=leaves[2] if bias else None,
                                               sampling_mask=mask, return_entropy=True, backend=backend, **kw)
    leaves64 = [x.double().requires_grad_() for x in (hidden, weight) + ((b,) if bias else ())]
    logits64 = leaves64[0] @ leaves64[1].t() + (leaves64[2] if bias else 0)
    lp64, ent64, _ = replay64(logits64, targets, sets, **kw)
    assert_close64(logp, lp64, dtype, scale=4, what="logp")
    assert_close64(ent, ent64, dtype, scale=4, what="entropy")
    grad_g, grad_e = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
    _loss_of(logp, ent, grad_g, grad_e).backward()
    _loss_of(lp64, ent64, grad_g.double(), grad_e.double()).backward()
    for name, leaf, leaf64 in zip(("d hidden", "d weight", "d bias"), leaves, leaves64):
        assert leaf.grad.dtype == dtype
        assert_close64(leaf.grad, leaf64.grad, dtype, scale=4, what=name)
    # d weight (and d bias) are exactly zero on the ids no valid position keeps
    used = torch.zeros(V, dtype=torch.bool)
    for i, s in enumerate(sets):
        if targets.view(-1)[i] != -100:
            used[s] = True
    assert (~used).sum() > 10 and leaves[1].grad[~used].abs().max() == 0
    if bias:
        assert leaves[2].grad[~used].abs().max() == 0


def test_fused_linear_reads_only_kept_weight_rows():
    """NaN in every weight row no set keeps (and at ignored positions' hidden states) changes nothing on the
    sparse route: the forward reads, and the backward gathers, only the kept rows."""
    sets, targets = case(12, sizes=SPARSE_SIZES)
    g = torch.Generator().manual_seed(12)
    hidden, weight = torch.randn(2, 5, 8, generator=g), torch.randn(V, 8, generator=g)
    used = torch.zeros(V, dtype=torch.bool)
    for i, s in enumerate(sets):
        if targets.view(-1)[i] != -100:
            used[s] = True
    poisoned_w, poisoned_h = weight.clone(), hidden.clone()
    poisoned_w[~used] = float("nan")
    poisoned_h[targets == -100] = float("nan")
    mask = SamplingMask.from_lists(sets)
    results = []
    for h, w in ((hidden, weight), (poisoned_h, poisoned_w)):
        h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
        logp, ent = gk.fused_linear_token_logprobs(h, w, targets, sampling_mask=mask, return_entropy=True,
                                                   backend="torch")
        _loss_of(logp, ent, torch.ones(2, 5), torch.ones(2, 5)).backward()
        results.append((logp, ent, h.grad, w.grad[used]))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("route_name", ["sparse", "dense"])
def test_weight_gradient_is_deterministic(route_name, monkeypatch):
    """Two backward passes give the same bits (d weight sums each id's entries in one fixed order)."""
    monkeypatch.setattr(torch_replay, "DENSE_ROW_FRACTION", 0 if route_name == "sparse" else V + 1)
    rng = random.Random(13)
    n = 64
    sets = [rng.sample(range(40), rng.choice((1, 3, 8, 20))) for _ in range(n)]  # ids shared by many rows
    targets = targets_for(rng, sets, 40).view(4, 16)
    g = torch.Generator().manual_seed(13)
    hidden, weight, bias = torch.randn(4, 16, 32, generator=g), torch.randn(V, 32, generator=g), torch.randn(V, generator=g)
    mask = SamplingMask.from_lists(sets)
    grads = []
    for _ in range(2):
        leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
        logp, ent = gk.fused_linear_token_logprobs(*leaves[:2], targets, bias=leaves[2], sampling_mask=mask,
                                                   return_entropy=True, backend="torch", chunk_size=16)
        _loss_of(logp, ent, torch.ones(4, 16), torch.full((4, 16), 0.3)).backward()
        grads.append([x.grad for x in leaves])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    assert grads[0][1][40:].abs().max() == 0 and grads[0][2][40:].abs().max() == 0


# --------------------------------------------------------------------------------------------- losses
def _masked_logits64(logits64: torch.Tensor, sets, valid: torch.Tensor) -> torch.Tensor:
    """The logits with every id off its position's set at -inf (valid positions only): the plain softmax
    of these is the replayed distribution (no softcap)."""
    v = logits64.shape[-1]
    keep = torch.ones(len(sets), v, dtype=torch.bool)
    for i, s in enumerate(sets):
        if bool(valid.view(-1)[i]):
            keep[i] = False
            keep[i, s] = True
    return torch.where(keep.view(logits64.shape), logits64, torch.full_like(logits64, -math.inf))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("function", ["grpo_loss", "fused_linear_grpo_loss"])
def test_grpo_losses_match_float64(backend, function, route):
    """The loss over the replayed distribution: grpo64 on the masked logits of the batch whose outside-set
    tokens are masked out (they leave the loss), gradients too; the metric counts them."""
    if backend != "torch" and route != "auto":
        pytest.skip("the routes are the torch backend's matrix")
    b, t, h = 3, 4, 8
    rng = random.Random(21)
    sets = random_sets(rng, b * t)
    ids = targets_for(rng, sets, outside=0.3).view(b, t)
    g = torch.Generator().manual_seed(21)
    hidden, weight = torch.randn(b, t, h, generator=g), torch.randn(V, h, generator=g)
    adv = torch.randn(b, generator=g)
    cmask = torch.ones(b, t)
    cmask[0, 3] = 0
    sets[3] = []  # a masked position with an empty set
    old = torch.randn(b, t, generator=g) * 0.05 - 3
    kw = dict(temperature=0.8, loss_type="grpo", beta=0.0)
    valid = cmask != 0
    in_set = torch.tensor([int(ids.view(-1)[i]) in sets[i] for i in range(b * t)]).view(b, t)
    outside = valid & ~in_set
    assert outside.sum() >= 1 and (valid & in_set).sum() >= 3
    mask = SamplingMask.from_lists(sets)
    leaves = [x.clone().requires_grad_() for x in ((hidden @ weight.t(),) if function == "grpo_loss" else (hidden, weight))]
    out = getattr(gk, function)(*leaves, ids, adv, cmask, old_logps=old, sampling_mask=mask, backend=backend, **kw)
    out.loss.backward()
    leaves64 = [x.double().requires_grad_() for x in ((hidden @ weight.t(),) if function == "grpo_loss" else (hidden, weight))]
    logits64 = leaves64[0] if function == "grpo_loss" else leaves64[0] @ leaves64[1].t()
    expected = grpo64(_masked_logits64(logits64, sets, valid & in_set), ids, adv.double(),
                      torch.where(outside, 0.0, cmask).double(), old_logps=old.double(), **kw)
    loss64 = expected[0] if isinstance(expected, tuple) else expected
    assert_close64(out.loss, loss64.detach(), what="loss")
    loss64.backward()
    for leaf, leaf64 in zip(leaves, leaves64):
        assert torch.isfinite(leaf.grad).all()
        assert_close64(leaf.grad, leaf64.grad, scale=2, what="gradient")
    share = out.metrics["sampling/outside_kept_set"]
    assert share.item() == pytest.approx(outside.sum().item() / cmask.sum().item())
    assert torch.equal(torch.isinf(out.per_token_logps), outside)


def test_modules_take_sampling_mask_per_call():
    sets, targets = case(31, b=2, t=4)
    g = torch.Generator().manual_seed(31)
    hidden, weight = torch.randn(2, 4, 8, generator=g), torch.randn(V, 8, generator=g)
    ids, cmask, adv = targets.clamp(min=0), (targets != -100).float(), torch.randn(2, generator=g)
    mask = SamplingMask.from_lists(sets)
    direct = gk.fused_linear_grpo_loss(hidden, weight, ids, adv, cmask, sampling_mask=mask, backend="torch")
    held = gk.FusedLinearGRPOLoss(backend="torch")(hidden, weight, ids, adv, cmask, sampling_mask=mask)
    assert torch.equal(direct.loss, held.loss) and "sampling/outside_kept_set" in held.metrics
    logits = hidden @ weight.t()
    direct = gk.grpo_loss(logits, ids, adv, cmask, sampling_mask=mask, backend="torch")
    held = gk.GRPOLoss(backend="torch", sampling_mask=mask)(logits, ids, adv, cmask)
    assert torch.equal(direct.loss, held.loss)


def test_sampling_mask_none_is_unchanged():
    """``sampling_mask=None`` is the call without it, bitwise."""
    g = torch.Generator().manual_seed(41)
    logits, ids, adv = torch.randn(2, 3, 11, generator=g), torch.randint(0, 11, (2, 3), generator=g), torch.randn(2, generator=g)
    a = gk.grpo_loss(logits, ids, adv, backend="torch")
    b = gk.grpo_loss(logits, ids, adv, backend="torch", sampling_mask=None)
    assert torch.equal(a.loss, b.loss) and "sampling/outside_kept_set" not in b.metrics


# ----------------------------------------------------------------------------------------- bad input
def _calls(mask, **extra):
    g = torch.Generator().manual_seed(51)
    logits, ids = torch.randn(2, 3, 11, generator=g), torch.randint(0, 11, (2, 3), generator=g)
    hidden, weight, adv = torch.randn(2, 3, 4, generator=g), torch.randn(11, 4, generator=g), torch.randn(2, generator=g)
    return [
        lambda: gk.token_logprobs(logits, ids, sampling_mask=mask, **extra),
        lambda: gk.fused_linear_token_logprobs(hidden, weight, ids, sampling_mask=mask, **extra),
        lambda: gk.grpo_loss(logits, ids, adv, sampling_mask=mask, **extra),
        lambda: gk.fused_linear_grpo_loss(hidden, weight, ids, adv, sampling_mask=mask, **extra),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad, error, match", [
    (SamplingMask.from_lists([[1]] * 5), ValueError, "sampling_mask holds 5 sets"),
    (SamplingMask.from_lists([[11]] * 6), ValueError, r"sampling_mask holds id 11 outside \[0, 11\)"),
    (SamplingMask.from_lists([[1, 2, 1]] + [[0]] * 5), ValueError, "sampling_mask repeats id 1"),
    (SamplingMask(torch.tensor([1, 2]), torch.tensor([0, 2, 1, 2, 2, 2, 2])), ValueError, "non-decreasing"),
    (SamplingMask(torch.tensor([1.0]), torch.tensor([0, 1, 1, 1, 1, 1, 1])), TypeError, "sampling_mask.token_ids"),
    ([[1]] * 6, TypeError, "sampling_mask must be a grpo_kernels.SamplingMask"),
])
def test_bad_sampling_mask_is_refused(backend, bad, error, match):
    for call in _calls(bad, backend=backend):
        with pytest.raises(error, match=match):
            call()


@pytest.mark.parametrize("truncation", [dict(top_k=3), dict(top_p=0.9)])
def test_sampling_mask_excludes_top_k_top_p(truncation):
    mask = SamplingMask.from_lists([[1]] * 6)
    for call in _calls(mask, **truncation):
        with pytest.raises(ValueError, match="sampling_mask"):
            call()
    for call in _calls(mask, top_k=0, top_p=1.0):  # vLLM's "off" values: no truncation
        call()


# ----------------------------------------------------------------------------- two gloo ranks, uneven shards
SHARDS = (90, V - 90)  # uneven vocabulary shards, in rank order
JOIN_TIMEOUT_S = 240


def _worker(rank: int, world: int, store_path: str) -> None:
    import datetime

    torch.set_num_threads(1)
    try:
        store = torch.distributed.FileStore(store_path, world)
        torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                             timeout=datetime.timedelta(seconds=90))
        group = torch.distributed.group.WORLD
        lo = sum(SHARDS[:rank])
        cols = slice(lo, lo + SHARDS[rank])
        sets, targets = case(71)
        g = torch.Generator().manual_seed(71)
        hidden, weight = torch.randn(2, 5, 8, generator=g), torch.randn(V, 8, generator=g)
        logits = hidden @ weight.t()
        mask = SamplingMask.from_lists(sets)
        grad_g, grad_e = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
        kw = dict(temperature=0.9, return_entropy=True, backend="torch")
        leaf64 = logits.double().requires_grad_()
        lp64, ent64, _ = replay64(leaf64, targets, sets, temperature=0.9)
        _loss_of(lp64, ent64, grad_g.double(), grad_e.double()).backward()
        # from logits: this rank's shard
        shard = logits[..., cols].clone().requires_grad_()
        logp, ent = gk.token_logprobs(shard, targets, sampling_mask=mask, process_group=group, **kw)
        assert_close64(logp, lp64, what=f"rank {rank} logp")
        assert_close64(ent, ent64, scale=5, what=f"rank {rank} entropy")
        _loss_of(logp, ent, grad_g, grad_e).backward()
        assert_close64(shard.grad, leaf64.grad[..., cols], what=f"rank {rank} d logits")
        # fused linear: this rank's rows of the weight
        h, w = hidden.clone().requires_grad_(), weight[cols].clone().requires_grad_()
        logp, ent = gk.fused_linear_token_logprobs(h, w, targets, sampling_mask=mask, process_group=group,
                                                   reduce_hidden_grad=True, **kw)
        assert_close64(logp, lp64, what=f"rank {rank} linear logp")
        h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
        lp64b, ent64b, _ = replay64(h64 @ w64.t(), targets, sets, temperature=0.9)
        _loss_of(lp64b, ent64b, grad_g.double(), grad_e.double()).backward()
        _loss_of(logp, ent, grad_g, grad_e).backward()
        assert_close64(w.grad, w64.grad[cols], what=f"rank {rank} d weight")
        assert_close64(h.grad, h64.grad, what=f"rank {rank} d hidden (reduced)")
        # the loss: the same on every rank, the outside-set share counted
        adv = torch.randn(2, generator=g)
        ids, cmask = targets.clamp(min=0), (targets != -100).float()
        out = gk.grpo_loss(logits[..., cols].clone(), ids, adv, cmask, sampling_mask=mask, process_group=group,
                           backend="torch")
        single = gk.grpo_loss(logits, ids, adv, cmask, sampling_mask=mask, backend="torch")
        assert_close64(out.loss, single.loss.double(), what=f"rank {rank} loss")
        assert out.metrics["sampling/outside_kept_set"].item() == single.metrics["sampling/outside_kept_set"].item()
    except BaseException:
        traceback.print_exc()
        raise
    leave_gloo_worker()


@pytest.mark.timeout(400)
def test_two_gloo_ranks_uneven_shards():
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(_worker, args=(2, os.path.join(tmp, "store")), nprocs=2, join=False,
                                     start_method="spawn")
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        try:
            while not context.join(timeout=max(1.0, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise AssertionError(f"two ranks did not finish in {JOIN_TIMEOUT_S} s (a hang)")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()


def test_backends_route_replay_to_their_kernels():
    """The torch backend replays with ``kernels/torch_replay.py``; the Triton one with
    ``kernels/triton_replay.py`` where that module provides the four functions."""
    from grpo_kernels import backends

    assert backends.REGISTRY["torch"].replay() is torch_replay
    try:
        from grpo_kernels.kernels import triton_replay
    except ImportError:
        assert backends.REGISTRY["triton"].replay() is torch_replay
        return
    complete = all(callable(getattr(triton_replay, name, None)) for name in backends.REPLAY_FUNCTIONS)
    assert backends.REGISTRY["triton"].replay() is (triton_replay if complete else torch_replay)
