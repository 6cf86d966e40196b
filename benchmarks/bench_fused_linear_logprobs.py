"""``fused_linear_token_logprobs``: torch, TRL's head; triton, Cut Cross-Entropy and verl on CUDA
(cases: benchmarks/kernels.py)."""

OP = "fused_linear_token_logprobs"


def test_fused_linear_token_logprobs(run_case, case):
    run_case(case)
