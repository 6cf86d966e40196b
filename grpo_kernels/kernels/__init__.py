"""Row kernels: log-prob, entropy and their gradient for every row of a [B, T, V] logits tensor.

Two implementations with the same three launchers, ``forward_rows``, ``backward_rows`` and (Triton
only) ``grpo_forward_rows``: ``triton_rows`` (fused Triton kernels) and ``torch_rows`` (chunked
PyTorch, the memory-lean path for machines without a GPU). ``grpo_kernels.backends`` wraps each in a
``RowBackend``; ``grpo_kernels.autograd`` binds a backend to autograd. ``triton_ops`` registers the
Triton launchers as ``torch.library`` custom ops, which the Triton backend calls while torch.compile traces.
"""
