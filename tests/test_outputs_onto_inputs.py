"""An outside tester's findings, through the real CLI and real files: an output named as an input of the same run
(through a symlink, ./x), JSON nested 100,000 levels deep or holding a 5,000-digit number, an input this user
cannot read, a symbolic link loop, a TensorRT-LLM export under a name eplb cannot read back, an empty --out.
Each is one error line naming the flag or file (exit 2), the input left as it was, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from eplb.cli import main
from tests.cli_run import last_line, run_eplb

DEEP = '{"loads": ' + "[" * 100_000 + "]" * 100_000 + "}"
LONG = "9" * 5_000


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """(exit code, last stderr line) of `eplb ARGV`; no traceback allowed."""
    code, err = run_eplb(capsys, *argv)
    return code, last_line(err)


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """In tmp_path (the working directory): a 2 x 4 load window, a placement solved for it, an SGLang dump, a
    per-step log."""
    monkeypatch.chdir(tmp_path)
    window = tmp_path / "w.json"
    window.write_text(json.dumps({"loads": [[5, 1, 1, 1], [1, 1, 1, 7]]}))
    placement = tmp_path / "p.json"
    assert main(["solve", "--loads", str(window), "--gpus", "2", "--redundant", "2", "--out", str(placement)]) == 0
    sglang = tmp_path / "sg.json"
    sglang.write_text(json.dumps({"logical_count": [[[3, 1, 2, 0], [0, 1, 2, 3]]]}))
    log = tmp_path / "log.npy"
    np.save(log, np.ones((3, 2, 4), dtype=np.int64))
    return {"window": window, "placement": placement, "sglang": sglang, "log": log}


SOLVE = ["solve", "--gpus", "2", "--redundant", "2"]


# 1. an output onto an input of the same run --------------------------------------------------------------------


@pytest.mark.parametrize("form", ["same", "dot", "symlink"])
def test_solve_out_onto_loads_is_refused(files: dict[str, Path], capsys: pytest.CaptureFixture[str], form: str) -> None:
    window = files["window"]
    out = {"same": str(window), "dot": f"./{window.name}", "symlink": str(window.with_name("link.json"))}[form]
    if form == "symlink":
        Path(out).symlink_to(window.name)
    before = window.read_text()
    code, err = run(capsys, *SOLVE, "--loads", str(window), "--out", out)
    assert code == 2 and "is the input (--loads" in err and "write to another name" in err
    assert window.read_text() == before


def test_solve_plan_onto_loads_is_refused(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    before = files["window"].read_text()
    code, err = run(capsys, *SOLVE, "--loads", str(files["window"]), "--current", str(files["placement"]),
                    "--plan", str(files["window"]))
    assert code == 2 and err.endswith("write to another name") and "--plan" in err and "(--loads" in err
    assert files["window"].read_text() == before


def test_solve_out_onto_current_stays_allowed(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """The incremental workflow (README): the serving placement replaced whole by the next one."""
    p = str(files["placement"])
    code, _ = run(capsys, *SOLVE, "--loads", str(files["window"]), "--current", p, "--out", p)
    assert code == 0 and "phy2log" in json.loads(files["placement"].read_text())


def test_import_load_out_onto_its_dump_is_refused(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    before = files["sglang"].read_text()
    code, err = run(capsys, "import-load", "--from", "sglang", str(files["sglang"]), "--out", "./sg.json")
    assert code == 2 and "is the input (FILE" in err and files["sglang"].read_text() == before


def test_export_out_onto_its_placement_is_refused(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    before = files["placement"].read_text()
    link = files["placement"].with_name("live.json")
    link.symlink_to(files["placement"])
    for out in (str(files["placement"]), str(link)):
        code, err = run(capsys, "export", "--placement", str(files["placement"]), "--to", "json", "--out", out)
        assert code == 2 and "is the input (--placement" in err
    assert files["placement"].read_text() == before


def test_logs_convert_onto_its_input_is_refused(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    npz = files["log"].with_suffix(".npz")
    assert main(["logs", "convert", str(files["log"]), str(npz)]) == 0
    capsys.readouterr()
    code, err = run(capsys, "logs", "convert", str(npz), f"./{npz.name}")
    assert code == 2 and "OUT" in err and "is the input (IN" in err


# 2. JSON too deep or holding too long a number -----------------------------------------------------------------


@pytest.mark.parametrize(("text", "message"), [(DEEP, "nested too deeply"),
                                               ('{"loads": [[' + LONG + ", 1]]}", "more than 4,300 digits")],
                         ids=["deep", "long"])
def test_json_beyond_pythons_reader_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str,
                                               message: str) -> None:
    window, log, spec = tmp_path / "w.json", tmp_path / "log.jsonl", tmp_path / "model.json"
    window.write_text(text)
    counts = text.removeprefix('{"loads": ').removesuffix("}")
    log.write_text('{"step": 0, "layer": 0, "counts": ' + counts + "}\n")
    spec.write_text(text)
    for argv, where in ((["solve", "--loads", str(window), "--gpus", "2"], f"{window}:"),
                        (["replay", str(log)], f"{log}: line 1:"),
                        (["cost", "--model", str(spec), "--hardware", "h100", "--link", "nvlink", "--ep", "8",
                          "--tokens-per-gpu", "100"], f"{spec}:")):
        code, err = run(capsys, *argv)
        assert code == 2 and where in err and message in err, (argv[0], err)


# 3. an input this user cannot read -----------------------------------------------------------------------------


def _unprivileged() -> list[str]:
    """A prefix that runs a command without root's power to read any file (none when not root)."""
    if os.geteuid() != 0:
        return []
    return ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search", "--"]


def test_an_unreadable_input_is_refused(files: dict[str, Path], tmp_path: Path) -> None:
    for p in (files["window"], files["log"], files["sglang"]):
        p.chmod(0)
    eplb = [*_unprivileged(), sys.executable, "-m", "eplb.cli"]
    cases = [(["solve", "--loads", str(files["window"]), "--gpus", "2"], files["window"]),
             (["replay", str(files["log"])], files["log"]),
             (["logs", "convert", str(files["log"]), str(tmp_path / "o.npz")], files["log"]),
             (["import-load", "--from", "sglang", str(files["sglang"]), "--out", str(tmp_path / "o.json")],
              files["sglang"])]
    for argv, path in cases:
        done = subprocess.run([*eplb, *argv], capture_output=True, text=True, timeout=120, check=False)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, (argv, done.stderr)
        assert f"{path}: cannot read it (Permission denied)" in lines[0]


# 4. a symbolic link loop ---------------------------------------------------------------------------------------


def test_a_symlink_loop_is_named(files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "b").symlink_to("a")
    (tmp_path / "a").symlink_to("b")
    for argv in ([*SOLVE, "--loads", str(files["window"]), "--out", "a"], [*SOLVE, "--loads", "a"],
                 ["logs", "convert", "a", "x.npz"], ["logs", "convert", str(files["log"]), "a"]):
        code, err = run(capsys, *argv)
        assert code == 2 and "'a': a symbolic link loop" in err, (argv, err)


# 5. a TensorRT-LLM export under a name that is not YAML ---------------------------------------------------------


@pytest.mark.parametrize("name", ["x.json", "x.npz"])
def test_trtllm_export_must_be_named_yaml(files: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                          name: str) -> None:
    code, err = run(capsys, "export", "--placement", str(files["placement"]), "--to", "trtllm", "--out", name)
    assert code == 2 and "the file is YAML" in err and "name it x.yaml" in err and not Path(name).exists()
    for ok in ("x.yaml", "x.yml"):
        assert main(["export", "--placement", str(files["placement"]), "--to", "trtllm", "--out", ok]) == 0
        assert main(["export", "--placement", ok, "--gpus", "2", "--to", "json", "--out", "back.json"]) == 0


# 6. an empty --out (an unset $OUT) -----------------------------------------------------------------------------


def test_an_empty_out_is_refused_everywhere(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    for argv, flag in (([*SOLVE, "--loads", str(files["window"]), "--out", ""], "--out"),
                       ([*SOLVE, "--loads", str(files["window"]), "--current", str(files["placement"]), "--plan", ""],
                        "--plan"),
                       (["import-load", "--from", "sglang", str(files["sglang"]), "--out", ""], "--out"),
                       (["export", "--placement", str(files["placement"]), "--to", "json", "--out", ""], "--out"),
                       (["logs", "convert", str(files["log"]), ""], "OUT"),
                       (["synth", "--out", ""], "--out")):
        code, err = run(capsys, *argv)
        assert code == 2 and f"{flag} is an empty name" in err, (argv, err)
