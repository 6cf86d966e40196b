"""``token_logprobs``: reference vs torch (vs triton and Liger-Kernel on CUDA), time and peak memory.

Cases come from ``benchmarks/_harness.py`` (``cpu_cases`` / ``gpu_cases``); see conftest.py.
"""

OP = "token_logprobs"


def test_token_logprobs(run_case, case):
    run_case(case)
