"""The CPU demo: a tiny random-init model learns single-digit addition with GRPO in about a minute.

The task: prompts ``"a+b="`` (a, b in 0..9), completions ``<think>a+b</think><answer>s</answer>``.

1. Model and tokenizer are built in code: a 2-layer Qwen2 (hidden 64) and a character tokenizer.
2. Warm start (supervised): the model imitates a *sloppy teacher* whose worked solutions are always
   in the right format but misread the ``+``: only 30% restate the problem as ``a+b``; 35% write
   ``a-b`` and 35% ``a*b``, and then answer what they wrote. The model learns the format and the
   three tables, and, like its teacher, mostly answers the wrong question.
3. GRPO with the fused loss on 80 of the 100 problems, rewarded for a correct answer (and the format).
4. Accuracy is measured with greedy decoding on the 20 problems that GRPO never trained on (the warm
   start saw every problem, with its teacher's noise), before and after GRPO.

On several processes (``torchrun --nproc-per-node 2 -m grpo demo --distributed ddp``, or ``fsdp``) rank 0
alone does the warm start and the evaluations, prints and writes; GRPO splits each step's 16 prompts
among the ranks, which start from rank 0's weights (DDP and the FSDP2 wrapper broadcast them).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from transformers.utils import logging as hf_logging

from grpo_kernels.options import IGNORE_INDEX

from . import checkpoint, distributed
from .tokenizer import char_tokenizer
from .rollout import HFGenerate
from .config import GRPOConfig
from .models import as_policy, completion_hidden, lm_head
from .trainer import UpdateBatch, set_seed, train

TAGS = ("<think>", "</think>", "<answer>", "</answer>")
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
FORMAT = re.compile(r"<think>[^<]*</think><answer>[^<]*</answer>", re.S)
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclass
class DemoConfig:
    output_dir: str = "runs/demo"
    seed: int = 0
    held_out: int = 20  # problems never used by GRPO, for the before/after accuracy
    teacher_ops: tuple = (("+", 0.30), ("-", 0.35), ("*", 0.35))  # the warm start's noise
    sft_steps: int = 400
    sft_batch: int = 64
    sft_lr: float = 3e-3
    grpo_steps: int = 120
    backend: str = "auto"  # the fused loss's backend ("auto" = the torch path on CPU)
    progress: bool = True
    distributed: str = "none"  # "ddp" or "fsdp" under torchrun


# ---------------------------------------------------------------------------- task and rewards
def problems() -> list[dict]:
    return [{"prompt": f"{a}+{b}=", "a": a, "b": b, "answer": str(a + b)} for a in range(10) for b in range(10)]


def split(rows: list[dict], held_out: int, seed: int) -> tuple[list[dict], list[dict]]:
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    return [rows[i] for i in order[held_out:]], [rows[i] for i in order[:held_out]]


def teacher_completion(a: int, b: int, rng: random.Random, ops) -> str:
    op = rng.choices([o for o, _ in ops], weights=[w for _, w in ops])[0]
    return f"<think>{a}{op}{b}</think><answer>{OPS[op](a, b)}</answer>"


def accuracy(prompts: list[str], completions: list[str], answer: list[str], **_) -> list[Optional[float]]:
    """1.0 when the last ``<answer>`` holds the right number, 0.0 otherwise (None when it has no answer)."""
    out = []
    for completion, gold in zip(completions, answer):
        found = ANSWER.findall(completion)
        out.append(None if not found else float(found[-1].strip() == gold))
    return out


def format_reward(prompts: list[str], completions: list[str], **_) -> list[float]:
    """1.0 for exactly ``<think>...</think><answer>...</answer>``."""
    return [float(FORMAT.fullmatch(c.strip()) is not None) for c in completions]


# ---------------------------------------------------------------------------- model
def build_model_and_tokenizer(seed: int):
    """A 2-layer Qwen2 with random weights and a character tokenizer; nothing is downloaded."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = char_tokenizer("0123456789+-*=", TAGS)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer


def sft_batch(tokenizer, prompts: list[str], completions: list[str]) -> UpdateBatch:
    """Prompt (left-padded) + completion + EOS (right-padded), loss on the completion and its EOS."""
    p = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    tokenizer.padding_side = "right"
    c = tokenizer([x + tokenizer.eos_token for x in completions], return_tensors="pt", padding=True, add_special_tokens=False)
    tokenizer.padding_side = "left"
    return UpdateBatch(
        input_ids=torch.cat([p.input_ids, c.input_ids], 1),
        attention_mask=torch.cat([p.attention_mask, c.attention_mask], 1),
        prompt_len=p.input_ids.shape[1],
        completion_ids=c.input_ids,
        loss_mask=c.attention_mask,
        advantages=torch.zeros(len(prompts)),
    )


def warm_start(model, tokenizer, rows: list[dict], cfg: DemoConfig) -> list[float]:
    """Supervised fine-tuning on the sloppy teacher's solutions; returns the loss curve."""
    from grpo_kernels import fused_linear_token_logprobs

    rng = random.Random(cfg.seed + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / cfg.sft_steps))
    model.train()
    losses = []
    for _ in range(cfg.sft_steps):
        picked = [rng.choice(rows) for _ in range(cfg.sft_batch)]
        batch = sft_batch(tokenizer, [r["prompt"] for r in picked], [teacher_completion(r["a"], r["b"], rng, cfg.teacher_ops) for r in picked])
        weight, bias = lm_head(model)
        targets = torch.where(batch.loss_mask.bool(), batch.completion_ids, torch.full_like(batch.completion_ids, IGNORE_INDEX))
        logp = fused_linear_token_logprobs(completion_hidden(model, batch), weight, targets, bias=bias, backend=cfg.backend)
        loss = -logp.sum() / batch.loss_mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    return losses


@torch.no_grad()
def evaluate(model, tokenizer, rows: list[dict], samples: int = 0) -> dict[str, float]:
    """Greedy accuracy (and, with ``samples``, mean accuracy of that many samples at temperature 1)."""
    engine, policy = HFGenerate(tokenizer, max_new_tokens=12, temperature=1.0), as_policy(model)
    greedy = engine.generate(policy, [r["prompt"] for r in rows], 1, greedy=True)
    scores = accuracy(None, greedy.completions, [r["answer"] for r in rows])
    result = {"greedy": sum(s or 0.0 for s in scores) / len(rows)}
    result["format"] = sum(format_reward(None, greedy.completions)) / len(rows)
    if samples:
        sampled = engine.generate(policy, [r["prompt"] for r in rows], samples)
        answers = [r["answer"] for r in rows for _ in range(samples)]
        result["sampled"] = sum(s or 0.0 for s in accuracy(None, sampled.completions, answers)) / len(answers)
    return result


# ---------------------------------------------------------------------------- the demo
def grpo_config(cfg: DemoConfig) -> GRPOConfig:
    return GRPOConfig(
        output_dir=cfg.output_dir, seed=cfg.seed, num_steps=cfg.grpo_steps,
        prompts_per_step=16, num_generations=8, max_new_tokens=12, temperature=1.0,
        reward_weights=[1.0, 0.2], loss_type="dapo", beta=0.04, eps_low=0.2, eps_high=0.28,
        num_iterations=1, backend=cfg.backend, learning_rate=3e-4, warmup_steps=5, max_grad_norm=1.0,
        save_every=0, progress=cfg.progress, drop_zero_signal_groups=True, distributed=cfg.distributed,
    )


DEMO_MARKER = ".grpo-demo"  # in an output directory the demo wrote: its own, to replace on the next run


def claim_output_dir(output_dir: str) -> None:
    """The demo owns its output directory: a previous demo run there is replaced, and it says so
    (``make demo`` twice just works); a directory holding another run's checkpoint is refused."""
    marker = os.path.join(output_dir, DEMO_MARKER)
    previous = os.path.exists(checkpoint.path_in(output_dir)) or os.path.exists(os.path.join(output_dir, "log.jsonl"))
    ours = os.path.exists(marker) or os.path.abspath(output_dir) == os.path.abspath(DemoConfig.output_dir)
    if previous and not ours:  # (the default directory is the demo's, marked or not: runs of older versions)
        raise FileExistsError(
            f"{output_dir} holds a training run that is not the demo's: choose another --output-dir for the demo"
        )
    if previous:
        print(f"{output_dir}/: the demo's own directory; its previous run is replaced", flush=True)
        for name in (checkpoint.FILENAME, "log.jsonl", "curves.png", "summary.json"):
            if os.path.exists(os.path.join(output_dir, name)):
                os.remove(os.path.join(output_dir, name))
    os.makedirs(output_dir, exist_ok=True)
    with open(marker, "w") as f:
        f.write("written by `python -m grpo demo`, which replaces this directory's run each time\n")


def run_demo(cfg: DemoConfig) -> dict:
    """Warm start, accuracy before, GRPO, accuracy after; writes log, curves, checkpoint under output_dir."""
    t0 = time.perf_counter()
    distributed.setup(cfg.distributed)
    main = distributed.is_main_process()
    torch.set_num_threads(1)  # a tiny model: more threads only add contention, and vary with the machine
    torch.use_deterministic_algorithms(True, warn_only=True)
    set_seed(cfg.seed)
    model, tokenizer = build_model_and_tokenizer(cfg.seed)
    train_rows, held_out_rows = split(problems(), cfg.held_out, cfg.seed)
    if main:  # the other ranks receive rank 0's weights when train() wraps the model
        print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters; "
              f"{len(train_rows)} GRPO problems, {len(held_out_rows)} held out", flush=True)
        losses = warm_start(model, tokenizer, problems(), cfg)
        before = evaluate(model, tokenizer, held_out_rows, samples=8)
        print(f"warm start: {cfg.sft_steps} steps, loss {losses[0]:.2f} -> {losses[-1]:.2f} ({time.perf_counter() - t0:.0f}s); "
              f"held-out accuracy {before['greedy']:.0%} greedy, {before['sampled']:.0%} sampled", flush=True)

    if main:
        claim_output_dir(cfg.output_dir)
    distributed.barrier()  # (the other ranks' train() checks the directory too)
    records = train(model, tokenizer, train_rows, {"accuracy": accuracy, "format": format_reward}, grpo_config(cfg))
    ranks = distributed.world_size()
    distributed.teardown()
    if not main:
        return {"grpo_steps": len(records)}
    after = evaluate(model, tokenizer, held_out_rows, samples=8)
    wall = time.perf_counter() - t0
    summary = {"before": before, "after": after, "grpo_steps": len(records), "wall_s": wall, "ranks": ranks}
    os.makedirs(cfg.output_dir, exist_ok=True)
    hf_logging.disable_progress_bar()
    model.save_pretrained(os.path.join(cfg.output_dir, "model"))  # `python -m grpo train --model` takes it
    tokenizer.save_pretrained(os.path.join(cfg.output_dir, "model"))
    with open(os.path.join(cfg.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"wrote {cfg.output_dir}/: log.jsonl, curves.png, checkpoint.pt, summary.json, model/")
    print(f"held-out accuracy sampled at temperature 1: {before['sampled']:.0%} -> {after['sampled']:.0%}")
    print(f"accuracy before GRPO: {before['greedy']:.0%} -> after: {after['greedy']:.0%}  "
          f"(greedy, {len(held_out_rows)} held-out problems; {wall:.0f}s)", flush=True)
    return summary


def _declared_int(field: str) -> Callable[[str], int]:
    """argparse type: an int within the range ``GRPOConfig`` declares for ``field`` (the demo's seed and step
    counts are a run's: read from the declaration, not restated), a usage error saying the range otherwise
    (before any model is built)."""
    bounds = GRPOConfig.__dataclass_fields__[field].metadata["bounds"]

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
        if not bounds.holds(value):
            raise argparse.ArgumentTypeError(f"must be {bounds.describe(integer=True)}, got {value}")
        return value

    return parse


_steps = _declared_int("num_steps")  # (>= 1: the SFT warm start's steps too)
_seed = _declared_int("seed")


def main(argv: Optional[list[str]] = None) -> dict:
    from grpo_kernels.options import BACKENDS

    parser = argparse.ArgumentParser(prog="python -m grpo demo", description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", default=DemoConfig.output_dir,
                        help="the demo's own directory: a previous demo run there is replaced (default: %(default)s)")
    parser.add_argument("--seed", type=_seed, default=DemoConfig.seed, help="(default: %(default)s)")
    parser.add_argument("--grpo-steps", type=_steps, default=DemoConfig.grpo_steps, help="(default: %(default)s)")
    parser.add_argument("--sft-steps", type=_steps, default=DemoConfig.sft_steps, help="(default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--backend", default=DemoConfig.backend, choices=BACKENDS,
                        help="the fused loss's backend (default: %(default)s)")
    parser.add_argument("--distributed", default="none", choices=distributed.KINDS,
                        help="under torchrun: ddp or fsdp (FSDP2)")
    args = parser.parse_args(argv)
    cfg = DemoConfig(output_dir=args.output_dir, seed=args.seed, grpo_steps=args.grpo_steps,
                     sft_steps=args.sft_steps, progress=not args.no_progress, backend=args.backend,
                     distributed=args.distributed)
    return run_demo(cfg)
