"""More GPUs than experts (DeepSeek-V3's EP320 decode: 256 experts, one per GPU, plus redundant ones)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from eplb.cli import main
from eplb.errors import EplbError
from eplb.evaluate import contiguous_placement
from eplb.io.windows import read_window
from eplb.placement import load_placement
from eplb.solve import Cluster, solve
from solvers import registry


def test_baseline_with_more_gpus_than_experts_is_the_round_robin_placement() -> None:
    base = contiguous_placement(2, 4, 6)
    assert base.slots_per_gpu.tolist() == [1] * 6
    assert base.phy2log.tolist() == [[0, 1, 2, 3, 0, 1]] * 2
    assert base.replicas.tolist() == [[2, 2, 1, 1]] * 2


@pytest.mark.parametrize(("gpus", "experts", "said"), [
    (0, 4, "num_gpus must be a whole number >= 1 (an int), got 0"),
    (4, 0, "num_experts must be a whole number >= 1 (an int), got 0"),
])
def test_baseline_refuses_no_gpus_or_no_experts(gpus: int, experts: int, said: str) -> None:
    with pytest.raises(EplbError, match=re.escape(f"contiguous_placement: {said}")):  # was a ZeroDivisionError
        contiguous_placement(2, experts, gpus)


@pytest.mark.parametrize("gpus", [288, 320])
def test_cli_solves_one_expert_per_gpu_beyond_the_expert_count(
    gpus: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p.json"
    assert main(["solve", "--gpus", str(gpus), "--slots-per-gpu", "1", "--out", str(out), "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    placement = load_placement(out)
    assert placement.num_gpus == gpus and placement.num_physical == gpus
    # every expert placed, the hottest ones replicated onto the extra GPUs, never twice on one GPU (1 slot each)
    loads = read_window(None).loads
    assert (placement.replicas >= 1).all() and placement.replicas.sum(axis=1).tolist() == [gpus] * 58
    hottest = np.argmax(loads, axis=1)
    assert (placement.replicas[np.arange(58), hottest] >= 2).all()
    predicted = answer["predicted"]
    assert max(predicted["lb"]) < predicted["baseline"]["lb_max"]
    assert all(t > 0 for t in predicted["time_us"])


FROM_SCRATCH = [
    n
    for n in registry.names()
    if not registry.get_solver(n).capabilities.requires_current and not registry.get_solver(n).capabilities.coactivation
]


@pytest.mark.parametrize("solver", FROM_SCRATCH)
def test_every_solver_places_more_gpus_than_experts(solver: str) -> None:
    rng = np.random.default_rng(3)
    loads = rng.pareto(1.5, size=(2, 8)) * 100
    outcome = solve(loads, Cluster(np.ones(12, dtype=np.int64)), solver=solver)
    assert outcome.placement.num_physical == 12
    assert outcome.balance.lb.max() <= outcome.baseline.lb.max() + 1e-9
