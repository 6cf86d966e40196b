"""One full GRPO step, end to end: our trainer against TRL's ``GRPOTrainer``, side by side (benchmarks/README.md)."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import sys
import tempfile
import traceback
import warnings
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Optional

import torch

from benchmarks import harness as H

WARMUP_STEPS = 1
PHASES = ("generation", "scoring", "logps", "loss+backward", "optimizer", "other")


@dataclass(frozen=True)
class Shape:
    """The step's batch on ``model`` (``harness.MODELS``): P prompts x G completions of T tokens after the prompt."""

    model: str
    prompts_per_step: int  # P
    num_generations: int  # G
    max_new_tokens: int  # T
    prompt_tokens: int

    @property
    def vocab_size(self) -> int:
        return H.MODELS[self.model]["vocab_size"]

    def describe(self) -> str:
        return (f"{H.describe_model(self.model)}; P={self.prompts_per_step} prompts x G={self.num_generations}, prompt "
                f"{self.prompt_tokens} + completion {self.max_new_tokens} tokens")


SHAPES = {
    "tiny": Shape("tiny", prompts_per_step=2, num_generations=4, max_new_tokens=16, prompt_tokens=12),  # CI's
    # the real Qwen2/2.5 vocabulary on a small body (benchmarks/long_context.py's 81M): the head dominates
    "qwen-vocab": Shape("81M", prompts_per_step=2, num_generations=4, max_new_tokens=32, prompt_tokens=32),
    # Qwen2.5-0.5B's shape, random weights: the GPU set's
    "qwen2.5-0.5b": Shape("qwen2.5-0.5b", prompts_per_step=4, num_generations=8, max_new_tokens=128, prompt_tokens=64),
}
# Every side's options, in TRL's names. beta > 0: the reference log-probs are part of the step; epsilon: ours
# eps_low = eps_high; top_k off; a constant learning rate; scale_rewards "group": ours advantage_std
# "unbiased"; num_iterations 1: on-policy, no old log-probs pass unless a vLLM rollout is corrected for.
OPTIONS = dict(beta=0.04, loss_type="dapo", epsilon=0.2, temperature=1.0, top_p=1.0, learning_rate=1e-6, adam_beta1=0.9,
               adam_beta2=0.99, weight_decay=0.0, max_grad_norm=1.0, scale_rewards="group", num_iterations=1, seed=0)
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 +-=?."


def build_model(shape: Shape):
    """The policy: seeded random weights, fp32, EOS 1, pad 0; no completion stops early."""
    model = H.qwen2(H.MODELS[shape.model] | dict(
        pad_token_id=0, eos_token_id=1, bos_token_id=None), shape.prompt_tokens + shape.max_new_tokens, seed=OPTIONS["seed"])
    model.generation_config.update(min_new_tokens=shape.max_new_tokens, eos_token_id=1, pad_token_id=0)
    return model


def build_tokenizer(vocab_size: int):
    """A character tokenizer of exactly ``vocab_size`` ids (``<pad>`` 0, ``<eos>`` 1, ``<unk>`` 2, then characters)."""
    from grpo.tokenizer import char_tokenizer

    more = (chr(c) for c in range(0x4E00, 0x30000) if not 0xD800 <= c < 0xE000)
    return char_tokenizer(CHARS + "".join(next(more) for _ in range(vocab_size - 3 - len(CHARS))))


def prompts(shape: Shape, count: int = 32) -> list[str]:
    """``count`` prompts of exactly ``prompt_tokens`` characters (= tokens): no prompt padding anywhere."""
    rng = random.Random(OPTIONS["seed"])
    return ["".join(rng.choice(CHARS) for _ in range(shape.prompt_tokens)) for _ in range(count)]


def checksum_reward(prompts, completions, **kwargs) -> list[float]:
    """A cheap reward that varies between completions (so advantages are not all 0): a checksum of the text."""
    return [float(sum(map(ord, c)) % 101) / 100 for c in completions]


class Meter:
    """The measured step: wall and thread CPU seconds per phase (``harness.Phases``), peak RSS, CUDA peak."""

    def __init__(self, device) -> None:
        self.device, self.phases, self.rss = device, H.Phases(device), H.RSS()
        self.phases.patch_optimizer()

    def begin(self) -> None:
        self.phases.clear()
        self.rss.start()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.phases.start("step")

    def end(self, outer: str, inner: str) -> dict:
        """The step's record; loss+backward is the phase ``outer`` less ``inner``."""
        self.phases.stop("step")
        out = self.rss.stop()
        if self.device.type == "cuda":
            out["cuda_peak_allocated_mib"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        for suffix, clock in (("", self.phases.wall), ("_cpu", self.phases.cpu)):
            phases = {p: clock.get(p, 0.0) for p in ("generation", "scoring", "logps", "optimizer")}
            phases["loss+backward"] = clock.get(outer, 0.0) - clock.get(inner, 0.0)
            out[f"step{suffix}_s"], out[f"phases{suffix}"] = clock["step"], phases_with_other(clock["step"], phases)
        return out


def phases_with_other(step_s: float, phases: dict) -> dict:
    """``phases`` in :data:`PHASES`' order, with ``other``: the part of the step no phase accounts for."""
    return {p: phases[p] for p in PHASES[:-1]} | {"other": max(0.0, step_s - sum(phases.values()))}


# -- the sides -------------------------------------------------------------------------------------------
SIDES = H.Sides()


def run_ours(shape: Shape, device, backend: str = "auto", **config) -> dict:
    """Our trainer's step: ``grpo.trainer.train_step`` after ``grpo.train``'s set-up (README); ``config``: more fields."""
    from grpo import trainer as tr
    from grpo.config import GRPOConfig

    model, tokenizer, rows, meter = build_model(shape), build_tokenizer(shape.vocab_size), [{"prompt": p} for p in prompts(shape)], Meter(device)
    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(
            output_dir=out, num_steps=WARMUP_STEPS + 1, prompts_per_step=shape.prompts_per_step, num_generations=shape.num_generations,
            max_new_tokens=shape.max_new_tokens, advantage_std="unbiased", eps_low=OPTIONS["epsilon"], backend=backend,
            progress=False, plot=False, **{k: OPTIONS[k] for k in ("seed", "temperature", "top_p", "scale_rewards", "beta", "loss_type",
                                                                   "num_iterations", "learning_rate", "weight_decay", "adam_beta1",
                                                                   "adam_beta2", "max_grad_norm")}, **config)
        tr.set_seed(cfg.seed)
        model, policy, ref_policy, optimizer = tr.setup_training(model, cfg, device)
        rollout = tr.default_rollout(model, tokenizer, cfg)
        for fn, phase in (("sample", "generation"), ("score_rollout", "scoring"), ("add_denominators", "logps"), ("update", "update")):
            meter.phases.patch(tr, fn, phase)
        try:
            for step in range(WARMUP_STEPS + 1):
                meter.begin()
                record = tr.train_step(step, policy, ref_policy, rollout, optimizer, rows, tr.as_named([checksum_reward]), cfg, device)
                measured = meter.end("update", "optimizer")
        finally:
            meter.phases.restore()
    return {**measured, "weights": str(next(model.parameters()).dtype).replace("torch.", ""),
            "completion_tokens": round(record["completion_length/mean"] * shape.prompts_per_step * shape.num_generations),
            "loss": record.get("loss"), "reward": record.get("reward"), "kl": record.get("kl")}


def _patch_unavailable() -> Optional[str]:
    reason = H.missing("trl", "datasets")
    try:
        import grpo_kernels.integrations.trl  # noqa: F401  (raises for a TRL it does not support)
    except Exception as exc:
        reason = reason or f"grpo_kernels.integrations.trl does not import: {type(exc).__name__}: {exc}"
    return reason


def run_trl(shape: Shape, device, patched: bool = False) -> dict:
    """TRL's ``GRPOTrainer.train()``: a warm-up and the measured step, its phases timed around TRL's methods (README)."""
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback

    from grpo_kernels.integrations import trl as gk_trl

    meter, measured = Meter(device), {}

    class TimedGRPOTrainer(trl.GRPOTrainer):
        pass

    # the no-grad log-prob calls are the old / reference log-probs; the loss's own forward is in loss+backward
    for method, phase in (("_generate", "generation"), ("_calculate_rewards", "scoring"), ("_prepare_inputs", "prepare_inputs"),
                          ("training_step", "training_step"),
                          ("_get_per_token_logps_and_entropies", lambda: None if torch.is_grad_enabled() else "logps")):
        meter.phases.patch(TimedGRPOTrainer, method, phase)

    class MeasureStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == WARMUP_STEPS:
                meter.begin()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == WARMUP_STEPS + 1:
                measured.update(meter.end("training_step", "prepare_inputs"))  # (advantages, bookkeeping: "other")

    P, G, T = shape.prompts_per_step, shape.num_generations, shape.max_new_tokens
    model, tokenizer = build_model(shape), build_tokenizer(shape.vocab_size)
    if patched:
        gk_trl.patch()
    try:
        with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model_dir = os.path.join(out, "policy")  # TRL loads its reference model from the policy's path: the same weights
            model.save_pretrained(model_dir)
            del model
            args = trl.GRPOConfig(
                output_dir=out, per_device_train_batch_size=P * G, gradient_accumulation_steps=1, num_generations=G,
                max_completion_length=T, max_steps=WARMUP_STEPS + 1, lr_scheduler_type="constant", top_k=0,
                generation_kwargs={"min_new_tokens": T}, report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
                use_cpu=device.type != "cuda", bf16=device.type == "cuda", dataloader_num_workers=0, **OPTIONS)
            trainer = TimedGRPOTrainer(model=model_dir, reward_funcs=checksum_reward, args=args, processing_class=tokenizer,
                                       train_dataset=Dataset.from_dict({"prompt": prompts(shape)}), callbacks=[MeasureStep()])
            trainer.train()
    finally:
        meter.phases.restore()
        if patched:
            gk_trl.unpatch()  # (--quick runs the next side in this process)
    forward = getattr(trainer.model, "_original_forward", trainer.model.forward)
    head = "grpo_kernels" if getattr(forward, "__grpo_kernels__", False) else "trl"
    if head != ("grpo_kernels" if patched else "trl"):
        raise RuntimeError(f"the policy's log-prob head is {head}'s, expected the other ({patched=})")
    logged = next((e for e in trainer.state.log_history if e.get("step") == WARMUP_STEPS + 1 and "loss" in e), {})
    return {**measured, "log_prob_head": head, "weights": str(next(trainer.model.parameters()).dtype).replace("torch.", ""),
            "completion_tokens": round(logged.get("completions/mean_length", float("nan")) * P * G),
            "loss": logged.get("loss"), "reward": logged.get("reward"), "kl": logged.get("kl")}


def vllm_python() -> Optional[str]:
    return H.venv_python(".venv-vllm", "GRPO_VLLM_PYTHON", "vllm")


def _vllm_unavailable() -> Optional[str]:
    return None if vllm_python() else f"vllm is not installed here, and no vLLM venv found (GRPO_VLLM_PYTHON, or .venv-vllm next to {sys.prefix})"


SIDES.register("ours", "grpo.trainer, fused loss (backend auto)")(run_ours)
SIDES.register("ours-reference", "grpo.trainer, plain-PyTorch reference loss (backend reference)")(
    lambda shape, device: run_ours(shape, device, backend="reference"))
SIDES.register("trl", "trl.GRPOTrainer, stock", unavailable=lambda: H.missing("trl", "datasets"))(run_trl)
SIDES.register("trl+patch", "trl.GRPOTrainer after grpo_kernels.integrations.trl.patch()", unavailable=_patch_unavailable)(
    lambda shape, device: run_trl(shape, device, patched=True))
SIDES.register("ours+vllm", "grpo.trainer, fused loss, use_vllm (the engine as the trainer builds it, in the vLLM venv's "
               "interpreter) with TRL's default importance-sampling correction", unavailable=_vllm_unavailable, python=vllm_python)(
    lambda shape, device: run_ours(shape, device, use_vllm=True))
SIDES.register("ours+vllm-uncorrected", "the same engine, vllm_importance_sampling_correction off (no old log-probs pass, "
               "a token-local loss): the engine's cost without the correction's", unavailable=_vllm_unavailable, python=vllm_python)(
    lambda shape, device: run_ours(shape, device, use_vllm=True, vllm_importance_sampling_correction=False))


def child(shape: str, sides: list[str]) -> None:
    """Each side's warm-up and measured step in this (fresh) process, a result line each (an error for one that raises)."""
    device = H.device()
    for name in sides:
        gc.collect()  # (several sides in one process: the previous one's model and trainer go first)
        try:
            result = SIDES[name].make(SHAPES[shape], device)
        except Exception as exc:
            traceback.print_exc()
            result = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        H.emit({"side": name, "python": sys.executable, "transformers": H.version("transformers"), "load_1m": H.load(), **result})


# -- the driver: fresh processes, interleaved rounds, tables -------------------------------------------
def run_child(sides: list[str], shape: str, timeout_s: float, threads: Optional[int]) -> list[dict]:
    """``sides`` one after the other in one fresh process (their interpreter's); one result per side."""
    results = H.fresh_call("benchmarks.trainer_step:child", {"shape": shape, "sides": sides}, python=SIDES[sides[0]].python(),
                           timeout_s=timeout_s, threads=threads)
    error = next((r for r in results if "side" not in r), {"error": "no result"})
    by_side = {r["side"]: r for r in results if "side" in r}
    return [{k: v for k, v in by_side.get(side, error).items() if k != "side"} for side in sides]


def summarise(records: list[dict], baseline: str = "ours") -> list[dict]:
    """Per side: medians over rounds, and the median per-round ratios to ``baseline``'s step time, CPU time and RSS."""
    ok = [r for r in records if "error" not in r]
    rows = []
    for side in dict.fromkeys(r["side"] for r in records):
        mine = [r for r in ok if r["side"] == side]
        if not mine:
            rows.append({"side": side, "error": next(r["error"] for r in records if r["side"] == side)})
            continue
        row = {"side": side, "rounds": len(mine)}
        for key in ("phases", "phases_cpu"):
            row[key] = {p: H.median([r.get(key, {}).get(p) for r in mine]) for p in PHASES}
        for key in ("step_s", "step_cpu_s", "peak_rss_mib", "cuda_peak_allocated_mib", "completion_tokens", "load_1m"):
            row[key] = H.median([r.get(key) for r in mine])
            per_round = {s: [next((r.get(key) for r in ok if r["round"] == rnd and r["side"] == s), None)
                             for rnd in sorted({r["round"] for r in mine})] for s in (side, baseline)}
            row[key + "_ratio"] = H.ratio(per_round, side, baseline)
        rows.append(row)
    return rows


def markdown(shape_name: str, rows: list[dict], cond: dict, skipped: dict[str, str]) -> list[str]:
    cuda, columns = any(r.get("cuda_peak_allocated_mib") for r in rows), [{"logps": "old/ref log-probs"}.get(p, p) for p in PHASES]
    x = lambda v: "" if v is None else f"{v:.2f}×"  # noqa: E731
    share = lambda r, key, p: "" if r[key].get(p) is None else f"{r[key][p]:.2f} s ({100 * r[key][p] / r['step' + key[6:] + '_s']:.0f}%)"  # noqa: E731
    wall, cpu = [], []
    for r in rows:
        if "error" in r:
            wall.append([r["side"], f"failed: {r['error'].splitlines()[-1][:120]}"])
            continue
        wall.append([r["side"], f"{r['step_s']:.2f} s", x(r["step_s_ratio"]), f"{r['peak_rss_mib']:,.0f} MiB", x(r["peak_rss_mib_ratio"])]
                    + ([f"{r['cuda_peak_allocated_mib'] or 0:,.0f} MiB", x(r["cuda_peak_allocated_mib_ratio"])] if cuda else [])
                    + [share(r, "phases", p) for p in PHASES] + [f"{r['completion_tokens']:.0f}", f"{r['load_1m']:.2f}"])
        if r.get("step_cpu_s") is not None:
            cpu.append([r["side"], f"{r['step_cpu_s']:.2f} s", x(r["step_cpu_s_ratio"])] + [share(r, "phases_cpu", p) for p in PHASES])
    wall += [[side, f"skipped: {reason}"] for side, reason in skipped.items()]
    return [f"## `{shape_name}`: {SHAPES[shape_name].describe()}", "",
            f"{cond['rounds']} interleaved round(s), " + ("each side in a fresh process" if cond["process_per_side"] else
                                                           "the sides of a round in one process")
            + f", torch threads {cond.get('side_threads') or 'default'}, {cond['dtype']}; {WARMUP_STEPS} warm-up step then "
            "the measured one; medians; ratios are per-round ratios to `ours`, medianed.", "",
            *H.table(["side", "step", "× ours", "step peak RSS", "× ours"] + (["CUDA peak", "× ours"] if cuda else [])
                     + columns + ["completion tokens", "load (1 min)"], wall), "",
            "Thread CPU time of the same steps (the main thread's `time.thread_time`, which a loaded machine does not "
            "stretch; all of torch's work with --threads 1):", "",
            *H.table(["side", "step CPU", "× ours", *columns], cpu), ""]


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
    p = H.flags(argparse.ArgumentParser(description=__doc__.splitlines()[0]), rounds=int, out_dir="benchmarks/results",
                quick=(False, "shape tiny, 1 round, --one-process, 1 thread, this interpreter's sides unless --sides names others"),
                one_process=(False, "the sides of a round in one process (a side in another interpreter still gets its own)"),
                shapes=([], None, sorted(SHAPES)), sides=([], None, list(SIDES)),
                timeout=(float, "seconds per process (default 120 with --quick, else 900)"),
                threads=(int, "OMP_NUM_THREADS of the side processes (1 with --quick)"))
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    shapes = args.shapes or (["tiny"] if args.quick else ["qwen2.5-0.5b"] if cuda else ["tiny", "qwen-vocab"])
    rounds, threads = args.rounds or (1 if args.quick else 3), args.threads or (1 if args.quick else None)
    if rounds < 1:
        p.error("--rounds must be >= 1")
    sides, skipped = SIDES.select(args.sides)
    if args.quick and not args.sides:  # CI's smoke run: this interpreter's sides (the vLLM venv's start-up is CI's slowest)
        skipped.update({s: "not in --quick unless named in --sides" for s in sides if SIDES[s].python() != sys.executable})
        sides = [s for s in sides if s not in skipped]
    for side, reason in skipped.items():
        print(f"[trainer_step] side {side} skipped: {reason}", flush=True)
    if not sides:
        return 0
    one_process = args.quick or args.one_process
    cond = H.conditions(shapes={s: {**dataclasses.asdict(SHAPES[s]), **H.MODELS[SHAPES[s].model]} for s in shapes}, options=OPTIONS, rounds=rounds, side_threads=threads,
                        warmup_steps=WARMUP_STEPS, process_per_side=not one_process,
                        dtype="fp32 weights" + (", bf16 autocast" if cuda else ""))
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, f"trainer_step-{'cuda' if cuda else 'cpu'}-{datetime.now(timezone.utc):%Y%m%d}"
                        + ("-quick" if args.quick else ""))
    records = []
    with open(stem + ".jsonl", "a") as jsonl:
        for shape in shapes:
            for rnd in range(rounds):
                order = H.rotated(sides, rnd)
                own = [s for s in order if SIDES[s].python() != sys.executable]  # another interpreter: its own process
                shared = [s for s in order if s not in own]
                batches = [[s] for s in order] if not one_process else [shared] * bool(shared) + [[s] for s in own]
                for batch in batches:
                    for side, result in zip(batch, run_child(batch, shape, args.timeout or (120.0 if args.quick else 900.0), threads)):
                        records.append({"shape": shape, "side": side, "round": rnd, **result})
                        jsonl.write(json.dumps({**records[-1], "conditions": cond}) + "\n")
                        jsonl.flush()
                        print(f"[trainer_step] {shape} round {rnd} {side}: " + (f"FAILED {result['error']}" if "error" in result else
                              f"step {result['step_s']:.2f} s ({result['step_cpu_s']:.2f} s CPU), step peak RSS "
                              f"{result['peak_rss_mib']:,.0f} MiB, {result['completion_tokens']} completion tokens, load "
                              f"{result.get('load_1m')}"), flush=True)
    report(records, cond, skipped, stem + ".md")
    print(f"[trainer_step] wrote {stem}.md, .json and .jsonl", flush=True)
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
