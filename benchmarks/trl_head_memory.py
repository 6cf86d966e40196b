"""TRL's fused LM head against ours on the CPU: peak extra memory of one forward+backward.

    PYTHONPATH=$PWD python -m benchmarks.trl_head_memory            # H 512, V 32,768, fp32, N 2,048 and 4,096
    PYTHONPATH=$PWD python -m benchmarks.trl_head_memory --tokens 1024 2048 --hidden 256

Both heads get the same fp32 hidden states [N, H] and lm_head weight [V, H] (both requiring grad) and
return per-token log-probs and entropies, as GRPOTrainer asks of the policy's head; the backward is
that of ``log_probs.sum()`` (the entropy computed, not differentiated: TRL's default, no entropy
bonus). TRL's head is ``trl.kernels.ChunkedLogProbFunction`` exactly as ``add_fused_lm_head`` calls it
on a CPU (every position, vocabulary chunk 32,768, its torch fallback for the Triton tile kernels);
ours is ``grpo_kernels.fused_linear_token_logprobs(..., backend="torch")`` with the default chunk.

Each (head, N) runs in a fresh process, and memory is measured two ways: the PyTorch profiler's
allocation events (peak of their running sum: the project's CPU method, ``benchmarks.profiling``),
and the process's resident-set high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``
just before the call, so only the call's growth counts). The one timing is indicative only (a single
run on a shared machine); memory is the point.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from benchmarks.profiling import cpu_peak_extra_bytes

    head, n, h, v = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.manual_seed(0)
    hidden = torch.randn(n, h, requires_grad=True)
    weight = (torch.randn(v, h) / h**0.5).requires_grad_()
    targets = torch.randint(0, v, (n,))

    if head == "trl":
        from trl.kernels import ChunkedLogProbFunction
        def run():
            logp, entropy, *_ = ChunkedLogProbFunction.apply(
                hidden, weight, None, targets, 1.0, 32768, None, 1.0, ("log_probs", "entropy"))
            logp.sum().backward()
    else:
        import grpo_kernels
        def run():
            logp, entropy = grpo_kernels.fused_linear_token_logprobs(
                hidden, weight, targets, return_entropy=True, backend="torch")
            logp.sum().backward()

    def hwm_kib():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1])

    run()  # warm-up: lazy imports, allocator pools
    hidden.grad = weight.grad = None
    profiler_peak, method = cpu_peak_extra_bytes(run)
    hidden.grad = weight.grad = None
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start_kib = hwm_kib()
    t0 = time.perf_counter()
    run()
    seconds = time.perf_counter() - t0
    rss_peak = (hwm_kib() - start_kib) * 1024
    print(json.dumps({"profiler_bytes": profiler_peak, "method": method, "rss_bytes": rss_peak, "seconds": seconds}))
    """
)


def measure(head: str, n: int, h: int, v: int) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # freed big buffers go back to the OS at once
    out = subprocess.run([sys.executable, "-c", CHILD, head, str(n), str(h), str(v)],
                         capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.0f} MiB" if nbytes < 2**30 else f"{nbytes / 2**30:.2f} GiB"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for the children")
    parser.add_argument("--out", default=None, help="write the table to this file too")
    args = parser.parse_args(argv)
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch
    import trl

    lines = []

    def write(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    write(f"H {args.hidden}, V {args.vocab}, fp32, CPU, forward (log-probs + entropy) + backward of log_probs.sum(); "
          f"torch {torch.__version__}, trl {trl.__version__}")
    write("| N tokens | TRL: profiler peak | TRL: RSS growth | TRL: time | ours: profiler peak | ours: RSS growth | ours: time |")
    write("|---:|---:|---:|---:|---:|---:|---:|")
    for n in args.tokens:
        r = {head: measure(head, n, args.hidden, args.vocab) for head in ("trl", "ours")}
        write(f"| {n:,} | " + " | ".join(
            f"{mib(r[h]['profiler_bytes'])} | {mib(r[h]['rss_bytes'])} | {r[h]['seconds']:.2f} s" for h in ("trl", "ours")
        ) + " |")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
