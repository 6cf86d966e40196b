"""Run ``uv pip <command>`` for the venv whose Python runs this script, with pip's index settings.

Usage (the Makefile's installs): ``<venv>/bin/python tools/uv_pip.py <uv> install|uninstall ARGS...``

uv installs the same packages as pip several times faster (parallel downloads and unpacking, one shared
cache that the five test venvs hardlink from, no bytecode compiled up front), but it reads neither pip's
configuration files nor its ``PIP_*`` variables. So this asks pip (``pip config list``, run by the same
venv's Python, so the venv's own pip.conf counts too) for what selects packages, and passes it on:

- ``index-url``, ``extra-index-url``, ``find-links`` and ``constraint`` (a machine's local mirror, its
  wheel folder and its version caps), with pip's precedence: a ``PIP_*`` variable over the ``[install]``
  section over ``[global]``; ``no-index`` too;
- ``--index-strategy unsafe-best-match``: pip takes the highest version over all its indexes, while uv by
  default takes a package from the first index that has it;
- pip's ``cert`` as ``SSL_CERT_FILE`` (unless that is set already): the CA bundle pip trusts.

The result is what ``pip install`` would have installed (the Makefile's history compares ``pip freeze``).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

# pip's option name -> uv's, for options that take values (list-valued ones repeat the flag per value)
_VALUED = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
           "constraint": "--constraint"}
_LISTS = {"extra-index-url", "find-links", "constraint"}
_TRUE = {"1", "true", "yes", "on"}


def pip_settings(python: str) -> dict[str, str]:
    """pip's effective value of each option that ``pip install`` would use: env over [install] over [global]."""
    listed = subprocess.run([python, "-m", "pip", "config", "list", "--disable-pip-version-check"],
                            check=True, capture_output=True, text=True).stdout
    by_section: dict[str, dict[str, str]] = {}
    for line in listed.splitlines():
        key, sep, value = line.partition("=")
        section, dot, name = key.rpartition(".")
        if not sep or not dot:
            continue
        by_section.setdefault(section, {})[name] = ast.literal_eval(value)  # pip prints each value's repr
    merged: dict[str, str] = {}
    for section in ("global", "install", ":env:"):  # lowest precedence first
        merged.update(by_section.get(section, {}))
    return merged


def uv_arguments(settings: dict[str, str], given: list[str]) -> list[str]:
    """uv pip install's arguments for pip's settings (see the module docstring), less an index URL that the
    command line ``given`` sets itself (as on pip's command line, it replaces the configured one)."""
    args = ["--index-strategy", "unsafe-best-match"]
    for name, flag in _VALUED.items():
        value = settings.get(name)
        if value and not (name == "index-url" and flag in given):
            for item in (value.split() if name in _LISTS else [value]):
                args += [flag, item]
    if settings.get("no-index", "").strip().lower() in _TRUE:
        args.append("--no-index")
    return args


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[1] not in ("install", "uninstall"):
        sys.exit("usage: <venv>/bin/python tools/uv_pip.py <uv> install|uninstall ARGS...")
    uv, command, rest = argv[0], argv[1], argv[2:]
    args = [uv, "pip", command, "--python", sys.executable]
    if command == "install":
        settings = pip_settings(sys.executable)
        args += uv_arguments(settings, rest)
        if settings.get("cert"):
            os.environ.setdefault("SSL_CERT_FILE", settings["cert"])
    os.execv(uv, args + rest)


if __name__ == "__main__":
    main(sys.argv[1:])
