"""The trainer's optimizer step against torch's fused AdamW, on one model's parameters (issue 39).

    python -m benchmarks.optimizer_step                         # Qwen2 4 layers, H 256, V 151,936 (82M), fp32 and bf16
    python -m benchmarks.optimizer_step --dtypes float32 --rounds 9 --out benchmarks/results/optimizer_step-cpu.md
    python -m benchmarks.optimizer_step --vocab 512 --hidden 32 --layers 1 --rounds 1 --out /tmp/o.md   # CI's size

One ``AdamW.step`` (lr 1e-6, betas 0.9 / 0.99, weight decay 0.01, after a warm-up step that creates the
state) over the parameters of a Qwen2-shaped model (embeddings, every layer's attention and MLP
weights, norms and q/k/v biases, untied ``lm_head``; :func:`parameter_shapes`), all trainable, with
fixed random gradients. Sides, per weight dtype:

- ``ours``: ``grpo.trainer.make_optimizer`` (``grpo.precision.adamw``): torch's fused AdamW on fp32
  weights; for bf16 weights ``MasterWeightAdamW`` (the gradients cast to fp32, the fused step on the fp32
  masters, the masters rounded into the weights).
- ``torch-fused``: ``torch.optim.AdamW(fused=True)`` on fp32 parameters of the same shapes: the goal
  (ours <= 1.1x). For bf16 weights this is the fp32 run's step, which the master path adds the two
  casts to.
- ``torch-foreach``: ``torch.optim.AdamW()`` with torch's default (foreach) implementation: what the
  trainer built before (fp32 parameters; for bf16 weights its ``MasterWeightAdamW`` around it).
- ``torch-fused-bf16`` (bf16 only): the fused kernel straight on the bf16 weights, the state in bf16,
  as a trainer without master weights steps them (it loses updates smaller than 2^-9 of a weight:
  ``tests/test_lora.py``); for scale, not a goal.

Rounds interleave the sides (the order rotates); the table gives the median step per side and the
median of the per-round ratios to ``torch-fused``, with the machine's load average. On CUDA each step is
timed between two synchronisations. ``--out`` writes the markdown table there and the JSON records
beside it (``.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from typing import Callable, Optional

import torch

HYPER = dict(lr=1e-6, betas=(0.9, 0.99), weight_decay=0.01)


def parameter_shapes(vocab: int, hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int) -> list[tuple]:
    """The parameter shapes of a Qwen2 causal LM (untied head), in ``named_parameters`` order."""
    head_dim = hidden // heads
    layer = [(heads * head_dim, hidden), (heads * head_dim,), (kv_heads * head_dim, hidden), (kv_heads * head_dim,),
             (kv_heads * head_dim, hidden), (kv_heads * head_dim,), (hidden, heads * head_dim),
             (intermediate, hidden), (intermediate, hidden), (hidden, intermediate), (hidden,), (hidden,)]
    return [(vocab, hidden)] + layer * layers + [(hidden,), (vocab, hidden)]


def load_average() -> Optional[str]:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return None


class Holder(torch.nn.Module):
    """The parameters as a module, for ``grpo.trainer.make_optimizer`` (which reads ``model.parameters()``)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__()
        self.params = torch.nn.ParameterList(params)


def build_sides(shapes: list[tuple], dtype: torch.dtype, device: torch.device) -> dict[str, tuple[Callable, list]]:
    """{side: (step function, its parameters)}, every parameter holding a fixed random gradient."""
    from grpo.config import GRPOConfig
    from grpo.precision import MasterWeightAdamW
    from grpo.trainer import make_optimizer

    g = torch.Generator(device="cpu").manual_seed(0)

    def params(dt: torch.dtype) -> list[torch.nn.Parameter]:
        out = []
        for shape in shapes:
            p = torch.nn.Parameter((torch.randn(shape, generator=g) * 0.02).to(device, dt))
            p.grad = (torch.randn(shape, generator=g) * 1e-3).to(device, dt)
            out.append(p)
        return out

    cfg = GRPOConfig(output_dir=os.devnull, learning_rate=HYPER["lr"], adam_beta1=HYPER["betas"][0],
                     adam_beta2=HYPER["betas"][1], weight_decay=HYPER["weight_decay"])
    sides = {}
    ours = params(dtype)
    sides["ours"] = make_optimizer(Holder(ours), cfg), ours
    fp32 = params(torch.float32)
    sides["torch-fused"] = torch.optim.AdamW(fp32, fused=True, **HYPER), fp32
    old = params(dtype)
    sides["torch-foreach"] = (MasterWeightAdamW if dtype != torch.float32 else torch.optim.AdamW)(old, **HYPER), old
    if dtype != torch.float32:
        plain = params(dtype)
        sides["torch-fused-bf16"] = torch.optim.AdamW(plain, fused=True, **HYPER), plain
    return sides


def timed_step(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], grads: list[torch.Tensor],
               device: torch.device) -> float:
    for p, grad in zip(params, grads):  # (the master path frees nothing of these: only its fp32 copies)
        p.grad = grad
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def measure(shapes: list[tuple], dtype: torch.dtype, rounds: int, device: torch.device) -> list[dict]:
    sides = build_sides(shapes, dtype, device)
    grads = {name: [p.grad for p in params] for name, (_, params) in sides.items()}
    for name, (optimizer, params) in sides.items():  # warm-up: AdamW's state is created here
        timed_step(optimizer, params, grads[name], device)
    names, records = list(sides), []
    for rnd in range(rounds):
        order = names[rnd % len(names):] + names[: rnd % len(names)]
        for name in order:
            optimizer, params = sides[name]
            seconds = timed_step(optimizer, params, grads[name], device)
            records.append({"dtype": str(dtype).replace("torch.", ""), "side": name, "round": rnd, "step_s": seconds,
                            "fused": bool(optimizer.param_groups[0].get("fused")), "optimizer": type(optimizer).__name__})
    return records


def table(records: list[dict], parameters: int, load_before: Optional[str], load_after: Optional[str], device: torch.device) -> str:
    lines = [
        f"## The optimizer step against torch's fused AdamW (`python -m benchmarks.optimizer_step`)",
        "",
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {device.type}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch thread(s); {parameters / 1e6:.1f}M parameters, all trainable; load average "
        f"{load_before} before, {load_after} after; medians over interleaved rounds, ratios are per-round ratios to "
        "`torch-fused`, medianed.",
        "",
        "| weights | side | optimizer | fused | rounds | step | x torch-fused |",
        "|---|---|---|---|---|---|---|",
    ]
    for dtype in dict.fromkeys(r["dtype"] for r in records):
        mine = [r for r in records if r["dtype"] == dtype]
        base = {r["round"]: r["step_s"] for r in mine if r["side"] == "torch-fused"}
        for side in dict.fromkeys(r["side"] for r in mine):
            rs = [r for r in mine if r["side"] == side]
            step = statistics.median(r["step_s"] for r in rs)
            ratio = statistics.median(r["step_s"] / base[r["round"]] for r in rs)
            lines.append(f"| {dtype} | {side} | {rs[0]['optimizer']} | {'yes' if rs[0]['fused'] else 'no'} | {len(rs)} | "
                         f"{step * 1e3:.1f} ms | {ratio:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=None, help="MLP width (default 4 x hidden)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=None, help="markdown table here, JSON records beside it (.jsonl)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        parser.error("--hidden must be a multiple of --heads, and --heads of --kv-heads")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = parameter_shapes(args.vocab, args.hidden, args.layers, args.intermediate or 4 * args.hidden, args.heads,
                              args.kv_heads)
    parameters = sum(torch.Size(s).numel() for s in shapes)
    load_before, records = load_average(), []
    for name in args.dtypes:
        records += measure(shapes, getattr(torch, name), args.rounds, device)
    text = table(records, parameters, load_before, load_average(), device)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
        with open(os.path.splitext(args.out)[0] + ".jsonl", "w") as f:
            for r in records:
                f.write(json.dumps({**r, "parameters": parameters, "device": device.type}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
