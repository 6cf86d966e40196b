"""Format reward: exactly ``<think>...</think><answer>...</answer>``."""

from __future__ import annotations

import functools
import re
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


# Characters that render as nothing, from Unicode's own properties (never a list of examples):
# * general categories Z* (separators: spaces), C* (Cc controls, Cf format, Cs, Co, Cn) and M*
#   (combining marks: a block of marks alone has no base to draw on);
# * Default_Ignorable_Code_Point, which Python's unicodedata does not expose: derived here by
#   its definition in DerivedCoreProperties.txt (UAX #44, Unicode 15):
#   Other_Default_Ignorable_Code_Point + Cf + Variation_Selector
#   - White_Space - FFF9..FFFB - 13430..1343F - Prepended_Concatenation_Mark,
#   with Other_Default_Ignorable_Code_Point and Variation_Selector from PropList.txt (below);
#   every Cf is already invisible by category, so only the two lists matter;
# * letters and symbols whose Unicode Name says they are blank (the fillers of Hangul and
#   Khitan, BRAILLE PATTERN BLANK, MUSICAL SYMBOL NULL NOTEHEAD, IDEOGRAPHIC HALF FILL SPACE).
_INVISIBLE_CATEGORIES = ("Z", "C", "M")
_OTHER_DEFAULT_IGNORABLE = ((0x034F, 0x034F), (0x115F, 0x1160), (0x17B4, 0x17B5),
                            (0x2065, 0x2065), (0x3164, 0x3164), (0xFFA0, 0xFFA0),
                            (0xFFF0, 0xFFF8), (0xE0000, 0xE0000), (0xE0002, 0xE001F),
                            (0xE0080, 0xE00FF), (0xE01F0, 0xE0FFF))
_VARIATION_SELECTOR = ((0x180B, 0x180D), (0x180F, 0x180F), (0xFE00, 0xFE0F), (0xE0100, 0xE01EF))
_BLANK_NAME = re.compile(r"(?:\bFILLER|\bPATTERN BLANK|\bNULL NOTEHEAD|\bHALF FILL SPACE)$")


def default_ignorable(c: str) -> bool:
    """Unicode's Default_Ignorable_Code_Point for one character (see the comment above)."""
    cp = ord(c)
    if unicodedata.category(c) == "Cf":
        return not (c.isspace() or 0xFFF9 <= cp <= 0xFFFB or 0x13430 <= cp <= 0x1343F
                    or _prepended_concatenation_mark(cp))
    return any(lo <= cp <= hi for lo, hi in _OTHER_DEFAULT_IGNORABLE + _VARIATION_SELECTOR)


def _prepended_concatenation_mark(cp: int) -> bool:
    # PropList.txt: Prepended_Concatenation_Mark (format characters that do render a sign).
    return 0x0600 <= cp <= 0x0605 or cp in (0x06DD, 0x070F, 0x0890, 0x0891, 0x08E2, 0x110BD,
                                            0x110CD)


@functools.lru_cache(maxsize=8192)  # a run of one blank character costs one lookup
def invisible(c: str) -> bool:
    """Whether one character renders as nothing (see the comment above)."""
    category = unicodedata.category(c)
    return (category.startswith(_INVISIBLE_CATEGORIES) or default_ignorable(c)
            or category in ("Lo", "So") and _BLANK_NAME.search(unicodedata.name(c, "")) is not None)


def _visible(text: str) -> bool:
    """Whether ``text`` holds a character that is seen when rendered (linear: each distinct
    character is looked at once)."""
    seen: set[str] = set()
    for c in text:
        if c not in seen:
            if not invisible(c):
                return True
            seen.add(c)
    return False



def format_reward_func(prompts: Sequence[Any], completions: Sequence[Any], *,
                       think_prefilled: bool = False, **kwargs: Any) -> list[float | None]:
    """TRL reward: :func:`format_reward` per completion."""
    return [format_reward(c, think_prefilled=think_prefilled) for c in completions]
