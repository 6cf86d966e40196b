"""The memory plan of one GRPO step: the predicted peak, term by term, from the model's config alone.

    python -m grpo plan --model Qwen2.5-1.5B --tokens 32768 --use-peft --model-dtype bfloat16 \\
        --gradient-checkpointing --gpu-memory 24GiB

The model is a Qwen2/Llama-shaped decoder (``hidden_size`` H, ``intermediate_size`` I, ``num_hidden_layers``
L, ``num_attention_heads`` / ``num_key_value_heads`` with ``head_dim`` d, ``vocab_size`` V, tied or
untied ``lm_head``; q/k/v with bias as Qwen2 has, o/gate/up/down without), trained by ``grpo.trainer``:
the fused loss (no [tokens, V] logits), attention that keeps no [L, L] matrix (flash / SDPA's flash
and memory-efficient kernels, per packed sequence), and AdamW. Every number is bytes, predicted, not
measured (``benchmarks/long_context.py memory`` puts them beside measurements). ``N`` is the tokens
one forward/backward sees: a packed micro-batch (``padding_free``: the real tokens, at most
``max_tokens_per_microbatch``), or a padded one (rows times the longest row).

Terms (``b``: bytes of the weights' dtype; trainable parameters ``P_t``: all ``P``, or the adapters):

- weights: ``P b``, plus LoRA's adapters in fp32 (``r (in + out)`` per adapted linear).
- reference: with ``beta > 0`` a frozen copy, ``P b``; with LoRA 0 (the policy with adapters off).
- gradients: ``P_t`` in the trainable parameters' dtype; fp32 master gradients too when the trainable
  weights are 16-bit (``grpo.precision.MasterWeightAdamW``).
- optimizer state: AdamW's two moments, 8 bytes per trainable parameter, plus a 4-byte fp32 master
  copy for 16-bit trainable weights.
- activations (saved for backward), per token and layer, in the compute dtype ``b``: the attention
  block ``2H + 2(H + kv) + kv + H`` (input and normed input, q/k before and after RoPE, v, the
  attention output; ``kv`` = kv heads x d) plus RMSNorm's fp32 upcast ``4H`` and the softmax
  log-sum-exp ``4 heads``; the MLP ``2H + 4I`` (input, normed, gate, up, SiLU(gate), their product)
  plus ``4H``; each LoRA adapter ``4 r`` (A's fp32 output, which B's matmul keeps), with
  ``lora_dropout`` a 1-byte mask per input element (``grpo.lora.DropoutLinearFunction`` keeps the input,
  counted above, and recomputes the dropped copy), and with 16-bit weights the fp32 copy of its input
  that peft casts for it, ``4 in`` (:func:`lora_activation_bytes`). Without checkpointing all L
  layers; with it, each layer's input ``H b`` plus one layer recomputed in full. Plus the embeddings' output, the final norm's and the hidden states the loss
  reads, and their gradient (``~4 N H b``), and the backward's temporaries (``N (2H + 2I) b``).
- the loss's chunk: one [c, V] block of logits (``c`` = ``grpo_kernels``' default chunk rows for
  N, H, V on the device) and, for a trainable head in 16-bit, its fp32 ``d W`` accumulator.
- the rollout's KV cache: ``2 L kv N b`` for the step's tokens at once (generation; freed before the
  update, so the peak takes the larger of it and the update's activations + chunk).
- runtime (CPU only): the Python process with torch and transformers imported, measured on this
  machine (``RUNTIME_BYTES_CPU``); a GPU's CUDA context is not in ``torch.cuda.max_memory_allocated``.

peak = weights + reference + gradients + optimizer state + runtime + max(activations + loss chunk,
KV cache).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

# Published configs (config.json on the Hugging Face hub, Qwen/Qwen2.5-*; parameter counts from the
# model cards: 0.49B, 1.54B, 7.61B), so a plan needs no hub access.
KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen2.5-0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "Qwen2.5-1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "Qwen2.5-7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}
# A fresh CPU process with torch, transformers, peft and grpo imported, before any model: its peak
# RSS on this project's 2-core machine was 0.41 GiB (torch alone 0.21 GiB), measured 2026-12-01.
RUNTIME_BYTES_CPU = int(0.42 * 2**30)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder's config that its memory depends on."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool
    head_dim: Optional[int] = None

    @classmethod
    def from_config(cls, config: Any) -> "ModelShape":
        """From a transformers config or a config.json dict (its text config for a multimodal one)."""
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        get = (lambda k, d=None: config.get(k, d)) if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        heads = get("num_attention_heads")
        return cls(
            hidden_size=get("hidden_size"), intermediate_size=get("intermediate_size"),
            num_hidden_layers=get("num_hidden_layers"), num_attention_heads=heads,
            num_key_value_heads=get("num_key_value_heads") or heads, vocab_size=get("vocab_size"),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)), head_dim=get("head_dim"),
        )

    @property
    def d(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def kv(self) -> int:
        return self.num_key_value_heads * self.d

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of one decoder layer."""
        H, I, q = self.hidden_size, self.intermediate_size, self.num_attention_heads * self.d
        return {"q_proj": (H, q), "k_proj": (H, self.kv), "v_proj": (H, self.kv), "o_proj": (q, H),
                "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)}

    def parameters(self) -> int:
        """Every parameter: embeddings, layers (with q/k/v biases and two norms), final norm, lm_head."""
        H = self.hidden_size
        layer = sum(i * o for i, o in self.linears().values()) + self.num_attention_heads * self.d + 2 * self.kv + 2 * H
        head = 0 if self.tie_word_embeddings else self.vocab_size * H
        return self.vocab_size * H + self.num_hidden_layers * layer + H + head

    def lora_parameters(self, r: int, targets: list[str]) -> int:
        return self.num_hidden_layers * sum(r * (i + o) for name, (i, o) in self.linears().items() if name in targets)


def load_shape(model: str) -> ModelShape:
    """A built-in name (:data:`KNOWN_CONFIGS`, with or without ``Qwen/``), a config.json, or a model folder."""
    name = model.split("/")[-1]
    if not os.path.exists(model) and name in KNOWN_CONFIGS:
        return ModelShape.from_config(KNOWN_CONFIGS[name])
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not os.path.isfile(path):
        raise ValueError(f"--model {model!r}: not a config.json, a model folder, nor one of {sorted(KNOWN_CONFIGS)}")
    with open(path) as f:
        return ModelShape.from_config(json.load(f))


def lora_targets(target_modules: str) -> list[str]:
    """The linear layers ``lora_target_modules`` adapts ('all-linear': all seven)."""
    if target_modules.strip().lower() == "all-linear":
        return list(LINEAR_NAMES)
    return [t.strip().rsplit(".", 1)[-1] for t in target_modules.split(",") if t.strip()]


@dataclass
class MemoryPlan:
    """The predicted peak of one step and its terms (bytes)."""

    terms: dict[str, int]
    settings: dict[str, Any]
    notes: dict[str, str] = field(default_factory=dict)
    gpu_memory: Optional[int] = None

    @property
    def update_transient(self) -> int:
        t = self.terms
        return t["activations"] + t["loss chunk"]

    @property
    def peak(self) -> int:
        t = self.terms
        persistent = t["weights"] + t["reference"] + t["gradients"] + t["optimizer state"] + t["runtime"]
        return persistent + max(self.update_transient, t["rollout KV cache"])

    @property
    def fits(self) -> Optional[bool]:
        return None if self.gpu_memory is None else self.peak <= self.gpu_memory

    def as_dict(self) -> dict[str, Any]:
        return {"settings": self.settings, "terms_bytes": self.terms, "peak_bytes": self.peak,
                "gpu_memory_bytes": self.gpu_memory, "fits": self.fits}

    def format(self) -> str:
        s = self.settings
        lines = [f"memory plan (predicted) of one step: {s['model']}, {s['parameters'] / 1e9:.3f}B parameters, "
                 f"{s['tokens']} tokens/micro-batch, {'LoRA r=' + str(s['lora_r']) if s['use_peft'] else 'full fine-tuning'}, "
                 f"{s['model_dtype']} weights, checkpointing {'on' if s['gradient_checkpointing'] else 'off'}, beta {s['beta']}"]
        for name, value in self.terms.items():
            note = self.notes.get(name, "")
            lines.append(f"  {name:<34} {gib(value):>9}{'  ' + note if note else ''}")
        lines.append(f"  {'peak':<34} {gib(self.peak):>9}  = weights + reference + gradients + optimizer + runtime "
                     f"+ max(activations + loss chunk, KV cache)")
        if self.gpu_memory is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            lines.append(f"  {verdict} in {gib(self.gpu_memory)} ({self.peak / self.gpu_memory:.0%} of it)")
        return "\n".join(lines)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def parse_size(text: str) -> int:
    """``24GiB``, ``24GB``, ``512MiB``, ``80e9`` -> bytes (GB = 1e9, GiB = 2^30)."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]i?B)?\s*", text)
    if not m:
        raise ValueError(f"--gpu-memory {text!r}: expected a size such as 24GiB, 24GB or 80e9")
    units = {None: 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    return int(float(m.group(1)) * units[m.group(2)])


def lora_activation_bytes(d_in: int, r: int, b: int, dropout: float) -> int:
    """Bytes one LoRA adapter of a linear with ``d_in`` inputs keeps for backward, per token (see the
    module docstring; measured per term with saved-tensor hooks, benchmarks/results/)."""
    return 4 * r + (d_in if dropout > 0 else 0) + (4 * d_in if b != 4 else 0)


def activation_bytes(shape: ModelShape, tokens: int, b: int, gradient_checkpointing: bool,
                     lora_inputs: list[int], lora_r: int, lora_dropout: float = 0.0) -> tuple[int, dict[str, int]]:
    """Bytes saved for the backward of one micro-batch of ``tokens`` tokens (see the module docstring)."""
    H, I, kv, heads = shape.hidden_size, shape.intermediate_size, shape.kv, shape.num_attention_heads
    attention = b * (2 * H + 2 * (H + kv) + kv + H) + 4 * H + 4 * heads
    mlp = b * (2 * H + 4 * I) + 4 * H
    adapters = sum(lora_activation_bytes(d_in, lora_r, b, lora_dropout) for d_in in lora_inputs)
    layer = tokens * (attention + mlp + adapters)
    if gradient_checkpointing:
        layers = shape.num_hidden_layers * tokens * H * b + layer
    else:
        layers = shape.num_hidden_layers * layer
    edges = tokens * H * (4 * b + 4)  # embeddings' output, final norm (and its fp32 upcast), hidden, d hidden
    backward = tokens * (2 * H + 2 * I) * b
    parts = {"layers": layers, "edges": edges, "backward": backward}
    return sum(parts.values()), parts


def plan(model: str | ModelShape, tokens: int, *, use_peft: bool = False, lora_r: int = 16,
         lora_target_modules: str = "all-linear", lora_dropout: float = 0.05, model_dtype: str = "float32",
         gradient_checkpointing: bool = False, beta: float = 0.0, rollout_tokens: Optional[int] = None,
         device: str = "cuda", gpu_memory: Optional[int] = None) -> MemoryPlan:
    """The predicted peak of one step of ``tokens`` tokens per micro-batch (``rollout_tokens``: tokens
    generated at once, default ``tokens``) with these ``GRPOConfig`` settings, on ``device``."""
    from grpo_kernels.autograd import default_chunk_size

    import torch

    shape = load_shape(model) if isinstance(model, str) else model
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    if model_dtype not in DTYPE_BYTES:
        raise ValueError(f"model_dtype must be one of {tuple(DTYPE_BYTES)}, got {model_dtype!r}")
    b = DTYPE_BYTES[model_dtype]
    P = shape.parameters()
    H, V = shape.hidden_size, shape.vocab_size
    targets = lora_targets(lora_target_modules) if use_peft else []
    adapters = shape.lora_parameters(lora_r, targets) if use_peft else 0
    trainable, trainable_bytes = (adapters, 4) if use_peft else (P, b)
    lora_inputs = [shape.linears()[t][0] for t in targets if t in shape.linears()]
    master = trainable_bytes != 4
    activations, parts = activation_bytes(shape, tokens, b, gradient_checkpointing, lora_inputs, lora_r, lora_dropout)
    kind = torch.device("cuda" if device == "cuda" else "cpu")
    chunk = default_chunk_size(V, H, torch.bfloat16 if b == 2 else torch.float32, kind, tokens)
    head_trainable = not use_peft
    terms = {
        "weights": P * b + adapters * 4,
        "reference": P * b if beta > 0 and not use_peft else 0,
        "gradients": trainable * trainable_bytes + (trainable * 4 if master else 0),
        "optimizer state": trainable * (8 + (4 if master else 0)),
        "activations": activations,
        "activations without checkpointing": activation_bytes(shape, tokens, b, False, lora_inputs, lora_r, lora_dropout)[0],
        "activations with checkpointing": activation_bytes(shape, tokens, b, True, lora_inputs, lora_r, lora_dropout)[0],
        "loss chunk": chunk * V * b + (V * H * 4 if head_trainable and b != 4 else 0),
        "rollout KV cache": 2 * shape.num_hidden_layers * shape.kv * (rollout_tokens or tokens) * b,
        "runtime": RUNTIME_BYTES_CPU if device == "cpu" else 0,
    }
    notes = {
        "weights": f"{P / 1e6:.1f}M x {b} B" + (f" + {adapters / 1e6:.2f}M adapter params x 4 B" if use_peft else ""),
        "reference": "adapters off: the policy's own weights" if use_peft and beta > 0 else ("a frozen copy" if beta > 0 else "beta = 0"),
        "gradients": f"{trainable / 1e6:.2f}M trainable x {trainable_bytes} B" + (" + fp32 master grads" if master else ""),
        "optimizer state": "AdamW moments 8 B" + (" + fp32 master 4 B" if master else "") + " per trainable param",
        "activations": f"{'with' if gradient_checkpointing else 'without'} checkpointing (the one this step uses)",
        "activations without checkpointing": "(for comparison; not added)",
        "activations with checkpointing": "(for comparison; not added)",
        "loss chunk": f"{chunk} rows x V={V}" + (" + fp32 dW" if head_trainable and b != 4 else ""),
        "rollout KV cache": f"{rollout_tokens or tokens} tokens (freed before the update)",
        "runtime": "torch + transformers in a CPU process" if device == "cpu" else "not counted on a GPU",
    }
    settings = dict(model=model if isinstance(model, str) else "(shape)", parameters=P, tokens=tokens, use_peft=use_peft,
                    lora_r=lora_r, lora_target_modules=lora_target_modules, model_dtype=model_dtype,
                    gradient_checkpointing=gradient_checkpointing, beta=beta, device=device, chunk_rows=chunk,
                    trainable_parameters=trainable)
    return MemoryPlan(terms, settings, notes, gpu_memory)


def plan_for_run(model_config: Any, cfg, tokens: int, device: str) -> MemoryPlan:
    """The plan of a trainer run: ``cfg``'s settings, ``tokens`` per micro-batch."""
    return plan(ModelShape.from_config(model_config), tokens, use_peft=cfg.use_peft, lora_r=cfg.lora_r,
                lora_target_modules=cfg.lora_target_modules, lora_dropout=cfg.lora_dropout,
                model_dtype=cfg.model_dtype, gradient_checkpointing=cfg.gradient_checkpointing, beta=cfg.beta,
                device=device)


def micro_batch_tokens(rows: list[dict], tokenizer, cfg, world_size: int = 1) -> int:
    """The most tokens one of a run's micro-batches can hold: this rank's completions, each its longest
    prompt (the longest by characters, tokenized) plus ``max_new_tokens``; packed, at most
    ``max_tokens_per_microbatch``; padded, ``micro_batch_size`` rows."""
    longest = max((r["prompt"] for r in rows), key=len, default="")
    prompt = len(tokenizer(longest, add_special_tokens=False)["input_ids"]) if tokenizer is not None else 0
    per_sequence = prompt + cfg.max_new_tokens
    sequences = cfg.prompts_per_step // world_size * cfg.num_generations
    if cfg.padding_free:
        return min(sequences * per_sequence, cfg.max_tokens_per_microbatch or sequences * per_sequence)
    return min(sequences, cfg.micro_batch_size or sequences) * per_sequence


def log_for_run(model_config: Any, cfg, tokens: int, device: str) -> MemoryPlan:
    """At the start of a run: write the plan to ``output_dir/memory_plan.json`` and, with
    ``cfg.progress``, print it to stderr."""
    import sys

    result = plan_for_run(model_config, cfg, tokens, device)
    os.makedirs(cfg.output_dir, exist_ok=True)
    with open(os.path.join(cfg.output_dir, "memory_plan.json"), "w") as f:
        json.dump(result.as_dict(), f, indent=1)
    if cfg.progress:
        print(result.format(), file=sys.stderr)
    return result


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m grpo plan", description="The predicted peak memory of one GRPO step.")
    p.add_argument("--model", required=True, help=f"a config.json, a model folder, or one of {sorted(KNOWN_CONFIGS)}")
    p.add_argument("--tokens", type=int, required=True, help="tokens per micro-batch (packed: real tokens; padded: rows x longest)")
    p.add_argument("--rollout-tokens", type=int, default=None, help="tokens generated at once (default: --tokens)")
    p.add_argument("--use-peft", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-target-modules", default="all-linear")
    p.add_argument("--lora-dropout", type=float, default=0.05)
    p.add_argument("--model-dtype", choices=tuple(DTYPE_BYTES), default="float32")
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--gpu-memory", default=None, help="say whether the peak fits, e.g. 24GiB or 24GB")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = p.parse_args(argv)
    try:
        result = plan(args.model, args.tokens, use_peft=args.use_peft, lora_r=args.lora_r,
                      lora_target_modules=args.lora_target_modules, lora_dropout=args.lora_dropout,
                      model_dtype=args.model_dtype, gradient_checkpointing=args.gradient_checkpointing, beta=args.beta,
                      rollout_tokens=args.rollout_tokens, device=args.device,
                      gpu_memory=None if args.gpu_memory is None else parse_size(args.gpu_memory))
    except ValueError as e:
        p.error(str(e))
    print(json.dumps(result.as_dict(), indent=1) if args.json else result.format())


if __name__ == "__main__":
    main()
