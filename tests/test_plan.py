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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_lora_dropout_term_is_what_backward_keeps(dtype):
    """The plan's dropout term (a 1-byte mask per adapter input element) against the bytes autograd
    keeps for a real peft model's forward (grpo.lora's adapters), with and without lora_dropout."""
    pytest.importorskip("peft")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo import lora
    from grpo.config import GRPOConfig
    from helpers import saved_for_backward

    config = Qwen2Config(**SMALL, tie_word_embeddings=False)
    tokens, r = 24, 4
    ids = torch.randint(0, SMALL["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(0))

    def kept(dropout: float) -> int:
        torch.manual_seed(0)
        model = lora.add_adapters(Qwen2ForCausalLM(config).to(getattr(torch, dtype)),
                                  GRPOConfig(output_dir="unused", use_peft=True, lora_r=r, lora_dropout=dropout)).train()
        return saved_for_backward(lambda: model(ids).logits, exclude=list(model.parameters()))[1]

    shape = plan.ModelShape.from_config(config)
    b = plan.DTYPE_BYTES[dtype]
    per_token = sum(plan.lora_activation_bytes(d_in, r, b, 0.1) - plan.lora_activation_bytes(d_in, r, b, 0.0)
                    for d_in, _ in shape.linears().values())
    assert kept(0.1) - kept(0.0) == tokens * shape.num_hidden_layers * per_token


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
