"""Data parallelism on torch.distributed: the process group, DDP / FSDP2 wrapping, collectives, checkpoints.

Launch with torchrun, one process per GPU (NCCL) or per CPU worker (gloo)::

    torchrun --nproc-per-node 4 -m grpo train --distributed fsdp --model ... --data ...

Every rank runs the same trainer on its own share of each step's prompts. Everything here is a no-op
in a single process, so the trainer calls these helpers unconditionally:

- ``setup`` / ``teardown``: the process group (NCCL with CUDA, gloo without), one device per rank.
- ``wrap``: DDP, or FSDP2 (``fully_shard`` on every decoder layer, then on the root). The wrapped
  module must do all its work inside ``forward`` (the trainer's ``Policy`` does): that is where DDP
  syncs gradients and FSDP2 gathers its sharded weights.
- ``all_reduce``, ``all_gather``, ``all_gather_objects``, ``barrier``: small collectives on CPU values.
- ``model_state`` / ``load_model_state``, ``optimizer_state`` / ``load_optimizer_state``: full
  (unsharded) state dicts, gathered for rank 0 to write and loaded on every rank.
"""

from __future__ import annotations

import atexit
import copy
import os
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

try:  # torch >= 2.6
    from torch.distributed.fsdp import FSDPModule, fully_shard
except ImportError:  # pragma: no cover - torch 2.4 / 2.5
    from torch.distributed._composable.fsdp import FSDPModule, fully_shard

KINDS = ("none", "ddp", "fsdp")
_initialised_here = False


# --------------------------------------------------------------------------------------------------
# processes
# --------------------------------------------------------------------------------------------------
def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main_process() -> bool:
    return rank() == 0


def launched_ranks() -> int:
    """How many processes the launcher (torchrun) started; 1 for a plain ``python`` run."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def setup(kind: str) -> None:
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` ...).

    ``kind`` is ``"none"``, ``"ddp"`` or ``"fsdp"``. A plain ``python`` run is a world of one, whatever
    the kind; several processes without a kind would each train alone, so that is an error.
    """
    global _initialised_here
    if kind not in KINDS:
        raise ValueError(f"distributed must be one of {KINDS}, got {kind!r}")
    if launched_ranks() > 1 and kind == "none":
        raise ValueError(f"{launched_ranks()} processes were launched: pass --distributed ddp or fsdp")
    if kind == "none" or launched_ranks() == 1 or dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    _initialised_here = True
    atexit.register(teardown)


def teardown() -> None:
    """Leave the process group, if ``setup`` joined it."""
    global _initialised_here
    if _initialised_here and dist.is_initialized():
        dist.destroy_process_group()
    _initialised_here = False


def device() -> torch.device:
    """This rank's device: its own GPU under torchrun (``LOCAL_RANK``), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


# --------------------------------------------------------------------------------------------------
# collectives on small CPU values (no-ops in a single process)
# --------------------------------------------------------------------------------------------------
def _comm_device() -> torch.device:
    return device() if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce(value, op: str = "sum"):
    """Sum (or ``"max"``) over ranks of a number or a tensor, returned on the input's device and type."""
    if world_size() == 1:
        return value
    t = torch.as_tensor(value)
    out = t.detach().to(_comm_device(), torch.float64 if t.is_floating_point() else torch.int64).clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    if isinstance(value, torch.Tensor):
        return out.to(value.device, value.dtype)
    return type(value)(out.item())


def all_gather(t: torch.Tensor) -> torch.Tensor:
    """Concatenate along dim 0 the tensors of every rank, in rank order (same shape on every rank)."""
    if world_size() == 1:
        return t
    local = t.detach().to(_comm_device()).contiguous()
    parts = [torch.empty_like(local) for _ in range(world_size())]
    dist.all_gather(parts, local)
    return torch.cat(parts).to(t.device)


def all_gather_objects(obj: Any) -> list:
    """Every rank's ``obj`` (picklable), in rank order."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


# --------------------------------------------------------------------------------------------------
# wrapping
# --------------------------------------------------------------------------------------------------
def is_fsdp(module: torch.nn.Module) -> bool:
    return isinstance(module, FSDPModule)


def unwrap_ddp(module: torch.nn.Module) -> torch.nn.Module:
    return module.module if isinstance(module, DDP) else module


def broadcast_from_rank0(module: torch.nn.Module) -> None:
    """Give every rank rank 0's weights and buffers (tensor by tensor, so no rank holds two copies)."""
    for t in list(module.parameters()) + list(module.buffers()):
        buf = t.detach().to(_comm_device()).contiguous()
        dist.broadcast(buf, src=0)
        with torch.no_grad():
            t.copy_(buf.to(t.device))


def wrap(policy: torch.nn.Module, kind: str, dev: torch.device, frozen: bool = False) -> torch.nn.Module:
    """``policy`` ready for data-parallel use; ``policy.model`` is the language model.

    - ``"ddp"``: the module moves to ``dev`` and DDP wraps it (DDP broadcasts rank 0's weights). A
      frozen module (the reference model) is not wrapped: it has no gradients to sync.
    - ``"fsdp"``: a copy is sharded, so the caller's model keeps its full weights (``copy_back``
      returns the trained ones): rank 0's weights are broadcast, every module the model lists in
      ``_no_split_modules`` (its decoder layers) is ``fully_shard``-ed, and then the root, which holds
      the embeddings, final norm and ``lm_head``. A forward of the root gathers them, so the fused loss
      can read ``lm_head.weight`` inside it; backward reduce-scatters (averages) the gradients.
    - one process, or ``"none"``: the module moves to ``dev``.
    """
    if world_size() == 1 or kind == "none":
        return policy.to(dev)
    if kind == "ddp":
        policy.to(dev)
        if frozen:
            return policy
        gpu = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else None
        return DDP(policy, device_ids=gpu)
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh

        policy = copy.deepcopy(policy)
        broadcast_from_rank0(policy)
        mesh = init_device_mesh(dev.type, (world_size(),))
        layer_classes = set(getattr(policy.model, "_no_split_modules", None) or [])
        for module in list(policy.modules()):
            if type(module).__name__ in layer_classes:
                fully_shard(module, mesh=mesh)
        fully_shard(policy, mesh=mesh)
        return policy
    raise ValueError(f"distributed must be one of {KINDS}, got {kind!r}")


def no_grad_sync(policy: torch.nn.Module, skip: bool):
    """Skip DDP's gradient all-reduce on this backward (all but a step's last micro-batch).

    FSDP2 reduce-scatters after every micro-batch instead, which keeps only sharded gradients.
    """
    return policy.no_sync() if skip and isinstance(policy, DDP) else nullcontext()


def copy_back(policy: torch.nn.Module, model: torch.nn.Module) -> None:
    """After FSDP2 training (which sharded a copy), copy the trained weights into ``model`` on every rank,
    one gathered tensor at a time."""
    if not is_fsdp(policy):
        return
    targets = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in policy.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            targets[name.removeprefix("model.")].copy_(full)


# --------------------------------------------------------------------------------------------------
# full state dicts for checkpoints (every rank calls; rank 0 gets the values)
# --------------------------------------------------------------------------------------------------
def _options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def model_state(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The language model's full state dict (keys as ``policy.model.state_dict()``); complete on rank 0."""
    if is_fsdp(policy):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        full = get_model_state_dict(policy, options=_options(cpu_offload=True))
        return {k.removeprefix("model."): v for k, v in full.items()}
    return unwrap_ddp(policy).model.state_dict()


def frozen_parameter_names(policy: torch.nn.Module) -> set[str]:
    """The names (``model_state``'s keys) of the parameters that do not train: a run never changes them
    (under LoRA, the whole base model), so a checkpoint need not hold them. Tied names are all listed."""
    return {n for n, p in unwrap_ddp(policy).model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def load_model_state(policy: torch.nn.Module, state: dict[str, torch.Tensor], absent: frozenset[str] = frozenset()) -> None:
    """Load a state dict (every rank has read it) into the policy, sharding it under FSDP2. ``absent``:
    the keys the state leaves out on purpose (the frozen weights, which the policy already holds); any
    other missing or unexpected key is a ``RuntimeError`` before anything is loaded, as a strict load's."""
    expected = set(unwrap_ddp(policy).model.state_dict())  # (under FSDP2 its shards: the names, nothing gathered)
    missing, unexpected = expected - set(state), set(state) - expected
    if missing != absent or unexpected:
        raise RuntimeError(f"the state does not fit the model: missing {sorted(missing - absent)[:3]}, unexpected "
                           f"{sorted(unexpected)[:3]}, left out as frozen but not the model's {sorted(absent - missing)[:3]}")
    if is_fsdp(policy):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(policy, {"model." + k: v for k, v in state.items()}, options=_options(strict=not absent))
    else:
        unwrap_ddp(policy).model.load_state_dict(state, strict=not absent)


def optimizer_state(policy: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's full state: ``optimizer.state_dict()``, or under FSDP2 gathered and keyed by name."""
    if is_fsdp(policy):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(policy, optimizer, options=_options(cpu_offload=True))
    return optimizer.state_dict()


def load_optimizer_state(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load what ``optimizer_state`` returned, whichever way the run that wrote it was wrapped."""
    keyed_by_name = any(isinstance(k, str) for k in state["state"])
    if not (keyed_by_name or is_fsdp(policy)):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    if not keyed_by_name:  # optimizer.state_dict() numbers the parameters in the order they were given
        names = [n.removeprefix("module.") for n, p in policy.named_parameters() if p.requires_grad]
        state = {
            "state": {names[i]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
        }
    set_optimizer_state_dict(policy, optimizer, optim_state_dict=state, options=_options())


def this_ranks(per_rank: Any) -> Any:
    """This rank's entry of a list saved by ``all_gather_objects`` (a single value stands for all ranks).

    Resuming on another number of ranks reuses the entries cyclically: the run continues, though it no
    longer repeats the samples the uninterrupted run would have drawn.
    """
    if isinstance(per_rank, list):
        return per_rank[rank() % len(per_rank)]
    return per_rank
