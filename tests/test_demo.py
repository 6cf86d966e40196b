"""grpo.demo: the demo owns its output directory and refuses another run's."""

from __future__ import annotations

import os

import pytest

from grpo import demo


def test_the_demo_owns_its_directory_and_refuses_another_runs(tmp_path, capsys):
    out = str(tmp_path / "demo")
    demo.claim_output_dir(out)  # a fresh directory
    open(os.path.join(out, "checkpoint.pt"), "wb").close()  # as the first demo run leaves it
    demo.claim_output_dir(out)
    assert "the demo's own directory; its previous run is replaced" in capsys.readouterr().out
    assert not os.path.exists(os.path.join(out, "checkpoint.pt"))
    other = tmp_path / "training"
    other.mkdir()
    (other / "checkpoint.pt").write_bytes(b"")
    with pytest.raises(FileExistsError, match="not the demo's"):
        demo.claim_output_dir(str(other))
