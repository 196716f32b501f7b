"""`eplb compare`: the report's numbers equal direct solver calls; the HTML renders in headless Chromium."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from eplb.budget import spread_evenly
from eplb.cli import main
from eplb.io.logs import open_log, write_counts
from eplb.io.windows import read_window
from eplb.replay import Schedule, replay
from eplb.report import ReplayStats, Run, verdict, write_report
from eplb.solve import Cluster, CostSetup, solve
from eplb.specs import HARDWARE_PRESETS, MODEL_PRESETS, link_bandwidth, load_model
from eplb.synth import SynthConfig, synth_log
from solvers import registry
from solvers.greedy import GreedySolver
from solvers.registry import Options, applicable

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "fixtures" / "esft-dsv2lite-law.json"
ARTIFACTS = ROOT / "test-artifacts"


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("report")
    code = main(["compare", "--loads", str(FIXTURE), "--layers", "3", "--solvers", "greedy,milp",
                 "--ep", "4,8", "--time-limit", "1", "--out", str(out)])
    assert code == 0
    return out


def test_report_numbers_match_direct_solver_calls(report: Path) -> None:
    results = json.loads((report / "results.json").read_text())
    loads = read_window(FIXTURE).loads[:3]
    assert [(r["solver"], r["ep"]) for r in results["runs"]] == [("greedy", 4), ("milp", 4), ("greedy", 8), ("milp", 8)]
    for run in results["runs"]:
        slots = spread_evenly(64 + run["ep"], run["ep"])
        assert run["slots_per_gpu"] == slots.tolist()
        options = applicable(run["solver"], Options(time_limit_s=1))
        direct = solve(loads, Cluster(slots), solver=run["solver"], options=options)
        if run["solver"] == "greedy":  # deterministic: identical numbers
            assert run["lb"] == pytest.approx(direct.balance.lb.tolist(), abs=1e-12)
        assert run["baseline_lb"] == pytest.approx(direct.baseline.lb.tolist(), abs=1e-12)
        assert len(run["bound"]) == len(run["solve_ms"]) == len(run["time_us"]) == 3
        assert all(b <= lb + 1e-9 for b, lb in zip(run["bound"], run["lb"], strict=True))
    greedy, milp = results["runs"][2], results["runs"][3]
    assert all(m <= g + 1e-9 for m, g in zip(milp["lb"], greedy["lb"], strict=True))  # MILP never worse


def test_report_files_and_verdict(report: Path) -> None:
    md = (report / "report.md").read_text()
    assert md.startswith("# eplb compare") and "EP8 x 9 slots: milp" in md
    assert "![Per-layer lb" in md and (report / "lb_per_layer.png").stat().st_size > 10_000
    html = (report / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 3 and "<img" in html and "src='lb_per_layer.png'" not in html


def _chromium(page: Path, shot: Path) -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing in CI: .ci/run must install Debian's chromium")
        pytest.skip("chromium is not installed (.ci/run installs Debian's chromium)")
    proc = subprocess.run(
        [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tempfile.mkdtemp()}", "--enable-logging=stderr", "--v=0",
         "--window-size=1200,2400", f"--screenshot={shot}", page.as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    assert shot.exists(), proc.stderr[-2000:]
    return "\n".join(line for line in proc.stderr.splitlines() if ":CONSOLE" in line)


def test_html_opens_in_chromium_without_console_errors(report: Path, tmp_path: Path) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "compare-report.png"
    assert _chromium(report / "report.html", shot) == ""
    assert shot.stat().st_size > 50_000  # a real rendering, kept as the test artefact
    broken = tmp_path / "broken.html"
    broken.write_text("<html><body><script>missingFunction()</script></body></html>")
    assert "missingFunction" in _chromium(broken, tmp_path / "broken.png")  # the check can fail


def test_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "--solvers", "greedy,magic", "--out", str(tmp_path)]) == 2
    assert ("--solvers names 1 unknown solver ('magic'): choose from greedy, deepseek, milp, milp-weighted, "
            "incremental, greedy-coact") in capsys.readouterr().err  # the registry's solvers
    assert main(["compare", "--solvers", "magic,x", "--out", str(tmp_path)]) == 2
    assert "--solvers names 2 unknown solvers ('magic', 'x'): choose from" in capsys.readouterr().err
    assert main(["compare", "--solvers", ",", "--out", str(tmp_path)]) == 2
    assert "--solvers ',' names no solver: choose from" in capsys.readouterr().err
    assert main(["compare", "--solvers", "greedy,,", "--out", str(tmp_path)]) == 2  # ran greedy alone before
    assert "--solvers 'greedy,,' has an empty item: give solver names separated by single commas" in \
        capsys.readouterr().err
    assert main(["compare", "--ep", "4,x", "--out", str(tmp_path)]) == 2
    assert "--ep takes comma-separated whole numbers of GPUs, 1 to 65,536, got '4,x'" in capsys.readouterr().err


REDUNDANT = "--redundant takes comma-separated whole numbers of redundant experts in all, 0 or more, got"
EP = "--ep takes comma-separated whole numbers of GPUs, 1 to 65,536, got"


def _refused_by_compare(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], said: str) -> None:
    """A one-layer greedy `eplb compare` with `argv` exits 2 with an error starting `said`, writing nothing."""
    assert main(["compare", "--solvers", "greedy", "--layers", "1", *argv, "--out", str(tmp_path / "r"),
                 "--no-progress"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err.startswith(f"eplb compare: error: {said}"), err
    assert "Traceback" not in err and not (tmp_path / "r").exists()


@pytest.mark.parametrize(("argv", "said"), [
    (["--redundant", "-1"], f"{REDUNDANT} -1"),
    (["--redundant", "1.5"], f"{REDUNDANT} '1.5'"),
    (["--redundant", "0,,32"], f"{REDUNDANT} '0,,32'"),  # a blank entry was skipped
    (["--redundant", ""], f"{REDUNDANT} ''"),  # no shape at all: a matplotlib traceback
    (["--redundant", ","], f"{REDUNDANT} ','"),
    (["--ep", "32", "--redundant", "0,7937"], "--redundant at EP32: 7937 redundant experts put more than 256 slots "
     "(one per expert) on some of the 32 GPUs: give at most 7936 redundant experts (extra slots would only hold a "
     "second copy on the same GPU)"),  # was 'EP32: 7937 slots on one GPU ...', the slots and no flag
    (["--ep", "32", "--redundant", "9" * 30], f"--redundant at EP32: {'9' * 30} redundant experts put more than 256 "
     "slots"),  # was an OverflowError traceback
    (["--ep", "300", "--redundant", "0"], "--redundant at EP300: 256 experts + 0 redundant leave some of the 300 "
     "GPUs without a slot: give at least 44 redundant experts"),  # was 'EP300: redundant experts ...', no flag
    (["--ep", "0"], f"{EP} 0"),  # was 'EP sizes must be >= 1', no flag
    (["--ep", "16,,32"], f"{EP} '16,,32'"),
    (["--ep", ""], f"{EP} ''"),
    (["--ep", "999999999"], f"{EP} 999999999"),  # was an 8 GB allocation, minutes of nothing
])  # fmt: skip
def test_bad_ep_and_redundant_name_the_flag_and_what_it_takes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    _refused_by_compare(tmp_path, capsys, argv, said)


def test_more_layers_than_the_window_and_an_endless_time_limit_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--layers beyond the window's was taken as all of them without a word (and named 'layers', not the flag,
    for a log); --time-limit inf or nan was taken (a MILP without end), which eplb solve refuses."""
    log = tmp_path / "log.npz"
    write_counts(log, np.ones((30, 2, 16), dtype=np.int64))
    for argv, said in (
        (["--layers", "59"], "--layers 59: the window has 58 layers (give 1 to 58)"),
        (["--log", str(log), "--layers", "3"], "--layers 3: the log has 2 layers (give 1 to 2)"),
        (["--time-limit", "inf"], "--time-limit must be > 0 seconds and finite, got inf"),
        (["--time-limit", "nan"], "--time-limit must be > 0 seconds and finite, got nan"),
    ):
        assert main(["compare", "--solvers", "greedy", *argv, "--out", str(tmp_path / "r"), "--no-progress"]) == 2
        assert capsys.readouterr().err == f"eplb compare: error: {said}\n"
    assert main(["compare", "--solvers", "greedy", "--layers", "58", "--ep", "8", "--out", str(tmp_path / "r"),
                 "--no-progress"]) == 0  # fmt: skip


@pytest.mark.parametrize(("argv", "said"), [
    (["--loads", str(FIXTURE), "--window", "5", "--trigger", "cost"], f"--window, --trigger set how --log replays a "
     f"routing log; --loads {FIXTURE} compares placements on one window: give --log FILE, or drop them"),
    (["--loads", str(FIXTURE), "--interval", "3000"], "--interval sets how --log replays"),  # its default, given
    (["--oracle-every", "3"], "--oracle-every sets how --log replays a routing log; the embedded window (no --log "
     "given) compares placements on one window: give --log FILE, or drop it"),
    (["--first-rebalance", "5", "--delay", "0", "--ewma", "0.5", "--threshold", "1.2", "--robust-windows", "2"],
     "--first-rebalance, --delay, --ewma, --threshold, --robust-windows set how --log replays"),
])  # fmt: skip
def test_log_replay_flags_with_a_window_are_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    """--window, --trigger, ... (the 'log replay' group) with --loads or the embedded window were ignored without a
    word (rc 0), while --objectives with --log is refused: they are refused by name, whatever their value."""
    assert main(["compare", "--solvers", "greedy", "--layers", "1", *argv, "--out", str(tmp_path / "r"),
                 "--no-progress"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err.startswith(f"eplb compare: error: {said}"), err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(("argv", "said"), [
    (["--ep", "4,4"], "--ep lists 4 twice: give each once"),
    (["--ep", "4,8,04"], "--ep lists 4 twice"),
    (["--redundant", "0,4,0"], "--redundant lists 0 twice"),
    (["--solvers", "greedy,greedy"], "--solvers lists greedy twice"),
    (["--solvers", "greedy, milp,greedy"], "--solvers lists greedy twice"),
    (["--objectives", "lb,time,lb"], "--objectives lists lb twice"),  # was deduplicated without a word
])  # fmt: skip
def test_a_sweep_entry_given_twice_is_refused_naming_the_flag_and_value(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    """`--ep 4,4` and `--solvers greedy,greedy` ran the same shape or solver twice, silently."""
    _refused_by_compare(tmp_path, capsys, argv, said)


# ----- --log: the same schedule replayed by every solver ------------------------------------------------------


LOG_SCHEDULE = Schedule(window=10, interval=20)  # rebalances at steps 20 and 40; placements serve from 21


@pytest.fixture(scope="module")
def log_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A 60-step, 3-layer, 16-expert synthetic log with a domain switch at step 30, a small model with
    16 experts (for times and bytes), and the report of greedy and a 0.5 s MILP replaying it at EP4."""
    d = tmp_path_factory.mktemp("log")
    log, model = d / "log.npz", d / "tiny.json"
    cfg = SynthConfig(steps=60, layers=3, experts=16, top_k=2, tokens=256, groups=1, shift_at=(30,), model=None,
                      hot_ratio=4)
    write_counts(log, synth_log(cfg), top_k=2)
    tiny = MODEL_PRESETS["deepseek-v3"].model_copy(update={"num_experts": 16, "top_k": 2, "name": "tiny"})
    model.write_text(json.dumps(tiny.to_dict()))
    out = d / "report"
    code = main(["compare", "--log", str(log), "--model", str(model), "--solvers", "greedy,milp", "--ep", "4",
                 "--window", "10", "--interval", "20", "--trigger", "periodic", "--oracle-every", "3",
                 "--time-limit", "0.5", "--out", str(out)])  # fmt: skip
    assert code == 0
    return out, log, model


def test_log_report_numbers_match_direct_replays(log_report: tuple[Path, Path, Path]) -> None:
    out, log, model_file = log_report
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [(r["solver"], r["ep"], r["slots_per_gpu"]) for r in runs] == [("greedy", 4, [5] * 4), ("milp", 4, [5] * 4)]
    hw = HARDWARE_PRESETS["b200"]
    cost = CostSetup(load_model(str(model_file)), hw, link_bandwidth(hw, "nvlink"), None, True)
    served = slice(21, None)  # positions served by the solver's own placements
    for run in runs:
        direct = replay(log, Cluster(np.full(4, 5)), schedule=LOG_SCHEDULE, solver=run["solver"], cost=cost,
                        time_limit_s=0.5, oracle_every=3, collect=True)  # fmt: skip
        st = direct.steps
        assert st is not None
        rep = run["replay"]
        assert rep["steps"] == 39 and rep["first_step"] == 21 and rep["rebalance_steps"] == [20, 40]
        assert len(run["lb"]) == len(run["bound"]) == len(run["solve_ms"]) == len(run["time_us"]) == 3
        # greedy is deterministic, so the report must equal the direct replay to the last digit; the MILP's
        # migration step stops on wall time under CPU load, so its placements (and moves) may differ run to run
        if run["solver"] == "greedy":
            assert run["moves"] == [rb.moves for rb in direct.rebalances]
            assert rep["bytes_moved"] == [rb.bytes_moved for rb in direct.rebalances]
            assert run["lb"] == pytest.approx(st.lb[served].mean(axis=0), rel=1e-9)
            assert run["time_us"] == pytest.approx(st.time_us[served].mean(axis=0), rel=1e-9)
            assert rep["static_lb"] == pytest.approx(st.static_lb[served].mean(axis=0), rel=1e-9)
            assert rep["lb_all_steps"] == pytest.approx(st.lb.mean(axis=0), rel=1e-9)
            assert rep["step_time_us"] == pytest.approx(st.time_us[served].sum(axis=1).mean(), rel=1e-9)
        assert len(run["moves"]) == len(rep["solve_ms"]) == len(rep["layer_solve_ms"]) == 2
        assert rep["bytes_moved"] == [m * tiny_expert_bytes(model_file) for m in run["moves"]]
        # the baselines do not depend on the solver: no EPLB and the sampled oracle equal the direct replay's
        assert run["baseline_lb"] == pytest.approx(st.no_eplb_lb[served].mean(axis=0), rel=1e-9)
        assert run["baseline_time_us"] == pytest.approx(st.no_eplb_time_us[served].mean(axis=0), rel=1e-9)
        sampled = st.oracle_lb[served]
        sampled = sampled[~np.isnan(sampled[:, 0])]
        assert rep["oracle_steps"] == len(sampled) == 13  # positions 21, 24, ..., 57
        assert rep["oracle_lb"] == pytest.approx(sampled.mean(axis=0), rel=1e-9)
        # the bound is a mean of per-step bounds: below every placement's mean lb, the oracle's included
        assert all(b <= x + 1e-6 for b, x in zip(run["bound"], run["lb"], strict=True))
        assert all(b <= x + 1e-6 for b, x in zip(run["bound"], rep["oracle_lb"], strict=True))
        assert all(b <= x + 1e-6 for b, x in zip(run["bound"], run["baseline_lb"], strict=True))
    greedy, milp = runs
    assert sum(milp["moves"]) <= sum(greedy["moves"])  # the MILP minimizes copies within 1% of its best lb
    assert greedy["status"] == ["heuristic"] * 3 and min(milp["solve_ms"]) > max(greedy["solve_ms"])


def tiny_expert_bytes(model_file: Path) -> float:
    return float(load_model(str(model_file)).expert_bytes)


def test_log_report_shows_moves_and_speaks_of_lb_and_moves(log_report: tuple[Path, Path, Path]) -> None:
    out = log_report[0]
    runs = json.loads((out / "results.json").read_text())["runs"]
    md = (out / "report.md").read_text()
    assert "## Moves per rebalance" in md and "![Moves and solve time per rebalance" in md
    table = md.split("## Moves per rebalance")[1].split("\n## ")[0]
    greedy_moves = runs[0]["moves"]
    assert f"| 20 | {greedy_moves[0]:,} (" in table and f"| 40 | {greedy_moves[1]:,} (" in table
    verdict_lines = [line for line in md.splitlines() if line.startswith("- EP4 x 5 slots")]
    assert len(verdict_lines) == 2
    assert "mean lb greedy" in verdict_lines[0] and "expert copies and solving in" in verdict_lines[0]
    assert "ms per rebalance (medians)" in verdict_lines[0]
    assert f"mean realized lb {np.mean(runs[1]['lb']):.4f} vs {np.mean(runs[0]['lb']):.4f}" in verdict_lines[1]
    assert f"{sum(runs[1]['moves']):,} vs {sum(greedy_moves):,} expert copies" in verdict_lines[1]
    assert (out / "moves_per_rebalance.png").stat().st_size > 10_000
    assert (out / "report.html").read_text().count("data:image/png;base64,") == 4


def test_log_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], log_report: tuple[Path, Path, Path]) -> None:
    log = str(log_report[1])
    assert main(["compare", "--log", log, "--interval", "100", "--out", str(tmp_path)]) == 2
    assert "the log has 60 steps but the first rebalanced placement serves from step position 101" in (
        capsys.readouterr().err)
    with pytest.raises(SystemExit):
        main(["compare", "--log", log, "--loads", str(FIXTURE), "--out", str(tmp_path)])
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize(("steps", "argv", "said"), [
    (1, ["--interval", "1", "--delay", "0"], "the log has 1 step but the first rebalanced placement serves from step "
     "position 1 (--interval 1, --delay 0): a rebalance needs a step before it and a step its placement serves, so "
     "no schedule fits 1 step: give a log of more than 1 step"),  # was 'the log has 1 steps ...: lower --interval'
    (1, [], "the log has 1 step but the first rebalanced placement serves from step position 3,001 (--interval "
     "3,000, --delay 1): a rebalance needs a step before it and a step its placement serves, so no schedule fits 1 "
     "step: give a log of more than 3,001 steps (or of 2 steps or more with --first-rebalance 1 --delay 0)"),
    (5, ["--first-rebalance", "4"], "the log has 5 steps but the first rebalanced placement serves from step "
     "position 5 (--first-rebalance 4, --delay 1): give --first-rebalance 3 or less, or a log of more than 5 steps"),
    (5, ["--interval", "4", "--delay", "3"], "(--interval 4, --delay 3): give --first-rebalance 1, or a log of more "
     "than 7 steps"),
    (2, ["--interval", "4", "--delay", "3"], "(--interval 4, --delay 3): give --delay 0 with --first-rebalance 1, or "
     "a log of more than 7 steps"),
])  # fmt: skip
def test_a_log_too_short_for_the_schedule_gets_advice_that_helps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], steps: int, argv: list[str], said: str
) -> None:
    """A 1-step log was told to 'lower --interval' at --interval 1: no schedule fits one step. The advice is a
    change that makes the first placement serve a step of the log (and it works), or a longer log."""
    log = tmp_path / "log.npz"
    write_counts(log, np.ones((steps, 2, 16), dtype=np.int64))
    base = ["compare", "--log", str(log), "--solvers", "greedy", "--ep", "4", "--out", str(tmp_path / "r"),
            "--no-progress"]  # fmt: skip
    assert main([*base, *argv]) == 2
    err = capsys.readouterr().err
    assert said in err and "lower --interval" not in err, err
    fix = re.search(r"give (--\S+ \d+)(?: or less)?(?: with (--first-rebalance 1))?, or a log", err)
    if fix is not None:  # the advice, taken, replays
        advised = [a for part in fix.groups() if part for a in part.split()]
        assert main([*base, *argv, *advised]) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        assert "replaying 1 step from" in out and "1 steps" not in out and "1 rebalances" not in out, out


def _compare_log(log: Path, model: Path, out: Path, solvers: str, *extra: str) -> int:
    """`eplb compare --log` of an edited copy of the module's log at EP4, LOG_SCHEDULE's periodic checks."""
    return main(["compare", "--log", str(log), "--model", str(model), "--solvers", solvers, "--ep", "4", "--window",
                 "10", "--interval", "20", "--trigger", "periodic", *extra, "--out", str(out)])


def test_log_report_leaves_out_steps_without_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], log_report: tuple[Path, Path, Path]
) -> None:
    """Steps 45-49 of the log without tokens: they have no lb, so the report's per-layer lb is the mean over the
    other served steps (it used to stop on an assertion); a log whose served steps are all empty is one error."""
    _, log, model = log_report
    counts = open_log(log).read_counts().counts.copy()
    counts[45:50] = 0
    holes = tmp_path / "holes.npz"
    write_counts(holes, counts, top_k=2)
    out = tmp_path / "report"
    assert _compare_log(holes, model, out, "greedy", "--oracle-every", "3") == 0
    run = json.loads((out / "results.json").read_text())["runs"][0]
    hw = HARDWARE_PRESETS["b200"]
    cost = CostSetup(load_model(str(model)), hw, link_bandwidth(hw, "nvlink"), None, True)
    direct = replay(open_log(holes), Cluster(np.full(4, 5)), schedule=LOG_SCHEDULE, solver="greedy", cost=cost,
                    oracle_every=3, collect=True)  # fmt: skip
    st = direct.steps
    assert st is not None and np.isnan(st.lb[45:50]).all()
    assert run["lb"] == pytest.approx(np.nanmean(st.lb[21:], axis=0), rel=1e-9)
    assert run["replay"]["lb_all_steps"] == pytest.approx(np.nanmean(st.lb, axis=0), rel=1e-9)
    counts[21:] = 0
    write_counts(holes, counts, top_k=2)
    capsys.readouterr()
    assert _compare_log(holes, model, tmp_path / "empty", "greedy") == 2
    assert "no layer has tokens in any step after the first rebalance" in capsys.readouterr().err


def test_a_log_layer_that_never_has_tokens_is_null_in_the_log_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], log_report: tuple[Path, Path, Path]
) -> None:
    """A layer all zero in every step (a dense layer a recorder dumped, as `eplb replay` takes it) has no realized
    lb: results.json says null for its lb, bound, baseline, static and oracle lb, as a window report does, and the
    means and the verdict are over the other layers. It was refused ('some layer has no tokens ...: use a longer
    log or an earlier --first-rebalance', advice that cannot help)."""
    _, log, model = log_report
    counts = open_log(log).read_counts().counts.copy()
    counts[:, 1] = 0
    dead = tmp_path / "dead.npz"
    write_counts(dead, counts, top_k=2)
    out = tmp_path / "report"
    assert _compare_log(dead, model, out, "greedy,deepseek", "--oracle-every", "3") == 0
    printed = capsys.readouterr().out
    runs = json.loads((out / "results.json").read_text())["runs"]
    hw = HARDWARE_PRESETS["b200"]
    cost = CostSetup(load_model(str(model)), hw, link_bandwidth(hw, "nvlink"), None, True)
    direct = replay(open_log(dead), Cluster(np.full(4, 5)), schedule=LOG_SCHEDULE, solver="greedy", cost=cost,
                    oracle_every=3, collect=True)  # fmt: skip
    st = direct.steps
    assert st is not None
    for run in runs:
        rs = run["replay"]
        assert run["lb"][1] is None and run["bound"][1] is None and run["baseline_lb"][1] is None
        assert rs["static_lb"][1] is None and rs["oracle_lb"][1] is None and rs["lb_all_steps"][1] is None
        assert None not in run["lb"][::2] and None not in rs["oracle_lb"][::2]
    assert runs[0]["lb"][::2] == pytest.approx(np.nanmean(st.lb[21:, ::2], axis=0), rel=1e-9)  # layer 1: no tokens
    assert "deepseek against greedy" in printed and "of 2 layers with tokens" in printed, printed
    assert "| EP4 x 5 slots | greedy |" in (out / "report.md").read_text()


def test_a_window_flag_with_a_log_names_the_flag_given(
    capsys: pytest.CaptureFixture[str], log_report: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """`--objectives time` alone with --log was refused as '--objectives and --coactivation compare ...'."""
    _, log, _ = log_report
    base = ["compare", "--log", str(log), "--ep", "4", "--out", str(tmp_path / "r")]
    assert main([*base, "--objectives", "time"]) == 2
    assert "error: --objectives compares placements on one window: give --loads, not --log" in capsys.readouterr().err
    assert main([*base, "--coactivation", str(log)]) == 2
    assert "error: --coactivation compares placements on one window" in capsys.readouterr().err
    assert main([*base, "--coactivation", str(log), "--objectives", "lb,time"]) == 2
    assert "error: --objectives and --coactivation compare placements on one window" in capsys.readouterr().err


def test_log_default_trigger_is_replays(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], log_report: tuple[Path, Path, Path]
) -> None:
    """compare --log takes eplb replay's default trigger: cost with a model, periodic without one (it used to
    be periodic always, while its help said cost). Each rebalance's per-layer solve times add up to at least
    its solve time, the cost trigger's other candidates included."""
    _, log, model = log_report
    common = ["--window", "10", "--interval", "20", "--oracle-every", "0"]
    for extra, trigger in (["--model", str(model)], "cost"), ([], "periodic"):
        out = tmp_path / trigger
        assert main(["compare", "--log", str(log), "--solvers", "greedy", "--ep", "4", *common, *extra,
                     "--out", str(out)]) == 0  # fmt: skip
        run = json.loads((out / "results.json").read_text())["runs"][0]
        capsys.readouterr()
        assert main(["replay", str(log), "--solver", "greedy", "--gpus", "4", "--slots-per-gpu", "5", *common,
                     *extra, "--json"]) == 0  # fmt: skip
        replayed = json.loads(capsys.readouterr().out)
        assert run["replay"]["schedule"]["trigger"] == replayed["schedule"]["trigger"] == trigger
        assert run["replay"]["rebalance_steps"] == [r["position"] for r in replayed["rebalances"]["list"]]
        for total, layers in zip(run["replay"]["solve_ms"], run["replay"]["layer_solve_ms"], strict=True):
            assert sum(layers) >= total - 0.01
    assert main(["compare", "--log", str(log), "--trigger", "cost", "--out", str(tmp_path / "x")]) == 2
    assert "--trigger cost needs a model" in capsys.readouterr().err


def test_schedule_from_owns_the_default_trigger() -> None:
    """compare and replay each wrote `"cost" if a model else "periodic"` (and the refusal of --trigger cost
    without one); `schedule_from(args, cost)` is the one place, which both call."""
    import argparse

    from eplb.cli.replay import add_schedule_options, schedule_from
    from eplb.errors import EplbError

    parser = argparse.ArgumentParser()
    add_schedule_options(parser)
    hw = HARDWARE_PRESETS["b200"]
    cost = CostSetup(MODEL_PRESETS["deepseek-v3"], hw, hw.nvlink_bandwidth)
    assert schedule_from(parser.parse_args([]), cost).trigger == "cost"
    assert schedule_from(parser.parse_args([]), None).trigger == "periodic"
    assert schedule_from(parser.parse_args(["--trigger", "threshold"]), cost).trigger == "threshold"
    with pytest.raises(EplbError, match=r"^--trigger cost needs a model to predict times"):
        schedule_from(parser.parse_args(["--trigger", "cost"]), None)
    with pytest.raises(EplbError, match=r"this run's trigger is periodic \(the default\)"):
        schedule_from(parser.parse_args(["--threshold", "1.2"]), None)


def test_log_run_without_a_rebalance_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], log_report: tuple[Path, Path, Path]
) -> None:
    """Every check keeps the serving placement (with a model, a window without tokens moves nothing; the cost
    trigger, now the default with a model, may keep it too): the run says so instead of failing on no rebalances."""
    _, log, model = log_report
    counts = open_log(log).read_counts().counts.copy()
    counts[10:20] = counts[30:40] = 0  # the windows of the checks at 20 and 40
    quiet = tmp_path / "quiet.npz"
    write_counts(quiet, counts, top_k=2)
    out = tmp_path / "r"
    assert main(["compare", "--log", str(quiet), "--model", str(model), "--solvers", "greedy", "--ep", "4",
                 "--window", "10", "--interval", "20", "--oracle-every", "0", "--out", str(out)]) == 0  # fmt: skip
    run = json.loads((out / "results.json").read_text())["runs"][0]
    assert run["moves"] == [] and run["replay"]["rebalance_steps"] == [] and run["status"] == ["no_rebalance"] * 3
    assert run["solve_ms"] == [0.0] * 3 and run["replay"]["schedule"]["trigger"] == "cost"
    assert "greedy" in capsys.readouterr().out
    setup = (out / "report.md").read_text()  # it said the steps were 'the first served by a rebalanced placement'
    assert "- steps averaged: 39, from step 21 (the first a rebalanced placement could serve) on\n" in setup
    assert "a check every 20 steps from step position 20," in setup  # the schedule's position, not a step id


def test_first_rebalance_solve_time_has_no_start_up_cost(tmp_path: Path, log_report: tuple[Path, Path, Path]) -> None:
    """In a fresh process the first rebalance used to carry one-time imports (scipy's assignment, ~0.3 s, for
    relabelling to the serving placement): the report's solve time per rebalance excludes that start-up."""
    out = tmp_path / "r"
    subprocess.run([sys.executable, "-m", "eplb.cli", "compare", "--log", str(log_report[1]), "--solvers", "greedy",
                    "--ep", "4", "--window", "10", "--interval", "10", "--oracle-every", "0", "--out", str(out)],
                   check=True, capture_output=True)  # fmt: skip
    solve_ms = json.loads((out / "results.json").read_text())["runs"][0]["replay"]["solve_ms"]
    assert len(solve_ms) == 5 and solve_ms[0] < 100, solve_ms  # each rebalance solves 3 x 16 in a few ms


def test_verdict_compares_whatever_ran(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without a plain greedy run the verdict compared nothing ("Only one solver ran"); it compares every solver
    with the first of the same objective, and time runs on predicted time."""
    out = tmp_path / "milps"
    assert main(["compare", "--loads", str(FIXTURE), "--solvers", "milp,milp-weighted", "--layers", "1",
                 "--time-limit", "0.3", "--ep", "8", "--out", str(out)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "nothing to compare" not in printed
    assert any(f"EP8 x 9 slots: milp-weighted {how} milp" in printed for how in ("beat", "did not beat", "matched"))
    assert "nothing to compare" not in (out / "report.md").read_text()
    out = tmp_path / "time"
    assert main(["compare", "--loads", str(FIXTURE), "--solvers", "greedy,milp", "--objectives", "time",
                 "--layers", "2", "--time-limit", "0.3", "--ep", "8", "--out", str(out)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "nothing to compare" not in printed
    assert "EP8 x 9 slots: milp+time predicted faster than greedy+time on" in printed and "ms per step" in printed
    out = tmp_path / "one"
    assert main(["compare", "--loads", str(FIXTURE), "--solvers", "greedy", "--layers", "1", "--out", str(out)]) == 0
    assert "Only one solver ran: nothing to compare." in capsys.readouterr().out


def test_time_objective_solve_time_is_the_whole_solve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A SOLVER+time run's solve time covers the time objective's candidates and predictions, not only the base
    solver's own time (greedy+time showed greedy's 0.01 ms per layer); here the pick is slowed by 0.2 s."""
    import eplb.solve
    from eplb.objective import choose_by_time as pick  # what eplb.solve calls (the name it imports is patched)

    def slow_pick(*args: object, **kwargs: object) -> object:
        time.sleep(0.2)
        return pick(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(eplb.solve, "choose_by_time", slow_pick)
    out = tmp_path / "r"
    topk = ROOT / "fixtures" / "esft-dsv2lite-law-topk.npz"
    assert main(["compare", "--loads", str(topk), "--coactivation", str(topk), "--solvers", "greedy", "--objectives",
                 "lb,time", "--layers", "2", "--ep", "8", "--hardware", "h800", "--link", "nic",
                 "--tokens-per-gpu", "256", "--out", str(out)]) == 0  # fmt: skip
    runs = {r["solver"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    assert sum(runs["greedy+time"]["solve_ms"]) >= 200 > sum(runs["greedy"]["solve_ms"])
    said = re.search(r"greedy\+time predicted faster than greedy .*; solve ([\d,.]+) vs", capsys.readouterr().out)
    assert said is not None and float(said[1].replace(",", "")) >= 100  # the verdict's median per layer


# ----- plots of data a log axis cannot show ------------------------------------------------------------------


def _zero_time_run(solver: str, solve_ms: list[float], rebalance_ms: list[float] | None = None) -> Run:
    """A 2-layer run whose solve times are `solve_ms` (0: rounded away, as a fast greedy layer's are), replayed
    with rebalances taking `rebalance_ms` when given."""
    run = Run(solver=solver, ep=4, slots_per_gpu=[5] * 4, lb=[1.0, 1.1], bound=[1.0, 1.0], solve_ms=solve_ms,
              status=["optimal"] * 2, gap=[0.0, 0.0], baseline_lb=[1.5, 1.6])  # fmt: skip
    if rebalance_ms is not None:
        run.moves = [0] * len(rebalance_ms)
        run.replay = ReplayStats(
            steps=10, first_step=1, rebalance_steps=list(range(5, 5 + 5 * len(rebalance_ms), 5)),
            solve_ms=rebalance_ms, layer_solve_ms=[solve_ms] * len(rebalance_ms), bytes_moved=None,
            window_lb=[1.0] * len(rebalance_ms), lb_all_steps=[1.0, 1.1], static_lb=[1.0, 1.1], oracle_lb=None,
            oracle_steps=0)  # fmt: skip
    return run


@pytest.mark.parametrize("rebalance_ms", [None, [0.0, 0.0]])
def test_a_report_whose_solve_times_are_all_zero_plots_without_warnings(
    tmp_path: Path, rebalance_ms: list[float] | None
) -> None:
    """The solve-time plots (per layer, per rebalance) had a log y axis whatever the data: with every time 0
    matplotlib warned 'Data has no positive values, and therefore cannot be log-scaled' and drew an empty axis.
    Warnings are errors here whatever pytest's flags (-p no:warnings included)."""
    runs = [_zero_time_run(s, [0.0, 0.0], rebalance_ms) for s in ("greedy", "milp")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        write_report(runs, tmp_path, {"title": "zero solve times"})
    pngs = {"lb_per_layer.png", "spread_and_time.png"} | ({"moves_per_rebalance.png"} if rebalance_ms else set())
    assert pngs <= {p.name for p in tmp_path.iterdir()}
    assert all((tmp_path / p).stat().st_size > 10_000 for p in pngs)


def test_the_solve_time_axis_is_log_when_some_time_is_positive() -> None:
    """The guard above can fail both ways: positive times (zeros among them) keep the log axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from eplb.report import _log_y

    fig, (some, none) = plt.subplots(1, 2)
    assert _log_y(some, [0.0, 0.4, 12.0]) == ", log scale" and some.get_yscale() == "log"
    assert _log_y(none, [0.0, 0.0]) == "" and none.get_yscale() == "linear"
    plt.close(fig)


def test_a_layer_without_tokens_counts_in_no_mean_of_a_window_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A layer of all-zero loads has no lb: results.json says null for it (lb, bound, baseline_lb, as the API's
    lists do), and the summary's means, the bound and the verdict are over the layers with tokens (its 1.0
    counted in the lb mean and the lower bound's). A window without any token is refused before any solve."""
    window = tmp_path / "w.json"
    window.write_text(json.dumps({"loads": [[90, 5, 3, 2, 0, 0, 0, 0], [0] * 8]}))
    out = tmp_path / "r"
    assert main(["compare", "--loads", str(window), "--solvers", "greedy,milp", "--ep", "2", "--redundant", "0",
                 "--time-limit", "0.5", "--out", str(out)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    runs = json.loads((out / "results.json").read_text())["runs"]
    for run in runs:
        assert run["lb"][1] is None and run["bound"][1] is None and run["baseline_lb"][1] is None
        assert run["lb"][0] == pytest.approx(1.8) and run["bound"][0] == pytest.approx(1.8)  # 90 of a mean of 50
    md = (out / "report.md").read_text()
    assert "| EP2 x 4 slots | greedy | 1.8000 | 1.8000 | 1.8000 | 0.0000 | 2.000 |" in md, md
    assert "milp matched greedy on every layer (1 layer with tokens; lb max 1.8000 vs 1.8000)" in printed
    (tmp_path / "z.json").write_text(json.dumps({"loads": [[0] * 8] * 2}))
    assert main(["compare", "--loads", str(tmp_path / "z.json"), "--ep", "2", "--out", str(tmp_path / "z")]) == 2
    assert "the load window has no tokens (every load is 0): no layer has an lb to compare" in capsys.readouterr().err
    assert not (tmp_path / "z").exists()


class _GreedyByAnotherName(GreedySolver):
    """A solver registered at run time (`test_every_registered_solver_is_a_choice_and_what_one_needs_is_said`)."""

    name = "greedy-registered-late"


def test_every_registered_solver_is_a_choice_and_what_one_needs_is_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--solvers took greedy, milp and milp-weighted only (a list of its own), refusing deepseek, incremental,
    greedy-coact and a solver registered at run time as 'unknown solver': the choices are the registry's. A solver
    the comparison cannot give what it needs is refused before any solve, saying why: incremental on one window
    (no serving placement; a log's replay gives it one), greedy-coact without co-activation data or on a counts
    log, deepseek on uneven slots."""
    late = _GreedyByAnotherName.name
    registry.register(late, f"{__name__}:_GreedyByAnotherName")
    try:
        out = tmp_path / "w"
        assert main(["compare", "--loads", str(FIXTURE), "--solvers", f"greedy,deepseek,{late}", "--layers", "2",
                     "--ep", "8", "--out", str(out), "--no-progress"]) == 0  # fmt: skip
        runs = json.loads((out / "results.json").read_text())["runs"]
        assert [r["solver"] for r in runs] == ["greedy", "deepseek", late]
        assert runs[2]["lb"] == runs[0]["lb"]
        assert f"EP8 x 9 slots: {late}" in capsys.readouterr().out
    finally:
        registry._TABLE.pop(late)
        registry._LOADED.pop(late, None)
    topk = str(ROOT / "fixtures" / "esft-dsv2lite-law-topk.npz")
    out = tmp_path / "coact"
    assert main(["compare", "--loads", topk, "--coactivation", topk, "--solvers", "greedy,greedy-coact", "--layers",
                 "2", "--ep", "8", "--out", str(out), "--no-progress"]) == 0  # fmt: skip
    assert [r["solver"] for r in json.loads((out / "results.json").read_text())["runs"]] == ["greedy", "greedy-coact"]
    out = tmp_path / "log"
    assert main(["compare", "--log", topk, "--solvers", "greedy,incremental,greedy-coact", "--ep", "8", "--window",
                 "8", "--interval", "8", "--trigger", "periodic", "--oracle-every", "0", "--out", str(out),
                 "--no-progress"]) == 0  # fmt: skip
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [r["solver"] for r in runs] == ["greedy", "incremental", "greedy-coact"]
    capsys.readouterr()
    counts = tmp_path / "counts.npz"
    write_counts(counts, synth_log(SynthConfig(steps=30, layers=2, experts=16, top_k=2, tokens=64, hot_ratio=4)),
                 top_k=2)  # fmt: skip
    for argv, said in (
        (["--solvers", "greedy,incremental"], "solver 'incremental' edits the placement being served, and a window "
         "comparison has none: compare it replaying a routing log (eplb compare --log FILE)"),
        (["--solvers", "greedy,greedy-coact"], "solver 'greedy-coact' co-locates experts chosen together and needs the "
         "window's co-activation data: give --coactivation FILE"),
        (["--solvers", "greedy,deepseek", "--ep", "4", "--redundant", "10"], "EP4 (4 GPUs, 66-67 slots each): solver "
         "'deepseek' needs the same slot count on every GPU"),
        (["--log", str(counts), "--solvers", "greedy,greedy-coact", "--ep", "4"], f"{counts}: greedy-coact needs the "
         "log's tokens (a token-level log with at most 50,000,000 picks)"),
    ):  # fmt: skip
        assert main(["compare", *argv, "--out", str(tmp_path / "r"), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"eplb compare: error: {said}"), err
        assert not (tmp_path / "r").exists()


def test_the_verdict_counts_layers_whose_lb_prints_the_same_as_matched() -> None:
    """The verdict said 'milp-weighted beat greedy on 8 of 8 layers: worst-layer lb 1.0002 vs 1.0002 (0.00% lower)':
    a layer counted as beaten on any difference, even one the tables' 4 decimals do not show. A layer whose lb prints
    the same is matched, counted apart, and a worst layer that prints the same is 'the same'."""

    def run(name: str, lb: list[float]) -> Run:
        return Run(solver=name, ep=8, slots_per_gpu=[9] * 8, lb=list(lb), bound=[1.0] * len(lb),
                   solve_ms=[1.0] * len(lb), status=["heuristic"] * len(lb), gap=[0.0] * len(lb),
                   baseline_lb=[2.0] * len(lb))  # fmt: skip

    greedy = [1.00021, 1.00013, 1.00030]
    (line,) = verdict([run("greedy", greedy), run("milp-weighted", [1.00019, 1.00012, 1.00010])])
    assert line.startswith("EP8 x 9 slots: milp-weighted beat greedy on 1 of 3 layers (matched on 2): worst-layer lb "
                           "1.0002 vs 1.0003 (0.01% lower)"), line
    (line,) = verdict([run("greedy", greedy), run("milp-weighted", [v - 2e-6 for v in greedy])])
    assert line.startswith("EP8 x 9 slots: milp-weighted matched greedy on every layer (3 layers; lb max 1.0003 vs "
                           "1.0003)"), line
    (line,) = verdict([run("greedy", greedy), run("milp-weighted", [1.00010, 1.00013, 1.00029])])
    assert line.startswith("EP8 x 9 slots: milp-weighted beat greedy on 1 of 3 layers (matched on 2): worst-layer lb "
                           "1.0003 vs 1.0003 (the same)"), line
    (line,) = verdict([run("greedy", greedy), run("milp-weighted", [1.00021, 1.00020, 1.00030])])
    assert line.startswith("EP8 x 9 slots: milp-weighted did not beat greedy on any layer (3 layers, worse on 1; lb "
                           "max 1.0003 vs 1.0003)"), line


def test_a_token_level_log_cut_by_layers_replays_as_the_log_of_those_layers(tmp_path: Path) -> None:
    """--layers N on a token-level log: the replay's tokens are the first N layers' (it read every layer's
    tokens from the file, a shape the N-layer placements did not fit, and stopped)."""
    from eplb.io.logs import write_topk
    from eplb.synth import synth_topk

    cfg = SynthConfig(steps=40, layers=3, experts=16, top_k=2, tokens=64, groups=1, model=None, hot_ratio=4)
    ids, offsets = synth_topk(cfg)
    full, cut = tmp_path / "full.npz", tmp_path / "cut.npz"
    write_topk(full, ids, offsets, num_experts=16)
    write_topk(cut, ids[:, :2], offsets, num_experts=16)
    tiny = MODEL_PRESETS["deepseek-v3"].model_copy(update={"num_experts": 16, "top_k": 2, "name": "tiny"})
    model = tmp_path / "tiny.json"
    model.write_text(json.dumps(tiny.to_dict()))
    runs = []
    for log, extra in ((full, ["--layers", "2"]), (cut, [])):
        out = tmp_path / log.stem
        assert main(["compare", "--log", str(log), "--model", str(model), "--solvers", "greedy", "--ep", "4",
                     "--window", "10", "--interval", "10", "--trigger", "periodic", "--no-progress", "--out", str(out),
                     *extra]) == 0
        runs.append(json.loads((out / "results.json").read_text())["runs"][0])
    assert len(runs[0]["lb"]) == 2 and runs[0]["lb"] == runs[1]["lb"] and runs[0]["time_us"] == runs[1]["time_us"]
    assert runs[0]["moves"] == runs[1]["moves"] and len(runs[0]["moves"]) == 2  # time_us: the reach of its tokens
