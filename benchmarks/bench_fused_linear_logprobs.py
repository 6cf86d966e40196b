"""``fused_linear_token_logprobs`` (log-prob and entropy from hidden states and the lm_head): ours vs
the torch path (vs triton and TRL's fused log-prob head on CUDA), time and peak memory.

Cases come from ``benchmarks/_harness.py`` (``gpu_cases`` / ``smoke_cases``); see conftest.py.
"""

OP = "fused_linear_token_logprobs"


def test_fused_linear_token_logprobs(run_case, case):
    run_case(case)
