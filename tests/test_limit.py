"""Smoke test of `benchmarks/limit.py` (figures are not asserted: timings never are)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.timeout(240)
def test_limit_quick_throughput_row(tmp_path):
    """The command end to end on its cheapest row (the multi-worker rows are the same code with two raw
    loops and the collectors' own tests' collectors)."""
    output = tmp_path / "limit.json"
    completed = subprocess.run(
        [sys.executable, str(BENCHMARKS / "limit.py"), "--quick", "--no-updates", "--rows", "collector",
         "--out", str(output)],
        capture_output=True, text=True, timeout=220,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    report = json.loads(output.read_text())
    names = [row["workload"] for row in report["rows"]]
    assert names == ["collector_cartpole"]
    for row in report["rows"]:
        assert row["figure"] > 0 and row["limit"] > 0 and row["ratio"] > 0 and row["cpu_ratio"] > 0
        assert f"| {row['workload']} |" in completed.stdout
    assert "load average" in completed.stdout and "| workload | figure | limit | ratio |" in completed.stdout


def test_limit_takes_rows_of_limit_updates_when_present(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import limit

    (tmp_path / "limit_updates.py").write_text(
        "def rows(quick, pairs=1):\n"
        "    return [{'workload': 'update_1m', 'figure': 2.0, 'limit': 1.0, 'ratio': 2.0,\n"
        "             'note': f'{quick} {pairs}'}]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "limit_updates", raising=False)
    monkeypatch.setattr(limit, "ROWS", {})
    report = limit.run(quick=True)
    assert report["rows"] == [{"workload": "update_1m", "figure": 2.0, "limit": 1.0, "ratio": 2.0, "note": "True 1"}]
    assert "| update_1m | 2.000 | 1.000 | 2.00 |  |  | True 1 |" in limit.format_table(report)
    assert limit.run(quick=True, pairs=3)["rows"][0]["note"] == "True 3"  # --pairs reaches the update rows
    assert limit.run(quick=True, updates=False)["rows"] == []


def test_limit_rows_are_chosen_by_name(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import limit

    rows = {name: (lambda quick, pairs, name=name: [{"workload": name, "figure": 1.0, "limit": 1.0, "ratio": 1.0,
                                               "note": ""}]) for name in ("collector", "multi")}
    monkeypatch.setattr(limit, "ROWS", rows)
    assert [row["workload"] for row in limit.run(quick=True, updates=False)["rows"]] == ["collector", "multi"]
    assert [row["workload"] for row in limit.run(quick=True, updates=False, rows=["multi"])["rows"]] == ["multi"]
    with pytest.raises(SystemExit):
        limit.main(["--rows", "nothing"])


def test_throughput_row_takes_the_medians_of_its_pairs(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import limit

    figures, limits = iter([100.0, 90.0, 120.0]), iter([200.0, 100.0, 150.0])
    calls = []
    monkeypatch.setattr(limit, "_workload", lambda name, quick: calls.append(name) or {
        "frames_per_s": next(figures), "ours_cpu": 1.0, "background_cpu": 0.0})
    monkeypatch.setattr(limit, "raw_loops", lambda processes, seconds: calls.append("raw") or {
        "steps_per_s": next(limits), "per_process": [1.0], "cpu_us_per_step": 5.0})
    row = limit.throughput_row("collector_cartpole", 1, quick=True, pairs=3)
    assert calls == ["collector_cartpole", "raw"] * 3  # alternating: each workload run, then its limit
    assert row["figure"] == 100.0 and row["limit"] == 150.0
    assert row["ratio"] == 0.8  # ratios 0.5, 0.9, 0.8: the median of the pairs', not figure / limit
    assert [pair["figure"] for pair in row["pairs"]] == [100.0, 90.0, 120.0]
    assert "medians of 3 pairs" in row["note"]
    with pytest.raises(SystemExit):
        limit.main(["--pairs", "0"])


def _busy_switch(busy_now: list) -> type:
    """A stand-in for limit_updates._Busy that records whether the busy loops would be running."""

    class Busy:
        def __enter__(self):
            busy_now[0] = True

        def __exit__(self, *exc):
            busy_now[0] = False

    return Busy


def test_update_rows_alternate_quiet_and_busy_runs_and_take_medians(monkeypatch):
    """``--pairs N``: rlharvest's side of the 1M update is run N times, quiet and busy alternated (each
    run a fresh process), the figures are the medians; TorchRL's side is run once per condition."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.delitem(sys.modules, "limit_updates", raising=False)  # not another test's stand-in
    import limit_updates

    busy_now, calls = [False], []
    Busy = _busy_switch(busy_now)

    ours = {False: iter([1.0, 3.0, 2.0]), True: iter([9.0, 4.0, 5.0])}

    def weightsync(python, script, workload, quick):
        calls.append((script, busy_now[0]))
        if script == "torchrl_side.py":
            return {"update_s": 20.0 if busy_now[0] else 10.0, "repeats": 10}
        return {"update_s": next(ours[busy_now[0]]), "copy_in_loop_s": 0.5, "repeats": 10}

    monkeypatch.setattr(limit_updates, "_Busy", Busy)
    monkeypatch.setattr(limit_updates, "_weightsync", weightsync)
    monkeypatch.setattr(limit_updates, "_torchrl_python", lambda: "python")
    rows = {row["workload"]: row for row in limit_updates._update_rows(quick=True, pairs=3)}
    assert calls == [("rlharvest_side.py", False), ("rlharvest_side.py", True)] * 3 + [
        ("torchrl_side.py", False), ("torchrl_side.py", True)]
    assert rows["update_1m_distributed/torchrl012"]["figure"] == 2.0
    assert rows["update_1m_distributed/torchrl012"]["ratio"] == 0.2
    assert rows["update_1m_distributed_busy/torchrl012"]["figure"] == 5.0
    assert rows["update_1m_distributed_busy/quiet"]["ratio"] == 2.5
    assert "median of 3 runs (9000.00, 4000.00, 5000.00 ms)" in rows["update_1m_distributed_busy/torchrl012"]["note"]


def test_update_rows_to_collecting_nodes_run_both_sides_pairs_times(monkeypatch):
    """The 1M update to nodes collecting (issue 49): both sides run ``pairs`` times per condition, quiet and
    busy alternated, against the async workload; the figures and TorchRL's are medians."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.delitem(sys.modules, "limit_updates", raising=False)
    import limit_updates

    busy_now, calls = [False], []
    Busy = _busy_switch(busy_now)

    ours = {False: iter([1.0, 3.0, 2.0]), True: iter([9.0, 4.0, 5.0])}
    theirs = {False: iter([10.0, 30.0, 20.0]), True: iter([40.0, 50.0, 60.0])}

    def weightsync(python, script, workload, quick):
        calls.append((script, workload, busy_now[0]))
        side = theirs if script == "torchrl_side.py" else ours
        return {"update_s": next(side[busy_now[0]]), "repeats": 20}

    monkeypatch.setattr(limit_updates, "_Busy", Busy)
    monkeypatch.setattr(limit_updates, "_weightsync", weightsync)
    monkeypatch.setattr(limit_updates, "_torchrl_python", lambda: "python")
    rows = {row["workload"]: row for row in limit_updates._update_rows(
        True, 3, "weightsync_distributed_collecting_1m", "update_1m_collecting", collecting=True)}
    assert {workload for _, workload, _ in calls} == {"weightsync_distributed_collecting_1m"}
    assert [(script, busy) for script, _, busy in calls] == [
        ("rlharvest_side.py", False), ("torchrl_side.py", False), ("rlharvest_side.py", True), ("torchrl_side.py", True)] * 3
    assert sorted(rows) == ["update_1m_collecting/torchrl012", "update_1m_collecting_busy/quiet",
                            "update_1m_collecting_busy/torchrl012"]
    assert rows["update_1m_collecting/torchrl012"]["ratio"] == 0.1  # 2.0 / 20.0
    assert rows["update_1m_collecting_busy/torchrl012"]["ratio"] == 0.1  # 5.0 / 50.0
    assert rows["update_1m_collecting_busy/quiet"]["ratio"] == 2.5
    assert "goal <= 0.25" in rows["update_1m_collecting/torchrl012"]["note"]


@pytest.mark.timeout(120)
def test_batched_rows_alternate_the_raw_loop_and_the_collector(monkeypatch):
    """A batched row's rlharvest child alternates rounds of the raw loop and of the Collector in one
    process; the row's ratio is the median of each round against the raw round before it."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import limit_batched

    measured = limit_batched.child("rlharvest", "batched_counting_16", rounds=2, seconds=0.2)
    assert len(measured["raw"]) == len(measured["collector"]) == 2
    for run in measured["raw"] + measured["collector"]:
        assert run["frames_per_s"] > 0 and run["cpu_us_per_frame"] > 0 and run["frames"] % 16 == 0

    rounds = {"raw": [{"frames_per_s": 100.0, "cpu_us_per_frame": 1.0}, {"frames_per_s": 200.0, "cpu_us_per_frame": 1.0}],
              "collector": [{"frames_per_s": 90.0, "cpu_us_per_frame": 2.0}, {"frames_per_s": 100.0, "cpu_us_per_frame": 1.25}]}
    monkeypatch.setattr(limit_batched, "_torchrl14_python", lambda: "python")
    monkeypatch.setattr(limit_batched, "_run_child", lambda python, side, row, n, seconds: (
        rounds if side == "rlharvest" else {"collector": [{"frames_per_s": 15.0, "cpu_us_per_frame": 10.0}]}))
    ours, theirs = limit_batched.row_of("batched_counting_16", quick=True)
    assert ours["workload"] == "batched_counting_16/raw" and ours["ratio"] == pytest.approx(0.7)  # median of 0.9, 0.5
    assert ours["cpu_ratio"] == pytest.approx(0.65)  # median of 0.5, 0.8
    assert theirs["workload"] == "batched_counting_16/torchrl14" and theirs["ratio"] == pytest.approx(0.1)


@pytest.mark.timeout(120)
def test_batched_step_times_every_part_of_the_loop(monkeypatch):
    """`benchmarks/batched_step.py` calls the rollout's parts as the loop calls them: it must follow the
    loop (its trajectory ids, its chunk writing) when the loop changes. One row, one repeat."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import batched_step

    parts = batched_step.anatomy("batched_counting_16", 1)
    for part in ("raw loop: whole step", "collector: whole step", "new trajectory ids, per step (collector)",
                 "writing the steps into the batch, per step (collector)"):
        assert parts[part] > 0, part
