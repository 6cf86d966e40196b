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

from grpo.logs import run_values
from grpo import checkpoint, logs
from grpo.advantages import group_advantages
from grpo.config import GRPOConfig
from helpers import tiny_config
from grpo.data import columns_of, load_jsonl
from grpo.demo import accuracy, build_model_and_tokenizer, format_reward, problems
from grpo.rollout import HFGenerate
from grpo.trainer import UpdateBatch, as_policy, make_optimizer, prepare_model, score, train, update


pytestmark = pytest.mark.usefixtures("one_thread")


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


# ---------------------------------------------------------------------------- issue 29
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
import time  # noqa: E402
from decimal import Decimal  # noqa: E402
from fractions import Fraction  # noqa: E402

import numpy as np  # noqa: E402

from grpo import demo  # noqa: E402
from grpo.__main__ import main as cli  # noqa: E402
from grpo.atomic import write_atomically  # noqa: E402
from grpo.rewards import REWARD_FUNCTIONS  # noqa: E402

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
    cfg = tiny_config(tmp_path)
    with pytest.raises(ValueError, match=r"reward function 'accuracy' needs the column 'answer'"):
        train(model, tokenizer, rows, {"accuracy": REWARD_FUNCTIONS["accuracy"], "format": REWARD_FUNCTIONS["format"]}, cfg)
    with pytest.raises(ValueError, match=r"'code' needs the column 'tests'"):
        train(model, tokenizer, rows, {"code": REWARD_FUNCTIONS["code"]}, cfg)
    with pytest.raises(ValueError, match=r"'mine' needs the column 'gold'"):
        train(model, tokenizer, rows, {"mine": lambda prompts, completions, gold, **_: [0.0] * len(completions)}, cfg)
    assert not os.path.exists(cfg.output_dir)  # refused before anything was written


def test_a_run_without_learning_signal_says_so_in_the_log_and_warns(tmp_path):
    model, tokenizer = build_model_and_tokenizer(seed=0)
    cfg = tiny_config(tmp_path, num_steps=logs.ZERO_SIGNAL_PATIENCE, max_new_tokens=2)
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
            train(model, tokenizer, problems()[:4], {"format": format_reward}, tiny_config(tmp_path))
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
    train(model, tokenizer, rows, rewards, tiny_config(tmp_path))
    path = os.path.join(tmp_path, "run", "checkpoint.pt")
    before = os.stat(path).st_mtime_ns
    with pytest.raises(FileExistsError, match=r"already holds a checkpoint .*--resume .*another --output-dir"):
        train(model, tokenizer, rows, rewards, tiny_config(tmp_path))
    for field, value in (("beta", 0.1), ("num_generations", 2), ("learning_rate", 1e-2), ("seed", 1), ("loss_type", "grpo")):
        with pytest.raises(ValueError, match=rf"{field}: .* -> {value!r}.*--resume-with-changes"):
            train(model, tokenizer, rows, rewards, tiny_config(tmp_path, num_steps=2, resume=True, **{field: value}))
    assert os.stat(path).st_mtime_ns == before  # nothing was replaced
    # what may change: the length of the run, logging, the layout of the same maths
    records = train(model, tokenizer, rows, rewards, tiny_config(tmp_path, num_steps=2, resume=True, micro_batch_size=2,
                                                                 padding_free=False))
    assert [r["step"] for r in records] == [1, 2]
    records = train(model, tokenizer, rows, rewards, tiny_config(tmp_path, num_steps=3, resume=True, beta=0.1,
                                                                 resume_with_changes=True))
    assert [r["step"] for r in records] == [1, 2, 3]


def test_the_demo_owns_its_directory_and_refuses_another_runs(tmp_path, capsys):
    out = str(tmp_path / "demo")
    demo.claim_output_dir(out)  # a fresh directory
    open(os.path.join(out, "checkpoint.pt"), "wb").close()  # as the first demo run leaves it
    demo.claim_output_dir(out)
    assert "the demo's own directory; its previous run is replaced" in capsys.readouterr().out
    assert not os.path.exists(os.path.join(out, "checkpoint.pt"))
    other = tmp_path / "training"
    other.mkdir()
    (other / "checkpoint.pt").write_bytes(b"")
    with pytest.raises(FileExistsError, match="not the demo's"):
        demo.claim_output_dir(str(other))


SIGTERM_CHILD = textwrap.dedent("""
    import os, signal, sys
    import torch
    from grpo.demo import build_model_and_tokenizer, problems
    from grpo.trainer import train
    sys.path.insert(0, {tests!r})
    from test_trainer_guards import tiny_config, pathlib_dir, counting_reward
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
    resumed = train(model, tokenizer, problems()[:8], {"r": counting_reward()}, tiny_config(killed, num_steps=3, resume=True))
    p_resumed = {k: v.clone() for k, v in model.state_dict().items()}
    model, tokenizer = build_model_and_tokenizer(seed=0)
    straight = train(model, tokenizer, problems()[:8], {"r": counting_reward()}, tiny_config(tmp_path / "straight", num_steps=3))
    assert [run_values(r) for r in resumed] == [run_values(r) for r in straight]
    for k, v in model.state_dict().items():
        assert torch.equal(p_resumed[k], v), k


def test_a_full_disk_during_a_save_says_so_with_the_path(tmp_path):
    """/dev/full answers every write with ENOSPC: the checkpoint's temporary file is made a link to it
    (a real full device; torch.save alone reports "PytorchStreamWriter failed writing file")."""
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    model, _ = build_model_and_tokenizer(seed=0)
    path = str(tmp_path / "checkpoint.pt")
    write_atomically(path, lambda f: f.write(b"the previous checkpoint"))
    os.symlink("/dev/full", path + ".tmp")
    policy = prepare_model(model, tiny_config(tmp_path), torch.device("cpu"))
    with pytest.raises(OSError, match=rf"No space left on device: could not write {path}") as info:
        checkpoint.save(path, 1, policy, None, make_optimizer(policy, tiny_config(tmp_path)), {})
    assert info.value.errno == 28
    assert open(path, "rb").read() == b"the previous checkpoint" and not os.path.lexists(path + ".tmp")


def test_a_file_size_limit_during_a_save_says_so_with_the_path(tmp_path):
    """RLIMIT_FSIZE (a real kernel limit, in a child process) makes writes fail with EFBIG."""
    code = textwrap.dedent(f"""
        import importlib.util, resource, signal
        spec = importlib.util.spec_from_file_location("atomic", {os.path.join(ROOT, 'grpo', 'atomic.py')!r})
        atomic = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(atomic)  # (grpo.atomic alone: importing the package would load torch)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel's SIGXFSZ kills the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        try:
            atomic.write_atomically({str(tmp_path / 'checkpoint.pt')!r}, lambda f: [f.write(bytes(1000)) for _ in range(10)])
        except OSError as e:
            print("OSError", e.errno, e)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                         capture_output=True, text=True, timeout=300)
    assert f"File too large: could not write {tmp_path / 'checkpoint.pt'}" in out.stdout, out.stdout + out.stderr[-2000:]
    assert not os.listdir(tmp_path)


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
