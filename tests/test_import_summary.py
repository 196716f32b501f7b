"""What `eplb import-load` prints of the window it wrote: with a layer that recorded no tokens the per-layer figure is
said to be a mean and that layer is named (the line said '81 token-expert assignments per layer' of layers holding 114,
0 and 130)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from eplb.cli import main


def test_a_layer_without_tokens_is_named_and_the_per_layer_figure_is_a_mean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    counts = np.zeros((2, 3, 4), dtype=np.int64)
    counts[:, 0] = [[10, 20, 30, 40], [0, 0, 4, 6]]  # layer 0: 110 picks
    counts[:, 2] = [[5, 5, 5, 5], [10, 0, 0, 0]]  # layer 2: 30; layer 1 none
    src = tmp_path / "c.npy"
    np.save(src, counts)
    assert main(["import-load", "--from", "vllm", str(src), "--out", str(tmp_path / "w.json")]) == 0
    printed = capsys.readouterr().out
    assert ("x 4 experts, 47 token-expert assignments per layer summed over 2 steps (the mean over layers; 1 layer "
            "without tokens: layer 1)") in printed, printed
    counts[:, 1] = 1
    np.save(src, counts)
    assert main(["import-load", "--from", "vllm", str(src), "--out", str(tmp_path / "w2.json")]) == 0
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith("x 4 experts, 49 token-expert assignments per layer summed over 2 steps"), printed
