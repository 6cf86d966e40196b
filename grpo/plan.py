"""The memory plan of one GRPO step: the predicted peak, term by term, from the model's config alone.

    python -m grpo plan --model Qwen3-8B --tokens 131072 --use-peft --model-dtype bfloat16 \\
        --gradient-checkpointing --activation-offload --mlp-chunk-tokens 4096 --gpu-memory 80GB

The model is a Qwen2/3- or Llama-shaped decoder (``hidden_size`` H, ``intermediate_size`` I,
``num_hidden_layers`` L, ``num_attention_heads`` / ``num_key_value_heads`` with ``head_dim`` d: q = heads
x d and kv = kv heads x d columns, ``vocab_size`` V, tied or untied ``lm_head``; q/k/v biases as Qwen2
has them unless the config says ``attention_bias``; Qwen3's per-head q/k RMSNorms), trained by
``grpo.trainer``: the fused loss (no [tokens, V] logits), AdamW, and on CUDA flash-attn 2's
variable-length kernel (the plan assumes it and says so: it keeps no [N, N] matrix). Every number is
bytes, predicted, not measured; ``docs/memory.md`` derives each term from what each operation saves for
its backward. ``N`` is the tokens one forward/backward sees: a packed micro-batch (``padding_free``: the
real tokens, at most ``max_tokens_per_microbatch``; G packed completions cost what one sequence of as
many tokens does, every term being linear in N), or a padded one (rows times the longest row).

Persistent (``b``: bytes of the weights' dtype; trainable parameters ``P_t``: all ``P``, or the adapters):

- weights ``P b`` (+ LoRA's fp32 adapters, ``r (in + out)`` per adapted linear); reference: a frozen copy
  with ``beta > 0`` (none with LoRA: the policy with its adapters off); gradients ``P_t`` in their dtype
  (+ fp32 master gradients for 16-bit trainable weights); AdamW's moments 8 B per trainable parameter
  (+ a 4 B fp32 master copy for 16-bit ones); on a CPU the Python runtime (:data:`RUNTIME_BYTES_CPU`).

Activations, per token (``a`` = the activations' bytes, ``b``; what an adapted linear keeps is
:func:`adapter_bytes`):

- a layer's attention block saves (:func:`layer_terms`): RMSNorm's fp32 upcast and 1/rms, ``4H + 4``
  (and its normalised input ``aH`` when its weight trains); the projections' input ``aH`` when q/k/v
  train; Qwen3's q/k norms ``4q + 4 heads + 4kv + 4 kv_heads`` (+ ``a(q + kv)`` when they train);
  flash-attn's q, k, v, output and log-sum-exp ``a(2q + 2kv) + 4 heads`` (the output is o_proj's input).
- fp32 weights under bf16 autocast: every linear keeps a bf16 copy of its weight (``2 in out`` a layer).
- its MLP saves: the norm as above, the gate/up input ``aH`` when they train, gate, act and up outputs
  ``3aI``, and their product ``aI`` when down_proj trains. Its backward adds ``3aI`` at once (the
  gradients of the product, the act and up). With ``mlp_chunk_tokens`` = c (< N), the MLP keeps only its
  input ``aH`` over all N tokens; the rest exists for c tokens at a time (``grpo.activations``), plus the
  input gradient ``aH`` and, for trainable MLP weights, their gradients summed in fp32 (``(4 + b)`` per
  parameter).
- flash-attn 2's varlen backward (the attention workspace): its fp32 dq accumulator and softmax
  statistics ``4q + 4 heads``, dq/dk/dv ``a(q + 2kv)``, dk/dv expanded to every head under GQA
  ``2aq``, and o_proj's input gradient ``aq``.
- a layer's peak: what its attention block saved, plus the larger of (what its MLP saved + the MLP's
  backward temporaries) and the attention workspace, plus the gradients entering and leaving it, ``2aH``.
- checkpointed layer inputs ``L N H a`` on the device; with ``activation_offload`` in (pinned) host memory,
  where the device holds two layers' (the one recomputed and the one prefetched).
- the edges: the final norm's saved tensors, the hidden states the loss reads and their gradient (the
  fused loss computes it in its forward), ``(4 + 2a)H + 4`` (+ ``aH`` for a trainable norm).
- the loss's chunk: one [c, V] block of logits (``c`` = ``grpo_kernels``' default chunk rows for N, H, V
  on the device) and, for a trainable head in 16-bit, its fp32 ``d W`` accumulator.
- the rollout's KV cache: ``2 L kv N a`` for the step's tokens at once (Hugging Face generation on the
  training GPU; freed before the update).

Two moments of the update bound the activations: the forward's end (the checkpointed inputs on the
device, or every layer's saved tensors without checkpointing; the edges; the loss chunk) and a layer's
backward (those inputs or saved tensors, and the layer's peak). Then

peak = weights + reference + gradients + optimizer state + runtime + max(update, KV cache).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .activations import check_settings as check_activation_settings
from .config import above

# Published configs (config.json on the Hugging Face hub, Qwen/Qwen2.5-* and Qwen/Qwen3-8B; parameter
# counts from the model cards: 0.49B, 1.54B, 7.61B, 8.2B), so a plan needs no hub access. docs/shapes/
# holds two of them as config.json files.
KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen2.5-0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "Qwen2.5-1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "Qwen2.5-7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "Qwen3-8B": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=False, attention_bias=False),
}
# A fresh CPU process with torch, transformers, peft and grpo imported, before any model: its peak
# RSS on this project's 2-core machine was 0.41 GiB (torch alone 0.21 GiB), measured 2026-12-01.
RUNTIME_BYTES_CPU = int(0.42 * 2**30)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_LINEARS, MLP_LINEARS = LINEAR_NAMES[:4], LINEAR_NAMES[4:]
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe", "olmo2", "gemma3", "gemma3_text")  # per-head q/k RMSNorms
GPU_MEMORY = above(0)  # --gpu-memory's bound (bytes)
MAX_SEARCH_TOKENS = 2**31  # the largest token count the plan's search tries
TIGHT = 0.95  # a step that fits above this share of the device is reported as leaving no headroom
SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


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
    qk_norm: bool = False  # Qwen3-style RMSNorm over each head's q and k
    attention_bias: Optional[bool] = None  # None: q/k/v biases (Qwen2); True: q/k/v/o biases; False: none

    @classmethod
    def from_config(cls, config: Any) -> "ModelShape":
        """From a transformers config or a config.json dict (its text config for a multimodal one).
        ``ValueError`` when a number the plan needs is missing or not a positive int."""
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        if isinstance(config, dict) and isinstance(config.get("text_config"), dict):
            config = {**config, **config["text_config"]}
        if not isinstance(config, dict) and not hasattr(config, "hidden_size"):
            raise ValueError(f"not a model config: {type(config).__name__}")
        get = (lambda k, d=None: config.get(k, d)) if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        for key in (*SHAPE_FIELDS, "num_key_value_heads", "head_dim"):
            value = get(key)
            if (value is not None or key in SHAPE_FIELDS) and not (isinstance(value, int) and not isinstance(value, bool)
                                                                  and value > 0):
                raise ValueError(f"{key} must be a positive int, got {value!r}")
        heads = get("num_attention_heads")
        bias = get("attention_bias")
        return cls(
            hidden_size=get("hidden_size"), intermediate_size=get("intermediate_size"),
            num_hidden_layers=get("num_hidden_layers"), num_attention_heads=heads,
            num_key_value_heads=get("num_key_value_heads") or heads, vocab_size=get("vocab_size"),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)), head_dim=get("head_dim"),
            qk_norm=get("model_type") in QK_NORM_MODEL_TYPES, attention_bias=None if bias is None else bool(bias),
        )

    @property
    def d(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def q(self) -> int:
        return self.num_attention_heads * self.d

    @property
    def kv(self) -> int:
        return self.num_key_value_heads * self.d

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of one decoder layer."""
        H, I, q = self.hidden_size, self.intermediate_size, self.q
        return {"q_proj": (H, q), "k_proj": (H, self.kv), "v_proj": (H, self.kv), "o_proj": (q, H),
                "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)}

    def parameters(self) -> int:
        """Every parameter: embeddings, layers (biases, two norms, q/k norms), final norm, lm_head."""
        H = self.hidden_size
        biases = {None: self.q + 2 * self.kv, True: self.q + 2 * self.kv + H, False: 0}[self.attention_bias]
        norms = 2 * H + (2 * self.d if self.qk_norm else 0)
        layer = sum(i * o for i, o in self.linears().values()) + biases + norms
        head = 0 if self.tie_word_embeddings else self.vocab_size * H
        return self.vocab_size * H + self.num_hidden_layers * layer + H + head

    def mlp_parameters(self) -> int:
        """The parameters of one layer's MLP (gate, up, down)."""
        return sum(i * o for name, (i, o) in self.linears().items() if name in MLP_LINEARS)

    def lora_parameters(self, r: int, targets: list[str]) -> int:
        return self.num_hidden_layers * sum(r * (i + o) for name, (i, o) in self.linears().items() if name in targets)


def load_shape(model: str, flag: str = "--model") -> ModelShape:
    """A built-in name (:data:`KNOWN_CONFIGS`, with or without ``Qwen/``), a config.json, or a model
    folder; ``ValueError`` naming ``flag`` for anything the plan cannot read."""
    if not isinstance(model, str):
        raise TypeError(f"{flag} must be a str (a config.json, a model folder or a built-in name), got {type(model).__name__}")
    name = model.split("/")[-1]
    if not os.path.exists(model) and name in KNOWN_CONFIGS:
        return ModelShape.from_config(KNOWN_CONFIGS[name])
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {model!r}: not a config.json, a model folder, nor one of {sorted(KNOWN_CONFIGS)}")
    try:
        with open(path) as f:
            config = json.load(f)
        return ModelShape.from_config(config)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{flag} {model!r}: cannot read a decoder's shape from {path}: {e}") from None


def lora_targets(target_modules: str) -> list[str]:
    """The linear layers ``lora_target_modules`` adapts ('all-linear': all seven)."""
    if target_modules.strip().lower() == "all-linear":
        return list(LINEAR_NAMES)
    return [t.strip().rsplit(".", 1)[-1] for t in target_modules.split(",") if t.strip()]


@dataclass
class MemoryPlan:
    """The predicted peak of one step and its terms (device bytes; ``host``: host bytes)."""

    terms: dict[str, int]
    settings: dict[str, Any]
    notes: dict[str, str] = field(default_factory=dict)
    gpu_memory: Optional[int] = None
    host: dict[str, int] = field(default_factory=dict)
    layer_saved: int = 0  # what one layer keeps from its forward to its backward (without checkpointing)
    largest_tokens: Optional[int] = None  # with gpu_memory: the most tokens per micro-batch that fit

    PERSISTENT = ("weights", "reference", "gradients", "optimizer state", "runtime")

    @property
    def persistent(self) -> int:
        return sum(self.terms[k] for k in self.PERSISTENT)

    @property
    def forward_end(self) -> int:
        """Activations at the end of the forward: the kept layer inputs (or every layer's saved
        tensors), the edges and the loss's chunk."""
        t = self.terms
        last = 0 if self.settings["gradient_checkpointing"] else self.layer_saved  # (the last layer's, too)
        return t["checkpointed layer inputs"] + t["saved by the other layers"] + last + t["edges"] + t["loss chunk"]

    @property
    def layer_backward(self) -> int:
        """Activations during a layer's backward: the kept inputs (or saved tensors) and its peak."""
        t = self.terms
        mlp_phase = t["layer: MLP"] + t["layer: LoRA inputs (MLP)"]
        return (t["checkpointed layer inputs"] + t["saved by the other layers"] + t["layer: attention"]
                + t["layer: LoRA inputs (attention)"] + max(mlp_phase, t["attention workspace"]) + t["layer: gradients"])

    @property
    def update_transient(self) -> int:
        return max(self.forward_end, self.layer_backward)

    @property
    def peak(self) -> int:
        return self.persistent + max(self.update_transient, self.terms["rollout KV cache"])

    @property
    def fits(self) -> Optional[bool]:
        return None if self.gpu_memory is None else self.peak <= self.gpu_memory

    def as_dict(self) -> dict[str, Any]:
        return {"settings": self.settings, "terms_bytes": self.terms, "host_bytes": self.host, "peak_bytes": self.peak,
                "update_bytes": self.update_transient, "gpu_memory_bytes": self.gpu_memory, "fits": self.fits,
                "largest_tokens": self.largest_tokens}

    def format(self) -> str:
        s = self.settings
        chunk = s["mlp_chunk_tokens"]
        lines = [f"memory plan (predicted) of one step: {s['model']}, {s['parameters'] / 1e9:.3f}B parameters, "
                 f"{s['tokens']} tokens/micro-batch, {'LoRA r=' + str(s['lora_r']) if s['use_peft'] else 'full fine-tuning'}, "
                 f"{s['model_dtype']} weights{', bf16 autocast' if s['autocast'] else ''}, checkpointing "
                 f"{'on' if s['gradient_checkpointing'] else 'off'}, activation offload "
                 f"{'on' if s['activation_offload'] else 'off'}, "
                 f"MLP chunks {chunk if chunk else 'off'}, beta {s['beta']}, {s['device']}"]
        for name, value in self.terms.items():
            note = self.notes.get(name, "")
            lines.append(f"  {name:<34} {gib(value):>9}{'  ' + note if note else ''}")
        lines.append(f"  {'update (activations at their peak)':<34} {gib(self.update_transient):>9}  = max(forward's end "
                     f"{gib(self.forward_end)}, a layer's backward {gib(self.layer_backward)})")
        lines.append(f"  {'peak':<34} {gib(self.peak):>9}  = weights + reference + gradients + optimizer + runtime "
                     f"+ max(update, KV cache)")
        for name, value in self.host.items():
            lines.append(f"  host memory: {name:<21} {gib(value):>9}  (pinned, not on the device)")
        if self.gpu_memory is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            tight = (": under 5% left for the CUDA context and the allocator's rounding, which the plan does not count"
                     if self.fits and self.peak > TIGHT * self.gpu_memory else "")
            lines.append(f"  {verdict} in {gib(self.gpu_memory)} ({self.peak / self.gpu_memory:.0%} of it{tight})")
            if self.largest_tokens is not None:
                most = (f">= {self.largest_tokens}" if self.largest_tokens >= MAX_SEARCH_TOKENS else str(self.largest_tokens))
                lines.append(f"  largest token count per micro-batch that fits: {most}"
                             + (" (none: the persistent terms alone do not fit)" if self.largest_tokens == 0 else ""))
        return "\n".join(lines)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def parse_size(text: str, flag: str = "--gpu-memory") -> int:
    """``24GiB``, ``24GB``, ``512MiB``, ``80e9`` -> bytes (GB = 1e9, GiB = 2^30); ``ValueError`` naming
    ``flag`` for anything else, a size not finite, or one outside :data:`GPU_MEMORY` (> 0)."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]i?B)?\s*", text) if isinstance(text, str) else None
    try:
        number = float(m.group(1)) if m else math.nan
    except ValueError:
        number = math.nan
    if not m or math.isnan(number):
        raise ValueError(f"{flag} {text!r}: expected a size such as 24GiB, 24GB or 80e9")
    units = {None: 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    size = number * units[m.group(2)]
    if not GPU_MEMORY.holds(size) or size < 1:
        raise ValueError(f"{flag} {text!r}: must be {GPU_MEMORY.describe()} bytes (at least 1)")
    return int(size)


# --------------------------------------------------------------------------------------------------
# the activation terms (bytes per token of one layer, unless said otherwise)
# --------------------------------------------------------------------------------------------------
def adapter_bytes(d_in: int, r: int, dropout: float, b: int, device: str, autocast: bool) -> tuple[int, bool]:
    """(bytes per token one LoRA adapter on a linear with ``d_in`` inputs keeps, whether it keeps the
    raw input instead: the layer's input tensor itself, shared by the adapters on it).

    peft's ``lora.Linear`` computes ``B(A(dropout(x.to(fp32))))``: the cast copies ``x`` unless the
    activations already are fp32 (``b`` 4); dropout keeps its mask, a bool on CUDA (fused dropout) but
    the fp32 scaled noise on a CPU; ``A`` keeps its input: fp32, or under bf16 autocast a bf16 copy;
    ``B`` keeps ``A``'s output, ``r`` wide. With ``dropout = 0``, fp32 activations and no autocast, ``A``'s
    input is ``x`` itself: nothing copied.
    """
    if dropout == 0 and b == 4 and not autocast:
        return 4 * r, True
    mask = 0 if dropout == 0 else (1 if device == "cuda" else 4)
    copy = 2 if autocast else 4
    return d_in * (mask + copy) + r * copy, False


def layer_terms(shape: ModelShape, tokens: int, b: int, *, full: bool, targets: list[str], lora_r: int,
                lora_dropout: float, device: str, autocast: bool, mlp_chunk_tokens: Optional[int]) -> dict[str, int]:
    """One decoder layer's activation terms for ``tokens`` tokens (see the module docstring), bytes:
    ``attention`` / ``mlp`` (what each block saves for its backward, the MLP's backward temporaries
    included), ``lora_attention`` / ``lora_mlp`` (the adapters' inputs), ``workspace`` (flash-attn's
    backward), ``gradients`` (in and out of the layer), ``saved`` (what the layer keeps from its forward
    to its backward: without checkpointing, per layer), ``mlp_chunk`` (the chunk's share of ``mlp``)."""
    H, I, q, kv, heads = shape.hidden_size, shape.intermediate_size, shape.q, shape.kv, shape.num_attention_heads
    kv_heads = shape.num_key_value_heads
    N = tokens
    adapters = {name: adapter_bytes(shape.linears()[name][0], lora_r, lora_dropout, b, device, autocast)
                for name in targets if name in shape.linears()}
    raw = {name for name, (_, keeps_raw) in adapters.items() if keeps_raw}
    adapter = {name: bytes_ for name, (bytes_, _) in adapters.items()}
    norm = 4 * H + 4 + (b * H if full else 0)  # fp32 upcast and 1/rms; the normalised input for the weight's gradient
    # attention: the norm; q/k/v's input (for their weights' gradients); q/k norms; flash-attn's q, k, v, out, lse
    qkv_input = b * H if full or raw & {"q_proj", "k_proj", "v_proj"} else 0
    qk_norm = (4 * (q + kv) + 4 * (heads + kv_heads) + (b * (q + kv) if full else 0)) if shape.qk_norm else 0
    attention = norm + qkv_input + qk_norm + b * (2 * q + 2 * kv) + 4 * heads
    lora_attention = sum(adapter.get(name, 0) for name in ATTENTION_LINEARS)
    # MLP: the norm; gate/up's input; gate, act and up outputs (the act and the product keep them); the product
    # (down_proj's input); backward: the gradients of the product, the act and up at once
    gate_up_input = b * H if full or raw & {"gate_proj", "up_proj"} else 0
    product = b * I if full or "down_proj" in raw else 0
    mlp_core = 3 * b * I + product + 3 * b * I
    lora_mlp = sum(adapter.get(name, 0) for name in MLP_LINEARS)
    chunk = min(mlp_chunk_tokens, N) if mlp_chunk_tokens else N
    if chunk < N:  # grpo.activations.ChunkedMLPFunction: its input over N; the rest one chunk at a time
        trainable_mlp = shape.mlp_parameters() if full else sum(
            lora_r * sum(shape.linears()[n]) for n in MLP_LINEARS if n in adapter)
        accumulators = trainable_mlp * (4 + (b if full else 4))  # fp32 sums + one chunk's gradients
        mlp_saved = norm + b * H
        mlp_chunk = chunk * (mlp_core + b * H) + accumulators  # + the chunk's input gradient
        mlp = N * (mlp_saved + b * H) + mlp_chunk  # + the input gradient dx over N
        lora_mlp_bytes = chunk * lora_mlp
        saved_mlp = N * mlp_saved
    else:
        mlp_chunk = 0
        mlp = N * (norm + gate_up_input + mlp_core)
        lora_mlp_bytes = N * lora_mlp
        saved_mlp = N * (norm + gate_up_input + 3 * b * I + product + lora_mlp)
    gqa = 2 * b * q if kv_heads != heads else 0
    workspace = 4 * q + 4 * heads + b * (q + 2 * kv) + gqa + b * q
    # fp32 weights under bf16 autocast: each linear casts its weight to bf16 and keeps the copy for its
    # input's gradient (frozen or not), a per-layer constant (the MLP's once, chunked or not)
    copies = {block: sum(2 * i * o for n, (i, o) in shape.linears().items() if n in names) if autocast and b == 4 else 0
              for block, names in (("attention", ATTENTION_LINEARS), ("mlp", MLP_LINEARS))}
    return {"attention": N * attention + copies["attention"], "lora_attention": N * lora_attention,
            "mlp": mlp + copies["mlp"], "lora_mlp": lora_mlp_bytes, "mlp_chunk": mlp_chunk, "workspace": N * workspace,
            "gradients": N * 2 * b * H, "saved": N * (attention + lora_attention) + saved_mlp + sum(copies.values())}


def plan(model: str | ModelShape, tokens: int, *, use_peft: bool = False, lora_r: int = 16,
         lora_target_modules: str = "all-linear", lora_dropout: float = 0.05, model_dtype: str = "float32",
         gradient_checkpointing: bool = False, beta: float = 0.0, rollout_tokens: Optional[int] = None,
         device: str = "cuda", gpu_memory: Optional[int] = None, activation_offload: bool = False,
         mlp_chunk_tokens: Optional[int] = None, bf16: bool = True,
         spell: Callable[[str], str] = lambda name: name) -> MemoryPlan:
    """The predicted peak of one step of ``tokens`` tokens per micro-batch (``rollout_tokens``: tokens
    generated at once, default ``tokens``) with these ``GRPOConfig`` settings (``bf16``: autocast, on
    CUDA only), on ``device``. With ``gpu_memory`` (bytes) it says whether the step fits, and the
    largest token count that does. ``spell``: how errors name a setting (the CLI's flags)."""
    shape = load_shape(model, spell("model")) if isinstance(model, str) else model
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"{spell('tokens')} must be an int >= 1, got {tokens!r}")
    if model_dtype not in DTYPE_BYTES:
        raise ValueError(f"{spell('model_dtype')} must be one of {tuple(DTYPE_BYTES)}, got {model_dtype!r}")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"{spell('device')} must be 'cuda' or 'cpu', got {device!r}")
    check_activation_settings(mlp_chunk_tokens, activation_offload, gradient_checkpointing, spell)
    if gpu_memory is not None and (isinstance(gpu_memory, bool) or not isinstance(gpu_memory, (int, float))
                                   or not GPU_MEMORY.holds(gpu_memory)):
        raise ValueError(f"{spell('gpu_memory')} must be {GPU_MEMORY.describe()} bytes, got {gpu_memory!r}")
    settings = dict(use_peft=use_peft, lora_r=lora_r, lora_target_modules=lora_target_modules, lora_dropout=lora_dropout,
                    model_dtype=model_dtype, gradient_checkpointing=gradient_checkpointing, beta=beta, device=device,
                    activation_offload=activation_offload, mlp_chunk_tokens=mlp_chunk_tokens, bf16=bf16)
    result = _plan(shape, tokens, rollout_tokens, **settings)
    result.settings["model"] = model if isinstance(model, str) else "(shape)"
    result.gpu_memory = None if gpu_memory is None else int(gpu_memory)
    if gpu_memory is not None:
        result.largest_tokens = _largest_tokens(lambda n: _plan(shape, n, rollout_tokens, **settings).peak <= gpu_memory)
    return result


def _largest_tokens(fits: Callable[[int], bool]) -> int:
    """The largest N in [1, MAX_SEARCH_TOKENS] with ``fits(N)`` (0: none), by doubling then bisection
    (the peak grows with N: every activation term is linear in it)."""
    if not fits(1):
        return 0
    lo = 1
    while lo < MAX_SEARCH_TOKENS and fits(min(2 * lo, MAX_SEARCH_TOKENS)):
        lo = min(2 * lo, MAX_SEARCH_TOKENS)
    if lo >= MAX_SEARCH_TOKENS:
        return MAX_SEARCH_TOKENS
    hi = 2 * lo  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _plan(shape: ModelShape, tokens: int, rollout_tokens: Optional[int], *, use_peft: bool, lora_r: int,
          lora_target_modules: str, lora_dropout: float, model_dtype: str, gradient_checkpointing: bool, beta: float,
          device: str, activation_offload: bool, mlp_chunk_tokens: Optional[int], bf16: bool) -> MemoryPlan:
    from grpo_kernels.autograd import default_chunk_size

    import torch

    b = DTYPE_BYTES[model_dtype]
    autocast = device == "cuda" and bf16
    P = shape.parameters()
    H, V, L, N = shape.hidden_size, shape.vocab_size, shape.num_hidden_layers, tokens
    targets = lora_targets(lora_target_modules) if use_peft else []
    adapters = shape.lora_parameters(lora_r, targets) if use_peft else 0
    trainable, trainable_bytes = (adapters, 4) if use_peft else (P, b)
    master = trainable_bytes != 4
    layer = layer_terms(shape, N, b, full=not use_peft, targets=targets, lora_r=lora_r, lora_dropout=lora_dropout,
                        device=device, autocast=autocast, mlp_chunk_tokens=mlp_chunk_tokens)
    inputs = L * N * H * b
    offloaded = activation_offload and device == "cuda"  # (on a CPU the trainer's offload is a no-op)
    if gradient_checkpointing:
        on_device = 2 * N * H * b if offloaded else inputs
        others = 0
    else:
        on_device, others = 0, (L - 1) * layer["saved"]
    kind = torch.device("cuda" if device == "cuda" else "cpu")
    chunk = default_chunk_size(V, H, torch.bfloat16 if b == 2 else torch.float32, kind, tokens)
    head_trainable = not use_peft
    final_norm = N * (4 * H + 4 + (b * H if not use_peft else 0))
    terms = {
        "weights": P * b + adapters * 4,
        "reference": P * b if beta > 0 and not use_peft else 0,
        "gradients": trainable * trainable_bytes + (trainable * 4 if master else 0),
        "optimizer state": trainable * (8 + (4 if master else 0)),
        "runtime": RUNTIME_BYTES_CPU if device == "cpu" else 0,
        "checkpointed layer inputs": on_device,
        "saved by the other layers": others,
        "layer: attention": layer["attention"],
        "layer: LoRA inputs (attention)": layer["lora_attention"],
        "layer: MLP": layer["mlp"],
        "layer: LoRA inputs (MLP)": layer["lora_mlp"],
        "attention workspace": layer["workspace"],
        "layer: gradients": layer["gradients"],
        "edges": final_norm + 2 * N * H * b,
        "loss chunk": chunk * V * b + (V * H * 4 if head_trainable and b != 4 else 0),
        "rollout KV cache": 2 * L * shape.kv * (rollout_tokens or tokens) * b,
    }
    lora_note = (f"{len([t for t in targets if t in ATTENTION_LINEARS])} adapters x N tokens, dropout {lora_dropout}"
                 f"{', bf16 autocast' if autocast else ''}")
    chunk_tokens = min(mlp_chunk_tokens, N) if mlp_chunk_tokens else N
    notes = {
        "weights": f"{P / 1e6:.1f}M x {b} B" + (f" + {adapters / 1e6:.2f}M adapter params x 4 B" if use_peft else ""),
        "reference": "adapters off: the policy's own weights" if use_peft and beta > 0 else ("a frozen copy" if beta > 0 else "beta = 0"),
        "gradients": f"{trainable / 1e6:.2f}M trainable x {trainable_bytes} B" + (" + fp32 master grads" if master else ""),
        "optimizer state": "AdamW moments 8 B" + (" + fp32 master 4 B" if master else "") + " per trainable param",
        "runtime": "torch + transformers in a CPU process" if device == "cpu" else "not counted on a GPU",
        "checkpointed layer inputs": (
            "checkpointing off: none kept (every layer keeps its saved tensors)" if not gradient_checkpointing else
            f"offloaded: 2 layers on the device (recomputed + prefetched) of {L} x N x H x {b} B in host memory"
            if offloaded else f"{L} layers x N x H x {b} B on the device"
            + (" (activation_offload: a no-op on a CPU)" if activation_offload else "")),
        "saved by the other layers": "checkpointing on: recomputed one layer at a time" if gradient_checkpointing else
        f"{L - 1} layers x their saved tensors (no checkpointing)",
        "layer: attention": "norm, q/k/v" + (" + q/k norms" if shape.qk_norm else "") + ", flash-attn's q k v out lse",
        "layer: LoRA inputs (attention)": lora_note if use_peft else "no adapters",
        "layer: MLP": (f"chunks of {chunk_tokens} tokens: its input over N + one chunk ({gib(layer['mlp_chunk'])})"
                       if chunk_tokens < N else "whole micro-batch: 4-5 x N x I saved + 3 x N x I gradients"),
        "layer: LoRA inputs (MLP)": (f"{len([t for t in targets if t in MLP_LINEARS])} adapters x "
                                     f"{chunk_tokens} tokens" if use_peft else "no adapters"),
        "attention workspace": "flash-attn 2 varlen backward (assumed): fp32 dq, dq/dk/dv" + (
            ", dk/dv per head (GQA)" if shape.num_key_value_heads != shape.num_attention_heads else ""),
        "layer: gradients": "the gradient into and out of the layer, 2 x N x H",
        "edges": "final norm, the hidden states the loss reads and their gradient",
        "loss chunk": f"{chunk} rows x V={V}" + (" + fp32 dW" if head_trainable and b != 4 else ""),
        "rollout KV cache": f"{rollout_tokens or tokens} tokens (generation on this GPU; freed before the update)",
    }
    host = {"checkpointed layer inputs": inputs} if gradient_checkpointing and offloaded else {}
    settings = dict(parameters=P, tokens=tokens, use_peft=use_peft, lora_r=lora_r,
                    lora_target_modules=lora_target_modules, lora_dropout=lora_dropout, model_dtype=model_dtype,
                    gradient_checkpointing=gradient_checkpointing, beta=beta, device=device, chunk_rows=chunk,
                    trainable_parameters=trainable, activation_offload=activation_offload,
                    mlp_chunk_tokens=mlp_chunk_tokens, autocast=autocast,
                    attention="flash-attn 2 varlen (assumed)" if device == "cuda" else "packed SDPA")
    return MemoryPlan(terms, settings, notes, host=host, layer_saved=layer["saved"])


def plan_for_run(model_config: Any, cfg, tokens: int, device: str) -> MemoryPlan:
    """The plan of a trainer run: ``cfg``'s settings, ``tokens`` per micro-batch."""
    return plan(ModelShape.from_config(model_config), tokens, use_peft=cfg.use_peft, lora_r=cfg.lora_r,
                lora_target_modules=cfg.lora_target_modules, lora_dropout=cfg.lora_dropout,
                model_dtype=cfg.model_dtype, gradient_checkpointing=cfg.gradient_checkpointing, beta=cfg.beta,
                device=device, activation_offload=cfg.activation_offload, mlp_chunk_tokens=cfg.mlp_chunk_tokens,
                bf16=cfg.bf16)


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
    p.add_argument("--activation-offload", action=argparse.BooleanOptionalAction, default=False,
                   help="the checkpointed layer inputs in host memory (needs --gradient-checkpointing)")
    p.add_argument("--mlp-chunk-tokens", type=int, default=None, help="each MLP over chunks of this many tokens")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast (on CUDA)")
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--gpu-memory", default=None, help="the device's memory, e.g. 80GB or 24GiB: says whether the step "
                   "fits and the largest token count that does")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = p.parse_args(argv)
    flag = lambda name: "--" + name.replace("_", "-")  # noqa: E731
    try:  # (every check needs only the config: nothing is loaded)
        gpu_memory = None if args.gpu_memory is None else parse_size(args.gpu_memory)
        result = plan(args.model, args.tokens, use_peft=args.use_peft, lora_r=args.lora_r,
                      lora_target_modules=args.lora_target_modules, lora_dropout=args.lora_dropout,
                      model_dtype=args.model_dtype, gradient_checkpointing=args.gradient_checkpointing, beta=args.beta,
                      rollout_tokens=args.rollout_tokens, device=args.device, gpu_memory=gpu_memory,
                      activation_offload=args.activation_offload, mlp_chunk_tokens=args.mlp_chunk_tokens,
                      bf16=args.bf16, spell=flag)
    except (TypeError, ValueError) as e:
        p.error(str(e))
    print(json.dumps(result.as_dict(), indent=1) if args.json else result.format())


if __name__ == "__main__":
    main()
