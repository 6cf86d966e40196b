"""grpo-kernels as the log-prob head of TRL's ``GRPOTrainer`` (trl >= 1.16, checked by patch(): docs/integrations.md).

    from grpo_kernels.integrations import trl as gk_trl
    gk_trl.patch()                      # once, before building the trainer
    trainer = trl.GRPOTrainer(...)      # as usual

or, without touching TRL globally, ``gk_trl.GRPOTrainer(...)`` (same arguments).

What TRL does, and the one thing we replace
-------------------------------------------
Since 1.15, ``GRPOTrainer.__init__`` calls ``add_fused_lm_head(model, temperature, cast_lm_head_to_fp32,
outputs)`` (``trl/trainer/utils.py``) on the policy (``outputs=("log_probs", "entropy")``) and on the
reference model (``("log_probs",)``). That replaces ``model.forward``: called with ``labels`` and
``fused_lm_head=True`` it runs the backbone, projects the hidden states through ``lm_head`` in tiles
(``trl/kernels/chunked_logprob.py``) and returns a ``FusedCausalLMOutput`` whose ``log_probs`` and
``entropy`` [B, S-1] (of ``softmax(logits / temperature)``) are 0 where the label is -100,
``label_mask = labels != -100`` and ``loss`` = summed NLL / ``num_items_in_batch`` (default: the number
of labels). Every GRPO option (loss types, KL and its bias correction, entropy bonus, entropy and
off-policy masks, importance-sampling ratios, metrics) is TRL code that consumes those tensors.

This module replaces only that head. ``add_fused_lm_head`` (the name ``trl.trainer.grpo_trainer``
calls) becomes a function that first lets TRL patch the model as usual (TRL's forward stays as the
fallback and serves every call without ``fused_lm_head=True``, e.g. generation), then puts a forward in
front of it that returns the same ``FusedCausalLMOutput`` fields, with the same masking, computed by
``grpo_kernels.fused_linear_token_logprobs`` on the labelled positions only. It is installed on the
model where TRL installs its own, so the trainer's ``model(...)`` call (through DDP / FSDP wrappers)
reaches it and their hooks fire as before.

Numerics: TRL computes each logits tile in the autocast dtype when autocast is on (TRL enables bf16
autocast by default, also on CPU), else in the hidden states' dtype, or in fp32 with
``cast_lm_head_to_fp32``, then reduces in fp32. We feed ``fused_linear_token_logprobs`` the hidden
states and ``lm_head`` in that same dtype with autocast off, so both heads round the logits the same
way and differ only by fp32 reduction order.

The sampler's truncation (an option; off by default, so TRL's numbers stay TRL's): TRL 1.16 scores
its tokens under the full ``softmax(logits / T)``, while vLLM draws them from that distribution
truncated to ``top_k`` then ``top_p`` (and TRL's vLLM importance-sampling correction divides by those
processed log-probs: TRL #6789). ``patch(top_k=..., top_p=...)`` (or ``GRPOTrainer(...,
grpo_kernels_top_k=..., grpo_kernels_top_p=...)``) makes the head return the log-probs and entropy of
the truncated, renormalised distribution (``grpo_kernels.fused_linear_token_logprobs``' ``top_k`` /
``top_p``): pass the values of your ``trl.GRPOConfig``. TRL's loss cannot leave out a token outside the
kept set (its log-prob is -inf there, as vLLM's): the head reports float32's lowest finite value
instead, which gives such a token an importance ratio of 0 (no policy gradient) but, with ``beta > 0``,
an overflowing KL term; grpo-kernels' own losses leave such tokens out (``docs/api.md``).

A DTensor head (FSDP2, or a tensor-parallel ``lm_head``) is gathered once per call with
``full_tensor()``, as TRL 1.16's head does (its gradient flows back to the shards through it).

Where grpo-kernels cannot serve, TRL's own head runs, after one ``UserWarning`` per reason (never a
silent difference): MoE router logits (TRL's head adds the load-balancing loss), a PEFT adapter on
``lm_head``, a DeepSpeed ZeRO-3 partitioned head (our backward recomputes the logits from the weight
saved in the forward, which ZeRO-3 re-partitions when its gather context closes), a non-float
(quantised) head, extra outputs TRL asks for that we do not compute (``log_sum_sq_probs``,
``mean_logits``, ``is_top1``), final-logit soft-capping or ``logit_scale`` when the installed
grpo-kernels does not offer them with TRL's meaning, and a TRL whose head this module does not know.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
import logging
import warnings
from typing import Any, Callable, Iterator, Optional

import torch

from ._host import TESTED as _TESTED

_TESTED_TRL = _TESTED["trl"]
try:
    import trl
    from trl.trainer import grpo_trainer as _grpo_trainer_module
    from trl.trainer import utils as _trl_utils
except ImportError as exc:  # pragma: no cover - exercised only without trl
    raise ImportError(
        f"grpo_kernels.integrations.trl needs TRL (pip install 'grpo-kernels[trl]'; tested: {', '.join(_TESTED_TRL)})"
    ) from exc

import grpo_kernels
from grpo_kernels.autograd import compute_dtype
from grpo_kernels.kernels.torch_rows import floor_logp
from grpo_kernels import _validation as V
from grpo_kernels.options import BACKENDS, IGNORE_INDEX, check_top_k, check_top_p

from . import _host

#: The lowest TRL release this integration is tested against (the "trl" extra's floor); a newer or
#: older one is patched when :func:`check_trl` passes (an untested one with an INFO record).
MIN_TRL_VERSION = _host.MINIMUM["trl"]
# trl.trainer.utils.add_fused_lm_head's parameters, as TRL 1.16 declares them (new in 1.15).
TRL_HEAD_PARAMETERS = ("model", "temperature", "cast_lm_head_to_fp32", "outputs")
# FusedCausalLMOutput's fields this integration fills.
_TRL_OUTPUT_FIELDS = ("loss", "log_probs", "entropy", "label_mask")

__all__ = ["patch", "unpatch", "is_patched", "GRPOTrainer", "add_fused_lm_head"]

# TRL's own head factory, as defined by TRL: what we delegate to, and what unpatch() puts back.
_TRL_ADD_FUSED_LM_HEAD: Optional[Callable[..., None]] = getattr(_trl_utils, "add_fused_lm_head", None)


def check_trl() -> None:
    """What this integration replaces and fills must be in the installed TRL, with the signature it was
    written for: ``add_fused_lm_head(model, temperature, cast_lm_head_to_fp32, outputs)`` in
    ``trl.trainer.utils`` and ``trl.trainer.grpo_trainer`` (the name the trainer calls), and
    ``FusedCausalLMOutput`` with the fields we fill. Raises ``HostMismatchError`` naming TRL's version
    and the missing piece; an untested release that passes is noted at INFO (once, on ``patch``)."""
    version = trl.__version__
    _host.require(callable(_TRL_ADD_FUSED_LM_HEAD), "trl", version, "trl.trainer.utils has no add_fused_lm_head")
    _host.require(callable(getattr(_grpo_trainer_module, "add_fused_lm_head", None)), "trl", version,
                  "trl.trainer.grpo_trainer does not call add_fused_lm_head")
    _host.require_parameters(_TRL_ADD_FUSED_LM_HEAD, TRL_HEAD_PARAMETERS, "trl", version, "add_fused_lm_head")
    output = getattr(_trl_utils, "FusedCausalLMOutput", None)
    fields = tuple(getattr(output, "__dataclass_fields__", {}))
    missing = [f for f in _TRL_OUTPUT_FIELDS if f not in fields]
    _host.require(output is not None and not missing, "trl", version,
                  f"trl.trainer.utils.FusedCausalLMOutput lacks {missing or 'everything'}")
# Per-token outputs of TRL's FusedCausalLMOutput that fused_linear_token_logprobs computes.
_SERVED_OUTPUTS = frozenset({"log_probs", "entropy"})
# dtypes fused_linear_token_logprobs accepts for hidden states and weight.
_CORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Values TRL's add_fused_lm_head decides and closes over in the forward it installs. Reading them
# (rather than re-deriving softcap / logit_scale from the config) keeps TRL's decisions exactly.
_TRL_HEAD_SETTINGS = (
    "temperature", "cast_lm_head_to_fp32", "outputs", "final_logit_softcapping", "logit_scale",
    "backbone_attr", "text_config",
)

#: INFO: one record each time a trainer installs a head on a model: ours (backend, chunk size), or
#: TRL's, with the reason. ``logging.basicConfig(level=logging.INFO)`` shows them.
logger = logging.getLogger(__name__)

_warned: set[str] = set()
_trl_head_before_patch: Optional[Callable[..., None]] = None


def _fall_back(reason: str, model: Optional[torch.nn.Module] = None) -> None:
    """Warn once per reason that TRL's own head serves a call; when it is the head a trainer
    installs on ``model``, also log it (INFO, every time)."""
    if model is not None:
        logger.info("grpo_kernels.integrations.trl: %s keeps TRL's own fused LM head: %s", type(model).__name__, reason)
    if reason in _warned:
        return
    _warned.add(reason)
    if model is None:
        logger.info("grpo_kernels.integrations.trl: a call falls back to TRL's own fused LM head: %s", reason)
    warnings.warn(
        f"grpo_kernels.integrations.trl: {reason}; TRL's own fused LM head computes these log-probs "
        "(TRL's numerics and memory).",
        UserWarning,
        stacklevel=3,
    )


def _check_settings(backend: str, chunk_size: Optional[int], top_k: Optional[int] = None,
                    top_p: Optional[float] = None) -> dict:
    """Refuse bad settings at ``patch`` time (each against its declaration, as the functions check it);
    -> the sampling keywords of the head ({} when off)."""
    V.check_choice("backend", backend, BACKENDS)
    V.check_chunk_size(chunk_size)
    top_k, top_p = check_top_k(top_k), check_top_p(top_p)  # (vLLM's "off" values: None)
    return {k: v for k, v in (("top_k", top_k), ("top_p", top_p)) if v is not None}


# --------------------------------------------------------------------------------------------------
# When we can serve: static (once per model) and per call
# --------------------------------------------------------------------------------------------------
def _trl_head_settings(trl_forward: Any) -> Optional[dict]:
    """The settings TRL's installed forward closes over, or None if it is not the head we know."""
    fn = getattr(trl_forward, "__func__", None)
    code, closure = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or closure is None:
        return None
    cells = dict(zip(code.co_freevars, closure))
    try:
        return {name: cells[name].cell_contents for name in _TRL_HEAD_SETTINGS}
    except (KeyError, ValueError):  # a missing name, or an empty cell
        return None


@functools.lru_cache(maxsize=None)
def _core_matches_trl_transform(softcap: Optional[float], logit_scale: float) -> bool:
    """Whether fused_linear_token_logprobs(softcap=, logit_scale=) is TRL's transform.

    TRL (``_torch_transform`` in trl/kernels/chunked_logprob.py) scales first, then soft-caps, then
    divides by the temperature: ``z -> softcap * tanh(z * logit_scale / softcap) / T``. One tiny
    float64-checked call tells whether the installed core agrees, including the order.
    """
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 4, generator=g) * 3
    weight = torch.randn(7, 4, generator=g)
    targets = torch.tensor([0, 3, 6])
    z = (hidden.double() @ weight.double().t()) * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    expected = torch.log_softmax(z, -1).gather(-1, targets[:, None])[:, 0]
    try:
        got = grpo_kernels.fused_linear_token_logprobs(
            hidden, weight, targets, softcap=softcap, logit_scale=logit_scale, backend="torch"
        )
    except (TypeError, ValueError):
        return False
    return bool(torch.allclose(got.double(), expected, rtol=1e-4, atol=1e-4))


def _transform_kwargs(softcap: Optional[float], logit_scale: float) -> Optional[dict]:
    """Keywords that give TRL's softcap / logit_scale to our head; None if the core cannot."""
    if softcap is None and logit_scale == 1.0:
        return {}
    params = inspect.signature(grpo_kernels.fused_linear_token_logprobs).parameters
    if "softcap" not in params or "logit_scale" not in params:
        return None
    if not _core_matches_trl_transform(softcap, float(logit_scale)):
        return None
    return {"softcap": softcap, "logit_scale": float(logit_scale)}


def _is_peft_wrapped(module: torch.nn.Module) -> bool:
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer

        if isinstance(module, BaseTunerLayer):
            return True
    except ImportError:
        pass
    # LoRA-style layers keep the wrapped layer as ``base_layer``; modules_to_save keeps ``original_module``.
    return hasattr(module, "base_layer") or hasattr(module, "original_module")


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor)


def _zero3_enabled() -> bool:
    try:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    except ImportError:  # pragma: no cover
        return False
    return bool(is_deepspeed_zero3_enabled())


def _unservable_call(model: torch.nn.Module, text_config: Any, kwargs: dict) -> Optional[str]:
    """Why this ``fused_lm_head=True`` call must go to TRL's head, or None if ours serves it."""
    # TRL requests router logits when the config asks for them unless the caller says otherwise.
    if kwargs.get("output_router_logits", getattr(text_config, "output_router_logits", False)):
        return "MoE router logits are requested (TRL's head adds the load-balancing loss)"
    lm_head = model.get_output_embeddings()
    if _is_peft_wrapped(lm_head):
        return "a PEFT adapter wraps lm_head"
    weight = getattr(lm_head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.dtype not in _CORE_DTYPES:
        return "lm_head.weight is not a 2-D fp32/bf16/fp16 matrix (quantised head?)"
    if _zero3_enabled():
        return "DeepSpeed ZeRO-3 partitions lm_head"
    return None


# --------------------------------------------------------------------------------------------------
# The head
# --------------------------------------------------------------------------------------------------
def _head_compute_dtype(hidden: torch.Tensor, cast_lm_head_to_fp32: bool) -> torch.dtype:
    """The dtype TRL's ChunkedLogProbFunction computes the logits tiles in."""
    if cast_lm_head_to_fp32:  # TRL casts the hidden states to fp32 and turns autocast off
        return torch.float32
    return compute_dtype(hidden)


def _fused_forward(
    model: torch.nn.Module, trl_forward: Callable[..., Any], settings: dict, transform: dict,
    backend: str, chunk_size: Optional[int], sampling: Optional[dict] = None,
) -> Callable[..., Any]:
    """The forward installed in front of TRL's: same keywords, same FusedCausalLMOutput."""
    text_config = settings["text_config"]
    backbone_attr = settings["backbone_attr"]
    temperature = settings["temperature"]
    cast_lm_head_to_fp32 = settings["cast_lm_head_to_fp32"]
    with_entropy = "entropy" in settings["outputs"]

    # The original signature, as TRL keeps it: `generate` validates its model kwargs against it.
    @functools.wraps(type(model).forward)
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        reason = _unservable_call(self, text_config, kwargs) if fused_lm_head else None
        if not fused_lm_head or reason is not None:
            if reason is not None:
                _fall_back(reason)
            return trl_forward(
                *args, fused_lm_head=fused_lm_head, labels=labels, shift_labels=shift_labels,
                num_items_in_batch=num_items_in_batch, **kwargs,
            )

        kwargs["use_cache"] = False
        backbone_outputs = getattr(self, backbone_attr)(*args, **kwargs)
        if shift_labels is None:  # labels [B, S]: position s predicts label s + 1
            hidden_states = backbone_outputs.last_hidden_state[:, :-1]
            labels = labels[:, 1:]
        else:  # pre-shifted under context / sequence parallelism
            hidden_states = backbone_outputs.last_hidden_state
            labels = shift_labels
        # Looked up on each call: FSDP and PEFT replace modules after TRL patched the model.
        lm_head = self.get_output_embeddings()
        weight, bias = lm_head.weight, lm_head.bias
        if _is_dtensor(weight):  # FSDP2 / tensor parallel: gathered for this call, as TRL's head does
            weight = weight.full_tensor()
            bias = bias.full_tensor() if _is_dtensor(bias) else bias
        hidden_states = hidden_states.to(weight.device)  # with device_map the backbone may end elsewhere
        labels = labels.to(weight.device)
        mask = labels != IGNORE_INDEX
        dtype = _head_compute_dtype(hidden_states, cast_lm_head_to_fp32)
        # Only labelled positions are projected (TRL does so on Triton devices, scores all on others).
        with torch.autocast(hidden_states.device.type, enabled=False):
            result = grpo_kernels.fused_linear_token_logprobs(
                hidden_states[mask].to(dtype), weight.to(dtype), labels[mask],
                bias=None if bias is None else bias.to(dtype), temperature=temperature,
                return_entropy=with_entropy, chunk_size=chunk_size, backend=backend, **transform, **(sampling or {}),
            )
        log_probs, entropy = result if with_entropy else (result, None)
        if sampling:  # outside the kept set: float32's lowest, not -inf, which TRL's loss cannot leave out
            log_probs = floor_logp(log_probs)
        # masked_scatter keeps the outputs connected to the model even when no label is valid.
        log_probs = log_probs.new_zeros(mask.shape).masked_scatter(mask, log_probs)
        if entropy is not None:
            entropy = entropy.new_zeros(mask.shape).masked_scatter(mask, entropy)
        denominator = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return _trl_utils.FusedCausalLMOutput(
            loss=-log_probs.sum() / denominator, log_probs=log_probs, entropy=entropy, label_mask=mask
        )

    forward.__grpo_kernels__ = True  # type: ignore[attr-defined]
    return forward


def _make_add_fused_lm_head(backend: str = "auto", chunk_size: Optional[int] = None, top_k: Optional[int] = None,
                            top_p: Optional[float] = None) -> Callable[..., None]:
    sampling = _check_settings(backend, chunk_size, top_k, top_p)

    def add_fused_lm_head(
        model: torch.nn.Module,
        temperature: float = 1.0,
        cast_lm_head_to_fp32: bool = False,
        outputs: tuple = ("log_probs",),
    ) -> None:
        """``trl.trainer.utils.add_fused_lm_head`` with grpo-kernels computing the log-probs.

        TRL patches the model first (its forward is the fallback and serves non-fused calls); ours
        then goes in front of it, unless this model needs TRL's head (one warning says why).
        """
        _TRL_ADD_FUSED_LM_HEAD(model, temperature=temperature, cast_lm_head_to_fp32=cast_lm_head_to_fp32, outputs=outputs)
        trl_forward = model.forward
        settings = _trl_head_settings(trl_forward)
        if settings is None:
            _fall_back(f"trl {trl.__version__}'s fused head is not the one this integration was written for", model)
            return
        unserved = sorted(set(outputs) - _SERVED_OUTPUTS)
        if unserved:
            _fall_back(f"TRL asks the head for {unserved}, which grpo-kernels does not compute", model)
            return
        softcap, logit_scale = settings["final_logit_softcapping"], settings["logit_scale"]
        transform = _transform_kwargs(softcap, logit_scale)
        if transform is None:
            _fall_back(
                f"the model uses final-logit soft-capping ({softcap}) / logit_scale ({logit_scale}), which this "
                "grpo-kernels does not apply as TRL does", model,
            )
            return
        model.forward = types.MethodType(
            _fused_forward(model, trl_forward, settings, transform, backend, chunk_size, sampling), model
        )
        logger.info(
            "grpo_kernels.integrations.trl: %s's log-prob head (%s) is grpo_kernels.fused_linear_token_logprobs "
            "(backend=%r, chunk_size=%r); a call it cannot serve falls back to TRL's head with a warning",
            type(model).__name__, ", ".join(outputs), backend, chunk_size,
        )

    add_fused_lm_head.__grpo_kernels__ = True  # type: ignore[attr-defined]
    return add_fused_lm_head


#: The replacement with default settings (backend "auto", default chunk size).
add_fused_lm_head = _make_add_fused_lm_head()


# --------------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------------
def patch(*, backend: str = "auto", chunk_size: Optional[int] = None, top_k: Optional[int] = None,
          top_p: Optional[float] = None) -> None:
    """Make every ``trl.GRPOTrainer`` built from now on use grpo-kernels' log-prob head.

    ``backend`` and ``chunk_size`` are passed to ``fused_linear_token_logprobs``. ``top_k`` / ``top_p``
    (default None: off, TRL's numbers): the log-probs and entropy of the distribution vLLM samples from
    with these settings (see the module docstring; pass your ``trl.GRPOConfig``'s). Calling it again
    changes the settings; ``unpatch()`` restores TRL as it was before the first call.
    """
    global _trl_head_before_patch
    head = _make_add_fused_lm_head(backend, chunk_size, top_k, top_p)
    check_trl()
    if _trl_head_before_patch is None:
        _host.note_untested(logger, "trl", trl.__version__)
        _trl_head_before_patch = _grpo_trainer_module.add_fused_lm_head
    _grpo_trainer_module.add_fused_lm_head = head


def unpatch() -> None:
    """Undo ``patch()``: TRL's module holds the very function it held before. Trainers built while
    patched keep grpo-kernels' head; build a new trainer for TRL's."""
    global _trl_head_before_patch
    if _trl_head_before_patch is not None:
        _grpo_trainer_module.add_fused_lm_head = _trl_head_before_patch
        _trl_head_before_patch = None


def is_patched() -> bool:
    """Whether ``patch()`` is in effect: ``trl.GRPOTrainer``s built now get grpo-kernels' head (each
    logs one INFO record on ``grpo_kernels.integrations.trl`` per model it installs a head on, ours
    or, with the reason, TRL's). ``GRPOTrainer`` of this module needs no patch, and does not set it."""
    return _trl_head_before_patch is not None


@contextlib.contextmanager
def _head_installed(head: Callable[..., None]) -> Iterator[None]:
    previous = _grpo_trainer_module.add_fused_lm_head
    _grpo_trainer_module.add_fused_lm_head = head
    try:
        yield
    finally:
        _grpo_trainer_module.add_fused_lm_head = previous


class GRPOTrainer(trl.GRPOTrainer):
    """``trl.GRPOTrainer`` with grpo-kernels' log-prob head, without patching TRL globally.

    Takes every argument of ``trl.GRPOTrainer``, plus ``grpo_kernels_backend``,
    ``grpo_kernels_chunk_size`` (passed to ``fused_linear_token_logprobs``) and
    ``grpo_kernels_top_k`` / ``grpo_kernels_top_p`` (the sampler's truncation, as in :func:`patch`).
    """

    def __init__(self, *args: Any, grpo_kernels_backend: str = "auto", grpo_kernels_chunk_size: Optional[int] = None,
                 grpo_kernels_top_k: Optional[int] = None, grpo_kernels_top_p: Optional[float] = None,
                 **kwargs: Any) -> None:
        # TRL calls add_fused_lm_head from its __init__ only: install ours for that call.
        head = _make_add_fused_lm_head(grpo_kernels_backend, grpo_kernels_chunk_size, grpo_kernels_top_k,
                                       grpo_kernels_top_p)
        check_trl()
        with _head_installed(head):
            super().__init__(*args, **kwargs)
