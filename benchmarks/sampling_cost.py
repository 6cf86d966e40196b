"""What the sampler's truncation costs: log-probs of the plain softmax against top-k, top-p and both (issue 34).

Two measurements, each written to the report:

1. **CPU, measured** (``backend="torch"``, the chunked PyTorch rows): ``token_logprobs`` with the entropy,
   forward only, on ``[rows, V]`` logits ``3 N(0, 1)`` at T = 0.7 (a flat distribution: a nucleus of
   thousands of tokens, the candidate search's worst case), in four modes (the script's
   ``harness.Sides``): plain, ``top_k``, ``top_p``, ``top_k`` + ``top_p``. Rounds alternate the modes' order; each
   round times one call per mode (``harness.interleave``, registered as ``harness.Sides``); the report
   gives each mode's median and the median of the per-round ratios to plain, with the conditions
   (load at the start and at the end: ``harness.Report``). Timings are ratios measured interleaved in
   one process: nothing else here is comparable across runs.
   The Triton kernels are not timed: on a CPU they run in Triton's interpreter, whose time says
   nothing about a GPU's.
2. **H200, predicted** (``--sass-model PATH``, the shared SASS model ``sass_model.py``): the plain
   forward launch against the sampled ones (``forward_rows_sampled``: its main kernel, whose bytes are
   two reads of the row, and the fallback kernel, which only flagged rows run), compiled for sm_90a
   from meta tensors; the model's predicted time and its bandwidth-only time per launch. Without a
   path this part is skipped (CI runs the script tiny, without it).

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.sampling_cost --out benchmarks/results/cpu-sampling_cost.md \
        [--rows 256 --vocab 32000 151936 --rounds 7] [--sass-model ../shared/tools/sass_model.py]
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Dict, List, Optional

import torch

import grpo_kernels as gk
from benchmarks import harness as H

# the sides: token_logprobs with the entropy under each truncation (plain first: the ratios' base)
SIDES = H.Sides()
MODES = {"plain": {}, "top_k=50": dict(top_k=50), "top_p=0.9": dict(top_p=0.9),
         "top_k=20,top_p=0.9": dict(top_k=20, top_p=0.9)}
for _mode, _kw in MODES.items():
    SIDES.register(_mode, f"token_logprobs(return_entropy=True, backend='torch', {', '.join(f'{k}={v}' for k, v in _kw.items()) or 'no truncation'})")(
        lambda logits, targets, _kw=_kw: (lambda: gk.token_logprobs(logits, targets, temperature=0.7,
                                                                    return_entropy=True, backend="torch", **_kw)))


def cpu_ratios(rows: int, vocab: int, rounds: int, seed: int = 0) -> Dict[str, Dict[str, Optional[float]]]:
    """mode -> {"seconds": median per call, "ratio": median of per-round ratios to plain} (harness.interleave)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, rows, vocab, generator=g) * 3.0
    targets = logits.argmax(-1)
    times = H.interleave({name: side.make(logits, targets) for name, side in SIDES.items()}, rounds)
    return {name: dict(seconds=H.median(times[name]), ratio=H.ratio(times, name, "plain")) for name in SIDES}


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
    p = H.parser(__doc__.splitlines()[0], rounds=7)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936])
    p.add_argument("--sass-model", default=None, help="path of sass_model.py for the predicted H200 part")
    a = p.parse_args(argv)
    report = H.Report("Sampler truncation cost (issue 34)")
    report.add("## CPU, measured: token_logprobs(return_entropy=True), backend='torch', forward, fp32", "",
               f"{a.rows} rows, temperature 0.7, logits 3 x N(0, 1) (a flat distribution: a nucleus of thousands of "
               f"tokens); medians of {a.rounds} interleaved rounds (harness.interleave), ratios the median of the "
               f"per-round ratios to plain", "")
    rows = []
    for v in a.vocab:
        for mode, r in cpu_ratios(a.rows, v, a.rounds).items():
            rows.append((v, mode, H.fmt_time(r["seconds"]), H.fmt_ratio(r["ratio"])))
            report.records.append(dict(kind="cpu", vocab=v, mode=mode, rows=a.rows, **r))
    report.add(*H.table(("V", "mode", "median", "x plain"), rows), "")
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
