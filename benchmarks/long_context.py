"""One GRPO training step at long context, in fresh processes: peak memory and time (benchmarks/README.md)."""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from typing import Callable, Optional

import torch

from benchmarks import harness as H

# the trainer's settings of each mode (each may take "+gc": gradient checkpointing); naive: padded rows,
# [rows, T, V] fp32 logits and log_softmax (the reference loss)
MODES = {"packed": dict(padding_free=True), "padded": dict(padding_free=False, micro_batch_size=1),
         "naive": dict(padding_free=False, micro_batch_size=1, backend="reference")}
VARIANTS = {"full": dict(use_peft=False, model_dtype="float32"), "lora": dict(use_peft=True, model_dtype="float32"),
            "lora+bf16": dict(use_peft=True, model_dtype="bfloat16")}
PROMPT_TOKENS = 256  # prompt length of every sequence (at scale 1)
# `options`' variants (issue 35, grpo.activations; benchmarks/README.md says what each measures)
OPTIONS = {"base": {}, "chunks": {"mlp_chunk_tokens": True}, "offload": {"activation_offload": True},
           "offload-copies": {"copies": True}}


def group_lengths(G: int, median: float, cap: int, sigma: float = 1.0, seed: int = 0) -> list[int]:
    """G lognormal(log median, sigma) sequence lengths capped at ``cap``, the longest at the cap."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(G, generator=g, dtype=torch.float64)
    lengths = [int(min(cap, max(16, round(median * math.exp(sigma * float(v)))))) for v in z]
    lengths[max(range(G), key=lengths.__getitem__)] = cap
    return lengths


def make_batch(lengths: list[int], prompt_tokens: int, vocab_size: int, device="cpu", seed: int = 0):
    """The trainer's ``UpdateBatch`` of sequences of ``lengths`` tokens: prompts left-padded, completions right-padded."""
    from grpo.trainer import UpdateBatch

    g = torch.Generator().manual_seed(seed)
    prompts = [min(prompt_tokens, n - 1) for n in lengths]
    completions = [n - p for n, p in zip(lengths, prompts)]
    B, P, T = len(lengths), max(prompts), max(completions)
    attention_mask = torch.zeros(B, P + T, dtype=torch.long)
    for b, (p, c) in enumerate(zip(prompts, completions)):
        attention_mask[b, P - p: P + c] = 1
    input_ids = torch.randint(0, vocab_size, (B, P + T), generator=g) * attention_mask  # pad id 0
    return UpdateBatch(input_ids.to(device), attention_mask.to(device), P, input_ids[:, P:].to(device),
                       attention_mask[:, P:].clone().to(device), torch.randn(B, generator=g).to(device))


def step(lengths: list[int], mode: str = "packed", size: str = "81M", device: str = "cpu", steps: int = 1,
         prompt_tokens: int = PROMPT_TOKENS, vocab_size: Optional[int] = None, copies: bool = False, **config) -> dict:
    """``steps`` trainer steps of one batch in this process, the last measured: phases, peaks, the plan's prediction (README)."""
    from grpo import activations, models, plan, precision, trainer

    base, _, gc = mode.partition("+")
    if base not in MODES or gc not in ("", "gc"):
        raise ValueError(f"mode must be one of {list(MODES)}, optionally with '+gc', got {mode!r}")
    dev, peak_gib = torch.device(device), lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # (KiB)
    out = {"rss_start_gib": peak_gib()}
    outside = lambda: (lambda free, total: total - free - torch.cuda.memory_reserved(dev))(*torch.cuda.mem_get_info(dev))  # noqa: E731
    if dev.type == "cuda":  # the bare context (and torch's first kernel), before anything else is on the device
        torch.zeros(1, device=dev)
        out["context_gib"] = outside() / 2**30
    cfg = trainer.GRPOConfig(**{"beta": 0.0, "backend": "torch", "gradient_checkpointing": gc == "gc", **MODES[base], **config},
                             output_dir=os.devnull, learning_rate=1e-6, progress=False, plot=False,
                             max_new_tokens=max(lengths), max_tokens_per_microbatch=max(lengths) if base == "packed" else None)
    shape = {**H.MODELS[size], **({"vocab_size": vocab_size} if vocab_size else {})}
    model = H.qwen2(shape, max(lengths), precision.torch_dtype(cfg.model_dtype), dev)
    out["rss_after_model_gib"] = peak_gib()  # the baseline: interpreter, imports and model
    model, policy, ref_policy, optimizer = trainer.setup_training(model, cfg, dev)
    offload = activations.ActivationOffload(dev) if copies else None
    if offload:
        offload.attach(models.unwrap(policy))
    batch, phases = make_batch(lengths, prompt_tokens, shape["vocab_size"], dev), H.Phases(dev)
    out.update(rss_after_setup_gib=peak_gib(), parameters=sum(p.numel() for p in model.parameters()),
               trainable=sum(p.numel() for p in policy.parameters() if p.requires_grad))
    phases.patch(trainer, "policy_loss", "forward+loss")
    phases.patch(torch.Tensor, "backward", "backward")
    phases.patch_optimizer()
    for i in range(steps):
        phases.clear()
        if dev.type == "cuda" and i == steps - 1:
            torch.cuda.reset_peak_memory_stats(dev)
        with phases("step"):
            if cfg.beta:
                with phases("reference"):
                    batch.ref_logps = trainer.completion_logps(ref_policy, batch, cfg, dev)
            policy.train()
            logs = trainer.update(policy, optimizer, batch, cfg, dev)
    phases.restore()
    predicted = plan.plan_for_run(models.unwrap(policy).config, cfg, max(lengths), dev.type)
    out.update(mode=mode, size=size, lengths=lengths, tokens=sum(lengths), config=config, loss=logs["loss"],
               step_s=phases.wall["step"], phases_s=phases.wall, phases_cpu_s=phases.cpu, peak_rss_gib=peak_gib(),
               predicted_peak_gib=predicted.peak / 2**30, predicted_terms_gib={k: v / 2**30 for k, v in predicted.terms.items()},
               predicted_allocator_peak_gib=predicted.allocator_peak / 2**30, predicted_runtime=predicted.runtime,
               predicted_reserve=predicted.reserve, threads=torch.get_num_threads())
    if offload:
        out.update(offload_peak_host_gib=offload.peak_host_bytes / 2**30, offload_copies=[offload.copies_out, offload.copies_in])
    if dev.type == "cuda":
        out.update(peak_allocated_gib=torch.cuda.max_memory_allocated(dev) / 2**30, gpu=torch.cuda.get_device_name(dev),
                   peak_reserved_gib=torch.cuda.max_memory_reserved(dev) / 2**30, outside_allocator_gib=outside() / 2**30)
    return out


def measure(lengths: list[int], budget_gib: Optional[float] = None, timeout_s: Optional[float] = None, **kwargs) -> dict:
    """:func:`step` in a fresh process, killed past ``budget_gib`` of RSS (``{"fits": False}``)."""
    result = H.fresh_call("benchmarks.long_context:step", {"lengths": lengths, **kwargs}, timeout_s=timeout_s,
                          budget_gib=budget_gib)[-1]
    if "error" in result:
        return {"lengths": lengths, **kwargs, "fits": False if "budget" in result["error"] else None, **result}
    return {**result, "fits": None if budget_gib is None else result["peak_rss_gib"] <= budget_gib}


def bisect(mode: str, budget_gib: float, lo: int, hi: int, rel_tol: float = 0.1) -> dict:
    """The longest single-sequence length in [lo, hi] whose step fits in ``budget_gib`` (to ``rel_tol``)."""
    probes = []

    def fits(n: int) -> bool:
        r = measure([n], budget_gib=budget_gib, mode=mode)
        probes.append({"length": n, "fits": r.get("fits"), "peak_rss_gib": r.get("peak_rss_gib", r.get("rss_seen_gib")),
                       "step_s": r.get("step_s")})
        print(json.dumps(probes[-1]), flush=True)
        return bool(r.get("fits"))

    if not fits(lo):
        return {"mode": mode, "budget_gib": budget_gib, "longest": None, "below": lo, "probes": probes}
    if fits(hi):
        return {"mode": mode, "budget_gib": budget_gib, "longest": hi, "at_least": True, "probes": probes}
    while hi / lo > 1 + rel_tol:
        mid = int(round(math.sqrt(lo * hi) / 64) * 64) or lo + 1
        if mid <= lo or mid >= hi:
            break
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return {"mode": mode, "budget_gib": budget_gib, "longest": lo, "first_failing": hi, "probes": probes}


def memory_rows(rows: list[dict]) -> list[str]:
    """Peak RSS of full fine-tuning, LoRA and LoRA + bf16 beside the plan's."""
    full = {(r["size"], r["tokens"]): r["peak_rss_gib"] for r in rows if r.get("variant") == "full" and "peak_rss_gib" in r}
    cells = [[r.get("size"), r.get("variant"), r.get("tokens"), None, r.get("error")] if "peak_rss_gib" not in r else
             [f"{r['size']} ({r['parameters'] / 1e6:.0f}M)", r["variant"], r["tokens"], f"{r['peak_rss_gib']:.2f}",
              f"{r['predicted_peak_gib']:.2f}", f"{r['predicted_peak_gib'] / r['peak_rss_gib']:.2f}",
              H.fmt_ratio(r["peak_rss_gib"] / full[r["size"], r["tokens"]]) if (r["size"], r["tokens"]) in full else None,
              H.fmt_time(r["step_s"])] for r in rows]
    return H.table(["size", "variant", "tokens", "peak RSS GiB", "predicted GiB", "pred / meas", "× full FT", "step"], cells)


def frozen_head(args) -> tuple[list[dict], list[str]]:
    """A frozen head (LoRA) against a trainable one, and its vocabulary blocks against the row chunks of [c, V]
    logits (``rows``: ``TorchBackend.tiles_vocabulary`` off), torch backend, one torch thread (README)."""
    from grpo_kernels import backends, fused_linear_grpo_loss as loss, fused_linear_token_logprobs as logprobs

    torch.set_num_threads(1)  # (so the main thread's CPU time is all of it)
    torch.manual_seed(0)
    N, H_, V, tiles = args.N, args.H, args.V, backends.TorchBackend.tiles_vocabulary
    hidden, weight = torch.randn(1, N, H_) * 0.5, torch.randn(V, H_) * 0.02
    ids, adv, mask = torch.randint(0, V, (1, N)), torch.randn(1), torch.ones(1, N)
    ops = {"loss fwd+bwd": lambda h, w: loss(h, w, ids, adv, mask, loss_type="dapo", backend="torch").loss.backward(),
           "loss fwd+bwd, entropy bonus": lambda h, w: loss(h, w, ids, adv, mask, loss_type="dapo", entropy_coef=0.01,
                                                            backend="torch").loss.backward(),
           "log-probs fwd+bwd": lambda h, w: logprobs(h, w, ids, backend="torch").sum().backward(),
           "log-probs, no_grad": lambda h, w: logprobs(h, w, ids, backend="torch")}

    def side(op: str, name: str) -> Callable[[], None]:
        grad = op != "log-probs, no_grad"
        h, w = hidden.clone().requires_grad_(grad), weight.clone().requires_grad_(name == "trainable")

        def run() -> None:
            backends.TorchBackend.tiles_vocabulary = (lambda self, transform: False) if name == "frozen, rows" else tiles
            try:
                with torch.set_grad_enabled(grad):
                    ops[op](h, w)
            finally:
                backends.TorchBackend.tiles_vocabulary = tiles
        return run

    records, lines = [], [f"N={N}, H={H_}, V={V}, fp32, torch backend, one torch thread; rows: chunks of [c, V] logits (c = "
                          f"default_chunk_size), frozen: the vocabulary in blocks; peak extra bytes of one call, main-thread CPU "
                          f"time of {args.rounds} interleaved rounds, medians:", ""]
    for op in ops:
        names = ("frozen", "frozen, rows") if op == "log-probs, no_grad" else ("trainable", "frozen", "frozen, rows")
        fns = {name: side(op, name) for name in names}
        peaks = {name: H.peak_extra_bytes(fn, torch.device("cpu"))[0] for name, fn in fns.items()}
        times = H.interleave(fns, args.rounds, clock=time.thread_time)
        records.append({"op": op, "N": N, "H": H_, "V": V, "threads": 1, "peak_extra_bytes": peaks, "thread_cpu_s": times})
        lines += [f"**{op}**", "", *H.timing_table(times, "frozen", ["peak extra"], lambda n: [H.fmt_bytes(peaks[n])]), ""]
    return records, lines


def options_lines(rows: list[dict], tokens: int, chunk: int, cuda: bool) -> list[str]:
    """Per variant the peak and time beside the plan's; on CUDA the plan's runtime and reserve (README)."""
    key, planned = ("peak_allocated_gib", "predicted_allocator_peak_gib") if cuda else ("peak_rss_gib", "predicted_peak_gib")
    ok: dict[str, list[dict]] = {}
    for r in (r for r in rows if "error" not in r):
        ok.setdefault(r["variant"], []).append(r)
    base = [r["step_s"] for r in ok.get("base", [])]
    lines = [f"One trainer step, {tokens} tokens (one packed sequence), gradient checkpointing; mlp_chunk_tokens {chunk}.", "",
             *H.table(["variant", "runs", f"peak {'allocated' if cuda else 'RSS'} GiB", "plan's GiB", "step", "× base"],
                      [[v, len(rs), f"{H.median([r[key] for r in rs]):.3f}", f"{rs[0][planned]:.3f}",
                        H.fmt_time(H.median([r["step_s"] for r in rs])),
                        H.fmt_ratio(H.median([r["step_s"] / b for r, b in zip(rs, base)]))] for v, rs in ok.items()]), ""]
    if ok.get("base") and ok.get("chunks"):
        measured = H.median([r[key] for r in ok["base"]]) - H.median([r[key] for r in ok["chunks"]])
        predicted = ok["base"][0]["predicted_peak_gib"] - ok["chunks"][0]["predicted_peak_gib"]
        lines += [f"mlp_chunk_tokens lowers the peak by {measured:.3f} GiB measured, {predicted:.3f} GiB by the plan (its MLP "
                  f"term): measured / plan = {measured / predicted:.2f}." if predicted else "The plan predicts no drop.", ""]
    if cuda:  # docs/memory.md: the runtime and allocator-reserve estimates
        gib = lambda d, pick=lambda k: True: sum(v for k, v in d.items() if pick(k)) / 2**30  # noqa: E731
        lines += H.table(["variant", "CUDA context GiB (measured / plan)", "outside the allocator after the step (context + "
                          "kernel images)", "reserved - allocated at the peak (plan: allocator reserve)"],
                         [[v, f"{r['context_gib']:.3f} / {gib(r['predicted_runtime'], lambda k: k.startswith('context')):.3f}",
                           f"{r['outside_allocator_gib']:.3f} / {gib(r['predicted_runtime'], lambda k: k.startswith(('context', 'kernel images'))):.3f}",
                           f"{r['peak_reserved_gib'] - r['peak_allocated_gib']:.3f} / {gib(r['predicted_reserve']):.3f}"]
                          for v, (r, *_) in ok.items()]) + [""]
    return lines + [f"{r['variant']}: {r['error'][-500:]}" for r in rows if "error" in r]


def options(args) -> tuple[list[dict], list[str]]:
    """The ``options`` command: rounds of every variant, each in a fresh process."""
    cuda, smoke = args.device == "cuda", args.smoke
    size = "wide-mlp-smoke" if smoke else "qwen2.5-0.5b" if cuda else "wide-mlp"
    tokens, chunk = args.tokens or (96 if smoke else 32768 if cuda else 4096), min(args.chunk, 32) if smoke else args.chunk
    rounds = 1 if smoke else args.rounds
    variants = args.variants or (["base", "chunks"] if smoke else ["base", "offload", "chunks"] if cuda else list(OPTIONS))
    peft = cuda and not H.missing("peft")  # CUDA: LoRA on bf16 weights where peft is installed
    rows = []
    for _ in range(rounds):
        for v in dict.fromkeys(["base", *variants]):
            config = {k: chunk if k == "mlp_chunk_tokens" else x for k, x in OPTIONS[v].items()}
            rows.append({"variant": v, **measure([tokens], mode="packed+gc", size=size, device=args.device, steps=2 if cuda else 1,
                                                  prompt_tokens=16, use_peft=peft, model_dtype="bfloat16" if cuda else "float32", **config)})
            print(json.dumps({k: x for k, x in rows[-1].items() if not k.startswith("predicted")}, default=str), flush=True)
    return rows, options_lines(rows, tokens, chunk, cuda)


def memory(args) -> tuple[list[dict], list[str]]:
    """Full fine-tuning vs LoRA vs LoRA + bf16, beta 0.04 (the reference model and its log-probs are part of the step)."""
    rows = [{"size": size, "variant": v, "tokens": n, **measure([n], size=size, beta=0.04, **VARIANTS[v],
                                                                gradient_checkpointing=args.gradient_checkpointing)}
            for size in args.sizes for n in args.lengths for v in args.variants]
    return rows, memory_rows(rows)


def bisect_command(args) -> tuple[list[dict], list[str]]:
    result = bisect(args.mode, args.budget_gib, args.lo, args.hi, args.rel_tol)
    return [result], ["```json", json.dumps(result, indent=1), "```"]


COMMANDS = {"bisect": bisect_command, "memory": memory, "frozen-head": frozen_head, "options": options}


def main(argv: Optional[list[str]] = None) -> int:
    p, common = H.parser(__doc__.splitlines()[0], rounds=None), H.parser(rounds=5, add_help=False)
    sub = p.add_subparsers(dest="cmd", required=True)
    command = lambda name, help_, **flags: H.flags(sub.add_parser(name, help=help_, parents=[common]), **flags)  # noqa: E731
    bis = command("bisect", "longest single sequence that fits in a memory budget", lo=1024, hi=32768, rel_tol=0.1)
    bis.add_argument("--mode", required=True)
    bis.add_argument("--budget-gib", type=float, required=True)
    command("memory", "full FT vs LoRA vs LoRA+bf16: peak RSS and step time beside the plan", sizes=(["81M", "180M"], None, list(H.MODELS)),
            lengths=[1024, 2048], variants=(list(VARIANTS), None, list(VARIANTS)), gradient_checkpointing=False)
    command("frozen-head", "frozen vs trainable lm_head, vocabulary blocks vs row chunks: peak extra bytes, thread CPU time",
            N=2048, H=512, V=151936)
    command("options", "issue 35's mlp_chunk_tokens / activation_offload: peak and time beside the plan",
            tokens=(int, "tokens of the one sequence (default 4096 on a CPU, 32768 on CUDA)"),
            chunk=(512, "mlp_chunk_tokens of the chunks variant"), device=("cpu", None, ("cpu", "cuda")),
            variants=([], "default: all on a CPU; base, offload, chunks on CUDA", list(OPTIONS)),
            smoke=(False, "CI: a tiny model, 96 tokens, one round, base and chunks")).set_defaults(rounds=3)
    args = p.parse_args(argv)
    report = H.Report(f"Long context: `python -m benchmarks.long_context {args.cmd}`")
    report.records, lines = COMMANDS[args.cmd](args)
    report.add(*lines).write(args.out)
    return 1 if any("error" in r for r in report.records) else 0


if __name__ == "__main__":
    sys.exit(main())
