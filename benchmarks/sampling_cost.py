"""What the sampler's truncation costs: log-probs of the plain softmax against top-k, top-p and both (issue 34).

Two measurements, each written to the report:

1. **CPU, measured** (``backend="torch"``, the chunked PyTorch rows): ``token_logprobs`` with the entropy,
   forward only, on ``[rows, V]`` logits of a peaked distribution (scaled standard normal), in four
   modes: plain, ``top_k``, ``top_p``, ``top_k`` + ``top_p``. Rounds alternate the modes' order; each
   round times one call per mode; the report gives each mode's median seconds and the median of the
   per-round ratios to plain, with the machine's load (``/proc/loadavg``) before and after. Timings
   are ratios measured interleaved in one process: nothing else here is comparable across runs.
   The Triton kernels are not timed: on a CPU they run in Triton's interpreter, whose time says
   nothing about a GPU's.
2. **H200, predicted** (``--sass-model PATH``, the shared SASS model ``sass_model.py``): the plain
   forward launch against the sampled ones (``forward_rows_sampled``: its main kernel, whose bytes are
   two reads of the row, and the fallback kernel, which only flagged rows run), compiled for sm_90a
   from meta tensors; the model's predicted time and its bandwidth-only time per launch. Without a
   path this part is skipped (CI runs the script tiny, without it).

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.sampling_cost --out benchmarks/results/sampling_cost.md \
        [--rows 256 --vocab 32000 151936 --rounds 7] [--sass-model ../shared/tools/sass_model.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

import grpo_kernels as gk

MODES = {"plain": {}, "top_k=50": dict(top_k=50), "top_p=0.9": dict(top_p=0.9),
         "top_k=20,top_p=0.9": dict(top_k=20, top_p=0.9)}


def _load() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"


def cpu_ratios(rows: int, vocab: int, rounds: int, seed: int = 0) -> Dict[str, Dict[str, float]]:
    """mode -> {"seconds": median per call, "ratio": median of per-round ratios to plain}."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, rows, vocab, generator=g) * 3.0  # peaked: a nucleus of tens of tokens
    targets = logits.argmax(-1)
    times: Dict[str, List[float]] = {m: [] for m in MODES}
    for mode, kw in MODES.items():  # warm-up (allocator, first-call paths)
        gk.token_logprobs(logits, targets, temperature=0.7, return_entropy=True, backend="torch", **kw)
    for r in range(rounds):
        order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
        for mode in order:
            start = time.perf_counter()
            gk.token_logprobs(logits, targets, temperature=0.7, return_entropy=True, backend="torch", **MODES[mode])
            times[mode].append(time.perf_counter() - start)
    out = {}
    for mode in MODES:
        ratios = [t / p for t, p in zip(times[mode], times["plain"])]
        out[mode] = dict(seconds=statistics.median(times[mode]), ratio=statistics.median(ratios))
    return out


def predicted(sass_model: str, vocab: int, rows: int = 16384) -> List[dict]:
    """The SASS model's prediction (H200, sm_90a, bf16) of the plain forward and the sampled launches."""
    os.environ.pop("TRITON_INTERPRET", None)
    spec = importlib.util.spec_from_file_location("sass_model", sass_model)
    sm = importlib.util.module_from_spec(spec)
    sys.modules["sass_model"] = sm
    spec.loader.exec_module(sm)
    from grpo_kernels.kernels import triton_rows

    b, t = 8, rows // 8
    logits = torch.empty(b, t, vocab, dtype=torch.bfloat16, device="meta")
    targets = torch.empty(b, t, dtype=torch.int64, device="meta")
    cases = [("plain", triton_rows.forward_rows, {}, 1)] + [
        (mode, triton_rows.forward_rows_sampled, kw, 2) for mode, kw in MODES.items() if kw]
    out = []
    for name, fn, kw, passes in cases:
        log = sm.capture(triton_rows, fn, logits=logits, targets=targets, temperature=0.7, ignore_index=-100,
                         with_entropy=True, **kw)
        for kernel, bound, options, grid in log:
            fallback = kernel.fn.__name__ == "sampled_logprobs_fallback_kernel"
            # the bytes charged: the main kernel reads the row twice; the fallback's passes run only for
            # the rows the main kernel flags (charged here as if every row were: an upper bound per row)
            launch = sm.Launch(name, kernel, sm._to_spec_args(bound), options, grid, read_bytes=2 * vocab * passes)
            r = sm.analyse(launch, 90, vocab, rows, "bf16")
            out.append(dict(mode=name, kernel=kernel.fn.__name__, vocab=vocab, regs=r.regs, spill=r.spill,
                            ctas_per_sm=r.ctas_per_sm, loops=len(r.loops), row_reads=0 if fallback else passes,
                            t_bw_ms=r.t_bw_ms, t_pred_ms=r.t_pred_ms, bound=r.bound, error=r.error))
    return out


def report(rows: int, vocabs: List[int], rounds: int, sass_model: Optional[str]) -> str:
    lines = ["# Sampler truncation cost (issue 34)", "",
             f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), load before: {_load()}", ""]
    lines += ["## CPU, measured: token_logprobs(return_entropy=True), backend='torch', forward, fp32", "",
              f"{rows} rows, temperature 0.7, logits 3 x N(0, 1); median of {rounds} interleaved rounds", "",
              "| V | mode | median s | x plain (median of per-round ratios) |", "|---|---|---|---|"]
    for v in vocabs:
        for mode, r in cpu_ratios(rows, v, rounds).items():
            lines.append(f"| {v} | {mode} | {r['seconds']:.4f} | {r['ratio']:.2f} |")
    lines += ["", f"load after: {_load()}", ""]
    if sass_model:
        lines += ["## H200, predicted by the SASS model (sm_90a, bf16, N = 16,384 rows)", "",
                  "t_bw: bytes read / (0.9 x 4.8 TB/s); row reads: passes over the row from HBM (the fallback "
                  "kernel's are per flagged row: it returns at once on the others, its line is an upper bound)", "",
                  "| V | mode | kernel | regs | spill | CTA/SM | row reads | t_bw (ms) | t_pred (ms) | bound |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for v in vocabs:
            for r in predicted(sass_model, v):
                t_pred = "-".join(f"{x:.2f}" for x in r["t_pred_ms"])
                lines.append(f"| {r['vocab']} | {r['mode']} | {r['kernel']} | {r['regs']} | {r['spill']} | "
                             f"{r['ctas_per_sm']} | {r['row_reads'] or 'per flagged row'} | {r['t_bw_ms']:.2f} | "
                             f"{t_pred} | {r['bound']}{' ' + r['error'] if r['error'] else ''} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--sass-model", default=None, help="path of sass_model.py for the predicted H200 part")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    text = report(a.rows, a.vocab, a.rounds, a.sass_model)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
