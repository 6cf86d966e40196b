"""Normalisation and equivalence of math answers (the engine behind ``grpo.rewards.math_equal``).

The module has two halves with different safety properties:

* **Cheap, bounded string work** (:func:`clean`, :func:`fast_equal`): regexes over length-capped
  strings and integer arithmetic with capped sizes. Safe to run in the trainer's own process.
* **SymPy reasoning** (:func:`compare`): parsing with ``latex2sympy2_extended`` and evaluating
  with SymPy can take unbounded time and memory, so it only ever runs inside the worker process
  (:mod:`grpo.rewards.worker`) that ``grpo.rewards`` starts and kills on timeout. SymPy is
  imported lazily so importing this module stays cheap.

Equivalence rules (documented here once; ``math_equal`` refers to them):

* Answers are split structurally before any parsing: ``\\{...\\}`` sets and comma- or
  semicolon-separated lists of several answers are unordered and compare as sets (as
  math-verify does: a repeated answer neither adds nor misses one); ``(a,b)or(c,d)`` is a list; tuples and intervals are ordered and their brackets must match
  (``(1,2)`` != ``[1,2]`` != ``[1,2)``); matrices compare cell by cell; ``a \\cup b`` unions are
  unordered lists of pieces; ``\\pm`` expands to the two-element set (so ``\\pm 2`` != ``2``).
* ``x = 5`` equals ``5`` when the left side is a bare variable (``x``, ``a_1``, ``f(x)``,
  ``(x, y)``); a chain ``x = 5 + 5 + 1 = 11`` is its last member; other equations compare as
  equations: ``l1 - r1`` must be a non-zero constant multiple of ``l2 - r2``. Inequalities in
  one variable (``x > 3``, ``1 \\le x < 2``, and linear ones ``-x > -1`` / ``2x < 2``, solved
  for the variable) become intervals; other inequalities need a positive constant multiple.
* Numbers are exact: integers, fractions, decimals (as exact rationals), radicals, ``\\pi`` ...
  Two values are equal when they are equal as rationals, or (irrationals) when they agree to
  40 significant digits at 60-digit precision, or (free symbols) when they agree at five sample
  points to 25 digits.
* **Decimals are exact.** A written decimal is the rational it spells (``0.5 == 1/2``,
  ``42.00 == 42``) and equals another value only when exactly equal: there is no rounding
  tolerance, so ``0.3333 != 1/3``, ``1.414 != sqrt(2)``, ``3.000 != 3.0001``. (A verifier that
  accepts a rounded value also accepts every wrong answer within the rounding window.)
* Percent: ``x%`` (also ``x pct``, ``x percent``, ``x percentage``) means ``x/100`` against a bare number, on either side (``50\\% == 0.5``,
  ``12.5\\% == 1/8``, ``0.5\\% != 0.5``, ``50 != 50\\%``); two percentages compare as
  written. (Reading a bare ``50`` as "50 percent" would also read ``0.5`` as "0.5 percent".)
  ``30^\\circ`` also matches
  ``\\pi/6`` (only when exactly one side carries the sign; with both, the numbers compare as
  written).
* Times ``h:mm`` (``h:mm:ss``, optional am/pm) compare as times of day: ``12:00 != 1:00``,
  ``1:00 pm == 13:00``. Any other ``a:b`` compares as exact text.
* Units in ``\\text{...}`` and common unit words are dropped, but never a digit (``2\\text{5 kg}``
  stays ``2 5``, which is not a number); digits separated only by spaces are never joined, so
  ``2 3`` is not ``23`` (only ``1,234``-style thousands, as the whole answer, or LaTeX ``1\\,234``
  / ``1{,}234`` / MATH's ``1,\\!234``; a first group never starts with 0: ``0,111`` is not 111). Words (``Monday``) compare case-insensitively as text.
* Unicode: superscripts (``x\u00b2``), vulgar fractions (``\u00bd``), ``\u211d`` and lookalike
  digits (NFKC: fullwidth, mathematical bold) are read as what they mean; invisible format
  characters are dropped. ``\\mathbb{R}`` and "all real numbers" mean ``(-\\infty, \\infty)``;
  set-builder ``\\{x \\mid x > 3\\}`` means the set its condition describes.
* Refused (never equal): unbalanced braces or brackets (truncated LaTeX), answers over
  :data:`MAX_CHARS`, nesting deeper than :data:`MAX_DEPTH`, and values that would be enormous
  (an integer power with more than :data:`MAX_DIGITS` digits, ``n!`` with ``n`` over
  :data:`MAX_FACTORIAL`) -- checked on the unevaluated tree before SymPy evaluates anything.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Iterator, Union

MAX_CHARS = 2000  # longer "answers" are essays or attacks, not answers
MAX_DEPTH = 40  # bracket nesting; deeper input is adversarial and slow to parse
MAX_DIGITS = 20_000  # largest integer power we agree to build
MAX_FACTORIAL = 20_000  # largest n for n!, binomial(n, k) ...
_SCI_EXP_LIMIT = 400  # |exponent| accepted in 1.5e300 style numbers by the fast path

# --------------------------------------------------------------------------------------------
# String cleaning (cheap, in-process)
# --------------------------------------------------------------------------------------------

_UNICODE = {
    "\u2212": "-", "\u2013": "-", "\u00d7": r"\times ", "\u00b7": r"\cdot ", "\u22c5": r"\cdot ",
    "\u03c0": r"\pi ", "\u221e": r"\infty ", "\u2264": r"\le ", "\u2265": r"\ge ", "\u2260": r"\ne ",
    "\u222a": r"\cup ", "\u2205": r"\emptyset ", "\u00b1": r"\pm ", "\u221a": r"\sqrt", "\u00a0": " ",
    "\u2009": " ", "\u202f": " ",
}
_DEG = "\u00b0"  # canonical degree marker after cleaning
_UNITS = {
    "cm", "mm", "km", "m", "meter", "metre", "centimeter", "centimetre", "millimeter", "kilometer",
    "in", "inch", "inche", "ft", "foot", "feet", "yd", "yard", "mile", "mi", "mph", "kph",
    "g", "kg", "mg", "gram", "kilogram", "lb", "lbs", "pound", "ounce", "oz", "ton",
    "s", "sec", "second", "min", "minute", "h", "hr", "hour", "day", "week", "month", "year",
    "l", "ml", "liter", "litre", "gallon", "cup", "unit", "sq", "square", "cubic", "dollar",
    "cent", "euro", "degree", "deg", "radian", "rad", "point", "people", "person", "student",
    "way", "time", "percent",
}
# Words that are mathematics, not text answers.
_MATH_WORDS = {"sqrt", "frac", "pi", "sin", "cos", "tan", "cot", "sec", "csc", "log", "ln", "exp",
               "infty", "inf", "arcsin", "arccos", "arctan"}

_TEXT_CMD = re.compile(r"\\(?:text|textrm|textnormal|textbf|textit|mbox|mathrm|mathbf|mathit|"
                       r"mathsf|boldsymbol|bm|operatorname)\s*\{")
_SPACING = re.compile(r"\\[,;:! ]|\\q?quad\b|~")
_SIZED = re.compile(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|biggl|biggr|Biggl|Biggr|big|Big|bigg|Bigg)"
                    r"(?![a-zA-Z])\s*")
# Thousands separators. Plain commas only when the whole answer is one such number ("(1,234)" is
# a pair); LaTeX's "1{,}234" and "1\,234" anywhere. Spaces never join digits ("2 3" is not 23).
# A group of thousands never starts with 0 ("0,111" is not 111); MATH writes "16,\!386".
_THOUSANDS = re.compile(r"[+-]?[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?", re.A)
_LATEX_THOUSANDS = re.compile(r"(?<![\d.])[1-9]\d{0,2}(?:(?:\{,\}|\\,|,\s*\\!)\s*\d{3}(?!\d))+", re.A)
_LATEX_SEPARATOR = re.compile(r"\{,\}|\\,|,\s*\\!|\s+")
_PERCENT_WORD = re.compile(r"(?<=\d)\s*(?:percent(?:age)?|pct)(?![A-Za-z])", re.I)
_SUPERSCRIPTS = dict(zip("\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079\u207a\u207b\u207f",
                         "0123456789+-n"))
_SUBSCRIPTS = dict(zip("\u2080\u2081\u2082\u2083\u2084\u2085\u2086\u2087\u2088\u2089", "0123456789"))
_BLACKBOARD = {"\u211d": r"\mathbb{R}", "\u2124": r"\mathbb{Z}", "\u2115": r"\mathbb{N}",
               "\u211a": r"\mathbb{Q}", "\u2102": r"\mathbb{C}"}
_REALS = re.compile(r"\\mathbb\s*\{?\s*R\s*\}?|\\R(?:eals)?(?![A-Za-z])|\ball real numbers\b", re.I)


def _unicode_math(s: str) -> str:
    """Read unicode notation as LaTeX; drop invisible characters; NFKC lookalike digits.

    Linear in ``len(s)``. Superscripts and vulgar fractions are rewritten before NFKC, which
    would otherwise turn ``x\u00b2`` into ``x2`` and ``\u00bd`` into ``1\u20442``.
    """
    out: list[str] = []
    i, n = 0, len(s)
    while i < n:
        c = s[i]
        if c in _SUPERSCRIPTS or c in _SUBSCRIPTS:
            table, mark = (_SUPERSCRIPTS, "^") if c in _SUPERSCRIPTS else (_SUBSCRIPTS, "_")
            j = i
            while j < n and s[j] in table:
                j += 1
            out.append(mark + "{" + "".join(table[ch] for ch in s[i:j]) + "}")
            i = j
            continue
        if c in _BLACKBOARD:
            out.append(_BLACKBOARD[c])
        elif unicodedata.category(c) in ("Cf", "Cc") and c not in "\t\n\r":
            pass  # zero-width and other invisible characters
        elif unicodedata.category(c) == "No" and "\u2044" in unicodedata.normalize("NFKC", c):
            num, _, den = unicodedata.normalize("NFKC", c).partition("\u2044")
            out.append(r"\frac{%s}{%s}" % (num, den))  # vulgar fraction: 1/2, 3/4 ...
        else:
            out.append(c)
        i += 1
    return unicodedata.normalize("NFKC", "".join(out))


def matching_brace(s: str, i: int) -> int:
    """Index of the ``}`` closing the ``{`` at ``s[i]``, or -1 (escaped braces don't count)."""
    depth = 0
    j = i
    while j < len(s):
        c = s[j]
        if c == "\\":
            j += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return j
        j += 1
    return -1


def _unwrap_text(s: str) -> str:
    """Replace ``\\text{...}``-like wrappers by their content; drop it when it is only a unit."""
    for _ in range(50):  # bounded: each pass removes one wrapper
        m = _TEXT_CMD.search(s)
        if not m:
            break
        end = matching_brace(s, m.end() - 1)
        if end < 0:
            break
        inner, rest = s[m.end():end].strip(), s[end + 1:]
        if _is_unit_phrase(inner):
            inner = ""
            rest = re.sub(r"^\s*\^\s*(?:\{\s*[23]\s*\}|[23])", "", rest)  # cm^2 is a unit too
        s = f"{s[:m.start()]} {inner} {rest}"
    return s


def _is_unit_phrase(text: str) -> bool:
    """Only unit words, ``/`` and squared/cubed exponents: never a digit that could be a value."""
    if len(text) > 200:
        return False
    bare = re.sub(r"\^\s*\{?\s*[23]\s*\}?", "", text)  # cm^2, m^{3}
    words = re.findall(r"[A-Za-z]+", bare)
    rest = re.sub(r"[A-Za-z]+|[\s/{}]", "", bare)
    return bool(words) and not rest and all(_singular(w.lower()) in _UNITS for w in words)


def _singular(w: str) -> str:
    return w[:-1] if len(w) > 2 and w.endswith("s") and w[:-1] in _UNITS else w


# One or more unit words separated by spaces or "/": words and separators alternate, so the
# match is linear (a nested "(word sep*)+" backtracks exponentially on "3 because ...!").
_UNIT_WORD = r"[A-Za-z]+(?:\^\{?[23]\}?)?"
_TRAILING_UNIT = re.compile(r"(?<=[\d}).\s])\s+(%s(?:[\s/]+%s)*)\s*$" % (_UNIT_WORD, _UNIT_WORD))


def _strip_trailing_units(s: str) -> str:
    """``12 inches`` -> ``12``; only words after a space, so ``5m`` (a product) is kept."""
    m = _TRAILING_UNIT.search(s)
    if m and _is_unit_phrase(m.group(1)) and s[:m.start()].strip():
        return s[:m.start()]
    return s


def _strip_outer(s: str) -> str:
    """Drop wrappers around the whole answer: $..$, \\(..\\), \\[..\\], \\boxed{..}, {..}."""
    for _ in range(10):
        t = s.strip()
        for a, b in (("$$", "$$"), ("$", "$"), (r"\(", r"\)"), (r"\[", r"\]")):
            if len(t) >= len(a) + len(b) and t.startswith(a) and t.endswith(b):
                t = t[len(a):len(t) - len(b)].strip()
        m = re.match(r"\\(?:boxed|fbox)\s*\{", t)
        if m and matching_brace(t, m.end() - 1) == len(t) - 1:
            t = t[m.end():-1].strip()
        if t.startswith("{") and matching_brace(t, 0) == len(t) - 1:
            t = t[1:-1].strip()
        if t == s:
            return t
        s = t
    return s


def _plain_to_latex(s: str) -> str:
    """Plain-text math (``sqrt(2)``, ``x**2``, ``pi``, ``inf``) into the LaTeX the parser reads."""
    s = s.replace("**", "^")
    s = re.sub(r"(?<![\\A-Za-z])(pi)(?![A-Za-z])", r"\\pi ", s)
    s = re.sub(r"(?<![\\A-Za-z])(?:infinity|inf)(?![A-Za-z])", r"\\infty ", s)
    s = re.sub(r"(?<![\\A-Za-z])(sqrt|sin|cos|tan|log|ln|exp)(?=\s*\()", r"\\\1", s)
    # \sqrt(2) -> \sqrt{2}: the parser wants braces around the radicand.
    for _ in range(20):
        m = re.search(r"\\sqrt\s*\(", s)
        if not m:
            break
        depth, j = 0, m.end() - 1
        while j < len(s):
            depth += {"(": 1, ")": -1}.get(s[j], 0)
            if depth == 0:
                break
            j += 1
        if j >= len(s):
            break
        s = s[:m.start()] + r"\sqrt{" + s[m.end():j] + "}" + s[j + 1:]
    return s


def clean(text: Any) -> str | None:
    """Normalise an answer string; ``None`` when it is missing or too long to be an answer."""
    if text is None:
        return None
    s = text if isinstance(text, str) else str(text)
    if len(s) > MAX_CHARS:
        return None
    s = _unicode_math(s)
    for a, b in _UNICODE.items():
        s = s.replace(a, b)
    s = _REALS.sub(r"(-\\infty, \\infty)", s)
    s = _strip_outer(s)
    s = re.sub(r"\\(?:displaystyle|textstyle|scriptstyle|limits|nolimits|mathstrut)(?![a-zA-Z])", "", s)
    s = re.sub(r"\\(?:left|right)\s*\.", "", s)
    s = _SIZED.sub("", s)
    s = _LATEX_THOUSANDS.sub(lambda m: _LATEX_SEPARATOR.sub("", m.group(0)), s)
    s = _SPACING.sub(" ", s)
    s = re.sub(r"\\[dtc]frac(?![a-zA-Z])", r"\\frac", s)
    s = re.sub(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\degree(?![a-zA-Z])|\\circ(?![a-zA-Z])\s*$",
               _DEG, s)
    s = re.sub(r"\\%|(?<=\d)\s*percent\b", "%", s)
    s = re.sub(r"\\\$|\$", "", s)
    s = _unwrap_text(s)
    s = _PERCENT_WORD.sub("%", s)  # "28 pct", "$28$ percent", "28 percentage"
    s = re.sub(r"\\(?:mathrm|mathit|operatorname)\s*([A-Za-z])", r"\1", s)
    s = re.sub(r"\s+", " ", s).strip()
    s = re.sub(r"(?<!\\)[.;]+$", "", s).strip()  # closing punctuation of a sentence
    s = _strip_trailing_units(s)
    s = re.sub(r"\s*\b(?:degrees?)\s*$", _DEG, s) if re.search(r"\d\s*degrees?\s*$", s) else s
    s = _plain_to_latex(s)
    s = re.sub(r"\s*(?:\bor\b|\band\b)\s*", ",", s) if re.search(r"\S\s+(?:or|and)\s+\S", s) else s
    s = re.sub(r"(?<=[)\]])\s*(?:or|and)\s*(?=[(\[])", ",", s)  # "(11,7)or(7,11)"
    s = re.sub(r"\\(?:varnothing|emptyset)(?![a-zA-Z])", r"\\emptyset", s)
    s = re.sub(r"\s+", " ", _strip_outer(s)).strip()
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    return s


# --------------------------------------------------------------------------------------------
# Exact numbers, percentages and times (cheap, in-process)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Num:
    """A number written out, as the exact rational it spells (decimals included)."""

    value: Fraction


# re.A: only ASCII digits are digits (NFKC already mapped fullwidth / bold lookalikes).
_NUM_RE = re.compile(
    r"(?P<sign>[+-]?)\s*(?P<int>\d*)(?:\.(?P<frac>\d*))?"
    r"(?:\s*(?:[eE]|\\times\s*10\s*\^|\\cdot\s*10\s*\^|\*\s*10\s*\^)\s*\{?\s*(?P<exp>[+-]?\d+)\s*\}?)?",
    re.A)
_FRAC_RE = re.compile(r"(?P<sign>[+-]?)\s*(?P<whole>\d+(?=\s*\\frac))?\s*"
                      r"(?:\\frac\s*\{\s*(?P<a>\d+)\s*\}\s*\{\s*(?P<b>\d+)\s*\}"
                      r"|(?P<c>\d+)\s*/\s*(?P<d>\d+))", re.A)
_TIME_RE = re.compile(r"(?P<h>\d{1,2}):(?P<m>\d{2})(?::(?P<s>\d{2}))?\s*(?P<ampm>[ap]\.?\s*m\.?)?",
                      re.A | re.I)


def parse_number(s: str) -> Num | None:
    """Parse a plain number (``-1.50``, ``3.2e5``, ``3/4``, ``\\frac{3}{4}``); ``None`` otherwise."""
    s = s.strip()
    if len(s) > 300:
        return None
    m = _FRAC_RE.fullmatch(s)
    if m:
        a, b = (m["a"], m["b"]) if m["a"] is not None else (m["c"], m["d"])
        if int(b) == 0:
            return None
        v = Fraction(int(a), int(b)) + int(m["whole"] or 0)  # 2\frac{1}{2} is a mixed number
        return Num(-v if m["sign"] == "-" else v)
    m = _NUM_RE.fullmatch(s)
    if not m or not (m["int"] or m["frac"]):
        return None
    exp = int(m["exp"]) if m["exp"] else 0
    if abs(exp) > _SCI_EXP_LIMIT:
        return None
    digits = (m["int"] or "") + (m["frac"] or "")
    v = Fraction(int(digits or "0"), 10 ** len(m["frac"] or "")) * Fraction(10) ** exp
    return Num(-v if m["sign"] == "-" else v)


def num_equal(a: Num, b: Num) -> bool:
    """Equality of two written numbers: exact (decimals are the rationals they spell)."""
    return a.value == b.value


def parse_time(s: str) -> int | None:
    """Seconds since midnight of ``h:mm``, ``h:mm:ss``, ``h:mm am/pm``; ``None`` if not a time."""
    m = _TIME_RE.fullmatch(s.strip())
    if not m:
        return None
    h, mins, secs = int(m["h"]), int(m["m"]), int(m["s"] or 0)
    if mins > 59 or secs > 59:
        return None
    if m["ampm"]:
        if not 1 <= h <= 12:
            return None
        h = h % 12 + (12 if m["ampm"][0].lower() == "p" else 0)
    elif h > 24:
        return None
    return (h * 60 + mins) * 60 + secs


def _split_flag(s: str) -> tuple[str, str]:
    """Split a trailing percent / degree sign off a scalar answer."""
    s = s.strip()
    if s.endswith("%"):
        return s[:-1].strip(), "%"
    if s.endswith(_DEG):
        return s[:-1].strip(), _DEG
    return s, ""


def _percent_value(n: Num, flag: str, other_flag: str) -> Num:
    """A percentage against a bare number is its value ``x/100`` (rule in the module docstring)."""
    if flag != "%" or other_flag == "%":
        return n
    return Num(n.value / 100)


def fast_equal(pred: Any, gold: Any) -> bool | None:
    """Cheap in-process verdict: identical answers, or two plain numbers. ``None``: undecided."""
    p, g = clean(pred), clean(gold)
    if p is None or g is None or not p or not g:
        return False if (p is None or not p) else None
    if p == g:
        return _balanced(p)
    pt, gt = parse_time(p), parse_time(g)
    if pt is not None or gt is not None:
        return pt is not None and pt == gt  # a time equals only the same time
    (ps, pf), (gs, gf) = _split_flag(p), _split_flag(g)
    if _DEG in (pf, gf):
        return None  # degrees may mean radians: needs pi, so SymPy
    pn, gn = parse_number(ps), parse_number(gs)
    if pn is None or gn is None:
        return None
    return num_equal(_percent_value(pn, pf, gf), _percent_value(gn, gf, pf))


# --------------------------------------------------------------------------------------------
# Structure: sets, tuples, intervals, matrices, equations (string level, cheap)
# --------------------------------------------------------------------------------------------


@dataclass
class Scalar:
    text: str
    flag: str = ""  # "%", degree marker or ""


@dataclass
class Seq:
    """Ordered: tuple, interval, vector. Brackets are part of the value."""

    open: str
    close: str
    items: list


@dataclass
class Bag:
    """Unordered: set, several answers, the two values of a +-."""

    items: list
    kind: str = "set"  # "set" or "union"


@dataclass
class Matrix:
    rows: list


@dataclass
class Rel:
    """An equation or inequality that is not a plain assignment."""

    op: str
    lhs: str
    rhs: str


@dataclass
class Assign:
    var: str
    value: Any


@dataclass
class Text:
    text: str


Node = Union[Scalar, Seq, Bag, Matrix, Rel, Assign, Text]

_OPEN = {"(": ")", "[": "]", "{": "}"}
_REL_OPS = {"=": "=", r"\le": "<=", r"\leq": "<=", r"\leqslant": "<=", r"\ge": ">=", r"\geq": ">=",
            r"\geqslant": ">=", "<": "<", ">": ">", r"\lt": "<", r"\gt": ">", r"\ne": "!=",
            r"\neq": "!=", "<=": "<=", ">=": ">="}


def _tokens(s: str):
    """Yield ``(index, token, depth_before)``; brackets of all kinds, incl. ``\\{`` and ``\\langle``."""
    depth = 0
    i = 0
    while i < len(s):
        c = s[i]
        if c == "\\":
            m = re.match(r"\\([A-Za-z]+|.)", s[i:])
            tok = m.group(0) if m else "\\"
            if tok in (r"\{", r"\langle", r"\lbrace"):
                yield i, tok, depth
                depth += 1
            elif tok in (r"\}", r"\rangle", r"\rbrace"):
                depth -= 1
                yield i, tok, depth
            else:
                yield i, tok, depth
            i += len(tok)
            continue
        if c in "([{":
            yield i, c, depth
            depth += 1
        elif c in ")]}":
            depth -= 1
            yield i, c, depth
        elif c in "<>" and i + 1 < len(s) and s[i + 1] == "=":
            yield i, c + "=", depth
            i += 2
            continue
        else:
            yield i, c, depth
        i += 1


def _balanced(s: str) -> bool:
    """Brackets balance and nest no deeper than MAX_DEPTH (truncated LaTeX fails this).

    Round and square brackets may pair with each other (``[1, 2)``); curly braces must pair
    among themselves, and every ``\\begin`` needs its ``\\end``.
    """
    depth = braces = 0
    for _, tok, d in _tokens(s):
        if d < 0 or d >= MAX_DEPTH:
            return False
        if tok == "{":
            braces += 1
        elif tok == "}":
            braces -= 1
            if braces < 0:
                return False
        depth = d + 1 if tok in ("(", "[", "{", r"\{", r"\langle", r"\lbrace") else (
            d if tok in (")", "]", "}", r"\}", r"\rangle", r"\rbrace") else d)
    return depth == 0 and braces == 0 and s.count(r"\begin") == s.count(r"\end")


def _split_top(s: str, seps: set[str]) -> list[str]:
    """Split at top-level separator tokens (outside any brackets)."""
    parts, last = [], 0
    for i, tok, d in _tokens(s):
        if d == 0 and tok in seps:
            parts.append(s[last:i])
            last = i + len(tok)
    parts.append(s[last:])
    return [p.strip() for p in parts]


def _top_tokens(s: str) -> list[tuple[int, str]]:
    return [(i, tok) for i, tok, d in _tokens(s) if d == 0]


def _outer_close(s: str) -> int:
    """Index of the token closing the bracket opened at ``s[0]`` (any closing kind), or -1."""
    for i, tok, d in _tokens(s):
        if d == 0 and i > 0 and tok in (")", "]", "}", r"\}", r"\rangle", r"\rbrace"):
            return i
    return -1


_SIMPLE_VAR = re.compile(r"(?:[A-Za-z]|\\[A-Za-z]+)(?:_\{?[A-Za-z0-9]+\}?)?'*(?:\([A-Za-z, ]*\))?")


def _is_simple_var(s: str) -> bool:
    s = s.strip()
    if s.startswith("(") and s.endswith(")"):
        return all(_SIMPLE_VAR.fullmatch(p.strip()) for p in s[1:-1].split(","))
    return bool(_SIMPLE_VAR.fullmatch(s)) and s not in (r"\pi", r"\infty")


def _var_free(s: str) -> bool:
    t = re.sub(r"\\(?:pi|infty|sqrt|frac|cdot|times|ln|log|sin|cos|tan|exp|e)(?![A-Za-z])", "", s)
    return not re.search(r"[A-Za-z]", t.replace("\\", ""))


_MATRIX_RE = re.compile(r"\\begin\{(pmatrix|bmatrix|Bmatrix|matrix|smallmatrix|array)\}"
                        r"(?:\{[^{}]*\})?(.*)\\end\{\1\}", re.S)


def parse_structure(s: str, depth: int = 0) -> Node | None:
    """Turn a cleaned answer into a tree of containers whose leaves are scalar strings."""
    s = s.strip()
    if not s or depth > 8:
        return None
    if s == r"\emptyset" or re.fullmatch(r"\\\{\s*\\\}", s):
        return Bag([])
    if len(_split_top(s, {r"\cup"})) > 1:
        parts = [parse_structure(p, depth + 1) for p in _split_top(s, {r"\cup"})]
        return None if None in parts else Bag(parts, kind="union")
    semis = _split_top(s, {";"})  # "-12;-11;-10": ";" separates answers (and outranks ",")
    if len(semis) > 1:
        parts = [parse_structure(p, depth + 1) for p in semis if p]
        return None if None in parts or not parts else Bag(parts)
    commas = _split_top(s, {","})
    if len(commas) > 1:
        parts = [parse_structure(p, depth + 1) for p in commas if p]
        return None if None in parts or not parts else Bag(parts)
    rel = _parse_relation(s, depth)
    if rel is not None:
        return rel
    m = re.fullmatch(r"(.+?)\\in(?![A-Za-z])(.+)", s)
    if m and _is_simple_var(m.group(1)):
        return parse_structure(m.group(2), depth + 1)
    m = _MATRIX_RE.fullmatch(s)
    if m:
        body = re.sub(r"\\hline", "", m.group(2))
        rows = [r for r in re.split(r"\\\\", body) if r.strip()]
        cells = [[parse_structure(c, depth + 1) for c in r.split("&")] for r in rows]
        if not cells or any(None in r for r in cells) or len({len(r) for r in cells}) != 1:
            return None
        return Matrix(cells)
    if s.startswith(r"\{") and s.endswith(r"\}") and _outer_close(s) == len(s) - 2:
        inner = s[2:-2]
        condition = _set_builder_condition(inner)
        if condition is not None:  # \{x \mid x > 3\}: the set its condition describes
            return parse_structure(condition, depth + 1)
        parts = [parse_structure(p, depth + 1) for p in _split_top(inner, {","})]
        return None if None in parts else Bag(parts)
    if s.startswith(r"\langle") and s.endswith(r"\rangle") and _outer_close(s) == len(s) - 7:
        parts = [parse_structure(p, depth + 1) for p in _split_top(s[7:-7], {","})]
        return None if None in parts else Seq("<", ">", parts)
    if s[0] in "([" and s[-1] in ")]" and _outer_close(s) == len(s) - 1:
        inner_parts = _split_top(s[1:-1], {","})
        if len(inner_parts) == 1:
            inner_parts = _split_top(s[1:-1], {";"})  # "(0;-2;6)"
        if len(inner_parts) > 1:
            parts = [parse_structure(p, depth + 1) for p in inner_parts]
            return None if None in parts else Seq(s[0], s[-1], parts)
    return _parse_scalar(s)


def _set_builder_condition(inner: str) -> str | None:
    """``x \\mid x > 3`` / ``x : x > 3`` / ``x \\in \\mathbb{R} | x > 3`` -> ``x > 3``; else None."""
    for sep in (r"\mid", "|", ":"):
        parts = _split_top(inner, {sep})
        if len(parts) < 2:
            continue
        var, cond = parts[0], sep.join(parts[1:]) if sep != r"\mid" else r" \mid ".join(parts[1:])
        var = re.sub(r"\\in(?![A-Za-z]).*$", "", var).strip()  # x \in R | ...
        if _is_simple_var(var) and cond.strip():
            return cond.strip()
    return None


def _parse_relation(s: str, depth: int) -> Node | None:
    toks = [(i, t) for i, t in _top_tokens(s) if t in _REL_OPS]
    if not toks:
        return None
    pieces, ops, last = [], [], 0
    for i, t in toks:
        pieces.append(s[last:i].strip())
        ops.append(_REL_OPS[t])
        last = i + len(t)
    pieces.append(s[last:].strip())
    if any(not p for p in pieces):
        return None
    if all(o == "=" for o in ops):
        if all(_is_simple_var(p) for p in pieces[:-1]):
            value = parse_structure(pieces[-1], depth + 1)
            return None if value is None else Assign(pieces[0].replace(" ", ""), value)
        if len(pieces) == 2:
            return Rel("=", pieces[0], pieces[1])
        # A chain "x = 5 + 5 + 1 = 11": the working ends in its last member, which is the answer.
        value = parse_structure(pieces[-1], depth + 1)
        if value is None:
            return None
        return Assign(pieces[0].replace(" ", ""), value) if _is_simple_var(pieces[0]) else value
    interval = _relation_to_interval(pieces, ops)
    if interval is not None:
        return interval
    if len(pieces) == 2:
        return Rel(ops[0], pieces[0], pieces[1])
    return None


def _relation_to_interval(pieces: list[str], ops: list[str]) -> Seq | None:
    """``x > 3`` -> ``(3, oo)``; ``1 <= x < 2`` -> ``[1, 2)``: one variable against constants."""
    if "=" in ops or "!=" in ops:
        return None
    inf, ninf = Scalar(r"\infty"), Scalar(r"-\infty")
    if len(pieces) == 2:
        pieces, ops = _solve_linear(pieces, ops)
        (a, b), op = pieces, ops[0]
        if _is_simple_var(b) and _var_free(a) and not (_is_simple_var(a) and _var_free(b)):
            a, b = b, a
            op = {"<": ">", ">": "<", "<=": ">=", ">=": "<="}[op]
        elif not (_is_simple_var(a) and _var_free(b)):
            return None
        bound = _parse_scalar(b)
        if not isinstance(bound, Scalar):
            return None
        if op in ("<", "<="):
            return Seq("(", ")" if op == "<" else "]", [ninf, bound])
        return Seq("(" if op == ">" else "[", ")", [bound, inf])
    if len(pieces) == 3 and _is_simple_var(pieces[1]) and _var_free(pieces[0]) and _var_free(pieces[2]):
        if all(o in ("<", "<=") for o in ops):
            lo, hi = _parse_scalar(pieces[0]), _parse_scalar(pieces[2])
            return Seq("(" if ops[0] == "<" else "[", ")" if ops[1] == "<" else "]", [lo, hi])
        if all(o in (">", ">=") for o in ops):
            lo, hi = _parse_scalar(pieces[2]), _parse_scalar(pieces[0])
            return Seq("(" if ops[1] == ">" else "[", ")" if ops[0] == ">" else "]", [lo, hi])
    return None


_LINEAR = re.compile(r"(?P<sign>[+-]?)\s*(?P<coef>\d+(?:\.\d+)?|\\frac\{\d+\}\{\d+\}|\d+/\d+)?"
                     r"\s*\*?\s*(?P<var>[A-Za-z])", re.A)
_FLIP = {"<": ">", ">": "<", "<=": ">=", ">=": "<="}


def _solve_linear(pieces: list[str], ops: list[str]) -> tuple[list[str], list[str]]:
    """``c x OP d`` with numbers ``c != 0`` and ``d`` -> ``x OP' d/c`` (flipped when ``c < 0``):
    ``-x > -1`` is ``x < 1``, ``2x < 2`` is ``x < 1``. Anything else is returned unchanged."""
    for side in (0, 1):
        m = _LINEAR.fullmatch(pieces[side].strip())
        d = parse_number(pieces[1 - side])
        if not m or d is None or not (m["sign"] or m["coef"]):
            continue
        c = parse_number(m["coef"]) if m["coef"] else Num(Fraction(1))
        if c is None or c.value == 0:
            continue
        coef = -c.value if m["sign"] == "-" else c.value
        bound = d.value / coef
        op = ops[0] if side == 0 else _FLIP[ops[0]]  # now "var OP bound"
        if coef < 0:
            op = _FLIP[op]
        text = (str(bound.numerator) if bound.denominator == 1 else
                r"%s\frac{%d}{%d}" % ("-" if bound < 0 else "", abs(bound.numerator), bound.denominator))
        return [m["var"], text], [op]
    return pieces, ops


def _parse_scalar(s: str) -> Node | None:
    s = s.strip()
    if not s or not _balanced(s):
        return None
    for pm, first, second in ((r"\pm", "+", "-"), (r"\mp", "-", "+")):
        if pm in s:
            if s.count(pm) != 1 or (r"\pm" in s and r"\mp" in s):
                return None
            return Bag([_parse_scalar(s.replace(pm, first)), _parse_scalar(s.replace(pm, second))])
    body, flag = _split_flag(s)
    if not body or re.search(r"\d\s+\d", body, re.A):
        return None  # "2 3": digits are never joined across a space, nor read as a product
    if ":" in body:
        return Text(body)  # a time or ratio not caught by fast_equal: exact text only
    if _looks_like_text(body):
        return Text(re.sub(r"\s+", " ", body).lower())
    return Scalar(body, flag)


def _looks_like_text(s: str) -> bool:
    if not re.fullmatch(r"[A-Za-z][A-Za-z '\-]*", s):
        return False
    words = s.split()
    return len(words) > 1 or (len(s) >= 4 and s.lower() not in _MATH_WORDS)


# --------------------------------------------------------------------------------------------
# SymPy side (worker process only)
# --------------------------------------------------------------------------------------------


class Unsafe(Exception):
    """The expression would be too large to evaluate."""


class _Lazy:
    """SymPy and the LaTeX parser, imported on first use (only the worker needs them)."""

    def __init__(self) -> None:
        self.ready = False

    def load(self) -> "_Lazy":
        if self.ready:
            return self
        import sympy
        from latex2sympy2_extended import latex2sympy
        from latex2sympy2_extended.latex2sympy2 import ConversionConfig
        from latex2sympy2_extended.math_normalization import NormalizationConfig

        self.sympy = sympy
        self.latex2sympy = latex2sympy
        # Our own cleaning already ran; keep the library's basic fixes (\frac12, \sqrt2) only.
        self.norm = NormalizationConfig(basic_latex=True, units=False, malformed_operators=True,
                                        nits=False, boxed="none", equations=False)
        # Mixed numbers (2\frac{1}{2}) are read by parse_number; inside expressions it's a product.
        self.conv = ConversionConfig(interpret_as_mixed_fractions=False,
                                     interpret_simple_eq_as_assignment=False,
                                     interpret_contains_as_eq=False, lowercase_symbols=False)
        self.ready = True
        return self


_L = _Lazy()


def load_parsers() -> None:
    """Import sympy and the LaTeX parser now rather than at the first comparison (a worker warms them
    before it says it is ready)."""
    _L.load()


@dataclass
class _Val:
    """Parsed value of a scalar: a written number, a SymPy expression, or text."""

    num: Num | None = None
    expr: Any = None
    text: str | None = None
    extra: dict = field(default_factory=dict)


def _check_size(func: Any, args: list) -> None:
    """Refuse to build huge integers: the check runs before SymPy evaluates the node."""
    sp = _L.sympy
    if func is sp.Pow and len(args) == 2:
        base, exp = args
        if base.is_Rational and exp.is_Rational and abs(exp) > 1:
            size = max(abs(base.p), abs(base.q))
            if size > 1:
                digits = float(abs(exp)) * (size.bit_length() * 0.30103)
                if digits > MAX_DIGITS:
                    raise Unsafe("power too large")
    elif func in (sp.factorial, sp.factorial2, sp.subfactorial, sp.binomial, sp.fibonacci, sp.lucas):
        for a in args:
            if a.is_Integer and abs(a) > MAX_FACTORIAL:
                raise Unsafe("factorial too large")


def _rebuild(e: Any, depth: int = 0) -> Any:
    """Evaluate an unevaluated SymPy tree bottom-up, checking sizes before each node."""
    sp = _L.sympy
    if depth > 200:
        raise Unsafe("too deep")
    if not isinstance(e, sp.Basic) or not e.args or e.is_Atom:
        return e
    args = [_rebuild(a, depth + 1) for a in e.args]
    _check_size(e.func, args)
    try:
        return e.func(*args)
    except TypeError:
        return e  # exotic constructors that cannot be rebuilt from args: keep as parsed


@functools.lru_cache(maxsize=2048)
def _sympy_of(text: str) -> Any:
    """LaTeX -> evaluated SymPy object; raises on failure or Unsafe."""
    sp = _L.load().sympy
    try:
        with sp.evaluate(False):  # unevaluated, so _rebuild can check sizes before evaluating
            e = _L.latex2sympy(text, normalization_config=_L.norm, conversion_config=_L.conv)
    except TypeError:
        # A few parser rules need evaluation; allowed only where nothing can grow huge.
        if re.search(r"\^|!|binom|\d{7}", text):
            raise
        e = _L.latex2sympy(text, normalization_config=_L.norm, conversion_config=_L.conv)
    e = _rebuild(e)
    if isinstance(e, sp.Basic) and e.has(sp.Float):
        # Decimals inside expressions are exact rationals, like plain decimals are.
        e = e.xreplace({f: sp.Rational(str(f)) for f in e.atoms(sp.Float)})
    return e


def _value(sc: Scalar) -> _Val:
    """Parse one scalar leaf. Raises on unparseable input."""
    n = parse_number(sc.text)
    if n is not None:
        return _Val(num=n)
    e = _sympy_of(sc.text)
    sp = _L.sympy
    if not isinstance(e, sp.Expr):
        raise ValueError(f"not a scalar expression: {type(e).__name__}")
    return _Val(expr=e)


def _as_expr(v: _Val) -> Any:
    sp = _L.load().sympy
    if v.expr is not None:
        return v.expr
    return sp.Rational(v.num.value.numerator, v.num.value.denominator)


def _numeric(e: Any, prec: int = 60) -> Any:
    """High-precision numeric value of a constant expression, or None."""
    sp = _L.sympy
    try:
        v = e.evalf(prec)
    except Exception:  # noqa: BLE001 - any SymPy failure means "not a number we can check"
        return None
    if not v.is_number or v.has(sp.nan, sp.zoo, sp.oo, -sp.oo):
        return None
    return v


def _close(a: Any, b: Any, digits: int) -> bool:
    sp = _L.sympy
    try:
        diff = abs(sp.N(a - b, digits + 20))
        scale = max(abs(sp.N(a, digits + 20)), abs(sp.N(b, digits + 20)))
        if scale == 0:
            return diff == 0
        return bool(diff <= scale * sp.Float(10) ** (-digits))
    except Exception:  # noqa: BLE001
        return False


_SAMPLES = (0.5713, -1.2471, 2.3319, 0.1337, -3.0917)


def _sym_equal(a: Any, b: Any) -> bool:
    """Equality of two SymPy expressions (see the module docstring for the rule)."""
    sp = _L.sympy
    if a == b:
        return True
    if a.has(sp.oo, -sp.oo, sp.zoo, sp.nan) or b.has(sp.oo, -sp.oo, sp.zoo, sp.nan):
        return bool(sp.simplify(a - b) == 0) if not (a.is_infinite or b.is_infinite) else a == b
    syms = a.free_symbols | b.free_symbols
    if not syms:
        if a.is_Rational and b.is_Rational:
            return a == b
        va, vb = _numeric(a), _numeric(b)
        if va is None or vb is None:
            return bool(sp.simplify(a - b) == 0)
        return _close(va, vb, 40)
    verdict = _sample_equal(a, b, sorted(syms, key=lambda s: s.name))
    if verdict is not None:
        return verdict
    return bool(sp.simplify(a - b) == 0)


def _evaluations(a: Any, b: Any, syms: list) -> Iterator[tuple[Any, Any]]:
    """``a`` and ``b`` evaluated to 50 digits at each of the fixed pseudo-random points (one value of
    ``_SAMPLES`` per symbol of ``syms``, shifted per point); a point where either fails is skipped."""
    sp = _L.sympy
    for k in range(len(_SAMPLES)):
        subs = {s: sp.Float(_SAMPLES[(k + j) % len(_SAMPLES)] + 0.1 * j, 50) for j, s in enumerate(syms)}
        try:
            va, vb = a.evalf(50, subs=subs), b.evalf(50, subs=subs)
        except Exception:  # noqa: BLE001
            continue
        yield va, vb


def _sample_equal(a: Any, b: Any, syms: list) -> bool | None:
    """Compare at fixed pseudo-random points; None when too few points evaluate."""
    sp = _L.sympy
    good = 0
    for va, vb in _evaluations(a, b, syms):
        if not (va.is_number and vb.is_number) or va.has(sp.nan, sp.zoo) or vb.has(sp.nan, sp.zoo):
            continue
        if not _close(va, vb, 25):
            return False
        good += 1
    return True if good >= 3 else None


def _imaginary(e: Any) -> Any:
    """Read a free symbol ``i`` as the imaginary unit (answers like ``3+2i``)."""
    sp = _L.sympy
    return e.xreplace({s: sp.I for s in e.free_symbols if s.name == "i"})


def _val_equal(x: _Val, y: _Val) -> bool:
    if x.num is not None and y.num is not None:
        return num_equal(x.num, y.num)
    return _sym_equal(_imaginary(_as_expr(x)), _imaginary(_as_expr(y)))


def _scalar_equal(p: Scalar, g: Scalar) -> bool:
    if p.text == g.text and p.flag == g.flag:
        return True
    pv, gv = _value(p), _value(g)
    for a in _candidates(pv, p.flag, g.flag):
        for b in _candidates(gv, g.flag, p.flag):
            if _val_equal(a, b):
                return True
    return False


def _candidates(v: _Val, flag: str, other: str) -> list[_Val]:
    """Readings of a flagged value against an unflagged one: 50% is 0.5 only; 30 degrees is 30
    or pi/6 (module docstring)."""
    if not flag or flag == other:
        return [v]
    sp = _L.load().sympy
    if flag == "%":
        if v.num is not None:
            return [_Val(num=_percent_value(v.num, "%", ""))]
        return [_Val(expr=_as_expr(v) * sp.Rational(1, 100))]
    return [v, _Val(expr=_as_expr(v) * sp.pi / 180)]


def _rel_expr(r: Rel | Assign) -> tuple[str, Any]:
    """Normal form ``(op, e)`` meaning ``e op 0`` with op in {=, >, >=, !=}."""
    sp = _L.load().sympy
    if isinstance(r, Assign):
        if not isinstance(r.value, Scalar):
            raise ValueError("structured assignment")
        lhs, rhs, op = _sympy_of(r.var), _as_expr(_value(r.value)), "="
    else:
        lhs, rhs, op = _sympy_of(r.lhs), _sympy_of(r.rhs), r.op
    if not (isinstance(lhs, sp.Expr) and isinstance(rhs, sp.Expr)):
        raise ValueError("relation sides must be expressions")
    if op in ("<", "<="):
        return {"<": ">", "<=": ">="}[op], rhs - lhs
    return op, lhs - rhs


def _rel_equal(p: Rel | Assign, g: Rel | Assign) -> bool:
    """Same relation up to a constant factor (positive for inequalities)."""
    sp = _L.sympy
    (op1, e1), (op2, e2) = _rel_expr(p), _rel_expr(g)
    if op1 != op2:
        return False
    if e1 == 0 or e2 == 0:
        return e1 == e2
    syms = sorted(e1.free_symbols | e2.free_symbols, key=lambda s: s.name)
    ratios = []
    for v1, v2 in _evaluations(e1, e2, syms):
        if not (v1.is_number and v2.is_number) or abs(v2) < 1e-30:
            continue
        ratios.append(v1 / v2)
    if len(ratios) < 3:
        ratio = sp.simplify(e1 / e2)
        ok = not ratio.free_symbols and ratio != 0
        return bool(ok and (op1 in ("=", "!=") or ratio.is_positive))
    r0 = ratios[0]
    if abs(r0) < 1e-30 or not all(_close(r, r0, 20) for r in ratios[1:]):
        return False
    return op1 in ("=", "!=") or bool(sp.re(r0) > 0)


def nodes_equal(p: Node, g: Node) -> bool:
    """Structural comparison; leaves go to SymPy."""
    if isinstance(p, Assign) and isinstance(g, Assign):
        # The variable's name is notation (k = 5 vs x = 5); if the values differ the two may
        # still be the same equation written for another variable (y = 2x vs x = y/2).
        if nodes_equal(p.value, g.value):
            return True
        return p.var != g.var and _rel_equal(p, g)
    if isinstance(p, Assign) and not isinstance(g, Rel):
        return nodes_equal(p.value, g)
    if isinstance(g, Assign) and not isinstance(p, Rel):
        return nodes_equal(p, g.value)
    if isinstance(p, (Rel, Assign)) and isinstance(g, (Rel, Assign)):
        return _rel_equal(p, g)
    if isinstance(p, Bag) and isinstance(g, Bag):
        return p.kind == g.kind and _match_unordered(p.items, g.items)
    if isinstance(p, Bag) and len(p.items) == 1 and p.kind == "set":
        return nodes_equal(p.items[0], g)
    if isinstance(g, Bag) and len(g.items) == 1 and g.kind == "set":
        return nodes_equal(p, g.items[0])
    if isinstance(p, Seq) and isinstance(g, Seq):
        return (p.open, p.close) == (g.open, g.close) and len(p.items) == len(g.items) and all(
            nodes_equal(a, b) for a, b in zip(p.items, g.items))
    if isinstance(p, Matrix) and isinstance(g, Matrix):
        return (len(p.rows), len(p.rows[0])) == (len(g.rows), len(g.rows[0])) and all(
            nodes_equal(a, b) for ra, rb in zip(p.rows, g.rows) for a, b in zip(ra, rb))
    if isinstance(p, Text) and isinstance(g, Text):
        return p.text == g.text
    if isinstance(p, Scalar) and isinstance(g, Scalar):
        return _scalar_equal(p, g)
    return False


def _match_unordered(ps: list, gs: list) -> bool:
    """Two small unordered collections hold the same answers: a perfect matching, or (as
    math-verify compares lists as sets) every answer of each side is one of the other side's,
    so a repeated answer neither adds nor misses one."""
    if max(len(ps), len(gs)) > 12 or not ps or not gs:
        return len(ps) == len(gs) == 0  # keep the search bounded; such answers are not results
    memo: dict[tuple[int, int], bool] = {}

    def eq(i: int, j: int) -> bool:
        if (i, j) not in memo:
            try:
                memo[(i, j)] = nodes_equal(ps[i], gs[j])
            except Exception:  # noqa: BLE001
                memo[(i, j)] = False
        return memo[(i, j)]

    def solve(i: int, used: frozenset) -> bool:
        if i == len(ps):
            return True
        return any(solve(i + 1, used | {j}) for j in range(len(gs)) if j not in used and eq(i, j))

    if len(ps) == len(gs) and solve(0, frozenset()):
        return True
    return (all(any(eq(i, j) for j in range(len(gs))) for i in range(len(ps)))
            and all(any(eq(i, j) for i in range(len(ps))) for j in range(len(gs))))


def _leaves(n: Node):
    if isinstance(n, (Scalar, Text)):
        yield n
    elif isinstance(n, (Seq, Bag)):
        for c in n.items:
            yield from _leaves(c)
    elif isinstance(n, Matrix):
        for r in n.rows:
            for c in r:
                yield from _leaves(c)
    elif isinstance(n, Assign):
        yield from _leaves(n.value)


def _parsed(text: Any) -> Node | None:
    """The structure of an answer after :func:`clean`; None when nothing is left or it does not parse."""
    cleaned = clean(text)
    return parse_structure(cleaned) if cleaned else None


def _gold_node(gold: str) -> Node | None:
    """Parse the reference; None when any part of it cannot be read (not scorable)."""
    node = _parsed(gold)
    if node is None:
        return None
    for leaf in _leaves(node):
        if isinstance(leaf, Scalar):
            _value(leaf)  # raises when unreadable
    if isinstance(node, Rel):
        _rel_expr(node)
    return node


def compare(pred: Any, gold: Any) -> bool | None:
    """Full equivalence check. ``None`` when the gold answer itself cannot be parsed."""
    try:
        g = _gold_node(gold)
    except Exception:  # noqa: BLE001 - any parse failure of the reference
        return None
    if g is None:
        return None
    quick = fast_equal(pred, gold)
    if quick is not None:
        return quick
    p = _parsed(pred)
    if p is None:
        return False
    try:
        return bool(nodes_equal(p, g))
    except (Exception, RecursionError):  # noqa: BLE001 - unparseable prediction is just wrong
        return False
