"""Side by side on this machine: ``fused_linear_grpo_loss`` (ours) against the reference, Liger-Kernel's
``LigerFusedLinearGRPOLoss`` and TRL's fused head (``trl.kernels.ChunkedLogProbFunction``), forward +
backward, printed as time and peak-memory ratios measured in one run.

    PYTHONPATH=$PWD python benchmarks/side_by_side_fused_linear.py            # the issue-14 table
    PYTHONPATH=$PWD python benchmarks/side_by_side_fused_linear.py --cases 1024x512x32000 --repeats 5

Every implementation gets the same inputs and options: fp32, dapo, beta = 0.04 with reference
log-probs, old log-probs, eps 0.2, temperature 1, every token in the mask, B = N / 512 sequences of
512 tokens; ``torch.autograd.grad(loss, [hidden, weight])``. Timing: ``--repeats`` rounds, each
running every implementation once in a shuffled order (interleaved, so a burst of load from other
processes hits all of them); the table gives each implementation's median time and, for the ratios,
the median over rounds of the per-round ratio. Peak extra memory: one separate run each, from the
PyTorch profiler's allocation events (``benchmarks.profiling.cpu_peak_extra_bytes``), or CUDA's
``max_memory_allocated``. Values and gradients of ours are compared with the reference's.

Liger runs with ``compiled=False`` (``--liger-compiled`` for its torch.compile path) and its default
chunking; TRL's head computes log-probs and entropies (vocabulary tiles of 32,768, TRL's setting),
the O(N) GRPO maths after it is ours (``grpo_kernels.objective``), as TRL's trainer would. Either is
skipped, with the reason printed, when it is not installed.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

import grpo_kernels as gk
from grpo_kernels import objective
from grpo_kernels.options import GRPOInputs, GRPOOptions
from benchmarks.profiling import cpu_peak_extra_bytes, cuda_peak_extra_bytes

DEFAULT_CASES = ["1024x512x32000", "2048x512x32000", "4096x512x32000", "1024x1024x32000", "4096x1024x32000",
                 "1024x1024x151936"]
T = 512
BETA, EPS = 0.04, 0.2


def make_inputs(n: int, h: int, v: int, device: torch.device, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    b = max(1, n // T)
    hidden = torch.randn(b, n // b, h, generator=g)
    weight = torch.randn(v, h, generator=g) / h**0.5 * 2
    ids = torch.randint(0, v, (b, n // b), generator=g)
    mask = torch.ones(b, n // b)
    adv = torch.randn(b, generator=g)
    with torch.no_grad():  # old / reference log-probs near the current ones, as in training
        logp = gk.fused_linear_token_logprobs(hidden, weight, ids)
    old = logp + 0.1 * torch.randn(logp.shape, generator=g)
    ref = logp + 0.1 * torch.randn(logp.shape, generator=g)
    out = dict(hidden=hidden, weight=weight, ids=ids, mask=mask, adv=adv, old=old, ref=ref)
    return {k: t.to(device) for k, t in out.items()}


def leaves(x: dict) -> Tuple[torch.Tensor, torch.Tensor]:
    """hidden and weight as leaves that require grad; made once per implementation, outside the timed
    and measured calls (``torch.autograd.grad`` accumulates nothing into them)."""
    return x["hidden"].detach().clone().requires_grad_(), x["weight"].detach().clone().requires_grad_()


def ours(x: dict, backend: str = "auto") -> Callable[[], Tuple[torch.Tensor, ...]]:
    h, w = leaves(x)

    def run():
        out = gk.fused_linear_grpo_loss(h, w, x["ids"], x["adv"], x["mask"], old_logps=x["old"], ref_logps=x["ref"],
                                        beta=BETA, eps_low=EPS, loss_type="dapo", backend=backend)
        return (out.loss.detach(),) + torch.autograd.grad(out.loss, [h, w])
    return run


def liger(x: dict, compiled: bool) -> Callable[[], Tuple[torch.Tensor, ...]]:
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    module = LigerFusedLinearGRPOLoss(beta=BETA, compiled=compiled, use_ref_model=True, epsilon_low=EPS,
                                      epsilon_high=EPS, loss_type="dapo", temperature=1.0)

    h, w = leaves(x)

    def run():
        out = module(h, w, x["ids"], x["mask"], x["adv"], ref_per_token_logps=x["ref"], old_per_token_logps=x["old"])
        loss = out[0] if isinstance(out, (tuple, list)) else out
        return (loss.detach(),) + torch.autograd.grad(loss, [h, w])
    return run


def trl_head(x: dict) -> Callable[[], Tuple[torch.Tensor, ...]]:
    from trl.kernels import ChunkedLogProbFunction

    options = GRPOOptions(beta=BETA, eps_low=EPS, loss_type="dapo")
    inputs = GRPOInputs(old_logps=x["old"], ref_logps=x["ref"])

    h, w = leaves(x)

    def run():
        out = ChunkedLogProbFunction.apply(h.reshape(-1, h.shape[-1]), w, None, x["ids"].reshape(-1), 1.0, 32768,
                                           None, 1.0, ("entropy",))
        logp, entropy = out[0].view(x["ids"].shape), out[1].view(x["ids"].shape)
        loss = objective.grpo_loss_from_logprobs(logp, entropy, x["adv"], x["mask"], inputs, options).loss
        return (loss.detach(),) + torch.autograd.grad(loss, [h, w])
    return run


def implementations(x: dict, args) -> Tuple[Dict[str, Callable], Dict[str, str]]:
    makers = {"reference": lambda: ours(x, "reference"), "ours": lambda: ours(x, args.backend),
              "liger": lambda: liger(x, args.liger_compiled), "trl": lambda: trl_head(x)}
    impls, skipped = {}, {}
    for name in args.impls.split(","):
        try:
            impls[name] = makers[name]()
        except Exception as exc:  # not installed, or an API that moved
            skipped[name] = f"{type(exc).__name__}: {exc}"
    return impls, skipped


def timed(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def peak(fn: Callable[[], object], device: torch.device) -> int:
    return cuda_peak_extra_bytes(fn, device) if device.type == "cuda" else cpu_peak_extra_bytes(fn)[0]


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)).item()


def run_case(spec: str, args, device: torch.device) -> dict:
    n, h, v = (int(s) for s in spec.split("x"))
    x = make_inputs(n, h, v, device)
    impls, skipped = implementations(x, args)
    for name, reason in skipped.items():
        print(f"  [{spec}] {name} skipped: {reason.splitlines()[0][:160]}", file=sys.stderr)
    # One untimed run each: warm-up, peak memory, and the values to compare.
    results, peaks = {}, {}
    for name, fn in list(impls.items()):
        try:
            holder = {}
            peaks[name] = peak(lambda: holder.setdefault("out", fn()), device)
            results[name] = holder["out"]
        except Exception as exc:
            print(f"  [{spec}] {name} failed: {type(exc).__name__}: {str(exc)[:160]}", file=sys.stderr)
            impls.pop(name)
    errors = {}
    if "reference" in results:
        for name, out in results.items():
            if name != "reference":
                errors[name] = max(max_rel_err(a, b) for a, b in zip(out, results["reference"]))
    del results
    times: Dict[str, List[float]] = {name: [] for name in impls}
    order = list(impls)
    rng = random.Random(0)
    for _ in range(args.repeats):
        rng.shuffle(order)
        for name in order:
            times[name].append(timed(impls[name], device))
    row = dict(case=spec, N=n, H=h, V=v, times=times, peaks=peaks, errors=errors)
    return row


def ratio(row: dict, a: str, b: str) -> Optional[float]:
    ta, tb = row["times"].get(a), row["times"].get(b)
    if not ta or not tb:
        return None
    return statistics.median(x / y for x, y in zip(ta, tb))


def fmt(x: Optional[float], spec: str = "{:.2f}") -> str:
    return "-" if x is None else spec.format(x)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="*", default=DEFAULT_CASES, help="NxHxV, e.g. 4096x512x32000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backend", default="auto", help="ours: auto | torch | triton")
    parser.add_argument("--impls", default="reference,ours,liger,trl", help="a subset, comma-separated")
    parser.add_argument("--liger-compiled", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="write the table to this file too")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    lines = []

    def write(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    write(f"# fused_linear_grpo_loss fwd+bwd, fp32, dapo beta={BETA} old+ref log-probs, {device.type}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.repeats} interleaved rounds")
    write("| N x H x V | ours / reference time | ours / Liger time | ours / TRL time | ours s | reference s | "
          "Liger s | TRL s | ours peak / reference peak | ours peak MiB | reference peak MiB | ours vs ref max rel err |")
    write("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for spec in args.cases:
        row = run_case(spec, args, device)
        med = {k: statistics.median(v) for k, v in row["times"].items() if v}
        pk = row["peaks"]
        mib = lambda b: None if b is None else b / 2**20  # noqa: E731
        mem_ratio = pk["ours"] / pk["reference"] if pk.get("reference") and pk.get("ours") is not None else None
        n, h, v = row["N"], row["H"], row["V"]
        write(f"| {n:,} x {h:,} x {v:,} | {fmt(ratio(row, 'ours', 'reference'))} | {fmt(ratio(row, 'ours', 'liger'))} | "
              f"{fmt(ratio(row, 'ours', 'trl'))} | {fmt(med.get('ours'))} | {fmt(med.get('reference'))} | "
              f"{fmt(med.get('liger'))} | {fmt(med.get('trl'))} | {fmt(mem_ratio)} | {fmt(mib(pk.get('ours')), '{:.0f}')} | "
              f"{fmt(mib(pk.get('reference')), '{:.0f}')} | {fmt(row['errors'].get('ours'), '{:.1e}')} |")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
