"""Vocabulary-parallel log-probs and GRPO losses (``grpo_kernels.vocab_parallel``) on the CPU with gloo.

Each test spawns 2 or 3 processes (``torch.multiprocessing``, a gloo group over a FileStore); every
rank builds the same random batch, takes its uneven contiguous shard of the vocabulary (logits, or
``weight [V_r, H]`` and ``bias [V_r]``), and checks, against the float64 statement in
``tests/spec64.py`` on the whole vocabulary: per-token log-probs, entropies, the loss and every
metric (and that they are bitwise equal on all ranks), the gradient of its shard (the matching
slice of the unsharded gradient), and ``d hidden`` (this rank's partial sum; their sum, or the
all-reduced one with ``reduce_hidden_grad``, is the full one). A counting wrapper around the
collectives checks that only O(tokens) values travel. Bad input raises the same error on every
rank, and the group still works afterwards. A stuck collective fails the test after a timeout.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from helpers import assert_close64, leave_gloo_worker
from grpo_cases import OPTION_CASES, build_kwargs, make_batch
from spec64 import grpo64, logprobs64

from grpo_kernels.vocab_parallel import FINGERPRINT_SLOTS

SHARDS = {2: (7, 12), 3: (5, 9, 6)}  # uneven vocabulary shards, in rank order
B, T, H = 3, 5, 8
JOIN_TIMEOUT_S = 240  # a deadlock fails the test instead of hanging CI
COLLECTIVE_TIMEOUT_S = 90


# ---------------------------------------------------------------------------- the parent's side
def _spawn(world: int, scenarios) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(_worker, args=(world, scenarios, os.path.join(tmp, "store")),
                                     nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        try:
            while not context.join(timeout=max(1.0, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise AssertionError(f"{scenarios} on {world} ranks did not finish in {JOIN_TIMEOUT_S} s (a hang)")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()


# One spawn per group size (starting the processes is most of the time): the torch backend's
# matrix, the Triton kernels (interpreter) on a few cases, then bad input (2 ranks) or a DTensor
# weight (3 ranks).
@pytest.mark.timeout(600)
def test_two_ranks():
    _spawn(2, ("match:torch", "match_small:triton", "bad_input:torch"))


@pytest.mark.timeout(600)
def test_three_ranks():
    _spawn(3, ("match:torch", "match_small:triton", "dtensor:torch"))


def test_without_a_group():
    """No group: reduce_hidden_grad=True has nothing to reduce over, and a group needs torch.distributed."""
    import grpo_kernels as gk

    hidden, weight = torch.randn(2, 3, 4), torch.randn(5, 4)
    ids, adv = torch.randint(0, 5, (2, 3)), torch.randn(2)
    with pytest.raises(ValueError, match="reduce_hidden_grad"):
        gk.fused_linear_grpo_loss(hidden, weight, ids, adv, reduce_hidden_grad=True)
    with pytest.raises(TypeError, match="reduce_hidden_grad"):
        gk.fused_linear_token_logprobs(hidden, weight, ids, reduce_hidden_grad="yes")
    if not torch.distributed.is_initialized():
        with pytest.raises(ValueError, match="not initialised"):
            gk.token_logprobs(torch.randn(2, 3, 5), ids, process_group=object())


# ---------------------------------------------------------------------------- the ranks' side
class CommunicationLog:
    """Counts the elements every collective of ``torch.distributed`` carries on this rank."""

    def __init__(self, dist) -> None:
        self.dist, self.elements, self.largest = dist, 0, 0
        self.original = dist.all_reduce

        def all_reduce(tensor, *args, **kwargs):
            self.elements += tensor.numel()
            self.largest = max(self.largest, tensor.numel())
            return self.original(tensor, *args, **kwargs)

        dist.all_reduce = all_reduce

    def reset(self) -> None:
        self.elements, self.largest = 0, 0


def _worker(rank: int, world: int, scenarios, store_path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        for scenario in scenarios:
            name, backend = scenario.split(":")
            {"match": _match, "match_small": _match_small, "bad_input": _bad_input, "dtensor": _dtensor}[name](
                rank, world, backend)
    except BaseException:
        traceback.print_exc()
        dist.destroy_process_group()
        raise
    leave_gloo_worker()


def _shard(world: int, rank: int):
    sizes = SHARDS[world]
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank]), sum(sizes)


def _same_on_all_ranks(x: torch.Tensor, what: str) -> None:
    import torch.distributed as dist

    gathered = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, x.detach().contiguous())
    for other in gathered:
        assert torch.equal(other, x.detach()) or (torch.isnan(other) == torch.isnan(x)).all(), f"{what} differs across ranks"


def _check_logprobs(rank, world, backend, log, seed, dtype=torch.float32, **transform):
    import grpo_kernels as gk

    cols, vocab = _shard(world, rank)
    logits, ids, mask, *_ = make_batch(seed, B=B, T=T, V=vocab)
    ids = torch.where(mask != 0, ids, -100)
    full = logits.double().requires_grad_()
    logp64, ent64 = logprobs64(full, ids, **transform)
    g = torch.Generator().manual_seed(seed + 1)
    up_logp, up_ent = torch.randn(B, T, generator=g, dtype=torch.float64), torch.randn(B, T, generator=g, dtype=torch.float64)
    (logp64 * up_logp + ent64 * up_ent).sum().backward()

    shard = logits[..., cols].to(dtype).requires_grad_()
    log.reset()
    logp, ent = gk.token_logprobs(shard, ids, return_entropy=True, backend=backend,
                                  process_group=torch.distributed.group.WORLD, **transform)
    # O(tokens) values travel: one exchange of the call's fingerprint, then 5 floats per token
    assert log.largest <= max(4 * B * T, 64), f"a collective carried {log.largest} elements"
    assert log.elements <= 5 * B * T + 2 * world + 2 * FINGERPRINT_SLOTS
    (logp * up_logp.float() + ent * up_ent.float()).sum().backward()
    what = f"token_logprobs {transform} {dtype} rank {rank}/{world}"
    assert_close64(logp, logp64, dtype, what=what + " logp")
    assert_close64(ent, ent64, dtype, what=what + " entropy")
    assert_close64(shard.grad, full.grad[..., cols], dtype, what=what + " d logits")
    _same_on_all_ranks(logp, what)
    _same_on_all_ranks(ent, what)


def _check_grpo(rank, world, backend, log, seed, case, linear=False, bias=False, reduce_hidden_grad=False,
                dtype=torch.float32, inplace_backward=False):
    import grpo_kernels as gk

    cols, vocab = _shard(world, rank)
    batch = make_batch(seed, B=B, T=T, V=vocab)
    logits, ids, mask = batch[:3]
    advantages, kw = build_kwargs(case, batch)
    if "segment_ids" in case:  # packed rows: two sequences per row
        kw["segment_ids"] = (torch.arange(T) >= 2).long().expand(B, T).contiguous()
        advantages = batch[6]
    what = f"{'fused_linear_' if linear else ''}grpo_loss {case} {dtype} rank {rank}/{world}"
    g = torch.Generator().manual_seed(seed + 7)
    if linear:
        hidden = torch.randn(B, T, H, generator=g)
        weight = torch.randn(vocab, H, generator=g) * 0.5
        b_full = torch.randn(vocab, generator=g) if bias else None
        h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
        b64 = None if b_full is None else b_full.double().requires_grad_()
        logits64 = h64 @ w64.t() + (0 if b64 is None else b64)
    else:
        logits64 = logits.double().requires_grad_()
    loss64, logp64, metrics64 = grpo64(logits64, ids, advantages, mask, **kw)
    loss64.backward()

    log.reset()
    group = torch.distributed.group.WORLD
    if linear:
        h = hidden.to(dtype).requires_grad_()
        w = weight[cols].to(dtype).requires_grad_()
        b_ = None if b_full is None else b_full[cols].to(dtype).requires_grad_()
        out = gk.fused_linear_grpo_loss(h, w, ids, advantages, mask, bias=b_, backend=backend, process_group=group,
                                        reduce_hidden_grad=reduce_hidden_grad, chunk_size=4, **kw)
    else:
        shard = logits[..., cols].to(dtype).requires_grad_()
        x = shard * 1 if inplace_backward else shard  # the buffer the gradient overwrites
        out = gk.grpo_loss(x, ids, advantages, mask, backend=backend, process_group=group,
                           inplace_backward=inplace_backward, **kw)
    assert log.largest <= max(4 * B * T, 64), f"{what}: a collective carried {log.largest} elements"
    out.loss.backward()
    assert_close64(out.loss, loss64, dtype, what=what + " loss")
    assert_close64(out.per_token_logps, logp64, dtype, what=what + " per_token_logps")
    assert set(out.metrics) == set(metrics64), what
    for name, value in out.metrics.items():
        assert_close64(value, metrics64[name], dtype, what=f"{what} metric {name}")
        _same_on_all_ranks(value.reshape(1), f"{what} metric {name}")
    _same_on_all_ranks(out.loss.reshape(1), what + " loss")
    _same_on_all_ranks(out.per_token_logps, what + " per_token_logps")
    if not linear:
        assert_close64(shard.grad, logits64.grad[..., cols], dtype, what=what + " d logits")
        return
    assert_close64(w.grad, w64.grad[cols], dtype, what=what + " d weight")
    if b_ is not None:
        assert_close64(b_.grad, b64.grad[cols], dtype, what=what + " d bias")
    if reduce_hidden_grad:
        assert_close64(h.grad, h64.grad, dtype, what=what + " d hidden (all-reduced)")
    else:  # this rank's partial sum; the ranks' partials add up to the whole gradient
        total = h.grad.clone()
        torch.distributed.all_reduce(total)
        assert_close64(total, h64.grad, dtype, what=what + " sum of the partial d hidden")
        if h64.grad.abs().max() > 1e-3:  # (a batch whose tokens are all clipped has no gradient)
            assert not torch.allclose(h.grad.double(), h64.grad), what + ": d hidden already reduced"


def _match(rank, world, backend):
    import torch.distributed as dist

    log = CommunicationLog(dist)
    _check_logprobs(rank, world, backend, log, 1)
    _check_logprobs(rank, world, backend, log, 2, temperature=0.7, softcap=3.0, logit_scale=1.3)
    _check_logprobs(rank, world, backend, log, 3, temperature=1.2, logit_scale=0.8)
    _check_logprobs(rank, world, backend, log, 4, dtype=torch.bfloat16)
    cases = dict(OPTION_CASES)
    for loss_type in ("grpo", "bnpo", "dr_grpo", "luspo", "cispo", "sapo", "vespo"):
        cases[loss_type] = dict(use_old=True, use_ref=True, beta=0.05, loss_type=loss_type)
    cases["softcap"] = dict(use_old=True, softcap=2.5, temperature=0.9)
    cases["packed"] = dict(use_old=True, use_ref=True, beta=0.05, segment_ids=True, loss_type="grpo")
    cases["packed_gspo"] = dict(use_old=True, segment_ids=True, importance_sampling_level="sequence")
    cases["num_items"] = dict(use_old=True, num_items_in_batch=9)
    if world > 2:  # the whole matrix runs on 2 ranks; 3 ranks take a covering subset
        cases = {k: cases[k] for k in ("old_ref_beta", "is_ratio_per_sequence", "entropy_coef", "gspo", "cispo", "sapo",
                                       "vespo", "softcap", "packed", "packed_gspo")}
    for i, case in enumerate(cases.values()):
        _check_grpo(rank, world, backend, log, 10 + i, case)
    _check_grpo(rank, world, backend, log, 40, cases["old_ref_beta"], dtype=torch.bfloat16)
    _check_grpo(rank, world, backend, log, 41, cases["entropy_coef"], inplace_backward=True)
    for i, name in enumerate(("old_ref_beta", "gspo", "entropy_coef", "packed", "vespo")):
        _check_grpo(rank, world, backend, log, 50 + i, cases[name], linear=True, bias=i % 2 == 0,
                    reduce_hidden_grad=i % 2 == 1)
    _check_fused_linear_logprobs(rank, world, backend)
    _check_modules(rank, world, backend)
    _check_sampling(rank, world, backend)


def _check_sampling(rank, world, backend):
    """A temperature tensor (per sequence, per token) and the sum of squared probabilities across shards:
    the one-device call's values and gradients (the shards' slices); top_k / top_p refused by name."""
    import grpo_kernels as gk

    group = torch.distributed.group.WORLD
    cols, vocab = _shard(world, rank)
    logits, ids, mask, old, ref, adv, *_ = make_batch(71, B=B, T=T, V=vocab)
    ids = torch.where(mask != 0, ids, -100)
    for temperature in (torch.tensor([0.6, 1.0, 1.5], dtype=torch.float64)[:B].expand(B).contiguous(),
                        torch.rand(B, T, generator=torch.Generator().manual_seed(72)) + 0.5):
        full = logits.clone().requires_grad_()
        lp1, ent1, sq1 = gk.token_logprobs(full, ids, temperature=temperature, return_entropy=True,
                                           return_sum_probs_sq=True, backend=backend)
        (lp1 + 0.5 * ent1).sum().backward()
        shard = logits[..., cols].clone().requires_grad_()
        lp, ent, sq = gk.token_logprobs(shard, ids, temperature=temperature, return_entropy=True,
                                        return_sum_probs_sq=True, backend=backend, process_group=group)
        (lp + 0.5 * ent).sum().backward()
        what = f"temperature {tuple(temperature.shape)} rank {rank}/{world}"
        assert_close64(lp, lp1.double(), what=what + " logp", scale=5)
        assert_close64(ent, ent1.double(), what=what + " entropy", scale=5)
        assert_close64(sq, sq1.double(), what=what + " sum_sq")
        assert_close64(shard.grad, full.grad[..., cols].double(), what=what + " d logits")
        _same_on_all_ranks(sq, what)
    hidden = torch.randn(B, T, H, generator=torch.Generator().manual_seed(73))
    weight = torch.randn(vocab, H, generator=torch.Generator().manual_seed(74))
    temperature = torch.tensor([0.7, 1.2, 0.9])[:B].expand(B).contiguous()
    one = gk.fused_linear_token_logprobs(hidden, weight, ids, temperature=temperature, return_sum_probs_sq=True,
                                         backend=backend)
    many = gk.fused_linear_token_logprobs(hidden, weight[cols], ids, temperature=temperature, return_sum_probs_sq=True,
                                          backend=backend, process_group=group, chunk_size=4)
    for a, b, name in zip(many, one, ("logp", "sum_sq")):
        assert_close64(a, b.double(), what=f"fused linear {name} rank {rank}/{world}", scale=5)
    loss_one = gk.grpo_loss(logits, ids.clamp(min=0), adv, mask, old_logps=old, temperature=temperature, backend=backend)
    loss_many = gk.grpo_loss(logits[..., cols].contiguous(), ids.clamp(min=0), adv, mask, old_logps=old,
                             temperature=temperature, backend=backend, process_group=group)
    assert_close64(loss_many.loss, loss_one.loss.double(), what="grpo_loss with a temperature tensor")


def _check_modules(rank, world, backend):
    """The modules hold process_group (and reduce_hidden_grad) like any other keyword."""
    import grpo_kernels as gk

    group = torch.distributed.group.WORLD
    cols, vocab = _shard(world, rank)
    logits, ids, mask, old, *_ = make_batch(61, B=B, T=T, V=vocab)
    adv = torch.randn(B, generator=torch.Generator().manual_seed(62))
    shard = logits[..., cols].contiguous()
    module = gk.GRPOLoss(process_group=group, loss_type="grpo", backend=backend)
    direct = gk.grpo_loss(shard, ids, adv, mask, process_group=group, loss_type="grpo", backend=backend)
    assert torch.equal(module(shard, ids, adv, mask).loss, direct.loss)
    hidden, weight = torch.randn(B, T, H), torch.randn(cols.stop - cols.start, H)
    module = gk.FusedLinearGRPOLoss(process_group=group, reduce_hidden_grad=True, backend=backend)
    direct = gk.fused_linear_grpo_loss(hidden, weight, ids, adv, mask, old_logps=old, process_group=group,
                                       reduce_hidden_grad=True, backend=backend)
    assert torch.equal(module(hidden, weight, ids, adv, mask, old_logps=old).loss, direct.loss)


def _check_fused_linear_logprobs(rank, world, backend):
    import grpo_kernels as gk

    cols, vocab = _shard(world, rank)
    g = torch.Generator().manual_seed(99)
    hidden, weight, bias = torch.randn(B, T, H, generator=g), torch.randn(vocab, H, generator=g), torch.randn(vocab, generator=g)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    ids[0, 1] = -100
    h64, w64, b64 = (x.double().requires_grad_() for x in (hidden, weight, bias))
    logp64, ent64 = logprobs64(h64 @ w64.t() + b64, ids, temperature=0.8)
    (logp64 + 0.5 * ent64).sum().backward()
    h, w, b = hidden.clone().requires_grad_(), weight[cols].clone().requires_grad_(), bias[cols].clone().requires_grad_()
    logp, ent = gk.fused_linear_token_logprobs(h, w, ids, bias=b, temperature=0.8, return_entropy=True, chunk_size=4,
                                               backend=backend, process_group=torch.distributed.group.WORLD,
                                               reduce_hidden_grad=True)
    (logp + 0.5 * ent).sum().backward()
    what = f"fused_linear_token_logprobs rank {rank}/{world}"
    assert_close64(logp, logp64, what=what + " logp")
    assert_close64(ent, ent64, what=what + " entropy")
    for name, actual, expected in (("hidden", h.grad, h64.grad), ("weight", w.grad, w64.grad[cols]),
                                   ("bias", b.grad, b64.grad[cols])):
        assert_close64(actual, expected, what=f"{what} d {name}")


def _match_small(rank, world, backend):
    """The Triton kernels in the interpreter: a few cases (it is slow)."""
    import torch.distributed as dist

    log = CommunicationLog(dist)
    _check_logprobs(rank, world, backend, log, 1, temperature=0.7, softcap=3.0)
    _check_grpo(rank, world, backend, log, 2, dict(use_old=True, use_ref=True, beta=0.05, entropy_coef=0.01))
    _check_grpo(rank, world, backend, log, 3, dict(use_ref=True, beta=0.05, importance_sampling_level="sequence"),
                linear=True, bias=True)


def _expect_error(exc_type, fragment: str, fn) -> None:
    try:
        fn()
    except exc_type as error:
        assert fragment in str(error), f"{fragment!r} not in {error}"
        return
    raise AssertionError(f"no {exc_type.__name__} mentioning {fragment!r}")


def _bad_input(rank, world, backend):
    import torch.distributed as dist

    import grpo_kernels as gk

    group = dist.group.WORLD
    cols, vocab = _shard(world, rank)
    logits, ids, mask, old, ref, adv, *_ = make_batch(5, B=B, T=T, V=vocab)
    shard = logits[..., cols].contiguous()
    call = lambda **kw: gk.grpo_loss(shard, kw.pop("ids", ids), adv, kw.pop("completion_mask", mask), process_group=group,  # noqa: E731
                                     backend=kw.pop("backend", backend), **kw)

    bad_ids = ids.clone()
    bad_ids[0, 0] = vocab  # outside every shard
    mask_all = torch.ones_like(mask)
    _expect_error(ValueError, "outside every vocabulary shard",
                  lambda: gk.grpo_loss(shard, bad_ids, adv, mask_all, process_group=group, backend=backend))
    _expect_error(ValueError, "outside every vocabulary shard",
                  lambda: gk.token_logprobs(shard, bad_ids, process_group=group, backend=backend))
    # arguments that differ across ranks: named, on every rank
    _expect_error(ValueError, "completion_ids", lambda: call(ids=(ids + rank) % vocab))
    _expect_error(ValueError, "the GRPO options", lambda: call(temperature=1.0 + rank))
    _expect_error(ValueError, "old_logps", lambda: call(old_logps=old + rank))
    _expect_error(ValueError, "targets", lambda: gk.token_logprobs(shard, (ids + rank) % vocab, process_group=group,
                                                                    backend=backend))
    # a refusal on one rank only: that rank's own error, a pointer to it on the others
    if rank == 1:
        _expect_error(ValueError, "completion_mask", lambda: call(completion_mask=mask[:, :2]))
    else:
        _expect_error(ValueError, "refused on rank(s) [1]", lambda: call())
    # the group's sizes: a rank's shard whose leading shape disagrees
    bad_shard = shard[:, :4] if rank == 0 else shard
    _expect_error(ValueError, "differ", lambda: gk.token_logprobs(bad_shard, ids[:, :4] if rank == 0 else ids,
                                                            process_group=group, backend=backend))
    _expect_error(ValueError, "reference", lambda: call(backend="reference"))
    hidden, weight = torch.randn(B, T, H), torch.randn(cols.stop - cols.start, H)
    _expect_error(TypeError, "reduce_hidden_grad",
                  lambda: gk.fused_linear_grpo_loss(hidden, weight, ids, adv, mask, process_group=group,
                                                    reduce_hidden_grad=1))
    _expect_error(TypeError, "process_group", lambda: gk.token_logprobs(shard, ids, process_group="world"))
    # the sampler's truncation is refused across shards, by name, on every rank
    _expect_error(ValueError, "top_k", lambda: gk.token_logprobs(shard, ids, top_k=5, process_group=group, backend=backend))
    _expect_error(ValueError, "top_p", lambda: call(top_p=0.9))
    _expect_error(ValueError, "top_p", lambda: gk.fused_linear_token_logprobs(hidden, weight, ids, top_p=0.5,
                                                                             process_group=group, backend=backend))
    _expect_error(ValueError, "top_k", lambda: gk.fused_linear_grpo_loss(hidden, weight, ids, adv, mask, top_k=3,
                                                                        process_group=group, backend=backend))
    # the group is still in step: a valid call now matches the one-device result
    log = CommunicationLog(dist)
    _check_grpo(rank, world, backend, log, 77, dict(use_old=True, use_ref=True, beta=0.05))
    # a group of one rank is the plain call, bitwise
    singles = [dist.new_group([r]) for r in range(world)]
    full = logits.clone().requires_grad_()
    plain = gk.grpo_loss(full, ids, adv, mask, old_logps=old, backend=backend)
    full_one = logits.clone().requires_grad_()
    one = gk.grpo_loss(full_one, ids, adv, mask, old_logps=old, backend=backend, process_group=singles[rank])
    plain.loss.backward()
    one.loss.backward()
    assert torch.equal(plain.loss, one.loss) and torch.equal(full.grad, full_one.grad)
    assert all(torch.equal(plain.metrics[k], one.metrics[k]) for k in plain.metrics)


def _dtensor(rank, world, backend):
    """A weight (and bias) DTensor sharded Shard(0) over a 1-D mesh implies the group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import grpo_kernels as gk

    mesh = init_device_mesh("cpu", (world,))
    vocab = 20  # torch.chunk's uneven shards over 3 ranks: 7, 7, 6
    g = torch.Generator().manual_seed(3)
    hidden, weight, bias = torch.randn(B, T, H, generator=g), torch.randn(vocab, H, generator=g), torch.randn(vocab, generator=g)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    adv, mask = torch.randn(B, generator=g), (torch.rand(B, T, generator=g) > 0.2).float()
    w = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
    b = distribute_tensor(bias, mesh, [Shard(0)]).requires_grad_()
    h = hidden.clone().requires_grad_()
    out = gk.fused_linear_grpo_loss(h, w, ids, adv, mask, bias=b, backend=backend, beta=0.0, reduce_hidden_grad=True)
    out.loss.backward()
    h64, w64, b64 = (x.double().requires_grad_() for x in (hidden, weight, bias))
    loss64, _, _ = grpo64(h64 @ w64.t() + b64, ids, adv, mask)
    loss64.backward()
    assert_close64(out.loss, loss64, what="dtensor loss")
    assert_close64(h.grad, h64.grad, what="dtensor d hidden")
    assert_close64(w.grad.full_tensor(), w64.grad, what="dtensor d weight")
    assert_close64(b.grad.full_tensor(), b64.grad, what="dtensor d bias")
    replicated = distribute_tensor(weight, mesh, [Replicate()])
    _expect_error(ValueError, "Shard(0)", lambda: gk.fused_linear_grpo_loss(h, replicated, ids, adv, mask,
                                                                            backend=backend))


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_reduce_hidden_grad_on_calls_from_logits(backend):
    """The four functions share the keyword; from logits there is no d hidden, so only False is taken."""
    import grpo_kernels as gk

    logits, ids, adv = torch.randn(2, 3, 11), torch.randint(11, (2, 3)), torch.randn(2)
    torch.testing.assert_close(gk.grpo_loss(logits, ids, adv, reduce_hidden_grad=False, backend=backend).loss,
                               gk.grpo_loss(logits, ids, adv, backend=backend).loss, rtol=0, atol=0)
    for call in (lambda **kw: gk.grpo_loss(logits, ids, adv, backend=backend, **kw),
                 lambda **kw: gk.token_logprobs(logits, ids, backend=backend, **kw)):
        with pytest.raises(ValueError, match="reduce_hidden_grad"):
            call(reduce_hidden_grad=True)
        with pytest.raises(TypeError, match="reduce_hidden_grad"):
            call(reduce_hidden_grad="False")
