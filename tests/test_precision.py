"""grpo.precision's AdamW: torch's fused kernel where it exists (fp32 weights and the fp32 masters of
16-bit ones), against an independent float64 AdamW; torch's state-dict format, so that a checkpoint the
foreach optimizer wrote (before the optimizer was fused) loads, stays fused and resumes bit for bit.
(Why 16-bit weights need masters at all: tests/test_lora.py.) Tiny tensors, CPU, a second or two.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import assert_close64, tiny_config

from grpo import precision
from grpo.demo import build_model_and_tokenizer
from grpo.optim import cpu_adamw
from grpo.trainer import make_optimizer, prepare_model

pytestmark = pytest.mark.usefixtures("one_thread")

HYPER = dict(lr=3e-2, betas=(0.9, 0.99), weight_decay=0.1, eps=1e-8)
SHAPES = [(7, 5), (13,), (3, 4, 2)]  # (awkward sizes: no vector width divides them)


def parameters(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64).to(dtype)) for s in SHAPES]


def gradients(steps: int, seed: int = 1) -> list[list[torch.Tensor]]:
    """Fresh gradients for every step, float64 (each optimizer gets them in its parameters' dtype)."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES] for _ in range(steps)]


def run(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], grads: list[list[torch.Tensor]]) -> None:
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.to(p.dtype)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def adamw64(start: list[torch.Tensor], grads: list[list[torch.Tensor]], lr: float, betas, weight_decay: float,
            eps: float) -> list[torch.Tensor]:
    """AdamW in float64, written out (Loshchilov & Hutter 2019, Algorithm 2; torch.optim.AdamW's
    documented update): decay, the two moments, bias corrections, the step."""
    b1, b2 = betas
    x = [t.double().clone() for t in start]
    m = [torch.zeros_like(t) for t in x]
    v = [torch.zeros_like(t) for t in x]
    for k, step_grads in enumerate(grads, start=1):
        for i, g in enumerate(step_grads):
            x[i] = x[i] * (1 - lr * weight_decay)
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            m_hat, v_hat = m[i] / (1 - b1**k), v[i] / (1 - b2**k)
            x[i] = x[i] - lr * m_hat / (v_hat.sqrt() + eps)
    return x


def is_fused(optimizer: torch.optim.Optimizer) -> bool:
    return all(group.get("fused") is True for group in optimizer.param_groups)


# ---------------------------------------------------------------------------- which AdamW
def test_the_trainers_adamw_is_fused_on_cpu_for_fp32_weights_and_for_bf16_masters(tmp_path):
    for dtype, cls in ((torch.float32, torch.optim.AdamW), (torch.bfloat16, precision.MasterWeightAdamW)):
        model, _ = build_model_and_tokenizer(seed=0)
        policy = prepare_model(model.to(dtype), tiny_config(tmp_path), torch.device("cpu"))
        optimizer = make_optimizer(policy, tiny_config(tmp_path))
        assert type(optimizer) is cls and is_fused(optimizer), dtype
        assert all(p.dtype == torch.float32 for g in optimizer.param_groups for p in g["params"])  # (the fused kernel's)


def test_parameters_without_a_fused_kernel_get_the_foreach_path():
    meta = [torch.nn.Parameter(torch.empty(3, device="meta"))]  # (no fused kernel for the meta device)
    assert not precision.fused_supported(meta) and not precision.fused_supported([])
    optimizer = precision.adamw(meta, lr=1e-3)
    assert type(optimizer) is torch.optim.AdamW and not optimizer.param_groups[0]["fused"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_step_matches_float64_adamw(dtype):
    """Five steps with weight decay: the weights (fp32; for bf16 weights their fp32 masters, and the
    weights = the masters rounded) against the float64 recurrence."""
    params, grads = parameters(dtype), gradients(5)
    start = [p.detach().double() for p in params]
    optimizer = precision.adamw(params, **HYPER)
    assert is_fused(optimizer)
    run(optimizer, params, grads)
    want = adamw64(start, [[g.to(dtype).double() for g in gs] for gs in grads], **HYPER)  # (the gradients it was given)
    stepped = optimizer.param_groups[0]["params"]  # fp32: the parameters themselves; bf16: the masters
    for got, expected in zip(stepped, want):
        assert got.dtype == torch.float32
        assert_close64(got, expected, torch.float32, what=str(dtype))
    for p, master in zip(params, stepped):  # the weights are the masters rounded, once
        assert torch.equal(p.detach(), master.detach().to(dtype))
    if dtype == torch.bfloat16:  # the fp32 gradient copies live only during the step
        assert all(master.grad is None for master in stepped)


@pytest.mark.parametrize("fused", [True, False])
def test_masters_step_as_one_torch_call_would_with_fp32_and_gradless_parameters(fused):
    """16-bit weights (fused: in slices, here one; otherwise in buckets through one kept fp32 buffer:
    SHAPES make three), an fp32 weight among them (stepped once, as it is) and one without a gradient
    (not stepped): bit for bit torch's AdamW of the same implementation in one call on fp32 copies given
    the same gradients."""
    params = parameters(torch.bfloat16) + [torch.nn.Parameter(torch.randn(6, dtype=torch.float32))]
    params.insert(1, torch.nn.Parameter(torch.randn(4, 3).to(torch.bfloat16)))  # (never has a gradient)
    plain = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    ours = precision.MasterWeightAdamW(params, fused=fused, **HYPER)
    torchs = torch.optim.AdamW(plain, fused=fused, **HYPER)
    for step_grads in gradients(4):
        grads = step_grads[:1] + [None] + step_grads[1:] + [torch.randn(6, dtype=torch.float64)]
        for p, q, g in zip(params, plain, grads):
            p.grad = None if g is None else g.to(p.dtype)
            q.grad = None if g is None else p.grad.float()
        ours.step()
        torchs.step()
        assert params[-1].grad is not None  # (an fp32 weight keeps its own gradient, as torch's AdamW leaves it)
        ours.zero_grad()
        torchs.zero_grad()
    for p, master, q in zip(params, ours.param_groups[0]["params"], plain):
        assert torch.equal(master, q) and torch.equal(p.detach(), q.detach().to(p.dtype))
    assert torch.equal(params[1].detach().float(), plain[1].detach())  # (never stepped: not even decayed)


@pytest.mark.parametrize("native", [True, False], ids=["one-pass", "slices"])
def test_fused_masters_step_as_torchs_fused_adamw_bitwise(native):
    """The fused path, in one pass (``native``: the CPU kernel) or through torch's ops in slices (a tiny
    ``slice_elements``: parameters several slices long with a ragged last one, small ones sharing a
    slice), two groups (weight decay, and amsgrad with none), a 16-bit
    parameter without a gradient, an fp32 one, torch's AMP attributes (a gradient scale; a found inf,
    which skips the step and its count), and a resume from the state dict mid-run: bit for bit torch's
    fused AdamW on fp32 copies given the same gradients; each step counter counts each step once."""
    g = torch.Generator().manual_seed(3)
    shapes = [(9, 23), (5,), (4, 30), (3,), (200,), (2, 2)]
    dtypes = [torch.bfloat16, torch.bfloat16, torch.float16, torch.bfloat16, torch.bfloat16, torch.float32]
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(d)) for s, d in zip(shapes, dtypes)]
    plain = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    gradless = 3  # (a 16-bit parameter never given a gradient)

    def groups(ps):
        return [{"params": ps[:3], "weight_decay": 0.1}, {"params": ps[3:], "weight_decay": 0.0, "amsgrad": True}]

    def build(ps, like=None):
        optimizer = precision.MasterWeightAdamW(groups(ps), fused=True, **{**HYPER, "weight_decay": 0.0})
        optimizer.slice_elements = 64  # (207 = 3 x 64 + 15, 5 shares the 15's slice; 120 = 64 + 56; 200 = 3 x 64 + 8)
        optimizer.native = native
        return optimizer

    ours, torchs = build(params), torch.optim.AdamW(groups(plain), fused=True, **{**HYPER, "weight_decay": 0.0})
    amp = [None, (2.0, 0.0), (4.0, 1.0), None, None, None]  # (grad_scale, found_inf) per step
    for k, scale in enumerate(amp):
        if k == 3:  # resume: a new optimizer from the state dict, on the weights as they are
            state = copy.deepcopy(ours.state_dict())
            params = [torch.nn.Parameter(p.detach().clone()) for p in params]
            ours = build(params)
            ours.load_state_dict(state)
        for i, (p, q) in enumerate(zip(params, plain)):
            grad = None if i == gradless else torch.randn(p.shape, generator=g).to(p.dtype)
            p.grad, q.grad = grad, None if grad is None else grad.float().clone()  # (the op unscales in place)
        for o in (ours, torchs):
            o.grad_scale, o.found_inf = (None, None) if scale is None else (torch.tensor(scale[0]), torch.tensor(scale[1]))
        ours.step()
        torchs.step()
        ours.zero_grad()
        torchs.zero_grad()
    masters = [m for group in ours.param_groups for m in group["params"]]
    for p, master, q in zip(params, masters, plain):
        assert torch.equal(master, q) and torch.equal(p.detach(), q.detach().to(p.dtype))
        assert master.grad is None
    for master, q in zip(masters, plain):
        mine, theirs = ours.state[master], torchs.state[q]
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert [float(ours.state[m]["step"]) for i, m in enumerate(masters) if i != gradless] == [5.0] * 5  # (6 steps, one skipped)
    assert not ours.state[masters[gradless]] and torch.equal(params[gradless].detach().float(), plain[gradless].detach())


# ---------------------------------------------------------------------------- the state dict and resuming
def old_format(state: dict) -> dict:
    """What ``torch.optim.AdamW`` (foreach, the trainer's optimizer before it was fused) writes for the
    same state: groups without ``fused``, the ``step`` counters as float32 tensors on the CPU."""
    state = copy.deepcopy(state)
    for group in state["param_groups"]:
        group["fused"], group["foreach"] = None, None
    for entry in state["state"].values():
        entry["step"] = entry["step"].detach().to("cpu", torch.float32).clone()
    return state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_foreach_checkpoint_loads_stays_fused_and_resumes_bitwise(dtype):
    grads = gradients(6)
    # the run that wrote the checkpoint, with the optimizer the trainer built before (foreach): its
    # state dict has the format that is on disk
    params = parameters(dtype)
    cls = precision.MasterWeightAdamW if dtype != torch.float32 else torch.optim.AdamW
    before = cls(params, **HYPER)
    run(before, params, grads[:3])
    written = copy.deepcopy(before.state_dict())  # (as read back from disk: no tensor shared with the optimizer)
    assert all(g["fused"] is None and g["foreach"] is None for g in written["param_groups"])
    assert all(s["step"].device.type == "cpu" for s in written["state"].values())
    weights = [p.detach().clone() for p in params]

    def resumed(state: dict) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
        ps = [torch.nn.Parameter(w.clone()) for w in weights]
        optimizer = precision.adamw(ps, **{**HYPER, "lr": 1.0})  # (the checkpoint's lr wins, as torch loads it)
        optimizer.load_state_dict(state)
        return optimizer, ps

    old, old_params = resumed(written)
    assert is_fused(old) and old.param_groups[0]["lr"] == HYPER["lr"]
    for saved, now in zip(written["state"].values(), old.state.values()):  # every value as written
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(now[key].cpu(), saved[key]), key
    # the same state in the fused optimizer's own format resumes the same way, bit for bit
    new, new_params = resumed(copy.deepcopy(old.state_dict()))
    new_format = new.state_dict()
    assert {k for g in new_format["param_groups"] for k in g} == {k for g in written["param_groups"] for k in g}
    assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in new_format["state"].values())
    assert new_format.keys() == written.keys()  # (state, param_groups; master_weights for 16-bit)
    run(old, old_params, grads[3:])
    run(new, new_params, grads[3:])
    for a, b in zip(old_params + old.param_groups[0]["params"], new_params + new.param_groups[0]["params"]):
        assert torch.equal(a, b)
    # and as the foreach run would have continued, to fp32 rounding (fused and foreach differ in the last bit)
    run(before, params, grads[3:])
    for a, b in zip(old.param_groups[0]["params"], before.param_groups[0]["params"]):
        assert_close64(a, b.detach().double(), torch.float32)


def test_the_fused_optimizer_resumes_bitwise_from_its_own_state_dict():
    grads = gradients(6)
    straight_params = parameters(torch.bfloat16)
    straight = precision.adamw(straight_params, **HYPER)
    run(straight, straight_params, grads)

    first_params = parameters(torch.bfloat16)
    first = precision.adamw(first_params, **HYPER)
    run(first, first_params, grads[:3])
    state = copy.deepcopy(first.state_dict())
    second_params = [torch.nn.Parameter(p.detach().clone()) for p in first_params]
    second = precision.adamw(second_params, **HYPER)
    second.load_state_dict(state)
    assert is_fused(second)
    run(second, second_params, grads[3:])
    for a, b in zip(second_params + second.param_groups[0]["params"], straight_params + straight.param_groups[0]["params"]):
        assert torch.equal(a, b)
    assert not any(math.isnan(float(p.detach().double().sum())) for p in second_params)


@pytest.mark.parametrize("first,second", [(True, False), (False, True)], ids=["one-pass-then-slices", "slices-then-one-pass"])
def test_a_checkpoint_resumes_bitwise_across_the_one_pass_and_slice_paths(first, second):
    """Save -> load -> step equals the uninterrupted run bit for bit when the run that wrote the state dict
    and the run that loads it step 16-bit weights on different paths (the format is the same)."""
    grads = gradients(6)

    def build(params, native):
        optimizer = precision.adamw(params, **HYPER)
        optimizer.native = native
        return optimizer

    straight_params = parameters(torch.bfloat16)
    straight = build(straight_params, first)
    run(straight, straight_params, grads)
    params = parameters(torch.bfloat16)
    before = build(params, first)
    run(before, params, grads[:3])
    state = copy.deepcopy(before.state_dict())
    params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    after = build(params, second)
    after.load_state_dict(state)
    run(after, params, grads[3:])
    for a, b in zip(params + after.param_groups[0]["params"], straight_params + straight.param_groups[0]["params"]):
        assert torch.equal(a, b)
    for a, b in zip(after.state.values(), straight.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in ("step", "exp_avg", "exp_avg_sq"))


@pytest.mark.parametrize("compiler", ["no-such-compiler-grpo", "false"], ids=["missing", "failing"])
def test_without_the_cpu_kernel_the_slices_step_and_the_reason_is_logged(monkeypatch, caplog, compiler):
    """No C++ compiler (or one that fails): the 16-bit weights step through torch's ops, with a logged
    reason, and the results are torch's fused AdamW's all the same."""
    monkeypatch.setattr(cpu_adamw, "_state", {})  # (the built library forgotten for this test; restored after)
    monkeypatch.setenv("CXX", compiler)
    params = parameters(torch.bfloat16)
    plain = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    ours = precision.adamw(params, **HYPER)
    torchs = torch.optim.AdamW(plain, fused=True, **HYPER)
    with caplog.at_level("WARNING", logger=cpu_adamw.__name__):
        for step_grads in gradients(2):
            for p, q, g in zip(params, plain, step_grads):
                p.grad = g.to(p.dtype)
                q.grad = p.grad.float()
            ours.step()
            torchs.step()
    assert cpu_adamw.library() is None and compiler in cpu_adamw.unavailable_reason()
    assert sum("the fused CPU master-weight AdamW is unavailable" in r.getMessage() for r in caplog.records) == 1  # (once)
    for p, master, q in zip(params, ours.param_groups[0]["params"], plain):
        assert torch.equal(master, q) and torch.equal(p.detach(), q.detach().to(p.dtype))
