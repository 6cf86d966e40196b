"""The Triton launchers as ``torch.library`` custom ops (namespace ``grpo_kernels``), for torch.compile.

dynamo cannot trace into a Triton launch (Python that reads strides, picks a launch configuration and
calls a JIT kernel), so each launcher is registered as one opaque operator with a fake (meta)
implementation that states only its outputs' shapes and dtypes. dynamo then records one node per
launch, and AOTAutograd / inductor trace the forward and the backward of ``grpo_kernels.autograd``'s
Functions through them without a graph break; at run time the node calls the launcher itself.

- ``torch.ops.grpo_kernels.forward_rows``: ``triton_rows.forward_rows`` -> 4 fp32 [B, T].
- ``torch.ops.grpo_kernels.forward_rows_sampled``: ``triton_rows.forward_rows_sampled`` (top-k / top-p,
  the sum of squared probabilities) -> 6 fp32 [B, T] and an int32 [B, T] (the tie index).
- ``torch.ops.grpo_kernels.grpo_forward_rows``: ``triton_rows.grpo_forward_rows`` -> 8 fp32 [B, T] and
  an int8 [B, T].
- ``torch.ops.grpo_kernels.backward_rows``: writes ``d loss / d logits`` into ``out``
  (``mutates_args=("out",)``) and returns nothing, since an op's output may not alias its input.

The ops take their schemas from the launchers' own signatures and type hints
(``torch.library.infer_schema``; the backward's returns nothing), and their fake implementations read
only the logits' shape: a new scalar parameter of a launcher (an int, float, bool, str or Optional of
one, with a type hint) is part of the op with no change here. Every output is a fresh tensor; nothing
aliases an input.

``log_normalizer`` and ``shift_log_sum`` are plain tensor arithmetic (no kernel), traced as they are.
An op call costs a Python dispatch on top of the launch (benchmarks/results/custom_op_overhead.md),
so ``backends.TritonBackend`` calls the ops only while compiling and the launchers directly otherwise. Importing this module registers the ops (the backend
imports it on its first traced launch; a saved graph that names them needs it imported to load).
"""

from __future__ import annotations

import inspect

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


forward_rows_sampled = torch.library.custom_op(f"{NAMESPACE}::forward_rows_sampled", triton_rows.forward_rows_sampled,
                                              mutates_args=())


@forward_rows_sampled.register_fake
def _forward_rows_sampled_fake(logits, targets, *args, **kwargs):
    return _row_outputs(logits, (torch.float32,) * (triton_rows.SAMPLED_ROWS_OUTPUTS - 1) + (torch.int32,))


grpo_forward_rows = torch.library.custom_op(f"{NAMESPACE}::grpo_forward_rows", triton_rows.grpo_forward_rows,
                                            mutates_args=())


@grpo_forward_rows.register_fake
def _grpo_forward_rows_fake(logits, *args, **kwargs):
    return _row_outputs(logits, (torch.float32,) * triton_rows.GRPO_ROWS_FLOAT_OUTPUTS + (torch.int8,))


def _into_out(launcher):
    """``launcher`` (which writes into its ``out`` argument and returns it) as a function of the same
    signature that returns nothing: an op's output may not alias one of its inputs."""

    def op(*args, **kwargs) -> None:
        launcher(*args, **kwargs)

    op.__signature__ = inspect.signature(launcher, eval_str=True).replace(return_annotation=None)
    op.__name__, op.__qualname__ = launcher.__name__, launcher.__qualname__
    op.__doc__ = f"``triton_rows.{launcher.__name__}`` into ``out`` (which may be ``logits`` itself)."
    return op


backward_rows = torch.library.custom_op(f"{NAMESPACE}::backward_rows", _into_out(triton_rows.backward_rows),
                                        mutates_args=("out",))


@backward_rows.register_fake
def _backward_rows_fake(*args, **kwargs) -> None:
    return None
