"""LoRA adapters through peft: the seam where the trainer turns a causal LM into one that trains adapters.

``GRPOConfig.use_peft`` (TRL's ``trl.ModelConfig`` names: ``lora_r``, ``lora_alpha``, ``lora_dropout``,
``lora_target_modules``) makes the trainer call :func:`add_adapters`, which wraps the model in a
``peft.PeftModel`` with a LoRA adapter (Hu et al., 2021: ``W x + (alpha / r) B A x``, ``A`` [r, in]
random, ``B`` [out, r] zero, so the adapted model starts as the base model). Only the adapters train:
the base weights, the embeddings and ``lm_head`` are frozen, so the fused loss computes no ``d W`` for
the head (``grpo_kernels``: two matmuls a chunk instead of three), there are no gradients or AdamW
state for the base, and with ``beta > 0`` the reference log-probs are the same model's with its
adapters disabled (:func:`adapters_disabled`, peft's ``disable_adapter``): no second copy is held.

The fused loss reads ``lm_head.weight`` itself, so an adapter on ``lm_head`` would be ignored by it:
targeting ``lm_head`` is refused, as is targeting the embeddings of a model whose ``lm_head`` is tied
to them. The input embeddings of an untied model (``embed_tokens``) take peft's ``lora.Embedding``:
``E[ids] + (alpha / r) A^T[ids] B^T``, ``A`` [r, V] looked up by token id, ``B`` [H, r]; peft applies no
dropout there (an id is not a feature vector to drop), and neither does :func:`fuse_dropout`. :func:`check_flags` checks what it can before the model is loaded (peft installed, the
target names against the model's modules, built on the meta device from its config).

What an adapter costs in activations (``grpo.plan.adapter_bytes`` derives it; ``docs/memory.md``):
peft's ``lora.Linear`` computes ``B(A(dropout(x.to(fp32))))``; :func:`add_adapters` moves the dropout
into ``A`` (:func:`fuse_dropout`), so each adapted linear keeps, per token, peft's fp32 cast of ``x``
(``x`` itself when it is fp32) and nothing of the mask, which its backward hashes again
(:func:`drop_mask`); without dropout peft's ``A`` keeps the fp32 cast, or under bf16 autocast a bf16
copy of it. The base layer keeps nothing when frozen. Inside a decoder layer's MLP,
``mlp_chunk_tokens`` (``grpo.activations``) limits these to one chunk of tokens.

The masks are a counter-based hash of (a seed drawn per adapter call, the token's row, the feature), so
the memory options never change the numbers: with ``mlp_chunk_tokens`` each chunk draws the rows of the
whole call's mask (:func:`dropout_seed`), and ``activation_offload`` copies bits; a run with either has
the same masks, losses and gradients, to fp32 rounding, as the run without.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Optional

import torch

from .activations import current_chunk

# ``cfg`` below is a ``grpo.config.GRPOConfig``, named rather than imported (the config imports the rollout
# engines, which import grpo.models, which imports this module)

ALL_LINEAR = "all-linear"  # peft's shorthand: every linear layer but the output head
ADAPTER_DIR = "adapter"  # under output_dir: what peft.PeftModel.from_pretrained loads


class PeftNotInstalled(ImportError, ValueError):
    """``use_peft`` without peft: a missing dependency, and a flag that cannot be honoured."""


def require_peft() -> None:
    try:
        import peft  # noqa: F401
    except ImportError:
        raise PeftNotInstalled(
            "use_peft=True (--use-peft) needs the peft package: pip install 'grpo-kernels[peft]' (or pip install peft)"
        ) from None


def target_modules(cfg: "GRPOConfig") -> str | list[str]:
    """``lora_target_modules`` as peft takes it: ``"all-linear"`` or a list of module names."""
    if cfg.lora_target_modules.strip().lower() == ALL_LINEAR:
        return ALL_LINEAR
    return [name.strip() for name in cfg.lora_target_modules.split(",") if name.strip()]


def _matches(module_name: str, target: str) -> bool:
    """peft's rule for a name in ``target_modules``: the module's full name, or its last dotted parts."""
    return module_name == target or module_name.endswith("." + target)


def adaptable_types() -> tuple:
    """The layer types peft's LoRA adapts (``get_peft_model`` raises for any other a target matches:
    a norm, an attention or MLP block)."""
    types: tuple = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
                    torch.nn.MultiheadAttention)
    try:
        from transformers.pytorch_utils import Conv1D  # GPT-2's linear layer

        types += (Conv1D,)
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    return types


def check_targets(model: torch.nn.Module, cfg: "GRPOConfig") -> None:
    """``ValueError`` naming ``lora_target_modules`` for a name that matches no module of ``model``, a
    module LoRA cannot adapt (a norm, a whole block: :func:`adaptable_types`), or that names its output
    head (or, when the head is tied to them, its input embeddings). ``model`` may live on the meta
    device: only names and the structure are read, nothing is changed."""
    targets = target_modules(cfg)
    if targets == ALL_LINEAR:
        return
    names = {name: module for name, module in model.named_modules() if name}
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and embeddings is not None and head.weight is embeddings.weight
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in names.items() if isinstance(m, torch.nn.Linear) and m is not head})
    for target in targets:
        matched = [(name, m) for name, m in names.items() if _matches(name, target)]
        if not matched:
            raise ValueError(
                f"lora_target_modules (--lora-target-modules): no module named {target!r} in {type(model).__name__}; "
                f"its linear layers are {linear} (or use 'all-linear')"
            )
        other = [(name, m) for name, m in matched if not isinstance(m, adaptable_types())]
        if other:
            name, m = other[0]
            raise ValueError(
                f"lora_target_modules (--lora-target-modules) names {target!r}, which matches {name} "
                f"({type(m).__name__}): LoRA adapts linear (or embedding, convolution) layers only, not a norm or a "
                f"block of layers; its linear layers are {linear} (or use 'all-linear')"
            )
        matched = [m for _, m in matched]
        if any(m is head for m in matched):
            why = (" and it is tied to the input embeddings (tie_word_embeddings), so training it would change both"
                   if tied else "")
            raise ValueError(
                f"lora_target_modules (--lora-target-modules) names {target!r}, the output head lm_head{why}: the fused "
                f"loss reads lm_head.weight itself, so an adapter there is not supported; target the decoder's layers"
            )
        if tied and any(m is embeddings for m in matched):
            raise ValueError(
                f"lora_target_modules (--lora-target-modules) names {target!r}, the input embeddings, which this model "
                "ties to lm_head (tie_word_embeddings): an adapter would train the embeddings but not the head that "
                "shares their weight; untie them or target the decoder's layers"
            )


def check_flags(cfg: "GRPOConfig", model_config: Optional[Any] = None) -> None:
    """What can be checked before the model's weights are loaded: peft is installed, and (given the
    model's ``transformers`` config) every target module exists and is not the head. Nothing without
    ``use_peft``."""
    if not cfg.use_peft:
        return
    require_peft()
    if model_config is not None and target_modules(cfg) != ALL_LINEAR:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):  # the modules without their weights
            skeleton = AutoModelForCausalLM.from_config(model_config)
        check_targets(skeleton, cfg)


def add_adapters(model: torch.nn.Module, cfg: "GRPOConfig") -> torch.nn.Module:
    """``model`` wrapped in a ``peft.PeftModel`` with a fresh LoRA adapter (initialised from torch's RNG),
    everything but the adapters frozen. peft injects the adapter layers into ``model`` in place.

    Adapter weights are fp32 even when the base is bf16 (peft's ``autocast_adapter_dtype``).
    """
    require_peft()
    from peft import LoraConfig, get_peft_model

    check_targets(model, cfg)
    config = LoraConfig(
        r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, target_modules=target_modules(cfg),
        task_type="CAUSAL_LM", bias="none",
    )
    try:
        peft_model = get_peft_model(model, config, autocast_adapter_dtype=True)
    except ValueError as e:  # e.g. a matched module of a type LoRA has no layer for
        raise ValueError(f"lora_target_modules (--lora-target-modules) = {cfg.lora_target_modules!r}: {e}") from None
    trainable = [name for name, p in peft_model.named_parameters() if p.requires_grad]
    if not trainable:
        raise ValueError(f"lora_target_modules (--lora-target-modules) = {cfg.lora_target_modules!r} added no adapters")
    fuse_dropout(peft_model)
    return peft_model


# --------------------------------------------------------------------------------------------------
# the adapters' dropout, fused into A, with masks hashed from (seed, row, column)
# --------------------------------------------------------------------------------------------------
_M32 = 0xFFFFFFFF
# int64 temporaries of at most this many elements while hashing (a few MiB on a CPU; fewer launches on a GPU)
HASH_BLOCK = {"cpu": 1 << 16, "cuda": 1 << 22}


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """``a * c mod 2**32`` for int64 tensors holding values < 2**32, without int64 overflow: c's two 16-bit
    halves, each product < 2**48."""
    return (a * (c & 0xFFFF) + (((a * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser (Appleby): a bijection of [0, 2**32) with full avalanche."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def draw_seed() -> int:
    """One adapter call's dropout seed: 62 random bits from torch's CPU generator (which gradient
    checkpointing and ``grpo.activations``' chunked MLP restore before their recomputes)."""
    return int(torch.randint(0, 1 << 62, (), dtype=torch.int64))


def drop_mask(seed: int, first_row: int, rows: int, width: int, p: float, device: torch.device) -> torch.Tensor:
    """Which elements dropout drops, bool [rows, width], for the rows ``first_row ...`` of an input of ``width``
    features: element (i, j) is dropped when ``fmix32(fmix32(i + s0) ^ fmix32(j + s1)) < p 2**32`` (``s0``,
    ``s1``: the seed's two 32-bit halves; integer arithmetic, the same bits on every device). A
    counter-based draw (as Philox's, Salmon et al., 2011, is): a chunk of rows gets the rows of the
    whole input's mask, so chunking cannot change it, and the backward recomputes it instead of keeping it."""
    s0, s1 = seed & _M32, (seed >> 32) & _M32
    threshold = int(round(p * (1 << 32)))
    col_hash = _fmix32((torch.arange(width, dtype=torch.int64, device=device) + s1) & _M32)
    out = torch.empty((rows, width), dtype=torch.bool, device=device)
    step = max(1, HASH_BLOCK.get(device.type, HASH_BLOCK["cuda"]) // max(width, 1))
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        row_ids = torch.arange(first_row + start, first_row + stop, dtype=torch.int64, device=device)
        row_hash = _fmix32((row_ids + s0) & _M32)
        torch.lt(_fmix32(row_hash[:, None] ^ col_hash[None, :]), threshold, out=out[start:stop])
    return out


def dropped_input(x: torch.Tensor, drop: torch.Tensor, p: float) -> torch.Tensor:
    """``x`` with the ``drop`` elements zeroed and the others times ``1 / (1 - p)`` (inverted dropout,
    Srivastava et al., 2014), a new tensor of ``x``'s dtype (the scale rounded to it as a scalar product is)."""
    return x.masked_fill(drop, 0).mul_(1.0 / (1 - p))


class DropoutLinearFunction(torch.autograd.Function):
    """``y = dropout(x, p) @ A^T``: peft's ``lora_A(lora_dropout(x))`` in one op (Hu et al., 2021, with
    dropout on the adapter's input, as peft applies it), x [..., in], A [r, in] -> y [..., r]; the mask
    is :func:`drop_mask` of ``(seed, first_row + row, column)`` for the rows of ``x`` flattened to [n, in].

    Backward keeps ``x`` (which the q/k/v, and gate/up, adapters of a layer share, and peft's cast keeps
    anyway) and ``A``, and nothing of the mask: it hashes the mask again (a bool, 1 byte an element, at
    a time), recomputes the dropped input for ``d A = dy^T dropout(x)`` and frees it before
    ``d x = (dy A) * mask / (1 - p)``, made in place (no input-sized fp32 temporary besides d x).
    peft's pair keeps the dropped fp32 copy and, on a CPU, dropout's fp32 noise: 8 bytes an element."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, p: float, seed: int, first_row: int) -> torch.Tensor:
        drop = drop_mask(seed, first_row, x.numel() // x.shape[-1], x.shape[-1], p, x.device).view(x.shape)
        dropped = dropped_input(x, drop, p)
        del drop
        ctx.save_for_backward(x, weight)
        ctx.p, ctx.seed, ctx.first_row = p, seed, first_row
        return torch.nn.functional.linear(dropped, weight)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight = ctx.saved_tensors
        dx = dw = None
        dy2 = dy.reshape(-1, dy.shape[-1])
        drop = drop_mask(ctx.seed, ctx.first_row, dy2.shape[0], x.shape[-1], ctx.p, x.device).view(x.shape)
        # Under bf16 autocast the forward's matmul ran on bf16 casts of the dropped input and of A, and dy
        # is bf16 (the backward itself runs outside autocast): the matmuls below take the same casts, and
        # each gradient returns to its input's dtype, as the backward of autocast's casts does in peft's
        # pair. Without autocast every cast here is a no-op.
        # (d A first: the dropped input it needs is freed before d x's input-sized matmul is made)
        if ctx.needs_input_grad[1]:  # (as linear's, for its transposed weight: dy^T dropped)
            dropped = dropped_input(x, drop, ctx.p)
            dw = dy2.t().mm(dropped.reshape(-1, x.shape[-1]).to(dy.dtype)).to(weight.dtype)
            del dropped
        if ctx.needs_input_grad[0]:  # (as linear's: dy @ A, then through the dropout, in place on that product)
            dx = dy2.mm(weight.to(dy.dtype)).view(x.shape).to(x.dtype).masked_fill_(drop, 0).mul_(1.0 / (1 - ctx.p))
        return dx, dw, None, None, None


def dropout_seed(module: torch.nn.Module) -> tuple[int, int]:
    """(seed, first row) for one call of the adapter ``module``'s dropout: a fresh seed, rows from 0; inside a
    chunked MLP (``grpo.activations.current_chunk``) the seed ``module`` drew on the call's first chunk and
    the chunk's first row, so the chunks' masks are the rows of the whole call's."""
    chunk = current_chunk()
    if chunk is None:
        return draw_seed(), 0
    if module not in chunk.seeds:
        chunk.seeds[module] = draw_seed()
    return chunk.seeds[module], chunk.start


class DropoutLinear(torch.nn.Linear):
    """peft's ``lora_A`` with the adapter's dropout inside it (:class:`DropoutLinearFunction`) while
    training; a plain linear map in eval mode. Its parameter is the adapter's own (the state-dict keys,
    the saved adapter and peft's merge read ``lora_A.<name>.weight`` as before)."""

    p: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.p > 0:
            return DropoutLinearFunction.apply(x, self.weight, self.p, *dropout_seed(self))
        return torch.nn.functional.linear(x, self.weight, self.bias)


def fuse_dropout(peft_model: torch.nn.Module) -> None:
    """In every LoRA layer of ``peft_model`` whose adapter has dropout, move the dropout into ``lora_A``
    (:class:`DropoutLinear`) and make ``lora_dropout`` the identity: peft computes ``lora_B(lora_A(
    lora_dropout(x)))``, the same map. Layers that apply ``lora_dropout`` elsewhere (peft's variants,
    such as DoRA) are left as they are."""
    for module in peft_model.modules():
        dropouts, As = getattr(module, "lora_dropout", None), getattr(module, "lora_A", None)
        if not isinstance(dropouts, torch.nn.ModuleDict) or not isinstance(As, torch.nn.ModuleDict):
            continue
        for name, dropout in list(dropouts.items()):
            A = As[name] if name in As else None
            if (not isinstance(dropout, torch.nn.Dropout) or dropout.p == 0 or type(A) is not torch.nn.Linear
                    or A.bias is not None or name in getattr(module, "lora_variant", {})):
                continue
            fused = DropoutLinear(A.in_features, A.out_features, bias=False, device="meta")
            fused.weight = A.weight
            fused.p = float(dropout.p)
            fused.train(A.training)
            As[name] = fused
            dropouts[name] = torch.nn.Identity()


def has_adapters(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a peft model (it can disable its adapters)."""
    return callable(getattr(model, "disable_adapter", None)) and callable(getattr(model, "get_base_model", None))


def base_of(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft model (its adapter layers injected), or ``model``."""
    return model.get_base_model() if has_adapters(model) else model


@contextlib.contextmanager
def adapters_disabled(peft_model: torch.nn.Module) -> Iterator[None]:
    """Run ``peft_model`` as its base model: the reference policy, from the same weights."""
    with peft_model.disable_adapter():
        yield


def save_adapter(peft_model: torch.nn.Module, output_dir: str, tokenizer: Optional[Any] = None) -> str:
    """Write the adapter with peft (``adapter_config.json``, ``adapter_model.safetensors``) under
    ``output_dir/adapter``; ``peft.PeftModel.from_pretrained(base_model, path)`` loads it. Returns the path."""
    path = os.path.join(output_dir, ADAPTER_DIR)
    # (the base embeddings are frozen: with embed_tokens targeted peft would also save the whole embedding
    # matrix, its default for a resized vocabulary; the adapter holds the adapters only)
    peft_model.save_pretrained(path, save_embedding_layers=False)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path
