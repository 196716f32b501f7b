"""Placements that hold up on the next interval: a swap refinement against several scenarios.

A placement solved on the sum of a window balances that sum; the steps it then serves look like parts of
the window, not its sum. `refine` takes any solver's placement and the window cut into recent
sub-windows (`Problem.scenarios`, [S, L, E]) and swaps pairs of slots between GPUs while that lowers the
worst lb over the scenarios and the whole window together. Each layer: find the busiest (scenario, GPU),
try every swap of one of its slots with a slot on another GPU (same node when the placement is
hierarchical; never two replicas of one expert on a GPU), take the best, repeat. Replica counts and
per-slot shares move with their slots, so every expert keeps its replicas and shares. Against a serving
placement (`Problem.current_phy2log`), the slots inside each GPU are then arranged so that every expert a GPU
keeps stays in its serving slot (`solvers.migration.arrange_slot_order`): a swap can land an expert on a GPU
that served it in another slot, and an aligned solver's output (incremental) must stay aligned for its moves
and migration plan. Under a move budget (`Options.max_moves`, `max_moves_per_layer`: the incremental solver's),
a swap may only spend the copies the solver left unspent (layers in order), so the budget still holds.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from solvers.migration import arrange_slot_order, count_moves, gpu_membership
from solvers.registry import Options, Problem, Solution

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
    x: FloatArray, p2l: IntArray, share: FloatArray, gpu: IntArray, node: IntArray | None, gpus: int,
    served: NDArray[np.bool_] | None = None, allowance: int | None = None,
) -> tuple[IntArray, FloatArray, int]:
    """Swap slots of one layer while the worst normalized GPU load over scenarios x [S, E] falls. With
    `served` [G, E] (expert e on GPU g in the serving placement) and `allowance`, a swap may add at most the
    copies left of the allowance. Returns (phy2log, shares, copies the swaps added)."""
    p2l, share = p2l.copy(), share.copy()
    added = 0
    num_experts = x.shape[1]
    per_gpu = _per_gpu(x[:, p2l] * share, gpu, gpus)
    held = np.zeros((gpus, num_experts), dtype=np.int64)  # replicas of each expert on each GPU
    np.add.at(held, (gpu, p2l), 1)
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
        dup = (held[g_star, eb] > 0)[None, :] | (held[h[None, :], ea[:, None]] > 0) | (ea[:, None] == eb[None, :])
        objective[dup] = np.inf
        copies = None
        if served is not None and allowance is not None:
            # a swap copies eb onto g* and ea onto h unless they served there, and frees the copy it undoes
            # when it takes a GPU's last replica of an expert that did not serve there
            new = ~served  # [G, E] a replica here would be a copy
            freed_g = new[g_star, ea] & (held[g_star, ea] == 1)
            freed_h = new[h, eb] & (held[h, eb] == 1)
            copies = (new[g_star, eb][None, :].astype(np.int64) - freed_g[:, None]
                      + new[h[None, :], ea[:, None]] - freed_h[None, :])  # fmt: skip
            objective[copies > allowance - added] = np.inf
        i, j = np.unravel_index(int(np.argmin(objective)), objective.shape)
        if not objective[i, j] < worst * (1 - 1e-12):
            break
        if copies is not None:
            added += int(copies[i, j])
        a, b = int(a_slots[i]), int(b_slots[j])
        ga, gb = int(gpu[a]), int(gpu[b])
        per_gpu[:, ga] += delta[:, i, j]
        per_gpu[:, gb] -= delta[:, i, j]
        held[ga, p2l[a]] -= 1
        held[gb, p2l[b]] -= 1
        p2l[a], p2l[b] = p2l[b], p2l[a]
        share[a], share[b] = share[b], share[a]
        held[ga, p2l[a]] += 1
        held[gb, p2l[b]] += 1
    return p2l, share, added


def _budget(
    problem: Problem, phy2log: IntArray, options: Options | None
) -> tuple[NDArray[np.bool_] | None, int, IntArray]:
    """(served [L, G, E] or None without a move budget, copies left of the whole model's budget, [L] copies
    left of each layer's budget) after the solver's own copies against the serving placement."""
    layers = phy2log.shape[0]
    unlimited = np.iinfo(np.int64).max // 4
    cur = problem.current_phy2log
    if cur is None or options is None or (options.max_moves is None and options.max_moves_per_layer is None):
        return None, unlimited, np.full(layers, unlimited, dtype=np.int64)
    slots = problem.slots_per_gpu.astype(np.int64)
    used = count_moves(phy2log, cur, slots)
    total = unlimited if options.max_moves is None else max(options.max_moves - int(used.sum()), 0)
    per_layer = unlimited if options.max_moves_per_layer is None else options.max_moves_per_layer
    layer_left = np.maximum(per_layer - used, 0).astype(np.int64)
    return gpu_membership(np.asarray(cur, dtype=np.int64), slots, problem.loads.shape[1]), total, layer_left


def refine(problem: Problem, solution: Solution, options: Options | None = None) -> Solution:
    """`solution` with slots swapped so that each layer's worst lb over the scenarios and the whole
    window is as low as the swaps can make it (never higher than before). problem.scenarios: [S, L, E].
    Against `problem.current_phy2log`, slots are arranged to it and the move budget of `options` holds."""
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
    served, total_left, layer_left = _budget(problem, phy2log, options)
    for layer in range(phy2log.shape[0]):
        x = scen[:, layer, :]
        mean = x.sum(axis=1, keepdims=True) / gpus
        x = np.divide(x, mean, out=np.zeros_like(x), where=mean > 0)  # GPU loads in units of the mean
        share = _slot_shares(phy2log[layer], None if shares is None else shares[layer], x.shape[1])
        before.append(worst_lb(x, phy2log[layer], slots, share))
        allowance = None if served is None else min(total_left, int(layer_left[layer]))
        p2l, share, added = _refine_layer(x, phy2log[layer], share, gpu, node, gpus,
                                          None if served is None else served[layer], allowance)  # fmt: skip
        total_left -= added
        phy2log[layer] = p2l
        if shares is not None:
            shares[layer] = share
        after.append(worst_lb(x, p2l, slots, share))
    if problem.current_phy2log is not None:  # GPUs keep their labels; kept experts go back to their serving slots
        phy2log, source = arrange_slot_order(phy2log, problem.current_phy2log, slots)
        if shares is not None:
            shares = np.take_along_axis(shares, source, axis=1)
    info = dict(solution.info)
    info["robust"] = {
        "scenarios": int(problem.scenarios.shape[0]),
        "worst_lb_before": round(float(np.mean(before)), 6),
        "worst_lb_after": round(float(np.mean(after)), 6),
    }
    return Solution(phy2log, shares, solution.status, solution.layer_status, solution.layer_ms,
                    solution.bound_tokens, info)  # fmt: skip
