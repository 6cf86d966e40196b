"""Checkpoints: one file, ``<output_dir>/checkpoint.pt``, from which a run resumes exactly.

It holds the step count, the policy's full weights, the reference model's (when ``beta > 0``), the
optimizer state and every rank's RNG states, so a resumed run samples the completions the
uninterrupted run would have. The learning-rate schedule is a pure function of the step, and the
prompts of a step a pure function of ``(seed, step)`` (``grpo.data.prompts_for_step``): neither needs
saving. Under data parallelism every rank calls ``save`` and ``load``; ``grpo.distributed`` gathers
full state for rank 0 to write.
"""

from __future__ import annotations

import errno
import fcntl
import os
import random
import signal
import sys
import threading
from typing import Any, Optional

import torch

from . import distributed
from .atomic import write_atomically
from .config import settings_as_stored

FILENAME = "checkpoint.pt"
LOCK_FILENAME = "run.lock"
# GRPOConfig fields a resumed run may change: how long it runs, how it logs and saves, and how the
# same maths is laid out on the machine. Every other field (the loss, the rewards' weights, G, the
# optimiser, the sampling, the seed) must match the checkpoint's, unless ``resume_with_changes``.
RESUMABLE_CHANGES = frozenset({
    "output_dir", "num_steps", "save_every", "resume", "resume_with_changes", "progress", "plot", "backend",
    "chunk_size", "padding_free", "max_tokens_per_microbatch", "micro_batch_size", "gradient_checkpointing",
    "distributed", "release_memory",
})


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

    The policy's frozen parameters (under LoRA the whole base model: all but the adapters) are not
    written, as peft's and transformers' checkpoints leave them out: the run never changes them, so the
    resuming run's model (``--model``) holds them. Their names and shapes are (``"frozen"``), and a
    resume checks them against its model. Nor are they read here: the save touches no page of a base
    weight that the run itself did not (a memory-mapped model's unread embedding rows stay on disk).
    """
    ranks = distributed.world_size()
    weights, frozen = distributed.model_state(policy), distributed.frozen_parameter_names(policy)
    state = {
        "step": step,
        "model": {k: v for k, v in weights.items() if k not in frozen},
        "frozen": {k: list(v.shape) for k, v in weights.items() if k in frozen},
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


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds no NaN and no inf, read in one pass with no temporary of its size
    (``torch.isfinite(t).all()`` allocates more than the tensor itself: at a save, more than the
    largest weight, which set a LoRA run's peak): ``aminmax`` propagates NaN, and an inf is a min or a max."""
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor.detach())
    return bool(torch.isfinite(low) & torch.isfinite(high))


def non_finite_tensors(tree: Any, prefix: str = "") -> list[str]:
    """Names (dotted paths) of the floating-point tensors in nested dicts / lists that hold a NaN or an inf."""
    if isinstance(tree, torch.Tensor):
        return [prefix] if tree.is_floating_point() and not all_finite(tree) else []
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return []
    return [name for k, v in items for name in non_finite_tensors(v, f"{prefix}.{k}" if prefix else str(k))]


def changed_settings(saved: Optional[dict[str, Any]], config: dict[str, Any]) -> list[str]:
    """``"field: saved -> now"`` for each setting outside :data:`RESUMABLE_CHANGES` that differs
    (fields only one of the two configs has are not compared: a checkpoint from another version; the saved
    values read as a config stores them today, ``grpo.config.settings_as_stored``: an older ``top_p=1.0`` is
    today's None)."""
    if not saved:
        return []
    saved = settings_as_stored(saved)
    return [f"{k}: {saved[k]!r} -> {config[k]!r}" for k in config
            if k in saved and k not in RESUMABLE_CHANGES and saved[k] != config[k]]


class CheckpointError(ValueError):
    """A ``checkpoint.pt`` a run cannot resume from: unreadable (truncated, corrupt, another format), not
    written by :func:`save`, or holding another model's weights. The message names the file."""


def _numpy_globals() -> list:
    """What ``np.random.get_state()`` pickles as (the RNG state is in every checkpoint), allowed by
    ``torch.load(weights_only=True)``: nothing else in a file can run code when it is read."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    return [np.dtype, np.ndarray, core.multiarray._reconstruct, type(np.dtype("uint32"))]


STATE_KEYS = ("step", "model", "ref_model", "optimizer", "rng", "config")


def read(path: str) -> dict[str, Any]:
    """The state :func:`save` wrote to ``path``, its tensors memory-mapped (nothing is copied until it is
    restored), checked for the structure ``save`` gives it; :class:`CheckpointError` naming the file
    otherwise (``torch.load``'s own error, e.g. an ``UnpicklingError``, kept as its cause). Loads with
    ``weights_only=True``: a foreign pickle cannot run code."""
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # (torch.load raises many kinds: RuntimeError, UnpicklingError, EOFError, ...)
        raise CheckpointError(f"{path} is not a readable grpo checkpoint ({type(e).__name__}: {e}); it may be truncated "
                              f"or from another program: move it away to start afresh, or point --output-dir elsewhere") from e
    problem = _structure_problem(state)
    if problem:
        raise CheckpointError(f"{path} is not a grpo checkpoint: {problem}")
    return state


def _structure_problem(state: Any) -> str:
    """What is wrong with ``state`` as :func:`save` writes it ('' when nothing is)."""
    if not isinstance(state, dict):
        return f"it holds a {type(state).__name__}, not a dict"
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        return f"no {', '.join(missing)} in it"
    if isinstance(state["step"], bool) or not isinstance(state["step"], int) or state["step"] < 0:
        return f"its step is {state['step']!r}"
    for key in ("model", "ref_model"):
        weights = state[key]
        if weights is None and key == "ref_model":
            continue
        if not isinstance(weights, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items()):
            return f"its {key!r} is not a state dict of tensors"
    frozen = state.get("frozen", {})  # (absent from checkpoints written before frozen weights were left out)
    if not isinstance(frozen, dict) or not all(isinstance(k, str) and isinstance(v, list) and all(
            isinstance(d, int) and not isinstance(d, bool) for d in v) for k, v in frozen.items()):
        return "its 'frozen' is not a map of names to shapes"
    if not isinstance(state["optimizer"], dict) or not {"state", "param_groups"} <= set(state["optimizer"]):
        return "its 'optimizer' is not an optimizer state dict"
    if not isinstance(state["config"], (dict, type(None))):
        return "its 'config' is not a dict"
    return ""


def _base_names(shapes: dict[str, Any]) -> dict[str, tuple]:
    """A model's names and shapes (``{name: tensor or shape}``) as the plain model's: a LoRA run's peft
    names (``base_model.model.`` prefix, ``.base_layer`` of an adapted layer) mapped back, its adapters left out."""
    return {k.removeprefix("base_model.model.").replace(".base_layer.", "."): tuple(getattr(v, "shape", v))
            for k, v in shapes.items() if ".lora_" not in k}


def check_resumable(state: dict[str, Any], path: str, model: Optional[torch.nn.Module], config: Optional[dict[str, Any]],
                    allow_changes: bool = False) -> None:
    """Whether a run can resume from ``state`` (:func:`read` of ``path``) before anything of the run
    loads or changes: the settings it was written with (unless ``allow_changes``; :func:`changed_settings`)
    and, given ``model`` (the caller's, as it is before the run casts it or adds adapters; a meta-device
    skeleton will do), its weights' names and shapes. ``ValueError`` / :class:`CheckpointError` naming the file."""
    changed = changed_settings(state.get("config"), config) if config is not None else []
    if changed and not allow_changes:
        raise ValueError(
            f"cannot resume {path}: the run was started with other settings ({'; '.join(changed)}). Resume with "
            f"the checkpoint's settings, or pass --resume-with-changes (GRPOConfig.resume_with_changes=True) to "
            f"continue with the new ones"
        )
    if model is None:
        return
    expected = _base_names(model.state_dict())  # (a model that already is a peft model: its base's names too)
    for key in ("model", "ref_model"):
        if state[key] is None:
            continue
        saved = _base_names({**state[key], **(state.get("frozen", {}) if key == "model" else {})})
        if saved != expected:
            missing, extra = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
            shapes = sorted(k for k in set(saved) & set(expected) if saved[k] != expected[k])
            what = "; ".join(part for part in (
                f"missing {missing[:3]}" if missing else "", f"unexpected {extra[:3]}" if extra else "",
                f"other shapes for {[(k, saved[k], expected[k]) for k in shapes[:3]]}" if shapes else "") if part)
            raise CheckpointError(f"{path} holds another model's weights ({key}: {what}): resume with the model it "
                                  f"was written for, or choose another --output-dir")


def restore(state: dict[str, Any], path: str, policy: torch.nn.Module, ref_policy: Optional[torch.nn.Module],
            optimizer: torch.optim.Optimizer) -> int:
    """Load a :func:`read` state into the run's policy, reference and optimizer, and set the RNG
    states (every rank); returns the steps done. A state that does not fit is a :class:`CheckpointError`
    naming the file."""
    try:
        distributed.load_model_state(policy, state["model"], frozenset(state.get("frozen", ())))
        if ref_policy is not None and state["ref_model"] is not None:
            distributed.load_model_state(ref_policy, state["ref_model"])
        distributed.load_optimizer_state(policy, optimizer, state["optimizer"])
        set_rng_state(distributed.this_ranks(state["rng"]))
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as e:
        raise CheckpointError(f"cannot resume from {path}: {type(e).__name__}: {e}") from e
    return int(state["step"])


def load(path: str, policy: torch.nn.Module, ref_policy: Optional[torch.nn.Module], optimizer: torch.optim.Optimizer,
         config: Optional[dict[str, Any]] = None, allow_changes: bool = False) -> int:
    """Restore everything ``save`` wrote (every rank reads the file); returns the steps done.

    With ``config`` (``dataclasses.asdict`` of the resuming run's), a setting that differs from the
    one the checkpoint was written with (:func:`changed_settings`) is a ``ValueError`` naming it,
    before anything is restored, unless ``allow_changes`` (``GRPOConfig.resume_with_changes``). The
    trainer itself reads and checks the file before its model changes (:func:`read`,
    :func:`check_resumable`), then restores (:func:`restore`).
    """
    state = read(path)
    check_resumable(state, path, None, config, allow_changes)
    return restore(state, path, policy, ref_policy, optimizer)


# --------------------------------------------------------------------------------------------------
# one run per output directory
# --------------------------------------------------------------------------------------------------
def check_output_dir(output_dir: str, resume: bool) -> None:
    """A fresh run never replaces an earlier run's checkpoint: ``FileExistsError`` naming the
    directory and the two ways on (``--resume``, or another ``--output-dir``)."""
    path = path_in(output_dir)
    if not resume and os.path.exists(path):
        raise FileExistsError(
            errno.EEXIST,
            f"{output_dir} already holds a checkpoint from an earlier run: pass --resume (GRPOConfig.resume=True) "
            f"to continue it, or choose another --output-dir",
            path,
        )


class OutputDirInUse(RuntimeError):
    """Another live process is training into the same output directory."""


def check_not_in_use(output_dir: str) -> None:
    """:class:`OutputDirInUse` when a live run holds ``output_dir``'s lock; creates nothing (a directory
    without a lock file is free). A probe: the run still takes the lock itself (:class:`RunLock`)."""
    path = os.path.join(output_dir, LOCK_FILENAME)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # (shared: two probes never refuse each other)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        raise OutputDirInUse(f"{output_dir} is in use by another training run (pid {holder}, lock {path}): wait for it to "
                             f"finish, or choose another --output-dir") from None
    finally:
        os.close(fd)  # (releases the probe's lock)


class RunLock:
    """An exclusive ``flock`` on ``<output_dir>/run.lock`` for the life of a run (rank 0 takes it).

    Two trainers on one directory would interleave ``log.jsonl`` and share ``checkpoint.pt.tmp``: the
    second refuses, naming the directory and the holder's pid. The kernel drops the lock when its
    process dies (SIGKILL included), so the file a killed run leaves behind never blocks ``--resume``.
    A context manager; ``enabled=False`` (the other ranks) takes nothing.
    """

    def __init__(self, output_dir: str, enabled: bool = True) -> None:
        self.output_dir, self.enabled, self._fd = output_dir, enabled, None

    def __enter__(self) -> "RunLock":
        if not self.enabled:
            return self
        os.makedirs(self.output_dir, exist_ok=True)
        path = os.path.join(self.output_dir, LOCK_FILENAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise OutputDirInUse(
                f"{self.output_dir} is in use by another training run (pid {holder}, lock {path}): wait for it to "
                f"finish, or choose another --output-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock (the file stays: harmless without the lock)
            self._fd = None


class StopOnSigterm:
    """SIGTERM (a scheduler's pre-emption, ``kill``, ``docker stop``) asks the run to stop, not to die:
    the handler only sets a flag; the trainer finishes the step, writes a checkpoint (atomically, as
    any checkpoint) and calls :meth:`exit`. A context manager restoring the previous handler; outside
    the main thread (where no handler can be installed) it does nothing.
    """

    def __init__(self) -> None:
        self.requested, self._previous = False, None

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def __enter__(self) -> "StopOnSigterm":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def agreed(self) -> bool:
        """Whether any rank was asked to stop (all ranks then save and stop together)."""
        return bool(distributed.all_reduce(float(self.requested), "max"))

    def exit(self, path: str, step: int) -> None:
        """After the checkpoint of ``step`` is written: say so, and exit as SIGTERM's default would (143)."""
        if distributed.is_main_process():
            print(f"SIGTERM: stopped after step {step}; checkpoint written to {path}. Continue with --resume "
                  f"(GRPOConfig.resume=True)", file=sys.stderr, flush=True)
        raise SystemExit(128 + signal.SIGTERM)
