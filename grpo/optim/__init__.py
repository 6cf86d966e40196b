"""The fused fp32-master-weight AdamW steps behind the trainer's optimizer (``grpo.precision.adamw``, their
one user): one pass per element that reads the 16-bit gradient, updates the fp32 master and moments and
writes the rounded 16-bit weight. ``master_adamw``: the contract both steps share (and its argument checks);
``cpu_adamw``: the CPU's (``cpu_adamw.cpp``, compiled on first use, bitwise torch's fused AdamW on the
masters); ``triton_adamw``: CUDA's (a Triton kernel, torch's AdamW to fp32 rounding).
"""
