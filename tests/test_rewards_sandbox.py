"""Tests for grpo.rewards.sandbox and its bootstrap (the jail and the judge): a policy that wants
reward without solving the task.

Every attack is checked from the outside (the score, the files, the test process's children, stray
sandbox processes, the clock), and every call must return within its timeout + 2 s. Sandbox attacks
run with the audit hook on (the shipped configuration) and, where the claim is about the OS layers,
with it off too. tests/rewards_corpus.py holds the honest solutions and the corpus of attacks.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid

import pytest

from grpo import rewards
from grpo.rewards import sandbox as _sandbox
from grpo.rewards import worker as math_worker
from grpo.rewards import code_reward, code_rewards
from helpers import SLACK, timed
from rewards_corpus import (ATTACK_TESTS, DOUBLE, FORGED_UNSCORABLE, HONEST, HONEST_STDIO, HOSTILE_CODE,
                            JUDGE_FORGERIES, TRUSTED_PROBLEMS, WORST_FORMS, WORST_PROGRAMS)
from rewards_corpus import ATTACKS as CORPUS_ATTACKS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.lru_cache(maxsize=1)
def _jail_ok() -> bool:
    return _sandbox.capabilities()["jail"]


needs_jail = pytest.mark.skipif("not _jail_ok()", reason="the sandbox cannot be built here")


# --------------------------------------------------------------------------------------------
# Forged verdicts: wrong code plus an attack must score 0
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cheat", [
    "import os\nos._exit(0)",  # leave before the tests run
    "import sys\nsys.exit(0)",
    "import os\nfor fd in range(3, 64):\n    try: os.write(fd, b'T 0 1\\n')\n    except OSError: pass",
    "print('T 0 1')",
])
def test_code_reward_cannot_be_faked(cheat):
    text = f"```python\ndef f(x): return -1\n{cheat}\n```"
    assert code_reward(text, ["assert f(1) == 2"]) == 0.0


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
    score = timed(lambda: code_reward(text, tests, timeout=2.0), 2.0 + SLACK)
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


@needs_jail
@pytest.mark.timeout(300)
def test_honest_stdlib_solutions_all_pass():
    # One completion per solution, scored in parallel (one sandbox + one judge run each).
    out = code_rewards([f"```python\n{c}\n```" for c, _ in HONEST], [t for _, t in HONEST],
                       timeout=20.0)
    assert len(HONEST) >= 50
    assert [i for i, o in enumerate(out) if o != 1.0] == []


def test_constant_set_displays_are_built_at_run_time_from_their_tuple():
    """A constant set display becomes a set comprehension over the tuple of its items (one insertion
    order, whatever the compilation merged); a display with a name is left as it is."""
    plan = _sandbox.plan_assert_tests("", ["assert [f(w) for w in {'ab', 'cd', 'ef'}] == [{w, 'z'} for w in 'ab']",
                                           "assert [f(w) for w in {(1, 'a'), (-2, 'b')}] == [1]"])
    assert not plan.refused
    source = plan.judge[0]
    assert "('ab', 'cd', 'ef')" in source and "{'ab', 'cd', 'ef'}" not in source and "{w, 'z'}" in source, source
    assert "((1, 'a'), (-2, 'b'))" in plan.judge[1] and "{(1, 'a')" not in plan.judge[1], plan.judge[1]


@needs_jail
@pytest.mark.timeout(120)
def test_a_set_s_order_is_one_on_both_sides_of_a_split_test(monkeypatch):
    """``[f(w) for w in {...}] == [w[::-1] for w in {...}]`` holds in plain Python under any hash seed (one
    compilation, one frozenset constant); split between the sandbox (the probe) and the judge (the other
    side) it once failed a correct program under some seeds (on CPython 3.11: 9, 12, 14 of 0-15), each
    side's frozenset rebuilt in its own order by constant merging. Every seed of 0-15, forced."""
    code = "def f(w):\n    return w[::-1]"
    tests = ["for w in {'ab', 'cd', 'ef', 'gh', 'ij', 'kl'}:\n    assert f(w) == w[::-1]",  # (its constants are
             "assert [f(w) for w in {'ab', 'cd', 'ef'}] == [w[::-1] for w in {'ab', 'cd', 'ef'}]"]  # merged too)
    for seed in range(16):
        monkeypatch.setattr(_sandbox.secrets, "randbelow", lambda n, seed=seed: seed)  # the run's PYTHONHASHSEED
        (job,) = _sandbox.assert_jobs(code, tests, timeout=20.0)
        assert job() == [(0, True), (1, True)], seed


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


def _batch_bound(units: int, timeout: float, workers: int) -> float:
    """Wall-clock bound of one ``code_rewards`` call of ``units`` units of sandboxed work (here one per
    program: its tests share one run) on ``workers`` threads. A unit takes at most its run
    (``timeout``) and one judge run (``JUDGE_SECONDS``), plus process starts (``SLACK``): ``T``. All
    units are queued at once and a thread takes the next as soon as it is free, so the call ends within
    r = ceil(units / workers) x ``T``: a unit that started after (r - 1) x ``T`` waited while every
    thread was busy, each through at least r units of its own, so more than ``units`` units would have
    started. One ``SLACK`` more for the parent's own work (planning, reading results)."""
    return -(-units // workers) * (timeout + _sandbox.JUDGE_SECONDS + SLACK) + SLACK


# The default pool on 2 cores (``code_rewards``: 2 x cpu_count, at least 2); explicit, so the bounds
# below hold whatever the machine's default.
BATCH_WORKERS = 4


@needs_jail
@pytest.mark.timeout(120)
def test_hostile_code_scores_zero_in_one_bounded_call():
    # tests/rewards_corpus.py's HOSTILE_CODE (colliding hashes, huge values, floods, loops, sleeps), all
    # in one call, each against a test it cannot pass (an assert for a program defining f, else stdin/stdout).
    codes = list(HOSTILE_CODE.values())
    tests = [["assert f(1) == 2"] if "def f" in code else [{"input": "", "output": "2"}] for code in codes]
    bound = _batch_bound(len(codes), 1.0, BATCH_WORKERS)
    out = timed(lambda: code_rewards([f"```python\n{c}\n```" for c in codes], tests, timeout=1.0,
                                     max_workers=BATCH_WORKERS), bound)
    assert dict(zip(HOSTILE_CODE, out)) == dict.fromkeys(HOSTILE_CODE, 0.0)


@needs_jail
@pytest.mark.timeout(120)
def test_worst_programs_score_zero_in_one_bounded_call():
    # WORST_PROGRAMS (sleeps, loops and exits inside the call, slow generators, 8 MiB results, deep
    # recursion, a self-alarm) against WORST_FORMS' plain asserts, all in one call.
    tests, trusted = WORST_FORMS["plain asserts"]
    codes = list(WORST_PROGRAMS.values())
    bound = _batch_bound(len(codes), 1.0, BATCH_WORKERS)
    out = timed(lambda: code_rewards([f"```python\n{c}\n```" for c in codes], [tests] * len(codes), timeout=1.0,
                                     max_workers=BATCH_WORKERS, trusted_code=[trusted] * len(codes)), bound)
    assert dict(zip(WORST_PROGRAMS, out)) == dict.fromkeys(WORST_PROGRAMS, 0.0)


# --------------------------------------------------------------------------------------------
# Trusted helpers and traced tests: the judge computes the inputs, the program only answers
# --------------------------------------------------------------------------------------------


@needs_jail
@pytest.mark.timeout(300)
def test_trusted_helpers_judge_solutions_and_refuse_forgeries():
    # Every solution 1.0; every forgery (redefined or patched helpers, their source searched
    # for, lying values, lookup tables, stateful answers, patched random) below 1.0. One batch.
    rows = [(name, kind, code, p) for name, p in TRUSTED_PROBLEMS.items()
            for kind, code in [("solution", p["solution"])] + sorted(p["forgeries"].items())]
    out = code_rewards([f"```python\n{code}\n```" for _, _, code, _ in rows],
                       [[p["test"]] for *_, p in rows], trusted_code=[p["trusted"] for *_, p in rows],
                       timeout=10.0)
    scores = {(name, kind): o for (name, kind, _, _), o in zip(rows, out)}
    assert {k: v for k, v in scores.items() if k[1] == "solution"} == \
        {(name, "solution"): 1.0 for name in TRUSTED_PROBLEMS}
    forged = {k: v for k, v in scores.items() if k[1] != "solution" and not (v is not None and v < 1.0)}
    assert forged == {}


def test_trusted_names_resolve_in_the_judge_even_when_the_program_defines_them():
    p = TRUSTED_PROBLEMS["rot_cipher"]
    forgery = p["forgeries"]["identity_pair"]  # defines encode_rot itself
    plan = _sandbox.plan_assert_tests(forgery, [p["test"]], p["trusted"])
    assert not plan.refused and plan.pre[0] is not None
    probes = [s[1] for s in plan.inside[0]["steps"] if s[0] == "probe"]
    assert probes and all("encode_rot" not in src and src.startswith("decode_rot(") for src in probes)
    assert "encode_rot(" in plan.judge[0] and "encode_rot(" in plan.pre[0]
    # the trusted source never reaches the sandbox: not in any step, nor in the run's job
    assert "SHIFT" not in json.dumps(plan.inside)


@needs_jail
def test_trusted_source_and_expected_values_never_enter_the_sandbox():
    p = TRUSTED_PROBLEMS["rot_cipher"]
    trusted = _sandbox.check_trusted_code(p["trusted"])
    plan = _sandbox.plan_assert_tests(p["solution"], [p["test"]], p["trusted"])
    traces = _sandbox.judge_inputs([plan.pre[0]], trusted=trusted, seed=3)
    sent = json.dumps(dict(plan.inside[0], trace=traces[0]))
    assert "SHIFT" not in sent and "encode_rot" not in sent
    # decoding what was sent gives only encoded strings: the plain texts (expected values)
    # are not among them
    runs = [run for run in traces[0] if run[1] not in ("n", "-")]
    assert len(runs) == 40


def test_bad_trusted_code_is_an_error_per_row(caplog):
    good = TRUSTED_PROBLEMS["add"]
    bad = {"not_a_str": 3, "does_not_parse": "def f(:\n", "io": "def g():\n    return open('/etc/passwd').read()\n",
           "prints": "def g(x):\n    print(x)\n    return x\n", "imports_os": "import os\ndef g():\n    return 1\n",
           "dunder": "def g(x):\n    return x.__class__\n", "format_escape": "def g(x):\n    return '{0.__globals__}'.format(x)\n",
           "undefined_name": "def g(x):\n    return add(x, 1)\n"}
    for name, code in bad.items():
        with pytest.raises((TypeError, ValueError), match="trusted_code"):
            _sandbox.check_trusted_code(code)
    solution = f"```python\n{good['solution']}\n```"
    n = len(bad) + 1
    with caplog.at_level(logging.ERROR, logger="grpo.rewards"):
        out = code_rewards([solution] * n, [[good["test"]]] * n,
                           trusted_code=[good["trusted"]] + list(bad.values()), timeout=10.0)
    assert out == [1.0] + [None] * len(bad)  # one bad row never takes the batch down
    messages = [r.getMessage() for r in caplog.records if "trusted_code" in r.getMessage()]
    assert len(messages) == len(set(messages)) == len(bad)  # logged once each
    code_rewards([solution], [[good["test"]]], trusted_code=[bad["io"]])
    assert sum("trusted_code" in r.getMessage() for r in caplog.records) == len(bad)


def test_stub_of_the_function_under_test_is_left_out_and_full_copies_are_refused():
    p = TRUSTED_PROBLEMS["poly_root"]
    source, names = _sandbox.check_trusted_code(p["trusted"])
    assert "find_root" not in names and "poly" in names and "find_root" not in source
    full = p["trusted"] + "    return 0.0\n"  # the function under test defined by the data
    plan = _sandbox.plan_assert_tests(p["solution"], [p["test"]], full)
    assert plan.judge == [None] and 0 in plan.unscorable and "find_root" in plan.unscorable[0]
    direct = _sandbox.plan_assert_tests("", ["assert find_root([1, 2]) == 0.0"], full)
    assert direct.judge == [None] and "reads nothing of the program" in direct.unscorable[0]


@needs_jail
@pytest.mark.timeout(120)
def test_loops_that_build_inputs_are_judged_in_one_run():
    right = "```python\ndef f(x, y):\n    return x + y\n```"
    wrong = "```python\ndef f(x, y):\n    return x + y if x < 500 else 0\n```"
    test = ("import random\nassert f(1, 2) == 3\nfor _ in range(200):\n"
            "    x, y = random.randint(0, 1000), random.randint(0, 1000)\n    assert f(x, y) == x + y\n")
    plan = _sandbox.plan_assert_tests("def f(x, y): pass", [test])
    assert plan.pre[0] is not None and len(plan.inside[0]["steps"]) == 3  # one probe per call site
    calls = []
    real = _sandbox.run

    def counting(*a, **k):
        calls.append(k.get("run_job"))
        return real(*a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_sandbox, "run", counting)
        assert code_rewards([right, wrong], [[test], [test]], timeout=10.0) == [1.0, 0.0]
    assert len(calls) == 2 and all(len(c["tests"][0]["trace"]) == 202 for c in calls)


def test_caps_on_step_runs_make_a_test_unscorable_not_failed():
    test = "for i in range(%d):\n    assert f(i + 0) == 2 * i\n" % (_sandbox.MAX_PROBE_CALLS + 1)
    plan = _sandbox.plan_assert_tests("def f(x): return 2 * x", ["for i in range(3):\n    y = i\n    assert f(y) == 2 * y", test.replace("assert", "y = i\n    assert")])
    traces = _sandbox.judge_inputs([plan.pre[0], plan.pre[1]], ids=[0, 1])
    assert len(traces[0]) == 3 and 1 not in traces  # over MAX_PROBE_CALLS: left out
    big = "for i in range(3):\n    y = 'x' * %d\n    assert f(y) == y\n" % (_sandbox.MAX_INPUT_BYTES // 2)
    plan = _sandbox.plan_assert_tests("def f(x): return x", [big])
    assert _sandbox.judge_inputs([plan.pre[0]]) == {}  # over MAX_INPUT_BYTES


@needs_jail
def test_refused_tests_are_unscorable_and_asserts_before_them_still_count():
    right = "```python\ndef f(x):\n    return 2 * x\n```"
    wrong = "```python\ndef f(x):\n    return -1\n```"
    refused = "while True:\n    break"  # not judged (a while loop)
    prefixed = "assert f(1) == 2\nwhile f(2) != 4:\n    pass"
    out = code_rewards([right, right, wrong, wrong], [[refused], [prefixed], [refused], [prefixed]])
    # no verdict for the correct program (never 0); the wrong one fails the asserts before
    assert out == [None, None, None, 0.0]
    assert code_rewards([right], [["assert f(1) == 2", refused]]) == [None]
    assert code_rewards([wrong], [["assert f(1) == 2", prefixed]]) == [0.0]
    # a refusal the program causes (it redefines a builtin the test uses) fails, as before
    shadow = "```python\ndef sorted(x):\n    return [2]\ndef f(x):\n    return 2 * x\n```"
    assert code_rewards([shadow], [["assert sorted([f(1)]) == [2]"]]) == [0.0]
    assert _sandbox.unscorable_tests(["assert f(1) == 2", refused, prefixed]).keys() == {1, 2}


def test_feedback_and_in_place_handoffs_are_refused():
    # The judge's own loop cannot follow the program's values (its first stage runs before the
    # program), and a value handed to a statement of the program and read again could have
    # been changed in place there: unscorable, never a wrong verdict.
    cases = {"for i in range(3):\n    r = f(i)\n    for j in range(r):\n        assert f(j) == 2 * j":
             "loop's iterable would depend on the program's output",
             "import random\nfor i in range(3):\n    xs = [random.randint(0, 9)]\n    g(xs)\n    assert xs == [1]":
             "reads xs after handing it",
             "for i in range(3):\n    r = f(i)\n    assert f(r) == 4 * i": "reads i after handing it"}
    for test, why in cases.items():
        plan = _sandbox.plan_assert_tests("def f(x): return 2 * x\ndef g(x): x.sort()", [test])
        assert plan.judge == [None] and why in plan.unscorable[0], test


# --------------------------------------------------------------------------------------------
# What the judge reads: only its own values and the program's plain answers
# --------------------------------------------------------------------------------------------


@needs_jail
@pytest.mark.timeout(300)
def test_forgeries_of_what_the_judge_reads_fail():
    # tests/rewards_corpus.py JUDGE_FORGERIES: rebinding the test's names (global statement,
    # globals(), every module dict), changing what it handed over in place, patching builtins,
    # sys.modules, judge modules or json, lying __class__ / __eq__ / __hash__ / __bool__ /
    # __float__ / __index__, values that change on a second read, BaseExceptions, exits at
    # the right moment, protocol lines on every descriptor, signal handlers walking frames,
    # answers by call count. Each beside an honest program on the same tests; one batch.
    names = list(JUDGE_FORGERIES)
    honest = sorted({(code, tuple(tests)) for code, _, tests in JUDGE_FORGERIES.values()})
    rows = [(code, list(tests)) for code, tests in honest] + [
        (JUDGE_FORGERIES[n][1], JUDGE_FORGERIES[n][2]) for n in names]
    out = code_rewards([f"```python\n{c}\n```" for c, _ in rows], [t for _, t in rows], timeout=10.0)
    assert out[:len(honest)] == [1.0] * len(honest)
    forged = dict(zip(names, out[len(honest):]))
    assert {n: v for n, v in forged.items() if n in FORGED_UNSCORABLE} == dict.fromkeys(FORGED_UNSCORABLE)
    assert {n: v for n, v in forged.items() if n not in FORGED_UNSCORABLE and not (
        v is not None and v < 1.0)} == {}


def test_values_the_test_binds_are_the_judges():
    # x = 3 is computed by the judge (its copy is what x * 2 reads) and by the sandbox (the
    # program's copy, in the test's own namespace): no probe reads x back.
    plan = _sandbox.plan_assert_tests("def f(y): return 2 * y", ["x = 3\nassert f(x) == x * 2"])
    assert plan.inside[0] == [["exec", "x = 3"], ["probe", 0, "f(x)"]]
    assert "x = 3" in plan.judge[0] and "x * 2" in plan.judge[0] and plan.python == [None]
    # Handed to a probe and read in a later statement: the judge's copy as written, the
    # sandbox's read back for the Python reading (a test that passes only that way is None).
    plan = _sandbox.plan_assert_tests("def f(xs): xs.sort()",
                                      ["xs = [3, 1, 2]\nassert f(xs) is None\nassert xs == [1, 2, 3]"])
    assert "assert xs == [1, 2, 3]" in plan.judge[0]
    assert "__grpo_probe__(1) == [1, 2, 3]" in plan.python[0]
    # Handed to a statement of the program (its effect is what the test checks): read back.
    plan = _sandbox.plan_assert_tests("def f(xs): xs.sort()", ["xs = [3, 1, 2]\nf(xs)\nassert xs == [1, 2, 3]"])
    assert "__grpo_probe__(0) == [1, 2, 3]" in plan.judge[0] and plan.python == [None]


@needs_jail
def test_the_python_reading_is_unscorable_never_zero():
    # An in-place update checked after a probe hands the list over: the test as written fails
    # on the judge's copy, Python's reading passes: None, for the right program and for the
    # forgery that empties the list alike; a program that does not change it is judged.
    test = ["xs = [3, 1, 2]\nassert f(xs) is None\nassert xs == [1, 2, 3]"]
    in_place = "```python\ndef f(xs):\n    xs.sort()\n```"
    forged = "```python\ndef f(xs):\n    xs[:] = [1, 2, 3]\n```"
    wrong = "```python\ndef f(xs):\n    return None\n```"
    assert code_rewards([in_place, forged, wrong], [test] * 3) == [None, None, 0.0]
    # ... but never a way out of the other tests' zeros: with a failed test beside it, it
    # counts as failed (the row is scored, not None).
    other = "ys = [2, 1]\nf(ys)\nassert ys == [1, 2]"
    assert code_rewards([in_place, forged], [test + [other]] * 2) == [None, 0.0]
    assert _sandbox.row_score([True, _sandbox.PYTHON_ONLY]) is None
    assert _sandbox.row_score([True, False, _sandbox.PYTHON_ONLY]) == 1


@needs_jail
@pytest.mark.timeout(120)
def test_honest_stdio_idioms_pass():
    # exit() / quit() (which the site module would define), open(0), sys.stdin.buffer,
    # SIGPIPE reset to its default, unicode, 200k lines, deep recursion under __main__.
    out = code_rewards([f"```python\n{c}\n```" for c, _ in HONEST_STDIO],
                       [t for _, t in HONEST_STDIO], timeout=20.0)
    assert out == [1.0] * len(HONEST_STDIO)


def test_modules_the_judge_cannot_run_make_a_test_unscorable():
    # Outside the standard library the sandbox has nothing; a module outside the judge's,
    # called on the program's values, would run inside, where the program can patch it.
    cases = {"import numpy as np\nassert np.allclose(f(1), 2)": "does not have",
             "import os\nassert os.path.exists(f(1))": "the judge does not run",
             "import os\np = os.path.join('a', f(1))\nassert p == 'a/b'": "the judge does not run"}
    for test, why in cases.items():
        assert why in _sandbox.unscorable_tests([test])[0], test
    # passed to the program, such a module's values are only its inputs: judged
    assert _sandbox.unscorable_tests(["import os\nassert f(os.sep) == '/'"]) == {}


def test_planning_stays_bounded_on_long_chains_of_names():
    # Each name read by the next: the names living inside would settle one per pass. Planning
    # runs in the trainer's process, so it stops after MAX_PLAN_PASSES: unscorable, never a stall.
    chain = "a0 = [1]\n" + "".join(f"a{i} = a{i - 1}\n" for i in range(1, 60)) + "assert f(a59) == [1]"
    reason = timed(lambda: _sandbox.unscorable_tests([chain]), 5.0)
    assert "did not settle" in reason[0]
    short = "a0 = [1]\na1 = a0\na2 = a1\nassert f(a2) == [1]"
    assert _sandbox.unscorable_tests([short]) == {}


@needs_jail
def test_records_past_the_cap_fail_only_their_tests(monkeypatch):
    monkeypatch.setattr(_sandbox, "MAX_RESULT_BYTES", 1 << 16)
    text = "```python\ndef f(n):\n    return 'x' * n\n```"
    tests = ["assert f(3) == 'xxx'", "assert f(100000) == 'x' * 100000", "assert f(2) == 'xx'"]
    assert code_rewards([text], [tests]) == [pytest.approx(1 / 3)]


@needs_jail
@pytest.mark.timeout(120)
def test_the_environment_and_working_directory_never_reach_judge_or_sandbox(monkeypatch, tmp_path):
    # Modules that would shadow the judge's (random, json, math), a sitecustomize, a startup
    # file and a PYTHONHOME: none is read, wherever the trainer runs and whatever it exports.
    marker = tmp_path / "reached"
    trap = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\nraise SystemExit(3)\n"
    for name in ("random", "json", "math", "sitecustomize", "usercustomize", "startup", "types"):
        (tmp_path / f"{name}.py").write_text(trap)
    monkeypatch.chdir(tmp_path)
    for var, value in (("PYTHONPATH", str(tmp_path)), ("PYTHONSTARTUP", str(tmp_path / "startup.py")),
                       ("PYTHONHOME", str(tmp_path)), ("PYTHONSAFEPATH", ""), ("PYTHONHASHSEED", "0")):
        monkeypatch.setenv(var, value)
    tests = ["import random\nfor _ in range(5):\n    x = random.randint(0, 9)\n    assert f(x) == 2 * x",
             "x = 3\nassert f(x) == x * 2"]
    out = code_rewards([DOUBLE, f"```python\n{WRONG}\n```"], [tests, tests], timeout=10.0)
    assert out == [1.0, 0.0] and not marker.exists()


@needs_jail
def test_no_descriptor_child_or_temp_file_outlives_a_batch(monkeypatch, tmp_path):
    def fds() -> set[str]:
        return set(os.listdir("/proc/self/fd"))

    # A temp directory of this test's own: the shared /tmp also holds other processes' files.
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setenv("TMPDIR", str(private))
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    temp = set(os.listdir(tempfile.gettempdir()))
    assert temp == set()
    before_fds, before_kids = fds(), _children()
    hostile = ["```python\nimport time\ntime.sleep(30)\n```", "```python\nimport os\nos._exit(3)\n```",
               "```python\ndef f(x):\n    while True:\n        pass\n```", DOUBLE]
    out = code_rewards(hostile, [["import random\nx = random.randint(1, 5)\nassert f(x) == 2 * x"]] * 4,
                       timeout=3.0)
    assert out == [0.0, 0.0, 0.0, 1.0]
    deadline = time.monotonic() + 2
    while (_children() - before_kids or fds() - before_fds) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (_children() - before_kids) and not (fds() - before_fds)
    assert set(os.listdir(tempfile.gettempdir())) - temp == set()


# --------------------------------------------------------------------------------------------
# Containment: what the program can see and touch (checked outside)
# --------------------------------------------------------------------------------------------


def _children() -> set[int]:
    kids: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                kids.update(int(p) for p in f.read().split())
        except OSError:
            pass
    return kids


def _sandbox_processes() -> list[int]:
    """Sandbox or judge processes that are ours or nobody's (orphans, parent 1): other
    sessions on the machine may be running sandboxes of their own, each under its parent."""
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    ours = b"grpo.rewards.sandbox`` runs" in f.read()
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
                if ours and ppid in (1, os.getpid()):
                    pids.append(int(pid))
            except (OSError, ValueError, IndexError):
                pass
    return pids


@pytest.fixture
def contained():
    """Yields a runner; afterwards, no child or sandbox process may remain."""
    before = _children()

    def run(code: str, timeout: float = 2.0, **kw) -> _sandbox.RunResult:
        start = time.monotonic()
        result = _sandbox.run(code, mode="stdio", stdin="", timeout=timeout, **kw)
        assert result.error is None
        assert time.monotonic() - start < timeout + 1.5
        return result

    yield run
    deadline = time.monotonic() + 2
    while _children() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (_children() - before)
    assert not _sandbox_processes()


LAYERS = [True, False]  # audit hook on; and off, to check what the OS enforces alone


@functools.lru_cache(maxsize=1)
def _caps() -> dict:
    return _sandbox.capabilities()


def _need_os_layers(audit: bool) -> None:
    caps = _caps()
    if not caps["jail"]:
        pytest.skip(f"the sandbox cannot be built on this machine: {caps['error']}")


def test_capabilities_reported():
    caps = _sandbox.capabilities()
    assert set(caps) == {"jail", "error", "root"}
    assert caps["jail"] is (caps["error"] is None)


def test_infinite_loop_is_killed(contained):
    r = contained("while True:\n    pass", timeout=1.0)
    assert r.timed_out and r.returncode is None


def test_sleeping_child_group_is_killed(contained):
    r = contained("import time\ntime.sleep(30)", timeout=1.0)
    assert r.timed_out


@pytest.mark.parametrize("audit", LAYERS)
def test_fork_bomb_is_contained(contained, audit):
    _need_os_layers(audit)
    r = contained("import os\nwhile True:\n    os.fork()", audit=audit)
    assert r.returncode not in (0, None) or r.timed_out


@pytest.mark.parametrize("audit", LAYERS)
def test_memory_bomb_is_contained(contained, audit):
    _need_os_layers(audit)
    r = contained("x = bytearray(8 << 30)\nprint('allocated')", audit=audit)
    assert "allocated" not in r.stdout and r.returncode != 0


@pytest.mark.parametrize("audit", LAYERS)
def test_cannot_write_outside_workdir(contained, audit, tmp_path):
    _need_os_layers(audit)
    target = tmp_path / "pwned.txt"
    shared_tmp = f"/tmp/grpo-escape-{uuid.uuid4().hex}"
    code = (f"for p in [{str(target)!r}, {shared_tmp!r}]:\n"
            "    try:\n        open(p, 'w').write('x')\n    except OSError:\n        pass\n"
            "open('inside.txt', 'w').write('ok')\nprint(open('inside.txt').read())")
    r = contained(code, audit=audit)
    assert r.stdout.strip() == "ok"  # the working directory itself is writable
    assert not target.exists()
    assert not os.path.exists(shared_tmp)


@pytest.mark.parametrize("audit", LAYERS)
def test_cannot_delete_outside_file(contained, audit, tmp_path):
    _need_os_layers(audit)
    victim = tmp_path / "keep.txt"
    victim.write_text("precious")
    code = (f"import os, shutil\nfor f in (lambda: os.remove({str(victim)!r}),"
            f" lambda: shutil.rmtree({str(tmp_path)!r})):\n"
            "    try:\n        f()\n    except OSError:\n        pass")
    contained(code, audit=audit)
    assert victim.read_text() == "precious"


@pytest.mark.parametrize("audit", LAYERS)
def test_os_system_is_contained(contained, audit, tmp_path):
    _need_os_layers(audit)
    marker = f"/tmp/grpo-escape-{uuid.uuid4().hex}"
    code = f"import os\ntry:\n    os.system('touch {marker}')\nexcept OSError:\n    pass"
    contained(code, audit=audit)
    time.sleep(0.2)
    assert not os.path.exists(marker)


@pytest.mark.parametrize("audit", LAYERS)
def test_socket_cannot_connect(contained, audit):
    _need_os_layers(audit)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            try:
                conn, _ = server.accept()
                accepted.append(conn)
                return
            except OSError:
                continue

    t = threading.Thread(target=accept)
    t.start()
    code = ("import socket\ntry:\n"
            f"    s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "    s.sendall(b'hello')\n    print('connected')\nexcept OSError as e:\n"
            "    print('blocked')")
    r = contained(code, audit=audit)
    time.sleep(0.3)  # a connection attempt would have reached accept() by now
    done.set()
    t.join()
    server.close()
    assert not accepted
    assert "connected" not in r.stdout


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
        timed(lambda: _sandbox.run(code, mode="stdio", timeout=3, audit=audit), 3 + SLACK)
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
@pytest.mark.parametrize("audit", [True, False], ids=["hook", "os-only"])
def test_no_native_code_from_the_writable_tmp(audit):
    # /tmp is noexec: a shared object copied there cannot be mapped (it would run native code
    # that reads the harness's memory, ctypes or not).
    code = textwrap.dedent("""
        import shutil, sys, glob, importlib.util
        src = glob.glob(sys.base_prefix + '/lib/python3*/lib-dynload/_bisect*.so')[0]
        shutil.copy(src, '/tmp/_bisect.so')
        try:
            importlib.util.module_from_spec(
                importlib.util.spec_from_file_location('_bisect', '/tmp/_bisect.so'))
            print('LOADED')
        except ImportError as e:
            print('REFUSED', e)
        """)
    r = _sandbox.run(code, mode="stdio", timeout=5, audit=audit)
    assert r.stdout.startswith("REFUSED") and "map segment" in r.stdout, (r.stdout, r.stderr)


@needs_jail
def test_python_signal_handlers_are_refused_defaults_are_not():
    # A handler is called with the running frame, whose f_back chain reaches the harness.
    code = textwrap.dedent("""
        import signal, importlib.util
        print(signal.signal(signal.SIGPIPE, signal.SIG_DFL) is not None)
        for attempt in (lambda: signal.signal(signal.SIGALRM, lambda *a: None),
                        lambda: importlib.util.module_from_spec(importlib.util.find_spec('_signal')),
                        lambda: __import__('_signal').signal(14, print)):
            try:
                attempt()
                print('INSTALLED')
            except (PermissionError, ImportError) as e:
                print('refused')
        """)
    r = _sandbox.run(code, mode="stdio", timeout=5)
    assert r.stdout.split() == ["True", "refused", "refused", "refused"], (r.stdout, r.stderr)


@needs_jail
def test_runaway_programs_end_on_time_and_leave_nothing():
    for code in (ATTACKS["setsid_and_sleep"], ATTACKS["stop_self"], ATTACKS["huge_stdout"],
                 "while True:\n    pass"):
        r = timed(lambda c=code: _sandbox.run(c, mode="stdio", timeout=1.5), 1.5 + SLACK)
        assert len(r.stdout) <= _sandbox.MAX_OUTPUT_BYTES
    time.sleep(0.3)
    assert not _sandbox_processes()


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


def test_the_package_keeps_the_one_module_names_and_a_patch_reaches_its_modules(monkeypatch):
    # grpo.rewards.sandbox was one module: its names, private ones too, stay on the package, and a name set
    # there (a test's monkeypatch) is set in the modules whose code reads it.
    from grpo.rewards.sandbox import jail, planner, policy, verdicts

    assert _sandbox.run is jail.run and _sandbox.judge is verdicts.judge and _sandbox.Planner is planner.Planner
    monkeypatch.setattr(_sandbox, "MAX_RESULT_BYTES", 7)
    assert policy.MAX_RESULT_BYTES == jail.MAX_RESULT_BYTES == verdicts.MAX_RESULT_BYTES == 7
    stand_in = object()
    monkeypatch.setattr(_sandbox, "run", stand_in)
    assert jail.run is stand_in and verdicts.run is stand_in
    monkeypatch.undo()
    assert verdicts.MAX_RESULT_BYTES == 8 << 20 and verdicts.run is jail.run is _sandbox.run is not stand_in


# --------------------------------------------------------------------------------------------
# The bootstrap, and the test process after all of the above
# --------------------------------------------------------------------------------------------


def test_bootstrap_is_a_packaged_file():
    from importlib import resources

    text = resources.files("grpo.rewards").joinpath("sandbox_bootstrap.py").read_text()
    assert text == _sandbox.bootstrap_source()
    assert text == resources.files("grpo.rewards.sandbox").joinpath("bootstrap.py").read_text()  # (the link's target)
    compile(text, "sandbox_bootstrap.py", "exec")  # a real module, seen by linters
    assert math_worker.main.__module__ == "grpo.rewards.worker"


def test_test_process_unharmed_after_escapes():
    # The previous tests ran in this process; it still works and has its cwd and files.
    assert os.getcwd() and os.path.exists(rewards.__file__)
    assert code_reward(DOUBLE, ["assert f(4) == 8"]) == 1.0
