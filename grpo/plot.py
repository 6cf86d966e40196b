"""The run's curves as a PNG, drawn in a process of their own.

``plot_curves(records, path)`` draws every curve of :data:`PLOTTED` the records have against ``step``.
The trainer calls :func:`plot_in_subprocess`: this file run as a script by the same interpreter, the
records on its stdin, so that matplotlib (tens of MiB once imported) never adds to the training
process's resident memory (benchmarks/results/lora_memory-cpu-20261202.md). The file imports nothing
of the project and nothing but the standard library and matplotlib, so that the child starts light.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import Optional

# The curves drawn by plot_curves, in order; missing keys are skipped.
PLOTTED = (
    ("reward", "reward (mean)"),
    ("accuracy", "accuracy"),
    ("kl", "KL to reference"),
    ("entropy", "entropy"),
    ("completion_length/mean", "completion length"),
    ("truncated_frac", "truncated fraction"),
    ("zero_signal_frac", "zero-signal groups (fraction)"),
    ("clip_ratio/region_mean", "clip ratio"),
    ("grad_norm", "grad norm"),
)


def plot_curves(records: list[dict], path: str, title: str = "GRPO") -> Optional[str]:
    """Draw every curve of ``PLOTTED`` that the records have against ``step``; returns the PNG path."""
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(k, label) for k, label in PLOTTED if any(r.get(k) is not None for r in records)]
    cols = 3
    rows = max(1, math.ceil(len(panels) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    for ax, (key, label) in zip(axes.flat, panels):
        xs = [r["step"] for r in records if r.get(key) is not None]
        ys = [r[key] for r in records if r.get(key) is not None]
        ax.plot(xs, ys, lw=1.2)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def plot_in_subprocess(records: list[dict], path: str, title: str = "GRPO") -> Optional[str]:
    """:func:`plot_curves` in a child process (``python grpo/plot.py PATH TITLE``, the records as JSON on
    stdin); ``RuntimeError`` with the child's stderr when it fails."""
    if not records:
        return None
    done = subprocess.run([sys.executable, os.path.abspath(__file__), path, title], input=json.dumps(records),
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"drawing {path} failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return path


if __name__ == "__main__":
    plot_curves(json.load(sys.stdin), sys.argv[1], sys.argv[2])
