"""The trainer's rollout correction through the loss (``rollout_logps`` + ``rollout_correction``) on a
real vLLM engine's log-probs equals TRL's ``is_ratio`` route (issue 27).

Runs in the vLLM venv (``make test``'s vLLM step; skipped where vLLM is not installed). A tiny Qwen2
built in code samples with a real engine; then the trainer's weights move (as they do when the engine
lags), so the engine's log-probs and the trainer's disagree by a known-nonzero amount. The trainer's
update (``grpo.trainer.update``, fp32) must give the gradient and loss of TRL 1.16's route restated in
float64 (``tests/spec64.py``): ``is_ratio = trl_is_ratio64(old, sampling, mask, mode, max, min)`` fed to
the loss as a constant weight, and log TRL's ``sampling/...`` metrics of that ratio.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("vllm")

from helpers import assert_close64  # noqa: E402
from grpo.rollout import VLLMRollout  # noqa: E402
from grpo.tokenizer import char_tokenizer  # noqa: E402
from grpo.trainer import GRPOConfig, UpdateBatch, as_policy, completion_logps, make_optimizer, update  # noqa: E402
from grpo_kernels.options import ROLLOUT_CORRECTIONS  # noqa: E402
from spec64 import grpo64, trl_is_ratio64  # noqa: E402

pytestmark = pytest.mark.timeout(900)
TEMPERATURE = 0.7
PROMPTS = ["1+2=", "7*8=", "<think>3-4"]
G = 4


def tiny_model(seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = char_tokenizer("0123456789+-*=", ("<think>", "</think>", "<answer>", "</answer>"))
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=64, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # a distribution far from uniform
        model.lm_head.weight.mul_(8)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    """(model the trainer updates, its completions sampled by a vLLM engine with the weights before they moved)."""
    model, tokenizer = tiny_model()
    path = tmp_path_factory.mktemp("tiny-qwen2-t27")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    torch.set_num_threads(2)
    engine = VLLMRollout(str(path), max_new_tokens=8, temperature=TEMPERATURE, kv_cache_memory_bytes=32 << 20, max_num_seqs=16)
    torch.manual_seed(0)
    out = engine.generate(as_policy(model), PROMPTS, G)
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
    batch = UpdateBatch(
        input_ids=torch.cat([out.prompt_ids, out.completion_ids], 1), attention_mask=torch.cat([out.prompt_mask, mask], 1),
        prompt_len=out.prompt_ids.shape[1], completion_ids=out.completion_ids, loss_mask=mask,
        advantages=torch.randn(B, generator=torch.Generator().manual_seed(2)), rollout_logps=out.sampling_logps,
    )
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
