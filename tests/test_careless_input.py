"""Careless input through the real CLI: malformed load windows and logs. Each gets one clear error line naming
the flag, field or file (exit 2)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from eplb.cli import main
from eplb.errors import EplbError
from eplb.io.logs import open_log
from solvers.plan import PlanError, build_plan

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """(exit code, last stderr line) of `eplb ARGV`, argparse's own errors included; no traceback allowed."""
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's type errors
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, (err.strip().splitlines() or [""])[-1]


def test_build_plan_refuses_an_infinite_stage_budget() -> None:
    with pytest.raises(PlanError, match="finite"):
        build_plan([[0, 1]], [[1, 0]], [1, 1], bytes_per_copy=1.0, stage_bytes=float("inf"))


# 6., 7. readers ---------------------------------------------------------------------------------------------


def _topk(path: Path, ids: list[list[list[int]]], offsets: object, num_experts: int = 4) -> Path:
    np.savez(path, topk_ids=np.asarray(ids, dtype=np.int16), step_offsets=np.asarray(offsets),
             num_experts=np.int64(num_experts))  # fmt: skip
    return path


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("big.jsonl", '{"step": 0, "layer": 0, "counts": [1e30, 1, 2, 3]}\n',
         "line 1: step 0, layer 0, expert 0: count is 1e+30, too large for a token count"),
        ("bool.jsonl", '{"step": 0, "layer": 0, "counts": [1, true, 2, 3]}\n', "line 1: counts[1] is true"),
    ],
)
def test_bad_jsonl_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, content: str,
                          message: str) -> None:  # fmt: skip
    path = tmp_path / name
    path.write_text(content)
    code, err = run(capsys, "replay", str(path), "--no-progress")
    assert code == 2 and f"{path}: {message}" in err


def test_bools_and_complex_loads_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    window = tmp_path / "w.json"
    window.write_text('{"loads": [[1, 2, false, 4]]}')
    code, err = run(capsys, "solve", "--loads", str(window), "--gpus", "2", "--slots-per-gpu", "2")
    assert code == 2 and "loads[0][2] is false: give a number, not true/false" in err
    npy = tmp_path / "w.npy"
    np.save(npy, np.array([[1 + 2j, 3, 4, 5]]))
    code, err = run(capsys, "solve", "--loads", str(npy), "--gpus", "2", "--slots-per-gpu", "2")
    assert code == 2 and "must hold real numbers (integers or floats), got dtype complex128" in err


def test_float_step_offsets_are_named_as_such(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _topk(tmp_path / "t.npz", [[[0, 1]], [[1, 3]], [[0, 3]]], np.array([0.0, 2.0, 3.0]))
    code, err = run(capsys, "replay", str(path), "--no-progress")
    assert code == 2 and "step_offsets must be integers (token positions), got dtype float64" in err


def test_a_repeated_expert_in_one_top_k_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _topk(tmp_path / "t.npz", [[[0, 1], [2, 3]], [[1, 3], [0, 1]], [[0, 3], [2, 2]]], [0, 2, 3])
    code, err = run(capsys, "replay", str(path), "--no-progress")
    assert code == 2 and "step 1, token 2, layer 1: top-k [2, 2] names an expert twice" in err
    code, err = run(capsys, "solve", "--loads", str(path), "--gpus", "2")
    assert code == 2 and "names an expert twice" in err


@pytest.mark.parametrize("fixture", sorted(FIXTURES.glob("esft-*-topk.npz")), ids=lambda p: p.name)
def test_shipped_token_logs_pick_distinct_experts(fixture: Path) -> None:
    log = open_log(fixture)
    assert sum(chunk.num_steps for chunk in log.iter_counts(4096)) == log.info.num_steps


def test_an_unreasonable_expert_count_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _topk(tmp_path / "t.npz", [[[0, 1]], [[1, 3]], [[0, 3]]], [0, 2, 3], num_experts=10**12)
    code, err = run(capsys, "replay", str(path), "--no-progress")
    assert code == 2 and "num_experts is 1,000,000,000,000: more than int16 topk_ids can name (at most 32,768)" in err
    with pytest.raises(EplbError, match="at most 32,768"):
        open_log(path)
