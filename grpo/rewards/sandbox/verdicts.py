"""A completion's assert tests judged (:func:`assert_jobs`): its plan, one sandboxed run that reports the
probes' values, and the judge -- a fresh interpreter that never holds an object of the program -- deciding
every test on those values (:func:`judge`); a traced test's inputs computed by the judge first
(:func:`judge_inputs`); a row's score from its verdicts (:func:`row_score`).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import subprocess
import tempfile
import zlib

from .assert_plan import plan_assert_tests
from .jail import SandboxUnavailable, bootstrap_source, end_group, memfd, runtime, run
from .planner import PROBE
from .policy import (ITER_SECONDS, JUDGE_BUILTINS, JUDGE_MODULES, JUDGE_SECONDS, JUDGE_TEST_SECONDS,
                     MAX_INPUT_BYTES, MAX_ITER_ITEMS, MAX_PROBE_CALLS, MAX_RESULT_BYTES, MAX_SET_ITEMS,
                     TRUSTED_EXTRA_BUILTINS, check_trusted_code)

log = logging.getLogger(__package__)  # "grpo.rewards.sandbox": the package's logger, as before the split


_SALT = secrets.randbits(62)  # this process's seeds: different from run to run, shared by a group


def _judge_seed(sources: list) -> int:
    """The seed of a completion's judge runs: a function of its judge sources and this
    process's salt, so that the completions of one group get the same random inputs."""
    h = 0
    for src in sources:
        h = (h * 1000003 + zlib.crc32(str(src).encode("utf-8", "surrogatepass"))) % (1 << 61)
    return (h ^ _SALT) % (1 << 31)


def assert_jobs(code: str, tests: list[str], *, timeout: float = 5.0,
                trusted_code: str | None = None, **kw):
    """Assert tests as units of sandboxed work: callables returning ``[(test index, verdict)]``
    with verdict True / False / None (unscorable) / :data:`PYTHON_ONLY` (a row's score:
    :func:`row_score`).

    All tests of a completion share one sandboxed run (``timeout``) that reports the probes'
    values, then one judge run (:data:`JUDGE_SECONDS`) that decides every test on those values;
    traced tests first get a judge run that computes the inputs their steps take
    (:func:`judge_inputs`). A test refused because of the program fails (reason logged at
    INFO); one refused on its own is unscorable (None), unless the asserts before its refused
    statement fail. A callable raises SandboxUnavailable when the jail cannot be built.
    """
    plan = plan_assert_tests(code, tests, trusted_code)
    for i, why in sorted(plan.refused.items()):
        if i in plan.unscorable:
            log.debug("assert test %d unscorable: %s", i, why)
        else:
            log.info("assert test %d refused (scored 0): %s", i, why)
    trusted = None
    if trusted_code is not None and len(plan.unscorable) < len(tests):
        trusted = check_trusted_code(trusted_code)
    judged = [i for i, j in enumerate(plan.judge) if j is not None]

    def job() -> list[tuple[int, bool | None | str]]:
        verdicts: dict[int, bool | None | str] = {
            i: None if i in plan.unscorable else False for i in range(len(tests))}
        runs = list(judged)
        if runs:
            seed = _judge_seed([plan.judge[i] for i in runs] + [trusted_code])
            # Drawn apart from the seed (which the program cannot see): the sandbox's
            # PYTHONHASHSEED is readable inside, and must say nothing about random's inputs.
            hash_seed = secrets.randbelow(1 << 32)
            traced = [i for i in runs if plan.pre[i] is not None]
            traces: dict[int, list] = {}
            if traced:
                traces = judge_inputs([plan.pre[i] for i in traced], trusted=trusted, seed=seed,
                                      ids=traced, hash_seed=hash_seed)
                for i in traced:
                    if i not in traces:
                        verdicts[i] = None  # the test itself failed or asked for too much
                runs = [i for i in runs if plan.pre[i] is None or i in traces]
            jobs_ = [plan.inside[i] if plan.pre[i] is None
                     else dict(plan.inside[i], trace=traces[i]) for i in runs]
            nonce = secrets.token_hex(16)
            r = run(code, mode="probes", timeout=timeout, **kw, hash_seed=hash_seed,
                    run_job={"tests": jobs_, "nonce": nonce, "max_items": MAX_SET_ITEMS,
                             "iter_items": MAX_ITER_ITEMS, "iter_seconds": ITER_SECONDS})
            if r.error is not None:
                raise SandboxUnavailable(r.error)
            passed = judge([plan.judge[i] for i in runs], r.results_bytes, nonce,
                           trusted=trusted, seed=seed, ids=runs, hash_seed=hash_seed,
                           traces={k: traces[i] for k, i in enumerate(runs) if i in traces},
                           python=[plan.python[i] for i in runs])
            for k, i in enumerate(runs):
                verdicts[i] = passed[k]
        for i in plan.prefix:
            if verdicts[i] is not False:
                verdicts[i] = None  # its asserts before the refused statement held: no verdict
        return list(verdicts.items())

    return [job]


# The judge's interpreter: no user site, no site (no sitecustomize, no .pth), no working
# directory on sys.path (-P), bytecode neither read from nor written to the tree (-B); the
# environment is exactly the one given (so not -I, which would drop PYTHONHASHSEED):
# PYTHONPATH, PYTHONSTARTUP, PYTHONHOME and the rest of the trainer's environment never reach it.
JUDGE_FLAGS = ("-s", "-S", "-P", "-B")


def _judge_process(job: dict, data: bytes, stage: str, read_limit: int, seed: int,
                   hash_seed: int) -> tuple[bool, bytes]:
    """Run one judge stage of the bootstrap on ``job`` (with ``data`` as its second
    descriptor, its output on a third); ``(exited cleanly within JUDGE_SECONDS, output up to
    read_limit bytes)``. Its stdout and stderr go to /dev/null: no code the judge runs can
    print a verdict line."""
    exe, _ = runtime()
    fds: list[int] = []
    try:
        job_fd = memfd(json.dumps(dict(job, stage=stage, seed=seed)).encode(), "judge")
        fds.append(job_fd)
        res_fd = memfd(data, "results")
        fds.append(res_fd)
        with tempfile.TemporaryFile() as out:
            out_w = os.open(f"/proc/self/fd/{out.fileno()}", os.O_WRONLY | os.O_APPEND)
            fds.append(out_w)
            proc = subprocess.Popen(
                [exe, *JUDGE_FLAGS, "-c", bootstrap_source(), "judge", str(job_fd), str(res_fd),
                 str(out_w)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                pass_fds=(job_fd, res_fd, out_w), cwd="/",
                env={"LANG": "C.UTF-8", "PYTHONHASHSEED": str(int(hash_seed) % (1 << 32))},
                start_new_session=True, close_fds=True)
            exited = end_group(proc, fds, JUDGE_SECONDS)
            out.seek(0)
            text = out.read(read_limit)
    finally:
        for fd in fds:
            os.close(fd)
    return exited and proc.returncode == 0, text


def _judge_job(sources: list[str], trusted: tuple | None, ids: list[int]) -> dict:
    return {"tests": sources, "test_seconds": JUDGE_TEST_SECONDS, "probe": PROBE,
            "builtins": sorted(JUDGE_BUILTINS), "modules": sorted(JUDGE_MODULES),
            "trusted_builtins": sorted(TRUSTED_EXTRA_BUILTINS), "max_items": MAX_SET_ITEMS,
            "trusted": trusted[0] if trusted else None,
            "trusted_names": list(trusted[1]) if trusted else [], "ids": list(ids)}


def judge_inputs(sources: list[str], *, trusted: tuple | None = None, seed: int = 0,
                 ids: list[int] | None = None, hash_seed: int | None = None) -> dict[int, list]:
    """The judge's first stage over traced tests (``AssertPlan.pre`` sources, run before the
    program, never with it): ``{id: [[step, encoded inputs], ...]}`` for each test that ran
    to its end within the caps; a test that raised on its own, asked for more than
    :data:`MAX_PROBE_CALLS` step runs or :data:`MAX_INPUT_BYTES` of inputs (all tests
    together), or did not finish within :data:`JUDGE_SECONDS` is left out (unscorable).
    ``trusted``: :func:`check_trusted_code`'s result; ``hash_seed``: the ``PYTHONHASHSEED``
    shared with the sandbox and the verdict stage (``seed`` when None)."""
    ids = list(range(len(sources))) if ids is None else list(ids)
    job = dict(_judge_job(sources, trusted, ids), max_calls=MAX_PROBE_CALLS,
               max_bytes=MAX_INPUT_BYTES)
    ok, text = _judge_process(job, b"", "inputs", MAX_INPUT_BYTES + 64 * (MAX_PROBE_CALLS + len(ids)) + 4096,
                              seed, seed if hash_seed is None else hash_seed)
    traces: dict[int, list] = {}
    if not ok:
        return traces
    known, calls = set(ids), 0
    pending: dict[int, list] = {}
    for line in text.split(b"\n"):
        parts = line.decode("ascii", errors="replace").split(" ")
        if len(parts) < 2 or not parts[0].isdigit() or int(parts[0]) not in known:
            continue
        t = int(parts[0])
        if parts[1] == "D" and len(parts) == 2 and t not in traces:
            traces[t] = pending.pop(t, [])
        elif parts[1] == "E":
            pending.pop(t, None)
        elif len(parts) == 3 and parts[1].isdigit() and t not in traces:
            calls += 1
            if calls > MAX_PROBE_CALLS:
                return {k: v for k, v in traces.items()}
            pending.setdefault(t, []).append([int(parts[1]), parts[2]])
    return traces


def judge(sources: list[str], results: bytes, nonce: str, *, trusted: tuple | None = None,
          seed: int = 0, ids: list[int] | None = None, traces: dict | None = None,
          python: list | None = None, hash_seed: int | None = None) -> list[bool | None | str]:
    """Run the judge stage of the bootstrap (a fresh interpreter, never the program) on the
    probe records ``results``; one verdict per judge source: True (passed), False, None
    (a traced test whose step runs, recomputed, are not those the program ran: unscorable),
    or :data:`PYTHON_ONLY` (fails as written, passes in its ``python`` reading; see
    :func:`row_score`).
    Anything short of a clean "passed" from the judge within :data:`JUDGE_SECONDS` fails.
    ``traces``: the step runs of the traced tests, by position in ``sources``; ``python``:
    per source, its Python reading (:attr:`AssertPlan.python`) or None. Records past
    :data:`MAX_RESULT_BYTES` are cut: the tests they belong to never finished (fail)."""
    n = len(sources)
    if len(results) > MAX_RESULT_BYTES:
        results = results[:results.rfind(b"\n", 0, MAX_RESULT_BYTES) + 1]
    if nonce.encode() not in results:
        return [False] * n  # not one record of ours: nothing to judge
    ids = list(range(n)) if ids is None else list(ids)
    job = dict(_judge_job(sources, trusted, ids), nonce=nonce,
               traces={str(k): v for k, v in (traces or {}).items()},
               python=list(python) if python is not None else None)
    ok, raw = _judge_process(job, results, "verdict", 24 * n + 64, seed,
                             seed if hash_seed is None else hash_seed)
    verdicts: list[bool | None] = [False] * n
    if not ok:
        return verdicts
    # The judge writes exactly "PASS <i>" / "MISS <i>" / "PYTH <i>" lines (bounded: n lines).
    for line in raw.decode("ascii", errors="replace").split("\n")[:n]:
        head, _, idx = line.partition(" ")
        if head in _VERDICTS and idx.isdigit() and len(idx) < 10 and int(idx) < n:
            verdicts[int(idx)] = _VERDICTS[head]
    return verdicts


PYTHON_ONLY = "python"  # a verdict: the test's two readings disagree (see the module docstring)
_VERDICTS = {"PASS": True, "MISS": None, "PYTH": PYTHON_ONLY}


def row_score(verdicts: list) -> int | None:
    """Tests passed in one completion's verdicts, or None (unscorable). A test unscorable on
    its own (None) makes the row None; a test that passes only in its Python reading
    (:data:`PYTHON_ONLY`: the program changed what it was handed) counts as failed when
    another test fails (else a wrong program could escape its zeros that way) and makes the
    row None otherwise (the right program may be updating in place)."""
    if None in verdicts:
        return None
    if PYTHON_ONLY in verdicts and False not in verdicts:
        return None
    return sum(v is True for v in verdicts)
