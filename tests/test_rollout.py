"""grpo.rollout without an engine to start: the trainer's rollout correction (the loss's), the weights a vLLM
engine is sent (LoRA merged, with real peft), the Completions contract, and --use-vllm without vLLM.

The engine itself is tests/test_rollout_vllm.py (a real vLLM, in the vLLM venv). Tiny models built in code,
CPU, fp32; a few seconds in all.
"""

from __future__ import annotations

import copy
import math
import pathlib
import tempfile
import importlib.util

import pytest
import torch

from helpers import assert_close64, run_cli, tiny_config, update_batch
from grpo.config import GRPOConfig
from grpo.demo import accuracy, build_model_and_tokenizer, problems
from grpo.rollout import Completions, HFGenerate, engine_weights, sample_tokens
from grpo.trainer import as_policy, train

HAS_VLLM = importlib.util.find_spec("vllm") is not None


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------- the trainer applies it
class ShiftedLogpsRollout(HFGenerate):
    """Hugging Face generate that also reports log-probs, each ``shift`` below the policy's: an engine
    whose probabilities disagree with the trainer's by a known factor (exp(shift) per token). Row r's
    completion is cut ``r % 3`` tokens short, so the lengths differ whatever the draws: a first step's
    loss, -sum_i A_i n_i / sum n, cancels to rounding noise when every n_i is equal (A has zero mean)."""

    def __init__(self, tokenizer, shift: float, **kwargs):
        super().__init__(tokenizer, **kwargs)
        self.shift = shift

    def generate(self, policy, prompts, num_generations, *, greedy=False):
        out = super().generate(policy, prompts, num_generations, greedy=greedy)
        for r in range(len(out.prompts)):
            end = max(1, int(out.completion_mask[r].sum()) - r % 3)
            out.completion_mask[r, end:] = 0
            out.completion_ids[r, end:] = self.tokenizer.pad_token_id
        out.completions = self.tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
        from grpo.trainer import completion_logps

        batch = update_batch(out, torch.zeros(len(out.prompts)))
        logps = completion_logps(policy, batch, GRPOConfig(backend="torch", temperature=self.temperature), torch.device("cpu"))
        out.sampling_logps = ((logps - self.shift) * out.completion_mask).float()
        return out


def test_trainer_weighs_the_loss_by_trls_ratio(tmp_path):
    """An engine 0.5 nats per token below the trainer: token_truncate caps every ratio (e^0.5) at 1.5, so
    the update is 1.5x the uncorrected one; token_mask with cap 1.5 zeroes every token: no update."""
    def run(**overrides):
        model, tokenizer = build_model_and_tokenizer(seed=0)
        before = copy.deepcopy(model.state_dict())
        cfg = tiny_config(pathlib.Path(tempfile.mkdtemp(dir=tmp_path)), max_grad_norm=math.inf, **overrides)
        engine = ShiftedLogpsRollout(tokenizer, 0.5, max_new_tokens=6, bf16=False)
        rec = train(model, tokenizer, problems()[:4], {"accuracy": accuracy, "length": lambda p, c, **_: [len(x) for x in c]}, cfg,
                    rollout=engine)[0]
        return rec, before

    off, _ = run(vllm_importance_sampling_correction=False)
    truncated, _ = run(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=1.5)
    masked, _ = run(vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_cap=1.5)
    assert "sampling/importance_sampling_ratio/mean" not in off
    assert truncated["sampling/sampling_logp_difference/mean"] == pytest.approx(0.5, abs=1e-5)
    assert truncated["sampling/importance_sampling_ratio/max"] == pytest.approx(1.5)
    assert truncated["loss"] == pytest.approx(1.5 * off["loss"], rel=1e-4) and abs(off["loss"]) > 1e-4
    assert truncated["grad_norm"] == pytest.approx(1.5 * off["grad_norm"], rel=1e-4) and off["grad_norm"] > 0
    assert masked["sampling/importance_sampling_ratio/max"] == 0.0
    assert masked["loss"] == 0.0 and masked["grad_norm"] == 0.0


# ---------------------------------------------------------------------------- the weights sent
def lora_model(seed=0, targets=("q_proj", "v_proj", "down_proj")):
    peft = pytest.importorskip("peft")
    model, _ = build_model_and_tokenizer(seed=seed)
    names = [n for n, _ in model.named_parameters()]
    peft_model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), lora_dropout=0.0))
    torch.manual_seed(seed + 1)
    for n, p in peft_model.named_parameters():
        if "lora_B" in n or "lora_embedding_A" in n:  # (peft starts these at 0: a delta of 0 could not tell merged from unmerged)
            p.data.normal_(0, 0.1)
    return peft_model, names


def test_engine_weights_merge_an_adapter_on_the_input_embeddings_as_peft_does():
    peft_model, base_names = lora_model(targets=("embed_tokens", "down_proj"))
    merged = copy.deepcopy(peft_model).merge_and_unload()
    sent = dict(engine_weights(peft_model))
    assert sorted(sent) == sorted(base_names)
    for n, p in merged.named_parameters():
        assert_close64(sent[n], p.detach().double(), what=n)
    base = peft_model.get_base_model().model.embed_tokens.base_layer.weight
    assert (sent["model.embed_tokens.weight"] - base).abs().max() > 1e-3  # the delta is in


def test_engine_weights_of_a_plain_model_are_its_parameters():
    model, _ = build_model_and_tokenizer(seed=0)
    sent = dict(engine_weights(model))
    assert list(sent) == [n for n, _ in model.named_parameters()]
    for n, p in model.named_parameters():
        assert torch.equal(sent[n], p.detach())


def test_engine_weights_merge_lora_as_peft_does_without_touching_the_policy():
    peft_model, base_names = lora_model()
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters()}
    merged = copy.deepcopy(peft_model).merge_and_unload()  # peft's own merge, on a copy
    for source in (peft_model, as_policy(peft_model), peft_model.get_base_model()):
        from grpo.rollout import language_model

        sent = dict(engine_weights(language_model(source)))
        assert sorted(sent) == sorted(base_names)  # the base model's names, no adapter factor
        for n, p in merged.named_parameters():
            assert_close64(sent[n], p.detach().double(), what=n)
        q = "model.layers.0.self_attn.q_proj.weight"
        base_q = peft_model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
        assert (sent[q] - base_q).abs().max() > 1e-3  # the delta is in
    for n, p in peft_model.named_parameters():
        assert torch.equal(p, before[n]), n
    with peft_model.disable_adapter():
        sent = dict(engine_weights(peft_model))
        assert torch.equal(sent["model.layers.0.self_attn.q_proj.weight"], peft_model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight)


def test_engine_weights_refuse_dora():
    peft = pytest.importorskip("peft")
    model, _ = build_model_and_tokenizer(seed=0)
    peft_model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ValueError, match="LoRA variant"):
        dict(engine_weights(peft_model))


# ---------------------------------------------------------------------------- the contract
def test_completions_check_sampling_logps():
    B, P, T = 4, 3, 5
    base = dict(prompt_ids=torch.zeros(B, P, dtype=torch.long), prompt_mask=torch.ones(B, P, dtype=torch.long),
                completion_ids=torch.zeros(B, T, dtype=torch.long), completion_mask=torch.ones(B, T, dtype=torch.long),
                truncated=torch.zeros(B, dtype=torch.bool), prompts=["p"] * B, completions=["c"] * B)
    assert Completions(**base).check(B).sampling_logps is None
    Completions(**base, sampling_logps=torch.zeros(B, T)).check(B)
    for bad in (torch.zeros(B, T - 1), torch.zeros(B, T, dtype=torch.float64), [0.0] * B):
        with pytest.raises(ValueError, match="sampling_logps"):
            Completions(**base, sampling_logps=bad).check(B)


def test_hf_generate_reports_no_sampling_logps():
    model, tokenizer = build_model_and_tokenizer(seed=0)
    out = HFGenerate(tokenizer, max_new_tokens=3, bf16=False).generate(as_policy(model), ["1+2="], 2)
    assert out.sampling_logps is None


def test_config_vllm_fields():
    cfg = GRPOConfig()
    assert (cfg.use_vllm, cfg.vllm_importance_sampling_correction, cfg.vllm_importance_sampling_mode,
            cfg.vllm_importance_sampling_clip_max, cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_cap,
            cfg.vllm_gpu_memory_utilization) == (False, True, "sequence_mask", 3.0, None, None, 0.3)  # TRL's
    loss = cfg.grpo_options()  # TRL's names set the loss's rollout correction
    assert (loss.rollout_correction, loss.rollout_correction_max, loss.rollout_correction_min) == ("sequence_mask", 3.0, None)
    loss = GRPOConfig(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_cap=2.0,
                      vllm_importance_sampling_clip_min=0.5).grpo_options()
    assert (loss.rollout_correction, loss.rollout_correction_max, loss.rollout_correction_min) == ("token_truncate", 2.0, 0.5)
    assert GRPOConfig(vllm_importance_sampling_correction=False).grpo_options().rollout_correction is None
    assert GRPOConfig(vllm_importance_sampling_clip_max=None).grpo_options().rollout_correction_max is None
    for name in ("rollout_correction", "rollout_correction_max", "rollout_correction_min"):
        assert name not in GRPOConfig.__dataclass_fields__  # (one spelling in the trainer: TRL's)
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode must be one of"):
        GRPOConfig(vllm_importance_sampling_mode="token")
    with pytest.raises(ValueError, match="vllm_importance_sampling_clip_max"):
        GRPOConfig(vllm_importance_sampling_clip_max=-1.0)
    # (the loss's own rule, min <= max, naming the config's fields, as the user set them)
    with pytest.raises(ValueError, match="vllm_importance_sampling_clip_min .* must be <= vllm_importance_sampling_clip_max"):
        GRPOConfig(vllm_importance_sampling_clip_min=4.0)
    with pytest.raises(TypeError, match="vllm_importance_sampling_correction"):
        GRPOConfig(vllm_importance_sampling_correction="False")
    with pytest.raises(ValueError, match="vllm_gpu_memory_utilization"):
        GRPOConfig(vllm_gpu_memory_utilization=1.5)
    with pytest.raises(TypeError, match="use_vllm"):
        GRPOConfig(use_vllm="yes")
    with pytest.raises(ValueError, match="single process"):
        GRPOConfig(use_vllm=True, distributed="ddp")
    with pytest.raises(ValueError, match="vespo"):
        GRPOConfig(use_vllm=True, loss_type="vespo")  # (TRL: a per-token mode with vespo)
    GRPOConfig(use_vllm=True, loss_type="vespo", vllm_importance_sampling_mode="token_mask")
    GRPOConfig(use_vllm=True, loss_type="vespo", vllm_importance_sampling_correction=False)


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here: tests/test_rollout_vllm.py runs the engine")
def test_use_vllm_without_vllm_is_a_clear_error_before_anything_runs(tmp_path):
    model, tokenizer = build_model_and_tokenizer(seed=0)
    before = copy.deepcopy(model.state_dict())
    cfg = GRPOConfig(output_dir=str(tmp_path / "run"), use_vllm=True, num_steps=1, prompts_per_step=2, num_generations=2,
                     max_new_tokens=4, backend="torch", progress=False, plot=False)
    with pytest.raises(ImportError, match=r"grpo-kernels\[vllm\]"):
        train(model, tokenizer, problems()[:4], {"accuracy": accuracy}, cfg)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+2=", "answer": "3"}\n')
    # the CLI says so before loading the model (which does not exist here)
    out = run_cli("train", "--model", str(tmp_path / "no-model"), "--data", str(data), "--use-vllm")
    assert out.returncode == 2 and "needs vLLM" in out.stderr and "grpo-kernels[vllm]" in out.stderr


def test_prompts_that_tokenize_to_nothing_are_a_clear_error():
    model, tokenizer = build_model_and_tokenizer(seed=0)
    with pytest.raises(ValueError, match="all 2 prompts are empty"):
        HFGenerate(tokenizer, max_new_tokens=4).generate(as_policy(model), ["", ""], 2)


# ---------------------------------------------------------------------------- the draw
def _kept_probs64(logits: torch.Tensor, temperature: float, top_k, top_p) -> torch.Tensor:
    """float64 [V]: the tempered softmax over vLLM's kept set, for one row, token by token: top-k keeps every
    logit at or above the k-th largest; top-p walks the kept tokens from the least likely up (ties in index
    order, as a stable sort leaves them) dropping each while the mass dropped so far, its own included, is
    at most 1 - top_p, never the last."""
    y = logits.double()
    keep = y >= (torch.sort(y, descending=True).values[top_k - 1] if top_k else -math.inf)
    if top_p is not None:
        p = torch.softmax(torch.where(keep, y / temperature, -math.inf), -1)
        ascending = [i for _, i in sorted((float(y[i]), i) for i in range(len(y)) if keep[i])]
        dropped = 0.0
        for i in ascending[:-1]:
            dropped += float(p[i])
            if dropped > 1 - top_p:
                break
            keep[i] = False
    return torch.softmax(torch.where(keep, y / temperature, -math.inf), -1)


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, None, 1.0), (1.3, 3, 1.0), (1.0, None, 0.8), (0.9, 4, 0.9)])
def test_sample_tokens_draws_the_tempered_truncated_softmax(temperature, top_k, top_p):
    """Frequencies over 60,000 rows of the same logits against the float64 distribution (within 5 standard
    errors each), no draw outside the kept set or of a -inf logit, the same draws from the same seed."""
    logits = torch.tensor([2.0, 0.5, -1.0, 1.2, float("-inf"), 0.5, -3.0, 1.9])
    want = _kept_probs64(logits, temperature, top_k, None if top_p == 1.0 else top_p)
    rows = logits.expand(60_000, -1).contiguous()
    torch.manual_seed(3)
    got = sample_tokens(rows, temperature, top_k, top_p)
    torch.manual_seed(3)
    assert torch.equal(sample_tokens(rows, temperature, top_k, top_p), got)
    assert got.dtype == torch.int64 and got.shape == (60_000,)
    freq = torch.bincount(got, minlength=8).double() / got.numel()
    assert (freq[want == 0] == 0).all() and want[4] == 0
    stderr = (want * (1 - want) / got.numel()).sqrt()
    assert ((freq - want).abs() <= 5 * stderr + 1e-12).all(), (freq, want)


@pytest.mark.parametrize("top_k, top_p", [(1, None), (5, None), (5, 0.7), (12, 0.95), (40, 0.5), (3, 0.999)])
def test_the_samplers_kept_set_is_the_loss_rules(top_k, top_p):
    """The sampler's kept set (top-k by its k-th value, top-p over those tokens only) is
    ``grpo_kernels.reference.kept_tokens``' on the whole row, ties included (logits on a coarse grid)."""
    from grpo.rollout import _kept
    from grpo_kernels.reference import kept_tokens

    g = torch.Generator().manual_seed(top_k)
    logits = (torch.randn(64, 40, generator=g) * 4).round() / 2  # (many ties, at the k-th value too)
    weights = (logits - logits.amax(-1, keepdim=True)) * (1.0 / 0.8)
    assert torch.equal(_kept(logits, weights, top_k, top_p), kept_tokens(logits, weights, top_k, top_p))


def test_sample_tokens_refuses_a_row_without_a_distribution():
    for bad in ([0.0, float("nan"), 1.0], [float("-inf")] * 3):
        logits = torch.tensor([[0.0, 1.0, 2.0], bad])
        with pytest.raises(ValueError, match="no distribution"):
            sample_tokens(logits, 1.0, None, 1.0)


# ---------------------------------------------------------------------------- top_k / top_p
def test_hf_generate_samples_with_top_k_and_checks_it():
    """top_k reaches transformers' generate: top_k=1 samples the greedy completion; the loss's rules refuse
    bad values (vLLM's off values 0 / -1 are off)."""
    model, tokenizer = build_model_and_tokenizer(seed=0)
    policy = as_policy(model)
    greedy = HFGenerate(tokenizer, max_new_tokens=5, bf16=False).generate(policy, ["1+2=", "7*8="], 1, greedy=True)
    torch.manual_seed(0)
    top1 = HFGenerate(tokenizer, max_new_tokens=5, bf16=False, top_k=1, temperature=1.5).generate(policy, ["1+2=", "7*8="], 1)
    assert torch.equal(top1.completion_ids, greedy.completion_ids)
    assert HFGenerate(tokenizer, max_new_tokens=5, top_k=0).top_k is None and HFGenerate(tokenizer, max_new_tokens=5, top_k=-1).top_k is None
    for kw, error in ((dict(top_k=-2), ValueError), (dict(top_k=2.5), TypeError), (dict(top_p=0.0), ValueError),
                      (dict(top_p=1.01), ValueError), (dict(temperature=0.0), ValueError)):
        with pytest.raises(error, match=next(iter(kw))):
            HFGenerate(tokenizer, max_new_tokens=5, **kw)


# ---------------------------------------------------------------------------- the kept sets and the draw
def counting_model(seed: int = 0, **generation):
    """A tiny Qwen2 over the demo's characters whose completions run on (its EOS is rarely the likeliest
    token), ``generation`` set in its generation config; and the tokenizer."""
    from grpo.tokenizer import char_tokenizer
    from helpers import tiny_causal_lm

    tokenizer = char_tokenizer("0123456789+-*=", ("<think>", "</think>", "<answer>", "</answer>"))
    model = tiny_causal_lm("Qwen2", seed, vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                           pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None).eval()
    for name, value in generation.items():
        setattr(model.generation_config, name, value)
    return model, tokenizer


COUNTING_PROMPTS = ["1+2=", "7*8=", "3-4", "<think>9"]


def logits64(model, out) -> torch.Tensor:
    """[B, T, V] float64: the model's logits (float64 weights) at each completion token of ``out``."""
    model64 = copy.deepcopy(model).double()
    ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
    mask = torch.cat([out.prompt_mask, out.completion_mask], 1)
    with torch.no_grad():
        logits = model64(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    return logits[:, out.prompt_ids.shape[1] - 1 : -1]


@pytest.mark.parametrize("lora", [False, True])
def test_a_models_repetition_penalty_does_not_change_the_draw(caplog, lora):
    """A model whose generation config has repetition_penalty=1.1 (and no_repeat_ngram_size=3): transformers'
    generate would apply them before the sampler, so that top_k=1 drew tokens the loss's top_k=1 scores
    -inf. HFGenerate leaves them out, says which at INFO (once), and restores the model's config: its top_k=1
    completions are the argmax of the model's own logits (float64), every one finite under the loss. The same
    through a peft model (whose generate copies its generation config into the model it wraps)."""
    import logging

    from grpo.rollout import _SampleAsVLLM
    from grpo.trainer import completion_logps

    model, tokenizer = counting_model(seed=0, repetition_penalty=1.1, no_repeat_ngram_size=3)
    policy = as_policy(model)
    if lora:  # (adapters that start at 0: the same model)
        peft = pytest.importorskip("peft")
        policy = as_policy(peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"], lora_dropout=0.0)))
    cfg = GRPOConfig(backend="torch", top_k=1, sampling_replay=False, max_new_tokens=16)
    engine = HFGenerate(tokenizer, max_new_tokens=16, bf16=False, top_k=1)

    def scored(out):
        logps = completion_logps(policy, update_batch(out, torch.zeros(len(out.prompts))), cfg, torch.device("cpu"))
        return logps[out.completion_mask.bool()]

    # the defect, on transformers' own route (the sampler after the model's processors): the test can fail
    enc = tokenizer(COUNTING_PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    from transformers import LogitsProcessorList

    raw = policy("generate", input_ids=enc.input_ids, attention_mask=enc.attention_mask, max_new_tokens=16, do_sample=False,
                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                 logits_processor=LogitsProcessorList([_SampleAsVLLM(1.0, 1, 1.0, record=False)]))
    P = enc.input_ids.shape[1]
    from grpo.rollout import completion_mask

    mask, truncated = completion_mask(raw[:, P:], tokenizer.eos_token_id)
    ids = raw[:, P:] * mask + tokenizer.pad_token_id * (1 - mask)
    before = Completions(enc.input_ids, enc.attention_mask, ids, mask, truncated, COUNTING_PROMPTS, [""] * 4)
    assert bool(torch.isinf(scored(before)).any()), "the model's repetition penalty must change some draw here"

    with caplog.at_level(logging.INFO, logger="grpo.rollout"):
        out = engine.generate(policy, COUNTING_PROMPTS, 1)
        engine.generate(policy, COUNTING_PROMPTS, 1)
    told = [r.getMessage() for r in caplog.records if "generation config out" in r.getMessage()]
    assert len(told) == 1 and "repetition_penalty=1.1" in told[0] and "no_repeat_ngram_size=3" in told[0], told
    assert model.generation_config.repetition_penalty == 1.1 and model.generation_config.no_repeat_ngram_size == 3
    m = out.completion_mask.bool()
    assert int(m.sum()) > 2 * len(COUNTING_PROMPTS)  # (completions long enough to repeat tokens)
    assert torch.isfinite(scored(out)).all()
    argmax = logits64(model, out).argmax(-1)
    assert torch.equal(out.completion_ids[m], argmax[m])
    greedy = engine.generate(policy, COUNTING_PROMPTS, 1, greedy=True)  # (evaluation leaves them out too)
    assert torch.equal(greedy.completion_ids, out.completion_ids) and greedy.sampling_mask is None


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (None, 0.8), (6, 0.9), (1, 1.0)])
def test_hf_generate_reports_the_sets_it_drew_from(monkeypatch, top_k, top_p):
    """Completions.sampling_mask holds, position by position (row-major [B, T]), exactly the kept set the
    sampler drew that token from (``_kept``'s mask at that step, watched as it returns), every sampled token
    inside its set, empty sets after EOS; nothing to report without truncation, or when not asked."""
    import grpo.rollout as rollout

    returned = []
    real_kept = rollout._kept
    monkeypatch.setattr(rollout, "_kept", lambda *a: returned.append(real_kept(*a)) or returned[-1])
    model, tokenizer = counting_model(seed=1)
    policy = as_policy(model)
    torch.manual_seed(0)
    out = HFGenerate(tokenizer, max_new_tokens=12, bf16=False, top_k=top_k, top_p=top_p, temperature=0.8).generate(
        policy, COUNTING_PROMPTS, 3).check(12)
    sets, mask = out.sampling_mask, out.completion_mask
    B, T = mask.shape
    assert isinstance(sets, rollout.SamplingMask) and sets.num_positions == B * T and len(returned) == T
    assert bool((mask == 0).any()) and bool(mask.sum(-1).gt(3).any())  # (EOS within some rows, long ones too)
    sizes = sets.sizes().view(B, T)
    for b in range(B):
        for t in range(T):
            got = sets.token_ids[sets.offsets[b * T + t]:sets.offsets[b * T + t + 1]].tolist()
            if not mask[b, t]:
                assert got == [], (b, t)
                continue
            assert got == returned[t][b].nonzero().squeeze(-1).tolist(), (b, t)
            assert int(out.completion_ids[b, t]) in got, (b, t)
    assert bool((sizes[mask.bool()] > 1).any()) or top_k == 1
    if top_k is not None:
        assert int(sizes.max()) <= top_k  # (no ties among fp32 logits here)
    assert HFGenerate(tokenizer, max_new_tokens=4, bf16=False, top_k=top_k, top_p=top_p,
                      return_sampling_mask=False).generate(policy, COUNTING_PROMPTS, 2).sampling_mask is None


def test_hf_generate_reports_no_sets_without_truncation():
    model, tokenizer = counting_model(seed=1)
    out = HFGenerate(tokenizer, max_new_tokens=4, bf16=False, temperature=0.7).generate(as_policy(model), COUNTING_PROMPTS, 2)
    assert out.sampling_mask is None
    with pytest.raises(TypeError, match="return_sampling_mask must be a bool"):
        HFGenerate(tokenizer, max_new_tokens=4, return_sampling_mask="yes")


def test_completions_check_sampling_mask():
    from grpo_kernels import SamplingMask

    B, P, T = 2, 3, 2
    base = dict(prompt_ids=torch.zeros(B, P, dtype=torch.long), prompt_mask=torch.ones(B, P, dtype=torch.long),
                completion_ids=torch.zeros(B, T, dtype=torch.long), completion_mask=torch.ones(B, T, dtype=torch.long),
                truncated=torch.zeros(B, dtype=torch.bool), prompts=["p"] * B, completions=["c"] * B)
    Completions(**base, sampling_mask=SamplingMask.from_lists([[[0, 1], [0]], [[1], [2, 3]]])).check(B)
    for bad in (SamplingMask.from_lists([[[0], [1], [2]]]), [[[0]]]):
        with pytest.raises(ValueError, match="sampling_mask"):
            Completions(**base, sampling_mask=bad).check(B)


@pytest.mark.parametrize("padding_free", [True, False])
def test_replayed_log_probs_are_the_kept_sets_and_recomputed_ones_agree_where_the_sets_do(padding_free):
    """One rollout at top_k=6, top_p=0.9: the trainer's log-probs over the sets HFGenerate reported (replay) are
    the float64 softmax over each set, every sampled token finite; recomputing the truncation from the
    trainer's logits (sampling_replay off) keeps the same set at almost every position, and there the two
    log-probs agree to fp32 rounding."""
    from grpo.trainer import completion_logps
    from grpo_kernels import SamplingMask
    from grpo_kernels.reference import kept_tokens

    model, tokenizer = counting_model(seed=2)
    policy = as_policy(model)
    torch.manual_seed(4)
    out = HFGenerate(tokenizer, max_new_tokens=12, bf16=False, top_k=6, top_p=0.9, temperature=0.8).generate(
        policy, COUNTING_PROMPTS, 3)
    mask = out.completion_mask.bool()
    B, T = mask.shape
    cfg = GRPOConfig(backend="torch", temperature=0.8, top_k=6, top_p=0.9, padding_free=padding_free, max_new_tokens=12)
    replayed = completion_logps(policy, update_batch(out, torch.zeros(B), sampling_mask=out.sampling_mask), cfg, torch.device("cpu"))
    recomputed = completion_logps(policy, update_batch(out, torch.zeros(B)), cfg, torch.device("cpu"))

    sets = out.sampling_mask
    kept = torch.zeros(B * T, logits64(model, out).shape[-1], dtype=torch.bool)
    kept[torch.repeat_interleave(torch.arange(B * T), sets.sizes()), sets.token_ids.long()] = True
    kept = kept.view(B, T, -1)
    z = logits64(model, out) / 0.8
    expected = z.gather(-1, out.completion_ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z.masked_fill(~kept, -math.inf), -1)
    assert torch.isfinite(replayed[mask]).all()
    assert_close64(replayed[mask], expected[mask], what="replayed log-probs")

    with torch.no_grad():  # the trainer's own fp32 logits, from which recomputing takes its sets
        ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
        am = torch.cat([out.prompt_mask, out.completion_mask], 1)
        logits = model(input_ids=ids, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0)).logits
        logits = logits[:, out.prompt_ids.shape[1] - 1 : -1]
    recomputed_sets = kept_tokens(logits, (logits - logits.amax(-1, keepdim=True)) * (1 / 0.8), 6, 0.9)
    same = mask & (recomputed_sets == kept).all(-1)
    assert int(same.sum()) >= 0.9 * int(mask.sum()) and bool((kept.sum(-1)[mask] > 1).any())
    assert_close64(recomputed[same], replayed[same].double(), what="recomputed where the sets agree")
    # the sets are what the loss reads: every id kept at every position is the untruncated softmax
    V = z.shape[-1]
    everything = SamplingMask(torch.arange(V).repeat(B * T), torch.arange(B * T + 1) * V)
    full = completion_logps(policy, update_batch(out, torch.zeros(B), sampling_mask=everything), cfg, torch.device("cpu"))
    untruncated = torch.log_softmax(z, -1).gather(-1, out.completion_ids.unsqueeze(-1)).squeeze(-1)
    assert_close64(full[mask], untruncated[mask], what="every id kept")
    assert (untruncated - expected)[mask].abs().max() > 1e-2  # (the truncation matters here)


# ---------------------------------------------------------------------------- the engine registry (issue 46)
class CountingEngine(HFGenerate):
    """Hugging Face generate, registered under its own name: counts the engines built from a config and the
    calls, and refuses (as an engine may) a config combination of its own: more than 4 generations."""

    built = 0
    calls = 0

    @classmethod
    def check_config(cls, cfg):
        from grpo_kernels.bounds import OptionError

        if cfg.num_generations > 4:
            raise OptionError(f"GRPOConfig.rollout_engine={cfg.rollout_engine!r} samples at most 4 completions per "
                              f"prompt: not num_generations={cfg.num_generations}", "GRPOConfig.rollout_engine",
                              "num_generations")

    @classmethod
    def from_config(cls, model, tokenizer, cfg):
        cls.built += 1
        return super().from_config(model, tokenizer, cfg)

    def generate(self, policy, prompts, num_generations, *, greedy=False):
        type(self).calls += 1
        return super().generate(policy, prompts, num_generations, greedy=greedy)


@pytest.fixture
def counting_engine():
    from grpo import rollout

    rollout.register_engine("counting", CountingEngine)
    CountingEngine.built = CountingEngine.calls = 0
    try:
        yield CountingEngine
    finally:
        del rollout.ENGINES["counting"]


def test_the_config_names_a_registered_engine_and_the_trainer_builds_it(counting_engine, tmp_path):
    from grpo import rollout
    from grpo.trainer import default_rollout

    model, tokenizer = build_model_and_tokenizer(seed=0)
    assert type(default_rollout(model, tokenizer, GRPOConfig())) is HFGenerate  # "hf", the default
    assert rollout.ENGINES["hf"] is HFGenerate and rollout.ENGINES["vllm"] is rollout.VLLMRollout
    cfg = tiny_config(tmp_path, rollout_engine="counting", num_steps=2, num_generations=2, top_k=0, top_p=1.0)
    assert (cfg.top_k, cfg.top_p, cfg.use_vllm) == (None, None, False)
    records = train(model, tokenizer, problems()[:8], {"accuracy": accuracy}, cfg)
    assert len(records) == 2 and (counting_engine.built, counting_engine.calls) == (1, 2)
    # the registry's names are the flag's choices, the new one included
    out = run_cli("train", "--help")  # (another process: the built-in engines)
    assert "--rollout-engine {hf,vllm}" in out.stdout


def test_an_engine_owns_its_checks_and_a_refused_combination_names_both_options(counting_engine, tmp_path):
    """The engine's check runs when the config is made or changed (before anything loads): a refusal names the
    options, and a refused assignment changes nothing. use_vllm=True with another engine is refused, naming both."""
    with pytest.raises(ValueError, match=r"GRPOConfig\.rollout_engine='counting' samples at most 4 .*num_generations=8"):
        GRPOConfig(rollout_engine="counting")
    cfg = GRPOConfig(rollout_engine="counting", num_generations=4)
    with pytest.raises(ValueError, match="num_generations=5"):
        cfg.num_generations = 5
    assert cfg.num_generations == 4
    with pytest.raises(ValueError, match=r"GRPOConfig\.use_vllm=True is TRL's spelling of rollout_engine='vllm', but "
                                         r"rollout_engine='counting'") as refused:
        GRPOConfig(use_vllm=True, rollout_engine="counting", num_generations=4)
    assert refused.value.names == ("GRPOConfig.use_vllm", "rollout_engine")
    with pytest.raises(ValueError, match="use_vllm.*rollout_engine"):
        cfg.use_vllm = True
    assert (cfg.use_vllm, cfg.rollout_engine) == (False, "counting")
    cfg.rollout_engine = "hf"  # (a new choice replaces the old)
    cfg.num_generations = 8
    # the command line: the same refusal, as flags, before any model loads
    out = run_cli("train", "--model", str(tmp_path / "no-model"), "--data", str(tmp_path / "none.jsonl"),
                  "--use-vllm", "--distributed", "ddp")
    assert out.returncode == 2 and "--rollout-engine='vllm' (--use-vllm) runs one engine in a single process" in out.stderr


def test_register_engine_refuses_what_it_cannot_build_from():
    from grpo import rollout

    class NotAnEngine:
        def generate(self, policy, prompts, num_generations, *, greedy=False):
            raise AssertionError

    with pytest.raises(TypeError, match="RolloutEngine subclass"):
        rollout.register_engine("plain", NotAnEngine)
    with pytest.raises(ValueError, match="an identifier"):
        rollout.register_engine("my engine", CountingEngine)
    with pytest.raises(ValueError, match="'hf' is already HFGenerate"):
        rollout.register_engine("hf", CountingEngine)
    assert rollout.register_engine("hf", HFGenerate) is HFGenerate  # (the same class again: nothing changes)
    with pytest.raises(ValueError, match=r"rollout_engine must be one of \('hf', 'vllm'\), got 'plain'"):
        rollout.engine_class("plain")
    assert set(rollout.ENGINES) == {"hf", "vllm"}


def test_engines_and_the_sampler_take_none_as_off():
    """Inside, "off" is None: the engines store None for TRL's / vLLM's spellings, and the sampler draws the same
    tokens (and reports no kept set) for None as for them."""
    _, tokenizer = build_model_and_tokenizer(seed=0)
    for off in ({}, dict(top_p=1.0, top_k=0), dict(top_p=None, top_k=-1)):
        engine = HFGenerate(tokenizer, max_new_tokens=3, **off)
        assert (engine.top_k, engine.top_p) == (None, None), off
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    tokens, kept = sample_tokens(logits, 0.8, None, None, return_kept=True)
    torch.manual_seed(1)
    assert torch.equal(sample_tokens(logits, 0.8, 0, 1.0), tokens) and kept is None
    torch.manual_seed(1)
    assert sample_tokens(logits, 0.8, None, 0.5, return_kept=True)[1] is not None
