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
    raise ValueError(
        f"unknown reward {name!r}: use one of {sorted(rewards.REWARD_FUNCTIONS)}, a function of grpo.rewards, or module:function"
    )


# ---------------------------------------------------------------------------- GRPOConfig as flags
def _converter(kind: type, optional: bool) -> Callable[[str], object]:
    """argparse ``type=`` for a field of type ``kind``: ``None`` (any case) is None for an Optional
    field, and a value ``kind`` cannot parse is a usage error naming what was expected."""

    def convert(text: str):
        if optional and text.lower() == "none":
            return None
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an' if kind is int else 'a'} {kind.__name__}{' or None' if optional else ''}, got {text!r}"
            ) from None

    convert.__name__ = kind.__name__  # argparse names the type in its messages
    return convert


def _flag_type(hint) -> tuple[type, Optional[str], bool]:
    """(type, nargs, optional) for a GRPOConfig field's type hint."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and len(args) == 1:
        kind, nargs, _ = _flag_type(args[0])
        return kind, nargs, True
    if typing.get_origin(hint) is list:
        return typing.get_args(hint)[0], "+", False
    return hint, None, False


def add_config_flags(parser: argparse.ArgumentParser, config_cls) -> None:
    """One flag per field of ``config_cls``, its help, choices and range taken from the field's metadata."""
    from grpo_kernels.options import OPTION_NAMES  # the loss fields, generated from the loss spec

    hints = typing.get_type_hints(config_cls)
    trainer = parser.add_argument_group(f"{config_cls.__name__} (in Python: grpo.{config_cls.__name__}(...))")
    loss = parser.add_argument_group("the loss (grpo_kernels.GRPOOptions; docs/api.md)")
    for field in dataclasses.fields(config_cls):
        group = loss if field.name in OPTION_NAMES else trainer
        flag = "--" + field.name.replace("_", "-")
        kind, nargs, optional = _flag_type(hints[field.name])
        meta = field.metadata
        nargs = "+" if meta.get("words") else nargs
        bounds = f"{meta['bounds'].describe(integer=kind is int)}; " if meta.get("bounds") is not None else ""
        text = meta.get("help", "").replace("%", "%%") + f" ({bounds}default: %(default)s)"
        metavar = kind.__name__.upper() + ("|None" if optional else "")
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default, help=text)
        elif meta.get("choices") is not None:  # (an Optional field's choices include None)
            choices = (*meta["choices"], None) if optional else meta["choices"]
            metavar = "{" + ",".join(meta["choices"]) + "}" + ("|None" if optional else "")
            group.add_argument(flag, type=_converter(kind, optional), choices=choices, default=field.default, metavar=metavar,
                               help=text)
        else:
            group.add_argument(flag, type=_converter(kind, optional), nargs=nargs, default=field.default, metavar=metavar,
                               help=text)


def _list_value(flag: str, values, parser: argparse.ArgumentParser):
    """A list flag's value: ``--flag None`` (alone) is None; None among numbers is a usage error."""
    if not isinstance(values, list) or None not in values:
        return values
    if len(values) > 1:
        parser.error(f"argument {flag}: None stands alone (None: the field's None), got {values}")
    return None


def config_from_args(args: argparse.Namespace, config_cls, parser: argparse.ArgumentParser):
    """The config the flags describe; a value the config refuses is reported as a usage error."""
    words = lambda f, v: ",".join(v) if f.metadata.get("words") and isinstance(v, list) else v  # noqa: E731
    flag = lambda f: "--" + f.name.replace("_", "-")  # noqa: E731
    try:
        return config_cls(**{f.name: words(f, _list_value(flag(f), getattr(args, f.name), parser))
                             for f in dataclasses.fields(config_cls)})
    except (TypeError, ValueError) as e:
        parser.error(str(e))


# ---------------------------------------------------------------------------- commands
def train_command(argv: list[str]) -> None:
    from . import distributed
    from .data import load_jsonl
    from .config import GRPOConfig
    from .lora import check_flags
    from .precision import check_device_supports, torch_dtype
    from .rollout import require_vllm
    from .models import default_device, load_model
    from .trainer import train

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
    try:  # every usage error before the model is built
        reward_fns = {name.split(":")[-1]: resolve_reward(name) for name in args.rewards}
    except (ImportError, AttributeError, ValueError) as e:
        parser.error(f"--rewards: {e}")
    try:
        rows = load_jsonl(args.data, args.prompt_key)
    except OSError as e:
        parser.error(f"--data: {e}")
    try:  # the dtype against the device and the LoRA flags against the model's config, before its weights load
        from transformers import AutoConfig

        check_device_supports(cfg.model_dtype, default_device())
        check_flags(cfg, AutoConfig.from_pretrained(args.model) if cfg.use_peft else None)
    except ValueError as e:
        parser.error(str(e))
    if cfg.use_vllm:
        try:
            require_vllm()  # before the model loads
        except ImportError as e:
            parser.error(str(e))
    model, tokenizer = load_model(args.model, dtype=torch_dtype(cfg.model_dtype))
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
    if not cfg.use_peft:  # (a LoRA run wrote its adapter, output_dir/adapter, and the base is unchanged)
        model.save_pretrained(f"{cfg.output_dir}/model")
        tokenizer.save_pretrained(f"{cfg.output_dir}/model")
    if records:
        last = {k: v for k, v in records[-1].items() if isinstance(v, (int, float))}
        print(json.dumps(last, indent=1))
    print(f"wrote {cfg.output_dir}/log.jsonl, curves.png, checkpoint.pt, {'adapter/' if cfg.use_peft else 'model/'}")


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
