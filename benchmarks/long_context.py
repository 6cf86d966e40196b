"""One GRPO training step at long context: peak memory and time (docs/benchmarks.md).

The model: Qwen2-shaped, random weights, 4 layers, hidden 256, MLP 1024, the real 151,936-token vocabulary,
untied head, fp32. Modes (each may take ``+gc``): ``packed`` (``grpo.packing``), ``padded`` (the trainer's
padded layout, the same fused loss), ``naive`` (padded, ``[rows, T, V]`` logits and the reference loss).
Peak memory: the peak RSS of a fresh process that builds the model and runs the step. The sweep over
lengths and the padded-vs-packed group are ``bench_long_context.py``'s sets (``GRPO_LC_SET=full``).

    python -m benchmarks.long_context bisect --mode naive --budget-gib 8 --lo 1024 --hi 8192
    python -m benchmarks.long_context memory --sizes 81M 180M --lengths 1024 2048   # full FT vs LoRA vs LoRA+bf16
    python -m benchmarks.long_context frozen-head     # fused linear loss: trainable vs frozen lm_head
    python -m benchmarks.long_context run --mode packed --lengths 2048  # one measurement (what the others spawn)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import torch

from benchmarks import harness as H

MODEL_SHAPE = dict(
    vocab_size=151936, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, tie_word_embeddings=False,
)
MODES = ("packed", "padded", "naive")  # each may take "+gc" (gradient checkpointing)
PROMPT_TOKENS = 256  # prompt length of every sequence (at scale 1)


# --------------------------------------------------------------------------------------------------
# the model and the batch
# --------------------------------------------------------------------------------------------------
def build_model(max_positions: int, gradient_checkpointing: bool, attn_implementation: str, vocab_size: int = MODEL_SHAPE["vocab_size"]):
    """The Qwen2-shaped benchmark model, fp32, seeded random weights, in training mode."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**{**MODEL_SHAPE, "vocab_size": vocab_size}, max_position_embeddings=max(max_positions, 1024))
    config._attn_implementation = attn_implementation
    model = Qwen2ForCausalLM(config).float().train()
    if gradient_checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def group_lengths(G: int, median: float, cap: int, sigma: float = 1.0, seed: int = 0) -> list[int]:
    """G reasoning-like sequence lengths: lognormal(log median, sigma) capped at ``cap``; the longest is
    set to the cap (a step with a truncated completion pads to ``max_new_tokens``)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(G, generator=g, dtype=torch.float64)
    lengths = [int(min(cap, max(16, round(median * math.exp(sigma * float(v)))))) for v in z]
    lengths[max(range(G), key=lengths.__getitem__)] = cap
    return lengths


def make_batch(lengths: list[int], prompt_tokens: int, vocab_size: int, seed: int = 0) -> SimpleNamespace:
    """A padded update batch (the trainer's ``UpdateBatch`` fields) of sequences of ``lengths`` tokens each.

    Each sequence has ``min(prompt_tokens, length - 1)`` prompt tokens (left-padded to the longest
    prompt) and the rest completion (right-padded); every completion token is a loss token.
    """
    g = torch.Generator().manual_seed(seed)
    prompts = [min(prompt_tokens, n - 1) for n in lengths]
    completions = [n - p for n, p in zip(lengths, prompts)]
    B, P, T = len(lengths), max(prompts), max(completions)
    input_ids = torch.randint(0, vocab_size, (B, P + T), generator=g)
    attention_mask = torch.zeros(B, P + T, dtype=torch.long)
    for b, (p, c) in enumerate(zip(prompts, completions)):
        attention_mask[b, P - p : P + c] = 1
    input_ids = input_ids * attention_mask  # pad id 0
    completion_mask = attention_mask[:, P:].clone()
    return SimpleNamespace(
        input_ids=input_ids, attention_mask=attention_mask, prompt_len=P, completion_ids=input_ids[:, P:],
        loss_mask=completion_mask, advantages=torch.randn(B, generator=g), old_logps=None, ref_logps=None,
    )


# --------------------------------------------------------------------------------------------------
# one step
# --------------------------------------------------------------------------------------------------
@dataclass
class StepTimes:
    forward: float = 0.0  # model forward
    loss: float = 0.0  # loss forward + backward down to the hidden states (and lm_head)
    backward: float = 0.0  # model backward from the hidden states
    optimizer: float = 0.0
    micro_batches: int = 0
    model_tokens: int = 0  # tokens through the model, padding included

    @property
    def total(self) -> float:
        return self.forward + self.loss + self.backward + self.optimizer


def _accumulate(times: StepTimes, hidden_fn, loss_fn) -> None:
    """Forward, loss, backward of one micro-batch, each phase timed apart (the loss sees detached hidden states)."""
    t0 = time.perf_counter()
    hidden = hidden_fn()
    t1 = time.perf_counter()
    leaf = hidden.detach().requires_grad_()
    loss_fn(leaf).backward()
    t2 = time.perf_counter()
    hidden.backward(leaf.grad)
    t3 = time.perf_counter()
    times.forward += t1 - t0
    times.loss += t2 - t1
    times.backward += t3 - t2
    times.micro_batches += 1
    times.model_tokens += hidden.shape[0] * hidden.shape[1]


def train_step(model, optimizer, batch: SimpleNamespace, mode: str, max_tokens: Optional[int],
               micro_batch_size: Optional[int]) -> StepTimes:
    """One GRPO update (dapo, on-policy, beta 0) of ``batch`` in ``mode``; returns the phase times."""
    from grpo import packing
    from grpo_kernels import fused_linear_grpo_loss, reference

    weight = model.lm_head.weight
    num_items = batch.loss_mask.sum().float().clamp(min=1.0)
    times = StepTimes()
    optimizer.zero_grad(set_to_none=True)
    if mode == "packed":
        for mb in packing.pack_batch(batch, max_tokens):
            _accumulate(
                times, lambda: packing.packed_forward(model, mb.layout),
                lambda h: fused_linear_grpo_loss(h, weight, mb.completion_ids, mb.advantages, mb.loss_mask,
                                                 loss_type="dapo", num_items_in_batch=num_items, backend="torch").loss,
            )
    else:
        B, P = batch.input_ids.shape[0], batch.prompt_len
        size = micro_batch_size or B
        for start in range(0, B, size):
            rows = slice(start, min(start + size, B))
            ids, am = batch.input_ids[rows], batch.attention_mask[rows]
            cids, mask, adv = batch.completion_ids[rows], batch.loss_mask[rows], batch.advantages[rows]

            def hidden_fn():
                position_ids = (am.cumsum(-1) - 1).clamp(min=0)  # as the trainer numbers left-padded rows
                out = model.base_model(input_ids=ids, attention_mask=am, position_ids=position_ids, use_cache=False)
                return out.last_hidden_state[:, P - 1 : -1]

            if mode == "padded":
                loss_fn = lambda h: fused_linear_grpo_loss(  # noqa: E731
                    h, weight, cids, adv, mask, loss_type="dapo", num_items_in_batch=num_items, backend="torch").loss
            else:  # naive: the [rows, T, V] logits, fp32 log_softmax
                loss_fn = lambda h: reference.grpo_loss(  # noqa: E731
                    model.lm_head(h), cids, adv, mask, loss_type="dapo", num_items_in_batch=num_items).loss
            _accumulate(times, hidden_fn, loss_fn)
    t0 = time.perf_counter()
    optimizer.step()
    times.optimizer = time.perf_counter() - t0
    return times


def run_one(mode: str, lengths: list[int], prompt_tokens: int, max_tokens: Optional[int],
            micro_batch_size: Optional[int], steps: int, vocab_size: int = MODEL_SHAPE["vocab_size"]) -> dict:
    """Build the model (``vocab_size`` ids: the real 151,936 unless a smoke run asks fewer), run ``steps``
    steps; the result with this process's peak RSS."""
    from grpo import packing

    base, _, gc = mode.partition("+")
    if base not in MODES or gc not in ("", "gc"):
        raise ValueError(f"mode must be one of {MODES}, optionally with '+gc', got {mode!r}")
    model = build_model(max(lengths), gc == "gc", "sdpa", vocab_size)
    if base == "packed":
        packing.use_packed_attention(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    batch = make_batch(lengths, prompt_tokens, model.config.vocab_size)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    per_step = [train_step(model, optimizer, batch, base, max_tokens, micro_batch_size) for _ in range(steps)]
    last = per_step[-1]
    return {
        "mode": mode, "lengths": lengths, "tokens": sum(lengths), "prompt_tokens": prompt_tokens,
        "max_tokens_per_microbatch": max_tokens, "micro_batch_size": micro_batch_size,
        "micro_batches": last.micro_batches, "model_tokens": last.model_tokens,
        "step_s": [round(t.total, 3) for t in per_step],
        "forward_s": round(last.forward, 3), "loss_s": round(last.loss, 3), "backward_s": round(last.backward, 3),
        "optimizer_s": round(last.optimizer, 3),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # KiB on Linux
        "rss_before_step_gib": rss_before / 2**20, "threads": torch.get_num_threads(), "vocab_size": vocab_size,
    }


# --------------------------------------------------------------------------------------------------
# full fine-tuning vs LoRA vs LoRA + bf16: one trainer step, beside the memory plan
# --------------------------------------------------------------------------------------------------
MEMORY_SIZES = {
    "81M": MODEL_SHAPE,  # 4 layers, H 256 (the sweep's model)
    "180M": dict(vocab_size=151936, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=2, tie_word_embeddings=False),
}
VARIANTS = {
    "full": dict(use_peft=False, model_dtype="float32"),
    "lora": dict(use_peft=True, model_dtype="float32"),
    "lora+bf16": dict(use_peft=True, model_dtype="bfloat16"),
}
MEMORY_BETA = 0.04


def memory_run(size: str, variant: str, length: int, gradient_checkpointing: bool, prompt_tokens: int = PROMPT_TOKENS) -> dict:
    """One trainer step in this process (what ``memory`` spawns): peak RSS after each phase, times, the
    plan's prediction. A new measurement is one more entry of the returned dict."""
    import tempfile

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo import models, plan, precision, trainer

    peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # noqa: E731  (GiB)
    rss_start = peak()
    cfg = trainer.GRPOConfig(
        output_dir=tempfile.mkdtemp(), beta=MEMORY_BETA, gradient_checkpointing=gradient_checkpointing, padding_free=True,
        backend="torch", learning_rate=1e-6, progress=False, plot=False, max_new_tokens=length, **VARIANTS[variant],
    )
    torch.manual_seed(0)
    config = Qwen2Config(**MEMORY_SIZES[size], max_position_embeddings=max(length, 1024))
    config._attn_implementation = "sdpa"
    torch.set_default_dtype(precision.torch_dtype(cfg.model_dtype))  # built in its dtype, as the CLI loads it:
    try:  # an fp32 model cast afterwards would set the peak RSS itself
        model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    parameters, rss_model = sum(p.numel() for p in model.parameters()), peak()  # (the baseline: imports and model)
    device = torch.device("cpu")
    t0 = time.perf_counter()
    model, policy, ref_policy, optimizer = trainer.setup_training(model, cfg, device)
    setup_s, rss_setup = time.perf_counter() - t0, peak()
    fields = vars(make_batch([length], prompt_tokens, config.vocab_size))
    batch = trainer.UpdateBatch(**{k: fields[k] for k in ("input_ids", "attention_mask", "prompt_len", "completion_ids", "loss_mask", "advantages")})
    t0 = time.perf_counter()
    batch.ref_logps = trainer.completion_logps(ref_policy, batch, cfg, device)
    t1 = time.perf_counter()
    policy.train()
    logs = trainer.update(policy, optimizer, batch, cfg, device)
    t2 = time.perf_counter()
    predicted = plan.plan_for_run(models.unwrap(policy).config, cfg, length, "cpu")
    return {
        "size": size, "parameters": parameters, "trainable": sum(p.numel() for p in policy.parameters() if p.requires_grad),
        "variant": variant, "tokens": length, "gradient_checkpointing": gradient_checkpointing, "beta": MEMORY_BETA,
        "loss": logs["loss"], "step_s": round(t2 - t0, 2), "reference_s": round(t1 - t0, 2), "update_s": round(t2 - t1, 2),
        "setup_s": round(setup_s, 2), "rss_start_gib": rss_start, "rss_after_model_gib": rss_model, "rss_after_setup_gib": rss_setup,
        "peak_rss_gib": peak(), "predicted_peak_gib": predicted.peak / 2**30, "threads": torch.get_num_threads(),
        "predicted_terms_gib": {k: v / 2**30 for k, v in predicted.terms.items()},
    }


def memory_rows(rows: list[dict]) -> list[str]:
    full = {(r["size"], r["tokens"], r["gradient_checkpointing"]): r["peak_rss_gib"] for r in rows if r.get("variant") == "full" and "peak_rss_gib" in r}
    cells = []
    for r in rows:
        if "peak_rss_gib" not in r:
            cells.append([r.get("size"), r.get("variant"), r.get("tokens"), None, r.get("error"), None, None, None, None])
            continue
        base = full.get((r["size"], r["tokens"], r["gradient_checkpointing"]))
        cells.append([f"{r['size']} ({r['parameters'] / 1e6:.0f}M)", r["variant"], r["tokens"], "on" if r["gradient_checkpointing"] else "off",
                      f"{r['peak_rss_gib']:.2f}", f"{r['predicted_peak_gib']:.2f}", f"{r['predicted_peak_gib'] / r['peak_rss_gib']:.2f}",
                      None if base is None else f"{r['peak_rss_gib'] / base:.2f}", f"{r['step_s']:.1f}"])
    return H.table(["size", "variant", "tokens", "ckpt", "peak RSS GiB", "predicted GiB", "pred / meas", "x full FT", "step s"], cells)


def frozen_head(N: int, H_: int, V: int, rounds: int) -> dict:
    """``fused_linear_grpo_loss`` forward + backward (dapo, fp32, backend torch) with a trainable vs a
    frozen weight, interleaved rounds after a warm-up of both; medians and their ratio."""
    from grpo_kernels import fused_linear_grpo_loss

    torch.manual_seed(0)
    hidden, weight = torch.randn(1, N, H_) * 0.5, torch.randn(V, H_) * 0.02
    ids, adv, mask = torch.randint(0, V, (1, N)), torch.randn(1), torch.ones(1, N)

    def step(trainable: bool):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_(trainable)
        return lambda: fused_linear_grpo_loss(h, w, ids, adv, mask, loss_type="dapo", backend="torch").loss.backward()

    times = H.interleave({"trainable": step(True), "frozen": step(False)}, rounds)
    return {"N": N, "H": H_, "V": V, "dtype": "float32", "rounds": rounds, "threads": torch.get_num_threads(),
            "trainable_s": times["trainable"], "frozen_s": times["frozen"], "trainable_median_s": H.median(times["trainable"]),
            "frozen_median_s": H.median(times["frozen"]), "frozen_over_trainable": H.ratio(times, "frozen", "trainable")}


# --------------------------------------------------------------------------------------------------
# measurements in fresh processes
# --------------------------------------------------------------------------------------------------
def measure(mode: str, lengths: list[int], prompt_tokens: int = PROMPT_TOKENS, max_tokens: Optional[int] = None,
            micro_batch_size: Optional[int] = None, steps: int = 1, budget_gib: Optional[float] = None,
            timeout_s: Optional[float] = None, vocab_size: Optional[int] = None) -> dict:
    """``run_one`` in a fresh process. With ``budget_gib`` it is killed once its RSS passes it (then
    ``{"fits": False}``): a probe that does not fit fails early instead of exhausting the machine."""
    args = ["benchmarks.long_context", "run", "--mode", mode, "--lengths", *map(str, lengths), "--prompt-tokens",
            str(prompt_tokens), "--steps", str(steps)] + (["--max-tokens", str(max_tokens)] if max_tokens else []) \
        + (["--micro-batch-size", str(micro_batch_size)] if micro_batch_size else []) \
        + (["--vocab-size", str(vocab_size)] if vocab_size else [])
    result = H.fresh(args, timeout_s=timeout_s, budget_gib=budget_gib)[-1]
    if "error" in result:
        over = "budget" in result["error"]
        return {"mode": mode, "lengths": lengths, "fits": False if over else None, **result}
    return {**result, "fits": None if budget_gib is None else result["peak_rss_gib"] <= budget_gib}


def bisect(mode: str, budget_gib: float, lo: int, hi: int, rel_tol: float = 0.1, **kwargs) -> dict:
    """The longest single-sequence length in [lo, hi] whose step fits in ``budget_gib`` (to ``rel_tol``):
    ``lo`` first (it must fit), then ``hi`` (if it fits: ``>= hi``), then geometric midpoints."""
    probes = []

    def fits(n: int) -> bool:
        r = measure(mode, [n], budget_gib=budget_gib, **kwargs)
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


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    common = [H.parser(rounds=5, add_help=False)]  # --rounds, --out
    run = sub.add_parser("run", help="one measurement in this process (its result line)")
    run.add_argument("--mode", required=True)
    run.add_argument("--lengths", type=int, nargs="+", required=True)
    run.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    run.add_argument("--max-tokens", type=int, default=None)
    run.add_argument("--micro-batch-size", type=int, default=None)
    run.add_argument("--steps", type=int, default=1)
    run.add_argument("--vocab-size", type=int, default=MODEL_SHAPE["vocab_size"],
                     help="the model's vocabulary (default the real 151,936; fewer only for a smoke run)")
    bis = sub.add_parser("bisect", parents=common, help="longest single sequence that fits in a memory budget")
    bis.add_argument("--mode", required=True)
    bis.add_argument("--budget-gib", type=float, required=True)
    bis.add_argument("--lo", type=int, default=1024)
    bis.add_argument("--hi", type=int, default=32768)
    bis.add_argument("--rel-tol", type=float, default=0.1)
    mem = sub.add_parser("memory", parents=common, help="full FT vs LoRA vs LoRA+bf16: peak RSS and step time beside the plan")
    mem.add_argument("--sizes", nargs="+", default=list(MEMORY_SIZES), choices=list(MEMORY_SIZES))
    mem.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    mem.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    mem.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=False)
    mrun = sub.add_parser("memory-run", help="one memory measurement in this process (its result line)")
    mrun.add_argument("--size", required=True, choices=list(MEMORY_SIZES))
    mrun.add_argument("--variant", required=True, choices=list(VARIANTS))
    mrun.add_argument("--length", type=int, required=True)
    mrun.add_argument("--gradient-checkpointing", action="store_true")
    fh = sub.add_parser("frozen-head", parents=common, help="fused linear loss fwd+bwd: trainable vs frozen lm_head")
    fh.add_argument("--N", type=int, default=2048)
    fh.add_argument("--H", type=int, default=512)
    fh.add_argument("--V", type=int, default=151936)
    args = p.parse_args(argv)

    if args.cmd == "run":
        H.emit(run_one(args.mode, args.lengths, args.prompt_tokens, args.max_tokens, args.micro_batch_size, args.steps,
                       args.vocab_size))
        return 0
    if args.cmd == "memory-run":
        H.emit(memory_run(args.size, args.variant, args.length, args.gradient_checkpointing))
        return 0
    report = H.Report(f"Long context: `python -m benchmarks.long_context {args.cmd}`")
    rows = report.records
    if args.cmd == "memory":
        for size in args.sizes:
            for n in args.lengths:
                for variant in args.variants:
                    cmd = ["benchmarks.long_context", "memory-run", "--size", size, "--variant", variant, "--length", str(n)]
                    r = H.fresh(cmd + (["--gradient-checkpointing"] if args.gradient_checkpointing else []))[-1]
                    rows.append({"size": size, "variant": variant, "tokens": n, **r})
        report.add(*memory_rows(rows))
    elif args.cmd == "frozen-head":
        rows.append(frozen_head(args.N, args.H, args.V, args.rounds))
        r = rows[-1]
        report.add(f"`fused_linear_grpo_loss` fwd+bwd, N={r['N']}, H={r['H']}, V={r['V']}, fp32, {r['rounds']} interleaved "
                   f"rounds: trainable {H.fmt_time(r['trainable_median_s'])}, frozen {H.fmt_time(r['frozen_median_s'])}, "
                   f"frozen / trainable {H.fmt_ratio(r['frozen_over_trainable'])}.")
    else:
        rows.append(bisect(args.mode, args.budget_gib, args.lo, args.hi, args.rel_tol))
        report.add("```json", json.dumps(rows[-1], indent=1), "```")
    report.write(args.out)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
