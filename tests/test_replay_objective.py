"""Replay with the time objective (`eplb replay --objective time`) and the time objective against a serving
placement (eplb.solve.solve with `current`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from eplb.cli import main
from eplb.coactivation import read_topk, summarize
from eplb.errors import EplbError
from eplb.io.windows import read_window
from eplb.replay import Schedule, replay
from eplb.solve import Cluster, CostSetup, solve
from eplb.specs import HARDWARE_PRESETS, MODEL_PRESETS, link_bandwidth
from solvers.migration import count_moves
from solvers.plan import apply_plan

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LAW = FIXTURES / "esft-dsv2lite-law-topk.npz"
H800 = HARDWARE_PRESETS["h800"]
SETUP = CostSetup(MODEL_PRESETS["deepseek-v2-lite"], H800, link_bandwidth(H800, "nic"), 4096)
CLUSTER = Cluster(np.full(8, 9, dtype=np.int64))


@pytest.mark.parametrize("solver", ["incremental", "greedy"])
def test_time_objective_against_a_serving_placement_is_aligned_and_planned(solver: str) -> None:
    """Co-location swaps move experts between GPUs; against a serving placement the answer must still keep every
    expert that stays on a GPU in its slot, so its plan applies (the plan builder refused it before)."""
    ids, offsets = read_topk(LAW)
    half = int(offsets[offsets.size // 2])
    first = np.stack([np.bincount(ids[:half, layer].ravel(), minlength=64) for layer in range(ids.shape[1])])
    current = solve(first.astype(np.float64), CLUSTER).placement
    loads = read_window(LAW).loads
    out = solve(loads, CLUSTER, solver=solver, current=current, cost=SETUP, coactivation=summarize(ids[half:], 64),
                objective="time", empty_slots=False)  # fmt: skip
    assert out.solver["objective"] == "time"
    assert set(out.solver["layer_choice"]) != {"solver"}  # some layer took a co-located candidate
    assert out.plan is not None and out.moves is not None
    moved = count_moves(out.placement.phy2log, current.phy2log, CLUSTER.slots_per_gpu)
    assert np.array_equal(out.moves, moved)
    assert np.array_equal(apply_plan(current.phy2log, out.plan), out.placement.phy2log)


def test_replay_with_the_time_objective_cuts_copies_per_token() -> None:
    sched = Schedule(window=16, interval=16, trigger="periodic")
    by_lb = replay(LAW, CLUSTER, schedule=sched, solver="greedy", cost=SETUP, oracle_every=0)
    by_time = replay(LAW, CLUSTER, schedule=sched, solver="greedy", cost=SETUP, oracle_every=0, objective="time")
    assert [r.solver_info["objective"] for r in by_time.rebalances] == ["time"] * len(by_time.rebalances)
    assert all("objective" not in r.solver_info for r in by_lb.rebalances)
    copies = {name: s["results"]["replay"]["copies_per_token"] for name, s in (("lb", by_lb.summary),
                                                                               ("time", by_time.summary))}
    assert copies["time"] < copies["lb"]


def test_replay_time_objective_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    counts = np.ones((4, 2, 64), dtype=np.int64)
    with pytest.raises(EplbError, match="token-level log"):
        replay(counts, CLUSTER, schedule=Schedule(window=2, interval=2), cost=SETUP, objective="time")
    with pytest.raises(EplbError, match="needs the model"):
        replay(LAW, CLUSTER, schedule=Schedule(window=2, interval=2, trigger="periodic"), objective="time")
    with pytest.raises(EplbError, match="unknown objective"):
        replay(LAW, CLUSTER, schedule=Schedule(window=2, interval=2), cost=SETUP, objective="fast")
    log = tmp_path / "counts.npz"
    np.savez(log, counts=counts)
    assert main(["replay", str(log), "--gpus", "8", "--slots-per-gpu", "9", "--model", "deepseek-v2-lite",
                 "--objective", "time", "--no-progress"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "token-level log" in err and "Traceback" not in err


def test_token_log_replay_times_count_the_gpus_tokens_reach(tmp_path: Path) -> None:
    """A token whose two experts share a GPU is dispatched once: on a token-level log the replay's comm term
    counts the GPUs each step's tokens reach (eplb.coactivation.step_reach), as `predict` does with that
    reach, not one copy per pick."""
    from eplb.coactivation import step_reach
    from eplb.cost import predict
    from eplb.replay.run import initial_placement, predict_time_us

    rng = np.random.default_rng(0)
    steps, tokens, layers = 6, 256, 2
    pair = rng.integers(0, 8, size=(steps * tokens, layers))  # each token picks experts 2i and 2i + 1
    ids = np.stack([2 * pair, 2 * pair + 1], axis=2).astype(np.int16)
    offsets = np.arange(0, steps * tokens + 1, tokens, dtype=np.int64)
    log = tmp_path / "pairs.npz"
    np.savez(log, topk_ids=ids, step_offsets=offsets, num_experts=np.int64(16))
    model = MODEL_PRESETS["deepseek-v3"].model_copy(update={"num_experts": 16, "top_k": 2, "name": "pairs"})
    setup = CostSetup(model, H800, link_bandwidth(H800, "nic"), 64.0)
    cluster = Cluster(np.full(8, 2, dtype=np.int64))
    out = replay(log, cluster, schedule=Schedule(window=2, interval=2, first=100), cost=setup, oracle_every=0,
                 collect=True)  # fmt: skip
    assert out.steps is not None and not out.rebalances  # the initial placement serves: GPU g holds 2g, 2g + 1
    serving = initial_placement(layers, 16, cluster.slots_per_gpu)
    reach = step_reach(ids, offsets, serving.phy2log, cluster.slots_per_gpu, 16)
    assert np.allclose(reach.sum(axis=2), 1.0)  # every token reaches exactly one GPU
    counts = np.stack([[np.bincount(ids[offsets[s] : offsets[s + 1], layer].ravel(), minlength=16)
                        for layer in range(layers)] for s in range(steps)])  # fmt: skip
    for s in range(steps):
        expected = predict(counts[s], serving.phy2log, cluster.slots_per_gpu, model, H800, setup.link_bw, 64.0,
                           reach=reach[s]).time_us  # fmt: skip
        assert np.allclose(out.steps.time_us[s], expected, rtol=1e-5)
    per_pick = predict_time_us(counts, serving, setup)  # the comm term from counts: one copy per pick
    assert (out.steps.time_us < per_pick * 0.9).all()


def test_time_objective_keeps_a_move_budget() -> None:
    """Under max_moves the time objective adds no co-located variant (its swaps would copy past the budget)."""
    from solvers.registry import Options

    ids, offsets = read_topk(LAW)
    half = int(offsets[offsets.size // 2])
    first = np.stack([np.bincount(ids[:half, layer].ravel(), minlength=64) for layer in range(ids.shape[1])])
    current = solve(first.astype(np.float64), CLUSTER).placement
    summary = summarize(ids[half:], 64)
    loads = summary.loads.astype(np.float64)
    for budget in (0, 5, 40):
        out = solve(loads, CLUSTER, current=current, cost=SETUP, coactivation=summary, objective="time",
                    empty_slots=False, options=Options(max_moves=budget))  # fmt: skip
        assert out.moves is not None and int(out.moves.sum()) <= budget
        assert set(out.solver["layer_choice"]) == {"solver"}
    free = solve(loads, CLUSTER, current=current, cost=SETUP, coactivation=summary, objective="time", empty_slots=False)
    assert set(free.solver["layer_choice"]) != {"solver"}  # without a budget it co-locates


def test_token_log_oracle_row_counts_the_gpus_tokens_reach(tmp_path: Path) -> None:
    """The per-step oracle of a token-level log is timed with its own placement's reach, as every other row."""
    from eplb.coactivation import step_reach
    from eplb.cost import predict
    from solvers.greedy import solve_greedy

    ids, offsets = read_topk(LAW)
    out = replay(LAW, CLUSTER, schedule=Schedule(window=4, interval=4), cost=SETUP, oracle_every=5, collect=True)
    assert out.steps is not None
    for s in (0, 5, 10):
        counts = np.stack([np.bincount(ids[offsets[s] : offsets[s + 1], layer].ravel(), minlength=64)
                           for layer in range(ids.shape[1])]).astype(np.float64)  # fmt: skip
        own = solve_greedy(counts, CLUSTER.slots_per_gpu)
        reach = step_reach(ids[offsets[s] : offsets[s + 1]], [0, offsets[s + 1] - offsets[s]], own,
                           CLUSTER.slots_per_gpu, 64)[0]  # fmt: skip
        expected = predict(counts, own, CLUSTER.slots_per_gpu, SETUP.model, H800, SETUP.link_bw, 4096,
                           reach=reach).time_us  # fmt: skip
        assert np.allclose(out.steps.oracle_time_us[s], expected, rtol=1e-5)
    assert np.isnan(out.steps.oracle_time_us[1]).all()
