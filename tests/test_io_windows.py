"""What `--loads` says of a JSON file of another kind: a placement, a plan, an engine's statistics dump."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eplb.cli import main

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


@pytest.mark.parametrize(
    ("content", "said"),
    [
        ({"format": "eplb.placement/v1", "num_experts": 2, "num_gpus": 1, "slots_per_gpu": [2],
          "phy2log": [[0, 1]]},
         "p.json: a placement file (phy2log), not a load window: give it as --placement (eplb evaluate) or --current "
         "(eplb solve), and the window as --loads"),
        ({"physical_to_logical_map": [[0, 1]]}, "p.json: a placement file (physical_to_logical_map), not a load"),
        ({"logical_count": [[[1, 2]]]},
         "p.json: SGLang's expert distribution dump (logical_count), not a load window: make one with `eplb "
         "import-load --from sglang p.json --out window.json`"),
        ({"num_copies": 0, "stages": []}, "p.json: a migration plan (stages), not a load window"),
        ({"counts": [[[1, 2]]]},
         "p.json: expected a 'loads' field holding [layers][experts] token counts (keys: counts); per-step counts "
         "[steps][layers][experts] under 'counts' are read by `eplb import-load --from vllm p.json --out "
         "window.json`"),
        ({"rows": [[1, 2]]}, "p.json: expected a 'loads' field holding [layers][experts] token counts (keys: rows)"),
    ],
)
def test_loads_names_the_kind_of_json_file_it_was_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, content: object, said: str
) -> None:
    """`eplb solve --loads p64.json` (the placement `--out` just wrote) said only "expected a 'loads' field": the
    file's kind and the flag that takes it are named now."""
    monkeypatch.chdir(tmp_path)
    Path("p.json").write_text(json.dumps(content))
    assert main(["solve", "--loads", "p.json", "--gpus", "1"]) == 2
    err = capsys.readouterr().err
    assert said in err, err
    assert "Traceback" not in err


def test_a_real_window_still_reads(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["solve", "--loads", str(FIXTURES / "seed004-counts.json"), "--gpus", "8"]) == 0
    assert "lb" in capsys.readouterr().out


def test_a_truncated_npz_says_it_was_cut_short_wherever_it_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`eplb replay` said a cut-off .npz loses its directory (copy it again); `--loads` and `import-load` gave only
    zipfile's 'File is not a zip file'."""
    import numpy as np

    whole = tmp_path / "whole.npz"
    np.savez(whole, counts=np.ones((50, 4, 16), dtype=np.int64))
    cut = tmp_path / "cut.npz"
    cut.write_bytes(whole.read_bytes()[:2000])
    hint = "a file cut short loses the archive's directory at its end: copy it again"
    for argv in (["solve", "--loads", str(cut), "--gpus", "2"],
                 ["import-load", "--from", "vllm", str(cut), "--out", str(tmp_path / "w.json")],
                 ["replay", str(cut), "--gpus", "2"]):  # fmt: skip
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{cut}: not a readable .npz archive (File is not a zip file); {hint}" in err, (argv, err)


def test_a_jsonl_or_parquet_routing_log_as_loads_says_how_to_use_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--loads reads a counts or token-level .npz log as its summed window; a JSONL log, a Parquet directory or one
    of its shards was 'unknown load file type' or 'is a directory; give a file'."""
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 0, "layer": 0, "counts": [1, 2, 3, 4]}\n')
    shards = tmp_path / "log.parquet"
    shards.mkdir()
    (shards / "part-00000.parquet").write_bytes(b"PAR1")
    for path in (log, shards, shards / "part-00000.parquet"):
        assert main(["solve", "--loads", str(path), "--gpus", "2"]) == 2
        err = capsys.readouterr().err
        assert (f"{path}: a routing log, which --loads reads only as an .npz: write one with `eplb logs convert {path} "
                "log.npz` (its counts summed over the steps are the window), or replay it with eplb replay") in err, err
