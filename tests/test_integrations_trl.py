"""grpo_kernels.integrations.trl against the real trl package (the `trl` extra).

TRL's own code is the reference for everything above the head: for each case two trainers are built
from the same tiny model (2-layer Qwen2, odd vocabulary, built in code, no network), one stock and one
with grpo-kernels' head, and TRL's `_compute_loss` runs on the same hand-made batch in both. The head
itself is also checked against float64 log-softmax of the model's own logits.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

trl = pytest.importorskip("trl", minversion="1.15", reason="trl >= 1.15 is not installed (pip install -e '.[trl]')")

from helpers import assert_close64, leave_gloo_worker, tiny_causal_lm, tolerance  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM  # noqa: E402
from trl.trainer import grpo_trainer as trl_grpo_module  # noqa: E402

from grpo_kernels.integrations import trl as gk_trl  # noqa: E402

# Every loss TRL's _compute_loss knows (test_loss_types_cover_trl checks this list against TRL's source).
from grpo_kernels.options import LOSS_TYPES  # noqa: E402
VOCAB = 67  # odd on purpose
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 "
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# --------------------------------------------------------------------------------------------------
# A tiny model, tokenizer and dataset, all built in code
# --------------------------------------------------------------------------------------------------
def make_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    vocab.update({c: 3 + i for i, c in enumerate(CHARS)})
    vocab.update({f"<x{i}>": i for i in range(len(vocab), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def make_model(seed: int = 0, **config) -> Qwen2ForCausalLM:
    model = tiny_causal_lm(
        "Qwen2", seed, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=1, bos_token_id=1, **config,
    )
    with torch.no_grad():  # a peaked, varied distribution: log-probs far from uniform, entropies spread
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny_qwen2")
    make_model().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer()


def toy_reward(prompts, completions, **kwargs):
    return [float(len(set(c))) + 0.1 * (sum(map(ord, c)) % 7) for c in completions]


TOY_DATASET = Dataset.from_dict({"prompt": ["abc", "hello", "xyz 12", "foo bar", "q", "rst uv"] * 2})


def make_config(tmp_path, dtype: str, **overrides) -> "trl.GRPOConfig":
    kwargs = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=7,
        report_to=[], use_cpu=True, save_strategy="no", seed=0, bf16=(dtype == "bf16"), beta=0.04,
        logging_steps=1, disable_tqdm=True,
    )
    kwargs.update(overrides)
    with warnings.catch_warnings():  # transformers' own deprecation notices about TrainingArguments
        warnings.simplefilter("ignore", FutureWarning)
        return trl.GRPOConfig(**kwargs)


def build(cls, model, tokenizer, args, **extra):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(model=model, reward_funcs=toy_reward, args=args, train_dataset=TOY_DATASET,
                   processing_class=tokenizer, **extra)


def build_pair(model_dir, tokenizer, args):
    """(stock TRL trainer, trainer with our head) from the same weights."""
    stock = build(trl.GRPOTrainer, model_dir, tokenizer, args)
    ours = build(gk_trl.GRPOTrainer, model_dir, tokenizer, args, grpo_kernels_backend="torch")
    return stock, ours


@pytest.fixture
def core_calls(monkeypatch) -> list:
    """Counts the calls the integration makes to grpo_kernels.fused_linear_token_logprobs (looked up
    at call time), so a test knows our head computed the numbers, not a silent delegation to TRL's."""
    import grpo_kernels

    calls = []
    real = grpo_kernels.fused_linear_token_logprobs

    def counting(*args, **kwargs):
        calls.append(kwargs.get("backend"))
        return real(*args, **kwargs)

    monkeypatch.setattr(grpo_kernels, "fused_linear_token_logprobs", counting)
    return calls


def uses_our_head(model) -> bool:
    """Whether model.forward is ours (possibly under accelerate's autocast wrapper)."""
    forward = getattr(model, "_original_forward", model.forward)
    return bool(getattr(forward, "__grpo_kernels__", False))


# --------------------------------------------------------------------------------------------------
# A batch in TRL's format
# --------------------------------------------------------------------------------------------------
B, P, C = 4, 5, 7


def make_batch(stock, seed: int) -> dict:
    """Left-padded prompts, right-padded completions, mixed-sign advantages, and old / ref / sampler
    log-probs perturbed away from the policy's so ratios clip and the KL is not 0."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, VOCAB, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[1, :2] = 0
    prompt_ids[1, :2] = 0
    completion_ids = torch.randint(3, VOCAB, (B, C), generator=g)
    completion_mask = torch.ones(B, C, dtype=torch.long)
    completion_mask[0, 4:] = 0
    completion_mask[2, 6:] = 0
    completion_ids[completion_mask == 0] = 0
    advantages = torch.tensor([1.3, -0.7, 0.4, -1.1]) * (1 + 0.2 * torch.rand(B, generator=g))
    with torch.no_grad():
        logps, _, _ = stock._get_per_token_logps_and_entropies(
            stock.model, torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1), C
        )
    noise = lambda s: s * torch.randn(B, C, generator=g)  # noqa: E731
    return {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
        "completion_ids": completion_ids, "completion_mask": completion_mask,
        "advantages": advantages,
        "old_per_token_logps": (logps + noise(0.3)) * completion_mask,
        "ref_per_token_logps": (logps + noise(0.2)) * completion_mask,
        "sampling_per_token_logps": (logps + noise(0.3)) * completion_mask,
        "importance_sampling_ratio": 0.6 + 0.8 * torch.rand(B, C, generator=g),
        "num_items_in_batch": completion_mask.sum(),
    }


def run_loss(trainer, batch: dict, vllm_is_ratio: bool):
    """TRL's own _compute_loss + backward: (loss, {param: grad}, metrics)."""
    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop; one micro-batch per step here
    trainer._metrics["train"].clear()
    if vllm_is_ratio:  # the vLLM importance-sampling branch, without a vLLM server
        trainer.use_vllm = True
        trainer.vllm_importance_sampling_correction = True
    loss = trainer.compute_loss(trainer.model, {k: v.clone() for k, v in batch.items()})
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    metrics = {k: list(v) for k, v in trainer._metrics["train"].items()}
    return loss.detach(), grads, metrics


def assert_grads_close(grads_o: dict, grads_s: dict, dtype: torch.dtype, what: str) -> None:
    """Every parameter's gradient: ours against TRL's.

    fp32: element-wise, at fp32 tolerance of that tensor's largest entry. Under bf16 autocast both
    heads round the same bf16 logits but the backward differs in where it rounds (TRL sums the hidden
    states' gradient in fp32, our core returns it in the bf16 the logits were computed in), and the
    bf16 backbone carries that through; TRL's own bf16 gradient is 10-50% away from its fp32 one on
    this peaked model, ours vs TRL ~1%. So under bf16: each tensor's relative L2 difference within
    the bf16 tolerance, and every element within it relative to the model's largest gradient.
    """
    rtol, _ = tolerance(dtype)
    largest = max(g.abs().max().item() for g in grads_s.values())
    for name, g in grads_s.items():
        assert g.abs().max() > 0, f"{what}: TRL's gradient of {name} is all zero"
        if dtype in (torch.float32, torch.float64):
            assert_close64(grads_o[name], g, dtype, scale=g.abs().max().item(), what=f"{what}: grad {name}")
            continue
        if name.endswith("k_proj.bias"):  # analytically 0 (softmax is shift-invariant): rounding noise only
            assert_close64(grads_o[name], g, dtype, scale=largest, what=f"{what}: grad {name}")
            continue
        rel = ((grads_o[name].double() - g.double()).norm() / g.double().norm()).item()
        assert rel <= rtol, f"{what}: grad {name}: relative L2 difference {rel:.2e} > {rtol}"
        assert_close64(grads_o[name], g, dtype, scale=largest, what=f"{what}: grad {name}")


def assert_parity(ours, stock, dtype: torch.dtype, what: str) -> None:
    """Ours against TRL's own result. Both heads round the logits to the same dtype and reduce in
    fp32, so the forward (loss, metrics) agrees to fp32 rounding even under bf16 autocast; gradients
    at the tolerance of the dtype the head computes in (see assert_grads_close)."""
    loss_o, grads_o, metrics_o = ours
    loss_s, grads_s, metrics_s = stock
    forward_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert torch.isfinite(loss_s) and torch.isfinite(loss_o), what
    # the loss is a mean of O(1) terms (advantage x ratio): tolerance relative to 1 at least
    assert_close64(loss_o, loss_s, forward_dtype, scale=max(loss_s.abs().item(), 1.0), what=f"{what}: loss")
    assert grads_o.keys() == grads_s.keys() and len(grads_s) > 0, what
    assert_grads_close(grads_o, grads_s, dtype, what)
    assert metrics_o.keys() == metrics_s.keys(), f"{what}: metric names differ"
    for key in metrics_s:
        assert_close64(torch.tensor(metrics_o[key]), torch.tensor(metrics_s[key]), forward_dtype, what=f"{what}: metric {key}")


# --------------------------------------------------------------------------------------------------
# Loss-level parity with TRL's own code path
# --------------------------------------------------------------------------------------------------
def test_loss_types_cover_trl():
    """Every loss name in TRL's _compute_loss is one we test (catches a new TRL loss in the pinned range)."""
    source = inspect.getsource(trl.GRPOTrainer._compute_loss)
    names = set()
    for clause in re.findall(r"self\.loss_type (?:==|in) ([^:]+):", source):
        names.update(re.findall(r'"(\w+)"', clause))
    assert names and names <= set(LOSS_TYPES), f"TRL has loss types {sorted(names - set(LOSS_TYPES))} not tested here"


LOSS_CASES = [pytest.param({"loss_type": name}, False, id=name) for name in LOSS_TYPES]
LOSS_CASES[LOSS_TYPES.index("luspo")] = pytest.param(
    {"loss_type": "luspo", "importance_sampling_level": "sequence"}, False, id="luspo")
OPTION_CASES = [
    pytest.param({"loss_type": "grpo", "delta": 1.3, "epsilon_high": 0.28}, False, id="two_sided_clip"),
    pytest.param({"loss_type": "grpo", "importance_sampling_level": "sequence"}, False, id="gspo"),
    pytest.param({"loss_type": "dapo", "use_bias_correction_kl": False}, False, id="kl_no_bias_correction"),
    pytest.param({"loss_type": "dapo", "beta": 0.0}, False, id="no_kl"),
    pytest.param({"loss_type": "dapo", "top_entropy_quantile": 0.4}, False, id="top_entropy_mask"),
    pytest.param({"loss_type": "bnpo", "entropy_coef": 0.05}, False, id="entropy_bonus"),
    pytest.param({"loss_type": "dapo", "entropy_coef": 0.05, "use_adaptive_entropy": True}, False, id="adaptive_entropy"),
    pytest.param({"loss_type": "dapo", "off_policy_mask_threshold": 0.05}, False, id="off_policy_mask"),
    pytest.param({"loss_type": "grpo"}, True, id="vllm_is_ratio"),
    pytest.param({"loss_type": "dr_grpo", "temperature": 0.7}, False, id="temperature"),
    pytest.param({"loss_type": "dapo", "cast_lm_head_to_fp32": True}, False, id="cast_lm_head_to_fp32"),
]


# Every loss type under both dtypes; each option under fp32, and under bf16 those whose point is
# bf16 or whose gradient path differs (entropy bonus: the entropy's gradient; IS ratio; fp32 head).
BF16_OPTIONS = {"entropy_bonus", "vllm_is_ratio", "cast_lm_head_to_fp32", "gspo"}
COMPUTE_LOSS_CASES = [
    pytest.param(*case.values, dtype, id=f"{case.id}-{dtype}")
    for case in LOSS_CASES + OPTION_CASES
    for dtype in DTYPES
    if case in LOSS_CASES or dtype == "fp32" or case.id in BF16_OPTIONS
]


@pytest.mark.parametrize("overrides, vllm_is_ratio, dtype", COMPUTE_LOSS_CASES)
def test_compute_loss_matches_trl(model_dir, tokenizer, tmp_path, core_calls, dtype, overrides, vllm_is_ratio):
    """Loss, every parameter's gradient and every logged metric equal TRL's own, under fp32 and under
    TRL's default bf16 autocast, with beta > 0 and the bias-corrected KL unless the case says otherwise."""
    args = make_config(tmp_path, dtype, **overrides)
    stock, ours = build_pair(model_dir, tokenizer, args)
    assert uses_our_head(ours.model) and not uses_our_head(stock.model)
    if stock.ref_model is not None:
        assert uses_our_head(ours.ref_model) and not uses_our_head(stock.ref_model)
    batch = make_batch(stock, seed=len(str(overrides)))
    stock_result = run_loss(stock, batch, vllm_is_ratio)
    assert core_calls == []
    ours_result = run_loss(ours, batch, vllm_is_ratio)
    assert core_calls == ["torch"]  # our head computed the policy's log-probs, once
    # With cast_lm_head_to_fp32 TRL's head computes in fp32 even under autocast, and so does ours.
    head_dtype = torch.float32 if overrides.get("cast_lm_head_to_fp32") else DTYPES[dtype]
    assert_parity(ours_result, stock_result, head_dtype, str(overrides))


def test_head_runs_inside_the_wrapped_models_call(model_dir, tokenizer, tmp_path, core_calls):
    """TRL calls `model(...)`; our head runs inside that call, so hooks of a wrapper (DDP, FSDP) or on
    the module fire around it, as they do around TRL's head."""
    args = make_config(tmp_path, "fp32", beta=0.0)
    ours = build(gk_trl.GRPOTrainer, model_dir, tokenizer, args, grpo_kernels_backend="torch")
    events = []
    ours.model.register_forward_pre_hook(lambda module, args: events.append(("pre", len(core_calls))))
    ours.model.register_forward_hook(lambda module, args, out: events.append(("post", len(core_calls))))
    batch = make_batch(ours, seed=11)
    assert events == [("pre", 0), ("post", 1)]


# --------------------------------------------------------------------------------------------------
# The head: per-token log-probs and entropies, against float64 and against TRL's head
# --------------------------------------------------------------------------------------------------
def float64_logps_entropy(model, input_ids, attention_mask, keep: int, temperature: float):
    """log softmax(logits / T)[next token] and the entropy from the model's own forward in float64."""
    import copy

    model64 = copy.deepcopy(model).double()
    model64.forward = type(model64).forward.__get__(model64)  # the plain HF forward, not a fused head
    with torch.no_grad():
        logits = model64(input_ids=input_ids, attention_mask=attention_mask).logits[:, -keep - 1:-1] / temperature
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, input_ids[:, -keep:, None])[..., 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    valid = attention_mask[:, -keep:].bool()
    return logp * valid, entropy * valid, valid


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_head_matches_float64_and_trl(model_dir, tokenizer, tmp_path, core_calls, dtype, backend):
    """Per-token log-probs and entropies through TRL's _get_per_token_logps_and_entropies (inside
    accelerator.autocast()): ours equals TRL's head to fp32 rounding (both round the logits to the
    autocast dtype the same way), and both equal float64 within the dtype's tolerance. Gradients of
    log-probs + entropies w.r.t. every parameter equal TRL's."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 (set by conftest before triton is imported)")
    args = make_config(tmp_path, dtype, temperature=0.8, beta=0.0)
    stock = build(trl.GRPOTrainer, model_dir, tokenizer, args)
    ours = build(gk_trl.GRPOTrainer, model_dir, tokenizer, args, grpo_kernels_backend=backend)
    batch = make_batch(stock, seed=7)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    results = {}
    for name, trainer in (("trl", stock), ("ours", ours)):
        trainer.model.zero_grad(set_to_none=True)
        logp, entropy, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C, compute_entropy=True)
        assert logp.dtype == entropy.dtype == torch.float32
        (logp.sum() + entropy.sum()).backward()
        results[name] = (logp.detach(), entropy.detach(),
                         {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
    assert core_calls == [backend]
    ref_logp, ref_entropy, valid = float64_logps_entropy(stock.model, ids, mask, C, 0.8)
    assert bool((results["ours"][0][~valid] == 0).all()) and bool((results["ours"][1][~valid] == 0).all())
    for name in ("trl", "ours"):  # both heads against float64, at the tolerance of their compute dtype
        assert_close64(results[name][0], ref_logp, DTYPES[dtype], scale=4.0, what=f"{name} logp vs float64")
        assert_close64(results[name][1], ref_entropy, DTYPES[dtype], scale=4.0, what=f"{name} entropy vs float64")
    # ours against TRL: the same rounded logits, so fp32 agreement even under bf16 autocast
    assert_close64(results["ours"][0], results["trl"][0], torch.float32, scale=4.0, what="logp vs TRL")
    assert_close64(results["ours"][1], results["trl"][1], torch.float32, scale=4.0, what="entropy vs TRL")
    for n, g in results["trl"][2].items():
        assert_close64(results["ours"][2][n], g, DTYPES[dtype], scale=g.abs().max().item(), what=f"grad {n}")


# --------------------------------------------------------------------------------------------------
# End to end: three optimizer steps, stock vs patched
# --------------------------------------------------------------------------------------------------
TIMING_KEYS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}


def train_logs(trainer) -> list[dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return [{k: v for k, v in entry.items() if k not in TIMING_KEYS} for entry in trainer.state.log_history]


@pytest.mark.parametrize("route", ["patch", "subclass"])
def test_three_step_run_matches_trl(model_dir, tokenizer, tmp_path, route):
    """Three GRPO steps (one generation of 12 completions, three optimizer steps on it, so the policy
    moves away from the sampler and ratios clip; lr 1e-2, beta 0.1, fp32): every logged number matches."""
    args = make_config(tmp_path, "fp32", steps_per_generation=3, max_steps=3, learning_rate=1e-2, beta=0.1,
                       loss_type="dapo", epsilon_high=0.28)
    stock_logs = train_logs(build(trl.GRPOTrainer, model_dir, tokenizer, args))
    if route == "patch":
        gk_trl.patch(backend="torch")
        try:
            patched = build(trl.GRPOTrainer, model_dir, tokenizer, args)
        finally:
            gk_trl.unpatch()
    else:
        patched = build(gk_trl.GRPOTrainer, model_dir, tokenizer, args, grpo_kernels_backend="torch")
    assert uses_our_head(patched.model) and uses_our_head(patched.ref_model)
    ours_logs = train_logs(patched)
    assert len(ours_logs) == len(stock_logs) == 4  # three steps and the summary
    assert any(entry.get("kl", 0) > 0 for entry in stock_logs[:3]), "the run should move the policy off the reference"
    for step, (o, s) in enumerate(zip(ours_logs, stock_logs)):
        assert o.keys() == s.keys(), f"step {step}: logged keys differ"
        for key, value in s.items():
            assert o[key] == pytest.approx(value, rel=1e-4, abs=1e-6), f"step {step}: {key} {o[key]} != {value}"


def test_bf16_run_matches_trl(model_dir, tokenizer, tmp_path):
    """One step under TRL's default bf16 autocast: the logged loss, KL, entropy and grad norm match."""
    args = make_config(tmp_path, "bf16", max_steps=1, learning_rate=1e-2, beta=0.1)
    stock_logs = train_logs(build(trl.GRPOTrainer, model_dir, tokenizer, args))
    ours_logs = train_logs(build(gk_trl.GRPOTrainer, model_dir, tokenizer, args, grpo_kernels_backend="torch"))
    for key in ("loss", "kl", "entropy", "grad_norm", "reward"):
        assert ours_logs[0][key] == pytest.approx(stock_logs[0][key], rel=1.6e-2, abs=1.6e-2), key


# --------------------------------------------------------------------------------------------------
# patch / unpatch, fallbacks
# --------------------------------------------------------------------------------------------------
def test_patch_unpatch_restores_trl_exactly(model_dir, tokenizer, tmp_path):
    original = trl_grpo_module.add_fused_lm_head
    assert not gk_trl.is_patched()
    gk_trl.patch()
    gk_trl.patch(backend="torch")  # patching twice must not lose TRL's function
    assert gk_trl.is_patched() and trl_grpo_module.add_fused_lm_head is not original
    gk_trl.unpatch()
    assert trl_grpo_module.add_fused_lm_head is original and not gk_trl.is_patched()
    gk_trl.unpatch()  # a second unpatch is a no-op
    assert trl_grpo_module.add_fused_lm_head is original
    # the subclass installs its head only for the duration of its __init__
    args = make_config(tmp_path, "fp32", beta=0.0)
    ours = build(gk_trl.GRPOTrainer, model_dir, tokenizer, args)
    assert uses_our_head(ours.model) and trl_grpo_module.add_fused_lm_head is original
    # after unpatch, a trainer is TRL's, bit for bit
    after = build(trl.GRPOTrainer, model_dir, tokenizer, args)
    never = build(trl.GRPOTrainer, model_dir, tokenizer, args)
    assert not uses_our_head(after.model)
    batch = make_batch(never, seed=3)
    assert_parity(run_loss(after, batch, False), run_loss(never, batch, False), torch.float64, "unpatched")


def test_bad_settings_raise():
    with pytest.raises(ValueError, match="backend"):
        gk_trl.patch(backend="cuda")
    with pytest.raises(ValueError, match="chunk_size"):
        gk_trl.patch(chunk_size=0)
    assert not gk_trl.is_patched()


def test_host_checks_refuse_another_head_and_note_an_untested_release(monkeypatch, caplog):
    """patch() checks TRL's add_fused_lm_head and FusedCausalLMOutput, not TRL's version: another
    signature is refused naming TRL's version and the piece (nothing patched); an untested release
    whose checks pass is patched with one INFO record."""
    from grpo_kernels.integrations import _host

    assert _host.is_tested("trl", trl.__version__), f"make test runs TRL {trl.__version__}, not in the tested table"

    def other_head(model, temperature=1.0, outputs=("log_probs",)):
        raise AssertionError("never called")

    monkeypatch.setattr(gk_trl, "_TRL_ADD_FUSED_LM_HEAD", other_head)
    with pytest.raises(_host.HostMismatchError, match=rf"trl {re.escape(trl.__version__)}: add_fused_lm_head has"):
        gk_trl.patch()
    assert not gk_trl.is_patched()
    monkeypatch.undo()
    monkeypatch.delattr(trl.trainer.utils.FusedCausalLMOutput, "__dataclass_fields__")
    with pytest.raises(_host.HostMismatchError, match="FusedCausalLMOutput lacks"):
        gk_trl.patch()
    monkeypatch.undo()
    monkeypatch.setitem(_host.TESTED, "trl", ("0.0.1",))
    try:
        with caplog.at_level("INFO", logger=gk_trl.__name__):
            gk_trl.patch()
        assert gk_trl.is_patched()
        assert any("not a release this integration was tested against" in r.getMessage() for r in caplog.records)
    finally:
        gk_trl.unpatch()


def trl_vs_ours_on_model(make, outputs=("log_probs", "entropy")):
    """Add TRL's head to one copy and ours to another; return both forwards' outputs on one batch."""
    stock, ours = make(), make()
    trl.trainer.utils.add_fused_lm_head(stock, temperature=0.9, outputs=outputs)
    gk_trl._make_add_fused_lm_head("torch")(ours, temperature=0.9, outputs=outputs)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :4] = -100
    return [m(input_ids=ids, labels=labels, fused_lm_head=True) for m in (stock, ours)], (stock, ours)


def count_warnings(record) -> int:
    return sum("grpo_kernels.integrations.trl" in str(w.message) for w in record)


def test_extra_outputs_fall_back_with_one_warning():
    gk_trl._warned.clear()
    with pytest.warns(UserWarning, match="is_top1") as record:
        (out_s, out_o), (_, ours) = trl_vs_ours_on_model(make_model, outputs=("log_probs", "is_top1"))
        trl_vs_ours_on_model(make_model, outputs=("log_probs", "is_top1"))
    assert count_warnings(record) == 1
    assert not uses_our_head(ours)
    assert torch.equal(out_o.log_probs, out_s.log_probs) and torch.equal(out_o.is_top1, out_s.is_top1)


def test_softcap_and_logit_scale_served_or_fall_back():
    """Soft-capping and logit_scale: ours when the core offers them with TRL's meaning (then equal to
    TRL's head to fp32 rounding), else TRL's head after one warning (then equal bit for bit)."""
    gk_trl._warned.clear()

    def make():
        model = make_model()
        model.config.final_logit_softcapping = 5.0  # read by TRL's head from the config
        model.config.logit_scale = 0.5
        return model

    supported = gk_trl._transform_kwargs(5.0, 0.5) is not None
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        (out_s, out_o), (_, ours) = trl_vs_ours_on_model(make)
    assert uses_our_head(ours) == supported
    if supported:
        assert count_warnings(record) == 0
        assert_close64(out_o.log_probs, out_s.log_probs, torch.float32, scale=4.0, what="softcapped logp")
        assert_close64(out_o.entropy, out_s.entropy, torch.float32, scale=4.0, what="softcapped entropy")
    else:
        assert count_warnings(record) == 1 and "soft-capping" in str(record[-1].message)
        assert torch.equal(out_o.log_probs, out_s.log_probs) and torch.equal(out_o.entropy, out_s.entropy)


def test_moe_router_logits_fall_back():
    """A MoE model that asks for router logits: TRL's head (it adds the load-balancing loss), one warning."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    gk_trl._warned.clear()

    def make():
        torch.manual_seed(0)
        return Qwen2MoeForCausalLM(Qwen2MoeConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=16,
            shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, output_router_logits=True, router_aux_loss_coef=0.01,
        ))

    with pytest.warns(UserWarning, match="router logits") as record:
        (out_s, out_o), (_, ours) = trl_vs_ours_on_model(make)
    assert count_warnings(record) == 1 and uses_our_head(ours)  # ours installed; this call served by TRL's
    assert out_s.aux_loss is not None and torch.equal(out_o.aux_loss, out_s.aux_loss)
    assert torch.equal(out_o.log_probs, out_s.log_probs) and torch.equal(out_o.loss, out_s.loss)


class AdapterWrappedHead(torch.nn.Module):
    """Shaped like a PEFT LoRA layer: the original Linear as ``base_layer``, its weight exposed."""

    def __init__(self, base: torch.nn.Linear):
        super().__init__()
        self.base_layer = base

    @property
    def weight(self):
        return self.base_layer.weight

    @property
    def bias(self):
        return self.base_layer.bias

    def forward(self, x):
        return self.base_layer(x)


@pytest.mark.parametrize("situation", ["peft_on_lm_head", "zero3"])
def test_unservable_calls_fall_back(monkeypatch, core_calls, situation):
    """Calls our head cannot serve go to TRL's head: its exact numbers, one warning naming why.
    (ZeRO-3 is simulated at the integration's own check: it does not run on one CPU process.)"""
    gk_trl._warned.clear()
    if situation == "zero3":
        monkeypatch.setattr(gk_trl, "_zero3_enabled", lambda: True)

    def make():
        model = make_model()
        if situation == "peft_on_lm_head":
            model.lm_head = AdapterWrappedHead(model.lm_head)
        return model

    match = {"peft_on_lm_head": "PEFT", "zero3": "ZeRO-3"}[situation]
    with pytest.warns(UserWarning, match=match) as record:
        (out_s, out_o), (_, ours) = trl_vs_ours_on_model(make)
        trl_vs_ours_on_model(make)
    assert count_warnings(record) == 1 and uses_our_head(ours) and core_calls == []
    assert torch.equal(out_o.log_probs, out_s.log_probs) and torch.equal(out_o.entropy, out_s.entropy)


def _fsdp2_head_worker(rank: int, world: int, store_path: str) -> None:
    """One rank of test_fsdp2_dtensor_head_is_served: TRL's head and ours on FSDP2 models whose
    lm_head is its own FSDP unit, so the head reads ``lm_head.weight`` as a sharded DTensor."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        gk_trl._warned.clear()
        models = []
        for install in (trl.trainer.utils.add_fused_lm_head, gk_trl._make_add_fused_lm_head("torch")):
            model = make_model()
            install(model, temperature=0.9, outputs=("log_probs", "entropy"))
            fully_shard(model.lm_head)
            fully_shard(model)
            models.append(model)
        stock, ours = models
        assert gk_trl._is_dtensor(ours.lm_head.weight) and uses_our_head(ours)
        ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(rank))  # data parallel
        labels = ids.clone()
        labels[:, :4] = -100
        calls = []
        original = gk_trl.grpo_kernels.fused_linear_token_logprobs
        gk_trl.grpo_kernels.fused_linear_token_logprobs = lambda *a, **k: calls.append(1) or original(*a, **k)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            out_s, out_o = (m(input_ids=ids, labels=labels, fused_lm_head=True) for m in (stock, ours))
        assert calls == [1] and count_warnings(record) == 0, "our head did not serve the DTensor head"
        assert_close64(out_o.log_probs, out_s.log_probs.double(), what="FSDP2 log_probs")
        assert_close64(out_o.entropy, out_s.entropy.double(), what="FSDP2 entropy")
        for out in (out_s, out_o):
            (out.log_probs.sum() + 0.3 * out.entropy.sum()).backward()
        assert_close64(ours.lm_head.weight.grad.full_tensor(), stock.lm_head.weight.grad.full_tensor().double(),
                       scale=8.0, what="FSDP2 d lm_head")
        assert_close64(ours.model.norm.weight.grad.full_tensor(), stock.model.norm.weight.grad.full_tensor().double(),
                       scale=8.0, what="FSDP2 d norm")
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_gloo_worker()


@pytest.mark.timeout(600)
def test_fsdp2_dtensor_head_is_served(tmp_path):
    """Under FSDP2 (2 gloo ranks, lm_head its own unit) the head is a DTensor: ours gathers it as
    TRL's does and serves the call (no fallback, no warning), with TRL's numbers and gradients."""
    import torch.multiprocessing as mp

    mp.start_processes(_fsdp2_head_worker, args=(2, str(tmp_path / "store")), nprocs=2, start_method="spawn")


def test_output_contract_matches_trl():
    """Same FusedCausalLMOutput fields as TRL's head: zeros where the label is -100, the label mask, the
    NLL loss with and without num_items_in_batch, shift_labels, and non-fused calls untouched."""
    (out_s, out_o), (stock, ours) = trl_vs_ours_on_model(make_model)
    assert torch.equal(out_o.label_mask, out_s.label_mask)
    assert out_o.log_probs.shape == out_s.log_probs.shape == (2, 8)
    assert bool((out_o.log_probs[~out_o.label_mask] == 0).all()) and bool((out_o.entropy[~out_o.label_mask] == 0).all())
    for field in ("loss", "log_probs", "entropy"):
        assert_close64(getattr(out_o, field), getattr(out_s, field), torch.float32, scale=4.0, what=field)
    assert out_o.log_sum_sq_probs is None and out_o.aux_loss is None
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    shift = ids.clone()
    shift[0, :2] = -100
    for kwargs in ({"shift_labels": shift}, {"labels": ids, "num_items_in_batch": torch.tensor(3)}):
        o, s = (m(input_ids=ids, fused_lm_head=True, **kwargs) for m in (ours, stock))
        assert_close64(o.loss, s.loss, torch.float32, scale=4.0, what=str(list(kwargs)))
        assert_close64(o.log_probs, s.log_probs, torch.float32, scale=4.0, what=str(list(kwargs)))
    o, s = (m(input_ids=ids) for m in (ours, stock))  # plain forward: the model's own logits
    assert torch.equal(o.logits, s.logits)


# --------------------------------------------------------------------------------------------------
# Memory: one GRPO step, stock vs patched
# --------------------------------------------------------------------------------------------------
MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, warnings
    os.environ["HF_HUB_OFFLINE"] = "1"
    warnings.simplefilter("ignore")
    import torch
    torch.set_num_threads(1)
    sys.path.insert(0, sys.argv[1])
    import test_integrations_trl as t
    import trl
    from grpo_kernels.integrations import trl as gk_trl

    def hwm_kib():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1])

    # 2 layers of width 32 and a 32,771-token vocabulary: the LM head dominates, as in real models.
    t.VOCAB = 32771
    peaks = {}
    for which in ("ours", "trl"):  # ours first: pages our run leaves cached only make TRL's growth look smaller
        args = t.make_config(os.path.join(sys.argv[2], which), "fp32", per_device_train_batch_size=8,
                             num_generations=8, max_completion_length=48, max_steps=1, beta=0.0)
        cls = gk_trl.GRPOTrainer if which == "ours" else trl.GRPOTrainer
        extra = {"grpo_kernels_backend": "torch"} if which == "ours" else {}
        trainer = cls(model=t.make_model(), reward_funcs=t.toy_reward, args=args, train_dataset=t.TOY_DATASET,
                      processing_class=t.make_tokenizer(), **extra)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the RSS high-water mark: measure train() only
        start = hwm_kib()
        trainer.train()
        peaks[which] = (hwm_kib() - start) / 1024
        del trainer
    print(json.dumps(peaks))
    """
)


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc to reset the RSS high-water mark")
def test_patched_step_peak_memory_below_trl(tmp_path):
    """Peak resident-memory growth of one GRPO step (8 completions of 48 tokens, V = 32,771, fp32, CPU,
    one thread), measured with the kernel's RSS high-water mark reset just before train(), in a fresh
    process with a fixed malloc mmap threshold (freed large buffers go back to the OS, so an earlier
    run cannot hide a later run's growth by more than it retained). TRL's CPU head scores every
    position in fp32 [N, V] tiles with several same-size temporaries; ours scores the completion
    tokens, a bounded chunk at a time."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(tests_dir), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, tests_dir, str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    peaks = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"peak RSS growth during one GRPO step: TRL {peaks['trl']:.0f} MiB, grpo-kernels {peaks['ours']:.0f} MiB")
    assert peaks["trl"] > 200, f"TRL's step should need hundreds of MiB here, measured {peaks['trl']:.0f}: measurement off"
    assert peaks["ours"] < 0.6 * peaks["trl"], peaks


def test_a_patched_trl_trainer_logs_which_head_it_got(tmp_path, caplog):
    """patch() said nothing: building a patched trl.GRPOTrainer logs one INFO record (logger
    ``grpo_kernels.integrations.trl``) naming our head; a head that falls back names the reason."""
    import logging

    pytest.importorskip("trl")
    import trl
    import test_integrations_trl as t

    from grpo_kernels.integrations import trl as gk_trl

    model_dir = str(tmp_path / "model")
    t.make_model().save_pretrained(model_dir)
    args = t.make_config(tmp_path / "run", "fp32", beta=0.0)
    gk_trl.patch(backend="torch")
    try:
        assert gk_trl.is_patched()
        with caplog.at_level(logging.INFO, logger="grpo_kernels"):
            trainer = t.build(trl.GRPOTrainer, model_dir, t.make_tokenizer(), args)
        ours = [r for r in caplog.records if r.name == "grpo_kernels.integrations.trl"]
        assert len(ours) == 1 and ours[0].levelno == logging.INFO, [r.getMessage() for r in ours]
        assert "grpo_kernels.fused_linear_token_logprobs" in ours[0].getMessage()
        assert "backend='torch'" in ours[0].getMessage() and t.uses_our_head(trainer.model)
        caplog.clear()
        gk_trl._warned.clear()
        with caplog.at_level(logging.INFO, logger="grpo_kernels"), pytest.warns(UserWarning, match="is_top1"):
            # TRL asks for an output we do not compute
            trl.trainer.grpo_trainer.add_fused_lm_head(t.make_model(), outputs=("log_probs", "is_top1"))
        ours = [r for r in caplog.records if r.name == "grpo_kernels.integrations.trl"]
        assert len(ours) == 1 and "keeps TRL's own fused LM head" in ours[0].getMessage()
        assert "is_top1" in ours[0].getMessage()
    finally:
        gk_trl.unpatch()


def test_sampling_option_off_by_default_and_the_truncated_distribution_when_given():
    """TRL's numbers by default (the plain softmax: the full-vocabulary head, bitwise as without the option);
    with top_k / top_p the head returns the truncated distribution's log-prob (float32's lowest for a label
    outside the kept set: TRL's loss cannot leave it out) and entropy, against spec64's float64 restatement."""
    from spec64 import sampled_logprobs64

    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :4] = -100
    outs = {}
    for name, kw in (("plain", {}), ("off", dict(top_k=0, top_p=1.0)), ("on", dict(top_k=5, top_p=0.8))):
        model = make_model()
        gk_trl._make_add_fused_lm_head("torch", None, **kw)(model, temperature=0.9, outputs=("log_probs", "entropy"))
        outs[name] = model(input_ids=ids, labels=labels, fused_lm_head=True)
    assert torch.equal(outs["off"].log_probs, outs["plain"].log_probs) and torch.equal(outs["off"].entropy, outs["plain"].entropy)
    model = make_model().double()
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1]
    targets = torch.where(labels[:, 1:] != -100, labels[:, 1:], -100)
    logp64, ent64, _ = sampled_logprobs64(logits, targets, 0.9, 5, 0.8)
    valid = targets != -100
    outside = torch.isinf(logp64) & valid
    assert outside.any() and (valid & ~outside).any(), "the case must have labels on both sides of the kept set"
    got = outs["on"].log_probs.detach()
    assert torch.all(got[outside] == torch.finfo(torch.float32).min)
    assert_close64(torch.where(outside, 0.0, got), torch.where(outside | ~valid, 0.0, logp64), scale=4.0, what="log-probs")
    assert_close64(outs["on"].entropy, torch.where(valid, ent64, 0.0), scale=4.0, what="entropy")
    with pytest.raises(ValueError, match="top_p"):
        gk_trl.patch(top_p=1.5)
    with pytest.raises(TypeError, match="top_k"):
        gk_trl.GRPOTrainer(grpo_kernels_top_k="20")
    assert not gk_trl.is_patched()
