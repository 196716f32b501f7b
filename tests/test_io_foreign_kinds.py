"""A migration plan given where a placement is expected (--placement, --current) is named as one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eplb.cli import main

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def test_a_plan_given_as_a_placement_is_named_a_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--plan` writes the copies, `--out` the placement; the plan as --placement said 'not a placement file I know
    (keys: bytes_per_copy, ...)'."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"num_copies": 0, "bytes_per_copy": None, "total_bytes": 0, "stage_bytes": None,
                                "stages": []}))  # fmt: skip
    window = str(FIXTURES / "seed004-counts.json")
    said = (f"{plan}: a migration plan (stages), not a placement: give the placement it leads to (the --out of the "
            "eplb solve that wrote it)")
    assert main(["evaluate", "--loads", window, "--placement", str(plan)]) == 2
    assert said in capsys.readouterr().err
    assert main(["solve", "--loads", window, "--current", str(plan)]) == 2
    assert said in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"rows": [[0, 1]]}))
    assert main(["evaluate", "--loads", window, "--placement", str(other)]) == 2
    assert "not a placement file I know (keys: rows)" in capsys.readouterr().err


def test_a_jsonl_routing_log_given_as_a_placement_is_named_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was parsed as YAML: "not valid YAML (expected '<document start>', but found '{' ...)"."""
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 0, "layer": 0, "counts": [1, 2]}\n{"step": 1, "layer": 0, "counts": [2, 1]}\n')
    assert main(["export", "--placement", str(log), "--to", "json", "--out", str(tmp_path / "e.json")]) == 2
    err = capsys.readouterr().err
    assert (f"{log}: a routing log (JSONL), not a placement: give it to eplb replay; placements are JSON or YAML "
            "text") in err, err
