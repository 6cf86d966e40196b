"""Format reward: exactly ``<think>...</think><answer>...</answer>``."""

from __future__ import annotations

import unicodedata
from typing import Any, Sequence

from grpo.rewards._common import MAX_TEXT_CHARS, completion_text

_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def format_reward(completion: Any, *, think_prefilled: bool = False) -> float:
    """1.0 for exactly ``<think>...</think><answer>...</answer>``, else 0.0.

    Each block appears once, both hold a visible character (zero-width, format, control and
    combining characters and unicode blanks do not count: see :func:`_visible`), only such
    invisible characters may surround them, and no tag appears inside another block. ``think_prefilled=True`` is for chat templates that already
    emitted ``<think>``: the completion starts inside the think block, so it must not contain
    ``<think>`` itself.
    """
    try:
        text = completion_text(completion)
        if not text or len(text) > MAX_TEXT_CHARS:
            return 0.0
        counts = {t: text.count(t) for t in _TAGS}
        expected_open = 0 if think_prefilled else 1
        if counts["<think>"] != expected_open or any(counts[t] != 1 for t in _TAGS[1:]):
            return 0.0
        if think_prefilled:
            think_start = 0
        else:
            head, _, _ = text.partition("<think>")
            if _visible(head):
                return 0.0
            think_start = text.index("<think>") + len("<think>")
        think_end = text.index("</think>")
        ans_open = text.index("<answer>")
        ans_close = text.index("</answer>")
        if not think_start <= think_end < ans_open < ans_close:
            return 0.0
        think = text[think_start:think_end]
        between = text[think_end + len("</think>"):ans_open]
        answer = text[ans_open + len("<answer>"):ans_close]
        after = text[ans_close + len("</answer>"):]
        if not _visible(think) or not _visible(answer) or _visible(between) or _visible(after):
            return 0.0
        return 1.0
    except Exception:  # noqa: BLE001
        return 0.0


# Characters that render as nothing: spaces and separators (Z*), format characters such as
# U+200B/U+2060/U+FEFF/U+00AD (Cf), controls (Cc), unassigned/private/surrogates (Cn/Co/Cs),
# combining marks without a base (M*), and the Hangul/Braille blanks that are category Lo/So.
_INVISIBLE_CATEGORIES = ("Z", "C", "M")
_BLANK_LETTERS = frozenset("\u115f\u1160\u3164\uffa0\u2800\u180e\u17b4\u17b5")


def _visible(text: str) -> bool:
    """Whether ``text`` holds a character that is seen when rendered (linear)."""
    for c in text:
        if c not in _BLANK_LETTERS and not unicodedata.category(c).startswith(_INVISIBLE_CATEGORIES):
            return True
    return False



def format_reward_func(prompts: Sequence[Any], completions: Sequence[Any], *,
                       think_prefilled: bool = False, **kwargs: Any) -> list[float | None]:
    """TRL reward: :func:`format_reward` per completion."""
    return [format_reward(c, think_prefilled=think_prefilled) for c in completions]
