"""``fused_linear_grpo_loss``: reference, torch, Liger-Kernel, TRL's head; triton on CUDA (cases: benchmarks/kernels.py)."""

OP = "fused_linear_grpo_loss"


def test_fused_linear_grpo_loss(run_case, case):
    run_case(case)
