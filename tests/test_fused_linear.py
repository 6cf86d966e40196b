"""fused_linear_token_logprobs / fused_linear_grpo_loss against float64, on both kernel backends.

Gradients w.r.t. hidden, weight and bias; fp32 and bf16; every loss type; chunk sizes that do and
do not divide the number of tokens; tied embeddings; a frozen head.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, assert_close64
from spec64 import grpo64, logprobs64

import grpo_kernels as gk
from grpo_kernels import autograd as ga

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


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
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


@pytest.mark.parametrize("backend", ["triton", "torch"])
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


@pytest.mark.parametrize("backend", ["triton", "torch"])
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


@pytest.mark.parametrize("backend", ["triton", "torch"])
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
    from benchmarks.profiling import cpu_peak_extra_bytes

    def peak_extra(n_tokens, fn):
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(1, n_tokens, 32, generator=g, requires_grad=True)
        weight = torch.randn(2000, 32, generator=g, requires_grad=True)
        ids = torch.randint(0, 2000, (1, n_tokens), generator=g)
        adv = torch.randn(1, generator=g)
        return cpu_peak_extra_bytes(lambda: fn(hidden, weight, ids, adv).loss.backward())[0]

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
from grpo_cases import OPTION_CASES, build_kwargs  # noqa: E402

from grpo_kernels.kernels import torch_rows  # noqa: E402


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


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
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
