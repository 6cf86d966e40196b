"""benchmarks/kernels.py: the agreement check, the skips, the sets, the pytest plugin on a set without a
case, and the report of a pytest-benchmark JSON (no timing is asserted anywhere here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import kernels as K  # noqa: E402

CPU = torch.device("cpu")


@pytest.mark.parametrize("op, H_", [("token_logprobs", None), ("grpo_loss", None), ("fused_linear_grpo_loss", 32),
                                     ("fused_linear_token_logprobs", 32)])
@pytest.mark.parametrize("pass_", ["fwd", "fwd+bwd"])
def test_torch_backend_agrees_with_the_reference(op, H_, pass_):
    case = K.Case(op, "torch", 64, 257, "fp32", pass_, T=16, H=H_, rounds=1)
    result = K.check_agreement(case, CPU)
    assert result["ok"], K.format_agreement(case, result)
    outputs = {"token_logprobs": {"logp"}, "grpo_loss": {"loss", "logp"}, "fused_linear_grpo_loss": {"loss"},
               "fused_linear_token_logprobs": {"logp", "entropy"}}[op]
    grads = {"grad_logits"} if op in K.LOGITS_OPS else {"grad_hidden", "grad_weight"}
    assert set(result["outputs"]) == outputs | (grads if pass_ == "fwd+bwd" else set())


def test_a_chunk_size_is_ours_at_that_chunk_and_agrees():
    case = K.Case("fused_linear_grpo_loss", "torch", 64, 300, "fp32", "fwd+bwd", T=32, H=16, chunk=7)
    assert "@7" in case.id and K.check_agreement(case, CPU)["ok"]


@pytest.mark.parametrize("op", K.LINEAR_OPS)
def test_a_frozen_head_has_no_weight_gradient_and_agrees(op):
    case = K.Case(op, "torch", 64, 300, "fp32", "fwd+bwd", T=32, H=16, frozen=True)
    result = K.check_agreement(case, CPU)
    assert case.id.endswith("-frozen") and result["ok"], K.format_agreement(case, result)
    assert "grad_hidden" in result["outputs"] and "grad_weight" not in result["outputs"]


def test_the_custom_ops_side_launches_through_torch_ops_and_agrees(monkeypatch):
    # the triton-ops side is CUDA-only in the sets; here its runner runs under the interpreter (tests/conftest.py)
    from grpo_kernels import backends, reference
    from grpo_kernels.kernels import triton_ops

    case = K.Case("grpo_loss", "triton-ops", 16, 33, "fp32", "fwd+bwd", T=8, rounds=1)
    calls, launchers = [], backends.TritonBackend.__dict__["_launchers"]
    for name in ("grpo_forward_rows", "backward_rows"):
        op = getattr(triton_ops, name)
        monkeypatch.setattr(triton_ops, name, lambda *a, _op=op, _name=name, **k: calls.append(_name) or _op(*a, **k))
    x = K.inputs(case, CPU)
    out = K.Runner(case, CPU, x, K.MAKERS["triton-ops"](case, x))()
    assert calls == ["grpo_forward_rows", "backward_rows"] and backends.TritonBackend.__dict__["_launchers"] is launchers
    y = {**x, "buf": x["buf"].detach().requires_grad_()}
    y["logits"] = y["buf"][:, :-1]
    agreement = K.compare(out, K._grads(case, y, K._ours(case, y, reference)()), "fp32")
    assert set(agreement) == {"loss", "logp", "grad_logits"} and all(o["ok"] for o in agreement.values()), agreement


def test_compare_catches_an_error_a_nan_and_passes_rounding():
    torch.manual_seed(0)
    e = {"logp": -torch.rand(4, 8, dtype=torch.float64) * 10, "loss": torch.tensor(0.3, dtype=torch.float64)}
    close = {k: (v * (1 + 1e-7)).float() for k, v in e.items()}
    assert all(o["ok"] for o in K.compare(close, e, "fp32").values())
    off = dict(close, logp=close["logp"] + 1e-3)
    assert not K.compare(off, e, "fp32")["logp"]["ok"]
    assert K.compare(off, e, "bf16")["logp"]["ok"]  # 1e-3 is within one bf16 rounding of magnitudes ~10
    assert not K.compare(dict(close, loss=torch.tensor(float("nan"))), e, "bf16")["loss"]["ok"]


def test_check_case_caps_the_logits_and_keeps_the_rest():
    case = K.Case("fused_linear_grpo_loss", "torch", 16384, 151936, "bf16", "fwd+bwd", T=1024, H=4096)
    small = K.check_case(case, CPU)
    assert small.N * small.V <= K.CHECK_ELEMENTS["cpu"] and small.N % small.T == 0
    assert (small.op, small.impl, small.V, small.H, small.dtype, small.pass_) == (case.op, case.impl, case.V, case.H,
                                                                                  case.dtype, case.pass_)


def test_cases_that_cannot_run_here_are_unavailable_with_the_reason():
    with pytest.raises(K.Unavailable, match="too large"):
        K.build(K.Case("token_logprobs", "reference", 2**24, 151936, "fp32", "fwd", T=1024), CPU)
    for impl, op in (("cce", "fused_linear_token_logprobs"), ("verl", "fused_linear_token_logprobs"), ("quack", "token_logprobs"),
                     ("triton", "grpo_loss")):
        with pytest.raises(K.Unavailable, match="needs CUDA|not installed"):
            K.build(K.Case(op, impl, 64, 128, "fp32", "fwd", T=32, H=16), CPU)
    with pytest.raises(K.Unavailable, match="has no"):
        K.build(K.Case("grpo_loss", "cce", 64, 128, "fp32", "fwd", T=32), CPU)


def test_sets_order_the_headline_cases_first_and_name_unknown_sets():
    gpu = K.gpu_cases(["reference", "torch", "triton", "trl", "cce", "verl", "quack"], "cuda")
    firsts = [c for c in gpu if c.priority == 0]
    assert {(c.op, c.pass_) for c in firsts} == {("token_logprobs", "fwd"), ("grpo_loss", "fwd+bwd"),
                                                 ("fused_linear_grpo_loss", "fwd+bwd")}
    peers = {(c.impl, c.V, c.pass_) for c in gpu if c.op == "fused_linear_token_logprobs"}
    assert {(i, v, p) for i in ("cce", "verl", "trl", "triton") for v in (32000, 151936) for p in K.PASSES} <= peers
    assert {c.impl for c in gpu if c.op == "token_logprobs"} >= {"quack", "triton"}
    with pytest.raises(ValueError, match="unknown benchmark set 'nope'.*cpu, gpu, smoke"):
        K.cases("nope", "cpu")


@pytest.mark.parametrize("name", ["cpu_cases", "gpu_cases", "smoke_cases"])
def test_run_order_keeps_each_comparison_together_reference_last_cheapest_first(name):
    impls = ["reference", "torch", "triton", "liger", "trl", "cce", "verl", "quack"]
    cases = getattr(K, name)(impls, "cuda" if name == "gpu_cases" else "cpu")
    ordered = K.run_order(cases)
    assert sorted(map(id, ordered)) == sorted(map(id, cases))
    shapes = [K.comparison(c) for c in ordered]
    runs = [s for i, s in enumerate(shapes) if i == 0 or shapes[i - 1] != s]
    assert len(runs) == len(set(runs)), "a comparison's sides are split apart"
    for shape in set(shapes):
        sides = [c for c in ordered if K.comparison(c) == shape]
        if any(c.impl == "reference" for c in sides):
            assert sides[-1].impl == "reference", [c.impl for c in sides]
        assert [c.priority for c in sides if c.impl != "reference"] == sorted(c.priority for c in sides if c.impl != "reference")
    groups = {}
    for c in ordered:
        groups.setdefault(K.comparison(c), []).append(c)
    keys = [(min(c.priority for c in g), sum(c.cost for c in g)) for g in groups.values()]
    assert keys == sorted(keys), "comparisons not by priority, then cheapest first"


@pytest.mark.timeout(300)
def test_a_set_without_a_case_skips_with_the_reason():
    """The regression of issue 26: an empty parametrisation crashed the session (INTERNALERROR)."""
    reason = "has no fused_linear_token_logprobs case on cpu"
    env = {**os.environ, "GRPO_BENCH_SET": "cpu", "GRPO_BENCH_IMPLS": "reference", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "pytest", "benchmarks/bench_kernels.py", "-k", "fused_linear_token_logprobs",
                           "--benchmark-only", "-q", "-p", "no:cacheprovider", "-rs"], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "INTERNALERROR" not in out and "1 skipped" in out and reason in out and "benchmark set: cpu" in out, out


def _bench(impl, n, median, peak, **extra):
    info = {"op": "fused_linear_grpo_loss", "impl": impl, "N": n, "B": n // 512, "T": 512, "V": 32000, "H": 512,
            "dtype": "fp32", "pass": "fwd+bwd", "sweep": True, "device": "cuda", "peak_mem_bytes": peak, **extra}
    return {"name": f"test_x[{impl}-{n}]", "extra_info": info, "stats": {"median": median}}


def test_report_renders_markdown_and_png(tmp_path):
    pytest.importorskip("matplotlib")
    mib = 2**20
    results = [_bench("reference", 2048, 2.0, 1500 * mib, tflops=0.5), _bench("reference", 4096, 4.0, 3000 * mib, tflops=0.5),
               _bench("torch", 2048, 2.5, 150 * mib, tflops=0.6, matmul_fraction=0.4),
               _bench("torch", 4096, 5.0, 158 * mib, tflops=0.6, matmul_fraction=0.4),
               {"stats": {"median": 0.00125}, "extra_info": {"op": "token_logprobs", "impl": "triton", "N": 16384, "V": 151936,
                "H": None, "dtype": "bf16", "pass": "fwd", "peak_mem_bytes": 3 * 2**16, "gbps": 3983.0, "bw_fraction": 0.87}}]
    data = {"machine_info": {"grpo_bench": {"cpu_model": "Test CPU", "cpu_count": 2, "torch": "2.x", "load_1m": 0.5,
                                            "date": "2026-01-01 00:00 UTC", "bench_set": "cpu", "note": "synthetic"}},
            "benchmarks": results, "grpo_memory_checks": K.memory_checks([{**b["extra_info"]} for b in results[:4]]),
            "grpo_skipped": [{"case": "fused_linear_grpo_loss-fwd+bwd-reference-N16384", "reason": "too large"}]}
    path = tmp_path / "cpu-test.json"
    path.write_text(json.dumps(data))
    assert K.main(["report", str(path)]) == 0
    md = (tmp_path / "cpu-test.md").read_text()
    assert "Test CPU" in md and "torch 2.x" in md and "synthetic" in md and "load average (1 min) 0.5" in md
    row = next(line for line in md.splitlines() if line.startswith("| torch | N=4096, V=32000, H=512"))
    assert "5.00 s" in row and "158.0 MiB" in row and "1.25×" in row and "0.053×" in row and "40% of matmul" in row
    assert "PASS" in md and "too large" in md and "## Headline cases" in md and "triton: 1.25 ms, 3983.0 GB/s, 87% of copy" in md
    pngs = sorted(tmp_path.glob("*.png"))
    assert [p.name for p in pngs] == ["cpu-test-fused_linear_grpo_loss-fwdbwd-fp32-V32000-H512.png"]
    assert pngs[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({pngs[0].name})" in md
