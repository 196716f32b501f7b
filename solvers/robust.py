"""Placements that hold up on the next interval: a swap refinement against several scenarios.

A placement solved on the sum of a window balances that sum; the steps it then serves look like parts of
the window, not its sum. `refine` takes any solver's placement and the window cut into recent
sub-windows (`Problem.scenarios`, [S, L, E]) and swaps pairs of slots between GPUs while that lowers the
worst lb over the scenarios and the whole window together. Each layer: find the busiest (scenario, GPU),
try every swap of one of its slots with a slot on another GPU (same node when the placement is
hierarchical; never two replicas of one expert on a GPU), take the best, repeat. Replica counts and
per-slot shares move with their slots, so every expert keeps its replicas and shares.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from solvers.registry import Problem, Solution

__all__ = ["refine", "worst_lb"]

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]
_MAX_SWAPS_PER_LAYER = 64


def _slot_shares(phy2log: IntArray, shares: FloatArray | None, num_experts: int) -> FloatArray:
    """[P] share of its expert's tokens each slot serves (1 / replicas when shares is None)."""
    if shares is not None:
        return shares
    replicas = np.bincount(phy2log, minlength=num_experts)
    out: FloatArray = 1.0 / replicas[phy2log]
    return out


def _per_gpu(slot_values: FloatArray, gpu: IntArray, gpus: int) -> FloatArray:
    """[S, G] sums of slot values [S, P] per GPU (gpu: [P] GPU of each slot)."""
    out = np.zeros((slot_values.shape[0], gpus))
    for g in range(gpus):
        out[:, g] = slot_values[:, gpu == g].sum(axis=1)
    return out


def worst_lb(loads: FloatArray, phy2log: IntArray, slots_per_gpu: IntArray, shares: FloatArray | None = None) -> float:
    """Worst lb over scenarios of one layer: loads [S, E], phy2log [P]."""
    gpu = np.repeat(np.arange(slots_per_gpu.size, dtype=np.int64), slots_per_gpu)
    v = loads[:, phy2log] * _slot_shares(phy2log, shares, loads.shape[1])
    per_gpu = _per_gpu(v, gpu, slots_per_gpu.size)
    mean = per_gpu.mean(axis=1)
    return float(np.max(np.divide(per_gpu.max(axis=1), mean, out=np.ones_like(mean), where=mean > 0)))


def _refine_layer(
    x: FloatArray, p2l: IntArray, share: FloatArray, gpu: IntArray, node: IntArray | None, gpus: int
) -> tuple[IntArray, FloatArray]:
    """Swap slots of one layer while the worst normalized GPU load over scenarios x [S, E] falls."""
    p2l, share = p2l.copy(), share.copy()
    num_experts = x.shape[1]
    per_gpu = _per_gpu(x[:, p2l] * share, gpu, gpus)
    present = np.zeros((gpus, num_experts), dtype=bool)
    present[gpu, p2l] = True
    all_gpus = np.arange(gpus)
    for _ in range(_MAX_SWAPS_PER_LAYER):
        worst = float(per_gpu.max())
        _, g_star = np.unravel_index(int(np.argmax(per_gpu)), per_gpu.shape)
        a_slots = np.flatnonzero(gpu == g_star)
        allowed = gpu != g_star
        if node is not None:
            allowed &= node[gpu] == node[g_star]
        b_slots = np.flatnonzero(allowed)
        if not a_slots.size or not b_slots.size:
            break
        va = x[:, p2l[a_slots]] * share[a_slots]  # [S, A]
        vb = x[:, p2l[b_slots]] * share[b_slots]  # [S, B]
        delta = vb[:, None, :] - va[:, :, None]  # [S, A, B]: what g* gains, h loses
        h = gpu[b_slots]
        new_g = per_gpu[:, g_star, None, None] + delta
        new_h = per_gpu[:, h][:, None, :] - delta
        # busiest GPU other than g* and h, per scenario and h: from the three busiest of each scenario
        top = np.argsort(-per_gpu, axis=1)[:, :3]
        top_val = np.take_along_axis(per_gpu, top, axis=1)
        ok = (top[:, :, None] != g_star) & (top[:, :, None] != all_gpus[None, None, :])  # [S, 3, G]
        first = np.argmax(ok, axis=1)  # [S, G]
        other = np.where(ok.any(axis=1), np.take_along_axis(top_val, first, axis=1), -np.inf)  # [S, G]
        objective = np.maximum(np.maximum(new_g, new_h), other[:, h][:, None, :]).max(axis=0)  # [A, B]
        ea, eb = p2l[a_slots], p2l[b_slots]
        dup = present[g_star, eb][None, :] | present[h[None, :], ea[:, None]] | (ea[:, None] == eb[None, :])
        objective[dup] = np.inf
        i, j = np.unravel_index(int(np.argmin(objective)), objective.shape)
        if not objective[i, j] < worst * (1 - 1e-12):
            break
        a, b = int(a_slots[i]), int(b_slots[j])
        ga, gb = int(gpu[a]), int(gpu[b])
        per_gpu[:, ga] += delta[:, i, j]
        per_gpu[:, gb] -= delta[:, i, j]
        present[ga, p2l[a]], present[gb, p2l[b]] = False, False
        p2l[a], p2l[b] = p2l[b], p2l[a]
        share[a], share[b] = share[b], share[a]
        present[ga, p2l[a]], present[gb, p2l[b]] = True, True
    return p2l, share


def refine(problem: Problem, solution: Solution) -> Solution:
    """`solution` with slots swapped so that each layer's worst lb over the scenarios and the whole
    window is as low as the swaps can make it (never higher than before). problem.scenarios: [S, L, E]."""
    assert problem.scenarios is not None
    slots = problem.slots_per_gpu
    gpus = slots.size
    gpu = np.repeat(np.arange(gpus, dtype=np.int64), slots)
    node = None
    if problem.hierarchical and problem.gpus_per_node is not None:
        node = np.arange(gpus, dtype=np.int64) // problem.gpus_per_node
    scen = np.concatenate([problem.scenarios, problem.loads[None]], axis=0)  # [S + 1, L, E]
    phy2log = solution.phy2log.copy()
    shares = None if solution.shares is None else solution.shares.copy()
    before, after = [], []
    for layer in range(phy2log.shape[0]):
        x = scen[:, layer, :]
        mean = x.sum(axis=1, keepdims=True) / gpus
        x = np.divide(x, mean, out=np.zeros_like(x), where=mean > 0)  # GPU loads in units of the mean
        share = _slot_shares(phy2log[layer], None if shares is None else shares[layer], x.shape[1])
        before.append(worst_lb(x, phy2log[layer], slots, share))
        p2l, share = _refine_layer(x, phy2log[layer], share, gpu, node, gpus)
        phy2log[layer] = p2l
        if shares is not None:
            shares[layer] = share
        after.append(worst_lb(x, p2l, slots, share))
    info = dict(solution.info)
    info["robust"] = {
        "scenarios": int(problem.scenarios.shape[0]),
        "worst_lb_before": round(float(np.mean(before)), 6),
        "worst_lb_after": round(float(np.mean(after)), 6),
    }
    return Solution(phy2log, shares, solution.status, solution.layer_status, solution.layer_ms,
                    solution.bound_tokens, info)  # fmt: skip
