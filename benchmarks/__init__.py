"""Benchmarks: fused GRPO kernels against the plain-PyTorch reference (speed and peak memory).

Run ``pytest benchmarks/ --benchmark-only`` (CPU set without a GPU, GPU set with one), then
``python -m benchmarks.report RESULTS.json``. See ``benchmarks/README.md``.
"""
