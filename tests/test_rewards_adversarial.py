"""Hostile inputs for grpo.rewards: a policy that wants reward without solving the task.

Every attack is checked from the outside (the score, the files, the processes, the clock), and
every call must return within its timeout + 2 s. Sandbox attacks run with the audit hook on
(the shipped configuration) and, where the claim is about the OS layers, with it off too.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
import uuid

import pytest

from grpo import rewards
from grpo.rewards import sandbox as _sandbox
from grpo.rewards import worker as math_worker
from grpo.rewards import (code_reward, code_rewards, extract_answer, format_reward, math_accuracy,
                          math_equal)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLACK = 2.0  # seconds over its timeout that any call may take


@functools.lru_cache(maxsize=1)
def _jail_ok() -> bool:
    return _sandbox.capabilities()["jail"]


needs_jail = pytest.mark.skipif("not _jail_ok()", reason="the sandbox cannot be built here")


def _timed(fn, budget: float):
    start = time.monotonic()
    out = fn()
    elapsed = time.monotonic() - start
    assert elapsed < budget, f"took {elapsed:.1f}s, budget {budget:.1f}s"
    return out


# --------------------------------------------------------------------------------------------
# Forged verdicts: wrong code plus an attack must score 0
# --------------------------------------------------------------------------------------------

WRONG = "def f(x):\n    return -1\n"
VALUE_TEST = ["assert f(1) == 2"]  # compared outside the sandbox
STATEMENT_TEST = ["r = f(1)\nassert r == 2"]  # the test binds a name: runs in-process, own process

ATTACKS = {
    "exit_zero_early": "import os\nos._exit(0)",
    "sys_exit": "raise SystemExit(0)",
    "print_result_lines": "print('{\"i\": 0, \"v\": {\"i\": \"2\"}}')\nprint('T 0 1')",
    "spray_fds": textwrap.dedent("""
        import os
        for fd in range(64):
            for line in (b'{"i": 0, "v": {"i": "2"}}\\n', b'T 0 1\\n', b'0' * 32 + b'\\n'):
                try:
                    os.write(fd, line)
                except OSError:
                    pass
        """),
    "getframe_locals": textwrap.dedent("""
        import sys, os
        try:
            fr = sys._getframe(1)
            while fr is not None:
                for k, v in fr.f_locals.items():
                    if isinstance(v, str) and len(v) == 32:
                        os.write(1, v.encode())
                fr = fr.f_back
        except Exception:
            pass
        """),
    "traceback_frames": textwrap.dedent("""
        import os
        try:
            raise ValueError
        except ValueError as e:
            try:
                fr = e.__traceback__.tb_frame
                while fr is not None:
                    fr.f_locals
                    fr = fr.f_back
                os._exit(0)
            except AttributeError:
                pass
        """),
    "generator_frames": textwrap.dedent("""
        def g():
            yield
        it = g()
        try:
            fr = it.gi_frame
        except AttributeError:
            fr = None
        """),
    "gc_scan": textwrap.dedent("""
        try:
            import gc
            for o in gc.get_objects():
                pass
        except Exception:
            pass
        """),
    "disable_audit_hook": textwrap.dedent("""
        import os, sys
        try:
            os.system('true')
        except PermissionError as e:
            tb = e.__traceback__
            while tb is not None:
                try:
                    tb.tb_frame.f_locals.clear()
                except AttributeError:
                    pass
                tb = tb.tb_next
        try:
            sys.settrace(lambda *a: None)
        except Exception:
            pass
        """),
    "always_equal": textwrap.dedent("""
        class Anything:
            def __eq__(self, other): return True
            def __ne__(self, other): return False
            def __bool__(self): return True
        def f(x):
            return Anything()
        """),
    "int_subclass": textwrap.dedent("""
        class Sneaky(int):
            def __eq__(self, other): return True
            __hash__ = int.__hash__
        def f(x):
            return Sneaky(-1)
        """),
    "patch_builtins": textwrap.dedent("""
        import builtins, json
        builtins.abs = lambda x: 0
        json.dumps = lambda *a, **k: '{"i": 0, "v": {"i": "2"}}'
        """),
    "code_object_surgery": textwrap.dedent("""
        try:
            code = (lambda: 0).__code__.replace(co_code=b'\\x00' * 8)
        except Exception:
            pass
        """),
    "marshal_code": "import marshal\ntry:\n    marshal.loads(b'\\xe3')\nexcept Exception:\n    pass",
    "ctypes_memory": "try:\n    import ctypes\n    ctypes.string_at(id(0), 64)\nexcept Exception:\n    pass",
    "proc_self_mem": textwrap.dedent("""
        for p in ('/proc/self/mem', '/proc/1/mem', '/dev/fd/3'):
            try:
                open(p, 'rb').read(1)
            except Exception:
                pass
        """),
    "dir_fd_open": textwrap.dedent("""
        import os
        try:
            d = os.open('/', os.O_RDONLY | os.O_DIRECTORY)
            os.open('tmp/x', os.O_WRONLY | os.O_CREAT, dir_fd=d)
        except Exception:
            pass
        """),
    "setsid_and_sleep": "import os, time\ntry:\n    os.setsid()\nexcept Exception:\n    pass\ntime.sleep(30)",
    "stop_self": "import os, signal\ntry:\n    os.kill(os.getpid(), signal.SIGSTOP)\nexcept Exception:\n    pass",
    "huge_stdout": "import sys\nwhile True:\n    sys.stdout.write('2\\n' * 65536)",
    "thread_bomb": textwrap.dedent("""
        import threading
        try:
            for _ in range(10000):
                threading.Thread(target=lambda: None).start()
        except Exception:
            pass
        """),
}


@needs_jail
@pytest.mark.parametrize("tests", [VALUE_TEST, STATEMENT_TEST], ids=["value", "statement"])
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_attack_cannot_forge_a_pass(attack, tests):
    code = ATTACKS[attack]
    if "def f(" not in code:
        code = WRONG + code
    text = f"```python\n{code}\n```"
    score = _timed(lambda: code_reward(text, tests, timeout=2.0), 2.0 + SLACK)
    assert score == 0.0


@needs_jail
def test_right_code_still_passes_both_kinds():
    right = "```python\ndef f(x):\n    return 2 * x\n```"
    tests = VALUE_TEST + STATEMENT_TEST + ["assert f(3) == 7", "r = f(3)\nassert r == 7"]
    assert code_reward(right, tests, timeout=5.0) == 0.5


@needs_jail
def test_expected_value_never_enters_the_sandbox():
    # The program searches every string it can reach for the expected value; it is not there.
    probe = textwrap.dedent("""
        import sys
        def f(x):
            return 0
        seen = repr(sys.argv) + repr(globals())
        if "31337" in seen:
            raise SystemExit(0)
        """)
    r = _sandbox.run(probe, mode="probes", run_job={"tests": [[["probe", 0, "f(1)"]]]}, timeout=3)
    assert r.error is None and "31337" not in r.stdout
    assert code_reward(f"```python\n{probe}\n```", ["assert f(1) == 31337"]) == 0.0


def test_humaneval_checkers_are_inlined_or_refused():
    inline = "def check(candidate):\n    assert candidate(1) == 2\ncheck(f)"
    plan = _sandbox.plan_assert_tests("", [inline])
    assert not plan.refused and plan.inside[0] == [["probe", 0, "f(1)"]]
    for kept in ["def check(c):\n    return c(1) == 2\nassert check(f)",
                 "def check(c):\n    assert c(1) == 2\ncheck(lambda x: f(x))",
                 "def check(c):\n    if c(1):\n        assert c(1) == 2\ncheck(f)"]:
        assert _sandbox.plan_assert_tests("", [kept]).judge == [None], kept


def test_test_logic_runs_in_the_judge():
    # Logic the test defines for itself is refused; logic it writes inline runs in the judge,
    # and only the program's parts (probes) run inside.
    plan = _sandbox.plan_assert_tests("", ["def ok(v):\n    return v > 3\nassert ok(f(1)) == True"])
    assert plan.judge == [None] and "FunctionDef" in plan.refused[0]
    for test in ["assert (lambda v: v > 3)(f(1)) == True", "assert all(v > 3 for v in f(1)) == True",
                 "assert isinstance(f(1), int) is True", "assert f(1) == g(1)", "assert 2 == len(f(1))"]:
        plan = _sandbox.plan_assert_tests("", [test])
        assert not plan.refused, test
        probes = [step[2] for step in plan.inside[0] if step[0] == "probe"]
        assert all(p in ("f(1)", "g(1)") for p in probes), (test, probes)


# --------------------------------------------------------------------------------------------
# Containment: what the program can see and touch (checked outside)
# --------------------------------------------------------------------------------------------

READ_PROBE = textwrap.dedent("""
    import os
    targets = {targets!r}
    for path in targets:
        try:
            with open(path, 'rb') as fh:
                print('READ', path, fh.read(64))
        except Exception as e:
            print('DENIED', path, type(e).__name__)
    for d in ('/', '/etc', '/proc', '/work', '/root', '/home'):
        try:
            print('LIST', d, sorted(os.listdir(d)))
        except Exception as e:
            print('NOLIST', d, type(e).__name__)
    """)


@needs_jail
@pytest.mark.parametrize("audit", [True, False], ids=["hook", "os-only"])
def test_filesystem_view_is_private(audit, tmp_path):
    data = tmp_path / "answers.jsonl"
    data.write_text('{"answer": "secret-7431"}\n')
    targets = [str(data), os.path.abspath(__file__), os.path.join(ROOT, "pyproject.toml"),
               "/etc/hostname", "/etc/passwd", "/etc/shadow", f"/proc/{os.getpid()}/cmdline",
               "/proc/self/environ", "/proc/self/mem", "/root/.bash_history"]
    r = _sandbox.run(READ_PROBE.format(targets=targets), mode="stdio", timeout=5, audit=audit)
    assert r.error is None and r.returncode == 0, r.stderr
    assert "READ" not in r.stdout, r.stdout
    listed = {ln.split(" ", 2)[1]: ln for ln in r.stdout.splitlines() if ln.startswith("LIST")}
    assert "'etc'" in listed["/"] and "'work'" not in listed["/"] and "'proc'" not in listed["/"]
    assert "hostname" not in listed.get("/etc", "") and "passwd" not in listed.get("/etc", "")
    assert "/work" not in listed and "/proc" not in listed


@needs_jail
@pytest.mark.parametrize("audit", [True, False], ids=["hook", "os-only"])
def test_cannot_write_anywhere_but_private_tmp(audit, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    os.chmod(tmp_path, 0o777)
    targets = [str(shared / "pwned"), "/tmp/pwned-" + uuid.uuid4().hex, "/usr/pwned",
               os.path.join(ROOT, "pwned"), "/dev/shm/pwned", "/pwned"]
    code = textwrap.dedent(f"""
        import os
        for p in {targets!r}:
            for attempt in (lambda: open(p, 'w').write('x'), lambda: os.mkdir(p + '.d')):
                try:
                    attempt()
                except Exception:
                    pass
        open('/tmp/mine.txt', 'w').write('ok')
        print(open('/tmp/mine.txt').read())
        """)
    r = _sandbox.run(code, mode="stdio", timeout=5, audit=audit)
    assert r.stdout.strip() == "ok", r.stderr
    for p in targets:
        assert not os.path.exists(p) and not os.path.exists(p + ".d"), p


@needs_jail
@pytest.mark.parametrize("audit", [True, False], ids=["hook", "os-only"])
def test_cannot_signal_the_trainer_or_its_processes(audit):
    victim = subprocess.Popen(["sleep", "30"])
    try:
        code = textwrap.dedent(f"""
            import os, signal
            for pid in (os.getppid(), {os.getpid()}, {victim.pid}, -1, 0):
                try:
                    os.kill(pid, signal.SIGKILL)
                except Exception:
                    pass
            """)
        _timed(lambda: _sandbox.run(code, mode="stdio", timeout=3, audit=audit), 3 + SLACK)
        assert victim.poll() is None  # still running
    finally:
        victim.kill()
        victim.wait()


@needs_jail
@pytest.mark.parametrize("audit", [True, False], ids=["hook", "os-only"])
def test_no_network_and_no_new_processes(audit):
    code = textwrap.dedent("""
        import os, socket
        try:
            socket.create_connection(('1.1.1.1', 53), timeout=1)
            print('CONNECTED')
        except Exception:
            pass
        try:
            if os.fork() == 0:
                os._exit(0)
            print('FORKED')
        except Exception:
            pass
        """)
    r = _sandbox.run(code, mode="stdio", timeout=3, audit=audit)
    assert "CONNECTED" not in r.stdout and "FORKED" not in r.stdout


@needs_jail
def test_runaway_programs_end_on_time_and_leave_nothing():
    for code in (ATTACKS["setsid_and_sleep"], ATTACKS["stop_self"], ATTACKS["huge_stdout"],
                 "while True:\n    pass"):
        r = _timed(lambda c=code: _sandbox.run(c, mode="stdio", timeout=1.5), 1.5 + SLACK)
        assert len(r.stdout) <= _sandbox.MAX_OUTPUT_BYTES
    time.sleep(0.3)
    leftovers = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"grpo.rewards.sandbox`` runs" in f.read():
                    leftovers.append(pid)
        except OSError:
            pass
    assert not leftovers


# The same checks as an ordinary user: when the tests run as root, drop to an unused uid with
# setpriv (no account needed) and run a script there.
UNPRIVILEGED_SCRIPT = textwrap.dedent("""
    import importlib.machinery, importlib.util, json, os, sys
    root, secret_dir = sys.argv[1], sys.argv[2]
    spec = importlib.machinery.PathFinder.find_spec("grpo", [root])
    sys.modules["grpo"] = importlib.util.module_from_spec(spec)  # grpo/__init__ imports torch
    from grpo import rewards
    from grpo.rewards import sandbox as _sandbox
    out = {"uid": os.getuid(), "caps": _sandbox.capabilities()}
    probe = ("import os\\n"
             "for p in [%r, %r, '/etc/hostname']:\\n"
             "    try:\\n        print('READ', open(p).read(20))\\n    except Exception:\\n        pass\\n"
             "try:\\n    open(%r, 'w').write('x')\\nexcept Exception:\\n    pass\\n"
             "print(os.getuid())\\n") % (os.path.join(secret_dir, "secret.txt"),
                                         os.path.join(root, "pyproject.toml"),
                                         os.path.join(secret_dir, "pwned"))
    for audit in (True, False):
        r = _sandbox.run(probe, mode="stdio", timeout=5, audit=audit)
        out["audit=%s" % audit] = [r.stdout, r.error]
    wrong = "```python\\ndef f(x):\\n    return -1\\nimport os\\nos._exit(0)\\n```"
    out["forged"] = rewards.code_rewards([wrong, wrong], [["assert f(1) == 2"],
                                                          ["r = f(1)\\nassert r == 2"]])
    right = "```python\\ndef f(x):\\n    return 2 * x\\n```"
    out["right"] = rewards.code_rewards([right], [["assert f(1) == 2", "r = f(1)\\nassert r == 2"]])
    print(json.dumps(out))
""")


def _unprivileged_python(uid: int) -> list[str] | None:
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    drop = [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    # The sandbox execs the real interpreter behind a venv: that one must be runnable too.
    probe = ("import os, sys; exe = os.path.realpath(getattr(sys, '_base_executable', None) "
             "or sys.executable); sys.exit(0 if os.access(exe, os.X_OK) else 1)")
    for exe in (sys.executable, "/usr/bin/python3"):
        if os.path.exists(exe) and subprocess.run(drop + [exe, "-I", "-c", probe],
                                                  capture_output=True).returncode == 0:
            return drop + [exe, "-I"]
    return None


def test_enforcement_as_an_ordinary_user():
    if os.geteuid() != 0:
        pytest.skip("already an ordinary user: every other sandbox test covers this case")
    uid = 54321 + os.getpid() % 1000
    cmd = _unprivileged_python(uid)
    if cmd is None:
        pytest.skip("no setpriv, or no Python this uid may run (e.g. the venv under /root)")
    base = tempfile.mkdtemp(prefix="grpo-unpriv-")  # pytest's tmp_path is 0700 for root
    try:
        os.chmod(base, 0o755)
        secret_dir = os.path.join(base, "user-data")
        os.mkdir(secret_dir)
        with open(os.path.join(secret_dir, "secret.txt"), "w") as f:
            f.write("secret-9911")
        for p in (secret_dir, os.path.join(secret_dir, "secret.txt")):
            os.chown(p, uid, uid)  # the ordinary user's own files: readable, writable by it
        script = os.path.join(base, "check.py")
        with open(script, "w") as f:
            f.write(UNPRIVILEGED_SCRIPT)
        os.chmod(script, 0o644)
        proc = subprocess.run(cmd + [script, ROOT, secret_dir], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["uid"] == uid
        if not out["caps"]["jail"]:
            # No unprivileged user namespaces here: the sandbox must fail closed, never run bare.
            assert out["forged"] == [None, None] and out["right"] == [None]
            pytest.skip(f"user namespaces unavailable: failed closed ({out['caps']['error']})")
        for audit in (True, False):
            stdout, error = out[f"audit={audit}"]
            assert error is None and "READ" not in stdout and "secret-9911" not in stdout
            assert stdout.split()[-1] == "65534"  # not the trainer's uid inside
        assert not os.path.exists(os.path.join(secret_dir, "pwned"))
        assert out["forged"] == [0.0, 0.0]
        assert out["right"] == [1.0]
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_sandbox_fails_closed(monkeypatch, caplog):
    # A jail that cannot be built scores None (unscorable), logs once, and runs nothing.
    monkeypatch.setattr(_sandbox, "_SYS_PIVOT_ROOT", {})
    monkeypatch.setattr(_sandbox.platform, "machine", lambda: "none")
    monkeypatch.setattr(rewards.code, "_sandbox_failure_logged", False)
    real_run = _sandbox.run

    def broken(code, **kw):
        r = real_run("import os\nos._exit(97)", **{**kw, "mode": "stdio"})
        r.error = r.error or "simulated failure"
        return r

    monkeypatch.setattr(_sandbox, "run", broken)
    text = "```python\ndef f(x):\n    return 2 * x\n```"
    with caplog.at_level(logging.ERROR, logger="grpo.rewards"):
        out = code_rewards([text, text], [["assert f(1) == 2"], [{"input": "", "output": ""}]])
    assert out == [None, None]
    assert sum("sandbox cannot be built" in r.getMessage() for r in caplog.records) == 1


# --------------------------------------------------------------------------------------------
# Bounded parsing: every reward on long adversarial strings
# --------------------------------------------------------------------------------------------

N = 64 * 1024
LONG_INPUTS = {
    "answer_tags": "<answer>" * (N // 8),
    "answer_close_tags": "</answer>" * (N // 9),
    "open_boxes": "\\boxed{" * (N // 7),
    "boxed_words": "\\boxed{3 " + "because there are apples " * (N // 25) + "!}",
    "braces": "{" * N + "}" * N,
    "unbalanced": "\\boxed{" + "{" * N,
    "fences": "```python\n" * (N // 10),
    "fence_pairs": "```python\nx\n```" * (N // 15),
    "think_tags": "<think>" * (N // 7),
    "letters_bang": "a " * N + "!",
    "digits_spaces": "1 " * N,
    "text_cmds": "\\text{" * (N // 6),
    "fracs": "\\frac{1}{" * (N // 9),
    "superscripts": "x" + "\u00b2" * N,
    "zero_width": "\u200b" * N,
    "colons": "1:" * N,
    "commas": "1," * N,
    "dots": "5" + "." * N + "x",
    "backslashes": "\\" * N,
    "nested_box": "\\boxed{" * 3000 + "5" + "}" * 3000,
}


@pytest.mark.parametrize("name", sorted(LONG_INPUTS))
def test_every_reward_is_bounded_on_long_input(name):
    s = LONG_INPUTS[name]
    boxed = f"\\boxed{{{s}}}"
    budget = 1.0 + SLACK
    _timed(lambda: extract_answer(s), 0.5 + SLACK)
    _timed(lambda: format_reward(s), 0.5 + SLACK)
    _timed(lambda: format_reward(f"<think>{s}</think><answer>{s}</answer>"), 0.5 + SLACK)
    _timed(lambda: rewards.extract_code(s), 0.5 + SLACK)
    assert _timed(lambda: math_accuracy(s, "3", timeout=1.0), budget) == 0.0
    assert _timed(lambda: math_accuracy(boxed, "3", timeout=1.0), budget) == 0.0
    assert _timed(lambda: math_equal(s[:3000], "3", timeout=1.0), budget) is False
    assert _timed(lambda: math_equal("3", s[:3000], timeout=1.0), budget) is False
    out = _timed(lambda: rewards.math_accuracy_reward(["p"], [boxed], answer=["3"], timeout=1.0),
                 budget)
    assert out == [0.0]
    # No runnable code in these strings (or a harmless one): the sandbox is not the bottleneck.
    _timed(lambda: code_reward(s, ["assert f(1) == 2"], timeout=1.0), 1.0 + SLACK)


def test_issue_hangs_are_gone():
    text = r"\boxed{3 because there are exactly three apples left over!}"
    assert _timed(lambda: math_accuracy(text, "3", timeout=1), 1 + SLACK) == 0.0
    assert _timed(lambda: extract_answer("<answer>" * 8000), 0.5) is None
    assert _timed(lambda: extract_answer("<answer>" * 8000 + "7</answer>"), 0.5) == "7"


# --------------------------------------------------------------------------------------------
# math_equal: false positives a policy would learn, and the false negatives of issue 15
# --------------------------------------------------------------------------------------------

FALSE_POSITIVES = [
    ("12:00", "1:00"), ("12:30", "12:03"), ("1:00 am", "1:00 pm"), ("10:00", "100"),
    ("0.3333", r"\frac{1}{3}"), ("0.33333333", r"\frac{1}{3}"), ("3.000", "3.0001"),
    ("3.0001", "3"), ("1.414", r"\sqrt{2}"), ("3.1416", r"\pi"), ("0.999", "1"),
    (r"2\text{5 kg}", "2"), (r"2\text{ 5 kg}", "25"), (r"5\text{ times }2", "52"),
    (r"3\text{ and }4", "34"), ("2 3", "23"), ("1 000", "1"), ("1 2 3", "123"),
    (r"0.5\%", "0.5"), ("0.5", r"0.5\%"), (r"50\%", "50"), (r"10\text{ cm}^2", "100"),
    # hedging: several answers for one
    ("1, 2, 3", "2"), (r"\{1,2,3\}", "2"), (r"2 \text{ or } 3", "2"), (r"\pm 3", "3"),
    (r"x = 1 \text{ or } x = 2", "1"), ("[1, 3]", "2"),
    # lookalikes
    ("\u0662", "2"), ("O", "0"), ("l", "1"), ("\u0417", "3"), ("\u0661\u0662", "12"),
    # wrapping and truncation tricks
    (r"\boxed{\boxed{4}", "4"), (r"\frac{1}{2", r"\frac{1}{2}"), ("4" + "0" * 2000, "4"),
    ("\\text{4}" + " " * 3000, "4"), (r"\sqrt{16", "4"),
]

FALSE_NEGATIVES_FIXED = [
    (r"\mathbb{R}", r"(-\infty, \infty)"), (r"(-\infty,\infty)", r"\mathbb{R}"),
    ("\u211d", r"\mathbb{R}"), (r"x \in \mathbb{R}", r"(-\infty, \infty)"),
    (r"\{x \mid x > 3\}", r"(3, \infty)"), (r"\{x : x \le 2\}", r"(-\infty, 2]"),
    (r"\{x \in \mathbb{R} \mid x > 3\}", "x > 3"), (r"\left\{ x \mid 1 < x < 2 \right\}", "(1, 2)"),
    ("(1,234)", "(1, 234)"), ("(1, 234)", "(1,234)"), ("1,234", "1234"), (r"1\,234", "1234"),
    ("x\u00b2", "x^2"), ("x\u00b2+2x+1", "(x+1)^2"), ("2\u00b3", "8"), ("\u00bd", r"\frac{1}{2}"),
    ("\u00be", "0.75"), ("2\u00bd", "2.5"), ("\uff14\uff12", "42"), ("\U0001d7d2", "4"),
    ("1:00 pm", "13:00"), ("7:05", "7:05"), ("4\u200b2", "42"), ("3.0", "3"),
]


@pytest.mark.parametrize("pred,gold", FALSE_POSITIVES)
def test_no_false_positive(pred, gold):
    assert _timed(lambda: math_equal(pred, gold, timeout=3.0), 3 + SLACK) is False
    assert math_equal(gold, pred, timeout=3.0) is False


@pytest.mark.parametrize("pred,gold", FALSE_NEGATIVES_FIXED)
def test_false_negatives_fixed(pred, gold):
    assert math_equal(pred, gold, timeout=5.0) is True


def test_nested_and_unbalanced_boxes():
    assert extract_answer(r"\boxed{\boxed{5}}") == "5"  # the innermost, last box
    assert math_accuracy(r"\boxed{\boxed{5}}", "5") == 1.0
    assert math_accuracy(r"\boxed{5}}", "5") == 1.0
    assert math_accuracy(r"\boxed{5", "5") == 0.0
    assert math_accuracy(r"\boxed{4} wait \boxed{5", "4") == 0.0  # truncated last answer
    assert math_accuracy(r"\boxed{1} \boxed{2} \boxed{3}", "2") == 0.0  # the last one counts


# --------------------------------------------------------------------------------------------
# format_reward: invisible content
# --------------------------------------------------------------------------------------------

INVISIBLE = ["\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\u00ad", "\u2061", "\u180e",
             "\u3164", "\u2800", "\u115f", "\uffa0", "\u00a0", "\u3000", "\u2028", "\u0301",
             "\ue000", "\u202e", "\u034f", "\U000e0020", "\u200b\u2060\ufeff \n\t"]


@pytest.mark.parametrize("blank", INVISIBLE, ids=[f"U+{ord(c[0]):04X}" for c in INVISIBLE])
def test_invisible_characters_are_not_content(blank):
    assert format_reward(f"<think>{blank}</think><answer>4</answer>") == 0.0
    assert format_reward(f"<think>r</think><answer>{blank}</answer>") == 0.0
    assert format_reward(f"{blank}<think>r</think>{blank}<answer>4</answer>{blank}") == 1.0
    assert format_reward(f"{blank}</think><answer>4</answer>", think_prefilled=True) == 0.0


# --------------------------------------------------------------------------------------------
# Arguments: timeouts and batch shapes
# --------------------------------------------------------------------------------------------

BAD_TIMEOUTS = [float("inf"), float("nan"), -1.0, 0.0, 1e10, 10**12]


@pytest.mark.parametrize("timeout", BAD_TIMEOUTS, ids=repr)
def test_bad_timeout_is_a_value_error(timeout):
    calls = [lambda: math_equal("1", "1", timeout=timeout),
             lambda: math_accuracy(r"\boxed{1}", "1", timeout=timeout),
             lambda: code_reward("```python\npass\n```", ["assert True"], timeout=timeout),
             lambda: code_rewards(["x"], [["assert True"]], timeout=timeout),
             lambda: rewards.math_accuracy_reward(["p"], [r"\boxed{1}"], answer=["1"],
                                                  timeout=timeout)]
    for call in calls:
        with pytest.raises(ValueError, match="timeout"):
            call()


@pytest.mark.parametrize("timeout", [True, "5", None])
def test_timeout_of_wrong_type_is_a_type_error(timeout):
    with pytest.raises(TypeError, match="timeout"):
        math_equal("1", "1", timeout=timeout)


def test_large_valid_timeout_still_scores_correct_answers():
    assert math_equal(r"\frac{2}{4}", "0.5", timeout=86_400) is True
    assert math_equal("(x+1)^2", "x^2+2x+1", timeout=1e4) is True


def test_code_rewards_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="tests"):
        code_rewards(["a", "b", "c"], [["assert True"]] * 2)
    with pytest.raises(ValueError, match="tests"):
        code_rewards(["a"], [["assert True"]] * 2)


# --------------------------------------------------------------------------------------------
# The math worker: its own module, and a start failure that is not a silent "wrong"
# --------------------------------------------------------------------------------------------


def test_worker_start_failure_is_logged_once_and_unscorable(monkeypatch, caplog):
    monkeypatch.setattr(math_worker, "LAUNCH", "raise SystemExit('no sympy here')")
    monkeypatch.setattr(rewards.math, "_pool", math_worker.WorkerPool(1))
    with caplog.at_level(logging.ERROR, logger="grpo.rewards.worker"):
        out = rewards.math_accuracy_reward(["p"] * 2, [r"\boxed{x+1}", r"\boxed{1+x}"],
                                           answer=["x+1", "x+1"])
        with pytest.raises(math_worker.VerifierUnavailable, match="no sympy here"):
            math_equal("x+1", "1+x")
    # x+1 == x+1 is decided in-process; 1+x needs SymPy, which is unavailable: None, not 0.
    assert out == [1.0, None]
    assert sum("failed to start" in r.getMessage() for r in caplog.records) == 1


def test_bootstrap_is_a_packaged_file():
    from importlib import resources

    text = resources.files("grpo.rewards").joinpath("sandbox_bootstrap.py").read_text()
    assert text == _sandbox._bootstrap_source()
    compile(text, "sandbox_bootstrap.py", "exec")  # a real module, seen by linters
    assert math_worker.main.__module__ == "grpo.rewards.worker"


# --------------------------------------------------------------------------------------------
# Round 2: honest standard-library code passes, forged verdicts of every form fail, the parent
# stays bounded (tests/rewards_corpus.py holds the solutions and the attacks)
# --------------------------------------------------------------------------------------------

from rewards_corpus import ATTACK_TESTS, HONEST  # noqa: E402
from rewards_corpus import ATTACKS as CORPUS_ATTACKS  # noqa: E402


@needs_jail
@pytest.mark.timeout(300)
def test_honest_stdlib_solutions_all_pass():
    # One completion per solution, scored in parallel (one sandbox + one judge run each).
    out = code_rewards([f"```python\n{c}\n```" for c, _ in HONEST], [t for _, t in HONEST],
                       timeout=20.0)
    assert len(HONEST) >= 50
    assert [i for i, o in enumerate(out) if o != 1.0] == []


@needs_jail
@pytest.mark.timeout(300)
def test_attacks_forge_no_test():
    out = code_rewards([f"```python\n{c}\n```" for c in CORPUS_ATTACKS.values()],
                       [ATTACK_TESTS] * len(CORPUS_ATTACKS), timeout=5.0)
    assert dict(zip(CORPUS_ATTACKS, out)) == dict.fromkeys(CORPUS_ATTACKS, 0.0)
    # The same tests against the right code all pass: the attack set is not trivially failing.
    assert code_reward("```python\ndef f(x):\n    return 2 * x\n```", ATTACK_TESTS) == 1.0


@pytest.mark.parametrize("seed", range(3))
def test_comparisons_are_planned_into_the_judge(seed):
    # Generated forms: every comparison, membership and literal-method test keeps the program
    # to probes (calls of f), never inside a comparison.
    import random
    rng = random.Random(seed)
    ops = ["==", "!=", "<", "<=", ">", ">=", "in", "not in", "is", "is not"]
    for _ in range(50):
        a, b = rng.randint(-9, 9), rng.randint(-9, 9)
        form = rng.choice([f"f({a}) {rng.choice(ops)} [{b}]", f"{b} == f({a}) == {b}",
                           f"[{b}].count(f({a})) == 1", f"({b},).index(f({a})) == 0",
                           f"f({a}) in {{{b}}}", f"not f({a}) != {b}", f"sorted([f({a})]) == [{b}]"])
        stmt = rng.choice([f"assert {form}", f"assert {form}\nassert f({b}) == {a}",
                           f"r = f({a})\nassert {form.replace(f'f({a})', 'r')}"])
        plan = _sandbox.plan_assert_tests("", [stmt])
        assert not plan.refused, stmt
        probes = [s[2] for s in plan.inside[0] if s[0] == "probe"]
        assert probes and all(p.startswith("f(") for p in probes), (stmt, probes)


@needs_jail
@pytest.mark.timeout(120)
def test_colliding_hash_results_do_not_stall_the_parent():
    # Integers sharing one hash value (multiples of 2**61 - 1) as a set and as many lines.
    code = textwrap.dedent("""
        M = (1 << 61) - 1
        def f(x):
            return {i * M for i in range(1, 200000)}
        import sys
        for i in range(1, 300000):
            sys.stdout.write('%d\\n' % (i * M))
        """)
    text = f"```python\n{code}\n```"
    start = time.monotonic()
    out = code_rewards([text, text], [["assert len(f(1)) == 5"], [{"input": "", "output": "1"}]],
                       timeout=2.0)
    assert time.monotonic() - start < 2.0 + _sandbox.JUDGE_SECONDS + 2 * SLACK
    assert out == [0.0, 0.0]


@pytest.mark.parametrize("cp", [0x1D159, 0x2800, 0x3164, 0x115F, 0xFFA0, 0x034F, 0x180B, 0xE0100,
                                0x200B, 0x2060, 0xFEFF, 0x00AD, 0x0300, 0x3000, 0x1D173])
def test_blank_rendering_blocks_are_empty(cp):
    c = chr(cp)
    assert format_reward(f"<think>{c}</think><answer>5</answer>") == 0.0
    assert format_reward(f"<think>ok</think><answer>{c * 3}</answer>") == 0.0
    assert format_reward(f"<think>ok{c}</think><answer>5</answer>") == 1.0


def test_default_ignorable_matches_its_definition_over_all_code_points():
    # Every Cf (bar the definition's exclusions) and every listed range is default-ignorable,
    # and each one is invisible; no letter, digit or punctuation is, outside the blank names.
    import unicodedata
    from grpo.rewards.format import default_ignorable, invisible
    for cp in range(0x110000):
        c = chr(cp)
        cat = unicodedata.category(c)
        if default_ignorable(c):
            assert invisible(c)
        if cat[0] in "LNP" and invisible(c):
            assert cp in (0x115F, 0x1160, 0x3164, 0xFFA0) or "FILLER" in unicodedata.name(c, ""), hex(cp)
    assert default_ignorable("\u200b") and not default_ignorable("\u0600") and not default_ignorable("a")


# --------------------------------------------------------------------------------------------
# Math, round 2: generated variants of each class (pred, gold, expected)
# --------------------------------------------------------------------------------------------


def _math_variants(seed: int) -> list[tuple[str, str, bool]]:
    import random
    rng = random.Random(seed)
    out = []
    for _ in range(4):
        n = rng.randint(1000, 99_999_999)
        groups = f"{n:,}".split(",")
        sep = rng.choice([",\\!", ",\\! ", "{,}", "\\,"])
        out.append((sep.join(groups), str(n), True))                      # MATH thousands
        out.append((f"$\\${sep.join(groups)}.{rng.randint(10, 99)}$", str(n), False))
        k = rng.randint(1, 999)
        out.append((f"0,{k:03d}", str(k), False))                          # leading-zero group
        out.append((f"0{{,}}{k:03d}", str(k), False))
        a, b, c = rng.randint(1, 9), rng.randint(1, 9), rng.randint(1, 9)
        var = rng.choice("xyzk")
        out.append((f"{var} = {a} + {b} + {c} = {a + b + c}", str(a + b + c), True))  # chains
        out.append((f"{var} = {a} + {b} = {a + b + 1}", str(a + b), False))
        d = rng.randint(1, 9)
        op, flipped = rng.choice([("<", ">"), (">", "<"), ("\\le", "\\ge"), ("\\ge", "\\le")])
        out.append((f"-{var} {op} -{d}", f"{var} {flipped} {d}", True))    # inequalities
        out.append((f"{a}{var} {op} {a * d}", f"{var} {op} {d}", True))
        out.append((f"{a}{var} {op} {a * d}", f"{var} {flipped} {d}", False))
        p = rng.randint(1, 99)
        out.append((f"{p} {rng.choice(['pct', 'percent', 'percentage'])}", f"{p}\\%", True))
        out.append((f"${p}$ percent", f"{p}\\%", True))
        out.append((f"{p + 1} pct", f"{p}\\%", False))
        xs = rng.sample(range(-20, 20), 4)
        out.append((";".join(map(str, xs)), "\\{" + ", ".join(map(str, reversed(xs))) + "\\}", True))
        out.append((";".join(map(str, xs[:3])), ", ".join(map(str, xs)), False))
        t1, t2 = (a, b), (c, d)
        out.append((f"({t1[0]},{t1[1]})or({t2[0]},{t2[1]})", f"({t2[0]}, {t2[1]}), ({t1[0]}, {t1[1]})", True))
        out.append((f"({a};{b};{c})", f"({a}, {b}, {c})", True))
        out.append((f"({a}, {b}), ({a}, {b}), ({c}, {d + 10})", f"({c}, {d + 10}), ({a}, {b})", True))
        out.append((f"({a}, {b}), ({c}, {d + 10})", f"({a}, {b + 10})", False))
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", range(2))
def test_math_classes_of_round_two(seed):
    cases = _math_variants(seed)
    with ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda c: math_equal(c[0], c[1], timeout=10.0), cases))
    wrong = [(p, g, e) for (p, g, e), r in zip(cases, got) if r != e]
    assert wrong == []
