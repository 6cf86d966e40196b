"""Benchmark cases, inputs, implementations and the peak-memory measurement.

A :class:`Case` is one (operation, implementation, shape, dtype, pass). :func:`cases` gives the CPU
or the GPU set. :func:`build` makes the inputs once and returns a zero-argument function that runs
the case; the test files time it with pytest-benchmark and record :func:`measure_peak` and the
throughput figures in ``benchmark.extra_info``.

Passes: ``fwd`` runs under ``torch.no_grad()`` with inputs that need no gradient (what a trainer does
for old/reference log-probs); ``fwd+bwd`` makes the inputs require grad and calls
``torch.autograd.grad`` (no ``.grad`` accumulation), so the gradients are part of the peak.

Peak memory is *extra* memory above what existed before the call (inputs excluded, outputs,
gradients and temporaries included), measured in a separate single run: CUDA's
``max_memory_allocated`` on a GPU, the running sum of the PyTorch profiler's allocation events on a
CPU.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import os
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch

from benchmarks.profiling import cpu_peak_extra_bytes, cuda_peak_extra_bytes

OPS = ("token_logprobs", "grpo_loss", "fused_linear_grpo_loss", "fused_linear_token_logprobs")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PASSES = ("fwd", "fwd+bwd")

# Every finished case's extra_info, for the memory checks printed at the end of the session.
RESULTS: List[dict] = []
# Cases that did not run: (case id, reason), reported in the results JSON.
SKIPPED: List[Tuple[str, str]] = []
# Cases whose outputs disagree with the reference's (the message), for the end of the session.
DISAGREED: List[str] = []


class Unavailable(Exception):
    """The implementation cannot run here (not installed, no CUDA, incompatible version, OOM)."""


@dataclass(frozen=True)
class Case:
    op: str
    impl: str
    N: int
    V: int
    dtype: str
    pass_: str
    T: int = 512
    H: Optional[int] = None
    rounds: int = 3
    sweep: bool = False  # part of the fused-linear memory sweep (flat vs growing in N)
    priority: int = 10  # lower runs first (the GPU headline numbers come first)

    @property
    def B(self) -> int:
        return max(1, self.N // self.T)

    @property
    def id(self) -> str:
        h = f"-H{self.H}" if self.H else ""
        return f"{self.op}-{self.pass_}-{self.impl}-N{self.N}-V{self.V}{h}-{self.dtype}"

    @property
    def group(self) -> str:
        h = f" H={self.H}" if self.H else ""
        return f"{self.op} {self.pass_} {self.dtype} V={self.V}{h}"

    def info(self) -> dict:
        return {
            "op": self.op, "impl": self.impl, "N": self.N, "B": self.B, "T": self.T, "V": self.V, "H": self.H,
            "dtype": self.dtype, "pass": self.pass_, "sweep": self.sweep,
        }


# --------------------------------------------------------------------------------------------------
# the two sets
# --------------------------------------------------------------------------------------------------
def liger_available() -> bool:
    try:
        import liger_kernel  # noqa: F401
    except Exception:
        return False
    return True


def trl_available() -> bool:
    try:
        from trl.kernels import ChunkedLogProbFunction  # noqa: F401
    except Exception:
        return False
    return True


def implementations(device: str) -> List[str]:
    """reference and torch everywhere; triton on CUDA only; Liger-Kernel and TRL's fused head when
    installed (on a CPU only for the fused-linear operation: Liger's chunked loss and TRL's head are
    plain PyTorch there, its from-logits kernels are Triton).

    Triton on a CPU runs only in its interpreter, far too slow to time: it is left out there.
    """
    impls = ["reference", "torch"] + (["triton"] if device == "cuda" else []) + ["liger", "trl"]
    only = os.environ.get("GRPO_BENCH_IMPLS")
    if only:
        impls = [i for i in impls if i in only.split(",")]
    # (the peers are imported only when asked for: importing them takes seconds)
    available = {"liger": liger_available, "trl": trl_available}
    return [i for i in impls if i not in available or available[i]()]


def cpu_cases(impls: List[str]) -> List[Case]:
    """Modest shapes that finish in a few minutes on 2 cores, plus the fused-linear memory sweep."""
    out = []
    for op in ("token_logprobs", "grpo_loss"):
        for impl in impls:
            for pass_ in PASSES:
                for n in (256, 512, 1024):
                    out.append(Case(op, impl, n, 32000, "fp32", pass_, T=256, rounds=2))
                out.append(Case(op, impl, 512, 32000, "bf16", pass_, T=256, rounds=2))
    out = [c for c in out if c.impl not in ("liger", "trl")]  # Liger's from-logits kernels are Triton
    for impl in impls:
        # Issue 14's table: fp32 forward+backward at V=32000, N 1k-4k, H 512 and 1024, and V=151936.
        # The H=512 points are also the memory sweep (flat in N for the fused ones, growing for the
        # reference, which materialises the [N, V] logits; stopped at 8192, where it needs GBs).
        for h in (512, 1024):
            for n in (1024, 2048, 4096, 8192, 16384):
                if n > 4096 and (h != 512 or impl in ("liger", "trl") or (impl == "reference" and n > 8192)):
                    continue
                out.append(Case("fused_linear_grpo_loss", impl, n, 32000, "fp32", "fwd+bwd", T=512, H=h,
                                rounds=1 if n > 4096 else 3, sweep=h == 512))
        out.append(Case("fused_linear_grpo_loss", impl, 1024, 151936, "fp32", "fwd+bwd", T=512, H=1024, rounds=2))
        if impl not in ("liger", "trl"):
            for n in (2048, 4096):
                out.append(Case("fused_linear_grpo_loss", impl, n, 32000, "fp32", "fwd", T=512, H=512, rounds=1))
    return out


def gpu_cases(impls: List[str]) -> List[Case]:
    """Real sizes: N up to 32k tokens, V 32k / 128k / 152k, H 4096, bf16. Headline cases first."""
    out = []
    big_v = 151936  # Qwen2/2.5
    for op in ("token_logprobs", "grpo_loss"):
        headline_pass = "fwd" if op == "token_logprobs" else "fwd+bwd"
        for impl in _impls_for(op, impls):
            for pass_ in PASSES:
                if impl == "liger" and op == "token_logprobs" and pass_ == "fwd+bwd":
                    continue  # Liger's selective log-softmax has no backward
                for n, v in ((16384, big_v), (4096, big_v), (8192, big_v), (32768, big_v), (16384, 32000), (16384, 128256)):
                    prio = 0 if (n, v, pass_) == (16384, big_v, headline_pass) else 5 if (n, v) == (16384, big_v) else 10
                    if impl == "torch" and prio:
                        prio += 5  # the CPU path on a GPU: after the kernels
                    out.append(Case(op, impl, n, v, "bf16", pass_, T=1024, rounds=10, priority=prio))
    for impl in _impls_for("fused_linear_grpo_loss", impls):
        for n in (16384, 4096, 8192, 32768):
            out.append(Case("fused_linear_grpo_loss", impl, n, big_v, "bf16", "fwd+bwd", T=1024, H=4096, rounds=5,
                            sweep=True, priority=0 if n == 16384 else 10))
        out.append(Case("fused_linear_grpo_loss", impl, 16384, big_v, "bf16", "fwd", T=1024, H=4096, rounds=5, priority=5))
        for v in (32000, 128256):
            out.append(Case("fused_linear_grpo_loss", impl, 16384, v, "bf16", "fwd+bwd", T=1024, H=4096, rounds=5, priority=10))
    # The fused log-prob head against TRL's (the reference would materialise 10 GB of fp32 logits)
    for impl in _impls_for("fused_linear_token_logprobs", impls):
        if impl == "reference":
            continue
        for pass_ in PASSES:
            out.append(Case("fused_linear_token_logprobs", impl, 16384, big_v, "bf16", pass_, T=1024, H=4096, rounds=5,
                            priority=5 if impl != "torch" else 15))
    return out


def smoke_cases(impls: List[str]) -> List[Case]:
    """Tiny shapes through every code path in seconds (to dry-run gpu_check.sh or the report)."""
    out = []
    for op in ("token_logprobs", "grpo_loss"):
        for impl in _impls_for(op, impls):
            for pass_ in PASSES:
                if (impl == "liger" and op == "token_logprobs" and pass_ == "fwd+bwd") or impl == "trl":
                    continue
                out.append(Case(op, impl, 128, 1024, "fp32", pass_, T=32, rounds=1))
    for impl in _impls_for("fused_linear_grpo_loss", impls):
        for n in (64, 128):
            out.append(Case("fused_linear_grpo_loss", impl, n, 1024, "fp32", "fwd+bwd", T=32, H=64, rounds=1, sweep=True))
    for impl in _impls_for("fused_linear_token_logprobs", impls):
        for pass_ in PASSES:
            out.append(Case("fused_linear_token_logprobs", impl, 128, 1024, "fp32", pass_, T=32, H=64, rounds=1))
    return out


def _impls_for(op: str, impls: List[str]) -> List[str]:
    """The implementations that have ``op``: Liger has no fused log-prob head case here; TRL has only
    its fused head (and the fused-linear loss built on it)."""
    if op == "fused_linear_token_logprobs":
        return [i for i in impls if i != "liger"]
    if op == "fused_linear_grpo_loss":
        return impls
    return [i for i in impls if i != "trl"]


SETS = {"cpu": cpu_cases, "gpu": gpu_cases, "smoke": smoke_cases}


def cases(bench_set: str, device: str) -> List[Case]:
    """The cases of ``bench_set`` ("cpu", "gpu" or "smoke") with the implementations available on
    ``device``; ``ValueError`` naming the set for any other name."""
    if bench_set not in SETS:
        raise ValueError(f"unknown benchmark set {bench_set!r} (GRPO_BENCH_SET / --bench-set): choose from "
                         f"{', '.join(SETS)} or auto")
    return SETS[bench_set](implementations(device))


# --------------------------------------------------------------------------------------------------
# inputs and implementations
# --------------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Runner:
    fn: Callable[[], None]
    device: torch.device
    inputs: dict = field(default_factory=dict)

    def __call__(self) -> dict:
        out = self.fn()
        _sync(self.device)  # the timer must see the device's work, not just the launches
        return out

    def close(self) -> None:
        self.inputs.clear()
        self.fn = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _peer(module: str, name: str):
    """``module.name`` from an optional peer library, or :class:`Unavailable` naming it."""
    try:
        return getattr(importlib.import_module(module), name)
    except Exception as exc:
        raise Unavailable(f"{module}.{name}: {exc}")


def _liger_grpo():
    return _peer("liger_kernel.transformers.grpo_loss", "triton_grpo_loss")


def _liger_selective_log_softmax():
    return _peer("liger_kernel.ops.grpo_loss", "fused_selective_log_softmax")


# The fused-linear cases' GRPO settings (issue 14): dapo, KL with beta 0.04, old log-probs.
FUSED_LINEAR_BETA = 0.04


def _liger_fused_linear(case: Case):
    LigerFusedLinearGRPOLoss = _peer("liger_kernel.chunked_loss", "LigerFusedLinearGRPOLoss")
    compiled = os.environ.get("GRPO_BENCH_LIGER_COMPILED", "0") == "1"
    try:
        return LigerFusedLinearGRPOLoss(beta=FUSED_LINEAR_BETA, compiled=compiled, use_ref_model=True, epsilon_low=0.2,
                                        epsilon_high=0.2, loss_type="dapo", temperature=1.0)
    except TypeError:  # older signatures
        return LigerFusedLinearGRPOLoss(beta=FUSED_LINEAR_BETA, compiled=compiled, use_ref_model=True)


def _trl_fused_head():
    return _peer("trl.kernels", "ChunkedLogProbFunction")


def _trl_logprob_head():
    """(hidden [N, H], weight [V, H], ids [N]) -> (logp [N], entropy [N]) through TRL's
    ``ChunkedLogProbFunction``, whose arguments changed across TRL versions (>= 1.x: a vocabulary
    ``chunk_size``, TRL's trainer default, and the optional outputs to compute)."""
    import inspect

    ChunkedLogProbFunction = _peer("trl.kernels.chunked_logprob", "ChunkedLogProbFunction")
    params = inspect.signature(ChunkedLogProbFunction.forward).parameters
    if "chunk_size" in params:
        try:
            from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE as chunk
        except Exception:
            chunk = 32768

        def head(hidden, weight, ids):
            out = ChunkedLogProbFunction.apply(hidden, weight, None, ids, 1.0, chunk, None, 1.0, ("entropy",))
            return out[0], out[1]
    else:
        def head(hidden, weight, ids):
            out = ChunkedLogProbFunction.apply(hidden, weight, None, ids, 1.0)
            return out[0], out[1]
    return head


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def build(case: Case, device: torch.device) -> Runner:
    """Inputs for ``case`` on ``device`` (made once) and the function that runs it.

    The function returns the case's outputs by name (:data:`OUTPUTS`: the loss or log-probs, and in
    ``fwd+bwd`` the gradients), which :func:`check_agreement` compares with the reference's.

    The GRPO settings are TRL's defaults: on-policy (``old_logps=None``), ``beta=0``, ``eps=0.2``,
    ``loss_type="dapo"``, every token in the mask. From-logits operations read the strided view
    ``model_logits[:, :-1]`` of a ``[B, T+1, V]`` tensor, as a trainer does; Liger-Kernel's
    functions take the whole ``[B, T+1, V]`` tensor (that is their interface).
    """
    import grpo_kernels as gk

    if (case.impl == "triton" or (case.impl == "liger" and case.op != "fused_linear_grpo_loss")) and device.type != "cuda":
        raise Unavailable(f"{case.impl} needs CUDA here (Triton on a CPU only runs in its interpreter)")
    if case.impl == "liger" and not liger_available():
        raise Unavailable("liger_kernel is not installed")
    if case.impl == "trl" and case.op not in ("fused_linear_grpo_loss", "fused_linear_token_logprobs"):
        raise Unavailable("TRL has a fused head only")
    check_fits(case, device)
    dtype = DTYPES[case.dtype]
    grad = case.pass_ == "fwd+bwd"
    B, T, V = case.B, case.T, case.V
    torch.manual_seed(0)
    ids = torch.randint(0, V, (B, T), device=device)
    adv = torch.randn(B, device=device)
    mask = torch.ones(B, T, device=device)
    inputs = {"ids": ids, "adv": adv, "mask": mask}
    backend = case.impl  # "reference", "torch" or "triton"

    if case.op in ("token_logprobs", "grpo_loss"):
        buf = (torch.randn(B, T + 1, V, device=device, dtype=torch.float32) * 2).to(dtype)
        buf.requires_grad_(grad)
        logits = buf[:, :-1]  # a strided view; with grad, autograd.grad stops at it ([B, T, V] gradient)
        inputs.update(buf=buf, logits=logits)
        if case.op == "token_logprobs":
            if case.impl == "liger":
                sel = _liger_selective_log_softmax()

                def run():
                    return {"logp": sel(buf, ids, 1.0)}
            else:
                def run():
                    with torch.set_grad_enabled(grad):
                        logp = gk.token_logprobs(logits, ids, backend=backend)
                        out = {"logp": logp}
                        if grad:
                            out["grad_logits"], = torch.autograd.grad(logp.sum(), [logits])
                        return out
        else:
            if case.impl == "liger":
                liger = _liger_grpo()

                def run():
                    with torch.set_grad_enabled(grad):
                        res = liger(buf, None, None, ids, adv, mask, temperature=1.0, beta=0.0, eps_low=0.2,
                                    eps_high=0.2, inplace=False)
                        loss = _first(res)
                        if loss.dim() > 0:  # older Liger returns per-token losses
                            loss = (loss * mask).sum() / mask.sum()
                        out = {"loss": loss}
                        if grad:
                            out["grad_logits"] = torch.autograd.grad(loss, [buf])[0][:, :-1]  # (its last position: 0)
                        return out
            else:
                def run():
                    with torch.set_grad_enabled(grad):
                        res = gk.grpo_loss(logits, ids, adv, mask, backend=backend)
                        out = {"loss": res.loss, "logp": res.per_token_logps}
                        if grad:
                            out["grad_logits"], = torch.autograd.grad(res.loss, [logits])
                        return out
    elif case.op == "fused_linear_grpo_loss":
        # dapo with beta = 0.04: old and reference log-probs near the current ones, as in training.
        H = case.H
        hidden = torch.randn(B, T, H, device=device, dtype=dtype).requires_grad_(grad)
        weight = (torch.randn(V, H, device=device, dtype=torch.float32) / H**0.5).to(dtype).requires_grad_(grad)
        with torch.no_grad():
            logp = gk.fused_linear_token_logprobs(hidden, weight, ids)
        old = logp + 0.1 * torch.randn_like(logp)
        ref = logp + 0.1 * torch.randn_like(logp)
        inputs.update(hidden=hidden, weight=weight, old=old, ref=ref)

        def finish(loss):
            out = {"loss": loss}
            if grad:
                out["grad_hidden"], out["grad_weight"] = torch.autograd.grad(loss, [hidden, weight])
            return out

        if case.impl == "liger":
            module = _liger_fused_linear(case)

            def run():
                with torch.set_grad_enabled(grad):
                    return finish(_first(module(hidden, weight, ids, mask, adv, ref_per_token_logps=ref, old_per_token_logps=old)))
        elif case.impl == "trl":
            head = _trl_fused_head()
            from grpo_kernels import objective
            from grpo_kernels.options import GRPOInputs, GRPOOptions

            options = GRPOOptions(beta=FUSED_LINEAR_BETA, loss_type="dapo")
            grpo_inputs = GRPOInputs(old_logps=old, ref_logps=ref)

            def run():  # TRL's head for log-probs and entropies, then the O(N) GRPO maths
                with torch.set_grad_enabled(grad):
                    lp, ent = head.apply(hidden.reshape(-1, H), weight, None, ids.reshape(-1), 1.0, 32768, None, 1.0,
                                         ("entropy",))[:2]
                    res = objective.grpo_loss_from_logprobs(lp.view(B, T), ent.view(B, T), adv, mask, grpo_inputs, options)
                    return finish(res.loss)
        else:
            def run():
                with torch.set_grad_enabled(grad):
                    res = gk.fused_linear_grpo_loss(hidden, weight, ids, adv, mask, old_logps=old, ref_logps=ref,
                                                    beta=FUSED_LINEAR_BETA, backend=backend)
                    return finish(res.loss)
    elif case.op == "fused_linear_token_logprobs":
        H = case.H
        hidden = torch.randn(B, T, H, device=device, dtype=dtype).requires_grad_(grad)
        weight = (torch.randn(V, H, device=device, dtype=torch.float32) / H**0.5).to(dtype).requires_grad_(grad)
        inputs.update(hidden=hidden, weight=weight)

        def finish(logp, entropy):
            out = {"logp": logp.reshape(B, T), "entropy": entropy.reshape(B, T)}
            if grad:
                out["grad_hidden"], out["grad_weight"] = torch.autograd.grad(logp.sum() + entropy.sum(), [hidden, weight])
            return out

        if case.impl == "trl":
            trl_head = _trl_logprob_head()

            def run():
                with torch.set_grad_enabled(grad):
                    return finish(*trl_head(hidden.view(-1, H), weight, ids.view(-1)))
        else:
            def run():
                with torch.set_grad_enabled(grad):
                    return finish(*gk.fused_linear_token_logprobs(hidden, weight, ids, return_entropy=True, backend=backend))
    else:
        raise ValueError(f"unknown op {case.op!r}")
    return Runner(run, device, inputs)


# The outputs each operation's runner returns (those of ``fwd+bwd`` add the gradients); a peer's
# runner returns the ones its interface gives (Liger's GRPO loss: no per-token log-probs).
OUTPUTS = {
    "token_logprobs": ("logp", "grad_logits"),
    "grpo_loss": ("loss", "logp", "grad_logits"),
    "fused_linear_grpo_loss": ("loss", "grad_hidden", "grad_weight"),
    "fused_linear_token_logprobs": ("logp", "entropy", "grad_hidden", "grad_weight"),
}


def reference_outputs(case: Case, inputs: dict) -> dict:
    """The case's outputs from ``grpo_kernels.reference`` (plain PyTorch, fp32 ``log_softmax`` over the
    whole vocabulary) on the same inputs, with the same GRPO settings as :func:`build`'s."""
    from grpo_kernels import reference as R

    grad = case.pass_ == "fwd+bwd"
    ids, adv, mask = inputs["ids"], inputs["adv"], inputs["mask"]
    with torch.set_grad_enabled(grad):
        if case.op in ("token_logprobs", "grpo_loss"):
            logits = inputs["buf"].detach().requires_grad_(grad)[:, :-1]
            if case.op == "token_logprobs":
                logp = R.token_logprobs(logits, ids)
                out, target = {"logp": logp}, logp.sum()
            else:
                res = R.grpo_loss(logits, ids, adv, mask)
                out, target = {"loss": res.loss, "logp": res.per_token_logps}, res.loss
            if grad:
                out["grad_logits"], = torch.autograd.grad(target, [logits])
            return out
        hidden = inputs["hidden"].detach().requires_grad_(grad)
        weight = inputs["weight"].detach().requires_grad_(grad)
        if case.op == "fused_linear_grpo_loss":
            loss = R.fused_linear_grpo_loss(hidden, weight, ids, adv, mask, old_logps=inputs["old"], ref_logps=inputs["ref"],
                                            beta=FUSED_LINEAR_BETA).loss
            out, target = {"loss": loss}, loss
        else:
            logp, entropy = R.fused_linear_token_logprobs(hidden, weight, ids, return_entropy=True)
            out, target = {"logp": logp, "entropy": entropy}, logp.sum() + entropy.sum()
        if grad:
            out["grad_hidden"], out["grad_weight"] = torch.autograd.grad(target, [hidden, weight])
        return out


# --------------------------------------------------------------------------------------------------
# will it fit, and does it agree with the reference
# --------------------------------------------------------------------------------------------------
def estimated_bytes(case: Case) -> int:
    """A lower bound on the memory ``case`` needs: its inputs, their gradients in ``fwd+bwd``, and for
    the reference three fp32 ``[N, V]`` buffers (logits, ``log_softmax``, its gradient)."""
    elt = torch.finfo(DTYPES[case.dtype]).bits // 8
    tokens = case.B * case.T
    if case.op in ("token_logprobs", "grpo_loss"):
        inputs = case.B * (case.T + 1) * case.V * elt
    else:
        inputs = (tokens + case.V) * case.H * elt
    grads = inputs if case.pass_ == "fwd+bwd" else 0
    materialised = 3 * tokens * case.V * 4 if case.impl == "reference" else 0
    return inputs + grads + materialised


def available_bytes(device: torch.device) -> Optional[int]:
    """Free memory on ``device``: CUDA's free bytes, or the kernel's MemAvailable on a CPU (None if unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fits(case: Case, device: torch.device) -> None:
    """:class:`Unavailable` when the case cannot fit in the device's free memory (on a CPU the kernel
    would kill the whole pytest run instead of raising an out-of-memory error)."""
    need, free = estimated_bytes(case), available_bytes(device)
    if free is not None and need > free:
        raise Unavailable(f"shape too large for this {device.type}: needs at least {need / 2**30:.1f} GiB, "
                          f"{free / 2**30:.1f} GiB free")


# (rtol, atol) of one rounding to the dtype at O(1) magnitudes; atol is scaled by each output's largest
# magnitude (tests/conftest.py's TOLERANCES, the same figures).
TOLERANCES = {"fp32": (1e-5, 1e-5), "fp16": (2e-3, 2e-3), "bf16": (1.6e-2, 1.6e-2)}
# The largest [N, V] a check materialises (the reference's fp32 logits): larger cases are checked on
# their first rows (same V, H, dtype, pass and implementation), so a check costs seconds, not minutes.
CHECK_ELEMENTS = {"cpu": 2**24, "cuda": 2**28}


def check_case(case: Case, device: torch.device) -> Case:
    """``case`` cut to at most ``CHECK_ELEMENTS`` logits (whole rows of ``T`` tokens, T shortened if need be)."""
    cap = max(64, CHECK_ELEMENTS.get(device.type, 2**24) // case.V)
    n = min(case.B * case.T, cap)
    T = min(case.T, n)
    return dataclasses.replace(case, N=(n // T) * T, T=T, rounds=1)


def compare(actual: dict, expected: dict, dtype: str) -> dict:
    """Per output: the largest error and its bound ``rtol * |e| + atol * max|e|``; NaN or inf where
    the reference is finite always fails."""
    rtol, atol = TOLERANCES[dtype]
    report = {}
    for name, e in expected.items():
        if name not in actual:
            continue
        a = actual[name].detach().double().cpu().reshape(e.shape)
        e = e.detach().double().cpu()
        scale = float(e.abs().max()) if e.numel() else 0.0
        err = (a - e).abs()
        bound = rtol * e.abs() + atol * scale
        finite = bool(torch.isfinite(a).all()) or not bool(torch.isfinite(e).all())
        worst = float((err / bound.clamp(min=1e-300)).max()) if e.numel() else 0.0
        report[name] = {"max_abs_err": float(err.max()) if e.numel() else 0.0, "scale": scale,
                        "err_over_bound": worst, "ok": finite and bool((err <= bound).all())}
    return report


def check_agreement(case: Case, device: torch.device) -> dict:
    """Run ``case`` (cut by :func:`check_case`) and the reference on the same inputs and compare every
    output the implementation returns. Returns ``{"checked": {N, T}, "rtol", "atol", "outputs", "ok"}``."""
    small = check_case(case, device)
    runner = build(small, device)
    try:
        actual = runner()
        expected = reference_outputs(small, runner.inputs)
        outputs = compare(actual, expected, case.dtype)
    finally:
        runner.inputs.clear()  # (no gc pass: small tensors, freed by reference counting)
    rtol, atol = TOLERANCES[case.dtype]
    return {"checked": {"N": small.N, "T": small.T}, "rtol": rtol, "atol": atol, "outputs": outputs,
            "ok": bool(outputs) and all(o["ok"] for o in outputs.values())}


def format_agreement(case: Case, result: dict) -> str:
    bad = {k: v for k, v in result["outputs"].items() if not v["ok"]}
    parts = [f"{k}: max |err| {v['max_abs_err']:.3e} = {v['err_over_bound']:.2f}x the bound (scale {v['scale']:.3e})"
             for k, v in (bad or result["outputs"]).items()]
    return (f"{case.id} vs grpo_kernels.reference at N={result['checked']['N']} (rtol {result['rtol']}, atol "
            f"{result['atol']} x max|ref|): " + "; ".join(parts or ["no output to compare"]))


# --------------------------------------------------------------------------------------------------
# peak memory
# --------------------------------------------------------------------------------------------------
def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, getattr(torch.cuda, "OutOfMemoryError", ())) or "out of memory" in str(exc).lower()


def measure_peak(runner: Runner) -> Tuple[int, str]:
    """(peak extra bytes, method) of one call of ``runner``, outside any timing loop."""
    try:
        if runner.device.type == "cuda":
            return cuda_peak_extra_bytes(runner, runner.device), "torch.cuda.max_memory_allocated"
        return cpu_peak_extra_bytes(runner)
    except Exception as exc:
        if _is_oom(exc):
            raise Unavailable(f"out of memory: {str(exc).splitlines()[0][:160]}") from None
        raise


# --------------------------------------------------------------------------------------------------
# throughput
# --------------------------------------------------------------------------------------------------
def floors(case: Case) -> dict:
    """The work a case must do: bytes over the logits for the from-logits operations (one read
    forward; two reads and one write forward+backward), flops for the fused-linear one."""
    elt = torch.finfo(DTYPES[case.dtype]).bits // 8
    if case.op in ("token_logprobs", "grpo_loss"):
        reads_writes = 1 if case.pass_ == "fwd" else 3
        return {"bytes_floor": reads_writes * case.N * case.V * elt}
    nhv = case.N * case.H * case.V
    useful = 2 * nhv if case.pass_ == "fwd" else 6 * nhv
    # Token-level losses: ours forms the gradient in the forward, 3 matmuls of 2*N*H*V flops each;
    # TRL's head, and our log-prob head (fused_linear_token_logprobs), recompute the logits in the backward (4).
    recompute = case.impl == "trl" or (case.op == "fused_linear_token_logprobs" and case.impl in ("torch", "triton"))
    executed = 2 * nhv if case.pass_ == "fwd" else (8 * nhv if recompute else 6 * nhv)
    return {"useful_flops": useful, "flops": executed}


def throughput(case: Case, median_s: float, copy_gbps: Optional[float], matmul_tflops: Optional[float]) -> dict:
    out = floors(case)
    if not median_s or median_s <= 0:
        return out
    if "bytes_floor" in out:
        out["gbps"] = out["bytes_floor"] / median_s / 1e9
        if copy_gbps:
            out["copy_gbps"] = copy_gbps
            out["bw_fraction"] = out["gbps"] / copy_gbps
    else:
        out["tflops"] = out["flops"] / median_s / 1e12
        out["useful_tflops"] = out["useful_flops"] / median_s / 1e12
        if matmul_tflops:
            out["matmul_tflops"] = matmul_tflops
            out["matmul_fraction"] = out["tflops"] / matmul_tflops
    return out


# --------------------------------------------------------------------------------------------------
# memory checks (fused linear: flat in N for ours, growing for the reference)
# --------------------------------------------------------------------------------------------------
def memory_checks(results: List[dict]) -> List[dict]:
    """Per (impl, dtype, V, H) sweep: peak at each N, the ratio to the reference at the same N,
    and the growth per doubling of N against the bytes of ``hidden`` and its gradient.

    The targets (from the fused-linear issue): ours at most 1/8 of the reference's peak at the
    largest N both ran, and doubling N adds no more than ``N * H * elt * 2`` bytes.
    """
    sweeps = {}
    for r in results:
        if r.get("op") != "fused_linear_grpo_loss" or r.get("pass") != "fwd+bwd" or not r.get("sweep"):
            continue
        if r.get("peak_mem_bytes") is None:
            continue
        key = (r["dtype"], r["V"], r["H"])
        sweeps.setdefault(key, {}).setdefault(r["impl"], {})[r["N"]] = r["peak_mem_bytes"]
    checks = []
    for (dtype, v, h), by_impl in sorted(sweeps.items()):
        ref = by_impl.get("reference", {})
        elt = torch.finfo(DTYPES[dtype]).bits // 8
        for impl, peaks in sorted(by_impl.items()):
            if impl == "reference":
                continue
            ns = sorted(peaks)
            points = []
            for n in ns:
                p = {"N": n, "peak_bytes": peaks[n], "reference_peak_bytes": ref.get(n)}
                if ref.get(n):
                    p["ratio_to_reference"] = peaks[n] / ref[n]
                points.append(p)
            growth = []
            for a, b in zip(ns, ns[1:]):
                allowed = (b - a) * h * elt * 2  # hidden rows + their gradient rows
                growth.append({"from_N": a, "to_N": b, "delta_bytes": peaks[b] - peaks[a], "allowed_bytes": allowed,
                               "ok": peaks[b] - peaks[a] <= allowed})
            common = [n for n in ns if ref.get(n)]
            ratio_check = None
            if common:
                n = max(common)
                ratio = peaks[n] / ref[n]
                ratio_check = {"N": n, "ratio": ratio, "target": 1 / 8, "ok": ratio <= 1 / 8}
            checks.append({"impl": impl, "dtype": dtype, "V": v, "H": h, "points": points, "growth": growth,
                           "ratio_check": ratio_check,
                           "ok": all(g["ok"] for g in growth) and (ratio_check is None or ratio_check["ok"])})
    return checks


def format_checks(checks: List[dict]) -> str:
    mib = 2**20
    lines = []
    for c in checks:
        lines.append(f"fused_linear_grpo_loss fwd+bwd peak extra memory, impl={c['impl']} vs reference, "
                     f"{c['dtype']} V={c['V']} H={c['H']}:")
        for p in c["points"]:
            ref = p["reference_peak_bytes"]
            ref_s = f"{ref / mib:9.1f} MiB" if ref else "      (not run)"
            ratio = f"  ratio {p['ratio_to_reference']:.4f} (1/{1 / p['ratio_to_reference']:.1f})" if p.get("ratio_to_reference") else ""
            lines.append(f"  N={p['N']:6d}  ours {p['peak_bytes'] / mib:9.1f} MiB   reference {ref_s}{ratio}")
        rc = c["ratio_check"]
        if rc:
            lines.append(f"  CHECK ours <= 1/8 of reference at N={rc['N']}: ratio {rc['ratio']:.4f} -> "
                         f"{'PASS' if rc['ok'] else 'FAIL'}")
        for g in c["growth"]:
            lines.append(f"  CHECK N {g['from_N']} -> {g['to_N']}: peak +{g['delta_bytes'] / mib:.1f} MiB <= hidden+grad "
                         f"{g['allowed_bytes'] / mib:.1f} MiB -> {'PASS' if g['ok'] else 'FAIL'}")
    return "\n".join(lines)
