"""``token_logprobs``: reference, torch; triton, Liger-Kernel and quack on CUDA (cases: benchmarks/kernels.py)."""

OP = "token_logprobs"


def test_token_logprobs(run_case, case):
    run_case(case)
