"""tools/uv_pip.py: pip's index settings, read through pip itself, become uv's arguments."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tools/
from tools import uv_pip  # noqa: E402


def _settings_with(monkeypatch, tmp_path: Path, config: str, **env: str) -> dict[str, str]:
    """pip's effective settings with CONFIG as the configuration file pip is pointed at and ENV as the only
    PIP_* variables (the machine's own, such as a PIP_FIND_LINKS, would override the file)."""
    conf = tmp_path / "pip.conf"
    conf.write_text(config)
    for name in [n for n in os.environ if n.startswith("PIP_")]:
        monkeypatch.delenv(name)
    for name, value in dict(PIP_CONFIG_FILE=str(conf), **env).items():
        monkeypatch.setenv(name, value)
    return uv_pip.pip_settings(sys.executable)


def test_pip_precedence_variable_over_install_over_global(monkeypatch, tmp_path):
    settings = _settings_with(
        monkeypatch, tmp_path,
        "[global]\nextra-index-url = file:///a/simple\n    file:///b/simple\nfind-links = /global\nindex-url = https://g/simple\n"
        "[install]\nfind-links = /install\n",
        PIP_INDEX_URL="https://env/simple")
    assert settings["extra-index-url"].split() == ["file:///a/simple", "file:///b/simple"]
    assert settings["find-links"] == "/install"  # [install] over [global]
    assert settings["index-url"] == "https://env/simple"  # a PIP_* variable over both


def test_uv_arguments_repeat_list_options_and_keep_pips_strategy():
    args = uv_pip.uv_arguments({"extra-index-url": "file:///a\nfile:///b", "find-links": "/w",
                                "constraint": "/c.txt", "index-url": "https://i/simple", "cert": "/ca.pem"}, [])
    assert args[:2] == ["--index-strategy", "unsafe-best-match"]
    pairs = list(zip(args[2::2], args[3::2]))
    assert pairs == [("--index-url", "https://i/simple"), ("--extra-index-url", "file:///a"),
                     ("--extra-index-url", "file:///b"), ("--find-links", "/w"), ("--constraint", "/c.txt")]


def test_an_index_url_on_the_command_line_replaces_the_configured_one():
    args = uv_pip.uv_arguments({"index-url": "https://configured/simple", "no-index": "yes"},
                               ["--index-url", "https://given/simple", "torch"])
    assert "https://configured/simple" not in args and "--index-url" not in args
    assert args[-1] == "--no-index"


def test_unknown_command_is_refused_with_the_usage():
    run = subprocess.run([sys.executable, uv_pip.__file__, "uv", "download", "x"], capture_output=True, text=True)
    assert run.returncode != 0 and "usage:" in run.stderr


@pytest.mark.parametrize("value,expected", [("true", True), ("1", True), ("no", False), ("", False)])
def test_no_index_is_read_as_pip_reads_a_flag(value, expected):
    assert ("--no-index" in uv_pip.uv_arguments({"no-index": value}, [])) is expected
