"""Eager cost of calling the Triton launchers through their torch.library custom ops (issue 27).

``backends.TritonBackend`` calls ``kernels.triton_ops`` (the custom ops) only while torch.compile
traces, and the launchers directly otherwise. This measures what the ops would cost an eager call:
one eager ``grpo_loss`` forward + backward, interleaved in one process, in three modes:

- ``launchers``: the Triton backend as shipped (eager calls the launchers);
- ``custom_ops``: the Triton backend with every launch through ``torch.ops.grpo_kernels.*``;
- ``torch``: ``backend="torch"`` (no Triton; not affected by the ops), for scale.

Rounds alternate the modes; each round times ``--reps`` calls per mode; the report is the median
per call and the median of the per-round ratios. Without CUDA the Triton kernels run in Triton's
interpreter (``TRITON_INTERPRET=1`` is set here), whose run time (hundreds of ms) hides a few
microseconds; so the dispatch itself is also timed apart: a custom op with ``forward_rows``' schema
whose body only allocates the four outputs, against the same Python function called directly
(``--dispatch-calls`` calls per round, interleaved). A ``grpo_loss`` call makes two launches.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/custom_op_overhead.py [--rounds 15 --reps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Optional, Tuple

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import grpo_kernels as gk  # noqa: E402
from grpo_kernels import backends  # noqa: E402
from grpo_kernels.kernels import triton_ops  # noqa: E402


def _outputs_only(logits: torch.Tensor, targets: torch.Tensor, temperature: float, ignore_index: int,
                  with_entropy: bool = True, softcap: Optional[float] = None,
                  logit_scale: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """forward_rows' signature and outputs, no kernel: what is left is the call's own cost."""
    b, t = logits.shape[0], logits.shape[1]
    return tuple(logits.new_empty((b, t)) for _ in range(4))


def dispatch_cost(rounds: int, calls: int) -> Tuple[float, float]:
    """Median per-call seconds of (the custom op, the plain function), interleaved rounds."""
    op = torch.library.custom_op("grpo_kernels_bench::outputs_only", _outputs_only, mutates_args=())
    x, ids = torch.randn(2, 8, 64), torch.zeros(2, 8, dtype=torch.long)
    per = {"op": [], "plain": []}
    for r in range(rounds):
        for name in (("op", "plain") if r % 2 == 0 else ("plain", "op")):
            fn = op if name == "op" else _outputs_only
            fn(x, ids, 1.0, -100)
            start = time.perf_counter()
            for _ in range(calls):
                fn(x, ids, 1.0, -100, with_entropy=True, softcap=None, logit_scale=1.0)
            per[name].append((time.perf_counter() - start) / calls)
    return statistics.median(per["op"]), statistics.median(per["plain"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--shape", type=int, nargs=3, default=(2, 8, 64), metavar=("B", "T", "V"))
    parser.add_argument("--dispatch-calls", type=int, default=2000)
    parser.add_argument("--out", default=None, help="write the printed report to this file too")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    b, t, v = args.shape
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(b, t, v, generator=g).to(device).requires_grad_()
    ids = torch.randint(0, v, (b, t), generator=g).to(device)
    adv = torch.randn(b, generator=g).to(device)
    mask = torch.ones(b, t, device=device)
    old = (torch.randn(b, t, generator=g) * 0.1 - 3.0).to(device)
    launchers = backends.TritonBackend._launchers

    def run(backend: str) -> None:
        loss = gk.grpo_loss(logits, ids, adv, mask, old_logps=old, beta=0.0, backend=backend).loss
        torch.autograd.grad(loss, logits)

    def timed(mode: str) -> float:
        backends.TritonBackend._launchers = classmethod(lambda cls: triton_ops) if mode == "custom_ops" else launchers
        try:
            run("torch" if mode == "torch" else "triton")  # warm
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.reps):
                run("torch" if mode == "torch" else "triton")
            if device == "cuda":
                torch.cuda.synchronize()
            return (time.perf_counter() - start) / args.reps
        finally:
            backends.TritonBackend._launchers = launchers

    modes = ("launchers", "custom_ops", "torch")
    times = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes[r % 3:] + modes[: r % 3]:  # rotate the order between rounds
            times[mode].append(timed(mode))
    ratios = [c / l for c, l in zip(times["custom_ops"], times["launchers"])]
    lines = []

    def write(line: str) -> None:
        print(line)
        lines.append(line)

    write(f"device {device}, logits [{b}, {t}, {v}] fp32, grpo_loss fwd+bwd (dapo, old_logps), "
          f"{args.rounds} rounds x {args.reps} calls, torch {torch.__version__}")
    write("| mode | median per call (ms) |")
    write("|---|---|")
    for mode in modes:
        write(f"| {mode} | {1e3 * statistics.median(times[mode]):.3f} |")
    write(f"\nmedian of per-round ratios custom_ops / launchers: {statistics.median(ratios):.4f} "
          f"(min {min(ratios):.4f}, max {max(ratios):.4f})")
    write(f"median per-call difference custom_ops - launchers: "
          f"{1e6 * statistics.median([c - l for c, l in zip(times['custom_ops'], times['launchers'])]):.1f} us")
    op, plain = dispatch_cost(args.rounds, args.dispatch_calls)
    write(f"\ndispatch alone (forward_rows' schema, outputs only): custom op {1e6 * op:.1f} us, plain function "
          f"{1e6 * plain:.1f} us per call: +{1e6 * (op - plain):.1f} us a launch, "
          f"x2 launches = {2 * (op - plain) / statistics.median(times['torch']):.2%} of the torch path's call")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
