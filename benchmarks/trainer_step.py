"""One full GRPO step, end to end: our trainer (fused loss, and the plain-PyTorch reference loss)
against TRL's ``GRPOTrainer`` (stock, and with ``grpo_kernels.integrations.trl.patch()``).

    python -m benchmarks.trainer_step                  # CPU: shapes tiny and qwen-vocab, 3 rounds
    python -m benchmarks.trainer_step --quick          # CI: shape tiny, 1 round, < 1 minute
    python -m benchmarks.trainer_step --shapes qwen-vocab --rounds 5 --sides ours trl
    python -m benchmarks.trainer_step --list           # the shapes and sides, and why a side cannot run here

A step is everything a trainer does between two batches of prompts: rollout (Hugging Face
``generate`` with the policy), rewards, advantages, reference log-probs (``beta > 0``), the loss
forward and backward, gradient clipping and the AdamW step. Every side gets the same model (a
Qwen2-shaped ``Qwen2ForCausalLM`` built in code from a seed, fp32 weights; bf16 autocast on CUDA as
both trainers do there), the same tokenizer (built in code), prompts, reward function and options
(:data:`OPTIONS`); completions are forced to exactly ``max_new_tokens`` tokens (``min_new_tokens``
suppresses EOS), so every side samples and trains on the same number of tokens. One warm-up step
precedes the measured one (lazy initialisation, AdamW's state).

Sides (:data:`SIDES`, a registry: add one with :func:`register`):
- ``ours``: ``grpo.trainer.train_step`` with ``backend="auto"`` (the fused hidden-state loss).
- ``ours-reference``: the same with ``backend="reference"`` (``[N, V]`` fp32 logits, ``log_softmax``).
- ``trl``: TRL's ``GRPOTrainer`` as shipped (its own chunked log-prob head since 1.15).
- ``trl+patch``: the same after ``grpo_kernels.integrations.trl.patch()``.
- ``ours+vllm``: ours with ``grpo.rollout.VLLMRollout`` as the rollout engine; only when that class
  exists and vLLM imports (else skipped with the reason). vLLM's length is not forced (no
  ``min_new_tokens`` in its rollout API): the token counts are reported.

Each (side, round) runs in a fresh process; rounds interleave the sides (the order rotates every
round), and the tables give medians over rounds and the median of the per-round ratios to ``ours``.
Phases: generation, scoring (rewards and advantages), old/ref log-probs, loss+backward (clipping
included), optimizer (``AdamW.step``, timed by torch's global optimizer hooks), other (the rest of
the step: batching, bookkeeping, logging). Ours reads the ``time/*`` entries of the trainer's own step
log; TRL's are measured by a subclass whose overrides time TRL's ``_generate``,
``_calculate_rewards``, the no-grad ``_get_per_token_logps_and_entropies`` calls, ``_prepare_inputs``
and ``training_step`` (each calls ``super()``; nothing of TRL is patched).

Memory: the step's peak resident set (``VmHWM`` after resetting it through ``/proc/self/clear_refs``
at the start of the step; ``MALLOC_MMAP_THRESHOLD_`` makes freed big buffers leave the process), the
resident set at its start, the whole process's peak (``ru_maxrss``), and on CUDA
``torch.cuda.max_memory_allocated`` over the step.

Results: ``benchmarks/results/trainer_step-<device>-<date>[-quick].jsonl`` (one line per measured
step, with the conditions) and ``.md`` (the tables). Exit status 1 when a side that is available here
failed (its error is in the JSON line), 0 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable, Optional

RESULT_PREFIX = "TRAINER_STEP_RESULT "
WARMUP_STEPS = 1


# --------------------------------------------------------------------------------------------------
# what every side shares: model, tokenizer, prompts, reward, options
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """A Qwen2-shaped model and the step's batch: ``prompts_per_step * num_generations`` completions
    of exactly ``max_new_tokens`` tokens after prompts of ``prompt_tokens`` tokens."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    prompts_per_step: int  # P
    num_generations: int  # G
    max_new_tokens: int  # T
    prompt_tokens: int

    def describe(self) -> str:
        return (f"Qwen2 {self.num_hidden_layers} layers, H={self.hidden_size}, MLP {self.intermediate_size}, heads "
                f"{self.num_attention_heads}/{self.num_key_value_heads} kv, V={self.vocab_size:,}; P={self.prompts_per_step} "
                f"prompts x G={self.num_generations}, prompt {self.prompt_tokens} + completion {self.max_new_tokens} tokens")


SHAPES = {
    # CI's: seconds per side
    "tiny": Shape(4096, 64, 128, 2, 2, 1, prompts_per_step=2, num_generations=4, max_new_tokens=16, prompt_tokens=12),
    # the real Qwen2/2.5 vocabulary on a small body (benchmarks/long_context.py's model): the head dominates
    "qwen-vocab": Shape(151936, 256, 1024, 4, 4, 2, prompts_per_step=2, num_generations=4, max_new_tokens=32,
                        prompt_tokens=32),
    # Qwen2.5-0.5B's shape (24 layers, H 896, V 151,936), random weights: the GPU set's
    "qwen2.5-0.5b": Shape(151936, 896, 4864, 24, 14, 2, prompts_per_step=4, num_generations=8, max_new_tokens=128,
                          prompt_tokens=64),
}

# The options every side runs with (TRL's names on the left of the comments' "=", ours where they differ).
OPTIONS = dict(
    beta=0.04,  # KL to a frozen reference model: the reference log-probs are part of the step
    loss_type="dapo",
    epsilon=0.2,  # ours: eps_low = eps_high = 0.2
    temperature=1.0,
    top_p=1.0,  # top_k off on both
    learning_rate=1e-6,  # constant (TRL: lr_scheduler_type="constant"; ours: no warm-up)
    adam_beta1=0.9,
    adam_beta2=0.99,
    weight_decay=0.0,
    max_grad_norm=1.0,
    scale_rewards="group",  # ours: advantage_std="unbiased" (TRL's group std)
    num_iterations=1,  # on-policy: no old log-probs pass on either side
    seed=0,
)

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 +-=?."


def build_model(shape: Shape):
    """The Qwen2-shaped policy: seeded random weights, fp32, untied ``lm_head``, EOS = 1, pad = 0;
    ``min_new_tokens = max_new_tokens`` in its generation config (no completion stops early)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(OPTIONS["seed"])
    config = Qwen2Config(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
        bos_token_id=None, max_position_embeddings=max(1024, shape.prompt_tokens + shape.max_new_tokens),
    )
    model = Qwen2ForCausalLM(config).float()
    model.generation_config.min_new_tokens = shape.max_new_tokens
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 0
    return model


def build_tokenizer(vocab_size: int):
    """A word-level tokenizer of exactly ``vocab_size`` ids, made in code: ``<pad>`` 0, ``<eos>`` 1,
    ``<unk>`` 2, one id per character of :data:`CHARS`, then filler tokens ``<tN>`` (which a random
    model samples as often as any other); prompts pad on the left."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    vocab.update({c: len(vocab) + i for i, c in enumerate(CHARS)})
    vocab.update({f"<t{i}>": i for i in range(len(vocab), vocab_size)})
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   padding_side="left", clean_up_tokenization_spaces=False)


def prompts(shape: Shape, count: int = 32) -> list[str]:
    """``count`` prompts of exactly ``prompt_tokens`` characters (= tokens): no prompt padding anywhere."""
    import random

    rng = random.Random(OPTIONS["seed"])
    return ["".join(rng.choice(CHARS) for _ in range(shape.prompt_tokens)) for _ in range(count)]


def checksum_reward(prompts, completions, **kwargs) -> list[float]:
    """A cheap reward that varies between completions (so advantages are not all 0): a checksum of the text."""
    return [float(sum(map(ord, c)) % 101) / 100 for c in completions]


# --------------------------------------------------------------------------------------------------
# measuring a step inside a side's process
# --------------------------------------------------------------------------------------------------
def _status_kib(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class StepMeter:
    """Wall time and peak memory of the measured step, and the optimizer's time inside it.

    ``AdamW.step`` is timed through torch's global optimizer hooks (``register_optimizer_step_pre_hook``
    / ``_post_hook``), which fire for our optimizer and for the one inside TRL's accelerate wrapper."""

    def __init__(self, device) -> None:
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.torch, self.device = torch, device
        self.optimizer_s, self._opt_start = 0.0, None
        register_optimizer_step_pre_hook(self._opt_pre)
        register_optimizer_step_post_hook(self._opt_post)

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def _opt_pre(self, optimizer, args, kwargs) -> None:
        self.sync()
        self._opt_start = time.perf_counter()

    def _opt_post(self, optimizer, args, kwargs) -> None:
        self.sync()
        self.optimizer_s += time.perf_counter() - self._opt_start

    def begin(self) -> None:
        self.sync()
        self.optimizer_s = 0.0
        try:  # "5": reset the peak resident set to the current one
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.hwm_reset = True
        except OSError:
            self.hwm_reset = False
        self.rss_start_kib = _status_kib("VmRSS")
        if self.device.type == "cuda":
            self.torch.cuda.reset_peak_memory_stats(self.device)
            self.cuda_start = self.torch.cuda.memory_allocated(self.device)
        self.start = time.perf_counter()

    def end(self) -> dict:
        self.sync()
        seconds = time.perf_counter() - self.start
        mib = lambda kib: None if kib is None else kib / 1024  # noqa: E731
        out = {
            "step_s": seconds,
            "optimizer_s": self.optimizer_s,
            "rss_start_mib": mib(self.rss_start_kib),
            # without the reset, VmHWM is the process's peak so far (marked so in the results)
            "step_peak_rss_mib": mib(_status_kib("VmHWM")),
            "step_peak_rss_is_step_only": self.hwm_reset,
            "process_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
        if self.device.type == "cuda":
            out["cuda_peak_allocated_mib"] = self.torch.cuda.max_memory_allocated(self.device) / 2**20
            out["cuda_start_allocated_mib"] = self.cuda_start / 2**20
        return out


def phases_with_other(step_s: float, phases: dict) -> dict:
    """``phases`` plus ``other``: the part of the step no phase accounts for."""
    return {**phases, "other": max(0.0, step_s - sum(phases.values()))}


# --------------------------------------------------------------------------------------------------
# the sides
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Side:
    """One way to run the step. ``run(shape, device)`` runs inside the side's own process and returns
    the measured step (:meth:`StepMeter.end`'s fields plus ``phases``, ``completion_tokens``, ``loss``);
    ``unavailable()`` is None when the side can run here, else the reason it cannot."""

    name: str
    description: str
    run: Callable
    unavailable: Callable[[], Optional[str]] = lambda: None
    python: Callable[[], Optional[str]] = lambda: sys.executable  # the interpreter its process runs in


SIDES: dict[str, Side] = {}


def register(side: Side) -> Side:
    SIDES[side.name] = side
    return side


def _our_config(shape: Shape, backend: str, output_dir: str):
    from grpo.config import GRPOConfig

    return GRPOConfig(
        output_dir=output_dir, seed=OPTIONS["seed"], num_steps=WARMUP_STEPS + 1, prompts_per_step=shape.prompts_per_step,
        num_generations=shape.num_generations, max_new_tokens=shape.max_new_tokens, temperature=OPTIONS["temperature"],
        top_p=OPTIONS["top_p"], advantage_std="unbiased", scale_rewards=OPTIONS["scale_rewards"], beta=OPTIONS["beta"],
        loss_type=OPTIONS["loss_type"], eps_low=OPTIONS["epsilon"], num_iterations=OPTIONS["num_iterations"],
        backend=backend, learning_rate=OPTIONS["learning_rate"], weight_decay=OPTIONS["weight_decay"],
        adam_beta1=OPTIONS["adam_beta1"], adam_beta2=OPTIONS["adam_beta2"], max_grad_norm=OPTIONS["max_grad_norm"],
        progress=False, plot=False,
    )


def run_ours(shape: Shape, device, backend: str = "auto", rollout_factory: Optional[Callable] = None) -> dict:
    """Our trainer's step: ``grpo.trainer.train_step`` after the set-up ``grpo.train`` does (seed, the
    policy, its frozen reference copy, AdamW, the rollout engine), without its logging and checkpoints."""
    from grpo import trainer as tr

    model, tokenizer = build_model(shape), build_tokenizer(shape.vocab_size)
    rows = [{"prompt": p} for p in prompts(shape)]
    with tempfile.TemporaryDirectory() as out:
        cfg = _our_config(shape, backend, out)
        tr.set_seed(cfg.seed)
        model, policy, ref_policy, optimizer = tr.setup_training(model, cfg, device)
        rollout = rollout_factory(model, tokenizer, cfg, out) if rollout_factory else tr.default_rollout(model, tokenizer, cfg)
        reward_fns = tr.as_named([checksum_reward])
        meter = StepMeter(device)
        for step in range(WARMUP_STEPS + 1):
            meter.begin()
            record = tr.train_step(step, policy, ref_policy, rollout, optimizer, rows, reward_fns, cfg, device)
            measured = meter.end()
    phases = {
        "generation": record["time/generate"],
        "scoring": record["time/score"],
        "logps": record["time/logps"],
        "loss+backward": record["time/update"] - measured["optimizer_s"],
        "optimizer": measured["optimizer_s"],
    }
    batch = shape.prompts_per_step * shape.num_generations
    weights = str(next(model.parameters()).dtype).replace("torch.", "")
    return {**measured, "phases": phases_with_other(measured["step_s"], phases), "weights": weights,
            "completion_tokens": round(record["completion_length/mean"] * batch), "loss": record.get("loss"),
            "reward": record.get("reward"), "kl": record.get("kl")}


def _trl_unavailable() -> Optional[str]:
    if importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None:
        return "trl is not installed (pip install -e '.[trl]')"
    return None


def _patch_unavailable() -> Optional[str]:
    reason = _trl_unavailable()
    if reason:
        return reason
    try:
        import grpo_kernels.integrations.trl  # noqa: F401  (raises for a TRL it does not support)
    except Exception as exc:
        return f"grpo_kernels.integrations.trl does not import: {type(exc).__name__}: {exc}"
    return None


def run_trl(shape: Shape, device, patched: bool = False) -> dict:
    """TRL's ``GRPOTrainer.train()`` for the warm-up and the measured step, same model, data and options.

    Phases come from a subclass (overrides that time TRL's own methods around ``super()``) and the
    step's bounds from a ``TrainerCallback`` (``on_step_begin`` / ``on_step_end``)."""
    from grpo_kernels.integrations import trl as gk_trl

    if patched:
        gk_trl.patch()
    try:
        return _run_trl(shape, device, patched)
    finally:
        if patched:
            gk_trl.unpatch()  # (--quick runs the next side in this process)


def _run_trl(shape: Shape, device, patched: bool) -> dict:
    import warnings

    import torch
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback

    meter = StepMeter(device)
    phase_s: dict[str, float] = {}

    class timed:
        def __init__(self, phase: str) -> None:
            self.phase = phase

        def __enter__(self):
            meter.sync()
            self.start = time.perf_counter()

        def __exit__(self, *exc):
            meter.sync()
            phase_s[self.phase] = phase_s.get(self.phase, 0.0) + time.perf_counter() - self.start

    class TimedGRPOTrainer(trl.GRPOTrainer):
        def _generate(self, *args, **kwargs):
            with timed("generation"):
                return super()._generate(*args, **kwargs)

        def _calculate_rewards(self, *args, **kwargs):
            with timed("scoring"):
                return super()._calculate_rewards(*args, **kwargs)

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            if torch.is_grad_enabled():  # the loss's own forward: part of loss+backward
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)
            with timed("logps"):  # old / reference log-probs, under no_grad
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)

        def _prepare_inputs(self, *args, **kwargs):
            with timed("prepare_inputs"):
                return super()._prepare_inputs(*args, **kwargs)

        def training_step(self, *args, **kwargs):
            with timed("training_step"):
                return super().training_step(*args, **kwargs)

    measured: dict = {}

    class MeasureStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == WARMUP_STEPS:
                phase_s.clear()
                meter.begin()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == WARMUP_STEPS + 1:
                measured.update(meter.end(), phase_s=dict(phase_s))

    P, G, T = shape.prompts_per_step, shape.num_generations, shape.max_new_tokens
    model, tokenizer = build_model(shape), build_tokenizer(shape.vocab_size)
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # TRL loads its reference model from the policy's path: the same weights, saved
        model_dir = os.path.join(out, "policy")
        model.save_pretrained(model_dir)
        del model
        args = trl.GRPOConfig(
            output_dir=out, per_device_train_batch_size=P * G, gradient_accumulation_steps=1, num_generations=G,
            max_completion_length=T, max_steps=WARMUP_STEPS + 1, learning_rate=OPTIONS["learning_rate"],
            lr_scheduler_type="constant", beta=OPTIONS["beta"], loss_type=OPTIONS["loss_type"], epsilon=OPTIONS["epsilon"],
            temperature=OPTIONS["temperature"], top_p=OPTIONS["top_p"], top_k=0, adam_beta1=OPTIONS["adam_beta1"],
            adam_beta2=OPTIONS["adam_beta2"], weight_decay=OPTIONS["weight_decay"], max_grad_norm=OPTIONS["max_grad_norm"],
            scale_rewards=OPTIONS["scale_rewards"], num_iterations=OPTIONS["num_iterations"], seed=OPTIONS["seed"],
            generation_kwargs={"min_new_tokens": T}, report_to=[], save_strategy="no", logging_steps=1,
            disable_tqdm=True, use_cpu=device.type != "cuda", bf16=device.type == "cuda", dataloader_num_workers=0,
        )
        trainer = TimedGRPOTrainer(model=model_dir, reward_funcs=checksum_reward, args=args, processing_class=tokenizer,
                                   train_dataset=Dataset.from_dict({"prompt": prompts(shape)}), callbacks=[MeasureStep()])
        trainer.train()
    forward = getattr(trainer.model, "_original_forward", trainer.model.forward)
    head = "grpo_kernels" if getattr(forward, "__grpo_kernels__", False) else "trl"
    if head != ("grpo_kernels" if patched else "trl"):
        raise RuntimeError(f"the policy's log-prob head is {head}'s, expected the other ({patched=})")
    logged = next((e for e in trainer.state.log_history if e.get("step") == WARMUP_STEPS + 1 and "loss" in e), {})
    ps = measured.pop("phase_s")
    inside = ps.get("prepare_inputs", 0.0)
    phases = {
        "generation": ps.get("generation", 0.0),
        "scoring": ps.get("scoring", 0.0),
        "logps": ps.get("logps", 0.0),
        "loss+backward": ps.get("training_step", 0.0) - inside,
        "optimizer": measured["optimizer_s"],
    }
    # what _prepare_inputs does besides the three phases (advantages, bookkeeping) is in "other"
    weights = str(next(trainer.model.parameters()).dtype).replace("torch.", "")
    return {**measured, "phases": phases_with_other(measured["step_s"], phases), "log_prob_head": head, "weights": weights,
            "completion_tokens": round(logged.get("completions/mean_length", float("nan")) * P * G),
            "loss": logged.get("loss"), "reward": logged.get("reward"), "kl": logged.get("kl")}


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def vllm_python() -> Optional[str]:
    """The interpreter that has vLLM: this one when it imports vllm, else ``$GRPO_VLLM_PYTHON``, else
    ``.venv-vllm/bin/python`` next to this interpreter's venv (``make install-vllm`` makes it), else None."""
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    venv = os.path.join(os.path.dirname(sys.prefix), ".venv-vllm", "bin", "python")
    for candidate in (os.environ.get("GRPO_VLLM_PYTHON"), venv):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def _vllm_unavailable() -> Optional[str]:
    if vllm_python() is None:
        return ("vllm is not installed here, and no vLLM venv was found (GRPO_VLLM_PYTHON, or .venv-vllm next to "
                f"{sys.prefix}: make install-vllm)")
    return None


def _vllm_rollout(model, tokenizer, cfg, out_dir):
    """A ``VLLMRollout`` on the policy saved to ``out_dir`` (the engine loads weights from a path)."""
    from grpo.rollout import VLLMRollout

    path = os.path.join(out_dir, "policy")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    dtype = "bfloat16" if next(model.parameters()).is_cuda and cfg.bf16 else "float32"  # as the trainer's autocast
    return VLLMRollout(path, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                       dtype=dtype, seed=cfg.seed, eos_token_id=1)


register(Side("ours", "grpo.trainer, fused loss (backend auto)", run_ours))
register(Side("ours-reference", "grpo.trainer, plain-PyTorch reference loss (backend reference)",
              lambda shape, device: run_ours(shape, device, backend="reference")))
register(Side("trl", "trl.GRPOTrainer, stock", run_trl, _trl_unavailable))
register(Side("trl+patch", "trl.GRPOTrainer after grpo_kernels.integrations.trl.patch()",
              lambda shape, device: run_trl(shape, device, patched=True), _patch_unavailable))
register(Side("ours+vllm", "grpo.trainer, fused loss, VLLMRollout for generation (in the vLLM venv's interpreter)",
              lambda shape, device: run_ours(shape, device, rollout_factory=_vllm_rollout), _vllm_unavailable,
              python=vllm_python))


def child(shape_name: str, *side_names: str) -> int:
    """Run each side's warm-up and measured step in this process, one after the other, and print a
    result line for each (a side that raises gets an ``error`` line; the next one still runs)."""
    import traceback

    import torch

    import gc

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for name in side_names:
        gc.collect()  # (several sides in one process: the previous one's model and trainer go first)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            result = {"side": name, **SIDES[name].run(SHAPES[shape_name], device)}
        except Exception as exc:
            traceback.print_exc()
            result = {"side": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


# --------------------------------------------------------------------------------------------------
# the driver: fresh processes, interleaved rounds, tables
# --------------------------------------------------------------------------------------------------
def conditions(shape_name: str, rounds: int, quick: bool) -> dict:
    import torch

    from benchmarks import machine

    info = machine.machine_info()
    versions = {}
    for name in ("transformers", "trl", "datasets"):
        try:
            versions[name] = importlib.import_module(name).__version__
        except Exception:
            versions[name] = None
    return {**info, **versions, "torch_threads": torch.get_num_threads(), "shape": shape_name,
            "shape_detail": dataclasses.asdict(SHAPES[shape_name]), "options": OPTIONS, "rounds": rounds,
            "warmup_steps": WARMUP_STEPS, "quick": quick, "dtype": "fp32 weights" + (", bf16 autocast" if torch.cuda.is_available() else "")}


def run_child(sides: list[str], shape: str, timeout_s: float, threads: Optional[int]) -> list[dict]:
    """``sides`` run one after the other in one fresh process; one result per side, in order."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [SIDES[sides[0]].python(), "-m", "benchmarks.trainer_step", "child", shape, *sides]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
        stdout, error = done.stdout, f"exit {done.returncode}: " + "\n".join((done.stderr or done.stdout).strip().splitlines()[-6:])
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        error = f"timed out after {timeout_s:.0f} s"
    wall = time.perf_counter() - start
    results = {}
    for line in stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            r = json.loads(line[len(RESULT_PREFIX):])
            results[r.pop("side")] = {**r, "process_wall_s": wall, "process_sides": len(sides)}
    return [results.get(side, {"error": error}) for side in sides]


def median(values: list) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarise(records: list[dict], baseline: str = "ours") -> list[dict]:
    """Per side: medians over rounds, and the median per-round ratio of step time and step peak RSS
    to ``baseline``'s in the same round."""
    ok = [r for r in records if "error" not in r]
    by_round = {(r["round"], r["side"]): r for r in ok}
    rows = []
    for side in dict.fromkeys(r["side"] for r in records):
        mine = [r for r in ok if r["side"] == side]
        if not mine:
            rows.append({"side": side, "error": next(r["error"] for r in records if r["side"] == side)})
            continue
        row = {"side": side, "rounds": len(mine)}
        for key in ("step_s", "step_peak_rss_mib", "rss_start_mib", "process_peak_rss_mib", "cuda_peak_allocated_mib",
                    "completion_tokens"):
            row[key] = median([r.get(key) for r in mine])
        row["phases"] = {p: median([r["phases"][p] for r in mine]) for p in mine[0]["phases"]}
        for key, name in (("step_s", "time_ratio"), ("step_peak_rss_mib", "rss_ratio"),
                          ("cuda_peak_allocated_mib", "cuda_ratio")):
            ratios = [r[key] / by_round[(r["round"], baseline)][key] for r in mine
                      if (r["round"], baseline) in by_round and r.get(key) and by_round[(r["round"], baseline)].get(key)]
            row[name] = median(ratios)
        rows.append(row)
    return rows


def markdown(shape_name: str, rows: list[dict], cond: dict, skipped: dict[str, str]) -> str:
    shape = SHAPES[shape_name]
    cuda = any(r.get("cuda_peak_allocated_mib") for r in rows)
    lines = [
        f"### `{shape_name}`: {shape.describe()}",
        "",
        f"{cond['date']}; {cond.get('gpu_name') or cond.get('cpu_model', '?')}, {cond.get('cpu_count', '?')} CPUs "
        f"(torch threads {cond['side_threads'] or cond['torch_threads']}); torch {cond.get('torch')}, transformers {cond.get('transformers')}, "
        f"trl {cond.get('trl')}; {cond['dtype']}; {cond['rounds']} interleaved round(s), "
        + ("each side in a fresh process, " if cond["process_per_side"] else "all sides in one process, ")
        + f"{WARMUP_STEPS} warm-up step then the measured one; medians; ratios are per-round ratios to `ours`, medianed.",
        "",
    ]
    head = "| side | step | × ours | step peak RSS | × ours |" + (" CUDA peak | × ours |" if cuda else "")
    head += " generation | scoring | old/ref log-probs | loss+backward | optimizer | other | completion tokens |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['side']} | failed: {r['error'].splitlines()[-1][:120]} |")
            continue
        fmt_x = lambda v: "" if v is None else f"{v:.2f}×"  # noqa: E731
        cells = [r["side"], f"{r['step_s']:.2f} s", fmt_x(r["time_ratio"]),
                 f"{r['step_peak_rss_mib']:,.0f} MiB" if r["step_peak_rss_mib"] else "?", fmt_x(r["rss_ratio"])]
        if cuda:
            cells += [f"{r['cuda_peak_allocated_mib']:,.0f} MiB" if r.get("cuda_peak_allocated_mib") else "?", fmt_x(r["cuda_ratio"])]
        for p in ("generation", "scoring", "logps", "loss+backward", "optimizer", "other"):
            v = r["phases"].get(p)
            cells.append("" if v is None else f"{v:.2f} s ({100 * v / r['step_s']:.0f}%)")
        cells.append(f"{r['completion_tokens']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    for side, reason in skipped.items():
        lines.append(f"| {side} | skipped: {reason} |")
    lines += ["", "Sides: " + "; ".join(f"`{s.name}`: {s.description}" for s in SIDES.values()) + "."]
    return "\n".join(lines)


def render_jsonl(path: str) -> int:
    """The tables of the records in ``path`` (every shape in it), written to the ``.md`` beside it."""
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    sections = []
    for shape in dict.fromkeys(r["shape"] for r in records):
        mine = [r for r in records if r["shape"] == shape]
        cond = {**mine[-1]["conditions"], "rounds": len({r["round"] for r in mine})}
        sections.append(markdown(shape, summarise(mine), cond, {}))
    text = TITLE + "\n\n".join(sections) + "\n"
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write(text)
    print(text)
    return 0


TITLE = "## One GRPO step: ours vs TRL (`python -m benchmarks.trainer_step`)\n\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["child"]:
        return child(*argv[1:])
    parser.add_argument("--quick", action="store_true",
                        help="shape tiny, 1 round, --one-process, 1 thread (CI's smoke run; under a minute)")
    parser.add_argument("--one-process", action="store_true",
                        help="all sides of a round in one process (saves the start-ups; CUDA peaks stay per step, "
                             "the RSS of a later side includes what the earlier ones left)")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=None)
    parser.add_argument("--sides", nargs="+", choices=list(SIDES), default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds per process (default 120 with --quick, else 900); a process past it loses the "
                             "sides it had not finished (reported as failed), the tables are still written")
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP_NUM_THREADS of the side processes (default: torch's own; 1 with --quick)")
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--list", action="store_true", help="print the shapes and sides and exit")
    parser.add_argument("--report", metavar="JSONL", help="only render the tables of an earlier run's JSONL "
                        "(e.g. one stopped early: its finished rounds) into the .md beside it")
    args = parser.parse_args(argv)
    if args.report:
        return render_jsonl(args.report)
    import torch

    cuda = torch.cuda.is_available()
    shapes = args.shapes or (["tiny"] if args.quick else ["qwen2.5-0.5b"] if cuda else ["tiny", "qwen-vocab"])
    rounds = args.rounds or (1 if args.quick else 3)
    if rounds < 1:
        parser.error("--rounds must be >= 1")
    timeout = args.timeout or (120.0 if args.quick else 900.0)
    threads = args.threads or (1 if args.quick else None)
    skipped = {s.name: reason for s in SIDES.values() if (reason := s.unavailable())}
    sides = [s for s in (args.sides or list(SIDES)) if s not in skipped]
    if args.list:
        for name, shape in SHAPES.items():
            print(f"shape {name}: {shape.describe()}")
        for s in SIDES.values():
            print(f"side {s.name}: {s.description}" + (f" -- skipped here: {skipped[s.name]}" if s.name in skipped else ""))
        return 0
    for side, reason in skipped.items():
        print(f"[trainer_step] side {side} skipped: {reason}", flush=True)
    if not sides:
        print("[trainer_step] no side can run here", flush=True)
        return 0
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, f"trainer_step-{'cuda' if cuda else 'cpu'}-{datetime.now(timezone.utc):%Y%m%d}"
                        + ("-quick" if args.quick else ""))
    failed = False
    sections = []
    with open(stem + ".jsonl", "a") as jsonl:
        for shape in shapes:
            one_process = args.quick or args.one_process
            cond = {**conditions(shape, rounds, args.quick), "side_threads": threads, "process_per_side": not one_process}
            records = []
            for rnd in range(rounds):
                order = sides[rnd % len(sides):] + sides[: rnd % len(sides)]  # rotate: interleaved, no fixed position
                # a fresh process per side; --quick / --one-process: all of them in one
                # (a side in another interpreter, the vLLM venv's, always gets a process of its own)
                own = [s for s in order if SIDES[s].python() != sys.executable]
                shared = [s for s in order if s not in own]
                batches = [[s] for s in order] if not one_process else [shared] * bool(shared) + [[s] for s in own]
                for batch in batches:
                    for side, result in zip(batch, run_child(batch, shape, timeout, threads)):
                        record = {"shape": shape, "side": side, "round": rnd, **result}
                        records.append(record)
                        jsonl.write(json.dumps({**record, "conditions": cond}) + "\n")
                        jsonl.flush()
                        if "error" in result:
                            failed = True
                            print(f"[trainer_step] {shape} round {rnd} {side}: FAILED {result['error']}", flush=True)
                        else:
                            print(f"[trainer_step] {shape} round {rnd} {side}: step {result['step_s']:.2f} s, step peak RSS "
                                  f"{result['step_peak_rss_mib']:,.0f} MiB, {result['completion_tokens']} completion tokens",
                                  flush=True)
            sections.append(markdown(shape, summarise(records), cond, skipped))
    text = TITLE + "\n\n".join(sections) + "\n"
    with open(stem + ".md", "w") as f:
        f.write(text)
    print(text)
    print(f"[trainer_step] wrote {stem}.md and {stem}.jsonl", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
