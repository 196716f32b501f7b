"""Migration plans: applied stage by stage they give the new placement, servable after every stage."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb.cli import main
from eplb.io.windows import read_window
from eplb.placement import load_placement
from solvers.greedy import solve_greedy
from solvers.incremental import rebalance
from solvers.migration import count_moves, relabel_gpus
from solvers.plan import MigrationPlan, PlanError, apply_plan, build_plan
from tests.test_migration import random_aligned_pair

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
EXPERT_BYTES = 44_040_192.0  # DeepSeek-V3: 3 x 7168 x 2048 fp8 weights


def test_a_swap_is_one_stage_and_two_copies() -> None:
    slots = np.array([2, 2])
    current = np.array([[0, 1, 2, 3]])
    new = np.array([[0, 2, 1, 3]])  # experts 1 and 2 trade GPUs: each reads the slot the other overwrites
    plan = build_plan(current, new, slots, EXPERT_BYTES)
    assert plan.num_copies == 2 == count_moves(new, current, slots).sum()
    assert plan.num_stages == 1
    assert sorted(zip(plan.expert.tolist(), plan.src_gpu.tolist(), plan.dst_gpu.tolist(), strict=True)) == [
        (1, 0, 1),
        (2, 1, 0),
    ]
    np.testing.assert_array_equal(apply_plan(current, plan), new)
    with pytest.raises(PlanError, match="at least"):
        build_plan(current, new, slots, EXPERT_BYTES, stage_bytes=EXPERT_BYTES)  # the cycle needs two copies


def test_apply_catches_a_plan_in_the_wrong_order() -> None:
    slots = np.array([2, 2])
    current = np.array([[0, 1, 2, 3]])
    new = np.array([[0, 2, 1, 3]])
    plan = build_plan(current, new, slots, EXPERT_BYTES)
    broken = type(plan)(**{**plan.__dict__, "stage": np.arange(plan.stage.size)})  # split the cycle
    with pytest.raises(PlanError, match=r"no replica|read from"):
        apply_plan(current, broken)


def test_sources_prefer_replicas_that_stay() -> None:
    slots = np.array([2, 2, 2])
    current = np.array([[0, 1, 0, 2, 3, 4]])  # expert 0 on GPUs 0 and 1
    new = np.array([[0, 1, 3, 2, 0, 4]])  # GPU 1 trades its 0 for the 3, GPU 2 trades the 3 for a 0
    plan = build_plan(current, new, slots)
    copy_of_0 = int(np.flatnonzero(plan.expert == 0)[0])
    assert plan.src_gpu[copy_of_0] == 0  # GPU 0's replica stays put; GPU 1's slot is overwritten
    np.testing.assert_array_equal(apply_plan(current, plan), new)


def test_a_second_replica_on_one_gpu_is_a_local_write() -> None:
    slots = np.array([3, 3])
    current = np.array([[0, 1, 2, 3, 4, 0]])
    new = np.array([[0, 0, 2, 3, 4, 1]])  # GPU 0 doubles expert 0 (local) over the 1, which moves to GPU 1
    plan = build_plan(current, new, slots, EXPERT_BYTES)
    assert plan.local.sum() == 1 and plan.num_copies == 1 == count_moves(new, current, slots).sum()
    np.testing.assert_array_equal(apply_plan(current, plan), new)
    assert plan.to_dict()["total_bytes"] == EXPERT_BYTES


@pytest.mark.parametrize("gpus, slots_each", [(32, 9), (64, 5)])
def test_real_drift_plans_apply_and_respect_the_stage_budget(gpus: int, slots_each: int) -> None:
    slots = np.full(gpus, slots_each, dtype=np.int64)
    current = solve_greedy(read_window("fixtures/sglang6017-dsv3-prefill-in4096.json").loads, slots)
    decode = read_window("fixtures/sglang6017-dsv3-decode-in1000out1000.json").loads
    fresh = relabel_gpus(solve_greedy(decode, slots), current, slots)
    incremental, _, _ = rebalance(decode, current, slots, max_moves=1500)
    for new, stage_bytes in ((fresh, 4 * 2**30), (incremental, 2**30), (incremental, None)):
        plan = build_plan(current, new, slots, EXPERT_BYTES, stage_bytes)
        assert plan.num_copies == count_moves(new, current, slots).sum()
        np.testing.assert_array_equal(apply_plan(current, plan), new)
        per_stage = np.bincount(plan.stage[~plan.local], minlength=plan.num_stages) * EXPERT_BYTES
        if stage_bytes is None:  # one stage per layer with copies
            assert plan.num_stages == np.unique(plan.layer).size
        else:
            assert per_stage.max() <= stage_bytes
            assert plan.num_stages >= plan.num_copies * EXPERT_BYTES / stage_bytes
        data = plan.to_dict()
        assert data["num_copies"] == plan.num_copies == sum(len(s["copies"]) for s in data["stages"])
        assert [s["bytes"] for s in data["stages"]] == per_stage.tolist()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 100_000), budget=st.sampled_from([None, 4, 9]), gpus_per_node=st.sampled_from([None, 1, 2]))
def test_random_plans_apply_stage_by_stage(seed: int, budget: int | None, gpus_per_node: int | None) -> None:
    rng = np.random.default_rng(seed)
    num_gpus = int(rng.integers(2, 6))
    slots = rng.integers(1, 5, size=num_gpus).astype(np.int64)
    num_experts = int(rng.integers(1, int(slots.sum()) + 1))
    current = solve_greedy(rng.gamma(0.5, 10.0, size=(3, num_experts)), slots)
    new = relabel_gpus(solve_greedy(rng.gamma(0.5, 10.0, size=(3, num_experts)), slots), current, slots)
    try:
        plan = build_plan(current, new, slots, 1.0, None if budget is None else float(budget), gpus_per_node)
    except PlanError as exc:  # only a cycle longer than the budget may refuse
        assert budget is not None and "at least" in str(exc)
        return
    assert plan.num_copies == count_moves(new, current, slots).sum()
    np.testing.assert_array_equal(apply_plan(current, plan), new)
    if budget is not None:
        assert np.bincount(plan.stage[~plan.local]).max(initial=0) <= budget
    elif gpus_per_node is not None:  # no budget: every copy with a serving replica on its node reads there
        assert _reads_across_with_a_holder_on_the_node(current, plan, gpus_per_node, slots) == 0


def test_an_empty_slot_is_never_read_and_an_emptied_one_is_released() -> None:
    """Serving [[0, 1, 2, -1]] (GPU 1's second slot empty), new [[0, -1, 2, 1]]: expert 1 moves to GPU 1 into the
    empty slot (one copy, read from GPU 0's slot 1, not the empty slot); GPU 0's slot 1 is then released: a row
    with expert -1, no bytes, after the copy that reads it, so the cluster serves 1 until its copy lands."""
    slots = np.array([2, 2])
    current, new = np.array([[0, 1, 2, -1]]), np.array([[0, -1, 2, 1]])
    plan = build_plan(current, new, slots, EXPERT_BYTES)
    rows = sorted(zip(plan.expert.tolist(), plan.src_slot.tolist(), plan.dst_slot.tolist(), plan.local.tolist(),
                      plan.stage.tolist(), strict=True))  # fmt: skip
    assert rows == [(-1, 1, 1, True, 0), (1, 1, 3, False, 0)]
    assert plan.num_copies == 1 and plan.to_dict()["total_bytes"] == EXPERT_BYTES
    assert [c["bytes"] for c in plan.to_dict()["stages"][0]["copies"]] == [EXPERT_BYTES, 0.0]  # the copy first
    np.testing.assert_array_equal(apply_plan(current, plan), new)
    # a slot empty in both needs nothing; filling an empty slot with an expert the GPU holds is a local write
    current, new = np.array([[0, 1, -1, 2, -1, 3]]), np.array([[0, 1, 1, 2, -1, 3]])
    plan = build_plan(current, new, np.array([3, 3]))
    assert plan.expert.tolist() == [1] and plan.local.tolist() == [True] and plan.src_slot.tolist() == [1]
    np.testing.assert_array_equal(apply_plan(current, plan), new)
    with pytest.raises(PlanError, match="expert 3 is in no slot of the serving placement"):
        build_plan([[0, 1, 2, -1]], [[0, 1, 2, 3]], slots)  # nothing to copy it from (was a wrong source)
    with pytest.raises(PlanError, match="or -1"):
        build_plan([[0, 1, 2, -2]], [[0, 1, 2, 3]], slots)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 100_000), budget=st.sampled_from([None, 2, 4]), gpus_per_node=st.sampled_from([None, 1, 2]))
def test_random_plans_with_empty_slots_apply_stage_by_stage(seed: int, budget: int | None,
                                                            gpus_per_node: int | None) -> None:
    """Placements whose redundant replicas are partly empty (-1) in the serving and the new placement: the plan
    copies exactly the (expert, GPU) pairs the new placement adds, releases the slots it empties, never copies from
    an empty slot, keeps to the budget, and applied stage by stage gives the new placement."""
    rng = np.random.default_rng(seed)
    current, new, slots = random_aligned_pair(rng, 4, int(rng.integers(2, 4)), empties=True)
    try:
        plan = build_plan(current, new, slots, 1.0, None if budget is None else float(budget), gpus_per_node)
    except PlanError as exc:
        assert budget is not None and "at least" in str(exc)
        return
    added = {(layer, gpu, e) for layer, row in enumerate(new.tolist()) for gpu, e in
             zip(np.repeat(np.arange(4), slots).tolist(), row, strict=True) if e >= 0} - {
        (layer, gpu, e) for layer, row in enumerate(current.tolist()) for gpu, e in
        zip(np.repeat(np.arange(4), slots).tolist(), row, strict=True)}  # fmt: skip
    copy = ~plan.local
    assert sorted(zip(plan.layer[copy].tolist(), plan.dst_gpu[copy].tolist(), plan.expert[copy].tolist(),
                      strict=True)) == sorted(added)  # fmt: skip
    released = plan.expert == -1
    assert sorted(zip(plan.layer[released].tolist(), plan.dst_slot[released].tolist(), strict=True)) == sorted(
        map(tuple, np.argwhere((new == -1) & (current != -1)).tolist()))  # fmt: skip
    assert np.all(current[plan.layer[copy], plan.src_slot[copy]] != -1)  # local writes read the new placement
    if budget is not None:
        assert np.bincount(plan.stage[copy]).max(initial=0) <= budget
    np.testing.assert_array_equal(apply_plan(current, plan), new)


def test_bad_inputs_are_refused() -> None:
    slots = np.array([2, 2])
    with pytest.raises(PlanError, match="layers"):
        build_plan(np.zeros((1, 4), np.int64), np.zeros((2, 4), np.int64), slots)
    with pytest.raises(PlanError, match="bytes of one expert"):
        build_plan(np.array([[0, 1, 2, 3]]), np.array([[0, 2, 1, 3]]), slots, stage_bytes=1e9)
    with pytest.raises(PlanError, match="align"):
        build_plan(np.array([[0, 1, 2, 3]]), np.array([[1, 0, 2, 3]]), slots)  # slots swapped inside GPU 0


def test_with_nodes_a_copy_reads_a_source_on_its_destinations_node() -> None:
    """Expert 0 is held on GPU 0 (node 0) and GPU 2 (node 1), both staying: the copy onto GPU 3 (node 1)
    reads GPU 2's over NVLink; without nodes it takes the first holder in turn, GPU 0, across the NIC."""
    slots = np.array([2, 2, 2, 2])
    current = np.array([[0, 1, 2, 3, 0, 4, 5, 1]])
    new = np.array([[0, 1, 2, 3, 0, 4, 5, 0]])  # GPU 3 trades its second 1 for a 0
    with_nodes = build_plan(current, new, slots, gpus_per_node=2)
    (copy,) = np.flatnonzero(~with_nodes.local)
    assert (with_nodes.dst_gpu[copy], with_nodes.src_gpu[copy]) == (3, 2)
    np.testing.assert_array_equal(apply_plan(current, with_nodes), new)
    spread = build_plan(current, new, slots)
    (copy,) = np.flatnonzero(~spread.local)
    assert (spread.dst_gpu[copy], spread.src_gpu[copy]) == (3, 0)


def test_with_nodes_a_node_local_source_wins_over_one_that_stays_elsewhere() -> None:
    """Expert 0 is held on GPU 0 (node 0, stays) and GPU 2 (node 1, overwritten by expert 6 from GPU 3): the copy
    of 0 onto GPU 3 reads GPU 2's replica over NVLink, in the stage that overwrites it (the plan used to take
    GPU 0's, across the NIC, because it stays put). Under a budget of one copy per stage the two copies, which
    read each other's slots, cannot share a stage: the copy of 0 then reads GPU 0's, and the plan still applies."""
    slots = np.array([2, 2, 2, 2])  # 2 nodes of 2 GPUs
    current = np.array([[0, 1, 2, 3, 0, 4, 5, 6]])
    new = np.array([[0, 1, 2, 3, 6, 4, 5, 0]])
    plan = build_plan(current, new, slots, EXPERT_BYTES, gpus_per_node=2)
    sources = dict(zip(plan.expert.tolist(), plan.src_gpu.tolist(), strict=True))
    assert sources == {0: 2, 6: 3} and plan.num_stages == 1
    np.testing.assert_array_equal(apply_plan(current, plan), new)
    tight = build_plan(current, new, slots, EXPERT_BYTES, stage_bytes=EXPERT_BYTES, gpus_per_node=2)
    assert dict(zip(tight.expert.tolist(), tight.src_gpu.tolist(), strict=True)) == {0: 0, 6: 3}
    assert tight.num_stages == 2
    np.testing.assert_array_equal(apply_plan(current, tight), new)


def _reads_across_with_a_holder_on_the_node(current: np.ndarray, plan: MigrationPlan, gpus_per_node: int,
                                            slots: np.ndarray) -> int:
    """Copies read from another node while a serving replica on the destination's node still holds the expert
    when the copy's stage reads (not overwritten by an earlier stage)."""
    node_of_slot = np.repeat(np.arange(slots.size), slots) // gpus_per_node
    overwritten = np.full(current.shape, np.iinfo(np.int64).max)
    overwritten[plan.layer, plan.dst_slot] = plan.stage
    found = 0
    for i in np.flatnonzero(~plan.local):
        layer, dst_node = plan.layer[i], plan.dst_gpu[i] // gpus_per_node
        if plan.src_gpu[i] // gpus_per_node == dst_node:
            continue
        near = (current[layer] == plan.expert[i]) & (node_of_slot == dst_node)
        found += int((near & (overwritten[layer] >= plan.stage[i])).any())
    return found


def test_user_trial_plan_reads_on_the_destinations_node(tmp_path: Path) -> None:
    """The user trial: prefill-in4096 placed on 32 GPUs in 4 nodes, then rebalanced to decode with a plan in 2 GiB
    stages. 14 of its 2,233 copies across nodes read another node while a replica on the destination's node was
    still there; now none does, the plan applies and every stage keeps to the budget."""
    first, plan_file = tmp_path / "p32n.json", tmp_path / "plan.json"
    cluster = ["--gpus", "32", "--gpus-per-node", "8"]
    assert main(["solve", "--loads", str(FIXTURES / "sglang6017-dsv3-prefill-in4096.json"), *cluster,
                 "--out", str(first)]) == 0
    assert main(["solve", "--loads", str(FIXTURES / "sglang6017-dsv3-decode-in1000out1000.json"), *cluster, "--current",
                 str(first), "--plan", str(plan_file), "--stage-gib", "2", "--out", str(tmp_path / "next.json")]) == 0
    current, new = load_placement(first), load_placement(tmp_path / "next.json")
    data = json.loads(plan_file.read_text())
    rows = [(c["layer"], c["expert"], c["src_gpu"], c["src_slot"], c["dst_gpu"], c["dst_slot"], c["bytes"] == 0.0, k)
            for k, stage in enumerate(data["stages"]) for c in stage["copies"]]
    layer, expert, src_gpu, src_slot, dst_gpu, dst_slot, local, stage = (np.asarray(c) for c in zip(*rows, strict=True))
    plan = MigrationPlan(layer, expert, src_gpu, src_slot, dst_gpu, dst_slot, local, stage)
    slots = current.slots_per_gpu
    assert _reads_across_with_a_holder_on_the_node(current.phy2log, plan, 8, slots) == 0
    np.testing.assert_array_equal(apply_plan(current.phy2log, plan), new.phy2log)
    assert max(stage["bytes"] for stage in data["stages"]) <= 2 * 2**30
    assert plan.num_copies == data["num_copies"] > 2000
