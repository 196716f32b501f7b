"""eplb.report on routing logs and its files: what a Run's replay fields hold, and what writing a report
that cannot be written says."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from eplb.errors import EplbError
from eplb.io.logs import as_log
from eplb.replay import Schedule, replay
from eplb.report import Run, compare_log, compare_window, write_report
from eplb.solve import Cluster


def _log_with_idle_windows() -> np.ndarray:
    """Counts [90, 4, 32]: layers 0-1 idle in the first check's window (steps 0-29), no token at all in the
    second's (30-59), every layer busy after."""
    rng = np.random.default_rng(1)
    log = rng.poisson(rng.gamma(0.5, 40.0, size=(1, 4, 32)), size=(90, 4, 32)).astype(np.int64)
    log[:30, :2] = 0
    log[30:60] = 0
    return log


def test_a_log_runs_window_lb_leaves_out_layers_without_tokens(tmp_path: Path) -> None:
    """ReplayStats.window_lb: per rebalance, the mean over the window's layers with tokens of the solver's lb
    (`Rebalance.window_lb_mean`, the replay's rule), null in results.json for a window without any token; the
    placeholder lb 1.0 of an idle layer used to pull the mean down."""
    log = _log_with_idle_windows()
    cluster, sched = Cluster(np.full(8, 5)), Schedule(window=30, interval=30)
    run = compare_log(as_log(log), [(8, cluster.slots_per_gpu)], ["greedy"], None, schedule=sched, oracle_every=0,
                      progress=False)[0]  # fmt: skip
    direct = replay(log, cluster, schedule=sched, solver="greedy", oracle_every=0, hindsight=False)
    first = direct.rebalances[0]
    assert (first.window_lb[2:] > 1.0).all()  # the busy layers' lb, above the idle layers' old placeholder 1.0
    assert run.replay is not None
    assert run.replay.window_lb[:2] == [pytest.approx(float(first.window_lb[2:].mean()), rel=1e-12), None]
    write_report([run], tmp_path / "report", {"title": "idle windows"})
    written = json.loads((tmp_path / "report" / "results.json").read_text())["runs"][0]["replay"]["window_lb"]
    assert written[:2] == [run.replay.window_lb[0], None]


@pytest.mark.parametrize("name", ["results.json", "report.md", "report.html", "lb_per_layer.png"])
def test_a_report_that_cannot_be_written_is_one_error(tmp_path: Path, name: str) -> None:
    """A full disk (the file a link to /dev/full) while `eplb compare --out` writes its report: EplbError naming the
    directory, for the JSON, the pages and the plots alike (the CLI prints it as one line)."""
    rng = np.random.default_rng(2)
    runs = compare_window(rng.poisson(20.0, size=(2, 32)).astype(np.float64), [(8, np.full(8, 5))], ["greedy"],
                          None, progress=False)  # fmt: skip
    out = tmp_path / "report"
    out.mkdir()
    (out / name).symlink_to("/dev/full")
    with pytest.raises(EplbError) as err:
        write_report(runs, out, {"title": "full disk"}, "--out")
    assert str(err.value) == f"--out {out}: cannot write the report there (No space left on device)"


def test_the_time_table_says_slower_for_a_run_slower_than_no_eplb(tmp_path: Path) -> None:
    """The 'vs no EPLB' cell of the predicted-time table was f'{speed:.2f}x faster' even below 1 ('0.95x faster'
    for a run 5% slower than no EPLB): it says 'slower' then, by how much, and 'as fast' for one that rounds to 1."""

    def run(ep: int, time_us: float) -> Run:
        return Run("greedy", ep, [5] * ep, [1.1], [1.0], [1.0], ["optimal"], [0.0], [1.5], time_us=[time_us],
                   baseline_time_us=[1000.0], bottleneck=["compute"])  # fmt: skip

    write_report([run(8, 500.0), run(16, 1000.0 / 0.95), run(32, 1000.4)], tmp_path / "r", {"title": "speed"})
    rows = [line for line in (tmp_path / "r" / "report.md").read_text().splitlines() if "compute 1" in line]
    cells = [[cell.strip() for cell in row.split("|")][4] for row in rows]
    assert cells == ["2.00x faster", "1.05x slower", "as fast"]
