"""Bad input fails early with a ValueError/TypeError that names the argument, never a silent wrong
answer (grpo_kernels._validation, on every backend): masked inputs are never read, bad scalars,
flags, ignore_index and masks are refused by name, aliased layouts are detected, empty batches and
huge logits give finite results.

Each case runs on every backend it concerns; the Triton one through the interpreter on the CPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import BACKENDS, CORE_LOSS_TYPES, DEVICE, B, H, T, V, batch

import grpo_kernels as gk


def poison_masked(x: torch.Tensor, mask: torch.Tensor, value: float) -> torch.Tensor:
    return torch.where(mask.expand_as(x) != 0, x, torch.full_like(x, value))


def run(backend, logits, ids, adv, mask, **kw):
    x = logits.clone().to(DEVICE).requires_grad_()
    kw = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    out = gk.grpo_loss(x, ids.to(DEVICE), adv.to(DEVICE), mask.to(DEVICE), backend=backend, **kw)
    out.loss.backward()
    return out, x.grad


def assert_same(clean, clean_grad, dirty, dirty_grad):
    assert torch.isfinite(dirty.loss), "loss"
    assert torch.isfinite(dirty_grad).all(), "gradient"
    torch.testing.assert_close(dirty.loss, clean.loss, rtol=0, atol=0)
    torch.testing.assert_close(dirty_grad, clean_grad, rtol=0, atol=0)
    assert clean.metrics.keys() == dirty.metrics.keys()
    for name in clean.metrics:
        assert torch.isfinite(dirty.metrics[name]), name
        torch.testing.assert_close(dirty.metrics[name], clean.metrics[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("poison", [float("nan"), float("-inf"), float("inf")])
def test_masked_per_token_inputs_are_never_read(backend, level, poison):
    """NaN / inf in old_logps, ref_logps, advantages, is_ratio only where the mask is 0 change nothing."""
    logits, ids, mask, adv, old, ref, is_ratio = batch()
    for loss_type in CORE_LOSS_TYPES:
        kw = dict(beta=0.05, eps_high=0.28, loss_type=loss_type, importance_sampling_level=level, entropy_coef=0.01)
        clean, clean_grad = run(backend, logits, ids, adv, mask, old_logps=old, ref_logps=ref, is_ratio=is_ratio, **kw)
        dirty, dirty_grad = run(
            backend, logits, ids, poison_masked(adv, mask, poison), mask, old_logps=poison_masked(old, mask, poison),
            ref_logps=poison_masked(ref, mask, poison), is_ratio=poison_masked(is_ratio, mask, poison), **kw,
        )
        assert_same(clean, clean_grad, dirty, dirty_grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_sequence_advantage_of_an_empty_sequence_is_never_read(backend):
    logits, ids, mask, adv, old, _, _ = batch(1)
    adv_seq = adv[:, 0].clone()
    clean, clean_grad = run(backend, logits, ids, adv_seq, mask, old_logps=old, loss_type="grpo")
    adv_seq[2] = float("nan")  # row 2 has no completion token
    dirty, dirty_grad = run(backend, logits, ids, adv_seq, mask, old_logps=old, loss_type="grpo")
    assert_same(clean, clean_grad, dirty, dirty_grad)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_masked_logit_rows_are_never_read(backend, poison):
    logits, ids, mask, adv, old, ref, _ = batch(2)
    clean, clean_grad = run(backend, logits, ids, adv, mask, old_logps=old, ref_logps=ref, beta=0.1)
    dirty_logits = torch.where(mask.unsqueeze(-1) != 0, logits, torch.full_like(logits, poison))
    dirty, dirty_grad = run(backend, dirty_logits, ids, adv, mask, old_logps=old, ref_logps=ref, beta=0.1)
    assert_same(clean, clean_grad, dirty, dirty_grad)
    assert (dirty_grad[mask == 0] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_never_reads_masked_hidden_states(backend):
    logits, ids, mask, adv, old, _, _ = batch(3)
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(B, T, H, generator=g)
    weight, bias = torch.randn(V, H, generator=g), torch.randn(V, generator=g)

    def go(h):
        h = h.clone().to(DEVICE).requires_grad_()
        w, b = weight.clone().to(DEVICE).requires_grad_(), bias.clone().to(DEVICE).requires_grad_()
        out = gk.fused_linear_grpo_loss(h, w, ids.to(DEVICE), adv.to(DEVICE), mask.to(DEVICE), bias=b,
                                        old_logps=old.to(DEVICE), backend=backend, chunk_size=4)
        out.loss.backward()
        return out, (h.grad, w.grad, b.grad)

    clean, clean_grads = go(hidden)
    dirty, dirty_grads = go(torch.where(mask.unsqueeze(-1) != 0, hidden, torch.full_like(hidden, float("nan"))))
    for c, d in zip(clean_grads, dirty_grads):
        assert torch.isfinite(d).all()
        torch.testing.assert_close(d, c, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(dirty.loss, clean.loss, rtol=1e-6, atol=0)


BAD_SCALARS = [
    ("num_items_in_batch", np.int64(0), ValueError),
    ("num_items_in_batch", np.float64("nan"), ValueError),
    ("num_items_in_batch", torch.tensor(0.0), ValueError),
    ("num_items_in_batch", torch.tensor([3.0, 4.0]), ValueError),
    ("num_items_in_batch", "7", TypeError),
    ("num_items_in_batch", float("inf"), ValueError),
    ("eps_high", float("nan"), ValueError),
    ("eps_low", float("nan"), ValueError),
    ("beta", float("nan"), ValueError),
    ("beta", torch.tensor(0.1), TypeError),
    ("temperature", float("inf"), ValueError),
    ("temperature", float("nan"), ValueError),
    ("delta", float("inf"), ValueError),
    ("entropy_coef", "0.1", TypeError),
    ("max_completion_length", 0, ValueError),
    ("max_completion_length", 2.5, ValueError),
    ("loss_type", 3, TypeError),  # (None is the documented default: dapo, tests/test_bounds.py)
    ("beta", -0.1, ValueError),  # (GRPOOptions declares beta >= 0: the functions refuse it too)
    ("kl_loss_coef", float("nan"), ValueError),  # (named as typed, not "beta")
    ("global_batch_size", 0, ValueError),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, value, error", BAD_SCALARS, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD_SCALARS)])
def test_bad_scalars_are_refused_by_name(backend, name, value, error):
    logits, ids, mask, adv, *_ = batch(9)
    with pytest.raises(error, match=name):
        gk.grpo_loss(logits, ids, adv, mask, backend=backend, **{name: value})


@pytest.mark.parametrize("backend", BACKENDS)
def test_numpy_and_tensor_counts_are_accepted(backend):
    logits, ids, mask, adv, *_ = batch(10)
    ref = gk.grpo_loss(logits, ids, adv, mask, backend=backend, num_items_in_batch=7).loss
    for n in (np.int64(7), np.float32(7), torch.tensor(7), torch.tensor([7.0])):
        torch.testing.assert_close(gk.grpo_loss(logits, ids, adv, mask, backend=backend, num_items_in_batch=n).loss, ref)


# ---------------------------------------------------------------------------------------------------
# issue 29: aliasing, flags, ignore_index, empty batches, masks, overflow
# ---------------------------------------------------------------------------------------------------
from grpo_kernels import _validation  # noqa: E402
from spec64 import logprobs64  # noqa: E402
from helpers import assert_close64  # noqa: E402


def _addresses(t: torch.Tensor) -> list:
    """Every element's offset in storage, by brute force."""
    idx = torch.zeros(t.shape, dtype=torch.long)
    for d, (size, stride) in enumerate(zip(t.shape, t.stride())):
        shape = [1] * t.dim()
        shape[d] = size
        idx = idx + torch.arange(size).view(shape) * stride
    return idx.flatten().tolist()


def test_overlap_check_is_sound_on_random_layouts():
    """Whenever two elements share an address, has_internal_overlap says so (any sizes and strides);
    a contiguous, permuted, sliced or stepped view is never refused."""
    g = torch.Generator().manual_seed(0)
    base = torch.zeros(4096)
    for _ in range(400):
        dims = int(torch.randint(1, 4, (1,), generator=g))
        sizes = torch.randint(1, 5, (dims,), generator=g).tolist()
        strides = torch.randint(0, 9, (dims,), generator=g).tolist()
        t = base.as_strided(sizes, strides)
        addresses = _addresses(t)
        if len(set(addresses)) < len(addresses):
            assert _validation.has_internal_overlap(t), (sizes, strides)
    x = torch.zeros(3, 5, 7)
    for view in (x, x.permute(1, 0, 2), x[:, 1:-1], x[::2, ::2], x.transpose(0, 1)[1:]):
        assert not _validation.has_internal_overlap(view)


NOT_BOOLS = ["False", "no", "", None, 0, 1, 1.0, np.int64(1), torch.tensor([True]), torch.tensor(1)]


def _flag_calls(backend):
    logits, ids, mask, adv, *_ = batch(13)
    g = torch.Generator().manual_seed(13)
    h, w = torch.randn(B, T, H, generator=g), torch.randn(V, H, generator=g)
    d = lambda t: t.to(DEVICE)  # noqa: E731
    yield "inplace_backward", lambda v: gk.grpo_loss(d(logits), d(ids), d(adv), d(mask), backend=backend, inplace_backward=v)
    yield "use_bias_correction_kl", lambda v: gk.grpo_loss(d(logits), d(ids), d(adv), d(mask), backend=backend,
                                                           use_bias_correction_kl=v)
    yield "return_entropy", lambda v: gk.token_logprobs(d(logits), d(ids), backend=backend, return_entropy=v)
    yield "return_entropy", lambda v: gk.fused_linear_token_logprobs(d(h), d(w), d(ids), backend=backend, return_entropy=v)
    yield "accumulate_in_weight_dtype", lambda v: gk.fused_linear_token_logprobs(
        d(h), d(w), d(ids), backend=backend, accumulate_in_weight_dtype=v)
    yield "accumulate_in_weight_dtype", lambda v: gk.fused_linear_grpo_loss(
        d(h), d(w), d(ids), d(adv), d(mask), backend=backend, accumulate_in_weight_dtype=v)


@pytest.mark.parametrize("backend", BACKENDS)
def test_flags_are_bools_on_every_function(backend):
    """'False' / 'no' / None / 1 are not bools: a TypeError naming the flag, before anything runs;
    True, False, numpy.bool_ and a 0-d torch bool tensor are."""
    for name, call in _flag_calls(backend):
        for value in NOT_BOOLS:
            with pytest.raises(TypeError, match=name):
                call(value)
        if backend != "triton":  # (read before any backend runs: the interpreter adds nothing here)
            for value in (np.bool_(True), torch.tensor(False)):
                call(value)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [None, "x", 1.5, True, np.bool_(False), torch.tensor(-100)])
def test_ignore_index_is_an_int(backend, value):
    """``True`` would have dropped every token with id 1; None / 'x' / 1.5 reached torch or Triton."""
    logits, ids, *_ = batch(16)
    with pytest.raises(TypeError, match="ignore_index"):
        gk.token_logprobs(logits.to(DEVICE), ids.to(DEVICE), ignore_index=value, backend=backend)
    with pytest.raises(TypeError, match="ignore_index"):
        gk.fused_linear_token_logprobs(torch.randn(B, T, H).to(DEVICE), torch.randn(V, H).to(DEVICE), ids.to(DEVICE),
                                       ignore_index=value, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_numpy_ignore_index_is_an_int(backend):
    logits, ids, *_ = batch(17)
    ids = ids.clone()
    ids[0, 0] = 3
    x = logits.to(DEVICE)
    ref = gk.token_logprobs(x, ids.to(DEVICE), ignore_index=3, backend=backend)
    got = gk.token_logprobs(x, ids.to(DEVICE), ignore_index=np.int64(3), backend=backend)
    assert ref[0, 0] == 0 and torch.equal(got, ref)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(3, 0), (0, 4), (0, 0)], ids=["T=0", "B=0", "both"])
def test_empty_batches_give_a_zero_loss_and_zero_gradients(backend, shape):
    """[B, 0, V] (no completion position) raised IndexError from amax(): a finite 0 loss and zero
    gradients of the inputs' shapes, for every loss type, level and function, as B = 0 already had."""
    b, t = shape
    d = lambda x: x.to(DEVICE)  # noqa: E731
    ids = torch.zeros(b, t, dtype=torch.long)
    for loss_type in gk.options.LOSS_TYPES:
        for level in gk.options.IMPORTANCE_SAMPLING_LEVELS:
            kw = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.1, ref_logps=d(torch.zeros(b, t)),
                      old_logps=d(torch.zeros(b, t)), is_ratio=d(torch.ones(b, 1)))
            x = torch.randn(b, t, V, device=DEVICE, requires_grad=True)
            out = gk.grpo_loss(x, d(ids), d(torch.randn(b)), d(torch.ones(b, t)), backend=backend, **kw)
            out.loss.backward()
            assert out.loss.item() == 0 and out.per_token_logps.shape == (b, t), (loss_type, level)
            assert x.grad.shape == x.shape
            h, w = torch.randn(b, t, H, device=DEVICE, requires_grad=True), torch.randn(V, H, device=DEVICE, requires_grad=True)
            out = gk.fused_linear_grpo_loss(h, w, d(ids), d(torch.randn(b, t)), backend=backend, **kw)
            out.loss.backward()
            assert out.loss.item() == 0 and (w.grad == 0).all() and h.grad.shape == h.shape, (loss_type, level)
    logp, entropy = gk.token_logprobs(torch.randn(b, t, V, device=DEVICE), d(ids), return_entropy=True, backend=backend)
    assert logp.shape == entropy.shape == (b, t)
    logp = gk.fused_linear_token_logprobs(torch.randn(b, t, H, device=DEVICE), torch.randn(V, H, device=DEVICE), d(ids),
                                          backend=backend)
    assert logp.shape == (b, t)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), -0.5])
def test_a_mask_must_be_finite_and_non_negative(backend, bad):
    logits, ids, mask, adv, *_ = batch(18)
    dirty = mask.clone()
    dirty[0, 1] = bad
    with pytest.raises(ValueError, match="completion_mask"):
        gk.grpo_loss(logits.to(DEVICE), ids.to(DEVICE), adv.to(DEVICE), dirty.to(DEVICE), backend=backend)
    with pytest.raises(ValueError, match="completion_mask"):
        gk.fused_linear_grpo_loss(torch.randn(B, T, H).to(DEVICE), torch.randn(V, H).to(DEVICE), ids.to(DEVICE),
                                  adv.to(DEVICE), dirty.to(DEVICE), backend=backend)
    if bad == -0.5:
        with pytest.raises(ValueError, match="completion_mask"):  # integer masks too
            gk.grpo_loss(logits.to(DEVICE), ids.to(DEVICE), adv.to(DEVICE), (dirty * 2).long().to(DEVICE), backend=backend)
    # where the id is ignore_index the mask is never read, as the contract says of that position
    ignored = ids.clone()
    ignored[0, 1] = -100
    clean = gk.grpo_loss(logits.to(DEVICE), ignored.to(DEVICE), adv.to(DEVICE), mask.to(DEVICE), backend=backend)
    out = gk.grpo_loss(logits.to(DEVICE), ignored.to(DEVICE), adv.to(DEVICE), dirty.to(DEVICE), backend=backend)
    assert torch.isfinite(out.loss) and out.loss == clean.loss


def _huge_logits(dtype: torch.dtype):
    """Rows with logits near the dtype's maximum (both signs) and targets far below the max."""
    big = 3e38 if dtype == torch.float32 else torch.finfo(dtype).max
    g = torch.Generator().manual_seed(19)
    x = torch.randn(2, 3, 9, generator=g, dtype=torch.float64)
    x[0, 0, 1] = big          # target below a huge max: logp < -FLT_MAX at T = 0.7
    x[0, 1, 2] = big          # huge max and its opposite in one row
    x[0, 1, 3] = -big
    x[1, 0, :] = big          # a uniform row at the maximum
    x[1, 2, 4] = -big         # a huge negative entry
    ids = torch.tensor([[4, 3, 0], [5, 4, 7]])
    return x.to(dtype), ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_huge_finite_logits_give_finite_results_that_every_backend_agrees_on(dtype, temperature):
    """A finite logit of 3e38 at T = 0.7 (logits / T overflows fp32): NaN on the torch backend and the
    reference, a finite loss on Triton. Every backend now shifts by the max before the temperature,
    and a log-prob below float32's range is its lowest finite value: finite losses, log-probs,
    entropies and gradients, equal across backends and to float64 on the shifted logits."""
    x0, ids = _huge_logits(dtype)
    adv = torch.tensor([1.0, -0.5])
    w_logp, w_ent = torch.randn(2, 2, 3, generator=torch.Generator().manual_seed(20))
    x64 = x0.double().requires_grad_()
    logp64, ent64 = logprobs64(x64 - x64.detach().amax(-1, keepdim=True), ids, temperature)
    logp64_floor = logp64.clamp(min=-torch.finfo(torch.float32).max)
    ((logp64 * w_logp.double()).sum() + (ent64 * w_ent.double()).sum()).backward()
    losses = {}
    for backend in BACKENDS:
        x = x0.clone().to(DEVICE).requires_grad_()
        logp, entropy = gk.token_logprobs(x, ids.to(DEVICE), temperature=temperature, return_entropy=True, backend=backend)
        ((logp * w_logp.to(DEVICE)).sum() + (entropy * w_ent.to(DEVICE)).sum()).backward()
        assert torch.isfinite(logp).all() and torch.isfinite(entropy).all() and torch.isfinite(x.grad).all(), backend
        assert_close64(logp, logp64_floor, what=f"{backend} logp")
        assert_close64(entropy, ent64, what=f"{backend} entropy")
        assert_close64(x.grad, x64.grad, dtype, scale=max(x64.grad.abs().max().item(), 1.0) * 1e-2, what=f"{backend} grad")
        for kw in (dict(), dict(old_logps=torch.full((2, 3), -1.0).to(DEVICE), entropy_coef=0.1),
                   dict(importance_sampling_level="sequence", loss_type="cispo", eps_high=2.0)):
            y = x0.clone().to(DEVICE).requires_grad_()
            out = gk.grpo_loss(y, ids.to(DEVICE), adv.to(DEVICE), temperature=temperature, backend=backend, **kw)
            out.loss.backward()
            assert torch.isfinite(out.loss) and torch.isfinite(y.grad).all(), (backend, kw)
            losses.setdefault(str(kw), []).append((backend, out.loss.item(), y.grad.double().cpu()))
    for key, results in losses.items():
        (_, loss0, grad0), *rest = results
        for backend, loss, grad in rest:
            assert loss == pytest.approx(loss0, rel=1e-5, abs=1e-6), (key, backend)
            torch.testing.assert_close(grad, grad0, rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=1e-5,
                                       msg=lambda m: f"{key} {backend}: {m}")


def test_a_transform_whose_float32_factor_overflows_is_refused():
    """An infinite kernel factor times the max's zero gap would be NaN: refused by name instead."""
    logits, ids, *_ = batch(21)
    for kw, name in ((dict(temperature=1e-39), "temperature"), (dict(logit_scale=1e30, temperature=1e-10), "logit_scale"),
                     (dict(softcap=1e-40), "softcap")):
        with pytest.raises(ValueError, match=name):
            gk.token_logprobs(logits, ids, **kw)
        with pytest.raises(ValueError, match=name):
            gk.GRPOLoss(**kw)
    out = gk.token_logprobs(logits, ids, temperature=1e-30)
    assert torch.isfinite(out).all()


# --------------------------------------------------------------------------------------------
# Bad input fails early with a ValueError/TypeError that names the argument, on every backend.


# the shapes of these argument checks (smaller than the masked batch of the checks above)
B2, T2, V2, H2 = 2, 3, 11, 8


def good():
    g = torch.Generator().manual_seed(0)
    return dict(
        logits=torch.randn(B2, T2, V2, generator=g),
        completion_ids=torch.randint(0, V2, (B2, T2), generator=g),
        advantages=torch.randn(B2, generator=g),
    )


GRPO_CASES = [
    ("logits", dict(logits=torch.randint(0, 5, (B2, T2, V2))), TypeError),
    ("logits", dict(logits=torch.randn(B2 * T2, V2)), ValueError),
    ("completion_ids", dict(completion_ids=torch.randn(B2, T2)), TypeError),
    ("completion_ids", dict(completion_ids=torch.zeros(B2, T2 + 1, dtype=torch.long)), ValueError),
    ("completion_ids", dict(completion_ids=torch.full((B2, T2), V2, dtype=torch.long)), ValueError),
    ("advantages", dict(advantages=torch.randn(B2 + 1)), ValueError),
    ("advantages", dict(advantages=torch.ones(B2, dtype=torch.long)), TypeError),
    ("completion_mask", dict(completion_mask=torch.ones(B2, T2 - 1)), ValueError),
    ("old_logps", dict(old_logps=torch.randn(B2)), ValueError),
    ("ref_logps", dict(beta=0.1), ValueError),
    ("loss_type", dict(loss_type="mean"), ValueError),
    ("temperature", dict(temperature=0.0), ValueError),
    ("temperature", dict(temperature=-1.0), ValueError),
    ("delta", dict(delta=1.1, eps_high=0.2), ValueError),
    ("importance_sampling_level", dict(importance_sampling_level="seq"), ValueError),
    ("is_ratio", dict(is_ratio=torch.ones(B2, T2 + 2)), ValueError),
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
    x = torch.randn(B2, T2, V2)
    with pytest.raises(ValueError, match="targets"):
        gk.token_logprobs(x, torch.zeros(B2, T2 + 1, dtype=torch.long), backend=backend)
    with pytest.raises(TypeError, match="targets"):
        gk.token_logprobs(x, torch.zeros(B2, T2), backend=backend)
    with pytest.raises(TypeError, match="logits"):
        gk.token_logprobs(x.long(), torch.zeros(B2, T2, dtype=torch.long), backend=backend)
    with pytest.raises(ValueError, match="temperature"):
        gk.token_logprobs(x, torch.zeros(B2, T2, dtype=torch.long), temperature=0, backend=backend)
    with pytest.raises(ValueError, match="targets"):
        gk.token_logprobs(x, torch.full((B2, T2), -1, dtype=torch.long), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_rejects_bad_input(backend):
    h, w = torch.randn(B2, T2, H2), torch.randn(V2, H2)
    ids, adv = torch.randint(0, V2, (B2, T2)), torch.randn(B2)
    with pytest.raises(ValueError, match="weight"):
        gk.fused_linear_grpo_loss(h, torch.randn(V2, H2 + 1), ids, adv, backend=backend)
    with pytest.raises(ValueError, match="bias"):
        gk.fused_linear_grpo_loss(h, w, ids, adv, bias=torch.randn(V2 + 1), backend=backend)
    with pytest.raises(ValueError, match="hidden"):
        gk.fused_linear_grpo_loss(h.view(B2 * T2, H2), w, ids, adv, backend=backend)
    with pytest.raises(ValueError, match="targets"):
        gk.fused_linear_token_logprobs(h, w, ids[:, :2], backend=backend)
    with pytest.raises(ValueError, match="ref_logps"):
        gk.fused_linear_grpo_loss(h, w, ids, adv, beta=0.1, backend=backend)


def test_masked_out_of_range_ids_are_never_read():
    """Where the mask is 0 the id may be anything (e.g. a pad id past the vocabulary)."""
    args = good()
    ids = args["completion_ids"].clone()
    ids[0, 2] = 10**6
    mask = torch.ones(B2, T2)
    mask[0, 2] = 0
    device = "cuda" if torch.cuda.is_available() else "cpu"  # Triton takes CUDA tensors where there is a GPU
    for backend in BACKENDS:
        out = gk.grpo_loss(args["logits"].to(device), ids.to(device), args["advantages"].to(device), mask.to(device), backend=backend)
        assert torch.isfinite(out.loss) and out.per_token_logps[0, 2] == 0
