"""Public API: what the kernels allocate, for a trainer that plans its memory before it loads a model.

``grpo.plan`` predicts a training step's peak from a model's shape; the log-prob and loss kernels' share
of it is decided by the rules here. Each name is the kernels' own rule, imported from the module that
applies it (defined there once; this module copies nothing), so a plan and the kernels cannot disagree:

    default_chunk_size(V, H, dtype, device, N)        # rows per chunk of the fused-linear path
    tile_columns(n, V, device)                        # Vb: the frozen head's vocabulary block for n rows
    frozen_head_bytes(n, V, H, dtype, device)         # the most bytes the frozen head's tiles hold for n rows
    NORM_BLOCK_ELEMENTS                               # the CPU RMSNorm's fp32 temporaries, in elements

``docs/memory.md`` derives the terms; ``docs/api.md`` ("Public modules") lists this module among the
names ``grpo`` may import.
"""

from __future__ import annotations

from .autograd import default_chunk_size
from .kernels.torch_norm import BLOCK_ELEMENTS as NORM_BLOCK_ELEMENTS
from .kernels.torch_rows import frozen_head_bytes, tile_columns

# Public API (docs/api.md, "Public modules"): the names other packages may import from this module.
__all__ = ["default_chunk_size", "tile_columns", "frozen_head_bytes", "NORM_BLOCK_ELEMENTS"]
