"""The program that ``grpo.rewards.sandbox`` runs to contain one untrusted Python run.

It is not imported: ``grpo.rewards.sandbox`` reads this file with ``importlib.resources`` and passes it
to ``python -I -S -B -c SOURCE STAGE ...``, once per stage, so it depends on the standard
library only and must not rely on module globals to keep secrets (the untrusted code can
``import __main__``). Two stages:

``jail`` (trusted, outside): reads the job from an inherited descriptor, creates new mount,
PID, network, IPC and UTS namespaces (plus a user namespace when not root), forks the future
PID 1 of the new PID namespace and waits for it. That child builds the filesystem view -- a
fresh tmpfs root holding read-only, nosuid bind mounts of the Python runtime and system
libraries only, a minimal ``/dev``, no ``/proc``, and a size-capped ``/tmp`` that is the
working directory -- pivots into it, sets resource limits, drops every
privilege (setuid to 65534 as root; an unmapped, capability-free user after ``execve`` in a
user namespace; ``no_new_privs`` always) and ``execve``s the interpreter again as stage
``run``. Any failure exits with :data:`JAIL_FAILED` after writing the reason to the result
descriptor: the sandbox fails closed.

``run`` (inside the jail): reads its job from a memfd, installs an audit hook, runs the code,
then the tests, and reports on the result descriptor (write-only for it).
"""

JAIL_FAILED = 97  # exit status of a jail that could not be built
JAILED_UID = 65534


def _jail(argv):
    import ctypes
    import json
    import os

    job_fd, res_fd = int(argv[0]), int(argv[1])
    job = json.loads(os.pread(job_fd, os.fstat(job_fd).st_size, 0))
    os.close(job_fd)

    def fail(why):
        try:
            os.write(res_fd, ("E " + why.replace("\n", " ") + "\n").encode())
        finally:
            os._exit(JAIL_FAILED)

    libc = ctypes.CDLL(None, use_errno=True)

    def check(ret, what):
        if ret != 0:
            fail("%s: %s" % (what, os.strerror(ctypes.get_errno())))

    NEWNS, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET = (
        0x00020000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
    is_root = os.geteuid() == 0
    uid, gid = os.geteuid(), os.getegid()
    flags = NEWNS | NEWUTS | NEWIPC | NEWPID | NEWNET | (0 if is_root else NEWUSER)
    check(libc.unshare(flags), "unshare")
    if not is_root:
        # Map our own uid to 65534 inside: we hold every capability of the new namespace until
        # execve, which clears them because the uid inside is not 0.
        try:
            for name, text in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (JAILED_UID, uid)),
                               ("gid_map", "%d %d 1" % (JAILED_UID, gid))):
                with open("/proc/self/" + name, "w") as f:
                    f.write(text)
        except OSError as e:
            fail("user namespace maps: %s" % e)
    alive_r, alive_w = os.pipe()  # the child watches this to learn that we died
    pid = os.fork()
    if pid:
        os.close(alive_r)
        os.close(res_fd)
        for fd in (0, 1, 2):
            try:
                os.close(fd)
            except OSError:
                pass
        while True:
            try:
                _, status = os.waitpid(pid, 0)
                break
            except ChildProcessError:
                os._exit(JAIL_FAILED)
            except InterruptedError:
                continue
        if os.WIFEXITED(status):
            os._exit(os.WEXITSTATUS(status))
        os._exit(128 + os.WTERMSIG(status))
    os.close(alive_w)
    try:
        _build_and_exec(job, res_fd, alive_r, is_root, libc, check)
    except Exception as e:  # noqa: BLE001 - fail closed, with the reason
        fail("%s: %s" % (type(e).__name__, e))


def _build_and_exec(job, res_fd, alive_r, is_root, libc, check):
    import os
    import resource
    import select
    import signal

    PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
    MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
        1, 2, 4, 8, 32, 4096, 16384, 1 << 18)
    MS_NOATIME, MS_NODIRATIME, MS_RELATIME, MNT_DETACH = 1024, 2048, 1 << 21, 2
    # statvfs flag -> mount flag: a bind remount inside a user namespace must keep the flags
    # that are locked on the source mount.
    ST_TO_MS = ((1, MS_RDONLY), (2, MS_NOSUID), (4, MS_NODEV), (8, MS_NOEXEC),
                (1024, MS_NOATIME), (2048, MS_NODIRATIME), (4096, MS_RELATIME))

    def mount(src, dst, fstype, flags, data=None):
        enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
        check(libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)),
              "mount %s on %s" % (src, dst))

    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
    if select.select([alive_r], [], [], 0)[0]:
        os._exit(JAIL_FAILED)  # the waiting parent is already gone
    os.close(alive_r)

    new = "/tmp"  # any existing directory: the mount namespace is ours alone
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for host in job["binds"]:
        inside = new + host
        if os.path.islink(host):
            os.makedirs(os.path.dirname(inside), exist_ok=True)
            os.symlink(os.readlink(host), inside)
            continue
        if os.path.isdir(host):
            os.makedirs(inside, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(inside), exist_ok=True)
            open(inside, "w").close()
        mount(host, inside, None, MS_BIND | MS_REC)
        locked = 0
        st = os.statvfs(host).f_flag
        for st_bit, ms_bit in ST_TO_MS:
            if st & st_bit:
                locked |= ms_bit
        mount(None, inside, None,
              MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | locked)
    os.mkdir(new + "/dev", 0o755)
    mount("tmpfs", new + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
    for dev in ("null", "zero", "random", "urandom"):
        open(new + "/dev/" + dev, "w").close()
        mount("/dev/" + dev, new + "/dev/" + dev, None, MS_BIND)
    # No /proc at all: nothing of other processes, and not /proc/self/mem either (a process may
    # always read its own memory there, which would reveal a statement test's nonce).
    os.mkdir(new + "/tmp", 0o755)
    mount("tmpfs", new + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
          "size=%dk,mode=0700" % max(64, job["tmp_bytes"] >> 10))
    if is_root:
        os.chown(new + "/tmp", JAILED_UID, JAILED_UID)
    # pivot_root(".", "."), then detach the old root stacked beneath: nothing of the host's tree
    # is left in this namespace except the bind mounts above.
    os.chdir(new)
    check(libc.syscall(job["sys_pivot_root"], b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "detach old root")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    try:
        libc.sethostname(b"sandbox", 7)
    except Exception:  # noqa: BLE001 - cosmetic
        pass
    os.chdir("/tmp")

    # The runner's job travels in a memfd: no file of it exists anywhere.
    run_fd = os.memfd_create("job", 0)
    os.write(run_fd, job["run_job"].encode())
    os.set_inheritable(run_fd, True)
    os.set_inheritable(res_fd, True)
    for name, value in (("RLIMIT_AS", job["memory_bytes"]), ("RLIMIT_FSIZE", job["file_bytes"]),
                        ("RLIMIT_CORE", 0), ("RLIMIT_NOFILE", 64),
                        ("RLIMIT_CPU", job["cpu_seconds"]),
                        ("RLIMIT_MEMLOCK", 0), ("RLIMIT_MSGQUEUE", 0)):
        try:
            resource.setrlimit(getattr(resource, name), (value, value))
        except (ValueError, OSError, AttributeError):
            pass
    if is_root:
        os.setgroups([])
        os.setresgid(JAILED_UID, JAILED_UID, JAILED_UID)
        os.setresuid(JAILED_UID, JAILED_UID, JAILED_UID)  # clears every capability
        check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": "/tmp",
           "TMPDIR": "/tmp", "PYTHONHASHSEED": "0"}
    exe = job["python"]
    # pycache_prefix names a directory that does not exist: imports compile the standard
    # library from source rather than unmarshal cached bytecode (marshal is refused inside).
    os.execve(exe, [exe, "-I", "-S", "-B", "-X", "pycache_prefix=/nonexistent", "-c",
                    job["source"], "run", str(run_fd), str(res_fd)], env)


# ------------------------------------------------------------------------------------------
# Stage "run": inside the jail
# ------------------------------------------------------------------------------------------


def _run(argv):
    import builtins
    import json
    import os
    import sys

    run_fd, res_fd = int(argv[0]), int(argv[1])
    job = json.loads(os.pread(run_fd, os.fstat(run_fd).st_size, 0))
    os.close(run_fd)
    write, compile_, exec_, eval_ = os.write, builtins.compile, builtins.exec, builtins.eval
    exit_, dumps, enc = os._exit, json.dumps, str.encode
    mode, code = job["mode"], job["code"]
    # No new processes or threads. Set here, after execve: set at setuid time, a limit already
    # exceeded by other sandboxes of the same uid would make that execve fail (EAGAIN).
    import resource
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    if job["audit"]:
        sys.addaudithook(_make_hook())
    glb = {"__name__": "__main__" if mode == "stdio" else "solution", "__builtins__": builtins}
    if mode == "stdio":
        del job
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
        exit_(status & 0xFF)
    # mode == "probes": the test's expected values and logic never enter this process; the
    # values of the probes leave, one line each, headed by a nonce that lives only in this
    # frame (grpo.rewards.sandbox.judge decides). The writer is built from primitives taken
    # before the program runs: patching json, builtins or modules cannot reach it.
    tests, nonce = job["tests"], job["nonce"]
    # A traced test ({"steps": [[kind, source, input names]], "trace": [[step, inputs]]}) runs
    # its steps in the trace's order, each with the values the judge computed bound to its
    # input names: decoded here, before the program runs, fresh objects for every step run.
    decode = _decoder(job.get("max_items", 20000))
    del job
    prepared = {}
    for t, test in enumerate(tests):
        if type(test) is dict:
            runs = []
            try:
                for sid, given in test["trace"]:
                    runs.append((sid, None if given == "-" else () if given == "n"
                                 else decode(given.encode("ascii"))))
            except Exception:  # noqa: BLE001 - not ours to run: the test fails
                runs = None
            prepared[t] = (test["steps"], runs)
    encode = _encoder()
    str_, join, zip_, type_, dict_ = str, "".join, zip, type, dict
    indexed = list(enumerate(tests))
    try:
        exec_(compile_(code, "solution.py", "exec"), glb)
    except BaseException as e:
        _report(e)
        exit_(1)
    for t, steps in indexed:
        if type_(steps) is dict_:
            steps, runs = prepared[t]
            compiled = {}
            try:
                for occ, (sid, values) in enumerate(runs):
                    kind, source, names = steps[sid]
                    if values is None:
                        if kind == "exec":
                            raise ValueError("the inputs of a statement could not be sent")
                        continue
                    if sid not in compiled:
                        compiled[sid] = compile_(source, "<test %d>" % t,
                                                 "exec" if kind == "exec" else "eval")
                    for name, value in zip_(names, values):
                        glb[name] = value
                    if kind == "exec":
                        exec_(compiled[sid], glb)
                        continue
                    head = join((nonce, " ", str_(t), " ", str_(occ), " "))
                    try:
                        value = eval_(compiled[sid], glb)
                        out = []
                        encode(value, out)
                        line = head + "v" + join(out)
                    except BaseException as e:
                        _report(e)
                        line = head + "x"
                    write(res_fd, enc(line + "\n"))
                write(res_fd, enc(join((nonce, " ", str_(t), " d\n"))))
            except BaseException as e:
                _report(e)
            continue
        try:
            for step in steps:
                if step[0] == "exec":
                    exec_(compile_(step[1], "<test %d>" % t, "exec"), glb)
                    continue
                head = join((nonce, " ", str_(t), " ", str_(step[1]), " "))
                try:
                    value = eval_(compile_(step[2], "<test %d>" % t, "eval"), glb)
                    out = []
                    encode(value, out)
                    line = head + "v" + join(out)
                except BaseException as e:
                    _report(e)
                    line = head + "x"
                write(res_fd, enc(line + "\n"))
            write(res_fd, enc(join((nonce, " ", str_(t), " d\n"))))
        except BaseException as e:
            _report(e)
    exit_(0)


def _encoder():
    """``encode(value, out)``: a value of exact builtin types as text (anything else raises,
    so an object with a custom ``__eq__`` cannot leave the process). Grammar, prefix form:
    ``N`` ``T`` ``F``, ``i<hex>;``, ``f<repr>;``, ``c<f><f>``, ``s<utf-8 hex>;``,
    ``b<hex>;``, ``l<n>;`` / ``t<n>;`` / ``S<n>;`` / ``R<n>;`` (frozenset) + n items,
    ``d<n>;`` + n key/value pairs. Every primitive is bound here, before the program runs."""
    type_, len_, isfinite, repr_, list_ = type, len, __import__("math").isfinite, repr, list
    encode_str, hex_bytes, append = str.encode, bytes.hex, list.append
    int_fmt = int.__format__
    float_repr = float.__repr__
    TAGS = {list: "l", tuple: "t", set: "S", frozenset: "R"}

    def encode(v, out, depth=0):
        if depth > 100:
            raise ValueError("value nested too deeply")
        t = type_(v)
        if v is None:
            append(out, "N")
        elif t is bool:
            append(out, "T" if v else "F")
        elif t is int:
            append(out, "i" + int_fmt(v, "x") + ";")
        elif t is float:
            append(out, "f" + float_repr(v) + ";")
        elif t is complex:
            append(out, "c")
            encode(v.real, out, depth + 1)
            encode(v.imag, out, depth + 1)
        elif t is str:
            append(out, "s" + hex_bytes(encode_str(v, "utf-8", "surrogatepass")) + ";")
        elif t is bytes:
            append(out, "b" + hex_bytes(v) + ";")
        elif t in TAGS:
            items = list_(v) if t is not list else v
            append(out, TAGS[t] + int_fmt(len_(items), "d") + ";")
            for x in items:
                encode(x, out, depth + 1)
        elif t is dict:
            append(out, "d" + int_fmt(len_(v), "d") + ";")
            for k in list_(v):
                encode(k, out, depth + 1)
                encode(v[k], out, depth + 1)
        else:
            raise TypeError("cannot report a value of this type")

    return encode


def _report(e):
    import sys
    try:
        sys.stderr.write("%s: %s\n" % (type(e).__name__, e))
        sys.stderr.flush()
    except BaseException:
        pass


def _make_hook():
    """Audit hook: a second layer inside the jail. Everything it closes over is immutable."""
    import os

    realpath = os.path.realpath
    isdir = os.path.isdir
    O_PATH = getattr(os, "O_PATH", 0)
    O_DIRECTORY = os.O_DIRECTORY
    # Reaching a frame is the one way to read the harness's locals (the nonce of the probe
    # records) from Python; sys._getframe is refused with ValueError, which namedtuple, enum,
    # typing and logging already catch. marshal stays refused (crafted code objects): the
    # standard library imports from source instead (``-X pycache_prefix``, see the jail).
    FRAME_EVENTS = frozenset({"sys._getframe", "sys._current_frames", "sys._current_exceptions"})
    FRAME_ATTRS = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back"})
    BLOCKED = frozenset({
        "os.system", "os.fork", "os.forkpty", "os.posix_spawn", "os.posix_spawnp", "os.kill",
        "os.killpg", "signal.pthread_kill", "sys.setprofile", "sys.settrace",
        "sys.addaudithook", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
        "os.chroot", "os.setns", "os.unshare", "code.__new__", "marshal.loads", "marshal.load",
        "function.__new__", "os.exec", "os.spawn", "pty.spawn", "mmap.__new__",
        "setopencode", "cpython.run_file", "cpython.PyInterpreterState_New",
        "_xxsubinterpreters.create", "os.setsid", "os.setpgid"})
    PREFIXES = ("socket.", "ctypes.", "subprocess.", "os.exec", "os.spawn", "resource.",
                "_posixsubprocess.", "sys.remote_exec", "winreg.")
    # Modules that can read or write raw memory, or run processes without an audit event.
    BLOCKED_IMPORTS = frozenset({"ctypes", "_ctypes", "_posixsubprocess", "_testcapi",
                                 "_testinternalcapi", "_testbuffer", "_testmultiphase",
                                 "_testimportmultiple", "_xxtestfuzz", "_ctypes_test",
                                 "_xxsubinterpreters", "_xxinterpchannels", "gc"})
    # Events whose last argument(s) are dir_fd (-1 or None when absent).
    DIR_FD_ARGS = {"os.mkdir": 1, "os.remove": 1, "os.rmdir": 1, "os.rename": 2,
                   "os.symlink": 1, "os.link": 2, "os.chmod": 1, "os.chown": 1, "os.utime": 1,
                   "os.mkfifo": 1, "os.mknod": 1}

    def hook(event, args):
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            if isinstance(path, int):
                return
            try:
                p = realpath(os.fsdecode(path))
            except Exception:
                raise PermissionError("sandbox: unreadable path")
            if p == "/proc" or p.startswith("/proc/") or p.startswith("/dev/fd"):
                raise PermissionError("sandbox: /proc is not available")
            # A directory descriptor would serve as dir_fd for opens the hook cannot resolve.
            if isinstance(flags, int) and flags & (O_PATH | O_DIRECTORY) or isdir(p):
                raise PermissionError("sandbox: directory descriptors are not available")
            return
        if event == "import":
            name = args[0] if args else ""
            if isinstance(name, str) and name.partition(".")[0] in BLOCKED_IMPORTS:
                raise ImportError("sandbox: module %s is not available" % name)
            return
        if event == "object.__getattr__":
            if len(args) > 1 and args[1] in FRAME_ATTRS:
                raise AttributeError("sandbox: frames are not available")
            return
        if event in FRAME_EVENTS:
            raise ValueError("sandbox: frames are not available")
        if event in BLOCKED or event.startswith(PREFIXES):
            if event.startswith("ctypes."):
                raise ImportError("sandbox: ctypes is not available")
            raise PermissionError("sandbox: %s is not allowed" % event)
        n = DIR_FD_ARGS.get(event)
        if n:
            if any(a is not None and a != -1 for a in tuple(args)[-n:]):
                raise PermissionError("sandbox: dir_fd is not allowed")
        elif event in ("os.listdir", "os.scandir", "os.fwalk") and args and isinstance(args[0], int):
            raise PermissionError("sandbox: listing a directory descriptor is not allowed")

    return hook


# ------------------------------------------------------------------------------------------
# Stage "judge": outside the jail, never with the program's code
# ------------------------------------------------------------------------------------------


class ProbeFailed(Exception):
    """A record that is missing, marks a raised probe, or does not decode."""


def _decoder(max_items):
    """``decode(data)``: the value of one record ``b"v..."`` (the grammar of :func:`_encoder`),
    iteratively: depth and sizes bounded. Raises :class:`ProbeFailed` on anything else."""

    def decode(data):
        if data[:1] != b"v":
            raise ProbeFailed("the probe raised")
        text = data.decode("ascii")
        pos, n = 1, len(text)
        stack = [[[], 1, lambda items: items[0]]]  # [items, remaining, constructor]

        def num(end_char=";"):
            nonlocal pos
            end = text.index(end_char, pos)
            if end - pos > 100000:
                raise ProbeFailed("number too long")
            out = text[pos:end]
            pos = end + 1
            return out

        while stack:
            items, remaining, ctor = stack[-1]
            if remaining == 0:
                stack.pop()
                value = (dict(zip(items[0::2], items[1::2])) if ctor is dict else ctor(items))
                if not stack:
                    return value
                stack[-1][0].append(value)
                stack[-1][1] -= 1
                continue
            if pos >= n:
                raise ProbeFailed("truncated")
            tag = text[pos]
            pos += 1
            if tag == "N":
                value = None
            elif tag == "T" or tag == "F":
                value = tag == "T"
            elif tag == "i":
                value = int(num(), 16)
            elif tag == "f":
                s = num()
                if len(s) > 64:
                    raise ProbeFailed("float too long")
                value = float(s)
            elif tag == "c":
                parts_ = []
                for _ in range(2):
                    if text[pos:pos + 1] != "f":
                        raise ProbeFailed("malformed complex")
                    pos += 1
                    parts_.append(float(num()))
                value = complex(*parts_)
            elif tag == "s":
                value = bytes.fromhex(num()).decode("utf-8", "surrogatepass")
            elif tag == "b":
                value = bytes.fromhex(num())
            elif tag in "ltSRd":
                count = int(num(), 10)
                if len(stack) > 100 or count < 0 or (tag in "SRd" and count > max_items):
                    raise ProbeFailed("too deep or too large")
                ctor = {"l": list, "t": tuple, "S": set, "R": frozenset, "d": dict}[tag]
                stack.append([[], 2 * count if tag == "d" else count, ctor])
                continue
            else:
                raise ProbeFailed("malformed")
            items.append(value)
            stack[-1][1] -= 1
        raise ProbeFailed("malformed")

    return decode


def _judge(argv):
    """Run the judge side of assert tests, never with the program's code. Two stages:

    ``inputs`` (before the program runs, only for *traced* tests: those with steps inside the
    test's own loops or ifs, or steps that take values only the judge computes): runs each
    test's first-stage source, which keeps the test's judge-side statements and replaces every
    step of the program by ``__grpo_at__(step, is_statement, inputs)``; prints one line per step
    run, ``<test> <step> <encoded inputs>`` (``n``: none, ``-``: they raised or cannot be sent),
    then ``<test> D`` (or ``<test> E``: the test itself failed or asked for too much).

    ``verdict`` (after the program ran): decides each test on the probe records of the
    ``probes`` run. The records are the program's output, hence hostile: they are decoded here,
    in a throwaway process under memory / CPU limits and the caller's wall clock, into exact
    builtin types only (no object of the program exists here), then each test's judge source
    runs with the judge's builtins over those values. Prints ``PASS <i>`` per passed test and
    ``MISS <i>`` per test that cannot be judged (a traced test whose steps, recomputed, are
    not the ones the program ran, or whose inputs could not be sent).

    Both stages seed ``random`` alike per test (``seed`` and the test's id) and run under the
    same ``PYTHONHASHSEED`` (the caller's), so the second recomputes exactly what the first sent;
    a step whose recomputed inputs differ is a miss, never a failure. ``trusted`` (the
    problem's own helper definitions, checked by ``grpo.rewards.sandbox.check_trusted_code``)
    runs once, in its own namespace with the judge's builtins (plus classes and errors) and
    modules reduced to their public, non-module attributes; its ``trusted_names`` are bound in
    every test's namespace, where the test's calls resolve.
    """
    import builtins
    import json
    import os
    import random
    import resource
    import signal
    import sys
    import types

    job_fd, res_fd = int(argv[0]), int(argv[1])
    for name, value in (("RLIMIT_AS", 2 << 30), ("RLIMIT_CPU", 10), ("RLIMIT_FSIZE", 1 << 20),
                        ("RLIMIT_NPROC", 0), ("RLIMIT_CORE", 0)):
        try:
            resource.setrlimit(getattr(resource, name), (value, value))
        except (ValueError, OSError):
            pass
    sys.path[:] = [p for p in sys.path if p]  # (started without -I: no working directory on it)
    job = json.loads(os.pread(job_fd, os.fstat(job_fd).st_size, 0))
    sources, budget, probe_name = job["tests"], job["test_seconds"], job["probe"]
    stage = job.get("stage", "verdict")
    ids = job.get("ids") or list(range(len(sources)))
    seed = int(job.get("seed", 0))
    allowed_modules = frozenset(job["modules"])
    sys.setrecursionlimit(400)
    write = os.write
    encode = _encoder()
    decode = _decoder(job["max_items"])

    # ``random`` as the tests see it: seeded by the job, never by the machine.
    real_seed = random.Random.seed

    def seeded(self, a=None, version=2):
        real_seed(self, seed if a is None else a, version)

    random.Random.seed = seeded

    class NoSystemRandom:
        def __init__(self, *a, **k):
            raise RuntimeError("the judge has no SystemRandom (its values could not be sent)")

    random.SystemRandom = NoSystemRandom

    real_import = builtins.__import__

    def import_(name, globals=None, locals=None, fromlist=(), level=0):
        if level or name.partition(".")[0] not in allowed_modules:
            raise ImportError("the judge does not import %s" % name)
        return real_import(name, globals, locals, fromlist, 0)

    safe = {n: getattr(builtins, n) for n in job["builtins"]}
    safe["__import__"] = import_
    glb = {"__builtins__": safe, "math": real_import("math"), probe_name: None}

    class Unscorable(BaseException):
        pass

    class TestTimeout(BaseException):
        pass

    def on_alarm(signum, frame):
        raise TestTimeout()

    signal.signal(signal.SIGALRM, on_alarm)

    def timed(fn):
        signal.setitimer(signal.ITIMER_REAL, budget)
        try:
            return fn()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    # The problem's own helpers, in their own namespace; modules as public attributes only.
    trusted = {}
    if job.get("trusted") is not None:
        proxies = {}

        def public(module):
            if module.__name__ not in proxies:
                proxies[module.__name__] = types.SimpleNamespace(**{
                    k: v for k, v in vars(module).items()
                    if not k.startswith("_") and not isinstance(v, types.ModuleType)})
            return proxies[module.__name__]

        def trusted_import(name, globals=None, locals=None, fromlist=(), level=0):
            return public(import_(name, globals, locals, fromlist, level))

        tsafe = dict(safe)
        tsafe.update({n: getattr(builtins, n) for n in job["trusted_builtins"]})
        tsafe["__import__"] = trusted_import
        tsafe["__build_class__"] = builtins.__build_class__
        tglb = {"__builtins__": tsafe, "__name__": "trusted"}
        try:
            timed(lambda: exec(compile(job["trusted"], "<trusted>", "exec"), tglb))
            trusted = {n: tglb[n] for n in job["trusted_names"] if n in tglb}
        except BaseException:  # noqa: BLE001 - no test can be judged
            for t in range(len(sources)):
                write(1, ("%d E\n" % ids[t] if stage == "inputs" else "MISS %d\n" % t).encode())
            os._exit(0)

    def encoded(thunk):
        """The inputs ``thunk()`` returns, encoded; ``-`` when they raise or cannot be sent."""
        if thunk is None:
            return "n"
        try:
            out = []
            encode(tuple(thunk()), out)
            return "v" + "".join(out)
        except Exception:  # noqa: BLE001 - the step cannot run; decided by how it is used
            return "-"

    def start(t):
        random.seed(seed * 1000003 + ids[t])
        glb.update(trusted)

    if stage == "inputs":
        max_calls, max_bytes = job["max_calls"], job["max_bytes"]
        used = [0, 0]
        lines = []

        class TooMany(BaseException):
            pass

        def record(sid, is_exec, thunk):
            enc = encoded(thunk)
            used[0] += 1
            used[1] += len(enc) + 24
            if used[0] > max_calls or used[1] > max_bytes:
                raise TooMany()
            lines.append("%d %d %s\n" % (ids[current_t[0]], sid, enc))

        current_t = [0]
        glb["__grpo_at__"] = record
        for t, src in enumerate(sources):
            current_t[0] = t
            start(t)
            del lines[:]
            try:
                timed(lambda: exec(compile(src, "<inputs %d>" % t, "exec"), glb))
                lines.append("%d D\n" % ids[t])
            except TooMany:
                lines[:] = ["%d E\n" % ids[t]]
                used[0], used[1] = max_calls, max_bytes  # nothing more for later tests either
            except BaseException:  # noqa: BLE001 - the test fails on its own: unscorable
                lines[:] = ["%d E\n" % ids[t]]
            write(1, "".join(lines).encode())
        os._exit(0)

    # stage == "verdict". Records: "<nonce> <test> <probe> v<value>" / "... x" (it raised) /
    # "<nonce> <test> d" (the test's steps completed); a traced test's records are numbered by
    # step run instead of probe. Lines without the nonce are the program's, not ours; a record
    # seen twice is void. Values are parsed only when a test reads them.
    raw = os.pread(res_fd, os.fstat(res_fd).st_size, 0)
    nonce = job["nonce"].encode()
    records, done = {}, {}
    for line in raw.split(b"\n"):
        parts = line.split(b" ", 3)
        if len(parts) < 3 or parts[0] != nonce or not parts[1].isdigit() or len(parts[1]) > 9:
            continue
        t = int(parts[1])
        if parts[2] == b"d" and len(parts) == 3:
            done[t] = done.get(t, 0) + 1
        elif len(parts) == 4 and parts[2].isdigit() and len(parts[2]) < 10:
            key = (t, int(parts[2]))
            records[key] = None if key in records else parts[3]
    del raw
    traces = {int(k): v for k, v in (job.get("traces") or {}).items()}

    current = [0]
    cache = {}

    def probe(pid):
        key = (current[0], pid)
        if key not in cache:
            rec = records.get(key)
            if rec is None:
                raise ProbeFailed("no value")
            cache[key] = decode(rec)
        return cache[key]

    runs = [0]

    def at(sid, is_exec, thunk):
        """The next step run of a traced test: the one the first stage sent, or a miss."""
        trace, n = traces.get(current[0]), runs[0]
        runs[0] += 1
        if trace is None or n >= len(trace) or trace[n][0] != sid:
            raise Unscorable()
        enc = encoded(thunk)
        if enc != trace[n][1] or (enc == "-" and is_exec):
            raise Unscorable()
        return (n, enc == "-")

    def val(handle):
        if handle[1]:
            raise Unscorable()  # its inputs raised or could not be sent: the test is broken
        return probe(handle[0])

    glb[probe_name], glb["__grpo_at__"], glb["__grpo_val__"] = probe, at, val
    for t, src in enumerate(sources):
        current[0], runs[0] = t, 0
        start(t)
        verdict = False
        try:
            timed(lambda: exec(compile(src, "<judge %d>" % t, "exec"), glb))
            verdict = done.get(t) == 1
            if verdict and t in traces and runs[0] != len(traces[t]):
                verdict = None
        except Unscorable:
            verdict = None
        except BaseException:  # noqa: BLE001 - any failure of the test fails it
            verdict = False
        if verdict is None:
            write(1, ("MISS %d\n" % t).encode())
        elif verdict:
            write(1, ("PASS %d\n" % t).encode())
    os._exit(0)


def main():
    import sys

    stage, rest = sys.argv[1], sys.argv[2:]
    if stage == "jail":
        _jail(rest)
    elif stage == "run":
        _run(rest)
    elif stage == "judge":
        _judge(rest)
    else:
        raise SystemExit("unknown stage %r" % stage)


if __name__ == "__main__":
    main()
