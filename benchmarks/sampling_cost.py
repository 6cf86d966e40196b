"""What the sampler's truncation costs against plain log-probs: CPU measured, H200 predicted (benchmarks/README.md)."""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Dict, List

import torch

import grpo_kernels as gk
from benchmarks import harness as H
from benchmarks.kernels import SAMPLINGS

MODES = {"plain": {}, **SAMPLINGS}  # token_logprobs' truncations (plain first: the ratios' base)


def cpu_times(rows: int, vocab: int, rounds: int, seed: int = 0) -> Dict[str, List[float]]:
    """mode -> seconds per round on ``[rows, vocab]`` logits ``3 N(0, 1)`` at T 0.7 (flat: the worst case), argmax targets."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, rows, vocab, generator=g) * 3.0
    targets = logits.argmax(-1)
    return H.interleave({mode: lambda kw=kw: gk.token_logprobs(logits, targets, temperature=0.7, return_entropy=True,
                                                               backend="torch", **kw) for mode, kw in MODES.items()}, rounds)


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
                            ctas_per_sm=r.ctas_per_sm, row_reads=None if fallback else passes, t_bw_ms=r.t_bw_ms,
                            t_pred_ms=list(r.t_pred_ms), bound=r.bound, error=r.error))
    return out


def main(argv=None) -> int:
    a = H.parser(__doc__.splitlines()[0], rounds=7, rows=256, vocab=[32000, 151936],
                 sass_model=(str, "path of sass_model.py for the predicted H200 part")).parse_args(argv)
    report = H.Report("Sampler truncation cost (issue 34)")
    report.add("## CPU, measured: token_logprobs(return_entropy=True), backend='torch', forward, fp32", "",
               f"{a.rows} rows, temperature 0.7, logits 3 x N(0, 1) (a flat distribution: a nucleus of thousands of "
               f"tokens); medians of {a.rounds} interleaved rounds (harness.interleave), ratios the median of the "
               f"per-round ratios to plain", "")
    for v in a.vocab:
        times = cpu_times(a.rows, v, a.rounds)
        report.records += [dict(kind="cpu", vocab=v, mode=mode, rows=a.rows, seconds=t) for mode, t in times.items()]
        report.add(f"### V = {v:,}", "", *H.timing_table(times, "plain"), "")
    if a.sass_model:
        report.add("## H200, predicted by the SASS model (sm_90a, bf16, N = 16,384 rows)", "",
                   "t_bw: bytes read / (0.9 x 4.8 TB/s); row reads: passes over the row from HBM (the fallback "
                   "kernel's are per flagged row: it returns at once on the others, its line an upper bound)", "")
        rows = []
        for v in a.vocab:
            for r in predicted(a.sass_model, v):
                report.records.append(dict(kind="predicted", **r))
                rows.append((r["vocab"], r["mode"], r["kernel"], r["regs"], r["spill"], r["ctas_per_sm"],
                             r["row_reads"] or "per flagged row", f"{r['t_bw_ms']:.2f}",
                             "-".join(f"{x:.2f}" for x in r["t_pred_ms"]), r["bound"] + (f" {r['error']}" if r["error"] else "")))
        report.add(*H.table(("V", "mode", "kernel", "regs", "spill", "CTA/SM", "row reads", "t_bw (ms)", "t_pred (ms)",
                             "bound"), rows), "")
    report.write(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
