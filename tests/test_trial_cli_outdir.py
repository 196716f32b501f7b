"""A log written into a directory that is not there is refused as every other output file is (`output_file`):
`eplb synth --out` and `eplb logs convert OUT` made the directories (`eplb.io.logs.output_log`) while solve, export
and import-load said 'create it first'."""

from __future__ import annotations

from pathlib import Path

import pytest

from eplb.cli import main
from tests.cli_run import error_prefix
from tests.cli_run import run_eplb as run

SHAPE = ["--steps", "3", "--layers", "2", "--experts", "16", "--top-k", "2", "--tokens", "64", "--hot-ratio", "4"]


@pytest.mark.parametrize("fmt", ["counts", "topk"])
def test_synth_refuses_a_missing_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str) -> None:
    out = tmp_path / "no" / "such" / "x.npz"
    code, err = run(capsys, "synth", "--out", str(out), "--format", fmt, *SHAPE)
    assert code == 2 and err == f"eplb synth: error: --out {out}: directory {out.parent} does not exist; create it " \
        "first\n", err
    assert not list(tmp_path.iterdir())


def test_synth_seed004_refuses_a_missing_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "no" / "x.jsonl"
    code, err = run(capsys, "synth", "--preset", "seed004", "--out", str(out), "--steps", "1", "--layers", "1")
    assert code == 2 and err.endswith(f"--out {out}: directory {out.parent} does not exist; create it first\n"), err
    assert not list(tmp_path.iterdir())


def test_synth_refuses_a_directory_as_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "d.npz"
    out.mkdir()
    code, err = run(capsys, "synth", "--out", str(out), *SHAPE)
    assert code == 2 and err == f"eplb synth: error: --out {out} is a directory; give a file name inside it\n", err


def test_logs_convert_refuses_a_missing_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "log.npz"
    assert main(["synth", "--out", str(log), *SHAPE]) == 0
    capsys.readouterr()
    for name in ("y.jsonl", "y.npz"):
        out = tmp_path / "no" / name
        code, err = run(capsys, "logs", "convert", str(log), str(out))
        assert code == 2 and err == f"eplb logs convert: error: OUT {out}: directory {out.parent} does not " \
            "exist; create it first\n", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.npz"]
    shards = tmp_path / "new" / "shards.parquet"  # a directory of shards is made, as replay --out DIR is
    assert main(["logs", "convert", str(log), str(shards)]) == 0 and shards.is_dir()


@pytest.mark.parametrize("under", ["x.json", "sub/x.json"])
def test_a_file_in_the_way_of_the_directory_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], under: str
) -> None:
    """`eplb solve --out a-file/x.json` said 'directory a-file does not exist; create it first': it exists, a file."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    out = a_file / under
    for argv in (["solve", "--gpus", "4", "--out", str(out)], ["synth", "--out", f"{out}.npz", *SHAPE]):
        code, err = run(capsys, *argv)
        shown = str(out) + ("" if argv[0] == "solve" else ".npz")
        assert code == 2 and err == error_prefix(argv) + f"--out {shown}: cannot write there ({a_file} is not a " \
            "directory)\n", err
