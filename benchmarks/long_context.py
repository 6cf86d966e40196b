"""One GRPO training step at long context, in fresh processes: peak memory and time (benchmarks/README.md)."""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from typing import Any, Optional

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


def qwen3(shape: dict, max_positions: int = 1024, dtype: Optional[torch.dtype] = None, device: Any = None, seed: int = 0):
    """A Qwen3 causal LM of ``shape`` (``Qwen3Config`` fields: its per-head q/k RMSNorms), seeded random weights
    built in ``dtype`` on ``device`` (``harness.qwen2``'s counterpart)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**shape, max_position_embeddings=max(max_positions, 1024))
    config._attn_implementation = "sdpa"
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype or torch.float32)
    try:
        with torch.device(device or "cpu"):
            return Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)


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
         prompt_tokens: int = PROMPT_TOKENS, vocab_size: Optional[int] = None, copies: bool = False,
         shape: Optional[dict] = None, micro_batch_tokens: Optional[int] = None, **config) -> dict:
    """``steps`` trainer steps of one batch in this process, the last measured: phases, peaks, the plan's prediction (README).
    ``shape``: a Qwen3 model of these ``Qwen3Config`` fields instead of ``size``'s Qwen2; ``micro_batch_tokens``:
    packed micro-batches of at most this many tokens (default the longest sequence), the tokens the plan is made for."""
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
                             max_new_tokens=max(lengths),
                             max_tokens_per_microbatch=(micro_batch_tokens or max(lengths)) if base == "packed" else None)
    if shape is not None:
        model = qwen3(shape, max(lengths), precision.torch_dtype(cfg.model_dtype), dev)
    else:
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
    mb_tokens = micro_batch_tokens or max(lengths)
    predicted = plan.plan_for_run(models.unwrap(policy).config, cfg, mb_tokens, dev.type,
                                  sequences=len(lengths) if mb_tokens >= sum(lengths) else 1)  # (one micro-batch of all)
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
    """:func:`step` in a fresh process, killed past ``budget_gib`` of RSS (``"fits"``: False; None after another failure)."""
    result = H.fresh_call("benchmarks.long_context:step", {"lengths": lengths, **kwargs}, timeout_s=timeout_s,
                          budget_gib=budget_gib)[-1]
    if "error" in result:
        return {"lengths": lengths, **kwargs, "fits": False if "budget" in result["error"] else None, **result}
    return {**result, "fits": None if budget_gib is None else result["peak_rss_gib"] <= budget_gib}


def bisect(args) -> tuple[list[dict], list[str]]:
    """The ``bisect`` command: the longest single sequence in [lo, hi] whose step fits in ``--budget-gib`` of RSS,
    to ``--rel-tol``; probes ``lo`` (it must fit), ``hi``, then geometric midpoints, each killed past the budget."""
    lo, hi, result = args.lo, args.hi, {"mode": args.mode, "budget_gib": args.budget_gib, "probes": []}

    def fits(n: int) -> bool:
        r = measure([n], budget_gib=args.budget_gib, mode=args.mode)
        result["probes"].append({"length": n, "fits": r.get("fits"), "peak_rss_gib": r.get("peak_rss_gib", r.get("rss_seen_gib")),
                                 "step_s": r.get("step_s")})
        print(json.dumps(result["probes"][-1]), flush=True)
        return bool(r.get("fits"))

    if not fits(lo):
        result.update(longest=None, below=lo)
    elif fits(hi):
        result.update(longest=hi, at_least=True)
    else:
        while hi / lo > 1 + args.rel_tol and lo < (mid := int(round(math.sqrt(lo * hi) / 64) * 64)) < hi:
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        result.update(longest=lo, first_failing=hi)
    return [result], ["```json", json.dumps(result, indent=1), "```"]


def variants_lines(rows: list[dict], base: str, cuda: bool = False) -> list[str]:
    """Per (size, tokens, variant): the median peak beside the plan's and the step, each against ``base``'s (the step:
    the median of the per-round ratios); on CUDA the allocator's peak and the plan's runtime and reserve (README)."""
    key, planned = ("peak_allocated_gib", "predicted_allocator_peak_gib") if cuda else ("peak_rss_gib", "predicted_peak_gib")
    ok: dict[tuple, list[dict]] = {}
    for r in (r for r in rows if "error" not in r):
        ok.setdefault((r["size"], r["tokens"], r["variant"]), []).append(r)
    cells = []
    for (size, n, v), rs in ok.items():
        peak, b = H.median([r[key] for r in rs]), ok.get((size, n, base), [])
        cells.append([size, n, v, len(rs), f"{peak:.3f}", f"{rs[0][planned]:.3f}", f"{rs[0][planned] / peak:.2f}",
                      H.fmt_ratio(peak / H.median([r[key] for r in b])) if b else None, H.fmt_time(H.median([r["step_s"] for r in rs])),
                      H.fmt_ratio(H.median([r["step_s"] / x["step_s"] for r, x in zip(rs, b)])) if b else None])
    lines = H.table(["size", "tokens", "variant", "runs", f"peak {'allocated' if cuda else 'RSS'} GiB", "plan's GiB", "plan / measured",
                     f"peak × {base}", "step", f"step × {base}"], cells) + [""]
    if cuda:  # docs/memory.md: the runtime and allocator-reserve estimates
        gib = lambda d, pick=lambda k: True: sum(v for k, v in d.items() if pick(k)) / 2**30  # noqa: E731
        lines += H.table(["variant", "CUDA context GiB (measured / plan)", "outside the allocator after the step (context + "
                          "kernel images)", "reserved - allocated at the peak (plan: allocator reserve)"],
                         [[v, f"{r['context_gib']:.3f} / {gib(r['predicted_runtime'], lambda k: k.startswith('context')):.3f}",
                           f"{r['outside_allocator_gib']:.3f} / {gib(r['predicted_runtime'], lambda k: k.startswith(('context', 'kernel images'))):.3f}",
                           f"{r['peak_reserved_gib'] - r['peak_allocated_gib']:.3f} / {gib(r['predicted_reserve']):.3f}"]
                          for (_, _, v), (r, *_) in ok.items()]) + [""]
    return lines + [f"{r.get('variant')}: {r['error'][-500:]}" for r in rows if "error" in r]


def options(args) -> tuple[list[dict], list[str]]:
    """The ``options`` command: rounds of every variant, each in a fresh process."""
    cuda, smoke = args.device == "cuda", args.smoke
    size = "wide-mlp-smoke" if smoke else "qwen2.5-0.5b" if cuda else "wide-mlp"
    tokens, chunk = args.tokens or (96 if smoke else 32768 if cuda else 4096), min(args.chunk, 32) if smoke else args.chunk
    rounds = 1 if smoke else args.rounds
    variants = args.variants or (["base", "chunks"] if smoke else ["base", "offload", "chunks"] if cuda else list(OPTIONS))
    peft = cuda and not H.missing("peft")  # CUDA: LoRA on bf16 weights where peft is installed
    rows, lines = [], [f"One trainer step, {tokens} tokens (one packed sequence), gradient checkpointing; mlp_chunk_tokens {chunk}.", ""]
    for _ in range(rounds):
        for v in dict.fromkeys(["base", *variants]):
            config = {k: chunk if k == "mlp_chunk_tokens" else x for k, x in OPTIONS[v].items()}
            rows.append({"variant": v, **measure([tokens], mode="packed+gc", size=size, device=args.device, steps=2 if cuda else 1,
                                                  prompt_tokens=16, use_peft=peft, model_dtype="bfloat16" if cuda else "float32", **config)})
            print(json.dumps({k: x for k, x in rows[-1].items() if not k.startswith("predicted")}, default=str), flush=True)
    key = "peak_allocated_gib" if cuda else "peak_rss_gib"
    drop = [(H.median([r[key] for r in rs]), rs[0]["predicted_peak_gib"]) for v in ("base", "chunks")
            if (rs := [r for r in rows if r["variant"] == v and "error" not in r])]
    if len(drop) == 2:
        (peak, plan), (peak_c, plan_c) = drop
        lines += [f"mlp_chunk_tokens lowers the peak by {peak - peak_c:.3f} GiB measured, {plan - plan_c:.3f} GiB by the plan (its MLP "
                  f"term): measured / plan = {(peak - peak_c) / (plan - plan_c):.2f}." if plan != plan_c else "The plan predicts no drop.", ""]
    return rows, lines + variants_lines(rows, "base", cuda)


def memory(args) -> tuple[list[dict], list[str]]:
    """Full fine-tuning vs LoRA vs LoRA + bf16, beta 0.04 (the reference model and its log-probs are part of the step)."""
    rows = [{"variant": v, **measure([n], size=size, beta=0.04, **VARIANTS[v], gradient_checkpointing=args.gradient_checkpointing)}
            for size in args.sizes for n in args.lengths for v in args.variants]
    return rows, variants_lines(rows, "full")


SHAPES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "shapes")


def one_layer(model_name: str = "Qwen2.5-1.5B", tokens: int = 1024, fused_norm: bool = True, chunk: Optional[int] = 512,
              lora_r: int = 16, lora_dropout: float = 0.05, threads: int = 1) -> dict:
    """One decoder layer of ``model_name``'s real widths (docs/shapes/<name>/config.json; one layer, a
    small vocabulary): bf16 weights, the trainer's LoRA adapters (``grpo.lora.add_adapters``, all-linear),
    ``chunk_mlps``, non-reentrant checkpointing, ``fuse_norms`` when ``fused_norm``, under CPU bf16 autocast
    (which dispatches its matmuls as CUDA's autocast does); its forward and backward on ``tokens`` tokens
    (one sequence), the peak bytes allocated above the start from the torch profiler's allocation events,
    beside ``grpo.plan.layer_peak``'s prediction of the same (``docs/memory.md``). The layer input ``x`` and
    the gradient entering it exist before (the plan's checkpointed input and one of its two gradients);
    the layer's output lives through the backward here (the plan's second gradient stands in for it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo import activations, lora, plan
    from grpo.config import GRPOConfig

    torch.set_num_threads(threads)
    config = AutoConfig.from_pretrained(model_name if os.path.isdir(model_name) else os.path.join(SHAPES_DIR, model_name))
    config.num_hidden_layers, config.vocab_size, config.max_position_embeddings = 1, 256, max(tokens, 1024)
    config.tie_word_embeddings = False
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    cfg = GRPOConfig(output_dir="unused", use_peft=True, lora_r=lora_r, lora_dropout=lora_dropout, model_dtype="bfloat16")
    model = lora.add_adapters(model, cfg)
    base = model.get_base_model()
    base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if chunk:
        activations.chunk_mlps(base, chunk)
    if fused_norm:
        activations.fuse_norms(base, "torch")
    model.train()
    layer = base.model.layers[0]
    H = config.hidden_size
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, tokens, H, generator=g).to(torch.bfloat16).requires_grad_(True)
    dy = torch.randn(1, tokens, H, generator=g).to(torch.bfloat16)
    position_ids = torch.arange(tokens)[None]
    cos_sin = base.model.rotary_emb(x, position_ids)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(x, attention_mask=None, position_embeddings=cos_sin, position_ids=position_ids)
        out = out[0] if isinstance(out, tuple) else out
        torch.autograd.backward(out, dy)

    for p in model.parameters():  # (the adapters' gradients exist before, as from an earlier micro-batch)
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    peak, method = H_peak(step)
    shape = plan.ModelShape.from_config(config)
    terms = plan.layer_terms(shape, tokens, 2, full=False, targets=list(plan.LINEAR_NAMES), lora_r=lora_r,
                             lora_dropout=lora_dropout, device="cpu", autocast=True, mlp_chunk_tokens=chunk,
                             fused_norm=fused_norm)
    planned = plan.layer_peak(terms)
    return {"model": model_name, "tokens": tokens, "fused_norm": fused_norm, "mlp_chunk_tokens": chunk, "lora_r": lora_r,
            "lora_dropout": lora_dropout, "measured_bytes": peak, "planned_bytes": planned, "method": method,
            "planned_terms": terms, "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def H_peak(fn) -> tuple[int, str]:
    """The peak bytes ``fn`` allocates above its start (CPU: the torch profiler's allocation events);
    the adapters' gradients, allocated in the warm-up, are zeroed in place, not freed."""
    return H.peak_extra_bytes(fn, torch.device("cpu"))


SMOKE_LAYER = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 256,
               "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
               "rms_norm_eps": 1e-6, "max_position_embeddings": 1024, "tie_word_embeddings": False}


def planned_layer_peak(model_name: str, tokens: int, fused_norm: bool, chunk: Optional[int], lora_r: int = 16,
                       lora_dropout: float = 0.05) -> int:
    """``grpo.plan.layer_peak`` of :func:`one_layer`'s case (device "cpu", bf16 autocast, LoRA on every linear)."""
    from transformers import AutoConfig

    from grpo import plan

    config = AutoConfig.from_pretrained(model_name if os.path.isdir(model_name) else os.path.join(SHAPES_DIR, model_name))
    terms = plan.layer_terms(plan.ModelShape.from_config(config), tokens, 2, full=False, targets=list(plan.LINEAR_NAMES),
                             lora_r=lora_r, lora_dropout=lora_dropout, device="cpu", autocast=True, mlp_chunk_tokens=chunk,
                             fused_norm=fused_norm)
    return plan.layer_peak(terms)


def layer(args) -> tuple[list[dict], list[str]]:
    """The ``layer`` command: one layer's measured peak beside the plan's, per model, token count and norm
    (``--from-json``: the records of an earlier run, the plan's side computed again by this code)."""
    rows = []
    for path in args.from_json:
        with open(path) as f:
            rows += json.load(f)["records"]  # (harness.Report's FILE.json)
    models, tokens, chunk = args.models, args.tokens, args.chunk
    if args.smoke:  # CI: a small layer of the same structure (H 64, I 256), two tiny token counts
        import tempfile

        models, tokens, chunk = [tempfile.mkdtemp(prefix="layer-smoke-")], [16, 48], 16
        with open(os.path.join(models[0], "config.json"), "w") as f:
            json.dump(SMOKE_LAYER, f)
    for name in [] if args.from_json else models:
        for n in tokens:
            for fused in (True, False):
                rows.append(H.fresh_call("benchmarks.long_context:one_layer", dict(
                    model_name=name, tokens=n, fused_norm=fused, chunk=chunk), budget_gib=4.0)[-1])
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "planned_terms"}), flush=True)
    for r in rows:
        if "error" not in r:
            r["planned_bytes"] = planned_layer_peak(r["model"], r["tokens"], r["fused_norm"], r["mlp_chunk_tokens"],
                                                    r["lora_r"], r["lora_dropout"])
    ok = [r for r in rows if "error" not in r]
    cells = [[os.path.basename(r["model"]), r["tokens"], r["mlp_chunk_tokens"], "fused" if r["fused_norm"] else "transformers'",
              f"{r['measured_bytes'] / 2**20:.1f}", f"{r['planned_bytes'] / 2**20:.1f}", f"{r['planned_bytes'] / r['measured_bytes']:.3f}"]
             for r in ok]
    lines = ["One decoder layer's forward + backward (bf16 weights, LoRA r=16 all-linear with dropout 0.05, non-reentrant "
             "checkpointing, MLP chunks of the listed tokens (chunking acts where tokens > chunk), CPU bf16 autocast): peak "
             "bytes allocated above the start, the torch profiler's allocation events, beside grpo.plan.layer_peak.", ""]
    lines += H.table(["model", "tokens", "MLP chunk", "RMSNorm", "measured MiB", "planned MiB", "plan / measured"], cells)
    slopes = []
    for name, chunk_, fused in sorted({(r["model"], r["mlp_chunk_tokens"], r["fused_norm"]) for r in ok}, key=str):
        rs = sorted((r for r in ok if (r["model"], r["mlp_chunk_tokens"], r["fused_norm"]) == (name, chunk_, fused)),
                    key=lambda r: r["tokens"])
        if len(rs) >= 2:
            a, b = rs[0], rs[-1]
            m = (b["measured_bytes"] - a["measured_bytes"]) / (b["tokens"] - a["tokens"])
            p = (b["planned_bytes"] - a["planned_bytes"]) / (b["tokens"] - a["tokens"])
            slopes.append([os.path.basename(name), f"{a['tokens']}-{b['tokens']}", chunk_, "fused" if fused else "transformers'",
                           f"{m:.0f}", f"{p:.0f}", f"{p / m:.3f}"])
    lines += ["", "Per-token slope between the two token counts of one model, chunk and norm (bytes per token):", ""]
    lines += H.table(["model", "tokens", "MLP chunk", "RMSNorm", "measured B/token", "planned B/token", "plan / measured"], slopes)
    return rows, lines + [f"error: {r['error'][-300:]}" for r in rows if "error" in r]


# `full`'s model (issue 45): Qwen3-shaped (per-head q/k RMSNorms, head_dim apart from H / heads, tied embeddings as
# Qwen3-0.6B to 4B have them) with the real vocabulary, small enough that a 131,072-token step runs on a shared 2-core CPU
FULL_SHAPE = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6)
# the published Qwen3 sizes the results file asks the CPU plan about at the same settings
QWEN3_SIZES = ("Qwen3-0.6B", "Qwen3-1.7B", "Qwen3-4B", "Qwen3-8B")
GOAL_TOKENS = 131072  # issue 45's length, at which that table asks the plan


def full(args) -> tuple[list[dict], list[str]]:
    """The ``full`` command (issue 45): one GRPO step (the trainer's ``update``: packed micro-batch, LoRA, gradient
    checkpointing, MLP chunks, fused RMSNorm; with ``--beta`` > 0 also the reference's no-grad pass) of ``--tokens``
    tokens in sequences of ``--sequence`` tokens packed into ONE micro-batch, in a fresh process; its peak RSS
    (``ru_maxrss``: the whole process, interpreter and model included) beside the CPU plan of exactly that step."""
    from grpo import plan

    smoke = args.smoke
    tokens, sequence, chunk = (512, 128, 64) if smoke else (args.tokens, args.sequence, args.chunk)
    shape = dict(FULL_SHAPE)
    config = dict(use_peft=True, lora_r=args.lora_r, lora_dropout=args.lora_dropout, model_dtype="float32",
                  mlp_chunk_tokens=chunk, fused_norm=True, beta=args.beta)
    if args.from_json:  # an earlier run's record: the plan's side computed again by this code
        with open(args.from_json) as f:
            earlier = json.load(f)
        r = earlier["records"][0]
        shape, tokens, config = r["shape"], r["tokens"], r["config"]
        sequence, chunk = max(r["lengths"]), config["mlp_chunk_tokens"]
    lengths = [sequence] * (tokens // sequence) + ([tokens % sequence] if tokens % sequence else [])
    if not args.from_json:
        r = measure(lengths, budget_gib=args.budget_gib, timeout_s=args.timeout_s, mode="packed+gc", shape=shape,
                    micro_batch_tokens=tokens, prompt_tokens=16 if smoke else PROMPT_TOKENS, **config)
        r.update(variant="full", shape=shape)
        print(json.dumps({k: v for k, v in r.items() if not k.startswith("predicted")}, default=str), flush=True)
    if "error" in r:
        return [r], [f"error: {r['error'][-800:]}"]
    # the plan of exactly this step (plan_for_run's arguments: the model's config and the run's settings), less
    # its tokenizer term (a run's, TOKENIZER_BYTES_PER_ENTRY_CPU x V): this step loads no tokenizer
    predicted = plan.plan(plan.ModelShape.from_config({**shape, "model_type": "qwen3"}), tokens, device="cpu",
                          gradient_checkpointing=True, sequences=len(lengths), **config)
    tokenizer = predicted.runtime["the tokenizer"] / 2**30
    planned, measured = predicted.peak / 2**30 - tokenizer, r["peak_rss_gib"]
    terms = {k: v / 2**30 for k, v in predicted.terms.items()}
    r.update(predicted_peak_gib=predicted.peak / 2**30, predicted_terms_gib=terms, planned_without_tokenizer_gib=planned,
             plan_over_measured=planned / measured)
    lines = [f"The step was measured {H.describe(earlier['conditions'])} (this file: its record, the plan's side "
             f"computed again by `--from-json`).", ""] if args.from_json else []
    lines += [f"One GRPO step of {tokens:,} tokens ({len(lengths)} sequences of {sequence} tokens, prompts of "
             f"{16 if smoke else PROMPT_TOKENS}, packed into one micro-batch), a Qwen3-shaped model of random weights: "
             + ", ".join(f"{k} {v}" for k, v in shape.items()) + f" ({r['parameters'] / 1e6:.1f}M parameters, "
             f"{r['trainable'] / 1e6:.3f}M trainable); fp32 weights, LoRA r={args.lora_r} all-linear with dropout "
             f"{args.lora_dropout}, gradient checkpointing (non-reentrant), MLP chunks of {chunk} tokens, fused RMSNorm, "
             f"beta {args.beta}, the torch backend's fused loss (frozen head in vocabulary blocks), AdamW. "
             "Measured: the process's peak RSS (ru_maxrss of a fresh process: interpreter, imports, model, step). "
             "Planned: `grpo.plan.plan` of the same config and settings on device 'cpu' (what `plan_for_run` gives a run), less its tokenizer "
             f"term ({tokenizer * 1024:.0f} MiB: this step loads none).", "",
             *H.table(["tokens", "measured peak RSS GiB", "planned GiB", "plan / measured", "step wall", "loss"],
                      [[f"{tokens:,}", f"{measured:.3f}", f"{planned:.3f}", f"{planned / measured:.3f}",
                        H.fmt_time(r["step_s"]), f"{r['loss']:.4f}"]]),
             "", "The plan's terms (GiB; the peak = the persistent terms + max(update, KV cache, no-grad pass)):", "",
             *H.table(["term", "GiB"], [[k, f"{v:.4f}"] for k, v in terms.items()]), "",
             f"RSS before the model {r['rss_start_gib']:.3f} GiB, after the model {r['rss_after_model_gib']:.3f}, "
             f"after setup {r['rss_after_setup_gib']:.3f}; phases (wall s): "
             + ", ".join(f"{k} {v:.1f}" for k, v in r["phases_s"].items()) + f"; threads {r['threads']}."]
    goal = GOAL_TOKENS
    lines += ["", f"The CPU plan (`python -m grpo plan --device cpu`, the same settings, sequences of {sequence} tokens, with "
              f"the tokenizer) of the published Qwen3 sizes at {goal:,} tokens, against this machine's 24 GiB, with fp32 "
              "weights (as measured here) and bf16 weights (no autocast on a CPU: bf16 activations too):", ""]
    cells = []
    for name in QWEN3_SIZES:
        for dtype in ("float32", "bfloat16"):
            p = plan.plan(name, goal, device="cpu", gradient_checkpointing=True, sequences=goal // sequence,
                          gpu_memory=24 * 2**30, **{**config, "model_dtype": dtype})
            cells.append([name, f"{p.settings['parameters'] / 1e9:.2f}B", dtype, f"{p.peak / 2**30:.2f}",
                          "yes" if p.fits else "no", f"{p.largest_tokens:,}"])
    lines += H.table(["model", "parameters", "weights", "planned peak GiB", "fits 24 GiB", "largest tokens that fit"], cells)
    return [r], lines


COMMANDS = {"bisect": bisect, "memory": memory, "options": options, "layer": layer, "full": full}


def main(argv: Optional[list[str]] = None) -> int:
    p, common = H.parser(__doc__.splitlines()[0], rounds=None), H.parser(rounds=5, add_help=False)
    sub = p.add_subparsers(dest="cmd", required=True)
    command = lambda name, help_, **flags: H.flags(sub.add_parser(name, help=help_, parents=[common]), **flags)  # noqa: E731
    bis = command("bisect", "longest single sequence that fits in a memory budget (issue 18)", lo=1024, hi=32768, rel_tol=0.1)
    bis.add_argument("--mode", required=True)
    bis.add_argument("--budget-gib", type=float, required=True)
    command("memory", "full FT vs LoRA vs LoRA+bf16: peak RSS and step time beside the plan", sizes=(["81M", "180M"], None, list(H.MODELS)),
            lengths=[1024, 2048], variants=(list(VARIANTS), None, list(VARIANTS)), gradient_checkpointing=False)
    command("options", "issue 35's mlp_chunk_tokens / activation_offload: peak and time beside the plan",
            tokens=(int, "tokens of the one sequence (default 4096 on a CPU, 32768 on CUDA)"),
            chunk=(512, "mlp_chunk_tokens of the chunks variant"), device=("cpu", None, ("cpu", "cuda")),
            variants=([], "default: all on a CPU; base, offload, chunks on CUDA", list(OPTIONS)),
            smoke=(False, "CI: a tiny model, 96 tokens, one round, base and chunks")).set_defaults(rounds=3)
    command("layer", "one real-width decoder layer's peak (profiler allocation events) beside the plan's (issue 45)",
            models=(["Qwen2.5-1.5B", "Qwen3-8B"], None, ["Qwen2.5-1.5B", "Qwen3-8B"]), tokens=[128, 512],
            chunk=(512, "mlp_chunk_tokens"), from_json=([], "recompute the plan's side for earlier runs' records (FILE.json ...)"),
            smoke=(False, "CI: a small layer (H 64, I 256) at 16 and 48 tokens")).set_defaults(rounds=1)
    command("full", "one GRPO step at full length (131,072 tokens), its peak RSS beside the CPU plan (issue 45)",
            tokens=131072, sequence=(4096, "tokens of each packed sequence"), chunk=(4096, "mlp_chunk_tokens"),
            lora_r=16, lora_dropout=0.05, beta=(0.0, "KL coefficient (> 0: the reference's no-grad pass too)"),
            budget_gib=(10.0, "kill the step past this RSS"), timeout_s=(1800.0, "kill the step after this long"),
            smoke=(False, "CI: 512 tokens in sequences of 128, chunks of 64"),
            from_json=(str, "recompute the plan's side for an earlier run's record (FILE.json)")).set_defaults(rounds=1)
    args = p.parse_args(argv)
    report = H.Report(f"Long context: `python -m benchmarks.long_context {args.cmd}`")
    report.records, lines = COMMANDS[args.cmd](args)
    report.add(*lines).write(args.out)
    return 1 if any("error" in r for r in report.records) else 0


if __name__ == "__main__":
    sys.exit(main())
