"""grpo.memory: phase peaks from the resident set's high-water mark, and the glibc release policies.

The measurements run in a fresh interpreter that imports only ``grpo/memory.py`` (loaded from its path:
no torch), so that resetting the high-water mark and the process-wide malloc settings never touch
the test session's own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from grpo import memory
from grpo.config import GRPOConfig

MEMORY_PY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "grpo", "memory.py")
LINUX_PEAKS = pytest.mark.skipif(not (os.path.exists(memory.STATUS) and os.access(memory.CLEAR_REFS, os.W_OK)),
                                 reason="needs Linux /proc/self/status and a writable /proc/self/clear_refs")
GLIBC = pytest.mark.skipif(memory.GLIBC is None, reason="needs glibc (malloc_trim, mallopt)")
MIB = 2**20


def run_fresh(body: str) -> dict:
    """``body`` in a fresh interpreter with ``m`` = grpo/memory.py loaded from its file; its last stdout line as JSON."""
    script = textwrap.dedent("""
        import ctypes, importlib.util, json, resource, sys
        spec = importlib.util.spec_from_file_location("m", sys.argv[1])
        m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
        rss = lambda: m.status_kib("VmRSS") / 1024
        maxrss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        def touched(mib):  # a buffer whose every page is written (resident)
            return bytearray(b"\\1") * (mib * 2**20)
    """) + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script, MEMORY_PY], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@LINUX_PEAKS
def test_each_phase_gets_its_own_peak_and_the_process_peak_survives_the_resets():
    """A 96 MiB phase then an 8 MiB one: each phase's value is its own peak (the second is not the
    first's), ``process_peak_mb`` is the larger, the resets did lower the mark (and ``ru_maxrss`` with
    it: why ``restore`` exists) and ``restore`` raises both back to the process's peak."""
    out = run_fresh("""
        p = m.PhaseMemory()
        start = rss()
        big = touched(96); del big
        p.mark("big")
        small = touched(8)
        p.mark("small")
        lowered = m.status_kib("VmHWM") / 1024
        p.restore()
        print(json.dumps({"start": start, **p.record(), "peak": p.process_peak_mb, "lowered": lowered,
                          "restored": m.status_kib("VmHWM") / 1024, "maxrss": maxrss()}))
    """)
    assert out["memory/per_phase"] is True
    assert out["memory/big_mb"] >= out["start"] + 90, out
    assert out["start"] + 4 <= out["memory/small_mb"] <= out["start"] + 30, out
    assert out["peak"] == pytest.approx(out["memory/big_mb"], abs=0.01)
    assert out["lowered"] < out["peak"] - 50, out
    assert out["peak"] - 1 <= out["restored"] <= out["peak"] + 8, out
    assert out["maxrss"] >= out["peak"] - 1, out  # (a child's ru_maxrss starts at its parent's: no upper bound)


@LINUX_PEAKS
def test_without_resets_the_mark_is_left_alone_and_each_phase_gets_the_process_peak():
    out = run_fresh("""
        p = m.PhaseMemory(reset=False)
        big = touched(64); del big
        p.mark("big")
        p.mark("after")
        print(json.dumps({**p.record(), "hwm": m.status_kib("VmHWM") / 1024}))
    """)
    assert out["memory/per_phase"] is False
    assert out["memory/after_mb"] == out["memory/big_mb"] == pytest.approx(out["hwm"], abs=0.5)


@LINUX_PEAKS
def test_a_process_that_freed_a_larger_workload_is_not_reset():
    """Its peak is far above its resident set: a restore would touch all of that again, so the tracker
    leaves the mark alone (``per_phase`` False)."""
    out = run_fresh("""
        big = touched(128); del big
        hwm = m.status_kib("VmHWM")
        p = m.PhaseMemory()
        print(json.dumps({"per_phase": p.per_phase, "kept": m.status_kib("VmHWM") >= hwm}))
    """)
    assert out == {"per_phase": False, "kept": True}


@GLIBC
@pytest.mark.parametrize("policy", ["never", "phases", "always"])
def test_release_policies_give_a_fragmented_heap_back(policy):
    """200 buffers of 100 KiB (under glibc's default mmap threshold: heap), every other one freed: the
    heap keeps the holes ("never"); "phases" returns them at the phase's end (malloc_trim), "always"
    already on free (each buffer its own mapping)."""
    out = run_fresh(f"""
        libc = m.GLIBC
        libc.malloc.restype = ctypes.c_void_p
        libc.free.argtypes = [ctypes.c_void_p]
        p = m.PhaseMemory({policy!r}, reset=False)
        bufs = [libc.malloc(100 * 1024) for _ in range(200)]
        for b in bufs:
            ctypes.memset(b, 1, 100 * 1024)
        full = rss()
        for b in bufs[::2]:
            libc.free(b)
        freed = rss()
        p.mark("phase")
        print(json.dumps({{"full": full, "freed": freed, "marked": rss()}}))
    """)
    held = out["full"] - out["marked"]
    if policy == "never":
        assert held < 3, out
    else:
        assert held > 8, out
    if policy == "always":
        assert out["full"] - out["freed"] > 8, out


def test_without_proc_there_are_no_fields_and_nothing_fails(monkeypatch, tmp_path):
    monkeypatch.setattr(memory, "STATUS", str(tmp_path / "no-status"))
    monkeypatch.setattr(memory, "CLEAR_REFS", str(tmp_path / "no-dir" / "clear_refs"))
    p = memory.PhaseMemory(reset=True)
    p.mark("generation")
    p.restore()
    assert not p.available and not p.per_phase and p.record() == {}


def test_release_policy_is_checked_by_name():
    with pytest.raises(ValueError, match="release"):
        memory.PhaseMemory("sometimes")
    with pytest.raises(ValueError, match="release_memory"):
        GRPOConfig(release_memory="sometimes")
    assert set(memory.RELEASE_POLICIES) >= {GRPOConfig().release_memory}
