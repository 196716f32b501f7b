"""`eplb export` and `eplb import-load` refuse a --gpus that is no GPU count by name, as `eplb evaluate` does."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from eplb.cli import main


@pytest.fixture()
def sglang_file(tmp_path: Path) -> Path:
    """An SGLang expert-location file of 2 layers x 4 slots (2 GPUs of 2 slots, 3 experts): it records no EP size."""
    path = tmp_path / "loc.json"
    path.write_text(json.dumps({"physical_to_logical_map": [[0, 1, 2, 0], [2, 1, 0, 1]]}))
    return path


@pytest.mark.parametrize("gpus", ["0", "-2"])
def test_export_refuses_a_gpu_count_below_one_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sglang_file: Path, gpus: str
) -> None:
    """It said '4 slots per layer do not split evenly over 0 GPUs; pass the EP size the file was made for'."""
    out = tmp_path / "back.json"
    assert main(["export", "--placement", str(sglang_file), "--to", "json", "--out", str(out), "--gpus", gpus]) == 2
    assert f"--gpus must be >= 1, got {gpus}" in capsys.readouterr().err
    assert not out.exists()
    assert main(["export", "--placement", str(sglang_file), "--to", "json", "--out", str(out), "--gpus", "2"]) == 0


def test_export_and_import_load_refuse_a_huge_gpu_count_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sglang_file: Path
) -> None:
    """As `eplb solve --gpus` and `eplb evaluate --gpus`: at most 65,536 GPUs, said before the file is read."""
    with pytest.raises(SystemExit):
        main(["export", "--placement", str(sglang_file), "--to", "json", "--out", str(tmp_path / "b.json"),
              "--gpus", "10000000"])  # fmt: skip
    assert "argument --gpus: 10000000 is too large (at most 65,536 GPUs)" in capsys.readouterr().err
    counts = tmp_path / "counts.npy"
    np.save(counts, np.ones((2, 2, 4), dtype=np.int64))
    with pytest.raises(SystemExit):
        main(["import-load", "--from", "vllm", str(counts), "--placement", str(sglang_file), "--gpus", "10000000",
              "--out", str(tmp_path / "w.json")])  # fmt: skip
    assert "argument --gpus: 10000000 is too large (at most 65,536 GPUs)" in capsys.readouterr().err
    assert main(["import-load", "--from", "vllm", str(counts), "--placement", str(sglang_file), "--gpus", "0",
                 "--out", str(tmp_path / "w.json")]) == 2  # fmt: skip
    assert "--gpus must be >= 1, got 0" in capsys.readouterr().err
