"""grpo_kernels/kernels/triton_rows.py: the epilogue equals the objective, and the row kernels compile ahead of time for sm_80 and sm_90a (GPU readiness without a GPU).

Triton's NVIDIA backend needs no driver: ``triton.compile(ASTSource(...), target=GPUTarget("cuda",
cc, 32))`` runs LLVM and the ``ptxas`` shipped in Triton's wheel. ``tools/aot.py`` (a CI tool)
captures the exact launch ``forward_rows`` / ``backward_rows`` make (meta tensors, so nothing is
allocated), specializes it as Triton's launcher would (16-byte alignment -> ``tt.divisibility``),
compiles it, and reads the cubin back with the wheel's ``cuobjdump``.

Every compilation runs in ONE subprocess (module-scoped fixture) with TRITON_INTERPRET unset:
conftest turns the interpreter on without a GPU, and then ``@triton.jit`` objects are
``InterpretedFunction`` objects that ``triton.compile`` cannot take. A private Triton cache makes
every variant really go through LLVM and ptxas.

Checked for each kernel x arch x logits dtype x vocabulary x flag set the launchers use:
- it compiles;
- no spills: cuobjdump's LOCAL and STACK are 0, and ptxas's own ``-v`` report agrees;
- with 16-byte-aligned rows, the logits are read with 128-bit loads (``LDG.E.128``), one per 16
  bytes of each thread's slice of a block, and the gradient stores of the backward are 128-bit
  (``STG.E.128``), but for one element-wide store: the target's exact term, written once per row.

Run with ``-s`` to see the table; set GRPO_AOT_REPORT=path.json to keep the full report.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import verl_cases as vc
from helpers import DEVICE

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tools/
from tools import aot  # noqa: E402

from grpo_kernels import objective  # noqa: E402
from grpo_kernels.options import GRPOInputs, GRPOOptions  # noqa: E402

VARIANTS = aot.default_variants()
IDS = [v.label for v in VARIANTS]


def test_the_aot_tool_is_not_shipped():
    """The ahead-of-time compile check is a CI tool of the repository (``tools/aot.py``), not a module of
    the installed package."""
    import importlib.util

    assert importlib.util.find_spec("grpo_kernels.kernels.aot") is None


@pytest.fixture(scope="module")
def report():
    rep = aot.compile_in_subprocess(timeout=900)
    if "unsupported" in rep:
        pytest.skip(f"cannot compile for CUDA targets here: {rep['unsupported']}")
    rows = rep["rows"]
    env = rep["env"]
    print(f"\n\nAOT compile: triton {env['triton']}, ptxas {env['ptxas']}, {len(rows)} variants in {rep['seconds']} s")
    print(aot.format_table(rows))
    for r in rep["results"]:
        if r["error"]:
            print(f"  {r['label']}: {r['error'].splitlines()[0]}")
    path = os.environ.get("GRPO_AOT_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(rep, f, indent=1)
    by_label = {r["label"]: r for r in rep["results"]}
    assert set(by_label) == set(IDS), "the subprocess compiled other variants than this test expects"
    return by_label


def _compiled(report, label):
    r = report[label]
    if r["error"]:
        pytest.skip("did not compile: see test_compiles")
    return r


@pytest.mark.parametrize("label", IDS)
def test_compiles(report, label):
    r = report[label]
    assert not r["error"], f"{label} does not compile for sm_{r['arch']}:\n{r['error']}"
    assert r["regs"] > 0 and r["block_v"] > 0


@pytest.mark.parametrize("label", IDS)
def test_specialization_matches_triton_launcher(report, label):
    """The signature compiled here is the one Triton's launcher derives from the same values."""
    r = _compiled(report, label)
    assert not r["specialization_mismatches"], r["specialization_mismatches"]
    if r["row_aligned"]:
        for name in ("logits_ptr", "stride_t", "V"):
            assert name in r["divisible"], f"{name} should carry tt.divisibility=16: {r['divisible']}"


@pytest.mark.parametrize("label", IDS)
def test_no_spills(report, label):
    r = _compiled(report, label)
    assert r["local"] == 0, f"{label}: {r['local']} bytes of local memory (register spills), {r['regs']} registers"
    assert r["stack"] == 0, f"{label}: {r['stack']}-byte stack frame"
    ptxas = r["ptxas"]
    if ptxas:
        assert ptxas.get("spill_stores", 0) == 0 and ptxas.get("spill_loads", 0) == 0, ptxas
        assert ptxas.get("stack", 0) == 0, ptxas
        assert ptxas.get("regs", r["regs"]) == r["regs"], (ptxas, r["regs"])
    if r["metadata_spills"] is not None:  # filled by Triton only when a driver loads the binary
        assert r["metadata_spills"] == 0
    # A CTA must fit one SM's register file (64K 32-bit registers on sm_80 and sm_90).
    assert r["regs"] * r["num_warps"] * 32 <= 65536, (r["regs"], r["num_warps"])


@pytest.mark.parametrize("label", IDS)
def test_vectorized_global_access(report, label):
    r = _compiled(report, label)
    if not r["row_aligned"]:
        pytest.skip(f"V={r['vocab']}: rows are not 16-byte aligned, scalar accesses are expected (reference row)")
    elem = aot.BYTES[r["dtype"]]
    threads = r["num_warps"] * 32
    # 16-byte vectors per thread per block: each thread holds BLOCK_V / threads contiguous elements.
    vectors = r["block_v"] * elem // (threads * 16)
    assert vectors >= 1, f"{label}: BLOCK_V={r['block_v']} gives under 16 bytes per thread"
    ldg, stg = r["ldg"], r["stg"]
    assert ldg.get("128", 0) >= vectors, (
        f"{label}: logits not read with 128-bit loads: LDG widths {ldg}, expected >= {vectors} LDG.E.128"
    )
    if r["dtype"] == "bf16":
        # Only the target logit may be read on its own (16-bit); the block loads are all 128-bit.
        assert ldg.get("16", 0) <= 1, f"{label}: narrow logits loads {ldg}"
    if r["kernel"] == "bwd":
        narrow = {bits: n for bits, n in stg.items() if bits != "128"}
        element_bits = str(8 * elem)
        assert set(narrow) <= {element_bits} and sum(narrow.values()) <= 1, (
            f"{label}: gradient stores not 128-bit (one {element_bits}-bit store for the target allowed): "
            f"STG widths {stg}"
        )
        assert stg.get("128", 0) >= vectors, f"{label}: STG widths {stg}, expected >= {vectors} STG.E.128"


# --------------------------------------------------------------------------------------------
# The Triton epilogue is the one hand-differentiated copy of the objective: its per-token loss,
# ``d loss / d logp``, ``d loss / d entropy``, KL and clip flags must equal ``objective``'s, with the
# derivatives from autograd of ``objective.per_token_loss``.


CASES = {
    "clip": dict(loss_type="dapo", eps_high=0.28),
    "clip_delta_beta": dict(loss_type="grpo", eps_high=0.28, delta=1.4, beta=0.05),
    "bias_corrected_kl": dict(loss_type="bnpo", beta=0.1, use_bias_correction_kl=True),
    "entropy_is_ratio": dict(loss_type="dr_grpo", entropy_coef=0.03, use_is=True),
    "cispo": dict(loss_type="cispo", eps_high=1.25, beta=0.02),
    "sapo": dict(loss_type="sapo", sapo_temperature_pos=0.8, sapo_temperature_neg=1.3, use_is=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_triton_epilogue_equals_autograd_of_the_objective(case):
    from grpo_kernels.kernels import triton_rows

    kw = dict(CASES[case])
    use_is = kw.pop("use_is", False)
    options = GRPOOptions(temperature=0.9, **kw)
    g = torch.Generator().manual_seed(list(CASES).index(case))
    b, t, v = 3, 11, 29
    logits = torch.randn(b, t, v, generator=g) * 2
    ids = torch.randint(0, v, (b, t), generator=g)
    mask = torch.ones(b, t)
    logp_now = torch.log_softmax(logits / options.temperature, -1).gather(-1, ids[..., None])[..., 0]
    # ratios spread over every region (below, inside and above the clip range; above delta / the cap)
    old = logp_now - torch.linspace(-0.7, 0.7, b * t).reshape(b, t)
    ref = logp_now + 0.3 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, t, generator=g)
    is_ratio = torch.rand(b, t, generator=g) + 0.5 if use_is else None
    inputs = GRPOInputs(old_logps=old, ref_logps=ref, is_ratio=is_ratio)
    weights = objective.token_weights(mask, options)

    out = triton_rows.grpo_forward_rows(
        logits=logits.to(DEVICE), targets=ids.to(DEVICE), advantages=adv.to(DEVICE), weights=weights.to(DEVICE),
        old_logps=old.to(DEVICE), ref_logps=ref.to(DEVICE), is_ratio=None if is_ratio is None else is_ratio.to(DEVICE),
        temperature=options.temperature, ignore_index=-100, eps_low=options.eps_low, eps_high=options.eps_high,
        delta=options.delta, beta=options.beta, entropy_coef=options.entropy_coef, loss_type=options.loss_type,
        use_bias_correction_kl=options.use_bias_correction_kl, sapo_temperature_pos=options.sapo_temperature_pos,
        sapo_temperature_neg=options.sapo_temperature_neg,
    )
    loss_k, logp_k, ent_k, _, _, coef_logp_k, coef_ent_k, kl_k, clip_k = (x.cpu() for x in out)

    logp = logp_k.clone().requires_grad_()
    ent = ent_k.clone().requires_grad_()
    terms = objective.per_token_loss(logp, ent, adv, mask, inputs, options)
    # the kernel's own entropy term is weighted like the policy term (the library passes entropy_coef=0
    # and adds TRL's token-mean bonus beside the kernel: objective.entropy_weights)
    weighted = terms.loss * weights - options.entropy_coef * ent * weights
    d_logp, d_ent = torch.autograd.grad(weighted.sum(), (logp, ent), allow_unused=True)
    d_ent = torch.zeros_like(ent) if d_ent is None else d_ent

    torch.testing.assert_close(loss_k, weighted.detach(), rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(coef_logp_k, d_logp, rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(coef_ent_k, d_ent, rtol=0, atol=0)
    # exp(d) - d - 1 is formed from O(1) terms: its rounding is absolute, a few ulp of 1
    torch.testing.assert_close(kl_k, terms.kl.detach(), rtol=2e-6, atol=3e-7)
    low, high = objective.clip_flags(terms.ratio.detach(), adv, mask, options)
    expected_clip = high.to(torch.int8) - (low.to(torch.int8) if low is not None else 0) if high is not None else torch.zeros_like(clip_k)
    assert torch.equal(clip_k, expected_clip.to(torch.int8))
    if options.loss_type in ("dapo", "cispo"):
        assert (clip_k != 0).any(), "the case must exercise a clip region"


# --------------------------------------------------------------------------------------------------
# the Triton epilogue's verl terms (grpo_loss_fwd_kernel): loss, d loss / d logp, KL and clip flags
# against autograd of the registered objective (as tests/test_objective.py for TRL's)
# --------------------------------------------------------------------------------------------------
EPILOGUE_CASES = {
    "vanilla_low_var_kl": dict(loss_mode="vanilla", kl_loss_type="low_var_kl", beta=0.1, delta=1.6),
    # a clip range wider than e^20, A > 0 at log r = 25: the clamp's zero derivative shows
    "vanilla_wide_clamp": dict(loss_mode="vanilla", kl_loss_type="k2", beta=0.0, eps_high=1e9, far_positive=True),
    "vanilla_k3+_is": dict(loss_mode="vanilla", kl_loss_type="k3+", beta=0.1, eps_high=0.28, use_is=True),
    "gpg_k1_on_policy": dict(loss_mode="gpg", kl_loss_type="k1", beta=0.05, on_policy=True),
    "cispo_abs": dict(loss_mode="cispo", kl_loss_type="abs", beta=0.05, eps_low=1.0, eps_high=0.3),
    "cispo_abs+": dict(loss_mode="cispo", kl_loss_type="abs+", beta=0.05, eps_low=0.1, eps_high=0.2),
    "sapo_k2_kl_apart": dict(loss_mode="sapo", kl_loss_type="k2", beta=0.2, sapo_temperature_pos=0.8,
                             sapo_temperature_neg=1.3, loss_agg_mode="token-sum", use_is=True),
    "sapo_on_policy_mse+": dict(loss_mode="sapo", kl_loss_type="mse+", beta=0.2, on_policy=True),
    "dppo_tv_k1+": dict(loss_mode="dppo_tv", kl_loss_type="k1+", beta=0.1, eps_low=0.02, eps_high=0.03, delta=1.2),
    "dppo_kl_low_var_kl+_is": dict(loss_mode="dppo_kl", kl_loss_type="low_var_kl+", beta=0.1, eps_low=0.002,
                                   eps_high=0.003, delta=1.2, use_is=True),
    "dppo_kl_default_cap": dict(loss_mode="dppo_kl", kl_loss_type="kl", beta=0.1, eps_low=0.002, eps_high=0.003),
    "dro_k3": dict(loss_mode="dro", kl_loss_type="k3", beta=0.1, dro_beta=0.7, entropy_coef=0.03),
    "dro_on_policy": dict(loss_mode="dro", kl_loss_type="kl+", beta=0.1, dro_beta=0.7, on_policy=True),
}


@pytest.mark.parametrize("case", list(EPILOGUE_CASES))
def test_triton_epilogue_verl_terms_equal_autograd_of_the_objective(case):
    from grpo_kernels.kernels import triton_rows

    kw = dict(EPILOGUE_CASES[case])
    use_is, on_policy = kw.pop("use_is", False), kw.pop("on_policy", False)
    far_positive = kw.pop("far_positive", False)
    options = GRPOOptions(temperature=0.9, **kw)
    g = torch.Generator().manual_seed(5000 + list(EPILOGUE_CASES).index(case))
    b, t, v = 3, 11, 29
    logits = torch.randn(b, t, v, generator=g) * 2
    ids = torch.randint(0, v, (b, t), generator=g)
    logits[2, 5, ids[2, 5]] = -80.0  # a token of log-prob about -90: an old log-prob 25 above it is one
    mask = torch.ones(b, t)
    logp_now = torch.log_softmax(logits / options.temperature, -1).gather(-1, ids[..., None])[..., 0]
    # ratios over every region (below, inside, above the clip range; above the cap; beyond the +-20
    # clamp), old log-probs <= 0
    old = (logp_now - torch.linspace(-0.7, 0.7, b * t).reshape(b, t)).clamp(max=-1e-3)
    old[2, 4] = logp_now[2, 4] - 25.0
    old[2, 5] = logp_now[2, 5] + 25.0
    ref = logp_now + 0.3 * torch.randn(b, t, generator=g)
    ref[1, 3] = logp_now[1, 3] + 30.0  # beyond low_var_kl's clamps on both sides
    ref[1, 4] = logp_now[1, 4] - 25.0
    adv = torch.randn(b, t, generator=g)
    adv[2, 4], adv[2, 5] = (1.0, -1.0) if far_positive else (-1.0, 1.0)
    is_ratio = torch.rand(b, t, generator=g) + 0.5 if use_is else None
    old_in = None if on_policy else old
    inputs = GRPOInputs(old_logps=old_in, ref_logps=ref, is_ratio=is_ratio)
    sequences = objective.Sequences(mask, None)
    weights = objective.token_weights(mask, options, None, sequences)
    kl_weights = objective.regulariser_weights(mask, options, inputs, sequences)
    apart = not torch.equal(kl_weights, weights)
    assert apart == (case == "sapo_k2_kl_apart")

    out = triton_rows.grpo_forward_rows(
        logits=logits.to(DEVICE), targets=ids.to(DEVICE), advantages=adv.to(DEVICE), weights=weights.to(DEVICE),
        old_logps=None if old_in is None else old_in.to(DEVICE), ref_logps=ref.to(DEVICE),
        is_ratio=None if is_ratio is None else is_ratio.to(DEVICE), temperature=options.temperature, ignore_index=-100,
        eps_low=options.eps_low, eps_high=options.eps_high, delta=options.delta, beta=options.beta,
        entropy_coef=options.entropy_coef, loss_type=options.loss_type, sapo_temperature_pos=options.sapo_temperature_pos,
        sapo_temperature_neg=options.sapo_temperature_neg, loss_mode=options.loss_mode,
        kl_loss_type=options.kl_loss_type, dro_beta=0.0 if options.dro_beta is None else options.dro_beta,
        kl_weights=kl_weights.to(DEVICE) if apart else None,
    )
    loss_k, logp_k, ent_k, _, _, coef_logp_k, coef_ent_k, kl_k, clip_k = (x.cpu() for x in out)

    logp = logp_k.clone().requires_grad_()
    ent = ent_k.clone().requires_grad_()
    terms = objective.policy_terms(logp, ent, adv, mask, inputs, options)
    # verl: the policy term by its weights, beta * KL by loss_agg_mode's; the kernel's own entropy term
    # is weighted like the policy term (the library passes entropy_coef=0 and adds verl's bonus beside it)
    weighted = terms.loss * weights + options.beta * terms.kl * kl_weights - options.entropy_coef * ent * weights
    d_logp, d_ent = torch.autograd.grad(weighted.sum(), (logp, ent), allow_unused=True)
    d_ent = torch.zeros_like(ent) if d_ent is None else d_ent

    assert torch.isfinite(loss_k).all() and torch.isfinite(coef_logp_k).all()
    torch.testing.assert_close(loss_k, weighted.detach(), rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(coef_logp_k, d_logp, rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(coef_ent_k, d_ent, rtol=0, atol=0)
    torch.testing.assert_close(kl_k, terms.kl.detach(), rtol=2e-6, atol=3e-7)
    zero = torch.zeros_like(clip_k)
    expected_clip = ((terms.high.to(torch.int8) if terms.high is not None else zero)
                     - (terms.low.to(torch.int8) if terms.low is not None else zero))
    assert torch.equal(clip_k, expected_clip.to(torch.int8))
    if far_positive:  # the clamped token: value e^20, no gradient through the clamp
        assert loss_k[2, 4] != 0 and coef_logp_k[2, 4] == 0
    elif options.loss_mode in ("vanilla", "dppo_tv", "dppo_kl"):  # the case exercises both flags
        assert (clip_k > 0).any() and (clip_k < 0).any()


def test_triton_launcher_refuses_what_it_has_no_term_for():
    from grpo_kernels.kernels import triton_rows

    x, ids, w = torch.randn(1, 2, 5), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2)
    common = dict(logits=x, targets=ids, advantages=w, weights=w, old_logps=None, ref_logps=w, is_ratio=None,
                  temperature=1.0, ignore_index=-100, eps_low=0.2, eps_high=0.2, delta=None, beta=0.1, entropy_coef=0.0)
    for kw, word in ((dict(loss_mode="gspo"), "loss_mode"), (dict(loss_mode="vanilla", kl_loss_type="full"), "kl_loss_type"),
                     (dict(loss_type="vespo"), "loss_type"), (dict(kl_weights=w), "kl_weights")):
        with pytest.raises(ValueError, match=word):
            triton_rows.grpo_forward_rows(**common, **kw)


# --------------------------------------------------------------------------------------------------
# grpo_loss on the Triton backend: verl's token-local specs fuse (one pass), and equal verl64
# --------------------------------------------------------------------------------------------------
FUSED_CASES = {
    "vanilla_low_var_kl+_far": dict(loss_mode="vanilla", kl_loss_type="low_var_kl+", loss_agg_mode="seq-mean-token-mean"),
    "sapo_k3_entropy": dict(loss_mode="sapo", kl_loss_type="k3", loss_agg_mode="token-mean", tau_pos=0.9, tau_neg=1.2),
    "cispo_abs": dict(loss_mode="cispo", kl_loss_type="abs", clip_ratio_low=1.0, clip_ratio_high=0.3,
                      loss_agg_mode="token-sum"),
    "gpg_k1_global": dict(loss_mode="gpg", kl_loss_type="k1", loss_agg_mode="seq-mean-token-sum-norm", dp_size=2,
                          global_batch_size=5, loss_scale_factor=9),
    "dppo_tv_k2": dict(loss_mode="dppo_tv", kl_loss_type="k2", **vc.MODE_SETTINGS["dppo_tv"]),
    "dppo_kl_k3+_global": dict(loss_mode="dppo_kl", kl_loss_type="k3+", loss_agg_mode="token-mean", dp_size=3,
                               batch_num_tokens=31, **vc.MODE_SETTINGS["dppo_kl"]),
    "dro_mse+_is": dict(loss_mode="dro", kl_loss_type="mse+", loss_agg_mode="seq-mean-token-sum", dro_beta=0.7,
                        is_weights=True),
}


@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_triton_backend_fuses_verl_token_local_specs(case):
    kw = dict(FUSED_CASES[case])
    if kw.pop("is_weights", False):
        kw["rollout_is_weights"] = torch.rand(vc.B, vc.T, generator=torch.Generator().manual_seed(3)) + 0.5
    logits, ids, mask, old, ref, adv = vc.batch(6000 + list(FUSED_CASES).index(case), far=True)
    poisoned = torch.where(mask[..., None] != 0, logits, torch.full((), float("nan")))  # masked: never read
    out, grad = vc.ours(poisoned, ids, adv, mask, backend="triton", old_logps=old, ref_logps=ref, kl_loss_coef=0.1,
                     entropy_coeff=0.02, **kw)
    assert type(out.loss.grad_fn).__name__ == "FusedGRPOLossFunctionBackward"  # the one-pass epilogue
    spec = {"batch_num_tokens": "batch_num_tokens", "rollout_is_weights": "rollout_is_weights"}
    spec_kw = {spec.get(k, k): v for k, v in kw.items() if k != "kl_loss_type"}
    spec_kw = vc.spec_settings(kw["loss_mode"], spec_kw)
    loss64, grad64 = vc.expected(logits, ids, mask, adv, old=old, ref=ref, beta=0.1, entropy_coef=0.02,
                              kl_loss_type=kw["kl_loss_type"], **spec_kw)
    vc.check(out.loss, grad, loss64, grad64)
    assert torch.equal(grad[mask == 0], torch.zeros_like(grad[mask == 0]))
    torch_out, _ = vc.ours(logits, ids, adv, mask, backend="torch", old_logps=old, ref_logps=ref, kl_loss_coef=0.1,
                        entropy_coeff=0.02, **kw)
    assert set(out.metrics) == set(torch_out.metrics)
    for name in out.metrics:
        torch.testing.assert_close(out.metrics[name], torch_out.metrics[name], rtol=1e-5, atol=1e-6, msg=name)


def test_triton_backend_does_not_fuse_verl_batch_level_modes():
    from grpo_kernels import backends

    triton_backend = backends.REGISTRY["triton"]
    assert all(triton_backend.fuses(GRPOOptions(loss_mode=m, dro_beta=0.1))
               for m in ("vanilla", "sapo", "gpg", "cispo", "dppo_tv", "dppo_kl", "dro"))
    assert not any(triton_backend.fuses(GRPOOptions(loss_mode=m)) for m in ("gspo", "clip_cov", "kl_cov", "geo_mean"))
    assert triton_backend.fuses(GRPOOptions(loss_type="dapo")) and not triton_backend.fuses(GRPOOptions(loss_type="vespo"))


# --------------------------------------------------------------------------------------------------
# the sampler's distribution (forward_rows_sampled): the candidate path, the fallback kernel, the kept
# set the backward reads, per-row temperatures; and both sampling kernels compile for sm_90a unspilled
# --------------------------------------------------------------------------------------------------
from grpo_kernels.kernels import torch_rows, triton_rows  # noqa: E402
from helpers import assert_close64  # noqa: E402
from spec64 import sampled_logprobs64  # noqa: E402


def _poisoned_empty(real_empty):
    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7)
    return empty


@pytest.mark.parametrize("capacity", [None, 2], ids=["candidates", "fallback"])
@pytest.mark.parametrize("top_k,top_p", [(5, None), (None, 0.85), (7, 0.6), (30, None)])
def test_sampled_rows_candidates_and_fallback(capacity, top_k, top_p, monkeypatch):
    """Both paths of forward_rows_sampled (the candidates that fit; a scratch of 2 forcing every truncated
    row through sampled_logprobs_fallback_kernel) write every output (poisoned allocations) and agree with
    spec64 and with torch_rows' kept set; top_k = 30 exceeds the slots (no certificate: all candidates)."""
    monkeypatch.setattr(triton_rows, "SAMPLING_CAPACITY_OVERRIDE", capacity)
    monkeypatch.setattr(torch, "empty", _poisoned_empty(torch.empty))
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(2, 3, 45, generator=g) * 2).round() / 4  # ties
    targets = logits.argmax(-1)
    targets[0, 1] = logits[0, 1].argmin()
    targets[1, 2] = -100
    temperature_rows = torch.tensor([[0.7, 0.9, 1.1], [1.3, 0.5, 0.8]], dtype=torch.float64)
    out = triton_rows.forward_rows_sampled(logits.to(DEVICE), targets.to(DEVICE), 1.0, -100, True,
                                           temperature_rows=temperature_rows.to(DEVICE), top_k=top_k, top_p=top_p,
                                           with_sum_sq=True)
    logp, entropy, row_max, log_sum, sum_sq, threshold, tie = (x.cpu() for x in out)
    assert not any(torch.isnan(x).any() for x in (row_max, log_sum, threshold)) and (tie != -7).all()
    logp64, ent64, sq64 = sampled_logprobs64(logits, targets, temperature_rows, top_k, top_p)
    assert torch.equal(torch.isinf(logp), torch.isinf(logp64))
    assert_close64(logp, logp64, scale=5, what="logp")
    assert_close64(entropy, ent64, scale=5, what="entropy")
    assert_close64(sum_sq, sq64, what="sum_sq")
    mine = torch_rows.kept_mask(logits, threshold, tie)
    stats = torch_rows.forward_rows(logits, targets, temperature_rows, -100, True, top_k=top_k, top_p=top_p)
    theirs = torch_rows.kept_mask(logits, stats.threshold, stats.tie_index)
    valid = targets != -100
    assert torch.equal(mine[valid], theirs[valid]), "the two backends' kept sets differ"


def test_sampled_backward_is_the_truncated_distributions(monkeypatch):
    """backward_rows with the kept set: d (logp + H) / d logits of the truncated distribution (0 outside it,
    no log-prob term for a target outside it), per-row temperatures, split over programs as for few rows."""
    monkeypatch.setattr(triton_rows, "SPLITS_OVERRIDE", 3)
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(2, 3, 53, generator=g) * 2
    targets = logits.argmax(-1)
    targets[1, 0] = logits[1, 0].argmin()
    temperature_rows = torch.rand(2, 3, generator=g, dtype=torch.float64) + 0.5
    out = triton_rows.forward_rows_sampled(logits.to(DEVICE), targets.to(DEVICE), 1.0, -100, True,
                                           temperature_rows=temperature_rows.to(DEVICE), top_k=9, top_p=0.8)
    logp, entropy, row_max, log_sum, _, threshold, tie = out
    up = torch.rand(2, 3, generator=g).to(DEVICE)
    grad = triton_rows.backward_rows(logits.to(DEVICE), targets.to(DEVICE), row_max, log_sum, entropy,
                                     torch.where(torch.isfinite(logp), up, 0.0), torch.ones_like(up), 1.0, -100,
                                     torch.empty_like(logits.to(DEVICE)), temperature_rows=temperature_rows.to(DEVICE),
                                     threshold=threshold, tie_index=tie)
    x64 = logits.double().requires_grad_()
    logp64, ent64, _ = sampled_logprobs64(x64, targets, temperature_rows, 9, 0.8)
    (torch.where(torch.isfinite(logp64), logp64, 0.0) * up.cpu().double() + ent64).sum().backward()
    assert torch.isinf(logp64[1, 0])
    assert_close64(grad, x64.grad, scale=0.1 * x64.grad.abs().max().item(), what="d logits")


@pytest.mark.parametrize("splits", [1, 3])
def test_plain_kernels_read_a_temperature_per_row(splits, monkeypatch):
    """The default kernels (forward, its split path, the backward) with temperature_rows: a row's
    outputs are those of its own float temperature, bitwise."""
    monkeypatch.setattr(triton_rows, "SPLITS_OVERRIDE", splits)
    g = torch.Generator().manual_seed(9)
    logits = (torch.randn(2, 2, 67, generator=g) * 3).to(DEVICE)
    targets = torch.randint(0, 67, (2, 2), generator=g).to(DEVICE)
    temps = [[0.7, 1.0], [1.3, 0.45]]
    rows = triton_rows.forward_rows(logits, targets, 1.0, -100, True,
                                    temperature_rows=torch.tensor(temps, dtype=torch.float64, device=DEVICE))
    grad_rows = triton_rows.backward_rows(logits, targets, rows[2], rows[3], rows[1], torch.ones(2, 2, device=DEVICE),
                                          torch.ones(2, 2, device=DEVICE), 1.0, -100, torch.empty_like(logits),
                                          temperature_rows=torch.tensor(temps, dtype=torch.float64, device=DEVICE))
    for i in range(2):
        for j in range(2):
            one = triton_rows.forward_rows(logits[i:i + 1, j:j + 1], targets[i:i + 1, j:j + 1], temps[i][j], -100, True)
            grad_one = triton_rows.backward_rows(logits[i:i + 1, j:j + 1], targets[i:i + 1, j:j + 1], one[2], one[3],
                                                 one[1], torch.ones(1, 1, device=DEVICE), torch.ones(1, 1, device=DEVICE),
                                                 temps[i][j], -100, torch.empty_like(logits[i:i + 1, j:j + 1]))
            for a, b in zip(rows, one):
                assert torch.equal(a[i, j], b[0, 0]), (i, j)
            assert torch.equal(grad_rows[i, j], grad_one[0, 0])


_SAMPLED_COMPILE = r"""
import json, sys
import torch
from tools import aot
from grpo_kernels.kernels import triton_rows
out = []
for dtype in (torch.bfloat16, torch.float32):
    logits = torch.empty(8, 2048, 151936, dtype=dtype, device="meta")
    targets = torch.empty(8, 2048, dtype=torch.int64, device="meta")
    launches = aot.capture_launches(triton_rows, triton_rows.forward_rows_sampled, logits=logits, targets=targets,
                                    temperature=0.7, ignore_index=-100, with_entropy=True, top_k=20, top_p=0.9,
                                    with_sum_sq=True)
    for launch in launches:
        args, options = aot.launch_spec(launch)
        ck, *_ = aot.compile_kernel(launch.kernel, args, launch.constexpr_names, 90, options)
        meta = ck.metadata._asdict() if hasattr(ck.metadata, "_asdict") else dict(ck.metadata)
        out.append(dict(kernel=launch.kernel.__name__, dtype=str(dtype), regs=meta.get("n_regs"),
                        ptx_local=ck.asm["ptx"].count(".local"), warps=options.get("num_warps")))
print(json.dumps(out))
"""


@pytest.mark.timeout(900)
def test_sampling_kernels_compile_for_sm90_without_spills():
    """sampled_logprobs_fwd_kernel and its fallback compile for sm_90a (bf16 and fp32 logits, V = 151,936)
    with no local memory (spills) in the PTX: GPU readiness without a GPU."""
    import subprocess
    import sys

    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", _SAMPLED_COMPILE], env=env, capture_output=True, text=True,
                          timeout=850, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if proc.returncode != 0 and "Unsupported" in proc.stderr:
        pytest.skip("cannot compile for CUDA targets here")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {r["kernel"] for r in results} == {"sampled_logprobs_fwd_kernel", "sampled_logprobs_fallback_kernel"}
    for r in results:
        assert r["ptx_local"] == 0, r
