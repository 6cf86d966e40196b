"""The fp32-master-weight AdamW step on the CPU in one pass (``cpu_adamw.cpp``): its build, its check
against torch and its launcher.

:func:`master_adamw_step` steps 16-bit (bf16 / fp16) weights through fp32 masters: per element it reads
the 16-bit gradient, updates the fp32 master, ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq``) and
writes the weight rounded to nearest even. Torch has no such kernel: through torch's ops the step is three
passes (the gradient cast to fp32, ``torch._fused_adamw_``, the master cast to 16 bits), and the two casts
cost ~0.7x of the fused AdamW pass itself (``benchmarks/results/optimizer_step-cpu-20261202.md``).

The library is C++ without torch headers, compiled once per source, compiler and CPU with the system's
``g++`` (``-O3 -march=native -fopenmp``, about a second) into a cache directory
(``$GRPO_KERNELS_CACHE``, else ``~/.cache/grpo_kernels``) and loaded with ``ctypes``; its OpenMP threads are
torch's own (the process's one ``libgomp``). Before it is used, :func:`library` checks it bitwise against
``torch._fused_adamw_`` on probe tensors (fp32 masters, the 16-bit gradients cast to fp32), for each vector
width torch's kernel may have been built with; so a master stepped here is the value torch's fused AdamW
gives the same master, bit for bit, and a checkpoint resumes exactly on either path. Where ``g++`` is
missing, the build fails or no width agrees, :func:`library` returns ``None`` with the reason in
:func:`unavailable_reason` (logged once), and the caller keeps torch's ops.

Each call is one parallel loop over all tensors (cut into :data:`BLOCK`-element blocks); ``ctypes`` releases
the GIL for it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional, Sequence

import torch

from .master_adamw import check_args

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_adamw.cpp")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp",
         "-std=c++17", "-shared", "-fPIC") + (("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ())
"""``-ffp-contract=off``: the multiply-adds are the ones the source writes (it matches torch's roundings
with explicit ``fma``); ``-fno-math-errno``: ``sqrt`` vectorises; no ``-ffast-math`` (it would reorder);
on x86, AVX-512's full width where the CPU has it (GCC's default tuning prefers 256 bits)."""
WIDTHS = (8, 16, 4)
"""Vector widths (floats) torch's CPU kernel may run (AVX2 / AVX512 builds); the first that agrees bitwise wins."""
BLOCK = 1 << 14
"""Elements of one unit of parallel work (a multiple of every width): 192 KiB of fp32 state, small enough
to balance threads, large enough that the loop's setup is noise."""

_state: dict = {}  # "lib": the loaded library or None, "width", "reason"


def _cache_dir() -> Path:
    """``$GRPO_KERNELS_CACHE``, else ``~/.cache/grpo_kernels``; a per-user folder in the temporary directory
    where that one cannot be written (a read-only home in CI)."""
    try:
        chosen = Path(os.environ.get("GRPO_KERNELS_CACHE") or Path.home() / ".cache" / "grpo_kernels")
        chosen.mkdir(parents=True, exist_ok=True)
        if os.access(chosen, os.W_OK):
            return chosen
    except (OSError, RuntimeError):  # (RuntimeError: no home directory)
        pass
    return Path(tempfile.gettempdir()) / f"grpo_kernels-{os.getuid()}"


def _cpu_key() -> str:
    """What ``-march=native`` depends on: the CPU's model and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown-cpu"
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))][:2]
    return "\n".join(lines)


def _build() -> Path:
    """The compiled library's path (compiled now unless cached); ``RuntimeError`` saying why it cannot be."""
    name = os.environ.get("CXX", "g++")
    compiler = shutil.which(name)
    if compiler is None:
        raise RuntimeError(f"no C++ compiler: {name!r} (g++, or $CXX) is not on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), version, *FLAGS, _cpu_key()]).encode()).hexdigest()[:20]
    target = _cache_dir() / f"cpu_adamw-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, renamed in: concurrent builds are safe
        out = Path(tmp) / target.name
        done = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(out)], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(out, target)
    return target


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    fn = lib.grpo_master_adamw_step
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    fn.argtypes = [i64, p, p, p, p, p, p, p, p, p, p, f32, f32, f32, f32, f32, f32, f32, ctypes.c_int, i64, i64, ctypes.c_int]
    fn.restype = None
    return lib


def library() -> Optional[ctypes.CDLL]:
    """The built, checked library; ``None`` where it cannot be used (:func:`unavailable_reason` says why)."""
    if "lib" not in _state:
        _state["lib"] = None
        try:
            lib = _load(_build())
            for width in WIDTHS:
                _state.update(lib=lib, width=width)
                if _agrees_with_torch():
                    break
            else:
                raise RuntimeError(f"its results differ from torch._fused_adamw_'s (torch {torch.__version__}) at "
                                   f"every vector width {WIDTHS}")
        except Exception as err:  # (an optional speed-up: whatever stops it, the caller falls back, and says why)
            _state.update(lib=None, reason=f"the fused CPU master-weight AdamW is unavailable: {err}")
            log.warning("%s; stepping 16-bit weights with torch's ops (three passes) instead", _state["reason"])
    return _state["lib"]


def unavailable_reason() -> Optional[str]:
    """Why :func:`library` returned ``None`` (``None`` when it did not, or has not been called)."""
    return _state.get("reason")


def _agrees_with_torch() -> bool:
    """Whether two steps of :func:`master_adamw_step` give ``torch._fused_adamw_``'s values bitwise, on
    probe tensors of awkward sizes (every width's body and tail) and the options that change the
    arithmetic (weight decay or none, amsgrad, maximize, a gradient scale, both branches of torch's lerp, bf16 and fp16)."""
    g = torch.Generator().manual_seed(0)
    sizes, dtypes = (37, 211, 1 << 14 | 3), (torch.bfloat16, torch.float16, torch.bfloat16)
    for options in ({"weight_decay": 0.1, "amsgrad": False, "maximize": False, "scale": None, "beta1": 0.9},
                    {"weight_decay": 0.0, "amsgrad": True, "maximize": True, "scale": 4.0, "beta1": 0.3}):
        ours = [[torch.randn(n, generator=g) for n in sizes]]  # masters
        ours += [[torch.randn(n, generator=g) * 0.1 for n in sizes], [torch.rand(n, generator=g) * 0.01 for n in sizes],
                 [torch.rand(n, generator=g) * 0.02 for n in sizes]]  # exp_avg, exp_avg_sq, max_exp_avg_sq
        theirs = [[t.clone() for t in ts] for ts in ours]
        weights = [m.to(d) for m, d in zip(ours[0], dtypes)]
        steps = [torch.tensor(3.0) for _ in sizes]
        hyper = dict(lr=0.01, beta1=options["beta1"], beta2=0.99, weight_decay=options["weight_decay"], eps=1e-8,
                     amsgrad=options["amsgrad"], maximize=options["maximize"])
        scale = None if options["scale"] is None else torch.tensor(options["scale"])
        for _ in range(2):
            grads = [(torch.randn(n, generator=g) * 0.1).to(d) for n, d in zip(sizes, dtypes)]
            torch._foreach_add_(steps, 1)
            master_adamw_step(ours[0], ours[1], ours[2], ours[3] if hyper["amsgrad"] else None, grads, weights,
                              steps, grad_scale=scale, **hyper)
            torch._fused_adamw_(theirs[0], [x.float() for x in grads], theirs[1], theirs[2],
                                theirs[3] if hyper["amsgrad"] else [], steps, grad_scale=scale, **hyper)
        checked = ours if hyper["amsgrad"] else ours[:3]
        if not all(torch.equal(a, b) for xs, ys in zip(checked, theirs) for a, b in zip(xs, ys)):
            return False
        if not all(torch.equal(w, m.to(w.dtype)) for w, m in zip(weights, theirs[0])):
            return False
    return True


def _addresses(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)


def master_adamw_step(masters: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
                      exp_avg_sqs: Sequence[torch.Tensor], max_exp_avg_sqs: Optional[Sequence[torch.Tensor]],
                      grads: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], steps: Sequence[torch.Tensor], *,
                      lr: float, beta1: float, beta2: float, weight_decay: float, eps: float, amsgrad: bool,
                      maximize: bool, grad_scale: Optional[torch.Tensor] = None,
                      found_inf: Optional[torch.Tensor] = None) -> None:
    """One AdamW step of the fp32 ``masters`` from the 16-bit ``grads``, the rounded masters written into
    ``weights`` (the tensors: ``master_adamw``'s contract, on the CPU), in one parallel pass; the fp32
    results are ``torch._fused_adamw_``'s bitwise (:func:`library`'s check). ``grad_scale``: a one-element
    fp32 tensor the gradients are divided by (AMP's unscaling; the gradients are left as they are);
    ``found_inf``: a one-element fp32 tensor, 1 to skip the step (as torch's CPU kernel returns). Needs
    :func:`library` (``RuntimeError`` with its reason without it)."""
    check_args(masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, grads, weights, steps, amsgrad, "cpu")
    lib = library()
    if lib is None:
        raise RuntimeError(unavailable_reason())
    if not masters or (found_inf is not None and float(found_inf) == 1.0):
        return
    count = len(masters)
    counts = [float(s) for s in steps]  # (torch's kernel reads the counter as a float, then forms these in double)
    step_size = torch.tensor([lr / (1 - beta1**k) for k in counts], dtype=torch.float32)
    bc2_sqrt = torch.tensor([math.sqrt(1 - beta2**k) for k in counts], dtype=torch.float32)
    numel = torch.tensor([t.numel() for t in masters], dtype=torch.int64)
    is_bf16 = torch.tensor([t.dtype == torch.bfloat16 for t in grads], dtype=torch.int8)
    tables = [_addresses(ts) for ts in (masters, exp_avgs, exp_avg_sqs)]
    tables.append(_addresses(max_exp_avg_sqs) if amsgrad else torch.zeros(count, dtype=torch.int64))
    tables += [_addresses(grads), _addresses(weights)]
    lib.grpo_master_adamw_step(
        count, *(t.data_ptr() for t in tables), numel.data_ptr(), is_bf16.data_ptr(), step_size.data_ptr(),
        bc2_sqrt.data_ptr(), 1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, eps,
        1.0 if grad_scale is None else float(grad_scale), -1.0 if maximize else 1.0, int(amsgrad), _state["width"],
        BLOCK, torch.get_num_threads())
