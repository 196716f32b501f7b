"""`eplb solve`'s slot budget flags echo the value they refuse (eplb.budget)."""

from __future__ import annotations

import pytest

from eplb.errors import EplbError
from tests.cli_run import run_eplb as run


@pytest.mark.parametrize(("argv", "said"), [
    (["--memory-budget-gib", "-1", "--model", "deepseek-v3"],
     "--memory-budget-gib must be finite and >= 0, got -1 GiB"),
    (["--memory-budget-gib", "nan", "--model", "deepseek-v3"],
     "--memory-budget-gib must be finite and >= 0, got nan"),
    (["--memory-budget-gib", "inf", "--model", "deepseek-v3"],
     "--memory-budget-gib must be finite and >= 0, got inf"),
    (["--gpus", "2", "--memory-budget-gib", "30,-2.5", "--model", "deepseek-v3"],
     "--memory-budget-gib must be finite and >= 0, got -2.5 GiB for GPU 1"),
    (["--memory-budget-gib", "1e300", "--model", "deepseek-v3"],  # said 'must be finite': 1e300 GiB overflowed
     "--memory-budget-gib 1e+300: more than any GPU holds (at most 931,323 GiB)"),
    (["--slots-per-gpu", "-1"], "--slots-per-gpu must be finite and >= 0, got -1"),
    (["--gpus", "2", "--slots-per-gpu", "9,-3"], "--slots-per-gpu must be finite and >= 0, got -3 for GPU 1"),
])  # fmt: skip
def test_a_refused_budget_echoes_the_value(capsys: pytest.CaptureFixture[str], argv: list[str], said: str) -> None:
    code, err = run(capsys, "solve", *argv)
    assert code == 2 and err == f"eplb solve: error: {said}\n", err


def test_the_python_api_echoes_the_value_too() -> None:
    from eplb.budget import GIB, slots_per_gpu

    with pytest.raises(EplbError, match=r"^memory budget must be finite and >= 0, got nan$"):
        slots_per_gpu(32, 256, memory_budget_bytes=float("nan"), slot_bytes=GIB)
    with pytest.raises(EplbError, match=r"^slots per GPU must be whole numbers, got 2.5$"):
        slots_per_gpu(4, 8, slots=[2.5])  # type: ignore[list-item]  # as a caller may
