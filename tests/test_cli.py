"""grpo.__main__ (the ``python -m grpo`` command line): usage errors come before any model is loaded."""

from __future__ import annotations

import pytest

from helpers import save_demo_model, write_prompts

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
    (("--loss-mode", "nope"), "--loss-mode"),
    (("--vllm-importance-sampling-clip-max=-1",), "--vllm-importance-sampling-clip-max"),  # (the flag, as typed)
    (("--mlp-chunk-tokens", "0"), "--mlp-chunk-tokens"), (("--mlp-chunk-tokens", "2.5"), "--mlp-chunk-tokens"),
    (("--activation-offload", "--no-gradient-checkpointing"), "--activation-offload"),  # (it needs checkpointing: issue 35)
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


# ---- every refusal of `python -m grpo train` comes before the model's weights load (issue 37)
@pytest.fixture(scope="module")
def model_without_weights(tmp_path_factory):
    """A saved model folder (config, tokenizer) whose weights file is garbage: loading the weights fails,
    so a refusal that exits 2 naming what it refused came before any weights were read."""
    from grpo.models import load_model

    folder = tmp_path_factory.mktemp("model")
    save_demo_model(folder)
    weights = list(folder.glob("*.safetensors"))
    assert weights
    for path in weights:
        path.write_bytes(b"\x00" * 64)
    with pytest.raises(Exception):  # the weights cannot load
        load_model(str(folder))
    write_prompts(folder / "prompts.jsonl", 4)
    return folder


def _held(out):
    from grpo import checkpoint

    return checkpoint.RunLock(str(out))


def _crafted(out, config=None, weights=True, garbage=False):
    import torch

    from grpo import checkpoint
    from grpo.demo import build_model_and_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    if garbage:
        (out / "checkpoint.pt").write_bytes(b"garbage")
        return
    state = {"step": 1, "model": build_model_and_tokenizer(seed=0)[0].state_dict() if weights else {"x": torch.zeros(2)},
             "ref_model": None, "optimizer": {"state": {}, "param_groups": []}, "rng": checkpoint.rng_state(), "config": config}
    torch.save(state, out / "checkpoint.pt")


CLI_REFUSALS = {  # name -> (extra flags, setup(out dir), words of the error line)
    "a checkpoint of an earlier run": ([], lambda out: _crafted(out), ["--output-dir", "already holds a checkpoint"]),
    "a live run holds the directory": ([], "lock", ["--output-dir", "in use"]),
    "resume: a corrupt checkpoint": (["--resume"], lambda out: _crafted(out, garbage=True), ["checkpoint.pt", "not a readable"]),
    "resume: another model's weights": (["--resume"], lambda out: _crafted(out, weights=False), ["another model"]),
    "resume: other settings": (["--resume"], lambda out: _crafted(out, {"num_generations": 8, "learning_rate": 0.5}),
                               ["learning_rate: 0.5 ->", "--resume-with-changes"]),
    "LoRA target that is a norm": (["--use-peft", "--lora-target-modules", "input_layernorm"], None,
                                   ["--lora-target-modules", "input_layernorm"]),
    "LoRA target that does not exist": (["--use-peft", "--lora-target-modules", "nope_proj"], None, ["--lora-target-modules"]),
    "reward weights for other functions": (["--reward-weights", "1", "2", "3"], None, ["--reward-weights"]),
    "a reward's column missing": (["--rewards", "grpo.demo:accuracy", "--prompt-key", "prompt"], "no answers",
                                  ["'answer'"]),
    "a data file without the prompt key": (["--prompt-key", "question"], None, ["--data", "'question'"]),
    "vespo with vLLM's sequence-level correction": (["--loss-type", "vespo", "--use-vllm"], None,
                                                    ["--vllm-importance-sampling-mode"]),
    "a range under the mode": (["--loss-mode", "vanilla", "--eps-low", "1"], None, ["--eps-low", "< 1"]),
    "a loss option of the model's config": ([], "softcap", ["softcap"]),
}


@pytest.mark.parametrize("case", list(CLI_REFUSALS))
def test_a_refused_command_line_exits_2_before_any_weights_load(case, model_without_weights, tmp_path, capsys):
    import contextlib
    import json as _json
    import shutil

    from grpo.__main__ import main

    flags, setup, words = CLI_REFUSALS[case]
    model, data, out = model_without_weights, model_without_weights / "prompts.jsonl", tmp_path / "out"
    if setup == "softcap":  # a head transform the loss refuses, read from config.json before the weights
        model = tmp_path / "model"
        shutil.copytree(model_without_weights, model)
        config = _json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(_json.dumps({**config, "final_logit_softcapping": -1.0}))
    if setup == "no answers":
        data = tmp_path / "no_answers.jsonl"
        data.write_text('{"prompt": "1+1="}\n{"prompt": "2+2="}\n')
    elif callable(setup):
        setup(out)
    before = sorted(p.name for p in out.iterdir()) if out.exists() else None
    argv = ["train", "--model", str(model), "--data", str(data), "--output-dir", str(out), "--rewards", "grpo.demo:format_reward",
            "--num-steps", "1", "--prompts-per-step", "2", "--num-generations", "2", "--backend", "torch", *flags]
    with (_held(out) if setup == "lock" else contextlib.nullcontext()):
        before = sorted(p.name for p in out.iterdir()) if out.exists() else None
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        after = sorted(p.name for p in out.iterdir()) if out.exists() else None
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err[-3000:]
    line = [x for x in err.splitlines() if "error:" in x][-1]
    assert all(w in line for w in words), line
    assert after == before  # nothing created (and no output dir when there was none)
