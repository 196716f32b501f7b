"""Incremental rebalancing: improve the serving placement a few expert copies at a time.

A fresh placement for a new window copies most experts (13,000+ copies at DeepSeek-V3 size). Here the
placement being served is edited instead, one move at a time, each move chosen where it lowers a layer's
busiest GPU and the GPUs near it the most per copy:

* spread: copy an expert of the busiest GPU ``h`` over a slot elsewhere that holds a redundant replica
  (the expert gains a replica, so ``h`` serves less of it; 1 copy);
* replace: overwrite a redundant replica on ``h`` with a replica of a colder expert (1 copy);
* swap: exchange a replica on ``h`` with one on a light GPU (2 copies);
* repair (first, while the serving placement has a duplicate): overwrite the second replica of an expert on a
  GPU with an expert the GPU lacks, the pair that leaves the lowest busiest GPU (1 copy).

A move is ranked by how much it lowers the summed excess above a level of every GPU it touches, per copy: fixing
``h`` by lifting a light GPU over the level is charged for the new overload, and spreading an expert that sits on
several overloaded GPUs is credited for all of them. With a target the level is the target; without one it is the
balanced level (the mean load x (1 + BALANCED)) and the drop of ``h`` counts too, so that a walk's every prefix is
a good state for a move budget to stop at (ranked by ``h``'s drop alone, a budget bought less balance: docs/solvers.md).

When other GPUs tie with ``h`` as the busiest (the same load up to rounding), the layer's max only drops when all of
them drop: a move is ranked by the highest load it leaves on them and on the GPUs it touches. When no move lowers them
all, the step lowers one of them (``h``'s moves first, as without ties; if ``h`` has none, those of each tied GPU in
turn), and the next step sees one tied GPU fewer.

A copy is one expert's weights landing on a GPU that did not hold it in the serving placement (a move
that puts an expert back where it was serving costs nothing). Every expert keeps >= 1 replica, no GPU
gets a second replica of an expert, GPUs keep their slot counts and, for hierarchical placements, an
expert only lands on a node its group already occupies.

A serving placement may hold two replicas of one expert on one GPU (DeepSeek's algorithm, which vLLM and SGLang
run, places some): a layer's first moves repair each such duplicate, whatever the target, by overwriting it with
an expert the GPU lacks (1 copy each), as far as the budget pays for them (a whole-model budget: the most
imbalanced layers first). A duplicate stays only on a GPU with more slots than the experts it may hold (all, or
those of its node's groups: greedy parks such spare slots on an expert the GPU holds alone), or where the budget is
spent.

Every layer walks its own trajectory of moves (a compiled loop, solvers/_incremental.c, layer by layer);
the whole model's budget is then shared by marginal gain: the lower convex hull of each layer's
(copies, busiest GPU load) points, merged by slope. The objective summed over layers is the busiest
GPU's tokens, i.e. the MoE time per step.

Shapes: ``loads [L, E]`` tokens, ``phy2log [L, P]``, ``slots_per_gpu [G]``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from solvers import _incremental
from solvers.loads import gpu_loads
from solvers.migration import arrange_slots, gpu_membership, relabel_gpus
from solvers.registry import Capabilities, Options, Problem, Solution, Solver
from solvers.validation import EMPTY_SLOT, InvalidPlacement, duplicate_count, validate_placement

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]
BoolArray = NDArray[np.bool_]

__all__ = ["Frontier", "IncrementalSolver", "Trajectory", "frontier", "rebalance", "trajectories"]

DEFAULT_TOLERANCE = 1e-3
"""Without a budget or target, a layer stops at the fewest copies within this much lb of the best its
trajectory reaches (0.1% of the mean GPU load)."""
MIN_GAIN = 1e-4
"""A move must lower the busiest GPU by this fraction of the mean GPU load."""
BALANCED = 5e-4
"""A layer whose busiest GPU is within this fraction of the mean load stops: nothing left to buy."""
_LIGHT_GPUS = 8
"""Swap partners of the busiest GPU: the slots of this many lightest GPUs."""
_LIGHT_GPUS_TARGET = 16
"""With a target, this many (moves ranked by excess over the target rarely fill the very lightest GPUs, and the
last GPUs above it need a partner whose replica fits the small excess). On the real DeepSeek-V3 windows at
EP64 / 320 slots, 16 instead of 8 takes 5% fewer copies to reach fresh greedy's lb x 1.01 per layer and reaches
it on every layer (8 missed one), for ~40% more walk time."""


@dataclass(frozen=True)
class Trajectory:
    """Every layer's moves, in the order taken.

    max_load: [L, K + 1] busiest GPU's tokens after k moves (k = 0: the serving placement; padded with
    the last value once a layer stops); copies: [L, K + 1] expert copies the state after k moves needs;
    steps: [L] moves each layer took; layer, step, slot, expert: one row per slot written (a swap writes
    two): step k's slot gets expert; mean_load: [L] mean GPU load, tokens; repairs: [L] the first moves of each
    layer that repaired a duplicate of the serving placement (every state worth stopping at comes after them).
    """

    max_load: FloatArray
    copies: IntArray
    steps: IntArray
    layer: IntArray
    step: IntArray
    slot: IntArray
    expert: IntArray
    mean_load: FloatArray
    repairs: IntArray

    def apply(self, current_phy2log: IntArray, take: IntArray) -> IntArray:
        """The placement after the first ``take[l]`` moves of each layer: [L, P]."""
        out = current_phy2log.copy()
        keep = np.flatnonzero(self.step < take[self.layer])
        # the last write to a slot wins
        key = (self.layer[keep] * out.shape[1] + self.slot[keep])[::-1]
        _, last = np.unique(key, return_index=True)
        rows = keep[::-1][last]
        out[self.layer[rows], self.slot[rows]] = self.expert[rows]
        return out


def _node_groups(
    phy2log: IntArray, gpu: IntArray, num_groups: int, gpus_per_node: int, num_experts: int
) -> IntArray:
    """[L, nodes, groups] 1 where the group has a replica on the node in the serving placement."""
    num_layers = phy2log.shape[0]
    num_nodes = int(gpu.max()) // gpus_per_node + 1
    on = np.zeros((num_layers, num_nodes, num_groups), dtype=np.int64)
    group = phy2log // (num_experts // num_groups)
    on[np.arange(num_layers)[:, None], (gpu // gpus_per_node)[None, :], group] = 1
    return on


def trajectories(
    loads: FloatArray,
    current_phy2log: IntArray,
    slots_per_gpu: IntArray,
    *,
    num_groups: int | None = None,
    gpus_per_node: int | None = None,
    max_steps: int | None = None,
    target_max_load: FloatArray | None = None,
    max_copies: int | None = None,
    max_repairs: IntArray | None = None,
) -> Trajectory:
    """Walk every layer from the serving placement, one best move per layer per step (compiled loop,
    solvers/_incremental.c).

    loads: [L, E] tokens of the new window; current_phy2log: [L, P] the serving placement;
    num_groups and gpus_per_node: keep every expert on the nodes its group occupies; max_steps: moves
    per layer at most (default: P); target_max_load: [L] a layer stops once its busiest GPU is at or
    below it; max_copies: a layer takes no move that would need more copies than this; max_repairs: [L]
    duplicates of the serving placement each layer repairs first at most (default: all of them). A layer also
    stops within BALANCED of the mean load, or when no move lowers its busiest GPU by MIN_GAIN of it.
    """
    w, phy, slots = _serving(loads, current_phy2log, slots_per_gpu)
    return _walk(w, phy, slots, num_groups=num_groups, gpus_per_node=gpus_per_node, max_steps=max_steps,
                 target_max_load=target_max_load, max_copies=max_copies, max_repairs=max_repairs)


def _walk(
    w: FloatArray,
    phy: IntArray,
    slots: IntArray,
    *,
    num_groups: int | None,
    gpus_per_node: int | None,
    max_steps: int | None,
    target_max_load: FloatArray | None,
    max_copies: int | None,
    max_repairs: IntArray | None,
) -> Trajectory:
    """:func:`trajectories` on arrays `_serving` has checked (contiguous, the serving placement valid)."""
    num_layers, num_experts = w.shape
    num_physical, num_gpus = phy.shape[1], slots.size
    steps_cap = num_physical if max_steps is None else max_steps
    mean = w.sum(axis=1) / num_gpus
    node_ok, group_size, node_size, groups, nodes = None, num_experts, num_gpus, 1, 1
    if num_groups is not None and gpus_per_node is not None:
        gpu = np.repeat(np.arange(num_gpus), slots)
        node_ok = _node_groups(phy, gpu, num_groups, gpus_per_node, num_experts)
        group_size, node_size, groups, nodes = num_experts // num_groups, gpus_per_node, num_groups, node_ok.shape[1]
    target = mean * (1 + BALANCED)
    # a move is ranked per copy by how far it lowers the summed excess of all GPUs above a level (its receivers and
    # the other holders of the experts whose replica counts change included), so a fix of the busiest GPU that lifts
    # another GPU near the top is charged for it: with a target, the excess above the target alone; without one, the
    # excess above the balanced level plus the busiest GPU's drop (every prefix of the walk is then a state a budget
    # may stop at: docs/solvers.md); a move must still lower the busiest GPU by MIN_GAIN
    level, rank_by_peak, light = target.copy(), 1.0, _LIGHT_GPUS
    if target_max_load is not None:
        target = np.maximum(target, np.asarray(target_max_load, dtype=np.float64))
        level, rank_by_peak, light = target, 0.0, _LIGHT_GPUS_TARGET
    out_max = np.empty((num_layers, steps_cap + 1))
    out_copies = np.empty((num_layers, steps_cap + 1), dtype=np.int64)
    steps = np.empty(num_layers, dtype=np.int64)
    out_slot = np.full((num_layers, steps_cap, 2), -1, dtype=np.int64)
    out_expert = np.full((num_layers, steps_cap, 2), -1, dtype=np.int64)
    repairs = np.zeros(num_layers, dtype=np.int64)
    repair_cap = np.full(num_layers, num_physical, dtype=np.int64) if max_repairs is None else max_repairs
    _incremental.walk(
        w, phy, slots, num_layers, num_experts, num_physical, num_gpus, steps_cap, light, node_ok,
        group_size, node_size, groups, nodes, target, -1 if max_copies is None else max_copies,
        np.ascontiguousarray(MIN_GAIN * mean), out_max, out_copies, steps, out_slot, out_expert,
        np.ascontiguousarray(level), rank_by_peak, np.ascontiguousarray(repair_cap, dtype=np.int64), repairs,
    )
    layer, step, col = np.nonzero(out_slot >= 0)
    return Trajectory(
        max_load=out_max,
        copies=out_copies,
        steps=steps,
        layer=layer.astype(np.int64),
        step=step.astype(np.int64),
        slot=out_slot[layer, step, col],
        expert=out_expert[layer, step, col],
        mean_load=mean,
        repairs=repairs,
    )


def _serving(
    loads: FloatArray, current_phy2log: IntArray, slots_per_gpu: IntArray
) -> tuple[FloatArray, IntArray, IntArray]:
    """(loads [L, E] float64, current_phy2log [L, P] int64, slots_per_gpu [G] int64), contiguous, once
    :func:`_check_serving` accepts them: what the compiled walk takes."""
    w = np.ascontiguousarray(loads, dtype=np.float64)
    phy = np.ascontiguousarray(current_phy2log, dtype=np.int64)
    slots = np.ascontiguousarray(slots_per_gpu, dtype=np.int64)
    _check_serving(w, phy, slots)
    return w, phy, slots


def _check_serving(loads: FloatArray, current_phy2log: IntArray, slots_per_gpu: IntArray) -> None:
    """ValueError (InvalidPlacement) unless ``current_phy2log [L, P]`` is a placement of ``loads [L, E]`` on
    ``slots_per_gpu [G]`` with every slot filled: the compiled walk indexes by its expert ids."""
    if loads.ndim != 2:
        raise ValueError(f"loads must be [layers, experts], got shape {loads.shape}")
    if current_phy2log.ndim != 2 or current_phy2log.shape[0] != loads.shape[0]:
        raise InvalidPlacement(f"the serving placement must be [layers, slots] with the loads' {loads.shape[0]} "
                               f"layers, got shape {current_phy2log.shape}")
    try:
        validate_placement(current_phy2log, slots_per_gpu, loads.shape[1])
    except InvalidPlacement as exc:
        raise InvalidPlacement(f"the serving placement: {exc}") from None
    if (current_phy2log == EMPTY_SLOT).any():
        layer, slot = (int(v) for v in np.argwhere(current_phy2log == EMPTY_SLOT)[0])
        raise InvalidPlacement(f"the serving placement has an empty slot (-1; layer {layer}, slot {slot}): "
                               "incremental edits need every slot holding an expert")


def _repairable(
    phy2log: IntArray, slots_per_gpu: IntArray, num_experts: int, num_groups: int | None, gpus_per_node: int | None
) -> IntArray:
    """[L] duplicates of ``phy2log [L, P]`` the repairs can remove: per GPU with at most as many slots as experts it
    may hold (all, or those of the groups on its node), as many as it has slots beyond the distinct experts it holds;
    none on a GPU with more slots (its duplicates stay)."""
    distinct = gpu_membership(phy2log, slots_per_gpu, num_experts).sum(axis=2)  # [L, G]
    may_hold = np.full(distinct.shape, num_experts, dtype=np.int64)
    if num_groups is not None and gpus_per_node is not None:
        gpu = np.repeat(np.arange(slots_per_gpu.size), slots_per_gpu)
        on_node = _node_groups(phy2log, gpu, num_groups, gpus_per_node, num_experts)  # [L, nodes, groups]
        node = np.arange(slots_per_gpu.size) // gpus_per_node
        may_hold = on_node.sum(axis=2)[:, node] * (num_experts // num_groups)
    room = np.where(slots_per_gpu[None, :] > may_hold, 0, slots_per_gpu[None, :] - distinct)
    return np.asarray(np.maximum(room, 0).sum(axis=1), dtype=np.int64)


def _budgeted_repairs(
    loads: FloatArray, phy2log: IntArray, slots_per_gpu: IntArray, max_moves: int, num_groups: int | None,
    gpus_per_node: int | None,
) -> IntArray:
    """[L] repairs each layer of ``phy2log [L, P]`` makes first under a whole-model budget of ``max_moves`` copies:
    the most imbalanced layers (busiest GPU / mean on ``loads [L, E]``) first, each as many as `_repairable` finds,
    while the budget lasts. Only layers with a duplicate are looked at (a cheap sort finds them): the others repair
    nothing, so they neither take budget nor shift the order, and a placement without any (greedy's, milp's, this
    solver's own) costs no repair work."""
    repairs = np.zeros(phy2log.shape[0], dtype=np.int64)
    dup = np.flatnonzero(duplicate_count(phy2log, slots_per_gpu))
    if dup.size == 0:
        return repairs
    need = _repairable(phy2log[dup], slots_per_gpu, loads.shape[1], num_groups, gpus_per_node)
    mean = loads[dup].sum(axis=1) / slots_per_gpu.size
    lb = gpu_loads(loads[dup], phy2log[dup], slots_per_gpu).max(axis=1) / np.where(mean > 0, mean, 1.0)
    order = np.argsort(-lb, kind="stable")
    before = np.cumsum(need[order]) - need[order]
    repairs[dup[order]] = np.minimum(need[order], np.maximum(max_moves - before, 0))
    return repairs


State = tuple[list[int], list[int], list[float]]
"""One layer's states worth stopping at: (steps, copies, max load), copies increasing, max load decreasing."""


def _pareto(traj: Trajectory, layer: int, cap: int | None) -> State:
    """The layer's Pareto states, all after its repairs; the first is the step right after them (step 0 without
    any: nothing moved, the only state with 0 copies has the serving placement's loads)."""
    k, first = int(traj.steps[layer]) + 1, int(traj.repairs[layer])
    copies, top = traj.copies[layer, :k].tolist(), traj.max_load[layer, :k].tolist()
    steps: list[int] = []
    for i in sorted(range(first, k), key=lambda i: (copies[i], top[i], i)):
        if cap is not None and copies[i] > cap:
            break
        if not steps or (top[i] < top[steps[-1]] * (1 - 1e-12) and copies[i] > copies[steps[-1]]):
            steps.append(i)
    return steps, [copies[i] for i in steps], [top[i] for i in steps]


def _hull(copies: list[int], top: list[float]) -> list[int]:
    """Indices of the lower convex hull of the points (copies, top), copies increasing: the layer's
    path of best gain per copy."""
    hull: list[int] = []
    for i in range(len(copies)):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            if (top[b] - top[a]) * (copies[i] - copies[a]) >= (top[i] - top[a]) * (copies[b] - copies[a]):
                hull.pop()  # b is on or above the segment a -> i
            else:
                break
        hull.append(i)
    return hull


@dataclass(frozen=True)
class Frontier:
    """Whole-model moves-vs-balance curve: the best state per budget, budget increasing.

    copies: [K] expert copies in all; lb_mean, lb_max: [K] mean and worst per-layer lb over layers;
    max_load_sum: [K] summed busiest-GPU tokens over layers (proportional to MoE time per step)."""

    copies: IntArray
    lb_mean: FloatArray
    lb_max: FloatArray
    max_load_sum: FloatArray

    def to_dict(self) -> dict[str, list[float] | list[int]]:
        return {
            "copies": self.copies.tolist(),
            "lb_mean": [round(float(v), 6) for v in self.lb_mean],
            "lb_max": [round(float(v), 6) for v in self.lb_max],
        }


def _segments(traj: Trajectory, cap: int | None) -> tuple[list[State], list[tuple[float, int, int]]]:
    """Per layer its Pareto states, and every hull segment as (gain per copy, layer, state index),
    steepest first."""
    states = [_pareto(traj, layer, cap) for layer in range(traj.max_load.shape[0])]
    segs: list[tuple[float, int, int]] = []
    for layer, (_, copies, top) in enumerate(states):
        hull = _hull(copies, top)
        segs.extend(
            ((top[a] - top[b]) / max(copies[b] - copies[a], 1), layer, b) for a, b in itertools.pairwise(hull)
        )
    segs.sort(key=lambda seg: -seg[0])
    return states, segs


def allocate(traj: Trajectory, max_moves: int | None, cap: int | None) -> IntArray:
    """Steps to take per layer: [L]. With max_moves, the whole-model budget goes where it buys the most
    max-load reduction per copy (hull segments by slope, then the remainder to the best affordable
    states); without, every layer takes its cheapest state within DEFAULT_TOLERANCE of its best."""
    states, segs = _segments(traj, cap)
    if max_moves is None:
        take = []
        for layer, (steps, _, top) in enumerate(states):
            good = min(top) + DEFAULT_TOLERANCE * float(traj.mean_load[layer])
            take.append(next(s for s, t in zip(steps, top, strict=True) if t <= good))
        return np.array(take, dtype=np.int64)
    spent = sum(copies[0] for _, copies, _ in states)  # the repairs (rebalance's budget has room for them)
    at = [0] * len(states)  # index into each layer's states
    closed = [False] * len(states)
    for _, layer, b in segs:
        if closed[layer]:
            continue
        copies = states[layer][1]
        extra = copies[b] - copies[at[layer]]
        if spent + extra <= max_moves:
            spent += extra
            at[layer] = b
        else:
            closed[layer] = True  # a later segment of this layer needs this one first
    # the remainder: each layer's best state that the leftover budget affords, best gain per copy first
    offers: list[tuple[float, int, int]] = []
    for layer, (_, copies, top) in enumerate(states):
        room = max_moves - spent + copies[at[layer]]
        fits = [j for j in range(at[layer] + 1, len(copies)) if copies[j] <= room]
        if fits:
            j = min(fits, key=lambda j: top[j])
            offers.append(((top[at[layer]] - top[j]) / max(copies[j] - copies[at[layer]], 1), layer, j))
    for _, layer, j in sorted(offers, reverse=True):
        copies = states[layer][1]
        if spent + copies[j] - copies[at[layer]] <= max_moves:
            spent += copies[j] - copies[at[layer]]
            at[layer] = j
    return np.array([steps[i] for (steps, _, _), i in zip(states, at, strict=True)], dtype=np.int64)


def frontier(traj: Trajectory, cap: int | None = None) -> Frontier:
    """The whole model's moves-vs-lb curve: hull segments of every layer taken by gain per copy."""
    states, segs = _segments(traj, cap)
    top = np.array([s[2][0] for s in states])
    copies = np.array([s[1][0] for s in states], dtype=np.int64)  # the repairs' copies, if any
    mean = np.where(traj.mean_load > 0, traj.mean_load, 1.0)
    lb = top / mean
    out_c, out_mean = [int(copies.sum())], [float(lb.mean())]
    out_max, out_sum = [float(lb.max())], [float(top.sum())]
    for _, layer, b in segs:
        _, c, t = states[layer]
        copies[layer], top[layer] = c[b], t[b]
        lb[layer] = t[b] / mean[layer]
        out_c.append(int(copies.sum()))
        out_mean.append(float(lb.mean()))
        out_max.append(float(lb.max()))
        out_sum.append(float(top.sum()))
    return Frontier(np.array(out_c), np.array(out_mean), np.array(out_max), np.array(out_sum))


def rebalance(
    loads: FloatArray,
    current_phy2log: IntArray,
    slots_per_gpu: IntArray,
    *,
    num_groups: int | None = None,
    gpus_per_node: int | None = None,
    max_moves: int | None = None,
    max_moves_per_layer: int | None = None,
    target_lb: float | FloatArray | None = None,
) -> tuple[IntArray, Trajectory, IntArray]:
    """Incremental rebalance of every layer. Returns (phy2log [L, P] aligned with the serving placement:
    experts that stay keep their slots, trajectory, steps taken per layer [L]).

    max_moves: expert copies in the whole model; max_moves_per_layer: per layer; target_lb: per layer,
    the fewest copies that reach it (layers that cannot stop at their best); one value for every layer or
    [L], one per layer (e.g. 1.01 x a fresh placement's lb of each layer). None of them: every layer
    stops once further moves gain less than DEFAULT_TOLERANCE of lb.
    """
    w, cur, slots = _serving(loads, current_phy2log, slots_per_gpu)
    mean = w.sum(axis=1) / slots.size
    target = None if target_lb is None else np.broadcast_to(np.asarray(target_lb, dtype=np.float64), mean.shape) * mean
    cap = max_moves_per_layer
    if max_moves is not None:
        cap = max_moves if cap is None else min(cap, max_moves)
    # the whole model's budget pays for the repairs first, most imbalanced layers first
    repairs = None if max_moves is None else _budgeted_repairs(w, cur, slots, max_moves, num_groups, gpus_per_node)
    traj = _walk(
        w, cur, slots, num_groups=num_groups, gpus_per_node=gpus_per_node, max_steps=None, target_max_load=target,
        max_copies=cap, max_repairs=repairs,
    )
    if max_moves == 0 or cap == 0:
        take = np.zeros(w.shape[0], dtype=np.int64)
    elif target is not None and max_moves is None:
        take = np.zeros(w.shape[0], dtype=np.int64)
        for layer in range(w.shape[0]):
            steps, _, top = _pareto(traj, layer, cap)
            reach = [s for s, t in zip(steps, top, strict=True) if t <= target[layer] * (1 + 1e-12)]
            take[layer] = reach[0] if reach else steps[-1]
    else:
        take = allocate(traj, max_moves, cap)
    phy2log = arrange_slots(traj.apply(cur, take), cur, slots)
    return phy2log, traj, take


class IncrementalSolver(Solver):
    """Registered as "incremental": `rebalance` from the serving placement."""

    name = "incremental"
    summary = "edit the serving placement a few copies at a time where it buys the most balance (milliseconds)"
    capabilities = Capabilities(hierarchical=True, current=True, requires_current=True, aligned=True)
    options = frozenset({"max_moves", "max_moves_per_layer", "target_lb"})

    def solve(self, problem: Problem, options: Options) -> Solution:
        assert problem.current_phy2log is not None  # check() refuses a missing current placement
        phy2log, _, take = rebalance(
            problem.loads,
            problem.current_phy2log,
            problem.slots_per_gpu,
            num_groups=problem.num_groups if problem.hierarchical else None,
            gpus_per_node=problem.gpus_per_node if problem.hierarchical else None,
            max_moves=options.max_moves,
            max_moves_per_layer=options.max_moves_per_layer,
            target_lb=options.target_lb,
        )
        info: dict[str, object] = {"steps": take.tolist()}
        if options.max_moves is None and options.max_moves_per_layer is None:
            # no budget: a layer whose edits stop short (of the target, if any) may go fresh; a budget is the
            # user's cap on copies, and its edits stand
            phy2log, info["fresh_layers"] = _fresh_where_edits_fall_short(problem, phy2log, options.target_lb)
        return Solution(phy2log, status="heuristic", info=info)


FRESH_LB_TOLERANCE = 1.01
"""Without a budget, a layer whose edited placement's busiest GPU is more than 1% above a fresh greedy
placement's takes the fresh one (relabelled onto the serving placement); with a target, a layer whose edits stop
short of it takes fresh greedy when that is 1% better or reaches the target."""


def _fresh_where_edits_fall_short(
    problem: Problem, edited: IntArray, target_lb: float | None = None
) -> tuple[IntArray, list[int]]:
    """Edits stop short of a re-solve when the serving placement is far off (e.g. hierarchical edits cannot move
    a group to another node). Per layer, take fresh greedy (relabelled, node-aware) where its busiest GPU is more
    than FRESH_LB_TOLERANCE lower than ``edited [L, P]``'s; with ``target_lb``, only on layers whose edits are above
    the target (x the mean GPU load, the check `rebalance` stops on), and also where fresh greedy reaches it.
    Returns phy2log [L, P] and the layers replaced."""
    from solvers.greedy import solve_greedy

    assert problem.current_phy2log is not None
    slots = problem.slots_per_gpu
    edited_max = gpu_loads(problem.loads, edited, slots).max(axis=1)
    level = None if target_lb is None else target_lb * problem.loads.sum(axis=1) / slots.size * (1 + 1e-12)
    if level is not None and not (edited_max > level).any():
        return edited, []  # every layer reached its target: no fresh solve needed
    fresh = solve_greedy(problem.loads, slots, num_groups=problem.num_groups, gpus_per_node=problem.gpus_per_node)
    fresh_max = gpu_loads(problem.loads, fresh, slots).max(axis=1)
    worse = edited_max > FRESH_LB_TOLERANCE * fresh_max
    if level is not None:
        worse = (edited_max > level) & (worse | (fresh_max <= level))
    if not worse.any():
        return edited, []
    nodes = problem.gpus_per_node if problem.hierarchical else None
    layers = np.flatnonzero(worse)
    out = edited.copy()
    out[layers] = relabel_gpus(fresh[layers], problem.current_phy2log[layers], slots, nodes)
    return out, layers.tolist()
