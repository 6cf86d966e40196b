"""The machine a benchmark ran on, and its two ceilings: copy bandwidth and matmul rate.

    python -m benchmarks.machine --out env.json     # writes machine + versions + date + ceilings

Copy bandwidth is ``2 * bytes / time`` of ``dst.copy_(src)`` (one read and one write per byte),
best of several; the matmul rate is ``2 * n^3 / time`` of a square matmul in the benchmark dtype,
best of several. On a GPU both are timed with CUDA events. Only stdlib + torch are used, so the
script runs with whatever torch the machine has.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import time
from typing import Optional

import torch


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except Exception:  # pragma: no cover - lscpu missing
        pass
    return platform.processor() or platform.machine()


def versions() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:  # pragma: no cover
        info["triton"] = None
    try:
        import liger_kernel  # noqa: F401
        from importlib.metadata import version

        info["liger_kernel"] = version("liger-kernel")
    except Exception:
        info["liger_kernel"] = None
    try:
        from importlib.metadata import version

        info["trl"] = version("trl")
    except Exception:
        info["trl"] = None
    return info


def machine_info() -> dict:
    """CPU model and count, GPU name and memory (when present), versions, date (UTC)."""
    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        **versions(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu_name"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
        info["device"] = "cuda"
    else:
        info["gpu_name"] = None
        info["device"] = "cpu"
    return info


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up (allocations, cuBLAS handles)
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth_gbps(device: Optional[torch.device] = None, nbytes: Optional[int] = None, repeats: int = 10) -> float:
    """Best-of-``repeats`` device copy bandwidth in GB/s (1e9 bytes), counting read + write."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if nbytes is None:
        nbytes = 4 * 2**30 if device.type == "cuda" else 256 * 2**20
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    t = _best_time(lambda: dst.copy_(src), device, repeats if device.type == "cuda" else max(3, repeats // 3))
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes / t / 1e9


def matmul_tflops(device: Optional[torch.device] = None, dtype: torch.dtype = torch.bfloat16, n: Optional[int] = None, repeats: int = 10) -> float:
    """Best-of-``repeats`` rate of an ``n x n x n`` matmul in TFLOP/s (2 n^3 flops)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if n is None:
        n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = _best_time(lambda: a @ b, device, repeats if device.type == "cuda" else 3)
    return 2 * n**3 / t / 1e12


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the JSON here (default: print)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="matmul dtype")
    parser.add_argument("--no-ceilings", action="store_true", help="skip the bandwidth and matmul measurements")
    args = parser.parse_args(argv)
    info = machine_info()
    if not args.no_ceilings:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
        if info["device"] == "cpu" and dtype != torch.float32:
            dtype = torch.float32  # CPU bf16 matmuls are not representative
        info["copy_gbps"] = round(copy_bandwidth_gbps(), 1)
        info["matmul_tflops"] = round(matmul_tflops(dtype=dtype), 2)
        info["matmul_dtype"] = str(dtype).replace("torch.", "")
    text = json.dumps(info, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
