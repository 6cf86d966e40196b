"""How an integration follows its host (TRL, verl, OpenRLHF) by checks, not version pins.

Each integration declares the lowest host version it supports (the extra's floor in ``pyproject.toml``)
and the releases it was tested against (:data:`TESTED`, the one table; ``docs/integrations.md`` prints
it and ``tests/test_integrations_host.py`` keeps the two equal). Before it replaces anything,
``patch()`` checks that what it replaces exists with the signature it was written for
(:func:`require`, :func:`require_parameters`). Then:

- a tested release: patched;
- an untested release whose checks pass: patched, with one INFO record naming the version
  (:func:`note_untested`);
- a failed check, whatever the release: :class:`HostMismatchError` naming the host, its version and
  the missing piece; nothing is patched. Never a silent wrong answer.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
from typing import Callable, Dict, Sequence, Tuple

from packaging.version import InvalidVersion, Version

__all__ = ["TESTED", "MINIMUM", "HostMismatchError", "installed_version", "require", "require_parameters",
           "note_untested", "is_tested"]

#: host distribution -> the releases its integration is tested against (``make test`` installs the
#: newest of each: tests/test_integrations_<host>.py). The one place these numbers live in code.
TESTED: Dict[str, Tuple[str, ...]] = {
    "trl": ("1.16.0",),
    "verl": ("0.9.1",),
    "openrlhf": ("0.11.2",),
}
#: host distribution -> the lowest release it supports (the ``pyproject.toml`` extra's floor).
MINIMUM: Dict[str, str] = {host: min(versions, key=Version) for host, versions in TESTED.items()}


class HostMismatchError(RuntimeError):
    """The installed host lacks something an integration replaces or reads, or has it with another
    signature: the integration refuses to patch (its message names the host's version and the piece)."""


def installed_version(distribution: str) -> str:
    """The installed version of ``distribution`` ("unknown" when its metadata is missing, e.g. a source tree)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def is_tested(distribution: str, version: str) -> bool:
    """Whether ``version`` is one :data:`TESTED` lists for ``distribution`` (compared as versions)."""
    try:
        v = Version(version)
    except InvalidVersion:
        return False
    return any(v == Version(t) for t in TESTED[distribution])


def require(condition: bool, distribution: str, version: str, piece: str) -> None:
    """Raise :class:`HostMismatchError` unless ``condition``: ``piece`` says what is missing or different."""
    if not condition:
        tested = ", ".join(TESTED[distribution])
        raise HostMismatchError(
            f"{distribution} {version}: {piece}; grpo_kernels.integrations.{distribution} replaces it and was "
            f"written for {distribution} {tested}, so it does not patch this release (nothing was changed)")


def require_parameters(fn: Callable, expected: Sequence[str], distribution: str, version: str, what: str) -> None:
    """``fn``'s parameter names must be ``expected``, in order (``what`` names ``fn`` in the error). An
    autograd Function's ``apply`` (verl's kernel is ``LinearCrossEntropy.apply``) is judged by its
    ``forward``, less ``ctx``."""
    owner = getattr(fn, "__self__", None)
    function_apply = isinstance(owner, type) and getattr(fn, "__name__", "") == "apply"
    try:
        names = tuple(inspect.signature(owner.forward if function_apply else fn).parameters)
    except (TypeError, ValueError, AttributeError):
        names = None
    if function_apply and names and names[0] == "ctx":
        names = names[1:]
    require(names == tuple(expected), distribution, version,
            f"{what} has the parameters {names}, not {tuple(expected)}")


def note_untested(logger: logging.Logger, distribution: str, version: str) -> None:
    """One INFO record when ``version`` is not a tested release (its checks passed: it is patched)."""
    if not is_tested(distribution, version):
        logger.info("grpo_kernels.integrations.%s: %s %s is not a release this integration was tested against "
                    "(%s); what it replaces has the signatures it was written for, so it is patched",
                    distribution, distribution, version, ", ".join(TESTED[distribution]))
