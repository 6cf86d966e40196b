"""The Triton launchers as ``torch.library`` custom ops (namespace ``grpo_kernels``), for torch.compile.

dynamo cannot trace into a Triton launch (Python that reads strides, picks a launch configuration and
calls a JIT kernel), so each launcher is registered as one opaque operator with a fake (meta)
implementation that states only its outputs' shapes and dtypes. dynamo then records one node per
launch, and AOTAutograd / inductor trace the forward and the backward of ``grpo_kernels.autograd``'s
Functions through them without a graph break; at run time the node calls the launcher itself.

- ``torch.ops.grpo_kernels.forward_rows``: ``triton_rows.forward_rows`` -> 4 fp32 [B, T].
- ``torch.ops.grpo_kernels.grpo_forward_rows``: ``triton_rows.grpo_forward_rows`` -> 8 fp32 [B, T] and
  an int8 [B, T].
- ``torch.ops.grpo_kernels.backward_rows``: writes ``d loss / d logits`` into ``out``
  (``mutates_args=("out",)``) and returns nothing, since an op's output may not alias its input.

The two forward ops take their schema from the launchers' own signatures and type hints
(``torch.library.infer_schema``), and their fake implementations read only the logits' shape: a new
scalar parameter of a launcher (an int, float, bool, str or Optional of one, with a type hint) is part
of the op with no change here. Every output is a fresh tensor; nothing aliases an input.

``log_normalizer`` and ``shift_log_sum`` are plain tensor arithmetic (no kernel), traced as they are.
An op call costs a Python dispatch on top of the launch (measured on a CPU: ~0.1-0.2 ms, in
benchmarks/results/custom_op_overhead.md), so ``backends.TritonBackend`` calls the ops only while
compiling and the launchers directly otherwise. Importing this module registers the ops (the backend
imports it on its first traced launch; a saved graph that names them needs it imported to load).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import triton_rows

NAMESPACE = "grpo_kernels"


def _row_outputs(logits: torch.Tensor, dtypes) -> tuple:
    """Fresh [B, T] tensors of ``dtypes`` on the logits' device: the outputs of a row launcher."""
    b, t = logits.shape[0], logits.shape[1]
    return tuple(logits.new_empty((b, t), dtype=dtype) for dtype in dtypes)


forward_rows = torch.library.custom_op(f"{NAMESPACE}::forward_rows", triton_rows.forward_rows, mutates_args=())


@forward_rows.register_fake
def _forward_rows_fake(logits, targets, *args, **kwargs):
    return _row_outputs(logits, (torch.float32,) * 4)


grpo_forward_rows = torch.library.custom_op(f"{NAMESPACE}::grpo_forward_rows", triton_rows.grpo_forward_rows,
                                            mutates_args=())


@grpo_forward_rows.register_fake
def _grpo_forward_rows_fake(logits, *args, **kwargs):
    return _row_outputs(logits, (torch.float32,) * triton_rows.GRPO_ROWS_FLOAT_OUTPUTS + (torch.int8,))


@torch.library.custom_op(f"{NAMESPACE}::backward_rows", mutates_args=("out",))
def backward_rows(
    logits: torch.Tensor,
    targets: torch.Tensor,
    row_max: torch.Tensor,
    log_sum: torch.Tensor,
    entropy: torch.Tensor,
    grad_logp: Optional[torch.Tensor],
    grad_entropy: Optional[torch.Tensor],
    temperature: float,
    ignore_index: int,
    out: torch.Tensor,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
) -> None:
    """``triton_rows.backward_rows`` into ``out`` [B, T, V] (``out`` may be ``logits`` itself)."""
    triton_rows.backward_rows(logits, targets, row_max, log_sum, entropy, grad_logp, grad_entropy, temperature,
                              ignore_index, out, softcap=softcap, logit_scale=logit_scale)


@backward_rows.register_fake
def _backward_rows_fake(*args, **kwargs) -> None:
    return None
