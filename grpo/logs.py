"""Run logs: one JSON object per step in ``log.jsonl`` (the PNG of its curves: ``grpo.plot``).

Only the main process writes (the trainer decides, in one place, by passing ``enabled``).
"""

from __future__ import annotations

import json
import math
import os
from typing import Iterable, Optional

import torch

from . import distributed
from .atomic import write_atomically


# metrics of the loss that are extremes over sequences or tokens (TRL's clip extremes, the rollout correction's)
EXTREME_KEYS = ("clip_ratio/low_min", "clip_ratio/high_max", "sampling/sampling_logp_difference/max",
                "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/max")
# verl's metrics reduced by loss_agg_mode against the batch's counts (the trainer's BatchTotals): a call's
# value is its share of the batch's, times dp_size
SHARE_KEYS = ("actor/entropy", "actor/kl_loss")


class LossMetrics:
    """The loss's metrics over an update's micro-batches and ranks, each reduced as its kind needs.

    Most metrics are token means (weighted by each micro-batch's loss tokens); those named in
    ``per_sequence`` are sequence means (weighted by its sequences); :data:`EXTREME_KEYS` take the
    extreme; :data:`SHARE_KEYS` are already a call's share of the batch's value and are summed (then
    divided by the calls, each share having been multiplied by the ranks). A micro-batch without loss
    tokens (a filler) weighs nothing.
    """

    def __init__(self, per_sequence: frozenset) -> None:
        self.per_sequence = per_sequence
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.summed: dict[str, float] = {}
        self.extremes: dict[str, float] = {}

    def add(self, metrics: dict, tokens: float, sequences: int) -> None:
        """One micro-batch's metrics (0-d tensors), its loss tokens and its sequences."""
        for k, v in metrics.items():  # (every rank has every key, fillers included)
            if k in EXTREME_KEYS:
                if tokens and math.isfinite(v.item()):
                    pick = min if k.endswith("min") else max
                    self.extremes[k] = pick(self.extremes.get(k, v.item()), v.item())
                continue
            if k in SHARE_KEYS:
                self.summed[k] = self.summed.get(k, 0.0) + v.item()
                continue
            weight = sequences if k in self.per_sequence else tokens
            self.sums[k] = self.sums.get(k, 0.0) + (v.item() * weight if tokens else 0.0)
            self.weights[k] = self.weights.get(k, 0.0) + (weight if tokens else 0.0)

    def reduce(self, losses: list, iterations: int) -> tuple[dict[str, float], list]:
        """(the metrics over every rank, the per-iteration losses summed over the ranks / the ranks), in one
        all-reduce (each rank's loss, and each share, was scaled by the world size)."""
        keys, share_keys = list(self.sums), list(self.summed)
        reduced = distributed.all_reduce(torch.tensor(
            [self.sums[k] for k in keys] + [self.weights[k] for k in keys] + [self.summed[k] for k in share_keys]
            + list(losses), dtype=torch.float64))
        n, m = len(keys), len(share_keys)
        losses = (reduced[2 * n + m :] / distributed.world_size()).tolist()
        logs = {k: float(v) / max(float(w), 1.0) for k, v, w in zip(keys, reduced[:n], reduced[n : 2 * n])}
        calls = distributed.world_size() * iterations
        logs.update({k: float(v) / calls for k, v in zip(share_keys, reduced[2 * n : 2 * n + m])})
        logs.update(self.global_extremes())
        return logs, losses

    def global_extremes(self) -> dict[str, float]:
        """``*_min`` / ``*_max`` metrics over every rank (each rank holds the same keys when any has
        tokens; a rank without sends +-inf, which the reduction ignores)."""
        keys = sorted(EXTREME_KEYS)
        signed = torch.tensor([(-1.0 if k.endswith("_min") else 1.0)
                               * self.extremes.get(k, -math.inf if k.endswith("_max") else math.inf)
                               for k in keys], dtype=torch.float64)
        reduced = distributed.all_reduce(signed, "max")  # max of -x is -(min of x)
        out = {}
        for k, v in zip(keys, reduced.tolist()):
            value = -v if k.endswith("_min") else v
            if math.isfinite(value):
                out[k] = value
        return out


# Steps in a row in which every group's rewards were all equal (every advantage 0: nothing is learned)
# before the log and the progress bar say so.
ZERO_SIGNAL_PATIENCE = 5


class ZeroSignalWatch:
    """Counts the steps in a row whose groups all had zero signal (``zero_signal_frac == 1``).

    ``update(record)`` returns the fields to add to that step's record: ``zero_signal_steps`` (the
    count), and, from :data:`ZERO_SIGNAL_PATIENCE` steps on, a ``warning`` that names the likely causes.
    A resumed run starts from the count its log's last records give, so its records are the
    uninterrupted run's.
    """

    def __init__(self, records: Iterable[dict] = (), patience: int = ZERO_SIGNAL_PATIENCE) -> None:
        self.patience, self.streak = patience, 0
        for record in records:
            self._count(record)

    def _count(self, record: dict) -> None:
        self.streak = self.streak + 1 if record.get("zero_signal_frac") == 1.0 else 0

    def update(self, record: dict) -> dict:
        self._count(record)
        out: dict = {"zero_signal_steps": self.streak}
        if self.streak >= self.patience:
            out["warning"] = (
                f"no learning signal for {self.streak} steps: in every group all completions got the same reward "
                f"(every advantage is 0). Check the reward functions and the data's columns (e.g. a missing "
                f"answer), or raise num_generations / the sampling temperature"
            )
        return out


# What a step's record says about the machine, not the run: a resumed run logs the same record except these.
MEASURED_KEYS = ("step_time", "generate_time", "tokens_per_s", "peak_memory_mb")
MEASURED_PREFIXES = ("time/", "memory/")  # the phase timings (time/generate ... time/update) and peaks (grpo.memory)


def run_values(record: dict) -> dict:
    """``record`` without its measurements of the machine (:data:`MEASURED_KEYS`, ``time/*``, ``memory/*``)."""
    return {k: v for k, v in record.items() if k not in MEASURED_KEYS and not k.startswith(MEASURED_PREFIXES)}


class RunLog:
    """Appends per-step records to ``path`` (JSONL) and keeps them in ``records``.

    resume_step: keep the records of an existing log up to this step (a resumed run redoes the later
    ones); None: start a new log.
    """

    def __init__(self, path: str, enabled: bool = True, resume_step: Optional[int] = None) -> None:
        self.path, self.enabled = path, enabled
        self.records: list[dict] = read_jsonl(path) if resume_step is not None else []
        self.records = [r for r in self.records if r.get("step", 0) <= (resume_step or 0)]
        if enabled:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            write_jsonl_atomic(path, self.records)  # a resumed run drops the steps after its checkpoint

    def amend(self, fields: dict) -> dict:
        """Add ``fields`` to the last record (measured after it was written: a checkpoint's save), rewriting
        the log atomically; returns the record."""
        if not self.records or not fields:
            return self.records[-1] if self.records else {}
        self.records[-1] = {**self.records[-1], **{k: None if isinstance(v, float) and not math.isfinite(v) else v
                                                   for k, v in fields.items()}}
        if self.enabled:
            write_jsonl_atomic(self.path, self.records)
        return self.records[-1]

    def write(self, record: dict) -> dict:
        """Append one step's record; NaN / inf values (e.g. a mean over nothing) are written as null."""
        record = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        self.records.append(record)
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        return record


def read_jsonl(path: str) -> list[dict]:
    """The records of a run's log; a last line cut short (the run was killed while writing it) is dropped.

    Any other line that is not a JSON object is an error naming the file and line: the log is the
    run's own, so that is damage, not something to skip over.
    """
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    records = []
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if line_no == len(lines):  # no newline after it: the write was torn
                break
            raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg}, column {e.colno})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{line_no}: expected a JSON object, got {type(record).__name__}")
        records.append(record)
    return records


def write_jsonl_atomic(path: str, records: Iterable[dict]) -> None:
    write_atomically(path, lambda f: f.write("".join(json.dumps(r) + "\n" for r in records).encode()))
