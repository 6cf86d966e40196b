"""grpo-kernels as the log-prob head of OpenRLHF's ``Actor`` (``openrlhf.models.Actor``).

    from grpo_kernels.integrations import openrlhf as gk_openrlhf
    gk_openrlhf.patch()        # once, in every process that builds or runs an Actor (driver and Ray workers)

What OpenRLHF does, and the one thing we replace
-------------------------------------------------
``Actor.forward(sequences, action_mask=None, attention_mask=None, return_output=False,
allgather_logits=False, return_logprobs=False, ring_attn_group=None, packed_seq_lens=None,
return_entropy=False, **mm_inputs)`` (``openrlhf/models/actor.py``, read in 0.11.2) runs the causal LM,
casts its ``[B, S, V]`` logits to fp32, divides them by ``Actor.temperature`` in place, and returns:

- ``log_probs[b, s] = log_softmax(logits[b, s])[sequences[b, s + 1]]`` for ``s < S - 1``
  (``torch.roll`` of the sequences by one; the wrapped last column is dropped);
- with ``action_mask [B, A]`` (the PPO actor, the experience maker): ``log_probs[:, -A:] * action_mask``;
  with ``return_logprobs`` and no ``action_mask`` (SFT, DPO): ``log_probs [B, S-1]``;
- with ``return_entropy`` (needs ``return_output``): ``output.entropy [B, S-1]``, the entropy of
  ``softmax(logits[b, s] / T)``;
- with ``return_output``: the model's output as well (``(log_probs, output)``).

``packing_samples`` (set by ``Actor.__init__``): the padded ``[B, S]`` batch is unpadded to one row
``[1, nnz]`` (and, with ``ring_attn_group``, padded to a multiple of the ring's size and sliced to
this rank's part) by OpenRLHF's ``unpad_and_slice_tensor``; the per-token results are gathered and
padded back to ``[B, S]`` (zeros at padding) by its ``gather_and_pad_tensor``.

:func:`patch` replaces ``Actor.forward`` with one that runs the same prologue (OpenRLHF's own
``unpad_and_slice_tensor`` / ``gather_and_pad_tensor``, the same position ids), calls the causal LM's
backbone (``model.base_model``: the decoder without ``lm_head``) for the hidden states, and computes the
log-probs (and entropy) with :func:`grpo_kernels.fused_linear_token_logprobs` on those hidden states
and ``lm_head.weight`` (and bias), ``temperature=Actor.temperature`` applied inside the kernel (not in
place on a tensor). The ``[B, S, V]`` logits never exist. With ``action_mask``, no ``return_logprobs`` and
no entropy, only the ``A`` scored positions of each row are projected. ``output`` (``return_output``) is a
``transformers`` ``CausalLMOutputWithPast`` without ``logits`` (``output["logits"]`` raises KeyError;
OpenRLHF's trainers read only ``output.entropy`` and, for MoE, ``output.aux_loss``), with
``output.entropy`` set as OpenRLHF sets it.

Numerics: OpenRLHF rounds the logits to the head's dtype (the ``lm_head`` matmul's output, bf16 for a bf16
model) and then works in fp32 (``.to(torch.float32)``, ``/ T``, log-softmax, entropy). The fused head forms
each chunk's logits in the weight's dtype and reduces in fp32, so both round the logits the same way and
differ by fp32 reduction order only (``tests/test_integrations_openrlhf.py`` checks log-probs, entropy and
every parameter gradient of a PPO loss built with OpenRLHF's ``PolicyLoss``, fp32 and bf16).

Where grpo-kernels does not serve a call, OpenRLHF's own forward runs it:

- silently, where there is nothing to replace: a call that asks for the logits themselves (``return_output``
  with neither ``action_mask`` nor ``return_logprobs``: OpenRLHF's critic / reward-model style call);
  an ``Actor`` built from a module, without ``packing_samples`` (OpenRLHF's forward raises its own error);
- after one ``UserWarning`` per reason (never a silent difference): a vision-language model or
  multimodal inputs; MoE router logits (``output.aux_loss``, computed by the causal LM's head); a PEFT
  adapter on ``lm_head``; a quantised (non-float) head; DeepSpeed ZeRO-3 (``lm_head.weight`` is a
  partitioned placeholder until its module's hooks gather it, and our backward re-reads the weight
  after they re-partition it); a model whose head transforms its logits (soft-capping, ``logit_scale``,
  ``logits_scaling``); a causal LM without a separate backbone.

Bad input raises ``ValueError``/``TypeError`` naming the argument as OpenRLHF names it, before the model
runs: ``sequences`` not a 2-D integer tensor, an ``attention_mask`` of another shape, an ``action_mask``
that is not ``[B, A]`` with ``A < S``, ``return_entropy`` without ``return_output`` (OpenRLHF asserts), a
flag that is not a bool.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import threading
import warnings
from typing import Any, Callable, Optional

import torch

from .. import _validation as V
from ..functional import fused_linear_token_logprobs
from ..options import BACKENDS
from . import _host

__all__ = ["patch", "unpatch", "is_patched", "ACTOR_MODULE", "ACTOR_FORWARD_PARAMETERS"]

logger = logging.getLogger(__name__)

DISTRIBUTION = "openrlhf"
ACTOR_MODULE = "openrlhf.models.actor"
#: ``Actor.forward``'s parameters as OpenRLHF 0.11.2 declares them; patch() refuses another signature.
ACTOR_FORWARD_PARAMETERS = ("self", "sequences", "action_mask", "attention_mask", "return_output", "allgather_logits",
                            "return_logprobs", "ring_attn_group", "packed_seq_lens", "return_entropy", "mm_inputs")
# The helpers of OpenRLHF's actor module the packed path calls (its ring-attention layout).
_PACKING_HELPERS = ("unpad_and_slice_tensor", "gather_and_pad_tensor")
# Config attributes with which a transformers causal LM transforms its logits after lm_head.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_lock = threading.RLock()
_openrlhf_forward: Optional[Callable[..., Any]] = None  # OpenRLHF's own Actor.forward, kept while patched
_warned: set = set()


def _fall_back(reason: str) -> None:
    """One UserWarning per reason: OpenRLHF's own forward (its logits, its numerics) serves this call."""
    if reason in _warned:
        return
    _warned.add(reason)
    logger.info("grpo_kernels.integrations.openrlhf: a call falls back to OpenRLHF's own Actor.forward: %s", reason)
    warnings.warn(f"grpo_kernels.integrations.openrlhf: {reason}; OpenRLHF's own Actor.forward computes these "
                  "log-probs (its [B, S, V] logits, its numerics)", UserWarning, stacklevel=3)


# --------------------------------------------------------------------------------------------------
# Which calls we serve
# --------------------------------------------------------------------------------------------------
def _causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers causal LM inside ``Actor.model`` (a PEFT model's base model)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _is_peft_wrapped(module: torch.nn.Module) -> bool:
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer

        if isinstance(module, BaseTunerLayer):
            return True
    except ImportError:  # pragma: no cover - OpenRLHF requires peft
        pass
    # LoRA-style layers keep the wrapped layer as ``base_layer``; modules_to_save keeps ``original_module``.
    return hasattr(module, "base_layer") or hasattr(module, "original_module")


def _zero3(weight: torch.Tensor) -> bool:
    if hasattr(weight, "ds_id"):  # a DeepSpeed ZeRO-3 partitioned parameter
        return True
    try:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    except ImportError:  # pragma: no cover
        return False
    return bool(is_deepspeed_zero3_enabled())


def _unservable(actor: torch.nn.Module, mm_inputs: dict) -> Optional[str]:
    """Why OpenRLHF's forward must serve this call, or None if ours does."""
    if mm_inputs or getattr(actor, "is_vlm", False):
        return "a vision-language model / multimodal inputs"
    lm = _causal_lm(actor.model)
    config = getattr(lm, "config", None)
    if getattr(config, "output_router_logits", False):
        return "MoE router logits (output.aux_loss comes from the causal LM's own head)"
    for name in _LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value is not None and not (name != "final_logit_softcapping" and value == 1):
            return f"the model transforms its logits after lm_head (config.{name}={value!r})"
    backbone = getattr(lm, "base_model", lm)
    if backbone is lm or not isinstance(backbone, torch.nn.Module):
        return f"{type(lm).__name__} has no backbone apart from its head (base_model)"
    head = lm.get_output_embeddings()
    if head is None or _is_peft_wrapped(head):
        return "a PEFT adapter wraps lm_head" if head is not None else "the model has no lm_head"
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.dtype not in _FLOAT_DTYPES:
        return "lm_head.weight is not a 2-D fp32/bf16/fp16 matrix (quantised head?)"
    if _zero3(weight):
        return "DeepSpeed ZeRO-3 partitions lm_head.weight"
    return None


def _check_call(sequences: object, action_mask: object, attention_mask: object, return_output: bool,
                return_entropy: bool) -> None:
    """The shapes OpenRLHF passes, named as it names them; raises before the model runs."""
    if return_entropy and not return_output:
        raise ValueError("return_entropy=True needs return_output=True (the entropy is returned as output.entropy)")
    sequences = V.check_tensor("sequences", sequences)
    if sequences.dim() != 2 or sequences.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"sequences must be a 2-D [B, S] int64/int32 tensor of token ids, got "
                         f"{sequences.dtype} of shape {list(sequences.shape)}")
    attention_mask = V.check_tensor("attention_mask", attention_mask)
    if attention_mask.shape != sequences.shape:
        raise ValueError(f"attention_mask must have sequences' shape {list(sequences.shape)}, got "
                         f"{list(attention_mask.shape)}")
    if action_mask is not None:
        action_mask = V.check_tensor("action_mask", action_mask)
        b, s = sequences.shape
        if action_mask.dim() != 2 or action_mask.shape[0] != b or not 1 <= action_mask.shape[1] < s:
            raise ValueError(f"action_mask must be [B, A] with B = {b} (sequences' rows) and 1 <= A < S = {s} "
                             f"(the last A of the S - 1 predicted positions), got {list(action_mask.shape)}")


# --------------------------------------------------------------------------------------------------
# The forward
# --------------------------------------------------------------------------------------------------
def _make_forward(openrlhf_forward: Callable[..., Any], actor_module: Any, backend: str,
                  chunk_size: Optional[int]) -> Callable[..., Any]:
    """``Actor.forward`` with the log-prob head of grpo-kernels; same signature, same results."""
    unpad_and_slice_tensor = actor_module.unpad_and_slice_tensor
    gather_and_pad_tensor = actor_module.gather_and_pad_tensor

    @functools.wraps(openrlhf_forward)
    def forward(self, sequences, action_mask=None, attention_mask=None, return_output=False, allgather_logits=False,
                return_logprobs=False, ring_attn_group=None, packed_seq_lens=None, return_entropy=False,
                **mm_inputs):
        args = dict(action_mask=action_mask, attention_mask=attention_mask, return_output=return_output,
                    allgather_logits=allgather_logits, return_logprobs=return_logprobs,
                    ring_attn_group=ring_attn_group, packed_seq_lens=packed_seq_lens, return_entropy=return_entropy)
        flags = dict(return_output=return_output, allgather_logits=allgather_logits, return_logprobs=return_logprobs,
                     return_entropy=return_entropy)
        for name, value in flags.items():
            V.check_flag(name, value)
        wants_logprobs = action_mask is not None or return_logprobs
        if not wants_logprobs or not hasattr(self, "packing_samples"):  # the logits themselves, or not ours to judge
            return openrlhf_forward(self, sequences, **args, **mm_inputs)
        reason = _unservable(self, mm_inputs)
        if reason is not None:
            _fall_back(reason)
            return openrlhf_forward(self, sequences, **args, **mm_inputs)
        _check_call(sequences, action_mask, attention_mask, return_output, return_entropy)

        batch, seqlen = sequences.shape
        if self.packing_samples:  # OpenRLHF's own unpadding (and ring-attention slicing)
            tokens, position_ids, rolled, ring_pad_len, indices = unpad_and_slice_tensor(
                sequences, attention_mask, ring_attn_group)
            forward_mask = None
        else:  # the same position ids and rolled targets as OpenRLHF's forward
            tokens, forward_mask = sequences, attention_mask
            rolled = torch.roll(sequences, shifts=-1, dims=1)
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)

        lm = _causal_lm(self.model)
        backbone_output = lm.base_model(tokens, attention_mask=forward_mask, position_ids=position_ids)
        hidden = backbone_output.last_hidden_state
        head = lm.get_output_embeddings()
        hidden, rolled = hidden.to(head.weight.device), rolled.to(head.weight.device)  # device_map may split them
        kw = dict(bias=head.bias, temperature=float(self.temperature), chunk_size=chunk_size, backend=backend)

        if action_mask is not None and not return_logprobs and not return_entropy and not self.packing_samples:
            # only the A scored positions: rows S-1-A .. S-2 predict sequences[:, S-A:]
            width = action_mask.shape[1]
            scored = slice(seqlen - 1 - width, seqlen - 1)
            log_probs = fused_linear_token_logprobs(hidden[:, scored], head.weight, rolled[:, scored], **kw)
            entropy = None
        else:
            log_probs, entropy = fused_linear_token_logprobs(hidden, head.weight, rolled, return_entropy=True, **kw) \
                if return_entropy else (fused_linear_token_logprobs(hidden, head.weight, rolled, **kw), None)
            if self.packing_samples:
                log_probs = gather_and_pad_tensor(log_probs, ring_attn_group, ring_pad_len, indices, batch, seqlen)
                if entropy is not None:
                    entropy = gather_and_pad_tensor(entropy, ring_attn_group, ring_pad_len, indices, batch, seqlen)
            log_probs = log_probs[:, :-1]
            if action_mask is not None:
                log_probs = log_probs[:, -action_mask.shape[1]:]

        output = None
        if return_output:
            from transformers.modeling_outputs import CausalLMOutputWithPast

            output = CausalLMOutputWithPast(past_key_values=getattr(backbone_output, "past_key_values", None),
                                            hidden_states=getattr(backbone_output, "hidden_states", None),
                                            attentions=getattr(backbone_output, "attentions", None))
            if entropy is not None:
                setattr(output, "entropy", entropy[:, :-1])  # as OpenRLHF sets it: an attribute, [B, S-1]
        if action_mask is not None:
            log_probs = log_probs * action_mask.float()
        return (log_probs, output) if return_output else log_probs

    forward.__grpo_kernels__ = True  # type: ignore[attr-defined]
    return forward


# --------------------------------------------------------------------------------------------------
# patch / unpatch
# --------------------------------------------------------------------------------------------------
def _actor_module() -> Any:
    try:
        return importlib.import_module(ACTOR_MODULE)
    except ImportError as error:
        raise ImportError(f"grpo_kernels.integrations.openrlhf needs OpenRLHF >= {_host.MINIMUM[DISTRIBUTION]} "
                          f"(pip install 'grpo-kernels[openrlhf]'); importing {ACTOR_MODULE} failed: {error}") from error


def _check_host(module: Any, version: str) -> None:
    """What patch() replaces and calls must be there, as written for (refuses naming the piece)."""
    actor = getattr(module, "Actor", None)
    _host.require(isinstance(actor, type), DISTRIBUTION, version, f"{ACTOR_MODULE} has no class Actor")
    _host.require(callable(getattr(actor, "forward", None)), DISTRIBUTION, version, "Actor has no forward")
    forward = _openrlhf_forward if _openrlhf_forward is not None else actor.forward
    _host.require_parameters(forward, ACTOR_FORWARD_PARAMETERS, DISTRIBUTION, version, "Actor.forward")
    for name in _PACKING_HELPERS:
        _host.require(callable(getattr(module, name, None)), DISTRIBUTION, version,
                      f"{ACTOR_MODULE} has no {name} (the packed-samples layout)")
    for name in _PACKING_HELPERS:
        params = list(inspect.signature(getattr(module, name)).parameters)
        want = (["sequences", "attention_mask", "ring_attn_group"] if name == "unpad_and_slice_tensor"
                else ["tensor", "ring_attn_group", "ring_attn_pad_len", "indices", "batch", "seqlen"])
        _host.require(params == want, DISTRIBUTION, version, f"{ACTOR_MODULE}.{name} has the parameters {params}, not {want}")


def patch(*, backend: str = "auto", chunk_size: Optional[int] = None) -> None:
    """Make ``openrlhf.models.Actor.forward`` compute its log-probs and entropy with grpo-kernels.

    Every ``Actor`` (built before or after; DeepSpeed engines call it) then runs the forward described
    in the module docstring. ``backend`` and ``chunk_size`` are passed to ``fused_linear_token_logprobs``.
    Checks first that OpenRLHF's ``Actor.forward`` and the packing helpers exist with the signatures this
    was written for (else :class:`~grpo_kernels.integrations._host.HostMismatchError` naming OpenRLHF's
    version and the missing piece, and nothing changes); an untested release that passes is patched
    with one INFO record. Calling it again only replaces the settings (OpenRLHF's own forward is kept
    once); :func:`unpatch` restores it. Raises ImportError without OpenRLHF.
    """
    global _openrlhf_forward
    V.check_choice("backend", backend, BACKENDS)
    chunk_size = V.check_chunk_size(chunk_size)
    with _lock:
        module = _actor_module()
        version = _host.installed_version(DISTRIBUTION)
        _check_host(module, version)
        if _openrlhf_forward is None:
            _openrlhf_forward = module.Actor.forward
            _host.note_untested(logger, DISTRIBUTION, version)
        module.Actor.forward = _make_forward(_openrlhf_forward, module, backend, chunk_size)
        logger.info("grpo_kernels.integrations.openrlhf: OpenRLHF %s's Actor.forward computes its log-probs and "
                    "entropy with grpo_kernels.fused_linear_token_logprobs (backend=%r, chunk_size=%r)",
                    version, backend, chunk_size)


def unpatch() -> None:
    """Undo :func:`patch`: ``Actor.forward`` is OpenRLHF's own function again. Harmless when not patched."""
    global _openrlhf_forward
    with _lock:
        if _openrlhf_forward is None:
            return
        import sys

        module = sys.modules.get(ACTOR_MODULE)
        if module is not None:
            module.Actor.forward = _openrlhf_forward
        _openrlhf_forward = None
        logger.info("grpo_kernels.integrations.openrlhf: OpenRLHF's own Actor.forward restored")


def is_patched() -> bool:
    """Whether ``openrlhf.models.Actor.forward`` is ours now (imports nothing)."""
    import sys

    module = sys.modules.get(ACTOR_MODULE)
    actor = getattr(module, "Actor", None)
    return actor is not None and getattr(actor.forward, "__grpo_kernels__", False) is True
