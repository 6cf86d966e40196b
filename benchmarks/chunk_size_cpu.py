"""fused_linear_grpo_loss forward+backward time against the chunk size, as a ratio to the reference.

    PYTHONPATH=$PWD python benchmarks/chunk_size_cpu.py 4096x512x32000 256,512,1024,2048 --repeats 3

The measurement behind ``grpo_kernels.autograd.MACHINE_BALANCE["cpu"]``: every chunk size and the
reference run once per round, in turn (interleaved); the ratios are medians over rounds of the
per-round ratio. Same inputs and options as ``side_by_side_fused_linear.py`` (fp32, dapo, beta 0.04).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_by_side_fused_linear import BETA, EPS, leaves, make_inputs, ours  # noqa: E402

import grpo_kernels as gk  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", help="NxHxV")
    parser.add_argument("chunks", help="comma-separated chunk sizes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the printed lines to this file too")
    args = parser.parse_args(argv)
    n, h, v = (int(s) for s in args.shape.split("x"))
    x = make_inputs(n, h, v, torch.device("cpu"))

    def with_chunk(c: int):
        hidden, weight = leaves(x)

        def run():
            out = gk.fused_linear_grpo_loss(hidden, weight, x["ids"], x["adv"], x["mask"], old_logps=x["old"],
                                            ref_logps=x["ref"], beta=BETA, eps_low=EPS, chunk_size=c)
            torch.autograd.grad(out.loss, [hidden, weight])
        return run

    fns = {int(c): with_chunk(int(c)) for c in args.chunks.split(",")}
    fns["reference"] = ours(x, "reference")
    times = {k: [] for k in fns}
    for _ in range(args.repeats):
        for k, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - start)
    default = gk.autograd.default_chunk_size(v, h, torch.float32, torch.device("cpu"), n)
    lines = [f"N={n} H={h} V={v} fp32, default_chunk_size -> {default}; reference {statistics.median(times['reference']):.2f} s"]
    for k in fns:
        if k != "reference":
            ratio = statistics.median(a / b for a, b in zip(times[k], times["reference"]))
            lines.append(f"chunk {k:5d}: {statistics.median(times[k]):.2f} s, {ratio:.2f} of the reference")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
