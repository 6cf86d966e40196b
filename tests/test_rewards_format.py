"""Tests for grpo.rewards.format: the think/answer format reward and what counts as content.

Invisible characters (default-ignorable, blank-rendering, fillers) are not content: a block holding
only them is empty.
"""

from __future__ import annotations

import pytest

from grpo.rewards import format_reward


@pytest.mark.parametrize("text,expected", [
    ("<think>reasoning</think><answer>4</answer>", 1.0),
    ("<think>\nreasoning\n</think>\n<answer>\n4\n</answer>\n", 1.0),
    ("<think></think><answer>4</answer>", 0.0),
    ("<think>  </think><answer>4</answer>", 0.0),
    ("<think>r</think><answer> </answer>", 0.0),
    ("<think>r</think><answer>4</answer> trailing", 0.0),
    ("preamble <think>r</think><answer>4</answer>", 0.0),
    ("<think>r</think>text<answer>4</answer>", 0.0),
    ("<think>r</think><answer>4</answer><answer>5</answer>", 0.0),
    ("<think>a</think><think>b</think><answer>4</answer>", 0.0),
    ("<think>a<answer>4</answer></think><answer>4</answer>", 0.0),
    ("<answer>4</answer><think>r</think>", 0.0),
    ("<think>r</think><answer>4", 0.0),
    ("<THINK>r</THINK><ANSWER>4</ANSWER>", 0.0),
    ("<think>r</think><answer>4</answer>" + "x" * 2_000_000, 0.0),
    ("", 0.0),
    (None, 0.0),
])
def test_format_reward(text, expected):
    assert format_reward(text) == expected


def test_format_reward_think_prefilled():
    assert format_reward("reasoning</think><answer>4</answer>", think_prefilled=True) == 1.0
    assert format_reward("reasoning</think><answer>4</answer>") == 0.0
    assert format_reward("<think>r</think><answer>4</answer>", think_prefilled=True) == 0.0
    assert format_reward("</think><answer>4</answer>", think_prefilled=True) == 0.0
    chat = [{"role": "assistant", "content": "<think>r</think><answer>4</answer>"}]
    assert format_reward(chat) == 1.0


# --------------------------------------------------------------------------------------------
# Invisible content
# --------------------------------------------------------------------------------------------


INVISIBLE = ["\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\u00ad", "\u2061", "\u180e",
             "\u3164", "\u2800", "\u115f", "\uffa0", "\u00a0", "\u3000", "\u2028", "\u0301",
             "\ue000", "\u202e", "\u034f", "\U000e0020", "\u200b\u2060\ufeff \n\t"]


@pytest.mark.parametrize("blank", INVISIBLE, ids=[f"U+{ord(c[0]):04X}" for c in INVISIBLE])
def test_invisible_characters_are_not_content(blank):
    assert format_reward(f"<think>{blank}</think><answer>4</answer>") == 0.0
    assert format_reward(f"<think>r</think><answer>{blank}</answer>") == 0.0
    assert format_reward(f"{blank}<think>r</think>{blank}<answer>4</answer>{blank}") == 1.0
    assert format_reward(f"{blank}</think><answer>4</answer>", think_prefilled=True) == 0.0


@pytest.mark.parametrize("cp", [0x1D159, 0x2800, 0x3164, 0x115F, 0xFFA0, 0x034F, 0x180B, 0xE0100,
                                0x200B, 0x2060, 0xFEFF, 0x00AD, 0x0300, 0x3000, 0x1D173])
def test_blank_rendering_blocks_are_empty(cp):
    c = chr(cp)
    assert format_reward(f"<think>{c}</think><answer>5</answer>") == 0.0
    assert format_reward(f"<think>ok</think><answer>{c * 3}</answer>") == 0.0
    assert format_reward(f"<think>ok{c}</think><answer>5</answer>") == 1.0


def test_default_ignorable_matches_its_definition_over_all_code_points():
    # Every Cf (bar the definition's exclusions) and every listed range is default-ignorable,
    # and each one is invisible; no letter, digit or punctuation is, outside the blank names.
    import unicodedata
    from grpo.rewards.format import default_ignorable, invisible
    for cp in range(0x110000):
        c = chr(cp)
        cat = unicodedata.category(c)
        if default_ignorable(c):
            assert invisible(c)
        if cat[0] in "LNP" and invisible(c):
            assert cp in (0x115F, 0x1160, 0x3164, 0xFFA0) or "FILLER" in unicodedata.name(c, ""), hex(cp)
    assert default_ignorable("\u200b") and not default_ignorable("\u0600") and not default_ignorable("a")
