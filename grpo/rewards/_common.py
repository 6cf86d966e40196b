"""Text helpers shared by the rewards: completion text, answer blocks, argument checks."""

from __future__ import annotations

import math
from typing import Any, Iterable

MAX_TEXT_CHARS = 1_000_000  # completions longer than this are not parsed at all
MAX_TIMEOUT = 86_400.0  # seconds; longer is a configuration error, not a budget


def last_answer_block(text: str) -> str | None:
    """Body of the last ``<answer>...</answer>``: the last close tag and the open tag nearest
    before it (two ``rfind`` calls: linear, where a lazy regex is quadratic on repeated tags)."""
    close = text.rfind("</answer>")
    if close < 0:
        return None
    start = text.rfind("<answer>", 0, close)
    return None if start < 0 else text[start + len("<answer>"):close]



def completion_text(completion: Any) -> str:
    """Text of a completion given as a string or as TRL chat messages."""
    if completion is None:
        return ""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return completion_text(completion.get("content"))
    if isinstance(completion, (list, tuple)):
        if completion and all(isinstance(m, dict) and "role" in m for m in completion):
            assistant = [m for m in completion if m.get("role") == "assistant"] or list(completion)
            return completion_text(assistant[-1].get("content"))
        # content given as parts: [{"type": "text", "text": ...}, ...]
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in completion)
    return str(completion)



def check_timeout(timeout: Any) -> float:
    """``timeout`` as a float; ValueError/TypeError naming it unless finite and in (0, 1 day]."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, got {type(timeout).__name__}")
    t = float(timeout)
    if not (math.isfinite(t) and 0 < t <= MAX_TIMEOUT):
        raise ValueError(f"timeout must be finite, > 0 and <= {MAX_TIMEOUT:g} seconds, got {timeout!r}")
    return t



def as_column(name: str, value: Any, n: int) -> list:
    """``value`` as a reward column of ``n`` rows: None or a scalar repeated, or a sequence of length ``n``."""
    if value is None:
        return [None] * n
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        return [value] * n
    value = list(value)
    if len(value) != n:
        raise ValueError(f"column {name!r} has {len(value)} rows for {n} completions")
    return value

