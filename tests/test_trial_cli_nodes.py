"""`eplb solve` and `eplb replay` name --gpus-per-node and --groups when they do not divide the GPUs or the experts
(they said '32 GPUs do not split into nodes of 5', `eplb.solve.check_shapes`' words, and no flag)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli_run import error_prefix, small_log
from tests.cli_run import run_eplb as run


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_log(tmp_path_factory.mktemp("nodes") / "log.npz")


@pytest.mark.parametrize(("flags", "said"), [
    (["--gpus-per-node", "5"], "{gpus} GPUs do not split into nodes of 5: give --gpus-per-node a divisor of {gpus}"),
    (["--gpus-per-node", "0"], "{gpus} GPUs do not split into nodes of 0: give --gpus-per-node a divisor of {gpus}"),
    (["--gpus-per-node", "2", "--groups", "7"],
     "{experts} experts do not split into 7 equal groups: give --groups a divisor of {experts}"),
    (["--gpus-per-node", "2", "--groups", "0"],
     "{experts} experts do not split into 0 equal groups: give --groups a divisor of {experts}"),
])  # fmt: skip
def test_nodes_and_groups_that_do_not_divide_are_named_by_flag(
    log: Path, capsys: pytest.CaptureFixture[str], flags: list[str], said: str
) -> None:
    for argv, gpus, experts in ((["solve", "--gpus", "32"], 32, 256), (["replay", str(log), "--gpus", "4"], 4, 16)):
        code, err = run(capsys, *argv, *flags)
        assert code == 2 and err == error_prefix(argv) + f"{said.format(gpus=gpus, experts=experts)}\n", err


def test_replay_refuses_them_before_it_makes_its_out_directory(
    log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run(capsys, "replay", str(log), "--gpus", "4", "--gpus-per-node", "3", "--out", str(tmp_path / "r"))
    assert code == 2 and "do not split into nodes of 3" in err and not list(tmp_path.iterdir()), err
