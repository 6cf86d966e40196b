"""The long-context options of issue 35 (``grpo.activations``) measured: one trainer step, fresh processes.

``mlp_chunk_tokens`` and ``activation_offload`` change memory by terms ``grpo.plan`` predicts; this
script puts the measurement beside the prediction. One step = ``grpo.trainer.update`` (forward, fused
loss, backward, AdamW; beta 0, one packed sequence, gradient checkpointing on) of a Qwen2-shaped model
built in code with random weights (:data:`SHAPE`: an MLP 16 times wider than the hidden size, so the
MLP term is large beside the rest), fp32, full fine-tuning, ``backend="torch"``; on CUDA a Qwen2.5-0.5B
shape with LoRA on bf16 weights (:data:`GPU_SHAPE`). On a CPU the one step is the first (AdamW's state
is created in it, as the plan counts); on CUDA a warm-up step runs first.

Variants (each in a fresh process, so that its peak is its own):

- ``base``: checkpointing only.
- ``chunks``: ``mlp_chunk_tokens`` (default 512).
- ``offload``: ``activation_offload`` as the trainer runs it: on a CPU a no-op (it logs one INFO line),
  so its ratio measures nothing but noise there.
- ``offload-copies``: ``grpo.activations.ActivationOffload`` attached on the CPU anyway, copying every
  checkpointed input into a separate host buffer and back (the GPU path's bookkeeping and copies,
  without pinning, streams or overlap): an upper bound on what the copies cost a CPU, not the GPU's cost.

CPU (default): peak RSS (``ru_maxrss``, with glibc's mmap threshold fixed at 128 KiB: see :func:`fresh`)
and the step's time of each variant, ``--rounds`` interleaved rounds (times: medians; each variant's
time as a ratio to ``base``'s, measured in the same rounds), and ``grpo.plan``'s peak for the same
settings (device "cpu"): the measured drop ``base - chunks`` against the plan's (its MLP term).
``--device cuda`` (a GPU check): the same step at ``--tokens`` (default 32,768) with
``torch.cuda.max_memory_allocated`` instead of RSS (beside the plan's ``allocator_peak``: its peak less
the CUDA context and kernel images, which the allocator does not see), offload on and off; and the
plan's runtime and allocator-reserve estimates checked (``docs/memory.md``): the CUDA context measured
before the model (``mem_get_info``'s used bytes less what torch's allocator reserved), what lies outside
the allocator after the step (the context and the kernels' images), and ``max_memory_reserved -
max_memory_allocated`` (block rounding and fragmentation) beside the plan's reserve. (``mem_get_info``
counts the whole device: the numbers hold on a GPU no other process uses, as a lent one is.)

    python -m benchmarks.long_context_options --out benchmarks/results/cpu-DATE-long_context_options.md
    python -m benchmarks.long_context_options --device cuda --tokens 32768 --out gpu-long_context_options.md
    python -m benchmarks.long_context_options --smoke --out /tmp/x.md       # CI: tiny, one round

Timings are ratios measured interleaved in one run; write the machine's load beside them (the report
does: ``/proc/loadavg`` at the start and the end).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Optional

import torch

SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=4096, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, tie_word_embeddings=False)
SMOKE_SHAPE = dict(SHAPE, hidden_size=32, intermediate_size=256, num_hidden_layers=2, vocab_size=256)
# CUDA: Qwen2.5-0.5B's published shape (random weights), LoRA r 16 on bf16 weights (full fine-tuning where
# peft is not installed), where the 24 layers' checkpointed inputs at 32k tokens (1.4 GB) are a visible share
GPU_SHAPE = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, tie_word_embeddings=True)
VARIANTS = {
    "base": dict(),
    "chunks": dict(mlp_chunk_tokens=True),
    "offload": dict(activation_offload=True),
    "offload-copies": dict(copies=True),
}
PROMPT_TOKENS = 16


def peft_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("peft") is not None


def step_in_this_process(variant: str, tokens: int, chunk: int, device: str, smoke: bool) -> dict:
    """Build the model, run one step of ``variant`` (on CUDA after a warm-up step); JSON-able results."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from benchmarks.long_context import make_batch
    from grpo import activations, plan, trainer
    from grpo.models import unwrap

    options = VARIANTS[variant]
    dev = torch.device(device)
    context = None
    if dev.type == "cuda":  # the bare context (and torch's first kernel), before anything else is on the device
        torch.zeros(1, device=dev)
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info(dev)
        context = total - free - torch.cuda.memory_reserved(dev)
    cfg = trainer.GRPOConfig(
        output_dir=tempfile.mkdtemp(), beta=0.0, gradient_checkpointing=True, padding_free=True, backend="torch",
        learning_rate=1e-6, progress=False, plot=False, max_new_tokens=tokens,
        mlp_chunk_tokens=chunk if options.get("mlp_chunk_tokens") else None,
        activation_offload=bool(options.get("activation_offload")),
        model_dtype="bfloat16" if device == "cuda" else "float32", use_peft=device == "cuda" and peft_available(),
    )
    shape = SMOKE_SHAPE if smoke else GPU_SHAPE if device == "cuda" else SHAPE
    torch.manual_seed(0)
    config = Qwen2Config(**shape, max_position_embeddings=max(tokens, 1024))
    config._attn_implementation = "sdpa"
    with dev:  # (built where it runs: a 0.5B model's random init on a CPU would take longer than its step)
        model = Qwen2ForCausalLM(config)
    model, policy, _, optimizer = trainer.setup_training(model, cfg, dev)
    copies = None
    if options.get("copies"):
        copies = activations.ActivationOffload(dev)
        copies.attach(unwrap(policy))
    fields = vars(make_batch([tokens], PROMPT_TOKENS, config.vocab_size))
    batch = trainer.UpdateBatch(**{k: fields[k].to(dev) if isinstance(fields[k], torch.Tensor) else fields[k]
                                   for k in ("input_ids", "attention_mask", "prompt_len", "completion_ids", "loss_mask",
                                             "advantages")})
    policy.train()
    if dev.type == "cuda":  # a warm-up step (kernels, cuBLAS handles), then the measured one
        trainer.update(policy, optimizer, batch, cfg, dev)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    logs = trainer.update(policy, optimizer, batch, cfg, dev)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    step_s = time.perf_counter() - t0
    predicted = plan.plan_for_run(unwrap(policy).config, cfg, tokens, dev.type)
    out = {"variant": variant, "tokens": tokens, "mlp_chunk_tokens": cfg.mlp_chunk_tokens, "device": dev.type,
           "use_peft": cfg.use_peft, "model_dtype": cfg.model_dtype,
           "shape": shape, "step_s": step_s, "loss": logs["loss"], "predicted_peak_bytes": predicted.peak,
           "predicted_terms": predicted.terms, "threads": torch.get_num_threads()}
    out.update(predicted_allocator_peak_bytes=predicted.allocator_peak, predicted_runtime=predicted.runtime,
               predicted_reserve=predicted.reserve)
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        out["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        out["measured_context_bytes"] = context
        out["outside_allocator_bytes"] = total - free - torch.cuda.memory_reserved(dev)  # context + kernel images
        out["gpu"] = torch.cuda.get_device_name()
    else:
        out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    if copies is not None:
        out["offload_peak_host_bytes"] = copies.peak_host_bytes
        out["offload_copies"] = [copies.copies_out, copies.copies_in]
    return out


def timing_in_this_process(tokens: int, chunk: int, rounds: int, smoke: bool) -> dict:
    """Each CPU variant's step time as a ratio to ``base``'s, in one process on one model: ``rounds``
    rounds, each variant once a round in turn (chunks toggled by the MLPs' chunk size, the offload's
    copies by its checkpoint wrappers); per-round ratios, then their median. (A lighter load on the
    measurement than fresh processes: the same model, warm, more rounds.)"""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from benchmarks.long_context import make_batch
    from grpo import activations, trainer
    from grpo.models import unwrap

    dev = torch.device("cpu")
    cfg = trainer.GRPOConfig(output_dir=tempfile.mkdtemp(), beta=0.0, gradient_checkpointing=True, padding_free=True,
                             backend="torch", learning_rate=1e-6, progress=False, plot=False, max_new_tokens=tokens,
                             mlp_chunk_tokens=chunk)
    torch.manual_seed(0)
    config = Qwen2Config(**(SMOKE_SHAPE if smoke else SHAPE), max_position_embeddings=max(tokens, 1024))
    config._attn_implementation = "sdpa"
    model, policy, _, optimizer = trainer.setup_training(Qwen2ForCausalLM(config), cfg, dev)
    inner = unwrap(policy)
    checkpoint_fns = {m: m._gradient_checkpointing_func for m in inner.modules()
                      if m.__dict__.get("_gradient_checkpointing_func") is not None}
    offload = activations.ActivationOffload(dev)
    fields = vars(make_batch([tokens], PROMPT_TOKENS, config.vocab_size))
    batch = trainer.UpdateBatch(**{k: fields[k] for k in ("input_ids", "attention_mask", "prompt_len", "completion_ids",
                                                          "loss_mask", "advantages")})
    policy.train()

    def step(variant: str) -> float:
        activations.chunk_mlps(inner, chunk if variant == "chunks" else tokens)  # (tokens: one chunk, the module as is)
        for m, fn in checkpoint_fns.items():
            m._gradient_checkpointing_func = fn
        if variant == "offload-copies":
            offload.attach(inner)
        t0 = time.perf_counter()
        trainer.update(policy, optimizer, batch, cfg, dev)
        return time.perf_counter() - t0

    variants = ("base", "chunks", "offload-copies")
    for v in variants:  # warm-up
        step(v)
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(rounds):
        for v in variants:
            times[v].append(step(v))
    ratios = {v: median([t / b for t, b in zip(times[v], times["base"])]) for v in variants}
    return {"tokens": tokens, "mlp_chunk_tokens": chunk, "rounds": rounds, "times_s": times, "ratio_to_base": ratios,
            "threads": torch.get_num_threads()}


def fresh(variant: str, tokens: int, chunk: int, device: str, smoke: bool) -> dict:
    """:func:`step_in_this_process` in a fresh process (JSON on its last line); ``{"error": ...}`` if it fails."""
    cmd = [sys.executable, "-m", "benchmarks.long_context_options", "--run", variant, "--tokens", str(tokens),
           "--chunk", str(chunk), "--device", device] + (["--smoke"] if smoke else [])
    # glibc's malloc raises its mmap threshold as blocks are freed (up to 32 MiB), after which freed [N, H]
    # blocks stay in its heap and the RSS high-water is the allocator's, not the tensors': a fixed threshold
    # returns every block of 128 KiB or more to the system when freed
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    if proc.returncode != 0:
        return {"variant": variant, "tokens": tokens, "error": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def report(results: list[dict], tokens: int, chunk: int, device: str, loads: tuple[str, str]) -> str:
    """A markdown table: per variant the median peak and time, the time ratio to ``base`` (per round,
    then the median), the plan's peak; then the measured drop by ``chunks`` beside the plan's."""
    key = "peak_allocated_bytes" if device == "cuda" else "peak_rss_bytes"
    planned = "predicted_allocator_peak_bytes" if device == "cuda" else "predicted_peak_bytes"
    ok: dict[str, list[dict]] = {}
    for r in results:
        if "error" not in r:
            ok.setdefault(r["variant"], []).append(r)
    base_times = [r["step_s"] for r in ok.get("base", [])]
    lines = [f"One trainer step, {tokens} tokens (one packed sequence), gradient checkpointing, {device}; "
             f"mlp_chunk_tokens {chunk}; load average at the start / end: {loads[0]} / {loads[1]}.", "",
             f"| variant | runs | peak {'allocated' if device == 'cuda' else 'RSS'} GiB (median) | plan's "
             f"{'allocator peak' if device == 'cuda' else 'peak'} GiB | "
             "step s (median) | time / base (median of rounds) |", "|---|---|---|---|---|---|"]
    for variant, rs in ok.items():
        ratios = [r["step_s"] / b for r, b in zip(rs, base_times)]
        lines.append(f"| {variant} | {len(rs)} | {median([r[key] for r in rs]) / 2**30:.3f} | "
                     f"{median([r[planned] for r in rs]) / 2**30:.3f} | "
                     f"{median([r['step_s'] for r in rs]):.2f} | {median(ratios):.2f} |")
    if ok.get("base") and ok.get("chunks"):
        measured = median([r[key] for r in ok["base"]]) - median([r[key] for r in ok["chunks"]])
        predicted = ok["base"][0]["predicted_peak_bytes"] - ok["chunks"][0]["predicted_peak_bytes"]
        ratio = f"{measured / predicted:.2f}" if predicted else "n/a"
        lines += ["", f"mlp_chunk_tokens lowers the peak by {measured / 2**30:.3f} GiB measured and "
                      f"{predicted / 2**30:.3f} GiB by the plan (its MLP term): measured / plan = {ratio}."]
    if device == "cuda":  # the plan's runtime and allocator-reserve estimates against the device (docs/memory.md)
        lines += ["", "| variant | CUDA context GiB (measured / plan) | outside the allocator after the step GiB "
                      "(measured / plan: context + kernel images) | reserved - allocated at the peak GiB "
                      "(measured / plan's allocator reserve) |", "|---|---|---|---|"]
        for variant, rs in ok.items():
            r = rs[0]
            runtime, reserve = r["predicted_runtime"], r["predicted_reserve"]
            planned_context = sum(v for k, v in runtime.items() if k.startswith("context"))
            lines.append(f"| {variant} | {r['measured_context_bytes'] / 2**30:.3f} / {planned_context / 2**30:.3f} | "
                         f"{r['outside_allocator_bytes'] / 2**30:.3f} / "
                         f"{(planned_context + runtime['kernel images']) / 2**30:.3f} | "
                         f"{(r['peak_reserved_bytes'] - r['peak_allocated_bytes']) / 2**30:.3f} / "
                         f"{sum(reserve.values()) / 2**30:.3f} |")
    for r in results:
        if "error" in r:
            lines.append(f"\n{r['variant']}: {r['error'][-500:]}")
    return "\n".join(lines) + "\n"


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=None, help="tokens of the sequence (default 4096 on a CPU, 32768 on CUDA)")
    p.add_argument("--chunk", type=int, default=512, help="mlp_chunk_tokens of the 'chunks' variant")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=None,
                   help="default: all on a CPU (--smoke: base and chunks); base, offload, chunks on CUDA")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each variant once a round)")
    p.add_argument("--smoke", action="store_true", help="a tiny model and 96 tokens, one round, base and chunks (CI)")
    p.add_argument("--out", default=None, help="write the markdown report here (and the JSON lines beside it)")
    p.add_argument("--timing", action="store_true", help="CPU: the variants' time ratios in one process, interleaved "
                   "rounds on one warm model (no memory); --rounds of them")
    p.add_argument("--run", choices=list(VARIANTS), default=None, help=argparse.SUPPRESS)  # one step, this process
    args = p.parse_args(argv)
    tokens = args.tokens or (96 if args.smoke else 32768 if args.device == "cuda" else 4096)
    chunk = min(args.chunk, 32) if args.smoke else args.chunk
    if args.run:
        torch.set_num_threads(int(os.environ.get("BENCH_THREADS", torch.get_num_threads())))
        print(json.dumps(step_in_this_process(args.run, tokens, chunk, args.device, args.smoke)))
        return
    if args.timing:
        start_load = loadavg()
        result = timing_in_this_process(tokens, chunk, 1 if args.smoke else args.rounds, args.smoke)
        result["load_start_end"] = [start_load, loadavg()]
        text = (f"Step time / base's, one process, {result['rounds']} interleaved rounds on one warm model, {tokens} tokens, "
                f"mlp_chunk_tokens {chunk}; load average at the start / end: {start_load} / {result['load_start_end'][1]}.\n\n"
                "| variant | median step s | time / base (median of per-round ratios) |\n|---|---|---|\n"
                + "".join(f"| {v} | {median(ts):.2f} | {result['ratio_to_base'][v]:.2f} |\n" for v, ts in result["times_s"].items()))
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
            with open(os.path.splitext(args.out)[0] + ".jsonl", "w") as f:
                f.write(json.dumps(result) + "\n")
        return
    variants = args.variants or (["base", "chunks"] if args.smoke else list(VARIANTS)
                                 if args.device == "cpu" else ["base", "offload", "chunks"])
    if "base" not in variants:
        variants = ["base", *variants]
    rounds = 1 if args.smoke else args.rounds
    start_load = loadavg()
    results = []
    for _ in range(rounds):
        for v in variants:
            results.append(fresh(v, tokens, chunk, args.device, args.smoke))
            print(json.dumps({k: v for k, v in results[-1].items() if k != "predicted_terms"}), flush=True)
    text = report(results, tokens, chunk, args.device, (start_load, loadavg()))
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
        with open(os.path.splitext(args.out)[0] + ".jsonl", "w") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    if any("error" in r for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
