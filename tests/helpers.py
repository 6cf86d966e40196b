"""Shared test helpers, imported explicitly (``from helpers import ...``).

- ``DEVICE``: "cuda" where a GPU is present, else "cpu" (Triton kernels then run through the
  interpreter: ``conftest.py`` sets TRITON_INTERPRET=1 before triton is first imported).
- ``assert_close64``: compare a result with a float64 reference at a tolerance that fits the dtype.
- ``poison_``: fill an output buffer with NaN before a kernel writes it.
- ``adamw64_step``: one AdamW step written out in float64 (the fused optimizers' reference).
- ``tiny_config``: a ``GRPOConfig`` for the trainer tests' tiny model (CPU, "torch" backend);
  ``TINY_UPDATE``: the fields of one update of ``tiny_qwen2`` on ``random_update_batch``.
- ``timed``, ``SLACK``: a call that must return within a wall-clock budget (the rewards tests).
- ``saved_for_backward``: the bytes autograd keeps for backward while a function runs.
- tiny models built in code: ``tiny_causal_lm`` (any transformers family, seeded weights),
  ``tiny_qwen2`` (the trainer's 2-layer Qwen2 of vocabulary 24), ``save_demo_model`` and
  ``write_prompts`` (the demo's model and tokenizer in a folder, and a prompts file, for the CLI).
- the trainer's batches: ``generate_rollouts``, ``update_batch`` (a rollout's), ``random_update_batch``
  (12 rows of random tokens for ``tiny_qwen2``, no model run).
- fresh processes: ``run_cli`` (``python -m grpo ...``), ``torchrun`` (2 ranks, gloo) and ``free_port``.
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import time
import weakref
from typing import Any, Callable, Optional, TypeVar

import torch

R = TypeVar("R")

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"

# (rtol, atol) for values that went through one rounding to the dtype, relative to O(1) magnitudes.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
    torch.float64: (1e-10, 1e-10),
}


def tolerance(dtype: torch.dtype):
    return TOLERANCES[dtype]


def assert_close64(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype = torch.float32, scale: float = 1.0, what: str = ""):
    """``actual`` against a float64 ``expected``: no NaN unless expected is NaN there, then within
    ``rtol * |expected| + atol * scale`` where the tolerance fits ``dtype``."""
    rtol, atol = TOLERANCES[dtype]
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    assert torch.equal(nan_a, nan_e), f"{what}: NaN pattern differs ({int(nan_a.sum())} vs {int(nan_e.sum())} NaNs)"
    a, e = a[~nan_e], e[~nan_e]
    inf_e = torch.isinf(e)
    assert torch.equal(a[inf_e], e[inf_e]), f"{what}: infinities differ"
    a, e = a[~inf_e], e[~inf_e]
    err = (a - e).abs()
    bound = rtol * e.abs() + atol * scale
    worst = (err - bound).argmax() if err.numel() else None
    assert bool((err <= bound).all()), (
        f"{what}: max error {err.max().item():.3e} (at expected {e[worst].item():.6g}, got {a[worst].item():.6g}), "
        f"rtol={rtol}, atol={atol * scale:.3e}"
    )


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill a buffer with NaN so a kernel that forgets to write an element is caught."""
    return t.fill_(float("nan"))


def poison_allocations(monkeypatch) -> None:
    """Every floating-point ``torch.empty`` / ``torch.empty_like`` comes back poisoned (NaN-filled by
    :func:`poison_`) for the rest of the test: an output element a kernel skips shows up."""
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return poison_(t) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: poisoned_empty(t.shape, dtype=kw.get("dtype", t.dtype), device=t.device))


def adamw64_step(x, m, v, vmax, g, step: int, *, lr: float, beta1: float, beta2: float, weight_decay: float,
                 eps: float, amsgrad: bool = False, maximize: bool = False, grad_scale: float = 1.0):
    """One AdamW step in float64, written out from ``torch.optim.AdamW``'s documented algorithm
    (Loshchilov & Hutter 2019, Algorithm 2): the gradient unscaled (and negated to maximize), decoupled
    weight decay, the two moments, the bias corrections, ``eps`` after the square root of the corrected
    second moment. Float64 tensors in (``vmax`` ignored unless ``amsgrad``); returns the new
    ``(x, m, v, vmax)``."""
    g = g / grad_scale * (-1.0 if maximize else 1.0)
    x = x * (1 - lr * weight_decay)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    if amsgrad:
        vmax = torch.maximum(vmax, v)
    v_hat = (vmax if amsgrad else v) / (1 - beta2**step)
    x = x - lr * (m / (1 - beta1**step)) / (v_hat.sqrt() + eps)
    return x, m, v, vmax


TINY_RUN = dict(
    seed=0, num_steps=1, prompts_per_step=2, num_generations=4, max_new_tokens=6, learning_rate=1e-3,
    backend="torch", progress=False, plot=False, save_every=0,
)


def tiny_config(tmp_path, **overrides: Any):
    """A ``GRPOConfig`` writing to ``tmp_path / "run"``: one step of 2 prompts x 4 generations of 6
    tokens, the "torch" backend, no progress bar, plot or checkpoint; ``overrides`` replace any field."""
    from grpo.config import GRPOConfig

    return GRPOConfig(**{"output_dir": str(tmp_path / "run"), **TINY_RUN, **overrides})


# The spec's own lists, never retyped here: the concrete backends (every one a test runs on), the
# fused ones, and the four loss types of TRL's first release that most kernel tests sweep (the spec's
# PPO-clipped types but luspo, whose length weighting has tests of its own over all of LOSS_TYPES).
from grpo_kernels.options import BACKENDS as _BACKEND_CHOICES  # noqa: E402
from grpo_kernels.options import CLIPPED_LOSS_TYPES  # noqa: E402

BACKENDS = tuple(b for b in _BACKEND_CHOICES if b != "auto")
KERNEL_BACKENDS = tuple(b for b in BACKENDS if b != "reference")
CORE_LOSS_TYPES = tuple(t for t in CLIPPED_LOSS_TYPES if t != "luspo")


# A small batch for the contract checks: masked positions, and a sequence with no completion token.
B, T, V, H = 3, 5, 13, 6


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T)
    mask[0, 3:] = 0
    mask[1, 0] = 0
    mask[2, :] = 0  # a sequence with no completion token at all
    adv = torch.randn(B, T, generator=g)
    old = torch.randn(B, T, generator=g) * 0.1 - 2.5
    ref = torch.randn(B, T, generator=g) * 0.1 - 2.5
    is_ratio = torch.rand(B, T, generator=g) + 0.5
    return logits, ids, mask, adv, old, ref, is_ratio


SLACK = 2.0  # seconds over its timeout that any reward call may take


def timed(fn: Callable[[], R], budget: float) -> R:
    """``fn()``, asserting that it returned within ``budget`` seconds of wall time."""
    start = time.monotonic()
    out = fn()
    elapsed = time.monotonic() - start
    assert elapsed < budget, f"took {elapsed:.1f}s, budget {budget:.1f}s"
    return out


def loss_and_logits_grad(logits, ids, adv, mask, backend: str = "torch", **kw):
    """``grpo_kernels.grpo_loss`` on a fresh leaf copy of ``logits`` (on DEVICE): (its output, d loss /
    d logits on the CPU)."""
    import grpo_kernels as gk

    x = logits.clone().to(DEVICE).requires_grad_()
    kw = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    out = gk.grpo_loss(x, ids.to(DEVICE), adv.to(DEVICE), mask.to(DEVICE), backend=backend, **kw)
    (grad,) = torch.autograd.grad(out.loss, x)
    return out, grad.cpu()


def saved_for_backward(fn: Callable[[], R], exclude=()) -> tuple[R, int]:
    """(fn(), bytes of the distinct storages autograd saved for backward while it ran), leaving out
    the storages of the tensors in ``exclude`` (a model's parameters)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(kept.values())


def peak_new_bytes(fn: Callable[[], R]) -> tuple[R, int]:
    """(fn(), the most bytes that storages made while it ran held at once): an op's output whose storage
    is none of its inputs' (not a view, not in place) counts from the op until the storage is freed, so a
    transient that a later op frees counts at its height. Ops autograd's backward runs here count too."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    live: dict[int, int] = {}
    state = {"now": 0, "peak": 0}

    def freed(ptr: int) -> None:
        state["now"] -= live.pop(ptr, 0)

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                ptr = t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else 0
                if ptr and ptr not in inputs and ptr not in live:
                    live[ptr] = t.untyped_storage().nbytes()
                    state["now"] += live[ptr]
                    weakref.finalize(t.untyped_storage(), freed, ptr)
            state["peak"] = max(state["peak"], state["now"])
            return out

    with Track():
        out = fn()
    return out, state["peak"]


# ---------------------------------------------------------------------------- tiny models, built in code
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")

# the trainer's tiny Qwen2 (test_trainer, test_distributed): token 0 pads, token 1 ends a completion
TINY_QWEN2 = dict(vocab_size=24, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0, eos_token_id=1, bos_token_id=None)


def tiny_causal_lm(family: str = "Qwen2", seed: int = 0, attn: Optional[str] = None, **config: Any):
    """``transformers.<family>ForCausalLM`` of ``<family>Config(**config)``, its weights drawn after
    ``torch.manual_seed(seed)`` (fp32, on the CPU); ``attn`` sets the attention implementation."""
    import transformers

    cfg = getattr(transformers, f"{family}Config")(**config)
    if attn is not None:
        cfg._attn_implementation = attn
    torch.manual_seed(seed)
    return getattr(transformers, f"{family}ForCausalLM")(cfg)


# one update of tiny_qwen2 on random_update_batch (test_trainer's verl cases, test_distributed): the
# GRPOConfig fields both set alike
TINY_UPDATE = dict(beta=0.05, entropy_coef=0.01, eps_low=0.2, eps_high=0.28, max_new_tokens=8, learning_rate=1e-3,
                   backend="torch", progress=False, plot=False)


def tiny_qwen2(tied: bool = False, seed: int = 0):
    """The trainer tests' Qwen2 (``TINY_QWEN2``), its embeddings tied to ``lm_head`` or not."""
    return tiny_causal_lm("Qwen2", seed, tie_word_embeddings=tied, **TINY_QWEN2)


def save_demo_model(folder) -> tuple:
    """The demo's model and tokenizer (seed 0), saved to ``folder``; returns (model, tokenizer)."""
    from grpo.demo import build_model_and_tokenizer

    model, tokenizer = build_model_and_tokenizer(seed=0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, tokenizer


def write_prompts(path, count: int, key: str = "prompt"):
    """The demo's first ``count`` problems as a JSON-lines prompts file (``key`` holds the prompt, "answer"
    the answer), for ``--data``; returns ``path``."""
    import json

    from grpo.demo import problems

    path.write_text("".join(json.dumps({key: r["prompt"], "answer": r["answer"]}) + "\n" for r in problems()[:count]))
    return path


# ---------------------------------------------------------------------------- the trainer's batches
def generate_rollouts(model, tokenizer, prompts, cfg, num_generations):
    """Completions as the trainer samples them."""
    from grpo.trainer import as_policy, default_rollout

    return default_rollout(model, tokenizer, cfg).generate(as_policy(model), prompts, num_generations)


def update_batch(rollout, advantages, loss_mask=None, **fields: Any):
    """The trainer's update batch for a rollout (prompt then completion, row-aligned); ``fields``: the
    other fields of ``UpdateBatch`` (old / ref / rollout log-probs)."""
    from grpo.trainer import UpdateBatch

    return UpdateBatch(
        input_ids=torch.cat([rollout.prompt_ids, rollout.completion_ids], 1),
        attention_mask=torch.cat([rollout.prompt_mask, rollout.completion_mask], 1),
        prompt_len=rollout.prompt_ids.shape[1], completion_ids=rollout.completion_ids,
        loss_mask=rollout.completion_mask if loss_mask is None else loss_mask, advantages=advantages, **fields,
    )


def random_update_batch(min_completion: int = 0, lossless_row: Optional[int] = None, seed: int = 0):
    """12 rollouts (4 prompts x G=3) for ``tiny_qwen2``: left-padded prompts of 1..4 tokens, completions of
    ``min_completion``..6 tokens (row 3 full), old / ref log-probs off the policy's; ``lossless_row`` keeps
    its completion tokens but no loss token."""
    from grpo.trainer import UpdateBatch

    g = torch.Generator().manual_seed(seed)
    B, P, T, V = 12, 4, 6, TINY_QWEN2["vocab_size"]
    prompt_len = torch.randint(1, P + 1, (B,), generator=g)
    prompt_mask = (torch.arange(P) >= P - prompt_len[:, None]).long()
    completion_len = torch.randint(min_completion, T + 1, (B,), generator=g)
    completion_len[3] = T
    completion_mask = (torch.arange(T) < completion_len[:, None]).long()
    loss_mask = completion_mask.clone()
    if lossless_row is not None:
        loss_mask[lossless_row] = 0
    completion_ids = torch.randint(2, V, (B, T), generator=g) * completion_mask
    input_ids = torch.cat([torch.randint(2, V, (B, P), generator=g) * prompt_mask, completion_ids], 1)
    return UpdateBatch(
        input_ids=input_ids, attention_mask=torch.cat([prompt_mask, completion_mask], 1), prompt_len=P,
        completion_ids=completion_ids, loss_mask=loss_mask, advantages=torch.randn(B, generator=g),
        old_logps=(-math.log(V) + 0.3 * torch.randn(B, T, generator=g)) * loss_mask,
        ref_logps=(-math.log(V) + 0.3 * torch.randn(B, T, generator=g)) * loss_mask,
    )


# ---------------------------------------------------------------------------- fresh processes
def run_cli(*args: str, env: Optional[dict] = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m grpo ARGS`` in a fresh process from the repository root (this checkout's ``grpo``),
    stdout and stderr captured as text; ``env`` replaces the environment."""
    return subprocess.run([sys.executable, "-m", "grpo", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def leave_gloo_worker() -> None:
    """The end of a spawned (or torchrun-started) gloo rank whose checks all passed: every rank reaches the
    barrier (no peer is still in a collective), the group is destroyed, and the process ends without the
    interpreter's teardown, whose C++ static destructors once aborted a rank that had passed ("terminate
    called without an active exception", SIGABRT, under load). A rank that raised never gets here: its
    error travels as torch.multiprocessing (or torchrun) reports it."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --nproc-per-node 2 ARGS`` (gloo on the CPU: one thread a rank, the
    Triton interpreter off, this checkout and tests/ importable), asserting that every rank exited 0."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join((ROOT, TESTS, env.get("PYTHONPATH", ""))))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc
