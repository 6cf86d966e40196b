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


# ---- None on the command line for every Optional field; bad values are usage errors (exit 2)
def parse(*flags: str):
    """The GRPOConfig that ``python -m grpo train`` flags describe (the CLI's own parser), or SystemExit."""
    import argparse

    from grpo.__main__ import add_config_flags, config_from_args
    from grpo.config import GRPOConfig

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_config_flags(parser, GRPOConfig)
    return config_from_args(parser.parse_args(list(flags)), GRPOConfig, parser)


def optional_fields():
    import dataclasses
    import typing

    from grpo.config import GRPOConfig

    hints = typing.get_type_hints(GRPOConfig)
    return [f for f in dataclasses.fields(GRPOConfig)
            if typing.get_origin(hints[f.name]) is typing.Union and type(None) in typing.get_args(hints[f.name])]


def test_every_optional_field_takes_none_on_the_command_line():
    fields = optional_fields()
    names = {f.name for f in fields}
    assert {"vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min", "loss_mode", "eps_high", "reward_weights", "chunk_size"} <= names
    for f in fields:
        flag = "--" + f.name.replace("_", "-")
        for text in ("None", "none"):
            assert getattr(parse(flag, text), f.name) is None, (flag, text)
    cfg = parse("--vllm-importance-sampling-clip-max", "None", "--vllm-importance-sampling-clip-min", "0.5")
    assert cfg.vllm_importance_sampling_clip_max is None and cfg.grpo_options().rollout_correction_max is None
    assert parse("--reward-weights", "1", "0.5").reward_weights == [1.0, 0.5]


@pytest.mark.parametrize("flags,named", [
    (("--max-new-tokens", "None"), "--max-new-tokens"), (("--reward-weights", "1", "None"), "--reward-weights"),
    (("--use-vllm", "true"), "unrecognized arguments: true"),  # (a bool is --use-vllm / --no-use-vllm)
    (("--loss-mode", "nope"), "--loss-mode"), (("--vllm-importance-sampling-clip-max", "-1"), "vllm_importance_sampling_clip_max"),
])
def test_bad_values_are_usage_errors_before_any_model_loads(flags, named, tmp_path, capsys):
    """Exit 2, the error line naming the flag, with a model path that does not exist (loading it would
    raise OSError)."""
    from grpo.__main__ import main

    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1="}\n')
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--model", str(tmp_path / "no-model"), "--data", str(data), *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err[-2000:]
    error = [line for line in err.splitlines() if "error:" in line][-1]
    assert named in error, error
