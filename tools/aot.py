"""Ahead-of-time compilation of the row kernels for CUDA targets, on a machine without a GPU.

Triton's NVIDIA backend (LLVM -> PTX, then the ``ptxas`` its wheel ships) does not need a driver or
a device: ``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` yields the PTX and
the cubin for any compute capability. This module

- captures the launch ``forward_rows`` / ``backward_rows`` make (``launcher_call``: the kernels are
  swapped for recorders and the launchers get meta tensors, so nothing is allocated or run), so the
  arguments, constexprs and ``num_warps`` are the launcher's own, whatever the kernel signature;
- builds the signature and the alignment attributes exactly as Triton's launcher would for that
  call (``specialize``): pointers ``*bf16``/``*fp32``/``*i64``..., ints ``i32``/``i64``, floats
  ``fp32``, and ``tt.divisibility = 16`` for 16-byte-aligned pointers and ints divisible by 16,
  checked against Triton's own ``native_specialize_impl`` where it exists;
- compiles every configuration the launchers use (``default_variants``, ``compile_all``), or any
  single kernel (``compile_kernel``);
- reads the cubin back with the ``cuobjdump`` from Triton's wheel: registers, local memory (spills),
  stack, and the width of every global load and store in the SASS.

Run it from the repository root as ``python -m tools.aot [--out report.json] [--jobs N]`` (a CI tool of
the repository, not shipped with ``grpo_kernels``; ``tests/test_triton_rows.py`` runs it). It must run with
``TRITON_INTERPRET`` unset: under the interpreter ``@triton.jit`` gives ``InterpretedFunction``
objects, which ``triton.compile`` cannot take. ``compile_in_subprocess`` does exactly that from a
process (a test) that runs with the interpreter on.

Needs Triton >= 3.3 (``attrs`` as ``{(index,): [["tt.divisibility", 16]]}`` and constexprs marked
``"constexpr"`` in the signature); 3.2 and older used ``AttrsDescriptor``, reported as unsupported.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

ARCHS = (80, 90)
VOCABS = (32_000, 151_936)
DTYPES = ("bf16", "fp32")
# Tokens per sequence used to form the row strides: stride_b = T * V. With V = 151,936 it exceeds
# 2**31, so that case also checks the i64-stride signature the launcher then gets.
SEQ_LEN = {32_000: 4096, 151_936: 16_384}
BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


class Unsupported(RuntimeError):
    """This Triton cannot compile for a CUDA target here (too old, or no NVIDIA backend/ptxas)."""


# ----------------------------------------------------------------------------------------------
# Signatures as the launcher builds them
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ptr:
    """A tensor argument: its element type in Triton's spelling and whether its address is 16-byte
    aligned (every fresh CUDA allocation is)."""

    dtype: str
    aligned: bool = True


def specialize(arg_names: List[str], args: Dict[str, Any], constexpr_names: Tuple[str, ...]):
    """(signature, constexprs, attrs) for ``triton.compile`` as the JIT launcher would build them.

    Mirrors ``triton.runtime.jit`` (``native_specialize_impl`` with ``align=True``): an int equal to 1
    becomes a constexpr; other ints are ``i32`` if they fit, else ``i64`` (``u64`` past 2**63), and
    get ``tt.divisibility = 16`` when divisible by 16; floats are ``fp32`` and never specialized;
    pointers get ``tt.divisibility = 16`` when 16-byte aligned.
    """
    signature: Dict[str, str] = {}
    constexprs: Dict[Tuple[int, ...], Any] = {}
    attrs: Dict[Tuple[int, ...], list] = {}
    divisible = [["tt.divisibility", 16]]
    for i, name in enumerate(arg_names):
        value = args[name]
        if name in constexpr_names:
            signature[name] = "constexpr"
            constexprs[(i,)] = value
        elif isinstance(value, Ptr):
            signature[name] = "*" + value.dtype
            if value.aligned:
                attrs[(i,)] = divisible
        elif isinstance(value, bool):
            signature[name] = "u1"
        elif isinstance(value, int):
            if value == 1:
                signature[name] = "constexpr"
                constexprs[(i,)] = 1
                continue
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "u64" if value >= 2**63 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = divisible
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{name}: cannot type {value!r}")
    return signature, constexprs, attrs


@dataclass
class Variant:
    kernel: str  # "fwd" (log-probs), "grpo" (log-probs + loss epilogue) or "bwd"
    arch: int  # compute capability: 80, 90 (sm_90a)
    dtype: str  # logits dtype: "bf16" or "fp32"
    vocab: int
    flags: Dict[str, bool]  # fwd: with_entropy; grpo: old, ref, is_ratio; bwd: grad_logp, grad_entropy
    targets_dtype: str = "i64"
    seq_len: int = 0  # 0: SEQ_LEN[vocab] or 4096
    options: Tuple[Tuple[str, Any], ...] = ()  # further launcher keywords: softcap, loss_type, ...

    @property
    def label(self) -> str:
        f = ",".join(k for k, v in self.flags.items() if v) or "-"
        rows = f"-T{self.seq_len}" if self.seq_len else ""
        extra = "".join(f"-{k}={v}" for k, v in self.options)
        return f"{self.kernel}-sm{self.arch}-{self.dtype}-V{self.vocab}-{f}-tgt{self.targets_dtype}{rows}{extra}"

    @property
    def row_aligned(self) -> bool:
        """Whether every row starts 16-byte aligned (row stride V times the element size)."""
        return self.vocab * BYTES[self.dtype] % 16 == 0


_TORCH_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "i64": "int64", "i32": "int32", "i8": "int8"}


def _torch_dtype(name: str):
    import torch

    return getattr(torch, _TORCH_NAMES[name])


def _triton_dtype(torch_dtype) -> str:
    name = str(torch_dtype).replace("torch.", "")
    return {v: k for k, v in _TORCH_NAMES.items()}[name]


@dataclass
class Launch:
    kernel: Any  # the JITFunction
    args: Dict[str, Any]  # by parameter name: tensors (meta), ints, floats, constexpr values
    options: Dict[str, Any]  # num_warps, num_stages, ...
    constexpr_names: Tuple[str, ...]


class _Recorder:
    """Stands in for a JITFunction: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self, kernel, log: List[Launch]):
        self.kernel, self.log = kernel, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            names = list(self.kernel.arg_names)
            bound = dict(zip(names, args))
            options = {}
            for k, v in kwargs.items():
                (bound if k in names else options)[k] = v
            for prm in self.kernel.params:  # parameters left to their defaults
                if prm.name not in bound and getattr(prm, "has_default", False):
                    bound[prm.name] = prm.default
            constexprs = tuple(p.name for p in self.kernel.params if p.is_constexpr)
            self.log.append(Launch(self.kernel, bound, options, constexprs))

        return launch

    def __getattr__(self, name):
        return getattr(self.kernel, name)


def capture_launches(module, fn, *args, **kwargs) -> List[Launch]:
    """Call ``fn`` with every ``@triton.jit`` kernel of ``module`` replaced by a recorder; return
    the launches it made (nothing runs). Meta tensors give the launcher real shapes and strides
    without memory."""
    from triton.runtime.jit import JITFunction

    log: List[Launch] = []
    saved = {k: v for k, v in vars(module).items() if isinstance(v, JITFunction)}
    try:
        for k, v in saved.items():
            setattr(module, k, _Recorder(v, log))
        fn(*args, **kwargs)
    finally:
        for k, v in saved.items():
            setattr(module, k, v)
    return log


def _require_compiler_mode():
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise Unsupported("TRITON_INTERPRET is set: @triton.jit objects are interpreter functions that "
                          "triton.compile cannot take; run unset (compile_in_subprocess does)")


def launcher_call(variant: Variant) -> Launch:
    """The launch ``forward_rows`` / ``backward_rows`` makes for this variant, for a
    [2, T, V] logits tensor (on the meta device)."""
    import inspect

    import torch

    _require_compiler_mode()
    from grpo_kernels.kernels import triton_rows

    b, t, v = 2, variant.seq_len or SEQ_LEN.get(variant.vocab, 4096), variant.vocab
    meta = dict(device="meta")
    logits = torch.empty(b, t, v, dtype=_torch_dtype(variant.dtype), **meta)
    targets = torch.empty(b, t, dtype=_torch_dtype(variant.targets_dtype), **meta)
    row = lambda: torch.empty(b, t, dtype=torch.float32, **meta)  # noqa: E731
    if variant.kernel == "fwd":
        fn = triton_rows.forward_rows
        kwargs = dict(logits=logits, targets=targets, temperature=0.7, ignore_index=-100,
                      with_entropy=variant.flags["with_entropy"])
    elif variant.kernel == "grpo":
        fn = triton_rows.grpo_forward_rows
        optional = lambda flag: row() if variant.flags[flag] else None  # noqa: E731
        kwargs = dict(logits=logits, targets=targets, advantages=torch.empty(b, dtype=torch.float32, **meta),
                      weights=row(), old_logps=optional("old"), ref_logps=optional("ref"),
                      is_ratio=optional("is_ratio"), temperature=0.7, ignore_index=-100, eps_low=0.2,
                      eps_high=0.28, delta=None, beta=0.04, entropy_coef=0.0)
        if variant.flags.get("kl_weights"):  # verl's sapo: the KL weighted apart from the policy term
            kwargs["kl_weights"] = row()
    else:
        fn = triton_rows.backward_rows
        kwargs = dict(logits=logits, targets=targets, temperature=0.7, ignore_index=-100,
                      out=torch.empty_like(logits),
                      grad_logp=row() if variant.flags["grad_logp"] else None,
                      grad_entropy=row() if variant.flags["grad_entropy"] else None)
        for name, prm in inspect.signature(fn).parameters.items():  # row statistics from the forward
            if name not in kwargs and prm.default is inspect.Parameter.empty:
                kwargs[name] = row()
    kwargs.update(dict(variant.options))
    launches = capture_launches(triton_rows, fn, **kwargs)
    if not launches:
        raise RuntimeError(f"{fn.__name__} launched no kernel")
    return launches[0]


def launch_spec(launch: Launch):
    """(args for ``specialize`` with tensors replaced by ``Ptr``, options)."""
    import torch

    args = {}
    for name, value in launch.args.items():
        if isinstance(value, torch.Tensor):
            offset = value.storage_offset() * value.element_size()  # meta tensors: base address 0
            args[name] = Ptr(_triton_dtype(value.dtype), offset % 16 == 0)
        else:
            args[name] = value
    return args, dict(launch.options)


def native_specialization_mismatches(launch: Launch, signature, attrs, arch: int) -> List[str]:
    """Where ``specialize`` differs from Triton's own launcher specialization
    (``native_specialize_impl``, Triton >= 3.3) on this launch's actual values; [] when it agrees
    or when this Triton has no such function to ask."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
    except ImportError:
        return []
    backend = type(make_backend(GPUTarget("cuda", arch, 32)))
    names = list(launch.kernel.arg_names)
    out = []
    for i, name in enumerate(names):
        if name in launch.constexpr_names:
            continue
        ty, spec = native_specialize_impl(backend, launch.args[name], False, True, True)[:2]
        mine = (signature[name], "D" if (i,) in attrs else "")
        theirs = (ty, spec or "")
        if ty == "constexpr":
            theirs = ("constexpr", "")
        if mine != theirs:
            out.append(f"{name}: ours {mine}, triton {theirs}")
    return out


def default_variants() -> List[Variant]:
    """Every kernel x arch x logits dtype x vocabulary x flag set the launchers use, one run with
    int32 targets, a vocabulary whose rows are not 16-byte aligned (V = 50,257) for reference, and
    the split-vocabulary launches few rows get."""
    fwd_flags = [dict(with_entropy=True), dict(with_entropy=False)]
    bwd_flags = [dict(grad_logp=True, grad_entropy=True), dict(grad_logp=True, grad_entropy=False),
                 dict(grad_logp=False, grad_entropy=True)]
    grpo_flags = [dict(old=True, ref=True, is_ratio=True), dict(old=False, ref=False, is_ratio=False)]
    out = []
    for arch in ARCHS:
        for dtype in DTYPES:
            for vocab in VOCABS:
                out += [Variant("fwd", arch, dtype, vocab, dict(f)) for f in fwd_flags]
                out += [Variant("grpo", arch, dtype, vocab, dict(f)) for f in grpo_flags]
                out += [Variant("bwd", arch, dtype, vocab, dict(f)) for f in bwd_flags]
    out.append(Variant("fwd", 90, "bf16", 151_936, dict(fwd_flags[0]), targets_dtype="i32"))
    out.append(Variant("fwd", 90, "bf16", 50_257, dict(fwd_flags[0])))
    # 2 x 128 rows: too few to fill the GPU, so the vocabulary is split (the first launch is the
    # partial-statistics kernel; the backward gets a 2-D grid)
    out.append(Variant("fwd", 90, "bf16", 151_936, dict(fwd_flags[0]), seq_len=128))
    out.append(Variant("bwd", 90, "bf16", 151_936, dict(bwd_flags[0]), seq_len=128))
    out.append(Variant("bwd", 90, "bf16", 50_257, dict(bwd_flags[0])))
    # soft-capping (Gemma) and the other fused objectives: constexpr branches of the same kernels
    softcap = (("softcap", 30.0),)
    out.append(Variant("fwd", 90, "bf16", 151_936, dict(fwd_flags[0]), options=softcap))
    out.append(Variant("bwd", 90, "bf16", 151_936, dict(bwd_flags[0]), options=softcap))
    out.append(Variant("grpo", 90, "bf16", 151_936, dict(grpo_flags[0]),
                       options=(("loss_type", "cispo"), ("use_bias_correction_kl", True))))
    out.append(Variant("grpo", 90, "bf16", 151_936, dict(grpo_flags[0]), options=(("loss_type", "sapo"),) + softcap))
    # verl's token-local objectives and KL estimators in the epilogue (constexpr branches too)
    verl = [(("loss_mode", "vanilla"), ("kl_loss_type", "low_var_kl+"), ("delta", 3.0)),
            (("loss_mode", "dppo_kl"), ("kl_loss_type", "abs"), ("delta", 20.0)),
            (("loss_mode", "dro"), ("kl_loss_type", "k1"), ("dro_beta", 0.1))]
    out += [Variant("grpo", 90, "bf16", 151_936, dict(grpo_flags[0]), options=o) for o in verl]
    out.append(Variant("grpo", 80, "bf16", 151_936, dict(grpo_flags[0]), options=verl[0]))
    out.append(Variant("grpo", 90, "bf16", 151_936, dict(grpo_flags[0], kl_weights=True),
                       options=(("loss_mode", "sapo"), ("kl_loss_type", "k3"))))
    return out


# ----------------------------------------------------------------------------------------------
# Tools and cubin inspection
# ----------------------------------------------------------------------------------------------


def cuda_tool(name: str) -> str:
    """Path of ``cuobjdump`` / ``nvdisasm`` / ``ptxas``: Triton's knob (honours TRITON_<NAME>_PATH),
    then the wheel's ``backends/nvidia/bin``, then ``PATH``."""
    try:
        from triton import knobs

        path = getattr(knobs.nvidia, name.replace("-", "_")).path
        if path and os.path.exists(path):
            return path
    except Exception:
        pass
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if os.path.exists(path):
        return path
    found = shutil.which(name)
    if found:
        return found
    raise Unsupported(f"{name} not found (Triton's backends/nvidia/bin or PATH)")


_RESOURCE = re.compile(r"(REG|STACK|SHARED|LOCAL):(\d+)")
_MEM_OP = re.compile(r"\b(LDG|STG)((?:\.[A-Z0-9_]+)*)")
_WIDTH_TOKENS = {"128": 128, "64": 64, "256": 256, "U16": 16, "S16": 16, "U8": 8, "S8": 8}


def resource_usage(cubin_path: str) -> Dict[str, int]:
    out = subprocess.run([cuda_tool("cuobjdump"), "--dump-resource-usage", cubin_path], check=True,
                         capture_output=True, text=True).stdout
    fn = out[out.index("Function"):] if "Function" in out else out
    return {k: int(v) for k, v in _RESOURCE.findall(fn)}


def sass(cubin_path: str) -> str:
    return subprocess.run([cuda_tool("cuobjdump"), "-sass", cubin_path], check=True, capture_output=True,
                          text=True).stdout


def global_memory_ops(sass_text: str) -> Dict[str, Dict[str, int]]:
    """{"LDG": {bits: count}, "STG": {...}} over the SASS; bits from the width suffix (none: 32)."""
    ops: Dict[str, Dict[str, int]] = {"LDG": {}, "STG": {}}
    for line in sass_text.splitlines():
        if not line.strip().startswith("/*"):
            continue
        m = _MEM_OP.search(line)
        if not m:
            continue
        bits = 32
        for tok in m.group(2).split(".")[1:]:
            bits = _WIDTH_TOKENS.get(tok, bits)
        ops[m.group(1)][str(bits)] = ops[m.group(1)].get(str(bits), 0) + 1
    return ops


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def ptxas_report(ptx: str, arch: int, log: str = "") -> Dict[str, int]:
    """Second opinion on registers and spills: the ``ptxas -v`` log of Triton's own ptxas run when
    it was captured, else ``ptxas -v`` run here on the PTX Triton produced (same ptxas, same target)."""
    out: Dict[str, Any] = {"source": "triton"}
    if not _PTXAS_SPILL.search(log):
        sm = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        with tempfile.TemporaryDirectory() as d:
            src = os.path.join(d, "k.ptx")
            with open(src, "w") as f:
                f.write(ptx)
            log = subprocess.run([cuda_tool("ptxas"), "-v", f"--gpu-name={sm}", src, "-o", os.path.join(d, "k.o")],
                                 check=True, capture_output=True, text=True).stderr
        out["source"] = "ptxas -v"
    regs, spill = _PTXAS_REGS.search(log), _PTXAS_SPILL.search(log)
    if regs:
        out["regs"] = int(regs.group(1))
    if spill:
        out.update(stack=int(spill.group(1)), spill_stores=int(spill.group(2)), spill_loads=int(spill.group(3)))
    return out


# ----------------------------------------------------------------------------------------------
# Compilation
# ----------------------------------------------------------------------------------------------


def compile_kernel(kernel, args: Dict[str, Any], constexpr_names, arch: int, options: Dict[str, Any]):
    """``triton.compile`` for ``cuda:arch`` as the launcher would specialize ``args`` (by parameter
    name; tensors as ``Ptr``); ``options`` as passed to the launch (num_warps, num_stages...).

    Returns (CompiledKernel with ``.asm["ptx"]`` and ``.asm["cubin"]``, signature, attrs, ptxas log)."""
    _require_compiler_mode()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs = specialize(list(kernel.arg_names), args, tuple(constexpr_names))
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    # Triton runs ptxas with -v and prints its log when the dump_ptxas_log knob is on (3.4+); keep it.
    log = io.StringIO()
    knobs = getattr(triton, "knobs", None)
    nvidia = getattr(knobs, "nvidia", None)
    has_dump = nvidia is not None and hasattr(nvidia, "dump_ptxas_log") and hasattr(nvidia, "scope")
    with nvidia.scope() if has_dump else contextlib.nullcontext(), contextlib.redirect_stdout(log):
        if has_dump:
            nvidia.dump_ptxas_log = True
        ck = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(options))
    return ck, signature, attrs, log.getvalue()


@dataclass
class Result:
    label: str
    kernel: str
    arch: int
    dtype: str
    vocab: int
    flags: Dict[str, bool]
    targets_dtype: str
    row_aligned: bool
    block_v: int = 0
    num_warps: int = 0
    constexprs: Dict[str, Any] = field(default_factory=dict)
    signature: Dict[str, str] = field(default_factory=dict)
    divisible: List[str] = field(default_factory=list)
    specialization_mismatches: List[str] = field(default_factory=list)
    regs: int = -1
    local: int = -1
    stack: int = -1
    shared: int = -1
    ptxas: Dict[str, Any] = field(default_factory=dict)
    metadata_regs: Optional[int] = None
    metadata_spills: Optional[int] = None
    ldg: Dict[str, int] = field(default_factory=dict)
    stg: Dict[str, int] = field(default_factory=dict)
    ptx_vector_loads: int = 0  # ld.global.v4.b32 / v2 in the PTX
    ptx_vector_stores: int = 0
    seconds: float = 0.0
    error: str = ""


def compile_variant(variant: Variant) -> Result:
    t0 = time.time()
    res = Result(variant.label, variant.kernel, variant.arch, variant.dtype, variant.vocab, dict(variant.flags),
                 variant.targets_dtype, variant.row_aligned)
    try:
        launch = launcher_call(variant)
        kernel = launch.kernel
        args, options = launch_spec(launch)
        res.constexprs = {k: launch.args[k] for k in launch.constexpr_names}
        res.block_v = int(launch.args.get("BLOCK_V", 0))
        res.num_warps = int(options.get("num_warps", 4))
        ck, signature, attrs, log = compile_kernel(kernel, args, launch.constexpr_names, variant.arch, options)
        res.signature = signature
        res.specialization_mismatches = native_specialization_mismatches(launch, signature, attrs, variant.arch)
        res.divisible = [kernel.arg_names[k[0]] for k in attrs]
        meta = ck.metadata._asdict() if hasattr(ck.metadata, "_asdict") else dict(ck.metadata)
        res.metadata_regs, res.metadata_spills = meta.get("n_regs"), meta.get("n_spills")
        ptx = ck.asm["ptx"]
        res.ptx_vector_loads = len(re.findall(r"ld\.global[.\w]*\.v[24]", ptx))
        res.ptx_vector_stores = len(re.findall(r"st\.global[.\w]*\.v[24]", ptx))
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "k.cubin")
            with open(path, "wb") as f:
                f.write(ck.asm["cubin"])
            usage = resource_usage(path)
            ops = global_memory_ops(sass(path))
        res.regs, res.local, res.stack, res.shared = (usage.get(k, -1) for k in ("REG", "LOCAL", "STACK", "SHARED"))
        res.ldg, res.stg = ops["LDG"], ops["STG"]
        res.ptxas = ptxas_report(ptx, variant.arch, log)
    except Exception as e:  # reported per variant; the caller decides
        res.error = f"{type(e).__name__}: {e}"
    res.seconds = round(time.time() - t0, 2)
    return res


def compile_all(variants: List[Variant], jobs: int = 0) -> List[Result]:
    jobs = jobs or min(len(variants), os.cpu_count() or 1)
    if jobs <= 1:
        return [compile_variant(v) for v in variants]
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        return list(pool.map(compile_variant, variants))


def environment() -> Dict[str, str]:
    import triton

    info = {"triton": triton.__version__}
    try:
        out = subprocess.run([cuda_tool("ptxas"), "--version"], capture_output=True, text=True).stdout
        info["ptxas"] = out.strip().splitlines()[-1]
    except Exception as e:
        info["ptxas"] = f"unavailable: {e}"
    return info


def check_supported():
    """Raise Unsupported with the reason when AOT compilation for CUDA cannot work here."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, make_backend  # noqa: F401
    except Exception as e:
        raise Unsupported(f"triton CUDA compiler API not importable: {e}")
    ver = tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:2])
    if ver < (3, 3):
        raise Unsupported(f"triton {triton.__version__}: ASTSource attrs use AttrsDescriptor before 3.3")
    try:
        make_backend(GPUTarget("cuda", 90, 32))
    except Exception as e:
        raise Unsupported(f"no NVIDIA backend in triton {triton.__version__}: {e}")
    for tool in ("ptxas", "cuobjdump"):
        cuda_tool(tool)


_FLAG_NAMES = {"with_entropy": "ent", "grad_logp": "logp", "grad_entropy": "ent"}


def vector_bits(widths: Dict[str, int]) -> int:
    """Width of the bulk accesses: 128 if there is any 128-bit (or wider) access, else the most
    frequent width; 0 when there is none."""
    if not widths:
        return 0
    wide = [int(b) for b in widths if int(b) >= 128]
    if wide:
        return max(wide)
    return int(max(widths.items(), key=lambda kv: (kv[1], int(kv[0])))[0])


def report_rows(results: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One flat row per variant: the table printed by the test and written as JSON."""
    rows = []
    for r in results:
        rows.append(dict(
            kernel=r["kernel"], arch=f"sm_{r['arch']}{'a' if r['arch'] >= 90 else ''}", dtype=r["dtype"],
            V=r["vocab"], flags="+".join(_FLAG_NAMES.get(k, k) for k, v in r["flags"].items() if v) or "-",
            targets=r["targets_dtype"], row_aligned=r["row_aligned"], BLOCK_V=r["block_v"], warps=r["num_warps"],
            regs=r["regs"], spills=r["local"], stack=r["stack"],
            ptxas_regs=r["ptxas"].get("regs", -1), ptxas_spills=r["ptxas"].get("spill_stores", -1),
            ld_bits=vector_bits(r["ldg"]), ld128=int(r["ldg"].get("128", 0)),
            st_bits=vector_bits(r["stg"]) if r["kernel"] == "bwd" else 0, st128=int(r["stg"].get("128", 0)),
            seconds=r["seconds"], error=r["error"],
        ))
    return rows


def format_table(rows: List[Dict[str, Any]]) -> str:
    cols = ["kernel", "arch", "dtype", "V", "flags", "targets", "row_aligned", "BLOCK_V", "warps", "regs", "spills",
            "stack", "ptxas_regs", "ptxas_spills", "ld_bits", "ld128", "st_bits", "st128"]
    cells = [[str(r[c]) for c in cols] for r in rows]
    width = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    line = lambda xs: "  ".join(x.rjust(w) for x, w in zip(xs, width))  # noqa: E731
    return "\n".join([line(cols), line(["-" * w for w in width])] + [line(x) for x in cells])


def compile_in_subprocess(timeout: float = 300, jobs: int = 0) -> Dict[str, Any]:
    """Run this module in a fresh interpreter with TRITON_INTERPRET unset and a private Triton cache
    (so every variant really goes through LLVM and ptxas); returns its JSON report."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "aot.json")
        env["TRITON_CACHE_DIR"] = os.path.join(d, "cache")
        cmd = [sys.executable, "-m", "tools.aot", "--out", out, "--jobs", str(jobs), "--quiet"]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
        if not os.path.exists(out):
            raise RuntimeError(f"AOT subprocess failed (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}")
        with open(out) as f:
            return json.load(f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the JSON report here")
    p.add_argument("--jobs", type=int, default=0, help="parallel compiles (0: one per CPU)")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    report: Dict[str, Any] = {}
    try:
        check_supported()
    except Unsupported as e:
        report = {"unsupported": str(e)}
    else:
        t0 = time.time()
        results = [asdict(r) for r in compile_all(default_variants(), a.jobs)]
        report = {"env": environment(), "seconds": round(time.time() - t0, 1), "results": results,
                  "rows": report_rows(results)}
        if not a.quiet:
            print(format_table(report["rows"]))
            for r in results:
                if r["error"]:
                    print(r["label"], r["error"].splitlines()[0] if r["error"] else "")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    if "unsupported" in report:
        print(report["unsupported"], file=sys.stderr)
        return 2
    return 1 if any(r["error"] for r in report["results"]) else 0


if __name__ == "__main__":
    sys.exit(main())
