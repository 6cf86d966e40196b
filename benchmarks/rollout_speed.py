"""Rollouts with vLLM (``grpo.rollout.VLLMRollout``) against Hugging Face generate (``grpo.rollout.HFGenerate``):
same model, prompts, G and lengths, in one process, interleaved rounds. (A whole trainer step with each
engine is ``benchmarks.trainer_step``'s ``ours`` against ``ours+vllm``.)

    PYTHONPATH=$PWD .venv-vllm/bin/python -m benchmarks.rollout_speed [--quick] [--out benchmarks/results/NAME.md]

The model: a random-init Qwen2 built in code (``--layers``, ``--hidden``; head size 64) with a character
tokenizer of about 4,000 symbols, so EOS is rare and every completion runs its full ``--new-tokens``.
Sides: HF fp32, vLLM fp32, HF bf16 (the model cast), vLLM bf16 (the engine in bf16, the fp32 policy's
weights synced into it at every call, inside its time). Without vLLM (the main venv) only the HF sides run.
"""

from __future__ import annotations

import copy
import time

import torch

from benchmarks import harness as H

SIDES = H.Sides()


def build(layers: int, hidden: int, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo.tokenizer import char_tokenizer

    tokenizer = char_tokenizer("0123456789+-*=" + "".join(chr(c) for c in range(0x4E00, 0x4E00 + 4000)))  # one token each
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, head_dim=64, max_position_embeddings=1024,
        tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    return model, tokenizer


def _hf(dtype: torch.dtype):
    def make(model, tokenizer, prompts, args):
        from grpo.models import as_policy
        from grpo.rollout import HFGenerate

        policy, hf = as_policy(copy.deepcopy(model).to(dtype)), HFGenerate(tokenizer, max_new_tokens=args.new_tokens, bf16=False)
        return lambda: hf.generate(policy, prompts, args.generations)
    return make


def _vllm(dtype: str):
    def make(model, tokenizer, prompts, args):
        from grpo.models import as_policy
        from grpo.rollout import VLLMRollout

        engine = VLLMRollout.for_model(model, tokenizer, max_new_tokens=args.new_tokens, dtype=dtype,
                                       kv_cache_memory_bytes=256 << 20, max_num_seqs=args.prompts * args.generations)
        return lambda: engine.generate(as_policy(model), prompts, args.generations)
    return make


no_vllm = lambda: H.missing("vllm") and f"{H.missing('vllm')} (run this with .venv-vllm/bin/python)"  # noqa: E731
SIDES.register("hf fp32")(_hf(torch.float32))
SIDES.register("vllm fp32", "in-process, eager, 256 MiB KV cache", no_vllm)(_vllm("float32"))
SIDES.register("hf bf16")(_hf(torch.bfloat16))
SIDES.register("vllm bf16", "in-process, eager, 256 MiB KV cache", no_vllm)(_vllm("bfloat16"))


def main(argv=None) -> int:
    p = H.parser(__doc__.splitlines()[0], rounds=3)
    p.add_argument("--quick", action="store_true", help="4 prompts x G 4 x 32 tokens, 2 rounds")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.generations, args.new_tokens, args.rounds = 4, 4, 32, 2
    from grpo.demo import problems

    model, tokenizer = build(args.layers, args.hidden)
    prompts = [r["prompt"] for r in problems()[: args.prompts]]
    names, skipped = SIDES.select()
    fns, start = {}, {}
    for name in names:  # (an engine's start-up is timed apart)
        t0 = time.perf_counter()
        fns[name], start[name] = SIDES[name].make(model, tokenizer, prompts, args), time.perf_counter() - t0
    tokens = {name: int(fn().completion_mask.sum()) for name, fn in fns.items()}  # warm-up, and the work each did
    times = H.interleave(fns, args.rounds, warmup=False)
    report = H.Report("Rollouts: vLLM vs Hugging Face generate (`python -m benchmarks.rollout_speed`)")
    report.records = [{"side": n, "seconds": times[n], "tokens": tokens[n], "start_s": start[n]} for n in names]
    report.add(f"Model: random-init Qwen2, {args.layers} layers, hidden {args.hidden}, "
               f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, vocabulary {len(tokenizer)}; "
               f"{args.prompts} prompts x G={args.generations} x {args.new_tokens} new tokens; {args.rounds} interleaved rounds "
               "after a warm-up, medians; vLLM's time includes the weight sync of every call.", "",
               *H.table(["rollout", "median", "tokens/s", "× hf fp32", "engine start"],
                        [[n, H.fmt_time(H.median(times[n])), f"{tokens[n] / H.median(times[n]):.0f}",
                          H.fmt_ratio(H.ratio(times, n, "hf fp32")), H.fmt_time(start[n])] for n in names]
                        + [[n, f"skipped: {why}", None, None, None] for n, why in skipped.items()]))
    report.write(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
