"""Minimal GRPO trainer built on grpo_kernels."""
