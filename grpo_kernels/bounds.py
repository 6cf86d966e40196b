"""Each option declared once: its type, range, choices and help, in its dataclass field's metadata.

An option is a dataclass field made by :func:`option`::

    beta: float = option(0.0, "KL coefficient", bounds=at_least(0))
    eps_low: float = option(0.2, "lower clip", bounds=Bounds(0, 1, high_open=True),
                            bounds_under={"cispo": Bounds(0, 1)})

and :meth:`Declaration.check` (:func:`declarations`, :func:`check_fields`) is the one check of a value
against that declaration: the type from the
field's annotation (``float``, ``int``, ``bool``, ``str``, ``list[float]``, each maybe ``Optional``),
then the choices, then the range (:class:`Bounds`; ``bounds_under`` replaces it under a given
``loss_mode``). ``grpo_kernels.GRPOOptions``, ``grpo.GRPOConfig``, the command lines generated from
the config (``python -m grpo train`` / ``plan``) and the public functions all check through it, so a
value refused at one entry point is refused at every one, with the same words.

Errors are :class:`OptionError` (a ``ValueError``) or :class:`OptionTypeError` (a ``TypeError``, and a
``ValueError`` too); both remember which option names their message mentions, so each entry point
re-words them in the spelling its user typed (:meth:`OptionError.respelled`): verl's
``clip_ratio_low`` for ``eps_low`` in a function call, ``GRPOConfig.vllm_importance_sampling_clip_max``
for ``rollout_correction_max`` in the config, ``--vllm-importance-sampling-clip-max`` on the command line.

Public API (``docs/api.md``, "Public modules"): a trainer declares its own options with these names
(``grpo.GRPOConfig`` does), so its checks and errors are the kernels'.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Mapping, NamedTuple, Optional, Tuple

import numpy as np

import torch


# --------------------------------------------------------------------------------------------------
# errors that name options, re-worded at each entry point
# --------------------------------------------------------------------------------------------------
class OptionError(ValueError):
    """A refused option value. ``names``: the option names the message mentions, the first the one
    refused; :meth:`respelled` writes them as an entry point's user spelled them."""

    def __init__(self, message: str, *names: str) -> None:
        super().__init__(message)
        self.message, self.names = message, tuple(names)

    def respelled(self, spelling: Mapping[str, str], first: Optional[str] = None) -> "OptionError":
        """The same error with each name in ``spelling`` replaced by its value (whole words only);
        ``first``, when given, replaces the first mention of the first name (e.g. ``GRPOConfig.eps_low``)."""
        message, names = self.message, []
        for i, name in enumerate(self.names):
            word = rf"(?<![\w.\-]){re.escape(name)}(?![\w])"
            if i == 0 and first is not None:  # its first mention only; the others as spelled
                message = re.sub(word, lambda _: first, message, count=1)
            new = spelling.get(name, name)
            if new != name:
                message = re.sub(word, lambda _: new, message)
            names.append(first if i == 0 and first is not None else new)
        error = type(self)(message, *names)
        error.__cause__ = self.__cause__
        return error


class OptionTypeError(OptionError, TypeError):
    """A value of the wrong type for an option (a ``TypeError``; also a ``ValueError``, as an
    invalid value, for callers that catch that)."""


# --------------------------------------------------------------------------------------------------
# ranges
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bounds:
    """An interval a number must lie in (NaN never does; infinities only when ``finite`` is False)."""

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False  # low < x, not low <= x
    high_open: bool = False  # x < high, not x <= high
    finite: bool = True

    def holds(self, x: float) -> bool:
        if not isinstance(x, numbers.Integral) and (math.isnan(x) or (self.finite and math.isinf(x))):
            return False  # (an int is finite, and may be too large for a float)
        if self.low is not None and not (x > self.low if self.low_open else x >= self.low):
            return False
        return self.high is None or (x < self.high if self.high_open else x <= self.high)

    def __str__(self) -> str:
        return self.describe()

    def describe(self, integer: bool = False) -> str:
        """E.g. ``">= 0, < 1"``, ``"> 0, finite"``; ``integer``: the value is an int (always finite)."""
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {_number(self.low)}")
        if self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {_number(self.high)}")
        if self.finite and not integer and (self.low is None or self.high is None):
            parts.append("finite")
        return ", ".join(parts)


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 2**53 else f"{x:g}"


def at_least(low: float) -> Bounds:
    return Bounds(low=low)


def above(low: float, finite: bool = True) -> Bounds:
    return Bounds(low=low, low_open=True, finite=finite)


FINITE = Bounds()
ZERO_TO_ONE = Bounds(low=0, high=1, high_open=True)  # [0, 1)
UNIT_INTERVAL = Bounds(low=0, high=1)  # [0, 1]
FRACTION = Bounds(low=0, high=1, low_open=True)  # (0, 1]


# --------------------------------------------------------------------------------------------------
# the declaration: a dataclass field whose metadata is the option's whole definition
# --------------------------------------------------------------------------------------------------
def option(default: Any, help: str, *, choices: Optional[tuple] = None, bounds: Optional[Bounds] = None,
           bounds_under: Optional[Mapping[str, Bounds]] = None, refused: Optional[Mapping[str, str]] = None,
           why: str = "", words: bool = False, parse: Optional[Callable[[str], Any]] = None) -> Any:
    """A dataclass field declaring an option: its default, ``help``, and where it has them its
    ``choices`` or its range ``bounds`` (``bounds_under``: another range under a ``loss_mode``, e.g.
    ``{"cispo": Bounds(0, 1)}``; ``refused``: values refused with a reason rather than the choice list;
    ``why``: the reason for a range that is not obvious, added to the error; ``words``: a
    comma-separated str whose command-line flag also takes several words; ``parse``: how its flag's text is
    read, when not by the type). The type is the field's annotation; ``dataclasses.MISSING``: no default.
    :meth:`Declaration.check` reads all of it."""
    return field(default=default, metadata={"help": help, "choices": choices, "bounds": bounds,
                                            "bounds_under": dict(bounds_under or {}), "refused": dict(refused or {}),
                                            "why": why, "words": words, "parse": parse})


def like(declared: "dataclasses.Field", default: Any = dataclasses.MISSING, help: Optional[str] = None) -> Any:
    """Another class's field with ``declared``'s metadata (type, range, choices: the same objects),
    e.g. a config field that sets a loss option under another name; ``default`` / ``help`` may differ."""
    meta = dict(declared.metadata)
    if help is not None:
        meta["help"] = help
    return field(default=declared.default if default is dataclasses.MISSING else default, metadata=meta)


def describe_bounds(f: "dataclasses.Field", integer: bool = False) -> str:
    """The range of ``f`` in words, with its ``loss_mode`` exceptions: ``">= 0, < 1; cispo: >= 0, <= 1"``."""
    bounds = f.metadata.get("bounds")
    text = bounds.describe(integer) if bounds is not None else ""
    under: Dict[str, list] = {}
    for mode, b in (f.metadata.get("bounds_under") or {}).items():
        under.setdefault(b.describe(integer), []).append(mode)
    extra = "; ".join(f"{', '.join(modes)}: {words}" for words, modes in under.items())
    return "; ".join(t for t in (text, extra) if t)


def kind_of(hint: Any) -> Tuple[Any, bool]:
    """(the value type, optional) of an annotation: ``Optional[float]`` -> (float, True)."""
    if typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return (args[0] if len(args) == 1 else hint), type(None) in typing.get_args(hint)
    return hint, False


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _as_bool(x: Any) -> Optional[bool]:
    """A real bool (Python, NumPy, a 0-d torch bool tensor) as ``bool``; None for anything else
    (a truthy string, 0 / 1, None)."""
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, torch.Tensor) and x.dtype == torch.bool and x.dim() == 0:
        return bool(x)
    return None


_EXPECTED = {bool: "a bool (True or False)", int: "an int", float: "a real number", str: "a str"}


def _type_error(name: str, value: Any, expected: str, optional: bool) -> OptionTypeError:
    return OptionTypeError(f"{name} must be {expected}{' or None' if optional else ''}, got "
                           f"{type(value).__name__} {value!r}", name)


def check_value(name: str, value: Any, kind: Any, *, optional: bool = False, bounds: Optional[Bounds] = None,
                choices: Optional[Iterable] = None, refused: Optional[Mapping[str, str]] = None, why: str = "",
                convert: bool = True) -> Any:
    """``value`` checked against a declaration: type ``kind`` (``float``, ``int``, ``bool``, ``str`` or
    ``list[float]``), None only when ``optional``, one of ``choices``, within ``bounds``. Returns it
    normalised (``convert``: a NumPy number as a Python one, a 0-d bool tensor as a bool) or raises
    :class:`OptionTypeError` / :class:`OptionError` naming ``name``."""
    if value is None:
        if optional:
            return None
        if choices is not None:
            raise OptionError(f"{name} must be one of {tuple(choices)}, got None", name)
        raise _type_error(name, value, _EXPECTED.get(kind, str(kind)), False)
    if typing.get_origin(kind) is list:
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or not all(_is_real(v) for v in value):
            raise _type_error(name, value, "a list of numbers", optional)
        checked = [check_value(f"{name}[{i}]", v, float, bounds=bounds, why=why, convert=convert)
                   for i, v in enumerate(value)]
        return checked if convert else value
    if kind is bool:
        flag = _as_bool(value)
        if flag is None:
            raise _type_error(name, value, _EXPECTED[bool], optional)
        return flag if convert else value
    if kind is str:
        if not isinstance(value, str):
            raise _type_error(name, value, f"one of {tuple(choices)}" if choices is not None else _EXPECTED[str], optional)
        if refused and value in refused:
            raise OptionError(f"{name}={value!r} is refused: {refused[value]}", name)
        if choices is not None and value not in choices:
            raise OptionError(f"{name} must be one of {tuple(choices)}, got {value!r}", name)
        return value
    if kind is int:
        if not _is_int(value):
            raise _type_error(name, value, _EXPECTED[int], optional)
        number = int(value) if convert else value
    elif kind is float:
        if not _is_real(value):
            raise _type_error(name, value, _EXPECTED[float], optional)
        number = value
        if convert:
            try:
                number = float(value)
            except OverflowError:  # an int beyond float64: not finite
                number = math.inf if value > 0 else -math.inf
    else:
        raise TypeError(f"{name}: no check for fields of type {kind!r}")
    if bounds is not None and not bounds.holds(number):
        because = f": {why}" if why else ""
        raise OptionError(f"{name} must be {bounds.describe(_is_int(value))}, got {value!r}{because}", name)
    return number


class Declaration(NamedTuple):
    """A field's declaration, read once from its annotation and metadata (:func:`declarations`)."""

    name: str
    kind: Any  # float, int, bool, str or list[float]
    optional: bool
    bounds: Optional[Bounds]
    bounds_under: Mapping[str, Bounds]
    choices: Optional[tuple]
    refused: Mapping[str, str]
    why: str

    def check(self, value: Any, *, name: Optional[str] = None, loss_mode: Optional[str] = None,
              convert: bool = True) -> Any:
        """``value`` checked as :func:`check_value` does, against this declaration (the range under
        ``loss_mode`` where it has one); errors name it ``name`` (default: the field's name)."""
        bounds = self.bounds_under.get(loss_mode, self.bounds) if loss_mode is not None else self.bounds
        return check_value(name or self.name, value, self.kind, optional=self.optional, bounds=bounds,
                           choices=self.choices, refused=self.refused, why=self.why, convert=convert)


_DECLARATIONS: Dict[type, Dict[str, Declaration]] = {}


def declarations(cls: type) -> Dict[str, Declaration]:
    """Field name -> :class:`Declaration` for dataclass ``cls``, read once and cached (a class's
    ``__post_init__`` then checks its fields without reading annotations again: cheap, and plain
    enough for torch.compile to trace)."""
    if cls not in _DECLARATIONS:
        hints = typing.get_type_hints(cls)
        out = {}
        for f in dataclasses.fields(cls):
            kind, optional = kind_of(hints[f.name])
            meta = f.metadata
            out[f.name] = Declaration(f.name, kind, optional, meta.get("bounds"), dict(meta.get("bounds_under") or {}),
                                      meta.get("choices"), dict(meta.get("refused") or {}), meta.get("why", ""))
        _DECLARATIONS[cls] = out
    return _DECLARATIONS[cls]


def check_fields(owner: type, values: Mapping[str, Any], *, loss_mode: Optional[str] = None,
                 spell: Callable[[str], str] = lambda name: name, convert: bool = True) -> Dict[str, Any]:
    """Every entry of ``values`` (field name -> value) of dataclass ``owner`` checked against its
    declaration; returns them normalised. ``spell(name)``: how errors name a field."""
    declared = declarations(owner)
    return {name: declared[name].check(value, name=spell(name), loss_mode=loss_mode, convert=convert)
            for name, value in values.items()}


def fields_by_name(cls: type) -> Dict[str, "dataclasses.Field"]:
    """Field name -> ``dataclasses.Field`` of dataclass ``cls`` (its declarations' metadata: help text)."""
    return {f.name: f for f in dataclasses.fields(cls)}


# Public API (docs/api.md, "Public modules"): the names other packages may import from this module.
__all__ = ["OptionError", "OptionTypeError", "Bounds", "at_least", "above", "FINITE", "ZERO_TO_ONE", "UNIT_INTERVAL",
           "FRACTION", "option", "like", "describe_bounds", "kind_of", "check_value", "Declaration", "declarations",
           "check_fields", "fields_by_name"]
