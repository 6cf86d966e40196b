"""benchmarks/: the harness's agreement check and skips, the pytest plugin on sets without a case,
and the trainer-step benchmark's registry and tables (no timing is asserted anywhere here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import _harness as H  # noqa: E402
from benchmarks import trainer_step as TS  # noqa: E402

CPU = torch.device("cpu")


@pytest.mark.parametrize("op, H_", [("token_logprobs", None), ("grpo_loss", None), ("fused_linear_grpo_loss", 32),
                                     ("fused_linear_token_logprobs", 32)])
@pytest.mark.parametrize("pass_", ["fwd", "fwd+bwd"])
def test_torch_backend_agrees_with_the_reference(op, H_, pass_):
    case = H.Case(op, "torch", 64, 257, "fp32", pass_, T=16, H=H_, rounds=1)
    result = H.check_agreement(case, CPU)
    assert result["ok"], H.format_agreement(case, result)
    expected = {n for n in H.OUTPUTS[op] if pass_ == "fwd+bwd" or not n.startswith("grad")}
    assert set(result["outputs"]) == expected


def test_compare_catches_an_error_a_nan_and_passes_rounding():
    torch.manual_seed(0)
    e = {"logp": -torch.rand(4, 8, dtype=torch.float64) * 10, "loss": torch.tensor(0.3, dtype=torch.float64)}
    close = {k: (v * (1 + 1e-7)).float() for k, v in e.items()}
    assert all(o["ok"] for o in H.compare(close, e, "fp32").values())
    off = dict(close, logp=close["logp"] + 1e-3)
    assert not H.compare(off, e, "fp32")["logp"]["ok"]
    assert H.compare(off, e, "bf16")["logp"]["ok"]  # 1e-3 is within one bf16 rounding of magnitudes ~10
    nan = dict(close, loss=torch.tensor(float("nan")))
    assert not H.compare(nan, e, "bf16")["loss"]["ok"]


def test_check_case_caps_the_logits_and_keeps_the_rest():
    case = H.Case("fused_linear_grpo_loss", "torch", 16384, 151936, "bf16", "fwd+bwd", T=1024, H=4096)
    small = H.check_case(case, CPU)
    assert small.N * small.V <= H.CHECK_ELEMENTS["cpu"] and small.N % small.T == 0
    assert (small.op, small.impl, small.V, small.H, small.dtype, small.pass_) == (case.op, case.impl, case.V, case.H,
                                                                                  case.dtype, case.pass_)


def test_a_shape_too_large_for_the_device_is_unavailable():
    case = H.Case("token_logprobs", "reference", 2**24, 151936, "fp32", "fwd", T=1024)
    with pytest.raises(H.Unavailable, match="too large"):
        H.build(case, CPU)


def test_unknown_set_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown benchmark set 'nope'.*cpu, gpu, smoke"):
        H.cases("nope", "cpu")


@pytest.mark.timeout(300)
def test_a_set_without_a_case_skips_with_the_reason():
    """The regression of issue 26: an empty parametrisation crashed the session (INTERNALERROR).
    (An unknown set name takes the same path, with the ValueError's message as the reason.)"""
    reason = "has no fused_linear_token_logprobs case on cpu"
    env = {**os.environ, "GRPO_BENCH_SET": "cpu", "GRPO_BENCH_IMPLS": "reference", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "pytest", "benchmarks/bench_fused_linear_logprobs.py", "--benchmark-only",
                           "-q", "-p", "no:cacheprovider", "-rs"], cwd=ROOT, env=env, capture_output=True, text=True)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "INTERNALERROR" not in out and "1 skipped" in out and reason in out, out


def test_trainer_step_registry_and_tables():
    assert {"ours", "ours-reference", "trl", "trl+patch", "ours+vllm"} <= set(TS.SIDES)
    reason = TS.SIDES["ours+vllm"].unavailable()
    assert reason is None or "VLLMRollout" in reason or "vllm" in reason
    phases = {"generation": 1.0, "scoring": 0.1, "logps": 0.5, "loss+backward": 2.0, "optimizer": 0.4}
    records = []
    for rnd in range(3):
        for side, scale in (("ours", 1.0), ("trl", 1.5 + rnd)):  # trl: 1.5, 2.5, 3.5 x ours -> median 2.5
            step = 4.0 * scale * (1 + rnd)
            records.append({"side": side, "round": rnd, "step_s": step, "step_peak_rss_mib": 1000.0 * scale,
                            "phases": TS.phases_with_other(step, {k: v * scale for k, v in phases.items()}),
                            "completion_tokens": 128})
    records.append({"side": "trl+patch", "round": 0, "error": "exit 1: boom"})
    rows = {r["side"]: r for r in TS.summarise(records)}
    assert rows["ours"]["time_ratio"] == 1.0 and rows["trl"]["time_ratio"] == pytest.approx(2.5)
    assert rows["trl"]["rss_ratio"] == pytest.approx(2.5) and rows["trl+patch"]["error"] == "exit 1: boom"
    assert rows["ours"]["phases"]["other"] == pytest.approx(8.0 - 4.0)  # median step 8 s, phases 4 s
    cond = {"date": "2026-01-01", "cpu_model": "Test CPU", "cpu_count": 2, "torch_threads": 2, "side_threads": 1,
            "torch": "2.x", "transformers": "5.x", "trl": "1.x", "dtype": "fp32 weights", "rounds": 3,
            "process_per_side": True}
    md = TS.markdown("tiny", TS.summarise(records), cond, {"ours+vllm": "no vllm"})
    assert "| ours | 8.00 s | 1.00× | 1,000 MiB | 1.00× | 1.00 s (12%)" in md
    assert "| trl+patch | failed: exit 1: boom |" in md and "| ours+vllm | skipped: no vllm |" in md
