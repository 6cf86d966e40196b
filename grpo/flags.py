"""Command-line flags generated from a dataclass's declared fields (``grpo_kernels.bounds.option``).

``add_config_flags(parser, GRPOConfig)`` adds one flag per field (``--max-new-tokens`` for
``max_new_tokens``), its help, choices, type and range taken from the field's declaration; an Optional
field takes ``None`` (any case), a bool field is ``--flag`` / ``--no-flag``, a field without a default
is a required flag, a field whose declaration has ``parse`` reads its text with it.
``config_from_args`` builds the dataclass from the parsed flags: the dataclass checks every value
against the same declarations, and a refusal is a usage error (exit 2) naming the flag as the user
typed it (:func:`usage_error`: ``--vllm-importance-sampling-clip-min``, not the option's Python name).
``python -m grpo train`` and ``python -m grpo plan`` (``grpo.__main__``, ``grpo.plan``) use them.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Callable, NoReturn, Optional

from grpo_kernels.bounds import OptionError, describe_bounds
from grpo_kernels.options import OPTION_NAMES  # the loss's fields, generated from the loss spec


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def flag_spelling(*classes: type) -> dict[str, str]:
    """A field's names in errors (``x``, ``Class.x``) -> its flag ``--x``, for each dataclass of ``classes``."""
    out = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            out[f.name] = out[f"{cls.__name__}.{f.name}"] = flag(f.name)
    return out


def _converter(kind: type, optional: bool) -> Callable[[str], object]:
    """argparse ``type=`` for a field of type ``kind``: ``None`` (any case) is None for an Optional
    field, and a value ``kind`` cannot parse is a usage error naming what was expected."""

    def convert(text: str):
        if optional and text.lower() == "none":
            return None
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an' if kind is int else 'a'} {kind.__name__}{' or None' if optional else ''}, got {text!r}"
            ) from None

    convert.__name__ = kind.__name__  # argparse names the type in its messages
    return convert


def _with_none(parse: Callable[[str], object]) -> Callable[[str], object]:
    """An Optional field's own parser, ``None`` (any case) read as None."""

    def convert(text: str):
        return None if text.lower() == "none" else parse(text)

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def _flag_type(hint) -> tuple[type, Optional[str], bool]:
    """(type, nargs, optional) for a field's type hint."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and len(args) == 1:
        kind, nargs, _ = _flag_type(args[0])
        return kind, nargs, True
    if typing.get_origin(hint) is list:
        return typing.get_args(hint)[0], "+", False
    return hint, None, False


def add_config_flags(parser: argparse.ArgumentParser, config_cls: type, only: Optional[tuple] = None,
                     title: Optional[str] = None) -> None:
    """One flag per field of ``config_cls`` (``only``: those fields), its help, choices and range taken
    from the field's declaration (the range under each ``loss_mode`` too); ``title``: the group's."""
    hints = typing.get_type_hints(config_cls)
    own = parser.add_argument_group(title or f"{config_cls.__name__} (in Python: grpo.{config_cls.__name__}(...))")
    loss = parser.add_argument_group("the loss (grpo_kernels.GRPOOptions; docs/api.md)") if title is None else own
    for field in dataclasses.fields(config_cls):
        if only is not None and field.name not in only:
            continue
        group = loss if field.name in OPTION_NAMES else own
        kind, nargs, optional = _flag_type(hints[field.name])
        meta = field.metadata
        nargs = "+" if meta.get("words") else nargs
        bounds = describe_bounds(field, integer=kind is int)
        required = field.default is dataclasses.MISSING
        default = "" if required else "default: %(default)s"
        text = meta.get("help", "").replace("%", "%%") + f" ({'; '.join(t for t in (bounds, default) if t)})"
        extra = dict(required=True) if required else dict(default=field.default)
        metavar = kind.__name__.upper() + ("|None" if optional else "")
        convert = meta.get("parse") or _converter(kind, optional)
        if meta.get("parse") and optional:
            convert = _with_none(convert)
        if kind is bool:
            group.add_argument(flag(field.name), action=argparse.BooleanOptionalAction, help=text, **extra)
        elif meta.get("choices") is not None:  # (an Optional field's choices include None)
            choices = (*meta["choices"], None) if optional else meta["choices"]
            metavar = "{" + ",".join(meta["choices"]) + "}" + ("|None" if optional else "")
            group.add_argument(flag(field.name), type=convert, choices=choices, metavar=metavar, help=text, **extra)
        else:
            group.add_argument(flag(field.name), type=convert, nargs=nargs, metavar=metavar, help=text, **extra)


def _list_value(name: str, values, parser: argparse.ArgumentParser):
    """A list flag's value: ``--flag None`` (alone) is None; None among numbers is a usage error."""
    if not isinstance(values, list) or None not in values:
        return values
    if len(values) > 1:
        parser.error(f"argument {name}: None stands alone (None: the field's None), got {values}")
    return None


def usage_error(parser: argparse.ArgumentParser, error: Exception, *classes: type) -> NoReturn:
    """``parser.error`` (exit 2) with ``error``'s message, the options of ``classes`` it names written as
    their flags (``grpo_kernels.bounds.OptionError``: ``GRPOConfig.eps_low`` / ``eps_low`` -> ``--eps-low``)."""
    if isinstance(error, OptionError) and classes:
        error = error.respelled(flag_spelling(*classes))
    message = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    parser.error(message)


def config_from_args(args: argparse.Namespace, config_cls: type, parser: argparse.ArgumentParser,
                     only: Optional[tuple] = None):
    """The dataclass the flags describe (``only``: those fields, the others their defaults); a value it
    refuses is a usage error naming the flag."""
    words = lambda f, v: ",".join(v) if f.metadata.get("words") and isinstance(v, list) else v  # noqa: E731
    try:
        return config_cls(**{f.name: words(f, _list_value(flag(f.name), getattr(args, f.name), parser))
                             for f in dataclasses.fields(config_cls) if only is None or f.name in only})
    except (TypeError, ValueError) as e:
        usage_error(parser, e, config_cls)
