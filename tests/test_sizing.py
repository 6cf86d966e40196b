"""grpo_kernels.sizing: the kernels' own allocation rules, public, defined once.

Each public name is the very object the kernels use (a copy could drift from the rule it restates), and
its numbers are what the kernels allocate: a chunk the fused-linear path takes, the frozen head's tile."""

from __future__ import annotations

import torch

from grpo_kernels import autograd, sizing
from grpo_kernels.kernels import torch_norm, torch_rows


def test_the_public_names_are_the_kernels_own():
    assert sizing.default_chunk_size is autograd.default_chunk_size
    assert sizing.tile_columns is torch_rows.tile_columns
    assert sizing.frozen_head_bytes is torch_rows.frozen_head_bytes
    assert sizing.NORM_BLOCK_ELEMENTS == torch_norm.BLOCK_ELEMENTS
    assert sorted(sizing.__all__) == sorted(["default_chunk_size", "tile_columns", "frozen_head_bytes",
                                             "NORM_BLOCK_ELEMENTS"])


def test_the_numbers_are_the_documented_rules():
    """default_chunk_size's docstring examples (fp32, CPU): V = 32,000, H = 512 -> the 1,024-row cap; a
    4,096-token batch -> 4 chunks of 1,024; V = 151,936, H = 1,024 -> 441 rows (the 256 MiB cap), 1,024
    tokens -> 3 chunks of 352. The frozen head's tile: at least one column, at most V."""
    cpu = torch.device("cpu")
    assert sizing.default_chunk_size(32_000, 512, torch.float32, cpu) == 1024
    assert sizing.default_chunk_size(32_000, 1024, torch.float32, cpu, 4096) == 1024
    assert sizing.default_chunk_size(151_936, 1024, torch.float32, cpu) == 441
    assert sizing.default_chunk_size(151_936, 1024, torch.float32, cpu, 1024) == 352
    for rows, vocab in ((1, 7), (3, 100_000), (10**9, 50)):
        width = sizing.tile_columns(rows, vocab, cpu)
        assert 1 <= width <= vocab
    # the frozen head's bytes: the [n, Vb] blocks (fp32 logits and e) and six [n, H] fp32 accumulators
    n, v, h = 5, 64, 8
    width = sizing.tile_columns(n, v, cpu)
    assert sizing.frozen_head_bytes(n, v, h, torch.float32, cpu) == n * width * 8 + 6 * n * h * 4
