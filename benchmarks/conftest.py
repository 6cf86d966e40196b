"""pytest-benchmark setup for ``pytest benchmarks/ --benchmark-only``.

- ``bench_*.py`` files are collected here (the project's ``testpaths`` is ``tests``, so a plain
  ``pytest`` never runs benchmarks).
- The set: ``--bench-set cpu|gpu|smoke|auto`` or ``GRPO_BENCH_SET`` (default ``auto``: ``gpu`` when
  CUDA is available, else ``cpu``; ``smoke`` is tiny shapes through every code path). ``GRPO_BENCH_IMPLS=reference,triton`` narrows the implementations.
- ``GRPO_BENCH_BUDGET_S``: skip the cases that would start after this many seconds (the results
  JSON is still written); the GPU set is ordered with its headline cases first.
- Copy bandwidth and matmul rate (for the fraction-of-ceiling figures) are read from
  ``GRPO_BENCH_COPY_GBPS`` / ``GRPO_BENCH_MATMUL_TFLOPS`` when set (``gpu_check.sh`` measures them
  once), else measured once per session.
- After timing, each case is checked against ``grpo_kernels.reference`` on the same inputs (every
  output and gradient, dtype-fit tolerances; cases with large ``[N, V]`` on their first rows): a
  disagreement fails the case. ``GRPO_BENCH_CHECK=0`` turns the check off.
- A case that cannot run here (an implementation not installed or not on this device, a shape that
  does not fit the free memory, out of memory) is skipped with the reason, and so is an operation the
  set has no case for; an unknown ``GRPO_BENCH_SET`` skips everything, naming the known sets.
- ``--benchmark-disable`` (CI's smoke run) executes every case once, with its memory run and check.
- TRITON_INTERPRET is never set here: Triton is benchmarked on CUDA only.
"""

from __future__ import annotations

import os
import time
from typing import Optional

import pytest
import torch

from benchmarks import _harness as H
from benchmarks import machine

_START = time.monotonic()
CEILINGS: dict = {}  # the measured (or given) copy bandwidth and matmul rate, for the results JSON


def pytest_addoption(parser):
    group = parser.getgroup("grpo-kernels benchmarks")
    group.addoption("--bench-set", default=None, choices=["cpu", "gpu", "smoke", "auto"],
                    help="benchmark set (default: $GRPO_BENCH_SET or auto = gpu when CUDA is available)")


def pytest_collect_file(file_path, parent):
    # A file named on the command line is collected by pytest itself, whatever its name.
    if file_path.suffix == ".py" and file_path.name.startswith("bench_") and not parent.session.isinitpath(file_path):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def bench_set(config) -> str:
    choice = config.getoption("--bench-set") or os.environ.get("GRPO_BENCH_SET", "auto")
    if choice == "auto":
        choice = "gpu" if torch.cuda.is_available() else "cpu"
    return choice


def bench_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_generate_tests(metafunc):
    """One parameter per case of the set for the module's ``OP``; a set with no case for it here (no
    implementation on this device, ``GRPO_BENCH_IMPLS`` excluding them all, an unknown set name) gives
    one skipped item that says why, so the run goes on (an empty parametrisation would reach the
    hooks below as pytest's NOTSET placeholder)."""
    if "case" not in metafunc.fixturenames:
        return
    op = getattr(metafunc.module, "OP")
    device = bench_device().type
    try:
        selected = [c for c in H.cases(bench_set(metafunc.config), device) if c.op == op]
        reason = (f"the {bench_set(metafunc.config)!r} set has no {op} case on {device} (implementations here: "
                  f"{', '.join(H.implementations(device)) or 'none'})")
    except ValueError as exc:  # an unknown set name
        selected, reason = [], str(exc)
    if not selected:
        H.SKIPPED.append((op, reason))
        metafunc.parametrize("case", [pytest.param(None, marks=pytest.mark.skip(reason=reason))], ids=["no-case"])
        return
    metafunc.parametrize("case", selected, ids=[c.id.replace(op + "-", "") for c in selected])


def pytest_collection_modifyitems(config, items):
    def priority(item):
        case = getattr(getattr(item, "callspec", None), "params", {}).get("case")
        return case.priority if isinstance(case, H.Case) else 100

    items.sort(key=priority)  # stable: file and parameter order within a priority


def _budget_s() -> Optional[float]:
    value = os.environ.get("GRPO_BENCH_BUDGET_S")
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        raise pytest.UsageError(f"GRPO_BENCH_BUDGET_S must be a number of seconds, got {value!r}") from None


def pytest_configure(config):
    _budget_s()  # a malformed budget is a usage error before anything runs


def pytest_runtest_setup(item):
    """Past ``GRPO_BENCH_BUDGET_S``, every benchmark still to start is skipped (any file's), so the
    results JSON is written before an outer timeout."""
    budget = _budget_s()
    if budget is not None and time.monotonic() - _START > budget:
        H.SKIPPED.append((item.name, "time budget spent"))
        pytest.skip("GRPO_BENCH_BUDGET_S spent")


@pytest.fixture(scope="session")
def ceilings():
    """(copy GB/s, matmul TFLOP/s) of this machine, from the environment or measured once on a GPU.

    On a CPU they are not measured (the torch path is no bandwidth kernel, and a shared CPU's numbers
    are noise): throughput is still reported, its fraction of a ceiling is not."""
    device = bench_device()
    copy = os.environ.get("GRPO_BENCH_COPY_GBPS")
    mm = os.environ.get("GRPO_BENCH_MATMUL_TFLOPS")
    if device.type != "cuda" and not (copy or mm):
        return None, None
    copy = float(copy) if copy else machine.copy_bandwidth_gbps(device) if device.type == "cuda" else None
    mm_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mm = float(mm) if mm else machine.matmul_tflops(device, dtype=mm_dtype) if device.type == "cuda" else None
    CEILINGS.update(copy_gbps=copy and round(copy, 1), matmul_tflops=mm and round(mm, 3),
                    matmul_dtype=str(mm_dtype).replace("torch.", ""))
    return copy, mm


def _skippable(case: H.Case, exc: BaseException) -> str:
    """The skip reason for an exception that means "cannot run here"; re-raise anything else."""
    if H._is_oom(exc):
        return "out of memory"
    if case.impl in ("liger", "trl"):  # a third-party API that changes between versions: record, do not fail
        return f"{case.impl} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    raise exc


def _skip(case: H.Case, reason: str, runners) -> None:
    H.SKIPPED.append((case.id, reason))
    for r in runners:
        r.close()
    runners.clear()
    pytest.skip(reason)


@pytest.fixture
def run_case(benchmark, ceilings, request):
    """Build ``case``, measure its peak memory in one run, time it, and fill ``extra_info``."""
    runners = []

    def _run(case: H.Case):
        device = bench_device()
        reason = None
        try:
            runner = H.build(case, device)
            runners.append(runner)
            if device.type == "cuda":
                runner()  # warm-up: Triton compilation, cuBLAS workspaces (outside the peak)
            peak, method = H.measure_peak(runner)  # on a CPU this run is also the warm-up
        except H.Unavailable as exc:
            reason = str(exc)
        except Exception as exc:
            reason = _skippable(case, exc)
        if reason is not None:
            _skip(case, reason, runners)  # outside the except block: the failed call's tensors are gone
        benchmark.group = case.group
        benchmark.extra_info.update(case.info())
        benchmark.extra_info.update(device=device.type, peak_mem_bytes=int(peak), peak_mem_method=method)
        try:
            benchmark.pedantic(runner, setup=lambda: H._sync(device), rounds=case.rounds, iterations=1, warmup_rounds=0)
        except Exception as exc:
            reason = _skippable(case, exc) + " (while timing)"
        if reason is not None:
            _skip(case, reason, runners)
        stats = getattr(getattr(benchmark, "stats", None), "stats", None)
        median = getattr(stats, "median", None)
        benchmark.extra_info.update(H.throughput(case, median, *ceilings))
        if case.impl != "reference" and os.environ.get("GRPO_BENCH_CHECK", "1") != "0":  # (the reference is what it is checked against)
            for r in runners:  # the timed inputs go before the check builds its own
                r.close()
            runners.clear()
            agreement = H.check_agreement(case, device)
            benchmark.extra_info["agreement"] = agreement
            if not agreement["ok"]:
                H.DISAGREED.append(H.format_agreement(case, agreement))
                pytest.fail("disagrees with the reference: " + H.format_agreement(case, agreement), pytrace=False)
        H.RESULTS.append(dict(benchmark.extra_info, median_s=median))

    yield _run
    for r in runners:
        r.close()


def pytest_benchmark_update_machine_info(config, machine_info):
    info = machine.machine_info()
    info["bench_set"] = bench_set(config)
    info["note"] = os.environ.get("GRPO_BENCH_NOTE", "")
    machine_info["grpo_bench"] = info


def pytest_benchmark_update_json(config, benchmarks, output_json):
    output_json.setdefault("machine_info", {}).setdefault("grpo_bench", {}).update(CEILINGS)
    output_json["grpo_memory_checks"] = H.memory_checks(H.RESULTS)
    output_json["grpo_skipped"] = [{"case": c, "reason": r} for c, r in H.SKIPPED]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    checks = H.memory_checks(H.RESULTS)
    if checks:
        terminalreporter.section("fused-linear peak memory checks")
        terminalreporter.write_line(H.format_checks(checks))
    if H.DISAGREED:
        terminalreporter.section("benchmark cases that disagree with the reference")
        for line in H.DISAGREED:
            terminalreporter.write_line(line)
    if H.SKIPPED:
        terminalreporter.section("benchmark cases not run")
        for case, reason in H.SKIPPED:
            terminalreporter.write_line(f"{case}: {reason}")
    terminalreporter.write_line(f"benchmark session wall time: {time.monotonic() - _START:.0f} s")
