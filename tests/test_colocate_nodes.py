"""Co-location on nodes (`solvers.coactivation.refine_on_nodes`, `pack_within_nodes`) and its use by the time
objective over two links."""

from __future__ import annotations

import numpy as np

from eplb.coactivation import CoactivationSummary, copies_per_token, pair_counts, summarize
from eplb.solve import Cluster, CostSetup, solve
from eplb.specs import HARDWARE_PRESETS, MODEL_PRESETS, all_to_all_links
from solvers.coactivation import pack_within_nodes, refine_on_nodes
from solvers.greedy import solve_greedy
from solvers.validation import duplicate_count, duplicate_free_possible

EXPERTS, GPUS, PER_NODE, SLOTS = 32, 8, 4, 5


def _teams_log(tokens: int, seed: int = 0) -> np.ndarray:
    """Tokens pick 4 of the 8 experts of one of 4 teams (team t: experts t, t + 4, ..., every 4th id): teams
    that contiguous or load-only placements spread over both nodes. [tokens, 1, 4]."""
    rng = np.random.default_rng(seed)
    team = rng.integers(0, 4, size=tokens)
    picks = np.stack([rng.choice(8, size=4, replace=False) for _ in range(tokens)])
    return (team[:, None] + 4 * picks)[:, None, :].astype(np.int16)


def _node_loads(p2l: np.ndarray, loads: np.ndarray, slots: np.ndarray) -> np.ndarray:
    reps = np.bincount(p2l, minlength=loads.size)
    gpu = np.repeat(np.arange(slots.size), slots)
    return np.bincount(gpu // PER_NODE, weights=loads[p2l] / reps[p2l], minlength=slots.size // PER_NODE)


def test_pack_within_nodes_keeps_what_each_node_holds_and_balances_its_gpus() -> None:
    rng = np.random.default_rng(1)
    slots = np.full(GPUS, SLOTS, dtype=np.int64)
    loads = rng.pareto(1.5, size=(3, EXPERTS)) * 100 + 1
    start = solve_greedy(loads, slots)
    shuffled = start.copy()
    for layer in range(3):  # a bad arrangement inside each node: its slots sorted by expert id
        for v in range(GPUS // PER_NODE):
            a, b = v * PER_NODE * SLOTS, (v + 1) * PER_NODE * SLOTS
            shuffled[layer, a:b] = np.sort(shuffled[layer, a:b])
    packed = pack_within_nodes(shuffled, loads, slots, PER_NODE)
    gpu = np.repeat(np.arange(GPUS), slots)
    for layer in range(3):
        for v in range(GPUS // PER_NODE):
            a, b = v * PER_NODE * SLOTS, (v + 1) * PER_NODE * SLOTS
            assert sorted(packed[layer, a:b].tolist()) == sorted(shuffled[layer, a:b].tolist())
        reps = np.bincount(packed[layer], minlength=EXPERTS)
        w = np.bincount(gpu, weights=loads[layer][packed[layer]] / reps[packed[layer]], minlength=GPUS)
        w0 = np.bincount(gpu, weights=loads[layer][shuffled[layer]] / reps[shuffled[layer]], minlength=GPUS)
        assert w.max() <= w0.max() + 1e-9
    assert int(duplicate_count(packed, slots).sum()) == 0


def test_refine_on_nodes_puts_experts_chosen_together_on_one_node_within_the_cap() -> None:
    ids = _teams_log(4000)
    loads = np.bincount(ids[:, 0].ravel(), minlength=EXPERTS).astype(np.float64)[None, :]
    slots = np.full(GPUS, SLOTS, dtype=np.int64)
    start = solve_greedy(loads, slots)
    pairs = pair_counts(ids, EXPERTS).astype(np.float64)
    (refined,) = refine_on_nodes(loads, start, slots, PER_NODE, pairs, [0.02])
    before = copies_per_token(ids, start, slots, EXPERTS, gpus_per_node=PER_NODE).nodes.mean()
    after = copies_per_token(ids, refined, slots, EXPERTS, gpus_per_node=PER_NODE).nodes.mean()
    assert after < before - 0.3  # teams gathered: most tokens reach one node
    cap = _node_loads(start[0], loads[0], slots).max() * 1.02 + 1e-6
    assert _node_loads(refined[0], loads[0], slots).max() <= cap
    assert np.array_equal(np.bincount(refined[0], minlength=EXPERTS), np.bincount(start[0], minlength=EXPERTS))
    assert int(duplicate_count(refined, slots).sum()) == 0


def _teams_over_two_links() -> tuple[CoactivationSummary, np.ndarray, CostSetup, Cluster]:
    """The teams log's summary and loads [1, E], a small DeepSeek-V3-like model over nvlink+nic, 2 nodes."""
    summary = summarize(_teams_log(4000), EXPERTS)
    hw = HARDWARE_PRESETS["h800"]
    within, between = all_to_all_links(hw, "nvlink+nic")
    model = MODEL_PRESETS["deepseek-v3"].model_copy(update={"num_experts": EXPERTS, "top_k": 4, "name": "teams"})
    setup = CostSetup(model, hw, within, 256.0, inter_node_bw=between)
    return summary, summary.loads.astype(np.float64), setup, Cluster(np.full(GPUS, SLOTS, dtype=np.int64), PER_NODE)


def test_time_objective_over_two_links_takes_node_colocation_when_it_is_faster() -> None:
    summary, loads, setup, cluster = _teams_over_two_links()
    lb = solve(loads, cluster, cost=setup, coactivation=summary)
    by_time = solve(loads, cluster, cost=setup, coactivation=summary, objective="time")
    assert any(name.startswith("co-locate on nodes") for name in by_time.solver["layer_choice"])
    assert by_time.prediction is not None and lb.prediction is not None
    assert by_time.prediction.total_time_us < lb.prediction.total_time_us * 0.95
    assert setup.inter_node_bw is not None
    one_link = CostSetup(setup.model, setup.hardware, setup.inter_node_bw, 256.0)  # no nodes in the comm term
    plain = solve(loads, cluster, cost=one_link, coactivation=summary, objective="time")
    assert "co-locate on nodes lb+0.5%" not in plain.solver["candidates"]


def test_pack_within_nodes_gives_replicas_on_one_node_distinct_gpus() -> None:
    """One node of 2 GPUs x 3 slots holding X (10), Y, Z, W (1 each) and two replicas of A: heaviest first
    fills [X A A | Y Z W]; a swap splits the replicas, so A lands on both GPUs."""
    x, a, y, z, w = 0, 1, 2, 3, 4
    p2l = np.array([[x, a, y, z, w, a]])
    loads = np.array([[10.0, 1.0, 1.0, 1.0, 1.0]])
    packed = pack_within_nodes(p2l, loads, np.array([3, 3]), 2)
    assert int(duplicate_count(packed, np.array([3, 3])).sum()) == 0
    assert sorted(packed[0].tolist()) == sorted(p2l[0].tolist())


def test_pack_within_nodes_removes_a_duplicate_no_single_swap_can() -> None:
    """One node of GPUs with 2, 1 and 3 slots holding expert 0 three times, 1 twice and 2 once (loads 2, 5, 18):
    heaviest first fills [2 0 | 1 | 1 0 0], and no swap removes the second 0 (GPU 1, the only GPU without a 0,
    holds a 1, which GPU 2 has). The 3-slot GPU must hold all three experts; greedy's repair finds it by a chain."""
    slots = np.array([2, 1, 3])
    packed = pack_within_nodes(np.array([[0, 0, 1, 0, 2, 1]]), np.array([[2.0, 5.0, 18.0]]), slots, 3)
    assert int(duplicate_count(packed, slots).sum()) == 0
    assert sorted(packed[0, 3:].tolist()) == [0, 1, 2] and sorted(packed[0].tolist()) == [0, 0, 0, 1, 1, 2]


def test_property_pack_within_nodes_leaves_no_duplicate_a_node_can_avoid() -> None:
    """2,000 seeded random pairs of nodes (2-4 GPUs of 1-4 slots, 2-6 experts, any replica counts, not only those
    refine_on_nodes leaves): wherever a node's counts fit its GPUs without two of one expert on one GPU
    (Gale-Ryser), the packing has none (single swaps left one on 59 of these 3,022 nodes), and each node keeps what
    it holds."""
    rng = np.random.default_rng(31)
    avoidable = 0
    for _ in range(2000):
        per_node, experts = int(rng.integers(2, 5)), int(rng.integers(2, 7))
        slots = np.tile(rng.integers(1, min(5, experts + 1), size=per_node), 2).astype(np.int64)  # two nodes
        experts = min(experts, int(slots.sum()))
        p2l = rng.integers(0, experts, size=(1, int(slots.sum())))
        p2l[0, :experts] = np.arange(experts)  # every expert somewhere
        loads = rng.integers(1, 20, size=(1, experts)).astype(np.float64)
        packed = pack_within_nodes(p2l, loads, slots, per_node)
        half = int(slots[:per_node].sum())
        for part in (slice(0, half), slice(half, None)):
            counts = np.bincount(p2l[0, part], minlength=experts)[None, :]
            assert np.array_equal(np.bincount(packed[0, part], minlength=experts)[None, :], counts)
            if duplicate_free_possible(counts, slots[:per_node])[0]:
                avoidable += 1
                assert int(duplicate_count(packed[:, part], slots[:per_node])[0]) == 0, (slots.tolist(), p2l.tolist())
    assert avoidable > 3000


def test_node_colocation_survives_the_relabelling_onto_a_serving_placement() -> None:
    """Against a serving placement the time objective's pick is relabelled with whole nodes (two links), so
    its co-location on nodes is kept: every node holds what it holds in the solve from scratch."""
    summary, loads, setup, cluster = _teams_over_two_links()
    served = solve(np.roll(loads, 5, axis=1), cluster).placement
    fresh = solve(loads, cluster, cost=setup, coactivation=summary, objective="time", empty_slots=False)
    again = solve(loads, cluster, solver="greedy", cost=setup, coactivation=summary, objective="time",
                  current=served)  # fmt: skip
    assert fresh.solver["layer_choice"][0].startswith("co-locate on nodes")
    held = [sorted(sorted(node) for node in o.placement.phy2log[0].reshape(GPUS // PER_NODE, -1).tolist())
            for o in (fresh, again)]  # fmt: skip
    assert held[0] == held[1]
    assert again.moves is not None and int(again.moves.sum()) > 0
