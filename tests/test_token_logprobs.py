"""token_logprobs on the Triton kernel (interpreter on CPU) and the memory-lean torch path.

Values and gradients of both outputs against the float64 spec, for every logits dtype, awkward
vocabulary sizes (1, a prime, not a multiple of any block), temperatures, strided views, ignored
rows, -inf entries, NaN rows and confident predictions.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, assert_close64, poison_
from spec64 import logprobs64

import grpo_kernels as gk
from grpo_kernels import backends

BACKENDS = ["triton", "torch"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (B, T, V): V = 1, a prime near 1,000, 32,003 and 65,536 + 3; fewer rows where V is large.
SHAPES = [(3, 5, 1), (3, 7, 997), (2, 3, 32003), (1, 3, 65539)]


def grad_scale(dtype: torch.dtype, expected: torch.Tensor) -> float:
    """Absolute-error scale for a gradient: fp32's p = exp(z - lse) carries an absolute error of about
    ulp(max |z|), so its floor is relative to the largest entry; a 16-bit gradient is dominated by
    its own per-element rounding (rtol), with a tiny floor for values near zero."""
    return (0.1 if dtype == torch.float32 else 1e-3) * expected.abs().max().item()


def check_against_spec(logits, targets, temperature, backend, dtype, seed=0):
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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_float64(backend, dtype, shape, temperature):
    b, t, v = shape
    g = torch.Generator().manual_seed(v + int(temperature * 10))
    logits = (torch.randn(b, t, v, generator=g) * 4).to(dtype).to(DEVICE)
    targets = torch.randint(0, v, (b, t), generator=g).to(DEVICE)
    check_against_spec(logits, targets, temperature, backend, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
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


@pytest.mark.parametrize("backend", BACKENDS)
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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_negative_infinity_entries(backend, dtype):
    """Padded vocabulary entries (-inf) are fine: finite values, zero gradient there."""
    g = torch.Generator().manual_seed(7)
    v = 300
    logits = (torch.randn(2, 3, v, generator=g) * 2).to(dtype).to(DEVICE)
    logits[..., 250:] = float("-inf")
    logits[0, 0, :100] = float("-inf")
    targets = torch.randint(100, 250, (2, 3), generator=g).to(DEVICE)
    logp, entropy, grad = check_against_spec(logits, targets, 1.0, backend, dtype)
    assert torch.isfinite(logp).all() and torch.isfinite(entropy).all()
    assert grad[..., 250:].abs().max() == 0


@pytest.mark.parametrize("backend", BACKENDS)
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


@pytest.mark.parametrize("backend", BACKENDS)
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_any_leading_shape_and_int32_ids(backend):
    g = torch.Generator().manual_seed(13)
    logits = torch.randn(2, 3, 4, 33, generator=g).to(DEVICE)
    targets = torch.randint(0, 33, (2, 3, 4), generator=g, dtype=torch.int32).to(DEVICE)
    logp = gk.token_logprobs(logits, targets, backend=backend)
    assert logp.shape == (2, 3, 4)
    assert_close64(logp, logprobs64(logits.cpu(), targets.cpu().long())[0], what="logp", scale=5)
    flat = gk.token_logprobs(logits.reshape(-1, 33), targets.reshape(-1), backend=backend)
    assert torch.equal(flat.view(2, 3, 4), logp)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_agree_and_outputs_are_fully_written(backend, monkeypatch):
    """Outputs are allocated with torch.empty: poison that allocation so a row the kernel skips shows up."""
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return poison_(t) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: poisoned_empty(t.shape, dtype=kw.get("dtype", t.dtype), device=t.device))
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


@pytest.mark.parametrize("backend", BACKENDS)
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
    check_against_spec(logits, targets.to(DEVICE), 0.7, "triton", dtype)
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
