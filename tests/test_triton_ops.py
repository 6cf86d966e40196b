"""torch.compile(fullgraph=True, backend="aot_eager") over the public functions on the Triton path
(CPU tensors in Triton's interpreter, set by conftest) and the torch path (issue 27).

Each compiled call must trace without a graph break (``fullgraph=True`` raises on one, and dynamo's
graph-break counter stays empty), launch our Triton kernels where the backend is Triton (counted at
the kernels: ``backend="auto"`` and ``"triton"`` do not fall back to the torch rows while compiling),
and give the eager call's loss and gradients and the float64 spec's (``tests/spec64.py``). The custom
ops (``grpo_kernels.kernels.triton_ops``) pass ``torch.library.opcheck``.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from helpers import assert_close64, tolerance
from spec64 import grpo64, logprobs64, verl64

import grpo_kernels as gk
from grpo_kernels.kernels import triton_ops, triton_rows

pytestmark = pytest.mark.timeout(600)
B, T, V, H = 2, 5, 13, 8
KERNELS = ("grpo_loss_fwd_kernel", "token_logprobs_fwd_kernel", "token_logprobs_bwd_kernel")


@contextmanager
def count_launches():
    """Launches of each kernel of ``KERNELS`` inside the block, counted by Triton's pre-run hooks."""
    launches = dict.fromkeys(KERNELS, 0)
    hooks = {}
    for name in KERNELS:
        def hook(*args, name=name, **kwargs):
            launches[name] += 1

        hooks[name] = hook
        getattr(triton_rows, name).add_pre_run_hook(hook)
    try:
        yield launches
    finally:
        for name, hook in hooks.items():
            getattr(triton_rows, name).pre_run_hooks.remove(hook)


def compile_and_run(fn, args):
    """(loss, grads, launches per kernel) of ``fn`` compiled whole; a graph break fails the test."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    with count_launches() as launches:
        loss = compiled(*args)
        grads = torch.autograd.grad(loss, args)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    return loss, grads, launches


def check_launches(backend, launches, forward_kernel):
    """Triton (``auto`` runs Triton here: conftest's interpreter) launched its kernels, torch none."""
    if backend == "torch":
        assert sum(launches.values()) == 0, launches
    else:
        assert launches[forward_kernel] > 0 and launches["token_logprobs_bwd_kernel"] > 0, launches


def check_equal(compiled, eager, what):
    """The compiled graph runs the same kernels as the eager call, its O(tokens) maths maybe in another
    order (the fused linear's coefficients come from torch.func while tracing): equal to fp32 rounding."""
    rtol, atol = tolerance(torch.float32)
    scale = float(eager.detach().abs().max())
    torch.testing.assert_close(compiled, eager, rtol=rtol, atol=atol * scale, msg=lambda m: f"{what}: {m}")


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T)
    mask[0, 3:] = 0
    adv = torch.randn(B, generator=g)
    logits = torch.randn(B, T, V, generator=g) * 2
    logp = torch.log_softmax(logits.double(), -1).gather(-1, ids[..., None])[..., 0]
    old = (logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    ref = (logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    is_ratio = torch.rand(B, T, generator=g) + 0.5
    return g, logits, ids, mask, adv, old, ref, is_ratio


def expected_grpo(logits64, ids, adv, mask, kw):
    """The float64 loss of ``kw``: TRL's (grpo64) or, with ``loss_mode``, verl's (verl64)."""
    if "loss_mode" not in kw:
        return grpo64(logits64, ids, adv, mask, **kw)[0]
    m = mask.double()
    logp, ent = logprobs64(logits64, torch.where(mask != 0, ids, -100))
    adv_tok = torch.where(m != 0, adv.double()[:, None].expand(B, T), 0.0)
    return verl64(logp, ent, adv_tok, m, old=kw.get("old_logps"), ref=kw.get("ref_logps"), loss_mode=kw["loss_mode"],
                  loss_agg_mode=kw["loss_agg_mode"], kl_loss_type=kw["kl_loss_type"], beta=kw["beta"],
                  entropy_coef=kw.get("entropy_coef", 0.0))


# (backend, keywords): the fused Triton epilogue (dapo, cispo; verl's vanilla with its KL estimator),
# the Triton row kernel then the shared maths (verl's sequence-level gspo), the torch rows (sapo), and
# the in-place backward
GRPO_CASES = {
    "triton_dapo_old_ref_entropy": ("triton", dict(old=True, ref=True, beta=0.04, entropy_coef=0.01)),
    "auto_cispo_is_ratio": ("auto", dict(old=True, is_ratio=True, loss_type="cispo", eps_high=2.0)),
    "triton_verl_vanilla_low_var_kl": ("triton", dict(old=True, ref=True, loss_mode="vanilla", beta=0.1,
                                                      loss_agg_mode="seq-mean-token-mean", kl_loss_type="low_var_kl",
                                                      entropy_coef=0.01)),
    "triton_verl_gspo_k2": ("triton", dict(old=True, ref=True, loss_mode="gspo", beta=0.1, kl_loss_type="k2",
                                           loss_agg_mode="seq-mean-token-sum")),
    "torch_sapo_ref": ("torch", dict(old=True, ref=True, beta=0.02, loss_type="sapo")),
    "triton_inplace_backward": ("triton", dict(old=True, inplace_backward=True)),
}


def grpo_keywords(flags: dict, old, ref, is_ratio) -> dict:
    kw = {k: v for k, v in flags.items() if k not in ("old", "ref", "is_ratio")}
    for flag, name, value in (("old", "old_logps", old), ("ref", "ref_logps", ref), ("is_ratio", "is_ratio", is_ratio)):
        if flags.get(flag):
            kw[name] = value
    return kw


@pytest.mark.parametrize("case", list(GRPO_CASES))
def test_grpo_loss_compiles_whole(case):
    backend, flags = GRPO_CASES[case]
    _, logits, ids, mask, adv, old, ref, is_ratio = batch(list(GRPO_CASES).index(case))
    kw = grpo_keywords(flags, old, ref, is_ratio)
    scale = torch.nn.Parameter(torch.ones(()))  # the logits come from an op (inplace_backward overwrites them)

    def fn(x, s):
        return gk.grpo_loss(x * s, ids, adv, mask, backend=backend, **kw).loss

    args = (logits.clone().requires_grad_(), scale)
    loss_c, grads_c, launches = compile_and_run(fn, args)
    fused = backend != "torch" and kw.get("loss_mode") != "gspo"  # (gspo: the row kernel, then the shared maths)
    check_launches(backend, launches, "grpo_loss_fwd_kernel" if fused else "token_logprobs_fwd_kernel")
    loss_e = fn(*args)
    grads_e = torch.autograd.grad(loss_e, args)
    check_equal(loss_c, loss_e, "loss")
    for a, e, name in zip(grads_c, grads_e, ("d logits", "d scale")):
        check_equal(a, e, name)

    spec_kw = {k: v for k, v in kw.items() if k != "inplace_backward"}
    x64 = logits.double().requires_grad_()
    loss64 = expected_grpo(x64, ids, adv, mask, spec_kw)
    (grad64,) = torch.autograd.grad(loss64, x64)
    assert torch.isfinite(loss_c) and grads_c[0].abs().sum() > 0
    assert_close64(loss_c, loss64, what="loss")
    assert_close64(grads_c[0], grad64, scale=float(grad64.abs().max()), what="d logits")


@pytest.mark.parametrize("function, backend", [("token_logprobs", "triton"), ("token_logprobs", "torch"),
                                               ("fused_linear_token_logprobs", "triton")])
def test_token_logprobs_compiles_whole(function, backend):
    g, logits, ids, mask, *_ = batch(11)
    ids = torch.where(mask != 0, ids, -100)
    c_logp, c_entropy = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    kw = dict(backend=backend, return_entropy=True, temperature=0.7)

    if function == "token_logprobs":
        args = (logits.clone().requires_grad_(),)
        outputs = lambda x: gk.token_logprobs(x, ids, **kw)  # noqa: E731
        logits64 = lambda x: x.double()  # noqa: E731
    else:
        args = (torch.randn(B, T, H, generator=g, requires_grad=True), torch.randn(V, H, generator=g, requires_grad=True))
        outputs = lambda h, w: gk.fused_linear_token_logprobs(h, w, ids, chunk_size=8, **kw)  # noqa: E731
        logits64 = lambda h, w: h.double() @ w.double().T  # noqa: E731

    def fn(*xs):
        logp, entropy = outputs(*xs)
        return (c_logp * logp).sum() + (c_entropy * entropy).sum()

    loss_c, grads_c, launches = compile_and_run(fn, args)
    check_launches(backend, launches, "token_logprobs_fwd_kernel")
    loss_e = fn(*args)
    for a, e in zip((loss_c, *grads_c), (loss_e, *torch.autograd.grad(loss_e, args))):
        check_equal(a, e, function)

    args64 = tuple(x.detach().double().requires_grad_() for x in args)
    logp64, entropy64 = logprobs64(logits64(*args64), ids, temperature=0.7)
    loss64 = (c_logp.double() * logp64).sum() + (c_entropy.double() * entropy64).sum()
    grads64 = torch.autograd.grad(loss64, args64)
    assert_close64(loss_c, loss64, scale=float(loss64.abs()), what="loss")
    for a, e in zip(grads_c, grads64):
        assert a.abs().sum() > 0
        assert_close64(a, e, scale=float(e.abs().max()), what="gradient")


# the gradient formed in the forward (token-local), and the recomputing backward (GSPO)
LINEAR_CASES = {
    "in_forward_dapo_old_ref_entropy": dict(old=True, ref=True, beta=0.04, entropy_coef=0.01),
    "recomputing_gspo": dict(old=True, importance_sampling_level="sequence"),
}


@pytest.mark.parametrize("case", list(LINEAR_CASES))
def test_fused_linear_grpo_loss_compiles_whole(case):
    g, _, ids, mask, adv, old, ref, is_ratio = batch(20 + list(LINEAR_CASES).index(case))
    kw = grpo_keywords(LINEAR_CASES[case], old, ref, is_ratio)
    args = (torch.randn(B, T, H, generator=g, requires_grad=True), torch.randn(V, H, generator=g, requires_grad=True))

    def fn(h, w):
        return gk.fused_linear_grpo_loss(h, w, ids, adv, mask, backend="triton", chunk_size=8, **kw).loss

    loss_c, grads_c, launches = compile_and_run(fn, args)
    check_launches("triton", launches, "token_logprobs_fwd_kernel")
    loss_e = fn(*args)
    grads_e = torch.autograd.grad(loss_e, args)
    check_equal(loss_c, loss_e, "loss")
    for a, e, name in zip(grads_c, grads_e, ("d hidden", "d weight")):
        check_equal(a, e, name)

    h64, w64 = (x.detach().double().requires_grad_() for x in args)
    loss64 = grpo64(h64 @ w64.T, ids, adv, mask, **kw)[0]
    grads64 = torch.autograd.grad(loss64, (h64, w64))
    assert_close64(loss_c, loss64, what="loss")
    for a, e, name in zip(grads_c, grads64, ("d hidden", "d weight")):
        assert a.abs().sum() > 0
        assert_close64(a, e, scale=float(e.abs().max()), what=name)


def test_custom_ops_pass_opcheck():
    """Schema, fake (meta) implementation, and AOT dispatch with dynamic shapes of each op, on tiny rows;
    the in-place backward (``out`` is ``logits``) too."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 17, generator=g)
    ids = torch.randint(0, 17, (2, 3), generator=g)
    ids[0, 1] = -100
    torch.library.opcheck(triton_ops.forward_rows, (logits, ids, 0.7, -100),
                          dict(with_entropy=True, softcap=5.0, logit_scale=1.0))
    _, entropy, row_max, log_sum = triton_ops.forward_rows(logits, ids, 0.7, -100)
    grad_logp, grad_entropy = torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g)
    torch.library.opcheck(triton_ops.backward_rows, (logits, ids, row_max, log_sum, entropy, grad_logp, grad_entropy,
                                                     0.7, -100, torch.full_like(logits, float("nan"))))
    in_place = logits.clone()
    torch.library.opcheck(triton_ops.backward_rows, (in_place, ids, row_max, log_sum, entropy, grad_logp, None,
                                                     0.7, -100, in_place))
    adv, weights, old = torch.randn(2, generator=g), torch.rand(2, 3, generator=g), torch.randn(2, 3, generator=g)
    torch.library.opcheck(triton_ops.grpo_forward_rows, (logits, ids, adv, weights, old, None, None, 0.7, -100, 0.2,
                                                         0.28, None, 0.04, 0.01), dict(loss_type="sapo"))


def test_custom_op_outputs_equal_the_launchers():
    """The ops return the launchers' values (fresh tensors, none aliasing an input); the backward op
    writes every element of ``out`` (poisoned first) as the launcher does."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 17, generator=g)
    ids = torch.randint(0, 17, (2, 3), generator=g)
    ops = triton_ops.forward_rows(logits, ids, 0.7, -100)
    direct = triton_rows.forward_rows(logits, ids, 0.7, -100)
    for a, e in zip(ops, direct):
        assert torch.equal(a, e) and a.data_ptr() not in (logits.data_ptr(), ids.data_ptr())
    _, entropy, row_max, log_sum = direct
    grad_logp = torch.randn(2, 3, generator=g)
    out = torch.full_like(logits, float("nan"))
    assert triton_ops.backward_rows(logits, ids, row_max, log_sum, entropy, grad_logp, None, 0.7, -100, out) is None
    expected = triton_rows.backward_rows(logits, ids, row_max, log_sum, entropy, grad_logp, None, 0.7, -100,
                                         torch.empty_like(logits))
    assert torch.equal(out, expected)


@pytest.mark.parametrize("name", ["forward_rows", "grpo_forward_rows"])
def test_forward_ops_take_the_launchers_signature(name):
    """The forward ops' schemas are inferred from the launchers themselves, so a parameter added to a
    launcher (a typed scalar) is part of its op with no other change: names, order and defaults agree."""
    import inspect

    schema = getattr(torch.ops.grpo_kernels, name).default._schema
    params = inspect.signature(getattr(triton_rows, name)).parameters
    assert [a.name for a in schema.arguments] == list(params)
    for arg in schema.arguments:
        default = params[arg.name].default
        if default is not inspect.Parameter.empty:
            assert arg.has_default_value() and arg.default_value == default, arg.name
