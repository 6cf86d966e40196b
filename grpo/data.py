"""Prompt data: rows of ``{"prompt": str, <column>: ...}`` and the order in which steps visit them.

The prompts of step ``s`` are a pure function of ``(seed, s)``: a fresh permutation of the rows each
epoch, read ``prompts_per_step`` at a time. So a resumed run sees exactly the prompts the
uninterrupted run would, and under data parallelism each rank takes its own slice of a step's
prompts (``shard_for_rank``: whole prompts, so a group of G completions never straddles ranks).

Rows are checked before a run starts (``check_rows``): bad data fails with the row (or the file and
line) named, not halfway through a run.
"""

from __future__ import annotations

import inspect
import json
from typing import Any, Callable, Mapping, Optional, Sequence

import torch


def load_jsonl(path: str, prompt_key: str = "prompt") -> list[dict[str, Any]]:
    """Rows of a JSONL file (UTF-8, one object per line, blank lines skipped); ``prompt_key`` is renamed to ``"prompt"``.

    A line that is not UTF-8, not JSON or not an object, and a row that breaks ``check_rows``, is an
    error naming the file and the line.
    """
    rows, line_numbers = [], []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")  # (a byte-order mark may open the file)
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg}, column {e.colno})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{line_no}: expected a JSON object per line, got {type(row).__name__}")
            if prompt_key not in row:
                raise ValueError(f"{path}:{line_no}: no {prompt_key!r} field (has {sorted(row)})")
            row["prompt"] = row.pop(prompt_key)
            rows.append(row)
            line_numbers.append(line_no)
    if not rows:
        raise ValueError(f"{path}: no rows")
    check_rows(rows, where=lambda i: f"{path}:{line_numbers[i]}")
    return rows


def check_rows(rows: Sequence[Mapping[str, Any]], where: Callable[[int], str] = lambda i: f"rows[{i}]") -> list[str]:
    """Check the rows a trainer takes prompts from; returns their columns other than ``"prompt"``.

    Each row is a mapping with a non-empty ``str`` prompt, and every row has the same columns: a
    column missing from some rows is an error naming it and the first such row (a value that is
    missing on purpose is written as ``None`` / JSON ``null``, and reaches the reward functions as
    ``None``). ``where(i)`` names row ``i`` in messages (a file and line for ``load_jsonl``).
    """
    if not rows:
        raise ValueError("no rows: the trainer needs at least one prompt")
    columns: dict[str, int] = {}  # column -> first row that has it
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise TypeError(f"{where(i)}: a row must be a dict, got {type(row).__name__}")
        if "prompt" not in row:
            raise ValueError(f"{where(i)}: no 'prompt' (has {sorted(row)})")
        if not isinstance(row["prompt"], str):
            raise TypeError(f"{where(i)}: the prompt must be a str, got {type(row['prompt']).__name__}")
        if not row["prompt"]:
            raise ValueError(f"{where(i)}: empty prompt (a completion needs something to follow)")
        for key in row:
            columns.setdefault(key, i)
    names = [k for k in columns if k != "prompt"]
    for i, row in enumerate(rows):
        for key in names:
            if key not in row:
                raise ValueError(
                    f"{where(i)} has no {key!r} column, which {where(columns[key])} has: give every row every "
                    f"column (None / null where a row has no value)"
                )
    return names


def reward_columns(fn: Callable) -> list[str]:
    """The data columns a reward function ``fn(prompts, completions, **columns)`` reads: its named
    parameters after the first two that have no default, or ``None`` as default (``answer=None``: a
    column that may be absent from a call, not a setting such as ``timeout=5.0``), bar those it names in
    an ``optional_columns`` attribute (``trusted_code`` of the code reward: used when the rows have it)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: nothing to read from
        return []
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    positional = [p for p in named if p.kind is p.POSITIONAL_OR_KEYWORD]
    skip = {p.name for p in positional[:2]}  # prompts, completions
    skip |= set(getattr(fn, "optional_columns", ()))  # columns it reads when the rows have them
    return [p.name for p in named if p.name not in skip and (p.default is p.empty or p.default is None)]


def check_reward_columns(reward_fns: Mapping[str, Callable], columns: Sequence[str],
                         rows: Optional[Sequence[Mapping[str, Any]]] = None) -> dict[str, list[tuple[int, str]]]:
    """Refuse, before the first step, a reward function that reads a column the rows do not have;
    then, with ``rows``, plan each reward's judging of every row and print how many rows it cannot
    judge and why (one line per reason, with the first such row).

    Without the first check, ``accuracy`` on prompts without an ``answer`` column would score nothing
    (``None``), the run would train on the other rewards alone and log ``accuracy: null``. The second
    reads a reward function's ``unscorable_rows(rows) -> [(row, reason)]`` where it has one (the code
    reward: tests it cannot judge whatever the completion, bad ``trusted_code``): such rows score
    ``None``, which the trainer treats as unscorable (no advantage), so a user sees it before any
    compute is spent. Returns ``{name: [(row, reason)]}`` for the rewards that have such rows.
    """
    for name, fn in reward_fns.items():
        missing = [c for c in reward_columns(fn) if c not in columns]
        if missing:
            have = ", ".join(repr(c) for c in columns) or "none besides the prompt"
            raise ValueError(
                f"reward function {name!r} needs the column {missing[0]!r}, which the prompts do not have (their "
                f"columns: {have}): add {missing[0]!r} to every row (null where unknown), or leave {name!r} out "
                f"of the rewards"
            )
    found: dict[str, list[tuple[int, str]]] = {}
    for name, fn in reward_fns.items():
        plan = getattr(fn, "unscorable_rows", None)
        if rows is None or not callable(plan):
            continue
        bad = list(plan(rows))
        if not bad:
            continue
        found[name] = bad
        first: dict[str, tuple[int, int]] = {}  # reason -> (first row, count)
        for row, reason in bad:
            r, k = first.get(reason, (row, 0))
            first[reason] = (r, k + 1)
        print(f"reward {name!r}: {len({r for r, _ in bad})} of {len(rows)} rows cannot be judged (scored None, no advantage):")
        for reason, (row, k) in first.items():
            print(f"  {k} rows (first: row {row}): {reason}")
    return found


def prompts_for_step(num_rows: int, step: int, prompts_per_step: int, seed: int) -> list[int]:
    """Row indices for ``step``: positions ``step*k .. step*k+k-1`` of a stream of per-epoch permutations."""
    indices = []
    for position in range(step * prompts_per_step, (step + 1) * prompts_per_step):
        epoch, offset = divmod(position, num_rows)
        order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        indices.append(int(order[offset]))
    return indices


def columns_of(rows: Sequence[Mapping[str, Any]], repeat: int) -> dict[str, list]:
    """Every column except ``prompt`` as lists, each entry repeated ``repeat`` times (once per completion).

    The columns are every row's (``check_rows``: one missing from some row is an error, never dropped).
    """
    names = check_rows(rows, where=lambda i: f"row {i}")
    return {k: [row[k] for row in rows for _ in range(repeat)] for k in names}


def shard_for_rank(indices: list[int], rank: int, world_size: int) -> list[int]:
    """This rank's contiguous share of a step's prompts: whole prompts, so its groups of G stay whole.

    Concatenated in rank order, the shares are the step's prompts in their single-process order.
    """
    if len(indices) % world_size:
        raise ValueError(f"{len(indices)} prompts per step do not split evenly over {world_size} ranks")
    share = len(indices) // world_size
    return indices[rank * share : (rank + 1) * share]
