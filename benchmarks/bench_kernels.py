"""The kernel cases of the set (``benchmarks/kernels.py``; the set, the check and the timing: ``conftest.py``)."""


def test_kernel(run_case, case):
    run_case(case)
