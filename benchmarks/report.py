"""Render a pytest-benchmark results JSON into a markdown report and PNG plots.

    python -m benchmarks.report RESULTS.json [--env ENV.json] [--out-dir DIR] [--md PATH] [--title TEXT]

Writes ``<stem>.md`` (default: next to RESULTS.json) with the conditions (machine, versions, date,
set, copy bandwidth / matmul rate) and, per operation, a table: impl, shape (N, V, H), dtype, pass,
median time, peak extra memory, time and memory relative to the reference at the same shape, and
the achieved GB/s (from-logits operations) or TFLOP/s (fused-linear) with its fraction of the
measured ceiling when present. Then one PNG per (operation, pass, dtype, V, H): time and peak memory
against N, one line per implementation. Only the standard library and matplotlib (Agg) are used.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

IMPL_ORDER = {"reference": 0, "torch": 1, "triton": 2, "liger": 3, "trl": 4}
OP_ORDER = {"token_logprobs": 0, "grpo_loss": 1, "fused_linear_grpo_loss": 2, "fused_linear_token_logprobs": 3}
PASS_ORDER = {"fwd": 0, "fwd+bwd": 1}
IMPL_STYLE = {
    "reference": dict(color="#d62728", marker="o", linestyle="--"),
    "torch": dict(color="#1f77b4", marker="s", linestyle="-"),
    "triton": dict(color="#2ca02c", marker="^", linestyle="-"),
    "liger": dict(color="#9467bd", marker="D", linestyle=":"),
    "trl": dict(color="#8c564b", marker="v", linestyle="-."),
}


# --------------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------------
def load_rows(data: dict) -> List[dict]:
    """One dict per benchmark: its extra_info plus ``median_s`` and ``name``."""
    rows = []
    for b in data.get("benchmarks", []):
        info = dict(b.get("extra_info") or {})
        if "op" not in info:
            continue
        info["median_s"] = (b.get("stats") or {}).get("median")
        info["name"] = b.get("name")
        rows.append(info)
    return rows


def conditions(data: dict, env: Optional[dict]) -> dict:
    cond = dict(((data.get("machine_info") or {}).get("grpo_bench")) or {})
    if env:
        cond.update({k: v for k, v in env.items() if v is not None})
    cond.setdefault("date", data.get("datetime"))
    # Ceilings recorded per benchmark win when the environment file has none.
    for r in load_rows(data):
        if "copy_gbps" in r:
            cond.setdefault("copy_gbps", round(r["copy_gbps"], 1))
        if "matmul_tflops" in r:
            cond.setdefault("matmul_tflops", round(r["matmul_tflops"], 2))
    return cond


# --------------------------------------------------------------------------------------------------
# formatting
# --------------------------------------------------------------------------------------------------
def fmt_time(s: Optional[float]) -> str:
    if s is None:
        return "—"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"


def fmt_bytes(b: Optional[float]) -> str:
    if b is None:
        return "—"
    if abs(b) >= 2**30:
        return f"{b / 2**30:.2f} GiB"
    if abs(b) >= 2**20:
        return f"{b / 2**20:.1f} MiB"
    return f"{b / 2**10:.1f} KiB"


def fmt_ratio(x: Optional[float]) -> str:
    return "—" if x is None else f"{x:.2f}×" if x >= 0.095 else f"{x:.3f}×"


def shape_of(r: dict) -> str:
    h = r.get("H")
    return f"N={r['N']}, V={r['V']}" + (f", H={h}" if h else "")


def throughput_of(r: dict) -> Tuple[str, str]:
    """(achieved throughput, fraction of the measured ceiling). Fractions are shown for GPU rows only:
    on a CPU the torch path is not a bandwidth kernel, and a shared CPU's ceilings are noise."""
    on_cpu = r.get("device") == "cpu"
    if r.get("gbps") is not None:
        frac = None if on_cpu else r.get("bw_fraction")
        return f"{r['gbps']:.1f} GB/s", ("—" if frac is None else f"{100 * frac:.0f}% of copy")
    if r.get("tflops") is not None:
        frac = None if on_cpu else r.get("matmul_fraction")
        return f"{r['tflops']:.2f} TFLOP/s", ("—" if frac is None else f"{100 * frac:.0f}% of matmul")
    return "—", "—"


def _key(r: dict):
    return (OP_ORDER.get(r["op"], 9), PASS_ORDER.get(r["pass"], 9), r["dtype"], r["V"], r.get("H") or 0, r["N"],
            IMPL_ORDER.get(r["impl"], 9))


def reference_index(rows: List[dict]) -> Dict[tuple, dict]:
    return {(r["op"], r["pass"], r["dtype"], r["N"], r["V"], r.get("H")): r for r in rows if r["impl"] == "reference"}


def table(rows: List[dict], ref: Dict[tuple, dict]) -> List[str]:
    out = [
        "| impl | shape | dtype | pass | median | peak memory | time / ref | memory / ref | throughput | of ceiling |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=_key):
        base = ref.get((r["op"], r["pass"], r["dtype"], r["N"], r["V"], r.get("H")))
        t_ratio = m_ratio = None
        if base and base.get("median_s") and r.get("median_s") is not None:
            t_ratio = r["median_s"] / base["median_s"]
        if base and base.get("peak_mem_bytes") and r.get("peak_mem_bytes") is not None:
            m_ratio = r["peak_mem_bytes"] / base["peak_mem_bytes"]
        tp, frac = throughput_of(r)
        out.append(
            f"| {r['impl']} | {shape_of(r)} | {r['dtype']} | {r['pass']} | {fmt_time(r.get('median_s'))} | "
            f"{fmt_bytes(r.get('peak_mem_bytes'))} | {fmt_ratio(t_ratio)} | {fmt_ratio(m_ratio)} | {tp} | {frac} |"
        )
    return out


def conditions_lines(cond: dict, data: dict) -> List[str]:
    if cond.get("gpu_name"):
        machine = f"{cond['gpu_name']}" + (f" ({cond.get('gpu_memory_gib')} GiB)" if cond.get("gpu_memory_gib") else "")
        machine += f", host CPU {cond.get('cpu_model', '?')} × {cond.get('cpu_count', '?')}"
    else:
        machine = f"CPU only: {cond.get('cpu_model', '?')}, {cond.get('cpu_count', '?')} cores"
        if cond.get("torch_threads"):
            machine += f", {cond['torch_threads']} torch threads"
    lines = [f"- Machine: {machine}"]
    versions = ", ".join(f"{k} {cond[k]}" for k in ("torch", "triton", "liger_kernel", "trl", "cuda", "python") if cond.get(k))
    lines.append(f"- Versions: {versions}")
    lines.append(f"- Date: {cond.get('date') or data.get('datetime', '?')}")
    if cond.get("bench_set"):
        lines.append(f"- Set: `{cond['bench_set']}`")
    ceil = []
    if cond.get("copy_gbps"):
        ceil.append(f"copy bandwidth {cond['copy_gbps']} GB/s (read + write, best of several)")
    if cond.get("matmul_tflops"):
        ceil.append(f"matmul {cond['matmul_tflops']} TFLOP/s ({cond.get('matmul_dtype', 'benchmark dtype')})")
    if ceil and cond.get("gpu_name"):
        lines.append("- Measured ceilings: " + "; ".join(ceil))
    methods = sorted({r.get("peak_mem_method") for r in load_rows(data) if r.get("peak_mem_method")})
    if methods:
        lines.append("- Peak memory: extra bytes above the inputs in one separate run, via " + ", ".join(methods))
    if cond.get("note"):
        lines.append(f"- Note: {cond['note']}")
    return lines


# The GPU issue's targets: token_logprobs forward at >= 85% of copy bandwidth on the one-read floor,
# grpo_loss forward+backward against the two-reads-one-write floor, fused-linear against the matmul rate.
HEADLINE = (
    ("token_logprobs", "fwd", 16384, 151936, None, "≥ 85% of copy bandwidth (one read of the logits)"),
    ("grpo_loss", "fwd+bwd", 16384, 151936, None, "against two reads + one write of the logits"),
    ("fused_linear_grpo_loss", "fwd+bwd", 16384, 151936, 4096, "against the matmul rate (8·N·H·V flops for ours)"),
)


def headline_lines(rows: List[dict]) -> List[str]:
    out = []
    for op, pass_, n, v, h, target in HEADLINE:
        hits = [r for r in rows if (r["op"], r["pass"], r["N"], r["V"], r.get("H")) == (op, pass_, n, v, h)]
        if not hits:
            continue
        out.append(f"- `{op}` {pass_} N={n} V={v}" + (f" H={h}" if h else "") + f" ({target}):")
        for r in sorted(hits, key=lambda r: IMPL_ORDER.get(r["impl"], 9)):
            tp, frac = throughput_of(r)
            out.append(f"  - {r['impl']}: {fmt_time(r.get('median_s'))}, {tp}, {frac}, peak {fmt_bytes(r.get('peak_mem_bytes'))}")
    return out


def checks_lines(checks: List[dict]) -> List[str]:
    out = []
    for c in checks:
        out.append(f"**fused_linear_grpo_loss fwd+bwd, {c['impl']} vs reference, {c['dtype']}, V={c['V']}, H={c['H']}**")
        out.append("")
        out.append("| N | ours peak | reference peak | ratio |")
        out.append("|---:|---:|---:|---:|")
        for p in c["points"]:
            ratio = p.get("ratio_to_reference")
            out.append(f"| {p['N']} | {fmt_bytes(p['peak_bytes'])} | {fmt_bytes(p.get('reference_peak_bytes'))} | "
                       f"{'—' if ratio is None else f'{ratio:.4f} (1/{1 / ratio:.0f})'} |")
        out.append("")
        rc = c.get("ratio_check")
        if rc:
            out.append(f"- ours ≤ 1/8 of the reference at N={rc['N']}: ratio {rc['ratio']:.4f} → "
                       f"**{'PASS' if rc['ok'] else 'FAIL'}**")
        for g in c.get("growth", []):
            out.append(f"- N {g['from_N']} → {g['to_N']}: peak grows {fmt_bytes(g['delta_bytes'])}, allowed "
                       f"(hidden + its gradient) {fmt_bytes(g['allowed_bytes'])} → **{'PASS' if g['ok'] else 'FAIL'}**")
        out.append("")
    return out


# --------------------------------------------------------------------------------------------------
# plots
# --------------------------------------------------------------------------------------------------
def plot_groups(rows: List[dict]) -> Dict[tuple, List[dict]]:
    groups = defaultdict(list)
    for r in rows:
        groups[(r["op"], r["pass"], r["dtype"], r["V"], r.get("H"))].append(r)
    return groups


def plot(rows: List[dict], out_dir: str, stem: str) -> List[Tuple[tuple, str]]:
    """One PNG per group: time and peak memory against N, one line per implementation."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # e.g. a lent GPU machine without it: render the plots later from the JSON
        print("matplotlib is not installed: no plots", file=sys.stderr)
        return []

    written = []
    for key, group in sorted(plot_groups(rows).items(), key=lambda kv: _key(kv[1][0])):
        op, pass_, dtype, v, h = key
        if len({r["N"] for r in group}) < 2:
            continue  # a single N is a table row, not a curve
        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
        slowest = max((r.get("median_s") or 0) for r in group)
        t_scale, t_unit = (1.0, "s") if slowest >= 2 else (1e3, "ms")
        for impl in sorted({r["impl"] for r in group}, key=lambda i: IMPL_ORDER.get(i, 9)):
            pts = sorted((r["N"], r.get("median_s"), r.get("peak_mem_bytes")) for r in group if r["impl"] == impl)
            style = IMPL_STYLE.get(impl, {})
            tp = [(n, t) for n, t, _ in pts if t is not None]
            mp = [(n, m) for n, _, m in pts if m is not None]
            if tp:
                ax_t.plot([n for n, _ in tp], [t * t_scale for _, t in tp], label=impl, **style)
            if mp:
                ax_m.plot([n for n, _ in mp], [m / 2**20 for _, m in mp], label=impl, **style)
        title = f"{op} {pass_} {dtype} V={v}" + (f" H={h}" if h else "")
        for ax, ylabel in ((ax_t, f"median time ({t_unit})"), (ax_m, "peak extra memory (MiB)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("N (tokens)")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
            ax.set_ylim(bottom=0)
        ax_t.set_title("time")
        ax_m.set_title("peak memory")
        fig.suptitle(title)
        fig.tight_layout()
        name = f"{stem}-{op}-{pass_.replace('+', '')}-{dtype}-V{v}" + (f"-H{h}" if h else "") + ".png"
        fig.savefig(os.path.join(out_dir, name), dpi=90)
        plt.close(fig)
        written.append((key, name))
    return written


# --------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------
def render(data: dict, out_dir: str, stem: str, env: Optional[dict] = None, title: Optional[str] = None) -> str:
    rows = load_rows(data)
    cond = conditions(data, env)
    ref = reference_index(rows)
    lines = [f"# {title or 'grpo-kernels benchmarks'}", ""]
    lines += conditions_lines(cond, data)
    lines += [
        "",
        "Times are medians of the timed rounds; `fwd` runs without autograd (old/reference log-probs), "
        "`fwd+bwd` computes the input gradients with `torch.autograd.grad`. Peak memory is the extra memory "
        "above the inputs (outputs, gradients and temporaries). Ratios are to the reference at the same "
        "shape, dtype and pass. Throughput: bytes of the floor (logits read once forward; read twice and "
        "gradient written once forward+backward) per second, or executed matmul flops per second "
        "(fused-linear: 8·N·H·V forward+backward for ours, which recomputes the logits, 6·N·H·V otherwise).",
        "",
    ]
    headline = headline_lines(rows)
    if headline:
        lines += ["## Headline cases", ""] + headline + [""]
    plots = dict(plot(rows, out_dir, stem)) if rows else {}
    for op in sorted({r["op"] for r in rows}, key=lambda o: OP_ORDER.get(o, 9)):
        op_rows = [r for r in rows if r["op"] == op]
        lines += [f"## `{op}`", ""]
        lines += table(op_rows, ref)
        lines.append("")
        for key, name in sorted(plots.items(), key=lambda kv: (PASS_ORDER.get(kv[0][1], 9), kv[0][2], kv[0][3], kv[0][4] or 0)):
            if key[0] == op:
                lines += [f"![{op} {key[1]} {key[2]} V={key[3]}{' H=' + str(key[4]) if key[4] else ''}]({name})", ""]
    checks = data.get("grpo_memory_checks") or []
    if checks:
        lines += ["## Fused-linear memory: flat in N for ours, growing for the reference", ""]
        lines += checks_lines(checks)
    skipped = data.get("grpo_skipped") or []
    if skipped:
        lines += ["## Cases not run", ""]
        lines += [f"- `{s['case']}`: {s['reason']}" for s in skipped]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Render pytest-benchmark JSON into markdown + PNG plots")
    parser.add_argument("results", help="pytest-benchmark --benchmark-json output")
    parser.add_argument("--env", help="machine JSON from `python -m benchmarks.machine` (default: env.json next to RESULTS if present)")
    parser.add_argument("--out-dir", help="where the markdown and PNGs go (default: RESULTS' folder)")
    parser.add_argument("--md", help="markdown path (default: OUT_DIR/<stem>.md)")
    parser.add_argument("--title", help="report title")
    args = parser.parse_args(argv)
    with open(args.results) as f:
        data = json.load(f)
    out_dir = args.out_dir or os.path.dirname(os.path.abspath(args.results))
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.splitext(os.path.basename(args.results))[0]
    env_path = args.env or os.path.join(os.path.dirname(os.path.abspath(args.results)), "env.json")
    env = None
    if os.path.exists(env_path):
        with open(env_path) as f:
            env = json.load(f)
        recorded = ((data.get("machine_info") or {}).get("grpo_bench")) or {}
        if not args.env and recorded and env.get("gpu_name") != recorded.get("gpu_name"):
            env = None  # an env.json from another machine's run in the same folder
    md = render(data, out_dir, stem, env, args.title)
    md_path = args.md or os.path.join(out_dir, stem + ".md")
    with open(md_path, "w") as f:
        f.write(md)
    print(md_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
