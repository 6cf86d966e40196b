"""Minimal GRPO trainer built on grpo_kernels.

    from grpo import GRPOConfig, train, group_advantages
    train(model, tokenizer, rows, {"accuracy": fn}, GRPOConfig(...))

``python -m grpo demo`` runs the CPU demo; ``python -m grpo train --help`` the command line trainer.
The trainer (which imports transformers) loads on first use, so ``import grpo`` stays light.
"""

from __future__ import annotations

from typing import Any

from .advantages import group_advantages, zero_signal_groups

__all__ = ["group_advantages", "zero_signal_groups", "GRPOConfig", "train"]


def __getattr__(name: str) -> Any:
    import importlib

    if name == "GRPOConfig":
        return importlib.import_module(".config", __name__).GRPOConfig
    if name == "train":
        return importlib.import_module(".trainer", __name__).train
    if name in ("trainer", "config", "rollout", "checkpoint", "data", "logs", "distributed", "demo", "rewards", "tokenizer"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'grpo' has no attribute {name!r}")
