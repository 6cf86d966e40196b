"""The SymPy side of ``grpo.rewards.math_equal``: a worker process and the client that drives it.

SymPy parsing and simplification can take unbounded time and memory, so
:func:`grpo.rewards.math_normalize.compare` only ever runs here, in a separate interpreter that the
caller kills when a request outlives its timeout.

* :func:`main` is the worker: ``python -m grpo.rewards.worker PARENT_PID MEMORY_BYTES`` (see
  :data:`LAUNCH` for how the client starts it). It answers JSON lines ``{"p": pred, "g": gold}``
  on stdin with ``{"r": true | false | null}`` on stdout (``null``: the gold answer cannot be
  parsed), after a first ``{"ready": true}``.
* :class:`WorkerPool` is the client: persistent workers, one checked out per call, killed
  (SIGKILL) and replaced when a request times out.

Failures are kept apart: a request that times out or crashes its worker is the answer's fault
(:class:`WorkerError`, scored as "not equal"); a worker that cannot *start* (SymPy missing,
interpreter broken) is the machine's fault (:class:`VerifierUnavailable`): it is logged once and
raised, so that no answer is silently scored wrong.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
import time

from grpo.rewards import math_normalize as _mn

__all__ = ["VerifierUnavailable", "WorkerError", "WorkerPool", "main"]

log = logging.getLogger(__name__)

WORKER_MEMORY = 3 << 30  # RLIMIT_AS of a math worker: room for SymPy, not for a blow-up
STARTUP_TIMEOUT = 120.0  # importing SymPy on a loaded machine; not charged to any request
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# ``python -m grpo.rewards.worker`` would first run grpo/__init__.py (which imports torch) and grpo/rewards/__init__.py: a second
# and useless copy of torch per worker. The launcher registers the ``grpo`` and ``grpo.rewards`` packages
# without running their __init__ and then imports this module by its normal name.
LAUNCH = (
    "import importlib.machinery, importlib.util, sys\n"
    "for name, where in (('grpo', [sys.argv[1]]), ('grpo.rewards', None)):\n"
    "    where = where or sys.modules['grpo'].__path__\n"
    "    spec = importlib.machinery.PathFinder.find_spec(name, where)\n"
    "    sys.modules[name] = importlib.util.module_from_spec(spec)\n"
    "from grpo.rewards.worker import main\n"
    "main(sys.argv[2:])\n"
)


class WorkerError(Exception):
    """The worker died, timed out or said something unreadable; it has been killed."""


class VerifierUnavailable(RuntimeError):
    """No math worker could be started: answers cannot be checked on this machine."""


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


def _limit_memory(max_bytes: int) -> None:
    """Cap the address space so a memory blow-up fails fast instead of swapping."""
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (max_bytes, max_bytes))
    except (ImportError, ValueError, OSError):
        pass


def _watch_parent(parent: int) -> None:
    """Exit when the parent dies even if the main thread is stuck inside SymPy."""

    def loop() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=loop, daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    """Serve comparisons on stdin/stdout until stdin closes. ``argv``: parent pid, memory bytes."""
    args = sys.argv[1:] if argv is None else argv
    parent_pid, memory_bytes = int(args[0]), int(args[1])
    # The protocol owns the real stdout; anything a library prints goes to stderr instead.
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    _watch_parent(parent_pid)
    _mn.load_parsers()
    _mn.compare(r"\frac{1}{2}", r"\sqrt{x}")  # warm the parser's caches before saying ready
    _limit_memory(memory_bytes)
    sys.setrecursionlimit(10_000)
    proto.write('{"ready": true}\n')
    for line in sys.stdin:
        try:
            req = json.loads(line)
            result = _mn.compare(req["p"], req["g"])
        except MemoryError:
            result = False
        except Exception:  # noqa: BLE001 - the protocol must always answer
            result = False
        proto.write(json.dumps({"r": result}) + "\n")


# --------------------------------------------------------------------------------------------
# Client side
# --------------------------------------------------------------------------------------------


class _Worker:
    """One persistent SymPy process speaking JSON lines over its stdin/stdout."""

    def __init__(self) -> None:
        # subprocess = fork+exec in C: safe from any thread, and the child is a fresh
        # interpreter, so neither torch's threads nor the trainer's __main__ come along.
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-B", "-c", LAUNCH, _PACKAGE_ROOT, str(os.getpid()),
                 str(WORKER_MEMORY)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                close_fds=True, start_new_session=True)
        except OSError as e:
            raise VerifierUnavailable(f"cannot start the math worker: {e}") from e
        self._buf = b""
        try:
            ready = self._read_line(time.monotonic() + STARTUP_TIMEOUT)
        except WorkerError as e:
            err = self._stderr_tail()
            self.kill()
            raise VerifierUnavailable(f"math worker failed to start ({e}): {err}") from e
        if not ready.get("ready"):
            self.kill()
            raise VerifierUnavailable("math worker did not say ready")
        self.proc.stderr.close()  # from now on a chatty library must not fill the pipe
        self.proc.stderr = None

    def _stderr_tail(self) -> str:
        try:
            self.proc.kill()
            self.proc.wait(timeout=5)
            return self.proc.stderr.read()[-2000:].decode("utf-8", "replace").strip()
        except (OSError, ValueError, subprocess.TimeoutExpired):
            return ""

    def _read_line(self, deadline: float) -> dict:
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError("timeout")
            readable, _, _ = select.select([fd], [], [], left)
            if readable:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise WorkerError("worker exited")
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        try:
            return json.loads(line)
        except ValueError as e:
            raise WorkerError("bad reply") from e

    def ask(self, pred: str, gold: str, timeout: float) -> bool | None:
        """Send one comparison; raises WorkerError (after killing the worker) on any failure."""
        deadline = time.monotonic() + timeout
        try:
            self.proc.stdin.write(json.dumps({"p": pred, "g": gold}).encode() + b"\n")
            self.proc.stdin.flush()
            reply = self._read_line(deadline)
        except (OSError, ValueError, WorkerError) as e:
            self.kill()
            raise WorkerError(str(e)) from e
        return reply.get("r")

    def kill(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass


class WorkerPool:
    """Up to ``size`` workers; a call checks one out, so concurrent threads never share one."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(size)
        self._start_failure_logged = False
        self._closed = False

    def compare(self, pred: str, gold: str, timeout: float) -> bool | None:
        """Worker verdict. Raises WorkerError (timeout, crash) or VerifierUnavailable (no start)."""
        with self._slots:
            with self._lock:
                worker = self._idle.pop() if self._idle else None
            if worker is None:
                try:
                    worker = _Worker()
                except VerifierUnavailable as e:
                    with self._lock:
                        first, self._start_failure_logged = not self._start_failure_logged, True
                    if first:
                        log.error("grpo.rewards: %s; math answers are unscorable", e)
                    raise
                with self._lock:
                    self._all.add(worker)
            try:
                result = worker.ask(pred, gold, timeout)
            except WorkerError:
                with self._lock:
                    self._all.discard(worker)
                # Start the replacement now, in the background: the next call then finds a
                # warm worker instead of waiting for SymPy to import.
                threading.Thread(target=self._replenish, daemon=True).start()
                raise
            with self._lock:
                self._idle.append(worker)
            return result

    def _replenish(self) -> None:
        try:
            worker = _Worker()
        except Exception:  # noqa: BLE001 - the next call starts (and reports) its own
            return
        with self._lock:
            if len(self._all) < self.size and not self._closed:
                self._all.add(worker)
                self._idle.append(worker)
                return
        worker.kill()

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            workers, self._all, self._idle = list(self._all), set(), []
        for w in workers:
            w.kill()


if __name__ == "__main__":
    main()
