"""GRPOConfig: checked when made (and on assignment), its choices grpo_kernels's own, its flags documented."""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest

import grpo_kernels
from grpo_kernels import options as _validation  # the loss's choice lists live in grpo_kernels.options
from grpo import advantages, distributed
from grpo.__main__ import main
from grpo.config import GRPOConfig


@pytest.mark.parametrize(
    "field, value, choices",
    [
        ("loss_type", "gpro", _validation.LOSS_TYPES),
        ("scale_rewards", "grup", advantages.SCALES),
        ("advantage_std", "sample", advantages.STD_KINDS),
        ("importance_sampling_level", "seq", _validation.IMPORTANCE_SAMPLING_LEVELS),
        ("backend", "tirton", _validation.BACKENDS),
        ("distributed", "deepspeed", distributed.KINDS),
    ],
)
def test_unknown_choice_is_refused_with_the_choices(field, value, choices):
    with pytest.raises(ValueError, match=rf"GRPOConfig\.{field} must be one of") as error:
        GRPOConfig(**{field: value})
    assert all(c in str(error.value) for c in choices) and repr(value) in str(error.value)


def test_choice_lists_are_the_owners_own():
    """The loss-side lists come from grpo_kernels, the others from the module that uses them: never retyped."""
    choices = {f.name: f.metadata["choices"] for f in dataclasses.fields(GRPOConfig) if f.metadata.get("choices")}
    assert choices["loss_type"] is _validation.LOSS_TYPES
    assert choices["importance_sampling_level"] is _validation.IMPORTANCE_SAMPLING_LEVELS
    assert choices["backend"] is _validation.BACKENDS
    assert choices["scale_rewards"] is advantages.SCALES and choices["advantage_std"] is advantages.STD_KINDS
    assert choices["distributed"] is distributed.KINDS


@pytest.mark.parametrize(
    "field, value",
    [
        ("learning_rate", -1e-6), ("learning_rate", math.nan), ("learning_rate", math.inf),
        ("eps_low", 1.0), ("eps_low", -0.1), ("eps_low", math.nan), ("eps_high", -0.2), ("eps_high", math.nan),
        ("temperature", 0.0), ("temperature", -1.0), ("temperature", math.inf), ("temperature", math.nan),
        ("top_p", 0.0), ("top_p", 1.5), ("beta", -0.1), ("beta", math.inf), ("delta", 1.0), ("delta", math.nan),
        ("entropy_coef", math.nan), ("weight_decay", -1.0), ("adam_beta1", 1.0), ("adam_beta2", -0.5),
        ("max_grad_norm", 0.0), ("max_grad_norm", math.nan), ("overlong_penalty", -1.0),
        ("num_steps", 0), ("prompts_per_step", 0), ("num_generations", 0), ("num_generations", 1), ("max_new_tokens", 0),
        ("num_iterations", 0), ("micro_batch_size", 0), ("chunk_size", 0), ("warmup_steps", -1), ("save_every", -1),
        ("overlong_buffer", -1), ("seed", -1), ("seed", 2**32), ("seed", 10**400),
    ],
)
def test_out_of_range_value_is_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"GRPOConfig\.{field} must be"):
        GRPOConfig(**{field: value})


@pytest.mark.parametrize(
    "field, value",
    [("learning_rate", "1e-6"), ("num_steps", 2.5), ("num_steps", True), ("resume", 1), ("loss_type", 3),
     ("eps_high", "0.28"), ("reward_weights", [1.0, "2"]), ("reward_weights", 1.0), ("output_dir", None)],
)
def test_wrong_type_is_refused_naming_the_field(field, value):
    with pytest.raises(TypeError, match=rf"GRPOConfig\.{field} must be"):
        GRPOConfig(**{field: value})


def test_rules_that_tie_fields_together():
    with pytest.raises(ValueError, match=r"delta must be > 1 \+ eps_high = 1.28"):
        GRPOConfig(eps_high=0.28, delta=1.25)
    GRPOConfig(eps_high=0.28, delta=1.3)
    with pytest.raises(ValueError, match="reward_weights\\[1\\] must be finite"):
        GRPOConfig(reward_weights=[1.0, math.inf])
    with pytest.raises(ValueError, match="reward_weights"):
        GRPOConfig(reward_weights=[])
    with pytest.raises(ValueError, match="overlong_buffer"):
        GRPOConfig(max_new_tokens=8, overlong_buffer=9)


def test_assignment_is_checked_and_a_refused_one_changes_nothing():
    cfg = GRPOConfig()
    cfg.loss_type = "grpo"
    with pytest.raises(ValueError, match="loss_type must be one of"):
        cfg.loss_type = "gpro"
    assert cfg.loss_type == "grpo"
    with pytest.raises(ValueError, match="learning_rate"):
        cfg.learning_rate = -1.0
    assert cfg.learning_rate == 1e-6
    assert dataclasses.replace(cfg, beta=0.1).beta == 0.1  # replace builds (and checks) a new config


def test_loss_options_are_keywords_of_the_fused_loss():
    """Every loss option the config passes is a keyword of the loss it calls: none is dropped or made up."""
    keywords = inspect.signature(grpo_kernels.fused_linear_grpo_loss).parameters
    options = GRPOConfig(loss_type="grpo", eps_high=0.28, delta=2.0).loss_options()
    assert set(options) <= set(keywords)
    assert options["loss_type"] == "grpo" and options["eps_high"] == 0.28 and options["max_completion_length"] == 256


def test_every_field_is_a_documented_flag(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "10000")  # one line per flag: argparse would wrap (and hyphenate) the help
    with pytest.raises(SystemExit) as done:
        main(["train", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "--loss-type {grpo,bnpo,dr_grpo,dapo,luspo,cispo,sapo,vespo}" in text and "--scale-rewards {group,batch,none}" in text
    assert "--backend {auto,triton,torch,reference}" in text and "--distributed {none,ddp,fsdp}" in text
    for f in dataclasses.fields(GRPOConfig):
        assert f.metadata["help"], f.name
        assert "--" + f.name.replace("_", "-") in text
        assert f.metadata["help"] in text, f.name
    # eps_low's range, and the ranges it takes under the modes that read it otherwise
    assert "(>= 0, < 1; cispo: >= 0, <= 1; dppo_tv, dppo_kl: >= 0, finite; default: 0.2)" in text


def test_a_bad_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as done:
        main(["train", "--model", "m", "--data", "d.jsonl", "--loss-type", "gpro"])
    assert done.value.code == 2 and "invalid choice: 'gpro'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        main(["train", "--model", "m", "--data", "d.jsonl", "--eps-low", "1.5"])
    assert done.value.code == 2 and "--eps-low must be >= 0, < 1, got 1.5" in capsys.readouterr().err  # (the flag typed)


def test_loss_fields_are_generated_from_the_loss_options(capsys, monkeypatch):
    """Every GRPOOptions field (but those the trainer sets) is a config field and a flag, with the option's
    own default, help and choices: a new loss option appears here without being retyped."""
    from grpo.config import TRAINER_OWNED_LOSS_OPTIONS

    config_fields = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    for f in dataclasses.fields(grpo_kernels.GRPOOptions):
        if f.name in TRAINER_OWNED_LOSS_OPTIONS:
            continue
        assert f.name in config_fields, f.name
        assert config_fields[f.name].metadata["help"] == f.metadata["help"]
        assert config_fields[f.name].metadata["choices"] is f.metadata.get("choices")
    for name in ("sapo_temperature_pos", "vespo_lambda_neg", "top_entropy_quantile", "off_policy_mask_threshold", "loss_mode"):
        assert name in config_fields
    assert GRPOConfig(loss_type="sapo", sapo_temperature_neg=1.3).loss_options()["sapo_temperature_neg"] == 1.3
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        GRPOConfig(top_entropy_quantile=1.5)
    monkeypatch.setenv("COLUMNS", "10000")
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    assert "--loss-agg-mode {" in text and "--vllm-importance-sampling-mode {token_truncate,token_mask,sequence_truncate,sequence_mask}" in text
    assert "--top-entropy-quantile" in text and "--vespo-k-pos" in text


def test_one_generation_per_prompt_is_refused():
    with pytest.raises(ValueError, match=r"num_generations must be >= 2.*advantage"):
        GRPOConfig(num_generations=1)


def test_config_takes_loss_mode_and_passes_one_loss_name():
    from grpo.config import GRPOConfig

    cfg = GRPOConfig(loss_mode="gspo", loss_agg_mode="seq-mean-token-sum")
    options = cfg.loss_options()
    assert options["loss_mode"] == "gspo" and "loss_type" not in options  # (the field's default is not a second name)
    assert cfg.grpo_options().is_verl
    with pytest.raises(ValueError, match="name the loss twice"):
        GRPOConfig(loss_mode="vanilla", loss_type="grpo")
    with pytest.raises(ValueError, match="needs loss_mode"):
        GRPOConfig(loss_agg_mode="seq-mean-token-sum")
    assert "loss_type" in GRPOConfig().loss_options()


def test_sampling_replay_is_a_bool_flag(capsys):
    """sampling_replay (on by default) is --sampling-replay / --no-sampling-replay; a string, even a truthy
    one, is refused in Python, and a value after the flag on the command line."""
    import argparse

    from grpo.flags import add_config_flags, config_from_args

    assert GRPOConfig().sampling_replay is True
    parser = argparse.ArgumentParser()
    add_config_flags(parser, GRPOConfig)
    assert config_from_args(parser.parse_args(["--no-sampling-replay"]), GRPOConfig, parser).sampling_replay is False
    assert config_from_args(parser.parse_args(["--sampling-replay"]), GRPOConfig, parser).sampling_replay is True
    for value in ("yes", "True", 1):
        with pytest.raises(TypeError, match=r"GRPOConfig\.sampling_replay must be a bool"):
            GRPOConfig(sampling_replay=value)
    cfg = GRPOConfig()
    with pytest.raises(TypeError, match="sampling_replay"):
        cfg.sampling_replay = "false"
    assert cfg.sampling_replay is True
    with pytest.raises(SystemExit) as done:
        parser.parse_args(["--sampling-replay=yes"])
    assert done.value.code == 2 and "--sampling-replay" in capsys.readouterr().err


# ---------------------------------------------------------------------------- "off" is None (issue 46)
@pytest.mark.parametrize("field, off", [("top_p", 1.0), ("top_p", 1), ("top_p", None), ("top_k", 0), ("top_k", -1),
                                        ("top_k", None)])
def test_the_samplers_off_spellings_are_stored_as_none(field, off):
    """TRL's ``top_p=1.0`` / ``top_k=0`` and vLLM's ``top_k=-1`` are accepted and stored as None, on construction,
    on assignment and through ``dataclasses.replace``; None is the default; an "on" value is kept as it is."""
    assert getattr(GRPOConfig(), field) is None
    cfg = GRPOConfig(**{field: off})
    assert getattr(cfg, field) is None and cfg.grpo_options().__getattribute__(field) is None
    on = {"top_p": 0.9, "top_k": 5}[field]
    cfg = GRPOConfig(**{field: on})
    assert getattr(cfg, field) == on
    setattr(cfg, field, off)
    assert getattr(cfg, field) is None
    assert getattr(dataclasses.replace(GRPOConfig(**{field: on}), **{field: off}), field) is None
    assert dataclasses.asdict(GRPOConfig(**{field: off}))[field] is None  # (what a checkpoint saves)


@pytest.mark.parametrize("field, bad, error", [("top_k", False, TypeError), ("top_k", 0.0, TypeError),
                                               ("top_k", -2, ValueError), ("top_p", 0.0, ValueError),
                                               ("top_p", 1.0000001, ValueError), ("top_p", "1", TypeError)])
def test_a_bad_truncation_is_refused_before_it_is_read_as_off(field, bad, error):
    """The declaration's check comes first: ``top_k=False`` (== 0) or ``0.0`` is not "off" but a wrong type, and a
    refused assignment leaves the config as it was."""
    with pytest.raises(error, match=rf"GRPOConfig\.{field}"):
        GRPOConfig(**{field: bad})
    cfg = GRPOConfig(**{field: {"top_p": 0.5, "top_k": 3}[field]})
    with pytest.raises(error, match=rf"GRPOConfig\.{field}"):
        setattr(cfg, field, bad)
    assert getattr(cfg, field) == {"top_p": 0.5, "top_k": 3}[field]


def test_trl_off_spellings_on_the_command_line_are_stored_as_none(capsys):
    import argparse

    from grpo.flags import add_config_flags, config_from_args

    parser = argparse.ArgumentParser()
    add_config_flags(parser, GRPOConfig)
    for flags in (["--top-p", "1.0", "--top-k", "0"], ["--top-k", "-1"], ["--top-p", "None", "--top-k", "none"], []):
        cfg = config_from_args(parser.parse_args(flags), GRPOConfig, parser)
        assert cfg.top_p is None and cfg.top_k is None, flags
    cfg = config_from_args(parser.parse_args(["--top-p", "0.9", "--top-k", "7"]), GRPOConfig, parser)
    assert (cfg.top_p, cfg.top_k) == (0.9, 7)


def test_an_older_checkpoints_top_p_of_one_resumes_under_none():
    """A config saved before "off" was None (``top_p=1.0``, ``top_k=0``) holds the same settings as today's."""
    from grpo import checkpoint

    now = dataclasses.asdict(GRPOConfig())
    older = {**now, "top_p": 1.0, "top_k": 0}
    older.pop("rollout_engine")  # (a field it did not have is not compared)
    assert checkpoint.changed_settings(older, now) == []
    assert checkpoint.changed_settings({**older, "top_p": 0.9}, now) == ["top_p: 0.9 -> None"]
    # (the config itself, rebuilt from the older dict, stores None)
    assert GRPOConfig(**{**older, "output_dir": "x"}).top_p is None


# ---------------------------------------------------------------------------- the rollout engine (issue 46)
def test_rollout_engine_choices_are_the_registrys_and_use_vllm_is_its_trl_spelling():
    from grpo import rollout

    assert GRPOConfig.__dataclass_fields__["rollout_engine"].metadata["choices"] == rollout.ENGINES.keys()
    assert GRPOConfig().rollout_engine == "hf" and GRPOConfig().use_vllm is False
    assert (GRPOConfig(use_vllm=True).rollout_engine, GRPOConfig(rollout_engine="vllm").use_vllm) == ("vllm", True)
    cfg = GRPOConfig()
    cfg.use_vllm = True
    assert cfg.rollout_engine == "vllm"
    cfg.use_vllm = False
    assert (cfg.rollout_engine, cfg.use_vllm) == ("hf", False)
    cfg.rollout_engine = "vllm"
    assert cfg.use_vllm is True
    with pytest.raises(ValueError, match=r"GRPOConfig\.rollout_engine must be one of \('hf', 'vllm'"):
        GRPOConfig(rollout_engine="sglang")
    with pytest.raises(TypeError, match=r"GRPOConfig\.use_vllm must be a bool"):
        GRPOConfig(use_vllm="True")
    # the engine's own refusal, on assignment too: nothing changes
    cfg = GRPOConfig(distributed="ddp")
    with pytest.raises(ValueError, match=r"GRPOConfig\.rollout_engine='vllm' \(use_vllm\) runs one engine in a single "
                                         r"process: not with distributed='ddp'"):
        cfg.use_vllm = True
    assert (cfg.use_vllm, cfg.rollout_engine, cfg.distributed) == (False, "hf", "ddp")
    with pytest.raises(ValueError, match="single process"):
        cfg.rollout_engine = "vllm"
    assert (cfg.use_vllm, cfg.rollout_engine) == (False, "hf")
