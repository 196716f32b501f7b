"""The robust swap pass (`solvers.robust`) after the incremental solver: the result stays aligned with the
serving placement (its moves and migration plan hold), and a move budget still holds after the swaps."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from eplb.replay import Schedule, initial_placement, replay
from eplb.replay import run as replay_run
from eplb.solve import Cluster, Outcome, solve
from solvers import registry
from solvers.migration import count_moves
from solvers.registry import Options, Problem
from solvers.robust import refine
from solvers.validation import validate_placement

SLOTS = np.full(8, 5)


def drifting_log(steps: int = 240, layers: int = 2, experts: int = 32, seed: int = 0) -> np.ndarray:
    """Counts [steps, layers, experts] whose hot set drifts every 30 steps."""
    rng = np.random.default_rng(seed)
    pops = rng.dirichlet(np.full(experts, 0.3), size=(steps // 30 + 1, layers))
    return rng.multinomial(4096, pops[np.arange(steps) // 30])


def assert_servable(phy2log: np.ndarray, slots: np.ndarray, experts: int) -> None:
    validate_placement(phy2log, slots, experts)
    gpu = np.repeat(np.arange(slots.size), slots)
    for layer in range(phy2log.shape[0]):
        for g in range(slots.size):  # no expert twice on one GPU (there is room for that here)
            held = phy2log[layer][gpu == g]
            assert len(set(held.tolist())) == held.size


@pytest.mark.parametrize("trigger", ["periodic", "threshold"])
def test_robust_incremental_replay_keeps_placements_aligned(trigger: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[np.ndarray, Outcome]] = []
    real = solve  # what eplb.replay.run calls

    def recording(*args: Any, **kwargs: Any) -> Outcome:
        outcome = real(*args, **kwargs)
        seen.append((kwargs["current"].phy2log.copy(), outcome))
        return outcome

    monkeypatch.setattr(replay_run, "solve", recording)
    monkeypatch.setattr(replay_run, "warm_up", lambda *args, **kwargs: None)  # its tiny solve is no rebalance
    log = drifting_log()
    sched = Schedule(window=50, interval=50, robust_windows=4, trigger=trigger, threshold=1.05)
    result = replay(log, Cluster(SLOTS), schedule=sched, solver="incremental", oracle_every=0, hindsight=False)
    assert len(result.rebalances) >= 3 and len(seen) == len(result.rebalances)
    serving = initial_placement(2, 32, SLOTS).phy2log
    for rebalance, (current, outcome) in zip(result.rebalances, seen, strict=True):
        assert np.array_equal(current, serving)  # each rebalance starts from what serves
        new = outcome.placement.phy2log
        assert_servable(new, SLOTS, 32)
        assert "robust" in outcome.solver
        counted = count_moves(new, current, SLOTS)
        assert outcome.moves is not None and np.array_equal(outcome.moves, counted)
        assert rebalance.moves == int(counted.sum()) and np.array_equal(rebalance.moves_per_layer, counted)
        assert outcome.plan is not None and outcome.plan.num_copies == rebalance.moves
        serving = new
    assert np.array_equal(result.final.phy2log, serving)


def test_robust_incremental_solve_against_a_hierarchical_serving_placement() -> None:
    log = drifting_log(steps=120).astype(np.float64)
    cluster = Cluster(SLOTS, num_groups=4, gpus_per_node=4)
    current = solve(log[:60].sum(axis=0), cluster, solver="greedy").placement
    scenarios = np.stack([log[60 + 15 * i : 75 + 15 * i].sum(axis=0) for i in range(4)])
    outcome = solve(log[60:].sum(axis=0), cluster, solver="incremental", current=current, scenarios=scenarios,
                    options=Options(robust=True))  # fmt: skip
    new = outcome.placement.phy2log
    assert_servable(new, SLOTS, 32)
    assert outcome.moves is not None and np.array_equal(outcome.moves, count_moves(new, current.phy2log, SLOTS))
    assert outcome.plan is not None and outcome.plan.num_copies == int(outcome.moves.sum())
    plain = solve(log[60:].sum(axis=0), cluster, solver="incremental", current=current).placement.phy2log
    node = np.repeat(np.arange(8), 5) // 4
    for layer in range(2):  # swaps stay within nodes: every expert keeps the nodes the solver gave it
        for e in range(32):
            assert set(node[new[layer] == e].tolist()) == set(node[plain[layer] == e].tolist())


@pytest.mark.parametrize("budget", [{"max_moves": 12}, {"max_moves_per_layer": 5}])
def test_robust_swaps_spend_only_the_copies_the_budget_leaves(budget: dict[str, int]) -> None:
    log = drifting_log(steps=120).astype(np.float64)
    current = initial_placement(2, 32, SLOTS).phy2log
    scenarios = np.stack([log[30 * i : 30 * i + 30].sum(axis=0) for i in range(4)])
    problem = Problem(log.sum(axis=0), SLOTS, current_phy2log=current, scenarios=scenarios)
    options = Options(max_moves=budget.get("max_moves"), max_moves_per_layer=budget.get("max_moves_per_layer"))
    edited = registry.solve("incremental", problem, options)
    unbounded = refine(problem, edited)  # no budget: the swaps copy freely
    bounded = refine(problem, edited, options)
    validate_placement(bounded.phy2log, SLOTS, 32)
    moves = count_moves(bounded.phy2log, current, SLOTS)
    assert int(count_moves(unbounded.phy2log, current, SLOTS).sum()) > int(moves.sum())
    if "max_moves" in budget:
        assert int(moves.sum()) <= budget["max_moves"]
    else:
        assert int(moves.max()) <= budget["max_moves_per_layer"]
    assert bounded.info["robust"]["worst_lb_after"] <= bounded.info["robust"]["worst_lb_before"]


def test_a_robust_solve_through_the_registry_keeps_its_move_budget() -> None:
    # `Options.robust` runs the swaps inside registry.solve: the budget must reach them there too
    log = drifting_log(steps=120).astype(np.float64)
    current = initial_placement(2, 32, SLOTS).phy2log
    scenarios = np.stack([log[30 * i : 30 * i + 30].sum(axis=0) for i in range(4)])
    problem = Problem(log.sum(axis=0), SLOTS, current_phy2log=current, scenarios=scenarios)
    free = registry.solve("incremental", problem, Options(robust=True))
    bounded = registry.solve("incremental", problem, Options(max_moves=12, robust=True))
    assert int(count_moves(free.phy2log, current, SLOTS).sum()) > 12
    assert int(count_moves(bounded.phy2log, current, SLOTS).sum()) <= 12
