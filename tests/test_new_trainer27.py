"""The trainer under verl's ``loss_mode`` (issue 27): one update equals verl's ``ppo_loss`` of the whole
batch, under any micro-batching (padded or packed) and on 2 ranks (DDP, and FSDP2 once); and the CLI's ``None``.

The reference is ``tests/spec64.py``'s float64 restatement of verl 0.9's ``ppo_loss`` / ``agg_loss``
(``verl64``) over the whole batch in one call, with no global keywords (a single process, a single
micro-batch): the trainer must turn its micro-batch and rank shares into exactly that, policy term,
KL and entropy bonus alike. The model is a tiny Qwen2 built in code (fp32 in the trainer, float64 in
the reference); one row has completion tokens but no loss token (as ``mask_truncated_completions``
leaves), which verl's sequence count leaves out. The DDP case runs this file as its worker under
``torchrun`` (2 CPU processes, gloo), as ``tests/test_distributed.py`` does.
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys

import pytest
import torch

from helpers import assert_close64
from grpo_kernels.options import LOSS_AGG_MODES, LOSS_MODES
from spec64 import logprobs64, verl64, verl_agg64, verl_kl64

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(900)

COMMON = dict(beta=0.05, entropy_coef=0.01, eps_low=0.2, eps_high=0.28, max_new_tokens=8, learning_rate=1e-3,
              max_grad_norm=math.inf, backend="torch", progress=False, plot=False)
# verl's three axes, every aggregation mode of the spec's own list; gspo's policy term is always
# seq-mean-token-mean (its KL and entropy stay token-mean here); verl 0.9's newer modes when the spec has them
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


def tiny_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=24, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False, pad_token_id=0,
                         eos_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def fixed_batch():
    """12 rows: left-padded prompts, completions of 1..6 tokens, old / ref log-probs off the policy's;
    row 5 keeps its completion tokens but no loss token."""
    from grpo.trainer import UpdateBatch

    g = torch.Generator().manual_seed(0)
    B, P, T, V = 12, 4, 6, 24
    prompt_len = torch.randint(1, P + 1, (B,), generator=g)
    prompt_mask = (torch.arange(P) >= P - prompt_len[:, None]).long()
    completion_len = torch.randint(1, T + 1, (B,), generator=g)
    completion_len[3] = T
    completion_mask = (torch.arange(T) < completion_len[:, None]).long()
    loss_mask = completion_mask.clone()
    loss_mask[5] = 0
    completion_ids = torch.randint(2, V, (B, T), generator=g) * completion_mask
    input_ids = torch.cat([torch.randint(2, V, (B, P), generator=g) * prompt_mask, completion_ids], 1)
    return UpdateBatch(
        input_ids=input_ids, attention_mask=torch.cat([prompt_mask, completion_mask], 1), prompt_len=P,
        completion_ids=completion_ids, loss_mask=loss_mask, advantages=torch.randn(B, generator=g),
        old_logps=(-math.log(V) + 0.3 * torch.randn(B, T, generator=g)) * loss_mask,
        ref_logps=(-math.log(V) + 0.3 * torch.randn(B, T, generator=g)) * loss_mask,
    )


def verl_reference(batch, case: dict):
    """(loss, {"actor/entropy", "actor/kl_loss"}, grads by parameter name): verl's ppo_loss of the whole
    batch in float64 (one call, no global keywords)."""
    model = tiny_model().double()
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
    policy = prepare_model(tiny_model(), cfg, torch.device("cpu"))
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
        assert_close64(grads[name], expected, scale=scale, what=f"{what}: grad of {name}")
    assert logs["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6), what
    for key, value in shares.items():
        assert logs[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (what, key)


@pytest.fixture(scope="module")
def references():
    torch.set_num_threads(1)
    batch = fixed_batch()
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
    model = tiny_model()
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
    batch = fixed_batch()
    rows = torch.arange(0, RANK0_ROWS) if distributed.rank() == 0 else torch.arange(RANK0_ROWS, len(batch))
    results = {(kind, case, split): trainer_update(batch.rows(rows), CASES[case], SPLITS[split], distributed=kind)
               for kind, case, split in DDP_RUNS}
    if distributed.is_main_process():
        torch.save(results, out_path)
    distributed.teardown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_give_the_single_process_update(tmp_path, references):
    out = tmp_path / "ddp.pt"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), os.path.abspath(__file__), "ddp", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    results = torch.load(out, weights_only=False)
    batch, refs = references
    assert set(results) == set(DDP_RUNS)
    for (kind, case, split), (logs, grads) in results.items():
        check_against_reference(logs, grads, refs[case], f"{kind} {case} {split}")
        single_logs, single_grads = trainer_update(batch, CASES[case], SPLITS["one"])
        for name, g in single_grads.items():  # and the single-process trainer, to fp32 rounding
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{case} {split} {name}: {m}")


# ---------------------------------------------------------------------------- the config and the CLI
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
    (("--loss-mode", "nope"), "--loss-mode"), (("--vllm-importance-sampling-clip-max", "-1"), "vllm_importance_sampling_clip_max"),
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


if __name__ == "__main__":  # a worker, started by torchrun
    torch.set_num_threads(1)
    {"ddp": worker_ddp}[sys.argv[1]](sys.argv[2])
