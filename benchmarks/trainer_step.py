"""One full GRPO step, end to end: our trainer against TRL's ``GRPOTrainer``, side by side.

    python -m benchmarks.trainer_step                  # CPU: shapes tiny and qwen-vocab, 3 rounds, every side
    python -m benchmarks.trainer_step --quick          # CI: shape tiny, 1 round, < 1 minute
    python -m benchmarks.trainer_step --shapes qwen-vocab --sides ours trl trl+patch --rounds 2 --threads 1
    python -m benchmarks.trainer_step --list           # the shapes and sides, and why a side cannot run here

A step is everything between two batches of prompts: rollout, rewards, advantages, reference log-probs
(beta > 0), the loss forward and backward, clipping and the AdamW step. Every side gets the same
Qwen2-shaped model (seeded, fp32; bf16 autocast on CUDA), tokenizer, prompts, reward and options
(:data:`OPTIONS`); completions are forced to ``max_new_tokens`` tokens. One warm-up step, then the measured one.

Sides (:data:`SIDES`): ``ours`` (``grpo.trainer``, fused loss), ``ours-reference`` (the plain-PyTorch
loss), ``trl`` (``GRPOTrainer`` as shipped), ``trl+patch`` (after ``grpo_kernels.integrations.trl.patch()``),
``ours+vllm`` (ours with ``VLLMRollout``; run by the vLLM venv's interpreter when this one has no vLLM:
``GRPO_VLLM_PYTHON``, or ``.venv-vllm`` next to this venv).

Each (side, round) runs in a fresh process (``harness.fresh``); rounds interleave the sides (the order
rotates); the tables give medians and the median per-round ratio to ``ours``, with the load average.
Phases: generation, scoring, old/ref log-probs, loss+backward, optimizer (torch's optimizer hooks),
other. Memory: the step's peak RSS (``harness.RSS``) and on CUDA ``max_memory_allocated``.
Results: ``benchmarks/results/trainer_step-<device>-<date>[-quick].md`` (+ ``.json``, and ``.jsonl``
written as the records come: ``--report JSONL`` renders a stopped run). Exit 1 when a side that can
run here failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable, Optional

from benchmarks import harness as H

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

# The options every side runs with, in TRL's names. beta > 0: the reference log-probs are part of the step;
# epsilon: ours eps_low = eps_high; top_k off on both; a constant learning rate; scale_rewards "group": ours
# advantage_std="unbiased"; num_iterations 1: on-policy, no old log-probs pass on either side.
OPTIONS = dict(beta=0.04, loss_type="dapo", epsilon=0.2, temperature=1.0, top_p=1.0, learning_rate=1e-6, adam_beta1=0.9,
               adam_beta2=0.99, weight_decay=0.0, max_grad_norm=1.0, scale_rewards="group", num_iterations=1, seed=0)

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
    model.generation_config.update(min_new_tokens=shape.max_new_tokens, eos_token_id=1, pad_token_id=0)
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
class StepMeter:
    """Wall time and peak memory of the measured step, and the optimizer's time inside it (torch's
    global optimizer hooks fire for ours and for the one inside TRL's accelerate wrapper)."""

    def __init__(self, device) -> None:
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.torch, self.device, self.rss = torch, device, H.RSS()
        self.optimizer_s, self._opt_start = 0.0, None
        register_optimizer_step_pre_hook(lambda *_: setattr(self, "_opt_start", self.now()))
        register_optimizer_step_post_hook(lambda *_: setattr(self, "optimizer_s", self.optimizer_s + self.now() - self._opt_start))

    def now(self) -> float:
        H.sync(self.device)
        return time.perf_counter()

    def begin(self) -> None:
        self.optimizer_s = 0.0
        self.rss.start()
        if self.device.type == "cuda":
            self.torch.cuda.reset_peak_memory_stats(self.device)
        self.start = self.now()

    def end(self) -> dict:
        out = {"step_s": self.now() - self.start, "optimizer_s": self.optimizer_s, **self.rss.stop()}
        if self.device.type == "cuda":
            out["cuda_peak_allocated_mib"] = self.torch.cuda.max_memory_allocated(self.device) / 2**20
        return out


def phases_with_other(step_s: float, phases: dict) -> dict:
    """``phases`` plus ``other``: the part of the step no phase accounts for."""
    return {**phases, "other": max(0.0, step_s - sum(phases.values()))}


# --------------------------------------------------------------------------------------------------
# the sides
# --------------------------------------------------------------------------------------------------
SIDES = H.Sides()


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
    return H.missing("trl", "datasets")


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

    def timed(method: str, phase: Callable[[], Optional[str]]):
        """An override of ``method`` that adds its time to ``phase()`` (None: not timed) around ``super()``."""
        def override(self, *args, **kwargs):
            name, start = phase(), meter.now()
            try:
                return getattr(super(TimedGRPOTrainer, self), method)(*args, **kwargs)
            finally:
                if name:
                    phase_s[name] = phase_s.get(name, 0.0) + meter.now() - start
        return override

    class TimedGRPOTrainer(trl.GRPOTrainer):
        pass

    # the no-grad log-prob calls are the old / reference log-probs; the loss's own forward is in loss+backward
    for method, phase in (("_generate", "generation"), ("_calculate_rewards", "scoring"), ("_prepare_inputs", "prepare_inputs"),
                          ("training_step", "training_step"), ("_get_per_token_logps_and_entropies", None)):
        setattr(TimedGRPOTrainer, method, timed(method, (lambda p=phase: p) if phase else
                                                (lambda: None if torch.is_grad_enabled() else "logps")))

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


def _vllm_rollout(model, tokenizer, cfg, out_dir):
    """A ``VLLMRollout`` on the policy saved to ``out_dir`` (the engine loads weights from a path)."""
    from grpo.rollout import VLLMRollout

    path = os.path.join(out_dir, "policy")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    dtype = "bfloat16" if next(model.parameters()).is_cuda and cfg.bf16 else "float32"  # as the trainer's autocast
    return VLLMRollout(path, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                       dtype=dtype, seed=cfg.seed, eos_token_id=1)


def vllm_python() -> Optional[str]:
    return H.venv_python(".venv-vllm", "GRPO_VLLM_PYTHON", "vllm")


def _vllm_unavailable() -> Optional[str]:
    if vllm_python() is None:
        return f"vllm is not installed here, and no vLLM venv found (GRPO_VLLM_PYTHON, or .venv-vllm next to {sys.prefix})"
    return None


SIDES.register("ours", "grpo.trainer, fused loss (backend auto)")(run_ours)
SIDES.register("ours-reference", "grpo.trainer, plain-PyTorch reference loss (backend reference)")(
    lambda shape, device: run_ours(shape, device, backend="reference"))
SIDES.register("trl", "trl.GRPOTrainer, stock", _trl_unavailable)(run_trl)
SIDES.register("trl+patch", "trl.GRPOTrainer after grpo_kernels.integrations.trl.patch()", _patch_unavailable)(
    lambda shape, device: run_trl(shape, device, patched=True))
SIDES.register("ours+vllm", "grpo.trainer, fused loss, VLLMRollout for generation (the vLLM venv's interpreter)",
               _vllm_unavailable, vllm_python)(lambda shape, device: run_ours(shape, device, rollout_factory=_vllm_rollout))


def child(shape_name: str, *side_names: str) -> int:
    """Each side's warm-up and measured step in this process, one after the other; a result line each (a
    side that raises gets an ``error`` line and the next one still runs)."""
    import gc
    import traceback

    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for name in side_names:
        gc.collect()  # (several sides in one process: the previous one's model and trainer go first)
        try:
            result = SIDES[name].make(SHAPES[shape_name], device)
        except Exception as exc:
            traceback.print_exc()
            result = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        H.emit({"side": name, "python": sys.executable, "transformers": H.version("transformers"),
                "load_1m": round(os.getloadavg()[0], 2), **result})
    return 0


# --------------------------------------------------------------------------------------------------
# the driver: fresh processes, interleaved rounds, tables
# --------------------------------------------------------------------------------------------------
def run_child(sides: list[str], shape: str, timeout_s: float, threads: Optional[int]) -> list[dict]:
    """``sides`` one after the other in one fresh process (their interpreter's); one result per side."""
    results = H.fresh(["benchmarks.trainer_step", "child", shape, *sides], python=SIDES[sides[0]].python(),
                      timeout_s=timeout_s, threads=threads)
    error = next((r for r in results if "side" not in r), {"error": "no result"})
    by_side = {r["side"]: r for r in results if "side" in r}
    return [{k: v for k, v in by_side.get(side, error).items() if k != "side"} for side in sides]


def summarise(records: list[dict], baseline: str = "ours") -> list[dict]:
    """Per side: medians over rounds, and the median per-round ratio of step time and step peak RSS
    to ``baseline``'s in the same round."""
    ok = [r for r in records if "error" not in r]
    rows = []
    for side in dict.fromkeys(r["side"] for r in records):
        mine = [r for r in ok if r["side"] == side]
        if not mine:
            rows.append({"side": side, "error": next(r["error"] for r in records if r["side"] == side)})
            continue
        row = {"side": side, "rounds": len(mine), "phases": {p: H.median([r["phases"][p] for r in mine]) for p in mine[0]["phases"]}}
        for key in ("step_s", "peak_rss_mib", "cuda_peak_allocated_mib", "completion_tokens", "load_1m"):
            row[key] = H.median([r.get(key) for r in mine])
        for key, name in (("step_s", "time_ratio"), ("peak_rss_mib", "rss_ratio"), ("cuda_peak_allocated_mib", "cuda_ratio")):
            per_round = {side: [], baseline: []}
            for rnd in sorted({r["round"] for r in mine}):
                pair = {r["side"]: r.get(key) for r in ok if r["round"] == rnd and r["side"] in (side, baseline)}
                for s in per_round:
                    per_round[s].append(pair.get(s))
            row[name] = H.ratio(per_round, side, baseline)
        rows.append(row)
    return rows


PHASES = ("generation", "scoring", "logps", "loss+backward", "optimizer", "other")


def markdown(shape_name: str, rows: list[dict], cond: dict, skipped: dict[str, str]) -> list[str]:
    cuda = any(r.get("cuda_peak_allocated_mib") for r in rows)
    x = lambda v: "" if v is None else f"{v:.2f}×"  # noqa: E731
    cells = []
    for r in rows:
        if "error" in r:
            cells.append([r["side"], f"failed: {r['error'].splitlines()[-1][:120]}"])
            continue
        cells.append([r["side"], f"{r['step_s']:.2f} s", x(r["time_ratio"]), f"{r['peak_rss_mib']:,.0f} MiB", x(r["rss_ratio"])]
                     + ([f"{r['cuda_peak_allocated_mib'] or 0:,.0f} MiB", x(r["cuda_ratio"])] if cuda else [])
                     + ["" if r["phases"].get(p) is None else f"{r['phases'][p]:.2f} s ({100 * r['phases'][p] / r['step_s']:.0f}%)"
                        for p in PHASES] + [f"{r['completion_tokens']:.0f}", f"{r['load_1m']:.2f}"])
    cells += [[side, f"skipped: {reason}"] for side, reason in skipped.items()]
    return [f"## `{shape_name}`: {SHAPES[shape_name].describe()}", "",
            f"{cond['rounds']} interleaved round(s), " + ("each side in a fresh process" if cond["process_per_side"] else
                                                           "the sides of a round in one process")
            + f", torch threads {cond.get('side_threads') or 'default'}, {cond['dtype']}; {WARMUP_STEPS} warm-up step then "
            "the measured one; medians; ratios are per-round ratios to `ours`, medianed.", "",
            *H.table(["side", "step", "× ours", "step peak RSS", "× ours"] + (["CUDA peak", "× ours"] if cuda else [])
                     + ["generation", "scoring", "old/ref log-probs", "loss+backward", "optimizer", "other", "completion tokens",
                        "load (1 min)"], cells), ""]


def report(records: list[dict], cond: dict, skipped: dict[str, str], out: Optional[str]) -> H.Report:
    rep = H.Report("One GRPO step: ours vs TRL (`python -m benchmarks.trainer_step`)", cond)
    for shape in dict.fromkeys(r["shape"] for r in records):
        mine = [r for r in records if r["shape"] == shape]
        rep.add(*markdown(shape, summarise(mine), {**cond, "rounds": len({r["round"] for r in mine})}, skipped))
    rep.add("Sides: " + "; ".join(f"`{s.name}`: {s.description}" for s in SIDES.values()) + ".")
    rep.records = records
    rep.write(out)
    return rep


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["child"]:
        return child(*argv[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="shape tiny, 1 round, --one-process, 1 thread, this interpreter's "
                   "sides unless --sides names others (CI's smoke run)")
    p.add_argument("--one-process", action="store_true",
                   help="the sides of a round in one process (a side in another interpreter still gets its own)")
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=None)
    p.add_argument("--sides", nargs="+", choices=list(SIDES), default=None)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--timeout", type=float, default=None, help="seconds per process (default 120 with --quick, else 900)")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the side processes (1 with --quick)")
    p.add_argument("--out-dir", default="benchmarks/results")
    p.add_argument("--list", action="store_true", help="print the shapes and sides and exit")
    p.add_argument("--report", metavar="JSONL", help="only render the tables of an earlier run's JSONL into the .md beside it")
    args = p.parse_args(argv)
    if args.report:
        with open(args.report) as f:
            records = [json.loads(line) for line in f if line.strip()]
        report(records, records[-1]["conditions"], {}, os.path.splitext(args.report)[0] + ".md")
        return 0
    import torch

    cuda = torch.cuda.is_available()
    shapes = args.shapes or (["tiny"] if args.quick else ["qwen2.5-0.5b"] if cuda else ["tiny", "qwen-vocab"])
    rounds, threads = args.rounds or (1 if args.quick else 3), args.threads or (1 if args.quick else None)
    if rounds < 1:
        p.error("--rounds must be >= 1")
    sides, skipped = SIDES.select(args.sides)
    if args.quick and not args.sides:  # CI's smoke run: this interpreter's sides (the vLLM venv's start-up is CI's slowest)
        skipped.update({s: "not in --quick unless named in --sides" for s in sides if SIDES[s].python() != sys.executable})
        sides = [s for s in sides if s not in skipped]
    if args.list:
        for name, shape in SHAPES.items():
            print(f"shape {name}: {shape.describe()}")
        for s in SIDES.values():
            print(f"side {s.name}: {s.description}" + (f" -- skipped here: {skipped[s.name]}" if s.name in skipped else ""))
        return 0
    for side, reason in skipped.items():
        print(f"[trainer_step] side {side} skipped: {reason}", flush=True)
    if not sides:
        return 0
    one_process = args.quick or args.one_process
    cond = H.conditions(shapes={s: dataclasses.asdict(SHAPES[s]) for s in shapes}, options=OPTIONS, rounds=rounds, side_threads=threads,
                        warmup_steps=WARMUP_STEPS, process_per_side=not one_process,
                        dtype="fp32 weights" + (", bf16 autocast" if cuda else ""))
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, f"trainer_step-{'cuda' if cuda else 'cpu'}-{datetime.now(timezone.utc):%Y%m%d}"
                        + ("-quick" if args.quick else ""))
    records = []
    with open(stem + ".jsonl", "a") as jsonl:
        for shape in shapes:
            for rnd in range(rounds):
                order = sides[rnd % len(sides):] + sides[: rnd % len(sides)]  # rotate: interleaved, no fixed position
                own = [s for s in order if SIDES[s].python() != sys.executable]  # another interpreter: its own process
                shared = [s for s in order if s not in own]
                batches = [[s] for s in order] if not one_process else [shared] * bool(shared) + [[s] for s in own]
                for batch in batches:
                    for side, result in zip(batch, run_child(batch, shape, args.timeout or (120.0 if args.quick else 900.0), threads)):
                        records.append({"shape": shape, "side": side, "round": rnd, **result})
                        jsonl.write(json.dumps({**records[-1], "conditions": cond}) + "\n")
                        jsonl.flush()
                        print(f"[trainer_step] {shape} round {rnd} {side}: " + (f"FAILED {result['error']}" if "error" in result else
                              f"step {result['step_s']:.2f} s, step peak RSS {result['peak_rss_mib']:,.0f} MiB, "
                              f"{result['completion_tokens']} completion tokens, load {result.get('load_1m')}"), flush=True)
    report(records, cond, skipped, stem + ".md")
    print(f"[trainer_step] wrote {stem}.md, .json and .jsonl", flush=True)
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
