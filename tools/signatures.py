"""The public functions' keyword blocks, written from the one declaration of each keyword.

The GRPO functions and modules (``grpo_loss``, ``fused_linear_grpo_loss``, their ``reference``
twins, ``GRPOLoss`` and ``FusedLinearGRPOLoss``) take every field of ``options.GRPOInputs`` and
``options.GRPOOptions`` as a keyword, plus verl's spellings (``options.VERL_SPELLINGS``,
``clip_ratio``, and the verl keys refused with what to pass instead); the log-prob functions take
``options.LogitTransform``'s fields and ``prepare.LogprobKeywords``'. Each signature writes them out,
type and default, so that ``help()``, a reader of the source and a static analyser (pyright, jedi) all
see the same keywords. This tool writes those blocks (and the dict literal that passes the GRPO keywords on)
between marker comments::

    # >>> GRPO keywords (tools/signatures.py)
    ...
    # <<< GRPO keywords

    python -m tools.signatures           # rewrite every block from the declarations
    python -m tools.signatures --check   # exit 1 naming each stale file (tests/test_signatures.py)

An option is then one field in ``options.py``; run this, and the signatures follow.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import sys
from typing import Any, Dict, List, NamedTuple, Sequence, Tuple

from grpo_kernels.options import (NOT_GIVEN, ROW_FIELD_ANNOTATIONS, VERL_SPELLINGS, VERL_WITHOUT_EQUIVALENT,
                                  GRPOInputs, GRPOOptions, LogitTransform)
from grpo_kernels.prepare import LogprobKeywords

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = ("grpo_kernels/functional.py", "grpo_kernels/reference.py", "grpo_kernels/modules.py")
# verl's clip_ratio sets both ends of the clip range (options._respell); typed as the option it fills first
CLIP_RATIO = ("clip_ratio", "eps_low")
WIDTH = 120


class Keyword(NamedTuple):
    """One keyword of a public signature: its name, its annotation as the source writes it, its default."""

    name: str
    annotation: str
    default: Any


Groups = List[Tuple[str, List[Keyword]]]  # (a comment naming the declaration, its keywords)


def _fields(cls: type, annotations: Dict[str, str] = {}) -> List[Keyword]:  # noqa: B006 (read only)
    """A dataclass's fields as keywords (annotation text: the field's, ``from __future__ import annotations``)."""
    return [Keyword(f.name, annotations.get(f.name, str(f.type)), f.default) for f in dataclasses.fields(cls)]


def or_not_given(annotation: str) -> str:
    """The annotation of a keyword that may also be left :data:`~grpo_kernels.options.NOT_GIVEN`."""
    if annotation == "Any" or "NotGiven" in annotation:
        return annotation
    if annotation.startswith("Optional[") and annotation.endswith("]"):
        return f"Union[{annotation[len('Optional['):-1]}, None, NotGiven]"
    if annotation.startswith("Union[") and annotation.endswith("]"):
        return f"Union[{annotation[len('Union['):-1]}, NotGiven]"
    return f"Union[{annotation}, NotGiven]"


def grpo_groups(inputs: type = GRPOInputs, options: type = GRPOOptions) -> Groups:
    """The GRPO keywords, grouped by their declaration (``inputs`` / ``options``: the dataclasses, or a
    derived copy in a test)."""
    ours = {k.name: k for k in _fields(inputs) + _fields(options, ROW_FIELD_ANNOTATIONS)}
    verl = [Keyword(name, or_not_given(ours[our].annotation), NOT_GIVEN)
            for name, our in list(VERL_SPELLINGS.items()) + [CLIP_RATIO]]
    return [
        ("per-call tensors, constants of the loss (options.GRPOInputs)", _fields(inputs)),
        ("the loss's options, each checked against its declaration (options.GRPOOptions)",
         _fields(options, ROW_FIELD_ANNOTATIONS)),
        ("verl's spellings of the options above (options.VERL_SPELLINGS)", verl),
        ("verl keys without an equivalent: refused, saying what to pass (options.VERL_WITHOUT_EQUIVALENT)",
         [Keyword(name, "NotGiven", NOT_GIVEN) for name in VERL_WITHOUT_EQUIVALENT]),
    ]


def per_call_groups(inputs: type = GRPOInputs, options: type = GRPOOptions) -> Groups:
    """The GRPO keywords of a module's ``forward``: each may also be left NOT_GIVEN, the module's value."""
    return [(title, [Keyword(k.name, or_not_given(k.annotation), NOT_GIVEN) for k in group])
            for title, group in grpo_groups(inputs, options)]


def logprob_groups(transform: type = LogitTransform, own: type = LogprobKeywords) -> Groups:
    """The log-prob functions' keywords, grouped by their declaration."""
    return [("the distribution: logit transform and sampler truncation (options.LogitTransform)",
             _fields(transform, ROW_FIELD_ANNOTATIONS)),
            ("the ignored id, the outputs, a replayed kept set (prepare.LogprobKeywords)", _fields(own))]


def keywords(groups: Groups) -> List[Keyword]:
    return [k for _, group in groups for k in group]


def _literal(value: Any) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def _packed(items: Sequence[str], indent: str) -> List[str]:
    """``items`` joined by ", " into lines of at most WIDTH characters, each ending with a comma."""
    lines, line = [], ""
    for item in items:
        if line and len(indent) + len(line) + len(item) + 2 > WIDTH:
            lines.append(indent + line.rstrip())
            line = ""
        line += item + ", "
    return lines + ([indent + line.rstrip()] if line else [])


def _signature_block(groups: Groups, indent: str) -> List[str]:
    out = []
    for title, group in groups:
        out.append(f"{indent}# {title}")
        out += [f"{indent}{k.name}: {k.annotation} = {_literal(k.default)}," for k in group]
    return out


def _passing_block(groups: Groups, indent: str) -> List[str]:
    """The entries of a dict literal that passes every keyword on under its own name (a literal, not
    ``dict(name=name)``: a reader, and a tool following a parameter, sees each value go into the dict)."""
    return _packed([f'"{k.name}": {k.name}' for k in keywords(groups)], indent)


# marker kind -> how its block is written
BLOCKS = {
    "GRPO keywords": lambda indent: _signature_block(grpo_groups(), indent),
    "GRPO keywords passed on": lambda indent: _passing_block(grpo_groups(), indent),
    "GRPO keywords per call": lambda indent: _signature_block(per_call_groups(), indent),
    "log-prob keywords": lambda indent: _signature_block(logprob_groups(), indent),
}
_MARKER = re.compile(r"^(?P<indent>\s*)# >>> (?P<kind>.+?) \(tools/signatures\.py\)\s*$")


def refresh(text: str) -> str:
    """``text`` with every marked block written anew (a block whose end marker is missing raises)."""
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        out.append(lines[i])
        found = _MARKER.match(lines[i])
        i += 1
        if not found:
            continue
        kind, indent = found["kind"], found["indent"]
        end = f"{indent}# <<< {kind}"
        j = i
        while j < len(lines) and lines[j] != end:
            j += 1
        if j == len(lines) or kind not in BLOCKS:
            raise ValueError(f"block {kind!r} opened at line {i} has no end marker {end.strip()!r} or is unknown")
        out += BLOCKS[kind](indent) + [end]
        i = j + 1
    return "\n".join(out)


def stale(root: pathlib.Path = ROOT) -> List[str]:
    """The files whose blocks differ from what :func:`refresh` writes."""
    return [name for name in FILES if refresh((root / name).read_text()) != (root / name).read_text()]


def main(argv: Sequence[str]) -> int:
    if "--check" in argv:
        names = stale()
        for name in names:
            print(f"{name}: a keyword block differs from the declarations; run python -m tools.signatures")
        return 1 if names else 0
    for name in FILES:
        path = ROOT / name
        text = path.read_text()
        if refresh(text) != text:
            path.write_text(refresh(text))
            print(f"rewrote {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
