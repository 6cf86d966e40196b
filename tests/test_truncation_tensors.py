"""top_k / top_p as tensors, one value per sequence (as vLLM takes them per request), and a kept target
whose own logit is -inf (issue 47, "Recompute, kept beside replay").

Tests ``grpo_kernels.options.LogitTransform`` (the tensors checked and broadcast), the row kernels
(``kernels/torch_rows.py``, ``kernels/triton_rows.py``: each row loads its own k / p) and
``reference.kept_tokens``, through the public functions, against spec64's float64 restatement of vLLM's
rules applied sequence by sequence with that sequence's own numbers (spec64 takes numbers only: an
independent route to the per-row answer).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import BACKENDS, DEVICE, KERNEL_BACKENDS, assert_close64, poison_allocations
from spec64 import sampled_logprobs64

import grpo_kernels as gk
from grpo_kernels import reference as R
from grpo_kernels.kernels import torch_rows
from grpo_kernels.options import LogitTransform

V = 23  # not a multiple of any block size
LOWEST = torch.finfo(torch.float32).min


def _batch(seed: int, b: int = 4, t: int = 3, v: int = V):
    """[b, t, v] logits on a quarter-integer grid (ties, also at the k-th value), one ignored target."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, t, v, generator=g) * 2).round() / 4
    targets = torch.randint(0, v, (b, t), generator=g)
    targets[1, t - 1] = -100
    return logits, targets


def _per_sequence64(logits, targets, temperature, top_k, top_p, **kw):
    """spec64's (logp, entropy, sum_sq) float64, each sequence under its own top_k / top_p (a tensor's
    value for that sequence, or the number), stacked: the per-row answer, built from scalar calls."""
    outs = []
    for i in range(logits.shape[0]):
        k = int(top_k[i]) if isinstance(top_k, torch.Tensor) else top_k
        p = float(top_p[i]) if isinstance(top_p, torch.Tensor) else top_p
        t = temperature[i:i + 1] if isinstance(temperature, torch.Tensor) else temperature
        outs.append(sampled_logprobs64(logits[i:i + 1], targets[i:i + 1], t, k, p, **kw))
    return tuple(torch.cat(parts) for parts in zip(*outs))


def _finite(x):
    return torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype, device=x.device))


# per-sequence values over 4 sequences: some rows on, some off (vLLM's 0 / -1 / >= V; top_p 1)
K_ROWS = torch.tensor([5, -1, 0, 9])
K_ROWS_WITH_V = torch.tensor([3, V, 1, V + 4])
P_ROWS = torch.tensor([0.7, 1.0, 0.35, 1.0], dtype=torch.float64)
CASES = {  # name -> (top_k, top_p)
    "k rows": (K_ROWS, None),
    "k rows, >= V off": (K_ROWS_WITH_V, None),
    "p rows": (None, P_ROWS),
    "k rows + p rows": (K_ROWS, P_ROWS),
    "k rows + p": (K_ROWS_WITH_V, 0.8),
    "k + p rows": (6, P_ROWS.float()),
    "k rows (int32) + p rows, T per sequence": (K_ROWS.int(), torch.tensor([1.0, 0.6, 0.9, 0.5])),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_per_sequence_truncation_is_each_sequences_own(backend, case, monkeypatch):
    """log-prob (-inf outside each row's kept set), entropy, sum of squared probabilities and the
    gradients of the log-prob and entropy, with [B] top_k / top_p tensors (rows on and rows off, mixed),
    against float64 spec64 run sequence by sequence with that sequence's numbers; every output written
    (poisoned allocations)."""
    poison_allocations(monkeypatch)
    logits, targets = _batch(1)
    top_k, top_p = CASES[case]
    temperature = torch.tensor([0.7, 1.3, 0.9, 1.1], dtype=torch.float64) if "T per" in case else 0.8
    dev = lambda z: z.to(DEVICE) if isinstance(z, torch.Tensor) else z  # noqa: E731
    x = logits.clone().to(DEVICE).requires_grad_()
    logp, entropy, sum_sq = gk.token_logprobs(x, targets.to(DEVICE), temperature=dev(temperature), top_k=dev(top_k),
                                              top_p=dev(top_p), return_entropy=True, return_sum_probs_sq=True,
                                              backend=backend)
    g = torch.Generator().manual_seed(2)
    up, ue = torch.rand(logits.shape[:2], generator=g), torch.rand(logits.shape[:2], generator=g)
    (_finite(logp) * up.to(DEVICE) + entropy * ue.to(DEVICE)).sum().backward()
    x64 = logits.double().requires_grad_()
    logp64, ent64, sq64 = _per_sequence64(x64, targets, temperature, top_k, top_p)
    (_finite(logp64) * up.double() + ent64 * ue.double()).sum().backward()
    outside = torch.isinf(logp64)
    assert torch.equal(torch.isinf(logp.cpu()), outside), "the kept sets differ"
    on_rows = [i for i in range(4) if _truncates(top_k, top_p, i)]
    assert outside[on_rows].any() and not outside[[i for i in range(4) if i not in on_rows]].any(), \
        "the case must truncate some rows (and leave the others whole)"
    assert_close64(logp, logp64, scale=5, what="logp")
    assert_close64(entropy, ent64, scale=5, what="entropy")
    assert_close64(sum_sq, sq64, what="sum_sq")
    assert_close64(x.grad, x64.grad, scale=max(0.1 * x64.grad.abs().max().item(), 1e-4), what="d logits")
    assert x.grad[1, 2].abs().max() == 0, "an ignored row gets no gradient"


def _truncates(top_k, top_p, i: int) -> bool:
    k = int(top_k[i]) if isinstance(top_k, torch.Tensor) else top_k
    p = float(top_p[i]) if isinstance(top_p, torch.Tensor) else top_p
    return (k is not None and 0 < k < V) or (p is not None and p < 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_sequence_truncation_of_the_fused_linear_function_and_the_loss(backend):
    """fused_linear_token_logprobs (chunks of 4 rows of 12: the per-row values follow the rows into each
    chunk) and grpo_loss / fused_linear_grpo_loss with [B] top_k / top_p: against float64, gradients to
    hidden and weight too; tokens outside a row's kept set leave the loss (finite everywhere)."""
    g = torch.Generator().manual_seed(7)
    b, t, h = 4, 3, 5
    hidden, weight = torch.randn(b, t, h, generator=g), torch.randn(V, h, generator=g) * 1.5
    targets = torch.randint(0, V, (b, t), generator=g)
    targets[2, 0] = -100
    top_k, top_p = torch.tensor([4, 0, 7, V]), torch.tensor([0.75, 0.5, 1.0, 1.0])
    leaves = [z.clone().to(DEVICE).requires_grad_() for z in (hidden, weight)]
    logp, entropy = gk.fused_linear_token_logprobs(*leaves, targets.to(DEVICE), top_k=top_k.to(DEVICE),
                                                   top_p=top_p.to(DEVICE), temperature=0.9, return_entropy=True,
                                                   backend=backend, **({"chunk_size": 4} if backend != "reference" else {}))
    (_finite(logp).sum() + entropy.sum()).backward()
    h64, w64 = (z.double().requires_grad_() for z in (hidden, weight))
    logp64, ent64, _ = _per_sequence64(h64 @ w64.t(), targets, 0.9, top_k, top_p)
    (_finite(logp64).sum() + ent64.sum()).backward()
    assert torch.equal(torch.isinf(logp.cpu()), torch.isinf(logp64)) and torch.isinf(logp64).any()
    assert_close64(logp, logp64, scale=5, what="logp")
    assert_close64(entropy, ent64, scale=5, what="entropy")
    for leaf, ref, name in zip(leaves, (h64, w64), ("hidden", "weight")):
        assert_close64(leaf.grad, ref.grad, scale=0.1 * ref.grad.abs().max().item(), what=f"d {name}")
    # the losses: finite, and equal to the reference's
    ids, adv = targets.clamp(min=0), torch.randn(b, generator=g)
    old = torch.randn(b, t, generator=g) * 0.05 - 2
    kw = dict(top_k=top_k.to(DEVICE), top_p=top_p.to(DEVICE), temperature=0.9, old_logps=old.to(DEVICE), beta=0.0)
    for function in ("grpo_loss", "fused_linear_grpo_loss"):
        args = (hidden @ weight.t(),) if function == "grpo_loss" else (hidden, weight)
        mine_leaves = [z.clone().to(DEVICE).requires_grad_() for z in args]
        ref_leaves = [z.clone().requires_grad_() for z in args]
        mine = getattr(gk, function)(*mine_leaves, ids.to(DEVICE), adv.to(DEVICE), backend=backend, **kw)
        ref = getattr(R, function)(*ref_leaves, ids, adv, **{k: (v.cpu() if isinstance(v, torch.Tensor) else v)
                                                            for k, v in kw.items()})
        mine.loss.backward()
        ref.loss.backward()
        assert math.isfinite(mine.loss.item()) and mine.metrics["sampling/outside_kept_set"] > 0
        assert_close64(mine.loss, ref.loss.double(), scale=5, what=f"{function} loss")
        for a, r in zip(mine_leaves, ref_leaves):
            assert torch.isfinite(a.grad).all()
            assert_close64(a.grad, r.grad.double(), scale=0.1 * r.grad.abs().max().item(), what=f"{function} grad")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", ["sequence", "token"])
def test_a_tensor_holding_one_value_is_the_number_bitwise(backend, shape):
    """A [B] or [B, T] top_k / top_p tensor holding the same number in every row gives the number's
    outputs and gradients bitwise, on all four functions (top_p float64, or a float32-exact value; the
    Triton interpreter being slow, its fused-linear and loss calls run for one of the cases only)."""
    logits, targets = _batch(3, b=2)
    b, t = targets.shape
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(b, t, 5, generator=g), torch.randn(V, 5, generator=g)
    adv, old = torch.randn(b, generator=g), torch.randn(b, t, generator=g) * 0.1 - 3
    ids = targets.clamp(min=0)
    full = lambda value, dtype: torch.full((b,) if shape == "sequence" else (b, t), value, dtype=dtype,  # noqa: E731
                                           device=DEVICE)
    for top_k, top_p in ((5, None), (None, 0.8), (7, 0.6), (4, 0.75)):

        every_function = backend != "triton" or (top_k, top_p) == (7, 0.6)

        def run(**sampling):
            x, h, w = (z.clone().to(DEVICE).requires_grad_() for z in (logits, hidden, weight))
            kw = dict(temperature=0.9, backend=backend, **sampling)
            lp, ent, sq = gk.token_logprobs(x, targets.to(DEVICE), return_entropy=True, return_sum_probs_sq=True, **kw)
            if not every_function:
                (_finite(lp).sum() + ent.sum()).backward()
                return lp, ent, sq, x.grad
            flp = gk.fused_linear_token_logprobs(h, w, targets.to(DEVICE), **kw)
            loss = gk.grpo_loss(x, ids.to(DEVICE), adv.to(DEVICE), old_logps=old.to(DEVICE), **kw).loss
            floss = gk.fused_linear_grpo_loss(h, w, ids.to(DEVICE), adv.to(DEVICE), old_logps=old.to(DEVICE), **kw).loss
            (_finite(lp).sum() + ent.sum() + _finite(flp).sum() + loss + floss).backward()
            return lp, ent, sq, flp, loss, floss, x.grad, h.grad, w.grad

        number = run(top_k=top_k, top_p=top_p)
        p_dtype = torch.float32 if top_p == 0.75 else torch.float64  # (0.75: float32-exact)
        tensor = run(top_k=None if top_k is None else full(top_k, torch.int64),
                     top_p=None if top_p is None else full(top_p, p_dtype))
        assert torch.isinf(number[0]).any(), "the case must truncate"
        for a, c in zip(number, tensor):
            assert torch.equal(a, c), (top_k, top_p)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_every_row_off_is_the_plain_softmax_bitwise(backend):
    """A tensor of vLLM's "off" values only (top_k 0 / -1, top_p 1) is no truncation at all (it becomes
    None when checked); one of top_k >= V in every row keeps every token (the same numbers)."""
    logits, targets = _batch(4)
    logits, targets = logits.to(DEVICE), targets.to(DEVICE)
    plain = gk.token_logprobs(logits, targets, temperature=0.7, return_entropy=True, backend=backend)
    assert LogitTransform(top_k=torch.tensor([0, -1, 0, -1]), top_p=torch.ones(4)).truncates is False
    out = gk.token_logprobs(logits, targets, temperature=0.7, top_k=torch.tensor([0, -1, 0, -1], device=DEVICE),
                            top_p=torch.ones(4, device=DEVICE), return_entropy=True, backend=backend)
    assert all(torch.equal(a, c) for a, c in zip(out, plain))
    wide = gk.token_logprobs(logits, targets, temperature=0.7, top_k=torch.full((4,), V, device=DEVICE),
                             return_entropy=True, backend=backend)
    for a, c in zip(wide, plain):
        assert_close64(a, c.double(), scale=5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kept_target_with_a_minus_inf_logit_is_minus_inf(backend):
    """A target whose own logit is -inf but which a truncation keeps (fewer finite logits than k: the k-th
    largest is -inf) gets -inf, as vLLM's log_softmax gives it, and no log-prob gradient; the entropy and
    the other rows are unchanged. Where the row does not truncate (a per-row "off" value, or no
    truncation) it keeps the floor of the untruncated softmax (float32's lowest, docs/api.md)."""
    logits, _ = _batch(5, b=3, t=2)
    logits[:, 0, 4:] = float("-inf")  # 4 finite logits in the first token of every sequence
    targets = torch.tensor([[9, 1], [9, 2], [9, 3]])  # logit -inf at (i, 0)
    top_k = torch.tensor([6, -1, 6])  # 6 > 4 finite: the k-th largest is -inf, every token kept
    for kw, expect in ((dict(top_k=top_k), [-math.inf, LOWEST, -math.inf]), (dict(top_k=6), [-math.inf] * 3),
                       (dict(top_k=6, top_p=torch.tensor([1.0, 1.0, 0.9])), [-math.inf] * 3), (dict(), [LOWEST] * 3)):
        x = logits.clone().to(DEVICE).requires_grad_()
        k = kw.get("top_k")
        sampling = {name: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for name, v in kw.items()}
        logp, entropy = gk.token_logprobs(x, targets.to(DEVICE), temperature=0.8, return_entropy=True,
                                          backend=backend, **sampling)
        assert logp[:, 0].tolist() == expect, kw
        if isinstance(kw.get("top_p"), torch.Tensor):  # row 2's top-p drops the -inf ones too: outside
            assert torch.isinf(logp[2, 0])
        (_finite(logp).sum() + entropy.sum()).backward()
        assert torch.isfinite(x.grad).all() and torch.isfinite(entropy).all(), kw
        # the gradient: the kept rows' float64 answer (no log-prob term at a -inf target where it truncates)
        x64 = logits.double().requires_grad_()
        if k is None:
            logp64, ent64, _ = sampled_logprobs64(x64, targets, 0.8)
        else:
            logp64, ent64, _ = _per_sequence64(x64, targets, 0.8, k, kw.get("top_p"))
        floor = torch.tensor(expect) == LOWEST  # (spec64 never keeps a -inf token: the floor's rows apart)
        (torch.where(torch.isfinite(logp64), logp64, 0.0).sum() + ent64.sum()).backward()
        if floor.any():  # the floor's gradient is the exact log-prob's: the one-hot term minus p, over T
            p = torch.softmax(logits[:, 0].double() / 0.8, -1)
            onehot = torch.nn.functional.one_hot(targets[:, 0], V).double()
            x64.grad[:, 0][floor] += ((onehot - p) / 0.8)[floor]
        assert_close64(entropy, ent64, scale=5, what="entropy")
        assert_close64(x.grad, x64.grad, scale=0.1 * x64.grad.abs().max().item(), what=f"d logits {kw}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_truncation_tensors_are_refused_before_any_kernel(backend, monkeypatch):
    """A float top_k tensor, a value out of the declared range (top_k < -1; top_p 0, 1.5, NaN), a wrong
    shape, a 0-d tensor or another device: a ValueError / TypeError naming top_k / top_p, on all four
    functions and every backend, before any row kernel runs."""
    monkeypatch.setattr(torch_rows, "forward_rows", lambda *a, **k: pytest.fail("a kernel ran"))
    from grpo_kernels.kernels import triton_rows

    for name in ("forward_rows", "forward_rows_sampled"):
        monkeypatch.setattr(triton_rows, name, lambda *a, **k: pytest.fail("a kernel ran"))
    logits, targets = _batch(6)
    b, t = targets.shape
    hidden, weight = torch.randn(b, t, 4), torch.randn(V, 4)
    bad = [
        (dict(top_k=torch.tensor([2.0, 3.0, 1.0, 4.0])), TypeError, "top_k"),
        (dict(top_k=torch.tensor([True, False, True, True])), TypeError, "top_k"),
        (dict(top_k=torch.tensor([2, -2, 1, 4])), ValueError, "top_k"),
        (dict(top_k=torch.tensor([2, 3, 1])), ValueError, "top_k"),
        (dict(top_k=torch.ones(b, t + 1, dtype=torch.int64)), ValueError, "top_k"),
        (dict(top_k=torch.tensor(3)), TypeError, "top_k"),
        (dict(top_k=torch.ones(b, dtype=torch.int64, device="meta")), ValueError, "top_k"),
        (dict(top_p=torch.tensor([0.5, 0.0, 0.9, 1.0])), ValueError, "top_p"),
        (dict(top_p=torch.tensor([0.5, 1.5, 0.9, 1.0])), ValueError, "top_p"),
        (dict(top_p=torch.tensor([0.5, float("nan"), 0.9, 1.0])), ValueError, "top_p"),
        (dict(top_p=torch.tensor([1, 1, 1, 1])), TypeError, "top_p"),
        (dict(top_p=torch.full((b + 1,), 0.5)), ValueError, "top_p"),
        (dict(top_p=torch.tensor(0.5)), TypeError, "top_p"),
        (dict(top_p=torch.full((b,), 0.5, device="meta")), ValueError, "top_p"),
    ]
    for kw, error, name in bad:
        calls = [lambda: gk.token_logprobs(logits, targets, backend=backend, **kw),
                 lambda: gk.fused_linear_token_logprobs(hidden, weight, targets, backend=backend, **kw),
                 lambda: gk.grpo_loss(logits, targets.clamp(min=0), torch.ones(b), backend=backend, **kw),
                 lambda: gk.fused_linear_grpo_loss(hidden, weight, targets.clamp(min=0), torch.ones(b), backend=backend,
                                                   **kw)]
        for call in calls:
            with pytest.raises(error, match=name):
                call()


def test_transform_keeps_broadcasts_and_slices_the_tensors_and_the_modules_take_them(monkeypatch):
    """LogitTransform keeps a checked tensor (not a copy), reads its values once (one ``.tolist()`` of two
    flags per tensor), broadcasts a [B] one to the call's rows and slices it with the rows; GRPOLoss /
    FusedLinearGRPOLoss hold [B] tensors and give the function's numbers."""
    k, p = torch.tensor([3, 0, -1, 7]), torch.tensor([0.5, 1.0, 0.9, 1.0])
    reads = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or real_tolist(self))
    transform = LogitTransform(temperature=0.7, top_k=k, top_p=p)
    monkeypatch.setattr(torch.Tensor, "tolist", real_tolist)
    assert len(reads) == 2, "one read of each tensor's values"
    assert transform.top_k is k and transform.top_p is p and transform.truncates and transform.truncates_per_row
    rows = transform.for_rows((4, 3))
    assert rows.top_k.shape == (4, 3) and torch.equal(rows.top_k[:, 2], k) and rows.temperature == 0.7
    assert torch.equal(rows.rows(torch.tensor([0, 7, 11])).top_p, torch.tensor([0.5, 0.9, 1.0]))
    g = torch.Generator().manual_seed(3)
    logits, hidden, weight = torch.randn(4, 3, V, generator=g), torch.randn(4, 3, 5, generator=g), torch.randn(V, 5, generator=g)
    ids, adv = logits.argmin(-1), torch.randn(4, generator=g)
    module = gk.GRPOLoss(top_k=k, top_p=p, temperature=0.9, backend="torch")
    direct = gk.grpo_loss(logits, ids, adv, top_k=k, top_p=p, temperature=0.9, backend="torch")
    held = module(logits, ids, adv)
    assert torch.equal(held.loss, direct.loss) and held.metrics["sampling/outside_kept_set"] > 0
    fused = gk.FusedLinearGRPOLoss(top_k=k, top_p=p, backend="torch")
    assert torch.equal(fused(hidden, weight, ids, adv).loss,
                       gk.fused_linear_grpo_loss(hidden, weight, ids, adv, top_k=k, top_p=p, backend="torch").loss)


def test_torch_truncation_per_row_asks_for_more_candidates(monkeypatch):
    """torch_rows.truncation with per-row k / p and a first request of 2 candidates: the nucleus grows
    row by row as with numbers, the rows without top-p take no candidates, a row with neither keeps all
    (threshold -inf, tie index -1); every row's kept set is kept_tokens' (the reference's) and spec64's."""
    monkeypatch.setattr(torch_rows, "_TOP_P_CANDIDATES", 2)
    g = torch.Generator().manual_seed(11)
    y = (torch.randn(5, 41, generator=g) * 1.5).round() / 2
    e = torch.exp(y - y.amax(-1, keepdim=True))
    k = torch.tensor([7, -1, 0, 3, 41])
    p = torch.tensor([0.9, 0.95, 1.0, 1.0, 1.0])
    threshold, tie = torch_rows.truncation(y, e, k, p)
    assert threshold[2] == -math.inf and tie[2] == -1 and tie[4] == -1 and (tie[[0, 1, 3]] >= 0).all()
    mine = torch_rows.kept_mask(y, threshold, tie)
    assert torch.equal(mine, R.kept_tokens(y, y, k, p))
    from spec64 import vllm_kept64

    for i in range(5):
        assert torch.equal(mine[i], vllm_kept64(y[i].double(), int(k[i]), float(p[i]))), i


@pytest.mark.parametrize("capacity", [None, 2], ids=["candidates", "fallback"])
def test_triton_per_row_candidates_and_fallback(capacity, monkeypatch):
    """forward_rows_sampled with top_k_rows / top_p_rows: both paths (the candidates that fit; a scratch
    of 2 forcing every truncated row through the fallback kernel, including a row whose top-k is off
    but top-p on) against spec64 row by row, and the kept set torch_rows finds."""
    pytest.importorskip("triton")
    from grpo_kernels.kernels import triton_rows

    from test_triton_rows import _poisoned_empty

    monkeypatch.setattr(triton_rows, "SAMPLING_CAPACITY_OVERRIDE", capacity)
    monkeypatch.setattr(torch, "empty", _poisoned_empty(torch.empty))
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(2, 3, 45, generator=g) * 2).round() / 4  # ties
    targets = logits.argmax(-1)
    targets[0, 1] = logits[0, 1].argmin()
    targets[1, 2] = -100
    k = torch.tensor([[5, -1, 30], [0, 7, 2]])
    p = torch.tensor([[1.0, 0.8, 0.6], [1.0, 0.5, 1.0]])
    out = triton_rows.forward_rows_sampled(logits.to(DEVICE), targets.to(DEVICE), 0.9, -100, True, with_sum_sq=True,
                                           top_k_rows=k.to(DEVICE), top_p_rows=p.to(DEVICE))
    logp, entropy, row_max, log_sum, sum_sq, threshold, tie = (x.cpu() for x in out)
    valid = targets != -100
    assert not any(torch.isnan(x).any() for x in (row_max, log_sum, threshold))
    assert tie[1, 0] == -1 and threshold[1, 0] == -math.inf, "a row with neither: everything kept"
    for i in range(2):
        for j in range(3):
            if not valid[i, j]:
                continue
            ref = sampled_logprobs64(logits[i, j][None], targets[i, j][None], 0.9, int(k[i, j]), float(p[i, j]))
            assert math.isinf(logp[i, j]) == math.isinf(ref[0][0]), (i, j)
            assert_close64(logp[i, j][None], ref[0], scale=5, what=f"logp {i, j}")
            assert_close64(entropy[i, j][None], ref[1], scale=5, what=f"entropy {i, j}")
            assert_close64(sum_sq[i, j][None], ref[2], what=f"sum_sq {i, j}")
    mine = torch_rows.kept_mask(logits, threshold, tie)
    stats = torch_rows.forward_rows(logits, targets, 0.9, -100, True, top_k=k, top_p=p)
    assert torch.equal(mine[valid], torch_rows.kept_mask(logits, stats.threshold, stats.tie_index)[valid])


def test_vllms_own_sampler_keeps_the_same_tokens_per_row():
    """vLLM's own apply_top_k_top_p (vllm.v1.sample.ops.topk_topp_sampler) with per-request k / p tensors
    keeps, row by row, the tokens our log-probs keep (finite log-prob) with the same tensors."""
    topk_topp = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    apply = getattr(topk_topp, "apply_top_k_top_p_pytorch", None) or topk_topp.apply_top_k_top_p
    g = torch.Generator().manual_seed(0)
    n, v = 24, 50
    z = torch.randn(n, v, generator=g) * 2
    k = torch.randint(1, v, (n,), generator=g)
    k[::5] = v  # vLLM's "off" (>= V) for some rows
    p = torch.rand(n, generator=g) * 0.98 + 0.01
    p[::4] = 1.0
    try:
        processed = apply(z.clone(), k, p, allow_cpu_sync=True)
    except TypeError:
        processed = apply(z.clone(), k, p)
    vllm_kept = torch.isfinite(processed)
    assert vllm_kept[0].all() and not vllm_kept.all(), "rows off (row 0: k = V, p = 1) and rows truncated"
    vllm_logp = torch.log_softmax(processed, -1)  # (its processed log-probs, at temperature 1)
    ids = torch.arange(v)
    for backend in ("torch", "reference"):
        for row in range(n):  # every token of the row as a target, the row's k / p as a [V] tensor
            logp = gk.token_logprobs(z[row].expand(v, v), ids, top_k=k[row].expand(v), top_p=p[row].expand(v),
                                     backend=backend)
            assert torch.equal(torch.isfinite(logp), vllm_kept[row]), (backend, row)
            assert_close64(logp, vllm_logp[row].double(), scale=5, what=f"{backend} row {row}")


def test_per_sequence_tensors_trace_under_torch_compile_fullgraph():
    """torch.compile(fullgraph=True, aot_eager) through the Triton backend with [B] top_k / top_p tensors:
    no graph break (the tensors reach the custom op as its top_k_rows / top_p_rows), the eager answer
    and gradient bitwise."""
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(2, 3, 19, generator=g).to(DEVICE), torch.randint(0, 19, (2, 3), generator=g).to(DEVICE)
    k, p = torch.tensor([4, -1], device=DEVICE), torch.tensor([0.8, 0.6], device=DEVICE)

    def fn(x, t, k, p):
        lp, ent = gk.token_logprobs(x, t, top_k=k, top_p=p, return_entropy=True, backend="triton")
        return _finite(lp).sum() + ent.sum()

    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    eager = fn(xa, t, k, p)
    eager.backward()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(xb, t, k, p)
    compiled.backward()
    assert torch.equal(eager, compiled) and torch.equal(xa.grad, xb.grad)


_AOT_SCRIPT = r"""
import sys, torch
from grpo_kernels.kernels import triton_rows
from tools import aot
try:
    aot.check_supported()
except aot.Unsupported as e:
    print("UNSUPPORTED", e); sys.exit(0)
b, t, v = 2, 64, 32000
meta = dict(device="meta")
logits = torch.empty(b, t, v, dtype=torch.bfloat16, **meta)
targets = torch.empty(b, t, dtype=torch.int64, **meta)
rows = lambda dtype=torch.float32: torch.empty(b, t, dtype=dtype, **meta)
calls = [(triton_rows.forward_rows_sampled, dict(top_k_rows=rows(torch.int64), top_p_rows=rows(), with_sum_sq=True)),
         (triton_rows.forward_rows_sampled, dict(top_k=50, top_p_rows=rows())),
         (triton_rows.backward_rows, dict(row_max=rows(), log_sum=rows(), entropy=rows(), grad_logp=rows(),
                                          grad_entropy=rows(), out=torch.empty_like(logits), threshold=rows(),
                                          tie_index=rows(torch.int32)))]
for fn, kw in calls:
    extra = dict(with_entropy=True) if fn is triton_rows.forward_rows_sampled else {}
    for launch in aot.capture_launches(triton_rows, fn, logits=logits, targets=targets, temperature=0.7,
                                       ignore_index=-100, **extra, **kw):
        args, options = aot.launch_spec(launch)
        aot.compile_kernel(launch.kernel, args, launch.constexpr_names, 90, options)
        print("COMPILED", launch.kernel.fn.__name__ if hasattr(launch.kernel, "fn") else launch.kernel)
"""


def test_per_row_sampled_kernels_compile_for_sm90(tmp_path):
    """The per-row sampled kernels (forward and fallback with PER_ROW_KP, both tensors and a number with
    a tensor) and the truncated backward compile ahead of time for sm_90 (LLVM and ptxas, no GPU:
    ``tools/aot.py``), in a fresh interpreter without TRITON_INTERPRET and with a private cache."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=900,
                          cwd=root)
    if "UNSUPPORTED" in proc.stdout:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("COMPILED") == 5, proc.stdout  # 2 x (forward, fallback) + the backward
