"""``grpo_loss``: reference, torch; triton and Liger-Kernel on CUDA (cases: benchmarks/kernels.py)."""

OP = "grpo_loss"


def test_grpo_loss(run_case, case):
    run_case(case)
