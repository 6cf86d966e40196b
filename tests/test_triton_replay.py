"""grpo_kernels/kernels/triton_replay.py: sampling-mask replay from hidden states and from logits, forward and
backward, against a float64 restatement written here (full logits, the log-softmax over each kept set, float64
autograd), on tiny awkward shapes through the Triton interpreter; d weight is deterministic and zero off the
kept ids; every kernel compiles for sm_90a without spills.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import List, Optional

import pytest
import torch
from helpers import DEVICE, assert_close64, poison_, poison_allocations

from grpo_kernels.kernels import triton_replay

# Tiny tiles: sets and runs of equal ids span several blocks of entries, H several tiles.
TINY = dict(BLOCK_E=4, BLOCK_H=16, BLOCK_K=4, BLOCK_R=2, BLOCK_HG=16)


@pytest.fixture
def tiny_blocks(monkeypatch):
    monkeypatch.setattr(triton_replay, "BLOCKS_OVERRIDE", TINY)


def _dev(t):
    return t.to(DEVICE) if isinstance(t, torch.Tensor) else t


def _cpu(t):
    return None if t is None else t.cpu()


# The launchers on DEVICE (inputs made on the CPU from seeded generators), their outputs back on the CPU.
def linear_forward(*args):
    return tuple(map(_cpu, triton_replay.replay_linear_forward(*map(_dev, args))))


def linear_backward(*args):
    return tuple(map(_cpu, triton_replay.replay_linear_backward(*map(_dev, args))))


def rows_forward(*args):
    return tuple(map(_cpu, triton_replay.replay_rows_forward(*map(_dev, args))))


def rows_backward(logits: torch.Tensor, *args) -> torch.Tensor:
    """``replay_rows_backward`` into ``out`` (the last argument, on DEVICE; may be ``logits``); returns it on the
    CPU."""
    *rest, out = args
    triton_replay.replay_rows_backward(logits, *map(_dev, rest), out)
    return out.cpu()


# ----------------------------------------------------------------------------------------------------------
# the float64 restatement
# ----------------------------------------------------------------------------------------------------------
def make_sets(sizes: List[int], vocab: int, gen: torch.Generator, outside=()):
    """Kept sets of the given sizes (distinct random ids each), targets in their set but for the rows in
    ``outside`` (and the empty sets), and the CSR (token_ids int64 [K], offsets int64 [N + 1])."""
    sets, targets = [], []
    for i, k in enumerate(sizes):
        perm = torch.randperm(vocab, generator=gen)
        s = perm[:k].tolist()
        sets.append(s)
        if k == 0 or i in outside:
            targets.append(int(perm[k]) if k < vocab else 0)
        else:
            targets.append(s[int(torch.randint(k, (1,), generator=gen))])
    token_ids = torch.tensor([j for s in sets for j in s], dtype=torch.int64)
    offsets = torch.zeros(len(sizes) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(sizes, dtype=torch.int64).cumsum(0)
    return sets, torch.tensor(targets, dtype=torch.int64), token_ids, offsets


def transform64(x: torch.Tensor, temperature, softcap: Optional[float], logit_scale: float) -> torch.Tensor:
    """z of raw float64 logits [N, V]; a -inf logit stays -inf (the contract), capped or not."""
    y = x * logit_scale
    if softcap is not None:
        y = softcap * torch.tanh(y / softcap)
    t = temperature.double()[:, None] if isinstance(temperature, torch.Tensor) else temperature
    return torch.where(x == float("-inf"), float("-inf"), y / t)


def replay64(z: torch.Tensor, sets, targets: torch.Tensor):
    """(logp, entropy, sum_sq, lse) float64 [N] over each row's kept set, written per row: the entries
    whose z is -inf take no part; an empty set (or all -inf) gives -inf, -inf, 0, 0."""
    logp, ent, sq, lse = [], [], [], []
    ninf = torch.tensor(float("-inf"), dtype=torch.float64)
    zero = torch.zeros((), dtype=torch.float64)
    for i, s in enumerate(sets):
        zs = z[i, torch.tensor(s, dtype=torch.long)] if s else z.new_zeros(0)
        finite = [j for j, v in zip(s, zs.detach().tolist()) if v != float("-inf")]
        if not finite:
            logp.append(ninf), ent.append(zero), sq.append(zero), lse.append(ninf)
            continue
        zf = z[i, torch.tensor(finite, dtype=torch.long)]
        lse_i = torch.logsumexp(zf, 0)
        lp = zf - lse_i
        p = lp.exp()
        t = int(targets[i])
        logp.append(lp[finite.index(t)] if t in finite else ninf)
        ent.append(lse_i - (p * zf).sum())  # H = lse - sum p z
        sq.append((p * p).sum())
        lse.append(lse_i)
    return torch.stack(logp), torch.stack(ent), torch.stack(sq), torch.stack(lse)


def upstream(n: int, logp64: torch.Tensor, gen: torch.Generator):
    """Random incoming gradients of logp and entropy; 0 on rows whose logp is -inf (what the caller passes)."""
    g = torch.randn(n, generator=gen, dtype=torch.float64)
    g = torch.where(torch.isinf(logp64.detach()), 0.0, g)
    e = torch.randn(n, generator=gen, dtype=torch.float64)
    return g, e


def loss64(logp, ent, g, e):
    lp = torch.where(g != 0, logp, 0.0)  # a -inf logp has g = 0 and no gradient
    return (g * lp).sum() + (e * ent).sum()


# ----------------------------------------------------------------------------------------------------------
# from hidden states
# ----------------------------------------------------------------------------------------------------------
LINEAR_CASES = [
    # (dtype, V, H, sizes, outside, temperature ("rows": a tensor), softcap, logit_scale, bias)
    (torch.float32, 37, 40, [1, 0, 37, 2, 5, 3, 8], (3,), 0.7, None, 1.0, True),
    (torch.bfloat16, 130, 24, [3, 1, 0, 130, 9, 2], (4,), "rows", 5.0, 0.8, False),
    (torch.float32, 130, 24, [2, 17, 1, 0, 6], (), "rows", None, 1.3, True),
]


def _linear_inputs(dtype, V, H, sizes, outside, temperature, seed):
    gen = torch.Generator().manual_seed(seed)
    sets, targets, token_ids, offsets = make_sets(sizes, V, gen, outside)
    n = len(sizes)
    hidden = torch.randn(n, H, generator=gen).to(dtype)
    weight = (torch.randn(V, H, generator=gen) * 0.4).to(dtype)
    bias = (torch.randn(V, generator=gen) * 0.5).to(dtype)
    if temperature == "rows":
        temperature = (torch.rand(n, generator=gen) + 0.5).float()
    return sets, targets, token_ids, offsets, hidden, weight, bias, temperature, gen


@pytest.mark.parametrize("case", LINEAR_CASES, ids=["fp32-bias", "bf16-rowsT-softcap", "fp32-rowsT-scale"])
@pytest.mark.parametrize("blocks", ["tiny", "default"])
def test_linear_forward_backward_match_float64(case, blocks, monkeypatch):
    dtype, V, H, sizes, outside, temperature, softcap, scale, with_bias = case
    if blocks == "tiny":
        monkeypatch.setattr(triton_replay, "BLOCKS_OVERRIDE", TINY)
    poison_allocations(monkeypatch)
    sets, targets, token_ids, offsets, hidden, weight, bias, temperature, gen = _linear_inputs(
        dtype, V, H, sizes, outside, temperature, seed=len(sizes) + V)
    bias = bias if with_bias else None
    n = len(sizes)

    h64 = hidden.double().requires_grad_()
    w64 = weight.double().requires_grad_()
    b64 = bias.double().requires_grad_() if with_bias else None
    x64 = h64 @ w64.T + (b64 if with_bias else 0.0)
    ref = replay64(transform64(x64, temperature, softcap, scale), sets, targets)
    g, e = upstream(n, ref[0], gen)
    wrt = [h64, w64] + ([b64] if with_bias else [])
    grads64 = torch.autograd.grad(loss64(ref[0], ref[1], g, e), wrt)

    out = linear_forward(hidden, weight, bias, targets, token_ids, offsets, temperature, softcap, scale, True, True)
    for a, r, what in zip(out, ref, ("logp", "entropy", "sum_sq", "lse")):
        assert a.dtype == torch.float32 and a.shape == (n,)
        assert_close64(a, r, torch.float32, what=what)  # fp32 sums of exact products: fp32-level even from bf16
    logp, entropy, _, lse = out
    d_hidden, d_weight, d_bias = linear_backward(hidden, weight, bias, targets, token_ids, offsets, lse, entropy,
                                                 g.float(), e.float(), temperature, softcap, scale, True, True, True)
    assert d_hidden.dtype == hidden.dtype and d_weight.dtype == weight.dtype
    assert_close64(d_hidden, grads64[0], dtype, what="d_hidden")
    assert_close64(d_weight, grads64[1], dtype, what="d_weight")
    kept = torch.zeros(V, dtype=torch.bool)
    kept[token_ids] = True
    assert (d_weight[~kept] == 0).all(), "d_weight must be exactly zero off the kept ids"
    if with_bias:
        assert d_bias.dtype == bias.dtype
        assert_close64(d_bias, grads64[2], dtype, what="d_bias")
        assert (d_bias[~kept] == 0).all()
    else:
        assert d_bias is None


@pytest.mark.parametrize("which", ["logp", "entropy", "none"])
def test_linear_one_incoming_gradient_and_outputs_not_asked(which, tiny_blocks, monkeypatch):
    """grad_logp or grad_entropy None counts as 0; entropy / sum_sq not asked are zeros; a gradient not
    needed is None."""
    poison_allocations(monkeypatch)
    sets, targets, token_ids, offsets, hidden, weight, bias, _, gen = _linear_inputs(
        torch.float32, 37, 24, [4, 1, 0, 9, 2], (0,), 1.0, seed=11)
    h64 = hidden.double().requires_grad_()
    w64 = weight.double().requires_grad_()
    ref = replay64(transform64(h64 @ w64.T + bias.double(), 1.1, None, 1.0), sets, targets)
    g, e = upstream(5, ref[0], gen)
    g = g if which == "logp" else torch.zeros_like(g)
    e = e if which == "entropy" else torch.zeros_like(e)
    logp, entropy, sum_sq, lse = linear_forward(hidden, weight, bias, targets, token_ids, offsets, 1.1, None, 1.0,
                                                False, False)
    assert_close64(logp, ref[0], what="logp")
    assert_close64(lse, ref[3], what="lse")
    assert torch.equal(entropy, torch.zeros(5)) and torch.equal(sum_sq, torch.zeros(5))
    if which == "entropy":  # the backward needs the entropy: ask for it
        entropy = linear_forward(hidden, weight, bias, targets, token_ids, offsets, 1.1, None, 1.0, True, False)[1]
    d_hidden, d_weight, d_bias = linear_backward(
        hidden, weight, bias, targets, token_ids, offsets, lse, entropy,
        g.float() if which == "logp" else None, e.float() if which == "entropy" else None,
        1.1, None, 1.0, True, which != "none", False)
    assert d_bias is None
    if which == "none":
        assert d_weight is None and torch.equal(d_hidden, torch.zeros_like(hidden))
        return
    gh, gw = torch.autograd.grad(loss64(ref[0], ref[1], g, e), [h64, w64])
    assert_close64(d_hidden, gh, what="d_hidden")
    assert_close64(d_weight, gw, what="d_weight")


def test_linear_weight_grad_is_deterministic_and_sums_shared_ids(tiny_blocks):
    """Many rows keep the same few ids (runs of up to 9 entries, several blocks deep): d weight has the same
    bits on two runs, and equals the float64 sum."""
    gen = torch.Generator().manual_seed(5)
    V, H, n = 13, 40, 9
    sets = [[3, 7, 1], [7], [7, 3], [0, 7, 12, 3, 5], [7, 3], [], [3], [7, 1, 3], list(range(V))]
    targets = torch.tensor([7, 7, 3, 12, 2, 0, 3, 1, 4])
    token_ids = torch.tensor([j for s in sets for j in s])
    offsets = torch.tensor([0] + [len(s) for s in sets]).cumsum(0)
    hidden = torch.randn(n, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * 0.3
    bias = torch.randn(V, generator=gen) * 0.3
    h64, w64, b64 = (t.double().requires_grad_() for t in (hidden, weight, bias))
    ref = replay64(transform64(h64 @ w64.T + b64, 0.9, 20.0, 1.0), sets, targets)
    g, e = upstream(n, ref[0], gen)
    grads64 = torch.autograd.grad(loss64(ref[0], ref[1], g, e), [h64, w64, b64])
    logp, entropy, _, lse = linear_forward(hidden, weight, bias, targets, token_ids, offsets, 0.9, 20.0, 1.0, True,
                                           False)
    runs = [linear_backward(hidden, weight, bias, targets, token_ids, offsets, lse, entropy, g.float(), e.float(), 0.9,
                            20.0, 1.0, True, True, True) for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    for a, r, what in zip(runs[0], grads64, ("d_hidden", "d_weight", "d_bias")):
        assert_close64(a, r, what=what)


def test_linear_weight_grad_zero_off_the_kept_ids_and_int32_ids(tiny_blocks):
    gen = torch.Generator().manual_seed(6)
    V, H = 130, 24
    sets, targets, token_ids, offsets = make_sets([2, 1, 5, 0, 3], V, gen)
    hidden, weight = torch.randn(5, H, generator=gen), torch.randn(V, H, generator=gen) * 0.3
    logp, entropy, _, lse = linear_forward(hidden, weight, None, targets, token_ids.int(), offsets, 1.0, None, 1.0,
                                           True, False)
    d_hidden, d_weight, _ = linear_backward(hidden, weight, None, targets, token_ids.int(), offsets, lse, entropy,
                                            torch.ones(5), torch.ones(5), 1.0, None, 1.0, False, True, True)
    assert d_hidden is None
    kept = torch.zeros(V, dtype=torch.bool)
    kept[token_ids] = True
    assert (d_weight[~kept] == 0).all()
    shared = torch.tensor([j for s in sets if len(s) > 1 for j in s])  # (a one-token set has p = 1: no gradient)
    assert (d_weight[shared] != 0).all()
    ref = linear_forward(hidden, weight, None, targets, token_ids, offsets, 1.0, None, 1.0, True, False)
    assert all(torch.equal(a, b) for a, b in zip((logp, entropy, lse), (ref[0], ref[1], ref[3])))


def test_no_kept_entries_and_no_rows():
    """K = 0 (every set empty): lse = logp = -inf, entropy = sum_sq = 0, zero gradients; N = 0: empty outputs."""
    hidden, weight = torch.randn(3, 8), torch.randn(11, 8)
    empty_ids, offsets = torch.zeros(0, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    targets = torch.tensor([1, 2, 3])
    logp, entropy, sum_sq, lse = linear_forward(hidden, weight, None, targets, empty_ids, offsets, 1.0, None, 1.0,
                                                True, True)
    assert torch.isinf(logp).all() and (logp < 0).all() and torch.equal(lse, logp)
    assert torch.equal(entropy, torch.zeros(3)) and torch.equal(sum_sq, torch.zeros(3))
    d_hidden, d_weight, _ = linear_backward(hidden, weight, None, targets, empty_ids, offsets, lse, entropy,
                                            torch.zeros(3), torch.ones(3), 1.0, None, 1.0, True, True, False)
    assert torch.equal(d_hidden, torch.zeros_like(hidden)) and torch.equal(d_weight, torch.zeros_like(weight))
    logits = torch.randn(3, 11, device=DEVICE)
    out = rows_backward(logits, targets, empty_ids, offsets, lse, entropy, None, torch.ones(3), 1.0, None, 1.0,
                        poison_(torch.empty_like(logits)))
    assert torch.equal(out, torch.zeros_like(out))
    none = rows_forward(logits[:0], targets[:0], empty_ids, offsets[:1], 1.0, None, 1.0, True, True)
    assert all(t.shape == (0,) for t in none)


# ----------------------------------------------------------------------------------------------------------
# from logits
# ----------------------------------------------------------------------------------------------------------
ROWS_CASES = [
    # (dtype, V, sizes, outside, temperature, softcap, logit_scale)
    (torch.float32, 37, [1, 0, 37, 2, 5, 3, 8], (3,), 0.7, None, 1.0),
    (torch.bfloat16, 130, [3, 1, 0, 130, 9, 2], (4,), "rows", 5.0, 0.8),
    (torch.float32, 130, [2, 17, 1, 0, 6, 130], (), "rows", 30.0, 1.0),
]


@pytest.mark.parametrize("case", ROWS_CASES, ids=["fp32", "bf16-rowsT-softcap", "fp32-rowsT-softcap"])
@pytest.mark.parametrize("in_place", [False, True])
def test_rows_forward_backward_match_float64(case, in_place, tiny_blocks, monkeypatch):
    """Strided rows (a slice of a wider buffer), kept -inf logits (one of them a target), poisoned outputs;
    ``out`` a fresh NaN buffer or the logits themselves."""
    dtype, V, sizes, outside, temperature, softcap, scale = case
    poison_allocations(monkeypatch)
    gen = torch.Generator().manual_seed(V + len(sizes))
    sets, targets, token_ids, offsets = make_sets(sizes, V, gen, outside)
    n = len(sizes)
    wide = (torch.randn(n, V + 5, generator=gen) * 2.0).to(dtype)
    logits = wide[:, 2:V + 2]  # row stride V + 5, not 16-byte aligned
    # a kept -inf logit that is not the target (row 4), and a target whose logit is -inf (row 0)
    other = [j for j in sets[4] if j != int(targets[4])][0]
    logits[4, other] = float("-inf")
    logits[0, int(targets[0])] = float("-inf")
    if temperature == "rows":
        temperature = (torch.rand(n, generator=gen) + 0.5).float()

    x64 = logits.double().requires_grad_()
    ref = replay64(transform64(x64, temperature, softcap, scale), sets, targets)
    g, e = upstream(n, ref[0], gen)
    (grad64,) = torch.autograd.grad(loss64(ref[0], ref[1], g, e), [x64])
    grad64 = torch.where(torch.isinf(logits.double()), 0.0, grad64)  # (0, not autograd's 0 * inf of the cap)

    logits = logits.to(DEVICE)
    out = rows_forward(logits, targets, token_ids, offsets, temperature, softcap, scale, True, True)
    for a, r, what in zip(out, ref, ("logp", "entropy", "sum_sq", "lse")):
        assert_close64(a, r, torch.float32, what=what)
    assert out[0][0] == float("-inf")
    logp, entropy, _, lse = out
    out_buffer = logits if in_place else poison_(torch.empty(n, V, dtype=dtype, device=DEVICE))
    grad_out = rows_backward(logits, targets, token_ids, offsets, lse, entropy, g.float(), e.float(), temperature,
                             softcap, scale, out_buffer)
    assert grad_out.dtype == dtype
    assert_close64(grad_out, grad64, dtype, what="d_logits")
    kept = torch.zeros(n, V, dtype=torch.bool)
    for i, s in enumerate(sets):
        kept[i, s] = True
    assert (grad_out[~kept] == 0).all(), "the gradient must be exactly zero off the kept entries"


def test_rows_confident_target_gradient_error_is_the_rounding_of_lse(tiny_blocks):
    """A target at 1 - p = 1.8e-5: ``g (1 - p)`` from ``one_minus_exp(z_t - lse)`` is off by no more than the
    rounding of the fp32 ``lse`` the contract hands the backward (``|lse| 2^-24`` a few times), far below
    what ``1 - p`` rounded to fp32 after ``exp`` would cost a smaller gap."""
    logits = torch.tensor([[12.0, -2.0, 0.0, 1.0, -1.0]])
    ids, offsets, targets = torch.tensor([0, 1, 3]), torch.tensor([0, 3]), torch.tensor([0])
    logp, entropy, _, lse = rows_forward(logits, targets, ids, offsets, 1.0, None, 1.0, True, False)
    out = rows_backward(logits.to(DEVICE), targets, ids, offsets, lse, entropy, torch.ones(1), None, 1.0, None, 1.0,
                        poison_(torch.empty(1, 5, device=DEVICE)))
    x64 = logits.double().requires_grad_()
    ref = replay64(x64, [[0, 1, 3]], targets)
    (grad64,) = torch.autograd.grad(ref[0].sum(), [x64])
    assert_close64(logp, ref[0].detach(), what="logp")
    assert abs(out[0, 0].item() - grad64[0, 0].item()) <= 4 * 2.0**-24 * abs(lse.item())
    assert_close64(out, grad64, what="d_logits")


def test_rows_nan_logit_keeps_its_row_nan_and_no_other(tiny_blocks):
    """A NaN kept logit (row 1; row 2's target) makes its row's outputs and gradient NaN, and leaves the other
    row exact."""
    gen = torch.Generator().manual_seed(9)
    sets, targets, token_ids, offsets = make_sets([5, 6, 3], 37, gen)
    logits = torch.randn(3, 37, generator=gen)
    logits[1, sets[1][2]] = float("nan")
    targets[2] = sets[2][1]
    logits[2, sets[2][1]] = float("nan")  # the target itself
    out = rows_forward(logits, targets, token_ids, offsets, 1.0, None, 1.0, True, True)
    ref = replay64(transform64(logits.double(), 1.0, None, 1.0), sets, targets)
    for a, r in zip(out, ref):
        assert torch.isnan(a[1:]).all()
        assert_close64(a[0], r[0])
    grad = rows_backward(logits.to(DEVICE), targets, token_ids, offsets, out[3], out[1], torch.ones(3), torch.ones(3),
                         1.0, None, 1.0, poison_(torch.empty(3, 37, device=DEVICE)))
    assert torch.isnan(grad[1, sets[1]]).all() and torch.isnan(grad[2, sets[2]]).all()
    assert not torch.isnan(grad[0]).any()


# ----------------------------------------------------------------------------------------------------------
# ahead-of-time compilation for sm_90a (GPU readiness without a GPU)
# ----------------------------------------------------------------------------------------------------------
_COMPILE = r"""
import json
import os
import tempfile
import torch
from grpo_kernels.kernels import triton_replay as tr
from tools import aot
meta = dict(device="meta")
out = []
n, v, h, k = 4096, 151936, 4096, 32768
for dtype in (torch.bfloat16, torch.float32):
    hidden, weight = torch.empty(n, h, dtype=dtype, **meta), torch.empty(v, h, dtype=dtype, **meta)
    bias, logits = torch.empty(v, dtype=dtype, **meta), torch.empty(n, v, dtype=dtype, **meta)
    row = lambda: torch.empty(n, dtype=torch.float32, **meta)
    csr = dict(targets=torch.empty(n, dtype=torch.int64, **meta), token_ids=torch.empty(k, dtype=torch.int64, **meta),
               offsets=torch.empty(n + 1, dtype=torch.int64, **meta))
    t = dict(temperature=row(), softcap=30.0, logit_scale=1.0)
    calls = [
        (tr.replay_linear_forward, dict(hidden=hidden, weight=weight, bias=bias, **csr, **t, with_entropy=True,
                                        with_sum_sq=True)),
        (tr.replay_linear_backward, dict(hidden=hidden, weight=weight, bias=bias, **csr, lse=row(), entropy=row(),
                                         grad_logp=row(), grad_entropy=row(), **t, needs_hidden_grad=True,
                                         needs_weight_grad=True, needs_bias_grad=True)),
        (tr.replay_rows_forward, dict(logits=logits, **csr, temperature=0.7, softcap=None, logit_scale=1.0,
                                      with_entropy=True, with_sum_sq=False)),
        (tr.replay_rows_backward, dict(logits=logits, **csr, lse=row(), entropy=row(), grad_logp=row(),
                                       grad_entropy=None, temperature=0.7, softcap=None, logit_scale=1.0,
                                       out=torch.empty_like(logits))),
    ]
    for fn, kwargs in calls:
        for launch in aot.capture_launches(tr, fn, **kwargs):
            args, options = aot.launch_spec(launch)
            ck, *_ = aot.compile_kernel(launch.kernel, args, launch.constexpr_names, 90, options)
            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, "k.cubin")
                with open(path, "wb") as f:
                    f.write(ck.asm["cubin"])
                usage = aot.resource_usage(path)
            out.append(dict(launcher=fn.__name__, kernel=launch.kernel.__name__, dtype=str(dtype),
                            regs=usage.get("REG", -1), local=usage.get("LOCAL", -1), stack=usage.get("STACK", -1),
                            ptx_local=ck.asm["ptx"].count(".local"), warps=options.get("num_warps")))
print(json.dumps(out))
"""


@pytest.mark.timeout(900)
def test_replay_kernels_compile_for_sm90_without_spills():
    """Every kernel the four launchers make compiles for sm_90a (bf16 and fp32, V = 151,936, H = 4,096, a
    temperature per row and a cap) with no spills (no local memory in the PTX, none and no stack in the cubin)."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=850,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if proc.returncode != 0 and "Unsupported" in proc.stderr:
        pytest.skip("cannot compile for CUDA targets here")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {r["kernel"] for r in results} == {"replay_entries_kernel", "replay_stats_kernel",
                                              "replay_hidden_grad_kernel", "replay_weight_grad_kernel",
                                              "replay_scatter_kernel"}
    for r in results:
        assert r["ptx_local"] == 0 and r["local"] == 0 and r["stack"] == 0, r
        assert 0 < r["regs"] and r["regs"] * r["warps"] * 32 <= 65536, r  # a CTA fits one SM's register file
