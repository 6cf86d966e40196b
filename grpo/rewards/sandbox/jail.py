"""One program run in the jail: the bootstrap (``bootstrap.py``) started from here as its ``jail`` stage,
its job on a memfd, the wall clock enforced from outside and nothing left behind; the stdin/stdout tests
on top of it. :mod:`grpo.rewards.sandbox` says what the jail holds.
"""

from __future__ import annotations

import json
import math
import os
import platform
import select
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from .policy import MAX_RESULT_BYTES

DEFAULT_MEMORY_MB = 1024
DEFAULT_FILE_MB = 16
DEFAULT_TMP_MB = 64
MAX_OUTPUT_BYTES = DEFAULT_FILE_MB << 20
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41, "ppc64le": 203, "s390x": 217}
JAIL_FAILED = 97  # see grpo.rewards.sandbox.bootstrap.JAIL_FAILED


@lru_cache(maxsize=1)
def bootstrap_source() -> str:
    return resources.files(__package__).joinpath("bootstrap.py").read_text(encoding="utf-8")


@lru_cache(maxsize=1)
def runtime() -> tuple[str, tuple[str, ...]]:
    """The real interpreter (not a venv shim) and the host paths the jail exposes read-only."""
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    paths = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache",
             prefix, os.path.dirname(os.path.dirname(exe))]
    seen: list[str] = []
    for p in paths:
        if os.path.lexists(p) and p != "/" and not any(p == q or p.startswith(q + "/") for q in seen):
            seen.append(p)
    return exe, tuple(seen)


@dataclass
class RunResult:
    """What one sandboxed run produced. ``error``: the sandbox could not be built (fail closed)."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    results: str = ""
    error: str | None = None
    results_bytes: bytes = b""  # the raw result descriptor (capped), for the judge


def end_group(proc: subprocess.Popen, fds: list, timeout: float) -> bool:
    """Close the parent's copies of the child's descriptors ``fds`` (emptied), wait up to ``timeout``
    seconds for the leader, then kill its whole process group whether or not the leader exited:
    nothing may outlive a run (and the jail's PID 1 dies with its parent, PR_SET_PDEATHSIG).
    The leader is reaped last; True when it exited in time."""
    for fd in fds:
        os.close(fd)
    fds.clear()
    exited = _wait_exit(proc, timeout)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    return exited


def _wait_exit(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait for the process to exit *without reaping it*; False on timeout.

    Keeping the zombie leader around means its process-group id cannot be recycled before we
    have signalled the group.
    """
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        try:
            proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        readable, _, _ = select.select([pidfd], [], [], max(0.0, timeout))
        return bool(readable)
    finally:
        os.close(pidfd)


def _read_capped(f, limit: int = MAX_OUTPUT_BYTES) -> str:
    f.seek(0)
    return f.read(limit).decode("utf-8", errors="replace")


def memfd(data: bytes, name: str) -> int:
    fd = os.memfd_create(name, 0)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def run(code: str, *, mode: str, run_job: dict | None = None, stdin: str | None = None,
        timeout: float = 5.0, memory_mb: int = DEFAULT_MEMORY_MB,
        file_mb: int = DEFAULT_FILE_MB, audit: bool = True, hash_seed: int = 0) -> RunResult:
    """Run ``code`` in the jail. ``mode``: ``"stdio"`` (``stdin`` in, stdout and the exit
    status out) or ``"probes"`` (``run_job`` carries ``tests``, ``nonce`` and ``max_items``:
    the program, then each test's steps; the probe records go to :attr:`RunResult.results`;
    its stdout is discarded: what it prints is nobody's business). ``audit=False`` leaves
    the audit hook out, so tests can check what the OS layers hold alone. ``hash_seed``: the
    run's ``PYTHONHASHSEED`` (the judge's, so that sets iterate alike on both sides).

    ``timeout`` is the wall-clock limit of the whole run, interpreter starts included; the
    process group is killed at that deadline whatever it does.
    """
    if mode not in ("stdio", "probes"):
        raise ValueError(f"mode must be 'stdio' or 'probes', got {mode!r}")
    exe, binds = runtime()
    source = bootstrap_source()
    run_job = dict(run_job or {}, mode=mode, code=code, audit=bool(audit))
    job = {"binds": list(binds), "python": exe, "source": source, "run_job": json.dumps(run_job),
           "memory_bytes": int(memory_mb) << 20, "file_bytes": int(file_mb) << 20,
           "tmp_bytes": DEFAULT_TMP_MB << 20, "cpu_seconds": int(math.ceil(timeout)) + 1,
           "sys_pivot_root": SYS_PIVOT_ROOT.get(platform.machine(), 155),
           "hash_seed": int(hash_seed) % (1 << 32)}
    fds: list[int] = []
    try:
        job_fd = memfd(json.dumps(job).encode(), "job")
        fds.append(job_fd)
        stdin_fd = memfd((stdin or "").encode("utf-8", errors="replace"), "stdin")
        fds.append(stdin_fd)
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
                tempfile.TemporaryFile() as res:
            # Write-only for the sandbox: it must not read back what it (or the harness) wrote.
            res_w = os.open(f"/proc/self/fd/{res.fileno()}", os.O_WRONLY | os.O_APPEND)
            fds.append(res_w)
            proc = subprocess.Popen(
                [exe, "-I", "-S", "-B", "-c", source, "jail", str(job_fd), str(res_w)],
                stdin=stdin_fd, stdout=out if mode == "stdio" else subprocess.DEVNULL, stderr=err,
                pass_fds=(job_fd, res_w), cwd="/",
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, start_new_session=True,
                close_fds=True)
            exited = end_group(proc, fds, timeout)
            res.seek(0)
            raw = res.read(MAX_RESULT_BYTES + 1)
            results = raw[:65536].decode("utf-8", errors="replace")
            error = None
            if proc.returncode == JAIL_FAILED:
                error = next((ln[2:] for ln in results.splitlines() if ln.startswith("E ")),
                             "sandbox could not be built")
            return RunResult(returncode=proc.returncode if exited else None,
                             stdout=_read_capped(out), stderr=_read_capped(err, 65536),
                             timed_out=not exited, results=results, error=error,
                             results_bytes=raw)
    finally:
        for fd in fds:
            os.close(fd)


class SandboxUnavailable(RuntimeError):
    """The jail could not be built on this machine; nothing was run."""


# --------------------------------------------------------------------------------------------
# stdin/stdout tests
# --------------------------------------------------------------------------------------------


def outputs_match(actual: str, expected: str) -> bool:
    """Whole-output comparison, line by line, trailing whitespace and final blank lines ignored."""
    def lines(s: str) -> list[str]:
        out = [ln.rstrip() for ln in s.splitlines()]
        while out and not out[-1]:
            out.pop()
        return out

    return lines(actual) == lines(expected)


def run_stdio_test(code: str, stdin: str, expected: str, *, timeout: float = 5.0, **kw) -> bool:
    """Pass when the program exits 0 within the timeout and prints exactly ``expected``.

    Raises SandboxUnavailable when the jail cannot be built.
    """
    r = run(code, mode="stdio", stdin=stdin, timeout=timeout, **kw)
    if r.error is not None:
        raise SandboxUnavailable(r.error)
    return not r.timed_out and r.returncode == 0 and outputs_match(r.stdout, expected)


def capabilities() -> dict:
    """Whether the jail can be built here: ``{"jail": bool, "error": str | None, "root": bool}``."""
    r = run("pass", mode="stdio", timeout=20.0)
    return {"jail": r.error is None and r.returncode == 0, "error": r.error,
            "root": os.geteuid() == 0}
