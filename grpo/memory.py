"""The process's resident memory phase by phase, and giving freed heap back to the OS (glibc).

:class:`PhaseMemory` gives the trainer's log its ``memory/<phase>_mb`` fields: the peak resident set
(MiB) of each phase of a step (generation, scoring, old/ref log-probs, forward + loss + backward,
optimizer, checkpoint save; and, once, the set-up: from the process's start to the first step). On Linux a phase's peak is ``VmHWM`` of ``/proc/self/status`` at its
end after the high-water mark was reset at its start (``echo 5 > /proc/self/clear_refs``,
proc(5)): two small file operations per phase. Resetting the mark also resets what ``getrusage``
reports as ``ru_maxrss`` (and what a parent's ``wait4`` sees at exit), so the tracker keeps the
process's peak itself (:attr:`PhaseMemory.process_peak_mb`) and :meth:`PhaseMemory.restore` raises the
mark back to it at the end of a run by touching that many fresh pages, freed at once: measurements of
the whole process (``/usr/bin/time``, ``ru_maxrss``) read what they would have read without the resets.
The restore's cost is one pass over the pages between the resident set at the end and the peak, so the
tracker resets only in a process whose peak so far is within :data:`RESET_SLACK` of its resident set
when the tracker starts (a fresh ``python -m grpo train``); in one that freed a larger earlier workload
(a notebook, a test session) the restore would touch all of that again. There, and where the mark
cannot be reset (not Linux, no permission), each phase's value is the process's peak so far
(``per_phase`` False), which still names the phase that raised it; without ``/proc`` there are no
fields at all.

Freed memory (``release_memory``, glibc only; a no-op elsewhere): glibc keeps the heap a program frees
for its next allocations, so a phase's peak includes what earlier phases freed but did not give back.
``malloc_trim(0)`` at a phase's end returns the free pages of every arena (``"phases"``);
``mallopt(M_MMAP_THRESHOLD, 64 KiB)`` and ``M_TRIM_THRESHOLD`` make every buffer of 64 KiB or more its
own mapping, returned on ``free`` (``"always"``, the effect of ``MALLOC_MMAP_THRESHOLD_=65536``): the
lowest peaks, paid for with page faults on every large allocation. Both are glibc's (mallopt(3),
malloc_trim(3)). benchmarks/results/lora_memory-cpu-20261202.md measures both.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from typing import Optional

STATUS = "/proc/self/status"
CLEAR_REFS = "/proc/self/clear_refs"
RELEASE_POLICIES = ("never", "phases", "always")  # GRPOConfig.release_memory's choices
# reset the high-water mark only while the process's peak so far is at most this fraction above its resident set
RESET_SLACK = 0.25
MMAP_THRESHOLD_BYTES = 64 * 1024  # "always": buffers from this size on are mapped alone and unmapped on free
# mallopt(3)'s parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def status_kib(field: str, path: Optional[str] = None) -> Optional[int]:
    """A ``kB`` field of ``/proc/self/status`` (``VmHWM``, ``VmRSS``) or of another such file (``VmRSS`` of
    ``/proc/PID/status``, ``MemAvailable`` of ``/proc/meminfo``), or None where there is none."""
    try:
        with open(path or STATUS) as f:
            return next((int(line.split()[1]) for line in f if line.startswith(field + ":")), None)
    except (OSError, ValueError, IndexError):
        return None


def reset_peak() -> bool:
    """Reset the resident set's high-water mark to the current resident set; False where it cannot be."""
    try:
        with open(CLEAR_REFS, "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _glibc() -> Optional[ctypes.CDLL]:
    """The C library when it is glibc (it has ``malloc_trim`` and ``mallopt``), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if all(hasattr(libc, name) for name in ("gnu_get_libc_version", "malloc_trim", "mallopt")) else None


GLIBC = _glibc()


def trim_heap() -> bool:
    """``malloc_trim(0)``: give every arena's free pages back to the OS; False where there is no glibc."""
    return bool(GLIBC is not None and GLIBC.malloc_trim(0) >= 0)


def map_large_buffers(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """``mallopt``: buffers of ``threshold`` bytes and more are mapped on their own (and unmapped on free),
    and the heap's free top is trimmed from ``threshold`` bytes on. Process-wide from then on (glibc has no
    getter to restore the earlier setting); False where there is no glibc."""
    if GLIBC is None:
        return False
    return bool(GLIBC.mallopt(M_MMAP_THRESHOLD, threshold)) and bool(GLIBC.mallopt(M_TRIM_THRESHOLD, threshold))


class PhaseMemory:
    """Peak resident memory (MiB) of each phase of a step, and of the process.

    ``mark(phase)`` closes a phase: its peak since the previous mark (the first: since the process
    started) becomes ``memory/<phase>_mb`` (a phase met twice in a step, e.g. forward + backward and
    optimizer with ``num_iterations`` > 1, keeps its larger peak); then, with ``release`` "phases" or
    "always", the heap's free pages go back to the OS, so that the next phase starts without them.
    ``record()`` returns the step's fields and starts the next step's. ``reset`` False: never reset the
    mark (a caller measuring the whole span itself, e.g. a benchmark, keeps an untouched ``VmHWM``).
    """

    def __init__(self, release: str = "never", reset: bool = True) -> None:
        if release not in RELEASE_POLICIES:
            raise ValueError(f"release must be one of {RELEASE_POLICIES}, got {release!r}")
        self.release = release
        peak = status_kib("VmHWM")
        self.available = peak is not None
        self.process_peak_kib = peak or 0
        fresh = peak is not None and peak <= (1 + RESET_SLACK) * (status_kib("VmRSS") or 0)
        self.per_phase = fresh and reset and reset_peak()
        self.phases: dict[str, float] = {}
        if release == "always":
            map_large_buffers()

    def mark(self, phase: str) -> None:
        """Close ``phase``: record its peak, give freed heap back (``release``), reset the mark."""
        peak = status_kib("VmHWM") if self.available else None
        if peak is not None:
            self.process_peak_kib = max(self.process_peak_kib, peak)
            key = f"memory/{phase}_mb"
            self.phases[key] = max(self.phases.get(key, 0.0), peak / 1024)
        if self.release != "never":
            trim_heap()
        if self.per_phase:
            reset_peak()

    @property
    def process_peak_mb(self) -> float:
        """The process's peak resident set so far (MiB), across the resets."""
        return self.process_peak_kib / 1024

    def record(self) -> dict[str, float]:
        """This step's ``memory/<phase>_mb`` fields (and ``memory/per_phase``); the next step starts afresh."""
        if not self.available:
            return {}
        out, self.phases = {**self.phases, "memory/per_phase": self.per_phase}, {}
        return out

    def __enter__(self) -> "PhaseMemory":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def restore(self) -> None:
        """Raise the high-water mark (and so ``ru_maxrss``) back to the process's peak: touch the pages
        between the current resident set and the peak once, then unmap them."""
        if not self.per_phase:
            return
        self.mark("restore")  # (the peak since the last mark counts too)
        self.phases.pop("memory/restore_mb", None)
        missing = self.process_peak_kib - (status_kib("VmRSS") or self.process_peak_kib)
        if missing <= 0:
            return
        pages = mmap.mmap(-1, missing * 1024)
        view = (ctypes.c_char * (missing * 1024)).from_buffer(pages)
        ctypes.memset(view, 1, missing * 1024)
        del view  # (mmap refuses to close while a ctypes view exports it)
        pages.close()
