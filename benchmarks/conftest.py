"""pytest-benchmark set-up of ``make bench``: the set, the budget, progress with an ETA, each case's run (README)."""

from __future__ import annotations

import os
import time
from typing import Optional, Tuple

import pytest
import torch

from benchmarks import harness as H
from benchmarks import kernels as K


def cpu_s() -> float:
    """CPU seconds of this process and its finished children (the long-context steps' fresh processes)."""
    return sum(os.times()[:4])


_START, _CPU_START, _LOAD_START = time.monotonic(), cpu_s(), H.load()
# The cpu set's default GRPO_BENCH_BUDGET_S: with the imports and the report, `make bench` ends within 15
# minutes on 2 cores even when other jobs slow it 2-3x (the set is ~8 CPU-minutes).
CPU_BUDGET_S = 600.0
STATE: dict = {"results": [], "skipped": [], "disagreed": [], "cut": [], "ceilings": {}, "done": 0.0, "total": 0.0,
               "count": 0}


def pytest_addoption(parser):
    parser.getgroup("grpo-kernels benchmarks").addoption(
        "--bench-set", default=None, choices=[*K.SETS, "auto"],
        help="benchmark set (default: $GRPO_BENCH_SET or auto = gpu when CUDA is available)")


def pytest_collect_file(file_path, parent):
    if file_path.suffix == ".py" and file_path.name.startswith("bench_") and not parent.session.isinitpath(file_path):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def bench_set(config) -> Tuple[str, str]:
    """(the set, why it was chosen)."""
    given = config.getoption("--bench-set") or os.environ.get("GRPO_BENCH_SET", "auto")
    if given != "auto":
        return given, "asked for (--bench-set / GRPO_BENCH_SET)"
    if torch.cuda.is_available():
        return "gpu", "auto: CUDA is available, the full shapes"
    return "cpu", "auto: no CUDA, the set sized for 2 CPU cores (GRPO_BENCH_SET=gpu for the full shapes)"


def budget(config) -> Tuple[Optional[float], str]:
    """(seconds after the start past which no case starts, why): ``GRPO_BENCH_BUDGET_S``, else the cpu set's."""
    value = os.environ.get("GRPO_BENCH_BUDGET_S")
    if value is None:
        return (CPU_BUDGET_S, "the cpu set's default") if bench_set(config)[0] == "cpu" else (None, "none")
    try:
        return float(value) or None, "GRPO_BENCH_BUDGET_S"
    except ValueError:
        raise pytest.UsageError(f"GRPO_BENCH_BUDGET_S must be a number of seconds, got {value!r}") from None


def pytest_configure(config):
    budget(config)  # a malformed budget is a usage error before anything runs


def pytest_report_header(config):
    (name, why), (seconds, whose) = bench_set(config), budget(config)
    return (f"benchmark set: {name} ({why}); time budget: " + (f"{seconds:.0f} s ({whose}; GRPO_BENCH_BUDGET_S=0 for none): "
            "a case that would start after it is skipped" if seconds else "none"))


def pytest_sessionstart(session):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter and reporter.verbosity < 0:  # -q hides the header
        reporter.write_line(pytest_report_header(session.config))


def pytest_generate_tests(metafunc):
    """One parameter per case of the set; an operation without a case here gives one skipped item saying why."""
    if "case" not in metafunc.fixturenames:
        return
    name, dev = bench_set(metafunc.config)[0], H.device().type
    try:
        selected, unknown = K.cases(name, dev), None
    except ValueError as exc:  # an unknown set name
        selected, unknown = [], str(exc)
    params = []
    for op in K.OPS:
        mine = [pytest.param(c, id=c.id) for c in selected if c.op == op]
        reason = unknown or (f"the {name!r} set has no {op} case on {dev} (implementations here: "
                             f"{', '.join(K.implementations(dev)) or 'none'})")
        params += mine or [pytest.param(None, marks=pytest.mark.skip(reason=reason), id=f"{op}-no-case")]
        STATE["skipped"] += [(f"{op} {i}", why) for i, why in K.skipped_peers(op, dev).items()] if mine else [(op, reason)]
    metafunc.parametrize("case", params)


def _params(item) -> dict:
    return getattr(getattr(item, "callspec", None), "params", {})


def _case(item) -> Optional[K.Case]:
    case = _params(item).get("case")
    return case if isinstance(case, K.Case) else None


def pytest_collection_modifyitems(config, items):
    """Whole comparisons in ``kernels.run_order`` (the kernel cases; the other modules' items after them,
    each its own comparison); each item's cost (``Case.cost``, a module's ``cost(params)``) for the ETA."""
    order = {id(c): i for i, c in enumerate(K.run_order([c for c in map(_case, items) if c is not None]))}
    items.sort(key=lambda item: order.get(id(_case(item)), len(order)))
    STATE["comparison"] = {item.nodeid: K.comparison(_case(item)) if _case(item) else item.nodeid for item in items}
    STATE["started"] = set()
    STATE["costs"] = {item.nodeid: _case(item).cost if _case(item) else getattr(item.module, "cost", lambda p: 1e9)(_params(item))
                      for item in items}
    STATE["total"], STATE["items"] = sum(STATE["costs"].values()), len(items)


def pytest_runtest_setup(item):
    """The budget is checked when a comparison starts: one begun runs to its end (all its sides), one not
    begun is cut whole, and the report lists what was cut."""
    seconds, elapsed = budget(item.config)[0], time.monotonic() - _START
    comparison = STATE.get("comparison", {}).get(item.nodeid, item.nodeid)
    if comparison in STATE.setdefault("started", set()):
        return
    if seconds is not None and elapsed > seconds:
        STATE["skipped"].append((item.name, f"time budget spent ({elapsed:.0f} s of {seconds:.0f} s)"))
        STATE["cut"].append(item.name)
        pytest.skip(f"GRPO_BENCH_BUDGET_S spent ({elapsed:.0f} s of {seconds:.0f} s)")
    STATE["started"].add(comparison)


def pytest_runtest_logreport(report):
    """One progress line per finished case: elapsed wall and CPU time, ETA from the cost of the cases to run."""
    if report.when != "call" and not (report.when == "setup" and report.skipped):
        return
    STATE["count"] += 1
    STATE["done"] += STATE.get("costs", {}).get(report.nodeid, 0.0)
    elapsed = time.monotonic() - _START
    eta = f"{elapsed * (STATE['total'] - STATE['done']) / STATE['done']:.0f}s" if STATE["done"] else "?"
    print(f"\n[bench {STATE['count']}/{STATE.get('items', '?')} +{elapsed:.0f}s cpu {cpu_s() - _CPU_START:.0f}s "
          f"ETA {eta}] {report.nodeid.split('::')[-1]} {report.outcome} ({report.duration:.1f} s)", flush=True)


@pytest.fixture(scope="session")
def ceilings():
    """(copy GB/s, matmul TFLOP/s): measured once on a GPU (``harness.ceilings``); none on a CPU."""
    if H.device().type == "cuda":
        STATE["ceilings"] = H.ceilings(H.device(), torch.bfloat16)
        torch.cuda.empty_cache()  # (its buffers: the cases' memory checks read what is free)
    return STATE["ceilings"].get("copy_gbps"), STATE["ceilings"].get("matmul_tflops")


@pytest.fixture
def run_case(benchmark, ceilings):
    """Check, measure and time ``case`` (``kernels.prepare``); what cannot run here is skipped with the reason."""
    runners = []

    def attempt(case: K.Case, fn):
        try:
            return fn()
        except K.Disagrees as exc:
            STATE["disagreed"].append(str(exc))
            pytest.fail(f"disagrees with the reference: {exc}", pytrace=False)
        except Exception as exc:
            if not isinstance(exc, K.Unavailable) and not K.is_oom(exc) and case.impl in K.OURS:
                raise
            reason = str(exc) if isinstance(exc, K.Unavailable) else "out of memory" if K.is_oom(exc) else \
                f"{case.impl} failed: {type(exc).__name__}: {str(exc)[:200]}"
        STATE["skipped"].append((case.id, reason))  # (outside the except block: the failed call's tensors are gone)
        pytest.skip(reason)

    def _run(case: K.Case):
        runner, info = attempt(case, lambda: K.prepare(case, H.device(), check=os.environ.get("GRPO_BENCH_CHECK", "1") != "0"))
        runners.append(runner)
        benchmark.group = case.group
        benchmark.extra_info.update(info)
        attempt(case, lambda: benchmark.pedantic(runner, rounds=case.rounds, iterations=1, warmup_rounds=0))
        median = getattr(getattr(getattr(benchmark, "stats", None), "stats", None), "median", None)
        benchmark.extra_info.update(K.throughput(case, median, *ceilings))
        STATE["results"].append(dict(benchmark.extra_info, median_s=median))

    yield _run
    for r in runners:
        r.close()


def pytest_benchmark_update_machine_info(config, machine_info):
    (name, why), (seconds, _) = bench_set(config), budget(config)
    machine_info["grpo_bench"] = H.conditions(bench_set=name, bench_set_reason=why, budget_s=seconds, load_1m=_LOAD_START,
                                              note=os.environ.get("GRPO_BENCH_NOTE", ""))


def pytest_benchmark_update_json(config, benchmarks, output_json):
    output_json.setdefault("machine_info", {}).setdefault("grpo_bench", {}).update(
        STATE["ceilings"], load_end_1m=H.load(), wall_s=round(time.monotonic() - _START), cpu_s=round(cpu_s() - _CPU_START))
    output_json["grpo_memory_checks"] = K.memory_checks(STATE["results"])
    output_json["grpo_skipped"] = [{"case": c, "reason": r} for c, r in STATE["skipped"]]
    output_json["grpo_cut_by_budget"] = list(STATE["cut"])  # whole comparisons not begun when the budget ran out


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    checks = K.memory_checks(STATE["results"])
    for title, lines in (("fused-linear peak memory checks", K.checks_lines(checks) if checks else []),
                         ("benchmark cases that disagree with the reference", STATE["disagreed"]),
                         ("benchmark cases not run", [f"{c}: {r}" for c, r in STATE["skipped"]]),
                         ("cut by the time budget (whole comparisons; every comparison begun ran to its end)",
                          [f"{len(STATE['cut'])} cases: " + ", ".join(STATE["cut"])] if STATE["cut"] else [])):
        if lines:
            terminalreporter.section(title)
            for line in lines:
                terminalreporter.write_line(line)
    terminalreporter.write_line(f"benchmark session: {time.monotonic() - _START:.0f} s wall, "
                                f"{cpu_s() - _CPU_START:.0f} s CPU (this process and its children)")
