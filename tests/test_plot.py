"""grpo.plot: the curves drawn in a child process, never importing matplotlib into the caller."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from grpo.plot import plot_in_subprocess

PLOT_PY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "grpo", "plot.py")
RECORDS = [{"step": 1, "reward": 0.5, "kl": None, "grad_norm": 1.0}, {"step": 2, "reward": 0.75, "grad_norm": 0.5}]


def test_the_child_draws_the_png_and_the_caller_never_imports_matplotlib(tmp_path):
    png = tmp_path / "curves.png"
    script = textwrap.dedent(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("plot", {PLOT_PY!r})
        plot = importlib.util.module_from_spec(spec); spec.loader.exec_module(plot)
        assert plot.plot_in_subprocess({RECORDS!r}, {str(png)!r}) == {str(png)!r}
        assert "matplotlib" not in sys.modules, "the caller imported matplotlib"
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    assert not (tmp_path / "curves.png.tmp.png").exists()


def test_a_child_that_fails_is_an_error_naming_the_path(tmp_path):
    path = str(tmp_path / "no-such-dir" / "curves.png")
    with pytest.raises(RuntimeError, match="no-such-dir"):
        plot_in_subprocess(RECORDS, path)
    assert plot_in_subprocess([], path) is None
