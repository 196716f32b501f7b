"""Running the `eplb` command in-process, for the tests of its refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from eplb.cli import main


def run_eplb(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """(exit code, whole stderr) of `eplb ARGV`, argparse's own errors included; no traceback allowed."""
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's errors
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def last_line(err: str) -> str:
    """The last line of a stderr ('' for none): the error after any notes."""
    return (err.strip().splitlines() or [""])[-1]


def small_log(out: Path) -> Path:
    """`eplb synth` of a small counts log at `out` (4 steps x 2 layers x 16 experts, top-2) to refuse flags on."""
    assert main(["synth", "--out", str(out), "--steps", "4", "--layers", "2", "--experts", "16", "--top-k", "2",
                 "--tokens", "64", "--hot-ratio", "4"]) == 0
    return out


def error_prefix(argv: list[str]) -> str:
    """How `eplb ARGV`'s errors start: the command, with its action for those that take one (`eplb logs convert:
    error: `), as argparse's own errors do."""
    words = argv[:2] if argv[0] in ("logs", "deployments") else argv[:1]
    return f"eplb {' '.join(words)}: error: "
