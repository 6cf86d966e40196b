"""LoRA through peft (``grpo.lora``), bf16 weights (``grpo.precision``) and the frozen head in the fused loss.

Real peft on the demo's 2-layer Qwen2 (built in code, nothing downloaded), CPU, backend="torch".
"""

from __future__ import annotations

import copy
import json
import math
import sys

import pytest
import torch

from grpo.logs import run_values
from grpo import lora, precision
from grpo.demo import accuracy, build_model_and_tokenizer, problems
from grpo.trainer import GRPOConfig, ReferenceWithoutAdapters, completion_logps, prepare_model, train
from helpers import (
    assert_close64, generate_rollouts, peak_new_bytes, save_demo_model, saved_for_backward, tiny_config, torchrun, update_batch, write_prompts,
)

pytest.importorskip("peft")
pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]


def length_reward(prompts, completions, **_):
    return [len(c) / 10 for c in completions]


REWARDS = {"accuracy": accuracy, "length": length_reward}


LORA_RUN = dict(
    num_steps=2, prompts_per_step=4, max_new_tokens=10, learning_rate=1e-2, use_peft=True, lora_r=4, lora_alpha=8, beta=0.05,
)


def lora_config(tmp_path, **overrides) -> GRPOConfig:
    return tiny_config(tmp_path, **{**LORA_RUN, **overrides})


def base_weights(model) -> dict[str, torch.Tensor]:
    """The transformers model's own tensors (embeddings, layers, lm_head), by their original names."""
    model = lora.base_of(model)
    return {k.replace(".base_layer", ""): v.detach().clone() for k, v in model.state_dict().items() if "lora_" not in k}


def adapter_weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters() if "lora_" in k}


# ---------------------------------------------------------------------------- training
def test_only_the_adapters_train_and_the_saved_adapter_loads(tmp_path):
    from peft import PeftModel

    model, tokenizer = build_model_and_tokenizer(seed=0)
    before = base_weights(model)
    cfg = lora_config(tmp_path, padding_free=True, gradient_checkpointing=True)
    records = train(model, tokenizer, problems()[:8], REWARDS, cfg)  # (peft injects the adapters into model)
    assert all(r["grad_norm"] > 0 for r in records)
    after = base_weights(model)
    assert after.keys() == before.keys()
    for k, v in before.items():  # embeddings, every layer, lm_head: bit-identical
        assert torch.equal(after[k], v), k
    trained = model
    assert any(float(v.abs().max()) > 0 for k, v in adapter_weights(trained).items() if "lora_B" in k)  # B starts at 0
    # the adapter peft wrote loads onto a fresh base and gives the trained model's logits
    fresh, _ = build_model_and_tokenizer(seed=0)
    loaded = PeftModel.from_pretrained(fresh, str(tmp_path / "run" / "adapter")).eval()
    ids = torch.randint(3, 20, (2, 9))
    trained.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, trained(ids).logits, rtol=0, atol=0)
        with loaded.disable_adapter():
            torch.testing.assert_close(loaded(ids).logits, fresh_logits(ids), rtol=1e-6, atol=1e-6)
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").exists()


def fresh_logits(ids: torch.Tensor) -> torch.Tensor:
    model, _ = build_model_and_tokenizer(seed=0)
    return model.eval()(ids).logits


def test_reference_is_the_policy_with_its_adapters_off(tmp_path):
    """The reference's log-probs are the base model's, from the policy's own weights (no copy)."""
    model, tokenizer = build_model_and_tokenizer(seed=0)
    untouched = copy.deepcopy(model)
    cfg = lora_config(tmp_path)
    peft_model = lora.add_adapters(model, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # adapters that change the model
    policy = prepare_model(peft_model, cfg, torch.device("cpu"))
    ref = ReferenceWithoutAdapters(policy)
    assert list(ref.parameters()) == []  # it holds no weights of its own
    rollout = generate_rollouts(peft_model, tokenizer, [r["prompt"] for r in problems()[:2]], cfg, 3)
    batch = update_batch(rollout, torch.zeros(6))
    policy.eval()
    ref_logps = completion_logps(ref, batch, cfg, torch.device("cpu"))
    base_logps = completion_logps(prepare_model(untouched, cfg, torch.device("cpu"), frozen=True), batch, cfg, torch.device("cpu"))
    policy_logps = completion_logps(policy, batch, cfg, torch.device("cpu"))
    mask = batch.loss_mask.bool()
    torch.testing.assert_close(ref_logps[mask], base_logps[mask], rtol=1e-5, atol=1e-5)
    assert (policy_logps[mask] - base_logps[mask]).abs().max() > 1e-3  # the adapters were on for the policy


def test_resume_is_bit_identical_to_the_uninterrupted_run(tmp_path):
    rows = problems()[:12]
    opts = dict(num_steps=4, num_iterations=2, lora_dropout=0.1, padding_free=True, gradient_checkpointing=True)

    model, tokenizer = build_model_and_tokenizer(seed=0)
    straight = train(model, tokenizer, rows, REWARDS, lora_config(tmp_path / "a", **opts))
    adapters_straight = adapter_weights(model)

    model, tokenizer = build_model_and_tokenizer(seed=0)
    train(model, tokenizer, rows, REWARDS, lora_config(tmp_path / "b", **dict(opts, num_steps=2)))
    torch.manual_seed(1234)  # whatever happened in between must not matter
    model, tokenizer = build_model_and_tokenizer(seed=0)  # a new process builds the model again
    resumed = train(model, tokenizer, rows, REWARDS, lora_config(tmp_path / "b", **opts, resume=True))
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    adapters_resumed = adapter_weights(model)
    assert adapters_resumed.keys() == adapters_straight.keys() and adapters_straight
    for k, v in adapters_straight.items():
        assert torch.equal(adapters_resumed[k], v), k
    assert [run_values(r) for r in resumed] == [run_values(r) for r in straight]
    state = torch.load(tmp_path / "b" / "run" / "checkpoint.pt", weights_only=False)
    assert state["ref_model"] is None  # the reference is the policy: held, and saved, once


def test_bf16_weights_with_fp32_adapters(tmp_path):
    model, tokenizer = build_model_and_tokenizer(seed=0)
    before = {k: v.to(torch.bfloat16) for k, v in base_weights(model).items()}
    records = train(model, tokenizer, problems()[:8], REWARDS, lora_config(tmp_path, model_dtype="bfloat16"))
    assert all(r["grad_norm"] > 0 and r["loss"] == r["loss"] for r in records)
    after = base_weights(model)
    for k, v in before.items():
        assert after[k].dtype == torch.bfloat16 and torch.equal(after[k], v), k
    adapters = adapter_weights(lora.base_of(model))
    assert adapters and all(v.dtype == torch.float32 for v in adapters.values())


# ---------------------------------------------------------------------------- AdamW on bf16 weights
def test_full_fine_tuning_in_bf16_steps_fp32_masters_and_resumes_exactly(tmp_path):
    rows = problems()[:8]
    opts = dict(use_peft=False, model_dtype="bfloat16", num_steps=2, learning_rate=1e-3)
    model, tokenizer = build_model_and_tokenizer(seed=0)
    initial = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    straight = train(model, tokenizer, rows, REWARDS, lora_config(tmp_path / "a", **opts))
    final = {k: v.clone() for k, v in model.state_dict().items()}
    assert all(v.dtype == torch.bfloat16 for v in final.values())
    assert any(not torch.equal(final[k], initial[k]) for k in final)  # the masters' updates reach the weights
    state = torch.load(tmp_path / "a" / "run" / "checkpoint.pt", weights_only=False)
    assert all(m.dtype == torch.float32 for m in state["optimizer"]["master_weights"])

    model, tokenizer = build_model_and_tokenizer(seed=0)
    train(model, tokenizer, rows, REWARDS, lora_config(tmp_path / "b", **dict(opts, num_steps=1)))
    model, tokenizer = build_model_and_tokenizer(seed=0)
    resumed = train(model, tokenizer, rows, REWARDS, lora_config(tmp_path / "b", **opts, resume=True))
    for k, v in final.items():
        assert torch.equal(model.state_dict()[k], v), k
    assert resumed[-1]["loss"] == straight[-1]["loss"]


def test_adamw_on_bf16_weights_loses_the_update_and_master_copies_keep_it():
    """Why full fine-tuning in bf16 steps fp32 masters: at lr 1e-5 the bf16 parameter never moves."""
    torch.manual_seed(0)
    start = torch.randn(256, dtype=torch.float64).clamp(-2, 2)
    grads = [torch.randn(256, dtype=torch.float64) for _ in range(20)]

    def run(param, opt):
        for g in grads:
            param.grad = g.to(param.dtype)
            opt.step()
            opt.zero_grad()
        return param.detach().double()

    reference = torch.nn.Parameter(start.clone())  # float64 AdamW: the update GRPO asks for
    want = run(reference, torch.optim.AdamW([reference], lr=1e-5, weight_decay=0.0))
    plain = torch.nn.Parameter(start.to(torch.bfloat16))
    got_plain = run(plain, torch.optim.AdamW([plain], lr=1e-5, weight_decay=0.0))
    master = torch.nn.Parameter(start.to(torch.bfloat16))
    opt = precision.MasterWeightAdamW([master], lr=1e-5, weight_decay=0.0)
    got_master = run(master, opt)
    moved = (want - start.to(torch.bfloat16).double()).abs()
    lost = (got_plain - start.to(torch.bfloat16).double()).abs()
    assert float(moved.mean()) > 1e-4 and float(lost.max()) == 0.0  # plain bf16 AdamW: every update rounded away
    master_fp32 = opt.param_groups[0]["params"][0].detach().double()
    start_bf16 = start.to(torch.bfloat16).double()  # (where the masters start)
    torch.testing.assert_close(master_fp32 - start_bf16, want - start, rtol=1e-2, atol=2e-6)  # fp32 rounding of ~1 weights
    torch.testing.assert_close(got_master, master_fp32.to(torch.bfloat16).double(), rtol=0, atol=0)
    # the masters travel in the state dict, so a resumed run continues from the fp32 values
    again = torch.nn.Parameter(got_master.to(torch.bfloat16))
    restored = precision.MasterWeightAdamW([again], lr=1e-5, weight_decay=0.0)
    restored.load_state_dict(opt.state_dict())
    assert torch.equal(restored.param_groups[0]["params"][0], opt.param_groups[0]["params"][0])


# ---------------------------------------------------------------------------- bad input
def test_use_peft_without_peft_names_the_flag(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft now raises ImportError
    model, tokenizer = build_model_and_tokenizer(seed=0)
    with pytest.raises(ValueError, match="--use-peft"):
        train(model, tokenizer, problems()[:4], REWARDS, lora_config(tmp_path))


def test_bf16_on_a_gpu_without_it_names_the_flag(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    with pytest.raises(ValueError, match="--model-dtype"):
        precision.check_device_supports("bfloat16", torch.device("cuda", 0))
    precision.check_device_supports("float32", torch.device("cuda", 0))  # (fp32 is always there)
    precision.check_device_supports("bfloat16", torch.device("cpu"))


@pytest.mark.parametrize("targets, tied, match", [
    ("q_proj,not_a_layer", False, "no module named 'not_a_layer'"),
    ("lm_head", False, "lm_head"),
    ("q_proj,lm_head", True, "tied"),
    ("embed_tokens", True, "tie_word_embeddings"),
    ("q_proj,input_layernorm", False, "Qwen2RMSNorm"),  # a norm: peft would raise only after the weights load
    ("norm", False, "Qwen2RMSNorm"),
    ("mlp", False, "Qwen2MLP"),  # a block of layers
    ("self_attn", True, "Qwen2Attention"),
])
def test_bad_target_modules_name_the_flag(tmp_path, targets, tied, match):
    from transformers import Qwen2Config

    config = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tied)
    cfg = lora_config(tmp_path, lora_target_modules=targets)
    with pytest.raises(ValueError, match="lora_target_modules") as err:
        lora.check_flags(cfg, config)  # from the config alone (a meta-device skeleton), before any weights load
    assert match in str(err.value)


def test_the_cli_refuses_bad_lora_flags_before_loading_the_model(tmp_path, monkeypatch, capsys):
    import grpo.trainer
    from grpo.__main__ import main

    save_demo_model(tmp_path / "model")
    data = write_prompts(tmp_path / "prompts.jsonl", 2)
    monkeypatch.setattr(grpo.trainer, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit):
        main(["train", "--model", str(tmp_path / "model"), "--data", str(data), "--use-peft",
              "--lora-target-modules", "q_proj", "nope_proj"])
    assert "lora_target_modules" in capsys.readouterr().err


def test_cli_trains_lora_in_bf16_and_writes_the_adapter(tmp_path, capsys):
    from grpo.__main__ import main

    save_demo_model(tmp_path / "model")
    data = write_prompts(tmp_path / "prompts.jsonl", 4)
    main([
        "train", "--model", str(tmp_path / "model"), "--data", str(data), "--rewards", "grpo.demo:accuracy",
        "--num-steps", "1", "--prompts-per-step", "2", "--num-generations", "2", "--max-new-tokens", "4",
        "--backend", "torch", "--no-progress", "--no-plot", "--output-dir", str(tmp_path / "out"),
        "--use-peft", "--lora-r", "4", "--lora-target-modules", "q_proj", "v_proj", "--beta", "0.04",
        "--model-dtype", "bfloat16",
    ])
    adapter = json.loads((tmp_path / "out" / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and sorted(adapter["target_modules"]) == ["q_proj", "v_proj"]
    assert not (tmp_path / "out" / "model").exists()
    assert '"step": 1' in capsys.readouterr().out


# ---------------------------------------------------------------------------- the adapters' dropout
def test_dropout_inside_lora_a_matches_float64_and_keeps_no_mask():
    """DropoutLinearFunction against the formula in float64: y = (x * m / (1 - p)) A^T with m the kept
    elements of drop_mask(seed, first_row + row, column), dx = (dy A) * m / (1 - p), dA = dy^T (x * m /
    (1 - p)); backward keeps x and A only (the mask is hashed again)."""
    g = torch.Generator().manual_seed(0)
    p = 0.3
    x = torch.randn(3, 5, 7, dtype=torch.float64, generator=g).requires_grad_()
    A = torch.randn(4, 7, dtype=torch.float64, generator=g).requires_grad_()
    dy = torch.randn(3, 5, 4, dtype=torch.float64, generator=g)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = lora.DropoutLinearFunction.apply(x, A, p, 987654321, 40)
    keep = (~lora.drop_mask(987654321, 40, 15, 7, p, torch.device("cpu"))).view(3, 5, 7).double()
    assert 0 < int(keep.sum()) < keep.numel()
    dropped = x.detach() * keep / (1 - p)
    assert_close64(y, dropped @ A.detach().T, torch.float64)
    dx, dA = torch.autograd.grad(y, (x, A), dy)
    assert_close64(dx, (dy @ A.detach()) * keep / (1 - p), torch.float64)
    assert_close64(dA, dy.reshape(-1, 4).T @ dropped.reshape(-1, 7), torch.float64)
    assert sorted((str(t.dtype), tuple(t.shape)) for t in saved) == sorted(
        [("torch.float64", (3, 5, 7)), ("torch.float64", (4, 7))])


def test_drop_mask_is_counter_based_and_drops_p():
    """drop_mask: rows [a, b) of a call are rows a..b of the whole call's mask (what chunking relies on);
    another seed gives an independent mask; the dropped fraction is p within 5 binomial standard
    deviations, per row and per column too (no row or feature left out)."""
    cpu = torch.device("cpu")
    whole = lora.drop_mask(2 ** 40 + 17, 0, 256, 200, 0.25, cpu)
    assert torch.equal(lora.drop_mask(2 ** 40 + 17, 37, 90, 200, 0.25, cpu), whole[37:127])
    n = whole.numel()
    sd = (0.25 * 0.75 / n) ** 0.5
    assert abs(whole.double().mean() - 0.25) < 5 * sd
    assert (whole.double().mean(0) - 0.25).abs().max() < 5 * (0.25 * 0.75 / 256) ** 0.5
    assert (whole.double().mean(1) - 0.25).abs().max() < 5 * (0.25 * 0.75 / 200) ** 0.5
    other = lora.drop_mask(2 ** 40 + 18, 0, 256, 200, 0.25, cpu)
    both = (whole & other).double().mean()
    assert abs(both - 0.25 ** 2) < 5 * (0.0625 * 0.9375 / n) ** 0.5
    assert not lora.drop_mask(5, 0, 8, 8, 0.0, cpu).any()


def test_adapter_dropout_backward_makes_no_fp32_noise_sized_temporaries():
    """DropoutLinearFunction's backward at its height holds d x (4 bytes an input element) and the bool
    mask (1 byte) and the hash's int64 block temporaries (lora.HASH_BLOCK elements, a constant): no fp32
    copy of the mask, no product beside d x, and the recomputed dropped input (for d A) is freed before
    d x is made. (aten's dropout backward on a CPU, ``grad * noise``, makes an fp32 noise and a product:
    8 more bytes an element.)"""
    torch.manual_seed(0)
    x = torch.randn(2, 512, 256, requires_grad=True)  # (4 hash blocks)
    A = torch.randn(8, 256, requires_grad=True)
    y = lora.DropoutLinearFunction.apply(x, A, 0.25, 12345, 0)
    dy = torch.randn_like(y)
    (dx, dA), peak = peak_new_bytes(lambda: torch.autograd.grad(y, (x, A), dy))
    small = dy.nbytes + dA.nbytes * 4 + 6 * 8 * lora.HASH_BLOCK["cpu"]  # (d A, the [N, r] matmuls; the hash's blocks)
    assert x.nbytes <= peak <= x.nbytes + 2 * x.numel() + small, (peak, x.nbytes)
    keep = (dx != 0)  # (a dropped element's gradient is 0; a kept one is (dy A) / (1 - p) there)
    torch.testing.assert_close(dx[keep], (dy @ A.detach())[keep] / 0.75, rtol=1e-6, atol=1e-6)


class MaskDropout(torch.nn.Module):
    """peft's ``lora_dropout`` as a plain module drawing grpo.lora's masks (one seed per call, as the fused
    op draws it): peft's own pair, lora_dropout then lora_A under plain autograd, with the fused op's masks."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        seed, first_row = lora.dropout_seed(self)
        drop = lora.drop_mask(seed, first_row, x.numel() // x.shape[-1], x.shape[-1], self.p, x.device)
        return x * (~drop).view(x.shape) * (1.0 / (1 - self.p))


def peft_with_mask_dropout(peft_model) -> None:
    for module in peft_model.modules():
        dropouts = getattr(module, "lora_dropout", None)
        if isinstance(dropouts, torch.nn.ModuleDict):
            for name, d in list(dropouts.items()):
                if isinstance(d, torch.nn.Dropout) and d.p > 0:
                    dropouts[name] = MaskDropout(d.p)


def test_adapter_dropout_is_pefts_bit_for_bit_and_backward_keeps_far_less():
    """add_adapters (dropout fused into lora_A) against peft's own LoRA on the same model, its dropout
    drawing the same masks (MaskDropout): the same logits and adapter gradients, bit for bit; what
    backward keeps beyond a run without dropout is a small fraction of what peft's dropout keeps (its fp32
    copy and a mask), and nothing of x's size for the mask."""
    from peft import LoraConfig, get_peft_model

    cfg = GRPOConfig(output_dir="unused", use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.2)
    ids = torch.randint(3, 20, (2, 9), generator=torch.Generator().manual_seed(0))

    def run(kind):
        model, _ = build_model_and_tokenizer(seed=0)
        torch.manual_seed(5)  # (the adapters' initialisation)
        if kind == "ours":
            peft_model = lora.add_adapters(model, cfg)
        else:
            peft_model = get_peft_model(model, LoraConfig(
                r=cfg.lora_r, lora_alpha=cfg.lora_alpha, target_modules="all-linear", task_type="CAUSAL_LM",
                lora_dropout=cfg.lora_dropout if kind == "peft" else 0.0), autocast_adapter_dtype=True)
            peft_with_mask_dropout(peft_model)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
        peft_model.train()
        torch.manual_seed(7)  # (the dropout's seeds)
        logits, kept = saved_for_backward(lambda: peft_model(ids).logits, exclude=list(peft_model.parameters()))
        logits.float().pow(2).mean().backward()
        grads = {n: q.grad.clone() for n, q in peft_model.named_parameters() if q.requires_grad}
        return logits.detach(), grads, kept, peft_model

    ours, theirs, none = run("ours"), run("peft"), run("no dropout")
    assert any(isinstance(m, lora.DropoutLinear) for m in ours[3].modules())
    assert torch.equal(ours[0], theirs[0]) and not torch.equal(ours[0], none[0])
    assert ours[1].keys() == theirs[1].keys() and ours[1]
    for name in ours[1]:
        assert torch.equal(ours[1][name], theirs[1][name]), name
    assert ours[2] - none[2] <= 0.25 * (theirs[2] - none[2])
    ours[3].eval()  # (no dropout in eval mode: the plain adapter)
    with torch.no_grad():
        assert torch.equal(ours[3](ids).logits, run_eval(theirs[3], ids))


def test_adapter_dropout_under_bf16_autocast_is_pefts():
    """Under bf16 autocast (the trainer's CUDA default; here a CPU's, which dispatches linear as CUDA's
    does) the fused lora_A's forward runs in bf16 and its backward receives bf16 gradients: it takes the
    casts peft's pair takes, so the step runs and gives the logits and adapter gradients of peft's pair
    with the same masks, bit for bit."""
    from peft import LoraConfig, get_peft_model

    cfg = GRPOConfig(output_dir="unused", use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.2)
    ids = torch.randint(3, 20, (2, 9), generator=torch.Generator().manual_seed(0))

    def run(fused: bool):
        model, _ = build_model_and_tokenizer(seed=0)
        torch.manual_seed(5)
        if fused:
            peft_model = lora.add_adapters(model, cfg)
        else:
            peft_model = get_peft_model(model, LoraConfig(
                r=cfg.lora_r, lora_alpha=cfg.lora_alpha, target_modules="all-linear", task_type="CAUSAL_LM",
                lora_dropout=cfg.lora_dropout), autocast_adapter_dtype=True)
            peft_with_mask_dropout(peft_model)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
        peft_model.train()
        torch.manual_seed(7)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = peft_model(ids).logits
        logits.float().pow(2).mean().backward()  # (outside autocast, as the trainer's)
        return logits.detach(), {n: q.grad for n, q in peft_model.named_parameters() if q.requires_grad}

    (ours, ours_grads), (theirs, theirs_grads) = run(True), run(False)
    assert torch.equal(ours, theirs)
    assert ours_grads.keys() == theirs_grads.keys() and ours_grads
    for name, grad in ours_grads.items():
        assert grad.dtype == torch.float32 and torch.isfinite(grad).all() and grad.abs().sum() > 0, name
        assert torch.equal(grad, theirs_grads[name]), name


def run_eval(model, ids):
    model.eval()
    with torch.no_grad():
        return model(ids).logits


# ---------------------------------------------------------------------------- the frozen head
def test_a_frozen_head_costs_two_matmuls_and_no_weight_gradient():
    """Under LoRA lm_head.weight does not require grad: per chunk the fused loss runs the logits and
    d hidden matmuls only, and no [V, H] buffer is ever allocated; d hidden is the trainable head's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from grpo_kernels import fused_linear_grpo_loss

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.matmuls, self.shapes = 0, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
                self.matmuls += 1
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and not func.is_view:  # (allocations: a view of the weight is none)
                    self.shapes.append(tuple(t.shape))
            return out

    torch.manual_seed(0)
    N, H, V, chunk = 48, 16, 40, 16
    hidden = torch.randn(1, N, H)
    weight = torch.randn(V, H) * 0.3
    ids, adv = torch.randint(0, V, (1, N)), torch.randn(1)
    mask = torch.ones(1, N)

    def run(trainable: bool):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_(trainable)
        rec = Record()
        with rec:
            out = fused_linear_grpo_loss(h, w, ids, adv, mask, loss_type="dapo", chunk_size=chunk, backend="torch")
            out.loss.backward()
        return h.grad, w.grad, rec

    g_frozen, w_frozen, frozen = run(False)
    g_train, w_train, trainable = run(True)
    assert w_frozen is None and w_train is not None
    torch.testing.assert_close(g_frozen, g_train, rtol=1e-6, atol=1e-7)
    chunks = N // chunk
    assert frozen.matmuls == 2 * chunks and trainable.matmuls == 3 * chunks
    assert (V, H) not in frozen.shapes and (V, H) in trainable.shapes


# ---------------------------------------------------------------------------- DDP and FSDP2 (2 CPU ranks, gloo)
def worker_data_parallel(out: str) -> None:
    """Under torchrun: a LoRA run with beta > 0 under DDP and under FSDP2, and under FSDP2 the same run
    interrupted after 1 of 2 steps then resumed."""
    import os

    from grpo import distributed

    distributed.setup("ddp")
    base = os.path.dirname(out)
    results = {kind: data_parallel_runs(kind, base) for kind in ("ddp", "fsdp")}
    if distributed.is_main_process():
        torch.save(results, out)
    distributed.teardown()


def data_parallel_runs(kind: str, base: str) -> dict:
    import dataclasses
    import os

    def run(name, **kw):
        model, tokenizer = build_model_and_tokenizer(seed=0)
        initial = base_weights(model)
        cfg = GRPOConfig(
            output_dir=os.path.join(base, f"{kind}-{name}"), num_steps=2, prompts_per_step=2, num_generations=2,
            max_new_tokens=6, learning_rate=1e-2, beta=0.05, backend="torch", progress=False, plot=False,
            save_every=0, distributed=kind, use_peft=True, lora_r=4, lora_alpha=8,
        )
        records = train(model, tokenizer, problems()[:12], REWARDS, dataclasses.replace(cfg, **kw))
        return records, adapter_weights(model), initial, base_weights(model)

    straight = run("straight")
    if kind == "ddp":  # (DDP checkpoints as one process does, which the tests above resume)
        return {"straight": straight, "resumed": None}
    run("resumed", num_steps=1)
    return {"straight": straight, "resumed": run("resumed", resume=True)}


def test_lora_on_two_ranks_trains_adapters_and_resumes_exactly(tmp_path):
    out = tmp_path / "data_parallel.pt"
    torchrun([__file__, str(out)])
    results = torch.load(out, weights_only=False)
    for kind in ("ddp", "fsdp"):
        check_data_parallel_run(results[kind], tmp_path / f"{kind}-straight")


def check_data_parallel_run(result: dict, output_dir) -> None:
    straight, adapters, initial, final = result["straight"]
    assert all(r["grad_norm"] > 0 for r in straight) and adapters
    for k, v in initial.items():
        assert torch.equal(final[k], v), k  # the base stays bit-identical
    assert (output_dir / "adapter" / "adapter_model.safetensors").exists()
    if result["resumed"] is None:
        return
    resumed, adapters_resumed, _, _ = result["resumed"]
    for k, v in adapters.items():
        assert torch.equal(adapters_resumed[k], v), k
    assert [run_values(r) for r in resumed] == [run_values(r) for r in straight]


if __name__ == "__main__":
    worker_data_parallel(sys.argv[1])


# ---------------------------------------------------------------------------- LoRA on untied input embeddings
EMBEDDING_TARGETS = "embed_tokens,down_proj"


def _randomised_adapters(peft_model) -> None:
    """Every adapter factor random (peft starts lora_B / lora_embedding_A at 0: the adapters would add nothing)."""
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name or "lora_embedding_A" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))) * 0.5)


def test_lora_on_untied_input_embeddings_is_pefts_bit_for_bit():
    """lora_target_modules="embed_tokens,down_proj" on a model whose head is not tied: add_adapters gives peft's
    own LoRA (peft's lora.Embedding: A [r, V] looked up by id, B [H, r], scaled by alpha / r; no dropout on it, as
    peft applies none, while down_proj's is the fused hashed one), the same logits and adapter gradients as
    get_peft_model with the same dropout masks, bit for bit; the embedding adapter's output and gradients equal a
    float64 restatement of the formula."""
    from peft import LoraConfig, get_peft_model

    cfg = GRPOConfig(output_dir="unused", use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.2,
                     lora_target_modules=EMBEDDING_TARGETS)
    ids = torch.randint(3, 20, (2, 9), generator=torch.Generator().manual_seed(0))

    def run(ours: bool):
        model, _ = build_model_and_tokenizer(seed=0)
        assert model.get_input_embeddings().weight is not model.get_output_embeddings().weight
        torch.manual_seed(5)
        if ours:
            lora.check_targets(model, cfg)
            peft_model = lora.add_adapters(model, cfg)
        else:
            peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.2, task_type="CAUSAL_LM",
                                                          target_modules=["embed_tokens", "down_proj"]),
                                        autocast_adapter_dtype=True)
            peft_with_mask_dropout(peft_model)
        _randomised_adapters(peft_model)
        peft_model.train()
        torch.manual_seed(7)
        logits = peft_model(ids).logits
        logits.float().pow(2).mean().backward()
        return logits.detach(), {n: q.grad.clone() for n, q in peft_model.named_parameters() if q.requires_grad}, peft_model

    (ours, ours_grads, model), (theirs, theirs_grads, _) = run(True), run(False)
    assert any("lora_embedding_A" in n for n in ours_grads) and any("down_proj.lora_A" in n for n in ours_grads)
    assert torch.equal(ours, theirs)
    assert ours_grads.keys() == theirs_grads.keys()
    for name, grad in ours_grads.items():
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0, name
        assert torch.equal(grad, theirs_grads[name]), name

    # the embedding adapter against float64: E[ids] + (alpha / r) (A^T[ids]) B^T, and its gradients
    layer = lora.base_of(model).model.embed_tokens
    A, B = layer.lora_embedding_A["default"], layer.lora_embedding_B["default"]
    W = layer.base_layer.weight
    assert tuple(A.shape) == (4, W.shape[0]) and tuple(B.shape) == (W.shape[1], 4)
    A.grad = B.grad = None
    upstream = torch.randn(2, 9, W.shape[1], generator=torch.Generator().manual_seed(3))
    out = layer(ids)  # (train mode: no dropout on an embedding adapter, as in peft)
    (out * upstream).sum().backward()
    A64, B64 = A.detach().double().requires_grad_(), B.detach().double().requires_grad_()
    want = W.detach().double()[ids] + (8 / 4) * (A64.t()[ids] @ B64.t())
    (want * upstream.double()).sum().backward()
    assert_close64(out, want, what="embedding adapter output")
    assert_close64(A.grad, A64.grad, scale=10, what="d lora_embedding_A")
    assert_close64(B.grad, B64.grad, scale=10, what="d lora_embedding_B")
    layer.eval()
    with torch.no_grad():
        assert torch.equal(layer(ids), out.detach())


def test_a_run_trains_adapters_on_untied_embeddings_and_plans_them(tmp_path):
    """The whole run accepts the untied embeddings as a target (the memory plan too, which counts their A and B),
    trains only the adapters, writes an adapter peft loads, and the plan refuses the tied case by name."""
    from peft import PeftModel

    from grpo import plan

    model, tokenizer = build_model_and_tokenizer(seed=0)
    before = base_weights(model)
    cfg = lora_config(tmp_path, lora_target_modules=EMBEDDING_TARGETS, num_steps=2)
    records = train(model, tokenizer, problems()[:8], REWARDS, cfg)
    assert len(records) == 2 and all(math.isfinite(r["loss"]) for r in records)
    after = base_weights(model)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    adapters = adapter_weights(model)
    embedding_A = [v for k, v in adapters.items() if "lora_embedding_A" in k]
    assert len(embedding_A) == 1 and embedding_A[0].abs().sum() > 0  # (peft starts it at 0: it trained)
    saved = json.loads((tmp_path / "run" / "memory_plan.json").read_text())
    assert saved["settings"]["lora_target_modules"] == EMBEDDING_TARGETS
    fresh, _ = build_model_and_tokenizer(seed=0)
    loaded = PeftModel.from_pretrained(fresh, str(tmp_path / "run" / "adapter"))
    ids = torch.randint(3, 20, (1, 6), generator=torch.Generator().manual_seed(1))
    assert torch.equal(run_eval(loaded, ids), run_eval(model, ids))

    shape = plan.ModelShape.from_config(dict(plan.KNOWN_CONFIGS["Qwen2.5-7B"]))
    with_embedding = plan.plan(shape, 1024, use_peft=True, lora_r=8, lora_target_modules=EMBEDDING_TARGETS, device="cpu")
    without = plan.plan(shape, 1024, use_peft=True, lora_r=8, lora_target_modules="down_proj", device="cpu")
    extra = with_embedding.terms["weights"] - without.terms["weights"]
    assert extra == 4 * 8 * (shape.vocab_size + shape.hidden_size)  # fp32 A [r, V] and B [H, r]
    assert with_embedding.terms["edges"] - without.terms["edges"] == 4 * 8 * 1024  # its [N, r] lookup
    tied = plan.ModelShape.from_config(dict(plan.KNOWN_CONFIGS["Qwen2.5-0.5B"]))
    with pytest.raises(ValueError, match="lora_target_modules names embed_tokens.*tie_word_embeddings"):
        plan.plan(tied, 1024, use_peft=True, lora_target_modules=EMBEDDING_TARGETS, device="cpu")
