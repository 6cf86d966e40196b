"""Row kernels: log-prob, entropy and their gradient for every row of a [B, T, V] logits tensor.

Two implementations with the same two functions, ``forward_rows`` and ``backward_rows``:
``triton_rows`` (fused Triton kernels) and ``torch_rows`` (chunked PyTorch, the memory-lean path for
machines without a GPU). ``grpo_kernels.autograd`` binds either to autograd.
"""
