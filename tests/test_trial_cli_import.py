"""`eplb import-load` given one statistics file twice (`d.json d.json`, `d.json ./d.json`) added its counts twice
without a word: an SGLang dump stacked on itself, a vLLM rank summed twice."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from eplb.cli import main
from tests.cli_run import run_eplb as run


@pytest.mark.parametrize("source", ["sglang", "vllm"])
def test_a_file_given_twice_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    monkeypatch.chdir(tmp_path)
    key = "logical_count" if source == "sglang" else "counts"
    Path("d.json").write_text(json.dumps({key: (np.arange(64).reshape(2, 2, 16) % 7).tolist()}))
    Path("e.json").write_text(json.dumps({key: (np.arange(64).reshape(2, 2, 16) % 5).tolist()}))
    for files in (["d.json", "d.json"], ["d.json", "e.json", "./d.json"]):
        code, err = run(capsys, "import-load", "--from", source, *files, "--out", "w.json")
        assert code == 2 and err == f"eplb import-load: error: FILE {files[-1]} is d.json again: its counts would be " \
            "added twice; give each file once\n", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.json", "e.json"]
    assert main(["import-load", "--from", source, "d.json", "e.json", "--out", "w.json"]) == 0  # two files: fine
