"""Every benchmark script under ``benchmarks/`` runs once, tiny, and writes its output.

Benchmarks are not tests: nothing here reads a timing. Each case runs one script as a user would
(``python -m benchmarks.<name> ...``, a fresh process, one torch thread; all started at once) at its
smallest meaningful size, its report written under a temporary directory (never into
``benchmarks/results/``), and asserts only that it exited 0, that every file it was asked to write
exists and is not empty, and that no record of its JSON is an error: a script that has rotted fails here.

Elsewhere: the pytest-benchmark suites (``benchmarks/bench_*.py``, their smoke sets), ``trainer_step --quick``
and ``kernels report`` run in ``make bench-ci``. A script that needs a package this interpreter lacks is
skipped with its name: ``trainer_step-vllm`` (the ``ours+vllm`` side) runs where vLLM is (``make test``
runs it with the vLLM venv).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent


class Script(NamedTuple):
    module: str  # benchmarks.<module>
    args: Tuple[str, ...]  # "{out}" is the test's temporary directory
    writes: Tuple[str, ...]  # files (glob patterns) under {out} that must exist and be non-empty
    needs: Tuple[str, ...] = ()  # importable packages, else skipped


SCRIPTS = {
    "kernels-compare": Script("kernels", ("compare", "--ops", "fused_linear_grpo_loss", "--shapes", "64x32x512", "--impls",
                                          "reference,torch,liger,trl,triton-ops", "--chunks", "16", "--frozen", "--rounds", "1", "--out",
                                          "{out}/compare.md"), ("compare.md", "compare.json")),
    "kernels-compare-rss": Script("kernels", ("compare", "--ops", "fused_linear_token_logprobs", "--shapes", "64x32x512",
                                              "--impls", "torch,trl,cce,verl", "--rss", "--rounds", "1", "--out",
                                              "{out}/head.md"), ("head.md", "head.json")),
    "vocab_parallel": Script(
        "vocab_parallel", ("--world", "2", "--tokens", "32", "--vocab", "64", "--hidden", "16", "--rounds", "1",
                           "--out", "{out}/vocab_parallel.md"), ("vocab_parallel.md", "vocab_parallel.json")),
    "long_context-memory": Script("long_context", ("memory", "--sizes", "tiny", "--lengths", "64", "--variants", "full", "lora",
                                                   "--out", "{out}/memory.md"), ("memory.md", "memory.json"), ("transformers", "peft")),
    "long_context-bisect": Script("long_context", ("bisect", "--mode", "packed", "--budget-gib", "0.3", "--lo", "64", "--hi", "128",
                                                   "--out", "{out}/bisect.md"), ("bisect.md", "bisect.json"), ("transformers",)),
    "rewards_hostile": Script("rewards_hostile", ("--smoke", "--out", "{out}/rewards_hostile.md"),
                              ("rewards_hostile.md", "rewards_hostile.json")),
    "optimizer_step": Script(
        "optimizer_step", ("--vocab", "512", "--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
                           "--rounds", "1", "--out", "{out}/optimizer_step.md"), ("optimizer_step.md", "optimizer_step.json")),
    "sampling_cost": Script("sampling_cost", ("--rows", "4", "--vocab", "257", "--rounds", "1",
                                              "--out", "{out}/sampling_cost.md"), ("sampling_cost.md", "sampling_cost.json")),
    "replay": Script("replay", ("--smoke", "--backend", "torch", "--out", "{out}/replay.md"), ("replay.md", "replay.json")),
    "replay-vllm": Script("replay", ("vllm", "--smoke", "--out", "{out}/replay_vllm.md"), ("replay_vllm.md", "replay_vllm.json"),
                          ("vllm",)),
    "trainer_step-vllm": Script("trainer_step", ("--quick", "--sides", "ours+vllm", "--out-dir", "{out}"),
                                ("trainer_step-*-quick.md", "trainer_step-*-quick.json"), ("vllm",)),
    "openrlhf_memory": Script("openrlhf_memory", ("--seq", "32", "--vocab", "257", "--hidden", "32", "--rounds", "1",
                                                  "--out", "{out}/openrlhf_memory.md"),
                              ("openrlhf_memory.md", "openrlhf_memory.json"), ("openrlhf",)),
    "long_context-options": Script("long_context", ("options", "--smoke", "--out", "{out}/options.md"),
                                   ("options.md", "options.json"), ("transformers",)),
    "long_context-layer": Script("long_context", ("layer", "--smoke", "--out", "{out}/layer.md"),
                                 ("layer.md", "layer.json"), ("transformers", "peft")),
    "long_context-full": Script("long_context", ("full", "--smoke", "--out", "{out}/full.md"),
                                ("full.md", "full.json"), ("transformers", "peft")),
}


def _missing(script: Script) -> list:
    return [p for p in script.needs if importlib.util.find_spec(p) is None]


def _command(script: Script, out: Path) -> list:
    return [sys.executable, "-m", f"benchmarks.{script.module}", *(a.format(out=out) for a in script.args)]


@pytest.fixture(scope="module")
def started(request, tmp_path_factory):
    """Every selected, runnable script started at once, each in its own directory: one thread each and
    mostly imports, so on 2 cores the set takes about half its sequential time. Each test waits for its own."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    selected = {item.callspec.params["name"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")}
    procs = {}
    for name, script in SCRIPTS.items():
        if name in selected and not _missing(script):
            out = tmp_path_factory.mktemp(name)
            log = open(out / "stdout+stderr.log", "w")
            proc = subprocess.Popen(_command(script, out), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            procs[name] = (proc, out, log)
    yield procs
    for proc, _, log in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(SCRIPTS))
def test_benchmark_script_runs_and_writes(name: str, started) -> None:
    script = SCRIPTS[name]
    missing = _missing(script)
    if missing:
        pytest.skip(f"benchmarks.{script.module} needs {', '.join(missing)}, not installed here")
    proc, out_dir, _ = started[name]
    cmd = " ".join(_command(script, out_dir))
    try:
        returncode = proc.wait(timeout=540)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    output = (out_dir / "stdout+stderr.log").read_text()
    assert returncode == 0, f"{cmd} exited {returncode}\n--- output\n{output[-6000:]}"
    for pattern in script.writes:
        found = sorted(out_dir.glob(pattern))
        assert found and all(f.stat().st_size > 0 for f in found), f"{cmd} did not write {out_dir / pattern}"
        if pattern.endswith(".json"):  # the harness's report: no record is an error
            records = json.loads(found[0].read_text())["records"]
            assert records and not [r for r in records if "error" in r], f"{cmd}: {records}"
