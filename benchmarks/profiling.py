"""Peak extra memory of a call, on a GPU (CUDA allocator stats) or a CPU (PyTorch profiler)."""

from __future__ import annotations

import gc
from typing import Callable, Tuple

import torch


def cuda_peak_extra_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """max_memory_allocated during ``fn`` minus what was allocated before it."""
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def cpu_peak_extra_bytes(fn: Callable[[], object]) -> Tuple[int, str]:
    """(peak bytes, method): the peak of the running sum of the CPU allocator's events.

    The profiler (``profile_memory=True``) records every allocation and free with its size and time;
    in time order their running sum is the memory held above what existed when profiling began.
    """
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []
    method = "torch.profiler memory events (kineto)"
    try:
        for e in prof.profiler.kineto_results.events():
            if e.name() == "[memory]" and str(e.device_type()).endswith("CPU"):
                events.append((e.start_ns(), int(e.nbytes())))
    except Exception:
        events = []
    if not events:
        # Profiler builds without kineto memory records: top-level function events carry the memory
        # each op allocated net of frees; a coarser running sum.
        method = "torch.profiler function events (coarse)"
        for e in prof.profiler.function_events:
            if e.cpu_parent is None or e.name == "[memory]":
                events.append((e.time_range.start, int(e.cpu_memory_usage)))
    events.sort(key=lambda x: x[0])
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return peak, method
