"""``fused_linear_grpo_loss``: reference vs torch (vs triton and Liger-Kernel on CUDA), time and peak memory.

Cases come from ``benchmarks/_harness.py`` (``cpu_cases`` / ``gpu_cases``); see conftest.py.
"""

OP = "fused_linear_grpo_loss"


def test_fused_linear_grpo_loss(run_case, case):
    run_case(case)
