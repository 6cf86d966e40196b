"""The kernel benchmarks: cases, implementations, agreement with the reference (benchmarks/README.md).

Commands: ``compare`` (side by side), ``report RESULTS.json`` (markdown + PNGs).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import sys
import types
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from benchmarks import harness as H
from grpo.memory import status_kib

LOGITS_OPS = ("token_logprobs", "grpo_loss")
LINEAR_OPS = ("fused_linear_grpo_loss", "fused_linear_token_logprobs")
OPS = LOGITS_OPS + LINEAR_OPS
PASSES = ("fwd", "fwd+bwd")
BETA = 0.04  # the fused-linear loss cases' GRPO settings (issue 14): dapo, KL with beta 0.04, old log-probs
# impl: (the operations it has, those that need CUDA, the module it needs)
IMPLS = {
    "reference": (OPS, (), None), "torch": (OPS, (), None), "triton": (OPS, OPS, "triton"),
    "triton-ops": (OPS, OPS, "triton"),  # ours' Triton launches through their torch.library custom ops (issue 27)
    "liger": (LOGITS_OPS + ("fused_linear_grpo_loss",), LOGITS_OPS, "liger_kernel"),
    "trl": (LINEAR_OPS, (), "trl"),
    "quack": (("token_logprobs",), ("token_logprobs",), "quack"),
    "cce": (("fused_linear_token_logprobs",), ("fused_linear_token_logprobs",), "cut_cross_entropy"),
    "verl": (("fused_linear_token_logprobs",), ("fused_linear_token_logprobs",), "verl"),
}
OURS = ("reference", "torch", "triton", "triton-ops")
# (rtol, atol) of one rounding at O(1) magnitudes; atol is scaled by each output's largest magnitude.
TOLERANCES = {"fp32": (1e-5, 1e-5), "fp16": (2e-3, 2e-3), "bf16": (1.6e-2, 1.6e-2)}
# The largest [N, V] an agreement check materialises: larger cases are checked on their first rows.
CHECK_ELEMENTS = {"cpu": 2**24, "cuda": 2**28}
# The sampler's truncations (issue 34) timed against plain log-probs: token_logprobs forward only.
SAMPLINGS = {"top_k=50": dict(top_k=50), "top_p=0.9": dict(top_p=0.9), "top_k=20,top_p=0.9": dict(top_k=20, top_p=0.9)}


class Unavailable(Exception):
    """The case cannot run here (not installed, no CUDA, too large, out of memory)."""


class Disagrees(Exception):
    """The outputs differ from the reference's beyond the dtype's tolerance."""


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
    priority: int = 10  # lower runs first (the headline numbers come first)
    chunk: Optional[int] = None  # ours' chunk_size (None: its default)
    sampling: Optional[str] = None  # a key of SAMPLINGS (token_logprobs)
    frozen: bool = False  # fused linear: the weight (lm_head) without a gradient, as under LoRA

    @property
    def B(self) -> int:
        return max(1, self.N // self.T)

    @property
    def id(self) -> str:
        return (f"{self.op}-{self.pass_}-{self.impl}" + (f"@{self.chunk}" if self.chunk else "") + f"-N{self.N}-V{self.V}"
                + (f"-H{self.H}" if self.H else "") + f"-{self.dtype}" + (f"-{self.sampling}" if self.sampling else "")
                + "-frozen" * self.frozen)

    @property
    def group(self) -> str:
        return f"{self.op} {self.pass_} {self.dtype} V={self.V}" + (f" H={self.H}" if self.H else "")

    @property
    def cost(self) -> float:
        """Its work in flops or their equivalent (200 a logit a pass): the progress line's ETA."""
        passes = 3 if self.pass_ == "fwd+bwd" else 1
        return self.N * self.V * (2 * (self.H or 0) + 200) * passes * (self.rounds + 2)

    def info(self) -> dict:
        return {**dataclasses.asdict(self), "pass": self.pass_, "B": self.B}


def comparison(case: Case) -> tuple:
    """The shape a case measures: the cases with one value of it are one comparison (its sides)."""
    return (case.op, case.pass_, case.N, case.V, case.H, case.T, case.dtype, case.sampling, case.frozen, case.chunk)


def side_rank(case: Case) -> tuple:
    """Within a comparison: ours (torch, triton) and the peers by the case's priority, the reference
    implementation (the slowest: full fp32 logits) last."""
    return (case.impl == "reference", case.priority, case.impl not in OURS, case.impl)


def run_order(cases: List[Case]) -> List[Case]:
    """``make bench``'s order: whole comparisons, one after another (each shape's sides together, so a
    time budget cut between comparisons leaves each run one complete), by their best priority, then
    cheapest first (the summed cost of their cases); inside one, :func:`side_rank`."""
    groups: dict = {}
    for case in cases:
        groups.setdefault(comparison(case), []).append(case)
    ranked = sorted(groups.values(), key=lambda g: (min(c.priority for c in g), sum(c.cost for c in g),
                                                    repr(comparison(g[0]))))
    return [case for group in ranked for case in sorted(group, key=side_rank)]


def unavailable(impl: str, op: str, device: str, installed: bool = True) -> Optional[str]:
    """Why ``impl`` cannot run ``op`` on ``device`` (None if it can); ``installed=False``: its package aside."""
    ops, cuda_ops, module = IMPLS[impl]
    if op not in ops:
        return f"{impl} has no {op}"
    if op in cuda_ops and device != "cuda":
        return f"{impl}'s {op} needs CUDA (GPU kernels; Triton's CPU interpreter is far too slow to time)"
    return H.missing(module) if module and installed else None


def implementations(device: str) -> List[str]:
    """Every implementation whose package is here (``GRPO_BENCH_IMPLS=a,b`` narrows them; ``triton-ops`` only
    where named: the sets time it in one case)."""
    only = os.environ.get("GRPO_BENCH_IMPLS", "").split(",")
    return [i for i in IMPLS if (i in only or only == [""] and i != "triton-ops") and not (IMPLS[i][2] and H.missing(IMPLS[i][2]))]


# -- the sets ------------------------------------------------------------------------------------------
def _cases(impls: List[str], device: str, op: str, shapes, passes=PASSES, dtype="fp32", **kw) -> List[Case]:
    """One case per (implementation that has ``op`` here, pass, (N, V, H) shape)."""
    return [Case(op, impl, n, v, dtype, p, H=h, **kw) for impl in impls for p in passes for n, v, h in shapes
            if not unavailable(impl, op, device, installed=False) and not (impl == "liger" and op == "token_logprobs" and p == "fwd+bwd")]


def cpu_cases(impls: List[str], device: str = "cpu") -> List[Case]:
    """The set sized for 2 CPU cores (benchmarks/README.md: Sets)."""
    some = lambda *names: [i for i in impls if i in names]  # noqa: E731
    sweep = [(n, 32000, 512) for n in (1024, 2048, 4096)]
    out = _cases(some("reference", "torch"), device, "fused_linear_grpo_loss", sweep, ("fwd+bwd",), rounds=2, sweep=True, priority=0)
    out += _cases(some("liger", "trl"), device, "fused_linear_grpo_loss", sweep[:2], ("fwd+bwd",), rounds=2, sweep=True, priority=1)
    out += _cases(some("reference", "torch", "liger"), device, "fused_linear_grpo_loss", [(1024, 151936, 1024)], ("fwd+bwd",), rounds=1)
    out += _cases(some("reference", "torch"), device, "fused_linear_grpo_loss", [(2048, 32000, 512)], ("fwd",), rounds=2)
    for op in LOGITS_OPS:
        out += _cases(impls, device, op, [(256, 32000, None), (1024, 32000, None)], T=256, rounds=2, priority=2)
        out += _cases(impls, device, op, [(512, 32000, None)], dtype="bf16", T=256, rounds=2)
    out += _cases(some("torch", "trl"), device, "fused_linear_token_logprobs", [(1024, 32000, 512)], ("fwd+bwd",), rounds=2)
    return out


def gpu_cases(impls: List[str], device: str = "cuda") -> List[Case]:
    """Real sizes, bf16, T = 1024: the headline cases first, then every peer at that shape, then the rest."""
    big, head = 151936, {("token_logprobs", "fwd"), ("grpo_loss", "fwd+bwd"), ("fused_linear_grpo_loss", "fwd+bwd")}
    sizes = [(16384, big), (4096, big), (8192, big), (32768, big), (16384, 32000), (16384, 128256)]

    def ranked(cases: List[Case]) -> List[Case]:
        """0: a headline case; 3: another at the headline shape; 10: the rest; torch's 5 later than its peers'."""
        def priority(c: Case) -> int:
            at_head = (c.N, c.V) == (16384, big)
            p = 0 if at_head and (c.op, c.pass_) in head else 3 if at_head else 10
            return p + (5 if c.impl == "torch" and p else 0)
        return [dataclasses.replace(c, priority=priority(c)) for c in cases]

    logits = [c for op in LOGITS_OPS for n, v in sizes for c in _cases(impls, device, op, [(n, v, None)], dtype="bf16", T=1024, rounds=10)]
    linear = []
    for n, v, p in [(n, v, "fwd+bwd") for n, v in sizes[:4]] + [(16384, big, "fwd")] + [(n, v, "fwd+bwd") for n, v in sizes[4:]]:
        linear += _cases(impls, device, "fused_linear_grpo_loss", [(n, v, 4096)], (p,), dtype="bf16", T=1024, rounds=5,
                         sweep=p == "fwd+bwd" and v == big)
    for v in (big, 32000):  # the fused log-prob head: ours, TRL's, Cut Cross-Entropy, verl
        linear += _cases([i for i in impls if i != "reference"], device, "fused_linear_token_logprobs", [(16384, v, 4096)],
                         dtype="bf16", T=1024, rounds=5)
    extra = [Case("token_logprobs", "triton", 16384, big, "bf16", "fwd", T=1024, rounds=10, priority=3, sampling=s)
             for s in SAMPLINGS if "triton" in impls]
    extra += [Case("grpo_loss", "triton-ops", n, big, "bf16", "fwd+bwd", T=1024, rounds=10, priority=3)
              for n in (1024, 16384) if "triton" in impls]  # the custom ops' dispatch, small and headline N
    return ranked(logits) + extra + ranked(linear)


def smoke_cases(impls: List[str], device: str = "cpu") -> List[Case]:
    """Tiny shapes through every code path in seconds (CI's dry run of gpu_check.sh)."""
    out = []
    for op in LOGITS_OPS:
        out += _cases(impls, device, op, [(128, 1024, None)], T=32, rounds=1)
    out += _cases(impls, device, "token_logprobs", [(128, 1024, None)], ("fwd",), T=32, rounds=1, sampling="top_k=20,top_p=0.9")
    out += _cases(impls, device, "fused_linear_grpo_loss", [(64, 1024, 64), (128, 1024, 64)], ("fwd+bwd",), T=32, rounds=1,
                  sweep=True)
    out += _cases(impls, device, "fused_linear_token_logprobs", [(128, 1024, 64)], T=32, rounds=1)
    return [c for c in out if not c.sampling or c.impl in OURS]


SETS = {"cpu": cpu_cases, "gpu": gpu_cases, "smoke": smoke_cases}


def cases(bench_set: str, device: str) -> List[Case]:
    """The cases of ``bench_set`` with the implementations here; ``ValueError`` naming the sets otherwise."""
    if bench_set not in SETS:
        raise ValueError(f"unknown benchmark set {bench_set!r} (GRPO_BENCH_SET / --bench-set): choose from "
                         f"{', '.join(SETS)} or auto")
    return SETS[bench_set](implementations(device), device)


def skipped_peers(op: str, device: str) -> Dict[str, str]:
    """{impl: why it has no case} for the implementations that have ``op`` but cannot run it here."""
    return {i: r for i in IMPLS if op in IMPLS[i][0] and (r := unavailable(i, op, device))}


# -- inputs and implementations ------------------------------------------------------------------------
def inputs(case: Case, device: torch.device, seed: int = 0) -> dict:
    """A case's inputs: ``buf`` [B, T+1, V] and its view ``logits`` or ``hidden``/``weight`` (README: Cases)."""
    g = torch.Generator(device).manual_seed(seed)
    dtype, grad, (B, T, V) = H.DTYPES[case.dtype], case.pass_ == "fwd+bwd", (case.B, case.T, case.V)
    rand = lambda *shape: torch.randn(*shape, generator=g, device=device)  # noqa: E731
    x = {"ids": torch.randint(0, V, (B, T), generator=g, device=device), "adv": rand(B), "mask": torch.ones(B, T, device=device)}
    if case.op in LOGITS_OPS:
        x["buf"] = (rand(B, T + 1, V) * 2).to(dtype)
        if case.sampling:  # a token the truncation keeps (any other's log-prob is -inf)
            x["ids"] = x["buf"][:, :-1].argmax(-1)
    else:
        x["hidden"], x["weight"] = rand(B, T, case.H).to(dtype), (rand(V, case.H) / case.H**0.5).to(dtype)
    if case.op == "fused_linear_grpo_loss":
        import grpo_kernels as gk

        with torch.no_grad():
            logp = gk.fused_linear_token_logprobs(x["hidden"], x["weight"], x["ids"])
        x["old"], x["ref"] = logp + 0.1 * rand(*logp.shape), logp + 0.1 * rand(*logp.shape)
    for k in ("buf", "hidden", "weight"):
        if k in x:
            x[k].requires_grad_(grad and not (k == "weight" and case.frozen))
    if "buf" in x:
        x["logits"] = x["buf"][:, :-1]
    return x


def _grads(case: Case, x: dict, out: dict, wrt: Optional[torch.Tensor] = None, to_logits=lambda g: g) -> dict:
    """``out`` with, in ``fwd+bwd``, the gradients of the loss or of the sum of the outputs (README: Cases)."""
    if case.pass_ == "fwd+bwd":
        target = out["loss"] if "loss" in out else sum(out[k].float().sum() for k in ("logp", "entropy") if k in out)
        if case.op in LOGITS_OPS:
            out["grad_logits"] = to_logits(torch.autograd.grad(target, [x["logits"] if wrt is None else wrt])[0])
        else:
            wrt = [x["hidden"]] + [x["weight"]] * (not case.frozen)
            out.update(zip(("grad_hidden", "grad_weight"), torch.autograd.grad(target, wrt)))
    return out


def _peer(module: str, name: str, bare: bool = False):
    """``module.name`` from a peer, or :class:`Unavailable`; ``bare``: without its packages' ``__init__``."""
    try:
        parts = module.split(".")
        for i in range(1, len(parts) if bare else 1):
            name_i = ".".join(parts[:i])
            if name_i not in sys.modules:
                spec = importlib.util.find_spec(name_i)
                sys.modules[name_i] = package = types.ModuleType(name_i)
                package.__path__, package.__spec__ = list(spec.submodule_search_locations), spec
        return getattr(importlib.import_module(module), name)
    except Exception as exc:
        raise Unavailable(f"{module}.{name}: {type(exc).__name__}: {exc}") from None


def _ours(case: Case, x: dict, gk=None) -> Callable[[], dict]:
    """``grpo_kernels`` (or ``gk``: ``grpo_kernels.reference``) with ``backend=case.impl`` and ``case.chunk``."""
    if gk is None:
        import grpo_kernels as gk
    back = {} if gk.__name__.endswith("reference") else {"backend": case.impl}
    kw = {**back, **({"chunk_size": case.chunk} if case.chunk and back else {})}
    pick = lambda names, out: dict(zip(names, out if isinstance(out, tuple) else (out,)))  # noqa: E731
    return {
        "token_logprobs": lambda: pick(("logp",), gk.token_logprobs(x["logits"], x["ids"], **SAMPLINGS.get(case.sampling, {}), **back)),
        "grpo_loss": lambda: pick(("loss", "logp"), tuple(gk.grpo_loss(x["logits"], x["ids"], x["adv"], x["mask"], **back)[:2])),
        "fused_linear_grpo_loss": lambda: {"loss": gk.fused_linear_grpo_loss(
            x["hidden"], x["weight"], x["ids"], x["adv"], x["mask"], old_logps=x["old"], ref_logps=x["ref"], beta=BETA, **kw).loss},
        "fused_linear_token_logprobs": lambda: pick(("logp", "entropy"), gk.fused_linear_token_logprobs(
            x["hidden"], x["weight"], x["ids"], return_entropy=True, **kw)),
    }[case.op]


@contextlib.contextmanager
def _through_custom_ops(case: Case):
    """For ``triton-ops``: every Triton launch through ``torch.ops.grpo_kernels.*``, as while torch.compile traces
    (the dispatch's cost beside ``triton``, which calls the launchers directly in eager mode: issue 27)."""
    if case.impl != "triton-ops":
        yield
        return
    from grpo_kernels import backends
    from grpo_kernels.kernels import triton_ops

    launchers = backends.TritonBackend.__dict__["_launchers"]
    backends.TritonBackend._launchers = classmethod(lambda cls: triton_ops)
    try:
        yield
    finally:
        backends.TritonBackend._launchers = launchers


def _liger(case: Case, x: dict) -> Callable[[], dict]:
    """Liger-Kernel's from-logits ops (the whole buffer) and ``LigerFusedLinearGRPOLoss`` (README)."""
    if case.op == "token_logprobs":
        sel = _peer("liger_kernel.ops.grpo_loss", "fused_selective_log_softmax")
        return lambda: {"logp": sel(x["buf"], x["ids"], 1.0)}
    first = lambda out: out[0] if isinstance(out, (tuple, list)) else out  # noqa: E731
    if case.op == "grpo_loss":
        fn = _peer("liger_kernel.transformers.grpo_loss", "triton_grpo_loss")

        def run():
            loss = first(fn(x["buf"], None, None, x["ids"], x["adv"], x["mask"], temperature=1.0, beta=0.0, eps_low=0.2,
                            eps_high=0.2, inplace=False))
            loss = (loss * x["mask"]).sum() / x["mask"].sum() if loss.dim() else loss  # older Liger: per-token losses
            return {"loss": loss, "_wrt": (x["buf"], lambda g: g[:, :-1])}
        return run
    module = _peer("liger_kernel.chunked_loss", "LigerFusedLinearGRPOLoss")(
        beta=BETA, compiled=os.environ.get("GRPO_BENCH_LIGER_COMPILED") == "1", use_ref_model=True, epsilon_low=0.2,
        epsilon_high=0.2, loss_type="dapo", temperature=1.0)
    return lambda: {"loss": first(module(x["hidden"], x["weight"], x["ids"], x["mask"], x["adv"], ref_per_token_logps=x["ref"],
                                         old_per_token_logps=x["old"]))}


def _trl(case: Case, x: dict) -> Callable[[], dict]:
    """TRL's fused head ``ChunkedLogProbFunction``; for the loss, then the O(N) GRPO maths (README)."""
    from grpo_kernels import objective
    from grpo_kernels.options import GRPOInputs, GRPOOptions

    head, shape = _peer("trl.kernels.chunked_logprob", "ChunkedLogProbFunction"), x["ids"].shape
    h = lambda: head.apply(x["hidden"].reshape(-1, case.H), x["weight"], None, x["ids"].reshape(-1), 1.0, 32768, None, 1.0,  # noqa: E731
                           ("entropy",))
    if case.op == "fused_linear_token_logprobs":
        return lambda: dict(zip(("logp", "entropy"), (t.view(shape) for t in h()[:2])))
    options, given = GRPOOptions(beta=BETA, loss_type="dapo"), GRPOInputs(old_logps=x["old"], ref_logps=x["ref"])
    return lambda: {"loss": objective.grpo_loss_from_logprobs(*(t.view(shape) for t in h()[:2]), x["adv"], x["mask"], given,
                                                              options).loss}


def _quack(case: Case, x: dict) -> Callable[[], dict]:
    """quack's ``cross_entropy`` over the contiguous buffer, the last position ignored (README)."""
    ce, (B, T, V) = _peer("quack.cross_entropy", "cross_entropy"), (case.B, case.T, case.V)
    target = torch.nn.functional.pad(x["ids"], (0, 1), value=-100).reshape(-1)

    def run():
        flat = x["buf"].view(B * (T + 1), V)
        return {"logp": -ce(flat, target, reduction="none").view(B, T + 1)[:, :-1],
                "_wrt": (flat, lambda g: g.view(B, T + 1, V)[:, :-1])}
    return run


def _cce(case: Case, x: dict) -> Callable[[], dict]:
    """Apple's Cut Cross-Entropy, exact: ``filter_eps=None``, ``reduction="none"`` (README)."""
    lce = _peer("cut_cross_entropy", "linear_cross_entropy")
    return lambda: {"logp": -lce(x["hidden"], x["weight"], x["ids"], reduction="none", filter_eps=None, impl="cce")}


def _verl(case: Case, x: dict) -> Callable[[], dict]:
    """verl's ``verl.utils.kernel.linear_cross_entropy`` (per-token log-probs and entropies)."""
    fn = _peer("verl.utils.kernel.linear_cross_entropy", "linear_cross_entropy", bare=True)
    return lambda: dict(zip(("logp", "entropy"), (t.view(x["ids"].shape) for t in fn(x["hidden"], x["weight"], x["ids"], 1.0, "none"))))


MAKERS = {**{i: _ours for i in OURS}, "triton-ops": lambda case, x: _ours(dataclasses.replace(case, impl="triton"), x),
          "liger": _liger, "trl": _trl, "quack": _quack, "cce": _cce, "verl": _verl}


@dataclass
class Runner:
    """A case's inputs (made once) and the call that runs it; the call returns the outputs by name."""

    case: Case
    device: torch.device
    x: dict
    fn: Callable[[], dict]

    def __call__(self) -> dict:
        with torch.set_grad_enabled(self.case.pass_ == "fwd+bwd"), _through_custom_ops(self.case):
            out = self.fn()
            out = _grads(self.case, self.x, out, *out.pop("_wrt", ()))
        H.sync(self.device)  # the timer must see the device's work, not just the launches
        return out

    def close(self) -> None:
        self.x.clear()
        self.fn = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def build(case: Case, device: torch.device) -> Runner:
    """:class:`Unavailable` when the case cannot run here (its reason), else its runner."""
    reason = unavailable(case.impl, case.op, device.type)
    if reason:
        raise Unavailable(reason)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 1024 * (status_kib("MemAvailable", "/proc/meminfo") or 2**60)
    need = estimated_bytes(case)
    if need > free:  # (on a CPU the kernel would kill the whole run instead of raising)
        raise Unavailable(f"shape too large for this {device.type}: needs at least {need / 2**30:.1f} GiB, "
                          f"{free / 2**30:.1f} GiB free")
    x = inputs(case, device)
    return Runner(case, device, x, MAKERS[case.impl](case, x))


def estimated_bytes(case: Case) -> int:
    """A lower bound on what ``case`` needs: inputs, their gradients, the reference's fp32 [N, V] buffers."""
    elt = torch.finfo(H.DTYPES[case.dtype]).bits // 8
    tokens = case.B * case.T
    inputs_ = case.B * (case.T + 1) * case.V * elt if case.op in LOGITS_OPS else (tokens + case.V) * case.H * elt
    return inputs_ * (2 if case.pass_ == "fwd+bwd" else 1) + (3 * tokens * case.V * 4 if case.impl == "reference" else 0)


# -- does it agree with the reference ------------------------------------------------------------------
def compare(actual: dict, expected: dict, dtype: str) -> dict:
    """Per output: the largest error against ``rtol * |e| + atol * max|e|``; a NaN where ``e`` is finite fails."""
    rtol, atol = TOLERANCES[dtype]
    report = {}
    for name, e in expected.items():
        if name not in actual:
            continue
        a, e = actual[name].detach().double().cpu().reshape(e.shape), e.detach().double().cpu()
        scale = float(e.abs().max()) if e.numel() else 0.0
        err, bound = (a - e).abs(), rtol * e.abs() + atol * scale
        finite = bool(torch.isfinite(a).all()) or not bool(torch.isfinite(e).all())
        report[name] = {"max_abs_err": float(err.max()) if e.numel() else 0.0, "scale": scale,
                        "err_over_bound": float((err / bound.clamp(min=1e-300)).max()) if e.numel() else 0.0,
                        "ok": finite and bool((err <= bound).all())}
    return report


def check_case(case: Case, device: torch.device) -> Case:
    """``case`` cut to at most ``CHECK_ELEMENTS`` logits (whole rows of ``T`` tokens, T shortened if need be)."""
    n = min(case.B * case.T, max(64, CHECK_ELEMENTS.get(device.type, 2**24) // case.V))
    T = min(case.T, n)
    return dataclasses.replace(case, N=(n // T) * T, T=T, rounds=1)


def check_agreement(case: Case, device: torch.device) -> dict:
    """``case`` (cut by :func:`check_case`) against ``grpo_kernels.reference`` on the same inputs."""
    from grpo_kernels import reference

    small = check_case(case, device)
    runner = build(small, device)
    try:
        actual = runner()
        grad = small.pass_ == "fwd+bwd"
        y = {**runner.x, **{k: runner.x[k].detach().requires_grad_(runner.x[k].requires_grad) for k in ("buf", "hidden", "weight")
                            if k in runner.x}}
        if "buf" in y:
            y["logits"] = y["buf"][:, :-1]
        with torch.set_grad_enabled(grad):
            expected = _ours(small, y, reference)()
            expected = _grads(small, y, {k: v for k, v in expected.items() if k in actual})
        outputs = compare(actual, expected, case.dtype)
    finally:
        runner.close()
    rtol, atol = TOLERANCES[case.dtype]
    return {"checked": {"N": small.N, "T": small.T}, "rtol": rtol, "atol": atol, "outputs": outputs,
            "ok": bool(outputs) and all(o["ok"] for o in outputs.values())}


def format_agreement(case: Case, result: dict) -> str:
    bad = {k: v for k, v in result["outputs"].items() if not v["ok"]} or result["outputs"]
    parts = [f"{k}: max |err| {v['max_abs_err']:.3e} = {v['err_over_bound']:.2f}x the bound (scale {v['scale']:.3e})"
             for k, v in bad.items()]
    return (f"{case.id} vs grpo_kernels.reference at N={result['checked']['N']} (rtol {result['rtol']}, atol "
            f"{result['atol']} x max|ref|): " + "; ".join(parts or ["no output to compare"]))


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, getattr(torch.cuda, "OutOfMemoryError", ())) or "out of memory" in str(exc).lower()


def prepare(case: Case, device: torch.device, check: bool = True) -> tuple:
    """(runner, info): the agreement check, the inputs, one call's peak memory (README: Cases)."""
    info = {**case.info(), "device": device.type}
    if check and case.impl != "reference":
        info["agreement"] = check_agreement(case, device)
        if not info["agreement"]["ok"]:
            raise Disagrees(format_agreement(case, info["agreement"]))
    runner = build(case, device)
    try:
        if device.type == "cuda":
            runner()  # compilation, workspaces: outside the peak
        info["peak_mem_bytes"], info["peak_mem_method"] = H.peak_extra_bytes(runner, device)
    except Exception as exc:
        runner.close()
        if is_oom(exc):
            raise Unavailable("out of memory") from None
        raise
    return runner, info


# -- throughput and the fused-linear memory checks -----------------------------------------------------
def throughput(case: Case, median_s: Optional[float], copy_gbps: Optional[float], matmul_tflops: Optional[float]) -> dict:
    """GB/s over the floor (from logits) or TFLOP/s (fused linear), with the ceilings' fractions (README)."""
    elt = torch.finfo(H.DTYPES[case.dtype]).bits // 8
    bwd = case.pass_ == "fwd+bwd"
    if case.op in LOGITS_OPS:
        out = {"bytes_floor": (3 if bwd else 1) * case.N * case.V * elt}
    else:
        nhv = case.N * case.H * case.V
        recompute = case.impl in ("trl", "cce", "verl") or (case.op == "fused_linear_token_logprobs" and case.impl in OURS)
        out = {"useful_flops": (6 if bwd else 2) * nhv, "flops": (8 if bwd and recompute else 6 if bwd else 2) * nhv}
    if median_s and "bytes_floor" in out:
        out["gbps"] = out["bytes_floor"] / median_s / 1e9
        if copy_gbps:
            out.update(copy_gbps=copy_gbps, bw_fraction=out["gbps"] / copy_gbps)
    elif median_s:
        out.update(tflops=out["flops"] / median_s / 1e12, useful_tflops=out["useful_flops"] / median_s / 1e12)
        if matmul_tflops:
            out.update(matmul_tflops=matmul_tflops, matmul_fraction=out["tflops"] / matmul_tflops)
    return out


def memory_checks(results: List[dict]) -> List[dict]:
    """The fused-linear sweeps' checks: flat in N for ours, at most 1/8 of the reference (README)."""
    sweeps: dict = {}
    for r in results:
        if r.get("op") == "fused_linear_grpo_loss" and r.get("pass") == "fwd+bwd" and r.get("sweep") and r.get("peak_mem_bytes") is not None:
            sweeps.setdefault((r["dtype"], r["V"], r["H"]), {}).setdefault(r["impl"], {})[r["N"]] = r["peak_mem_bytes"]
    checks = []
    for (dtype, v, h), by_impl in sorted(sweeps.items()):
        ref, elt = by_impl.get("reference", {}), torch.finfo(H.DTYPES[dtype]).bits // 8
        for impl, peaks in sorted((i, p) for i, p in by_impl.items() if i != "reference"):
            ns = sorted(peaks)
            points = [{"N": n, "peak_bytes": peaks[n], "reference_peak_bytes": ref.get(n),
                       **({"ratio_to_reference": peaks[n] / ref[n]} if ref.get(n) else {})} for n in ns]
            growth = [{"from_N": a, "to_N": b, "delta_bytes": peaks[b] - peaks[a], "allowed_bytes": (b - a) * h * elt * 2,
                       "ok": peaks[b] - peaks[a] <= (b - a) * h * elt * 2} for a, b in zip(ns, ns[1:])]
            n = max((n for n in ns if ref.get(n)), default=None)
            rc = n and {"N": n, "ratio": peaks[n] / ref[n], "target": 1 / 8, "ok": peaks[n] / ref[n] <= 1 / 8}
            checks.append({"impl": impl, "dtype": dtype, "V": v, "H": h, "points": points, "growth": growth, "ratio_check": rc,
                           "ok": all(g["ok"] for g in growth) and (not rc or rc["ok"])})
    return checks


def checks_lines(checks: List[dict]) -> List[str]:
    out = []
    for c in checks:
        out += [f"**fused_linear_grpo_loss fwd+bwd, {c['impl']} vs reference, {c['dtype']}, V={c['V']}, H={c['H']}**", ""]
        out += H.table(["N", f"{c['impl']} peak", "reference peak", "ratio"], [
            [p["N"], H.fmt_bytes(p["peak_bytes"]), H.fmt_bytes(p["reference_peak_bytes"]),
             f"{p['ratio_to_reference']:.4f} (1/{1 / p['ratio_to_reference']:.0f})" if p.get("ratio_to_reference") else None]
            for p in c["points"]]) + [""]
        if c["ratio_check"]:
            rc = c["ratio_check"]
            out.append(f"- {c['impl']} ≤ 1/8 of the reference at N={rc['N']}: ratio {rc['ratio']:.4f} → **{'PASS' if rc['ok'] else 'FAIL'}**")
        out += [f"- N {g['from_N']} → {g['to_N']}: peak grows {H.fmt_bytes(g['delta_bytes'])}, allowed (hidden + its gradient) "
                f"{H.fmt_bytes(g['allowed_bytes'])} → **{'PASS' if g['ok'] else 'FAIL'}**" for g in c["growth"]] + [""]
    return out


# -- the report of a pytest-benchmark JSON -------------------------------------------------------------
ORDER = {k: i for i, k in enumerate(list(IMPLS) + list(OPS) + list(PASSES))}
# The GPU issue's targets: the from-logits floors and the fused-linear loss against the matmul rate.
HEADLINE = (("token_logprobs", "fwd", 16384, 151936, None, "≥ 85% of copy bandwidth (one read of the logits)"),
            ("grpo_loss", "fwd+bwd", 16384, 151936, None, "against two reads + one write of the logits"),
            ("fused_linear_grpo_loss", "fwd+bwd", 16384, 151936, 4096, "against the matmul rate"),
            ("fused_linear_token_logprobs", "fwd+bwd", 16384, 151936, 4096, "the log-prob head: ours, TRL, CCE, verl"))


def _key(r: dict) -> tuple:
    return (ORDER.get(r["op"], 99), ORDER.get(r["pass"], 99), r["dtype"], r["V"], r.get("H") or 0, r["N"], ORDER.get(r["impl"], 99),
            r.get("sampling") or "")


def _name(r: dict) -> str:
    return r["impl"] + (f"@{r['chunk']}" if r.get("chunk") else "") + (f" {r['sampling']}" if r.get("sampling") else "") + \
        " frozen" * bool(r.get("frozen"))


def _throughput_cells(r: dict) -> List[str]:
    """(achieved throughput, fraction of the measured ceiling: GPU rows only, a shared CPU's are noise)."""
    gpu = r.get("device") != "cpu"
    if r.get("gbps") is not None:
        return [f"{r['gbps']:.1f} GB/s", f"{100 * r['bw_fraction']:.0f}% of copy" if gpu and r.get("bw_fraction") else "—"]
    if r.get("tflops") is not None:
        return [f"{r['tflops']:.2f} TFLOP/s", f"{100 * r['matmul_fraction']:.0f}% of matmul" if gpu and r.get("matmul_fraction") else "—"]
    return ["—", "—"]


def render(data: dict, out_dir: str, stem: str, title: Optional[str] = None) -> str:
    """The markdown report of a pytest-benchmark JSON, its plots, memory checks and the cases not run."""
    rows = [{**b["extra_info"], "median_s": (b.get("stats") or {}).get("median")} for b in data.get("benchmarks", [])
            if "op" in (b.get("extra_info") or {})]
    cond = dict((data.get("machine_info") or {}).get("grpo_bench") or {})
    cond.setdefault("date", data.get("datetime"))
    shape = lambda r: (r["op"], r["pass"], r["dtype"], r["N"], r["V"], r.get("H"))  # noqa: E731
    ref = {shape(r): r for r in rows if r["impl"] == "reference"}
    lines = [f"Set `{cond['bench_set']}` ({cond.get('bench_set_reason', '')})." if cond.get("bench_set") else ""]
    if cond.get("gpu_name") and cond.get("copy_gbps"):
        lines.append(f"Measured ceilings: copy {cond['copy_gbps']} GB/s, matmul {cond.get('matmul_tflops')} TFLOP/s "
                     f"({cond.get('matmul_dtype', 'bf16')}).")
    if cond.get("note"):
        lines.append(f"Note: {cond['note']}")
    lines += ["", "Medians of the timed rounds; `fwd` without autograd, `fwd+bwd` with the input gradients "
              "(`torch.autograd.grad`). Peak memory: extra bytes above the inputs, one separate run. Ratios: to the "
              "reference at the same shape, dtype and pass. Every implementation but the reference passed its "
              "agreement check before it was timed.", ""]
    head = []
    for op, p, n, v, h, target in HEADLINE:
        hits = sorted((r for r in rows if (r["op"], r["pass"], r["N"], r["V"], r.get("H")) == (op, p, n, v, h)), key=_key)
        if hits:
            head.append(f"- `{op}` {p} N={n} V={v}" + (f" H={h}" if h else "") + f" ({target}):")
            head += [f"  - {_name(r)}: {H.fmt_time(r.get('median_s'))}, " + ", ".join(_throughput_cells(r))
                     + f", peak {H.fmt_bytes(r.get('peak_mem_bytes'))}" for r in hits]
    if head:
        lines += ["## Headline cases", "", *head, ""]
    groups = defaultdict(list)
    for r in rows:
        groups[(r["op"], r["pass"], r["dtype"], r["V"], r.get("H"))].append(r)
    for op in sorted({r["op"] for r in rows}, key=lambda o: ORDER.get(o, 99)):
        cells = []
        for r in sorted((r for r in rows if r["op"] == op), key=_key):
            base = ref.get(shape(r)) or {}
            over = lambda k: r[k] / base[k] if base.get(k) and r.get(k) is not None else None  # noqa: E731
            cells.append([_name(r), f"N={r['N']}, V={r['V']}" + (f", H={r['H']}" if r.get("H") else ""), r["dtype"], r["pass"],
                          H.fmt_time(r.get("median_s")), H.fmt_bytes(r.get("peak_mem_bytes")), H.fmt_ratio(over("median_s")),
                          H.fmt_ratio(over("peak_mem_bytes")), *_throughput_cells(r)])
        lines += [f"## `{op}`", ""] + H.table(["impl", "shape", "dtype", "pass", "median", "peak memory", "time / ref",
                                               "memory / ref", "throughput", "of ceiling"], cells) + [""]
        for key, group in sorted(groups.items(), key=lambda kv: _key(kv[1][0])):
            if key[0] != op or len({r["N"] for r in group}) < 2:
                continue  # a single N is a table row, not a curve
            name = f"{stem}-{op}-{key[1].replace('+', '')}-{key[2]}-V{key[3]}" + (f"-H{key[4]}" if key[4] else "") + ".png"
            series = lambda f: {i: [(r["N"], f(r)) for r in group if _name(r) == i and f(r) is not None]  # noqa: E731
                                for i in sorted({_name(r) for r in group}, key=lambda i: ORDER.get(i, 99))}
            if H.plot(os.path.join(out_dir, name), " ".join(map(str, (k for k in key if k))), [
                    ("median time (s)", series(lambda r: r.get("median_s"))),
                    ("peak extra memory (MiB)", series(lambda r: None if r.get("peak_mem_bytes") is None else r["peak_mem_bytes"] / 2**20))],
                    "N (tokens)"):
                lines += [f"![{key[0]} {key[1]} {key[2]} V={key[3]}]({name})", ""]
    steps = [b["extra_info"] for b in data.get("benchmarks", []) if "mode" in (b.get("extra_info") or {})]
    if steps:
        lines += ["## One GRPO step at long context (`bench_long_context.py`: the measured step of a fresh process)", "",
                  *H.table(["mode", "sequences", "tokens", "step", "peak RSS"], [
                      [r["mode"], len(r["lengths"]), r["tokens"], H.fmt_time(r.get("step_s")),
                       H.fmt_bytes(r["peak_rss_gib"] * 2**30 if r.get("peak_rss_gib") else None)] for r in steps]), ""]
    if data.get("grpo_memory_checks"):
        lines += ["## Fused-linear memory: flat in N for ours, growing for the reference", ""] + checks_lines(data["grpo_memory_checks"])
    if data.get("grpo_cut_by_budget"):
        lines += ["## Cut by the time budget", "", f"{len(data['grpo_cut_by_budget'])} cases, whole comparisons not "
                  "begun when GRPO_BENCH_BUDGET_S ran out (every comparison begun ran all its sides): "
                  + ", ".join(f"`{c}`" for c in data["grpo_cut_by_budget"]), ""]
    if data.get("grpo_skipped"):
        lines += ["## Cases not run", ""] + [f"- `{s['case']}`: {s['reason']}" for s in data["grpo_skipped"]] + [""]
    cond.setdefault("load_end_1m", None)
    return H.Report(title or "grpo-kernels benchmarks", cond).add(*lines).text()


# -- commands ------------------------------------------------------------------------------------------
def compare_shape(op: str, shape: str, impls: List[str], chunks: List[int], args, device: torch.device) -> List[dict]:
    """Every implementation of ``op`` at ``shape`` (``NxHxV``; ``NxV``): prepared, then interleaved."""
    n, *rest = (int(s) for s in shape.split("x"))
    base = dict(op=op, N=n, V=rest[-1], dtype=args.dtype, pass_="fwd+bwd", T=min(512, n), H=rest[0] if len(rest) > 1 else None,
                rounds=args.rounds)
    runners, records = {}, []
    again = [dict(chunk=c) for c in chunks] + [dict(frozen=True)] * (args.frozen and op in LINEAR_OPS)
    for case in [Case(impl=i, **base) for i in impls] + [Case(impl="torch", **base, **kw) for kw in again]:
        name = _name(case.info())
        try:
            runners[name], rec = prepare(case, device)
            if args.rss:
                rec["rss"] = H.fresh_call("benchmarks.kernels:rss_child", {"case": dataclasses.asdict(case)}, timeout_s=900)[-1]
        except Exception as exc:  # not installed, no CUDA, an API that moved, a disagreement: said in the table
            rec = {**case.info(), "skipped": f"{type(exc).__name__}: {str(exc)[:300]}", "disagrees": isinstance(exc, Disagrees)}
        records.append({**rec, "name": name})
    times = H.interleave(runners, args.rounds, device, warmup=False)  # (the memory run was the warm-up)
    first = "reference" if "reference" in times else next(iter(times), None)
    for rec in records:
        if rec["name"] in times:
            rec.update(times_s=times[rec["name"]], median_s=H.median(times[rec["name"]]), ratio_to=first,
                       ratio=H.ratio(times, rec["name"], first), ratio_to_torch=H.ratio(times, rec["name"], "torch"))
    return records


def compare_main(argv: List[str]) -> int:
    args = H.parser("kernel implementations side by side: agreement, peak memory, interleaved time", rounds=3,
                    ops=(["fused_linear_grpo_loss"], None, list(OPS)), dtype=("fp32", None, list(H.DTYPES)),
                    shapes=(["1024x512x32000", "4096x512x32000", "1024x1024x151936"], "NxHxV (fused linear) or NxV (from logits)"),
                    impls=("reference,torch,liger,trl", "comma-separated (those an op lacks are left out)"),
                    chunks=("", "ours (torch) again at these chunk sizes, comma-separated"),
                    frozen=(False, "ours (torch) again with the head frozen (LoRA's lm_head: no weight gradient)"),
                    rss=(False, "each case's peak RSS in a fresh process too")).parse_args(argv)
    device = H.device()
    report = H.Report("Kernels side by side (`python -m benchmarks.kernels compare`)")
    report.add(f"{args.dtype}, forward + backward, {args.rounds} interleaved rounds, medians; ratios: medians of the per-round "
               "ratios; peak: extra bytes of one separate call; agreement with the reference checked first.", "")
    for op in args.ops:
        for shape in args.shapes:
            records = compare_shape(op, shape, [i for i in args.impls.split(",") if op in IMPLS[i][0]],
                                    [int(c) for c in args.chunks.split(",") if c], args, device)
            report.records += records
            rss = lambda r: r["rss"].get("error", "")[:80] or f"{r['rss']['peak_rss_mib'] - r['rss']['rss_start_mib']:,.0f} MiB"  # noqa: E731
            report.add(f"## `{op}` {shape}", "", *H.table(
                ["impl", "median", f"× {next((r['ratio_to'] for r in records if r.get('ratio_to')), '?')}", "× torch", "peak extra",
                 "RSS growth (fresh process)", "agrees", "skipped"],
                [[r["name"], H.fmt_time(r.get("median_s")), H.fmt_ratio(r.get("ratio")), H.fmt_ratio(r.get("ratio_to_torch")),
                  H.fmt_bytes(r.get("peak_mem_bytes")),
                  rss(r) if r.get("rss") else None, "—" if "agreement" not in r else "yes" if r["agreement"]["ok"] else "no",
                  r.get("skipped", "")] for r in records]), "")
    report.write(args.out)
    return 1 if any(r.get("disagrees") for r in report.records) else 0


def rss_child(case: dict) -> dict:
    """One call of ``case`` after a warm-up, in this (fresh) process: its peak RSS and seconds (``compare --rss``)."""
    runner = build(Case(**case), H.device())
    runner()
    span = H.RSS().start()
    seconds = H.timed(runner, runner.device)
    return {**span.stop(), "seconds": seconds}


def report_main(argv: List[str]) -> int:
    p = H.flags(argparse.ArgumentParser(description="render a pytest-benchmark JSON into markdown + PNG plots"), title=str)
    p.add_argument("results")
    args = p.parse_args(argv)
    path = Path(args.results).resolve()
    md = path.with_suffix(".md")
    md.write_text(render(json.loads(path.read_text()), str(path.parent), path.stem, args.title))
    print(md)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"compare": compare_main, "report": report_main}
    if not argv or argv[0] not in commands:
        print(__doc__)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
