"""The GRPO trainer on a tiny model built in code: masks, rewards, the loop, accumulation, resume, demo.

Everything runs on CPU in a few seconds except the demo test (about half a minute). The fused loss
uses backend="torch" (the conftest sets TRITON_INTERPRET=1, under which "auto" would pick the slow
Triton interpreter); one small test runs the Triton kernels through the interpreter end to end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
import types
from decimal import Decimal
from fractions import Fraction
from typing import Optional

import numpy as np
import pytest
import torch

import helpers
from helpers import generate_rollouts, leave_gloo_worker, random_update_batch, tiny_qwen2, torchrun, update_batch
from grpo import checkpoint, logs
from grpo.logs import run_values
from grpo_kernels.options import LOSS_AGG_MODES, LOSS_MODES
from spec64 import logprobs64, verl64, verl_agg64, verl_kl64
from grpo.demo import DemoConfig, accuracy, build_model_and_tokenizer, format_reward, problems, run_demo
from grpo.rewards import REWARD_FUNCTIONS
from grpo.rollout import Completions, HFGenerate, completion_mask
from grpo.trainer import (
    GRPOConfig, as_policy, completion_logps, default_rollout, make_optimizer, overlong_penalty, prepare_model,
    score, total_reward, train, update,
)


def length_reward(prompts, completions, **_):
    """Gives an untrained model (whose completions never close an answer) something to learn."""
    return [len(c) / 10 for c in completions]


REWARDS = {"accuracy": accuracy, "format": format_reward, "length": length_reward}


pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.timeout(900)]

TRAINER_RUN = dict(num_steps=2, prompts_per_step=4, max_new_tokens=12)


def tiny_config(tmp_path, **overrides) -> GRPOConfig:
    return helpers.tiny_config(tmp_path, **{**TRAINER_RUN, **overrides})


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
    model, tokenizer = build_model_and_tokenizer(seed=0)
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
    model, tokenizer = build_model_and_tokenizer(seed=0)
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
    if os.path.exists("/proc/self/status"):  # each phase's peak resident memory (grpo.memory); the save's after the fact
        phases = ("generation", "scoring", "logps", "backward", "optimizer")
        assert all(0 < records[1][f"memory/{p}_mb"] <= records[1]["peak_memory_mb"] for p in phases), records[1]
        assert "memory/setup_mb" in records[0] and "memory/save_mb" in records[-1] and records[-1] == lines[-1]
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_every_option_together_runs_and_stays_finite(tmp_path):
    model, tokenizer = build_model_and_tokenizer(seed=0)
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
    model, tokenizer = build_model_and_tokenizer(seed=0)
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
        m, _ = build_model_and_tokenizer(seed=0)
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
    model, tokenizer = build_model_and_tokenizer(seed=0)
    cfg = tiny_config(tmp_path, max_new_tokens=8)
    rollout = generate_rollouts(model, tokenizer, ["1+2=", "3+4="], cfg, num_generations=3)
    batch = update_batch(rollout, torch.zeros(6))
    padded = completion_logps(prepare_model(build_model_and_tokenizer(seed=0)[0], dataclasses.replace(cfg, padding_free=False), torch.device("cpu")),
                              batch, dataclasses.replace(cfg, padding_free=False), torch.device("cpu"))
    packed_cfg = dataclasses.replace(cfg, padding_free=True, max_tokens_per_microbatch=9)
    packed = completion_logps(prepare_model(build_model_and_tokenizer(seed=0)[0], packed_cfg, torch.device("cpu")), batch, packed_cfg,
                              torch.device("cpu"))
    assert padded.shape == packed.shape and (padded[rollout.completion_mask != 0] != 0).all()
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)


def test_resume_continues_as_the_uninterrupted_run(tmp_path):
    rows = problems()[:12]
    opts = dict(num_steps=4, num_iterations=2, beta=0.05, max_new_tokens=8)

    model, tokenizer = build_model_and_tokenizer(seed=0)
    straight = train(model, tokenizer, rows, REWARDS, tiny_config(tmp_path / "a", **opts))
    p_straight = params(model)

    model, tokenizer = build_model_and_tokenizer(seed=0)
    train(model, tokenizer, rows, REWARDS, tiny_config(tmp_path / "b", **dict(opts, num_steps=2)))
    with open(tmp_path / "b" / "run" / "log.jsonl", "a") as f:
        f.write('{"step": 3, "reward": 0.')  # killed while logging the step after the checkpoint
    torch.manual_seed(1234)  # whatever the process did in between must not matter
    model, tokenizer = build_model_and_tokenizer(seed=0)  # a new process would build the model again
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
    model, tokenizer = build_model_and_tokenizer(seed=0)
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
    model, tokenizer = build_model_and_tokenizer(seed=0)
    cfg = tiny_config(tmp_path, num_steps=1, prompts_per_step=2, num_generations=2, max_new_tokens=4, backend="triton")
    record = train(model, tokenizer, problems()[:4], REWARDS, cfg, device=device)[0]
    assert math.isfinite(record["loss"]) and math.isfinite(record["entropy"])


def test_cli_trains_a_saved_model(tmp_path, capsys):
    from grpo.__main__ import main

    helpers.save_demo_model(tmp_path / "model")
    data = helpers.write_prompts(tmp_path / "prompts.jsonl", 4, key="question")
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
    model, tokenizer = build_model_and_tokenizer(seed=0)
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


# ---------------------------------------------------------------------------------------------------
# The trainer refuses poison: non-finite rewards, losses, gradients and weights; bad data; a second run
# on one output directory; a SIGTERM. Each test failed before the fix it guards (issues 16, 29). The
# one-step run of helpers.tiny_config (2 prompts x 4 generations of 6 tokens).
# ---------------------------------------------------------------------------------------------------
def finite_params(model) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def completions(n: int):
    return types.SimpleNamespace(prompts=[f"p{i}" for i in range(n)], completions=[f"c{i}" for i in range(n)])


def test_non_finite_rewards_are_unscorable_with_a_warning_naming_function_and_row():
    def spiky(prompts, completions, **_):
        return [1.0, math.inf, None, -math.inf, math.nan, 1e39, 0.0, 2.0]

    with pytest.warns(RuntimeWarning, match=r"reward function 'spiky' returned inf for row 1 .*3 values"):
        per_fn, nonfinite = score({"spiky": spiky}, completions(8), {})
    assert per_fn.dtype == torch.float64
    assert torch.isnan(per_fn[[1, 2, 3, 4], 0]).all()  # +-inf and NaN: unscorable, as None is
    assert per_fn[5, 0].item() == 1e39  # huge but finite: a score (float32 would have made it inf)
    assert nonfinite.tolist() == [3]


@pytest.mark.parametrize(
    "values, kind",
    [(["1.0"] * 4, TypeError), (None, TypeError), ([[1.0]] * 4, TypeError), (1.0, TypeError), (torch.tensor(1.0), TypeError),
     ("1234", TypeError), ([1.0] * 3, ValueError)],
)
def test_a_reward_of_the_wrong_type_is_refused_naming_the_function(values, kind):
    def broken(prompts, completions, **_):
        return values

    with pytest.raises(kind, match="reward function 'broken'"):
        score({"broken": broken}, completions(4), {})


def test_rewards_as_tuples_arrays_and_tensors_are_read():
    import numpy as np

    for values in ((1.0, None, 0.5, 2), np.array([1.0, 7.0, 0.5, 2.0], dtype=np.float32), torch.tensor([1.0, 0.0, 0.5, 2.0])):
        per_fn, _ = score({"f": lambda p, c, **_: values}, completions(4), {})
        assert per_fn[[0, 2, 3], 0].tolist() == [1.0, 0.5, 2.0] and per_fn.shape == (4, 1)


def test_run_with_infinite_and_huge_rewards_stays_finite(tmp_path):
    """A reward of +-inf is unscorable; 1e39 is a score: advantages, weights and the checkpoint stay finite."""
    def spiky(prompts, completions, **_):
        return [[math.inf, 1e39, -math.inf, 0.5][i % 4] for i in range(len(completions))]

    model, tokenizer = build_model_and_tokenizer(seed=0)
    with pytest.warns(RuntimeWarning, match="reward function 'spiky' returned inf for row 0"):
        record = train(model, tokenizer, problems()[:4], {"spiky": spiky, "format": format_reward}, helpers.tiny_config(tmp_path))[0]
    assert record["rewards/spiky/nonfinite"] == 4 and record["skipped_updates"] == 0
    assert math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"]) and record["grad_norm"] > 0
    assert finite_params(model)
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    assert all(bool(torch.isfinite(v).all()) for v in state["model"].values())


def fixed_batch(model, tokenizer, cfg, advantages):
    engine = HFGenerate(tokenizer, max_new_tokens=cfg.max_new_tokens)
    return update_batch(engine.generate(as_policy(model), ["1+2=", "3+4="], 2), advantages)


@pytest.mark.parametrize("poison", ["advantage", "weight"])
def test_a_non_finite_loss_or_gradient_never_reaches_the_optimizer(tmp_path, poison):
    torch.manual_seed(0)
    model, tokenizer = build_model_and_tokenizer(seed=0)
    cfg = helpers.tiny_config(tmp_path, num_iterations=2)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    batch = fixed_batch(model, tokenizer, cfg, advantages)
    if poison == "advantage":
        batch.advantages = torch.tensor([math.inf, -1.0, 0.5, -0.5])
    else:  # a NaN in one layer's weights: NaN activations, loss and gradient
        with torch.no_grad():
            model.model.layers[1].mlp.down_proj.weight[0, 0] = math.nan
    policy = prepare_model(model, cfg, torch.device("cpu"))
    optimizer = make_optimizer(policy, cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(RuntimeWarning, match="skipped"):
        logs_ = update(policy, optimizer, batch, cfg, torch.device("cpu"))
    assert logs_["skipped_updates"] == 2  # both iterations
    assert not math.isfinite(logs_["loss"]) or not math.isfinite(logs_["grad_norm"])
    assert not optimizer.state  # AdamW never stepped: no moments filled with NaN
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, equal_nan=True)


def test_a_skipped_update_is_in_the_json_log_line(tmp_path):
    """A reward of 1e39 without std scaling gives an advantage beyond float32: that step is skipped and logged."""
    calls = []

    def huge(prompts, completions, **_):  # in the first step only
        calls.append(1)
        return [1e39 if i == 0 and len(calls) == 1 else float(i % 2) for i in range(len(completions))]

    model, tokenizer = build_model_and_tokenizer(seed=0)
    cfg = helpers.tiny_config(tmp_path, num_steps=2, scale_rewards="none")
    with pytest.warns(RuntimeWarning, match="skipped"):
        records = train(model, tokenizer, problems()[:4], {"huge": huge}, cfg)
    lines = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["skipped_updates"] for r in lines] == [1, 0] == [r["skipped_updates"] for r in records]
    assert lines[0]["loss"] is None or lines[0]["grad_norm"] is None  # non-finite: written as null
    assert finite_params(model)


def test_train_checks_every_row_before_it_starts(tmp_path):
    model, tokenizer = build_model_and_tokenizer(seed=0)
    rows = problems()[:6]
    del rows[4]["answer"]
    with pytest.raises(ValueError, match=r"rows\[4\] has no 'answer' column"):
        train(model, tokenizer, rows, {"accuracy": accuracy}, helpers.tiny_config(tmp_path))
    with pytest.raises(ValueError, match=r"rows\[0\]: empty prompt"):
        train(model, tokenizer, [{"prompt": ""}] * 4, {"format": format_reward}, helpers.tiny_config(tmp_path))
    with pytest.raises(TypeError, match=r"rows\[1\]: the prompt must be a str"):
        train(model, tokenizer, [{"prompt": "1+1="}, {"prompt": 7}], {"format": format_reward}, helpers.tiny_config(tmp_path))
    with pytest.raises(ValueError, match="no rows"):
        train(model, tokenizer, [], {"format": format_reward}, helpers.tiny_config(tmp_path))


def test_reward_functions_are_checked_before_the_run(tmp_path):
    model, tokenizer = build_model_and_tokenizer(seed=0)
    cfg = helpers.tiny_config(tmp_path)
    with pytest.raises(ValueError, match="share a name"):  # two lambdas: one would have been dropped
        train(model, tokenizer, problems()[:4], [lambda p, c, **_: [0.0] * len(c), lambda p, c, **_: [1.0] * len(c)], cfg)
    with pytest.raises(ValueError, match="at least one reward function"):
        train(model, tokenizer, problems()[:4], {}, cfg)
    with pytest.raises(TypeError, match="reward function 'x' is not callable"):
        train(model, tokenizer, problems()[:4], {"x": 1.0}, cfg)
    with pytest.raises(TypeError, match="rollout must implement"):
        train(model, tokenizer, problems()[:4], {"format": format_reward}, cfg, rollout=object())
    assert not os.path.exists(cfg.output_dir)  # refused before anything was written


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_any_real_number_like_reward_is_read_and_bools_are_0_or_1():
    """``np.array(..) == 1`` gives numpy.bool_: it stopped the run while Python and torch bools worked."""
    cases = [
        (np.array([1, 0, 1, 1]) == 1, [1.0, 0.0, 1.0, 1.0]),
        ([np.float32(0.5), np.int64(2), np.bool_(False), np.float16(1.5)], [0.5, 2.0, 0.0, 1.5]),
        ([Fraction(1, 4), Decimal("0.75"), True, torch.tensor(False)], [0.25, 0.75, 1.0, 0.0]),
        ([torch.tensor(0.5), torch.tensor([2]), np.array(3.0), np.array([4])], [0.5, 2.0, 3.0, 4.0]),
        (torch.tensor([True, False, True, False]), [1.0, 0.0, 1.0, 0.0]),
    ]
    for values, expected in cases:
        per_fn, nonfinite = score({"f": lambda p, c, **_: values}, completions(4), {})
        assert per_fn[:, 0].tolist() == expected and nonfinite.tolist() == [0], values


@pytest.mark.parametrize("value", ["1", b"1", [1.0], {"r": 1}, 1 + 2j, torch.tensor([1.0, 2.0]), object()])
def test_a_value_that_is_not_a_number_is_refused_naming_function_and_row(value):
    with pytest.raises(TypeError, match=r"reward function 'f' returned .* for row 2: expected a number or None"):
        score({"f": lambda p, c, **_: [1.0, None, value, 0.0]}, completions(4), {})


def test_a_number_beyond_float64_is_unscorable_with_a_warning():
    with pytest.warns(RuntimeWarning, match="reward function 'f' returned inf for row 1"):
        per_fn, nonfinite = score({"f": lambda p, c, **_: [1, 10**400, Decimal("NaN"), 0]}, completions(4), {})
    assert torch.isnan(per_fn[[1, 2], 0]).all() and nonfinite.tolist() == [2]


def test_a_reward_that_needs_a_missing_column_is_refused_before_the_first_step(tmp_path):
    """The default rewards without an ``answer`` column trained on format alone, logging accuracy: null."""
    model, tokenizer = build_model_and_tokenizer(seed=0)
    rows = [{"prompt": r["prompt"]} for r in problems()[:4]]
    cfg = helpers.tiny_config(tmp_path)
    with pytest.raises(ValueError, match=r"reward function 'accuracy' needs the column 'answer'"):
        train(model, tokenizer, rows, {"accuracy": REWARD_FUNCTIONS["accuracy"], "format": REWARD_FUNCTIONS["format"]}, cfg)
    with pytest.raises(ValueError, match=r"'code' needs the column 'tests'"):
        train(model, tokenizer, rows, {"code": REWARD_FUNCTIONS["code"]}, cfg)
    with pytest.raises(ValueError, match=r"'mine' needs the column 'gold'"):
        train(model, tokenizer, rows, {"mine": lambda prompts, completions, gold, **_: [0.0] * len(completions)}, cfg)
    assert not os.path.exists(cfg.output_dir)  # refused before anything was written


def test_a_run_without_learning_signal_says_so_in_the_log_and_warns(tmp_path):
    model, tokenizer = build_model_and_tokenizer(seed=0)
    cfg = helpers.tiny_config(tmp_path, num_steps=logs.ZERO_SIGNAL_PATIENCE, max_new_tokens=2)
    with pytest.warns(RuntimeWarning, match=f"no learning signal for {logs.ZERO_SIGNAL_PATIENCE} steps"):
        records = train(model, tokenizer, problems()[:4], {"flat": lambda p, c, **_: [1.0] * len(c)}, cfg)
    assert [r["zero_signal_steps"] for r in records] == list(range(1, logs.ZERO_SIGNAL_PATIENCE + 1))
    assert "warning" in records[-1] and all("warning" not in r for r in records[:-1])
    logged = [json.loads(line) for line in open(os.path.join(cfg.output_dir, "log.jsonl"))]
    assert "no learning signal" in logged[-1]["warning"]
    # the count restarts after a step with signal, and a resumed log gives the same count
    watch = logs.ZeroSignalWatch([{"zero_signal_frac": 1.0}, {"zero_signal_frac": 0.5}, {"zero_signal_frac": 1.0}])
    assert watch.update({"zero_signal_frac": 1.0}) == {"zero_signal_steps": 2}


def test_a_second_run_on_one_output_dir_is_refused_and_a_killed_runs_lock_is_not(tmp_path):
    out = str(tmp_path / "run")
    with checkpoint.RunLock(out):
        with pytest.raises(checkpoint.OutputDirInUse, match=rf"{out} is in use by another training run \(pid {os.getpid()}"):
            checkpoint.RunLock(out).__enter__()
        model, tokenizer = build_model_and_tokenizer(seed=0)
        with pytest.raises(checkpoint.OutputDirInUse, match=out):
            train(model, tokenizer, problems()[:4], {"format": format_reward}, helpers.tiny_config(tmp_path))
    # a process holding the lock is SIGKILLed: its lock file stays, its lock does not
    # (a forked child: it only takes the lock and sleeps, so no interpreter or torch to start again)
    ready, done = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            checkpoint.RunLock(out).__enter__()
            os.write(done, b"locked")
            time.sleep(600)
        finally:
            os._exit(1)
    assert os.read(ready, 6) == b"locked"
    with pytest.raises(checkpoint.OutputDirInUse, match=f"pid {pid}"):
        checkpoint.RunLock(out).__enter__()
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert os.path.exists(os.path.join(out, checkpoint.LOCK_FILENAME))
    with checkpoint.RunLock(out):
        pass


def test_a_fresh_run_never_replaces_a_checkpoint_and_resume_refuses_changed_settings(tmp_path):
    model, tokenizer = build_model_and_tokenizer(seed=0)
    rows, rewards = problems()[:4], {"format": format_reward}
    train(model, tokenizer, rows, rewards, helpers.tiny_config(tmp_path))
    path = os.path.join(tmp_path, "run", "checkpoint.pt")
    before = os.stat(path).st_mtime_ns
    with pytest.raises(FileExistsError, match=r"already holds a checkpoint .*--resume .*another --output-dir"):
        train(model, tokenizer, rows, rewards, helpers.tiny_config(tmp_path))
    for field, value in (("beta", 0.1), ("num_generations", 2), ("learning_rate", 1e-2), ("seed", 1), ("loss_type", "grpo")):
        with pytest.raises(ValueError, match=rf"{field}: .* -> {value!r}.*--resume-with-changes"):
            train(model, tokenizer, rows, rewards, helpers.tiny_config(tmp_path, num_steps=2, resume=True, **{field: value}))
    assert os.stat(path).st_mtime_ns == before  # nothing was replaced
    # what may change: the length of the run, logging, the layout of the same maths
    records = train(model, tokenizer, rows, rewards, helpers.tiny_config(tmp_path, num_steps=2, resume=True, micro_batch_size=2,
                                                                 padding_free=False))
    assert [r["step"] for r in records] == [1, 2]
    records = train(model, tokenizer, rows, rewards, helpers.tiny_config(tmp_path, num_steps=3, resume=True, beta=0.1,
                                                                 resume_with_changes=True))
    assert [r["step"] for r in records] == [1, 2, 3]


SIGTERM_CHILD = textwrap.dedent("""
    import os, signal, sys
    import torch
    from grpo.demo import build_model_and_tokenizer, problems
    from grpo.trainer import train
    sys.path.insert(0, {tests!r})
    from helpers import tiny_config
    from test_trainer import pathlib_dir, counting_reward
    torch.set_num_threads(1)
    model, tokenizer = build_model_and_tokenizer(seed=0)
    train(model, tokenizer, problems()[:8], {{"r": counting_reward(kill_at_call=2)}},
          tiny_config(pathlib_dir({out!r}), num_steps=50))
""")


def pathlib_dir(path: str):
    import pathlib

    return pathlib.Path(path)


def counting_reward(kill_at_call: int = 0):
    """A reward that varies with the completion; on its ``kill_at_call``-th call the process gets a real SIGTERM."""
    calls = [0]

    def r(prompts, completions, **_):
        calls[0] += 1
        if calls[0] == kill_at_call:
            os.kill(os.getpid(), signal.SIGTERM)
        return [float(len(c) % 3) for c in completions]

    r.__name__ = "r"
    return r


def test_sigterm_saves_a_checkpoint_and_exits_and_the_resumed_run_is_the_uninterrupted_one(tmp_path):
    killed = tmp_path / "killed"
    child = subprocess.run([sys.executable, "-c", SIGTERM_CHILD.format(tests=os.path.join(ROOT, "tests"), out=str(killed))],
                           cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=600)
    assert child.returncode == 128 + signal.SIGTERM, child.stderr[-3000:]
    assert "SIGTERM: stopped after step 2; checkpoint written to" in child.stderr
    assert torch.load(killed / "run" / "checkpoint.pt", weights_only=False)["step"] == 2
    assert not os.path.exists(killed / "run" / "checkpoint.pt.tmp")
    model, tokenizer = build_model_and_tokenizer(seed=0)
    resumed = train(model, tokenizer, problems()[:8], {"r": counting_reward()}, helpers.tiny_config(killed, num_steps=3, resume=True))
    p_resumed = {k: v.clone() for k, v in model.state_dict().items()}
    model, tokenizer = build_model_and_tokenizer(seed=0)
    straight = train(model, tokenizer, problems()[:8], {"r": counting_reward()}, helpers.tiny_config(tmp_path / "straight", num_steps=3))
    assert [run_values(r) for r in resumed] == [run_values(r) for r in straight]
    for k, v in model.state_dict().items():
        assert torch.equal(p_resumed[k], v), k


# --------------------------------------------------------------------------------------------------
# verl's loss_mode (issue 27): one update equals verl's ppo_loss of the whole batch, under any
# micro-batching (padded or packed) and on 2 ranks (DDP, and FSDP2 once). The reference is
# tests/spec64.py's float64 restatement of verl 0.9.1's ppo_loss / agg_loss (verl64) over the whole
# batch in one call, with no global keywords; one row has completion tokens but no loss token, which
# verl's sequence count leaves out. The 2-rank case runs this file as its worker under torchrun.
# --------------------------------------------------------------------------------------------------
COMMON = dict(helpers.TINY_UPDATE, max_grad_norm=math.inf)
# verl's three axes, every aggregation mode of the spec's own list; gspo's policy term reduced by
# loss_agg_mode, as verl 0.9.1 does (0.9.0 forced seq-mean-token-mean); verl 0.9's newer modes when the spec has them
CASES = {f"vanilla-{agg}": dict(loss_mode="vanilla", loss_agg_mode=agg) for agg in LOSS_AGG_MODES}
CASES.update({
    "gspo": dict(loss_mode="gspo", loss_agg_mode="token-mean"),
    "cispo-seq-mean-token-mean-k1": dict(loss_mode="cispo", loss_agg_mode="seq-mean-token-mean", kl_loss_type="k1"),
})
CASES.update({f"{mode}-seq-mean-token-sum": dict(loss_mode=mode, loss_agg_mode="seq-mean-token-sum", **extra)
              for mode, extra in (("dppo_tv", {}), ("dro", dict(dro_beta=0.1))) if mode in LOSS_MODES})
# micro-batchings of one update: padded rows per micro-batch, or packed tokens per micro-batch
SPLITS = {
    "one": dict(padding_free=False),
    "padded-1": dict(padding_free=False, micro_batch_size=1),
    "padded-5": dict(padding_free=False, micro_batch_size=5),
    "packed-12": dict(padding_free=True, max_tokens_per_microbatch=12),
}
MICRO_SPLITS = ("one", "padded-1", "packed-12")  # (padded-1: a micro-batch holds only the row without loss tokens)
RANK0_ROWS = 8  # of the 12 rows (unequal shares, as drop_zero_signal_groups leaves)


def verl_reference(batch, case: dict):
    """(loss, {"actor/entropy", "actor/kl_loss"}, grads by parameter name): verl's ppo_loss of the whole
    batch in float64 (one call, no global keywords)."""
    model = tiny_qwen2().double()
    am, P = batch.attention_mask, batch.prompt_len
    out = model.base_model(input_ids=batch.input_ids, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0),
                           use_cache=False)
    logits = model.lm_head(out.last_hidden_state[:, P - 1 : -1])
    m = batch.loss_mask.double()
    logp, entropy = logprobs64(logits, torch.where(m != 0, batch.completion_ids, -100))
    adv = batch.advantages.double()[:, None].expand_as(m)
    agg_mode, kl_type = case["loss_agg_mode"], case.get("kl_loss_type", "low_var_kl")
    loss = verl64(logp, entropy, adv, m, old=batch.old_logps, ref=batch.ref_logps, **{**case, "kl_loss_type": kl_type},
                  beta=COMMON["beta"], entropy_coef=COMMON["entropy_coef"], eps_low=COMMON["eps_low"],
                  eps_high=COMMON["eps_high"], loss_scale_factor=COMMON["max_new_tokens"])
    loss.backward()
    with torch.no_grad():
        shares = {"actor/entropy": verl_agg64(entropy, m, agg_mode, loss_scale_factor=COMMON["max_new_tokens"]),
                  "actor/kl_loss": verl_agg64(verl_kl64(logp, batch.ref_logps.double(), kl_type), m, agg_mode,
                                              loss_scale_factor=COMMON["max_new_tokens"])}
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), {k: float(v) for k, v in shares.items()}, grads


def trainer_update(batch, case: dict, split: dict, **overrides):
    """(logs, grads by parameter name) of one ``grpo.trainer.update`` on ``batch`` (this rank's share)."""
    from grpo.trainer import GRPOConfig, make_optimizer, prepare_model, update

    cfg = GRPOConfig(**COMMON, **case, **split, **overrides)
    policy = prepare_model(tiny_qwen2(), cfg, torch.device("cpu"))
    logs = update(policy, make_optimizer(policy, cfg), batch, cfg, torch.device("cpu"))
    grads = {name.removeprefix("module.").removeprefix("model."): full(p.grad).detach().clone()
             for name, p in policy.named_parameters() if p.grad is not None}
    return logs, grads


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # (a sharded DTensor under FSDP2)


def check_against_reference(logs, grads, reference, what: str) -> None:
    loss, shares, ref_grads = reference
    assert ref_grads.keys() == grads.keys(), what
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    assert scale > 1e-3, what  # a gradient worth comparing
    for name, expected in ref_grads.items():
        helpers.assert_close64(grads[name], expected, scale=scale, what=f"{what}: grad of {name}")
    assert logs["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6), what
    for key, value in shares.items():
        assert logs[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (what, key)


@pytest.fixture(scope="module")
def references():
    torch.set_num_threads(1)
    batch = random_update_batch(min_completion=1, lossless_row=5)
    return batch, {name: verl_reference(batch, case) for name, case in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_loss_mode_update_is_verls_loss_of_the_whole_batch_under_any_micro_batching(case, references):
    batch, refs = references
    assert int((batch.loss_mask.sum(-1) > 0).sum()) == len(batch) - 1  # (the row without loss tokens is there)
    for split_name in MICRO_SPLITS:
        logs, grads = trainer_update(batch, CASES[case], SPLITS[split_name])
        check_against_reference(logs, grads, refs[case], f"{case} {split_name}")


def test_geo_mean_in_one_micro_batch_is_verls(references):
    """geo_mean's policy term is a mean over the call's sequences (verl's torch.mean), which no global
    keyword reaches: one micro-batch in one process is verl's loss of the batch (docs/trainer.md)."""
    batch, _ = references
    case = dict(loss_mode="geo_mean", loss_agg_mode="seq-mean-token-mean")
    logs, grads = trainer_update(batch, case, SPLITS["one"])
    check_against_reference(logs, grads, verl_reference(batch, case), "geo_mean one")


def test_loss_mode_splits_differ_without_the_global_keywords(references):
    """The comparison above can fail: summing micro-batch losses each reduced over its own tokens
    (verl's agg_loss without batch_num_tokens) is not the batch's loss."""
    batch, refs = references
    import grpo_kernels

    loss, _, _ = refs["vanilla-token-mean"]
    model = tiny_qwen2()
    total = 0.0
    for rows in (torch.arange(0, 1), torch.arange(1, 12)):
        mb = batch.rows(rows)
        am = mb.attention_mask
        hidden = model.base_model(input_ids=mb.input_ids, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0),
                                  use_cache=False).last_hidden_state[:, mb.prompt_len - 1 : -1]
        total += float(grpo_kernels.fused_linear_grpo_loss(
            hidden, model.lm_head.weight, mb.completion_ids, mb.advantages, mb.loss_mask, old_logps=mb.old_logps,
            ref_logps=mb.ref_logps, loss_mode="vanilla", loss_agg_mode="token-mean", beta=COMMON["beta"],
            entropy_coef=COMMON["entropy_coef"], eps_low=0.2, eps_high=0.28, backend="torch").loss)
    assert abs(total - loss) > 1e-3


# ---------------------------------------------------------------------------- 2 ranks
DDP_CASES = ("vanilla-token-mean", "gspo", "vanilla-seq-mean-token-sum")
if "token-sum" in LOSS_AGG_MODES:  # verl 0.9's token-sum, and its seq-mean-token-sum-norm (with dp_size), which came with it
    DDP_CASES += ("vanilla-token-sum", "vanilla-seq-mean-token-sum-norm")
DDP_SPLITS = ("padded-5", "packed-12")
DDP_RUNS = [("ddp", case, split) for case in DDP_CASES for split in DDP_SPLITS]
DDP_RUNS += [("fsdp", "vanilla-seq-mean-token-sum", "packed-12")]


def worker_ddp(out_path: str) -> None:
    from grpo import distributed

    distributed.setup("ddp")
    batch = random_update_batch(min_completion=1, lossless_row=5)
    rows = torch.arange(0, RANK0_ROWS) if distributed.rank() == 0 else torch.arange(RANK0_ROWS, len(batch))
    results = {(kind, case, split): trainer_update(batch.rows(rows), CASES[case], SPLITS[split], distributed=kind)
               for kind, case, split in DDP_RUNS}
    if distributed.is_main_process():
        torch.save(results, out_path)


def test_two_ranks_give_the_single_process_update(tmp_path, references):
    out = tmp_path / "ddp.pt"
    torchrun([os.path.abspath(__file__), "ddp", str(out)], timeout=600)
    results = torch.load(out, weights_only=False)
    batch, refs = references
    assert set(results) == set(DDP_RUNS)
    for (kind, case, split), (rank_logs, grads) in results.items():
        check_against_reference(rank_logs, grads, refs[case], f"{kind} {case} {split}")
        single_logs, single_grads = trainer_update(batch, CASES[case], SPLITS["one"])
        for name, g in single_grads.items():  # and the single-process trainer, to fp32 rounding
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{case} {split} {name}: {m}")


if __name__ == "__main__":  # a worker, started by torchrun
    torch.set_num_threads(1)
    {"ddp": worker_ddp}[sys.argv[1]](sys.argv[2])
    leave_gloo_worker()


# --------------------------------------------------------------------------------------------------
# Every refusal of grpo.train comes before anything changes, loads or is created (issue 37): a table of
# refusals, each checked for the same property: the caller's model bitwise as it was (values, dtypes,
# modules: no LoRA layers, config), the RNG as it was, the output directory as it was (not created when
# it was absent), no lock left held. The run would cast to bf16 and add LoRA adapters, so a refusal that
# came after either would show.
# --------------------------------------------------------------------------------------------------
class ReportingRollout(ScriptedRollout):
    """ScriptedRollout that reports the engine's log-probs of the sampled tokens (as vLLM does)."""

    def generate(self, policy, prompts, num_generations, *, greedy=False):
        out = super().generate(policy, prompts, num_generations, greedy=greedy)
        g = torch.Generator().manual_seed(self.calls)
        out.sampling_logps = (-torch.rand(out.completion_ids.shape, generator=g) * 2).float() * out.completion_mask
        return out


class LongPromptEngine(ScriptedRollout):
    reports_sampling_logps = False

    def check_prompts(self, prompts):
        raise ValueError(f"prompt 0 ({prompts[0][:10]!r}) has too many tokens for this engine")


def model_state(model) -> dict:
    return {"tensors": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "dtypes": {k: v.dtype for k, v in model.state_dict().items()},
            "modules": [(n, type(m).__name__) for n, m in model.named_modules()],
            "grad": {n: p.requires_grad for n, p in model.named_parameters()},
            "config": model.config.to_json_string(), "rng": torch.get_rng_state()}


def directory_state(path) -> Optional[list]:
    if not os.path.exists(path):
        return None
    return sorted((os.path.relpath(os.path.join(d, f), path), os.stat(os.path.join(d, f)).st_mtime_ns,
                   os.stat(os.path.join(d, f)).st_size) for d, _, files in os.walk(path) for f in files)


def crafted_checkpoint(path: str, weights_of=None, config: Optional[dict] = None, **changes) -> None:
    """A checkpoint file as checkpoint.save lays it out (``weights_of``'s weights, an empty optimizer), or with ``changes``."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    weights = weights_of.state_dict() if weights_of is not None else {}
    state = {"step": 1, "model": {k: v.detach().clone() for k, v in weights.items()},
             "ref_model": None, "optimizer": {"state": {}, "param_groups": []}, "rng": checkpoint.rng_state(),
             "config": config}
    state.update(changes)
    torch.save(state, path)


def _refusals():
    """name -> (setup(tmp_path, model, cfg) -> train's arguments (or None to skip), the error, words its message names)."""
    ckpt = lambda cfg: checkpoint.path_in(cfg.output_dir)  # noqa: E731
    other_model = lambda: build_model_and_tokenizer(seed=1)[0]  # noqa: E731
    tiny_other = {"lm_head.weight": torch.zeros(3, 2)}
    return {
        "cfg not a GRPOConfig": (lambda p, m, c: dict(cfg=dataclasses.asdict(c)), TypeError, ["cfg"]),
        "rollout not a Rollout": (lambda p, m, c: dict(rollout=object()), TypeError, ["rollout"]),
        "a row without a prompt": (lambda p, m, c: dict(rows=[{"question": "1+1="}] * 4), ValueError, ["rows[0]"]),
        "no reward function": (lambda p, m, c: dict(rewards={}), ValueError, ["reward function"]),
        "reward weights for other functions": (lambda p, m, c: dict(cfg=dataclasses.replace(c, reward_weights=[1.0, 2.0])),
                                               ValueError, ["reward_weights"]),
        "a reward's column missing": (lambda p, m, c: dict(rows=[{"prompt": r["prompt"]} for r in problems()[:4]],
                                                           rewards={"accuracy": accuracy}), ValueError, ["'answer'"]),
        "LoRA target that does not exist": (lambda p, m, c: dict(cfg=dataclasses.replace(c, lora_target_modules="nope_proj")),
                                            ValueError, ["lora_target_modules", "nope_proj"]),
        "LoRA target that is a norm": (lambda p, m, c: dict(cfg=dataclasses.replace(c, lora_target_modules="q_proj,input_layernorm")),
                                       ValueError, ["lora_target_modules", "input_layernorm", "Qwen2RMSNorm"]),
        "LoRA target that is a block": (lambda p, m, c: dict(cfg=dataclasses.replace(c, lora_target_modules="mlp")),
                                        ValueError, ["lora_target_modules", "Qwen2MLP"]),
        "LoRA target lm_head": (lambda p, m, c: dict(cfg=dataclasses.replace(c, lora_target_modules="lm_head")),
                                ValueError, ["lm_head"]),
        "MLP chunks on a model without `mlp` modules": (  # (the layers' MLPs renamed: nothing to chunk)
            lambda p, m, c: [layer._modules.__setitem__("feed_forward", layer._modules.pop("mlp")) for layer in m.model.layers]
            and dict(cfg=dataclasses.replace(c, mlp_chunk_tokens=8)), ValueError, ["mlp_chunk_tokens", "no decoder layer"]),
        "the model's head transform": (lambda p, m, c: setattr(m.config, "final_logit_softcapping", -1.0) or {},
                                       ValueError, ["softcap"]),
        "vespo with an engine that may report log-probs": (
            lambda p, m, c: dict(cfg=dataclasses.replace(c, loss_type="vespo"), rollout=ReportingRollout(None)),
            ValueError, ["vllm_importance_sampling_mode", "vespo", "reports_sampling_logps"]),
        "a prompt too long for the engine": (lambda p, m, c: dict(rollout=LongPromptEngine(None)), ValueError, ["too many tokens"]),
        "ranks that do not divide the batch": (lambda p, m, c: os.environ.__setitem__("WORLD_SIZE", "3") or {},
                                               ValueError, ["prompts_per_step", "3 ranks"]),
        "a checkpoint of an earlier run": (lambda p, m, c: crafted_checkpoint(ckpt(c), m) or {}, FileExistsError,
                                           ["already holds a checkpoint", "--resume"]),
        "a live run holds the directory": (lambda p, m, c: {"hold_lock": True}, checkpoint.OutputDirInUse, ["in use"]),
        "resume: a corrupt checkpoint": (
            lambda p, m, c: (os.makedirs(c.output_dir), open(ckpt(c), "wb").write(b"\x00not a checkpoint")) and
            dict(cfg=dataclasses.replace(c, resume=True)), checkpoint.CheckpointError, ["checkpoint.pt", "not a readable"]),
        "resume: a truncated checkpoint": (
            lambda p, m, c: (crafted_checkpoint(ckpt(c), m), os.truncate(ckpt(c), 300)) and
            dict(cfg=dataclasses.replace(c, resume=True)), checkpoint.CheckpointError, ["checkpoint.pt"]),
        "resume: another program's file": (
            lambda p, m, c: os.makedirs(c.output_dir) or torch.save({"weights": torch.zeros(2)}, ckpt(c)) or
            dict(cfg=dataclasses.replace(c, resume=True)), checkpoint.CheckpointError, ["checkpoint.pt", "not a grpo checkpoint"]),
        "resume: another model's weights": (
            lambda p, m, c: crafted_checkpoint(ckpt(c), None, model=tiny_other) or dict(cfg=dataclasses.replace(c, resume=True)),
            checkpoint.CheckpointError, ["checkpoint.pt", "another model"]),
        "resume: other settings": (
            lambda p, m, c: crafted_checkpoint(ckpt(c), m, {**dataclasses.asdict(c), "learning_rate": 0.5}) or
            dict(cfg=dataclasses.replace(c, resume=True)), ValueError, ["learning_rate: 0.5 ->", "--resume-with-changes"]),
        "resume: a LoRA checkpoint of another model": (
            lambda p, m, c: crafted_checkpoint(ckpt(c), other_model().model.layers[0]) or
            dict(cfg=dataclasses.replace(c, resume=True)), checkpoint.CheckpointError, ["another model"]),
    }


REFUSALS = _refusals()


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_refused_run_changes_loads_and_creates_nothing(case, tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # (a case may set WORLD_SIZE: this test's copy only)
    model, tokenizer = build_model_and_tokenizer(seed=0)
    cfg = helpers.tiny_config(tmp_path, model_dtype="bfloat16", use_peft=True, beta=0.1, lora_target_modules="q_proj,v_proj")
    setup, error, words = REFUSALS[case]
    args = dict(cfg=cfg, rows=problems()[:4], rewards={"format": format_reward}, rollout=None)
    args.update(setup(tmp_path, model, cfg) or {})
    hold = args.pop("hold_lock", False)
    for engine in (args["rollout"],):
        if isinstance(engine, ScriptedRollout):
            engine.tokenizer = tokenizer
    before, directory = model_state(model), directory_state(cfg.output_dir)
    lock = checkpoint.RunLock(cfg.output_dir) if hold else contextlib.nullcontext()
    with lock:
        directory = directory_state(cfg.output_dir) if hold else directory
        with pytest.raises(error) as refused:
            train(model, tokenizer, args["rows"], args["rewards"], args["cfg"], rollout=args["rollout"])
        assert all(w in str(refused.value) for w in words), str(refused.value)
        assert directory_state(cfg.output_dir) == directory, "the output directory changed"
    after = model_state(model)
    assert after["modules"] == before["modules"] and after["dtypes"] == before["dtypes"]  # no cast, no LoRA layers
    assert after["grad"] == before["grad"] and after["config"] == before["config"]
    assert all(torch.equal(after["tensors"][k], v) for k, v in before["tensors"].items())
    assert torch.equal(after["rng"], before["rng"])
    with checkpoint.RunLock(cfg.output_dir):  # (no lock left held)
        pass


def test_the_refusal_table_covers_every_check_of_check_run():
    """Each check train() makes before anything changes is a row of the table above (by its words)."""
    import inspect

    from grpo import trainer

    source = inspect.getsource(trainer.check_run)
    for check in ("check_flags", "check_targets", "mlp_modules", "check_rows", "as_named", "reward_weights", "check_reward_columns",
                  "prompts_per_step", "grpo_options", "sequence_correction_refused", "check_prompts",
                  "check_output_dir", "check_not_in_use", "checkpoint.read", "check_resumable"):
        assert check in source, check
    assert len(REFUSALS) >= 20


def test_an_accepted_run_after_refusals_trains_with_rollout_correction_max_none(tmp_path):
    """rollout_correction_max=None (vllm_importance_sampling_clip_max=None, "unbounded") with token_truncate
    crashed in torch.clamp at the first step: now the ratio is left unclamped, and the step is finite."""
    model, tokenizer = build_model_and_tokenizer(seed=0)
    cfg = tiny_config(tmp_path, num_steps=1, vllm_importance_sampling_mode="token_truncate",
                      vllm_importance_sampling_clip_max=None)
    assert cfg.grpo_options().rollout_correction_max is None and cfg.grpo_options().rollout_correction_min is None
    records = train(model, tokenizer, problems()[:8], {"format": format_reward}, cfg, rollout=ReportingRollout(tokenizer))
    assert math.isfinite(records[0]["loss"]) and records[0]["sampling/importance_sampling_ratio/max"] > 0


def test_vespo_s_correction_is_decided_from_the_engine_s_declaration(tmp_path):
    """vespo takes a per-token correction of the engine's log-probs (TRL). Whether an engine reports them
    is known before the first step only from its declaration (grpo.rollout.Rollout): Hugging Face generate
    declares it never does, so the default (sequence-level) mode is fine there; an engine that says
    False and then reports them is refused at that step, before its log-probs are used."""
    cfg = tiny_config(tmp_path, num_steps=1, loss_type="vespo")
    model, tokenizer = build_model_and_tokenizer(seed=0)
    tokenizer_engine = HFGenerate(tokenizer, max_new_tokens=4)
    assert tokenizer_engine.reports_sampling_logps is False and ReportingRollout(tokenizer).__dict__.get("reports_sampling_logps") is None
    records = train(model, tokenizer, problems()[:8], {"format": format_reward}, cfg)  # (HF generate)
    assert math.isfinite(records[0]["loss"])

    class Undeclared(ReportingRollout):
        reports_sampling_logps = False

    with pytest.raises(ValueError, match="Undeclared declares reports_sampling_logps = False but returned sampling_logps"):
        train(model, tokenizer, problems()[:8], {"format": format_reward}, tiny_config(tmp_path / "b", num_steps=1),
              rollout=Undeclared(tokenizer))
    token = dataclasses.replace(cfg, output_dir=str(tmp_path / "c"), vllm_importance_sampling_mode="token_mask")
    records = train(model, tokenizer, problems()[:8], {"format": format_reward}, token, rollout=ReportingRollout(tokenizer))
    assert "sampling/importance_sampling_ratio/mean" in records[0]


def test_sampling_settings_reach_the_engine_and_every_log_prob(tmp_path):
    """GRPOConfig.top_k / top_p reach the rollout engine (transformers' warpers: temperature, top-k, top-p,
    vLLM's order and rules) and every log-prob of the loss: the old policy's and the reference's are those
    of the same truncated distribution (spec64's float64 restatement of vLLM), every token the engine drew
    lies in our kept set, and a step logs the share of loss tokens outside it."""
    model, tokenizer = build_model_and_tokenizer(seed=0)
    cfg = tiny_config(tmp_path, top_k=4, top_p=0.85, temperature=0.9, num_steps=1, num_iterations=2, beta=0.04)
    engine = default_rollout(model, tokenizer, cfg)
    assert (engine.temperature, engine.top_k, engine.top_p) == (0.9, 4, 0.85)
    torch.manual_seed(1)
    rollout = engine.generate(as_policy(model), [p["prompt"] for p in problems()[:4]], 4)
    batch = update_batch(rollout, torch.zeros(len(rollout.prompts)))
    logps = completion_logps(model, batch, cfg, torch.device("cpu"))
    mask = rollout.completion_mask.bool()
    assert torch.isfinite(logps[mask]).all(), "a token the engine drew lies outside the loss's kept set"
    with torch.no_grad():
        logits = model.double()(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                position_ids=(batch.attention_mask.cumsum(-1) - 1).clamp(min=0)).logits
    model.float()
    from spec64 import sampled_logprobs64

    P = batch.prompt_len
    ids = torch.where(mask, rollout.completion_ids, -100)
    expected = sampled_logprobs64(logits[:, P - 1:-1], ids, 0.9, 4, 0.85)[0]
    helpers.assert_close64(torch.where(mask, logps, 0.0), torch.where(mask, expected, 0.0), scale=5, what="old log-probs")
    full = logprobs64(logits[:, P - 1:-1], ids, 0.9)[0]
    assert (expected - full)[mask].abs().max() > 1e-3, "the truncation must matter in this case"
    record = train(model, tokenizer, problems()[:4], REWARDS, cfg)[0]
    assert "sampling/outside_kept_set" in record and 0.0 <= record["sampling/outside_kept_set"] <= 1.0
    assert math.isfinite(record["loss"]) and math.isfinite(record["kl"])
    plain = train(*build_model_and_tokenizer(seed=0), problems()[:4], REWARDS, tiny_config(tmp_path / "plain", num_steps=1))[0]
    assert "sampling/outside_kept_set" not in plain


# ---------------------------------------------------------------------------- sampling-mask replay
def sets_of(mask) -> list[list[int]]:
    """A SamplingMask as Python lists, one per position."""
    o = mask.offsets.tolist()
    return [mask.token_ids[o[i]:o[i + 1]].tolist() for i in range(mask.num_positions)]


def test_the_kept_sets_follow_their_tokens_into_every_micro_batch():
    """UpdateBatch.sampling_mask (B * T sets, row-major) is cut with its rows (padded micro-batches, dropped
    groups) and re-ordered with its tokens when packed: each packed position owns the set of the completion
    token it predicts, an empty one where it predicts none; fillers hold empty sets."""
    from grpo import packing
    from grpo.trainer import micro_batches
    from grpo_kernels import SamplingMask

    batch = random_update_batch(min_completion=1)
    B, T = batch.completion_ids.shape
    g = torch.Generator().manual_seed(5)
    sets = [sorted(set(torch.randint(0, 24, (int(torch.randint(1, 6, (), generator=g)),), generator=g).tolist())
                   | {int(batch.completion_ids[b, t])}) if batch.attention_mask[b, batch.prompt_len + t] else []
            for b in range(B) for t in range(T)]
    batch.sampling_mask = SamplingMask.from_lists(sets)
    for size in (None, 5, 1):
        cfg = GRPOConfig(padding_free=False, micro_batch_size=size)
        start = 0
        for mb in micro_batches(batch, cfg):
            n = len(mb)
            assert sets_of(mb.sampling_mask) == sets[start * T:(start + n) * T], size
            start += n
        assert start == B
    picked = torch.tensor([7, 3, 10])
    assert sets_of(batch.rows(picked).sampling_mask) == [s for b in picked.tolist() for s in sets[b * T:(b + 1) * T]]
    for budget in (None, 9, 1):
        seen = set()
        for mb in micro_batches(batch, GRPOConfig(padding_free=True, max_tokens_per_microbatch=budget)):
            source = mb.layout.source.reshape(-1).tolist()
            assert mb.sampling_mask.num_positions == mb.num_tokens
            assert sets_of(mb.sampling_mask) == [sets[s] if s >= 0 else [] for s in source], budget
            seen |= {s for s in source if s >= 0}
            targets = mb.completion_ids.reshape(-1)
            assert all(int(targets[j]) in got for j, got in enumerate(sets_of(mb.sampling_mask)) if source[j] >= 0)
        assert seen == {b * T + t for b in range(B) for t in range(T) if sets[b * T + t]}, budget
    assert sets_of(batch.filler().sampling_mask) == [[]] * T
    assert sets_of(packing.filler_micro_batch(batch).sampling_mask) == [[]]
    batch.sampling_mask = None
    assert all(mb.sampling_mask is None for c in (dict(padding_free=False, micro_batch_size=5), dict(padding_free=True))
               for mb in micro_batches(batch, GRPOConfig(**c)))


@pytest.mark.parametrize("replay", [True, False])
def test_a_truncating_run_replays_the_engines_sets_or_recomputes(tmp_path, monkeypatch, replay):
    """Three steps at top_k=5, top_p=0.9 (grpo_loss's old and reference passes too: num_iterations=2, beta > 0,
    packed micro-batches): with sampling_replay every log-prob the loss takes is over the sets HFGenerate
    reported, so no sampled token falls outside them; off, the loss recomputes top_k / top_p. Both train."""
    import grpo.models as models

    calls = []
    real = models.truncation
    monkeypatch.setattr(models, "truncation", lambda mb, cfg: calls.append(real(mb, cfg)) or calls[-1])
    model, tokenizer = build_model_and_tokenizer(seed=0)
    before = params(model)
    cfg = tiny_config(tmp_path, num_steps=3, top_k=5, top_p=0.9, num_iterations=2, beta=0.04, max_tokens_per_microbatch=40,
                      sampling_replay=replay)
    records = train(model, tokenizer, problems()[:8], REWARDS, cfg)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["kl"]) and r["grad_norm"] > 0 for r in records)
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    # old, reference and policy passes, several micro-batches each
    assert len(calls) > 3 * 4
    if replay:
        assert all("sampling_mask" in c and c["top_k"] is None and c["top_p"] is None for c in calls)
        assert all(r["sampling/outside_kept_set"] == 0.0 for r in records)
    else:
        assert all("sampling_mask" not in c and (c["top_k"], c["top_p"]) == (5, 0.9) for c in calls)
