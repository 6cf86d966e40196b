"""grpo_loss on the fused kernels (Triton interpreter on CPU, and the torch path) against float64.

Every option of the contract is on in at least one case, with each loss type, in fp32 and bf16,
with an empty sequence in the batch; values, gradients and metrics are checked, and the backends
are checked against each other.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, assert_close64
from grpo_cases import OPTION_CASES, build_kwargs, make_batch
from spec64 import grpo64

import grpo_kernels as gk
from grpo_kernels import reference as R

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]


def to_device(kw: dict) -> dict:
    return {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


def run_loss(logits, ids, advantages, mask, backend, **kw):
    x = logits.detach().clone().to(DEVICE).requires_grad_()
    out = gk.grpo_loss(x, ids.to(DEVICE), advantages.to(DEVICE), mask.to(DEVICE), backend=backend, **to_device(kw))
    out.loss.backward()
    return out, x.grad


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
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


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
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


@pytest.mark.parametrize("backend", ["triton", "torch"])
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


@pytest.mark.parametrize("backend", ["triton", "torch"])
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
        for loss_type in LOSS_TYPES:
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


@pytest.mark.parametrize("backend", ["triton", "torch"])
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
