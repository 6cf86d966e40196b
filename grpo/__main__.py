"""Command line: ``python -m grpo demo`` and ``python -m grpo train``.

    python -m grpo demo                                # the CPU demo (about a minute)
    python -m grpo plan --model Qwen2.5-1.5B --tokens 32768 --use-peft --model-dtype bfloat16 \
        --gradient-checkpointing --gpu-memory 24GiB    # the predicted peak memory of a step (grpo.plan)
    python -m grpo train --model Qwen/Qwen2.5-0.5B-Instruct --data prompts.jsonl \\
        --rewards accuracy format --reward-weights 1.0 0.2 --num-steps 200 --learning-rate 1e-6

    torchrun --nproc-per-node 8 -m grpo train --distributed fsdp --model ... --data ...   # or ddp
    torchrun --nproc-per-node 2 -m grpo demo --distributed ddp    # the demo on 2 CPU processes (gloo)

Every field of ``GRPOConfig`` is a flag (``--max-new-tokens``, ``--beta``, ``--loss-type`` ...); the
loss's flags are generated from ``grpo_kernels.GRPOOptions``, help text included. An Optional field
takes ``None`` (any case: ``--rollout-correction-max None``, ``--loss-mode none``); a bool field is
``--flag`` / ``--no-flag``.
``--prompts-per-step`` is the global batch, split evenly among the ranks.
The data is JSONL with a prompt column and any others (e.g. ``answer``), which reach the reward
functions as keyword lists. A reward is a name of ``grpo.rewards.REWARD_FUNCTIONS`` (``accuracy``: math answers against the
``answer`` column; ``format``: ``<think>..</think><answer>..</answer>``; ``code``: tests in the
``tests`` column), another TRL-style function of ``grpo.rewards``, or ``package.module:function`` for
your own ``fn(prompts, completions, **columns) -> list[float | None]``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Callable, Optional

from .flags import add_config_flags, config_from_args, usage_error  # noqa: F401 (GRPOConfig as flags)


# ---------------------------------------------------------------------------- rewards by name
def resolve_reward(name: str) -> Callable:
    """A reward function from a name of ``grpo.rewards.REWARD_FUNCTIONS``, a function of ``grpo.rewards``
    or ``module:function``."""
    if ":" in name:
        module, attr = name.split(":", 1)
        return getattr(importlib.import_module(module), attr)
    rewards = importlib.import_module("grpo.rewards")
    if name in rewards.REWARD_FUNCTIONS:
        return rewards.REWARD_FUNCTIONS[name]
    if callable(getattr(rewards, name, None)):
        return getattr(rewards, name)
    raise ValueError(
        f"unknown reward {name!r}: use one of {sorted(rewards.REWARD_FUNCTIONS)}, a function of grpo.rewards, or module:function"
    )


# ---------------------------------------------------------------------------- commands
def train_command(argv: list[str]) -> None:
    from . import checkpoint, distributed
    from .data import load_jsonl
    from .config import GRPOConfig
    from .lora import check_flags
    from .models import load_model
    from .rollout import engine_class
    from .trainer import check_run, train

    parser = argparse.ArgumentParser(prog="python -m grpo train", description="GRPO on a JSONL of prompts.")
    parser.add_argument("--model", required=True, help="a local path or a Hugging Face model name")
    parser.add_argument("--data", required=True, help="JSONL: one object per prompt, e.g. {\"prompt\": ..., \"answer\": ...}")
    parser.add_argument("--prompt-key", default="prompt", help="the JSONL field that holds the prompt (default: prompt)")
    parser.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                        help="wrap prompts in the tokenizer's chat template (default: when it has one)")
    parser.add_argument("--rewards", nargs="+", default=["accuracy", "format"],
                        help="reward functions: names of grpo.rewards.REWARD_FUNCTIONS, functions of grpo.rewards, "
                             "or module:function (default: accuracy format)")
    add_config_flags(parser, GRPOConfig)
    args = parser.parse_args(argv)
    cfg = config_from_args(args, GRPOConfig, parser)
    # every check that needs no weights, before they load: the flags, rewards and data, then the model's
    # config, tokenizer and module structure (a meta-device skeleton), the output directory and the
    # checkpoint to resume from (grpo.trainer.check_run, which grpo.train runs too)
    try:
        reward_fns = {name.split(":")[-1]: resolve_reward(name) for name in args.rewards}
    except (ImportError, AttributeError, ValueError) as e:
        parser.error(f"--rewards: {e}")
    try:
        rows = load_jsonl(args.data, args.prompt_key)
    except (OSError, ValueError, TypeError) as e:  # (missing, not JSON lines, a row without its prompt ...)
        parser.error(f"--data: {e}")
    try:  # what needs nothing of the model: the packages its flags need
        check_flags(cfg)
        engine_class(cfg.rollout_engine).require()  # (vLLM for --rollout-engine vllm / --use-vllm)
    except ImportError as e:
        parser.error(str(e))
    skeleton, tokenizer = model_skeleton(args.model, parser)
    use_template = args.chat_template if args.chat_template is not None else bool(getattr(tokenizer, "chat_template", None))
    if use_template:
        for row in rows:
            row["prompt"] = tokenizer.apply_chat_template(
                [{"role": "user", "content": row["prompt"]}], tokenize=False, add_generation_prompt=True
            )
    try:
        check_run(cfg, rows, reward_fns, model=skeleton, tokenizer=tokenizer)
    except (FileExistsError, checkpoint.OutputDirInUse, checkpoint.CheckpointError) as e:
        usage_error(parser, type(e)(f"--output-dir: {e.strerror if isinstance(e, OSError) and e.strerror else e}"))
    except (ImportError, TypeError, ValueError) as e:
        usage_error(parser, e, GRPOConfig)
    from .precision import torch_dtype

    del skeleton  # (the checks' meta-device model; the tokenizer they checked is the run's)
    model, tokenizer = load_model(args.model, dtype=torch_dtype(cfg.model_dtype), tokenizer=tokenizer)
    records = train(model, tokenizer, rows, reward_fns, cfg)
    main_process = distributed.is_main_process()
    distributed.teardown()
    if not main_process:
        return
    if not cfg.use_peft:  # (a LoRA run wrote its adapter, output_dir/adapter, and the base is unchanged)
        model.save_pretrained(f"{cfg.output_dir}/model")
        tokenizer.save_pretrained(f"{cfg.output_dir}/model")
    if records:
        last = {k: v for k, v in records[-1].items() if isinstance(v, (int, float))}
        print(json.dumps(last, indent=1))
    print(f"wrote {cfg.output_dir}/log.jsonl, curves.png, checkpoint.pt, {'adapter/' if cfg.use_peft else 'model/'}")


def model_skeleton(name_or_path: str, parser: argparse.ArgumentParser):
    """(the model built on the meta device from its config: module names and shapes, no weights; its
    left-padding tokenizer), or a usage error naming ``--model``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(name_or_path)
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, padding_side="left")
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError) as e:
        parser.error(f"--model {name_or_path!r}: no causal language model's config and tokenizer there ({e})")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return skeleton, tokenizer


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"train": train_command, "demo": lambda rest: importlib.import_module("grpo.demo").main(rest),
                "plan": lambda rest: importlib.import_module("grpo.plan").main(rest)}
    parser = argparse.ArgumentParser(
        prog="python -m grpo", usage="%(prog)s [-h] {train,demo,plan} [flags ...]", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="`python -m grpo train --help` and `python -m grpo demo --help` list each command's flags.",
    )
    parser.add_argument("command", choices=list(commands), help="what to run, followed by its flags")
    args = parser.parse_args(argv[:1])  # (the rest is the command's, --help included)
    commands[args.command](argv[1:])


if __name__ == "__main__":
    main()
