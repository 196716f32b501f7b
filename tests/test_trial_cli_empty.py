"""An empty file name (an unset `$VAR`) given to a file flag is refused, as README.md says of outputs: several
flags took it as not given and did other work without a word (`replay --out ""` wrote no files, `compare --log ""`
compared the embedded window, `solve --current ""` solved afresh, `solve --coactivation ""` and `--model ""` ran
without them, `import-load --placement ""` read no placement)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli_run import error_prefix, small_log
from tests.cli_run import run_eplb as run


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_log(tmp_path_factory.mktemp("empty") / "log.npz")


@pytest.mark.parametrize(("argv", "flag"), [
    (["replay", "LOG", "--gpus", "4", "--out", ""], "--out"),
    (["compare", "--log", "", "--ep", "4", "--out", "{tmp}/r", "--layers", "1"], "--log"),
    (["solve", "--current", ""], "--current"),
    (["solve", "--coactivation", ""], "--coactivation"),
    (["solve", "--model", ""], "--model"),
    (["cost", "--hardware", "", "--ep", "8", "--tokens-per-gpu", "256"], "--hardware"),
    (["import-load", "--from", "vllm", "LOG", "--placement", "", "--out", "{tmp}/w.json"], "--placement"),
])  # fmt: skip
def test_an_empty_file_name_is_refused(
    log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], flag: str
) -> None:
    args = [str(log) if a == "LOG" else a.format(tmp=tmp_path) for a in argv]
    code, err = run(capsys, *args)
    assert code == 2 and err == error_prefix(argv) + f"{flag} is an empty name (an unset variable?): give a file " \
        "name\n", err
    assert not list(tmp_path.iterdir())
