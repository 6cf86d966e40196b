"""Eager cost of calling the Triton launchers through their torch.library custom ops (issue 27; benchmarks/README.md)."""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import grpo_kernels as gk  # noqa: E402
from benchmarks import harness as H  # noqa: E402
from grpo_kernels import backends  # noqa: E402
from grpo_kernels.kernels import triton_ops  # noqa: E402


def _outputs_only(logits: torch.Tensor, targets: torch.Tensor, temperature: float, ignore_index: int,
                  with_entropy: bool = True, softcap: Optional[float] = None,
                  logit_scale: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """forward_rows' signature and outputs, no kernel: what is left is the call's own cost."""
    return tuple(logits.new_empty(logits.shape[:2]) for _ in range(4))


def main(argv=None) -> int:
    p = H.parser(__doc__.splitlines()[0], rounds=15, reps=(5, "calls per side per round"), dispatch_calls=2000)
    p.add_argument("--shape", type=int, nargs=3, default=(2, 8, 64), metavar=("B", "T", "V"))
    args = p.parse_args(argv)
    device = H.device()
    b, t, v = args.shape
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(b, t, v, generator=g).to(device).requires_grad_()
    ids, adv = torch.randint(0, v, (b, t), generator=g).to(device), torch.randn(b, generator=g).to(device)
    old, mask = (torch.randn(b, t, generator=g) * 0.1 - 3.0).to(device), torch.ones(b, t, device=device)
    launchers = backends.TritonBackend._launchers

    def side(mode: str):
        def run():
            backends.TritonBackend._launchers = classmethod(lambda cls: triton_ops) if mode == "custom_ops" else launchers
            try:
                for _ in range(args.reps):
                    loss = gk.grpo_loss(logits, ids, adv, mask, old_logps=old, backend="torch" if mode == "torch" else "triton").loss
                    torch.autograd.grad(loss, logits)
            finally:
                backends.TritonBackend._launchers = launchers
        return run

    times = H.interleave({m: side(m) for m in ("launchers", "custom_ops", "torch")}, args.rounds, device)
    per_call = {m: [s / args.reps for s in ts] for m, ts in times.items()}
    op = torch.library.custom_op("grpo_kernels_bench::outputs_only", _outputs_only, mutates_args=())
    x, zeros = torch.randn(2, 8, 64), torch.zeros(2, 8, dtype=torch.long)
    calls = lambda fn: lambda: [fn(x, zeros, 1.0, -100, with_entropy=True, softcap=None, logit_scale=1.0)  # noqa: E731
                                for _ in range(args.dispatch_calls)]
    dispatch = {k: H.median(ts) / args.dispatch_calls for k, ts in
                H.interleave({"op": calls(op), "plain": calls(_outputs_only)}, args.rounds).items()}
    diff = H.median([c - launch for c, launch in zip(per_call["custom_ops"], per_call["launchers"])])
    report = H.Report("Custom-op overhead (`python -m benchmarks.custom_op_overhead`)")
    report.records = [{"per_call_s": per_call, "dispatch_s": dispatch, "shape": args.shape, "device": device.type}]
    report.add(f"{device.type}, logits [{b}, {t}, {v}] fp32, grpo_loss fwd+bwd (dapo, old_logps), {args.rounds} interleaved "
               f"rounds x {args.reps} calls; medians per call.", "",
               *H.table(["mode", "median per call"], [[m, H.fmt_time(H.median(ts))] for m, ts in per_call.items()]), "",
               f"custom_ops / launchers, median of per-round ratios: {H.fmt_ratio(H.ratio(per_call, 'custom_ops', 'launchers'))}; "
               f"median difference {diff * 1e6:.1f} µs a call.", "",
               f"Dispatch alone (forward_rows' schema, outputs only): custom op {dispatch['op'] * 1e6:.1f} µs, plain function "
               f"{dispatch['plain'] * 1e6:.1f} µs a call: +{(dispatch['op'] - dispatch['plain']) * 1e6:.1f} µs a launch; two "
               f"launches = {2 * (dispatch['op'] - dispatch['plain']) / H.median(per_call['torch']):.2%} of the torch path's call.")
    report.write(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
