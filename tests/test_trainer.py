"""The GRPO trainer on a tiny model built in code: masks, rewards, the loop, accumulation, resume, demo.

Everything runs on CPU in a few seconds except the demo test (about half a minute). The fused loss
uses backend="torch" (the conftest sets TRITON_INTERPRET=1, under which "auto" would pick the slow
Triton interpreter); one small test runs the Triton kernels through the interpreter end to end.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch

import helpers
from grpo.logs import run_values
from grpo.demo import DemoConfig, accuracy, build_model_and_tokenizer, format_reward, problems, run_demo
from grpo.rollout import Completions, completion_mask
from grpo.trainer import (
    GRPOConfig, UpdateBatch, as_policy, completion_logps, default_rollout, overlong_penalty, prepare_model, total_reward, train, update,
)



def length_reward(prompts, completions, **_):
    """Gives an untrained model (whose completions never close an answer) something to learn."""
    return [len(c) / 10 for c in completions]


REWARDS = {"accuracy": accuracy, "format": format_reward, "length": length_reward}


pytestmark = pytest.mark.usefixtures("one_thread")

TRAINER_RUN = dict(num_steps=2, prompts_per_step=4, max_new_tokens=12)


def tiny_config(tmp_path, **overrides) -> GRPOConfig:
    return helpers.tiny_config(tmp_path, **{**TRAINER_RUN, **overrides})


def fresh_model():
    model, tokenizer = build_model_and_tokenizer(seed=0)
    return model, tokenizer


def generate_rollouts(model, tokenizer, prompts, cfg, num_generations):
    """Completions as the trainer samples them."""
    return default_rollout(model, tokenizer, cfg).generate(as_policy(model), prompts, num_generations)


def update_batch(rollout, advantages, loss_mask=None) -> UpdateBatch:
    """The trainer's update batch for a rollout (prompt then completion, row-aligned)."""
    return UpdateBatch(
        input_ids=torch.cat([rollout.prompt_ids, rollout.completion_ids], 1),
        attention_mask=torch.cat([rollout.prompt_mask, rollout.completion_mask], 1),
        prompt_len=rollout.prompt_ids.shape[1], completion_ids=rollout.completion_ids,
        loss_mask=rollout.completion_mask if loss_mask is None else loss_mask, advantages=advantages,
    )


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------- pieces
def test_completion_mask_covers_up_to_the_first_eos():
    eos = 2
    ids = torch.tensor([[5, 6, 2, 0, 0], [5, 2, 7, 2, 0], [5, 6, 7, 8, 9]])
    mask, truncated = completion_mask(ids, eos)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert truncated.tolist() == [False, False, True]
    mask, truncated = completion_mask(ids, [eos, 9])
    assert truncated.tolist() == [False, False, False]


def test_rewards_weighted_sum_with_none_and_overlong_penalty(tmp_path):
    per_fn = torch.tensor([[1.0, 1.0], [math.nan, 0.5], [math.nan, math.nan]])
    total = total_reward(per_fn, torch.tensor([1.0, 0.2]), torch.zeros(3))
    assert total[0].item() == pytest.approx(1.2) and total[1].item() == pytest.approx(0.1)
    assert math.isnan(total[2].item())
    cfg = tiny_config(tmp_path, max_new_tokens=10, overlong_buffer=4, overlong_penalty=1.0)
    assert overlong_penalty(torch.tensor([3, 6, 8, 10]), cfg).tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0])


def test_rollouts_left_pad_prompts_and_mask_completions(tmp_path):
    model, tokenizer = fresh_model()
    cfg = tiny_config(tmp_path, max_new_tokens=6)
    rollout = generate_rollouts(model, tokenizer, ["1+2=", "11+22="], cfg, num_generations=3)
    assert rollout.prompt_ids.shape == (6, 6) and rollout.prompt_mask[0].tolist() == [0, 0, 1, 1, 1, 1]
    assert rollout.prompts == ["1+2="] * 3 + ["11+22="] * 3
    assert rollout.completion_ids.shape[0] == 6 and rollout.completion_ids.shape[1] <= 6
    ended = (rollout.completion_ids == tokenizer.eos_token_id).any(-1)
    assert torch.equal(ended, ~rollout.truncated)
    # after the EOS: padding, outside the mask
    assert torch.all((rollout.completion_ids == tokenizer.pad_token_id) | (rollout.completion_mask == 1))


# ---------------------------------------------------------------------------- the loop
def test_two_step_run_writes_logs_plot_checkpoint_and_changes_the_policy(tmp_path):
    model, tokenizer = fresh_model()
    before = params(model)
    cfg = tiny_config(tmp_path, plot=True)
    records = train(model, tokenizer, problems()[:10], REWARDS, cfg)
    assert [r["step"] for r in records] == [1, 2]
    for key in ("reward", "reward_std", "rewards/accuracy/mean", "rewards/format/std", "accuracy", "entropy",
                "clip_ratio/region_mean", "completion_length/mean", "completion_length/max", "truncated_frac",
                "zero_signal_groups", "tokens_per_s", "step_time", "peak_memory_mb", "loss", "grad_norm",
                "time/generate", "time/score", "time/logps", "time/update"):
        assert key in records[0], key
    assert all(math.isfinite(records[-1][k]) for k in ("loss", "grad_norm", "entropy"))
    out = tmp_path / "run"
    lines = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    assert (out / "checkpoint.pt").exists() and (out / "curves.png").stat().st_size > 1000
    assert not any(name.endswith(".tmp") for name in os.listdir(out))
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_every_option_together_runs_and_stays_finite(tmp_path):
    model, tokenizer = fresh_model()
    cfg = tiny_config(
        tmp_path, num_steps=1, max_new_tokens=5, num_iterations=2, micro_batch_size=5, beta=0.1, eps_high=0.28,
        delta=2.0, mask_truncated_completions=True, overlong_buffer=2, drop_zero_signal_groups=True,
        gradient_checkpointing=True, scale_rewards="batch", advantage_std="unbiased", loss_type="grpo",
        entropy_coef=0.01, warmup_steps=3, temperature=0.9, top_p=0.95, reward_weights=[1.0, 0.5],
    )
    cfg.reward_weights = [1.0, 0.5, 0.1]
    record = train(model, tokenizer, problems()[:8], REWARDS, cfg)[0]
    assert record["truncated_frac"] > 0 and "rewards/overlong/mean" in record and "rewards/length/mean" in record
    assert record["lr"] == pytest.approx(1e-3 / 3)
    for key in ("loss", "grad_norm", "kl", "entropy", "clip_ratio/low_mean"):
        assert math.isfinite(record.get(key, 0.0)), key


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo", "grpo", "dr_grpo", "luspo", "cispo", "sapo", "vespo"])
def test_gradient_accumulation_and_packing_match_one_big_padded_batch(tmp_path, loss_type):
    """Micro-batch losses add up to the full batch's, padded (any micro_batch_size) or packed (any
    token budget, padding_free): the normalisers are the whole batch's, and a sequence without loss
    tokens counts as a padded empty row does."""
    model, tokenizer = fresh_model()
    cfg = tiny_config(tmp_path, max_new_tokens=8, loss_type=loss_type, eps_high=0.28 if loss_type != "cispo" else 1.5)
    rollout = generate_rollouts(model, tokenizer, ["1+2=", "3+4=", "5+6="], cfg, num_generations=4)
    loss_mask = rollout.completion_mask.clone()
    loss_mask[3] = 0  # e.g. a truncated completion masked out: a sequence with no loss token
    batch = update_batch(rollout, torch.linspace(-1, 1, 12), loss_mask=loss_mask)
    batch.old_logps = torch.full(loss_mask.shape, -1.5) * loss_mask  # off-policy: ratios away from 1
    results = []
    settings = [dict(padding_free=False, micro_batch_size=None), dict(padding_free=False, micro_batch_size=5),
                dict(padding_free=False, micro_batch_size=1), dict(padding_free=True, max_tokens_per_microbatch=None),
                dict(padding_free=True, max_tokens_per_microbatch=20), dict(padding_free=True, max_tokens_per_microbatch=1)]
    for setting in settings:
        m, _ = fresh_model()
        c = dataclasses.replace(cfg, max_grad_norm=1e9, **setting)
        m = prepare_model(m, c, torch.device("cpu"))
        start = params(m)
        logs = update(m, torch.optim.SGD(m.parameters(), lr=1.0), batch, c, torch.device("cpu"))
        results.append((logs, {k: start[k] - v for k, v in m.state_dict().items()}))  # the gradient
    (full, grad_full), *rest = results
    assert full["grad_norm"] > 0
    for (logs, grad), setting in zip(rest, settings[1:]):
        assert logs["loss"] == pytest.approx(full["loss"], abs=1e-6), setting
        assert logs["grad_norm"] == pytest.approx(full["grad_norm"], rel=1e-4), setting
        for k in grad_full:
            torch.testing.assert_close(grad[k], grad_full[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"{setting} {k}: {m}")


def test_packed_old_logps_equal_padded(tmp_path):
    """Old-policy / reference log-probs use the same packing and come back in the padded layout."""
    model, tokenizer = fresh_model()
    cfg = tiny_config(tmp_path, max_new_tokens=8)
    rollout = generate_rollouts(model, tokenizer, ["1+2=", "3+4="], cfg, num_generations=3)
    batch = update_batch(rollout, torch.zeros(6))
    padded = completion_logps(prepare_model(fresh_model()[0], dataclasses.replace(cfg, padding_free=False), torch.device("cpu")),
                              batch, dataclasses.replace(cfg, padding_free=False), torch.device("cpu"))
    packed_cfg = dataclasses.replace(cfg, padding_free=True, max_tokens_per_microbatch=9)
    packed = completion_logps(prepare_model(fresh_model()[0], packed_cfg, torch.device("cpu")), batch, packed_cfg,
                              torch.device("cpu"))
    assert padded.shape == packed.shape and (padded[rollout.completion_mask != 0] != 0).all()
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)


def test_resume_continues_as_the_uninterrupted_run(tmp_path):
    rows = problems()[:12]
    opts = dict(num_steps=4, num_iterations=2, beta=0.05, max_new_tokens=8)

    model, tokenizer = fresh_model()
    straight = train(model, tokenizer, rows, REWARDS, tiny_config(tmp_path / "a", **opts))
    p_straight = params(model)

    model, tokenizer = fresh_model()
    train(model, tokenizer, rows, REWARDS, tiny_config(tmp_path / "b", **dict(opts, num_steps=2)))
    with open(tmp_path / "b" / "run" / "log.jsonl", "a") as f:
        f.write('{"step": 3, "reward": 0.')  # killed while logging the step after the checkpoint
    torch.manual_seed(1234)  # whatever the process did in between must not matter
    model, tokenizer = fresh_model()  # a new process would build the model again
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # and its starting weights must not matter either
    resumed = train(model, tokenizer, rows, REWARDS, tiny_config(tmp_path / "b", **opts, resume=True))
    assert all(r["grad_norm"] > 0 for r in straight)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for k, v in p_straight.items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-6, atol=1e-7)
    assert [run_values(r) for r in resumed] == [run_values(r) for r in straight]
    logged = (tmp_path / "b" / "run" / "log.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in logged] == [1, 2, 3, 4]


class ScriptedRollout:
    """Another rollout engine, as vLLM would plug in: completions that do not come from ``generate``."""

    texts = ("<answer>1</answer>", "<think>x</think>")

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.calls = tokenizer, 0

    def generate(self, policy, prompts, num_generations, *, greedy=False):
        self.calls += 1
        tok = self.tokenizer
        repeated = [p for p in prompts for _ in range(num_generations)]
        texts = [self.texts[i % 2] for i in range(len(repeated))]
        enc = tok(repeated, return_tensors="pt", padding=True, add_special_tokens=False)
        tok.padding_side = "right"
        out = tok([t + tok.eos_token for t in texts], return_tensors="pt", padding=True, add_special_tokens=False)
        tok.padding_side = "left"
        truncated = torch.zeros(len(texts), dtype=torch.bool)
        return Completions(enc.input_ids, enc.attention_mask, out.input_ids, out.attention_mask, truncated, repeated, texts)


def test_another_rollout_engine_plugs_in(tmp_path):
    model, tokenizer = fresh_model()
    engine = ScriptedRollout(tokenizer)
    before = params(model)
    seen = []

    def answered(prompts, completions, **_):
        seen.extend(completions)
        return [float(c.startswith("<answer>")) for c in completions]

    records = train(model, tokenizer, problems()[:8], {"answered": answered}, tiny_config(tmp_path), rollout=engine)
    assert engine.calls == 2 and set(seen) == set(ScriptedRollout.texts)
    assert [r["reward"] for r in records] == [0.5, 0.5] and records[0]["completion_length/max"] == 4  # <answer> 1 </answer> <eos>
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())

    class OneShort(ScriptedRollout):
        def generate(self, *args, **kwargs):
            out = super().generate(*args, **kwargs)
            out.completion_mask = out.completion_mask[:-1]
            return out

    with pytest.raises(ValueError, match=r"OneShort returned completion_mask of shape \[15, 4\], expected \[16, 4\]"):
        train(model, tokenizer, problems()[:8], {"answered": answered}, tiny_config(tmp_path / "short"), rollout=OneShort(tokenizer))


def test_triton_backend_end_to_end(tmp_path):
    """One step through the Triton kernels (the interpreter on CPU), as on a GPU."""
    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif os.environ.get("TRITON_INTERPRET") == "1":
        device = torch.device("cpu")
    else:
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    model, tokenizer = fresh_model()
    cfg = tiny_config(tmp_path, num_steps=1, prompts_per_step=2, num_generations=2, max_new_tokens=4, backend="triton")
    record = train(model, tokenizer, problems()[:4], REWARDS, cfg, device=device)[0]
    assert math.isfinite(record["loss"]) and math.isfinite(record["entropy"])


def test_cli_trains_a_saved_model(tmp_path, capsys):
    from grpo.__main__ import main

    model, tokenizer = fresh_model()
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"question": r["prompt"], "answer": r["answer"]}) for r in problems()[:4]))
    main([
        "train", "--model", str(tmp_path / "model"), "--data", str(data), "--prompt-key", "question",
        "--rewards", "grpo.demo:accuracy", "grpo.demo:format_reward", "--reward-weights", "1", "0.2",
        "--num-steps", "1", "--prompts-per-step", "2", "--num-generations", "2", "--max-new-tokens", "4",
        "--backend", "torch", "--no-progress", "--no-plot", "--output-dir", str(tmp_path / "out"),
    ])
    assert (tmp_path / "out" / "log.jsonl").exists() and (tmp_path / "out" / "model" / "config.json").exists()
    assert '"step": 1' in capsys.readouterr().out


# ---------------------------------------------------------------------------- the demo learns
def test_demo_learns(tmp_path):
    """A shorter demo: the warm start answers the wrong question; GRPO fixes it on held-out problems."""
    cfg = DemoConfig(output_dir=str(tmp_path / "demo"), grpo_steps=40, backend="torch", progress=False)
    summary = run_demo(cfg)
    before, after = summary["before"], summary["after"]
    assert before["format"] >= 0.9  # the warm start taught the format...
    assert before["greedy"] <= 0.4  # ...but not to add
    assert after["sampled"] >= before["sampled"] + 0.3
    assert after["greedy"] >= 0.7
    assert (tmp_path / "demo" / "curves.png").exists() and (tmp_path / "demo" / "summary.json").exists()


def test_the_loss_applies_the_models_final_logit_softcapping(tmp_path):
    """A Gemma-style head caps its logits: the trainer's log-probs must be the model's own."""
    model, tokenizer = fresh_model()
    model.config.final_logit_softcapping = 2.0  # tight, so capping changes every log-prob
    cfg = tiny_config(tmp_path, max_new_tokens=6)
    rollout = generate_rollouts(model, tokenizer, ["1+2=", "3+4="], cfg, num_generations=2)
    batch = update_batch(rollout, torch.zeros(4))
    cfg = dataclasses.replace(cfg, padding_free=False)
    got = completion_logps(prepare_model(model, cfg, torch.device("cpu")), batch, cfg, torch.device("cpu"))
    with torch.no_grad():
        out = unwrap_model_logits(model, batch)
        capped = 2.0 * torch.tanh(out / 2.0) / cfg.temperature
        expected = torch.log_softmax(capped.double(), -1).gather(-1, batch.completion_ids[..., None])[..., 0]
    m = batch.loss_mask != 0
    torch.testing.assert_close(got[m].double(), expected[m], rtol=1e-5, atol=1e-5)


def unwrap_model_logits(model, batch):
    am = batch.attention_mask
    out = model.base_model(input_ids=batch.input_ids, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0),
                           use_cache=False)
    return model.lm_head(out.last_hidden_state[:, batch.prompt_len - 1:-1]).float()
