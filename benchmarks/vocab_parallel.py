"""Vocabulary-parallel GRPO loss against gathering the vocabulary, W gloo processes (benchmarks/README.md)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import time

import torch
import torch.multiprocessing as mp

from benchmarks import harness as H


def meter_collectives(dist) -> dict:
    """Wraps ``all_reduce`` and ``all_gather``: the bytes this rank puts in, the calls and their seconds (reset per step)."""
    meter = {"bytes": 0, "calls": 0, "seconds": 0.0}
    for name in ("all_reduce", "all_gather"):
        def wrapped(first, *args, _original=getattr(dist, name), **kwargs):
            tensor = first if isinstance(first, torch.Tensor) else args[0]  # all_reduce(tensor), all_gather(list, tensor)
            meter["bytes"] += tensor.numel() * tensor.element_size()
            meter["calls"] += 1
            meter["seconds"] -= time.perf_counter()
            out = _original(first, *args, **kwargs)
            meter["seconds"] += time.perf_counter()
            return out
        setattr(dist, name, wrapped)
    return meter


def _worker(rank: int, world: int, args: argparse.Namespace, store_path: str, out_path: str) -> None:
    import torch.distributed as dist

    import grpo_kernels as gk

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    meter = meter_collectives(dist)
    sizes = [args.vocab // world + (1 if r < args.vocab % world else 0) for r in range(world)]
    cols = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
    b, t = 2, args.tokens // 2
    g = torch.Generator().manual_seed(0)
    logits_full = torch.randn(b, t, args.vocab, generator=g)
    ids = torch.randint(0, args.vocab, (b, t), generator=g)
    adv, mask = torch.randn(b, generator=g), torch.ones(b, t)
    old = torch.log_softmax(logits_full, -1).gather(-1, ids[..., None])[..., 0] + 0.1 * torch.randn(b, t, generator=g)
    shard = logits_full[..., cols].contiguous()
    del logits_full
    hidden = torch.randn(b, t, args.hidden, generator=g)
    weight_shard = (torch.randn(args.vocab, args.hidden, generator=g) * 0.05)[cols].contiguous()
    group = dist.group.WORLD
    kw = dict(old_logps=old, beta=0.0, loss_type="dapo", backend="torch")

    def vp_logits():
        x = shard.clone().requires_grad_()
        gk.grpo_loss(x, ids, adv, mask, process_group=group, **kw).loss.backward()
        return x.grad

    widest = max(sizes)  # gloo gathers equal sizes: uneven shards travel padded to the widest

    def gathered(local: torch.Tensor, dim: int) -> torch.Tensor:
        pad = [0, 0] * (local.dim() - 1 - dim) + [0, widest - local.shape[dim]]
        parts = [torch.empty_like(torch.nn.functional.pad(local, pad)) for _ in sizes]
        dist.all_gather(parts, torch.nn.functional.pad(local, pad))
        return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim)

    def gather_logits():
        full = gathered(shard, 2).requires_grad_()
        gk.grpo_loss(full, ids, adv, mask, **kw).loss.backward()
        return full.grad[..., cols]

    def vp_linear():
        h, w = hidden.clone().requires_grad_(), weight_shard.clone().requires_grad_()
        gk.fused_linear_grpo_loss(h, w, ids, adv, mask, process_group=group, **kw).loss.backward()
        return w.grad

    def gather_weight():
        h, w = hidden.clone().requires_grad_(), gathered(weight_shard, 0).requires_grad_()
        gk.fused_linear_grpo_loss(h, w, ids, adv, mask, **kw).loss.backward()
        return w.grad[cols]

    impls = {fn.__name__: fn for fn in (vp_logits, gather_logits, vp_linear, gather_weight)}
    # the two ways agree (the tests check both against float64; this guards the benchmark itself)
    assert torch.allclose(vp_logits(), gather_logits(), rtol=1e-4, atol=1e-7)
    assert torch.allclose(vp_linear(), gather_weight(), rtol=1e-4, atol=1e-6)
    record = {name: {"comm_seconds": [], "bytes": 0, "collectives": 0} for name in impls}

    def after(_round: int, name: str) -> None:  # each timed call: what went through the collectives, then all wait
        record[name]["comm_seconds"].append(meter["seconds"])
        record[name]["bytes"], record[name]["collectives"] = meter["bytes"], meter["calls"]
        dist.barrier()
        meter.update(bytes=0, calls=0, seconds=0.0)

    dist.barrier()
    meter.update(bytes=0, calls=0, seconds=0.0)
    for name, seconds in H.interleave(impls, args.rounds, warmup=False, progress=after).items():
        record[name]["seconds"] = seconds
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"sizes": sizes, "record": record}, f)
    dist.destroy_process_group()


def main(argv=None) -> int:
    args = H.parser(__doc__.split("\n")[0], rounds=5, world=2, tokens=1024, vocab=32000, hidden=256).parse_args(argv)
    report = H.Report(f"Vocabulary-parallel GRPO step vs gathering the vocabulary (CPU, gloo, {args.world} processes)")
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "raw.json")
        mp.start_processes(_worker, args=(args.world, args, os.path.join(tmp, "store"), raw), nprocs=args.world,
                           start_method="spawn")
        with open(raw) as f:
            data = json.load(f)
    times = {name: r["seconds"] for name, r in data["record"].items()}
    report.records = [{"args": vars(args), **data}]
    report.add(f"N = {args.tokens} tokens (B = 2), V = {args.vocab} in shards {data['sizes']}, H = {args.hidden}, fp32, dapo "
               f"with old log-probs, torch backend; forward + backward, {args.rounds} interleaved rounds, medians, rank 0. "
               "`bytes`: what rank 0 puts into collectives in one step.", "", *H.table(
                   ["implementation", "step", "vs gathering", "in collectives", "collectives", "bytes", "bytes / token"],
                   [[name, H.fmt_time(H.median(r["seconds"])),
                     H.fmt_ratio(H.ratio(times, name, "gather_logits" if "logits" in name else "gather_weight")),
                     H.fmt_time(H.median(r["comm_seconds"])), r["collectives"], f"{r['bytes']:,}", f"{r['bytes'] / args.tokens:,.1f}"]
                    for name, r in data["record"].items()]))
    report.write(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
