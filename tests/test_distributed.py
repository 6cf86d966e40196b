"""Data parallelism on CPU: 2 processes under torchrun with gloo, DDP and FSDP2, against one process.

Each test launches ``python -m torch.distributed.run --nproc-per-node 2 tests/test_distributed.py
SCENARIO OUT`` (this file is also the worker); rank 0 saves what it measured to OUT, and the test
compares it here with the same computation in this (single) process.

- equivalence: one update on a fixed global batch of rollouts (no sampling involved), each rank taking
  its share, must give the single-process gradients (compared directly: Adam's first step would hide
  a wrong scale), parameters after an AdamW step, and logged loss / metrics; for every loss type, for
  DDP and FSDP2, with equal and unequal shares (as ``drop_zero_signal_groups`` leaves), and with the
  embeddings tied to ``lm_head`` under FSDP2.
- resume: a 2-rank run (DDP, FSDP2) interrupted after 1 of 2 steps and resumed ends where the straight
  run does; the FSDP2 checkpoint also resumes in a single process.
- demo: ``torchrun --nproc-per-node 2 -m grpo demo --distributed ddp`` (shortened) learns.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time

import torch

from helpers import CORE_LOSS_TYPES, TINY_UPDATE, leave_gloo_worker, random_update_batch, tiny_qwen2, torchrun

from grpo.logs import run_values

LOSS_TYPES = CORE_LOSS_TYPES
SPLITS = {"even": 6, "uneven": 9}  # rows of the 12 on rank 0 (whole groups of 3)
CASES = [(kind, loss, split, False) for kind in ("ddp", "fsdp") for loss in LOSS_TYPES for split in SPLITS]
CASES += [("fsdp", "dapo", "uneven", True), ("ddp", "grpo", "even", True)]


# ---------------------------------------------------------------------------- shared by both sides
def config(loss_type: str, **overrides):
    from grpo.trainer import GRPOConfig

    return GRPOConfig(**{**TINY_UPDATE, "loss_type": loss_type, "weight_decay": 0.01, "max_grad_norm": 1e9, **overrides})


def one_update(kind: str, loss_type: str, tied: bool, batch, micro_batch_size):
    """Gradients, parameters after one AdamW step, and logs: every value full (unsharded), on CPU."""
    from grpo import distributed
    from grpo.trainer import make_optimizer, prepare_model, update

    cfg = config(loss_type, distributed=kind, micro_batch_size=micro_batch_size)
    policy = prepare_model(tiny_qwen2(tied), cfg, torch.device("cpu"))
    optimizer = make_optimizer(policy, cfg)
    logs = update(policy, optimizer, batch, cfg, torch.device("cpu"))
    grads = {}
    for name, p in policy.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name.removeprefix("module.").removeprefix("model.")] = grad.detach().clone()
    return grads, distributed.model_state(policy), logs


# ---------------------------------------------------------------------------- the workers (under torchrun)
def worker_equivalence(out: str) -> None:
    from grpo import distributed

    distributed.setup("ddp")
    rank, batch = distributed.rank(), random_update_batch()
    results = {}
    for kind, loss_type, split, tied in CASES:
        n0 = SPLITS[split]
        mine = batch.rows(torch.arange(0, n0) if rank == 0 else torch.arange(n0, len(batch)))
        results[(kind, loss_type, split, tied)] = one_update(kind, loss_type, tied, mine, micro_batch_size=4)
    if rank == 0:
        torch.save(results, out)


def worker_resume(out: str) -> None:
    from grpo import distributed
    from grpo.demo import accuracy, build_model_and_tokenizer, format_reward, problems
    from grpo.trainer import GRPOConfig, train

    distributed.setup("ddp")
    rewards = {"accuracy": accuracy, "format": format_reward, "length": lambda p, c, **_: [len(x) / 10 for x in c]}
    base = os.path.dirname(out)
    results = {"initial": build_model_and_tokenizer(seed=0)[0].state_dict()}
    for kind in ("ddp", "fsdp"):
        def run(name, **kw):
            model, tokenizer = build_model_and_tokenizer(seed=0)
            cfg = GRPOConfig(
                output_dir=os.path.join(base, f"{kind}-{name}"), num_steps=2, prompts_per_step=4, num_generations=4,
                max_new_tokens=8, learning_rate=1e-3, beta=0.05, micro_batch_size=3, drop_zero_signal_groups=True,
                backend="torch", progress=False, plot=False, save_every=0, distributed=kind,
            )
            records = train(model, tokenizer, problems()[:12], rewards, dataclasses.replace(cfg, **kw))
            return records, {k: v.clone() for k, v in model.state_dict().items()}

        straight = run("straight")
        run("resumed", num_steps=1)
        resumed = run("resumed", resume=True)
        results[kind] = (straight, resumed)
    if rank_is_main():
        torch.save(results, out)


def policy_method_calls(kind: str, batch) -> dict:
    """Each of Policy's methods called through the (wrapped) module: ``policy(Policy.logps, ...)`` etc. Under DDP
    the wrapper has no ``logps`` attribute and under FSDP2 the weights are shards outside a forward: the call
    goes through ``__call__``, where DDP prepares its gradient sync and FSDP2 gathers the weights."""
    from grpo.models import Policy, prepare_model

    cfg = config("grpo", distributed=kind, beta=0.0)
    policy, device = prepare_model(tiny_qwen2(), cfg, torch.device("cpu")), torch.device("cpu")
    with torch.no_grad():
        logps = policy(Policy.logps, batch, cfg, device)
    out = policy(Policy.loss, batch, cfg, device, num_items_in_batch=batch.loss_mask.sum().float())
    out.loss.backward()
    grads = {}
    for name, p in policy.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name.removeprefix("module.").removeprefix("model.")] = grad.detach().clone()
    with torch.no_grad():
        P = batch.prompt_len
        ids = policy(Policy.generate, input_ids=batch.input_ids[:3, :P], attention_mask=batch.attention_mask[:3, :P],
                     max_new_tokens=4, do_sample=False, pad_token_id=0)
    return {"logps": logps, "loss": out.loss.detach(), "grads": grads, "generated": ids}


def worker_policy_methods(out: str) -> None:
    """The same batch on both ranks (so DDP's averaged gradients are the one-process ones)."""
    from grpo import distributed

    distributed.setup("ddp")
    batch = random_update_batch()
    results = {kind: policy_method_calls(kind, batch) for kind in ("ddp", "fsdp")}
    if distributed.rank() == 0:
        torch.save(results, out)


def rank_is_main() -> bool:
    from grpo import distributed

    return distributed.is_main_process()


# ---------------------------------------------------------------------------- the launcher
def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_one_update_on_two_ranks_matches_one_process(tmp_path):
    out = tmp_path / "equivalence.pt"
    torchrun([__file__, "equivalence", str(out)])
    results = torch.load(out, weights_only=False)
    batch = random_update_batch()
    torch.set_num_threads(1)
    report, single = [], {}
    for (kind, loss_type, split, tied), (grads, state, logs) in results.items():
        if (loss_type, tied) not in single:
            single[loss_type, tied] = one_update("none", loss_type, tied, batch, micro_batch_size=None)
        ref_grads, ref_state, ref_logs = single[loss_type, tied]
        assert ref_grads.keys() == grads.keys() and ref_logs.keys() == logs.keys()
        assert max(float(g.abs().max()) for g in ref_grads.values()) > 1e-3  # a gradient worth comparing
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{kind} {loss_type} {split} grad {name}: {m}")
        # Adam's first step is lr * g / (|g| + eps), eps = 1e-8: d step / d g = lr * eps / (|g| + eps)^2, which
        # at |g| ~ eps magnifies the rounding of g (two ranks' partial sums against one process's sum: ~1e-10
        # here, and CPU-dependent) by lr / (4 eps) = 2.5e4. Where |g| >= 1e-6 the magnification is at most
        # lr * eps / 1e-12 = 10: there the parameters agree to 1% of a step; elsewhere each still moved by at
        # most one step, lr * (1 + weight_decay * |p|)
        for name in ref_state:
            grad = ref_grads.get(name)
            conditioned = torch.ones_like(ref_state[name], dtype=torch.bool) if grad is None else grad.abs() >= 1e-6
            torch.testing.assert_close(state[name][conditioned], ref_state[name][conditioned], rtol=0, atol=1e-5,
                                       msg=lambda m: f"{kind} {loss_type} {split} param {name}: {m}")
            assert float((state[name] - ref_state[name]).abs().max()) <= 2 * 1e-3 * (1 + 0.01 * float(ref_state[name].abs().max())) + 1e-6
        for key in ref_logs:
            assert logs[key] == pytest_approx(ref_logs[key]), (kind, loss_type, split, key, logs[key], ref_logs[key])
        report.append(f"{kind:4} {loss_type:7} {split:6} tied={tied!s:5} max|dgrad|={max_diff(grads, ref_grads):.1e} "
                      f"max|dparam|={max_diff(state, ref_state):.1e}")
    print("\n".join(report))


def test_policy_methods_under_ddp_and_fsdp2_are_the_one_process_ones(tmp_path):
    """``policy(Policy.logps / loss / generate, ...)`` on a DDP- and an FSDP2-wrapped Policy (2 ranks, the same
    batch on each): the log-probs, the loss, every gradient (DDP's and FSDP2's averages of equal ones) and the
    greedy completions equal those of an unwrapped Policy in one process."""
    out = tmp_path / "policy_methods.pt"
    torchrun([__file__, "policy_methods", str(out)])
    results = torch.load(out, weights_only=False)
    torch.set_num_threads(1)
    single = policy_method_calls("none", random_update_batch())
    assert single["grads"] and max(float(g.abs().max()) for g in single["grads"].values()) > 1e-3
    for kind, got in results.items():
        torch.testing.assert_close(got["logps"], single["logps"], rtol=1e-6, atol=1e-6, msg=lambda m: f"{kind} logps: {m}")
        torch.testing.assert_close(got["loss"], single["loss"], rtol=1e-6, atol=1e-7, msg=lambda m: f"{kind} loss: {m}")
        assert got["grads"].keys() == single["grads"].keys(), kind
        for name, grad in single["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{kind} {name}: {m}")
        assert torch.equal(got["generated"], single["generated"]), kind


def pytest_approx(value):
    import pytest

    return pytest.approx(value, rel=1e-5, abs=1e-6)


def test_two_rank_run_resumes_as_the_uninterrupted_run(tmp_path):
    out = tmp_path / "resume.pt"
    torchrun([__file__, "resume", str(out)])
    results = torch.load(out, weights_only=False)
    initial = results.pop("initial")
    for kind, ((straight, p_straight), (resumed, p_resumed)) in results.items():
        assert any(not torch.equal(v, initial[k]) for k, v in p_straight.items()), f"{kind}: the model did not train"
        assert [r["step"] for r in resumed] == [1, 2], kind
        assert all(r.get("grad_norm", 0) > 0 for r in straight), kind
        assert [run_values(r) for r in resumed] == [run_values(r) for r in straight], kind
        for k, v in p_straight.items():
            torch.testing.assert_close(p_resumed[k], v, rtol=1e-6, atol=1e-7, msg=lambda m: f"{kind} {k}: {m}")
    # the FSDP2 checkpoint (full weights, optimizer state keyed by name) resumes in one process too
    from grpo.demo import accuracy, build_model_and_tokenizer, format_reward, problems
    from grpo.trainer import GRPOConfig, train

    model, tokenizer = build_model_and_tokenizer(seed=0)
    cfg = GRPOConfig(output_dir=str(tmp_path / "fsdp-straight"), num_steps=3, prompts_per_step=4, num_generations=4,
                     max_new_tokens=8, learning_rate=1e-3, beta=0.05, backend="torch", progress=False, plot=False,
                     save_every=0, resume=True, resume_with_changes=True)  # (the format is under test, not the settings)
    records = train(model, tokenizer, problems()[:12], {"accuracy": accuracy, "format": format_reward}, cfg)
    assert [r["step"] for r in records] == [1, 2, 3] and math.isfinite(records[-1]["loss"])


def test_two_rank_demo_learns(tmp_path):
    import json

    start = time.perf_counter()
    proc = torchrun(["-m", "grpo", "demo", "--distributed", "ddp", "--sft-steps", "200", "--grpo-steps", "30", "--backend", "torch",
                     "--no-progress", "--output-dir", str(tmp_path / "demo")])
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    before, after = summary["before"], summary["after"]
    print(proc.stdout[-1500:], f"({time.perf_counter() - start:.0f}s)")
    assert before["greedy"] <= 0.4
    assert after["sampled"] >= before["sampled"] + 0.3 and after["greedy"] >= 0.7
    assert proc.stdout.count("accuracy before GRPO") == 1  # printed by rank 0 only


if __name__ == "__main__":  # a worker, started by torchrun
    scenario, out_path = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    {"equivalence": worker_equivalence, "resume": worker_resume, "policy_methods": worker_policy_methods}[scenario](out_path)
    leave_gloo_worker()
