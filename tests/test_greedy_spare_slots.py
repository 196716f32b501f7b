"""Greedy on GPUs with more slots than their node's experts, and on nodes whose slots differ: against the no-EPLB
(contiguous) placement and brute-force optima of small layers."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import solvers.greedy
from eplb.evaluate import balance, contiguous_placement
from eplb.io.windows import read_window
from eplb.placement import Placement
from solvers.greedy import solve_greedy
from solvers.validation import duplicate_count
from tests.test_greedy import assert_hot_pair_reaches_no_eplbs_lb

FIXTURES = Path(__file__).parent.parent / "fixtures"


def _busiest(loads: np.ndarray, slots: np.ndarray, phy2log: np.ndarray) -> float:
    """Tokens of the busiest GPU of one layer (loads [1, E])."""
    return float(balance(loads, Placement(phy2log, slots, loads.shape[1])).gpu_loads.max())


def _fillings(slots: int, experts: int) -> np.ndarray:
    """[K, experts] replicas of each expert, for every filling of one GPU's slots: with more slots than experts any
    multiset, else distinct experts (the solvers' rule: no duplicate where the slots allow none)."""
    pick = (itertools.combinations_with_replacement(range(experts), slots) if slots > experts
            else itertools.combinations(range(experts), slots))  # fmt: skip
    return np.array([np.bincount(c, minlength=experts) for c in pick], dtype=np.int64)


def _node_optimum(loads: np.ndarray, slots: tuple[int, ...]) -> float:
    """The least busiest GPU over every placement of experts loads [n] on one node's GPUs (every slot filled, every
    expert placed, uniform shares); the last GPU's fillings enumerated at once."""
    fills = [_fillings(s, loads.size) for s in slots]
    best = np.inf
    for combo in itertools.product(*(range(len(f)) for f in fills[:-1])):
        held = [fills[g][i][None, :] for g, i in enumerate(combo)]
        count = sum(held, np.zeros((1, loads.size), dtype=np.int64)) + fills[-1]  # [K, n]
        ok = (count > 0).all(axis=1)
        if ok.any():
            share = loads / count[ok]
            per_gpu = [(h * share).sum(axis=1) for h in held] + [(fills[-1][ok] * share).sum(axis=1)]
            best = min(best, float(np.max(per_gpu, axis=0).min()))
    return best


def _assignments(groups: int, nodes: int) -> Iterator[tuple[tuple[int, ...], ...]]:
    """Every assignment of groups to nodes in equal counts: a tuple of each node's groups."""
    def rest(left: tuple[int, ...], node: int) -> Iterator[tuple[tuple[int, ...], ...]]:
        if node == nodes:
            yield ()
            return
        for chosen in itertools.combinations(left, groups // nodes):
            for tail in rest(tuple(g for g in left if g not in chosen), node + 1):
                yield (chosen, *tail)
    return rest(tuple(range(groups)), 0)


def _best_over_assignments(
    loads: np.ndarray, slots: np.ndarray, groups: int, per_node: int,
    node_peak: Callable[[np.ndarray, np.ndarray], float],
) -> float:
    """min over assignments of groups to nodes of the busiest node, node_peak(experts loads [n], node slots)."""
    size, nodes = loads.size // groups, slots.size // per_node
    memo: dict[tuple[int, tuple[int, ...]], float] = {}
    best = np.inf
    for assignment in _assignments(groups, nodes):
        worst = 0.0
        for node, chosen in enumerate(assignment):
            if (node, chosen) not in memo:
                experts = np.concatenate([np.arange(g * size, (g + 1) * size) for g in chosen])
                memo[node, chosen] = node_peak(loads[experts], slots[node * per_node:(node + 1) * per_node])
            worst = max(worst, memo[node, chosen])
        best = min(best, worst)
    return best


def _optimum(loads: np.ndarray, slots: np.ndarray, groups: int | None, per_node: int | None) -> float:
    """Brute-force least busiest GPU of one layer loads [E]: global, or groups on nodes in equal counts."""
    if groups is None or per_node is None:
        return _node_optimum(loads, tuple(int(s) for s in slots))
    return _best_over_assignments(loads, slots, groups, per_node,
                                  lambda w, s: _node_optimum(w, tuple(int(v) for v in s)))  # fmt: skip


def _duplicates_only_on_spare_gpus(phy2log: np.ndarray, slots: np.ndarray, node_experts: int) -> bool:
    """Whether a layer's phy2log [P] has no two replicas of one expert on a GPU with at most node_experts slots."""
    gpu = np.repeat(np.arange(slots.size), slots)
    return all(np.unique(phy2log[gpu == g]).size == slots[g] for g in np.flatnonzero(slots <= node_experts))


def test_cli_a_gpu_with_spare_slots_on_each_node_holds_one_expert_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`eplb solve --gpus 4 --gpus-per-node 2 --groups 2 --slots-per-gpu 3,1,3,1` on loads 100, 90, 1, 5 gave lb 2.857
    against 2.041 for no EPLB: whichever node took the hot group, its 3-slot GPU held a replica of both hot experts
    plus a duplicate ({100, 90, 90} | {100}: 140). Three replicas of one expert there ({100, 100, 100} | {90})
    serve 100 and 90: lb 2.041, the baseline's, in both node orders."""
    assert_hot_pair_reaches_no_eplbs_lb(tmp_path, capsys, ("3,1,3,1", "1,3,1,3"))


def test_global_spare_slots_hold_an_expert_no_other_gpu_holds() -> None:
    """Loads 100, 90 on GPUs of 3 and 1 slots (global): the 3-slot GPU holds one expert three times and the other
    GPU the other, the busiest GPU 100 (the fewest duplicates, {100, 90, 90} | {100}, made it 140)."""
    loads, slots = np.array([[100.0, 90]]), np.array([3, 1])
    phy2log = solve_greedy(loads, slots)
    assert _busiest(loads, slots, phy2log) == pytest.approx(100)
    assert np.unique(phy2log[0, :3]).size == 1 and phy2log[0, 3] != phy2log[0, 0]
    assert duplicate_count(phy2log, slots).tolist() == [2]


def test_every_slot_vector_of_the_repro_never_above_no_eplb_where_a_placement_is_not() -> None:
    """The repro's family: 4 experts in 2 groups on 2 nodes x 2 GPUs of 1-4 slots, some GPU with more slots than its
    node's 2 experts (all 240 slot vectors), 3 seeded load vectors each: the busiest GPU is never above the
    contiguous placement's unless every placement's is (brute force), and within 1.1x of the optimum. With the
    fewest duplicates (before), 347 of 2,400 such layers (10 loads per vector) were above the contiguous placement
    although the optimum was not, the worst 1.5x the optimum."""
    rng = np.random.default_rng(31)
    checked = reachable = 0
    for slots in (np.array(s) for s in itertools.product(range(1, 5), repeat=4) if max(s) > 2):
        for _ in range(3):
            loads = np.asarray(rng.pareto(1.0, (1, 4)) * 50 + 1 if rng.random() < 0.5 else rng.integers(1, 200, (1, 4)),
                               dtype=np.float64)
            phy2log = solve_greedy(loads, slots, num_groups=2, gpus_per_node=2)
            ours = _busiest(loads, slots, phy2log)
            base = float(balance(loads, contiguous_placement(1, 4, 4)).gpu_loads.max())
            best = _optimum(loads[0], slots, 2, 2)
            if best <= base * (1 + 1e-9):
                assert ours <= base * (1 + 1e-9), (loads.tolist(), slots.tolist(), phy2log.tolist())
                reachable += 1
            assert ours <= 1.1 * best, (loads.tolist(), slots.tolist(), phy2log.tolist())
            for node in range(2):
                local = phy2log[0, np.repeat(np.arange(4) // 2, slots) == node]
                assert np.unique(local // 2).size == 1  # one group per node
                assert _duplicates_only_on_spare_gpus(local, slots[2 * node:2 * node + 2], 2)
            checked += 1
    assert checked == 720 and reachable > 600


def _spare_case(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, int | None, int | None]:
    """(loads [1, E], slots [G], groups, GPUs per node): a small layer, hierarchical (2-3 nodes of 1-3 GPUs) or global
    (2-3 GPUs), with some GPU of more slots than its node's experts (at most 5 slots, 4 experts per node)."""
    hierarchical = rng.random() < 0.7
    while True:
        if hierarchical:
            nodes, per_node = int(rng.integers(2, 4)), int(rng.integers(1, 4))
            groups = nodes * int(rng.integers(1, 3))
            experts = groups * int(rng.integers(1, 3))
        else:
            nodes, per_node, groups, experts = 1, int(rng.integers(2, 4)), 0, int(rng.integers(2, 5))
        node_experts = experts // nodes
        slots = rng.integers(1, node_experts + 3, size=nodes * per_node)
        if ((slots.reshape(nodes, per_node).sum(axis=1) >= node_experts).all() and (slots > node_experts).any()
                and np.minimum(slots, node_experts).max() <= 4 and slots.max() <= 5):  # fmt: skip
            break
    kind = int(rng.integers(3))
    loads = (rng.pareto(1.0, (1, experts)) * 50 + 1 if kind == 0 else rng.integers(1, 200, (1, experts)) * 1.0
             if kind == 1 else rng.gamma(0.3, 100.0, (1, experts)) + 1e-3)  # fmt: skip
    return loads, slots.astype(np.int64), (groups or None), (per_node if hierarchical else None)


def test_property_spare_slots_within_a_factor_of_the_optimum() -> None:
    """150 seeded small layers (hierarchical or global) with a GPU of more slots than its node's experts: the
    busiest GPU is within 1.4x of the brute-force optimum (4,000 layers of this sampler, 4 seeds: at most 1.353x,
    mean 1.005-1.007; with the fewest duplicates, before, up to 1.84x, mean 1.10, 21-23% of layers above 1.2x), the
    mean within 1.03x; duplicates only on GPUs with more slots than their node's experts, groups on nodes."""
    rng = np.random.default_rng(2027)
    ratios = []
    for _ in range(150):
        loads, slots, groups, per_node = _spare_case(rng)
        phy2log = solve_greedy(loads, slots, num_groups=groups, gpus_per_node=per_node)
        ratio = _busiest(loads, slots, phy2log) / _optimum(loads[0], slots, groups, per_node)
        assert ratio <= 1.4, (loads.tolist(), slots.tolist(), groups, per_node, phy2log.tolist())
        ratios.append(ratio)
        per = slots.size if per_node is None else per_node
        nodes = slots.size // per
        node_of_slot = np.repeat(np.arange(slots.size) // per, slots)
        if groups is not None:
            size = loads.shape[1] // groups
            assert all(np.unique(node_of_slot[phy2log[0] // size == g]).size == 1 for g in range(groups))
        for node in range(nodes):
            local, node_slots = phy2log[0, node_of_slot == node], slots[node * per:(node + 1) * per]
            assert _duplicates_only_on_spare_gpus(local, node_slots, loads.shape[1] // nodes)
    assert float(np.mean(ratios)) <= 1.03


def _unlike_case(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(loads [1, E], slots [G], groups, GPUs per node): 2-3 nodes of 1-3 GPUs whose slots differ from node to node,
    more groups than nodes, no GPU with more slots than its node's experts."""
    while True:
        nodes, per_node = int(rng.integers(2, 4)), int(rng.integers(1, 4))
        groups = nodes * 2
        experts = groups * int(rng.integers(1, 3))
        node_experts = experts // nodes
        slots = rng.integers(1, node_experts + 1, size=nodes * per_node)
        node_slots = slots.reshape(nodes, per_node)
        if (node_slots.sum(axis=1) >= node_experts).all() and np.unique(node_slots, axis=0).shape[0] > 1:
            break
    loads = rng.pareto(1.0, (1, experts)) * 50 + 1 if rng.random() < 0.5 else rng.integers(1, 200, (1, experts)) * 1.0
    return loads, slots.astype(np.int64), groups, per_node


def test_property_unlike_nodes_take_the_groups_they_carry_best() -> None:
    """300 seeded small layers on nodes whose slots differ: the busiest GPU against the best assignment of groups
    to nodes (equal counts; brute force over every assignment, each node placed as greedy places it alone).
    Bins of equal tokens suit alike nodes; on unlike ones the groups are swapped between nodes while that lowers
    the busiest. At the best on at least 95% of the layers and never above 1.25x (4,000 layers of this sampler, 4
    seeds: 98.1-98.5% at it, the worst 1.18x; with the packing's bins alone, before, 77-78%, the worst 1.38x)."""
    rng = np.random.default_rng(808)
    at_best = 0
    for _ in range(300):
        loads, slots, groups, per_node = _unlike_case(rng)
        ours = _busiest(loads, slots, solve_greedy(loads, slots, num_groups=groups, gpus_per_node=per_node))
        best = _best_over_assignments(loads[0], slots, groups, per_node,
                                      lambda w, s: _busiest(w[None, :], s, solve_greedy(w[None, :], s)))  # fmt: skip
        assert ours <= 1.25 * best, (loads.tolist(), slots.tolist(), groups, per_node)
        at_best += ours <= best * (1 + 1e-9)
    assert at_best >= 285


def test_budget_whose_nodes_differ_swaps_groups_on_a_shipped_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """prefill-in4096 on 4 nodes x 8 GPUs under per-GPU budgets of 20 GiB on three nodes and 29 on the fourth
    (DeepSeek-V3: 8 and 12 slots per GPU, 288 in all, as --redundant 32): the groups swapped between nodes give no
    layer a busier GPU than the packing's bins did (MAX_GROUP_SWAP_ROUNDS 0), and the mean lb falls by more than
    0.005 (1.3318 to 1.3218)."""
    loads = read_window(FIXTURES / "sglang6017-dsv3-prefill-in4096.json").loads
    slots = np.repeat([8, 8, 8, 12], 8)
    ours = balance(loads, Placement(solve_greedy(loads, slots, num_groups=8, gpus_per_node=8), slots, 256)).lb
    monkeypatch.setattr(solvers.greedy, "MAX_GROUP_SWAP_ROUNDS", 0)
    bins = balance(loads, Placement(solve_greedy(loads, slots, num_groups=8, gpus_per_node=8), slots, 256)).lb
    assert np.all(ours <= bins * (1 + 1e-12))
    assert ours.mean() < bins.mean() - 0.005


def test_group_swaps_stand_down_where_a_round_would_try_too_many(monkeypatch: pytest.MonkeyPatch) -> None:
    """256 groups on 4 unlike nodes: each round would try 64^2 x 3 swaps, each placing two nodes again (minutes
    for 61 layers); beyond MAX_GROUP_SWAP_CANDIDATES the bins' assignment stands, exactly as with no swap rounds."""
    rng = np.random.default_rng(5)
    loads = rng.pareto(1.2, (2, 256)) + 0.01
    slots = np.array([9] * 16 + [8] * 16)
    placed = solve_greedy(loads, slots, num_groups=256, gpus_per_node=8)
    monkeypatch.setattr(solvers.greedy, "MAX_GROUP_SWAP_ROUNDS", 0)
    assert np.array_equal(placed, solve_greedy(loads, slots, num_groups=256, gpus_per_node=8))


def test_parked_duplicates_occupy_no_more_gpus_than_the_replica_cap() -> None:
    """max_replicas caps the GPUs that hold an expert: the extra slots of a GPU with more slots than experts hold
    duplicates of one it holds, which occupy no other GPU."""
    rng = np.random.default_rng(11)
    for _ in range(200):
        loads = rng.integers(1, 100, (1, 6)).astype(np.float64)
        slots = np.array([int(rng.integers(7, 10)), 1])
        for cap in (1, 2):
            placed = solve_greedy(loads, slots, max_replicas=cap)
            gpu = np.repeat(np.arange(2), slots)
            holders = [len(set(gpu[placed[0] == e].tolist())) for e in range(6)]
            assert max(holders) <= cap, (loads, slots, cap, placed)
