"""Run untrusted Python from model completions in a contained child process.

Each run is a fresh ``python -I -B`` started with ``subprocess`` (fork+exec in C, safe from any
thread). A small bootstrap runs first, while it may still hold privileges, and then executes
the completion. Layers, outermost first (each one is tried; what applied is reported in
:attr:`RunResult.features`):

* **Process group + wall clock.** The child leads a new session; on timeout the parent sends
  SIGKILL to the whole group. The leader is not reaped until the group has been killed, so its
  group id cannot be reused meanwhile. ``RLIMIT_CPU`` backs this up if the parent dies.
* **Network.** A new network namespace (``unshare(CLONE_NEWNET)``; as non-root, together with a
  user namespace): no interface but a down loopback, so nothing can be reached.
* **Filesystem.** A fresh working directory. As root: a private mount namespace with new,
  size-capped tmpfs on ``/tmp``, ``/var/tmp`` and ``/dev/shm``, and the code runs as user
  ``nobody`` (65534), which cannot write, delete or chmod anything root owns. ``RLIMIT_FSIZE``
  caps every file, stdout included.
* **Resources.** ``RLIMIT_AS`` (memory), ``RLIMIT_NPROC = 0`` (no new processes: enforced for
  non-root users, hence the switch to ``nobody``; it also forbids threads), ``RLIMIT_NOFILE``,
  ``RLIMIT_CORE = 0``; stdin is ``/dev/null`` unless the test supplies input.
* **Audit hook** (``sys.addaudithook``, cannot be removed from Python): refuses process
  creation, sockets, ctypes, signals, tracing and frame / gc introspection, and file writes,
  deletions and renames outside the working directory. It is a second layer, not the boundary:
  it also protects machines where the OS layers are unavailable.

Results of assert tests travel on a separate file descriptor, each line tagged with a random
nonce that only the bootstrap's local variables hold (reaching them needs the frame access the
audit hook refuses), so printing or exiting early cannot fake a pass.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

NOBODY = 65534
DEFAULT_MEMORY_MB = 1024
DEFAULT_FILE_MB = 16
MAX_OUTPUT_BYTES = DEFAULT_FILE_MB << 20

# The bootstrap runs as ``python -I -B -c BOOTSTRAP job.json``. Everything lives inside _main()
# so that no secret sits in module globals that the untrusted code could import.
_BOOTSTRAP = r'''
def _main():
    import builtins, json, os, sys, resource
    job_path = sys.argv[1]
    with open(job_path) as f:
        job = json.load(f)
    try:
        os.unlink(job_path)
    except OSError:
        pass
    nonce, rfd = job["nonce"], job["result_fd"]
    write, compile_, exec_, enc = os.write, builtins.compile, builtins.exec, str.encode
    feats = {"netns": False, "mountns": False, "private_tmp": False, "nobody": False}
    is_root = os.geteuid() == 0
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        NEWNET, NEWNS, NEWUSER = 0x40000000, 0x00020000, 0x10000000
        if is_root:
            feats["netns"] = libc.unshare(NEWNET) == 0
            feats["mountns"] = libc.unshare(NEWNS) == 0
            # Private propagation first: otherwise the tmpfs below would appear on the host.
            MS_REC, MS_PRIVATE, MS_NOSUID, MS_NODEV = 16384, 1 << 18, 2, 4
            if feats["mountns"] and libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) == 0:
                ok = True
                for d in (b"/tmp", b"/var/tmp", b"/dev/shm"):
                    if os.path.isdir(d):
                        ok &= libc.mount(b"tmpfs", d, b"tmpfs", MS_NOSUID | MS_NODEV,
                                         b"size=64m,mode=1777") == 0
                feats["private_tmp"] = ok
                if ok:
                    _expose_sys_path(libc)
        else:
            feats["netns"] = libc.unshare(NEWUSER | NEWNET) == 0
    except Exception:
        pass
    workdir = job["workdir"]  # already the cwd; its parent is 0700, so never chdir by path
    if feats["private_tmp"]:
        workdir = "/tmp/sandbox"
        os.mkdir(workdir, 0o700)
        os.chown(workdir, job["uid"], job["uid"])
        os.chdir(workdir)
    mem = job["memory_bytes"]
    for name, value in (("RLIMIT_AS", mem), ("RLIMIT_FSIZE", job["file_bytes"]),
                        ("RLIMIT_CORE", 0), ("RLIMIT_NOFILE", 64),
                        ("RLIMIT_CPU", job["cpu_seconds"]), ("RLIMIT_NPROC", 0)):
        try:
            resource.setrlimit(getattr(resource, name), (value, value))
        except (ValueError, OSError, AttributeError):
            pass
    if is_root:
        try:
            os.setgroups([])
            os.setgid(job["uid"])
            os.setuid(job["uid"])
            feats["nobody"] = True
        except OSError:
            pass
    os.environ.update(HOME=workdir, TMPDIR=workdir)
    feats["audit"] = bool(job["audit"])
    write(rfd, enc(nonce + " F " + json.dumps(feats) + "\n"))  # rfd is write-only
    code, tests, mode = job["code"], job["tests"], job["mode"]
    if job["audit"]:
        sys.addaudithook(_make_hook(os.path.realpath(workdir), job["private"]))
    del job
    if mode == "stdio":
        glb = {"__name__": "__main__", "__builtins__": builtins}
        status = 0
        try:
            exec_(compile_(code, "solution.py", "exec"), glb)
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException as e:
            _report(e)
            status = 1
        try:
            sys.stdout.flush()
        except BaseException:
            status = 1
        os._exit(status)
    glb = {"__name__": "solution", "__builtins__": builtins}
    try:
        exec_(compile_(code, "solution.py", "exec"), glb)
    except BaseException as e:
        _report(e)
        os._exit(1)
    for i, test in enumerate(tests):
        ok = False
        try:
            exec_(compile_(test, "<test %d>" % i, "exec"), glb)
            ok = True
        except BaseException as e:
            _report(e)
        write(rfd, enc("%s T %d %d\n" % (nonce, i, ok)))
    os._exit(0)


def _expose_sys_path(libc):
    # The interpreter may live where "nobody" cannot read (e.g. under /root): bind-mount every
    # such import directory read-only into the private /tmp and import from there instead.
    import os, sys
    MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC = 1, 32, 4096, 16384

    def world_readable(path):
        cur = "/"
        try:
            for comp in os.path.realpath(path).split("/")[1:]:
                if not os.stat(cur).st_mode & 0o001:
                    return False
                cur = os.path.join(cur, comp)
            return os.stat(cur).st_mode & 0o005 == 0o005
        except OSError:
            return False

    os.mkdir("/tmp/.imports", 0o755)
    moved = {}
    for i, entry in enumerate(sys.path):
        if entry and os.path.isdir(entry) and not world_readable(entry):
            dst = "/tmp/.imports/%d" % i
            os.mkdir(dst, 0o755)
            if libc.mount(os.fsencode(entry), os.fsencode(dst), None, MS_BIND | MS_REC, None) == 0:
                libc.mount(None, os.fsencode(dst), None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)
                moved[entry.rstrip("/")] = dst

    def remap(path):
        for src, dst in moved.items():
            if path == src or path.startswith(src + "/"):
                return dst + path[len(src):]
        return path

    sys.path[:] = [remap(p) for p in sys.path]
    for mod in list(sys.modules.values()):  # packages already imported (collections, encodings)
        search = getattr(mod, "__path__", None)
        if isinstance(search, list):
            search[:] = [remap(p) for p in search]
    sys.path_importer_cache.clear()


def _report(e):
    import sys
    try:
        sys.stderr.write("%s: %s\n" % (type(e).__name__, e))
        sys.stderr.flush()
    except BaseException:
        pass


def _make_hook(root, private):
    import os
    realpath, sep = os.path.realpath, os.sep
    WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    # Frame access (sys._getframe, f_code) stays allowed: namedtuple and warnings need it.
    BLOCKED = {"os.system", "os.fork", "os.forkpty", "os.posix_spawn", "os.posix_spawnp",
               "os.kill", "os.killpg", "signal.pthread_kill", "sys._current_frames",
               "sys.setprofile", "sys.settrace", "gc.get_objects", "gc.get_referrers",
               "gc.get_referents", "os.startfile", "pty.spawn", "webbrowser.open",
               "os.chroot", "os.setns", "os.unshare"}
    PREFIXES = ("socket.", "ctypes.", "subprocess.", "os.exec", "os.spawn", "resource.",
                "_posixsubprocess.", "http.", "urllib.", "ftplib.", "smtplib.", "telnetlib.")
    PATH_ARGS = {"os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1), "os.mkdir": (0,),
                 "os.symlink": (0, 1), "os.link": (0, 1), "os.truncate": (0,), "os.chmod": (0,),
                 "os.chown": (0,), "os.utime": (0,), "os.chflags": (0,), "os.lchflags": (0,),
                 "os.setxattr": (0,), "os.removexattr": (0,), "os.mkfifo": (0,),
                 "os.mknod": (0,), "shutil.rmtree": (0,), "shutil.copyfile": (1,),
                 "shutil.copytree": (1,), "shutil.move": (0, 1), "os.chdir": ()}

    def inside(path):
        if isinstance(path, int):
            return True  # an already-open descriptor: opening it was checked
        try:
            p = os.fsdecode(path)
            rp = realpath(p)
        except Exception:
            return False
        return rp == root or rp.startswith(root + sep) or rp == "/dev/null"

    def secret(path):
        # The harness's own files (results, job) and re-opening descriptors via /proc.
        try:
            p = realpath(os.fsdecode(path))
        except Exception:
            return True
        if p.startswith(("/proc/", "/dev/fd/")) and "/fd/" in p:
            return True
        return (p == private or p.startswith(private + sep)) and not (
            p == root or p.startswith(root + sep))

    def hook(event, args):
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            if not isinstance(path, int) and secret(path):
                raise PermissionError("sandbox: harness file")
            writing = (mode is not None and any(c in str(mode) for c in "wax+")) or (
                isinstance(flags, int) and flags & WRITE_FLAGS)
            if writing and not inside(path):
                raise PermissionError("sandbox: writing outside the working directory")
        elif event in BLOCKED or event.startswith(PREFIXES):
            if event.startswith("ctypes."):
                raise ImportError("sandbox: ctypes is not available")
            raise PermissionError("sandbox: %s is not allowed" % event)
        elif event in PATH_ARGS:
            for i in PATH_ARGS[event]:
                if i < len(args) and not inside(args[i]):
                    raise PermissionError("sandbox: %s outside the working directory" % event)

    return hook


_main()
'''


@dataclass
class RunResult:
    """What one sandboxed run produced."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    tests_passed: list[bool] = field(default_factory=list)
    features: dict = field(default_factory=dict)


def _child_env(workdir: str) -> dict[str, str]:
    # A clean environment: the trainer's variables (tokens, paths) are none of the code's business.
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "HOME": workdir, "TMPDIR": workdir, "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


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


def run(code: str, *, mode: str, tests: list[str] | None = None, stdin: str | None = None,
        timeout: float = 5.0, memory_mb: int = DEFAULT_MEMORY_MB, file_mb: int = DEFAULT_FILE_MB,
        audit: bool = True) -> RunResult:
    """Run ``code`` in the sandbox; ``mode`` is ``"asserts"`` (run ``tests`` after it) or ``"stdio"``.

    ``timeout`` is the wall-clock limit of the whole run, interpreter start included.
    """
    root = tempfile.mkdtemp(prefix="grpo-sandbox-")  # 0700: the child's files live in work/
    is_root = os.geteuid() == 0
    try:
        work = os.path.join(root, "work")
        os.mkdir(work, 0o700)
        if is_root:
            os.chown(work, NOBODY, NOBODY)
        nonce = secrets.token_hex(16)
        job_path = os.path.join(root, "job.json")
        res_path = os.path.join(root, "results")
        # Write-only for the child: it must not read back the nonce it was given.
        res_fd = os.open(res_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with open(os.path.join(root, "stdout"), "w+b") as out, \
                open(os.path.join(root, "stderr"), "w+b") as err, \
                open(res_fd, "wb") as res:
            with open(os.open(job_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                json.dump({"nonce": nonce, "code": code, "tests": list(tests or []),
                           "mode": mode, "workdir": work, "uid": NOBODY,
                           "memory_bytes": int(memory_mb) << 20, "file_bytes": int(file_mb) << 20,
                           "audit": bool(audit), "cpu_seconds": int(timeout) + 2,
                           "result_fd": res.fileno(), "private": os.path.realpath(root)}, f)
            stdin_f = subprocess.DEVNULL
            if stdin is not None:
                in_path = os.path.join(root, "stdin")
                with open(in_path, "wb") as f:
                    f.write(stdin.encode("utf-8", errors="replace"))
                stdin_f = open(in_path, "rb")
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-B", "-c", _BOOTSTRAP, job_path],
                    stdin=stdin_f, stdout=out, stderr=err, pass_fds=(res.fileno(),),
                    cwd=work, env=_child_env(work), start_new_session=True, close_fds=True)
            finally:
                if stdin is not None:
                    stdin_f.close()
            exited = _wait_exit(proc, timeout)
            # Kill the whole group whether or not the leader exited: nothing may outlive a run.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
            with open(res_path, "rb") as f:
                passed, features = _parse_results(_read_capped(f), nonce, len(tests or []))
            return RunResult(returncode=None if not exited else proc.returncode,
                             stdout=_read_capped(out), stderr=_read_capped(err, 65536),
                             timed_out=not exited, tests_passed=passed, features=features)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _parse_results(text: str, nonce: str, n_tests: int) -> tuple[list[bool], dict]:
    """Only lines carrying this run's nonce count; a test without a line failed."""
    passed = [False] * n_tests
    features: dict = {}
    for line in text.splitlines():
        parts = line.split(" ", 2)
        if len(parts) < 3 or parts[0] != nonce:
            continue
        if parts[1] == "F":
            try:
                features = json.loads(parts[2])
            except ValueError:
                pass
        elif parts[1] == "T":
            idx, _, ok = parts[2].partition(" ")
            if idx.isdigit() and int(idx) < n_tests and ok.strip() == "1":
                passed[int(idx)] = True
    return passed, features


def run_asserts(code: str, tests: list[str], *, timeout: float = 5.0, **kw) -> list[bool]:
    """Per-test pass flags for assert-style tests run after ``code`` in one process."""
    return run(code, mode="asserts", tests=tests, timeout=timeout, **kw).tests_passed


def outputs_match(actual: str, expected: str) -> bool:
    """Whole-output comparison, line by line, trailing whitespace and final blank lines ignored."""
    def lines(s: str) -> list[str]:
        out = [ln.rstrip() for ln in s.splitlines()]
        while out and not out[-1]:
            out.pop()
        return out

    return lines(actual) == lines(expected)


def run_stdio_test(code: str, stdin: str, expected: str, *, timeout: float = 5.0, **kw) -> bool:
    """Pass when the program exits 0 within the timeout and prints exactly ``expected``."""
    r = run(code, mode="stdio", stdin=stdin, timeout=timeout, **kw)
    return not r.timed_out and r.returncode == 0 and outputs_match(r.stdout, expected)


def capabilities() -> dict:
    """Which containment layers work on this machine (runs a trivial program)."""
    return run("pass", mode="asserts", tests=[], timeout=10.0).features
