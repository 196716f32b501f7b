"""What every `eplb` subcommand that writes a file does when the file cannot be written."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from eplb.cli import main
from eplb.io.files import replace_text
from tests.cli_run import error_prefix


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 2-layer x 16-expert window, a placement of it on 4 GPUs, a log of that shape and an SGLang stat dump."""
    d = tmp_path_factory.mktemp("outputs")
    files = {"window": d / "w.json", "placement": d / "p.json", "log": d / "log.npz", "sglang": d / "sglang.json"}
    files["window"].write_text(json.dumps({"loads": (np.arange(32).reshape(2, 16) + 1).tolist()}))
    files["sglang"].write_text(json.dumps({"logical_count": (np.arange(64).reshape(2, 2, 16) % 7).tolist()}))
    for argv in (["solve", "--loads", str(files["window"]), "--gpus", "4", "--out", str(files["placement"])],
                 ["synth", "--out", str(files["log"]), "--steps", "20", "--layers", "2", "--experts", "16",
                  "--top-k", "2", "--tokens", "64", "--hot-ratio", "4"]):  # fmt: skip
        assert main(argv) == 0
    return files


WRITERS = {
    "solve --out": (["solve", "--loads", "{window}", "--gpus", "4", "--out", "{bad}.json"], "--out"),
    "solve --plan": (["solve", "--loads", "{window}", "--gpus", "4", "--current", "{placement}", "--plan",
                      "{bad}.json"], "--plan"),
    "export": (["export", "--placement", "{placement}", "--to", "sglang", "--out", "{bad}.json"], "--out"),
    "import-load": (["import-load", "--from", "sglang", "{sglang}", "--out", "{bad}.json"], "--out"),
    "synth": (["synth", "--out", "{bad}.npz", "--steps", "3", "--layers", "2", "--experts", "16", "--top-k", "2",
               "--tokens", "64", "--hot-ratio", "4"], "cannot write"),
    "logs convert": (["logs", "convert", "{log}", "{bad}.jsonl"], "cannot write"),
    "replay": (["replay", "{log}", "--gpus", "4", "--no-progress", "--out", "{bad}"], "--out"),
    "compare": (["compare", "--loads", "{window}", "--solvers", "greedy", "--ep", "4", "--no-progress", "--out",
                 "{bad}"], "--out"),
    "cost --plot": (["cost", "--model", "deepseek-v3", "--ep", "8", "--tokens-per-gpu", "256", "--plot",
                     "{bad}.png"], "--plot"),
}  # fmt: skip
"""Every subcommand that writes a file (but `eplb history --plot`, which needs a server: `eplb.io.images`), its
arguments with the output {bad}, and the start of what its error names."""
IN_PLACE = ("solve --out", "solve --plan", "export", "import-load", "cost --plot")
"""The writers that write the file itself (the log writers and the directories go through NAME.part or mkdir)."""


@pytest.mark.parametrize(("writer", "target"), [
    *((writer, "no directory") for writer in WRITERS), *((writer, "full disk") for writer in IN_PLACE),
])  # fmt: skip
def test_an_output_that_cannot_be_written_is_one_line(
    inputs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], writer: str, target: str
) -> None:
    """A path under /proc (a directory nothing can be created in: FileNotFoundError), or a full disk (a name linked
    to /dev/full: ENOSPC): `eplb solve --out` and `--plan`, `export` and `import-load` printed a traceback and exited
    1, as the others did not; `eplb synth` under /proc said the log would take more than /proc's 0 GB free."""
    argv, names = WRITERS[writer]
    bad = Path("/proc/eplb-no-such-dir") if target == "no directory" else tmp_path / "full"
    if target == "full disk":
        suffix = next(a for a in argv if a.startswith("{bad}")).removeprefix("{bad}")
        (tmp_path / f"full{suffix}").symlink_to("/dev/full")
    args = [a.format(bad=bad, **{k: str(v) for k, v in inputs.items()}) for a in argv]
    assert main(args) == 2
    err = capsys.readouterr().err
    cause = "No such file or directory" if target == "no directory" else "No space left on device"
    assert err.count("\n") == 1 and err.startswith(error_prefix(argv) + "") and cause in err, err
    said = err.removeprefix(error_prefix(argv) + "")
    assert said.startswith(names) and str(bad)[:30] in said, said  # --plot clips a long path (eplb.errors.shown)


def test_a_failed_write_leaves_the_old_placement_whole(
    inputs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`eplb solve --current p.json --out p.json` (the incremental workflow) on a disk that fills during the write:
    the placement being served stays as it was (written in place, it was truncated), and nothing is left beside it."""
    serving = tmp_path / "p.json"
    serving.write_bytes(inputs["placement"].read_bytes())
    before = serving.read_bytes()

    def full_disk(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full_disk)
    argv = ["solve", "--loads", str(inputs["window"]), "--gpus", "4", "--current", str(serving), "--out", str(serving)]
    assert main(argv) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert serving.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]


def test_replace_text_keeps_the_mode_and_writes_through_symlinks_and_devices(tmp_path: Path) -> None:
    old = tmp_path / "old.json"
    old.write_text("old")
    old.chmod(0o640)
    replace_text(old, "new")
    assert old.read_text() == "new" and stat.S_IMODE(old.stat().st_mode) == 0o640
    fresh = tmp_path / "fresh.json"
    mask = os.umask(0o022)
    try:
        replace_text(fresh, "x")
    finally:
        os.umask(mask)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o644  # as open() would make it, not mkstemp's 0600
    link = tmp_path / "link.json"
    link.symlink_to(old)
    replace_text(link, "via link")
    assert link.is_symlink() and old.read_text() == "via link"
    replace_text("/dev/null", "in place")  # a device is written, not replaced
    assert Path("/dev/null").is_char_device()
