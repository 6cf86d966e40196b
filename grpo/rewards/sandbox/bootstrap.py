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
    # noexec: a shared object the program writes here could be loaded (an import of a .so, or
    # _imp.create_dynamic) and run native code that reads the harness's memory.
    mount("tmpfs", new + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
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
    # The environment is this one, built here, and nothing else: not -I (which would ignore
    # PYTHONHASHSEED) but -s -S -P (no user site, no site, no working directory on sys.path).
    # The hash seed is the judge's (grpo.rewards.sandbox: the same in the sandbox and both
    # judge stages), so that sets and dicts built alike iterate alike on both sides.
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": "/tmp",
           "TMPDIR": "/tmp", "PYTHONHASHSEED": str(int(job.get("hash_seed", 0)))}
    exe = job["python"]
    # pycache_prefix names a directory that does not exist: imports compile the standard
    # library from source rather than unmarshal cached bytecode (marshal is refused inside).
    os.execve(exe, [exe, "-s", "-S", "-P", "-B", "-X", "pycache_prefix=/nonexistent", "-c",
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
    exit_, enc = os._exit, str.encode
    mode, code = job["mode"], job["code"]
    # No new processes or threads. Set here, after execve: set at setuid time, a limit already
    # exceeded by other sandboxes of the same uid would make that execve fail (EAGAIN).
    import resource
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    # exit() and quit(), which the site module (left out: -S) would define: programs call them.
    builtins.exit, builtins.quit = _Quitter("exit"), _Quitter("quit")
    # The builtins the test's own steps see: a copy taken now, so that a program that patches
    # builtins (builtins.sorted = ...) changes what its own code sees, never the test's.
    pristine = dict(builtins.__dict__)
    if job["audit"]:
        sys.addaudithook(_make_hook())
        _relay_signals()
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
    max_items = job.get("max_items", 20000)
    decode = _decoder(max_items)
    encode = _encoder(max_items, job.get("iter_items", 100000), job.get("iter_seconds", 1.0))
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
    str_, join, zip_, type_, dict_, list_ = str, "".join, zip, type, dict, list
    update, items, get = dict.update, dict.items, dict.get
    missing = object()
    indexed = list(enumerate(tests))
    try:
        exec_(compile_(code, "solution.py", "exec"), glb)
    except BaseException as e:
        _report(e)
        exit_(1)

    # Each test's own names (what its steps bind: ``s = Stack()``, ``x = [3, 1, 2]``) live in
    # a dict of this frame, never in the program's globals: a ``global`` statement or
    # ``globals()`` of the program cannot rebind or read them. A step runs in a fresh dict
    # holding the program's globals as they are now, then the test's names, with the
    # builtins copied before the program ran.
    def namespace(own):
        ns = {}
        update(ns, glb)
        update(ns, own)
        ns["__builtins__"] = pristine
        return ns

    def keep(ns, own):  # the names a statement of the test bound
        for k, v in list_(items(ns)):
            if get(own, k, missing) is not v and get(glb, k, missing) is not v:
                own[k] = v

    def probe(t, label, evaluate):  # one line: the probe's value, or "x" when evaluating it raised
        head = join((nonce, " ", str_(t), " ", str_(label), " "))
        try:
            line = head + encode(evaluate())
        except BaseException as e:
            _report(e)
            line = head + "x"
        write(res_fd, enc(line + "\n"))

    def done(t):  # the test's last line
        write(res_fd, enc(join((nonce, " ", str_(t), " d\n"))))

    for t, steps in indexed:
        own = {}
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
                    ns = namespace(own)
                    for name, value in zip_(names, values):
                        ns[name] = value
                    if kind == "exec":
                        exec_(compiled[sid], ns)
                        keep(ns, own)
                        continue
                    probe(t, occ, lambda: eval_(compiled[sid], ns))
                done(t)
            except BaseException as e:
                _report(e)
            continue
        try:
            for step in steps:
                ns = namespace(own)
                if step[0] == "exec":
                    exec_(compile_(step[1], "<test %d>" % t, "exec"), ns)
                    keep(ns, own)
                    continue
                probe(t, step[1], lambda: eval_(compile_(step[2], "<test %d>" % t, "eval"), ns))
            done(t)
        except BaseException as e:
            _report(e)
    exit_(0)


class _Quitter:
    """``exit()`` / ``quit()`` as the site module defines them (raise SystemExit)."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return "Use %s() or Ctrl-D (i.e. EOF) to exit" % self.name

    def __call__(self, code=None):
        raise SystemExit(code)


def _relay_signals():
    """Python signal handlers are refused: a handler is called with the frame that runs when
    the signal arrives, whose ``f_back`` chain reaches this harness (its nonce, the test's
    names). ``_signal.signal`` is replaced by a relay through the audit hook, which installs
    only ``SIG_DFL`` / ``SIG_IGN`` (``signal.signal(signal.SIGPIPE, signal.SIG_DFL)`` still
    works); the real function lives only in the hook's closure (unreachable: no API lists
    hooks). ``_imp.create_builtin`` is relayed the same way, refusing a second ``_signal`` or
    ``_imp`` (``importlib.util.module_from_spec`` would make one with the real functions)."""
    import sys
    import _imp

    audit = sys.audit

    def signal(signalnum, handler):
        box = []
        audit("sandbox.signal", signalnum, handler, box)
        return box[0]

    def create_builtin(spec):
        box = []
        audit("sandbox.create_builtin", spec, box)
        return box[0]

    sys.modules["_signal"].signal = signal
    _imp.create_builtin = create_builtin


class ProbeFailed(Exception):
    """A record that is missing, marks a raised probe, or does not decode."""


class Snapshot:
    """An iterator as the program's produced it: the values it yielded (up to the caps), then
    StopIteration if it ended there; reading past a cut (the caps, or the iterator raised)
    fails the test."""

    __slots__ = ("items", "pos", "complete")

    def __init__(self, items, complete):
        self.items, self.pos, self.complete = list(items), 0, complete

    def __iter__(self):
        return self

    def __next__(self):
        if self.pos < len(self.items):
            self.pos += 1
            return self.items[self.pos - 1]
        if self.complete:
            raise StopIteration
        raise ProbeFailed("read past the values the program's iterator produced")

    def __repr__(self):
        return "<iterator>"


class Record:
    """A dataclass instance or a plain Enum member of the program, as data: its class's
    name and its fields (a member: its name). Equal to a record of the same class name and
    fields, whatever the program's ``__eq__`` said; fields read as attributes."""

    __slots__ = ("cls", "fields", "member")

    def __init__(self, cls, fields, member):
        if not isinstance(cls, str) or not all(isinstance(f, tuple) and len(f) == 2
                                               and isinstance(f[0], str) for f in fields):
            raise ProbeFailed("malformed record")
        self.cls, self.fields, self.member = cls, tuple(fields), member

    def _key(self):
        return (self.cls, self.member, self.fields)

    def __eq__(self, other):
        return isinstance(other, Record) and self._key() == other._key()

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        return hash(self._key())

    def __getattr__(self, name):
        for k, v in object.__getattribute__(self, "fields"):
            if k == name:
                return v
        raise AttributeError(name)

    def __repr__(self):
        if self.member:
            return "%s.%s" % (self.cls.rpartition(".")[2], self.fields[0][1])
        return "%s(%s)" % (self.cls.rpartition(".")[2], ", ".join("%s=%r" % f for f in self.fields))


def _encoder(max_items=20000, iter_items=100000, iter_seconds=1.0):
    """``encode(value) -> str``: a value's record body, ``v`` + prefix-form text:

    ``N`` ``T`` ``F``, ``i<hex>;``, ``f<repr>;``, ``c<f><f>``, ``s<utf-8 hex>;``,
    ``b<hex>;``, ``y<hex>;`` (bytearray), ``l<n>;`` / ``t<n>;`` / ``S<n>;`` / ``R<n>;``
    (frozenset) + n items, ``d<n>;`` + n key/value pairs, ``J<n>;`` + n characters of JSON
    (lists and str-keyed dicts of None/bool/int/float/str only: decoded by C code, fast),
    ``g`` + start, stop, step (range), ``K`` / ``V`` / ``W<n>;`` + n items (dict keys / values /
    items views), ``q`` + numerator, denominator (Fraction), ``D<hex>;`` (Decimal),
    ``Q`` + maxlen + list (deque), ``A<kind><n>;`` + n ints (datetime's date ``d``,
    datetime ``D``, time ``t``, timedelta ``r``, without tzinfo), ``I<end>`` + list (an
    iterator's values, read up to ``iter_items`` / ``iter_seconds``; end ``e`` it ended,
    ``t`` the caps cut it, ``r`` it raised: reading past a cut fails the test), ``Z`` + class
    name + tuple of (field, value) pairs (a dataclass instance), ``E`` + class name + member
    name (a plain Enum member): :class:`Record` in the judge.

    Subclasses of the builtin types (IntEnum, namedtuple, Counter, OrderedDict, ...) leave as
    their builtin base's value, read by the base type's own C methods (bound here, before the
    program runs): an overridden ``__eq__``, ``__iter__`` or ``__repr__`` plays no part; a
    dataclass instance or a plain Enum member is its class name and fields (compared as data,
    never by its ``__eq__``). An object of any other type raises TypeError (its probe fails).
    Whatever the program does, a record is one fixed plain value, read once: what the judge
    compares is data, never an object of the program (a value that would change on a second
    read cannot)."""
    import time

    type_, len_, list_, set_, map_, issubclass_, hasattr_, getattr_ = (
        type, len, list, set, map, issubclass, hasattr, getattr)
    str_ = str
    stop_, join = StopIteration, "".join
    int_fmt, float_repr = int.__format__, float.__repr__
    encode_str, bytes_hex, bytearray_hex = str.encode, bytes.hex, bytearray.hex
    creal, cimag = complex.__dict__["real"].__get__, complex.__dict__["imag"].__get__
    list_iter, tuple_iter = list.__iter__, tuple.__iter__
    set_iter, fset_iter = set.__iter__, frozenset.__iter__
    dict_items, dict_values = dict.items, dict.values
    append = list.append
    monotonic = time.monotonic
    enum_base = __import__("enum").Enum  # imported at startup (re needs it), taken before the program
    keys_t, values_t, items_t = type({}.keys()), type({}.values()), type({}.items())
    none_t = type(None)
    max_text = 1 << 20  # a Decimal's digits
    # JSON by the C encoder itself, built here: nothing the program patches in json reaches it.
    # No circularity markers: plain() has already refused anything nested past 50 levels.
    import _json

    def refuse(o):
        raise TypeError("not JSON")

    c_encoder = _json.make_encoder(None, refuse, _json.encode_basestring_ascii, None, ":", ",",
                                   False, False, True)

    def to_json(v):
        return join(c_encoder(v, 0))

    def scalar(k):
        return k is int or k is str or k is float or k is bool or k is none_t

    def plain(v, depth):
        """Whether JSON carries ``v`` exactly (lists, str-keyed dicts, JSON scalars)."""
        t = type_(v)
        if scalar(t):
            return True
        if depth > 50:
            return False
        if t is dict:
            for k in set_(map_(type_, v)):
                if k is not str:
                    return False
            return plain(list_(dict_values(v)), depth + 1)
        if t is not list:
            return False
        nested = False
        for k in set_(map_(type_, v)):
            if k is list or k is dict:
                nested = True
            elif not scalar(k):
                return False
        if nested:
            for x in v:
                tx = type_(x)
                if (tx is list or tx is dict) and not plain(x, depth + 1):
                    return False
        return True

    def seq(tag, values, out, depth):
        append(out, tag + int_fmt(len_(values), "d") + ";")
        for x in values:
            tagged(x, out, depth + 1)

    def materialise(it, nxt):
        """(values, end) of an iterator, within the caps."""
        values, end = [], "t"
        deadline = monotonic() + iter_seconds
        while len_(values) < iter_items:
            try:
                x = nxt(it)
            except stop_:
                end = "e"
                break
            except BaseException:  # noqa: BLE001 - it raised: reading past here fails
                end = "r"
                break
            append(values, x)
            if monotonic() > deadline:
                break
        return values, end

    def json_form(v, out):
        try:
            text = to_json(v)
        except Exception:  # noqa: BLE001 - ints past JSON's digits, cycles: the long form
            return False
        append(out, "J" + int_fmt(len_(text), "d") + ";" + text)
        return True

    def tagged(v, out, depth):
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
        elif t is str:
            append(out, "s" + bytes_hex(encode_str(v, "utf-8", "surrogatepass")) + ";")
        elif (t is list or t is dict) and plain(v, 0) and json_form(v, out):
            pass
        elif issubclass_(t, int):  # bool cannot be subclassed; IntEnum, IntFlag, ...
            append(out, "i" + int_fmt(v, "x") + ";")
        elif issubclass_(t, float):
            append(out, "f" + float_repr(v) + ";")
        elif issubclass_(t, complex):
            append(out, "cf" + float_repr(creal(v)) + ";f" + float_repr(cimag(v)) + ";")
        elif issubclass_(t, str):
            append(out, "s" + bytes_hex(encode_str(v, "utf-8", "surrogatepass")) + ";")
        elif issubclass_(t, bytes):
            append(out, "b" + bytes_hex(v) + ";")
        elif issubclass_(t, bytearray):
            append(out, "y" + bytearray_hex(v) + ";")
        elif issubclass_(t, list):
            seq("l", list_(list_iter(v)), out, depth)
        elif issubclass_(t, tuple):
            seq("t", list_(tuple_iter(v)), out, depth)
        elif issubclass_(t, frozenset):
            seq("R", list_(fset_iter(v)), out, depth)
        elif issubclass_(t, set):
            seq("S", list_(set_iter(v)), out, depth)
        elif issubclass_(t, dict):
            pairs = list_(dict_items(v))
            append(out, "d" + int_fmt(len_(pairs), "d") + ";")
            for k, x in pairs:
                tagged(k, out, depth + 1)
                tagged(x, out, depth + 1)
        elif t is range:
            append(out, "g")
            for x in (v.start, v.stop, v.step):
                tagged(x, out, depth + 1)
        elif t is keys_t or t is values_t or t is items_t:
            seq("K" if t is keys_t else "V" if t is values_t else "W", list_(v), out, depth)
        else:
            other(v, t, out, depth)

    def other(v, t, out, depth):
        module, name = getattr_(t, "__module__", None), getattr_(t, "__qualname__", None)
        known = (module, name) if type_(module) is str and type_(name) is str else None
        if known == ("fractions", "Fraction"):
            n, d = v.numerator, v.denominator
            if type_(n) is not int or type_(d) is not int:
                raise TypeError("a Fraction of non-ints")
            append(out, "q")
            tagged(n, out, depth + 1)
            tagged(d, out, depth + 1)
        elif known == ("decimal", "Decimal"):
            s = str_(v)
            if not issubclass_(type_(s), str) or len_(s) > max_text:
                raise TypeError("a Decimal without a short str")
            append(out, "D" + bytes_hex(encode_str(s, "ascii")) + ";")
        elif known == ("collections", "deque"):
            m = v.maxlen
            if m is not None and type_(m) is not int:
                raise TypeError("a deque with a strange maxlen")
            append(out, "Q")
            tagged(m, out, depth + 1)
            seq("l", list_(v), out, depth + 1)
        elif known in (("datetime", "date"), ("datetime", "datetime"), ("datetime", "time"),
                       ("datetime", "timedelta")) and getattr_(v, "tzinfo", None) is None:
            fields = {"date": ("year", "month", "day"),
                      "datetime": ("year", "month", "day", "hour", "minute", "second", "microsecond"),
                      "time": ("hour", "minute", "second", "microsecond"),
                      "timedelta": ("days", "seconds", "microseconds")}[name]
            values = [getattr_(v, f) for f in fields]
            for x in values:
                if type_(x) is not int:
                    raise TypeError("a datetime value with strange fields")
            append(out, "A" + {"date": "d", "datetime": "D", "time": "t", "timedelta": "r"}[name])
            seq("", values, out, depth)
        elif issubclass_(t, enum_base):  # a plain Enum member (IntEnum, StrEnum: their base)
            append(out, "E")
            tagged(name if type_(name) is str else None, out, depth + 1)
            tagged(v.name, out, depth + 1)
        elif type_(getattr_(t, "__dataclass_fields__", None)) is dict:
            fields = [f for f in getattr_(t, "__dataclass_fields__") if type_(f) is str]
            if len_(fields) > max_items:
                raise ValueError("too many fields")
            append(out, "Z")
            tagged(name if type_(name) is str else None, out, depth + 1)
            seq("t", [(f, getattr_(v, f)) for f in fields], out, depth + 1)
        elif hasattr_(t, "__next__"):
            values, end = materialise(v, t.__next__)
            append(out, "I" + end)
            tagged(values, out, depth + 1)
        else:
            # An object of the program's own (or any other) type has no value the judge could
            # compare: its __eq__, __bool__, __str__ ... are the program's to make lie.
            raise TypeError("cannot report a value of type %s" % (name,))

    def encode(v):
        out = ["v"]
        tagged(v, out, 0)
        return join(out)

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

    import _imp
    import sys
    import types

    realpath = os.path.realpath
    isdir = os.path.isdir
    # The real functions that _relay_signals replaces: held only here.
    real_signal, real_create_builtin = sys.modules["_signal"].signal, _imp.create_builtin
    callable_, int_int, namespace = callable, int.__int__, types.SimpleNamespace
    FRESH_REFUSED = frozenset({"_signal", "_imp"})
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
                                 "_xxsubinterpreters", "_xxinterpchannels", "gc", "_signal",
                                 "_imp"})
    # Events whose last argument(s) are dir_fd (-1 or None when absent).
    DIR_FD_ARGS = {"os.mkdir": 1, "os.remove": 1, "os.rmdir": 1, "os.rename": 2,
                   "os.symlink": 1, "os.link": 2, "os.chmod": 1, "os.chown": 1, "os.utime": 1,
                   "os.mkfifo": 1, "os.mknod": 1}

    def hook(event, args):
        if event == "sandbox.signal":  # _relay_signals: only SIG_DFL / SIG_IGN, never a callable
            signalnum, handler, box = args
            if callable_(handler):
                raise PermissionError("sandbox: Python signal handlers are not available "
                                      "(a handler would be handed this process's frames)")
            box.append(real_signal(int_int(signalnum), int_int(handler)))
            return
        if event == "sandbox.create_builtin":
            spec, box = args
            name = spec.name
            if type(name) is not str or name in FRESH_REFUSED:
                raise ImportError("sandbox: a second copy of module %r is not available" % (name,))
            box.append(real_create_builtin(namespace(name=name, origin="built-in")))
            return
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


def _decoder(max_items):
    """``decode(data)``: the value of one record ``b"v..."`` (the grammar of :func:`_encoder`),
    iteratively: depth and sizes bounded. Raises :class:`ProbeFailed` on anything else (a
    constructor's own error included)."""
    import json

    loads = json.loads

    def lazy(module, name):
        return lambda *a: getattr(__import__(module), name)(*a)

    fraction, decimal_, deque = (lazy("fractions", "Fraction"), lazy("decimal", "Decimal"),
                                 lazy("collections", "deque"))
    dt = {k: lazy("datetime", v) for k, v in
          (("d", "date"), ("D", "datetime"), ("t", "time"), ("r", "timedelta"))}
    arity = {"d": 3, "D": 7, "t": 4, "r": 3}

    def pairs(items):
        if len(items) % 2:
            raise ProbeFailed("malformed")
        return list(zip(items[0::2], items[1::2]))

    seqs = {"l": list, "t": tuple, "S": set, "R": frozenset, "d": lambda items: dict(pairs(items)),
            "K": lambda items: dict.fromkeys(items).keys(),
            "V": lambda items: dict(enumerate(items)).values(),
            "W": lambda items: dict(items).items()}

    def decode(data):
        if data[:1] != b"v":
            raise ProbeFailed("the probe raised")
        try:
            return parse(data.decode("ascii"))
        except ProbeFailed:
            raise
        except Exception as e:  # noqa: BLE001 - malformed, whatever the reason
            raise ProbeFailed("malformed record (%s)" % type(e).__name__)

    def parse(text):
        pos, n = 1, len(text)
        stack = [[[], 1, lambda items: items[0]]]  # [items, remaining, constructor]

        def num(end_char=";", limit=100000):
            nonlocal pos
            end = text.index(end_char, pos)
            if end - pos > limit:
                raise ProbeFailed("number too long")
            out = text[pos:end]
            pos = end + 1
            return out

        while stack:
            items, remaining, ctor = stack[-1]
            if remaining == 0:
                stack.pop()
                value = ctor(items)
                if not stack:
                    if pos != n:
                        raise ProbeFailed("trailing data")
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
                value = float(num(limit=64))
            elif tag == "c":
                parts_ = []
                for _ in range(2):
                    if text[pos:pos + 1] != "f":
                        raise ProbeFailed("malformed complex")
                    pos += 1
                    parts_.append(float(num(limit=64)))
                value = complex(*parts_)
            elif tag in "sbyD":  # strings: bounded by the record's size only
                raw = bytes.fromhex(num(limit=n))
                value = (raw.decode("utf-8", "surrogatepass") if tag == "s" else raw if tag == "b"
                         else bytearray(raw) if tag == "y" else decimal_(raw.decode("ascii")))
            elif tag == "J":
                count = int(num(), 10)
                if count < 0 or pos + count > n:
                    raise ProbeFailed("truncated")
                value = loads(text[pos:pos + count])
                pos += count
            elif tag in seqs:
                count = int(num(), 10)
                if len(stack) > 100 or count < 0 or (tag in "SRdKW" and count > max_items):
                    raise ProbeFailed("too deep or too large")
                stack.append([[], 2 * count if tag == "d" else count, seqs[tag]])
                continue
            elif tag == "g":
                stack.append([[], 3, lambda items: range(*items)])
                continue
            elif tag == "q":
                stack.append([[], 2, lambda items: fraction(*items)])
                continue
            elif tag == "Q":
                stack.append([[], 2, lambda items: deque(items[1], items[0])])
                continue
            elif tag == "A":
                kind = text[pos:pos + 1]
                pos += 1
                if kind not in dt or int(num(), 10) != arity[kind]:
                    raise ProbeFailed("malformed date")
                stack.append([[], arity[kind], lambda items, k=kind: dt[k](*items)])
                continue
            elif tag == "E":
                stack.append([[], 2, lambda items: Record(items[0], (("name", items[1]),), True)])
                continue
            elif tag == "Z":
                stack.append([[], 2, lambda items: Record(items[0], items[1], False)])
                continue
            elif tag == "I":
                end = text[pos:pos + 1]
                pos += 1
                stack.append([[], 1, lambda items, e=end: Snapshot(items[0], e == "e")])
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
    step of the program by ``__grpo_at__(step, is_statement, inputs)``; writes one line per step
    run, ``<test> <step> <encoded inputs>`` (``n``: none, ``-``: they raised or cannot be sent),
    then ``<test> D`` (or ``<test> E``: the test itself failed or asked for too much).

    ``verdict`` (after the program ran): decides each test on the probe records of the
    ``probes`` run. The records are the program's output, hence hostile: they are decoded here,
    in a throwaway process under memory / CPU limits and the caller's wall clock, into exact
    builtin types only (no object of the program exists here), then each test's judge source
    runs with the judge's builtins over those values. Writes ``PASS <i>`` per passed test and
    ``MISS <i>`` per test that cannot be judged (a traced test whose steps, recomputed, are
    not the ones the program ran, or whose inputs could not be sent) and ``PYTH <i>`` per test
    whose two readings disagree: it fails on the values as it built them but passes in its
    ``python`` reading (where what it handed to the program is read back from the sandbox),
    or passes as written while its Python reading cannot be judged. A test with a Python
    reading passes only when both readings pass; its Python reading failing fails it. Both stages write to their third descriptor;
    their stdout and stderr go nowhere (no test code can print a verdict).

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

    job_fd, res_fd, out_fd = int(argv[0]), int(argv[1]), int(argv[2])
    for name, value in (("RLIMIT_AS", 2 << 30), ("RLIMIT_CPU", 10), ("RLIMIT_FSIZE", 1 << 20),
                        ("RLIMIT_NPROC", 0), ("RLIMIT_CORE", 0)):
        try:
            resource.setrlimit(getattr(resource, name), (value, value))
        except (ValueError, OSError):
            pass
    sys.path[:] = [p for p in sys.path if p]  # (-P: no working directory on it; made sure)
    job = json.loads(os.pread(job_fd, os.fstat(job_fd).st_size, 0))
    sources, budget, probe_name = job["tests"], job["test_seconds"], job["probe"]
    stage = job.get("stage", "verdict")
    ids = job.get("ids") or list(range(len(sources)))
    seed = int(job.get("seed", 0))
    allowed_modules = frozenset(job["modules"])
    sys.setrecursionlimit(400)
    write = os.write
    encode = _encoder(job["max_items"])
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

    # A test's budget is CPU time (SIGPROF), not wall time: a loaded machine does not fail it.
    signal.signal(signal.SIGPROF, on_alarm)

    def timed(fn):
        signal.setitimer(signal.ITIMER_PROF, budget)
        try:
            return fn()
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)

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
                write(out_fd, ("%d E\n" % ids[t] if stage == "inputs" else "MISS %d\n" % t).encode())
            os._exit(0)

    def encoded(thunk):
        """The inputs ``thunk()`` returns, encoded; ``-`` when they raise or cannot be sent."""
        if thunk is None:
            return "n"
        try:
            return encode(tuple(thunk()))
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
            write(out_fd, "".join(lines).encode())
        os._exit(0)

    # stage == "verdict". Records: "<nonce> <test> <probe> v<value>" / "... x" (it raised) /
    # "<nonce> <test> d" (the test's steps completed); a traced test's records are numbered by
    # step run instead of probe. Lines without the nonce are the program's, not ours; a record
    # seen twice is void. Values are parsed only when a test reads them.
    raw = os.pread(res_fd, os.fstat(res_fd).st_size, 0)
    nonce = job["nonce"].encode()
    records, done = {}, {}  # records: {test: {probe or step run: record}}
    for line in raw.split(b"\n"):
        parts = line.split(b" ", 3)
        if len(parts) < 3 or parts[0] != nonce or not parts[1].isdigit() or len(parts[1]) > 9:
            continue
        t = int(parts[1])
        if parts[2] == b"d" and len(parts) == 3:
            done[t] = done.get(t, 0) + 1
        elif len(parts) == 4 and parts[2].isdigit() and len(parts[2]) < 10:
            mine, k = records.setdefault(t, {}), int(parts[2])
            mine[k] = None if k in mine else parts[3]
    del raw
    traces = {int(k): v for k, v in (job.get("traces") or {}).items()}

    current = [0]
    cache = {}  # {(test, probe): (decoded, value or the reason it failed)}

    def predecode(t):
        """Decode test ``t``'s records before its budget starts (they count against the
        process's wall clock only)."""
        for k, rec in records.get(t, {}).items():
            if (t, k) not in cache:
                try:
                    cache[(t, k)] = (True, decode(rec)) if rec is not None else (False, "twice")
                except ProbeFailed as e:
                    cache[(t, k)] = (False, str(e))

    def probe(pid):
        ok, value = cache.get((current[0], pid), (False, "no value"))
        if not ok:
            raise ProbeFailed(value)
        return value

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
    python = job.get("python") or [None] * len(sources)

    def verdict_of(t, src):
        current[0], runs[0] = t, 0
        start(t)
        try:
            timed(lambda: exec(compile(src, "<judge %d>" % t, "exec"), glb))
            verdict = done.get(t) == 1
            if verdict and t in traces and runs[0] != len(traces[t]):
                verdict = None
        except Unscorable:
            verdict = None
        except BaseException:  # noqa: BLE001 - any failure of the test fails it
            verdict = False
        return verdict

    for t, src in enumerate(sources):
        predecode(t)
        verdict = verdict_of(t, src)
        if python[t] is not None and verdict is not None:
            # Python's own reading (what the program left in the values it was handed) is the
            # dataset's; the test as written (the judge's copies) is what no program can move.
            # A pass needs both; a fail in Python's reading is a fail; a fail as written that
            # Python's reading passes (an in-place update the test checks, or a forgery that
            # changed the expected values) cannot be told apart.
            reading = verdict_of(t, python[t])
            if reading is False or (verdict is False and reading is None):
                continue
            if not (verdict is True and reading is True):
                write(out_fd, ("PYTH %d\n" % t).encode())
                continue
        if verdict is None:
            write(out_fd, ("MISS %d\n" % t).encode())
        elif verdict:
            write(out_fd, ("PASS %d\n" % t).encode())
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
