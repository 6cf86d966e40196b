"""Command line: ``python -m grpo demo`` and ``python -m grpo train``.

    python -m grpo demo                                # the CPU demo (about a minute)
    python -m grpo train --model Qwen/Qwen2.5-0.5B-Instruct --data prompts.jsonl \\
        --rewards accuracy format --reward-weights 1.0 0.2 --num-steps 200 --learning-rate 1e-6

    torchrun --nproc-per-node 8 -m grpo train --distributed fsdp --model ... --data ...   # or ddp
    torchrun --nproc-per-node 2 -m grpo demo --distributed ddp    # the demo on 2 CPU processes (gloo)

Every field of ``GRPOConfig`` is a flag (``--max-new-tokens``, ``--beta``, ``--loss-type`` ...).
``--prompts-per-step`` is the global batch, split evenly among the ranks.
The data is JSONL with a prompt column and any others (e.g. ``answer``), which reach the reward
functions as keyword lists. A reward is a name of ``grpo.rewards.REWARD_FUNCTIONS`` (``accuracy``: math answers against the
``answer`` column; ``format``: ``<think>..</think><answer>..</answer>``; ``code``: tests in the
``tests`` column), another TRL-style function of ``grpo.rewards``, or ``package.module:function`` for
your own ``fn(prompts, completions, **columns) -> list[float | None]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import typing
from typing import Callable, Optional


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
    raise SystemExit(
        f"unknown reward {name!r}: use one of {sorted(rewards.REWARD_FUNCTIONS)}, a function of grpo.rewards, or module:function"
    )


# ---------------------------------------------------------------------------- GRPOConfig as flags
def _flag_type(hint) -> tuple[Callable, Optional[str]]:
    """(converter, nargs) for a GRPOConfig field's type hint."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and len(args) == 1:
        return _flag_type(args[0])
    if typing.get_origin(hint) is list:
        return typing.get_args(hint)[0], "+"
    return hint, None


def add_config_flags(parser: argparse.ArgumentParser, config_cls) -> None:
    """One flag per field of ``config_cls``, its help, choices and range taken from the field's metadata."""
    hints = typing.get_type_hints(config_cls)
    group = parser.add_argument_group(f"{config_cls.__name__} (in Python: grpo.{config_cls.__name__}(...))")
    for field in dataclasses.fields(config_cls):
        flag = "--" + field.name.replace("_", "-")
        kind, nargs = _flag_type(hints[field.name])
        meta = field.metadata
        bounds = f"{meta['bounds'].describe(integer=kind is int)}; " if meta.get("bounds") is not None else ""
        text = meta.get("help", "").replace("%", "%%") + f" ({bounds}default: %(default)s)"
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default, help=text)
        elif meta.get("choices") is not None:
            group.add_argument(flag, type=kind, choices=meta["choices"], default=field.default, help=text)
        else:
            group.add_argument(flag, type=kind, nargs=nargs, default=field.default, metavar=kind.__name__.upper(), help=text)


def config_from_args(args: argparse.Namespace, config_cls, parser: argparse.ArgumentParser):
    """The config the flags describe; a value the config refuses is reported as a usage error."""
    try:
        return config_cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(config_cls)})
    except (TypeError, ValueError) as e:
        parser.error(str(e))


# ---------------------------------------------------------------------------- commands
def train_command(argv: list[str]) -> None:
    from . import distributed
    from .data import load_jsonl
    from .config import GRPOConfig
    from .rollout import require_vllm
    from .trainer import load_model, train

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
    reward_fns = {name.split(":")[-1]: resolve_reward(name) for name in args.rewards}
    if cfg.use_vllm:
        try:
            require_vllm()  # before the model loads
        except ImportError as e:
            parser.error(str(e))
    model, tokenizer = load_model(args.model)
    rows = load_jsonl(args.data, args.prompt_key)
    use_template = args.chat_template if args.chat_template is not None else bool(getattr(tokenizer, "chat_template", None))
    if use_template:
        for row in rows:
            row["prompt"] = tokenizer.apply_chat_template(
                [{"role": "user", "content": row["prompt"]}], tokenize=False, add_generation_prompt=True
            )
    records = train(model, tokenizer, rows, reward_fns, cfg)
    main_process = distributed.is_main_process()
    distributed.teardown()
    if not main_process:
        return
    model.save_pretrained(f"{cfg.output_dir}/model")
    tokenizer.save_pretrained(f"{cfg.output_dir}/model")
    if records:
        last = {k: v for k, v in records[-1].items() if isinstance(v, (int, float))}
        print(json.dumps(last, indent=1))
    print(f"wrote {cfg.output_dir}/log.jsonl, curves.png, checkpoint.pt, model/")


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"train": train_command, "demo": lambda rest: importlib.import_module("grpo.demo").main(rest)}
    if not argv or argv[0] not in commands:
        print(__doc__)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    commands[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
