"""The memory plan (``grpo.plan``): parameter counts against real models, the terms' rules, the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from grpo import plan

pytestmark = pytest.mark.timeout(120)

SMALL = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=300)


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count_is_the_models(tied):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SMALL, tie_word_embeddings=tied)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    unique = {id(p): p.numel() for p in model.parameters()}  # (a tied head counts once)
    assert plan.ModelShape.from_config(config).parameters() == sum(unique.values())


def test_lora_parameter_count_is_peft_s():
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SMALL, tie_word_embeddings=False)
    torch.manual_seed(0)
    for targets in ("all-linear", "q_proj,v_proj,down_proj"):
        model = get_peft_model(Qwen2ForCausalLM(config), LoraConfig(
            r=8, target_modules="all-linear" if targets == "all-linear" else targets.split(","), task_type="CAUSAL_LM"))
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert plan.ModelShape.from_config(config).lora_parameters(8, plan.lora_targets(targets)) == trainable


@pytest.mark.parametrize("name, published", [("Qwen2.5-0.5B", 0.49e9), ("Qwen2.5-1.5B", 1.54e9), ("Qwen2.5-7B", 7.61e9)])
def test_built_in_configs_have_their_published_sizes(name, published):
    assert abs(plan.load_shape(name).parameters() / published - 1) < 0.01
    assert plan.load_shape("Qwen/" + name) == plan.load_shape(name)


def test_a_1_5b_32k_lora_bf16_checkpointed_step_fits_24gb_and_full_fine_tuning_does_not():
    fits = plan.plan("Qwen2.5-1.5B", 32768, use_peft=True, model_dtype="bfloat16", gradient_checkpointing=True,
                     beta=0.04, gpu_memory=24 * 10**9)
    assert fits.fits and fits.peak <= 24e9
    assert fits.terms["reference"] == 0 and fits.terms["optimizer state"] < 0.2 * 2**30
    full = plan.plan("Qwen2.5-1.5B", 32768, gradient_checkpointing=True, beta=0.04, gpu_memory=24 * 10**9)
    assert not full.fits
    P = plan.load_shape("Qwen2.5-1.5B").parameters()
    assert full.terms["weights"] == full.terms["reference"] == 4 * P  # fp32 policy and its frozen copy
    assert full.terms["gradients"] == 4 * P and full.terms["optimizer state"] == 8 * P
    no_ckpt = plan.plan("Qwen2.5-1.5B", 32768, use_peft=True, model_dtype="bfloat16", beta=0.04, gpu_memory=24 * 10**9)
    assert not no_ckpt.fits  # every layer's activations at 32k: far too many
    assert fits.peak == sum(fits.terms[k] for k in ("weights", "reference", "gradients", "optimizer state", "runtime")) + max(
        fits.terms["activations"] + fits.terms["loss chunk"], fits.terms["rollout KV cache"])


def test_terms_scale_as_their_rules_say():
    a = plan.plan("Qwen2.5-0.5B", 4096, gradient_checkpointing=False)
    b = plan.plan("Qwen2.5-0.5B", 8192, gradient_checkpointing=False)
    assert b.terms["rollout KV cache"] == 2 * a.terms["rollout KV cache"]
    assert b.terms["activations"] == 2 * a.terms["activations"]  # linear in tokens (no [L, L] attention)
    assert b.terms["weights"] == a.terms["weights"]
    bf16 = plan.plan("Qwen2.5-0.5B", 4096, model_dtype="bfloat16")
    assert bf16.terms["weights"] * 2 == a.terms["weights"]
    # full fine-tuning in bf16: fp32 masters + moments, 12 B, and bf16 + fp32 gradients, 6 B
    P = plan.load_shape("Qwen2.5-0.5B").parameters()
    assert bf16.terms["optimizer state"] == 12 * P and bf16.terms["gradients"] == 6 * P


def test_config_json_path_and_bad_model(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**SMALL, "tie_word_embeddings": True}))
    assert plan.load_shape(str(path)) == plan.load_shape(str(tmp_path))
    with pytest.raises(ValueError, match="--model"):
        plan.load_shape(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="gpu-memory"):
        plan.parse_size("lots")
    assert plan.parse_size("24GiB") == 24 * 2**30 and plan.parse_size("24GB") == 24 * 10**9


def test_cli_prints_every_term_and_the_verdict(capsys):
    from grpo.__main__ import main

    main(["plan", "--model", "Qwen2.5-1.5B", "--tokens", "32768", "--use-peft", "--model-dtype", "bfloat16",
          "--gradient-checkpointing", "--beta", "0.04", "--gpu-memory", "24GB"])
    out = capsys.readouterr().out
    for term in ("weights", "reference", "gradients", "optimizer state", "activations without checkpointing",
                 "activations with checkpointing", "loss chunk", "rollout KV cache", "peak"):
        assert term in out
    assert "fits in" in out and "NOT" not in out


# ---- the plan CLI is a CLI: every bad value a usage error naming the flag, before anything is computed
def plan_cli(*argv: str):
    from grpo.__main__ import main

    main(["plan", *argv])


def declared_bad_values(cls, name):
    """Values the field's declaration refuses, as command-line text (just outside its range, NaN, inf,
    a value of another type, an unknown choice)."""
    from grpo_kernels.bounds import declarations

    d = declarations(cls)[name]
    if d.kind is bool:
        return []
    if d.kind is str:
        return ["nope"] if d.choices else []
    out = ["x"] + (["2.5"] if d.kind is int else [])
    b = d.bounds
    if b is not None:
        if b.low is not None:
            out.append(str(b.low if b.low_open else b.low - 1))
        if b.high is not None:
            out.append(str(b.high if b.high_open else b.high * 2 + 1))
        if b.finite and d.kind is float:
            out += ["nan", "inf", "1e400"]
    return out


def plan_flag_cases():
    from grpo.config import GRPOConfig

    cases = [(plan.PlanSettings, name) for name in ("tokens", "rollout_tokens", "device", "gpu_memory")]
    return cases + [(GRPOConfig, name) for name in plan.PLAN_CONFIG_FIELDS]


@pytest.mark.parametrize("cls, name", plan_flag_cases(), ids=[n for _, n in plan_flag_cases()])
def test_every_plan_flag_refuses_what_its_declaration_refuses(cls, name, capsys):
    flag = "--" + name.replace("_", "-")
    base = ["--model", "Qwen2.5-0.5B", "--tokens", "64", "--use-peft"]
    values = declared_bad_values(cls, name)
    assert values or name in ("use_peft", "gradient_checkpointing", "lora_target_modules")
    for value in values:
        with pytest.raises(SystemExit) as done:
            plan_cli(*base, f"{flag}={value}")
        err = capsys.readouterr().err
        line = [x for x in err.splitlines() if "error:" in x][-1]
        assert done.value.code == 2 and flag in line, (value, line)


@pytest.mark.parametrize("argv, named", [
    (["--lora-target-modules", "nope_proj"], "--lora-target-modules"),
    (["--lora-target-modules", "input_layernorm"], "--lora-target-modules"),  # a norm: LoRA adapts linear layers
    (["--lora-target-modules", ","], "--lora-target-modules"),
    (["--gpu-memory", "0"], "--gpu-memory"), (["--gpu-memory", "1e400"], "--gpu-memory"), (["--gpu-memory=-3GB"], "--gpu-memory"),
    (["--gpu-memory", "lots"], "--gpu-memory"), (["--gpu-memory", "1e300"], "--gpu-memory"),
    (["--lora-r", "0"], "--lora-r"), (["--lora-r=-4"], "--lora-r"), (["--lora-dropout", "3"], "--lora-dropout"),
    (["--beta", "nan"], "--beta"), (["--model-dtype", "float16"], "--model-dtype"),
])
def test_the_issue_s_examples_are_usage_errors(argv, named, capsys):
    with pytest.raises(SystemExit) as done:
        plan_cli("--model", "Qwen2.5-0.5B", "--tokens", "64", "--use-peft", *argv)
    line = [x for x in capsys.readouterr().err.splitlines() if "error:" in x][-1]
    assert done.value.code == 2 and named in line, line


@pytest.mark.parametrize("content", [
    "not json", "[1, 2]", '"a string"', json.dumps({"model_type": "bert", "hidden_size": 8, "vocab_size": 10}),
    json.dumps({**SMALL, "num_attention_heads": 0}), json.dumps({**SMALL, "hidden_size": 65}),
    json.dumps({**SMALL, "vocab_size": "300"}), json.dumps({**SMALL, "num_hidden_layers": True}),
])
def test_a_config_that_is_not_a_decoder_s_is_a_usage_error_naming_model(content, tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(SystemExit) as done:
        plan_cli("--model", str(path), "--tokens", "64")
    line = [x for x in capsys.readouterr().err.splitlines() if "error:" in x][-1]
    assert done.value.code == 2 and "--model" in line and str(path) in line, line


def test_plan_function_refuses_what_the_trainer_refuses():
    """plan() reads GRPOConfig's declarations: the settings the trainer refuses are refused here too, by name."""
    for kw, name in ((dict(use_peft=True, lora_r=0), "lora_r"), (dict(use_peft=True, lora_r=-4), "lora_r"),
                     (dict(lora_dropout=3.0), "lora_dropout"), (dict(beta=float("nan")), "beta"),
                     (dict(use_peft=True, lora_target_modules="nope_proj"), "lora_target_modules"),
                     (dict(model_dtype="float16"), "model_dtype"), (dict(rollout_tokens=0), "rollout_tokens"),
                     (dict(gpu_memory=0), "gpu_memory"), (dict(device="tpu"), "device")):
        with pytest.raises(ValueError, match=name):
            plan.plan("Qwen2.5-0.5B", 64, **kw)
    with pytest.raises(ValueError, match="tokens"):
        plan.plan("Qwen2.5-0.5B", 0)


def test_gpu_memory_is_in_gigabytes_and_the_verdict_is_printed(capsys):
    plan_cli("--model", "Qwen2.5-0.5B", "--tokens", "64", "--gpu-memory", "80")
    out = capsys.readouterr().out
    assert "fits in 80 GB" in out
    plan_cli("--model", "Qwen2.5-7B", "--tokens", "4096", "--gpu-memory", "24GiB", "--json")
    result = json.loads(capsys.readouterr().out)
    assert result["gpu_memory_bytes"] == 24 * 2**30 and result["fits"] is False
    assert plan.parse_size("80") == 80e9 and plan.parse_size("512MiB") == 2**29


@pytest.mark.parametrize("model, dtype, device", [("Qwen2.5-0.5B", "float32", "cuda"), ("Qwen2.5-1.5B", "bfloat16", "cuda"),
                                                  ("Qwen2.5-0.5B", "float32", "cpu")])
def test_the_peak_never_falls_as_tokens_grow(model, dtype, device):
    """The loss chunk of N tokens splits them into equal chunks, so a few more tokens could take a smaller
    chunk (1,082 tokens planned more than 1,084): the plan now takes the largest chunk of any micro-batch
    of at most N tokens, and every term grows with N."""
    from grpo_kernels.autograd import default_chunk_size

    shape = plan.load_shape(model)
    rows = default_chunk_size(shape.vocab_size, shape.hidden_size, torch.bfloat16 if dtype == "bfloat16" else torch.float32,
                              torch.device(device))
    # (around each multiple of the chunk, where one more token makes one more, smaller, chunk)
    counts = sorted(set(range(1, 5000, 37)) | {k * rows + d for k in range(1, 5) for d in range(-2, 3)})
    previous = None
    for n in counts:
        p = plan.plan(model, n, model_dtype=dtype, device=device)
        if previous is not None:
            assert p.peak >= previous.peak and p.terms["loss chunk"] >= previous.terms["loss chunk"], n
        previous = p
