"""Flags the CLI ignored without a word: each is now refused, or noted, before the work."""

from __future__ import annotations

from pathlib import Path

import pytest

from eplb.cli import main

SYNTH = ["synth", "--steps", "20", "--layers", "2", "--experts", "16", "--top-k", "2", "--tokens", "64"]


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """The one error line of a run that must fail with exit 2."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.strip()


@pytest.mark.parametrize(("out", "kind"), [("x.npz", "NPZ"), ("x.jsonl", "JSONL")])
def test_shard_steps_for_a_log_of_one_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], out: str, kind: str
) -> None:
    """`eplb logs convert small.npz x.npz --shard-steps 10` wrote the file and ignored --shard-steps, while
    --compress was refused for the wrong format; Parquet takes it."""
    log = tmp_path / "log.npz"
    assert main([*SYNTH, "--out", str(log)]) == 0
    err = _error(capsys, ["logs", "convert", str(log), str(tmp_path / out), "--shard-steps", "10"])
    assert err == (f"eplb logs: error: --shard-steps sets the steps per shard file of a Parquet log; OUT "
                   f"{tmp_path / out} is {kind}, one file: drop --shard-steps, or name it .parquet")
    assert not (tmp_path / out).exists()
    assert main(["logs", "convert", str(log), str(tmp_path / "p.parquet"), "--shard-steps", "10"]) == 0
    assert capsys.readouterr().out.endswith(" in 2 shards\n")
    assert main(["logs", "convert", str(log), str(tmp_path / out)]) == 0
