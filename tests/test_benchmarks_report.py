"""benchmarks/report.py renders a small synthetic pytest-benchmark JSON into markdown and PNG plots."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

REPORT = Path(__file__).resolve().parents[1] / "benchmarks" / "report.py"


def _load_report():
    spec = importlib.util.spec_from_file_location("benchmarks_report_under_test", REPORT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench(impl, n, median, peak, **extra):
    info = {"op": "fused_linear_grpo_loss", "impl": impl, "N": n, "B": n // 512, "T": 512, "V": 32000, "H": 512,
            "dtype": "fp32", "pass": "fwd+bwd", "sweep": True, "device": "cuda", "peak_mem_bytes": peak,
            "peak_mem_method": "torch.profiler memory events (kineto)", **extra}
    return {"name": f"test_x[{impl}-{n}]", "group": "g", "params": {}, "extra_info": info,
            "stats": {"median": median, "min": median, "max": median, "mean": median, "rounds": 1}}


def _synthetic():
    mib = 2**20
    benchmarks = [
        _bench("reference", 2048, 2.0, 1500 * mib, tflops=0.5),
        _bench("reference", 4096, 4.0, 3000 * mib, tflops=0.5),
        _bench("torch", 2048, 2.5, 150 * mib, tflops=0.6, matmul_fraction=0.4),
        _bench("torch", 4096, 5.0, 158 * mib, tflops=0.6, matmul_fraction=0.4),
        {"name": "test_tl[ref]", "stats": {"median": 0.010}, "extra_info": {
            "op": "token_logprobs", "impl": "reference", "N": 1024, "V": 32000, "H": None, "dtype": "bf16",
            "pass": "fwd", "peak_mem_bytes": 200 * mib, "gbps": 6.5, "bw_fraction": 0.9}},
        {"name": "test_tl[triton]", "stats": {"median": 0.00125}, "extra_info": {
            "op": "token_logprobs", "impl": "triton", "N": 16384, "V": 151936, "H": None, "dtype": "bf16",
            "pass": "fwd", "peak_mem_bytes": 3 * 2**16, "gbps": 3983.0, "bw_fraction": 0.87}},
    ]
    checks = [{"impl": "torch", "dtype": "fp32", "V": 32000, "H": 512,
               "points": [{"N": 2048, "peak_bytes": 150 * mib, "reference_peak_bytes": 1500 * mib, "ratio_to_reference": 0.1},
                          {"N": 4096, "peak_bytes": 158 * mib, "reference_peak_bytes": 3000 * mib, "ratio_to_reference": 158 / 3000}],
               "growth": [{"from_N": 2048, "to_N": 4096, "delta_bytes": 8 * mib, "allowed_bytes": 16 * mib, "ok": True}],
               "ratio_check": {"N": 4096, "ratio": 158 / 3000, "target": 0.125, "ok": True}, "ok": True}]
    return {
        "machine_info": {"grpo_bench": {"cpu_model": "Test CPU", "cpu_count": 2, "torch": "2.x", "triton": "3.x",
                                        "date": "2026-01-01 00:00 UTC", "bench_set": "cpu", "note": "synthetic"}},
        "datetime": "2026-01-01T00:00:00",
        "benchmarks": benchmarks,
        "grpo_memory_checks": checks,
        "grpo_skipped": [{"case": "fused_linear_grpo_loss-fwd+bwd-reference-N16384", "reason": "too large"}],
    }


def test_report_renders_markdown_and_png(tmp_path):
    report = _load_report()
    results = tmp_path / "cpu-test.json"
    results.write_text(json.dumps(_synthetic()))
    assert report.main([str(results)]) == 0

    md = (tmp_path / "cpu-test.md").read_text()
    assert "Test CPU" in md and "torch 2.x" in md and "synthetic" in md
    assert "| impl | shape | dtype | pass | median | peak memory | time / ref | memory / ref |" in md
    # torch at N=4096: 5.0 s vs 4.0 s, 158 MiB vs 3000 MiB
    row = next(line for line in md.splitlines() if line.startswith("| torch | N=4096, V=32000, H=512"))
    assert "5.00 s" in row and "158.0 MiB" in row and "1.25×" in row and "0.053×" in row and "40% of matmul" in row
    assert "90% of copy" in md and "6.5 GB/s" in md
    assert "PASS" in md and "too large" in md
    assert "## Headline cases" in md and "triton: 1.25 ms, 3983.0 GB/s, 87% of copy" in md

    pngs = sorted(tmp_path.glob("*.png"))
    assert [p.name for p in pngs] == ["cpu-test-fused_linear_grpo_loss-fwdbwd-fp32-V32000-H512.png"]
    assert pngs[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"]({pngs[0].name})" in md
