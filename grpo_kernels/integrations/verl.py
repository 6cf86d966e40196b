"""grpo-kernels inside verl's own model forwards: verl 0.9's fused log-prob/entropy kernel, replaced.

    from grpo_kernels.integrations import verl as gk_verl
    gk_verl.patch()        # or nothing at all: the "verl.plugins" entry point calls it (docs/verl.md)

What verl does, and the one thing we replace
--------------------------------------------
With ``actor_rollout_ref.model.use_fused_kernels=True`` and
``actor_rollout_ref.model.fused_kernel_options.impl_backend=triton``, verl 0.9's FSDP engine calls
``verl.models.transformers.monkey_patch.patch_forward_with_backends(model, use_fused_kernels=True,
fused_kernels_backend="triton")``, which makes the model class's ``forward``
``verl.models.transformers.dense_common.forward_with_triton_backend`` (or its ``qwen2_vl`` / ``qwen3_vl``
/ ``qwen3_5`` / ``glm4v`` sibling). That forward runs the backbone and then, importing the name at call
time, ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy(hidden_states, lm_head.weight,
rolled_labels, temperature, "none")`` and returns its ``(log_probs, entropy)``. The Megatron forwards
(``verl/models/mcore/model_forward_fused.py``: ``fused_output_processor`` and the legacy
``_fused_GPTModel_forward``; ``model_forward_1f1b_overlap.py``) hold module-level copies of the same
function, imported at module load, and pass the tensor-parallel group as a sixth argument.

:func:`patch` points every one of those names at :func:`linear_cross_entropy` below (the kernel module's
own, which the HF forwards read at call time and Megatron forwards imported later copy, and every copy a
loaded verl module already holds), which has verl's signature and semantics and runs
``grpo_kernels.fused_linear_token_logprobs`` (``return_entropy=True``, and ``process_group=`` for the
tensor-parallel case): the ``[tokens, vocab]`` logits never exist, the same as in verl's kernel, and
unlike it this runs on any device (Triton on CUDA, the chunked PyTorch path or Triton's interpreter on a
CPU), with any hidden size and uneven vocabulary shards. ``grpo_kernels.integrations.verl_plugin`` (a
``verl.plugins`` entry point) calls :func:`patch` whenever verl is imported; importing this module changes
nothing of verl's.

verl's kernel (``verl/utils/kernel/linear_cross_entropy.py`` ``LinearCrossEntropy``, its Triton code in
``verl/utils/kernel/kernels.py`` ``efficient_entropy_forward`` / ``efficient_entropy_backward``), as
read in 0.9.1, and what we keep of it:

- ``hidden [..., H]`` is flattened to ``[N, H]`` and ``labels`` (any shape with ``N`` elements) to
  ``[N]``, in their own element orders: HF ``[B, L, H]`` with ``[B, L]``, ``[1, nnz, H]`` with
  ``[1, nnz]``, Megatron ``[S, 1, H]`` with ``[1, S]``. ``weight [V_r, H]``.
- With ``z = hidden @ weight.T / temperature`` (fp32: the products of 16-bit operands are kept in fp32,
  never rounded to 16 bits; ``fused_linear_token_logprobs(fp32_logits=True)``), ``log_probs[i] = z[i, labels[i]] -
  logsumexp(z[i])`` and ``entropy[i] = logsumexp(z[i]) - sum_j softmax(z[i])_j z[i, j]``, both fp32.
  ``reduction="none"``: ``log_probs [N]``; ``"sum"``: the 0-d sum of the ``N`` log-probs; ``"mean"``:
  that sum divided by ``N`` (every row, as verl's kernel divides by ``num_tokens``; 0 for ``N = 0``).
  ``entropy`` is ``[N]`` whatever the reduction. (verl's kernel lower-cases ``reduction``; so do we.)
- Gradients flow to ``hidden`` and ``weight`` (each in its own dtype) through both outputs.
- ``dist_process_group``: verl's tensor-parallel group; ``weight`` is this rank's contiguous
  vocabulary shard (rank order), ``labels`` are global ids, every rank gets the same outputs. The
  gradient of ``hidden`` follows verl's backward: ``d hidden = d logits[:, shard] @ weight_shard``, this
  rank's partial sum, not all-reduced (verl's ``efficient_entropy_backward`` has no collective; the
  caller's sequence-parallel gather / tensor-parallel region reduces it). ``d weight`` is this shard's
  slice of the unsharded gradient. (verl passes plain tensors; a DTensor weight sharded over the
  vocabulary, ``Shard(0)`` on a 1-D mesh, is taken as this rank's shard of its mesh's group, as
  ``fused_linear_token_logprobs`` takes it; ranks whose labels or shapes differ are refused.)

Where we are exact and verl's kernel is not (run under Triton's interpreter, and read in its code):
its ``"sum"`` / ``"mean"`` give inf when ``N`` is not a multiple of 16 and read uninitialised memory
under tensor parallelism; a label of -100 gets an undefined log-prob (the kernel never writes that row's
target logit); shards must all have ``V / world`` rows (the kernel offsets ids by ``rank * V_r``); ``H``
must be a multiple of 128. Here:

- **A -100 label** (``IGNORE_INDEX``, the only id outside ``[0, V)`` accepted): log-prob exactly 0 with
  no gradient; its entropy is the row's true entropy (entropy reads no label), with its gradient. It
  counts in ``"mean"``'s ``N``.
- Shards may be uneven (any positive sizes); ``H`` any size; ``hidden`` any strides.

Temperature: a positive number, as verl passes it (verl's kernel asserts a Python float; we take any
real number). A tensor (verl PR #6110's per-token ``temperature_rmpad [N]``, or one per sequence ``[B]``
for ``hidden [B, L, H]``) is handed to ``fused_linear_token_logprobs`` as its per-token ``[..]`` /
per-sequence ``[B]`` temperature, where that function takes tensors (API contract v4).

Bad input raises ``ValueError`` / ``TypeError`` naming the argument as verl names it (``hidden``,
``weight``, ``labels``, ``temperature``, ``reduction``, ``dist_process_group``) before any kernel runs; under
tensor parallelism the ranks first agree (one small all-reduce), so a rank's refusal raises on every
rank instead of hanging a collective.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import threading
from types import ModuleType
from typing import Any, List, Optional, Tuple, Union

import torch

from .. import _validation as V
from .. import vocab_parallel
from ..functional import fused_linear_token_logprobs
from ..options import IGNORE_INDEX, LogitTransform
from . import _host

__all__ = ["linear_cross_entropy", "patch", "unpatch", "is_patched", "REDUCTIONS", "VERL_KERNEL_MODULE",
           "MEGATRON_FORWARD_MODULES"]

logger = logging.getLogger(__name__)

# verl's kernels.get_entropy_reduction_enum_number: the reductions of the log-probs verl knows.
REDUCTIONS = ("none", "sum", "mean")
# Where verl defines its kernel; the HF forwards import the name from here at call time.
VERL_KERNEL_MODULE = "verl.utils.kernel.linear_cross_entropy"
KERNEL_NAME = "linear_cross_entropy"
# Modules that copy the name at import (they need megatron-core).
MEGATRON_FORWARD_MODULES = ("verl.models.mcore.model_forward_fused", "verl.models.mcore.model_forward_1f1b_overlap")
# verl's linear_cross_entropy's parameters, as verl 0.9.1 declares them; patch() refuses another signature.
KERNEL_PARAMETERS = ("hidden", "weight", "labels", "temperature", "reduction", "dist_process_group")


# --------------------------------------------------------------------------------------------------
# verl's kernel, ours
# --------------------------------------------------------------------------------------------------
def _check_reduction(reduction: object) -> str:
    if not isinstance(reduction, str):
        raise TypeError(f"reduction must be a str, one of {REDUCTIONS}, got {type(reduction).__name__} {reduction!r}")
    if reduction.lower() not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS} (verl's), got {reduction!r}")
    return reduction.lower()


def _check_group(dist_process_group: object) -> Optional[Any]:
    """None, or a ProcessGroup of an initialised torch.distributed that holds this rank."""
    if dist_process_group is None:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("dist_process_group was given but torch.distributed is not initialised (init_process_group)")
    if not isinstance(dist_process_group, dist.ProcessGroup):
        raise TypeError(f"dist_process_group must be a torch.distributed.ProcessGroup or None, "
                        f"got {type(dist_process_group).__name__}")
    if dist.get_rank(dist_process_group) < 0:
        raise ValueError("dist_process_group does not contain this rank")
    return dist_process_group


def _check_tensors(hidden: object, weight: object, labels: object) -> torch.Tensor:
    """hidden [..., H] float, weight [V_r, H] float on hidden's device, labels: ``N = hidden.numel() / H``
    int32/int64 ids on hidden's device, any shape. Returns the labels in hidden's leading shape."""
    V.check_linear(hidden, weight, None)
    if weight.shape[0] < 1:  # softmax over no id; under tensor parallelism, a rank without a shard
        raise ValueError(f"weight must hold at least one vocabulary row (this rank's shard with "
                         f"dist_process_group), got shape {list(weight.shape)}")
    if weight.device != hidden.device:
        raise ValueError(f"weight is on {weight.device}, hidden on {hidden.device}: put them on one device")
    labels = V.check_tensor("labels", labels)
    if labels.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"labels must be int32 or int64 token ids, got {labels.dtype}")
    n = hidden.numel() // hidden.shape[-1]
    if labels.numel() != n:
        raise ValueError(f"labels must hold one id per row of hidden: {n} ids (hidden {list(hidden.shape)} is "
                         f"[N, H] flattened), got {labels.numel()} (shape {list(labels.shape)})")
    if labels.device != hidden.device:
        raise ValueError(f"labels is on {labels.device}, hidden on {hidden.device}: put them on one device")
    return labels.reshape(hidden.shape[:-1])


def _checked(hidden, weight, labels, temperature, reduction):
    """Every local check, in verl's argument names: (labels in hidden's leading shape, temperature as
    ``fused_linear_token_logprobs`` takes it, reduction lower-cased)."""
    reduction = _check_reduction(reduction)
    labels = _check_tensors(hidden, weight, labels)
    if isinstance(temperature, torch.Tensor):
        temperature = _per_row_temperature(temperature, hidden)
    else:
        temperature = LogitTransform(temperature=temperature).temperature  # its declared range, named
    return labels, temperature, reduction


def _per_row_temperature(temperature: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """A temperature tensor in the layout ``fused_linear_token_logprobs`` reads against ``hidden``'s
    leading shape: one per token (``N`` values, as verl #6110's flat ``temperature_rmpad``) reshaped to
    that shape, or one per sequence ``[B]`` for ``hidden [B, L, H]`` as it is."""
    leading = hidden.shape[:-1]
    n = hidden.numel() // hidden.shape[-1]
    if temperature.dim() == 1 and len(leading) >= 2 and temperature.shape[0] == leading[0]:
        return temperature
    if temperature.numel() == n and temperature.dim() >= 1:
        return temperature.reshape(leading)
    raise ValueError(f"temperature must be a number, one value per token ({n}, hidden {list(hidden.shape)} "
                     f"flattened) or, for a 3-D hidden, one per sequence [{leading[0]}]; got shape "
                     f"{list(temperature.shape)}")


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: Union[float, torch.Tensor] = 1.0,
    reduction: str = "none",
    dist_process_group: Optional[Any] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """verl 0.9's ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy``, on grpo-kernels.

    hidden [..., H] (fp16/bf16/fp32), weight [V_r, H] (``lm_head.weight``, or this rank's vocabulary
    shard with ``dist_process_group``), labels: ``N = hidden.numel() / H`` int32/int64 ids in
    ``[0, V)`` or -100, any shape. Returns ``(log_probs, entropy)`` float32: ``log_probs [N]`` for
    ``reduction="none"``, 0-d for ``"sum"`` / ``"mean"``; ``entropy [N]``; both of
    ``softmax(hidden @ weight.T / temperature)``, differentiable w.r.t. ``hidden`` and ``weight``. A -100
    label has log-prob 0 (no gradient) and its row's true entropy. With ``dist_process_group``,
    ``d hidden`` is this rank's partial sum (verl's backward). The module docstring has the details.
    """
    group = _check_group(dist_process_group)
    if vocab_parallel.is_dtensor(weight):  # its mesh's group and its local shard
        group, weight, _ = vocab_parallel.resolve_sharded_head(group, weight, None)
    if group is not None and vocab_parallel.world_size(group) > 1:
        # checked on every rank inside the agreement: one rank's refusal raises on all of them
        with vocab_parallel.agreement(group) as agree:
            labels, temperature, reduction = _checked(hidden, weight, labels, temperature, reduction)
            agree.local_size = weight.shape[0]
            agree.declare("hidden's shape", tuple(hidden.shape))
            agree.declare("labels", labels)
            agree.declare("temperature", temperature)
            agree.declare("reduction", reduction)
        vocab_parallel.check_targets_in_vocabulary(labels, agree.shard, IGNORE_INDEX, "labels")
    else:
        group = None
        labels, temperature, reduction = _checked(hidden, weight, labels, temperature, reduction)
        V.check_ids_in_range(labels, weight.shape[0], IGNORE_INDEX, "labels")

    # A -100 row is computed with a stand-in target (id 0) so that its entropy is exact; its log-prob is
    # then replaced by a constant 0, which also stops its gradient.
    ignored = labels == IGNORE_INDEX
    targets = labels.masked_fill(ignored, 0)
    # fp32_logits: verl's kernel keeps each logit's products in fp32 (never rounded to bf16)
    log_probs, entropy = fused_linear_token_logprobs(hidden, weight, targets, temperature=temperature,
                                                     return_entropy=True, process_group=group, fp32_logits=True)
    log_probs = log_probs.masked_fill(ignored, 0.0).reshape(-1)
    entropy = entropy.reshape(-1)
    if reduction == "sum":
        log_probs = log_probs.sum()
    elif reduction == "mean":
        log_probs = log_probs.sum() / max(log_probs.numel(), 1)
    return log_probs, entropy


# --------------------------------------------------------------------------------------------------
# patch / unpatch
# --------------------------------------------------------------------------------------------------
_lock = threading.RLock()
_patching = False  # set while patch() runs: importing verl loads its plugins, ours calls patch() again
_verl_kernel: Optional[Any] = None  # verl's own function, kept while patched


def _verl_modules() -> List[Tuple[str, ModuleType]]:
    return [(name, module) for name, module in list(sys.modules.items())
            if isinstance(module, ModuleType) and (name == "verl" or name.startswith("verl."))]


def _swap(old: Any, new: Any) -> List[str]:
    """Every loaded verl module's attribute that is ``old`` becomes ``new``; their dotted names."""
    swapped = []
    for name, module in _verl_modules():
        for attr, value in list(vars(module).items()):
            if value is old:
                setattr(module, attr, new)
                swapped.append(f"{name}.{attr}")
    return swapped


def _megatron_note() -> str:
    """What becomes of verl's Megatron forwards, which copy the kernel's name when they are imported."""
    loaded = [name for name in MEGATRON_FORWARD_MODULES if name in sys.modules]
    if len(loaded) == len(MEGATRON_FORWARD_MODULES):
        return ""
    if importlib.util.find_spec("megatron") is None:
        logger.debug("grpo_kernels.integrations.verl: megatron-core is not installed, so verl's Megatron forwards "
                     "(%s) cannot import here: nothing of theirs to patch", ", ".join(MEGATRON_FORWARD_MODULES))
        return ""
    return "; verl's Megatron forwards imported from now on copy it"


def patch() -> None:
    """Make every verl forward that calls verl's fused kernel call :func:`linear_cross_entropy`.

    Replaces ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy``, which verl's HF forwards
    import at call time and verl's Megatron forwards (``MEGATRON_FORWARD_MODULES``) copy when they are
    imported (after this, they copy ours), and every copy already held by a loaded verl module. Imports
    no Megatron code (that costs seconds in every verl process, FSDP ones included). Logs one INFO
    record on this module's logger naming what it replaced. Calling it again is harmless. Raises
    ImportError without verl, and ``HostMismatchError`` (changing nothing) when verl's kernel is missing or
    has another signature than :data:`KERNEL_PARAMETERS`; an untested verl that passes is patched with
    one INFO record.
    """
    global _patching, _verl_kernel
    with _lock:
        if _patching:
            return
        _patching = True
        try:
            try:
                kernel_module = importlib.import_module(VERL_KERNEL_MODULE)
            except ImportError as error:
                raise ImportError(f"grpo_kernels.integrations.verl.patch() needs verl >= {_host.MINIMUM['verl']} "
                                  "(pip install 'grpo-kernels[verl]')") from error
            version = _host.installed_version("verl")
            current = getattr(kernel_module, KERNEL_NAME, None)
            _host.require(callable(current), "verl", version, f"{VERL_KERNEL_MODULE} has no {KERNEL_NAME}")
            first = _verl_kernel is None
            _host.require_parameters(current if first else _verl_kernel, KERNEL_PARAMETERS, "verl", version,
                                     f"{VERL_KERNEL_MODULE}.{KERNEL_NAME}")
            if first:
                _verl_kernel = current
                _host.note_untested(logger, "verl", version)
            swapped = _swap(_verl_kernel, linear_cross_entropy)
            if swapped:
                logger.info("grpo_kernels.integrations.verl: verl %s's fused log-prob/entropy kernel is now "
                            "grpo_kernels.integrations.verl.linear_cross_entropy in %s%s", version,
                            ", ".join(swapped), _megatron_note())
        finally:
            _patching = False


def unpatch() -> None:
    """Undo :func:`patch`: every verl module attribute that holds our function holds verl's again
    (including Megatron forwards imported while patched). Harmless when not patched."""
    global _verl_kernel
    with _lock:
        if _verl_kernel is None:
            return
        restored = _swap(linear_cross_entropy, _verl_kernel)
        _verl_kernel = None
        logger.info("grpo_kernels.integrations.verl: verl's own kernel restored in %s", ", ".join(restored) or "-")


def is_patched() -> bool:
    """Whether verl's HF forwards call our kernel now (imports nothing)."""
    module = sys.modules.get(VERL_KERNEL_MODULE)
    return module is not None and getattr(module, KERNEL_NAME, None) is linear_cross_entropy
