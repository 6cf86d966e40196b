"""The trainer's optimizer step against torch's fused AdamW, on one model's parameters (issue 39; benchmarks/README.md)."""

from __future__ import annotations

import os
import sys
from typing import Optional

import torch

from benchmarks import harness as H

HYPER = dict(lr=1e-6, betas=(0.9, 0.99), weight_decay=0.01)


def sides(shapes: list, dtype: torch.dtype, device: torch.device) -> tuple[dict, dict]:
    """({side: one step}, {side: its optimizer}): AdamW over its own copy of parameters of ``shapes``, fixed gradients."""
    from grpo.config import GRPOConfig
    from grpo.precision import MasterWeightAdamW
    from grpo.trainer import make_optimizer

    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(s, generator=g) * 0.02, torch.randn(s, generator=g) * 1e-3) for s in shapes]

    def params(dt: torch.dtype) -> torch.nn.ParameterList:
        out = torch.nn.ParameterList([torch.nn.Parameter(w.to(device, dt)) for w, _ in weights])
        for p, (_, grad) in zip(out, weights):
            p.grad = grad.to(device, dt)
        return out

    cfg = GRPOConfig(output_dir=os.devnull, learning_rate=HYPER["lr"], adam_beta1=HYPER["betas"][0],
                     adam_beta2=HYPER["betas"][1], weight_decay=HYPER["weight_decay"])
    optimizers = {"ours": make_optimizer(params(dtype), cfg),  # fused; 16-bit weights: fp32 masters, one pass
                  "torch-fused": torch.optim.AdamW(params(torch.float32), fused=True, **HYPER),  # the goal: ours <= 1.1x
                  "torch-foreach": (MasterWeightAdamW if dtype != torch.float32 else torch.optim.AdamW)(params(dtype), **HYPER)}
    if dtype != torch.float32:
        optimizers["ours-slices"] = make_optimizer(params(dtype), cfg)  # the masters through torch's ops (three passes)
        optimizers["ours-slices"].native = False
        optimizers["torch-fused-16bit"] = torch.optim.AdamW(params(dtype), fused=True, **HYPER)  # no masters: for scale
    grads = {name: [p.grad for group in o.param_groups for p in group["params"]] for name, o in optimizers.items()}

    def step(name: str):
        def run():
            for p, grad in zip((p for group in optimizers[name].param_groups for p in group["params"]), grads[name]):
                p.grad = grad  # (the master path drops its fp32 copies only)
            optimizers[name].step()
        return run
    return {name: step(name) for name in optimizers}, optimizers


def path(optimizer: torch.optim.Optimizer, device: torch.device) -> str:
    """How ``optimizer`` steps: fused / foreach, and for 16-bit masters one pass or torch's ops in slices."""
    if not optimizer.param_groups[0].get("fused"):
        return "foreach"
    if getattr(optimizer, "_pairs", None):  # (MasterWeightAdamW with 16-bit weights)
        return "fused, one pass" if optimizer._native_kernel(device) else "fused, slices"
    return "fused"


def main(argv: Optional[list[str]] = None) -> int:
    args = H.parser(__doc__.splitlines()[0], rounds=7, vocab=151936, hidden=256, layers=4, heads=4, kv_heads=2,
                    dtypes=(["float32", "bfloat16"], None, ["float32", "bfloat16"])).parse_args(argv)
    device = H.device()
    shape = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                 num_attention_heads=args.heads, num_key_value_heads=args.kv_heads)
    shapes = [p.shape for p in H.qwen2(shape, device="meta").parameters()]
    count = sum(s.numel() for s in shapes)
    report = H.Report("The optimizer step against torch's fused AdamW (`python -m benchmarks.optimizer_step`)")
    report.add(f"{device.type}; a Qwen2 model's {count / 1e6:.1f}M parameters ({args.layers} layers, H {args.hidden}, V "
               f"{args.vocab:,}), all trainable; one warm-up step (AdamW's state), then {args.rounds} interleaved rounds, medians.", "")
    for name in args.dtypes:
        fns, optimizers = sides(shapes, getattr(torch, name), device)
        times = H.interleave(fns, args.rounds, device)
        kind = {n: (type(o).__name__, path(o, device)) for n, o in optimizers.items()}
        report.records += [{"dtype": name, "side": n, "optimizer": kind[n][0], "path": kind[n][1], "parameters": count,
                            "step_s": t, "load_1m": H.load()} for n, t in times.items()]
        report.add(f"## {name} weights", "", *H.timing_table(times, "torch-fused", ["optimizer", "path"], lambda n: kind[n]), "")
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
