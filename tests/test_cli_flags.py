"""Flags the CLI ignored without a word: each is now refused, or noted, before the work."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from eplb.cli import main
from eplb.io.logs import open_log

SYNTH = ["synth", "--steps", "20", "--layers", "2", "--experts", "16", "--top-k", "2", "--tokens", "64", "--hot-ratio",
         "4"]


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
    assert err == (f"eplb logs convert: error: --shard-steps sets the steps per shard file of a Parquet log; OUT "
                   f"{tmp_path / out} is {kind}, one file: drop --shard-steps, or name it .parquet")
    assert not (tmp_path / out).exists()
    assert main(["logs", "convert", str(log), str(tmp_path / "p.parquet"), "--shard-steps", "10"]) == 0
    assert capsys.readouterr().out.endswith(" in 2 shards\n")
    assert main(["logs", "convert", str(log), str(tmp_path / out)]) == 0


@pytest.mark.parametrize(("argv", "said"), [
    (["--shift-every", "0"], "--shift-every is the mean steps between random regime shifts and must be > 0, got 0: "
                             "drop it for none"),
    (["--shift-every", "-5"], "--shift-every is the mean steps between random regime shifts and must be > 0, got "
                              "-5: drop it for none"),
    (["--preset", "seed004", "--shift-every", "50"], "--preset seed004 draws each layer-step on its own, without "
                                                    "expert groups, drift or regime shifts; drop --shift-every"),
    (["--preset", "seed004", "--groups", "4"], "--preset seed004 draws each layer-step on its own, without expert "
                                              "groups, drift or regime shifts; drop --groups"),
    (["--preset", "seed004", "--drift-std", "0.6"], "--preset seed004 draws each layer-step on its own, without "
                                                   "expert groups, drift or regime shifts; drop --drift-std"),
    (["--preset", "seed004", "--top-k", "8"], "--preset seed004 fixes 256 experts, top-8, 4096 tokens and skew 0.4; "
                                             "drop --top-k"),  # it said --top_k
])  # fmt: skip
def test_synth_flags_that_would_do_nothing_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    """`--shift-every 0` meant no random shifts without saying so; the seed004 preset ignored the popularity
    flags (groups, drift, shifts), which defaulted to values it could not tell from given ones."""
    out = tmp_path / "log.npz"
    assert _error(capsys, ["synth", "--out", str(out), "--steps", "3", "--layers", "2", *argv]) == (
        f"eplb synth: error: {said}")
    assert not out.exists()


def test_synth_notes_a_model_name_that_is_no_preset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`synth --model deepseek-v33` wrote the typo into the log without a word (only `eplb replay` noted it later):
    a name that is no preset is noted before the work, with the preset it is close to; the log keeps the name."""
    out = tmp_path / "log.npz"
    shape = ["--steps", "3", "--layers", "2", "--no-progress"]
    assert main(["synth", "--out", str(out), *shape, "--model", "deepseek-v33"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("note: --model 'deepseek-v33' is no preset (deepseek-v4.1-flash, deepseek-v3, ") and \
        err.endswith("; did you mean deepseek-v3?\n") and err.count("\n") == 1, err
    assert open_log(out).info.model == "deepseek-v33"
    assert main(["synth", "--out", str(out), *shape, "--model", "my-own-moe"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("note: --model 'my-own-moe' is no preset (") and "did you mean" not in err, err
    for preset in (["--model", "DeepSeek-V3"], []):
        assert main(["synth", "--out", str(out), *shape, *preset]) == 0
        assert capsys.readouterr().err == ""
    assert _error(capsys, ["synth", "--out", str(out), *shape, "--model", "deepseek-v33", "--tokens", "0"]).startswith(
        "eplb synth: error: --tokens must be")  # refused before any note


@pytest.mark.parametrize("argv", [
    ["solve", "--loads", "{window}", "--gpus", "4", "--out", "{tmp}/x.npz"],
    ["solve", "--loads", "{window}", "--gpus", "4", "--current", "{placement}", "--plan", "{tmp}/x.npz"],
    ["export", "--placement", "{placement}", "--to", "json", "--out", "{tmp}/x.npz"],
    ["export", "--placement", "{placement}", "--to", "vllm-ascend", "--out", "{tmp}/x.npz"],
])  # fmt: skip
def test_a_json_output_named_as_another_format_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    """`eplb solve --out x.npz` wrote JSON under an .npz name without a word; a name without a suffix (/dev/stdout)
    and any case of .json are taken."""
    window, placement = tmp_path / "w.json", tmp_path / "p.json"
    window.write_text(json.dumps({"loads": (np.arange(32).reshape(2, 16) + 1).tolist()}))
    assert main(["solve", "--loads", str(window), "--gpus", "4", "--out", str(placement)]) == 0
    args = [a.format(window=window, placement=placement, tmp=tmp_path) for a in argv]
    flag = args[-2]
    assert _error(capsys, args) == (f"eplb {args[0]}: error: {flag} {tmp_path}/x.npz: the file is JSON, but its name "
                                    "ends in '.npz': name it x.json")
    assert not (tmp_path / "x.npz").exists()
    for name in ("x.JSON", "x"):
        assert main([*args[:-1], str(tmp_path / name)]) == 0, name
        json.loads((tmp_path / name).read_text())


def test_a_placement_written_to_dev_stdout_reaches_a_pipe(tmp_path: Path) -> None:
    """`eplb solve --out /dev/stdout | jq` said 'cannot write it (No such file or directory)': /dev/stdout was
    resolved to its target, which for a pipe is no path (pipe:[N]), and a temporary file was made beside it. A path
    that is no regular file as opened is written in place."""
    import subprocess
    import sys

    window = tmp_path / "w.json"
    window.write_text(json.dumps({"loads": (np.arange(32).reshape(2, 16) + 1).tolist()}))
    proc = subprocess.run([sys.executable, "-m", "eplb.cli", "solve", "--loads", str(window), "--gpus", "4", "--out",
                           "/dev/stdout"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith('{"format": "eplb.placement/v1"'), proc.stdout[:200]
