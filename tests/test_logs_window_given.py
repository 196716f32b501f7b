"""A load window given where a routing log is expected is named as one, with the command that takes it, in every
file type a window comes in (it was said for an .npz 'counts' of two axes only)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from eplb.cli import main

HINT = "a [layers, experts] window: use it with eplb solve --loads"


def test_a_window_npy_is_named_as_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "w.npy"
    np.save(path, np.ones((3, 8), dtype=np.int64))
    assert main(["replay", str(path), "--gpus", "2"]) == 2
    err = capsys.readouterr().err
    assert f"w.npy: counts must be [steps, layers, experts], got shape [3, 8] ({HINT})" in err, err
    assert main(["logs", "convert", str(path), str(tmp_path / "x.npz")]) == 2
    assert HINT in capsys.readouterr().err


def test_an_npz_holding_loads_is_named_a_window(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`eplb solve --loads` reads an .npz array 'loads' ([layers, E]); as a log it is that window."""
    path = tmp_path / "w.npz"
    np.savez(path, loads=np.ones((3, 8), dtype=np.int64))
    assert main(["replay", str(path), "--gpus", "2"]) == 2
    err = capsys.readouterr().err
    assert ("w.npz: expected 'counts' ([steps, layers, E]) or 'topk_ids' ([tokens, layers, k]), found ['loads'] "
            "(a 'loads' array is a load window: use it with eplb solve --loads)") in err, err


def test_a_counts_npy_still_replays(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.npy"
    np.save(path, np.ones((4, 3, 8), dtype=np.int64))
    assert main(["replay", str(path), "--gpus", "2", "--window", "2", "--interval", "2"]) == 0
    assert "replayed 4 steps x 3 layers" in capsys.readouterr().out
