"""`eplb export --layer-ids` that name a layer the placement has no row for: the refusal named the file, not the
flag that asked for the layer ('p.json: has no row for layer 0 (it covers layers 3-60)')."""

from __future__ import annotations

from pathlib import Path

import pytest

from eplb.cli import main
from tests.cli_run import run_eplb as run


def test_layer_ids_without_a_row_name_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    placement, yaml = tmp_path / "p.json", tmp_path / "t.yaml"
    assert main(["solve", "--gpus", "8", "--out", str(placement)]) == 0  # DeepSeek-V3's layers 3-60
    assert main(["export", "--placement", str(placement), "--to", "trtllm", "--out", str(yaml)]) == 0
    capsys.readouterr()
    for source, extra in ((placement, []), (yaml, ["--gpus", "8"])):
        code, err = run(capsys, "export", "--placement", str(source), *extra, "--to", "sglang", "--layer-ids", "3,0,1",
                        "--out", str(tmp_path / "s.json"))
        assert code == 2 and err == f"eplb export: error: --layer-ids 3,0,1: {source} has no row for layer 0 (it " \
            "covers layers 3-60)\n", err
    assert not (tmp_path / "s.json").exists()
