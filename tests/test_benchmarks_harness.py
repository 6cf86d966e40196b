"""benchmarks/harness.py (interleaving, ratios, fresh processes, sides, the report writer) and the
trainer-step benchmark's registry and tables built on it (no timing is asserted anywhere here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import harness as H  # noqa: E402
from benchmarks import trainer_step as TS  # noqa: E402


def test_interleave_rotates_the_order_and_ratio_is_the_median_per_round():
    calls = []
    times = H.interleave({k: (lambda k=k: calls.append(k)) for k in "abc"}, rounds=3, warmup=False)
    assert calls == list("abcbcacab") and all(len(t) == 3 for t in times.values())
    assert H.ratio({"x": [2.0, 9.0, 3.0], "y": [1.0, 1.0, 1.0]}, "x", "y") == 3.0
    assert H.ratio({"x": [1.0]}, "x", "missing") is None and H.median([None, 2.0, 4.0]) == 3.0


def test_sides_select_gives_the_reason_a_side_cannot_run():
    sides = H.Sides()
    sides.register("here")(lambda: None)
    sides.register("gone", unavailable=lambda: H.missing("no_such_module_xyz"))(lambda: None)
    assert sides.select() == (["here"], {"gone": "no_such_module_xyz not installed"})
    with pytest.raises(ValueError, match="unknown side 'nope'"):
        sides.select(["nope"])


def test_fresh_reports_a_failure_and_nothing_for_a_silent_success():
    assert H.fresh(["this"], timeout_s=60) == []  # (the Zen of Python: no result line, exit 0)
    failed = H.fresh(["benchmarks.no_such_module"], timeout_s=60)
    assert len(failed) == 1 and "exit 1" in failed[0]["error"] and "No module named" in failed[0]["error"]


def test_report_writes_markdown_and_json_with_the_load(tmp_path):
    report = H.Report("T", H.conditions(note="x"))
    report.records.append({"a": 1})
    report.add(*H.table(["side", "time"], [["ours", H.fmt_time(0.5)], ["peer", None]]))
    report.write(str(tmp_path / "r.md"))
    md, data = (tmp_path / "r.md").read_text(), json.loads((tmp_path / "r.json").read_text())
    assert md.startswith("# T\n") and "load average (1 min)" in md and "| ours | 500.00 ms |" in md and "| peer | — |" in md
    assert data["records"] == [{"a": 1}] and "load_1m" in data["conditions"] and "load_end_1m" in data["conditions"]


def test_phases_sum_wall_and_cpu_per_phase_and_put_patched_functions_back():
    import types

    owner = types.SimpleNamespace(work=lambda n: sum(i * i for i in range(n)))
    phases = H.Phases()
    phases.patch(owner, "work", "work")
    with phases("outer"):
        owner.work(200_000)
        owner.work(200_000)
    phases.restore()
    assert set(phases.wall) == set(phases.cpu) == {"work", "outer"} and owner.work(3) == 5
    assert 0 < phases.wall["work"] <= phases.wall["outer"] and 0 < phases.cpu["work"] <= phases.cpu["outer"] + 1e-3
    assert owner.work.__name__ == "<lambda>"  # the original again, not the wrapper


def test_trainer_step_registry_and_tables():
    assert set(TS.SIDES) == {"ours", "ours-reference", "trl", "trl+patch", "ours+vllm", "ours+vllm-uncorrected"}
    reason = TS.SIDES["ours+vllm"].unavailable()
    assert reason is None and TS.SIDES["ours+vllm"].python() or "vllm" in reason
    phases = {"generation": 1.0, "scoring": 0.1, "logps": 0.5, "loss+backward": 2.0, "optimizer": 0.4}
    records = []
    for rnd in range(3):
        for side, scale in (("ours", 1.0), ("trl", 1.5 + rnd)):  # trl: 1.5, 2.5, 3.5 x ours -> median 2.5
            step = 4.0 * scale * (1 + rnd)
            records.append({"side": side, "round": rnd, "step_s": step, "step_cpu_s": step / 2, "peak_rss_mib": 1000.0 * scale,
                            "load_1m": 1.0, "phases": TS.phases_with_other(step, {k: v * scale for k, v in phases.items()}),
                            "phases_cpu": TS.phases_with_other(step / 2, {k: v * scale / 2 for k, v in phases.items()}),
                            "completion_tokens": 128})
    records.append({"side": "trl+patch", "round": 0, "error": "exit 1: boom"})
    rows = {r["side"]: r for r in TS.summarise(records)}
    assert rows["ours"]["step_s_ratio"] == 1.0 and rows["trl"]["step_s_ratio"] == pytest.approx(2.5)
    assert rows["trl"]["step_cpu_s_ratio"] == pytest.approx(2.5) and rows["trl"]["peak_rss_mib_ratio"] == pytest.approx(2.5)
    assert rows["trl+patch"]["error"] == "exit 1: boom"
    assert rows["ours"]["phases"]["other"] == pytest.approx(8.0 - 4.0)  # median step 8 s, phases 4 s
    assert list(rows["ours"]["phases_cpu"]) == list(TS.PHASES) and rows["ours"]["phases_cpu"]["other"] == pytest.approx(2.0)
    md = "\n".join(TS.markdown("tiny", TS.summarise(records), {"rounds": 3, "process_per_side": True, "dtype": "fp32"},
                               {"ours+vllm": "no vllm"}))
    assert "| ours | 8.00 s | 1.00× | 1,000 MiB | 1.00× | 1.00 s (12%)" in md and "| ours | 4.00 s | 1.00× | 0.50 s (12%)" in md
    assert "| trl+patch | failed: exit 1: boom |" in md and "| ours+vllm | skipped: no vllm |" in md
