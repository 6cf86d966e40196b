"""Checkpoints: one file, ``<output_dir>/checkpoint.pt``, from which a run resumes exactly.

It holds the step count, the policy's full weights, the reference model's (when ``beta > 0``), the
optimizer state and every rank's RNG states, so a resumed run samples the completions the
uninterrupted run would have. The learning-rate schedule is a pure function of the step, and the
prompts of a step a pure function of ``(seed, step)`` (``grpo.data.prompts_for_step``): neither needs
saving. Under data parallelism every rank calls ``save`` and ``load``; ``grpo.distributed`` gathers
full state for rank 0 to write.
"""

from __future__ import annotations

import os
import random
from typing import Any, Optional

import torch

from . import distributed
from .atomic import write_atomically

FILENAME = "checkpoint.pt"


def path_in(output_dir: str) -> str:
    return os.path.join(output_dir, FILENAME)


def rng_state() -> dict[str, Any]:
    import numpy as np

    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def save(
    path: str,
    step: int,
    policy: torch.nn.Module,
    ref_policy: Optional[torch.nn.Module],
    optimizer: torch.optim.Optimizer,
    config: dict[str, Any],
) -> None:
    """Write the checkpoint via a temporary file, fsync and ``os.replace``, so a crash never leaves half a file.

    Refuses (``ValueError`` naming the tensors, nothing written) when a weight or optimizer moment is
    NaN or inf: such a checkpoint would only crash, or silently poison, the run that resumes from it.

    Every rank calls this: full (unsharded) weights and optimizer state are gathered for rank 0, which
    writes them with every rank's RNG state; the others wait until the file is there. ``config`` is
    stored for the record (``dataclasses.asdict`` of the run's config); ``load`` does not read it.
    """
    ranks = distributed.world_size()
    state = {
        "step": step,
        "model": distributed.model_state(policy),
        "ref_model": distributed.model_state(ref_policy) if ref_policy is not None else None,
        "optimizer": distributed.optimizer_state(policy, optimizer),
        "rng": rng_state() if ranks == 1 else distributed.all_gather_objects(rng_state()),  # a list: one per rank
        "config": config,
    }
    # rank 0 holds the full state: it checks, and every rank learns the verdict (so all raise, none hangs)
    bad = non_finite_tensors({k: state[k] for k in ("model", "ref_model", "optimizer")}) if distributed.is_main_process() else []
    if distributed.all_reduce(len(bad)):
        raise ValueError(
            f"refusing to write {path}: non-finite values in {', '.join(bad[:5]) or 'the state on rank 0'}"
            f"{f' and {len(bad) - 5} more tensors' if len(bad) > 5 else ''}"
        )
    if distributed.is_main_process():
        write_atomically(path, lambda f: torch.save(state, f))
    distributed.barrier()


def non_finite_tensors(tree: Any, prefix: str = "") -> list[str]:
    """Names (dotted paths) of the floating-point tensors in nested dicts / lists that hold a NaN or an inf."""
    if isinstance(tree, torch.Tensor):
        return [prefix] if tree.is_floating_point() and not bool(torch.isfinite(tree).all()) else []
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return []
    return [name for k, v in items for name in non_finite_tensors(v, f"{prefix}.{k}" if prefix else str(k))]


def load(path: str, policy: torch.nn.Module, ref_policy: Optional[torch.nn.Module], optimizer: torch.optim.Optimizer) -> int:
    """Restore everything ``save`` wrote (every rank reads the file); returns the steps done."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    distributed.load_model_state(policy, state["model"])
    if ref_policy is not None and state["ref_model"] is not None:
        distributed.load_model_state(ref_policy, state["ref_model"])
    distributed.load_optimizer_state(policy, optimizer, state["optimizer"])
    set_rng_state(distributed.this_ranks(state["rng"]))
    return int(state["step"])
