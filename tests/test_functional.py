"""grpo_loss on the fused kernels (Triton interpreter on CPU, and the torch path) against float64.

Every option of the contract is on in at least one case, with each loss type, in fp32 and bf16,
with an empty sequence in the batch; values, gradients and metrics are checked, and the backends
are checked against each other.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import BACKENDS, CORE_LOSS_TYPES, DEVICE, KERNEL_BACKENDS, assert_close64, poison_allocations
from grpo_cases import OPTION_CASES, build_kwargs, make_batch
from spec64 import grpo64, logprobs64

import grpo_kernels as gk
from grpo_kernels import autograd as ga
from grpo_kernels import backends, objective
from grpo_kernels import reference as R
from grpo_kernels.kernels import torch_rows
from grpo_kernels.options import LOSS_TYPES, ROLLOUT_CORRECTIONS, split_grpo_keywords


def to_device(kw: dict) -> dict:
    return {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


def run_loss(logits, ids, advantages, mask, backend, **kw):
    x = logits.detach().clone().to(DEVICE).requires_grad_()
    out = gk.grpo_loss(x, ids.to(DEVICE), advantages.to(DEVICE), mask.to(DEVICE), backend=backend, **to_device(kw))
    out.loss.backward()
    return out, x.grad


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("loss_type", CORE_LOSS_TYPES)
@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_grpo_loss_matches_float64(backend, dtype, loss_type, case):
    batch = make_batch(100 + list(OPTION_CASES).index(case), dtype=dtype, V=131)
    logits, ids, mask = batch[:3]
    advantages, kw = build_kwargs(OPTION_CASES[case], batch)
    if loss_type == "dr_grpo":
        kw["max_completion_length"] = 11
    if loss_type == "dapo":
        kw["num_items_in_batch"] = torch.tensor(23.0)
    out, grad = run_loss(logits, ids, advantages, mask, backend, loss_type=loss_type, **kw)

    x64 = logits.double().requires_grad_()
    loss64, logp64, metrics64 = grpo64(x64, ids, advantages, mask, loss_type=loss_type, **kw)
    loss64.backward()

    assert out.loss.dtype == torch.float32 and out.loss.dim() == 0 and grad.dtype == dtype
    assert_close64(out.loss, loss64, what="loss")
    assert_close64(out.per_token_logps, logp64, scale=10, what="per_token_logps")
    assert_close64(grad, x64.grad, dtype, scale=(0.1 if dtype == torch.float32 else 1e-3) * x64.grad.abs().max().item(), what="grad")
    assert grad[1].abs().max() == 0, "the empty sequence must get no gradient"
    assert set(out.metrics) == set(metrics64)
    for name, value in metrics64.items():
        assert_close64(out.metrics[name], value, what=name)


@pytest.mark.parametrize("loss_type", CORE_LOSS_TYPES)
def test_three_backends_agree(loss_type):
    batch = make_batch(7, V=97)
    logits, ids, mask = batch[:3]
    advantages, kw = build_kwargs(dict(use_old=True, use_ref=True, beta=0.05, entropy_coef=0.02, temperature=0.9), batch)
    results = {b: run_loss(logits, ids, advantages, mask, b, loss_type=loss_type, **kw) for b in ("reference", "torch", "triton")}
    ref_out, ref_grad = results["reference"]
    for backend in ("torch", "triton"):
        out, grad = results[backend]
        assert_close64(out.loss, ref_out.loss.double(), what=f"{backend} loss")
        assert_close64(grad, ref_grad.double(), scale=0.1 * ref_grad.abs().max().item(), what=f"{backend} grad")
        for name in ref_out.metrics:
            assert_close64(out.metrics[name], ref_out.metrics[name].double(), what=f"{backend} {name}")


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_inplace_backward_writes_gradient_into_logits(backend):
    batch = make_batch(3, V=67)
    logits, ids, mask = batch[:3]
    advantages, kw = build_kwargs(dict(use_old=True, use_ref=True, beta=0.04), batch)
    _, expected = run_loss(logits, ids, advantages, mask, backend, **kw)

    model_logits = torch.randn(logits.shape[0], logits.shape[1] + 2, logits.shape[2]).to(DEVICE)
    model_logits[:, 1:-1] = logits.to(DEVICE)
    leaf = model_logits.clone().requires_grad_()
    work = leaf * 1.0  # a non-leaf buffer the trainer would not reuse
    view = work[:, 1:-1]
    out = gk.grpo_loss(view, ids.to(DEVICE), advantages.to(DEVICE), mask.to(DEVICE), backend=backend, inplace_backward=True, **to_device(kw))
    out.loss.backward()
    assert torch.allclose(leaf.grad[:, 1:-1], expected, rtol=0, atol=1e-7)
    # the buffer now holds the gradient, which is how the memory is saved
    assert torch.allclose(view.detach(), expected, rtol=0, atol=1e-7)


def test_drop_in_for_trainer_code():
    """grpo_loss(logits, ...) equals what a TRL-style trainer computes from reference.token_logprobs."""
    batch = make_batch(21, V=89)
    logits, ids, mask, old, ref, adv = batch[:6]
    beta, eps = 0.04, 0.2

    def trainer_loss(x):  # the code a trainer has today
        per_token_logps = R.token_logprobs(x, ids)
        log_ratio = per_token_logps - old
        coef_1 = torch.exp(log_ratio)
        coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps)
        per_token_loss = -torch.min(coef_1 * adv.unsqueeze(1), coef_2 * adv.unsqueeze(1))
        per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
        per_token_loss = per_token_loss + beta * per_token_kl
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()

    x1 = logits.clone().requires_grad_()
    expected = trainer_loss(x1)
    expected.backward()
    x2 = logits.clone().requires_grad_()
    out = gk.grpo_loss(x2, ids, adv, mask, old_logps=old, ref_logps=ref, beta=beta, eps_low=eps, loss_type="grpo")
    out.loss.backward()
    assert_close64(out.loss, expected.double(), what="loss")
    assert_close64(x2.grad, x1.grad.double(), scale=0.1 * x1.grad.abs().max().item(), what="grad")


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_hyperparameters_do_not_change_the_inputs_or_need_float64(backend):
    """Runtime hyper-parameters: several values in a row give the float64 answer each time."""
    batch = make_batch(5, V=41)
    logits, ids, mask = batch[:3]
    advantages, kw = build_kwargs(dict(use_old=True, use_ref=True), batch)
    for beta, eps, temperature in [(0.0, 0.2, 1.0), (0.1, 0.3, 0.6), (0.01, 0.1, 1.3)]:
        out, grad = run_loss(logits, ids, advantages, mask, backend, beta=beta, eps_low=eps, temperature=temperature, **kw)
        x64 = logits.double().requires_grad_()
        loss64, _, _ = grpo64(x64, ids, advantages, mask, beta=beta, eps_low=eps, temperature=temperature, **kw)
        loss64.backward()
        assert_close64(out.loss, loss64, what=f"loss at beta={beta}")
        assert_close64(grad, x64.grad, scale=0.1 * x64.grad.abs().max().item(), what="grad")


def test_module_wrapper_holds_config():
    batch = make_batch(9, V=29)
    logits, ids, mask = batch[:3]
    advantages, kw = build_kwargs(dict(use_old=True, use_ref=True, beta=0.02), batch)
    module = gk.GRPOLoss(beta=0.02, loss_type="bnpo", backend="torch")
    out = module(logits, ids, advantages, mask, old_logps=kw["old_logps"], ref_logps=kw["ref_logps"])
    direct = gk.grpo_loss(logits, ids, advantages, mask, loss_type="bnpo", backend="torch", **kw)
    assert torch.equal(out.loss, direct.loss)
    assert "bnpo" in repr(module)


def test_all_masked_batch_gives_zero_loss_and_gradient():
    batch = make_batch(11, V=23)
    logits, ids = batch[:2]
    mask = torch.zeros_like(batch[2])
    for backend in ("reference", "torch", "triton"):
        for loss_type in CORE_LOSS_TYPES:
            out, grad = run_loss(logits, ids, batch[5], mask, backend, loss_type=loss_type)
            assert out.loss.item() == 0 and grad.abs().max() == 0 and torch.isfinite(out.loss)


def test_works_under_torch_compile():
    """torch.compile (aot_eager: traces forward and backward without a C++ toolchain) gives the eager answer."""
    batch = make_batch(13, V=50)
    logits, ids, mask, old, ref, adv = batch[:6]

    def loss_fn(x):
        return gk.grpo_loss(x, ids, adv, mask, old_logps=old, ref_logps=ref, beta=0.04, backend="torch").loss

    compiled = torch.compile(loss_fn, backend="aot_eager")
    x1, x2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    compiled(x1).backward()
    loss_fn(x2).backward()
    assert torch.equal(x1.grad, x2.grad)


@pytest.mark.gpu
def test_new_hyperparameter_values_compile_no_new_kernel():
    from grpo_kernels.kernels import triton_rows

    batch = make_batch(15, V=300)
    logits, ids, mask = batch[:3]
    advantages, kw = build_kwargs(dict(use_old=True, use_ref=True), batch)
    run_loss(logits, ids, advantages, mask, "triton", beta=0.1, **kw)

    def cache_size():
        """Compiled variants of every row kernel, the fused GRPO forward (which takes beta, eps and
        delta) included (triton >= 3.2 keeps them per device)."""
        kernels = [k for k in vars(triton_rows).values() if hasattr(k, "device_caches")]
        assert triton_rows.grpo_loss_fwd_kernel in kernels and triton_rows.row_stats_partial_kernel in kernels
        return sum(len(entry[0]) for k in kernels for entry in k.device_caches.values())

    before = cache_size()
    for beta, eps, temperature in [(0.2, 0.1, 0.5), (0.0, 0.3, 1.7)]:
        run_loss(logits, ids, advantages, mask, "triton", beta=beta, eps_low=eps, temperature=temperature, **kw)
    assert cache_size() == before


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("use_delta", [False, True])
def test_every_clip_region_values_gradients_and_metrics(backend, use_delta):
    """Ratios placed in each region (below 1-eps_low, inside, between 1+eps_low and 1+eps_high,
    above 1+eps_high, above delta) with positive and negative advantages."""
    eps_low, eps_high, delta = 0.2, 0.28, 1.6
    ratios = torch.tensor([0.5, 0.79, 0.95, 1.0, 1.1, 1.22, 1.27, 1.3, 1.5, 1.7, 3.0])
    b, t, v = 2, ratios.numel(), 37
    g = torch.Generator().manual_seed(31)
    logits = torch.randn(b, t, v, generator=g) * 2
    ids = torch.randint(0, v, (b, t), generator=g)
    logp_now = torch.log_softmax(logits.double(), -1).gather(-1, ids[..., None])[..., 0]
    old = (logp_now - torch.log(ratios.double())).float()
    adv = torch.tensor([1.3, -0.7])
    kw = dict(old_logps=old, eps_low=eps_low, eps_high=eps_high, delta=delta if use_delta else None, loss_type="bnpo")
    out, grad = run_loss(logits, ids, adv, torch.ones(b, t), backend, **kw)
    x64 = logits.double().requires_grad_()
    loss64, _, metrics64 = grpo64(x64, ids, adv, torch.ones(b, t), **kw)
    loss64.backward()
    assert_close64(out.loss, loss64, what="loss")
    assert_close64(grad, x64.grad, scale=0.1 * x64.grad.abs().max().item(), what="grad")
    for name, value in metrics64.items():
        assert_close64(out.metrics[name], value, what=name)
    assert metrics64["clip_ratio/low_mean"] > 0 and metrics64["clip_ratio/high_mean"] > 0


@pytest.mark.parametrize("splits", [1, 3], ids=lambda s: f"splits{s}")
def test_fused_kernel_split_and_whole_row_paths_match_float64(splits, monkeypatch):
    """The fused GRPO forward on rows of several blocks, read whole (many rows) and split over
    programs then merged (few rows), forced either way: loss, gradient and metrics against float64."""
    from grpo_kernels.kernels import triton_rows

    monkeypatch.setattr(triton_rows, "SPLITS_OVERRIDE", splits)
    chosen = []
    choose = triton_rows.choose_splits
    monkeypatch.setattr(triton_rows, "choose_splits", lambda *a: chosen.append(choose(*a)) or chosen[-1])
    batch = make_batch(17 + splits, B=2, T=3, V=9001)
    logits, ids, mask = batch[:3]
    advantages, kw = build_kwargs(dict(use_old=True, use_ref=True, beta=0.04, entropy_coef=0.01), batch)
    out, grad = run_loss(logits, ids, advantages, mask, "triton", loss_type="bnpo", **kw)
    x64 = logits.double().requires_grad_()
    loss64, logp64, metrics64 = grpo64(x64, ids, advantages, mask, loss_type="bnpo", **kw)
    loss64.backward()
    assert chosen and all(n == splits for n, _ in chosen), chosen  # forward and backward took that path
    assert_close64(out.loss, loss64, what="loss")
    assert_close64(out.per_token_logps, logp64, scale=10, what="per_token_logps")
    assert_close64(grad, x64.grad, scale=0.1 * x64.grad.abs().max().item(), what="grad")
    assert set(out.metrics) == set(metrics64)
    for name, value in metrics64.items():
        assert_close64(out.metrics[name], value, what=name)


def test_fused_forward_masked_rows_are_zero_and_never_read():
    """grpo_forward_rows: a masked row (ignore_index) is never read (NaN logits there cannot leak)
    and gets 0 in every per-token output, the metric inputs (kl, clip) included."""
    from grpo_kernels.kernels import triton_rows

    batch = make_batch(19, B=2, T=5, V=77)
    logits, ids, _, old, ref, adv = batch[:6]
    ids = ids.clone()
    ids[0, 2] = ids[1, 4] = -100
    logits = logits.clone()
    logits[0, 2] = logits[1, 4] = float("nan")
    outs = triton_rows.grpo_forward_rows(
        logits.to(DEVICE), ids.to(DEVICE), adv.to(DEVICE), torch.ones(2, 5, device=DEVICE), old.to(DEVICE),
        ref.to(DEVICE), None, 1.0, -100, 0.2, 0.2, None, 0.04, 0.01,
    )
    names = ("loss", "logp", "entropy", "row_max", "log_sum", "coef_logp", "coef_entropy", "kl", "clip")
    assert len(outs) == len(names)
    for name, x in zip(names, outs):
        assert x[0, 2] == 0 and x[1, 4] == 0, name
        if x.is_floating_point():
            assert torch.isfinite(x).all(), name
    assert outs[-1].dtype == torch.int8


# --------------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True): no graph break, the same loss and gradients (issue 27)
# --------------------------------------------------------------------------------------------------
COMPILE_CASES = {
    "dapo_old_ref_entropy": dict(old_logps=True, ref_logps=True, beta=0.04, entropy_coef=0.01),
    "gspo": dict(old_logps=True, importance_sampling_level="sequence"),
    "verl_vanilla_kl": dict(old_logps=True, ref_logps=True, loss_mode="vanilla", loss_agg_mode="seq-mean-token-mean",
                            kl_loss_type="low_var_kl", beta=0.1),
    "trl_masks_rollout": dict(rollout=True, rollout_correction="token_mask", top_entropy_quantile=0.5,
                              off_policy_mask_threshold=2.0, rollout_correction_max=10.0),
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("function", ["grpo_loss", "fused_linear_grpo_loss"])
@pytest.mark.parametrize("case", list(COMPILE_CASES))
def test_torch_compile_fullgraph_same_loss_and_gradients(function, case):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(list(COMPILE_CASES).index(case))
    b, t, v, h = 2, 5, 13, 8
    ids = torch.randint(0, v, (b, t), generator=g)
    mask = torch.ones(b, t)
    mask[0, 3:] = 0
    adv = torch.randn(b, generator=g)
    adv[0] = adv[0].abs()  # a sequence the off-policy mask keeps
    base = torch.randn(b, t, generator=g) * 0.2 - 2.5
    kw = dict(COMPILE_CASES[case])
    for name, key in (("old_logps", "old_logps"), ("ref_logps", "ref_logps"), ("rollout", "rollout_logps")):
        if kw.pop(name, False):
            kw[key] = base + 0.1 * torch.randn(b, t, generator=g)
    if function == "grpo_loss":
        args = (torch.randn(b, t, v, generator=g, requires_grad=True),)
        fn = lambda x: gk.grpo_loss(x, ids, adv, mask, backend="torch", **kw).loss  # noqa: E731
    else:
        args = (torch.randn(b, t, h, generator=g, requires_grad=True), torch.randn(v, h, generator=g, requires_grad=True))
        fn = lambda x, w: gk.fused_linear_grpo_loss(x, w, ids, adv, mask, backend="torch", chunk_size=4, **kw).loss  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break raises
    loss_c = compiled(*args)
    grads_c = torch.autograd.grad(loss_c, args)
    loss_e = fn(*args)
    grads_e = torch.autograd.grad(loss_e, args)
    assert torch.isfinite(loss_c)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-6, atol=1e-7)
    for a, e in zip(grads_c, grads_e):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------------------------
# token_logprobs on the Triton kernel (interpreter on CPU) and the memory-lean torch path.
#
# Values and gradients of both outputs against the float64 spec, for every logits dtype, awkward
# vocabulary sizes (1, a prime, not a multiple of any block), temperatures, strided views, ignored
# rows, -inf entries, NaN rows and confident predictions.


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (B, T, V): V = 1, a prime near 1,000, 32,003 and 65,536 + 3; fewer rows where V is large.
SHAPES = [(3, 5, 1), (3, 7, 997), (2, 3, 32003), (1, 3, 65539)]


def grad_scale(dtype: torch.dtype, expected: torch.Tensor) -> float:
    """Absolute-error scale for a gradient: fp32's p = exp(z - lse) carries an absolute error of about
    ulp(max |z|), so its floor is relative to the largest entry; a 16-bit gradient is dominated by
    its own per-element rounding (rtol), with a tiny floor for values near zero."""
    return (0.1 if dtype == torch.float32 else 1e-3) * expected.abs().max().item()


def check_logprobs_against_spec(logits, targets, temperature, backend, dtype, seed=0):
    """Run forward + backward of both outputs and compare with float64 autograd through the spec."""
    g = torch.Generator().manual_seed(seed)
    x = logits.detach().clone().requires_grad_()
    logp, entropy = gk.token_logprobs(x, targets, temperature=temperature, return_entropy=True, backend=backend)
    w_logp = torch.randn(targets.shape, generator=g).to(x.device)
    w_ent = torch.randn(targets.shape, generator=g).to(x.device)
    ((logp * w_logp).sum() + (entropy * w_ent).sum()).backward()

    x64 = logits.detach().double().cpu().requires_grad_()
    logp64, ent64 = logprobs64(x64, targets.cpu(), temperature)
    ((logp64 * w_logp.cpu().double()).sum() + (ent64 * w_ent.cpu().double()).sum()).backward()

    assert logp.dtype == torch.float32 and entropy.dtype == torch.float32
    assert x.grad.dtype == logits.dtype
    # Outputs are fp32 computed from the (already rounded) inputs: fp32 accuracy whatever the input
    # dtype, relative to the size of lse, which sets the rounding of z - lse.
    scale = max(1.0, (logits.detach().float().abs().max().item() / temperature))
    assert_close64(logp, logp64, torch.float32, scale=scale, what="logp")
    assert_close64(entropy, ent64, torch.float32, scale=scale, what="entropy")
    assert_close64(x.grad, x64.grad, dtype, scale=grad_scale(dtype, x64.grad), what="grad")
    return logp, entropy, x.grad


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_float64(backend, dtype, shape, temperature):
    b, t, v = shape
    g = torch.Generator().manual_seed(v + int(temperature * 10))
    logits = (torch.randn(b, t, v, generator=g) * 4).to(dtype).to(DEVICE)
    targets = torch.randint(0, v, (b, t), generator=g).to(DEVICE)
    check_logprobs_against_spec(logits, targets, temperature, backend, dtype)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_strided_view_of_model_logits(backend, dtype):
    """model_logits[:, P-1:-1, :] is read in place: no copy, correct values and gradient."""
    g = torch.Generator().manual_seed(11)
    b, prompt, t, v = 3, 4, 6, 261
    model_logits = (torch.randn(b, prompt + t, v, generator=g) * 3).to(dtype).to(DEVICE).requires_grad_()
    view = model_logits[:, prompt - 1 : -1, :]
    assert not view.is_contiguous()
    targets = torch.randint(0, v, (b, t), generator=g).to(DEVICE)
    targets[0, 0] = -100
    logp, entropy = gk.token_logprobs(view, targets, return_entropy=True, backend=backend)
    (logp.sum() + entropy.sum()).backward()
    x64 = model_logits.detach().double().cpu().requires_grad_()
    lp64, ent64 = logprobs64(x64[:, prompt - 1 : -1, :], targets.cpu())
    (lp64.sum() + ent64.sum()).backward()
    assert_close64(logp, lp64, what="logp", scale=10)
    assert_close64(entropy, ent64, what="entropy", scale=10)
    assert_close64(model_logits.grad, x64.grad, dtype, scale=grad_scale(dtype, x64.grad), what="grad")
    # positions outside the view get exactly zero gradient
    assert model_logits.grad[:, : prompt - 1].abs().max() == 0 and model_logits.grad[:, -1].abs().max() == 0


def test_strided_view_is_not_copied(monkeypatch):
    """The row kernel sees the original storage and strides of a [B, T, V] slice."""
    seen = {}
    kernels = backends.resolve("torch", torch.device("cpu"))
    original = kernels.forward_rows

    def spy(logits, *args, **kwargs):
        seen["ptr"], seen["stride"] = logits.data_ptr(), logits.stride()
        return original(logits, *args, **kwargs)

    monkeypatch.setattr(kernels, "forward_rows", spy)
    model_logits = torch.randn(2, 9, 31)
    view = model_logits[:, 3:-1, :]
    gk.token_logprobs(view, torch.zeros(2, 5, dtype=torch.long), backend="torch")
    assert seen["ptr"] == view.data_ptr() and seen["stride"] == view.stride()


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_ignore_index_rows_are_zero_and_never_read(backend):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 4, 37, generator=g).to(DEVICE)
    targets = torch.randint(0, 37, (2, 4), generator=g).to(DEVICE)
    targets[0, 1] = targets[1, 3] = -100
    logits[0, 1] = float("nan")  # an ignored row is never read: its NaNs cannot leak
    logits[1, 3] = float("nan")
    x = logits.clone().requires_grad_()
    logp, entropy = gk.token_logprobs(x, targets, return_entropy=True, backend=backend)
    (logp.sum() + entropy.sum()).backward()
    assert logp[0, 1] == 0 and logp[1, 3] == 0 and entropy[0, 1] == 0 and entropy[1, 3] == 0
    assert x.grad[0, 1].abs().max() == 0 and x.grad[1, 3].abs().max() == 0
    assert torch.isfinite(logp).all() and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_negative_infinity_entries(backend, dtype):
    """Padded vocabulary entries (-inf) are fine: finite values, zero gradient there."""
    g = torch.Generator().manual_seed(7)
    v = 300
    logits = (torch.randn(2, 3, v, generator=g) * 2).to(dtype).to(DEVICE)
    logits[..., 250:] = float("-inf")
    logits[0, 0, :100] = float("-inf")
    targets = torch.randint(100, 250, (2, 3), generator=g).to(DEVICE)
    logp, entropy, grad = check_logprobs_against_spec(logits, targets, 1.0, backend, dtype)
    assert torch.isfinite(logp).all() and torch.isfinite(entropy).all()
    assert grad[..., 250:].abs().max() == 0


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_nan_row_gives_nan_for_that_row_only(backend):
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(1, 4, 129, generator=g).to(DEVICE)
    logits[0, 2, 17] = float("nan")
    targets = torch.randint(0, 129, (1, 4), generator=g).to(DEVICE)
    targets[0, 2] = 3  # a target other than the NaN entry: the NaN must still show
    logp, entropy = gk.token_logprobs(logits, targets, return_entropy=True, backend=backend)
    assert torch.isnan(logp[0, 2]) and torch.isnan(entropy[0, 2])
    keep = torch.tensor([0, 1, 3])
    assert torch.isfinite(logp[0, keep]).all() and torch.isfinite(entropy[0, keep]).all()


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_confident_prediction_keeps_its_gradient(backend, dtype):
    """p_target = 0.999: the target's gradient g * (1 - p) = 0.001 * g survives rounding."""
    v = 1000
    logits = torch.zeros(2, 1, v)
    # log(0.999 / (0.001 / (V - 1))) puts p_target at 0.999
    logits[:, :, 5] = torch.log(torch.tensor(0.999 * (v - 1) / 0.001))
    logits = logits.to(dtype).to(DEVICE)
    targets = torch.full((2, 1), 5, device=DEVICE)
    x = logits.clone().requires_grad_()
    gk.token_logprobs(x, targets, backend=backend).sum().backward()
    x64 = logits.double().cpu().requires_grad_()
    logprobs64(x64, targets.cpu())[0].sum().backward()
    expected = x64.grad[:, :, 5]
    assert 5e-4 < expected.abs().min().item() < 2e-3
    # fp32: the sum s = 1 + 999 * 1e-6 itself rounds at ~1e-7, i.e. ~1e-4 of 1 - p; the reference
    # (fp32 log_softmax, then 1 - p) loses ~6e-3 here, so we must also beat it.
    rtol = {torch.float32: 1e-3, torch.float16: 2e-3, torch.bfloat16: 4e-3}[dtype]

    def rel_error(grad):
        return ((grad[:, :, 5].double().cpu() - expected).abs() / expected.abs()).max().item()

    rel = rel_error(x.grad)
    assert rel < rtol, f"target gradient relative error {rel:.2e} >= {rtol}"
    x_ref = logits.clone().requires_grad_()
    gk.token_logprobs(x_ref, targets, backend="reference").sum().backward()
    assert rel <= rel_error(x_ref.grad)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_any_leading_shape_and_int32_ids(backend):
    g = torch.Generator().manual_seed(13)
    logits = torch.randn(2, 3, 4, 33, generator=g).to(DEVICE)
    targets = torch.randint(0, 33, (2, 3, 4), generator=g, dtype=torch.int32).to(DEVICE)
    logp = gk.token_logprobs(logits, targets, backend=backend)
    assert logp.shape == (2, 3, 4)
    assert_close64(logp, logprobs64(logits.cpu(), targets.cpu().long())[0], what="logp", scale=5)
    flat = gk.token_logprobs(logits.reshape(-1, 33), targets.reshape(-1), backend=backend)
    assert torch.equal(flat.view(2, 3, 4), logp)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_backends_agree_and_outputs_are_fully_written(backend, monkeypatch):
    """Outputs are allocated with torch.empty: poison that allocation so a row the kernel skips shows up."""
    poison_allocations(monkeypatch)
    g = torch.Generator().manual_seed(17)
    logits = torch.randn(3, 5, 211, generator=g).to(DEVICE)
    targets = torch.randint(0, 211, (3, 5), generator=g).to(DEVICE)
    targets[1, 2] = -100
    x = logits.clone().requires_grad_()
    logp, ent = gk.token_logprobs(x, targets, return_entropy=True, backend=backend)
    (logp.sum() - ent.sum()).backward()
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all() and torch.isfinite(x.grad).all()
    ref = gk.token_logprobs(logits, targets, return_entropy=True, backend="reference")
    assert_close64(logp, ref[0].double(), what="logp vs reference", scale=5)
    assert_close64(ent, ref[1].double(), what="entropy vs reference", scale=5)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_only_logp_requested_gives_finite_gradient(backend):
    """Entropy not requested: its buffer is not computed and must not leak into the gradient."""
    g = torch.Generator().manual_seed(19)
    logits = torch.randn(2, 3, 77, generator=g).to(DEVICE)
    targets = torch.randint(0, 77, (2, 3), generator=g).to(DEVICE)
    x = logits.clone().requires_grad_()
    gk.token_logprobs(x, targets, backend=backend).sum().backward()
    x64 = logits.double().cpu().requires_grad_()
    logprobs64(x64, targets.cpu())[0].sum().backward()
    assert_close64(x.grad, x64.grad, scale=grad_scale(torch.float32, x64.grad), what="grad")


@pytest.mark.skipif(DEVICE != "cpu", reason="interpreter check of 64-bit row offsets")
def test_row_offsets_beyond_int32():
    """A row that starts past element 2**31 is addressed correctly (int64 offsets)."""
    v = 96
    storage = torch.empty(2**31 + 4 * v, dtype=torch.bfloat16)  # untouched pages cost no memory
    big = storage.as_strided((2, 1, v), (2**31 + v, v, 1))
    g = torch.Generator().manual_seed(23)
    rows = (torch.randn(2, 1, v, generator=g) * 2).to(torch.bfloat16)
    big.copy_(rows)
    targets = torch.tensor([[3], [90]])
    logp = gk.token_logprobs(big, targets, backend="triton")
    assert_close64(logp, logprobs64(rows, targets)[0], what="logp", scale=5)


@pytest.mark.parametrize("splits", [1, 3], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_and_whole_row_paths_match_float64(splits, dtype, monkeypatch):
    """The row read whole (1 split: the many-rows path) and split over programs then merged (the
    few-rows path), both forced on rows of several blocks, with -inf, ignored and confident rows."""
    from grpo_kernels.kernels import triton_rows

    monkeypatch.setattr(triton_rows, "SPLITS_OVERRIDE", splits)
    chosen = []
    choose = triton_rows.choose_splits
    monkeypatch.setattr(triton_rows, "choose_splits", lambda *a: chosen.append(choose(*a)) or chosen[-1])
    g = torch.Generator().manual_seed(41 + splits)
    b, t, v = 2, 3, 20011  # several blocks whatever the dtype, and a partial last block
    logits = torch.randn(b, t, v, generator=g) * 3
    logits[0, 1, : v // 2] = float("-inf")  # whole chunks of -inf
    logits[1, 2, 7] = 40.0  # a confident row
    logits = logits.to(dtype).to(DEVICE)
    targets = torch.randint(v // 2, v, (b, t), generator=g)
    targets[1, 0] = -100
    targets[1, 2] = 7
    check_logprobs_against_spec(logits, targets.to(DEVICE), 0.7, "triton", dtype)
    assert chosen and all(n == splits for n, _ in chosen), chosen  # forward and backward took that path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_huge_finite_logits(dtype, temperature):
    """Finite logits near the dtype's maximum (>= 1e32 in fp32, the bf16 maximum): the first block's
    rescaling of an empty sum must not make -inf * 0 = NaN; logp, entropy and gradient are finite
    and match float64.

    The float64 spec cannot be evaluated on these logits as they are: next to 3e38 its own ulp is
    ~6e22, so lse - sum(p z) loses every O(1) digit. Softmax is shift-invariant, so the reference is
    evaluated on x - max(x) (the maximum detached), where float64 is exact enough. Targets far below
    the maximum (logp ~ -1e32 and ~ -FLT_MAX) are checked at T = 1, where that logp is finite in fp32."""
    big = torch.finfo(dtype).max if dtype == torch.bfloat16 else 3e38
    g = torch.Generator().manual_seed(43)
    v = 300
    logits = torch.randn(4, 1, v, generator=g, dtype=torch.float64)
    logits[0] = logits[0] * 1e32  # one-hot softmax at 1e32 scale, both signs
    logits[1, 0, [3, 77, 250]] = big  # three tied maxima
    logits[2] = big  # a uniform row at the maximum
    logits[3, 0, 11] = big  # one huge maximum and its opposite
    logits[3, 0, 12] = -big
    logits = logits.to(dtype).to(DEVICE)
    targets = torch.tensor([[int(logits[0, 0].float().argmax())], [77], [5], [11]])
    if temperature == 1.0:
        targets[0, 0], targets[3, 0] = 9, 40
    targets = targets.to(DEVICE)
    w_logp, w_ent = torch.randn(2, 4, 1, generator=g)

    x = logits.detach().clone().requires_grad_()
    logp, entropy = gk.token_logprobs(x, targets, temperature=temperature, return_entropy=True, backend="triton")
    ((logp * w_logp.to(DEVICE)).sum() + (entropy * w_ent.to(DEVICE)).sum()).backward()
    x64 = logits.detach().double().cpu().requires_grad_()
    logp64, ent64 = logprobs64(x64 - x64.detach().amax(-1, keepdim=True), targets.cpu(), temperature)
    ((logp64 * w_logp.double()).sum() + (ent64 * w_ent.double()).sum()).backward()

    assert torch.isfinite(logp).all() and torch.isfinite(entropy).all() and torch.isfinite(x.grad).all()
    assert_close64(logp, logp64, what="logp")
    assert_close64(entropy, ent64, what="entropy")
    assert_close64(x.grad, x64.grad, dtype, scale=grad_scale(dtype, x64.grad), what="grad")


# --------------------------------------------------------------------------------------------
# fused_linear_token_logprobs / fused_linear_grpo_loss against float64, on both kernel backends.
#
# Gradients w.r.t. hidden, weight and bias; fp32 and bf16; every loss type; chunk sizes that do and
# do not divide the number of tokens; tied embeddings; a frozen head.


B, T, H, V = 3, 5, 24, 157  # N = 15 tokens


def make_inputs(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) / H**0.5 * 3).to(dtype)
    bias = (torch.randn(V, generator=g) * 0.5).to(dtype)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.2).float()
    mask[2] = 0
    logits64 = hidden.double() @ weight.double().T + bias.double()
    logp64 = torch.log_softmax(logits64, -1).gather(-1, ids[..., None])[..., 0]
    old = (logp64 + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    ref = (logp64 + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    adv = torch.randn(B, generator=g)
    return hidden, weight, bias, ids, mask, old, ref, adv


def leaves(*tensors):
    return [t.detach().clone().to(DEVICE).requires_grad_() for t in tensors]


def leaves64(*tensors):
    return [t.detach().double().requires_grad_() for t in tensors]


def grad_tol(dtype, expected):
    """Absolute scale for gradients that come out of a matmul: their rounding error is relative to
    the sum of |terms|, so to the largest entry, not to each (possibly cancelled) entry."""
    return (0.1 if dtype == torch.float32 else 1.0) * expected.abs().max().item()


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("loss_type", CORE_LOSS_TYPES)
@pytest.mark.parametrize("chunk_size", [4, 5, 64])  # 4 does not divide N = 15, 5 does, 64 > N
def test_fused_linear_grpo_loss_matches_float64(backend, dtype, loss_type, chunk_size):
    hidden, weight, bias, ids, mask, old, ref, adv = make_inputs(chunk_size, dtype)
    kw = dict(old_logps=old, ref_logps=ref, beta=0.04, entropy_coef=0.01, temperature=0.8, loss_type=loss_type, eps_high=0.28)
    h, w, b = leaves(hidden, weight, bias)
    out = gk.fused_linear_grpo_loss(
        h, w, ids.to(DEVICE), adv.to(DEVICE), mask.to(DEVICE), bias=b, chunk_size=chunk_size, backend=backend,
        **{k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()},
    )
    out.loss.backward()
    h64, w64, b64 = leaves64(hidden, weight, bias)
    loss64, logp64, metrics64 = grpo64(h64 @ w64.T + b64, ids, adv, mask, **kw)
    loss64.backward()
    # bf16: the logits themselves are rounded to bf16 after the matmul, as in any bf16 lm_head
    value_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
    assert_close64(out.loss, loss64, value_dtype, what="loss")
    assert_close64(out.per_token_logps, logp64, value_dtype, scale=5, what="logps")
    for name, got, want in (("hidden", h.grad, h64.grad), ("weight", w.grad, w64.grad), ("bias", b.grad, b64.grad)):
        assert got.dtype == dtype, name
        assert_close64(got, want, dtype, scale=grad_tol(dtype, want), what=f"grad {name}")
    for name in ("kl", "entropy"):
        assert_close64(out.metrics[name], metrics64[name], value_dtype, what=name)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_fused_linear_token_logprobs_and_entropy(backend):
    hidden, weight, bias, ids, *_ = make_inputs(1)
    ids[0, 1] = -100
    h, w = leaves(hidden, weight)
    logp, ent = gk.fused_linear_token_logprobs(h, w, ids.to(DEVICE), return_entropy=True, chunk_size=4, temperature=1.3, backend=backend)
    (logp.sum() + 0.5 * ent.sum()).backward()
    h64, w64 = leaves64(hidden, weight)
    lp64, ent64 = logprobs64(h64 @ w64.T, ids, 1.3)
    (lp64.sum() + 0.5 * ent64.sum()).backward()
    assert_close64(logp, lp64, scale=5, what="logp")
    assert_close64(ent, ent64, scale=5, what="entropy")
    assert_close64(h.grad, h64.grad, scale=grad_tol(torch.float32, h64.grad), what="grad hidden")
    assert_close64(w.grad, w64.grad, scale=grad_tol(torch.float32, w64.grad), what="grad weight")
    assert logp[0, 1] == 0 and h.grad[0, 1].abs().max() == 0


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_tied_embeddings_gradients_add_up(backend):
    """lm_head.weight is also the input embedding: both gradients land on the one parameter."""
    hidden, weight, _, ids, mask, old, _, adv = make_inputs(2)
    ids_in = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))

    def run(w, loss_fn):
        h = torch.tanh(torch.nn.functional.embedding(ids_in.to(w.device), w) + hidden.to(w.device, w.dtype))
        return loss_fn(h, w)

    w = weight.clone().to(DEVICE).requires_grad_()
    on_device = [t.to(DEVICE) for t in (ids, adv, mask, old)]
    run(w, lambda h, w_: gk.fused_linear_grpo_loss(
        h, w_, on_device[0], on_device[1], on_device[2], old_logps=on_device[3], chunk_size=4, backend=backend).loss
    ).backward()
    w64 = weight.double().requires_grad_()
    run(w64, lambda h, w_: grpo64(h @ w_.T, ids, adv, mask, old_logps=old)[0]).backward()
    assert_close64(w.grad, w64.grad, scale=grad_tol(torch.float32, w64.grad), what="tied weight grad")


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_frozen_head_gets_no_weight_gradient(backend, monkeypatch):
    hidden, weight, bias, ids, mask, old, _, adv = make_inputs(3)
    calls = []
    monkeypatch.setattr(ga, "_accumulate_weight_grad", lambda *a, **k: calls.append(1))
    h = hidden.clone().to(DEVICE).requires_grad_()
    w, b, ids_d, adv_d, mask_d, old_d = (t.to(DEVICE) for t in (weight, bias, ids, adv, mask, old))
    out = gk.fused_linear_grpo_loss(h, w, ids_d, adv_d, mask_d, bias=b, old_logps=old_d, chunk_size=4, backend=backend)
    out.loss.backward()
    assert w.grad is None and not calls and h.grad is not None
    h64 = hidden.double().requires_grad_()
    grpo64(h64 @ weight.double().T + bias.double(), ids, adv, mask, old_logps=old)[0].backward()
    assert_close64(h.grad, h64.grad, scale=grad_tol(torch.float32, h64.grad), what="grad hidden")


def test_no_grad_does_no_gradient_work():
    """Under no_grad (old and reference log-probs) nothing is saved for a backward."""
    hidden, weight, _, ids, *_ = make_inputs(4)
    w = weight.clone().requires_grad_()
    with torch.no_grad():
        logp = gk.fused_linear_token_logprobs(hidden, w, ids, chunk_size=4, backend="torch")
    assert logp.grad_fn is None and not logp.requires_grad
    assert_close64(logp, logprobs64(hidden.double() @ weight.double().T, ids)[0], scale=5, what="logp")


def test_default_chunk_size_rule():
    """The documented rule: rows from the rate rule (which uses H), capped by the memory budget and
    the device's row cap, then split evenly over N."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    rule = ga.default_chunk_size
    assert rule(32000, 512, torch.bfloat16, cuda) > rule(32000, 1024, torch.bfloat16, cuda) >= 256  # a wider head needs fewer rows
    assert rule(32000, 512, torch.float32, cpu) == rule(32000, 1024, torch.float32, cpu) == ga.MAX_CHUNK_ROWS["cpu"]
    big = rule(151936, 1024, torch.float32, cpu)  # capped by the budget
    assert 256 <= big and big * 151936 * 4 <= ga.CHUNK_LOGITS_BUDGET["cpu"]
    gpu = rule(151936, 4096, torch.bfloat16, cuda)
    assert 512 <= gpu and gpu * 151936 * 2 <= ga.CHUNK_LOGITS_BUDGET["cuda"]
    assert rule(151936, 64, torch.float32, cpu) == ga.CHUNK_LOGITS_BUDGET["cpu"] // (151936 * 4)  # bound by memory
    for n in (100, 1100, 4096, 5000):
        rows = rule(32000, 512, torch.float32, cpu, num_tokens=n)
        chunks = -(-n // rows)
        assert rows % 16 == 0 and rows <= rule(32000, 512, torch.float32, cpu)
        assert n - rows * (chunks - 1) > rows - 16 * chunks, (n, rows)  # no small remainder chunk


def test_peak_memory_is_flat_in_tokens():
    """Extra memory of forward + backward is bounded by the chunk, not by N (CPU profiler)."""
    from benchmarks.harness import peak_extra_bytes

    def peak_extra(n_tokens, fn):
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(1, n_tokens, 32, generator=g, requires_grad=True)
        weight = torch.randn(2000, 32, generator=g, requires_grad=True)
        ids = torch.randint(0, 2000, (1, n_tokens), generator=g)
        adv = torch.randn(1, generator=g)
        return peak_extra_bytes(lambda: fn(hidden, weight, ids, adv).loss.backward(), torch.device("cpu"))[0]

    def fused(h, w, i, a):
        return gk.fused_linear_grpo_loss(h, w, i, a, chunk_size=256, backend="torch")

    def reference(h, w, i, a):
        return gk.fused_linear_grpo_loss(h, w, i, a, backend="reference")

    small, large = peak_extra(2048, fused), peak_extra(4096, fused)
    ref_small, ref_large = peak_extra(2048, reference), peak_extra(4096, reference)
    hidden_bytes = 2048 * 32 * 4  # the extra hidden rows and their gradient, per doubling
    assert large - small <= 4 * hidden_bytes + 2**20, (small, large)
    assert ref_large - ref_small > 2048 * 2000 * 4  # the reference grows with N * V
    assert large * 8 <= ref_large, (large, ref_large)


# --------------------------------------------------------------------------------------------------
# the gradient formed in the forward (autograd.FusedLinearGRPOLoss), issue 14
# --------------------------------------------------------------------------------------------------

def linear_batch(seed: int, dtype=torch.float32):
    """hidden, weight, bias and a grpo_cases batch whose logits are their projection."""
    hidden, weight, bias, ids, mask, _, _, adv = make_inputs(seed, dtype)
    g = torch.Generator().manual_seed(seed + 1000)
    logits64 = hidden.double() @ weight.double().T + bias.double()
    logp64 = torch.log_softmax(logits64, -1).gather(-1, ids[..., None])[..., 0]
    old = (logp64 + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    ref = (logp64 + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    adv_tok = torch.randn(B, T, generator=g)
    is_ratio = torch.rand(B, T, generator=g) + 0.5
    mask[1, :2] = 0.5  # fractional mask weights count too
    batch = (None, ids, mask, old, ref, adv, adv_tok, is_ratio)
    return hidden, weight, bias, batch


def on_device(kw):
    return {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


def run_fused(hidden, weight, bias, batch, advantages, kw, **extra):
    _, ids, mask, *_ = batch
    h, w, b = leaves(hidden, weight, bias)
    out = gk.fused_linear_grpo_loss(h, w, ids.to(DEVICE), advantages.to(DEVICE), mask.to(DEVICE), bias=b,
                                    **on_device(kw), **extra)
    return out, (h, w, b)


def run64(hidden, weight, bias, batch, advantages, kw):
    _, ids, mask, *_ = batch
    h64, w64, b64 = leaves64(hidden, weight, bias)
    loss64, logp64, metrics64 = grpo64(h64 @ w64.T + b64, ids, advantages, mask, **kw)
    return loss64, logp64, metrics64, (h64, w64, b64)


def check_grads(got, want, dtype=torch.float32, what=""):
    for name, g, w in zip(("hidden", "weight", "bias"), got, want):
        assert g.dtype == dtype, name
        assert_close64(g, w, dtype, scale=grad_tol(dtype, w), what=f"{what} grad {name}")


@pytest.mark.parametrize("loss_type", CORE_LOSS_TYPES)
@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_gradient_in_forward_every_option_matches_float64(case, loss_type):
    """Every option set of the loss tests, every loss type; token-level ones form the gradient in
    the forward, GSPO ones take the recompute path. chunk_size 4 does not divide the 12 kept rows."""
    seed = 300 + list(OPTION_CASES).index(case)
    hidden, weight, bias, batch = linear_batch(seed)
    advantages, kw = build_kwargs(OPTION_CASES[case], batch)
    kw["loss_type"] = loss_type
    if loss_type == "dapo":
        kw["num_items_in_batch"] = 29
    if loss_type == "dr_grpo":
        kw["max_completion_length"] = 9
    out, (h, w, b) = run_fused(hidden, weight, bias, batch, advantages, kw, chunk_size=4, backend="torch")
    token_level = kw.get("importance_sampling_level", "token") == "token"
    assert (type(out.loss.grad_fn).__name__ == "FusedLinearGRPOLossFunctionBackward") == token_level
    out.loss.backward()
    loss64, logp64, metrics64, grads64 = run64(hidden, weight, bias, batch, advantages, kw)
    loss64.backward()
    assert_close64(out.loss, loss64, what="loss")
    assert_close64(out.per_token_logps, logp64, scale=5, what="logps")
    check_grads((h.grad, w.grad, b.grad), [t.grad for t in grads64])
    for name, value in metrics64.items():
        assert_close64(out.metrics[name], value, what=name)


@pytest.mark.parametrize("case", ["old_ref_beta", "entropy_coef", "temperature"])
def test_gradient_in_forward_triton_backend(case):
    """The Triton row kernels (interpreter on a CPU) through the default forward_backward_rows."""
    hidden, weight, bias, batch = linear_batch(400 + len(case))
    advantages, kw = build_kwargs(OPTION_CASES[case], batch)
    out, (h, w, b) = run_fused(hidden, weight, bias, batch, advantages, kw, chunk_size=5, backend="triton")
    assert type(out.loss.grad_fn).__name__ == "FusedLinearGRPOLossFunctionBackward"
    out.loss.backward()
    loss64, logp64, _, grads64 = run64(hidden, weight, bias, batch, advantages, kw)
    loss64.backward()
    assert_close64(out.loss, loss64, what="loss")
    check_grads((h.grad, w.grad, b.grad), [t.grad for t in grads64])


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("mode", ROLLOUT_CORRECTIONS)
def test_rollout_correction_given_old_logps_forms_the_gradient_in_the_forward(mode, packed):
    """Given old_logps, a rollout correction's weights are constants in every mode, the sequence-level
    ones too (objective.constant_rollout_weights): the fused-linear loss forms its gradient in the
    forward, with the loss, gradients and metrics of the path that takes the log-probs first (what a
    sequence-level call ran before: fused_linear_token_logprobs, then objective's maths) and, by rows,
    of the float64 spec. Bounds that both clip/zero some weights; chunk_size 4 splits sequences."""
    hidden, weight, bias, batch = linear_batch(940 + 2 * ROLLOUT_CORRECTIONS.index(mode) + packed)
    _, ids, mask, old, ref, adv, adv_tok, _ = batch
    mask = (mask != 0).float()  # (TRL's completion mask is 0/1: the spec weights the differences by it)
    batch = (None, ids, mask) + batch[3:]
    adv = adv_tok if packed else adv  # (one advantage per packed sequence's token)
    g = torch.Generator().manual_seed(941)
    rollout = old + 0.15 * torch.randn(B, T, generator=g)
    kw = dict(loss_type="grpo", old_logps=old, ref_logps=ref, beta=0.04, entropy_coef=0.01, rollout_logps=rollout,
              rollout_correction=mode, rollout_correction_max=1.15, rollout_correction_min=0.9)
    if packed:
        kw["segment_ids"] = torch.tensor([[0, 0, 1, 1, 1], [3, 3, 3, 5, 5], [0, 0, 0, 0, 0]])
    out, (h, w, b) = run_fused(hidden, weight, bias, batch, adv, kw, chunk_size=4, backend="torch")
    assert type(out.loss.grad_fn).__name__ == "FusedLinearGRPOLossFunctionBackward"
    out.loss.backward()

    # the log-probs first, then the shared maths (the backward recomputes the chunks' logits)
    inputs, options = split_grpo_keywords(on_device(kw), "fused_linear_grpo_loss")
    eff = objective.effective_mask(ids, mask).to(DEVICE)
    h2, w2, b2 = leaves(hidden, weight, bias)
    logp, entropy = gk.fused_linear_token_logprobs(h2, w2, objective.masked_ids(ids.to(DEVICE), eff), bias=b2,
                                                   return_entropy=True, chunk_size=4, backend="torch")
    first = objective.grpo_loss_from_logprobs(logp, entropy, adv.to(DEVICE), eff, inputs, options)
    first.loss.backward()
    torch.testing.assert_close(out.loss, first.loss, rtol=1e-6, atol=1e-7)
    for got, want in zip((h.grad, w.grad, b.grad), (h2.grad, w2.grad, b2.grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert set(out.metrics) == set(first.metrics) and "sampling/importance_sampling_ratio/mean" in out.metrics
    for name, value in first.metrics.items():
        torch.testing.assert_close(out.metrics[name], value, rtol=1e-6, atol=1e-7, msg=name)
    ratios = objective.constant_rollout_weights(inputs, eff, options, objective.Sequences(eff, inputs.segment_ids))
    assert ((ratios == 0) | (ratios == 1.15) | (ratios == 0.9)).any() and ((ratios > 0.9) & (ratios < 1.15)).any()
    if not packed:  # (the float64 spec's correction is by rows)
        loss64, _, metrics64, grads64 = run64(hidden, weight, bias, batch, adv, kw)
        loss64.backward()
        assert_close64(out.loss, loss64, what="loss")
        check_grads((h.grad, w.grad, b.grad), [t.grad for t in grads64])


@pytest.mark.parametrize("case", ["old_ref_beta", "gspo"])
def test_incoming_gradient_scales_and_two_losses_add(case):
    """backward of 3.7 * loss1 + loss2 (two calls on the same parameters, different options)."""
    hidden, weight, bias, batch = linear_batch(500)
    advantages, kw = build_kwargs(OPTION_CASES[case], batch)
    kw2 = dict(kw, loss_type="grpo", entropy_coef=0.05, temperature=0.9)
    _, ids, mask, *_ = batch
    h, w, b = leaves(hidden, weight, bias)
    args = (ids.to(DEVICE), advantages.to(DEVICE), mask.to(DEVICE))
    loss1 = gk.fused_linear_grpo_loss(h, w, *args, bias=b, chunk_size=4, backend="torch", **on_device(kw)).loss
    loss2 = gk.fused_linear_grpo_loss(h, w, *args, bias=b, chunk_size=7, backend="torch", **on_device(kw2)).loss
    (3.7 * loss1 + loss2).backward()
    h64, w64, b64 = leaves64(hidden, weight, bias)
    logits64 = h64 @ w64.T + b64
    (3.7 * grpo64(logits64, ids, advantages, mask, **kw)[0] + grpo64(logits64, ids, advantages, mask, **kw2)[0]).backward()
    check_grads((h.grad, w.grad, b.grad), (h64.grad, w64.grad, b64.grad))


def test_second_backward_raises_instead_of_reusing_the_gradient():
    """retain_graph=True then a second backward: the gradient formed in the forward was handed over
    (no copy) to the first backward, so the second raises; the first one's gradients are right."""
    hidden, weight, bias, batch = linear_batch(600)
    advantages, kw = build_kwargs(OPTION_CASES["old_ref_beta"], batch)
    out, (h, w, b) = run_fused(hidden, weight, bias, batch, advantages, kw, chunk_size=4, backend="torch")
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        out.loss.backward()
    loss64, _, _, grads64 = run64(hidden, weight, bias, batch, advantages, kw)
    loss64.backward()
    check_grads((h.grad, w.grad, b.grad), [t.grad for t in grads64])


def test_second_backward_on_the_recompute_path_is_correct():
    """GSPO recomputes the logits in the backward, so retain_graph gives the gradient twice."""
    hidden, weight, bias, batch = linear_batch(601)
    advantages, kw = build_kwargs(OPTION_CASES["gspo"], batch)
    out, (h, w, b) = run_fused(hidden, weight, bias, batch, advantages, kw, chunk_size=4, backend="torch")
    out.loss.backward(retain_graph=True)
    out.loss.backward()
    loss64, _, _, (h64, w64, b64) = run64(hidden, weight, bias, batch, advantages, kw)
    (2 * loss64).backward()
    check_grads((h.grad, w.grad, b.grad), (h64.grad, w64.grad, b64.grad))


def test_no_grad_loss_takes_the_forward_only_path():
    hidden, weight, bias, batch = linear_batch(602)
    advantages, kw = build_kwargs(OPTION_CASES["old_ref_beta"], batch)
    with torch.no_grad():
        out, _ = run_fused(hidden, weight, bias, batch, advantages, kw, chunk_size=4, backend="torch")
    assert out.loss.grad_fn is None
    loss64, logp64, _, _ = run64(hidden, weight, bias, batch, advantages, kw)
    assert_close64(out.loss, loss64, what="loss")


@pytest.mark.parametrize("accumulate_in_weight_dtype", [False, True])
@pytest.mark.parametrize("path", ["grpo_loss", "token_logprobs"])
def test_weight_gradient_accumulation_modes(accumulate_in_weight_dtype, path, monkeypatch):
    """bf16 head: d W accumulated in fp32 (default) or in bf16; both within bf16 tolerance of float64
    and each in the dtype it claims (checked on the accumulator itself)."""
    hidden, weight, bias, batch = linear_batch(700, torch.bfloat16)
    advantages, kw = build_kwargs(OPTION_CASES["old_ref_beta"], batch)
    seen = []
    original = ga._accumulate_weight_grad
    monkeypatch.setattr(ga, "_accumulate_weight_grad",
                        lambda acc, g, h, first=False: (seen.append(acc.dtype), original(acc, g, h, first)))
    _, ids, mask, *_ = batch
    h, w, b = leaves(hidden, weight, bias)
    if path == "grpo_loss":
        loss = gk.fused_linear_grpo_loss(h, w, ids, advantages, mask, bias=b, chunk_size=4, backend="torch",
                                         accumulate_in_weight_dtype=accumulate_in_weight_dtype, **kw).loss
    else:
        logp, ent = gk.fused_linear_token_logprobs(h, w, ids, bias=b, chunk_size=4, return_entropy=True, backend="torch",
                                                   accumulate_in_weight_dtype=accumulate_in_weight_dtype)
        loss = (logp * mask).sum() + 0.3 * ent.sum()
    loss.backward()
    h64, w64, b64 = leaves64(hidden, weight, bias)
    if path == "grpo_loss":
        loss64 = grpo64(h64 @ w64.T + b64, ids, advantages, mask, **kw)[0]
    else:
        lp64, ent64 = logprobs64(h64 @ w64.T + b64, ids)
        loss64 = (lp64 * mask).sum() + 0.3 * ent64.sum()
    loss64.backward()
    assert seen and set(seen) == {torch.bfloat16 if accumulate_in_weight_dtype else torch.float32}
    check_grads((h.grad, w.grad, b.grad), (h64.grad, w64.grad, b64.grad), torch.bfloat16)


def test_weight_dtype_accumulation_error_is_documented_size():
    """Accumulating d W in bf16 over many chunks: its error against fp32 accumulation stays within
    ~2^-8 * sqrt(chunks) of the gradient's scale (the docstring's claim), 64 one-row chunks here."""
    g = torch.Generator().manual_seed(7)
    n, h_size, v = 64, 32, 97
    hidden = torch.randn(n, h_size, generator=g).bfloat16()
    weight = (torch.randn(v, h_size, generator=g) / h_size**0.5 * 3).bfloat16()
    ids = torch.randint(0, v, (n,), generator=g)
    grads = {}
    for mode in (False, True):
        w = weight.clone().requires_grad_()
        gk.fused_linear_token_logprobs(hidden, w, ids, chunk_size=1, backend="torch",
                                       accumulate_in_weight_dtype=mode).sum().backward()
        grads[mode] = w.grad.double()
    scale = grads[False].abs().max()
    err = (grads[True] - grads[False]).abs().max() / scale
    assert 0 < err <= 2**-8 * n**0.5, err.item()


@pytest.mark.parametrize("path", ["grpo_loss", "token_logprobs"])
def test_bf16_autocast_is_one_compute_dtype(path):
    """Under bf16 autocast with fp32 parameters the logits are formed in bf16 once per call and the
    gradient is taken from those same logits (the dtype recorded in the forward, reused in the
    backward): the gradients are those of the same call on bf16 copies of the parameters (before
    their final rounding to bf16), and the softmax gradient sums to ~0 over the vocabulary (the bias
    gradient's sum; 1e-2 of its size when the backward recomputed the logits in fp32 against the
    forward's bf16 statistics, -0.0116 in the issue's case)."""
    g = torch.Generator().manual_seed(11)
    b_, t_, h_, v_ = 2, 16, 64, 2000
    hidden = torch.randn(b_, t_, h_, generator=g)
    weight = torch.randn(v_, h_, generator=g) / h_**0.5 * 16  # logits ~ +-60: bf16 rounds them by ~0.25
    bias = torch.randn(v_, generator=g)
    ids = torch.randint(0, v_, (b_, t_), generator=g)
    adv = torch.randn(b_, generator=g)

    def run(params, autocast):
        h, w, b = params
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if path == "grpo_loss":
                loss = gk.fused_linear_grpo_loss(h, w, ids, adv, bias=b, chunk_size=8, backend="torch").loss
            else:
                loss = gk.fused_linear_token_logprobs(h, w, ids, bias=b, chunk_size=8, backend="torch").sum() / 32
        loss.backward()
        return [p.grad for p in params]

    grads = run(leaves(hidden, weight, bias), autocast=True)
    assert all(gr.dtype == torch.float32 for gr in grads)
    bf16 = run([t.bfloat16().requires_grad_() for t in (hidden, weight, bias)], autocast=False)
    for name, got, want in zip(("hidden", "weight", "bias"), grads, bf16):
        assert torch.equal(got.bfloat16(), want), name  # fp32 accumulators, rounded once for bf16 inputs
    bias_grad = grads[2]
    # what is left is the bf16 rounding of d logits (~2e-4 of the size); ~1e-2 when inconsistent
    assert abs(bias_grad.sum().item()) <= 2**-10 * bias_grad.abs().sum().item(), bias_grad.sum().item()


@pytest.mark.parametrize("factored", [False, True], ids=["plain", "factored"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("entropy_grad_scale", [0.0, 1.0, 50.0])
def test_torch_forward_backward_rows_matches_float64(dtype, entropy_grad_scale, factored, monkeypatch):
    """The fused torch row pass against float64 autograd: temperature, a -inf logit, an ignored row,
    a confident row (p_t ~ 1 - 1e-5), blocks of rows that do not divide n (one block here is 3 rows);
    d loss / d entropy of 0 (None), ~1 and ~50 (a large entropy bonus: the -inf logit's gradient was
    NaN there). ``factored``: without an entropy gradient the buffer holds e' and the gradient is
    ``row_scale * e' + onehot * target_grad``; with one, the full gradient (from log e')."""
    with_entropy_grad = entropy_grad_scale != 0
    monkeypatch.setattr(torch_rows, "BLOCK_ELEMENTS", 3 * 157)
    g = torch.Generator().manual_seed(9)
    n, v = 8, 157
    logits = (torch.randn(n, v, generator=g) * 3).to(dtype)
    logits[2, 5] = float("-inf")
    targets = torch.randint(0, v, (n,), generator=g)
    targets[4] = -100
    logits[6, targets[6]] = logits[6].float().max().to(dtype) + 14  # 1 - p_t ~ 1e-5 after the temperature
    g_logp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g) * entropy_grad_scale
    seen = {}

    def coefficients(logp, entropy):
        seen["logp"], seen["entropy"] = logp.clone(), entropy.clone()
        return g_logp, g_ent if with_entropy_grad else None

    buf = logits.clone()
    out = torch_rows.forward_backward_rows(buf, targets, 0.7, -100, coefficients, factored=factored)
    logp, entropy = out.logp, out.entropy
    assert (out.row_scale is not None) == (factored and not with_entropy_grad)
    if out.row_scale is not None:
        assert buf.dtype == dtype and (buf[torch.arange(n), targets.clamp(min=0)] == 0).all()
        grad = buf.double() * out.row_scale.double()[:, None]
        grad[torch.arange(n), targets.clamp(min=0)] += out.target_grad.double()
        buf = grad.to(dtype)
    z64 = logits.double().requires_grad_()
    lp64, ent64 = logprobs64(z64, targets, 0.7)
    ((lp64 * g_logp.double()).sum() + ((ent64 * g_ent.double()).sum() if with_entropy_grad else 0)).backward()
    assert torch.equal(seen["logp"], logp) and torch.equal(seen["entropy"], entropy)
    assert_close64(logp, lp64, scale=5, what="logp")
    assert_close64(entropy, ent64, scale=5, what="entropy")
    assert buf.dtype == dtype
    assert_close64(buf, z64.grad, dtype, scale=grad_tol(torch.float32, z64.grad), what="d logits")
    assert buf[4].abs().max() == 0


def test_gradient_in_forward_with_no_completion_token():
    """Every position masked: loss 0, zero gradients (the d W accumulator is then zeros, not unset)."""
    hidden, weight, bias, batch = linear_batch(900)
    _, ids, mask, *_ = batch
    h, w, b = leaves(hidden, weight, bias)
    out = gk.fused_linear_grpo_loss(h, w, ids, torch.randn(B), torch.zeros_like(mask), bias=b, backend="torch")
    assert type(out.loss.grad_fn).__name__ == "FusedLinearGRPOLossFunctionBackward"
    out.loss.backward()
    assert out.loss.item() == 0
    for grad in (h.grad, w.grad, b.grad):
        assert torch.equal(grad, torch.zeros_like(grad))


# --------------------------------------------------------------------------------------------
# Final-logit soft-capping (Gemma-2/3) and logit scale (Cohere), with their gradients, on every
# backend and the fused-linear path, against float64.


TRANSFORMS = [dict(softcap=30.0), dict(softcap=5.0, temperature=0.7), dict(logit_scale=0.0625), dict(softcap=8.0, logit_scale=2.5, temperature=1.3)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("transform", TRANSFORMS, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_token_logprobs_with_transform(backend, dtype, transform):
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(3, 5, 257, generator=g) * 12).to(dtype)  # large enough for the cap to bend
    ids = torch.randint(0, 257, (3, 5), generator=g)
    ids[1, 2] = -100
    x = logits.clone().to(DEVICE).requires_grad_()
    lp, ent = gk.token_logprobs(x, ids.to(DEVICE), return_entropy=True, backend=backend, **transform)
    w = torch.randn(3, 5, generator=g)
    (lp * w.to(DEVICE) + ent).sum().backward()
    x64 = logits.double().requires_grad_()
    lp64, ent64 = logprobs64(x64, ids, **transform)
    (lp64 * w.double() + ent64).sum().backward()
    assert_close64(lp, lp64, scale=10, what="logp")
    assert_close64(ent, ent64, scale=10, what="entropy")
    assert_close64(x.grad, x64.grad, dtype, scale=0.1 * x64.grad.abs().max().item(), what="grad")
    assert (x.grad[1, 2] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_grpo_loss_with_softcap(backend, loss_type):
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 6, 101, generator=g) * 10
    ids = torch.randint(0, 101, (2, 6), generator=g)
    adv, old = torch.randn(2, generator=g), torch.randn(2, 6, generator=g) * 0.2 - 4
    kw = dict(loss_type=loss_type, old_logps=old, softcap=15.0, logit_scale=0.8, temperature=0.9, entropy_coef=0.01)
    x = logits.clone().to(DEVICE).requires_grad_()
    out = gk.grpo_loss(x, ids.to(DEVICE), adv.to(DEVICE), backend=backend, **{k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()})
    out.loss.backward()
    x64 = logits.double().requires_grad_()
    loss64, _, _ = grpo64(x64, ids, adv, None, **kw)
    loss64.backward()
    assert_close64(out.loss, loss64, what="loss")
    assert_close64(x.grad, x64.grad, scale=0.1 * x64.grad.abs().max().item(), what="grad")


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_with_softcap(backend):
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(2, 7, 8, generator=g), torch.randn(61, 8, generator=g) * 3
    ids = torch.randint(0, 61, (2, 7), generator=g)
    h = hidden.clone().to(DEVICE).requires_grad_()
    w = weight.clone().to(DEVICE).requires_grad_()
    lp, ent = gk.fused_linear_token_logprobs(h, w, ids.to(DEVICE), softcap=10.0, logit_scale=1.5, return_entropy=True,
                                             chunk_size=5, backend=backend)
    (lp + ent).sum().backward()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    lp64, ent64 = logprobs64(h64 @ w64.T, ids, softcap=10.0, logit_scale=1.5)
    (lp64 + ent64).sum().backward()
    assert_close64(lp, lp64, scale=10, what="logp")
    assert_close64(h.grad, h64.grad, scale=0.1 * h64.grad.abs().max().item(), what="grad hidden")
    assert_close64(w.grad, w64.grad, scale=0.1 * w64.grad.abs().max().item(), what="grad weight")


@pytest.mark.parametrize("name, value", [("softcap", 0.0), ("softcap", -1.0), ("softcap", float("inf")), ("logit_scale", 0.0), ("logit_scale", float("nan"))])
def test_bad_transforms_are_refused(name, value):
    with pytest.raises(ValueError, match=name):
        gk.token_logprobs(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), **{name: value})
    with pytest.raises(ValueError, match=name):
        gk.GRPOLoss(**{name: value})


# --------------------------------------------------------------------------------------------
# Contract v2: TRL's other objectives (luspo, cispo, sapo, vespo), the bias-corrected KL, the new
# clip metrics, and packed rows (``segment_ids``), on every backend, against the float64 spec.


CASES = {
    "on_policy": dict(),
    "old_ref_beta": dict(use_old=True, use_ref=True, beta=0.04),
    "bias_corrected_kl": dict(use_old=True, use_ref=True, beta=0.1, use_bias_correction_kl=True),
    "is_ratio": dict(use_old=True, use_is=True),
    "is_ratio_per_sequence": dict(use_old=True, use_is="column"),
    "per_token_adv": dict(use_old=True, adv_per_token=True, entropy_coef=0.01),
    "gspo": dict(use_old=True, use_ref=True, beta=0.02, importance_sampling_level="sequence"),
    "params": dict(use_old=True, eps_high=0.28, sapo_temperature_pos=0.7, sapo_temperature_neg=1.3,
                   vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.0, vespo_lambda_neg=1.0),
}


def run(logits, ids, advantages, mask, backend, **kw):
    x = logits.detach().clone().to(DEVICE).requires_grad_()
    kw = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    out = gk.grpo_loss(x, ids.to(DEVICE), advantages.to(DEVICE), mask.to(DEVICE), backend=backend, **kw)
    out.loss.backward()
    return out, x.grad


def check_against_spec(out, grad, logits, ids, advantages, mask, kw, dtype=torch.float32):
    x64 = logits.double().requires_grad_()
    loss64, logp64, metrics64 = grpo64(x64, ids, advantages, mask, **kw)
    loss64.backward()
    assert_close64(out.loss, loss64, what="loss")
    assert_close64(out.per_token_logps, logp64, scale=10, what="per_token_logps")
    assert_close64(grad, x64.grad, dtype, scale=(0.1 if dtype == torch.float32 else 1e-3) * x64.grad.abs().max().item(), what="grad")
    assert set(out.metrics) == set(metrics64)
    for name, value in metrics64.items():
        assert_close64(out.metrics[name], value, what=name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_type", ["luspo", "cispo", "sapo", "vespo"])
@pytest.mark.parametrize("case", list(CASES))
def test_trl_objectives_match_float64(backend, loss_type, case):
    batch = make_batch(200 + list(CASES).index(case), V=131)
    logits, ids, mask = batch[:3]
    advantages, kw = build_kwargs(CASES[case], batch)
    kw["loss_type"] = loss_type
    if loss_type == "cispo":
        kw["eps_high"] = 1.3  # cispo's cap on the ratio (ScaleRL recommends 5; 1.3 makes it bind here)
    out, grad = run(logits, ids, advantages, mask, backend, **kw)
    check_against_spec(out, grad, logits, ids, advantages, mask, kw)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_bias_corrected_kl_and_clip_extremes(backend, loss_type):
    batch = make_batch(17, dtype=torch.bfloat16, V=131)
    logits, ids, mask = batch[:3]
    advantages, kw = build_kwargs(CASES["bias_corrected_kl"], batch)
    kw.update(loss_type=loss_type, eps_high=0.28, delta=1.6)
    out, grad = run(logits, ids, advantages, mask, backend, **kw)
    check_against_spec(out, grad, logits, ids, advantages, mask, kw, dtype=torch.bfloat16)
    assert out.metrics["clip_ratio/high_max"] >= out.metrics["clip_ratio/high_mean"] >= 0
    assert 0 <= out.metrics["clip_ratio/low_min"] <= out.metrics["clip_ratio/low_mean"] + 1e-6


def pack(batch_tensors, mask, lengths_per_row):
    """Pack the rows of a padded [B, T] batch into fewer rows: returns packed tensors and segment ids.

    ``lengths_per_row`` lists, for each packed row, which padded rows go into it (in order)."""
    b, t = mask.shape
    width = max(sum(t for _ in rows) for rows in lengths_per_row)
    packed = []
    for x in batch_tensors:
        shape = (len(lengths_per_row), width) + tuple(x.shape[2:])
        packed.append(torch.zeros(shape, dtype=x.dtype))
    seg = torch.full((len(lengths_per_row), width), -1, dtype=torch.long)
    pmask = torch.zeros(len(lengths_per_row), width)
    for r, rows in enumerate(lengths_per_row):
        pos = 0
        for s, src in enumerate(rows):
            for x, p in zip(batch_tensors, packed):
                p[r, pos:pos + t] = x[src]
            seg[r, pos:pos + t] = 10 * s + 3  # any ids: only equality within a row matters
            pmask[r, pos:pos + t] = mask[src]
            pos += t
    return packed, pmask, seg


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_packed_rows_equal_the_padded_batch(backend, loss_type, level):
    """segment_ids: several sequences per row give the padded batch's loss, gradients and metrics."""
    g = torch.Generator().manual_seed(5)
    b, t, v = 4, 6, 37
    logits = torch.randn(b, t, v, generator=g) * 2
    ids = torch.randint(0, v, (b, t), generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.3).float()
    mask[:, 0] = 1  # every sequence keeps a token (an all-masked sequence does not exist when packed)
    adv = torch.randn(b, generator=g).unsqueeze(-1).expand(b, t).contiguous()
    old = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0] + 0.3 * torch.randn(b, t, generator=g)
    ref = old + 0.2 * torch.randn(b, t, generator=g)
    is_ratio = torch.rand(b, t, generator=g) + 0.5
    kw = dict(loss_type=loss_type, beta=0.05, importance_sampling_level=level, eps_high=0.28, max_completion_length=t,
              use_bias_correction_kl=loss_type == "dapo")
    padded, padded_grad = run(logits, ids, adv, mask, backend, old_logps=old, ref_logps=ref, is_ratio=is_ratio, **kw)

    layout = [[0, 2], [1], [3]]
    (p_logits, p_ids, p_adv, p_old, p_ref, p_is), p_mask, seg = pack([logits, ids, adv, old, ref, is_ratio], mask, layout)
    p_mask[2, t:] = 0  # row 2 has one sequence and trailing padding
    p_ids[1, t:] = 10**6  # padding ids are never read
    p_old[1, t:] = float("nan")
    packed, packed_grad = run(p_logits, p_ids, p_adv, p_mask, backend, old_logps=p_old, ref_logps=p_ref, is_ratio=p_is,
                              segment_ids=seg, **kw)
    assert_close64(packed.loss, padded.loss.double(), what="loss")
    for r, rows in enumerate(layout):
        for s, src in enumerate(rows):
            got = packed_grad[r, s * t:(s + 1) * t]
            assert_close64(got, padded_grad[src].double(), scale=0.1 * padded_grad.abs().max().item(), what="grad")
            assert_close64(packed.per_token_logps[r, s * t:(s + 1) * t], padded.per_token_logps[src].double(), what="logp")
    assert set(packed.metrics) == set(padded.metrics)
    for name in padded.metrics:
        assert_close64(packed.metrics[name], padded.metrics[name].double(), what=name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "vespo"])
def test_packed_rows_match_float64_spec(backend, loss_type):
    g = torch.Generator().manual_seed(8)
    b, t, v = 2, 9, 29
    logits = torch.randn(b, t, v, generator=g)
    ids = torch.randint(0, v, (b, t), generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.2).float()
    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2], [5, 5, 5, 5, 5, 7, 7, 7, 7]])
    adv = torch.randn(b, t, generator=g)
    old = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0] + 0.3 * torch.randn(b, t, generator=g)
    kw = dict(loss_type=loss_type, old_logps=old, segment_ids=seg, importance_sampling_level="sequence")
    out, grad = run(logits, ids, adv, mask, backend, **kw)
    check_against_spec(out, grad, logits, ids, adv, mask, kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_takes_segment_ids(backend):
    g = torch.Generator().manual_seed(9)
    b, t, h, v = 2, 8, 5, 23
    hidden, weight = torch.randn(b, t, h, generator=g), torch.randn(v, h, generator=g)
    ids = torch.randint(0, v, (b, t), generator=g)
    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [4, 4, 4, 4, 4, 4, 4, 4]])
    adv = torch.randn(b, t, generator=g)
    kw = dict(loss_type="grpo", segment_ids=seg, importance_sampling_level="sequence")
    hl = hidden.clone().requires_grad_()
    out = gk.fused_linear_grpo_loss(hl.to(DEVICE), weight.to(DEVICE), ids.to(DEVICE), adv.to(DEVICE), backend=backend,
                                    **{k: (x.to(DEVICE) if isinstance(x, torch.Tensor) else x) for k, x in kw.items()})
    out.loss.backward()
    h64 = hidden.double().requires_grad_()
    loss64, _, _ = grpo64(h64 @ weight.double().T, ids, adv, None, **kw)
    loss64.backward()
    assert_close64(out.loss, loss64, what="loss")
    assert_close64(hl.grad, h64.grad, scale=0.1 * h64.grad.abs().max().item(), what="grad hidden")


def test_segment_ids_are_validated():
    logits, ids, adv = torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), torch.randn(2, 3)
    with pytest.raises(ValueError, match="segment_ids"):
        gk.grpo_loss(logits, ids, adv, segment_ids=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="segment_ids"):
        gk.grpo_loss(logits, ids, adv, segment_ids=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="advantages"):
        gk.grpo_loss(logits, ids, adv[:, 0], segment_ids=torch.zeros(2, 3, dtype=torch.long))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "vespo"])
def test_packed_row_without_loss_tokens(backend, loss_type):
    """A packed micro-batch whose sequences have no loss token (a trainer's filler, a masked-out
    truncated completion alone in its row): loss 0, zero gradient, finite metrics."""
    logits = torch.randn(1, 6, 11).to(DEVICE).requires_grad_()
    ids = torch.randint(0, 11, (1, 6)).to(DEVICE)
    out = gk.grpo_loss(logits, ids, torch.randn(1, 6).to(DEVICE), torch.zeros(1, 6).to(DEVICE), backend=backend,
                       loss_type=loss_type, segment_ids=torch.tensor([[0, 0, 0, 1, 1, 1]]).to(DEVICE),
                       importance_sampling_level="sequence")
    out.loss.backward()
    assert out.loss.item() == 0 and (logits.grad == 0).all()
    assert all(torch.isfinite(v) or k.endswith(("_min", "_max")) for k, v in out.metrics.items())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_fused_linear_gradient_in_forward_every_objective(backend, loss_type):
    """The fused-linear path (gradient formed in the forward for token-local objectives, recomputed
    for vespo) with packed rows, soft-capping and the bias-corrected KL, against float64."""
    g = torch.Generator().manual_seed(11)
    b, t, h, v = 2, 7, 5, 23
    hidden, weight = torch.randn(b, t, h, generator=g), torch.randn(v, h, generator=g) * 2
    ids = torch.randint(0, v, (b, t), generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.2).float()
    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [3, 3, 3, 3, 3, 3, 3]])
    adv = torch.randn(b, t, generator=g)
    logp_now = torch.log_softmax(10.0 * torch.tanh(hidden @ weight.T / 10.0), -1).gather(-1, ids[..., None])[..., 0]
    old = logp_now + 0.3 * torch.randn(b, t, generator=g)
    ref = logp_now + 0.2 * torch.randn(b, t, generator=g)
    kw = dict(loss_type=loss_type, old_logps=old, ref_logps=ref, beta=0.05, use_bias_correction_kl=True, softcap=10.0,
              segment_ids=seg, eps_high=1.3 if loss_type == "cispo" else 0.28, entropy_coef=0.01)
    hl, wl = hidden.clone().to(DEVICE).requires_grad_(), weight.clone().to(DEVICE).requires_grad_()
    out = gk.fused_linear_grpo_loss(hl, wl, ids.to(DEVICE), adv.to(DEVICE), mask.to(DEVICE), backend=backend, chunk_size=4,
                                    **{k: (x.to(DEVICE) if isinstance(x, torch.Tensor) else x) for k, x in kw.items()})
    (out.loss * 2.5).backward()  # an incoming gradient other than 1
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    loss64, _, metrics64 = grpo64(h64 @ w64.T, ids, adv, mask, **kw)
    (loss64 * 2.5).backward()
    assert_close64(out.loss, loss64, what="loss")
    assert_close64(hl.grad, h64.grad, scale=0.1 * h64.grad.abs().max().item(), what="grad hidden")
    assert_close64(wl.grad, w64.grad, scale=0.1 * w64.grad.abs().max().item(), what="grad weight")
    for name, value in metrics64.items():
        assert_close64(out.metrics[name], value, what=name)


# --------------------------------------------------------------------------------------------------
# the sampler's distribution: top_k / top_p, temperature tensors, the sum of squared probabilities
# --------------------------------------------------------------------------------------------------
from spec64 import sampled_logprobs64  # noqa: E402

SAMPLING_V = 37  # not a multiple of any block size


def sampling_batch(seed: int, dtype, v: int = SAMPLING_V, temperature: float = 0.7):
    """[3, 3, V] logits on a half-integer grid (ties everywhere, also at the k-th value), one ignored row,
    and row (0, 0) built for a tie at the top-p threshold: one token at 3, four at 1 (ids 10..13), the
    rest 0; ``p_tie`` puts the threshold inside the four (keeps 3: 2.5 of their mass is needed)."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(3, 3, v, generator=g) * 2).round() / 2
    logits[0, 0] = 0.0
    logits[0, 0, 5] = 3.0
    logits[0, 0, 10:14] = 1.0
    targets = torch.randint(0, v, (3, 3), generator=g)
    targets[0, 0] = 11  # the lowest-indexed kept tie... (10 is dropped, 11 12 13 kept)
    targets[1, 1] = -100
    p = torch.softmax(logits[0, 0].double() / temperature, 0)
    p_tie = float(p[5] + 2.5 * p[10])
    return logits.to(dtype), targets, p_tie


SAMPLING_CASES = {  # name -> (top_k, top_p); "tie" is the designed top-p tie
    "top_k": (5, None), "top_k=1": (1, None), "top_p": (None, 0.8), "tie": (None, "tie"),
    "tiny_top_p": (None, 1e-6), "top_k+top_p": (6, 0.7), "top_k+tie": (8, "tie"),
}


def _finite(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_sampled_logprobs_match_vllm_restatement(backend, dtype, case):
    """log-prob (-inf outside the kept set), entropy and sum of squared probabilities of vLLM's truncated
    distribution, and the gradients of the log-prob and entropy, against spec64's float64 restatement of
    vLLM's rules (ties at the k-th value, at the top-p threshold: the higher-indexed tied tokens stay)."""
    logits, targets, p_tie = sampling_batch(3, dtype)
    top_k, top_p = SAMPLING_CASES[case]
    top_p = p_tie if top_p == "tie" else top_p
    temperature = torch.tensor([0.7, 0.7, 1.3], dtype=torch.float64) if "top_k+" in case else 0.7
    x = logits.clone().to(DEVICE).requires_grad_()
    logp, entropy, sum_sq = gk.token_logprobs(
        x, targets.to(DEVICE), temperature=temperature.to(DEVICE) if isinstance(temperature, torch.Tensor) else temperature,
        top_k=top_k, top_p=top_p, return_entropy=True, return_sum_probs_sq=True, backend=backend)
    (_finite(logp).sum() + entropy.sum()).backward()
    x64 = logits.double().requires_grad_()
    logp64, ent64, sq64 = sampled_logprobs64(x64, targets, temperature, top_k, top_p)
    (_finite(logp64).sum() + ent64.sum()).backward()
    assert torch.equal(torch.isinf(logp.cpu()), torch.isinf(logp64)), "the kept set differs"
    if case in ("tie", "top_k+tie"):
        assert logp[0, 0].item() > -math.inf and torch.isinf(logp64).any(), "the designed tie case must test both sides"
    assert not sum_sq.requires_grad and sum_sq.dtype == torch.float32
    assert_close64(logp, logp64, what="logp", scale=5)
    assert_close64(entropy, ent64, what="entropy", scale=5)
    assert_close64(sum_sq, sq64, what="sum of squared probabilities")
    # (top_k=1: the gradient is 0, float64's is rounding noise: an absolute floor)
    assert_close64(x.grad, x64.grad, dtype, scale=max(grad_scale(dtype, x64.grad), 1e-4), what="grad")
    assert x.grad[1, 1].abs().max() == 0, "an ignored row gets no gradient"
    if case == "top_k=1":  # the largest value is kept, with every token tied at it (vLLM's top-k keeps ties)
        valid = targets != -100
        at_max = logits.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) == logits.amax(-1)
        assert torch.equal(torch.isfinite(logp.cpu())[valid], at_max[valid])


def test_designed_tie_keeps_the_higher_indices():
    """Row (0, 0): of four tokens tied at the top-p threshold the three with the highest ids stay."""
    logits, targets, p_tie = sampling_batch(3, torch.float32)
    for backend in BACKENDS:
        row = logits[0, 0].expand(4, -1).to(DEVICE)
        logp = gk.token_logprobs(row, torch.tensor([10, 11, 12, 13], device=DEVICE), temperature=0.7, top_p=p_tie,
                                 backend=backend)
        assert torch.isinf(logp[0]) and torch.isfinite(logp[1:]).all(), backend


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_sampled_logprobs_off_values_are_the_plain_softmax(backend):
    """vLLM's "off" values (top_k 0, -1, >= V; top_p 1) give the plain softmax's numbers, bitwise."""
    logits, targets, _ = sampling_batch(5, torch.float32)
    logits, targets = logits.to(DEVICE), targets.to(DEVICE)
    plain = gk.token_logprobs(logits, targets, temperature=0.7, return_entropy=True, backend=backend)
    for top_k, top_p in ((0, 1.0), (-1, None), (None, 1.0), (SAMPLING_V, None), (SAMPLING_V + 3, 1.0)):
        out = gk.token_logprobs(logits, targets, temperature=0.7, top_k=top_k, top_p=top_p, return_entropy=True,
                                backend=backend)
        assert all(torch.equal(a, b) for a, b in zip(out, plain)), (top_k, top_p)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sampled_logprobs_of_the_fused_linear_function(backend):
    """fused_linear_token_logprobs: the truncated distribution of hidden @ W^T + b, chunked (a chunk of 4 rows
    of 9), per-sequence temperatures; gradients to hidden, weight and bias against float64."""
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(3, 3, 6, generator=g)
    weight, bias = torch.randn(SAMPLING_V, 6, generator=g), torch.randn(SAMPLING_V, generator=g)
    targets = torch.randint(0, SAMPLING_V, (3, 3), generator=g)
    targets[2, 0] = -100
    temperature = torch.tensor([0.6, 1.0, 1.4], dtype=torch.float64)
    leaves = [t.clone().to(DEVICE).requires_grad_() for t in (hidden, weight, bias)]
    kw = dict(temperature=temperature.to(DEVICE), top_k=9, top_p=0.75, return_entropy=True, return_sum_probs_sq=True,
              backend=backend)
    logp, entropy, sum_sq = gk.fused_linear_token_logprobs(leaves[0], leaves[1], targets.to(DEVICE), bias=leaves[2],
                                                           **({"chunk_size": 4} if backend != "reference" else {}), **kw)
    (_finite(logp).sum() + entropy.sum()).backward()
    h64, w64, b64 = (t.double().requires_grad_() for t in (hidden, weight, bias))
    logp64, ent64, sq64 = sampled_logprobs64(h64 @ w64.t() + b64, targets, temperature, 9, 0.75)
    (_finite(logp64).sum() + ent64.sum()).backward()
    assert torch.equal(torch.isinf(logp.cpu()), torch.isinf(logp64)) and torch.isinf(logp64).any()
    assert_close64(logp, logp64, scale=5, what="logp")
    assert_close64(entropy, ent64, scale=5, what="entropy")
    assert_close64(sum_sq, sq64, what="sum_sq")
    for leaf, ref, name in zip(leaves, (h64, w64, b64), ("hidden", "weight", "bias")):
        assert_close64(leaf.grad, ref.grad, scale=grad_scale(torch.float32, ref.grad), what=f"d {name}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", ["sequence", "token"])
def test_temperature_tensor_filled_with_a_float_is_the_float_bitwise(backend, shape):
    """A [B] or [B, T] temperature tensor holding the float (float64; or a float32-exact value) gives the
    float's outputs and gradients bitwise, on all four functions."""
    logits, targets, _ = sampling_batch(11, torch.float32)
    b, t = targets.shape
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(b, t, 5, generator=g), torch.randn(SAMPLING_V, 5, generator=g)
    adv, old = torch.randn(b, generator=g), torch.randn(b, t, generator=g) * 0.1 - 3
    ids = targets.clamp(min=0)
    for value, dtype in ((0.9, torch.float64), (0.75, torch.float32)):  # (0.9: c ln 2 rounds differently in two steps)
        tensor = torch.full((b,) if shape == "sequence" else (b, t), value, dtype=dtype, device=DEVICE)

        def run(temperature):
            x, h, w = (z.clone().to(DEVICE).requires_grad_() for z in (logits, hidden, weight))
            lp, ent = gk.token_logprobs(x, targets.to(DEVICE), temperature=temperature, return_entropy=True, backend=backend)
            flp = gk.fused_linear_token_logprobs(h, w, targets.to(DEVICE), temperature=temperature, backend=backend)
            loss = gk.grpo_loss(x, ids.to(DEVICE), adv.to(DEVICE), old_logps=old.to(DEVICE), temperature=temperature,
                                backend=backend).loss
            floss = gk.fused_linear_grpo_loss(h, w, ids.to(DEVICE), adv.to(DEVICE), old_logps=old.to(DEVICE),
                                              temperature=temperature, backend=backend).loss
            (lp.sum() + ent.sum() + flp.sum() + loss + floss).backward()
            return lp, ent, flp, loss, floss, x.grad, h.grad, w.grad

        for a, c in zip(run(value), run(tensor)):
            assert torch.equal(a, c), (value, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_sampling_arguments_are_refused_before_any_kernel(backend, monkeypatch):
    """top_k, top_p and a temperature tensor: a ValueError / TypeError naming the keyword, on every
    backend, before any row kernel runs."""
    for module in (torch_rows,):
        monkeypatch.setattr(module, "forward_rows", lambda *a, **k: pytest.fail("a kernel ran"))
    from grpo_kernels.kernels import triton_rows

    for name in ("forward_rows", "forward_rows_sampled"):
        monkeypatch.setattr(triton_rows, name, lambda *a, **k: pytest.fail("a kernel ran"))
    logits, targets, _ = sampling_batch(1, torch.float32)
    b, t = targets.shape
    hidden, weight = torch.randn(b, t, 4), torch.randn(SAMPLING_V, 4)
    bad = [
        (dict(top_k=-2), ValueError, "top_k"), (dict(top_k=2.0), TypeError, "top_k"), (dict(top_k=True), TypeError, "top_k"),
        (dict(top_p=0.0), ValueError, "top_p"), (dict(top_p=1.5), ValueError, "top_p"),
        (dict(top_p=float("nan")), ValueError, "top_p"), (dict(top_p="0.9"), TypeError, "top_p"),
        (dict(temperature=torch.ones(b + 1)), ValueError, "temperature"),
        (dict(temperature=torch.ones(b, t + 1)), ValueError, "temperature"),
        (dict(temperature=torch.ones(b, dtype=torch.int64)), TypeError, "temperature"),
        (dict(temperature=torch.tensor([1.0, 0.0, 1.0])), ValueError, "temperature"),
        (dict(temperature=torch.tensor([1.0, -2.0, 1.0])), ValueError, "temperature"),
        (dict(temperature=torch.tensor([1.0, float("inf"), 1.0])), ValueError, "temperature"),
        (dict(temperature=torch.tensor([1.0, float("nan"), 1.0])), ValueError, "temperature"),
        (dict(temperature=torch.tensor([1.0, 1e-39, 1.0])), ValueError, "temperature"),
        (dict(temperature=torch.ones(b, device="meta")), ValueError, "temperature"),
        (dict(return_sum_probs_sq="yes"), TypeError, "return_sum_probs_sq"),
    ]
    for kw, error, name in bad:
        calls = [lambda: gk.token_logprobs(logits, targets, backend=backend, **kw),
                 lambda: gk.fused_linear_token_logprobs(hidden, weight, targets, backend=backend, **kw)]
        if "return_sum_probs_sq" not in kw:
            calls += [lambda: gk.grpo_loss(logits, targets.clamp(min=0), torch.ones(b), backend=backend, **kw),
                      lambda: gk.fused_linear_grpo_loss(hidden, weight, targets.clamp(min=0), torch.ones(b), backend=backend, **kw)]
        for call in calls:
            with pytest.raises(error, match=name):
                call()


@pytest.mark.parametrize("backend", BACKENDS)
def test_return_order_is_contract_v4(backend):
    logits, targets, _ = sampling_batch(2, torch.float32)
    logits, targets = logits.to(DEVICE), targets.to(DEVICE)
    logp = gk.token_logprobs(logits, targets, backend=backend)
    assert isinstance(logp, torch.Tensor)
    lp, sq = gk.token_logprobs(logits, targets, return_sum_probs_sq=True, backend=backend)
    lp2, ent, sq2 = gk.token_logprobs(logits, targets, return_entropy=True, return_sum_probs_sq=True, backend=backend)
    assert torch.equal(lp, logp) and torch.equal(lp2, logp) and torch.equal(sq, sq2)
    assert_close64(sq, sampled_logprobs64(logits.cpu(), targets.cpu())[2], what="sum_sq of the plain softmax")
    assert_close64(ent, sampled_logprobs64(logits.cpu(), targets.cpu())[1], what="entropy", scale=5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("function", ["grpo_loss", "fused_linear_grpo_loss"])
def test_loss_leaves_tokens_outside_the_kept_set_out(backend, function):
    """Under top_k / top_p a token outside the kept set (current, old or reference log-prob -inf) leaves the
    loss as if masked: the loss, the gradient and the metrics are those of the masked batch, nothing is
    NaN or inf, its logits get no gradient, and sampling/outside_kept_set is its share."""
    g = torch.Generator().manual_seed(4)
    b, t, h = 3, 4, 6
    hidden, weight = torch.randn(b, t, h, generator=g), torch.randn(SAMPLING_V, h, generator=g) * 2
    logits = hidden @ weight.t()
    ids = logits.argmax(-1)  # always kept
    ids[0, 1], ids[1, 3] = logits[0, 1].argmin(), logits[1, 3].argmin()  # outside the current kept set
    adv = torch.randn(b, generator=g)
    mask = torch.ones(b, t)
    mask[0, 3] = 0
    old = torch.randn(b, t, generator=g) * 0.05 - 2
    old[2, 1] = -math.inf  # outside the old policy's kept set
    ref = torch.randn(b, t, generator=g) * 0.05 - 2
    ref[1, 2] = -math.inf
    kw = dict(top_k=6, top_p=0.9, temperature=0.8, beta=0.04, loss_type="grpo")
    current = sampled_logprobs64(logits, ids, 0.8, 6, 0.9)[0]
    outside = (torch.isinf(current) | torch.isinf(old) | torch.isinf(ref)) & (mask != 0)
    assert outside.sum() >= 3 and (~outside & (mask != 0)).sum() >= 3, "the case must leave some tokens out, not all"

    def run(masked, **extra):
        leaves = [z.clone().to(DEVICE).requires_grad_() for z in ((logits,) if function == "grpo_loss" else (hidden, weight))]
        fn = getattr(gk, function)
        m = torch.where(outside, 0.0, mask) if masked else mask
        o, r = (torch.where(outside, -2.0, old), torch.where(outside, -2.0, ref)) if masked else (old, ref)
        out = fn(*leaves, ids.to(DEVICE), adv.to(DEVICE), m.to(DEVICE), old_logps=o.to(DEVICE), ref_logps=r.to(DEVICE),
                 backend=backend, **kw, **extra)
        out.loss.backward()
        return out, [leaf.grad for leaf in leaves]

    out, grads = run(False)
    expected, expected_grads = run(True)
    assert torch.isfinite(out.loss) and all(torch.isfinite(gr).all() for gr in grads)
    assert_close64(out.loss, expected.loss.double(), what="loss")
    for gr, eg in zip(grads, expected_grads):
        assert_close64(gr, eg.double(), scale=grad_scale(torch.float32, eg.double()), what="gradient")
    if function == "grpo_loss":
        assert grads[0][outside.to(DEVICE)].abs().max() == 0, "a token outside the kept set sends no gradient"
    share = out.metrics.pop("sampling/outside_kept_set")
    assert share.item() == pytest.approx(outside.sum().item() / mask.sum().item())
    assert set(out.metrics) == set(expected.metrics) - {"sampling/outside_kept_set"}
    for name, value in expected.metrics.items():
        if name != "sampling/outside_kept_set":
            assert_close64(out.metrics[name], value.double(), what=name)
    per_token = out.per_token_logps.cpu()
    assert torch.equal(torch.isinf(per_token), torch.isinf(current) & (mask != 0)), "per_token_logps keeps the -inf"
