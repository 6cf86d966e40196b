"""grpo_kernels.integrations._host: the tested-releases table, the extras' floors, the checks."""

from __future__ import annotations

import logging
import re

from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

from grpo_kernels.integrations import _host

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parent.parent


def docs_table() -> dict:
    """host -> tested releases, as docs/integrations.md's first table lists them."""
    text = (ROOT / "docs" / "integrations.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| (\w+) \| ([\d., ]+) \| `([^`]+)` \|", text, flags=re.M)
    return {host: (tuple(v.strip() for v in versions.split(",")), extra) for host, versions, extra in rows}


def test_docs_table_is_the_code_table():
    table = docs_table()
    assert {host: versions for host, (versions, _) in table.items()} == _host.TESTED
    for host, (_, extra) in table.items():
        assert extra == f"{host}>={_host.MINIMUM[host]}"


def test_extras_name_the_lowest_tested_release_and_no_cap():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for host in _host.TESTED:
        (spec,) = extras[host]
        req = Requirement(spec)
        assert req.name == host
        assert [(s.operator, s.version) for s in req.specifier] == [(">=", _host.MINIMUM[host])], spec
        assert Version(_host.MINIMUM[host]) == min(Version(v) for v in _host.TESTED[host])


def test_is_tested_compares_versions():
    assert _host.is_tested("verl", "0.9.1") and _host.is_tested("verl", "0.9.1.0")
    assert not _host.is_tested("verl", "0.9.2") and not _host.is_tested("verl", "unknown")


def test_require_names_the_host_its_version_and_the_piece():
    _host.require(True, "verl", "9.9", "never")
    with pytest.raises(_host.HostMismatchError, match=r"^verl 9\.9: the kernel is gone; .*nothing was changed"):
        _host.require(False, "verl", "9.9", "the kernel is gone")


def test_require_parameters_reads_functions_and_autograd_function_apply():
    def kernel(hidden, weight, labels):
        return hidden

    class Kernel(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, labels):
            return hidden

    _host.require_parameters(kernel, ("hidden", "weight", "labels"), "verl", "9.9", "kernel")
    _host.require_parameters(Kernel.apply, ("hidden", "weight", "labels"), "verl", "9.9", "Kernel")
    with pytest.raises(_host.HostMismatchError, match=r"Kernel has the parameters \('hidden', 'weight', 'labels'\)"):
        _host.require_parameters(Kernel.apply, ("hidden", "weight"), "verl", "9.9", "Kernel")


def test_note_untested_logs_once_per_call_only_for_untested(caplog):
    log = logging.getLogger("grpo_kernels.integrations.verl")
    with caplog.at_level(logging.INFO, logger=log.name):
        _host.note_untested(log, "verl", "0.9.1")
        assert not caplog.records
        _host.note_untested(log, "verl", "0.10.0")
    (record,) = caplog.records
    assert "verl 0.10.0 is not a release" in record.getMessage() and "0.9.1" in record.getMessage()
