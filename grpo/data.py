"""Prompt data: rows of ``{"prompt": str, <column>: ...}`` and the order in which steps visit them.

The prompts of step ``s`` are a pure function of ``(seed, s)``: a fresh permutation of the rows each
epoch, read ``prompts_per_step`` at a time. So a resumed run sees exactly the prompts the
uninterrupted run would, and under data parallelism each rank takes its own slice of a step's
prompts (``shard_for_rank``: whole prompts, so a group of G completions never straddles ranks).
"""

from __future__ import annotations

import json
from typing import Any

import torch


def load_jsonl(path: str, prompt_key: str = "prompt") -> list[dict[str, Any]]:
    """Rows of a JSONL file; every row must have ``prompt_key`` (renamed to ``"prompt"``)."""
    rows = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if prompt_key not in row:
                raise ValueError(f"{path}:{line_no}: no {prompt_key!r} field (has {sorted(row)})")
            row["prompt"] = row.pop(prompt_key)
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def prompts_for_step(num_rows: int, step: int, prompts_per_step: int, seed: int) -> list[int]:
    """Row indices for ``step``: positions ``step*k .. step*k+k-1`` of a stream of per-epoch permutations."""
    indices = []
    for position in range(step * prompts_per_step, (step + 1) * prompts_per_step):
        epoch, offset = divmod(position, num_rows)
        order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        indices.append(int(order[offset]))
    return indices


def columns_of(rows: list[dict[str, Any]], repeat: int) -> dict[str, list]:
    """Every column except ``prompt`` as lists, each entry repeated ``repeat`` times (once per completion)."""
    keys = [k for k in rows[0] if k != "prompt"]
    return {k: [row.get(k) for row in rows for _ in range(repeat)] for k in keys}


def shard_for_rank(indices: list[int], rank: int, world_size: int) -> list[int]:
    """This rank's contiguous share of a step's prompts: whole prompts, so its groups of G stay whole.

    Concatenated in rank order, the shares are the step's prompts in their single-process order.
    """
    if len(indices) % world_size:
        raise ValueError(f"{len(indices)} prompts per step do not split evenly over {world_size} ranks")
    share = len(indices) // world_size
    return indices[rank * share : (rank + 1) * share]
