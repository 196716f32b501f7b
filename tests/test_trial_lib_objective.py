"""The time objective on clusters a new user solves for: more GPUs than experts (DeepSeek-V3's EP320 decode)."""

from __future__ import annotations

import numpy as np

from eplb.objective import one_slot_per_expert
from eplb.solve import Cluster, CostSetup, solve
from eplb.specs import link_bandwidth, load_hardware, load_model
from solvers.validation import EMPTY_SLOT, validate_placement


def test_one_slot_per_expert_with_more_gpus_than_experts_leaves_the_extra_gpus_empty() -> None:
    """8 experts on 10 GPUs of one slot: 8 GPUs hold one expert each, 2 hold none (it raised 'greedy: every GPU needs
    at least one slot')."""
    loads = np.random.default_rng(0).random((2, 8)) * 100
    slots = np.ones(10, dtype=np.int64)
    phy2log = one_slot_per_expert(loads, slots)
    assert phy2log.shape == (2, 10)
    validate_placement(phy2log, slots, 8)
    assert ((phy2log == EMPTY_SLOT).sum(axis=1) == 2).all()
    assert [sorted(row[row >= 0].tolist()) for row in phy2log] == [list(range(8))] * 2


def test_the_time_objective_solves_more_gpus_than_experts() -> None:
    """`eplb solve --gpus 320 --slots-per-gpu 1 --objective time` (documented: more GPUs than experts) crashed with a
    traceback in the fewer-replicas candidate; the same on 72 GPUs for DeepSeek-V2-Lite's 64 experts."""
    model, hw = load_model("deepseek-v2-lite"), load_hardware("h100")
    cost = CostSetup(model, hw, link_bandwidth(hw, "nvlink"), tokens_per_gpu=256)
    loads = np.random.default_rng(1).pareto(1.5, (3, model.num_experts)) * 100
    outcome = solve(loads, Cluster([1] * (model.num_experts + 8)), cost=cost, objective="time")
    assert outcome.placement.num_gpus == model.num_experts + 8
    assert set(outcome.solver["layer_choice"]) <= {"solver", "one slot per expert"}
