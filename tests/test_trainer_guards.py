"""The trainer refuses poison: non-finite rewards, losses, gradients and weights; bad data; torn logs.

Each test here failed before the fix it guards (issue 16). Tiny model built in code, CPU, fp32, the
"torch" backend; about ten seconds in all.
"""

from __future__ import annotations

import json
import math
import os
import types

import pytest
import torch

from grpo import checkpoint, logs
from grpo.advantages import group_advantages
from grpo.config import GRPOConfig
from grpo.data import columns_of, load_jsonl
from grpo.demo import accuracy, build_model_and_tokenizer, format_reward, problems
from grpo.rollout import HFGenerate
from grpo.trainer import UpdateBatch, as_policy, make_optimizer, prepare_model, score, train, update


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_config(tmp_path, **overrides) -> GRPOConfig:
    base = dict(
        output_dir=str(tmp_path / "run"), seed=0, num_steps=1, prompts_per_step=2, num_generations=4,
        max_new_tokens=6, learning_rate=1e-3, backend="torch", progress=False, plot=False, save_every=0,
    )
    return GRPOConfig(**{**base, **overrides})


def finite_params(model) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def completions(n: int):
    return types.SimpleNamespace(prompts=[f"p{i}" for i in range(n)], completions=[f"c{i}" for i in range(n)])


# ---------------------------------------------------------------------------- rewards
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


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_huge_rewards_never_make_advantages_nan(scale):
    rewards = torch.tensor([1e39, 0.0, 1.0, 2.0, 1.5e308, 1.5e308, -1.7e308, 0.0], dtype=torch.float64)
    adv = group_advantages(rewards, 4, scale=scale)
    assert not torch.isnan(adv).any()
    if scale != "none":  # |r - mean| itself overflows float32 only without a std to divide by
        assert torch.isfinite(adv).all()
        assert adv[4] > 0 and adv[6] < 0
    if scale == "group":  # (with the batch's std, set by 1e308, the first group's advantages round to 0)
        assert adv[0] > 0 and adv[1] < 0
    with pytest.raises(ValueError, match=r"rewards\[1\] is inf"):
        group_advantages(torch.tensor([0.0, math.inf]), 2, scale=scale)


def test_run_with_infinite_and_huge_rewards_stays_finite(tmp_path):
    """A reward of +-inf is unscorable; 1e39 is a score: advantages, weights and the checkpoint stay finite."""
    def spiky(prompts, completions, **_):
        return [[math.inf, 1e39, -math.inf, 0.5][i % 4] for i in range(len(completions))]

    model, tokenizer = build_model_and_tokenizer(seed=0)
    with pytest.warns(RuntimeWarning, match="reward function 'spiky' returned inf for row 0"):
        record = train(model, tokenizer, problems()[:4], {"spiky": spiky, "format": format_reward}, tiny_config(tmp_path))[0]
    assert record["rewards/spiky/nonfinite"] == 4 and record["skipped_updates"] == 0
    assert math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"]) and record["grad_norm"] > 0
    assert finite_params(model)
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    assert all(bool(torch.isfinite(v).all()) for v in state["model"].values())


# ---------------------------------------------------------------------------- the update
def fixed_batch(model, tokenizer, cfg, advantages):
    engine = HFGenerate(tokenizer, max_new_tokens=cfg.max_new_tokens)
    out = engine.generate(as_policy(model), ["1+2=", "3+4="], 2)
    return UpdateBatch(
        input_ids=torch.cat([out.prompt_ids, out.completion_ids], 1),
        attention_mask=torch.cat([out.prompt_mask, out.completion_mask], 1),
        prompt_len=out.prompt_ids.shape[1], completion_ids=out.completion_ids,
        loss_mask=out.completion_mask, advantages=advantages,
    )


@pytest.mark.parametrize("poison", ["advantage", "weight"])
def test_a_non_finite_loss_or_gradient_never_reaches_the_optimizer(tmp_path, poison):
    torch.manual_seed(0)
    model, tokenizer = build_model_and_tokenizer(seed=0)
    cfg = tiny_config(tmp_path, num_iterations=2)
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
    cfg = tiny_config(tmp_path, num_steps=2, scale_rewards="none")
    with pytest.warns(RuntimeWarning, match="skipped"):
        records = train(model, tokenizer, problems()[:4], {"huge": huge}, cfg)
    lines = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["skipped_updates"] for r in lines] == [1, 0] == [r["skipped_updates"] for r in records]
    assert lines[0]["loss"] is None or lines[0]["grad_norm"] is None  # non-finite: written as null
    assert finite_params(model)


# ---------------------------------------------------------------------------- checkpoints
def test_a_checkpoint_with_non_finite_weights_is_refused(tmp_path):
    model, _ = build_model_and_tokenizer(seed=0)
    cfg = tiny_config(tmp_path)
    policy = prepare_model(model, cfg, torch.device("cpu"))
    with torch.no_grad():
        model.lm_head.weight[3, 5] = math.inf
    path = checkpoint.path_in(cfg.output_dir)
    with pytest.raises(ValueError, match=r"non-finite.*lm_head\.weight"):
        checkpoint.save(path, 1, policy, None, make_optimizer(policy, cfg), {})
    assert not os.path.exists(path) and not os.path.exists(path + ".tmp")


def test_a_checkpoint_is_fsynced_before_and_after_the_rename(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.path.isdir(f"/proc/self/fd/{fd}"))), real_fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", b)), real_replace(a, b)))
    model, _ = build_model_and_tokenizer(seed=0)
    cfg = tiny_config(tmp_path)
    policy = prepare_model(model, cfg, torch.device("cpu"))
    path = checkpoint.path_in(cfg.output_dir)
    checkpoint.save(path, 1, policy, None, make_optimizer(policy, cfg), {})
    assert events == [("fsync", False), ("replace", path), ("fsync", True)]  # the file, the rename, its directory


# ---------------------------------------------------------------------------- logs
def test_a_torn_last_log_line_is_dropped_and_a_broken_middle_line_named(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "rew')  # killed while writing step 3
    assert logs.RunLog(str(path), resume_step=2).records == [{"step": 1}, {"step": 2}]
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    path.write_text('{"step": 1}\n{"step": 2, "re\n{"step": 3}\n')
    with pytest.raises(ValueError, match=rf"{path}:2: not valid JSON"):
        logs.RunLog(str(path), resume_step=3)


# ---------------------------------------------------------------------------- data
def test_columns_of_refuses_a_column_missing_from_some_rows():
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b"}, {"prompt": "c", "answer": "3"}]
    with pytest.raises(ValueError, match=r"row 1 has no 'answer' column"):
        columns_of(rows, 2)
    rows = [{"prompt": "a"}, {"prompt": "b", "tests": ["assert True"]}]  # not taken from the first row only
    with pytest.raises(ValueError, match=r"row 0 has no 'tests' column"):
        columns_of(rows, 2)
    rows = [{"prompt": "a", "answer": None}, {"prompt": "b", "answer": "2"}]  # an explicit None is a value
    assert columns_of(rows, 2) == {"answer": [None, None, "2", "2"]}


def test_train_checks_every_row_before_it_starts(tmp_path):
    model, tokenizer = build_model_and_tokenizer(seed=0)
    rows = problems()[:6]
    del rows[4]["answer"]
    with pytest.raises(ValueError, match=r"rows\[4\] has no 'answer' column"):
        train(model, tokenizer, rows, {"accuracy": accuracy}, tiny_config(tmp_path))
    with pytest.raises(ValueError, match=r"rows\[0\]: empty prompt"):
        train(model, tokenizer, [{"prompt": ""}] * 4, {"format": format_reward}, tiny_config(tmp_path))
    with pytest.raises(TypeError, match=r"rows\[1\]: the prompt must be a str"):
        train(model, tokenizer, [{"prompt": "1+1="}, {"prompt": 7}], {"format": format_reward}, tiny_config(tmp_path))
    with pytest.raises(ValueError, match="no rows"):
        train(model, tokenizer, [], {"format": format_reward}, tiny_config(tmp_path))


def test_prompts_that_tokenize_to_nothing_are_a_clear_error():
    model, tokenizer = build_model_and_tokenizer(seed=0)
    with pytest.raises(ValueError, match="all 2 prompts are empty"):
        HFGenerate(tokenizer, max_new_tokens=4).generate(as_policy(model), ["", ""], 2)


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"prompt": "a"}\n{"prompt": "b",\n', r":2: not valid JSON"),
        (b'{"prompt": "a"}\n\n{"prompt": "\xff\xfe"}\n', r":3: not UTF-8"),
        (b'{"prompt": "a"}\n["b"]\n', r":2: expected a JSON object"),
        (b'{"prompt": "a"}\n{"prompt": 3}\n', r":2: the prompt must be a str"),
        (b'{"prompt": ""}\n{"prompt": ""}\n', r":1: empty prompt"),
        (b'{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n', r":2 has no 'answer' column"),
    ],
)
def test_a_bad_jsonl_record_is_named_by_file_and_line(tmp_path, content, message):
    path = tmp_path / "data.jsonl"
    path.write_bytes(content)
    with pytest.raises((ValueError, TypeError), match=f"{path}{message}"):
        load_jsonl(str(path))


def test_jsonl_with_a_byte_order_mark_and_crlf_loads(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"question": "1+1=", "answer": "2"}\r\n{"question": "2+2=", "answer": "4"}\r\n')
    assert load_jsonl(str(path), "question") == [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]


def test_reward_functions_are_checked_before_the_run(tmp_path):
    model, tokenizer = build_model_and_tokenizer(seed=0)
    cfg = tiny_config(tmp_path)
    with pytest.raises(ValueError, match="share a name"):  # two lambdas: one would have been dropped
        train(model, tokenizer, problems()[:4], [lambda p, c, **_: [0.0] * len(c), lambda p, c, **_: [1.0] * len(c)], cfg)
    with pytest.raises(ValueError, match="at least one reward function"):
        train(model, tokenizer, problems()[:4], {}, cfg)
    with pytest.raises(TypeError, match="reward function 'x' is not callable"):
        train(model, tokenizer, problems()[:4], {"x": 1.0}, cfg)
    with pytest.raises(TypeError, match="rollout must implement"):
        train(model, tokenizer, problems()[:4], {"format": format_reward}, cfg, rollout=object())
    assert not os.path.exists(cfg.output_dir)  # refused before anything was written


# ---------------------------------------------------------------------------- config
def test_one_generation_per_prompt_is_refused():
    with pytest.raises(ValueError, match=r"num_generations must be >= 2.*advantage"):
        GRPOConfig(num_generations=1)
