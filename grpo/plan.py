"""The memory plan of one GRPO step: the predicted peak, term by term, from the model's config alone.

    python -m grpo plan --model Qwen3-8B --tokens 131072 --use-peft --model-dtype bfloat16 \\
        --gradient-checkpointing --activation-offload --mlp-chunk-tokens 4096 --gpu-memory 80   # GB (or 80GiB)

Every flag is checked against its declaration before anything is computed: the trainer's settings
(``--use-peft``, ``--lora-r``, ``--activation-offload``, ``--mlp-chunk-tokens``, ``--beta`` ...: the
``GRPOConfig`` fields in :data:`PLAN_CONFIG_FIELDS`) against ``GRPOConfig``'s (the same ranges the
trainer refuses), the plan's own against :class:`PlanSettings`; a bad value is a usage error (exit 2)
naming the flag, as is a ``--model`` whose config.json is not a decoder's. :func:`plan` checks its
arguments against the same declarations (``grpo_kernels.bounds.OptionError`` naming the argument).

The model is a Qwen2/3- or Llama-shaped decoder (``hidden_size`` H, ``intermediate_size`` I,
``num_hidden_layers`` L, ``num_attention_heads`` / ``num_key_value_heads`` with ``head_dim`` d: q = heads
x d and kv = kv heads x d columns, ``vocab_size`` V, tied or untied ``lm_head``; q/k/v biases as Qwen2
has them unless the config says ``attention_bias``; Qwen3's per-head q/k RMSNorms), trained by
``grpo.trainer``: the fused loss (no [tokens, V] logits), AdamW, and on CUDA flash-attn 2's
variable-length kernel (the plan assumes it and says so: it keeps no [N, N] matrix). Every number is
bytes, predicted, not measured; ``docs/memory.md`` derives each term from what each operation saves for
its backward. ``N`` is the tokens one forward/backward sees: a packed micro-batch (``padding_free``: the
real tokens, at most ``max_tokens_per_microbatch``, in ``sequences`` packed sequences), or a padded one
(rows times the longest row). Every activation term is linear in N; the packing enters only through
flash-attn's backward, which pads each sequence's rows of its fp32 accumulators by 128.

Persistent (``b``: bytes of the weights' dtype; trainable parameters ``P_t``: all ``P``, or the adapters):

- weights ``P b`` (+ LoRA's fp32 adapters, ``r (in + out)`` per adapted linear); reference: a frozen copy
  with ``beta > 0`` (none with LoRA: the policy with its adapters off); gradients ``P_t`` in their dtype
  (+ fp32 master gradients for 16-bit trainable weights); AdamW's moments 8 B per trainable parameter
  (+ a 4 B fp32 master copy for 16-bit ones).
- runtime: on a CPU the Python process (:data:`RUNTIME_BYTES_CPU`, measured) and its tokenizer
  (:data:`TOKENIZER_BYTES_PER_ENTRY_CPU` per vocabulary entry, measured), freed memory assumed returned
  (``release_memory`` 'always'; with another policy the runtime's note says what is not counted); on a GPU
  :data:`CUDA_RUNTIME_BYTES`: the CUDA context (local memory for every resident thread, the device heap,
  the driver's state), the kernels' images loaded on first use, and cuBLAS/cuBLASLt's workspaces
  (an estimate for a Hopper GPU, derived in docs/memory.md, to be checked on the first lent GPU).

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
  statistics ``4 heads d' + 4 heads`` (``d'``: d rounded up to 32) over N + 128 rows per packed
  sequence, dq/dk/dv ``a(q + 2kv)``, dk/dv expanded to every head under GQA ``2aq``, and o_proj's input
  gradient ``aq``.
- a layer's peak: what its attention block saved, plus the larger of (what its MLP saved + the MLP's
  backward temporaries) and the attention workspace, plus the gradients entering and leaving it, ``2aH``.
- checkpointed layer inputs ``L N H a`` on the device; with ``activation_offload`` in (pinned) host memory,
  where the device holds two layers' (the one recomputed and the one prefetched).
- the edges: the final norm's saved tensors, the hidden states the loss reads and their gradient (the
  fused loss computes it in its forward), ``(4 + 2a)H + 4`` (+ ``aH`` for a trainable norm).
- the loss's chunk: one [c, V] block of logits (``c`` = ``grpo_kernels``' default chunk rows on the
  device: the largest chunk of any micro-batch of at most N tokens, so that the peak never falls as N
  grows) and, for a trainable head in 16-bit, its fp32 ``d W`` accumulator; a frozen head (LoRA) on a
  CPU walks the vocabulary in blocks instead: ``grpo_kernels.kernels.torch_rows.frozen_head_bytes``.
- the rollout's KV cache: ``2 L kv N a`` for the step's tokens at once (Hugging Face generation on the
  training GPU; freed before the update).

Two moments of the update bound the activations: the forward's end (the checkpointed inputs on the
device, or every layer's saved tensors without checkpointing; the edges; the loss chunk) and a layer's
backward (those inputs or saved tensors, and the layer's peak). Then

peak = weights + reference + gradients + optimizer state + runtime + max(update, KV cache).

The verdict: the step fits a device of ``gpu_memory`` bytes when peak + the allocator reserve (on a GPU,
:func:`allocator_reserve`: torch's caching allocator's block rounding, and fragmentation modelled as
one stranded block of the largest tensor a layer's backward allocates and frees) is at most
``gpu_memory``. ``fits``, the largest token count that fits and the JSON's ``fits`` all read that one
predicate (:attr:`MemoryPlan.needed`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from grpo_kernels.bounds import Bounds, OptionError, above, at_least, check_fields, check_value, option

from .activations import check_offload
from .config import GRPOConfig
from .flags import add_config_flags, config_from_args, usage_error

# Published configs (config.json on the Hugging Face hub, Qwen/Qwen2.5-* and Qwen/Qwen3-*; parameter
# counts from the model cards: 0.49B, 1.54B, 7.61B; 0.6B, 1.7B, 4.0B, 8.2B), so a plan needs no hub access. docs/shapes/
# holds two of them as config.json files.
KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen2.5-0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "Qwen2.5-1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "Qwen2.5-7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "Qwen3-0.6B": dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True, attention_bias=False),
    "Qwen3-1.7B": dict(model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True, attention_bias=False),
    "Qwen3-4B": dict(model_type="qwen3", hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=True, attention_bias=False),
    "Qwen3-8B": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=False, attention_bias=False),
}
MiB = 2**20
# A fresh CPU process with torch, transformers, peft and grpo imported, before any model: its peak
# RSS on this project's 2-core machine was 0.41 GiB (torch alone 0.21 GiB), measured 2026-12-01.
RUNTIME_BYTES_CPU = int(0.42 * 2**30)
# ... and the run's tokenizer, per vocabulary entry: resident growth of AutoTokenizer.from_pretrained for
# character tokenizers of 151,936 and 32,000 entries, 384 and 519 B (56 and 16 MiB), measured 2026-12-02
# (benchmarks/results/lora_memory-cpu-20261202.md); a CPU step's whole process holds it.
TOKENIZER_BYTES_PER_ENTRY_CPU = 450
# What a CUDA process holds besides its tensors, on a Hopper GPU (H100 SXM / H200: 132 SMs of compute
# capability 9.0), with lazy module loading (CUDA >= 11.7; torch's default). docs/memory.md derives each
# part; together an ESTIMATE (0.66 GiB), to be checked on the first lent GPU: `benchmarks.
# long_context options --device cuda` records the measured context and the memory outside torch's
# allocator beside it. Other GPUs have as many or fewer resident threads: a smaller context.
HOPPER_SMS, THREADS_PER_SM = 132, 2048
STACK_BYTES_PER_THREAD = 1024  # cudaLimitStackSize's default
CUDA_RUNTIME_BYTES: dict[str, int] = {
    # the driver reserves each resident thread's local memory (its stack) when the context is made
    "context: local memory": STACK_BYTES_PER_THREAD * THREADS_PER_SM * HOPPER_SMS,  # 264 MiB
    "context: device heap and printf FIFO": 8 * MiB + 1 * MiB,  # cudaLimitMallocHeapSize / PrintfFifoSize defaults
    # the rest of a bare torch context: 426 MiB measured on a 142-SM Ada GPU (torch 2.10, CUDA 13) less
    # its 213 MiB of local memory (142 x 1,536 threads x 1 KiB) and the 9 MiB above
    "context: driver state": 204 * MiB,
    # the step's kernels (ATen, cuBLAS/cuBLASLt, flash-attn, ours in Triton), each module loaded on first use
    "kernel images": 128 * MiB,
    # torch's cuBLAS workspace (sm90: 4,096 KiB x 8) and cuBLASLt's (1 MiB), one per (cuBLAS handle,
    # stream): the forward's thread and autograd's device thread (the backward, the recompute) each
    # hold a handle. Allocated by the caching allocator, so in torch.cuda.max_memory_allocated.
    "cuBLAS workspaces": 2 * (4096 * 1024 * 8 + 1 * MiB),
}
RUNTIME_OUTSIDE_ALLOCATOR = ("context: local memory", "context: device heap and printf FIFO", "context: driver state",
                             "kernel images")
# torch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp): every block a multiple of 512 B
# (kMinBlockSize); a request of 10 MiB or more (kMinLargeAlloc) gets its own segment rounded up to
# 2 MiB (kRoundLarge), its tail unusable by anything but another request of 1-2 MiB; smaller ones
# share 2 MiB (<= 1 MiB requests) or 20 MiB segments, at most one of each partly filled.
ALLOC_MIN_BLOCK, ALLOC_MIN_LARGE, ALLOC_ROUND_LARGE = 512, 10 * MiB, 2 * MiB
ALLOC_SEGMENT_TAILS = 20 * MiB + 2 * MiB
# the tensors a layer's recompute and backward hold at once (docs/memory.md lists them; fewer than
# this for every supported shape), each rounded by at most ALLOC_ROUND_LARGE
LAYER_TENSORS = 64
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EMBEDDING = "embed_tokens"  # the input embeddings: a LoRA target too (peft's lora.Embedding) when untied from the head
ATTENTION_LINEARS, MLP_LINEARS = LINEAR_NAMES[:4], LINEAR_NAMES[4:]
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe", "olmo2", "gemma3", "gemma3_text")  # per-head q/k RMSNorms
DECODER_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
MAX_SEARCH_TOKENS = 2**31  # the largest token count the plan's search tries
FLASH_PAD_ROWS = 128  # flash-attn 2's varlen backward: its fp32 accumulators pad each sequence by 128 rows


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
        ``ValueError`` naming the first number a Qwen2/3- or Llama-shaped decoder needs that is missing
        or not a positive int (e.g. the config of an encoder, or not a model config at all)."""
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        if isinstance(config, dict) and isinstance(config.get("text_config"), dict):
            config = {**config, **config["text_config"]}
        if not isinstance(config, dict) and not hasattr(config, "to_dict"):
            raise ValueError(f"not a model config: a {type(config).__name__}, not a JSON object")
        get = (lambda k, d=None: config.get(k, d)) if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        numbers = {k: get(k) for k in DECODER_KEYS}
        kv_heads = get("num_key_value_heads")
        numbers["num_key_value_heads"] = numbers["num_attention_heads"] if kv_heads is None else kv_heads
        numbers["head_dim"] = get("head_dim")
        for key, value in numbers.items():
            if value is None and key == "head_dim":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"not a decoder config: {key} is {value!r} (a Qwen2/3- or Llama-shaped decoder's config "
                                 f"has {', '.join(DECODER_KEYS)} as positive ints)")
        heads = numbers["num_attention_heads"]
        if numbers["head_dim"] is None and numbers["hidden_size"] % heads:
            raise ValueError(f"not a decoder config: hidden_size {numbers['hidden_size']} is not a multiple of "
                             f"num_attention_heads {heads} (and no head_dim)")
        if heads % numbers["num_key_value_heads"]:
            raise ValueError(f"not a decoder config: num_attention_heads {heads} is not a multiple of "
                             f"num_key_value_heads {numbers['num_key_value_heads']}")
        bias = get("attention_bias")
        return cls(tie_word_embeddings=bool(get("tie_word_embeddings", False)), qk_norm=get("model_type") in QK_NORM_MODEL_TYPES,
                   attention_bias=None if bias is None else bool(bias), **numbers)

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

    def parameter_tensors(self) -> list[int]:
        """The element count of every parameter tensor: embeddings, each layer's linears, biases and norms
        (q/k norms), the final norm, an untied lm_head."""
        H = self.hidden_size
        biases = {None: [self.q, self.kv, self.kv], True: [self.q, self.kv, self.kv, H], False: []}[self.attention_bias]
        norms = [H, H] + ([self.d, self.d] if self.qk_norm else [])
        layer = [i * o for i, o in self.linears().values()] + biases + norms
        head = [] if self.tie_word_embeddings else [self.vocab_size * H]
        return [self.vocab_size * H] + layer * self.num_hidden_layers + [H] + head

    def parameters(self) -> int:
        """Every parameter: embeddings, layers (biases, two norms, q/k norms), final norm, lm_head."""
        return sum(self.parameter_tensors())

    def mlp_parameters(self) -> int:
        """The parameters of one layer's MLP (gate, up, down)."""
        return sum(i * o for name, (i, o) in self.linears().items() if name in MLP_LINEARS)

    def lora_tensors(self, r: int, targets: list[str]) -> list[int]:
        """The element count of every LoRA adapter matrix (A: r x in, B: out x r) on ``targets``; on the input
        embeddings (:data:`EMBEDDING`), peft's ``lora.Embedding``: A r x V, B H x r."""
        layers = [n for name, (i, o) in self.linears().items() if name in targets for n in (r * i, r * o)] * self.num_hidden_layers
        return layers + ([r * self.vocab_size, self.hidden_size * r] if EMBEDDING in targets else [])

    def lora_parameters(self, r: int, targets: list[str]) -> int:
        return sum(self.lora_tensors(r, targets))


def load_shape(model: str, flag: str = "--model") -> ModelShape:
    """A built-in name (:data:`KNOWN_CONFIGS`, with or without ``Qwen/``), a config.json, or a model
    folder; ``ValueError`` naming ``flag`` and the file for anything the plan cannot read."""
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
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{flag} {model!r}: {path} is not a readable JSON config ({e})") from None
    try:
        return ModelShape.from_config(config)
    except ValueError as e:
        raise ValueError(f"{flag} {model!r}: {path}: {e}") from None


def lora_targets(target_modules: str) -> list[str]:
    """The linear layers ``lora_target_modules`` adapts ('all-linear': all seven)."""
    if target_modules.strip().lower() == "all-linear":
        return list(LINEAR_NAMES)
    return [t.strip().rsplit(".", 1)[-1] for t in target_modules.split(",") if t.strip()]


def check_lora_targets(shape: ModelShape, target_modules: str) -> list[str]:
    """:func:`lora_targets`, each one a linear layer the plan models or the input embeddings of a model whose
    head is not tied to them (``ValueError`` naming ``lora_target_modules`` otherwise: a norm, a block, a name
    the model does not have; ``grpo.lora.check_targets`` refuses the tied embeddings too)."""
    targets = lora_targets(target_modules)
    unknown = [t for t in targets if t not in shape.linears() and t != EMBEDDING]
    if not targets or unknown:
        raise OptionError(f"lora_target_modules must be 'all-linear' or linear layers of the planned decoder "
                          f"({', '.join(LINEAR_NAMES)}) or its untied input embeddings ({EMBEDDING}), got "
                          f"{target_modules!r}", "lora_target_modules")
    if EMBEDDING in targets and shape.tie_word_embeddings:
        raise OptionError(f"lora_target_modules names {EMBEDDING}, the input embeddings, which this model ties to lm_head "
                          "(tie_word_embeddings): an adapter would train the embeddings but not the head", "lora_target_modules")
    return targets


# --------------------------------------------------------------------------------------------------
# the CUDA caching allocator: what it holds for a request, and the reserve the verdict keeps
# --------------------------------------------------------------------------------------------------
def allocator_block(size: int) -> int:
    """The bytes torch's CUDA caching allocator holds for a request of ``size`` bytes: a multiple of
    512 B, and from 10 MiB on its own segment rounded up to 2 MiB (see :data:`ALLOC_ROUND_LARGE`)."""
    if size <= 0:
        return 0
    step = ALLOC_ROUND_LARGE if size >= ALLOC_MIN_LARGE else ALLOC_MIN_BLOCK
    return -(-size // step) * step


def allocator_reserve(kept_tensors: list[int], transient_tensors: dict[str, int]) -> tuple[dict[str, int], str]:
    """The memory a GPU needs beyond the plan's peak for torch's caching allocator, and the name of the
    largest transient tensor (docs/memory.md, "The allocator reserve"):

    - block rounding: each tensor the step keeps (``kept_tensors``, bytes: weights, adapters, gradients,
      optimizer state, the checkpointed inputs on the device) rounded as :func:`allocator_block` rounds
      it, exactly; :data:`LAYER_TENSORS` transient tensors of one layer at most 2 MiB each; one partly
      filled segment of each pool, :data:`ALLOC_SEGMENT_TAILS`.
    - fragmentation: one block of the largest tensor a layer's recompute, its backward or the loss
      allocates and frees (``transient_tensors``: name -> bytes). Each layer's backward allocates the
      sizes the previous layer's freed, into those blocks, but the tensors that outlive a layer (the
      gradient passed down, the prefetched input, the summed parameter gradients) were carved out of
      them meanwhile; the model is that the largest request then finds no free block big enough once
      and takes a new segment. A model, not a bound: the first lent GPU checks it
      (``max_memory_reserved - max_memory_allocated``, ``python -m benchmarks.long_context options``).
    """
    name, largest = max(transient_tensors.items(), key=lambda kv: kv[1])
    rounding = sum(allocator_block(n) - n for n in kept_tensors) + LAYER_TENSORS * ALLOC_ROUND_LARGE + ALLOC_SEGMENT_TAILS
    return {"block rounding": rounding, "fragmentation": allocator_block(largest)}, name


# --------------------------------------------------------------------------------------------------
# pinned host memory: torch's CUDA host allocator rounds each block up to a power of two
# --------------------------------------------------------------------------------------------------
PINNED_ROUND_SETTING = "pinned_max_round_threshold_mb"  # torch's allocator setting that ends the rounding above it
ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def pinned_round_threshold(environ: Optional[dict] = None) -> Optional[int]:
    """The bytes above which torch's pinned host allocator stops rounding a block up to a power of two:
    ``pinned_max_round_threshold_mb`` in ``PYTORCH_ALLOC_CONF`` (or ``PYTORCH_CUDA_ALLOC_CONF``), or None
    when unset (every block rounded: ``torch.cuda.memory.host_memory_stats``' documentation)."""
    environ = os.environ if environ is None else environ
    for variable in ALLOC_CONF_VARIABLES:
        for item in environ.get(variable, "").split(","):
            key, _, value = item.partition(":")
            if key.strip() == PINNED_ROUND_SETTING and value.strip().isdigit():
                return int(value.strip()) * MiB
    return None


def pinned_block(size: int, threshold: Optional[int]) -> int:
    """The bytes torch's pinned allocator takes for a request of ``size``: the next power of two, or ``size``
    itself above ``threshold`` (:func:`pinned_round_threshold`)."""
    if size <= 0:
        return 0
    if threshold is not None and size > threshold:
        return size
    return 1 << (size - 1).bit_length()


def physical_memory() -> Optional[int]:
    """This machine's physical memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return None


@dataclass
class MemoryPlan:
    """The predicted peak of one step and its terms (device bytes; ``host``: host bytes)."""

    terms: dict[str, int]
    settings: dict[str, Any]
    notes: dict[str, str] = field(default_factory=dict)
    gpu_memory: Optional[int] = None
    host: dict[str, int] = field(default_factory=dict)
    layer_saved: int = 0  # what one layer keeps from its forward to its backward (without checkpointing)
    layer: dict[str, int] = field(default_factory=dict)  # one layer's terms (layer_terms), for layer_peak
    largest_tokens: Optional[int] = None  # with gpu_memory: the most tokens per micro-batch that fit
    runtime: dict[str, int] = field(default_factory=dict)  # the runtime term's parts
    reserve: dict[str, int] = field(default_factory=dict)  # the allocator reserve's parts (allocator_reserve)
    largest_transient: str = ""  # the tensor the fragmentation reserve is one block of
    ranks_per_node: int = 1  # ranks on one machine, each pinning its own host copies
    host_memory: Optional[int] = None  # one machine's host memory (bytes), for the host verdict

    @property
    def host_per_node(self) -> int:
        """Host memory the offload pins on one machine: every rank there holds its own copies."""
        return self.ranks_per_node * sum(self.host.values())

    @property
    def host_fits(self) -> Optional[bool]:
        return None if self.host_memory is None or not self.host else self.host_per_node <= self.host_memory

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
        return t["checkpointed layer inputs"] + t["saved by the other layers"] + layer_peak(self.layer)

    @property
    def update_transient(self) -> int:
        return max(self.forward_end, self.layer_backward)

    @property
    def peak(self) -> int:
        t = self.terms
        return self.persistent + max(self.update_transient, t["rollout KV cache"], t.get("no-grad pass", 0))

    @property
    def allocator_peak(self) -> int:
        """What ``torch.cuda.max_memory_allocated`` should show (the peak less the runtime's parts outside
        torch's allocator: the context and the kernels' images); on a CPU the peak itself (peak RSS)."""
        return self.peak - sum(self.runtime.get(k, 0) for k in RUNTIME_OUTSIDE_ALLOCATOR)

    @property
    def allocator_reserve(self) -> int:
        return sum(self.reserve.values())

    @property
    def needed(self) -> int:
        """The device memory the step needs: its peak and the allocator reserve (the verdict's one predicate)."""
        return self.peak + self.allocator_reserve

    @property
    def fits(self) -> Optional[bool]:
        return None if self.gpu_memory is None else self.needed <= self.gpu_memory

    def as_dict(self) -> dict[str, Any]:
        return {"settings": self.settings, "terms_bytes": self.terms, "runtime_bytes": self.runtime,
                "host_bytes": self.host, "peak_bytes": self.peak, "update_bytes": self.update_transient,
                "allocator_peak_bytes": self.allocator_peak,
                "allocator_reserve_bytes": {**self.reserve, "total": self.allocator_reserve,
                                            "largest_transient_tensor": self.largest_transient},
                "needed_bytes": self.needed, "gpu_memory_bytes": self.gpu_memory, "fits": self.fits,
                "largest_tokens": self.largest_tokens, "ranks_per_node": self.ranks_per_node,
                "host_per_node_bytes": self.host_per_node, "host_memory_bytes": self.host_memory,
                "host_fits": self.host_fits, "no_grad_pass_bytes": self.terms.get("no-grad pass", 0)}

    def format(self) -> str:
        s = self.settings
        chunk = s["mlp_chunk_tokens"]
        lines = [f"memory plan (predicted) of one step: {s['model']}, {s['parameters'] / 1e9:.3f}B parameters, "
                 f"{s['tokens']} tokens/micro-batch in {s['sequences']} sequence{'s' if s['sequences'] > 1 else ''}, "
                 f"{'LoRA r=' + str(s['lora_r']) if s['use_peft'] else 'full fine-tuning'}, "
                 f"{s['model_dtype']} weights{', bf16 autocast' if s['autocast'] else ''}, checkpointing "
                 f"{'on' if s['gradient_checkpointing'] else 'off'}, activation offload "
                 f"{'on' if s['activation_offload'] else 'off'}, "
                 f"MLP chunks {chunk if chunk else 'off'}, fused RMSNorm {'on' if s['fused_norm'] else 'off'}, "
                 f"beta {s['beta']}, {s['device']}"]
        for name, value in self.terms.items():
            note = self.notes.get(name, "")
            lines.append(f"  {name:<34} {gib(value):>9}{'  ' + note if note else ''}")
        lines.append(f"  {'update (activations at their peak)':<34} {gib(self.update_transient):>9}  = max(forward's end "
                     f"{gib(self.forward_end)}, a layer's backward {gib(self.layer_backward)})")
        lines.append(f"  {'peak':<34} {gib(self.peak):>9}  = weights + reference + gradients + optimizer + runtime "
                     f"+ max(update, KV cache, no-grad pass)")
        for name, value in self.host.items():
            lines.append(f"  host memory: {name:<21} {gib(value):>9}  (pinned, not on the device; "
                         f"{self.notes.get('host: ' + name, '')})")
        if self.host:
            lines.append(f"  host memory per node ({self.ranks_per_node} rank{'s' if self.ranks_per_node > 1 else ''}) "
                         f"{gib(self.host_per_node):>9}  (each rank pins its own copies)")
            if self.host_memory is not None:
                lines.append(f"  host: {'fits' if self.host_fits else 'does NOT fit'} in {self.host_memory / 1e9:.4g} GB "
                             f"= {gib(self.host_memory)} of host memory: needs {gib(self.host_per_node)}")
        if self.reserve:
            lines.append(f"  {'allocator reserve':<34} {gib(self.allocator_reserve):>9}  = block rounding "
                         f"{gib(self.reserve['block rounding'])} + fragmentation {gib(self.reserve['fragmentation'])} "
                         f"(one block of the largest transient tensor: {self.largest_transient})")
        else:
            lines.append(f"  {'allocator reserve':<34} {gib(0):>9}  (a CPU: no caching allocator; glibc maps large "
                         f"blocks and returns them)")
        lines.append(f"  {'needed':<34} {gib(self.needed):>9}  = peak + allocator reserve")
        if self.gpu_memory is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            lines.append(f"  {verdict} in {self.gpu_memory / 1e9:.4g} GB = {gib(self.gpu_memory)}: needs "
                         f"{gib(self.needed)} ({self.needed / self.gpu_memory:.1%} of it)")
            if self.largest_tokens is not None:
                most = (f">= {self.largest_tokens}" if self.largest_tokens >= MAX_SEARCH_TOKENS else str(self.largest_tokens))
                lines.append(f"  largest token count per micro-batch that fits: {most}"
                             + (" (none: the persistent terms alone do not fit)" if self.largest_tokens == 0 else ""))
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
    sequences: int = option(1, "sequences packed into the micro-batch (e.g. G completions): flash-attn's varlen backward "
                            "pads each by 128 rows", bounds=at_least(1))
    rollout_tokens: Optional[int] = option(None, "tokens generated at once (None: --tokens)", bounds=at_least(1))
    device: str = option("cuda", "where the step runs", choices=("cuda", "cpu"))
    gpu_memory: Optional[float] = option(None, "the GPU's memory in GB (or with a unit: 24GiB, 80GB): say whether the "
                                         "step fits (its peak and the allocator reserve) and the largest token count "
                                         "that does", bounds=Bounds(0, MAX_GPU_GB, low_open=True), parse=gigabytes)
    ranks_per_node: int = option(1, "ranks on one machine: with activation_offload each pins its own copy of the "
                                 "checkpointed inputs in the machine's host memory", bounds=at_least(1))
    host_memory: Optional[float] = option(None, "one machine's host memory in GB (or with a unit): say whether the "
                                          "offload's pinned copies of all its ranks fit", bounds=Bounds(0, MAX_GPU_GB, low_open=True),
                                          parse=gigabytes)
    json: bool = option(False, "print the plan as JSON")

    def __post_init__(self) -> None:
        check_fields(PlanSettings, dataclasses.asdict(self), convert=False)
        check_packing(self.tokens, self.sequences)


def check_packing(tokens: int, sequences: int) -> None:
    """Each packed sequence holds a token at least: ``OptionError`` naming ``sequences`` and ``tokens``."""
    if sequences > tokens:
        raise OptionError(f"sequences ({sequences}) must be <= tokens ({tokens}): each packed sequence holds at least "
                          "one token", "sequences", "tokens")


# GRPOConfig's fields the plan reads (their flags and declarations are the config's)
PLAN_CONFIG_FIELDS = ("use_peft", "lora_r", "lora_target_modules", "lora_dropout", "model_dtype", "bf16",
                      "gradient_checkpointing", "activation_offload", "mlp_chunk_tokens", "fused_norm", "beta",
                      "release_memory")
# ... and their defaults, GRPOConfig's own (read from its fields, not restated): :func:`plan`'s keywords
CONFIG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GRPOConfig) if f.name in PLAN_CONFIG_FIELDS}


# --------------------------------------------------------------------------------------------------
# the activation terms (bytes per token of one layer, unless said otherwise)
# --------------------------------------------------------------------------------------------------
def adapter_bytes(d_in: int, r: int, dropout: float, x_bytes: int, autocast: bool) -> tuple[int, bool]:
    """(bytes per token one LoRA adapter on a linear with ``d_in`` inputs keeps for its backward, whether
    what it keeps includes the adapter's input ``x`` itself: the tensor the base layer reads, shared by
    the adapters on it and counted once, by :func:`layer_terms`). ``x_bytes``: ``x``'s element size.

    The trainer's adapters are peft's ``lora.Linear`` with ``grpo.lora.fuse_dropout`` applied
    (``grpo.lora.add_adapters``): ``B(A_p(x.to(fp32)))``. peft's cast copies ``x`` unless it is fp32
    (``4 d_in``). With ``dropout`` > 0, ``A_p`` is ``grpo.lora.DropoutLinearFunction``: it keeps the cast
    ``x`` and nothing of the mask (it hashes the mask again and recomputes the dropped copy in its
    backward). With ``dropout`` 0,
    ``A_p`` is peft's ``lora_A`` (an ``nn.Linear``), which keeps its input: the cast ``x``, or under bf16
    autocast the bf16 copy autocast makes of it (``2 d_in``; the fp32 cast is then freed). ``B`` keeps
    ``A``'s output, ``r`` wide: fp32 (``4 r``), bf16 under autocast (``2 r``). (Under autocast ``B``'s
    weight, and ``lora_A``'s with dropout 0, are kept in bf16 too: ``2 r (in + out)`` a layer, a constant
    the plan leaves out.)
    """
    out = 2 * r if autocast else 4 * r
    copied = x_bytes != 4  # peft's x.to(fp32)
    if dropout > 0:
        return (4 * d_in if copied else 0) + out, not copied
    if autocast:
        return 2 * d_in + out, False
    return (4 * d_in if copied else 0) + out, not copied


# the linears whose input is an autocast op's output (the attention's, the MLP's product): bf16 under
# bf16 autocast whatever the weights' dtype; the others read the residual stream's norms (the weights' dtype)
AUTOCAST_INPUTS = ("o_proj", "down_proj")


# transformers' Python RMSNorm (LlamaRMSNorm, Qwen2/3RMSNorm), differentiated by autograd: its backward holds
# this many fp32 copies of its input at once besides its d x (the gradient through the weight product, its
# fp32 cast, the rsqrt's and the square's gradients and their sum), 18 B a row element: measured with the
# torch profiler's allocation events (bf16 x [4096, 1024], frozen or trainable weight: 20 B an element
# with d x's 2 B), 2026-12-07. grpo_kernels.rms_norm's backward holds d x alone (its fp32 work in rows:
# on a CPU blocks of torch_norm.BLOCK_ELEMENTS, a constant; on CUDA one tile per program).
PYTHON_NORM_BACKWARD_FP32 = 4.5
# grpo_kernels.kernels.torch_norm's fp32 block temporaries at once (a CPU's constant; 0 on CUDA: Triton tiles)
FUSED_NORM_CPU_BLOCKS = 4
# grpo.lora.drop_mask's int64 temporaries at once (of lora.HASH_BLOCK elements each, per device type)
HASH_TEMPORARIES = 5
HASH_BLOCK_ELEMENTS = {"cpu": 1 << 16, "cuda": 1 << 22}  # (grpo.lora.HASH_BLOCK; tests/test_plan.py checks they agree)


def layer_terms(shape: ModelShape, tokens: int, b: int, *, full: bool, targets: list[str], lora_r: int,
                lora_dropout: float, device: str, autocast: bool, mlp_chunk_tokens: Optional[int],
                sequences: int = 1, fused_norm: bool = False) -> dict[str, int]:
    """One decoder layer's activation terms for ``tokens`` tokens in ``sequences`` packed sequences (see
    the module docstring), bytes:
    ``attention`` / ``mlp`` (what each block saves for its backward, the MLP's backward temporaries
    included), ``lora_attention`` / ``lora_mlp`` (the adapters' inputs), ``workspace`` (flash-attn's
    backward), ``gradients`` (in and out of the layer), ``saved`` (what the layer keeps from its forward
    to its backward: without checkpointing, per layer), ``mlp_chunk`` (the chunk's share of ``mlp``),
    ``norm_backward`` (the MLP's RMSNorm's backward beyond what it saved: its d x and, for transformers'
    Python norm, :data:`PYTHON_NORM_BACKWARD_FP32` fp32 copies of its input; ``fused_norm``: d x and, on a
    CPU, the torch path's blocks), ``mlp_norm`` (what that norm saved: all the MLP block keeps once its
    MLP's backward is done), ``lora_o`` (o_proj's adapter input: freed by o_proj's backward, before the
    attention's own backward and its workspace). :func:`layer_peak` combines them.

    RMSNorm's saved tensors per token: transformers' module keeps its fp32 upcast and 1/rms (``4H + 4``,
    and its normalised input ``bH`` when its weight trains); ``fused_norm`` (``grpo_kernels.rms_norm``)
    keeps its input and 1/rms: the attention's norm reads the layer input, which the layer keeps anyway
    (``4``), the MLP's reads the residual after the attention (``bH + 4``)."""
    H, I, q, kv, heads = shape.hidden_size, shape.intermediate_size, shape.q, shape.kv, shape.num_attention_heads
    kv_heads = shape.num_key_value_heads
    N = tokens
    adapters = {name: adapter_bytes(shape.linears()[name][0], lora_r, lora_dropout,
                                    2 if autocast and name in AUTOCAST_INPUTS else b, autocast)
                for name in targets if name in shape.linears()}
    raw = {name for name, (_, keeps_raw) in adapters.items() if keeps_raw}
    adapter = {name: bytes_ for name, (bytes_, _) in adapters.items()}
    if fused_norm:  # x (the layer input, kept anyway; the MLP's: the residual) and 1/rms
        norm_attention, norm = 4, b * H + 4
    else:  # fp32 upcast and 1/rms; the normalised input for the weight's gradient
        norm_attention = norm = 4 * H + 4 + (b * H if full else 0)
    blocks = FUSED_NORM_CPU_BLOCKS * 4 * min(N * H, norm_blocks_elements()) if device == "cpu" else 0
    norm_backward = N * b * H + (blocks if fused_norm else int(N * PYTHON_NORM_BACKWARD_FP32 * 4 * H))
    # attention: the norm; q/k/v's input (for their weights' gradients); q/k norms; flash-attn's q, k, v, out, lse
    qkv_input = b * H if full or raw & {"q_proj", "k_proj", "v_proj"} else 0
    qk_norm = (4 * (q + kv) + 4 * (heads + kv_heads) + (b * (q + kv) if full else 0)) if shape.qk_norm else 0
    if shape.qk_norm and fused_norm:  # (their inputs, q and k before the norm: b, and 1/rms per head)
        qk_norm = b * (q + kv) + 4 * (heads + kv_heads)
    attention = norm_attention + qkv_input + qk_norm + b * (2 * q + 2 * kv) + 4 * heads
    lora_attention = sum(adapter.get(name, 0) for name in ATTENTION_LINEARS)
    # MLP: the norm; gate/up's input; gate, act and up outputs (the act and the product keep them); the product
    # (down_proj's input); backward: the gradients of the product, the act and up at once
    gate_up_input = b * H if full or raw & {"gate_proj", "up_proj"} else 0
    product = b * I if full or "down_proj" in raw else 0
    mlp_core = 3 * b * I + product + 3 * b * I
    lora_mlp = sum(adapter.get(name, 0) for name in MLP_LINEARS)
    chunk = min(mlp_chunk_tokens, N) if mlp_chunk_tokens else N
    # the adapters' dropout (grpo.lora.DropoutLinearFunction) in the MLP's backward, for the widest adapter input
    # of one chunk: its bool mask, and then the hash's int64 block temporaries (while the mask is made) or the
    # recomputed dropped input, fp32 (for d A)
    widest = max((shape.linears()[n][0] for n in MLP_LINEARS if n in adapter), default=0)
    hash_block = min(chunk * widest, HASH_BLOCK_ELEMENTS.get(device, HASH_BLOCK_ELEMENTS["cuda"]))
    dropout_mask = (chunk * widest + max(HASH_TEMPORARIES * 8 * hash_block, 4 * chunk * widest)
                    if lora_dropout > 0 and widest else 0)
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
    # flash-attn 2's varlen backward: fp32 dq accumulator [N + 128 s, heads, d'] (d' = d rounded up to 32, or
    # 256 past 192) and softmax_d [heads, N + 128 s]; dq, dk, dv; dk/dv per head under GQA; o_proj's input gradient
    flash_fp32 = 4 * heads * (-(-shape.d // 32) * 32 if shape.d <= 192 else 256) + 4 * heads
    workspace = flash_fp32 + b * (q + 2 * kv) + gqa + b * q
    padded = FLASH_PAD_ROWS * sequences * flash_fp32 if device == "cuda" else 0
    # fp32 weights under bf16 autocast: each linear casts its weight to bf16 and keeps the copy for its
    # input's gradient (frozen or not), a per-layer constant (the MLP's once, chunked or not)
    copies = {block: sum(2 * i * o for n, (i, o) in shape.linears().items() if n in names) if autocast and b == 4 else 0
              for block, names in (("attention", ATTENTION_LINEARS), ("mlp", MLP_LINEARS))}
    return {"attention": N * attention + copies["attention"], "lora_attention": N * lora_attention,
            "mlp": mlp + copies["mlp"], "lora_mlp": lora_mlp_bytes, "mlp_chunk": mlp_chunk, "workspace": N * workspace + padded,
            # (saved: the fused attention norm's input too, which is the layer's input; without checkpointing
            # nothing else keeps it, with checkpointing it is the checkpointed input, counted there)
            "gradients": N * 2 * b * H,
            "saved": N * (attention + lora_attention + (b * H if fused_norm else 0)) + saved_mlp + sum(copies.values()),
            "norm_backward": norm_backward, "mlp_norm": N * norm, "lora_o": N * adapter.get("o_proj", 0),
            "dropout_mask": dropout_mask}


def norm_blocks_elements() -> int:
    """The torch path's fp32 block (``grpo_kernels.kernels.torch_norm.BLOCK_ELEMENTS`` elements)."""
    from grpo_kernels.sizing import NORM_BLOCK_ELEMENTS as BLOCK_ELEMENTS

    return BLOCK_ELEMENTS


# transformers' Python RMSNorm's forward holds this many fp32 copies of its input at once (its upcast, the
# square, the product; the output's cast included), 12 B a row element: measured with the torch
# profiler's allocation events (bf16 x [4096, 1024]), 2026-12-07; grpo_kernels.rms_norm's: its output
PYTHON_NORM_FORWARD_FP32 = 3.0


def no_grad_pass(shape: ModelShape, tokens: int, b: int, *, use_peft: bool, fused_norm: bool,
                 mlp_chunk_tokens: Optional[int], device: str) -> int:
    """One decoder layer's forward under no_grad at its height (the old and reference log-probs' passes):
    nothing is saved, so a layer holds its input and output (``2bH``), a norm's forward (``bH`` fused, else
    :data:`PYTHON_NORM_FORWARD_FP32` fp32 copies), and the larger of the attention's q, k, v and output
    ``b(2q + 2kv)`` (with an adapter's fp32 cast of its input, ``4H``) and the MLP's gate, up, their
    activation and product over a chunk ``4bI`` (with down_proj's adapter's fp32 cast, ``4I``)."""
    H, I, q, kv, N = shape.hidden_size, shape.intermediate_size, shape.q, shape.kv, tokens
    chunk = min(mlp_chunk_tokens, N) if mlp_chunk_tokens else N
    blocks = FUSED_NORM_CPU_BLOCKS * 4 * min(N * H, norm_blocks_elements()) if device == "cpu" and fused_norm else 0
    norm = N * b * H + blocks if fused_norm else int(N * PYTHON_NORM_FORWARD_FP32 * 4 * H)
    attention = N * (b * (2 * q + 2 * kv) + (4 * H if use_peft else 0))
    mlp = chunk * (4 * b * I + (4 * I if use_peft else 0))
    return 2 * N * b * H + max(norm, attention, mlp)


def layer_peak(terms: dict[str, int]) -> int:
    """A layer's recompute and backward at its height, from :func:`layer_terms`: what the attention block
    saved and the gradients in and out, plus the largest of three moments of its backward: the MLP's
    (what the MLP block saved, its adapters' inputs, its backward's temporaries), the MLP norm's (what it
    saved and its backward), and the attention's (its workspace, o_proj's adapter input freed by then)."""
    base = terms["attention"] + terms["lora_attention"] + terms["gradients"]
    return base + max(terms["mlp"] + terms["lora_mlp"] + terms["dropout_mask"], terms["mlp_norm"] + terms["norm_backward"],
                      terms["workspace"] - terms["lora_o"])


def plan(model: str | ModelShape, tokens: int, *, use_peft: bool = CONFIG_DEFAULTS["use_peft"],
         lora_r: int = CONFIG_DEFAULTS["lora_r"], lora_target_modules: str = CONFIG_DEFAULTS["lora_target_modules"],
         lora_dropout: float = CONFIG_DEFAULTS["lora_dropout"], model_dtype: str = CONFIG_DEFAULTS["model_dtype"],
         bf16: bool = CONFIG_DEFAULTS["bf16"], gradient_checkpointing: bool = CONFIG_DEFAULTS["gradient_checkpointing"],
         activation_offload: bool = CONFIG_DEFAULTS["activation_offload"],
         mlp_chunk_tokens: Optional[int] = CONFIG_DEFAULTS["mlp_chunk_tokens"], fused_norm: bool = CONFIG_DEFAULTS["fused_norm"],
         beta: float = CONFIG_DEFAULTS["beta"], rollout_tokens: Optional[int] = None, sequences: int = 1, device: str = "cuda",
         gpu_memory: Optional[int] = None, release_memory: str = CONFIG_DEFAULTS["release_memory"], ranks_per_node: int = 1,
         host_memory: Optional[int] = None) -> MemoryPlan:
    """The predicted peak of one step of ``tokens`` tokens per micro-batch, packed in ``sequences``
    sequences (``rollout_tokens``: tokens generated at once, default ``tokens``) with these ``GRPOConfig``
    settings (``bf16``: autocast, on CUDA only), on ``device``. With ``gpu_memory`` (bytes) it says whether
    the step fits (:attr:`MemoryPlan.needed`: the peak and the allocator reserve) and the largest token
    count that does. Every argument is checked against its declaration (``GRPOConfig``'s for the
    trainer's settings, :class:`PlanSettings`' for the plan's own), LoRA's targets against the planned
    decoder's linear layers: ``grpo_kernels.bounds.OptionError`` (a ``ValueError``) naming it."""
    config = dict(use_peft=use_peft, lora_r=lora_r, lora_target_modules=lora_target_modules, lora_dropout=lora_dropout,
                  model_dtype=model_dtype, bf16=bf16, gradient_checkpointing=gradient_checkpointing,
                  activation_offload=activation_offload, mlp_chunk_tokens=mlp_chunk_tokens, fused_norm=fused_norm,
                  beta=beta, release_memory=release_memory)
    check_fields(GRPOConfig, config, convert=False)  # (the trainer's declarations: the same ranges)
    check_offload(activation_offload, gradient_checkpointing)
    check_fields(PlanSettings, dict(tokens=tokens, sequences=sequences, rollout_tokens=rollout_tokens, device=device),
                 convert=False)
    check_packing(tokens, sequences)
    check_value("gpu_memory", gpu_memory, int, optional=True, bounds=above(0))
    check_value("host_memory", host_memory, int, optional=True, bounds=above(0))
    check_fields(PlanSettings, dict(ranks_per_node=ranks_per_node), convert=False)
    shape = load_shape(model, "model") if isinstance(model, str) else model
    if use_peft:
        check_lora_targets(shape, lora_target_modules)
    result = _plan(shape, tokens, rollout_tokens, sequences, device=device, **config)
    result.settings["model"] = model if isinstance(model, str) else "(shape)"
    result.gpu_memory = gpu_memory
    result.ranks_per_node, result.host_memory = ranks_per_node, host_memory
    if gpu_memory is not None:  # (the verdict's predicate, MemoryPlan.needed, at every count tried)
        result.largest_tokens = _largest_tokens(
            lambda n: _plan(shape, n, rollout_tokens, min(sequences, n), device=device, **config).needed <= gpu_memory)
    return result


def _largest_tokens(fits: Callable[[int], bool]) -> int:
    """The largest N in [1, MAX_SEARCH_TOKENS] with ``fits(N)`` (0: none), by doubling then bisection
    (what the step needs grows with N: every activation term is linear in it, the loss's chunk and the
    rounded blocks never shrink)."""
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


def _plan(shape: ModelShape, tokens: int, rollout_tokens: Optional[int], sequences: int, *, use_peft: bool, lora_r: int,
          lora_target_modules: str, lora_dropout: float, model_dtype: str, bf16: bool, gradient_checkpointing: bool,
          activation_offload: bool, mlp_chunk_tokens: Optional[int], fused_norm: bool, beta: float,
          release_memory: str, device: str) -> MemoryPlan:
    from grpo_kernels.sizing import default_chunk_size, frozen_head_bytes, tile_columns

    import torch

    b = DTYPE_BYTES[model_dtype]
    autocast = device == "cuda" and bf16
    P = shape.parameters()
    H, I, V, L, N = shape.hidden_size, shape.intermediate_size, shape.vocab_size, shape.num_hidden_layers, tokens
    targets = lora_targets(lora_target_modules) if use_peft else []
    adapters = shape.lora_parameters(lora_r, targets) if use_peft else 0
    trainable, trainable_bytes = (adapters, 4) if use_peft else (P, b)
    master = trainable_bytes != 4
    layer = layer_terms(shape, N, b, full=not use_peft, targets=targets, lora_r=lora_r, lora_dropout=lora_dropout,
                        device=device, autocast=autocast, mlp_chunk_tokens=mlp_chunk_tokens, sequences=sequences,
                        fused_norm=fused_norm)
    inputs = L * N * H * b
    offloaded = activation_offload and device == "cuda"  # (on a CPU the trainer's offload is a no-op)
    if gradient_checkpointing:
        on_device = 2 * N * H * b if offloaded else inputs
        others = 0
    else:
        on_device, others = 0, (L - 1) * layer["saved"]
    kind, dtype = torch.device("cuda" if device == "cuda" else "cpu"), torch.bfloat16 if b == 2 else torch.float32
    # the largest chunk of any micro-batch of at most `tokens` tokens (a smaller one may take bigger
    # chunks: N rows are split into equal ones), so that the plan bounds every micro-batch and its peak
    # never falls as tokens grow
    chunk = default_chunk_size(V, H, dtype, kind, min(tokens, default_chunk_size(V, H, dtype, kind)))
    head_trainable = not use_peft
    tiled_head = not head_trainable and device != "cuda"  # (CUDA's default backend, Triton, takes row chunks)
    # the final norm's saved tensors: fused, its input (the last layer's output) and 1/rms; transformers': its fp32
    # upcast and 1/rms (+ the normalised input for a trainable weight)
    loss_chunk = frozen_head_bytes(chunk, V, H, dtype, kind) if tiled_head else chunk * V * b
    final_norm = N * (b * H + 4 if fused_norm else 4 * H + 4 + (b * H if not use_peft else 0))
    runtime = dict(CUDA_RUNTIME_BYTES) if device == "cuda" else {"the Python process (torch, transformers)": RUNTIME_BYTES_CPU,
                                                                 "the tokenizer": TOKENIZER_BYTES_PER_ENTRY_CPU * V}
    terms = {
        "weights": P * b + adapters * 4,
        "reference": P * b if beta > 0 and not use_peft else 0,
        "gradients": trainable * trainable_bytes + (trainable * 4 if master else 0),
        "optimizer state": trainable * (8 + (4 if master else 0)),
        "runtime": sum(runtime.values()),
        "checkpointed layer inputs": on_device,
        "saved by the other layers": others,
        "layer: attention": layer["attention"],
        "layer: LoRA inputs (attention)": layer["lora_attention"],
        "layer: MLP": layer["mlp"],
        "layer: LoRA inputs (MLP)": layer["lora_mlp"],
        "attention workspace": layer["workspace"],
        "layer: gradients": layer["gradients"],
        "layer: RMSNorm backward": layer["norm_backward"],
        # (+ an adapter on the input embeddings keeps its fp32 lookup of A, [N, r], for B's backward)
        "edges": final_norm + 2 * N * H * b + (4 * lora_r * N if EMBEDDING in targets else 0),
        # a frozen head on a CPU (the torch backend) walks the vocabulary in blocks: [c, Vb], not [c, V]
        "loss chunk": loss_chunk + (V * H * 4 if head_trainable and b != 4 and not tiled_head else 0),
        "rollout KV cache": 2 * L * shape.kv * (rollout_tokens or tokens) * b,
        "no-grad pass": no_grad_pass(shape, N, b, use_peft=use_peft, fused_norm=fused_norm,
                                     mlp_chunk_tokens=mlp_chunk_tokens, device=device) + 2 * N * H * b + loss_chunk,
    }
    lora_note = (f"{len([t for t in targets if t in ATTENTION_LINEARS])} adapters x N tokens, dropout {lora_dropout}"
                 f"{', bf16 autocast' if autocast else ''}")
    chunk_tokens = min(mlp_chunk_tokens, N) if mlp_chunk_tokens else N
    notes = {
        "weights": f"{P / 1e6:.1f}M x {b} B" + (f" + {adapters / 1e6:.2f}M adapter params x 4 B" if use_peft else ""),
        "reference": "adapters off: the policy's own weights" if use_peft and beta > 0 else ("a frozen copy" if beta > 0 else "beta = 0"),
        "gradients": f"{trainable / 1e6:.2f}M trainable x {trainable_bytes} B" + (" + fp32 master grads" if master else ""),
        "optimizer state": "AdamW moments 8 B" + (" + fp32 master 4 B" if master else "") + " per trainable param",
        "runtime": ("CUDA context " + gib(sum(v for k, v in runtime.items() if k.startswith("context")))
                    + f" + kernel images {gib(runtime['kernel images'])} + cuBLAS workspaces "
                    + f"{gib(runtime['cuBLAS workspaces'])} (Hopper, lazy loading: an estimate, docs/memory.md)"
                    if device == "cuda" else "torch + transformers in a CPU process (measured)"
                    + ("" if release_memory == "always" else f"; release_memory={release_memory!r}: the heap glibc "
                       "keeps after free is not counted (LoRA runs measured 0.1-2.1 W above the plan, "
                       "benchmarks/results/lora_memory-cpu-20261202.md)")),
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
        "attention workspace": ("flash-attn 2 varlen backward (assumed): fp32 dq and softmax_d over N + 128 x "
                                f"{sequences} rows, dq/dk/dv" if device == "cuda" else "packed SDPA's backward: dq/dk/dv")
        + (", dk/dv per head (GQA)" if shape.num_key_value_heads != shape.num_attention_heads else ""),
        "layer: gradients": "the gradient into and out of the layer, 2 x N x H",
        "layer: RMSNorm backward": ("grpo_kernels.rms_norm (fused_norm): its d x" + (" + the CPU path's fp32 blocks"
                                    if device == "cpu" else "") if fused_norm else
                                    f"transformers' Python RMSNorm: d x + {PYTHON_NORM_BACKWARD_FP32} x N x H x 4 B fp32"),
        "edges": "final norm, the hidden states the loss reads and their gradient"
                 + (f", the embeddings' adapter lookup N x {lora_r} x 4 B" if EMBEDDING in targets else ""),
        "loss chunk": (f"{chunk} rows x Vb={tile_columns(chunk, V, kind)} (the frozen head's vocabulary blocks)" if tiled_head
                       else f"{chunk} rows x V={V}" + (" + fp32 dW" if head_trainable and b != 4 else "")),
        "rollout KV cache": f"{rollout_tokens or tokens} tokens (generation on this GPU; freed before the update)",
        "no-grad pass": "the old / reference log-probs' forward under no_grad: one layer's activations at a time, "
                        "the hidden states and a logits chunk (nothing kept for a backward)",
    }
    reserve, largest = {}, ""
    if device == "cuda":  # torch's caching allocator (a CPU's glibc maps large blocks and returns them)
        params = shape.parameter_tensors()
        trainable_tensors = shape.lora_tensors(lora_r, targets) if use_peft else params
        kept = [n * b for n in params] + ([n * b for n in params] if beta > 0 and not use_peft else [])
        kept += [n * 4 for n in trainable_tensors] if use_peft else []  # the adapters
        kept += [n * trainable_bytes for n in trainable_tensors]  # gradients
        kept += [n * 4 for n in trainable_tensors] * (4 if master else 2)  # moments (+ fp32 master weights, grads)
        kept += [N * H * b] * (2 if offloaded else L) if gradient_checkpointing else []
        d_acc = -(-shape.d // 32) * 32 if shape.d <= 192 else 256
        transient = {f"RMSNorm's fp32 upcast [{N}, {H}]": 4 * N * H,
                     f"q, the attention output [{N}, {shape.q}]": b * N * shape.q,
                     f"an MLP activation [{chunk_tokens}, {I}]": b * chunk_tokens * I,
                     f"flash-attn's fp32 dq accumulator [{N} + 128 x {sequences}, {shape.num_attention_heads} x {d_acc}]":
                         4 * (N + FLASH_PAD_ROWS * sequences) * shape.num_attention_heads * d_acc,
                     f"the loss's logits block [{chunk}, {V}]": chunk * V * b}
        if "down_proj" in targets and (b != 4 or autocast or lora_dropout > 0):
            # peft's fp32 cast of its adapter's input (bf16 activations, or autocast's bf16 product), or the
            # fused dropout's fp32 dropped copy (adapter_bytes), made in the forward and again in the backward
            transient[f"down_proj's adapter input in fp32 [{chunk_tokens}, {I}]"] = 4 * chunk_tokens * I
        if head_trainable and b != 4:
            transient[f"the head's fp32 dW [{V}, {H}]"] = 4 * V * H
        reserve, largest = allocator_reserve(kept, transient)
    host, threshold = {}, pinned_round_threshold()
    if gradient_checkpointing and offloaded:  # each layer's input in its own pinned block, rounded by torch's allocator
        block = pinned_block(N * H * b, threshold)
        host["checkpointed layer inputs"] = L * block
        notes["host: checkpointed layer inputs"] = (
            f"{L} blocks of N x H x {b} B = {N * H * b / MiB:.1f} MiB, each rounded up to a power of two by torch's "
            f"pinned allocator: {block / MiB:.0f} MiB; {PINNED_ROUND_SETTING} in PYTORCH_ALLOC_CONF below the block "
            "size avoids it" if block != N * H * b else
            f"{L} blocks of N x H x {b} B, not rounded" + (f" ({PINNED_ROUND_SETTING} = {threshold // MiB} MiB)"
                                                          if threshold is not None and N * H * b > threshold else
                                                          " (already a power of two)"))
    settings = dict(parameters=P, tokens=tokens, sequences=sequences, use_peft=use_peft, lora_r=lora_r,
                    lora_target_modules=lora_target_modules, lora_dropout=lora_dropout, model_dtype=model_dtype,
                    gradient_checkpointing=gradient_checkpointing, beta=beta, device=device, chunk_rows=chunk,
                    trainable_parameters=trainable, activation_offload=activation_offload,
                    mlp_chunk_tokens=mlp_chunk_tokens, fused_norm=fused_norm, bf16=bf16, autocast=autocast,
                    release_memory=release_memory,
                    attention="flash-attn 2 varlen (assumed)" if device == "cuda" else "packed SDPA")
    return MemoryPlan(terms, settings, notes, host=host, layer_saved=layer["saved"], runtime=runtime, reserve=reserve,
                      largest_transient=largest, layer=layer)


def plan_for_run(model_config: Any, cfg, tokens: int, device: str, sequences: int = 1) -> MemoryPlan:
    """The plan of a trainer run: ``cfg``'s settings, ``tokens`` per micro-batch in ``sequences`` sequences."""
    return plan(ModelShape.from_config(model_config), tokens, sequences=min(sequences, tokens), device=device,
                **{name: getattr(cfg, name) for name in PLAN_CONFIG_FIELDS})


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
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    result.ranks_per_node, result.host_memory = local, physical_memory()
    if result.host_fits is False:
        import logging

        logging.getLogger(__name__).warning(
            "activation_offload: the checkpointed inputs need %s of pinned host memory on this machine (%d rank(s) x %s; "
            "%s) and it has %s: expect swapping or a failed pinned allocation; use fewer tokens per micro-batch "
            "(max_tokens_per_microbatch) or fewer ranks per machine", gib(result.host_per_node), local,
            gib(sum(result.host.values())), result.notes.get("host: checkpointed layer inputs", ""), gib(result.host_memory))
    os.makedirs(cfg.output_dir, exist_ok=True)
    with open(os.path.join(cfg.output_dir, "memory_plan.json"), "w") as f:
        json.dump(result.as_dict(), f, indent=1)
    if cfg.progress:
        print(result.format(), file=sys.stderr)
    return result


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m grpo plan``: every flag checked against its declaration (:class:`PlanSettings`, and
    ``GRPOConfig``'s for the trainer's settings); a bad value is a usage error (exit 2) naming the flag."""
    p = argparse.ArgumentParser(prog="python -m grpo plan", description="The predicted peak memory of one GRPO step, "
                                "and with --gpu-memory whether it fits and the largest token count that does.")
    add_config_flags(p, PlanSettings, title="the step")
    add_config_flags(p, GRPOConfig, only=PLAN_CONFIG_FIELDS)
    args = p.parse_args(argv)
    settings = config_from_args(args, PlanSettings, p)
    cfg = config_from_args(args, GRPOConfig, p, only=PLAN_CONFIG_FIELDS)
    try:  # (every check needs only the config: nothing is loaded)
        shape = load_shape(settings.model)
        result = plan(shape, settings.tokens, rollout_tokens=settings.rollout_tokens, sequences=settings.sequences,
                      device=settings.device, gpu_memory=gpu_memory_bytes(settings.gpu_memory),
                      ranks_per_node=settings.ranks_per_node, host_memory=gpu_memory_bytes(settings.host_memory),
                      **{name: getattr(cfg, name) for name in PLAN_CONFIG_FIELDS})
    except ValueError as e:
        usage_error(p, e, GRPOConfig, PlanSettings)
    result.settings["model"] = settings.model
    print(json.dumps(result.as_dict(), indent=1) if settings.json else result.format())


if __name__ == "__main__":
    main()
