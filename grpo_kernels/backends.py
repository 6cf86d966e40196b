"""Backends: the row kernels behind the public functions, behind one explicit interface.

A backend computes, for every row of ``[B, T, V]`` logits, the target's log-prob, the entropy and
the two softmax statistics the backward needs (``forward_rows``), and writes ``d loss / d logits``
from per-row gradients (``backward_rows``). A backend whose ``fuses(options)`` is true also evaluates
that token-level GRPO loss inside the log-prob pass (``grpo_forward_rows``). The autograd Functions in
``grpo_kernels.autograd`` receive the backend object and call nothing else.

To add a backend (another GPU, a CUDA C++ kernel): subclass :class:`RowBackend`, implement its
methods with the same shapes and dtypes, and register an instance in :data:`REGISTRY`.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import ClassVar, Dict, Optional

import torch

from .kernels import torch_replay, torch_rows
from .objective import is_token_local
from .kernels.torch_rows import FrozenHeadRows, RowGradient, RowStats
from .options import LogitTransform


# the functions of a replay kernels module (kernels/torch_replay.py's contract)
REPLAY_FUNCTIONS = ("replay_rows_forward", "replay_rows_backward", "replay_linear_forward", "replay_linear_backward")


def _rows_temperature(t: LogitTransform, logits: torch.Tensor) -> Optional[torch.Tensor]:
    """A per-row temperature tensor as the rows of ``logits [B, T, V]`` ([B, T]), or None for a float."""
    return t.temperature.reshape(logits.shape[:2]) if t.per_row else None


class RowBackend:
    """The interface every backend implements. Per-row outputs are float32 [B, T].

    ``forward_rows(logits [B, T, V], targets [B, T], transform, ignore_index, with_entropy, with_sum_sq)``
        -> ``RowStats(logp, entropy, row_max, log_sum, sum_probs_sq, threshold, tie_index)``
        (``kernels.torch_rows.RowStats``): ``row_max`` and ``log_sum`` are the max of the
        transformed logits ``z`` (``options.LogitTransform``: logit scale, softcap, temperature, a
        float or a tensor with one per row) and ``log sum exp(z - max)`` over the distribution's
        support: the kept set of a truncation (``transform.top_k`` / ``top_p``, vLLM's rule), which
        ``threshold`` / ``tie_index`` describe (None without one), where a target outside it gets
        ``logp = -inf``; ``sum_probs_sq`` when asked. Rows whose target is ``ignore_index`` are never
        read and give 0.
    ``backward_rows(logits, targets, row_max, log_sum, entropy, grad_logp, grad_entropy,
        transform, ignore_index, out, threshold=None, tie_index=None)`` writes ``d loss / d logits``
        into ``out`` (which may be ``logits`` itself) in ``out``'s dtype and returns it; a ``None``
        gradient means zero; with a kept set, the gradient of the truncated distribution (the set a
        constant).
    ``forward_backward_rows(logits [n, V], targets [n], transform, ignore_index, coefficients, factored)``
        -> ``RowGradient(logp, entropy, row_scale, target_grad)``, with ``d loss / d logits`` written
        over ``logits`` (the fused-linear path's gradient in the forward), or in factored form
        (``kernels.torch_rows.forward_backward_rows``); the default composes the two methods above
        and never factors.
    ``transform`` may also be a bare temperature.
    """

    name: ClassVar[str]
    def fuses(self, options) -> bool:
        """Whether ``grpo_forward_rows`` evaluates this configuration's loss in the log-prob pass
        (token-local objectives only); otherwise the shared objective runs after the row kernel."""
        return False

    def check_device(self, device: torch.device) -> None:
        """Raise ValueError (naming ``backend``) when this backend cannot run on ``device``."""

    def forward_rows(self, logits, targets, transform, ignore_index, with_entropy, with_sum_sq=False) -> RowStats:
        raise NotImplementedError

    def backward_rows(self, logits, targets, row_max, log_sum, entropy, grad_logp, grad_entropy,
                      transform, ignore_index, out, threshold=None, tie_index=None) -> torch.Tensor:
        raise NotImplementedError

    def grpo_forward_rows(self, logits, targets, advantages, weights, inputs, options, ignore_index, entropy_coef=None,
                          kl_weights=None, transform=None):
        """Only where ``fuses(options)``: see ``kernels.triton_rows.grpo_forward_rows`` (``entropy_coef``
        overrides the options': the bonus weighted like the policy term, per token, in the kernel;
        ``kl_weights``: the KL's own weights under ``loss_mode``, where they differ from ``weights``;
        ``transform``: the options' with a per-row temperature shaped as the rows, if not theirs)."""
        raise NotImplementedError(f"backend {self.name!r} has no fused GRPO forward")

    def log_normalizer(self, row_max, log_sum, transform) -> torch.Tensor:
        """``log sum_j exp(z_j)`` in nats (float32, the shape of ``row_max``) from ``forward_rows``'
        ``(row_max, log_sum)``; ``grpo_kernels.vocab_parallel`` merges these across shards."""
        return row_max + log_sum

    def shift_log_sum(self, log_sum, shift) -> torch.Tensor:
        """The ``log_sum`` for which ``backward_rows`` (with the same ``row_max``) sees a normaliser
        ``exp(shift)`` times larger (``shift`` in nats): the whole vocabulary's, from one shard's row."""
        return log_sum + shift

    def forward_backward_rows(self, logits, targets, transform, ignore_index, coefficients,
                              factored: bool = False) -> RowGradient:
        """Gradient in the forward (the fused-linear path), on rows the caller owns.

        ``logits [n, V]``, ``targets [n]``: computes ``(logp, entropy)`` float32 [n], asks
        ``coefficients(logp, entropy) -> (d loss/d logp [n], d loss/d entropy [n] or None)`` and writes
        ``d loss / d logits`` over ``logits`` in place. With ``factored`` a backend may instead leave
        ``e'`` there and return ``row_scale`` and ``target_grad`` (see
        ``kernels.torch_rows.forward_backward_rows``). This default is ``forward_rows``, then
        ``backward_rows`` with ``out=logits`` (never factored); ``TorchBackend`` fuses them.
        """
        rows, tgt = logits.unsqueeze(0), targets.unsqueeze(0)
        stats = self.forward_rows(rows, tgt, transform, ignore_index, True)
        g_logp, g_entropy = coefficients(stats.logp[0], stats.entropy[0])
        self.backward_rows(rows, tgt, stats.row_max, stats.log_sum, stats.entropy, g_logp.unsqueeze(0),
                           None if g_entropy is None else g_entropy.unsqueeze(0), transform, ignore_index, rows,
                           stats.threshold, stats.tie_index)
        return RowGradient(stats.logp[0], stats.entropy[0])

    def replay(self) -> ModuleType:
        """The module of this backend's sampling-mask replay kernels (``replay_rows_forward``,
        ``replay_rows_backward``, ``replay_linear_forward``, ``replay_linear_backward``: the contract of
        ``kernels/torch_replay.py``); by default the PyTorch ones, which run on any device."""
        return torch_replay

    def tiles_vocabulary(self, transform) -> bool:
        """Whether :meth:`frozen_head_rows` serves this transform (the fused-linear path of a head
        without a weight gradient then walks the vocabulary in blocks instead of the rows)."""
        return False

    def frozen_head_rows(self, hidden, weight, bias, targets, transform, ignore_index, with_entropy,
                         with_sum_sq=False, hidden_grads=0) -> FrozenHeadRows:
        """Only where :meth:`tiles_vocabulary`: see ``kernels.torch_rows.frozen_head_rows`` (hidden [n, H],
        weight [V, H], bias [V] | None in one compute dtype, targets [n]; ``transform`` of these n rows)."""
        raise NotImplementedError(f"backend {self.name!r} does not tile the vocabulary")

    def __repr__(self) -> str:
        return f"<{self.name} row backend>"


class TorchBackend(RowBackend):
    """Chunked PyTorch: one chunk's fp32 copy at a time (``kernels/torch_rows.py``); any device."""

    name = "torch"

    @staticmethod
    def _temperature(t: LogitTransform, logits: torch.Tensor):
        rows = _rows_temperature(t, logits)
        return t.temperature if rows is None else rows

    def forward_rows(self, logits, targets, transform, ignore_index, with_entropy, with_sum_sq=False) -> RowStats:
        t = LogitTransform.of(transform)
        return torch_rows.forward_rows(logits, targets, self._temperature(t, logits), ignore_index, with_entropy,
                                       softcap=t.softcap, logit_scale=t.logit_scale, top_k=t.top_k_for(logits.shape[-1]),
                                       top_p=t.top_p, with_sum_sq=with_sum_sq)

    def backward_rows(self, logits, targets, row_max, log_sum, entropy, grad_logp, grad_entropy,
                      transform, ignore_index, out, threshold=None, tie_index=None) -> torch.Tensor:
        t = LogitTransform.of(transform)
        return torch_rows.backward_rows(logits, targets, row_max, log_sum, entropy, grad_logp, grad_entropy,
                                        self._temperature(t, logits), ignore_index, out, softcap=t.softcap,
                                        logit_scale=t.logit_scale, threshold=threshold, tie_index=tie_index)

    def log_normalizer(self, row_max, log_sum, transform) -> torch.Tensor:
        t = LogitTransform.of(transform)
        temperature = t.temperature.reshape(row_max.shape) if t.per_row else t.temperature
        return torch_rows.log_normalizer(row_max, log_sum, temperature, t.softcap, t.logit_scale)

    def forward_backward_rows(self, logits, targets, transform, ignore_index, coefficients,
                              factored: bool = False) -> RowGradient:
        t = LogitTransform.of(transform)
        if t.softcap is None and not t.truncates:  # the fused pass; the logit scale folds into the temperature
            temperature = t.temperature.reshape(-1).double() / t.logit_scale if t.per_row else t.temperature / t.logit_scale
            return torch_rows.forward_backward_rows(logits, targets, temperature, ignore_index, coefficients, factored)
        return super().forward_backward_rows(logits, targets, t, ignore_index, coefficients)

    def tiles_vocabulary(self, transform) -> bool:
        return not LogitTransform.of(transform).truncates  # (a truncation needs the whole row's order)

    def frozen_head_rows(self, hidden, weight, bias, targets, transform, ignore_index, with_entropy,
                         with_sum_sq=False, hidden_grads=0) -> FrozenHeadRows:
        t = LogitTransform.of(transform)
        temperature = t.temperature.reshape(-1) if t.per_row else t.temperature
        return torch_rows.frozen_head_rows(hidden, weight, bias, targets, temperature, ignore_index, with_entropy,
                                           with_sum_sq, hidden_grads, softcap=t.softcap, logit_scale=t.logit_scale)


@torch.compiler.assume_constant_result  # fixed for the process once Triton is imported: no guard, no graph break
def triton_interprets() -> bool:
    """Whether Triton kernels run in Triton's CPU interpreter in this process.

    That is fixed when ``@triton.jit`` decorates a function (it reads ``TRITON_INTERPRET`` then), and
    Triton's own library (``triton.language.standard``) is decorated when Triton is first imported:
    if another library imported Triton before the variable was set, our kernels would be interpreted
    but Triton's ``tl.max`` / ``tl.sum`` not, and nothing could run. So ask the decorated objects,
    ours and Triton's, not the variable; before Triton is imported, the variable decides.
    """
    from_variable = os.environ.get("TRITON_INTERPRET", "0") == "1"
    standard = sys.modules.get("triton.language.standard")
    ours = sys.modules.get(__name__.rsplit(".", 1)[0] + ".kernels.triton_rows")
    if standard is None and ours is None:
        return from_variable
    from triton.runtime.interpreter import InterpretedFunction

    decorated = [m for m in (standard and standard.cdiv, ours and ours.token_logprobs_fwd_kernel) if m is not None]
    return all(isinstance(fn, InterpretedFunction) for fn in decorated)


class TritonBackend(RowBackend):
    """Fused Triton kernels (``kernels/triton_rows.py``): CUDA tensors, or CPU tensors in the interpreter."""

    name = "triton"

    def fuses(self, options) -> bool:
        """The token-local objectives (``objective.is_token_local``) whose term the epilogue has: all of
        TRL's and verl's token-local ones (sapo, vanilla, gpg, cispo, dppo_tv, dppo_kl, dro); not under a
        truncation (top-k / top-p), whose tokens outside the kept set leave the loss's normalisers first."""
        return (is_token_local(options) and not options.transform.truncates
                and self._module().fuses_objective(options.loss_type, options.loss_mode))

    @staticmethod
    def _module() -> ModuleType:
        from .kernels import triton_rows  # imported lazily: Triton is heavy to import

        return triton_rows

    @classmethod
    def _launchers(cls) -> ModuleType:
        """The launchers as custom ops while torch.compile traces (one opaque node per launch:
        ``kernels.triton_ops``), else the launchers themselves (no dispatch cost in eager mode)."""
        if torch.compiler.is_compiling():
            from .kernels import triton_ops

            return triton_ops
        return cls._module()

    def check_device(self, device: torch.device) -> None:
        if device.type == "cpu" and not triton_interprets():
            raise ValueError(
                "backend='triton' needs CUDA tensors, or, for CPU tensors, TRITON_INTERPRET=1 set before Triton "
                "is first imported (by any library)"
            )

    @staticmethod
    def _transform_keywords(transform, logits: Optional[torch.Tensor] = None, rows_shape=None) -> dict:
        """The launchers' keywords of a transform: a per-row temperature as ``temperature_rows`` [B, T]
        (the rows of ``logits``, or ``rows_shape``), the float then unused (1.0). Only set keywords are
        passed, so a plain call is the launcher's own default signature."""
        t = LogitTransform.of(transform)
        out = dict(temperature=1.0 if t.per_row else t.temperature, softcap=t.softcap, logit_scale=t.logit_scale)
        if t.per_row:
            out["temperature_rows"] = t.temperature.reshape(logits.shape[:2] if logits is not None else rows_shape)
        return out

    def forward_rows(self, logits, targets, transform, ignore_index, with_entropy, with_sum_sq=False) -> RowStats:
        t = LogitTransform.of(transform)
        keywords = self._transform_keywords(t, logits)
        top_k = t.top_k_for(logits.shape[-1])
        if top_k is None and t.top_p is None and not with_sum_sq:  # the plain row pass
            return RowStats(*self._launchers().forward_rows(logits=logits, targets=targets, ignore_index=ignore_index,
                                                            with_entropy=with_entropy, **keywords))
        truncated = top_k is not None or t.top_p is not None
        sampling = dict(top_k=top_k, top_p=t.top_p)
        for name in ("top_k", "top_p"):  # one per row: the launcher's own tensor keyword, [B, T]
            if isinstance(sampling[name], torch.Tensor):
                sampling[f"{name}_rows"] = sampling.pop(name).reshape(logits.shape[:2])
        out = self._launchers().forward_rows_sampled(logits=logits, targets=targets, ignore_index=ignore_index,
                                                     with_entropy=with_entropy, with_sum_sq=with_sum_sq, **sampling,
                                                     **keywords)
        return RowStats(*out[:4], out[4] if with_sum_sq else None, *(out[5:] if truncated else (None, None)))

    def backward_rows(self, logits, targets, row_max, log_sum, entropy, grad_logp, grad_entropy,
                      transform, ignore_index, out, threshold=None, tie_index=None) -> torch.Tensor:
        kept = {} if threshold is None else dict(threshold=threshold, tie_index=tie_index)
        self._launchers().backward_rows(  # the custom op returns nothing: it mutates ``out``
            logits=logits, targets=targets, row_max=row_max, log_sum=log_sum, entropy=entropy, grad_logp=grad_logp,
            grad_entropy=grad_entropy, ignore_index=ignore_index, out=out,
            **self._transform_keywords(transform, logits), **kept,
        )
        return out

    def replay(self) -> ModuleType:
        """``kernels/triton_replay.py`` where it provides the four replay functions, else the PyTorch ones."""
        try:
            from .kernels import triton_replay
        except ImportError:
            return torch_replay
        if all(callable(getattr(triton_replay, name, None)) for name in REPLAY_FUNCTIONS):
            return triton_replay
        return torch_replay

    def log_normalizer(self, row_max, log_sum, transform) -> torch.Tensor:
        return self._module().log_normalizer(row_max, log_sum, **self._transform_keywords(transform, rows_shape=row_max.shape))

    def shift_log_sum(self, log_sum, shift) -> torch.Tensor:
        return self._module().shift_log_sum(log_sum, shift)

    def grpo_forward_rows(self, logits, targets, advantages, weights, inputs, options, ignore_index, entropy_coef=None,
                          kl_weights=None, transform=None):
        verl = dict(loss_mode=options.loss_mode, kl_loss_type=options.kl_loss_type,
                    dro_beta=0.0 if options.dro_beta is None else options.dro_beta, kl_weights=kl_weights)
        transform = options.transform if transform is None else transform
        return self._launchers().grpo_forward_rows(
            logits=logits, targets=targets, advantages=advantages, weights=weights, old_logps=inputs.old_logps,
            ref_logps=inputs.ref_logps, is_ratio=inputs.is_ratio, **self._transform_keywords(transform, logits),
            ignore_index=ignore_index, eps_low=options.eps_low, eps_high=options.eps_high, delta=options.delta,
            beta=options.beta, entropy_coef=options.entropy_coef if entropy_coef is None else entropy_coef,
            loss_type=options.loss_type,
            use_bias_correction_kl=options.use_bias_correction_kl, sapo_temperature_pos=options.sapo_temperature_pos,
            sapo_temperature_neg=options.sapo_temperature_neg, **(verl if options.is_verl else {}),
        )


REGISTRY: Dict[str, RowBackend] = {backend.name: backend for backend in (TritonBackend(), TorchBackend())}


def resolve(name: str, device: torch.device) -> RowBackend:
    """The backend for a name ("auto", "triton", "torch") and the tensors' device.

    "auto" is Triton for CUDA tensors, and for CPU tensors when Triton runs in its interpreter;
    otherwise the chunked torch path. The same while torch.compile traces (the Triton launches are
    custom ops then: ``kernels.triton_ops``).
    """
    if name == "auto":
        use_triton = device.type == "cuda" or (device.type == "cpu" and triton_interprets())
        name = "triton" if use_triton else "torch"
    backend = REGISTRY.get(name)
    if backend is None:
        raise ValueError(f"backend must be one of {('auto',) + tuple(REGISTRY) + ('reference',)}, got {name!r}")
    backend.check_device(device)
    return backend
