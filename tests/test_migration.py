"""Relabelling GPUs against the current placement and counting the weights to copy, and where from."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from eplb.cost.migration import plan_copies, plan_for
from solvers.greedy import solve_greedy
from solvers.loads import gpu_loads
from solvers.migration import arrange_slots, count_moves, relabel_gpus, relabel_slot_order
from solvers.plan import PlanError


def gpu_sets(phy2log: NDArray[np.int64], slots: NDArray[np.int64]) -> list[list[frozenset[int]]]:
    starts = np.concatenate([[0], np.cumsum(slots)[:-1]])
    return [[frozenset(row[a : a + s].tolist()) for a, s in zip(starts, slots, strict=True)] for row in phy2log]


def test_counts_weights_copied_onto_gpus() -> None:
    slots = np.array([2, 2])
    current = np.array([[0, 1, 2, 3]])
    assert count_moves(current, current, slots).tolist() == [0]
    assert count_moves(np.array([[1, 0, 3, 2]]), current, slots).tolist() == [0]  # slots inside a GPU
    assert count_moves(np.array([[0, 2, 1, 3]]), current, slots).tolist() == [2]
    assert count_moves(np.array([[2, 3, 0, 1]]), current, slots).tolist() == [4]  # until relabelled


def test_relabel_swaps_whole_gpus_and_keeps_slots() -> None:
    slots = np.array([2, 2])
    current = np.array([[0, 1, 2, 3]])
    relabeled = relabel_gpus(np.array([[3, 2, 1, 0]]), current, slots)
    np.testing.assert_array_equal(relabeled, current)
    assert count_moves(relabeled, current, slots).tolist() == [0]


def test_relabel_only_exchanges_gpus_with_the_same_slot_count() -> None:
    slots = np.array([1, 2, 1])
    current = np.array([[0, 1, 2, 3]])
    new = np.array([[3, 1, 2, 0]])  # GPU 0 and GPU 2 swapped: both have 1 slot
    np.testing.assert_array_equal(relabel_gpus(new, current, slots), current)
    new = np.array([[1, 0, 3, 2]])  # would need the 1-slot and 2-slot GPUs exchanged
    relabeled = relabel_gpus(new, current, slots)
    assert [len(s) for s in gpu_sets(relabeled, slots)[0]] == [1, 2, 1]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), num_gpus=st.integers(2, 4), layers=st.integers(1, 3))
def test_relabel_is_the_best_permutation(seed: int, num_gpus: int, layers: int) -> None:
    rng = np.random.default_rng(seed)
    slots = rng.integers(1, 4, size=num_gpus).astype(np.int64)
    num_experts = int(slots.max()) + int(rng.integers(0, 3))
    if slots.sum() < num_experts:
        slots[0] += num_experts - int(slots.sum())
        num_experts = max(num_experts, int(slots.max()))
    loads = rng.gamma(0.7, 10.0, size=(layers, num_experts))
    current = solve_greedy(loads, slots)
    new = solve_greedy(loads * rng.lognormal(0, 0.5, size=loads.shape), slots)
    relabeled, source = relabel_slot_order(new, current, slots)
    moves = count_moves(relabeled, current, slots)
    assert np.all(moves <= count_moves(new, current, slots))
    np.testing.assert_array_equal(np.take_along_axis(new, source, axis=1), relabeled)
    for layer in range(layers):
        # same GPUs up to labels: the multiset of (slot count, expert set) is unchanged
        before = sorted(zip(slots.tolist(), map(sorted, gpu_sets(new, slots)[layer]), strict=True))
        after = sorted(zip(slots.tolist(), map(sorted, gpu_sets(relabeled, slots)[layer]), strict=True))
        assert before == after
        # no permutation among equal-slot GPUs does better
        best = None
        sets_new = gpu_sets(new, slots)[layer]
        sets_cur = gpu_sets(current, slots)[layer]
        for perm in itertools.permutations(range(num_gpus)):
            if any(slots[p] != slots[g] for g, p in enumerate(perm)):
                continue
            cost = sum(len(sets_new[g] - sets_cur[p]) for g, p in enumerate(perm))
            best = cost if best is None else min(best, cost)
        assert moves[layer] == best
        # experts kept on a GPU keep their slot
        assert _misplaced(relabeled[layer], current[layer], slots) == 0
    np.testing.assert_allclose(
        np.sort(gpu_loads(loads, relabeled, slots), axis=1), np.sort(gpu_loads(loads, new, slots), axis=1)
    )


def _misplaced(new: NDArray[np.int64], cur: NDArray[np.int64], slots: NDArray[np.int64]) -> int:
    """Replicas a GPU keeps (multiset intersection) that are not in their current slot."""
    starts = np.concatenate([[0], np.cumsum(slots)[:-1]])
    out = 0
    for a, s in zip(starts, slots, strict=True):
        n, c = new[a : a + s].tolist(), cur[a : a + s].tolist()
        kept = sum(min(n.count(e), c.count(e)) for e in set(n))
        out += kept - sum(1 for x, y in zip(n, c, strict=True) if x == y)
    return out


def test_relabel_is_identity_on_the_current_placement() -> None:
    rng = np.random.default_rng(0)
    loads = rng.gamma(0.7, 10.0, size=(3, 16))
    slots = np.array([5, 5, 4, 6])
    current = solve_greedy(loads, slots)
    np.testing.assert_array_equal(relabel_gpus(current, current, slots), current)


def test_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="layers"):
        count_moves(np.zeros((1, 4), np.int64), np.zeros((2, 4), np.int64), np.array([2, 2]))
    with pytest.raises(ValueError, match="sum"):
        relabel_gpus(np.zeros((1, 4), np.int64), np.zeros((1, 4), np.int64), np.array([2, 3]))


def test_arrange_slots_keeps_gpus_and_puts_kept_experts_back() -> None:
    slots = np.array([3, 2])
    current = np.array([[0, 1, 2, 3, 4]])
    new = np.array([[2, 0, 4, 1, 3]])  # GPU 0 holds {0, 2, 4}: 0 and 2 stay, 4 lands; GPU 1 {1, 3}
    arranged = arrange_slots(new, current, slots)
    np.testing.assert_array_equal(arranged, [[0, 4, 2, 3, 1]])
    assert gpu_sets(arranged, slots) == gpu_sets(new, slots)
    assert count_moves(arranged, current, slots).tolist() == [2]


def test_relabel_keeps_hierarchical_groups_on_their_nodes() -> None:
    rng = np.random.default_rng(3)
    slots = np.full(8, 5, dtype=np.int64)  # 2 nodes of 4 GPUs, 4 groups of 8 experts
    old, new = rng.gamma(0.5, 100.0, size=(2, 6, 32))
    current = solve_greedy(old, slots, num_groups=4, gpus_per_node=4)
    fresh = solve_greedy(new, slots, num_groups=4, gpus_per_node=4)
    gpu_node = np.repeat(np.arange(8), 5) // 4

    def spread(p: NDArray[np.int64]) -> int:
        on = np.zeros((6, 4, 2), dtype=bool)
        on[np.arange(6)[:, None], p // 8, gpu_node[None, :]] = True
        return int(on.sum(axis=2).max())

    assert spread(current) == spread(fresh) == 1
    assert spread(relabel_gpus(fresh, current, slots)) > 1  # free relabelling splits groups across nodes
    kept = relabel_gpus(fresh, current, slots, gpus_per_node=4)
    assert spread(kept) == 1
    assert np.all(count_moves(kept, current, slots) <= count_moves(fresh, current, slots))


def _empty_some(row: NDArray[np.int64], rng: np.random.Generator) -> None:
    """Empty (-1) some redundant replicas of row [P] in place; every expert keeps one."""
    for s in rng.permutation(row.size):
        if row[s] >= 0 and (row == row[s]).sum() > 1 and rng.random() < 0.3:
            row[s] = -1


def random_aligned_pair(rng: np.random.Generator, gpus: int, slots_each: int, empties: bool) -> tuple[
        NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:  # fmt: skip
    """(current, new [3, P], slots [G]): random placements of E <= P experts, every expert held in every layer;
    new rewrites random slots with experts their GPU does not hold (so it is aligned: nothing a GPU keeps
    moves), which makes swaps and longer cycles of copies across GPUs and nodes; with empties, some redundant
    replicas of both are -1."""
    slots = np.full(gpus, slots_each, dtype=np.int64)
    p = gpus * slots_each
    e = int(rng.integers(max(1, p // 2), p + 1))
    gpu = np.repeat(np.arange(gpus), slots)
    cur = np.stack([rng.permutation(np.concatenate([np.arange(e), rng.integers(0, e, p - e)])) for _ in range(3)])
    new = cur.copy()
    for layer in range(3):
        if empties:
            _empty_some(cur[layer], rng)
        row = cur[layer].copy()
        for s in rng.choice(p, size=int(rng.integers(0, p + 1)), replace=False):
            options = np.setdiff1d(np.arange(e), cur[layer, gpu == gpu[s]])
            if options.size:
                row[s] = rng.choice(options)
        if np.setdiff1d(np.arange(e), row).size:  # an expert lost: keep the layer as it is
            row = cur[layer].copy()
        if empties:
            _empty_some(row, rng)
        new[layer] = row
    return cur, new, slots


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 100_000), per_node=st.integers(1, 3), nodes=st.integers(2, 3),
       stage_copies=st.sampled_from([None, 1, 2, 4]), empties=st.booleans())
def test_the_estimate_counts_the_plans_copies(seed: int, per_node: int, nodes: int, stage_copies: int | None,
                                             empties: bool) -> None:
    """The migration estimate (`eplb.cost.migration`, what the cost trigger charges) counts the plan's copies: into
    each GPU, out of each GPU, and into each GPU from another node. Without a stage budget a copy crosses nodes
    exactly when its expert has no replica on the destination's node; a budget may add copies that read across
    the NIC to break a cycle longer than the budget, and the estimate follows the plan under the same budget."""
    rng = np.random.default_rng(seed)
    cur, new, slots = random_aligned_pair(rng, per_node * nodes, int(rng.integers(2, 4)), empties)
    try:
        plan = plan_for(new, cur, slots, per_node, stage_copies)
    except PlanError as exc:  # only a cycle longer than the budget may refuse
        assert stage_copies is not None and "at least" in str(exc)
        return
    gpus = slots.size
    into, sent, across = plan_copies(plan, gpus, per_node)
    # into each GPU: the experts it holds in the new placement and not in the serving one, counted apart from the plan
    arrived = [[len(n - c - {-1}) for n, c in zip(new_layer, cur_layer, strict=True)]
               for new_layer, cur_layer in zip(gpu_sets(new, slots), gpu_sets(cur, slots), strict=True)]
    assert into.tolist() == np.sum(arrived, axis=0).tolist()
    assert sent.sum() == into.sum() and np.all(across <= into)  # one source per copy; across is a part of into
    # the rule without a budget, counted apart from the plan: copies of an expert the destination's node lacks
    node = np.repeat(np.arange(gpus), slots) // per_node
    none_near = 0
    for i in np.flatnonzero(~plan.local):
        layer, dst_node = plan.layer[i], plan.dst_gpu[i] // per_node
        none_near += int(not np.any((cur[layer] == plan.expert[i]) & (node == dst_node)))
    if stage_copies is None:
        assert across.sum() == none_near
    else:
        assert across.sum() >= none_near
    assert plan_copies(plan, gpus, None)[2].sum() == 0  # one node: nothing crosses


def test_the_estimate_counts_a_read_across_nodes_that_breaks_a_cycle() -> None:
    """Expert 0 on GPU 0 (node 0, stays) and GPU 2 (node 1); GPU 2 takes 6 from GPU 3 and GPU 3 takes 0. Without a
    budget the copy of 0 reads GPU 2's replica (node 1) in the stage that overwrites it: nothing crosses. With
    one copy per stage the two copies cannot share a stage, so the copy of 0 reads GPU 0's across the NIC, and the
    estimate counts it (it used to count only copies of an expert the node lacks: none)."""
    slots = np.array([2, 2, 2, 2])  # 2 nodes of 2 GPUs
    current = np.array([[0, 1, 2, 3, 0, 4, 5, 6]])
    new = np.array([[0, 1, 2, 3, 6, 4, 5, 0]])
    assert plan_copies(plan_for(new, current, slots, 2), 4, 2)[2].tolist() == [0, 0, 0, 0]
    _, sent, across = plan_copies(plan_for(new, current, slots, 2, stage_copies=1), 4, 2)
    assert across.tolist() == [0, 0, 0, 1]
    assert sent.tolist() == [1, 0, 0, 1]


def test_the_estimate_from_the_solves_plan_equals_the_one_it_builds() -> None:
    """Replay passes `rebalance_cost` the plan its solve built (`Outcome.plan`, with the cluster's GPUs per node)
    instead of the estimate building it again: on every ordered pair of shipped windows (the embedded one and
    fixtures/sglang6017-*.json), EP32 in 4 nodes of 8 over NVLink + NIC, from a serving greedy placement to
    incremental (a move budget and none) and fresh greedy, global and hierarchical, the bytes into, out of and
    across nodes are the plan's either way, and so is the cost."""
    from pathlib import Path

    from eplb.cost.migration import MigrationSpec, plan_copies, plan_for
    from eplb.io.windows import read_window
    from eplb.solve import Cluster, CostSetup, evaluate, solve
    from eplb.specs import HARDWARE_PRESETS, MODEL_PRESETS, all_to_all_links
    from solvers.registry import Options

    shipped = sorted((Path(__file__).resolve().parents[1] / "fixtures").glob("sglang6017-*.json"))
    windows = [read_window(None).loads, *(read_window(str(p)).loads for p in shipped)]
    model, hardware = MODEL_PRESETS["deepseek-v3"], HARDWARE_PRESETS["h800"]
    nvlink, nic = all_to_all_links(hardware, "nvlink+nic")
    cost = CostSetup(model, hardware, nvlink, 256.0, inter_node_bw=nic)
    spec = MigrationSpec(nvlink, hbm_bw=hardware.hbm_bandwidth, inter_node_bw=nic, gpus_per_node=8)
    slots = np.full(32, 9, dtype=np.int64)
    across, ignored = 0.0, 0
    for cluster in (Cluster(slots, gpus_per_node=8), Cluster(slots, gpus_per_node=8, num_groups=8)):
        for before, after in itertools.permutations(windows, 2):
            serving = solve(before, cluster, solver="greedy").placement
            pred = evaluate(after, serving, cost, gpus_per_node=8).prediction
            assert pred is not None
            for kwargs in ({"options": Options(max_moves=2_000)}, {}, {"solver": "greedy"}):
                out = solve(after, cluster, current=serving, cost=cost, **kwargs)
                assert out.plan is not None
                args = (out.placement.phy2log, serving.phy2log, slots, model.expert_bytes, pred)
                given, built = spec.rebalance_cost(*args, out.plan), spec.rebalance_cost(*args)
                assert given == built and given.bytes > 0, kwargs
                across += float(plan_copies(out.plan, 32, 8)[2].sum())
                nodeless = plan_for(out.placement.phy2log, serving.phy2log, slots)  # sources read anywhere
                ignored += spec.rebalance_cost(*args, nodeless) == given
    assert across > 0  # copies read on other nodes: the NIC's share is counted both ways
    assert ignored < 36  # the plan given is the one counted: read without nodes, some of them cost otherwise


@pytest.mark.parametrize(("solver", "split"), [("greedy", "uniform"), ("incremental", "uniform"),
                                                ("milp", "uniform"), ("milp", "weighted")])
def test_a_layer_without_tokens_keeps_its_serving_placement(solver: str, split: str) -> None:
    """Nothing to balance, nothing to copy: a window's idle layer keeps the serving placement whatever the
    solver, and the other layers are solved as without it."""
    from eplb.placement import Placement
    from eplb.solve import Cluster, solve
    from solvers.registry import Options

    rng = np.random.default_rng(7)
    slots = np.full(4, 5, dtype=np.int64)
    old, new = rng.gamma(0.5, 100, (2, 3, 16))
    current = Placement(solve_greedy(old, slots), slots, 16)
    idle = new.copy()
    idle[1] = 0.0
    options = Options(time_limit_s=2.0) if solver == "milp" else None
    with_idle = solve(idle, Cluster(slots), solver=solver, current=current, options=options, split=split)
    assert with_idle.moves is not None and with_idle.moves[1] == 0
    assert np.array_equal(with_idle.placement.phy2log[1], current.phy2log[1])
    if split == "weighted":  # the serving layer's shares come with it: uniform, as it serves
        assert with_idle.placement.shares is not None
        np.testing.assert_allclose(with_idle.placement.shares[1], current.slot_shares()[1])
    if solver != "milp":  # time-limited: the busy layers' answers may differ between runs
        busy = solve(new, Cluster(slots), solver=solver, current=current, options=options)
        assert busy.moves is not None and busy.moves[1] > 0  # the same layer with tokens moves
        assert np.array_equal(with_idle.placement.phy2log[[0, 2]], busy.placement.phy2log[[0, 2]])
