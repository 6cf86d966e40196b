"""grpo.__main__ (the ``python -m grpo`` command line): usage errors come before any model is loaded."""

from __future__ import annotations

import pytest

from grpo.__main__ import main as cli


def test_cli_usage_errors_come_before_any_model(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli(["--help"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("usage: python -m grpo")
    for argv, message in (
        ([], "required: command"),
        (["fit"], "invalid choice: 'fit'"),
        (["demo", "--backend", "foo"], "argument --backend: invalid choice: 'foo'"),
        (["demo", "--grpo-steps", "0"], "--grpo-steps: must be >= 1"),
        (["train", "--model", "nowhere", "--data", str(tmp_path / "missing.jsonl"), "--eps-high", "None"], "--data: "),
        (["train", "--model", "nowhere", "--data", "x", "--eps-high", "high"], "expected a float or None, got 'high'"),
        (["train", "--model", "nowhere", "--data", "x", "--rewards", "nope"], "--rewards: unknown reward 'nope'"),
    ):
        with pytest.raises(SystemExit) as exit_:
            cli(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err and "usage:" in err, (argv, err)
    with pytest.raises(SystemExit):
        cli(["demo", "--help"])
    assert "{auto,triton,torch,reference}" in capsys.readouterr().out
