"""The memory plan of one GRPO step: the predicted peak, term by term, from the model's config alone.

    python -m grpo plan --model Qwen2.5-1.5B --tokens 32768 --use-peft --model-dtype bfloat16 \\
        --gradient-checkpointing --gpu-memory 24      # GB (or 24GiB)

Every flag is checked against its declaration before anything is computed: the trainer's settings
(``--use-peft``, ``--lora-r``, ``--beta`` ...) against ``GRPOConfig``'s (the same ranges the trainer
refuses), the plan's own against :class:`PlanSettings`; a bad value is a usage error (exit 2) naming
the flag, as is a ``--model`` whose config.json is not a decoder's.

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
  plus ``4H``; each LoRA adapter its fp32 input after dropout and the dropout mask, ``5 in``, and
  ``4 r``. Without checkpointing all L layers; with it, each layer's input ``H b`` plus one layer
  recomputed in full. Plus the embeddings' output, the final norm's and the hidden states the loss
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
import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from grpo_kernels.bounds import Bounds, OptionError, above, at_least, check_fields, check_value, option

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
DECODER_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


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
        """From a transformers config or a config.json dict (its text config for a multimodal one).
        ``ValueError`` naming the first number a Qwen2/Llama-shaped decoder needs that is missing or
        not a positive int (e.g. the config of an encoder, or not a model config at all)."""
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        elif isinstance(config, dict) and isinstance(config.get("text_config"), dict):
            config = config["text_config"]
        if not isinstance(config, dict) and not hasattr(config, "to_dict"):
            raise ValueError(f"not a model config: a {type(config).__name__}, not a JSON object")
        get = (lambda k, d=None: config.get(k, d)) if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        numbers = {k: get(k) for k in DECODER_KEYS}
        numbers["num_key_value_heads"] = get("num_key_value_heads") or numbers["num_attention_heads"]
        numbers["head_dim"] = get("head_dim")
        for key, value in numbers.items():
            if value is None and key == "head_dim":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"not a decoder config: {key} is {value!r} (a Qwen2/Llama-shaped decoder's config has "
                                 f"{', '.join(DECODER_KEYS)} as positive ints)")
        if numbers["head_dim"] is None and numbers["hidden_size"] % numbers["num_attention_heads"]:
            raise ValueError(f"not a decoder config: hidden_size {numbers['hidden_size']} is not a multiple of "
                             f"num_attention_heads {numbers['num_attention_heads']} (and no head_dim)")
        return cls(tie_word_embeddings=bool(get("tie_word_embeddings", False)), **numbers)

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
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--model {model!r}: {path} is not a readable JSON config ({e})") from None
    try:
        return ModelShape.from_config(config)
    except ValueError as e:
        raise ValueError(f"--model {model!r}: {path}: {e}") from None


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
            lines.append(f"  {verdict} in {self.gpu_memory / 1e9:.4g} GB = {gib(self.gpu_memory)} ({self.peak / self.gpu_memory:.0%} of it)")
        return "\n".join(lines)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def parse_size(text: str) -> float:
    """``24``, ``24GB``, ``24GiB``, ``512MiB``, ``80e9B`` -> bytes (a bare number is GB; GB = 1e9,
    GiB = 2^30). The number is not range-checked here: ``--gpu-memory`` is (:class:`PlanSettings`)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?|inf|nan)\s*(B|[KMGT]i?B)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"--gpu-memory {text!r}: expected a size in GB such as 24, 24GB, 24GiB or 512MiB")
    units = {None: 1e9, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
             "TIB": 2**40}
    return float(m.group(1)) * units[m.group(2).upper() if m.group(2) else None]


def gigabytes(text: str) -> float:
    """``--gpu-memory``'s text -> GB (argparse type: a malformed size is a usage error)."""
    try:
        return parse_size(text) / 1e9
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).split(": ", 1)[-1]) from None


def gpu_memory_bytes(gb: Optional[float]) -> Optional[int]:
    return None if gb is None else round(gb * 1e9)


# The plan's own flags, declared as options (grpo_kernels.bounds) like GRPOConfig's, which give the
# others (PLAN_CONFIG_FIELDS): python -m grpo plan checks every flag against its declaration.
MAX_GPU_GB = (2**63 - 1) / 1e9  # (bytes as an int64)


@dataclass
class PlanSettings:
    """``python -m grpo plan``'s own flags; :func:`plan` reads their declarations too."""

    model: str = option(dataclasses.MISSING, f"a config.json, a model folder, or one of {sorted(KNOWN_CONFIGS)}")
    tokens: int = option(dataclasses.MISSING, "tokens per micro-batch (packed: real tokens; padded: rows x longest)",
                         bounds=at_least(1))
    rollout_tokens: Optional[int] = option(None, "tokens generated at once (None: --tokens)", bounds=at_least(1))
    device: str = option("cuda", "where the step runs", choices=("cuda", "cpu"))
    gpu_memory: Optional[float] = option(None, "the GPU's memory in GB (or with a unit: 24GiB, 80GB): say whether the "
                                         "peak fits", bounds=Bounds(0, MAX_GPU_GB, low_open=True), parse=gigabytes)
    json: bool = option(False, "print the plan as JSON")

    def __post_init__(self) -> None:
        check_fields(PlanSettings, dataclasses.asdict(self), convert=False)


# GRPOConfig's fields the plan reads (their flags and declarations are the config's)
PLAN_CONFIG_FIELDS = ("use_peft", "lora_r", "lora_target_modules", "lora_dropout", "model_dtype", "gradient_checkpointing",
                      "beta")


def check_lora_targets(shape: ModelShape, target_modules: str) -> list[str]:
    """:func:`lora_targets`, each one a linear layer the plan models (``ValueError`` naming
    ``lora_target_modules`` otherwise: a norm, a block, a name the model does not have)."""
    targets = lora_targets(target_modules)
    unknown = [t for t in targets if t not in shape.linears()]
    if not targets or unknown:
        raise OptionError(f"lora_target_modules must be 'all-linear' or linear layers of the planned decoder "
                          f"({', '.join(LINEAR_NAMES)}), got {target_modules!r}", "lora_target_modules")
    return targets


def activation_bytes(shape: ModelShape, tokens: int, b: int, gradient_checkpointing: bool,
                     lora_inputs: list[int], lora_r: int) -> tuple[int, dict[str, int]]:
    """Bytes saved for the backward of one micro-batch of ``tokens`` tokens (see the module docstring)."""
    H, I, kv, heads = shape.hidden_size, shape.intermediate_size, shape.kv, shape.num_attention_heads
    attention = b * (2 * H + 2 * (H + kv) + kv + H) + 4 * H + 4 * heads
    mlp = b * (2 * H + 4 * I) + 4 * H
    adapters = sum(5 * d_in + 4 * lora_r for d_in in lora_inputs)
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
    """The predicted peak of one step of up to ``tokens`` tokens per micro-batch (``rollout_tokens``: tokens
    generated at once, default ``tokens``) with these ``GRPOConfig`` settings, on ``device``; ``gpu_memory``
    in bytes. Every argument is checked against its declaration (``GRPOConfig``'s, :class:`PlanSettings`'),
    and LoRA's targets against the planned decoder's linear layers: ``bounds.OptionError`` naming it."""
    from grpo_kernels.autograd import default_chunk_size

    import torch

    from .config import GRPOConfig  # (its declarations: the same ranges as the trainer's)

    check_fields(GRPOConfig, dict(use_peft=use_peft, lora_r=lora_r, lora_target_modules=lora_target_modules,
                                  lora_dropout=lora_dropout, model_dtype=model_dtype,
                                  gradient_checkpointing=gradient_checkpointing, beta=beta), convert=False)
    check_fields(PlanSettings, dict(tokens=tokens, rollout_tokens=rollout_tokens, device=device), convert=False)
    check_value("gpu_memory", gpu_memory, int, optional=True, bounds=above(0))
    shape = load_shape(model) if isinstance(model, str) else model
    b = DTYPE_BYTES[model_dtype]
    P = shape.parameters()
    H, V = shape.hidden_size, shape.vocab_size
    targets = check_lora_targets(shape, lora_target_modules) if use_peft else []
    adapters = shape.lora_parameters(lora_r, targets) if use_peft else 0
    trainable, trainable_bytes = (adapters, 4) if use_peft else (P, b)
    lora_inputs = [shape.linears()[t][0] for t in targets if t in shape.linears()]
    if use_peft and lora_dropout == 0 and b == 4:
        lora_inputs = []  # the adapter's input is the base layer's saved input (no copy, no mask)
    master = trainable_bytes != 4
    activations, parts = activation_bytes(shape, tokens, b, gradient_checkpointing, lora_inputs, lora_r)
    kind, dtype = torch.device("cuda" if device == "cuda" else "cpu"), torch.bfloat16 if b == 2 else torch.float32
    # the largest chunk of any micro-batch of at most `tokens` tokens (a smaller one may take bigger
    # chunks: N rows are split into equal ones), so that the plan bounds every micro-batch and its peak
    # never falls as tokens grow
    chunk = default_chunk_size(V, H, dtype, kind, min(tokens, default_chunk_size(V, H, dtype, kind)))
    head_trainable = not use_peft
    terms = {
        "weights": P * b + adapters * 4,
        "reference": P * b if beta > 0 and not use_peft else 0,
        "gradients": trainable * trainable_bytes + (trainable * 4 if master else 0),
        "optimizer state": trainable * (8 + (4 if master else 0)),
        "activations": activations,
        "activations without checkpointing": activation_bytes(shape, tokens, b, False, lora_inputs, lora_r)[0],
        "activations with checkpointing": activation_bytes(shape, tokens, b, True, lora_inputs, lora_r)[0],
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
    """``python -m grpo plan``: every flag checked against its declaration (:class:`PlanSettings`, and
    ``GRPOConfig``'s for the trainer's settings); a bad value is a usage error (exit 2) naming the flag."""
    from .config import GRPOConfig
    from .flags import add_config_flags, config_from_args, usage_error

    p = argparse.ArgumentParser(prog="python -m grpo plan", description="The predicted peak memory of one GRPO step.")
    add_config_flags(p, PlanSettings, title="the step")
    add_config_flags(p, GRPOConfig, only=PLAN_CONFIG_FIELDS)
    args = p.parse_args(argv)
    settings = config_from_args(args, PlanSettings, p)
    cfg = config_from_args(args, GRPOConfig, p, only=PLAN_CONFIG_FIELDS)
    try:
        result = plan(settings.model, settings.tokens, rollout_tokens=settings.rollout_tokens, device=settings.device,
                      gpu_memory=gpu_memory_bytes(settings.gpu_memory),
                      **{name: getattr(cfg, name) for name in PLAN_CONFIG_FIELDS})
    except ValueError as e:
        usage_error(p, e, GRPOConfig, PlanSettings)
    print(json.dumps(result.as_dict(), indent=1) if settings.json else result.format())


if __name__ == "__main__":
    main()
