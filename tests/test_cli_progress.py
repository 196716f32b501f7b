"""The progress lines of long `eplb solve` and `eplb synth` runs (eplb.progress: on stderr, when it is a terminal,
or with --progress)."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import numpy as np
import pytest

from eplb.cli import main
from eplb.cli.solve import Ticker


def test_a_solve_counts_its_seconds_with_progress(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`eplb solve --gpus 65536 --slots-per-gpu 1` ran 36 s without a sign on a terminal (one compiled call, no
    units to count): the ticker line names the solver and the problem, ends with its own line, and --no-progress
    (as a pipe by default) draws nothing."""
    window = tmp_path / "w.json"
    window.write_text(json.dumps({"loads": (np.arange(32).reshape(2, 16) + 1).tolist()}))
    base = ["solve", "--loads", str(window), "--gpus", "4", "--json"]
    assert main([*base, "--progress"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("\rsolve ") and err.endswith(" s elapsed (greedy, 2 layers x 16 experts on 4 GPUs)\n"), err
    for quiet in ([], ["--no-progress"]):
        assert main([*base, *quiet]) == 0
        assert capsys.readouterr().err == ""
    assert main([*base, "--progress", "--slots-per-gpu", "2"]) == 2  # 8 slots for 16 experts: refused, no line
    assert capsys.readouterr().err.startswith("eplb solve: error: ")


def test_the_ticker_draws_only_work_that_outlasts_its_delay() -> None:
    """A quick solve draws nothing on a terminal; one past `after` seconds is redrawn until it ends."""
    for work, drawn in ((0.0, False), (0.3, True)):
        stream = io.StringIO()
        with Ticker("solve", enabled=True, after=0.1, every=0.02, stream=stream) as ticker:
            ticker.start("greedy")
            time.sleep(work)
        text = stream.getvalue()
        assert (text != "") == drawn, text
        if drawn:
            assert text.count("\r") >= 3 and text.endswith(" s elapsed (greedy)\n"), text
    stream = io.StringIO()
    with Ticker("solve", enabled=False, after=0.0, stream=stream) as ticker:
        ticker.start()
        time.sleep(0.05)
    assert stream.getvalue() == ""


@pytest.mark.parametrize("argv", [
    ["--steps", "600", "--layers", "2", "--experts", "16", "--top-k", "2", "--tokens", "64", "--hot-ratio", "4"],
    ["--steps", "2", "--preset", "seed004"],
])  # fmt: skip
def test_synth_shows_a_progress_bar_over_its_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    """`eplb synth --steps 8000 --shift-at 5000` drew for 21 s without a sign; it now counts its steps as replay
    does (the seed004 preset too)."""
    steps = int(argv[1])
    assert main(["synth", "--out", str(tmp_path / "log.npz"), "--progress", *argv]) == 0
    err = capsys.readouterr().err
    assert err.startswith("\rsynth [") and f" {steps:,}/{steps:,} steps 100% " in err and err.endswith("\n"), err
    assert main(["synth", "--out", str(tmp_path / "log2.npz"), *argv]) == 0
    assert capsys.readouterr().err == ""
