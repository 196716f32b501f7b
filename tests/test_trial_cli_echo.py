"""Refusals that did not echo the value given: `eplb synth --gpus 0`, `eplb compare --layers 0`,
`eplb solve --max-lb-slack -1`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli_run import run_eplb as run


@pytest.mark.parametrize(("argv", "said"), [
    (["synth", "--out", "{tmp}/x.npz", "--gpus", "0"], "eplb synth: error: --gpus must be >= 1, got 0"),
    (["synth", "--out", "{tmp}/x.npz", "--gpus", "-4"], "eplb synth: error: --gpus must be >= 1, got -4"),
    (["compare", "--layers", "0", "--out", "{tmp}/r"], "eplb compare: error: --layers must be >= 1, got 0"),
    (["solve", "--max-lb-slack", "-1"],
     "eplb solve: error: --max-lb-slack must be between 0 and 1 (0.01 = lb within 1% of the best), got -1"),
    (["solve", "--max-lb-slack", "nan"],
     "eplb solve: error: --max-lb-slack must be between 0 and 1 (0.01 = lb within 1% of the best), got nan"),
])  # fmt: skip
def test_the_value_is_echoed(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], said: str) -> None:
    code, err = run(capsys, *[a.format(tmp=tmp_path) for a in argv])
    assert code == 2 and err == said + "\n", err
    assert not list(tmp_path.iterdir())
